// CUDA side of the public API: device capability checks, the device error word, and turning
// validated PrefillParams into the kernels' argument block.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "flashkda/flashkda.h"
#include "runtime/cuda_dispatch.h"
#include "sm90/kda_decode_sm90.cuh"
#include "sm90/kda_prefill_sm90.cuh"

namespace flashkda {

static_assert(sm90::ChunkRecord<128>::kBytes == detail::chunk_record_bytes(128), "record size drifted");
static_assert(sm90::ChunkRecord<64>::kBytes == detail::chunk_record_bytes(64), "record size drifted");
static_assert(sm90::kChunk == detail::kChunkTokens, "chunk size drifted");

namespace {

constexpr int kMaxDevices = 64;
// Per device: 0 unknown, 1 supported, 2 unsupported; SM count cached beside it.  Queried once so
// that run() does no device-property work on the hot path.
std::atomic<int> g_support[kMaxDevices];
std::atomic<int> g_num_sms[kMaxDevices];
std::atomic<int> g_cc[kMaxDevices];

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int vec_ok(const TensorRef& t, int elems_per_16b) {
  if (!aligned16(t.data)) return 0;
  for (int d = 0; d + 2 < t.ndim; ++d) {
    if (t.strides[d] % elems_per_16b != 0) return 0;
  }
  return 1;
}

// Largest power of two <= 16 that divides the address of every row the kernels copy: the base, the
// strides of all but the last two dims (elements of `elt` bytes) and `offset_elems` (the head or
// slice offset within a row).
int byte_align(const TensorRef& t, int elt, int64_t offset_elems) {
  uint64_t x = reinterpret_cast<uintptr_t>(t.data) | static_cast<uint64_t>(offset_elems * elt) | 16u;
  for (int d = 0; d + 2 < t.ndim; ++d) x |= static_cast<uint64_t>(t.strides[d] * elt);
  return static_cast<int>(x & (~x + 1));
}

// Whether environment variable `name` is set to `value` (dev switches for A/B runs).
bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}

// Dev switch for A/B runs: FLASHKDA_DECODE_KERNEL=pipelined, =latency or =fixed forces a decode kernel
// (default: chosen by the call's size, see sm90::DecodeKernel).  Read on every call, so a test can
// run both kernels in one process.
sm90::DecodeKernel decode_kernel_choice() {
  if (env_is("FLASHKDA_DECODE_KERNEL", "pipelined")) return sm90::DecodeKernel::kPipelined;
  if (env_is("FLASHKDA_DECODE_KERNEL", "latency")) return sm90::DecodeKernel::kLatency;
  if (env_is("FLASHKDA_DECODE_KERNEL", "fixed")) return sm90::DecodeKernel::kFixedLayout;
  if (env_is("FLASHKDA_DECODE_KERNEL", "stream")) return sm90::DecodeKernel::kStream;
  return sm90::DecodeKernel::kAuto;
}

// The pipelined decode kernel's state loads: evict-first (1) or normal (0) L2 policy.  Evict-first for
// speculative calls on fp32 pools that read at most kEvictFirstMaxStateBytes of state: on the H200 it
// measured -2.3% on spec 1+3 N = 64 H = 16 (64 MiB read) and +0.6% on N = 256 (256 MiB), 3 rounds each
// (perf-notes v39); the calls between, smaller ones and bf16 pools are not yet swept
// (bench/probe_decode_switch.py), so larger calls and bf16 pools keep the normal policy.  Dev
// switch FLASHKDA_DECODE_LOAD_POLICY=evict_first | normal forces it (A/B runs).
constexpr int64_t kEvictFirstMaxStateBytes = int64_t{64} << 20;

int decode_load_evict_first(const DecodeShape& shape, bool f32) {
  if (env_is("FLASHKDA_DECODE_LOAD_POLICY", "evict_first")) return 1;
  if (env_is("FLASHKDA_DECODE_LOAD_POLICY", "normal")) return 0;
  if (!shape.spec || !f32) return 0;
  const int64_t state_bytes = shape.N * shape.H * shape.V * shape.K * int64_t{4};  // read once a call
  return state_bytes <= kEvictFirstMaxStateBytes ? 1 : 0;
}

// Dev switch: FLASHKDA_DECODE_PDL=0 launches the decode kernels without programmatic dependent
// launch.
bool decode_pdl() {
  static const bool pdl = !env_is("FLASHKDA_DECODE_PDL", "0");
  return pdl;
}

}  // namespace

