// state_recurrence: the sequential part of the chunked KDA prefill.
//
// Grid: (N sequences, H heads, V / (16 NW) state slices).  Block: NW warps (1 or 2 warpgroups);
// warp w owns state rows v in [v0 + 16w, v0 + 16w + 16) as fp32 accumulators in registers (16 x D
// per warp, the wgmma accumulator layout), so warps never exchange state.  Per chunk, with the chunk
// record of chunk_prepare in shared memory, each warpgroup runs on its 64 rows (sm_90a wgmma, A
// from registers, B from the record's SW128 tiles, kda_wgmma.cuh):
//   VnT = UT - S W^T            (64 x C: 8 m64n64k16, bf16)
//   OT  = S QT^T + VnT MQK^T    (64 x C: 8 + 4 m64n64k16, bf16 / fp16)
//   S   = S diag(gamma) + VnT KD  (64 x D: 4 m64n128k16, fp16, KD N-major)
// With mma.sync each warp loaded every B fragment itself (8 warps x ~56 KB of ldmatrix a chunk);
// wgmma reads each tile once per warpgroup.  The record of chunk c+1 streams in while chunk c is
// computed (2 stages), issued right after the chunk's one block barrier by one thread as TMA bulk
// copies (one per tile: the record holds each tile as its SW128 shared-memory image) completing on
// the stage's mbarrier; with cp.async every thread issued ~20-40 16-byte copies a chunk between the
// barrier and the first wgmma.  The output tile goes through shared memory so that global stores
// are 16-byte rows; it is double-buffered and stored during the next chunk's first wgmma batch (one
// barrier per chunk instead of two).
// Shared memory (D = 128, NW = 8): 2 stages x (W, QT, KD 3 x 16 KB + MQK 8 KB + UT 16 KB + gamma,
// rounded to 1 KB) + 2 output tiles x 17 KB + 2 mbarriers + 1 KB alignment: 182 KB.
//
// Block order (kWhole, varlen, more blocks than SMs): blocks take (sequence, head) longest sequence
// first, head fastest (a.walk_longest_first), so that the longest walks start in the first wave and
// not possibly in the last (varlen H96: walk 353.6 -> 294.0 us).
//
// Modes (context parallelism, kda_segment_scan.cuh): kWhole walks whole sequences (grid.x = N).
// kSegmentMap walks one segment of a sequence (grid.x = N max_segs) from S = 0 and from S = I at
// once: the grid's z covers 2D rows, rows [0, D) are L (the state rows, UT as usual) and rows
// [D, 2D) are A (UT = 0, starting from the identity), which are the affine map S_end = S_start A + L
// of the segment, written to the workspace.  No output: QT, MQK and the output tile are not loaded
// (2 stages x 42 KB at NW = 4, two blocks per SM).  kSegmentApply walks one segment from the start
// state segment_scan wrote, writes the outputs, and the final state from the last segment.
#pragma once

#include <cuda_fp16.h>

#include "sm90/kda_common.cuh"
#include "sm90/kda_walk_order.h"
#include "sm90/kda_wgmma.cuh"

