// decode: the recurrent KDA path on a state pool (spec section 4): plain decode (1-D
// ssm_state_indices, the state read from and written back to pool[idx[n]]) and speculative decode
// (2-D indices: read pool[idx[n, acc[n] - 1]], write the state after token t to pool[idx[n, t]]).
//
// Grid: (N requests x V / kRowsPerBlock row slices, H).  Block: 4 warps, no specialisation; each
// thread owns 16 columns of two state rows in registers (kda_token_recurrence.cuh), so the state is
// read once from the pool, stays on chip across all of the request's tokens, and is written once per
// write slot: the only state traffic is the unavoidable one.  Two kernels: spec decode
// (decode_chunked_kernel) preprocesses 8 tokens per block barrier, two per warp; plain decode
// (decode_warp_kernel) has no block barrier: each warp checks
// the request and preprocesses kWarpTokens = 2 tokens at a time itself into its own shared buffer
// (3 x D fp32 per token; 12 KB per block for D = 128); the next 2 tokens' loads fly while the
// current 2 run.
//
// Memory-bound by design: per request and head the state is D x D x 4 bytes (64 KB for D = 128)
// against ~1 KB of q/k/v/g per token, so the kernel must keep enough state bytes in flight: all 16
// columns of a thread are loaded with eight 16-byte loads issued back to back, before the index
// checks below, and V is split over D / kRowsPerBlock blocks (4 for D = 128) so that even one request
// of 16 heads spreads over 64 blocks.  The state load is issued right after the read slot is
// known, before the other checks, so the chain of dependent memory round trips of a block is short:
// read slot -> (state, tokens, checks) -> math -> stores.
//
// Device-side validation (the host cannot read CUDA index values without a sync): every warp of a
// request checks the request's cu_seqlens pair, num_accepted_tokens, all its index entries (< P),
// and its token_rows; a request that fails reads nothing more, writes nothing (neither out nor pool)
// and records its DeviceError code in the workspace error word, other requests run.  Pool-row
// conflicts between requests (a row written twice, or written by one and read by another) are
// checked by one warp per request after its work and reported (kStateSlotConflict); the rows
// involved are then unspecified, but every access stays inside the pool.  The host clears the word
// before each call.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

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

// A padded request: zero its output rows (the thread's state rows), touch no state.
template <int D>
__device__ inline void zero_padded_outputs(const DecodeArgs& a, int64_t batch, int64_t bos, int64_t len,
                                           int64_t out_col, const int (&vrow)[TokenLayout<D>::kRowsPerThread],
                                           int j) {
  if (j != 0) return;
  for (int64_t t = 0; t < len; ++t) {
    bf16* o = a.out + batch * a.out_sb + mapped_row(a, bos + t) * a.out_st + out_col;
#pragma unroll
    for (int q = 0; q < TokenLayout<D>::kRowsPerThread; ++q) o[vrow[q]] = __float2bfloat16_rn(0.f);
  }
}

// Run by the threads of one warp or block per request after its work: reports (not gates, which
// would put an O(N S^2) chain of loads in front of every block) whether another request touches a
// row this one writes, or writes the row it reads; the rows involved are then unspecified.
__device__ inline void report_decode_conflicts(const DecodeArgs& a, int64_t n, int64_t len, int64_t read,
                                               int first, int stride) {
  int conflict = 0;
  if (a.spec) {
    for (int64_t e = first; e < len * len; e += stride) {
      const int64_t t1 = e / len, t2 = e % len;
      if (t1 < t2) {
        const int64_t w1 = slot_at(a, n, t1);
        if (w1 >= 0 && w1 == slot_at(a, n, t2)) conflict = 1;
      }
    }
  }
  for (int64_t m = first; m < a.N; m += stride) {
    if (m != n && decode_conflicts(a, n, len, read, m)) conflict = 1;
  }
  if (conflict) atomicExch(a.error_word, static_cast<int>(DeviceError::kStateSlotConflict));
}

// Tokens a warp loads and preprocesses at once (registers: 13 floats per lane and token; 4 spilled
// ~200 bytes at the 128-register cap that gives 4 blocks per SM, 2 spill 24).
constexpr int kWarpTokens = 2;

