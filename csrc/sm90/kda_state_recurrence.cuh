// state_recurrence: the sequential part of the chunked KDA prefill.
//
// Grid: (N sequences, H heads, V / (16 NW) state slices).  Block: NW warps (1 or 2 warpgroups);
// warp w owns state rows v in [v0 + 16w, v0 + 16w + 16) as fp32 accumulators in registers (16 x D
// per warp, the wgmma accumulator layout), so warps never exchange state.  Per chunk, with the chunk
// record of chunk_prepare and the chunk's v rows (the block's V slice) in shared memory, each
// warpgroup runs on its 64 rows (sm_90a wgmma, A from registers, B from the record's tiles: KT, QT, KD
// SW128, Tb and MQK packed triangles in the no-swizzle layout, kda_sw128.h / kda_wgmma.cuh):
//   XT  = v^T - S KT^T          (64 x C: 8 m64n64k16 bf16; the accumulator starts from v^T)
//   VnT = XT Tb^T               (64 x C: 10 m64n16k16 fp16 on Tb's lower blocks, XT shifted into fp16)
//   OT  = S QT^T + VnT MQK^T    (64 x C: 8 m64n64k16 bf16 + 10 m64n16k16 fp16 into an accumulator of
//                               their own, added at the end)
//   S   = S diag(gamma) + VnT KD  (64 x D: 4 m64n128k16, fp16, KD N-major)
// VnT = T_inv diag(b) (v - kt S^T) is formed here rather than W = Tb kt and U = Tb v in chunk_prepare:
// v is read once, by the walk (its rows by ldmatrix.trans arrive in the accumulator's own order, so
// they initialise XT exactly), and chunk_prepare has no W or U products.  OT's products are issued
// after VnT's and before OT += VnT MQK^T, the state update's: the tensor pipe runs groups in order, so
// they stay off the state's chain.
// With mma.sync each warp loaded every B fragment itself (8 warps x ~56 KB of ldmatrix a chunk);
// wgmma reads each tile once per warpgroup.  The record of chunk c+1 streams in while chunk c is
// computed (2 stages), issued right after the chunk's one block barrier as TMA bulk copies (one per
// tile: the record holds each tile as its shared-memory image) completing on the stage's mbarrier; with
// cp.async every thread issued ~20-40 16-byte copies a chunk between the barrier and the first wgmma.  The
// chunk's v rows (16 KB at NW = 8) do come by cp.async, 4 a thread: bulk copies of 64 rows would be 64 issues
// from uniform registers, one lane at a time.  The output tile goes through shared memory so that global
// stores are 16-byte rows; it is double-buffered and stored during the next chunk's first wgmma batch (one
// barrier per chunk instead of two).
// Shared memory (D = 128, NW = 8): 2 stages x (KT, QT, KD 3 x 16 KB + MQK, Tb 2 x 5 KB + v rows 17 KB +
// gamma, rounded to 1 KB: 76 KB) + 2 output tiles x 17 KB + 2 mbarriers + 1 KB alignment: 187 KB.
//
// Launch: the 8-warp whole walk follows chunk_prepare with programmatic stream serialisation
// (kda_prefill_sm90.cuh): the prologue up to the spans (and the pool row's load) runs before
// griddepcontrol.wait; after it the first record and v-row copies are issued, then the error word and
// the pool row are tested (their loads overlap the copies), then the state is read and the walk runs.
// Context parallelism: the head walk launches plainly, the segment maps programmatically after it (no
// wait: they read only chunk_prepare's records), segment_scan after the maps and the segment walks after
// the scan programmatically too, each waiting for the grid before it (launch_context_parallel).
//
// Block order (kWhole, varlen, more blocks than SMs): blocks take (sequence, head) longest sequence
// first, head fastest (a.walk_longest_first), so that the longest walks start in the first wave and
// not possibly in the last (varlen H96: walk 353.6 -> 294.0 us).
//
// Modes (context parallelism, kda_segment_scan.cuh): kWhole walks whole sequences (grid.x = N).
// kSegmentHead is the whole walk cut after segment 0 (grid.x = N): it writes segment 0's outputs and
// checkpoints and ends with S_1 in the workspace (a sequence of one segment ends as the whole walk).
// kSegmentMap walks one segment s in [1, nseg - 2] of a sequence (grid.x = N max_segs) from S = 0 and
// from S = I at once, beside the head walk (launched programmatically after it): the grid's z covers
// 2D rows, rows [0, D) are L (the state rows, with v as usual) and rows [D, 2D) are A (no v term,
// starting from the identity), which are the affine map S_end = S_start A + L of the segment, written
// to the workspace.  No output: QT, MQK and the output tile are not loaded (2 stages x 51 KB at NW =
// 4, two blocks per SM).  kSegmentApply walks one segment s >= 1 from the start state the head walk
// (s = 1) or segment_scan wrote, writes the outputs, and the final state from the last segment.
#pragma once

#include <cuda_fp16.h>

#include <utility>

#include "sm90/kda_common.cuh"
#include "sm90/kda_walk_order.h"
#include "sm90/kda_wgmma.cuh"