namespace flashkda {
namespace sm90 {

enum class RecurrenceMode : int { kWhole = 0, kSegmentMap = 1, kSegmentApply = 2 };

template <int D, int NW, bool kMap = false>
struct RecurrenceSmem {
  static constexpr int kVs = 16 * NW;  // state rows per block
  static constexpr int kLdO = kVs + 8;
  // W, QT, KD (C x D) and MQK (C x C): SW128 tiles (kda_wgmma.cuh), the B operands of the wgmma.
  static constexpr int kTile = kChunk * D * 2;
  static constexpr int kW = 0;
  static constexpr int kQT = kW + kTile;
  static constexpr int kKD = kQT + (kMap ? 0 : kTile);
  static constexpr int kMQK = kKD + kTile;
  // UT: the block's kVs rows of the record's [D][C] SW128 image (128-byte rows), one contiguous run.
  static constexpr int kUT = kMQK + (kMap ? 0 : kChunk * kChunk * 2);
  static constexpr int kGamma = kUT + kVs * kChunk * 2;
  static constexpr int kShift = kGamma + D * 4;  // UT, MQK, KD shifts (int32), copied with gamma
  static constexpr int kGammaCopy = D * 4 + 16;
  static constexpr int kStage = (kShift + 16 + 1023) / 1024 * 1024;  // SW128 tiles stay 1024-aligned
  static constexpr int kOut = 2 * kStage;
  static constexpr int kOutTile = kChunk * kLdO * 2;  // two: chunk c's tile is stored during chunk c + 1
  static constexpr int kBar = kOut + (kMap ? 0 : 2 * kOutTile);  // the stages' `full` mbarriers
  // + 1024: the kernel aligns the dynamic shared memory base up to 1024 bytes.
  static constexpr int kBytes = kBar + 16 + 1024;
  static_assert(kMap || 2 * kOutTile >= 32 * NW * 8 + 4, "longest-first scratch fits the out tiles");
  static_assert(kTile % 1024 == 0 && kMQK % 1024 == 0, "SW128 tiles must be 1024-byte aligned");
  static_assert(kUT % 16 == 0 && kGamma % 16 == 0 && kBar % 8 == 0, "bulk copy / mbarrier alignment");
};

// Copies the parts of one chunk record this block needs into a stage: TMA bulk copies issued by one
// thread, completing on the stage's mbarrier `full` (expect_tx of their total).  The record's tiles
// are already the stage's SW128 images.  kMap: no QT or MQK; load_ut false for blocks of A rows
// (their UT is zero).
template <int D, int NW, bool kMap>
__device__ inline void load_record_bulk(const char* rec, unsigned char* stage, int v0, bool load_ut,
                                        uint64_t* full) {
  using SM = RecurrenceSmem<D, NW, kMap>;
  using R = ChunkRecord<D>;
  static_assert(R::kUtShift == R::kGamma + D * 4, "gamma and the shifts are one run");
  constexpr uint32_t kUTBytes = SM::kVs * kChunk * 2;
  const uint32_t bytes = 2 * SM::kTile + (kMap ? 0 : SM::kTile + kChunk * kChunk * 2) +
                         (load_ut ? kUTBytes : 0) + SM::kGammaCopy;
  mbar_arrive_expect_tx(full, bytes);
  bulk_load(stage + SM::kW, rec + R::kW, SM::kTile, full);
  if constexpr (!kMap) bulk_load(stage + SM::kQT, rec + R::kQT, SM::kTile, full);
  bulk_load(stage + SM::kKD, rec + R::kKD, SM::kTile, full);
  if constexpr (!kMap) bulk_load(stage + SM::kMQK, rec + R::kMQK, kChunk * kChunk * 2, full);
  if (load_ut) bulk_load(stage + SM::kUT, rec + R::kUT + v0 * kChunk * 2, kUTBytes, full);
  bulk_load(stage + SM::kGamma, rec + R::kGamma, SM::kGammaCopy, full);
}

template <int D, int NW, RecurrenceMode kMode>
__global__ void __launch_bounds__(32 * NW, kMode == RecurrenceMode::kSegmentMap ? 2 : 1)
    state_recurrence_kernel(const PrefillArgs a) {
  static_assert(D == 64 || D == 128, "head dim");
  static_assert(16 * NW <= D && D % (16 * NW) == 0, "state slices must tile V");
  static_assert(NW % 4 == 0, "whole warpgroups: each owns 64 state rows of the wgmma");
  constexpr bool kMap = kMode == RecurrenceMode::kSegmentMap;
  constexpr bool kWhole = kMode == RecurrenceMode::kWhole;
  using SM = RecurrenceSmem<D, NW, kMap>;
  constexpr int kThreads = 32 * NW;
  constexpr int NT = D / 8;  // n-tiles of a state row block
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  auto out_tile = [&](int c) { return reinterpret_cast<bf16*>(smem + SM::kOut + (c & 1) * SM::kOutTile); };

  if (*reinterpret_cast<volatile int*>(a.error_word) != 0) return;  // bad indices: write nothing

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  int64_t n = kWhole ? blockIdx.x : blockIdx.x / a.max_segs;
  const int seg = kWhole ? 0 : static_cast<int>(blockIdx.x % a.max_segs);
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
  const int64_t srow = state_row(a, n);
  const int nchunks = static_cast<int>((sp.len + kChunk - 1) / kChunk);
  // This block's chunks [c_begin, c_end).  The map of a sequence's last segment is never used.
  int c_begin = 0, c_end = nchunks;
  bool last_segment = true;
  if constexpr (!kWhole) {
    const int nseg = num_segments(a, sp.len);
    if (seg >= nseg || (kMap && seg == nseg - 1)) return;
    c_begin = seg * a.seg_chunks;
    c_end = min(nchunks, c_begin + a.seg_chunks);
    last_segment = seg == nseg - 1;
  }
  // Map blocks: rows [0, D) are L, rows [D, 2D) are A (no UT, identity start).
  const bool a_rows = kMap && v0 >= D;

  if (srow < 0) {  // padded sequence: zero its output rows, touch no state
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

  // Start loading the first chunk before touching the state.  Stage k & 1 holds chunk c_begin + k; its
  // mbarrier completes once per use, so use k waits for parity (k >> 1) & 1.
  const char* rec_base = a.records + (sp.slot0 * a.H + h) * static_cast<int64_t>(ChunkRecord<D>::kBytes);
  const int64_t rec_stride = static_cast<int64_t>(a.H) * ChunkRecord<D>::kBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SM::kBar);
  if (tid == 0) {
    mbar_init(&full[0], 1);
    mbar_init(&full[1], 1);
    fence_mbarrier_init();
    if (c_begin < c_end)
      load_record_bulk<D, NW, kMap>(rec_base + c_begin * rec_stride, smem, v0, !a_rows, &full[0]);
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
  if constexpr (kWhole) {
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
  // the remaining o - C c tokens of it with the token recurrence.
  int next_ckpt = 0;
  const int64_t ckpt_row0 = n * a.n_ckpt;
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
  auto store_out_tile = [&](int c) {
    const bf16* sOut = out_tile(c);
    const int rows = (sp.len - c * kChunk < kChunk) ? static_cast<int>(sp.len - c * kChunk) : kChunk;
    constexpr int kVec = SM::kVs / 8;
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
    if constexpr (kWhole) {
      if (a.ckpt_offsets != nullptr) write_checkpoints(c);
    }
    const int k = c - c_begin;
    unsigned char* stage = smem + (k & 1) * SM::kStage;
    mbar_wait(&full[k & 1], (k >> 1) & 1);  // chunk c's record (issued during chunk c - 1)
    // The one block barrier of a chunk: every warp is done with chunk c - 1 (its stage, which the
    // next copy overwrites, and the out tile stored below).
    __syncthreads();
    if (tid == 0 && c + 1 < c_end) {
      load_record_bulk<D, NW, kMap>(rec_base + (c + 1) * rec_stride, smem + ((k + 1) & 1) * SM::kStage, v0,
                                    !a_rows, &full[(k + 1) & 1]);
    }
    if (h0_bf16_pending) {  // first chunk only (uniform)
      h0_bf16_convert();
      h0_bf16_pending = false;
    }
    const float* sGamma = reinterpret_cast<const float*>(stage + SM::kGamma);
    const bf16* sUT = reinterpret_cast<const bf16*>(stage + SM::kUT);
    const int* shifts = reinterpret_cast<const int*>(stage + SM::kShift);  // UT, MQK, KD
    const float ut_scale = pow2i(shifts[0]);
    const uint32_t st = smem_addr(stage);

    // VnT = UT - S W^T and OT = S QT^T share the A operand (the state, as bf16, from registers;
    // -S by the instruction's scale-a).  Each warpgroup multiplies its 64 rows by the whole tile.
    float vn[8][4], o[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = 8 * j + 2 * t;
      if (a_rows) {
        vn[j][0] = vn[j][1] = vn[j][2] = vn[j][3] = 0.f;
      } else {
        // Rows 16 warp + g (+ 8) of the SW128 image: the 8 rows g sit in 8 different 16-byte bank groups.
        const float2 u0 = __half22float2(
            *reinterpret_cast<const __half2*>(sUT + sw128_element<SM::kVs>(16 * warp + g, col)));
        const float2 u1 = __half22float2(
            *reinterpret_cast<const __half2*>(sUT + sw128_element<SM::kVs>(16 * warp + g + 8, col)));
        vn[j][0] = u0.x * ut_scale;
        vn[j][1] = u0.y * ut_scale;
        vn[j][2] = u1.x * ut_scale;
        vn[j][3] = u1.y * ut_scale;
      }
      o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    }
    uint32_t sa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* e = &s[2 * ks + (i >> 1)][2 * (i & 1)];
        sa[ks][i] = pack_bf16(e[0], e[1]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {  // K-major B: a k16 step is 32 bytes, a half 64 columns
      const uint32_t koff = (ks >> 2) * (kChunk * 128) + (ks & 3) * 32;
      wgmma_m64n64k16_rs<__nv_bfloat16, -1, 0>(vn, sa[ks], sw128_desc(st + SM::kW + koff, 16, 1024));
      if constexpr (!kMap)
        wgmma_m64n64k16_rs<__nv_bfloat16, 1, 0>(o, sa[ks], sw128_desc(st + SM::kQT + koff, 16, 1024));
    }
    wgmma_commit();
    if constexpr (!kMap) {
      if (c > c_begin) store_out_tile(c - 1);  // overlaps the wgmma batch
    }
    wgmma_wait<0>();
    wgmma_fence_operands(vn);
    if constexpr (!kMap) wgmma_fence_operands(o);
    // VnT enters the two remaining products as an fp16 A operand, shifted by a power of two (per
    // warp and chunk) so that |VnT'| < 2^14; MQK and KD come shifted from the record.  The fp32
    // accumulators are rescaled around those products, exactly.
    float vmax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      vmax = fmaxf(vmax,
                   fmaxf(fmaxf(fabsf(vn[j][0]), fabsf(vn[j][1])), fmaxf(fabsf(vn[j][2]), fabsf(vn[j][3]))));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, off));
    const int shift_n = pow2_shift(vmax, 14);
    const float vn_down = pow2i(-shift_n);
    uint32_t va[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      va[ks][0] = pack_f16(vn[2 * ks][0] * vn_down, vn[2 * ks][1] * vn_down);
      va[ks][1] = pack_f16(vn[2 * ks][2] * vn_down, vn[2 * ks][3] * vn_down);
      va[ks][2] = pack_f16(vn[2 * ks + 1][0] * vn_down, vn[2 * ks + 1][1] * vn_down);
      va[ks][3] = pack_f16(vn[2 * ks + 1][2] * vn_down, vn[2 * ks + 1][3] * vn_down);
    }
    const int o_shift = shift_n + shifts[1];
    const float o_down = pow2i(-o_shift), o_up = pow2i(o_shift);
    if constexpr (!kMap) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] *= o_down;
      }
    }
    // S = S diag(gamma) + VnT KD.
    const int s_shift = shift_n + shifts[2];
    const float s_down = pow2i(-s_shift), s_up = pow2i(s_shift);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float2 gm = *reinterpret_cast<const float2*>(sGamma + 8 * j + 2 * t);
      const float g0 = gm.x * s_down, g1 = gm.y * s_down;
      s[j][0] *= g0;
      s[j][1] *= g1;
      s[j][2] *= g0;
      s[j][3] *= g1;
    }
    // OT += VnT MQK^T (MQK K-major: rows are tokens; its upper blocks are zero in the record) and
    // S += VnT KD (KD N-major: rows are the k16 steps' tokens, 2048 bytes a step, halves LBO apart).
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if constexpr (!kMap)
        wgmma_m64n64k16_rs<__half, 1, 0>(o, va[ks], sw128_desc(st + SM::kMQK + ks * 32, 16, 1024));
      const uint64_t dk = sw128_desc(st + SM::kKD + ks * 2048, kChunk * 128, 1024);
      if constexpr (D == 128) {
        wgmma_m64n128k16_f16_rs<1, 1>(s, va[ks], dk);
      } else {
        wgmma_m64n64k16_rs<__half, 1, 1>(s, va[ks], dk);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    if constexpr (!kMap) wgmma_fence_operands(o);
    if constexpr (!kMap) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] *= o_up;
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
      bf16* sOut = out_tile(c);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int tok = 8 * j + 2 * t, vl = 16 * warp + g;
        sOut[tok * SM::kLdO + vl] = __float2bfloat16_rn(o[j][0]);
        sOut[(tok + 1) * SM::kLdO + vl] = __float2bfloat16_rn(o[j][1]);
        sOut[tok * SM::kLdO + vl + 8] = __float2bfloat16_rn(o[j][2]);
        sOut[(tok + 1) * SM::kLdO + vl + 8] = __float2bfloat16_rn(o[j][3]);
      }
    }
  }
  if constexpr (!kMap) {
    if (c_begin < c_end) {
      __syncthreads();
      store_out_tile(c_end - 1);
    }
  }

  if constexpr (kMap) {
    // The segment's map: rows of L (part 1) or of A (part 2).
    float* dst = segment_block<D>(a, n, sp, seg, h, a_rows ? kSegMapA : kSegMapL);
    const int row0 = r0 - (a_rows ? D : 0);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        *reinterpret_cast<float2*>(dst + static_cast<int64_t>(row0 + 8 * (e >> 1)) * D + 8 * j + 2 * t) =
            make_float2(s[j][e], s[j][e + 1]);
      }
    }
    return;
  }
  if constexpr (kWhole) {
    if (a.ckpt_offsets != nullptr) write_checkpoints(nchunks);
  }
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