template <int D, class A>
__device__ inline void load_warp_tokens(const A& a, int64_t batch, int64_t tok0, int nt, int h,
                                        const int (&vrow)[TokenLayout<D>::kRowsPerThread], int lane,
                                        TokenRaw<D> (&raw)[kWarpTokens],
                                        float (&vv)[TokenLayout<D>::kRowsPerThread][kWarpTokens]) {
  constexpr int kR = TokenLayout<D>::kRowsPerThread;
#pragma unroll
  for (int i = 0; i < kWarpTokens; ++i) {
    if (i < nt) {
      const int64_t row = mapped_row(a, tok0 + i);
      load_token<D>(a, batch, row, h, lane, raw[i]);
      const int64_t base = batch * a.v_sb + row * a.v_st + static_cast<int64_t>(h) * D;
#pragma unroll
      for (int q = 0; q < kR; ++q) vv[q][i] = __bfloat162float(a.v[base + vrow[q]]);
    }
  }
}

// Plain decode (1-D indices).  Every warp works on its own: it checks the request, preprocesses the request's
// tokens itself (redundantly with the block's other warps: a few hundred bytes from L2 against 16 KB of state
// per warp) and synchronises only with __syncwarp, so no warp ever waits for another at a barrier.
template <int D, bool kF32>
__global__ void __launch_bounds__(kTokenWarps * 32, 4) decode_warp_kernel(const DecodeArgs a) {
  using TL = TokenLayout<D>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = TL::kColsPerLane;
  constexpr int kR = TL::kRowsPerThread;
  constexpr int kSlices = D / TL::kRowsPerBlock;
  __shared__ __align__(16) TokenBuf<D> sbuf[kTokenWarps][kWarpTokens];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = blockIdx.x / kSlices;
  const int h = blockIdx.y;
  const int slice = static_cast<int>(blockIdx.x % kSlices);
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = TL::row(slice, q, warp, lane);
  const int j = lane % TL::kLanesPerRow;
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;  // state rows per pool row
  const int64_t out_col = static_cast<int64_t>(h) * D;
  StateT* pool = static_cast<StateT*>(a.pool);

  // ---- 1. the span, then at once the first tokens' loads (they depend on nothing else; rows are
  // clamped, so this stays in bounds before token_rows is checked); the read slot, then at once the
  // state load (speculative: clamped into the pool, used only if every check passes).
  // Dependent round trips: [cu] -> [acc] -> idx -> (state, tokens, checks) -> stores.
  int64_t batch, bos, len, read = -1;
  int err = decode_span(a, n, &batch, &bos, &len) ? 0 : static_cast<int>(DeviceError::kBadCuSeqlens);
  TokenRaw<D> raw[kWarpTokens];
  float vv[kR][kWarpTokens];
  if (len > 0) {
    load_warp_tokens<D>(a, batch, bos, len < kWarpTokens ? static_cast<int>(len) : kWarpTokens, h, vrow, lane,
                        raw, vv);
  }
  if (err == 0) err = decode_read_slot(a, n, len, &read);
  float s[kR][16];
  if (read >= 0) {
    const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
#pragma unroll
    for (int q = 0; q < kR; ++q)
      load_state_row<D, kF32>(pool + (r * head_rows + out_col + vrow[q]) * D, j, s[q]);
  }
  if (err == 0) err = decode_entries_error(a, n, bos, len, lane, 32);
  if (__any_sync(0xffffffffu, err != 0)) {  // a bad request writes nothing
    if (err != 0) atomicExch(a.error_word, err);
    return;
  }

  if (read < 0) {  // padded request: zero its outputs, touch no state
    zero_padded_outputs<D>(a, batch, bos, len, out_col, vrow, j);
  } else {
    // ---- 2. the tokens, kWarpTokens at a time: the state stays in registers; out and (spec) the
    // write slot of each token.
    float expA, dtb[PC];
    load_gate_params<D>(a, h, lane, &expA, dtb);
    for (int64_t c0 = 0; c0 < len; c0 += kWarpTokens) {
      const int nt = static_cast<int>(len - c0 < kWarpTokens ? len - c0 : kWarpTokens);
      float b[kWarpTokens], vcur[kR][kWarpTokens];
#pragma unroll
      for (int i = 0; i < kWarpTokens; ++i) {
        if (i < nt) b[i] = preprocess_token<D>(a, raw[i], expA, dtb, sbuf[warp][i], lane);
#pragma unroll
        for (int q = 0; q < kR; ++q) vcur[q][i] = vv[q][i];
      }
      __syncwarp();
      // raw is free again: the next chunk's loads fly while this chunk runs.
      const int64_t c1 = c0 + kWarpTokens;
      if (c1 < len) {
        load_warp_tokens<D>(a, batch, bos + c1,
                            len - c1 < kWarpTokens ? static_cast<int>(len - c1) : kWarpTokens, h, vrow, lane,
                            raw, vv);
      }
#pragma unroll
      for (int i = 0; i < kWarpTokens; ++i) {
        if (i < nt) {
          const int64_t w = a.spec ? slot_at(a, n, c0 + i) : -1;
          bf16* orow = a.out + batch * a.out_sb + mapped_row(a, bos + c0 + i) * a.out_st + out_col;
#pragma unroll
          for (int q = 0; q < kR; ++q) {
            const float o = advance_row<D>(s[q], sbuf[warp][i], j, b[i], vcur[q][i]);
            if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o);
            if (w >= 0) store_state_row<D, kF32>(pool + (w * head_rows + out_col + vrow[q]) * D, j, s[q]);
          }
        }
      }
      __syncwarp();  // the buffer is rewritten by the next chunk
    }
    if (!a.spec && len > 0) {
#pragma unroll
      for (int q = 0; q < kR; ++q)
        store_state_row<D, kF32>(pool + (read * head_rows + out_col + vrow[q]) * D, j, s[q]);
    }
  }

  // ---- 3. one warp per request (head 0, slice 0, warp 0) reports pool-row conflicts.
  if (h == 0 && slice == 0 && warp == 0 && read >= 0) report_decode_conflicts(a, n, len, read, lane, 32);
}

