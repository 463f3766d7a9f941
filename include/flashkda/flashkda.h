// FlashKDA public C++ API (torch-free).
//
// A KDA prefill call is described by PrefillParams: every tensor is a TensorRef (pointer, dtype,
// sizes, strides in elements, device), so validation can name the argument, the expected value and
// the given value without knowing any framework.  The flow is the CUTLASS 3 one:
//
//   flashkda::PrefillParams p = ...;
//   flashkda::Status s = flashkda::can_implement(p);          // never aborts, never writes
//   std::vector<char> ws(flashkda::workspace_size(p));
//   s = flashkda::run(p, ws.data(), ws.size(), stream);       // CPU tensors: reference; CUDA: sm90
//
// The math is ../shared/kda_spec.md sections 2 and 3; the state is V-first: [N, H, V, K].
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// cudaStream_t without pulling in the CUDA headers (this is how cuda_runtime_api.h declares it).
struct CUstream_st;

namespace flashkda {

using Stream = CUstream_st*;

enum class DType : int { kBFloat16 = 0, kFloat16, kFloat32, kFloat64, kInt32, kInt64, kBool, kOther };
enum class DeviceType : int { kCPU = 0, kCUDA };
enum class GateMode : int {
  kBounded = 0,  // a = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
  kSoftplus,     // a = -exp(A_log[h]) * softplus(g + dt_bias[h])
  kPrecomputed,  // a = g
};

const char* dtype_name(DType t);
const char* gate_mode_name(GateMode m);
size_t dtype_size(DType t);

constexpr int kMaxRank = 5;

// A strided view of a tensor.  ndim < 0 means "not given" (an optional argument left out).
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kOther;
  int ndim = -1;
  int64_t sizes[kMaxRank] = {0, 0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0, 0};  // in elements
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;
  // With dtype kOther: the caller's name for the dtype (a static string, e.g. "int16"), so that an
  // error can say what was given rather than "other".  Optional.
  const char* other_dtype_name = nullptr;

  bool defined() const { return ndim >= 0; }
  int64_t numel() const;
};

// Helpers to describe a tensor without a framework (used by C++ consumers and tests).
TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                          DeviceType device = DeviceType::kCPU, int device_index = 0);
TensorRef make_strided_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                                  std::initializer_list<int64_t> strides,
                                  DeviceType device = DeviceType::kCPU, int device_index = 0);

// One KDA prefill (chunked or not: the result is that of the recurrence of spec section 2).
//
// Shapes (B batch rows, T tokens per row, H heads, K key dim, V value dim, N sequences):
//   q, k, g  [B, T, H, K]   q, k, v bf16; g bf16 or fp32
//   v, out   [B, T, H, V]   bf16
//   beta     [B, T, H]      bf16 or fp32
//   A_log    [H] fp32, dt_bias [H, K] or [H*K] fp32: required by the bounded and softplus gates
//   initial_state, final_state: [N, H, V, K] fp32 or bf16, contiguous, optional, may alias.
//     With state_indices they are a state pool [P, H, V, K] and sequence n uses row state_indices[n].
//   cu_seqlens [N+1] int32/int64 (then B == 1); without it N = B.
//   state_indices [N] int32/int64 (optional); has_initial_state [N] bool (optional).
//   checkpoint_offsets [N, n_ckpt] int32/int64 and checkpoint_state [N, n_ckpt, H, V, K] fp32
//     (optional, given together; spec section 5): checkpoint_state[n, j] receives the state of
//     sequence n after its first checkpoint_offsets[n, j] tokens (0 <= offset <= length of sequence
//     n, non-decreasing along a row; offset 0 is the starting state), i.e. the final state of running
//     that prefix alone.  Padded sequences (negative state index) leave their rows untouched.  The
//     offsets of CUDA calls are checked on the device (DeviceError kBadCheckpointOffset).
//   token_rows [T] int32/int64 (optional, varlen layout only): the token tensors then have R rows
//     (dim 1: q, k, g [1, R, H, K], v, out [1, R, H, V], beta [1, R, H]) and logical token t (the t of
//     cu_seqlens, which must end at T = the length of token_rows) lives in row token_rows[t]; rows
//     no token maps to are neither read nor written.  Values in [0, R), distinct (checked on the
//     host for CPU tensors; the range on the device for CUDA ones, DeviceError kBadTokenRow).
// Strides: each token's [H, D] block (q, k, v, g, out) and [H] (beta) must be contiguous; the token
// and batch strides are free, so slices of fused projections are read in place.
struct PrefillParams {
  TensorRef q, k, v, g, beta;
  TensorRef A_log, dt_bias;
  TensorRef out;
  TensorRef initial_state, final_state;
  TensorRef cu_seqlens;
  TensorRef state_indices;
  TensorRef has_initial_state;
  TensorRef checkpoint_offsets;  // [N, n_ckpt] int32/int64, contiguous
  TensorRef checkpoint_state;    // [N, n_ckpt, H, V, K] fp32, contiguous, written
  // Optional output/input row map (serving steps that mix prefill and decode tokens): [T_log]
  // int32/int64, contiguous, varlen layout only.  Logical token t (the t of cu_seqlens) reads q, k,
  // v, g, beta from row token_rows[t] of dim 1 and writes out at that row; rows no token maps to are
  // neither read nor written.  Without it, logical token t is row t.
  TensorRef token_rows;

