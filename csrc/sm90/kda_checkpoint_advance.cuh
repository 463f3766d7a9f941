// checkpoint_advance: finishes the prefill's checkpoint states (spec section 5).
//
// state_recurrence stores, for checkpoint offset o of sequence n, the state at the start of chunk
// c = floor(o / C) (an exact chunk-boundary state).  This kernel advances it over the remaining
// r = o - C c < C tokens with the token recurrence (kda_token_recurrence.cuh), in place, so that
// checkpoint_state[n, j] equals the final state of running the first o tokens alone.  Chunk-aligned
// offsets (r = 0) need nothing and their blocks exit at once.
//
// Grid: (N x n_ckpt x V / kRowsPerBlock row slices, H).  Block: 4 warps; each thread holds 16 fp32
// columns of one state row (TokenLayout), shared memory is one token buffer per warp (6 KB).
// Runs after state_recurrence on the same stream; does nothing when chunk_prepare flagged an input.
#pragma once

#include "sm90/kda_token_recurrence.cuh"

namespace flashkda {
namespace sm90 {

template <int D>
__global__ void __launch_bounds__(kTokenWarps * 32) checkpoint_advance_kernel(const PrefillArgs a) {
  using TL = TokenLayout<D>;
  constexpr int PC = TL::kColsPerLane;
  constexpr int kSlices = D / TL::kRowsPerBlock;
  __shared__ __align__(16) TokenBuf<D> sbuf[kTokenWarps];
  if (*reinterpret_cast<volatile int*>(a.error_word) != 0) return;  // bad inputs: write nothing

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t e = blockIdx.x / kSlices;  // (sequence, checkpoint) pair
  const int h = blockIdx.y;
  const int vrow = static_cast<int>(blockIdx.x % kSlices) * TL::kRowsPerBlock + warp * TL::kRowsPerWarp +
                   lane / TL::kLanesPerRow;
  const int j = lane % TL::kLanesPerRow;
  const int64_t n = e / a.n_ckpt;
  if (state_row(a, n) < 0) return;  // padded sequence: its checkpoint rows stay untouched
  const SeqSpan sp = sequence_span(a, n);
  const int64_t o = load_index(a.ckpt_offsets, a.ckpt_int64, e);
  const int64_t first = (o / kChunk) * kChunk;  // tokens already in the stored state
  if (o <= first || o > sp.len) return;

  float* row = a.ckpt_state + ((e * a.H + h) * D + vrow) * static_cast<int64_t>(D);
  float s[16];
  load_state_row<D, true>(row, j, s);
  const bool gated = a.gate_mode != kGatePrecomputed;
  const float expA = gated ? expf(a.A_log[h]) : 0.f;
  float dtb[PC];
#pragma unroll
  for (int i = 0; i < PC; ++i) dtb[i] = gated ? a.dt_bias[h * D + lane * PC + i] : 0.f;
  TokenBuf<D>& buf = sbuf[warp];
  TokenRaw<D> raw;
  load_token<D>(a, sp.batch, mapped_row(a, sp.bos + first), h, vrow, lane, raw);
  for (int64_t tok = first; tok < o; ++tok) {
    const TokenRaw<D> cur = raw;
    if (tok + 1 < o) load_token<D>(a, sp.batch, mapped_row(a, sp.bos + tok + 1), h, vrow, lane, raw);
    __syncwarp();
    const float b = preprocess_token<D>(a, cur, expA, dtb, buf, lane);
    __syncwarp();
    (void)advance_row<D>(s, buf, j, b, cur.v);
  }
  store_state_row<D, true>(row, j, s);
}

}  // namespace sm90
}  // namespace flashkda