Status cuda_device_supported(int device_index) {
  if (device_index < 0 || device_index >= kMaxDevices) {
    return Status::unsupported_device("flashkda: device index " + std::to_string(device_index) +
                                      " out of range");
  }
  int state = g_support[device_index].load(std::memory_order_acquire);
  if (state == 0) {
    int major = 0, minor = 0, sms = 0;
    cudaError_t e1 = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index);
    cudaError_t e2 = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index);
    cudaError_t e3 = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index);
    if (e1 != cudaSuccess || e2 != cudaSuccess || e3 != cudaSuccess) {
      cudaGetLastError();
      return Status::unsupported_device("flashkda: cannot query CUDA device " + std::to_string(device_index));
    }
    g_cc[device_index].store(major * 10 + minor);
    g_num_sms[device_index].store(sms);
    state = (major == 9 && minor == 0) ? 1 : 2;
    g_support[device_index].store(state, std::memory_order_release);
  }
  if (state != 1) {
    const int cc = g_cc[device_index].load();
    return Status::unsupported_device(
        "flashkda: argument 'q': expected a CUDA device of compute capability 9.0 "
        "(Hopper, the sm_90a kernels), got device " +
        std::to_string(device_index) + " of compute capability " + std::to_string(cc / 10) + "." +
        std::to_string(cc % 10));
  }
  return Status::ok_status();
}

// The workspace header holds kErrorWords int32 error words: the prefill kernels use word 0 (the host
// clears the header before each prefill call), the decode kernels rewrite all of them on every call
// (one per block, see write_decode_error_words in kda_decode_sm90.cuh).  The error is the first non-zero
// word.
constexpr int kErrorWords = static_cast<int>(detail::kWorkspaceHeaderBytes / sizeof(int32_t));
static_assert(kErrorWords == sm90::kDecodeErrorSlots, "the decode kernel's error words fill the header");

Status read_device_error(const void* workspace, Stream stream, DeviceError* err) {
  int32_t words[kErrorWords];
  cudaError_t e = cudaMemcpyAsync(words, workspace, sizeof(words), cudaMemcpyDeviceToHost,
                                  reinterpret_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) e = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return sm90::cuda_status(e, "read_device_error");
  int32_t word = 0;
  for (int i = 0; i < kErrorWords && word == 0; ++i) word = words[i];
  if (err) *err = static_cast<DeviceError>(word);
  return Status::ok_status();
}

Status clear_device_error(void* workspace, Stream stream) {
  return sm90::cuda_status(
      cudaMemsetAsync(workspace, 0, detail::kWorkspaceHeaderBytes, reinterpret_cast<cudaStream_t>(stream)),
      "clear_device_error");
}