  GateMode gate_mode = GateMode::kBounded;
  bool use_qk_l2norm = true;
  bool use_beta_sigmoid = true;
  float scale = 0.0f;  // > 0, or 0 for K^-0.5 (negative values are rejected)
  float lower_bound = -5.0f;
};

struct Status {
  enum class Code : int { kOk = 0, kInvalidArgument, kNotImplemented, kUnsupportedDevice, kCudaError };
  Code code = Code::kOk;
  std::string message;

  static Status ok_status() { return Status{}; }
  static Status invalid(std::string msg) { return Status{Code::kInvalidArgument, std::move(msg)}; }
  static Status not_implemented(std::string msg) { return Status{Code::kNotImplemented, std::move(msg)}; }
  static Status unsupported_device(std::string msg) {
    return Status{Code::kUnsupportedDevice, std::move(msg)};
  }
  static Status cuda_error(std::string msg) { return Status{Code::kCudaError, std::move(msg)}; }
  bool ok() const { return code == Code::kOk; }
};

// The problem dimensions that validation derived from the params.
struct ProblemShape {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
  int64_t total_tokens = 0;  // B * T
  bool varlen = false;
  int64_t num_checkpoints = 0;  // n_ckpt (0 without checkpoints)
  int64_t rows = 0;             // dim 1 of q/k/v/g/beta/out (== T unless token_rows is given)
};

// Bytes of workspace a CUDA call needs; CPU calls need none.  Depends only on sizes known to the
// host, so an engine can size it once for its largest step and reuse it (it is not cleared by us).
// total_tokens counts logical tokens (the length of token_rows when given, not the row count).
size_t workspace_size(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim = 128);
size_t workspace_size(const PrefillParams& p);

// Checks every argument (dtype, rank, shape, strides, device, values of host-side cu_seqlens and
// indices, head dim, aliasing rules) and returns the first problem found, naming the argument,
// the expected and the given value.  It reads host memory only; for CUDA tensors the index values
// are checked by the kernel itself (see run()).
Status can_implement(const PrefillParams& p, ProblemShape* shape = nullptr);

// Runs the prefill.  CPU tensors: the reference (float64 accumulation).  CUDA tensors: the sm90
// kernels on `stream`, no allocation, no host synchronisation (graph-capturable).  For CUDA tensors
// the values of cu_seqlens / state_indices / token_rows / checkpoint_offsets are validated on the
// device (ranges, order, and no pool row shared by two sequences): on a bad value the kernels write
// nothing and record an error code in the workspace (read it with read_device_error()).  Not
// checked on the device: that token_rows values are distinct (the caller's contract on CUDA; two
// tokens on one row race on its output).
Status run(const PrefillParams& p, void* workspace, size_t workspace_bytes, Stream stream = nullptr);

// Device-side input errors recorded by the last run() that used this workspace.
enum class DeviceError : int32_t {
  kNone = 0,
  kBadCuSeqlens = 1,         // cu_seqlens not non-decreasing from 0 to T
  kBadStateIndex = 2,        // state_indices out of [0, P) (negative means padding and is allowed)
  kBadTokenRow = 3,          // token_rows value out of [0, rows)
  kBadCheckpointOffset = 4,  // checkpoint_offsets outside [0, length] or decreasing along a row
  kBadAcceptedCount = 5,     // num_accepted_tokens outside [1, S]
  kStateSlotConflict = 6,    // a pool row written twice (two sequences / requests on it), or written
                             // by one decode request and read by another
};
const char* device_error_name(DeviceError e);
// Synchronises `stream` and reads the error header (the first 4096 bytes of the workspace: 1024
// error words; the first non-zero one is the error) - a debugging / validation aid, not for hot
// paths.  Every run() / run_decode() reports its own call: prefill clears the header before its
// kernels (a memset node), the decode kernel rewrites every word itself (no memset node).
Status read_device_error(const void* workspace, Stream stream, DeviceError* err);
// Clears the error header (asynchronously on `stream`).
Status clear_device_error(void* workspace, Stream stream);
// The same two, given the workspace's size: a workspace shorter than the 4096-byte header (or null)
// is refused (invalid argument 'workspace') before any copy; the forms above trust the caller.
Status read_device_error(const void* workspace, size_t workspace_bytes, Stream stream, DeviceError* err);
Status clear_device_error(void* workspace, size_t workspace_bytes, Stream stream);

// True when the library was built with the CUDA kernels, and whether `device_index` can run them.
bool built_with_cuda();
Status cuda_device_supported(int device_index);

}  // namespace flashkda