// Speculative decode (several tokens per request): the block preprocesses kTokenChunk = 8 tokens at
// once, two per warp, behind a block barrier (measured faster than warp-redundant preprocessing
// there: spec 1+3 at batch 256 fp32 462 vs 537 us; plain decode is the other way round, 207 vs 190).
template <int D, bool kF32>
__global__ void __launch_bounds__(kTokenWarps * 32, 4) decode_chunked_kernel(const DecodeArgs a) {
  using TL = TokenLayout<D>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = TL::kColsPerLane;
  constexpr int kR = TL::kRowsPerThread;
  constexpr int kSlices = D / TL::kRowsPerBlock;
  __shared__ __align__(16) TokenChunkSmem<D> sm;
  __shared__ int64_t s_slot[kTokenChunk], s_row[kTokenChunk];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = blockIdx.x / kSlices;
  const int h = blockIdx.y;
  const int slice = static_cast<int>(blockIdx.x % kSlices);
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = TL::row(slice, q, warp, lane);
  const int j = lane % TL::kLanesPerRow;
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;  // state rows per pool row
  const int64_t out_col = static_cast<int64_t>(h) * D;
  StateT* pool = static_cast<StateT*>(a.pool);

  // ---- 1. the span, then at once the first token chunk's loads (they depend on nothing else; row
  // indices are clamped, so this stays in bounds before token_rows is checked); the read slot, then
  // at once the state load (speculative: clamped into the pool, used only if every check passes).
  // Dependent round trips of a block: [cu] -> [acc] -> idx -> (state, tokens, checks) -> stores.
  int64_t batch, bos, len, read = -1;
  int err = decode_span(a, n, &batch, &bos, &len) ? 0 : static_cast<int>(DeviceError::kBadCuSeqlens);
  TokenChunkRegs<D> regs;
  if (len > 0)
    load_token_chunk<D>(a, batch, bos, len < kTokenChunk ? static_cast<int>(len) : kTokenChunk, h, vrow,
                        regs);
  if (err == 0) err = decode_read_slot(a, n, len, &read);
  float s[kR][16];
  if (read >= 0) {
    const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
#pragma unroll
    for (int q = 0; q < kR; ++q)
      load_state_row<D, kF32>(pool + (r * head_rows + out_col + vrow[q]) * D, j, s[q]);
  }
  if (err == 0) err = decode_entries_error(a, n, bos, len, tid, blockDim.x);
  if (__syncthreads_or(err != 0)) {  // a bad request writes nothing
    if (err != 0) atomicExch(a.error_word, err);
    return;
  }

  if (read < 0) {  // padded request: zero its outputs, touch no state
    zero_padded_outputs<D>(a, batch, bos, len, out_col, vrow, j);
  } else {
    // ---- 2. the tokens, kTokenChunk at a time: the state stays in registers; out and (spec) the
    // write slot of each token.
    float expA, dtb[PC];
    load_gate_params<D>(a, h, lane, &expA, dtb);
    for (int64_t c0 = 0; c0 < len; c0 += kTokenChunk) {
      const int nt = static_cast<int>(len - c0 < kTokenChunk ? len - c0 : kTokenChunk);
      if (c0 > 0) load_token_chunk<D>(a, batch, bos + c0, nt, h, vrow, regs);
      // Write slot and output row of each token: the same for the whole block, so kept in shared
      // memory (published by compute_token_chunk's first barrier, protected by its last).
      if (tid < nt) {
        s_slot[tid] = a.spec ? slot_at(a, n, c0 + tid) : -1;
        s_row[tid] = mapped_row(a, bos + c0 + tid);
      }
      compute_token_chunk<D>(a, nt, j, expA, dtb, sm, regs, s, [&](int i, const float(&o)[kR]) {
        bf16* orow = a.out + batch * a.out_sb + s_row[i] * a.out_st + out_col;
        const int64_t w = s_slot[i];
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o[q]);
          if (w >= 0) store_state_row<D, kF32>(pool + (w * head_rows + out_col + vrow[q]) * D, j, s[q]);
        }
      });
    }
    if (!a.spec && len > 0) {
#pragma unroll
      for (int q = 0; q < kR; ++q)
        store_state_row<D, kF32>(pool + (read * head_rows + out_col + vrow[q]) * D, j, s[q]);
    }
  }

  // ---- 3. one block per request (head 0, slice 0) reports pool-row conflicts.
  if (h == 0 && slice == 0 && read >= 0) report_decode_conflicts(a, n, len, read, tid, blockDim.x);
}