namespace detail {

// Checks every CUDA entry point makes before touching the device: workspace alignment (the kernels
// store 16-byte words into it) and a supported GPU.
Status check_cuda_call(const TensorRef& q, const void* workspace) {
  if (!aligned16(workspace)) {
    return Status::invalid(
        "flashkda: argument 'workspace': expected a 16-byte aligned pointer, got an unaligned one");
  }
  return cuda_device_supported(q.device_index);
}

// The fields PrefillArgs and DecodeArgs share (same names): token inputs and their strides, dtypes,
// vector-load flags, gate parameters, cu_seqlens, the token_rows map, the per-token options and the
// error word.  Params is PrefillParams or DecodeParams, validated.
template <class Args, class Params>
void fill_token_args(Args* a, const Params& p, int64_t head_dim, void* workspace) {
  a->q = static_cast<const sm90::bf16*>(p.q.data);
  a->k = static_cast<const sm90::bf16*>(p.k.data);
  a->v = static_cast<const sm90::bf16*>(p.v.data);
  a->g = p.g.data;
  a->beta = p.beta.data;
  a->out = static_cast<sm90::bf16*>(p.out.data);
  a->q_sb = p.q.strides[0], a->q_st = p.q.strides[1];
  a->k_sb = p.k.strides[0], a->k_st = p.k.strides[1];
  a->v_sb = p.v.strides[0], a->v_st = p.v.strides[1];
  a->g_sb = p.g.strides[0], a->g_st = p.g.strides[1];
  a->beta_sb = p.beta.strides[0], a->beta_st = p.beta.strides[1];
  a->out_sb = p.out.strides[0], a->out_st = p.out.strides[1];
  a->g_fp32 = p.g.dtype == DType::kFloat32;
  a->beta_fp32 = p.beta.dtype == DType::kFloat32;
  a->vec_q = vec_ok(p.q, 8);
  a->vec_k = vec_ok(p.k, 8);
  a->vec_g = vec_ok(p.g, a->g_fp32 ? 4 : 8);
  const bool gated = p.gate_mode != GateMode::kPrecomputed;
  a->A_log = gated ? static_cast<const float*>(p.A_log.data) : nullptr;
  a->dt_bias = gated ? static_cast<const float*>(p.dt_bias.data) : nullptr;
  a->cu_seqlens = p.cu_seqlens.defined() ? p.cu_seqlens.data : nullptr;
  a->cu_int64 = p.cu_seqlens.defined() && p.cu_seqlens.dtype == DType::kInt64;
  a->token_rows = p.token_rows.defined() ? p.token_rows.data : nullptr;
  a->rows_int64 = p.token_rows.defined() && p.token_rows.dtype == DType::kInt64;
  a->num_rows = p.q.sizes[1];
  a->gate_mode = static_cast<int>(p.gate_mode);
  a->l2norm = p.use_qk_l2norm;
  a->beta_sigmoid = p.use_beta_sigmoid;
  a->scale = p.scale > 0.f ? p.scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  a->lower_bound = p.lower_bound;
  a->error_word = static_cast<int*>(workspace);
}

// Segment length (chunks) of the context-parallel recurrence, 0 for the sequence-parallel one: the
// dev switch's, else the automatic plan (auto_segment_chunks, api.cpp).
int64_t segment_chunks(const ProblemShape& shape, int64_t chunks_max, int sms) {
  const int64_t forced = forced_segment_chunks();
  if (forced != 0) return forced > 0 ? forced : 0;
  return auto_segment_chunks(shape.N, shape.H, shape.K, chunks_max, sms);
}

Status run_prefill_cuda(const PrefillParams& p, const ProblemShape& shape, void* workspace, Stream stream) {
  Status st = check_cuda_call(p.q, workspace);
  if (!st.ok()) return st;
  sm90::PrefillArgs a{};
  fill_token_args(&a, p, shape.K, workspace);
  a.vec_v = vec_ok(p.v, 8);
  a.vec_out = vec_ok(p.out, 8);
  a.h0 = p.initial_state.defined() ? p.initial_state.data : nullptr;
  a.ht = p.final_state.defined() ? p.final_state.data : nullptr;
  const TensorRef& st_ref = p.initial_state.defined() ? p.initial_state : p.final_state;
  a.state_fp32 = st_ref.defined() ? (st_ref.dtype == DType::kFloat32) : 1;
  a.h0_pairs = reinterpret_cast<uintptr_t>(a.h0) % (a.state_fp32 ? 8 : 4) == 0;
  a.ht_vec16 = a.ht != nullptr && aligned16(a.ht);
  a.pool_rows = st_ref.defined() ? st_ref.sizes[0] : 0;
  a.state_indices = p.state_indices.defined() ? p.state_indices.data : nullptr;
  a.idx_int64 = p.state_indices.defined() && p.state_indices.dtype == DType::kInt64;
  a.has_initial_state =
      p.has_initial_state.defined() ? static_cast<const bool*>(p.has_initial_state.data) : nullptr;
  a.B = static_cast<int>(shape.B);
  a.T = static_cast<int>(shape.T);
  a.H = static_cast<int>(shape.H);
  a.N = static_cast<int>(shape.N);
  a.records = static_cast<char*>(workspace) + kWorkspaceHeaderBytes;
  a.num_slots = sm90::num_chunk_slots(shape.varlen, shape.B, shape.T, shape.N);
  const bool ckpt = p.checkpoint_offsets.defined() && shape.num_checkpoints > 0;
  a.ckpt_offsets = ckpt ? p.checkpoint_offsets.data : nullptr;
  a.ckpt_int64 = ckpt && p.checkpoint_offsets.dtype == DType::kInt64;
  a.n_ckpt = ckpt ? static_cast<int>(shape.num_checkpoints) : 0;
  a.ckpt_state = ckpt ? static_cast<float*>(p.checkpoint_state.data) : nullptr;

  a.walk_pdl = !env_is("FLASHKDA_PREFILL_PDL", "0");  // read on every call: a test runs both in one process
  // Probe switches (bench/probe_sm_partition.py), read on every call: one stage alone, the walk's warps.
  a.dev_only = env_is("FLASHKDA_PREFILL_ONLY", "prepare")      ? 1
               : env_is("FLASHKDA_PREFILL_ONLY", "recurrence") ? 2
                                                               : 0;
  a.walk_warps = env_is("FLASHKDA_PREFILL_WALK_WARPS", "4")   ? 4
                 : env_is("FLASHKDA_PREFILL_WALK_WARPS", "8") ? 8
                                                              : 0;
  const int sms = g_num_sms[p.q.device_index].load();
  const int64_t chunks_max = (shape.T + kChunkTokens - 1) / kChunkTokens;  // of the longest sequence
  const int64_t seg_chunks = segment_chunks(shape, chunks_max, sms);       // with or without checkpoints
  if (seg_chunks > 0) {
    a.seg_chunks = static_cast<int>(seg_chunks);
    a.max_segs = static_cast<int>(std::max<int64_t>(1, (chunks_max + seg_chunks - 1) / seg_chunks));
    a.seg_ws = reinterpret_cast<float*>(a.records +
                                        record_area_bytes(shape.total_tokens, shape.H, shape.N, shape.K));
  }

  st = clear_device_error(workspace, stream);  // the kernels only set it: report this call alone
  if (!st.ok()) return st;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (shape.K == 128) return sm90::launch_prefill_d128(a, sms, s);
  return sm90::launch_prefill_d64(a, sms, s);
}

Status run_decode_cuda(const DecodeParams& p, const DecodeShape& shape, void* workspace, Stream stream) {
  Status st = check_cuda_call(p.q, workspace);
  if (!st.ok()) return st;
  sm90::DecodeArgs a{};
  fill_token_args(&a, p, shape.K, workspace);
  a.pool = p.state_pool.data;
  a.pool_rows = p.state_pool.sizes[0];
  a.idx = p.ssm_state_indices.data;
  a.idx_int64 = p.ssm_state_indices.dtype == DType::kInt64;
  a.slots = shape.spec ? p.ssm_state_indices.sizes[1] : 1;
  a.spec = shape.spec;
  a.num_accepted = p.num_accepted_tokens.defined() ? p.num_accepted_tokens.data : nullptr;
  a.acc_int64 = p.num_accepted_tokens.defined() && p.num_accepted_tokens.dtype == DType::kInt64;
  a.T = shape.T;
  a.H = static_cast<int>(shape.H);
  a.N = static_cast<int>(shape.N);
  const int64_t D = shape.K;
  a.align_q = byte_align(p.q, 2, D);
  a.align_k = byte_align(p.k, 2, D);
  a.align_g = byte_align(p.g, a.g_fp32 ? 4 : 2, D);
  a.align_v = byte_align(p.v, 2, 32);  // head (D) and row-slice (32 or 64 rows) offsets
  a.align_dtb = a.dt_bias != nullptr ? byte_align(p.dt_bias, 4, D) : 16;
  // The pool's 16-byte alignment was checked by can_implement_decode.
  const bool f32 = p.state_pool.dtype == DType::kFloat32;
  // The decode kernels rewrite every error word themselves; an empty call, which launches nothing,
  // clears the header to report this call alone.
  if (a.N == 0 || a.H == 0) return clear_device_error(workspace, stream);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int sms = g_num_sms[p.q.device_index].load();
  a.load_evict_first = decode_load_evict_first(shape, f32);
  const sm90::DecodeKernel kernel = decode_kernel_choice();
  return sm90::launch_decode(a, static_cast<int>(shape.K), f32, kernel, decode_pdl(), sms, s);
}

}  // namespace detail
}  // namespace flashkda
