// segment_scan: the start state of every segment of a context-parallel prefill.
//
// Context parallelism (few sequences x heads, long sequences; kda_spec.md section 3): the walk over
// a sequence's chunks is affine in the state, S_end = S_start A + L, with A (K x K) and L (V x K)
// per segment of seg_chunks chunks.  state_recurrence<kSegmentHead> walks segment 0 of every sequence
// from h0 (or 0) to S_1 while state_recurrence<kSegmentMap> computes (L, A) of segments 1 .. nseg - 2
// beside it; this kernel chains them, S_{s+1} = S_s A_s + L_s from S_1, and writes S_2 .. S_{nseg-1} to
// the workspace; state_recurrence<kSegmentApply> then walks segments 1 .. nseg - 1 in parallel from
// their start states, writing the outputs (and the final state from the last one).  Nothing here
// reads h0 (the head walk read it before any segment walk can write ht over it, in an in-place pool).
// A sequence of fewer than three segments has nothing to scan.
//
// Grid: (N, H, D / 16).  Block: D / 8 warps owning 16 state rows; warp w computes columns
// [8 w, 8 w + 8) of S A with tf32 mma (m16n8k8), each operand split in a high and a low tf32 part
// (three products: fp32-like accuracy, the combination adds no error beyond the segment walks).
// The grid is one block per SM at most (N H D / 16 blocks: 128 for 1x16384 H16), so each step is a
// dependent chain per warp: 16 warps of 8 columns (was 4 of 32) cut the chain of a step by 4x
// (3 steps took 21.6 us on the H200, 1x16384 H16; measured 21.8 -> 16.7 us on an H100, perf-notes v23).
// Shared memory: S's 16 rows (16 x (D + 4) fp32) and two stages of A (D x (D + 8) fp32, 68 KB each
// at D = 128): A_{s+1} streams in with cp.async while step s runs, so a step costs one mma pass
// instead of a chain of L2 round trips (the first version, loading A's fragments straight from
// global memory, took ~10 us a step).
#pragma once

#include "sm90/kda_common.cuh"

