// Decode / speculative decode on a state pool (spec section 4): the argument block and the device
// helpers both decode kernels share (request span, read slot, index checks, pool-row conflicts, the
// error words), and the launch entry points.
//   plain decode: 1-D ssm_state_indices, the state read from and written back to pool[idx[n]];
//   spec decode:  2-D indices, read pool[idx[n, acc[n] - 1]], the state after token t written to
//                 pool[idx[n, t]].
// The kernels: kda_decode_fixed.cuh (few requests in the fixed layout, <= 4 tokens each: no block
// barrier on the chain), kda_decode_latency.cuh (few requests, any layout: one short chain of round
// trips per block), kda_decode_stream.cuh (many requests, plain decode in the fixed layout: persistent
// blocks whose warps each pipeline the next item's state under the current item's math) and
// kda_decode_pipelined.cuh (many requests otherwise: a persistent warp-specialised state stream).
//
// Device-side validation (the host cannot read CUDA index values without a sync): a request's
// cu_seqlens pair, num_accepted_tokens, every index entry (< P) and every token row are checked
// before any of its writes; a request that fails writes nothing (neither out nor pool) and its
// DeviceError code goes to the error words; other requests run.  Pool-row conflicts between
// requests are checked off the state path and reported (kStateSlotConflict).  Every index is
// clamped before use, so bad values never read or write out of bounds.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <utility>

#include "flashkda/flashkda.h"
#include "sm90/kda_token_recurrence.cuh"