namespace flashkda {
namespace sm90 {

enum class RecurrenceMode : int { kWhole = 0, kSegmentMap = 1, kSegmentApply = 2, kSegmentHead = 3 };

template <int D, int NW, bool kMap = false>
struct RecurrenceSmem {
  static constexpr int kVs = 16 * NW;  // state rows per block
  static constexpr int kLdO = kVs + 8;
  // KT, QT, KD (C x D): SW128 tiles (kda_wgmma.cuh), the B operands of the wgmma; MQK and Tb below.
  static constexpr int kTile = kChunk * D * 2;
  static constexpr int kKT = 0;
  static constexpr int kQT = kKT + kTile;
  static constexpr int kKD = kQT + (kMap ? 0 : kTile);
  static constexpr int kMQK = kKD + kTile;
  // MQK and Tb [C][C] fp16: packed triangles as in the record (tri64_offset), the K-major B operands of
  // OT += VnT MQK^T and VnT = XT Tb^T, K step ks reading only its rows 16 ks .. 63 (triangle_product_first).
  static constexpr int kTb = kMQK + (kMap ? 0 : kTri64Bytes);
  // The chunk's v rows, this block's kVs columns (bf16), padded by 16 bytes so that the 8 rows of an
  // ldmatrix.trans hit 8 different bank groups; 16-byte cp.async by every thread (copy_v_rows_async).
  static constexpr int kLdV = kVs + 8;
  static constexpr int kV = kTb + kTri64Bytes;
  static constexpr int kGamma = kV + kChunk * kLdV * 2;
  static constexpr int kShift = kGamma + D * 4;  // Tb, MQK, KD shifts (int32), copied with gamma
  static constexpr int kGammaCopy = D * 4 + 16;
  static constexpr int kStage = (kShift + 16 + 1023) / 1024 * 1024;  // SW128 tiles stay 1024-aligned
  static constexpr int kOut = 2 * kStage;
  static constexpr int kOutTile = kChunk * kLdO * 2;  // two: chunk c's tile is stored during chunk c + 1
  static constexpr int kBar = kOut + (kMap ? 0 : 2 * kOutTile);  // the stages' `full` mbarriers
  // + 1024: the kernel aligns the dynamic shared memory base up to 1024 bytes.
  static constexpr int kBytes = kBar + 16 + 1024;
  static_assert(kMap || 2 * kOutTile >= 32 * NW * 8 + 4, "longest-first scratch fits the out tiles");
  static_assert(kBytes <= 227 * 1024, "a block's shared memory must fit an SM");
  static_assert(!kMap || 2 * (kBytes + 1024) <= 228 * 1024, "the map pass runs two blocks per SM");
  static_assert(kTile % 1024 == 0, "SW128 tiles must be 1024-byte aligned");
  static_assert(kMQK % 16 == 0 && kTb % 16 == 0, "no-swizzle operands and bulk copies: 16-byte aligned");
  static_assert(kV % 16 == 0 && (kLdV * 2) % 16 == 0 && kGamma % 16 == 0 && kBar % 8 == 0,
                "bulk copy / ldmatrix / mbarrier alignment");
};

// D = A B^T with B a 64 x 64 packed triangle (tri64) whose base descriptor is `tri` (tri64_desc), in
// m64n16k16 blocks: D's column block J (tiles 2 J, 2 J + 1) takes K steps 0 .. J (B's row block J of step ks
// is 512 (J - ks) bytes into the step), the first overwriting: 10 blocks where a full tile takes 16.  Only
// m64n16k16 on D: an accumulator shared with other shapes made ptxas serialise the kernel's wgmma (C7511).
template <int J, int... kSteps>
__device__ __forceinline__ void triangle_column(float (&d)[8][4], const uint32_t (&a)[4][4], uint64_t tri,
                                                std::integer_sequence<int, kSteps...>) {
  (wgmma_m64n16k16_f16_rs<2 * J, (kSteps != 0)>(d, a[kSteps], desc_offset(tri, tri64_block(J, kSteps))), ...);
}
__device__ __forceinline__ void triangle_product_first(float (&d)[8][4], const uint32_t (&a)[4][4],
                                                       uint64_t tri) {
  triangle_column<0>(d, a, tri, std::make_integer_sequence<int, 1>{});
  triangle_column<1>(d, a, tri, std::make_integer_sequence<int, 2>{});
  triangle_column<2>(d, a, tri, std::make_integer_sequence<int, 3>{});
  triangle_column<3>(d, a, tri, std::make_integer_sequence<int, 4>{});
}

// A 16 x 64 accumulator tile times `scale` as the fp16 A fragments of four k16 steps (the accumulator's
// n-tiles 2 ks and 2 ks + 1 are step ks's k halves).
__device__ inline void acc_to_a_f16(const float (&x)[8][4], float scale, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float* e = &x[2 * ks + (i >> 1)][2 * (i & 1)];
      a[ks][i] = pack_f16(e[0] * scale, e[1] * scale);
    }
  }
}

// Rows of chunk c of sequence span sp (the last chunk may be short).
__device__ inline int chunk_rows(const SeqSpan& sp, int c) {
  const int64_t left = sp.len - static_cast<int64_t>(c) * kChunk;
  return left < kChunk ? static_cast<int>(left) : kChunk;
}

// Issues the record copies of chunk c into a stage, completing on the stage's mbarrier `full`: the
// parts of its record this block needs, as TMA bulk copies (the record's tiles are already the stage's
// SW128 images).  kMap: no QT or MQK (A-row blocks of the map pass still need Tb).  Copy j (KT, QT, KD,
// MQK, Tb, gamma) is issued by the calling thread when mine(j); the one thread with `expects` registers
// the bytes (the stage's only expected arrival).
//   - the walk's first copies: thread 0 issues all six (mine always true, expects);
//   - in the chunk loop they are spread over the warps' lane 0: copy j to warp (j + 1) % NW, warp 0
//     expects, so no warp issues more than two.  By one thread they were ~80 instructions on warp 0's
//     path each chunk, and the warpgroup's next wgmma waits for its slowest warp.  The phase cannot
//     complete before warp 0's arrive, so copies that complete first leave the transaction count
//     negative for a while, which the mbarrier allows.  Needs the barrier's initialisation visible to
//     every warp (the chunk loop's barriers), hence thread 0 alone for the first copies.
template <int D, int NW, bool kMap, class Mine>
__device__ inline void issue_record_copies(const char* rec, unsigned char* stage, uint64_t* full,
                                           bool expects, Mine mine) {
  using SM = RecurrenceSmem<D, NW, kMap>;
  using R = ChunkRecord<D>;
  static_assert(R::kShifts == R::kGamma + D * 4, "gamma and the shifts are one run");
  constexpr uint32_t bytes =
      2 * SM::kTile + (kMap ? 0 : SM::kTile + kTri64Bytes) + kTri64Bytes + SM::kGammaCopy;
  if (expects) mbar_arrive_expect_tx(full, bytes);
  if (mine(0)) bulk_load(stage + SM::kKT, rec + R::kKT, SM::kTile, full);
  if constexpr (!kMap) {
    if (mine(1)) bulk_load(stage + SM::kQT, rec + R::kQT, SM::kTile, full);
  }
  if (mine(2)) bulk_load(stage + SM::kKD, rec + R::kKD, SM::kTile, full);
  if constexpr (!kMap) {
    if (mine(3)) bulk_load(stage + SM::kMQK, rec + R::kMQK, kTri64Bytes, full);
  }
  if (mine(4)) bulk_load(stage + SM::kTb, rec + R::kTb, kTri64Bytes, full);
  if (mine(5)) bulk_load(stage + SM::kGamma, rec + R::kGamma, SM::kGammaCopy, full);
}