namespace flashkda {
namespace sm90 {

template <int D>
constexpr int scan_threads() {
  return 32 * (D / 8);  // one warp per 8 columns
}

template <int D>
struct ScanSmem {
  static constexpr int kLdS = D + 4;  // S rows: the A-fragment loads hit 32 distinct banks
  static constexpr int kLdA = D + 8;  // A rows: the B-fragment loads (rows t, columns g) likewise
  static constexpr int kS = 0;
  static constexpr int kA = kS + 16 * kLdS * 4;
  static constexpr int kStageA = D * kLdA * 4;
  static constexpr int kBytes = kA + 2 * kStageA;
  static_assert(kA % 16 == 0 && kStageA % 16 == 0, "cp.async alignment");
};

template <int D>
__device__ inline void load_map_a_async(const float* A, float* sA, int tid) {
  constexpr int kVec = D / 4;  // 16-byte pieces per row
  for (int e = tid; e < D * kVec; e += scan_threads<D>()) {
    const int r = e / kVec, c4 = (e % kVec) * 4;
    cp_async_16(sA + r * ScanSmem<D>::kLdA + c4, A + static_cast<int64_t>(r) * D + c4);
  }
}

template <int D>
__global__ void __launch_bounds__(scan_threads<D>()) segment_scan_kernel(const PrefillArgs a) {
  static_assert(D == 64 || D == 128, "head dim");
  using SM = ScanSmem<D>;
  constexpr int kLd = SM::kLdS, kLdA = SM::kLdA;
  constexpr int kThreads = scan_threads<D>();
  extern __shared__ __align__(128) unsigned char smem[];
  float* sS = reinterpret_cast<float*>(smem + SM::kS);

  // The segment walks, launched programmatically after this grid, may be placed once every block here
  // has started (they wait for its completion before they read a start state).  Launched
  // programmatically after the segment maps, every block here waits for their completion (which
  // implies the head walk's and chunk_prepare's) before it reads anything they wrote, the error word
  // included, and before it exits, so that the scan's completion implies theirs.
  pdl_launch_dependents();
  pdl_wait_primary();
  if (*reinterpret_cast<volatile int*>(a.error_word) != 0) return;  // bad indices: write nothing

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int row0 = blockIdx.z * 16;
  const SeqSpan sp = sequence_span(a, n);
  const int64_t srow = state_row(a, n);
  if (srow < 0) return;  // padding: the apply pass only zeroes its outputs
  const int nseg = num_segments(a, sp.len);
  if (nseg < 3) return;  // S_1 is the head walk's, and segment 1 may be the last
  load_map_a_async<D>(segment_block<D>(a, n, sp, 1, h, kSegMapA), reinterpret_cast<float*>(smem + SM::kA),
                      tid);
  cp_async_commit();

  // S_1 (rows [row0, row0 + 16)): the head walk's final state, which the map grid's completion
  // implies (state_recurrence_kernel, block (0, 0, 0) of the maps).
  const float* start1 = segment_block<D>(a, n, sp, 1, h, kSegStart);
  for (int e = tid; e < 16 * D / 4; e += kThreads) {
    const int r = e / (D / 4), c4 = (e % (D / 4)) * 4;
    *reinterpret_cast<float4*>(&sS[r * kLd + c4]) =
        *reinterpret_cast<const float4*>(start1 + static_cast<int64_t>(row0 + r) * D + c4);
  }

  const int col0 = 8 * warp;
  for (int s = 1; s + 1 < nseg; ++s) {
    const float* L = segment_block<D>(a, n, sp, s, h, kSegMapL);
    constexpr int NJ = 1;  // n-tiles of 8 columns a warp
    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = col0 + 8 * j + 2 * t;
      const float2 l0 = *reinterpret_cast<const float2*>(L + static_cast<int64_t>(row0 + g) * D + col);
      const float2 l1 = *reinterpret_cast<const float2*>(L + static_cast<int64_t>(row0 + g + 8) * D + col);
      acc[j][0] = l0.x, acc[j][1] = l0.y, acc[j][2] = l1.x, acc[j][3] = l1.y;
    }
    // A_s is in stage (s - 1) & 1 (A_1 in stage 0)
    if (s + 2 < nseg) {  // A of the next step into the other stage (free since step s - 1 ended)
      load_map_a_async<D>(segment_block<D>(a, n, sp, s + 1, h, kSegMapA),
                          reinterpret_cast<float*>(smem + SM::kA + (s & 1) * SM::kStageA), tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // A_s and S_s visible to every warp
    const float* sA = reinterpret_cast<const float*>(smem + SM::kA + ((s - 1) & 1) * SM::kStageA);
#pragma unroll 4
    for (int kk = 0; kk < D / 8; ++kk) {
      const float x[4] = {sS[g * kLd + 8 * kk + t], sS[(g + 8) * kLd + 8 * kk + t],
                          sS[g * kLd + 8 * kk + t + 4], sS[(g + 8) * kLd + 8 * kk + t + 4]};
      uint32_t ahi[4], alo[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ahi[i] = to_tf32(x[i]);
        alo[i] = to_tf32(x[i] - __uint_as_float(ahi[i]));
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int col = col0 + 8 * j + g;
        const float b0 = sA[(8 * kk + t) * kLdA + col];
        const float b1 = sA[(8 * kk + t + 4) * kLdA + col];
        const uint32_t b0h = to_tf32(b0), b1h = to_tf32(b1);
        const uint32_t b0l = to_tf32(b0 - __uint_as_float(b0h)), b1l = to_tf32(b1 - __uint_as_float(b1h));
        mma_tf32(acc[j], alo, b0h, b1h);
        mma_tf32(acc[j], ahi, b0l, b1l);
        mma_tf32(acc[j], ahi, b0h, b1h);
      }
    }
    __syncthreads();  // every warp has read S_s and A_s
    float* next = segment_block<D>(a, n, sp, s + 1, h, kSegStart);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = col0 + 8 * j + 2 * t;
      *reinterpret_cast<float2*>(&sS[g * kLd + col]) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(&sS[(g + 8) * kLd + col]) = make_float2(acc[j][2], acc[j][3]);
      *reinterpret_cast<float2*>(next + static_cast<int64_t>(row0 + g) * D + col) =
          make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(next + static_cast<int64_t>(row0 + g + 8) * D + col) =
          make_float2(acc[j][2], acc[j][3]);
    }
  }
}

}  // namespace sm90
}  // namespace flashkda