namespace flashkda {
namespace sm90 {

struct DecodeArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const void* g;
  const void* beta;
  bf16* out;
  int64_t q_sb, q_st, k_sb, k_st, v_sb, v_st, g_sb, g_st, beta_sb, beta_st, out_sb, out_st;
  int g_fp32, beta_fp32;
  int vec_q, vec_k, vec_g;  // rows 16-byte aligned: vector loads allowed
  // Byte alignment (16, 8, 4 or 2) of every head row of q, k, g, of every row slice of v and of
  // dt_bias's head rows: the piece size of the pipelined kernel's cp.async copies.
  int align_q, align_k, align_g, align_v, align_dtb;
  const float* A_log;    // [H] (null for the precomputed gate)
  const float* dt_bias;  // [H * K]
  void* pool;            // [P, H, V, K] fp32 / bf16
  int64_t pool_rows;     // P
  const void* idx;       // [N] or [N, S]
  int idx_int64;
  int64_t slots;  // S (1 for 1-D)
  int spec;       // 2-D indices
  const void* num_accepted;
  int acc_int64;
  const void* cu_seqlens;  // [N + 1] or null
  int cu_int64;
  const void* token_rows;  // [T] or null
  int rows_int64;
  int64_t num_rows;  // dim 1 of the token tensors
  int64_t T;         // tokens per batch row (fixed) or logical tokens (varlen)
  int H, N;
  int gate_mode, l2norm, beta_sigmoid;
  float scale, lower_bound;
  int* error_word;
  // The pipelined kernel's TMA loads of state slices carry an L2 evict-first policy (set by the host
  // from the call's size; FLASHKDA_DECODE_LOAD_POLICY forces it).
  int load_evict_first;
};

// Request n's tokens; false when its cu_seqlens pair is invalid (the span is then empty).
__device__ inline bool decode_span(const DecodeArgs& a, int64_t n, int64_t* batch, int64_t* bos,
                                   int64_t* len) {
  if (a.cu_seqlens == nullptr) {
    *batch = n, *bos = 0, *len = a.T;
    return true;
  }
  const int64_t b0 = load_index(a.cu_seqlens, a.cu_int64, n);
  const int64_t e0 = load_index(a.cu_seqlens, a.cu_int64, n + 1);
  const bool ok = b0 >= 0 && e0 >= b0 && e0 <= a.T && (n != 0 || b0 == 0) && (n != a.N - 1 || e0 == a.T);
  *batch = 0, *bos = ok ? b0 : 0, *len = ok ? e0 - b0 : 0;
  return ok;
}

__device__ inline int64_t slot_at(const DecodeArgs& a, int64_t n, int64_t col) {
  return load_index(a.idx, a.idx_int64, n * a.slots + col);
}

// The read slot of request n (negative: padded); returns 0 or the DeviceError code.  Checks what
// the read slot depends on: num_accepted in [1, S], the slot < P, and (spec) len <= S.
// Split in two for callers that want the loads early: decode_read_slot_load issues them (they depend
// on n alone: num_accepted -> index entry, the entry clamped into the row) and decode_read_slot_check
// validates once the span is known.
struct ReadSlotLoad {
  int64_t acc, slot;
};
__device__ inline ReadSlotLoad decode_read_slot_load(const DecodeArgs& a, int64_t n) {
  ReadSlotLoad r;
  r.acc = a.spec ? load_index(a.num_accepted, a.acc_int64, n) : 1;
  const int64_t col = a.spec && r.acc >= 1 && r.acc <= a.slots ? r.acc - 1 : 0;
  r.slot = slot_at(a, n, col);
  return r;
}
__device__ inline int decode_read_slot_check(const DecodeArgs& a, const ReadSlotLoad& r, int64_t len,
                                             int64_t* read) {
  if (a.spec && (r.acc < 1 || r.acc > a.slots)) return static_cast<int>(DeviceError::kBadAcceptedCount);
  *read = r.slot;
  if (*read >= a.pool_rows) return static_cast<int>(DeviceError::kBadStateIndex);
  if (a.spec && *read >= 0 && len > a.slots) return static_cast<int>(DeviceError::kBadStateIndex);
  return 0;
}
__device__ inline int decode_read_slot(const DecodeArgs& a, int64_t n, int64_t len, int64_t* read) {
  return decode_read_slot_check(a, decode_read_slot_load(a, n), len, read);
}

// True when request m (!= n, valid, not padded) reads or writes a row that n writes, or writes a
// row that n reads.
__device__ inline bool decode_conflicts(const DecodeArgs& a, int64_t n, int64_t len, int64_t read,
                                        int64_t m) {
  int64_t bm, bosm, lenm, readm = -1;
  if (!decode_span(a, m, &bm, &bosm, &lenm)) return false;  // m is skipped (and flagged) itself
  if (decode_read_slot(a, m, lenm, &readm) != 0 || readm < 0) return false;
  if (!a.spec) return readm == read;  // 1-D: each request reads and writes its own row
  for (int64_t t = 0; t < len; ++t) {
    const int64_t w = slot_at(a, n, t);
    if (w >= 0 && w == readm) return true;
  }
  for (int64_t u = 0; u < lenm; ++u) {
    const int64_t wm = slot_at(a, m, u);
    if (wm < 0) continue;
    if (wm == read) return true;
    for (int64_t t = 0; t < len; ++t) {
      if (slot_at(a, n, t) == wm) return true;
    }
  }
  return false;
}

// The request's remaining own checks, spread over the calling threads (thread `first` of `stride`):
// every index entry < P and every token row in [0, rows).  Returns 0 or a DeviceError code.
__device__ inline int decode_entries_error(const DecodeArgs& a, int64_t n, int64_t bos, int64_t len,
                                           int first, int stride) {
  int err = 0;
  for (int64_t e = first; e < a.slots; e += stride) {
    if (slot_at(a, n, e) >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
  }
  if (a.token_rows != nullptr) {
    for (int64_t t = first; t < len; t += stride) {
      const int64_t r = load_index(a.token_rows, a.rows_int64, bos + t);
      if (r < 0 || r >= a.num_rows) err = static_cast<int>(DeviceError::kBadTokenRow);
    }
  }
  return err;
}

// Whether request n (valid, not padded) shares a pool row with another request: another request
// reads or writes a row n writes, or writes the row n reads, or (spec) n writes one row twice.  The
// rows involved are then unspecified (the kernels report, not gate: gating would put an O(N S^2)
// chain of loads in front of every state copy), but every access stays inside the pool.  Lanes of
// the calling warp split the other requests.
__device__ inline bool decode_request_conflicts(const DecodeArgs& a, int64_t n, int lane) {
  int64_t batch, bos, len, read = -1;
  if (!decode_span(a, n, &batch, &bos, &len)) return false;
  if (decode_read_slot(a, n, len, &read) != 0 || read < 0) return false;
  bool conflict = false;
  if (a.spec) {
    for (int64_t e = lane; e < len * len; e += 32) {
      const int64_t t1 = e / len, t2 = e % len;
      if (t1 < t2) {
        const int64_t w1 = slot_at(a, n, t1);
        if (w1 >= 0 && w1 == slot_at(a, n, t2)) conflict = true;
      }
    }
  }
  for (int64_t m = lane; m < a.N; m += 32) {
    if (m != n && decode_conflicts(a, n, len, read, m)) conflict = true;
  }
  return __any_sync(0xffffffffu, conflict);
}

// Touches every 32 bytes of the kernel's parameter block (the DecodeArgs of a __grid_constant__
// parameter), called by one thread per block before griddepcontrol.wait.  Each launch has its own
// parameter buffer, so every first use of a field's constant-cache line is a miss (ncu at batch 1:
// 10-15% of the stall samples, "imc", spread along the chain); touched together here, the misses
// overlap each other and the previous kernel's tail.  The caller stores the returned sum to a
// volatile shared word, so the loads are not removed.
__device__ inline uint32_t touch_decode_params(const DecodeArgs& a) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&a);
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(DecodeArgs) / 4); i += 8) x += w[i];
  return x;
}