// The chunk's v rows of the block's slice into a stage, when they are 16-byte aligned: 16-byte
// cp.async by every thread (64 kVs / 8 / 32 NW = 4 a thread), committed as one group that the thread
// waits for before the next chunk barrier, which publishes the rows.  (Bulk copies, one a row, take
// their addresses from uniform registers: a warp issues its lanes' copies one after another, and one
// warp issuing all 64 held its warpgroup's first wgmma back.)
template <int D, int NW, bool kMap>
__device__ inline void copy_v_rows_async(const PrefillArgs& a, const SeqSpan& sp, int h, int c,
                                         unsigned char* stage, int v0, int tid) {
  using SM = RecurrenceSmem<D, NW, kMap>;
  constexpr int kThreads = 32 * NW;
  constexpr int kVec = SM::kVs / 8;  // 16-byte pieces a row
  if (!a.vec_v) return;
  const int rows = chunk_rows(sp, c);
  const int64_t tok0 = sp.bos + static_cast<int64_t>(c) * kChunk;
  const bf16* base = a.v + sp.batch * a.v_sb + h * D + v0;
  unsigned char* sv = stage + SM::kV;
  constexpr int kPerThread = kChunk * kVec / kThreads;
  constexpr int kRowStep = kThreads / kVec;  // rows between a thread's copies
  static_assert(kThreads % kVec == 0, "a thread's copies keep their 16-byte piece of the row");
  if (a.token_rows == nullptr && rows == kChunk) {
    // Full chunk without a row map (every chunk but a sequence's last, in the common layouts): the
    // thread's rows are tid / kVec + kRowStep i, from one address.  The general path below costs ~40
    // instructions a copy (the row map's branch, a 64-bit multiply, the shared address conversion),
    // ~160 of the ~1,100 a warp issues a chunk on the 4-warp walks' one warp per scheduler.
    const int r = tid / kVec, piece = tid % kVec;
    const bf16* src = base + (tok0 + r) * a.v_st + piece * 8;
    const int64_t step = kRowStep * a.v_st;
    const uint32_t dst = smem_addr(sv) + r * SM::kLdV * 2 + piece * 16;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      cp_async_16_shared(dst + i * kRowStep * SM::kLdV * 2, src + i * step);
    cp_async_commit();
    return;
  }
  // Every row index first (token_rows: one load each, all in flight together; the copies' memory
  // clobber would otherwise keep each load next to its copy, a round trip per copy), then the copies.
  int64_t src_row[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int r = (tid + i * kThreads) / kVec;
    src_row[i] = r < rows ? mapped_row(a, tok0 + r) : 0;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid + i * kThreads, r = e / kVec, piece = e % kVec;
    if (r < rows) cp_async_16(sv + r * SM::kLdV * 2 + piece * 16, base + src_row[i] * a.v_st + piece * 8);
  }
  cp_async_commit();
}