template <int D, bool kF32>
Status launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  using TL = TokenLayout<D>;
  if (a.N <= 0 || a.H <= 0) return Status::ok_status();
  const int64_t blocks = static_cast<int64_t>(a.N) * (D / TL::kRowsPerBlock);
  if (blocks > 0x7fffffff || a.H > 65535) {
    return Status::invalid(
        "flashkda: argument 'q': expected at most 65535 heads and 2^31 decode blocks, got more");
  }
  dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(a.H));
  if (a.spec) {
    decode_chunked_kernel<D, kF32><<<grid, kTokenWarps * 32, 0, stream>>>(a);
  } else {
    decode_warp_kernel<D, kF32><<<grid, kTokenWarps * 32, 0, stream>>>(a);
  }
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::ok_status();
  return Status::cuda_error(std::string("flashkda: decode launch: ") + cudaGetErrorString(e));
}

// Explicit instantiations live in kda_decode_sm90_d{64,128}.cu (fp32 and bf16 pools each).
// `pipelined`: the persistent kernel of kda_decode_pipelined.cuh (the default; it rewrites the error
// words itself), else the per-request kernels above (the caller clears the error word first).
// `pdl`: launch the pipelined kernel with programmatic stream serialisation (its set-up overlaps the
// previous kernel's tail; see decode_pipelined_kernel).
Status launch_decode_d64(const DecodeArgs& a, bool state_f32, bool pipelined, bool pdl, int num_sms,
                         cudaStream_t stream);
Status launch_decode_d128(const DecodeArgs& a, bool state_f32, bool pipelined, bool pdl, int num_sms,
                          cudaStream_t stream);

}  // namespace sm90
}  // namespace flashkda
