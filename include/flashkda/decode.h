// FlashKDA recurrent decode / speculative decode (torch-free, spec section 4).
//
// The serving path: a few tokens per request, the recurrent state of each request living in a state
// pool [P, H, V, K] that the call reads and writes in place (no gather / scatter copies).  Same
// conventions as flashkda.h (TensorRef arguments, Status with the argument name):
//
//   flashkda::DecodeParams p = ...;
//   flashkda::Status s = flashkda::can_implement_decode(p);     // never aborts, never writes
//   s = flashkda::run_decode(p, workspace, flashkda::workspace_size_decode(p), stream);
//
// Layout (B rows, T tokens per row, H heads, K = V head dims, N requests, P pool rows):
//   q, k, g  [B, T, H, K]    v, out [B, T, H, V]    beta [B, T, H]
//   * fixed layout (no cu_seqlens): N = B requests with exactly T tokens each (T = 1: plain decode;
//     T = 1 + num_spec: speculative decode, the same number of drafts for every request);
//   * varlen layout (cu_seqlens [N+1] int32/int64, then B == 1): request n has the tokens
//     cu_seqlens[n] .. cu_seqlens[n+1]-1 (any count >= 0).
//   dtypes, strides, gate modes and flags: exactly those of PrefillParams.
//   token_rows [T] (optional, varlen layout only): as PrefillParams::token_rows, the token tensors
//     have R rows and logical token t (the t of cu_seqlens) reads and writes row token_rows[t].
//   state_pool [P, H, V, K] fp32 or bf16, contiguous, V-first: read and written in place.
//
// Which pool rows are used (a negative index means "padding"):
//   ssm_state_indices 1-D [N] int32/int64: request n starts from pool[idx[n]] and the state after
//     its last token is written back to pool[idx[n]].  idx[n] < 0: a padded request (its output rows
//     are zeroed, no state is read or written).  num_accepted_tokens must not be given.
//   ssm_state_indices 2-D [N, S] int32/int64 with num_accepted_tokens [N] int32/int64 (required):
//     request n starts from pool[idx[n, num_accepted[n] - 1]] (its read slot), and the state after
//     its t-th token (t = 0, 1, ...) is written to pool[idx[n, t]] (one slot per draft position, so
//     the scheduler can roll back rejected drafts).  A negative read slot marks a padded request
//     (output zeroed, nothing read or written); a negative write slot skips that one write.  S == T
//     in the fixed layout; in the varlen layout S >= the token count of every non-padded request.
//     The read slot may be one of the request's own write slots (it is read before any write).
//
// Validation (host values of CPU index tensors; for CUDA tensors the values are the kernel's job):
//   every index < P (>= P is an error, any negative value is padding); 1 <= num_accepted[n] <= S;
//   no pool row written twice in one call (two writes would race), and no pool row written by one
//   request and read by another (a read/write race).
//
// CUDA tensors: the sm90 decode kernel, on `stream`, no allocation, no host synchronisation
// (graph-capturable).  It checks the index values itself and records a DeviceError in the workspace
// (kBadCuSeqlens, kBadStateIndex, kBadTokenRow, kBadAcceptedCount, kStateSlotConflict;
// read_device_error()).  The check is per request, inside the one kernel (a whole-call check
// would need a pass over every request before the first write): a request with a bad value writes
// nothing (its output rows and pool rows stay as they were) while the other requests run; for a
// pool-row conflict the error is recorded and the rows involved are the caller's to discard.  Host
// (CPU) tensors are checked whole before anything is written.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkda/flashkda.h"

namespace flashkda {

struct DecodeParams {
  TensorRef q, k, v, g, beta;
  TensorRef A_log, dt_bias;
  TensorRef out;
  TensorRef state_pool;           // [P, H, V, K] fp32 / bf16, read and written in place
  TensorRef ssm_state_indices;    // [N] or [N, S] int32 / int64
  TensorRef num_accepted_tokens;  // [N] int32 / int64, required with 2-D ssm_state_indices
  TensorRef cu_seqlens;           // [N+1] int32 / int64 (optional; then B == 1)
  TensorRef token_rows;           // [T_log] int32 / int64 (optional, varlen only): as PrefillParams

  GateMode gate_mode = GateMode::kBounded;
  bool use_qk_l2norm = true;
  bool use_beta_sigmoid = true;
  float scale = 0.0f;  // > 0, or 0 for K^-0.5 (negative values are rejected)
  float lower_bound = -5.0f;
};

// The problem dimensions validation derived from DecodeParams.
struct DecodeShape {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0;
  int64_t N = 0;             // requests
  int64_t P = 0;             // pool rows
  int64_t slots = 1;         // S: columns of 2-D ssm_state_indices (1 for 1-D)
  int64_t total_tokens = 0;  // B * T
  int64_t rows = 0;          // dim 1 of q/k/v/g/beta/out (== T unless token_rows is given)
  bool varlen = false;
  bool spec = false;  // 2-D ssm_state_indices (one write slot per token)
};

// Checks every argument and returns the first problem as "flashkda: argument '<name>': expected
// <what>, got <what>" (kInvalidArgument), kNotImplemented for valid problems the kernels do not
// cover (head dims other than 64 / 128), kUnsupportedDevice for CUDA tensors this build / GPU cannot
// run.  Reads host memory only.
Status can_implement_decode(const DecodeParams& p, DecodeShape* shape = nullptr);

// Bytes of workspace a decode call needs: none on CPU; a CUDA call needs this many bytes of device
// memory (the error header: 4096 today; sized from host numbers only, so one buffer serves every
// step).
size_t workspace_size_decode(const DecodeParams& p);

// Runs the decode.  CPU tensors: the reference (float64 accumulation; validates first and writes
// nothing on error).  CUDA tensors: the sm90 decode kernel on `stream`; `workspace` must be device
// memory of at least workspace_size_decode(p) bytes (else kInvalidArgument naming 'workspace').
Status run_decode(const DecodeParams& p, void* workspace, size_t workspace_bytes, Stream stream = nullptr);

}  // namespace flashkda