// The parts of a stage's v rows copy_v_rows_async does not write, by every thread with ordinary stores:
// all rows when v's rows are not 16-byte aligned (element copies), and the rows past the end of a
// short last chunk (zeros: they enter XT, whose columns there meet Tb's zero columns, but 0 times
// stale bits could be a NaN).  Run while the stage is free (after the chunk barrier that retired its
// previous use); the next chunk barrier publishes the writes.
template <int D, int NW, bool kMap>
__device__ inline void fill_v_rows(const PrefillArgs& a, const SeqSpan& sp, int h, int c,
                                   unsigned char* stage, int v0, int tid) {
  using SM = RecurrenceSmem<D, NW, kMap>;
  constexpr int kThreads = 32 * NW;
  const int rows = chunk_rows(sp, c);
  uint16_t* sv = reinterpret_cast<uint16_t*>(stage + SM::kV);
  if (a.vec_v) {
    constexpr int kVec = SM::kVs / 8;  // 16-byte pieces a row
    for (int e = rows * kVec + tid; e < kChunk * kVec; e += kThreads) {
      *reinterpret_cast<uint4*>(sv + (e / kVec) * SM::kLdV + (e % kVec) * 8) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
    const int64_t tok0 = sp.bos + static_cast<int64_t>(c) * kChunk;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(a.v);
    for (int e = tid; e < kChunk * SM::kVs; e += kThreads) {
      const int r = e / SM::kVs, col = e % SM::kVs;
      sv[r * SM::kLdV + col] =
          r < rows ? v[sp.batch * a.v_sb + mapped_row(a, tok0 + r) * a.v_st + h * D + v0 + col] : uint16_t{0};
    }
  }
}

template <int D, int NW, RecurrenceMode kMode>
__global__ void __launch_bounds__(32 * NW, kMode == RecurrenceMode::kSegmentMap ? 2 : 1)
    state_recurrence_kernel(const PrefillArgs a) {
  static_assert(D == 64 || D == 128, "head dim");
  static_assert(16 * NW <= D && D % (16 * NW) == 0, "state slices must tile V");
  static_assert(NW % 4 == 0, "whole warpgroups: each owns 64 state rows of the wgmma");
  constexpr bool kMap = kMode == RecurrenceMode::kSegmentMap;
  constexpr bool kWhole = kMode == RecurrenceMode::kWhole;
  // The head walk: the whole walk of segment 0 (an instantiation of its own, so that the whole walk's
  // code, whose 4-warp chain is sensitive to register allocation, stays as it is).
  constexpr bool kHead = kMode == RecurrenceMode::kSegmentHead;
  using SM = RecurrenceSmem<D, NW, kMap>;
  constexpr int kThreads = 32 * NW;
  constexpr int NT = D / 8;  // n-tiles of a state row block
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  auto out_tile = [&](int c) { return reinterpret_cast<bf16*>(smem + SM::kOut + (c & 1) * SM::kOutTile); };

  // The segment maps launch programmatically after the head walk and run beside it; segment_scan after
  // the maps, so that its launch and its blocks' placement (on the SMs phase 1 leaves free) overlap
  // the maps instead of following them (it waits for their completion before it reads anything).
  if constexpr (kHead || kMap) pdl_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int64_t n = (kWhole || kHead) ? blockIdx.x : blockIdx.x / a.max_segs;
  const int seg = (kWhole || kHead) ? 0 : static_cast<int>(blockIdx.x % a.max_segs);
  int h = blockIdx.y;
  if constexpr (kWhole) {
    if (a.walk_longest_first && a.cu_seqlens != nullptr && a.N > 1 && a.N <= kThreads) {
      // Longest sequences first: blocks are dispatched x fastest, so block (x, y) takes the head
      // (x + N y) % H of the sequence ranked (x + N y) / H by length (longest first, ties by index).
      // With more blocks than SMs (varlen batches), the longest walks then start in the first wave
      // instead of possibly the last.  The out tiles are free scratch until chunk 0's end.
      int64_t* lens = reinterpret_cast<int64_t*>(smem + SM::kOut);
      int* pick = reinterpret_cast<int*>(lens + kThreads);
      int64_t rank_wanted;
      longest_first_block(blockIdx.x, blockIdx.y, a.N, a.H, &rank_wanted, &h);
      if (tid < a.N) {
        const int64_t lo = load_index(a.cu_seqlens, a.cu_int64, tid);
        const int64_t hi = load_index(a.cu_seqlens, a.cu_int64, tid + 1);
        lens[tid] = hi - lo;
      }
      __syncthreads();
      if (tid < a.N && length_rank(lens, a.N, tid) == rank_wanted) *pick = tid;  // ranks: a permutation
      __syncthreads();
      n = *pick;
    }
  }
  const int v0 = blockIdx.z * SM::kVs;
  const SeqSpan sp = sequence_span(a, n);
  // The pool row is loaded here and resolved after the first copies are issued (below).
  uint32_t srow_lo, srow_hi;
  issue_state_row_load(a, n, &srow_lo, &srow_hi);
  const int nchunks = static_cast<int>((sp.len + kChunk - 1) / kChunk);
  // This block's chunks [c_begin, c_end).  The map of a sequence's last segment is never used.
  int c_begin = 0, c_end = nchunks;
  bool last_segment = true;
  if constexpr (kHead) {
    // Context parallelism: segment 0 of every sequence, walked beside the segment maps of segments
    // 1 .. nseg - 2; it ends by writing S_1, segment 1's start state (or as the whole walk, when
    // the sequence has one segment).
    if (nchunks > a.seg_chunks) {
      c_end = a.seg_chunks;
      last_segment = false;
    }
  } else if constexpr (!kWhole) {
    // The segment walks launch programmatically after segment_scan (after the head walk when no map is
    // needed: fewer than three segments); every block of theirs, idle ones included, waits for it here, so
    // that their grid's completion implies the scan's (and through it the maps', the head walk's and
    // chunk_prepare's) for whatever the stream runs next, even when no sequence has a second segment.
    // (Waiting in the idle path only, before its return, made ptxas move the segment walk's descriptors out
    // of the uniform registers: 223 -> 242 registers, +175 instructions a chunk.)
    if constexpr (!kMap) pdl_wait_primary();
    // Segment 0 is the head walk's (no map, no segment walk); the map of a sequence's last segment
    // would never be used.
    const int nseg = num_segments(a, sp.len);
    if (seg == 0 || seg >= nseg || (kMap && seg == nseg - 1)) {
      // The maps launch programmatically after the head walk and do not wait for it (they read only
      // chunk_prepare's records); block (0, 0, 0), always idle (segment 0), waits for it before it
      // exits, so that the map grid's completion implies the head walk's for segment_scan, which
      // reads S_1 (a plain launch waits only for the grid before it).
      if (kMap && (blockIdx.x | blockIdx.y | blockIdx.z) == 0) pdl_wait_primary();
      return;
    }
    c_begin = seg * a.seg_chunks;
    c_end = min(nchunks, c_begin + a.seg_chunks);
    last_segment = seg == nseg - 1;
  }
  // Map blocks: rows [0, D) are L, rows [D, 2D) are A (no v term, identity start).
  const bool a_rows = kMap && v0 >= D;

  // Everything above read call inputs only (indices are clamped where used).  A walk launched with
  // programmatic stream serialisation (the 8-warp whole walk, launch_recurrence) may have started
  // while chunk_prepare still runs: the wait returns once chunk_prepare has completed and its writes
  // (records, error word) are visible, and every block passes it before it writes or exits, so the
  // walk's completion still implies chunk_prepare's for the launches after it.  Without the launch
  // attribute it returns at once.  The segment maps skip it: their primary is the head walk, whose
  // results they do not read (see above).  The segment walks waited above, for segment_scan (launched
  // programmatically after the maps), whose completion implies the maps', the head walk's and
  // chunk_prepare's: every block of each passes its own wait (the maps' through block (0, 0, 0)).
  if constexpr (kWhole || kHead) pdl_wait_primary();

  // Start loading the first chunk before touching the state, and before the error word and the pool
  // row are tested: both are loads whose round trips then overlap the first record's instead of
  // preceding it (a pool call's walk waited for its index before its first copy: perf-notes v27).  The
  // copies read in-bounds memory whatever the indices (spans and slots are clamped).  Stage k & 1 holds
  // chunk c_begin + k; its mbarrier completes once per use, so use k waits for parity (k >> 1) & 1.
  const char* rec_base = a.records + (sp.slot0 * a.H + h) * static_cast<int64_t>(ChunkRecord<D>::kBytes);
  const int64_t rec_stride = static_cast<int64_t>(a.H) * ChunkRecord<D>::kBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SM::kBar);
  if (tid == 0) {
    mbar_init(&full[0], 1);
    mbar_init(&full[1], 1);
    fence_mbarrier_init();
  }
  if (tid == 0 && c_begin < c_end)
    issue_record_copies<D, NW, kMap>(rec_base + c_begin * rec_stride, smem, &full[0], true,
                                     [](int) { return true; });
  if (!a_rows && c_begin < c_end) {
    copy_v_rows_async<D, NW, kMap>(a, sp, h, c_begin, smem, v0, tid);
    fill_v_rows<D, NW, kMap>(a, sp, h, c_begin, smem, v0, tid);
  }

  asm volatile("" : "+r"(srow_lo), "+r"(srow_hi));  // the pool row is consumed from here on
  const int64_t srow = state_row_resolve(a, srow_lo, srow_hi);
  const bool bad_indices = *reinterpret_cast<volatile int*>(a.error_word) != 0;
  if (bad_indices || srow < 0) {  // block-uniform
    // Copies into this block's shared memory must land before it exits: thread 0 (which initialised
    // the mbarrier and issued the record copies) waits for them, every thread for its cp.async.
    if (tid == 0 && c_begin < c_end) mbar_wait(&full[0], 0);
    cp_async_wait<0>();
  }
  if (bad_indices) return;  // bad indices: write nothing
  if (srow < 0) {           // padded sequence: zero its output rows, touch no state
    if constexpr (!kMap) {
      constexpr int kVec = SM::kVs / 8;
      const int64_t t0 = static_cast<int64_t>(c_begin) * kChunk;
      const int64_t t1 = kWhole ? sp.len : min(sp.len, static_cast<int64_t>(c_end) * kChunk);
      for (int64_t e = t0 * kVec + tid; e < t1 * kVec; e += kThreads) {
        const int64_t tok = mapped_row(a, sp.bos + e / kVec);
        bf16* o = a.out + sp.batch * a.out_sb + tok * a.out_st + h * D + v0 + (e % kVec) * 8;
        for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(0.f);
      }
    }
    return;
  }

  // State rows of this warp: r0 = v0 + 16 warp + g, r1 = r0 + 8; columns 8 j + 2 t (+1).
  float s[NT][4];
  const int r0 = v0 + 16 * warp + g;
  const bool has_h0 = starts_from_h0(a, n);
  const int64_t sbase = (srow * a.H + h) * static_cast<int64_t>(D) * D;
  // bf16 h0 pairs (kWhole, paired loads) are converted only after the first chunk's record wait: a
  // conversion before the walk held the issue of the next record stage until the state had arrived,
  // which cost the bf16 state +1.3 us (8x2048 H16) and +6 us (1x8192 H64) over fp32, whose loads
  // are waited for at their first use.
  bool h0_bf16_pending = false;
  auto h0_bf16_convert = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {  // element idx is the low half (little-endian)
        const uint32_t u = __float_as_uint(s[j][e]);
        s[j][e] = __uint_as_float(u << 16);
        s[j][e + 1] = __uint_as_float(u & 0xffff0000u);
      }
    }
  };
  if constexpr (kWhole || kHead) {
    if (a.h0_pairs) {
      // Every load is issued before any is converted: with the conversion next to its load, the bf16
      // path reused one register for all 32 loads and waited for each in turn (+4 us a call).
      const int64_t row_base = sbase + static_cast<int64_t>(r0) * D + 2 * t;
      if (!has_h0) {
#pragma unroll
        for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      } else if (a.state_fp32) {
        const float* h0 = static_cast<const float*>(a.h0) + row_base;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const float2 x = *reinterpret_cast<const float2*>(h0 + 8 * (e >> 1) * D + 8 * j);
            s[j][e] = x.x;
            s[j][e + 1] = x.y;
          }
        }
      } else {  // raw bf16 pairs parked in s[j][0], s[j][2]; converted by h0_bf16_convert below
        const bf16* h0 = static_cast<const bf16*>(a.h0) + row_base;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[j][2 * e] = __uint_as_float(*reinterpret_cast<const uint32_t*>(h0 + 8 * e * D + 8 * j));
          }
        }
        h0_bf16_pending = true;
      }
    } else {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t idx = sbase + static_cast<int64_t>(r0 + 8 * (e >> 1)) * D + 8 * j + 2 * t + (e & 1);
          s[j][e] = has_h0 ? load_scalar(a.h0, a.state_fp32, idx) : 0.f;
        }
      }
    }
  } else if constexpr (kMap) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t + (e & 1), row = r0 + 8 * (e >> 1) - D;
        s[j][e] = (a_rows && row == col) ? 1.f : 0.f;
      }
    }
  } else {
    const float* start = segment_block<D>(a, n, sp, seg, h, kSegStart);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 x = *reinterpret_cast<const float2*>(
            start + static_cast<int64_t>(r0 + 8 * (e >> 1)) * D + 8 * j + 2 * t);
        s[j][e] = x.x;
        s[j][e + 1] = x.y;
      }
    }
  }

  __syncthreads();  // the mbarriers are initialised before any thread waits on them

  // With checkpoints the state is read at the walk's top, and an empty sequence has no first chunk:
  // both convert here.
  if (h0_bf16_pending && (a.ckpt_offsets != nullptr || c_begin >= c_end)) {
    h0_bf16_convert();
    h0_bf16_pending = false;
  }

  // Checkpoints (offsets validated by chunk_prepare: non-decreasing, within the sequence): the
  // state at the start of chunk c = o / C goes to checkpoint_state; checkpoint_advance then runs
  // the remaining o - C c tokens of it with the token recurrence.  The whole walk writes them all; with
  // context parallelism the segment walks (which start from their segment's exact state) write those
  // of chunks [c_begin, c_end), and the sequence's last segment also those at its end.
  int next_ckpt = 0;
  const int64_t ckpt_row0 = n * a.n_ckpt;
  if constexpr (!kWhole && !kHead && !kMap) {
    if (a.ckpt_offsets != nullptr) {
      while (next_ckpt < a.n_ckpt &&
             load_index(a.ckpt_offsets, a.ckpt_int64, ckpt_row0 + next_ckpt) / kChunk < c_begin)
        ++next_ckpt;
    }
  }
  auto write_checkpoints = [&](int c) {
    while (next_ckpt < a.n_ckpt) {
      const int64_t o = load_index(a.ckpt_offsets, a.ckpt_int64, ckpt_row0 + next_ckpt);
      if (o / kChunk != c) break;
      float* dst = a.ckpt_state + ((ckpt_row0 + next_ckpt) * a.H + h) * static_cast<int64_t>(D) * D;
#pragma unroll
      for (int jj = 0; jj < NT; ++jj) {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int64_t idx = static_cast<int64_t>(r0 + 8 * (e >> 1)) * D + 8 * jj + 2 * t;
          *reinterpret_cast<float2*>(dst + idx) = make_float2(s[jj][e], s[jj][e + 1]);
        }
      }
      ++next_ckpt;
    }
  };

  // Global stores of chunk c's output tile (16-byte rows), from its shared-memory tile.
  // Full chunks without a row map and with 16-byte rows (every chunk but a sequence's last, in the
  // common layouts) take a fixed pattern: thread tid stores rows tid / kVec + kOutStep i, i < 4, from
  // one address a chunk.  The general loop below paid ~25 instructions a row (the row
  // map's branch, a 64-bit multiply, the vector / element branch): ~100 of the ~1,100 a warp issues a
  // chunk, on the 4-warp walks' one warp per scheduler.
  constexpr int kVec = SM::kVs / 8;
  constexpr int kOutStep = kThreads / kVec;  // rows a pass
  static_assert(kThreads % kVec == 0 && kChunk % kOutStep == 0, "the output tile's rows split evenly");
  auto store_out_tile = [&](int c) {
    const bf16* sOut = out_tile(c);
    const int rows = (sp.len - c * kChunk < kChunk) ? static_cast<int>(sp.len - c * kChunk) : kChunk;
    if (a.token_rows == nullptr && a.vec_out && rows == kChunk) {  // kernel parameters: uniform
      // Formed here rather than once per walk: hoisted, the offsets' registers spilled the whole walk.
      const int r = tid / kVec, c8 = (tid % kVec) * 8;
      bf16* dst = a.out + sp.batch * a.out_sb + (sp.bos + c * kChunk + r) * a.out_st + h * D + v0 + c8;
      const int64_t step = kOutStep * a.out_st;
      const bf16* src = sOut + r * SM::kLdO + c8;
#pragma unroll
      for (int i = 0; i < kChunk / kOutStep; ++i) {
        *reinterpret_cast<uint4*>(dst + i * step) =
            *reinterpret_cast<const uint4*>(src + i * kOutStep * SM::kLdO);
      }
      return;
    }
    for (int e = tid; e < rows * kVec; e += kThreads) {
      const int r = e / kVec, c8 = (e % kVec) * 8;
      const int64_t tok = mapped_row(a, sp.bos + c * kChunk + r);
      bf16* dst = a.out + sp.batch * a.out_sb + tok * a.out_st + h * D + v0 + c8;
      const bf16* src = sOut + r * SM::kLdO + c8;
      if (a.vec_out) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int i = 0; i < 8; ++i) dst[i] = src[i];
      }
    }
  };

  for (int c = c_begin; c < c_end; ++c) {
    if constexpr (!kMap) {
      if (a.ckpt_offsets != nullptr) write_checkpoints(c);
    }
    const int k = c - c_begin;
    unsigned char* stage = smem + (k & 1) * SM::kStage;
    mbar_wait(&full[k & 1], (k >> 1) & 1);  // chunk c's record (issued during chunk c - 1)
    cp_async_wait<0>();                     // this thread's copies of chunk c's v rows
    // The one block barrier of a chunk: every warp is done with chunk c - 1 (its stage, which the
    // next copy overwrites, and the out tile stored below), and chunk c's v rows are in place.
    __syncthreads();
    unsigned char* next_stage = smem + ((k + 1) & 1) * SM::kStage;
    if (lane == 0 && c + 1 < c_end) {
      issue_record_copies<D, NW, kMap>(rec_base + (c + 1) * rec_stride, next_stage, &full[(k + 1) & 1],
                                       warp == 0, [warp](int j) { return (j + 1) % NW == warp; });
    }
    if (!a_rows && c + 1 < c_end) copy_v_rows_async<D, NW, kMap>(a, sp, h, c + 1, next_stage, v0, tid);
    if (h0_bf16_pending) {  // first chunk only (uniform)
      h0_bf16_convert();
      h0_bf16_pending = false;
    }
    const float* sGamma = reinterpret_cast<const float*>(stage + SM::kGamma);
    const int* shifts = reinterpret_cast<const int*>(stage + SM::kShift);  // Tb, MQK, KD
    const uint32_t st = smem_addr(stage);

    // XT's accumulator starts from v^T: rows 16 warp .. of the slice (v columns), k = the chunk's
    // tokens, by ldmatrix.trans from the staged v rows, whose A-fragment order is the accumulator's
    // (n-tile 2 ks: registers 0, 1; n-tile 2 ks + 1: registers 2, 3), exactly (bf16 -> fp32).  A-row
    // blocks of the map pass have no v term.
    float xt[8][4], o[8][4];
    // The v fragments stay as loaded (bf16 pairs) for max |v| in XT's bound, formed under XT's products.
    uint32_t vf[4][4];
    if (!a_rows) {
      const bf16* sV = reinterpret_cast<const bf16*>(stage + SM::kV);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        load_a_frag_trans(vf[ks], sV, SM::kLdV, 16 * warp, 16 * ks, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // element k in the low half
          float* e = &xt[2 * ks + (i >> 1)][2 * (i & 1)];
          e[0] = __uint_as_float(vf[ks][i] << 16);
          e[1] = __uint_as_float(vf[ks][i] & 0xffff0000u);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) xt[j][0] = xt[j][1] = xt[j][2] = xt[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) vf[ks][0] = vf[ks][1] = vf[ks][2] = vf[ks][3] = 0u;
    }
    // XT -= S KT^T and, later, OT = S QT^T share the state operand (bf16, from registers; -S by the
    // instruction's scale-a).  Each warpgroup multiplies its 64 rows by the whole tile.
    uint32_t sa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* e = &s[2 * ks + (i >> 1)][2 * (i & 1)];
        sa[ks][i] = pack_bf16(e[0], e[1]);
      }
    }
    const uint64_t d_kt = sw128_desc(st + SM::kKT, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {  // K-major B: a k16 step is 32 bytes, a half 64 columns
      const uint32_t koff = (ks >> 2) * (kChunk * 128) + (ks & 3) * 32;
      wgmma_m64n64k16_rs<__nv_bfloat16, -1, 0>(xt, sa[ks], desc_offset(d_kt, koff));
    }
    wgmma_commit();
    // XT's fp16 shift from a bound instead of its maximum, computed while XT's products run, so that
    // no reduction over XT sits between their completion and VnT's products: an entry of row r is
    // |v_rt - sum_d S_rd KT_td| <= |v_rt| + ||S_r||_1 max|k|, and max|k| < 2^(KD's shift) (bf16(S) and
    // KT's bf16 rounding stay within the 2^15 target's margin: fp16 holds < 2^16).  |KT| <= |k| rests
    // on the log decays being <= 0 (the contract's a_t, as KD's and MQK's fp16 shifts in chunk_prepare
    // do).  The bound exceeds XT's maximum by a few times on typical inputs (numerics_study.py (10));
    // the looseness costs only headroom above fp16's subnormals.  The thread's two state rows (r0,
    // r0 + 8) are its XT rows; their 1-norms are summed over the 4 lanes of a row.  The shift must
    // be one for the whole warp (VnT sums over tokens held by different lanes): the bound's maximum
    // is over all 32 lanes, not only over the rows.
    const int shift_x = [&] {
      // max |v| from the bf16 bits: non-negative bf16 patterns order like their values (per-half
      // unsigned maxima of the sign-cleared pairs)
      uint32_t vbits = 0u;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int i = 0; i < 4; ++i) vbits = __vmaxu2(vbits, vf[ks][i] & 0x7fff7fffu);
      }
      const float vmax = fmaxf(__uint_as_float(vbits << 16), __uint_as_float(vbits & 0xffff0000u));
      float n0 = 0.f, n1 = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        n0 += fabsf(s[j][0]) + fabsf(s[j][1]);
        n1 += fabsf(s[j][2]) + fabsf(s[j][3]);
      }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        n0 += __shfl_xor_sync(0xffffffffu, n0, off);
        n1 += __shfl_xor_sync(0xffffffffu, n1, off);
      }
      float bound = fmaf(fmaxf(n0, n1), pow2i(shifts[2]), vmax);
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) bound = fmaxf(bound, __shfl_xor_sync(0xffffffffu, bound, off));
      return pow2_shift(bound, 15);
    }();
    const int sx = shift_x + shifts[0];
    // VnT enters the two remaining products as an fp16 A operand, shifted by a power of two (per
    // warp and chunk) so that |VnT'| < 2^14; MQK and KD come shifted from the record.  The fp32
    // accumulators are rescaled around those products, exactly (sx: VnT's scale; the saturating
    // powers only clamp where the result itself leaves fp32's range).
    // The shift is static, so that no reduction over VnT sits between its products and the state
    // update's: |XT'| < 2^15 (its shift), |Tb'| < 2 (the record's shift) and 64 terms give
    // |VnT'| < 2^22, so 2^-8 puts it under 2^14 (XT's shift is from a bound, typically a few times
    // XT's maximum, and Tb' is normalised, so VnT' peaks 7-10 binades under fp16's top and 18 or more
    // above its subnormals; numerics_study.py section (10)).
    // shift_n + sx >= -60 bounds the unscaled VnT's shift as before the pre-scale: a tiny VnT (tiny b)
    // under a large pre-scale would otherwise push o_up / s_down past 2^120 and the products to inf.
    const int shift_n = max(8, -60 - sx);
    // S = S diag(gamma) + VnT KD.  Every shift is known before XT is, so S diag(gamma) 2^-s_shift is
    // formed while XT's products run (they and OT's read the bf16 copy `sa`, not S), pinned there: the
    // chain from VnT's products to the update's keeps only VnT's conversion.  (Formed under VnT's
    // products instead, its registers on top of VnT's and OT's in-flight operands spilled.)
    const int s_shift = sx + shift_n + shifts[2];
    const float s_down = pow2i_sat(-s_shift);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float2 gm = *reinterpret_cast<const float2*>(sGamma + 8 * j + 2 * t);
      const float g0 = gm.x * s_down, g1 = gm.y * s_down;
      s[j][0] *= g0;
      s[j][1] *= g1;
      s[j][2] *= g0;
      s[j][3] *= g1;
    }
    wgmma_fence_operands(s);
    if constexpr (!kMap) {
      if (c > c_begin) store_out_tile(c - 1);  // overlaps the wgmma batch
    }
    wgmma_wait<0>();
    wgmma_fence_operands(xt);
    // XT enters VnT = XT Tb^T as an fp16 A operand shifted by a power of two (per warp and chunk) so
    // that |XT'| < 2^15; VnT's accumulator then holds VnT 2^-sx, sx = shift_x + Tb's shift.
    uint32_t xa[4][4];
    acc_to_a_f16(xt, pow2i(-shift_x), xa);
    // VnT's and OT's first products overwrite their accumulators (scale-d = 0): no zeroing, which
    // the compiler placed after XT's wait (on the chain) or inside OT's batch (C7519).
    float vn[8][4];
    wgmma_fence();
    // Tb is a packed triangle: K step ks holds only rows (VnT's columns) 16 ks .. 63.
    triangle_product_first(vn, xa, tri64_desc(st + SM::kTb));
    wgmma_commit();
    // OT = S QT^T is off the state's chain: issued after VnT's products (the tensor pipe runs groups
    // in order), it runs while VnT is converted and the state's update is issued.
    if constexpr (!kMap) {
      const uint64_t d_qt = sw128_desc(st + SM::kQT, 16, 1024);
      wgmma_m64n64k16_rs<__nv_bfloat16, 1, 0, false>(o, sa[0], d_qt);
#pragma unroll
      for (int ks = 1; ks < D / 16; ++ks) {
        const uint32_t koff = (ks >> 2) * (kChunk * 128) + (ks & 3) * 32;
        wgmma_m64n64k16_rs<__nv_bfloat16, 1, 0>(o, sa[ks], desc_offset(d_qt, koff));
      }
      wgmma_commit();
      wgmma_wait<1>();  // VnT's group
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operands(vn);
    uint32_t va[4][4];
    acc_to_a_f16(vn, pow2i(-shift_n), va);
    // S += VnT KD (KD N-major: rows are the k16 steps' tokens, 2048 bytes a step, halves LBO apart),
    // and VnT MQK^T (MQK K-major: rows are tokens; a packed triangle, its upper blocks neither stored
    // nor multiplied) into an accumulator of its own, added to OT below: on OT itself, its m64n16k16
    // blocks beside OT's m64n64k16 made ptxas serialise every wgmma of the kernel (C7511), and OT's
    // own products would have to be done before these are issued.
    const uint64_t d_kd = sw128_desc(st + SM::kKD, kChunk * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t dk = desc_offset(d_kd, ks * 2048);
      if constexpr (D == 128) {
        wgmma_m64n128k16_f16_rs<1, 1>(s, va[ks], dk);
      } else {
        wgmma_m64n64k16_rs<__half, 1, 1>(s, va[ks], dk);
      }
    }
    float om[8][4];
    if constexpr (!kMap) triangle_product_first(om, va, tri64_desc(st + SM::kMQK));
    wgmma_commit();
    // The output's and the state's scale-backs, formed only now (registers are scarce above).
    const int o_shift = sx + shift_n + shifts[1];
    const float o_up = pow2i_sat(o_shift);
    const float s_up = pow2i_sat(s_shift);
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    if constexpr (!kMap) {
      wgmma_fence_operands(o);
      wgmma_fence_operands(om);
      // OT = S QT^T + (VnT' MQK'^T) 2^o_shift: one rounding, as (OT 2^-o_shift + VnT' MQK'^T) 2^o_shift
      // had (the power of two is exact).
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = fmaf(om[j][e], o_up, o[j][e]);
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= s_up;
    }
    if constexpr (!kMap) {
      // Output tile OT (rows v, columns token) -> sOut[token][v]; stored to global memory during the
      // next chunk (after its top barrier, while its first wgmma batch runs) or after the walk.
      // The fragment's 8 x 8 blocks (v rows 16 warp + 8 half + g, tokens 8 j + 2 t, + 1) go out
      // transposed by stmatrix, four a instruction: lane l gives row l % 8 of block (j = 2 q + l / 16,
      // half = (l / 8) % 2), i.e. token 8 j + l % 8's 8 v values (16 bytes).  Element stores took
      // 32 STS.U16 and 16 PRMT a thread and chunk, on the 4-warp walks' one warp per scheduler.
      // The row pitch (kLdO: 144 bytes) puts the 8 rows of a block on 8 different bank quads.
      static_assert((SM::kLdO * 2) % 16 == 0 && SM::kOutTile % 16 == 0, "stmatrix rows are 16-byte aligned");
      const uint32_t out_row =
          smem_addr(out_tile(c)) +
          ((8 * ((lane >> 4) & 1) + (lane & 7)) * SM::kLdO + 16 * warp + 8 * ((lane >> 3) & 1)) * 2;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t r[4] = {pack_bf16(o[2 * q][0], o[2 * q][1]), pack_bf16(o[2 * q][2], o[2 * q][3]),
                               pack_bf16(o[2 * q + 1][0], o[2 * q + 1][1]),
                               pack_bf16(o[2 * q + 1][2], o[2 * q + 1][3])};
        stmatrix_x4_trans(out_row + q * 16 * SM::kLdO * 2, r);
      }
    }
    // Outside the wgmma batches: inside one, this loop's registers made ptxas fence the batch (C7519).
    if (!a_rows && c + 1 < c_end) fill_v_rows<D, NW, kMap>(a, sp, h, c + 1, next_stage, v0, tid);
  }
  if constexpr (!kMap) {
    if (c_begin < c_end) {
      __syncthreads();
      store_out_tile(c_end - 1);
    }
  }

  // The thread's state rows row0, row0 + 8 (fragment layout, fp32 pairs) into a D x D fp32 block of
  // the workspace (a segment's map, or S_1).
  auto store_state_rows = [&](float* dst, int row0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        *reinterpret_cast<float2*>(dst + static_cast<int64_t>(row0 + 8 * (e >> 1)) * D + 8 * j + 2 * t) =
            make_float2(s[j][e], s[j][e + 1]);
      }
    }
  };
  if constexpr (kMap) {
    // The segment's map: rows of L (part 1) or of A (part 2).
    store_state_rows(segment_block<D>(a, n, sp, seg, h, a_rows ? kSegMapA : kSegMapL), r0 - (a_rows ? D : 0));
    return;
  }
  if constexpr (kHead) {
    if (!last_segment) {  // the head walk: S_1 (fp32) for segment_scan and segment 1's walk
      store_state_rows(segment_block<D>(a, n, sp, 1, h, kSegStart), r0);
      return;
    }
  }
  if (a.ckpt_offsets != nullptr && last_segment) write_checkpoints(nchunks);  // (the map pass returned above)
  if (a.ht != nullptr && last_segment && a.ht_vec16) {
    // The warp's 16 state rows are 16 D contiguous entries of ht: they go through shared memory (the
    // record stages, free since the last chunk's barrier) and out as 16-byte stores, whole sectors
    // for either dtype (the fragment layout alone writes 8- or 4-byte pieces).
    constexpr int kLdX = D + 4;
    static_assert(NW * 16 * kLdX * 4 <= 2 * SM::kStage, "state exit tile must fit in the stages");
    float* x = reinterpret_cast<float*>(smem) + warp * 16 * kLdX;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        *reinterpret_cast<float2*>(x + (g + 8 * (e >> 1)) * kLdX + 8 * j + 2 * t) =
            make_float2(s[j][e], s[j][e + 1]);
      }
    }
    __syncwarp();
    const int64_t base = sbase + static_cast<int64_t>(v0 + 16 * warp) * D;
    if (a.state_fp32) {
      float* dst = static_cast<float*>(a.ht) + base;
      for (int i = lane; i < 16 * D / 4; i += 32) {
        const int row = i / (D / 4), c4 = (i % (D / 4)) * 4;
        *reinterpret_cast<float4*>(dst + row * D + c4) =
            *reinterpret_cast<const float4*>(x + row * kLdX + c4);
      }
    } else {
      bf16* dst = static_cast<bf16*>(a.ht) + base;
      for (int i = lane; i < 16 * D / 8; i += 32) {
        const int row = i / (D / 8), c8 = (i % (D / 8)) * 8;
        const float4 lo = *reinterpret_cast<const float4*>(x + row * kLdX + c8);
        const float4 hi = *reinterpret_cast<const float4*>(x + row * kLdX + c8 + 4);
        uint4 u;
        u.x = pack_bf16(lo.x, lo.y);
        u.y = pack_bf16(lo.z, lo.w);
        u.z = pack_bf16(hi.x, hi.y);
        u.w = pack_bf16(hi.z, hi.w);
        *reinterpret_cast<uint4*>(dst + row * D + c8) = u;
      }
    }
  } else if (a.ht != nullptr && last_segment) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t idx = sbase + static_cast<int64_t>(r0 + 8 * (e >> 1)) * D + 8 * j + 2 * t + (e & 1);
        if (a.state_fp32) {
          static_cast<float*>(a.ht)[idx] = s[j][e];
        } else {
          static_cast<bf16*>(a.ht)[idx] = __float2bfloat16_rn(s[j][e]);
        }
      }
    }
  }
}

}  // namespace sm90
}  // namespace flashkda