// Programmatic dependent launch, after a decode kernel's set-up: every thread waits for the previous
// kernel (its writes visible) before touching global memory, then lets the next kernel launch its own
// set-up into free SM slots.  Without the launch attribute both are no-ops.
__device__ __forceinline__ void decode_wait_previous_kernel() {
  pdl_wait_primary();
  pdl_launch_dependents();
}

// The set-up of a one-wave or stream decode block (kda_decode_latency / _fixed / _stream.cuh) before
// it touches global memory: thread 0 clears the block's shared error code and touches the parameter
// block, then every thread waits for the previous kernel.
__device__ __forceinline__ void decode_block_setup(const DecodeArgs& a, int* err, uint32_t* param_touch) {
  if (threadIdx.x == 0) {
    *err = 0;
    *reinterpret_cast<volatile uint32_t*>(param_touch) = touch_decode_params(a);
  }
  __syncthreads();
  decode_wait_previous_kernel();
}

// Error words of the decode kernels: the workspace header's kDecodeErrorSlots int32 words.  Every
// call rewrites all of them (block b: word b its code, words b + G, b + 2G, ... zero, G <= the word
// count), so no clearing memset precedes a decode kernel and read_device_error reports exactly the
// last call.
constexpr int kDecodeErrorSlots = 1024;
__device__ inline void write_decode_error_words(const DecodeArgs& a, int code) {
  const int64_t G = gridDim.x;
  for (int64_t w = blockIdx.x; w < kDecodeErrorSlots; w += G) a.error_word[w] = w == blockIdx.x ? code : 0;
}

// Launches a decode kernel on a 1-D grid, with programmatic stream serialisation when `pdl` (its
// set-up before griddepcontrol.wait overlaps the previous kernel's tail).
template <class... Params, class... Args>
Status launch_decode_grid(void (*kernel)(Params...), int64_t grid, int threads, size_t smem, bool pdl,
                          cudaStream_t stream, const char* what, Args&&... args) {
  return launch_maybe_programmatic(kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), smem, pdl,
                                   stream, what, std::forward<Args>(args)...);
}

// Which decode kernel runs a call.  kAuto: for few requests (a chain of round trips, not a stream)
// the fixed-layout kernel (kda_decode_fixed.cuh) when the call is in the fixed layout with at most 4
// tokens a request, else the latency kernel (kda_decode_latency.cuh), each when its one-wave grid
// fits; many requests in the fixed layout: a stream kernel (kda_decode_stream.cuh: plain one-token calls,
// and spec / several-token calls on bf16 pools), the others the pipelined kernel (kda_decode_pipelined.cuh).
// The others force one (dev switch for A/B runs; a forced kernel falls back to the next in that order when
// the call does not fit).
enum class DecodeKernel { kAuto, kPipelined, kLatency, kFixedLayout, kStream };

// The kernel choice and launch for one head dim and pool dtype (defined in kda_decode_stream.cuh),
// explicitly instantiated once per file: kda_decode_sm90_d{64,128}_{f32,bf16}.cu.  Every kernel
// rewrites all the error words itself.  `pdl`: launch with programmatic stream serialisation (the
// kernel's set-up overlaps the previous kernel's tail).
template <int D, bool kF32>
Status launch_decode_kernel(const DecodeArgs& a, DecodeKernel kernel, bool pdl, int num_sms,
                            cudaStream_t stream);
extern template Status launch_decode_kernel<64, true>(const DecodeArgs&, DecodeKernel, bool, int,
                                                      cudaStream_t);
extern template Status launch_decode_kernel<64, false>(const DecodeArgs&, DecodeKernel, bool, int,
                                                       cudaStream_t);
extern template Status launch_decode_kernel<128, true>(const DecodeArgs&, DecodeKernel, bool, int,
                                                       cudaStream_t);
extern template Status launch_decode_kernel<128, false>(const DecodeArgs&, DecodeKernel, bool, int,
                                                        cudaStream_t);

inline Status launch_decode(const DecodeArgs& a, int head_dim, bool state_f32, DecodeKernel kernel, bool pdl,
                            int num_sms, cudaStream_t stream) {
  if (head_dim == 128) {
    return state_f32 ? launch_decode_kernel<128, true>(a, kernel, pdl, num_sms, stream)
                     : launch_decode_kernel<128, false>(a, kernel, pdl, num_sms, stream);
  }
  return state_f32 ? launch_decode_kernel<64, true>(a, kernel, pdl, num_sms, stream)
                   : launch_decode_kernel<64, false>(a, kernel, pdl, num_sms, stream);
}

}  // namespace sm90
}  // namespace flashkda
