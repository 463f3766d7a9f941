// checkpoint_advance: finishes the prefill's checkpoint states (spec section 5).
//
// state_recurrence stores, for checkpoint offset o of sequence n, the state at the start of chunk
// c = floor(o / C) (an exact chunk-boundary state).  This kernel advances it over the remaining
// r = o - C c < C tokens with the token recurrence (kda_token_recurrence.cuh), in place, so that
// checkpoint_state[n, j] equals the final state of running the first o tokens alone.  Chunk-aligned
// offsets (r = 0) need nothing and their blocks exit at once.
//
// Grid: (N x n_ckpt x V / kRowsPerBlock row slices, H).  Block: 4 warps; each thread holds 16 fp32
// columns of two state rows (TokenLayout); shared memory holds kTokenChunk = 8 preprocessed tokens
// (12 KB), filled by the warps in parallel, so 63 tokens cost 8 memory round trips, not 63.
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
  __shared__ __align__(16) TokenChunkSmem<D> sm;
  if (*reinterpret_cast<volatile int*>(a.error_word) != 0) return;  // bad inputs: write nothing

  constexpr int kR = TL::kRowsPerThread;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;  // exits below are block-uniform
  const int64_t e = blockIdx.x / kSlices;                      // (sequence, checkpoint) pair
  const int h = blockIdx.y;
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = TL::row(static_cast<int>(blockIdx.x % kSlices), q, warp, lane);
  const int j = lane % TL::kLanesPerRow;
  const int64_t n = e / a.n_ckpt;
  if (state_row(a, n) < 0) return;  // padded sequence: its checkpoint rows stay untouched
  const SeqSpan sp = sequence_span(a, n);
  const int64_t o = load_index(a.ckpt_offsets, a.ckpt_int64, e);
  const int64_t first = (o / kChunk) * kChunk;  // tokens already in the stored state
  if (o <= first || o > sp.len) return;

  float* base = a.ckpt_state + (e * a.H + h) * static_cast<int64_t>(D) * D;
  float s[kR][16];
#pragma unroll
  for (int q = 0; q < kR; ++q) load_state_row<D, true>(base + vrow[q] * D, j, s[q]);
  float expA, dtb[PC];
  load_gate_params<D>(a, h, lane, &expA, dtb);
  TokenChunkRegs<D> regs;
  for (int64_t t0 = first; t0 < o; t0 += kTokenChunk) {
    const int nt = static_cast<int>(o - t0 < kTokenChunk ? o - t0 : kTokenChunk);
    load_token_chunk<D>(a, sp.batch, sp.bos + t0, nt, h, vrow, regs);
    compute_token_chunk<D>(a, nt, j, expA, dtb, sm, regs, s, [](int, const float(&)[kR]) {});
  }
#pragma unroll
  for (int q = 0; q < kR; ++q) store_state_row<D, true>(base + vrow[q] * D, j, s[q]);
}

}  // namespace sm90
}  // namespace flashkda
