// chunk_prepare: everything of a 64-token chunk that does not depend on the recurrent state.
//
// Grid: (H, Y, Z), head fastest, Y Z >= the chunk slots; each block's slot from kda_prepare_order.h, so that
// the blocks dispatched last prepare every sequence's first chunks (their records still in L2 when the walk
// starts reading).
// Block: 256 threads = 8 warps, no warp specialisation; phases are separated by __syncthreads:
//   1. stage the raw q, k, g rows of the chunk in shared memory by cp.async (one round trip;
//      per-element copies when a row is not 16-byte aligned), beta alongside (rows past the sequence
//      end are zero: inert tokens); l2-normalise q and k in registers (shuffles inside the 16 lanes
//      that hold a row), gate -> log decay (log2 units), beta; cumulative decay G by a two-level scan.
//      q and k are kept as fp16 when l2-normalised (|x| <= 1: 8x finer than bf16) and as the raw bf16
//      otherwise (exact).
//   2. gamma = 2^G_last and the fp16 shifts to the chunk record (QT, KT and KD: 4b); the shifts are
//      formed by warp 7 alone and reach the others through shared memory by the phase's barrier.
//   3. L = strict_lower(diag(b) kt kb^T) and MQK = lower_incl(qt kb^T) on tensor cores, per 16x16
//      block (I, J).  Off-diagonal blocks use the reference row 16I-1 (the row before block I):
//      A = k_i 2^(G_i - G_ref), B = k_j 2^(G_ref - G_j), both <= 1 for any gate.  Diagonal blocks use
//      row 16I+7; when a chunk's half-span exceeds kMaxHalfSpanLog2 they are summed pairwise instead.
//      The diagonal blocks carry the largest entries of L and MQK, so their factors go through
//      tf32 mma (fp32 range, 10-bit mantissa) rather than bf16.  Off-diagonal factors are bf16, or
//      fp16 (packed products) when q and k are l2-normalised; A depends on I alone, so the warps that
//      own two blocks of one row block form it once.  Warps 0-3 own the diagonal blocks, 4-7 the six
//      off-diagonal ones; their q / k fragments come by ldmatrix.x4.  MQK is fp16 with a power-of-two shift
//      from the bound scale |q_i| |k_j|, written to its staged record image and stored by one TMA bulk copy
//      right after phase 3 (the 4-byte fragment stores it replaced cost 2-3% of a call).
//   4. T_inv = (I + L)^-1 in a buffer of its own: 16x16 diagonal blocks by fp32 forward substitution
//      (in phase 3, by the warp that computed L_II), then the off-diagonal blocks
//      T_IJ = -T_II sum_M L_IM T_MJ on tf32 mma, one warp per column J walking I = J+1 .. 3 (a column
//      needs only its own blocks: no block barrier between).
//   4b. beside those walks (a dependent chain on warps 0-2), warps 3-7 write QT = scale q 2^G,
//      KT = k 2^G (bf16), KD = k 2^(G_last - G) (fp16, shifted) to the chunk record.  Every exponent
//      here is <= 0.
//   5. Tb = T_inv diag(b) 2^-shift_t (fp16, |Tb'| < 2) goes to the record (its packed triangle image,
//      tri64_offset, staged over G, one TMA bulk store).  The walk forms VnT = (v^T - S KT^T) Tb^T itself, so
//      neither v nor W nor U is handled here.  fp16's 11-bit mantissa on T_inv is what keeps the state error
//      well under bf16's.
// Issue slots, not memory, bind outside phase 1: instructions cut in the prologue paid ~1:1 in time,
// in phases 2-5 ~0.5:1, in phase 1 nothing (perf-notes v24), so index math there is kept lean.
// Shared memory (D = 128): q, k 16-bit 2 x 17.4 KB, G fp32 34.8 KB (later the staged Tb), L fp32
// 17.4 KB, T_inv fp32 17.4 KB, staged MQK 5 KB (its packed triangle): 109.2 KB, two blocks per SM
// (113 KB allowed).
#pragma once

#include <cuda_fp16.h>

#include <type_traits>

#include "sm90/kda_common.cuh"
#include "sm90/kda_pair_tiles.h"
#include "sm90/kda_sw128.h"

namespace flashkda {
namespace sm90 {

template <int D>
struct PrepareSmem {
  // fp32 rows (G).  D + 8: a pitch of 8 banks, so the float2 reads of the L / MQK blocks (lanes g, t
  // of an mma fragment: rows g, column pairs 2t) are conflict-free (D + 4 had them 2-way).
  static constexpr int kLdF = D + 8;
  static constexpr int kLdH = D + 8;  // 16-bit rows (ldmatrix-friendly padding)
  // fp32 64 x 64 (L, T_inv): C + 4 keeps every row 16-byte aligned, so the diagonal substitution
  // reads its block's rows as float4 without touching the neighbouring block (written concurrently
  // by another warp in phase 3), and the mma A-fragment reads (rows g, column t) are conflict-free.
  static constexpr int kLdT = kChunk + 4;
  static constexpr int kQ = 0;                       // 16-bit q [C][kLdH]
  static constexpr int kK = kQ + kChunk * kLdH * 2;  // 16-bit k [C][kLdH]
  static constexpr int kG = kK + kChunk * kLdH * 2;  // fp32 G [C][kLdF]
  static constexpr int kL = kG + kChunk * kLdF * 4;  // fp32 L [C][kLdT]
  static constexpr int kB = kL + kChunk * kLdT * 4;  // fp32 b [C]
  static constexpr int kTot = kB + kChunk * 4;       // fp32 scan partial sums [4][D]
  // int-encoded maxima: (unused), |k|, |T_inv b|, |q_row|^2, |k_row|^2; then the shifts shift_m, shift_d
  static constexpr int kMax = kTot + 4 * D * 4;
  static constexpr int kEnd = kMax + 32;
  // T_inv in a region of its own, not over q and k: QT / KT / KD (phase 4b) read q, k and G while
  // warps 0-2 walk T_inv's columns.  The walks' scratch (16 x 16 a warp) lives in T_inv's upper
  // block (J, 3), which nothing else reads (Tb takes the lower blocks only).
  static constexpr int kTinvBytes = kChunk * kLdT * 4;
  static constexpr int kTi = kEnd;  // fp32 T_inv [C][kLdT]
  // MQK [C][C] fp16 staged as its packed record image (tri64_offset, kda_sw128.h) in a buffer of its
  // own (nothing is dead in phase 3), stored by one TMA bulk copy right after phase 3.
  static constexpr int kMqkSt = (kEnd + kTinvBytes + 15) / 16 * 16;
  static constexpr int kBytes = kMqkSt + kTri64Bytes;
  // The Tb [C][C] record tile is staged as its packed image over G (dead after phase 3) for one TMA
  // bulk store.
  static constexpr int kTbSt = kG;
  static_assert(kTbSt + kTri64Bytes <= kL, "staged Tb must fit over G");
  static_assert(kTbSt % 16 == 0, "bulk stores read 16-byte aligned shared memory");
  // Two blocks per SM: 228 KB of shared memory an SM, 1 KB of it reserved per block.
  static_assert(D != 128 || 2 * (kBytes + 1024) <= 228 * 1024, "chunk_prepare must fit two blocks per SM");
};

constexpr int kPrepareThreads = 256;

// threadIdx.x read afresh where it is used: the compiler computes the indices of a late phase
// derived from `tid` (or from warp and lane) early and keeps them live through phase 3, the register
// peak (Tb's mapping: +2 registers at D = 128); a volatile read cannot be hoisted.
__device__ inline int thread_index_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Device-side checks of index values (the host cannot read them without a sync).  Run by one
// block; a failure is recorded in the workspace error word and the state pass then writes nothing.
__device__ inline void validate_device_inputs(const PrefillArgs& a) {
  int bad = 0;
  if (a.cu_seqlens) {
    for (int64_t i = threadIdx.x; i <= a.N; i += blockDim.x) {
      const int64_t v = load_index(a.cu_seqlens, a.cu_int64, i);
      if (i == 0 && v != 0) bad = 1;
      if (i == a.N && v != a.T) bad = 1;
      if (i > 0 && v < load_index(a.cu_seqlens, a.cu_int64, i - 1)) bad = 1;
      if (v < 0 || v > a.T) bad = 1;
    }
  }
  if (bad) atomicExch(a.error_word, 1);
  if (a.state_indices) {
    for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x) {
      if (load_index(a.state_indices, a.idx_int64, i) >= a.pool_rows) atomicExch(a.error_word, 2);
    }
  }
  if (a.token_rows) {
    for (int64_t t = threadIdx.x; t < a.T; t += blockDim.x) {
      const int64_t r = load_index(a.token_rows, a.rows_int64, t);
      if (r < 0 || r >= a.num_rows) atomicExch(a.error_word, 3);
    }
  }
  if (a.ckpt_offsets) {  // 0 <= offset <= length, non-decreasing along a row
    for (int64_t e = threadIdx.x; e < static_cast<int64_t>(a.N) * a.n_ckpt; e += blockDim.x) {
      const int64_t n = e / a.n_ckpt, j = e % a.n_ckpt;
      const int64_t o = load_index(a.ckpt_offsets, a.ckpt_int64, e);
      const int64_t prev = j > 0 ? load_index(a.ckpt_offsets, a.ckpt_int64, e - 1) : 0;
      if (o < prev || o > sequence_span(a, n).len) atomicExch(a.error_word, 4);
    }
  }
}

// No two sequences on one pool row (they would race on it: DeviceError kStateSlotConflict; the state
// pass then writes nothing).  The N x N comparisons go in tiles of 256 x 256 sequences (ti <= tj,
// kda_pair_tiles.h), dealt over the head-0 blocks (`block` of `num_blocks`) from block 1 on (block 0
// validates the rest): a tile is 512 index loads and 256 broadcast shared-memory compares a thread, so the
// check stays a few microseconds of a few blocks for any N (one block scanning all pairs would take
// milliseconds at N = 8192, and N blocks loading all N indices each is O(N^2) L2 traffic).  `keys`: 256 int64
// of shared memory, free again when it returns.  Block-uniform (barriers inside).
__device__ inline void check_state_rows_distinct(const PrefillArgs& a, uint32_t block, uint32_t num_blocks,
                                                 int64_t* keys) {
  constexpr int kTile = kPrepareThreads;
  const int64_t nt = (static_cast<int64_t>(a.N) + kTile - 1) / kTile;
  const int64_t tiles = pair_tile_count(nt);
  const int64_t blocks = num_blocks > 1 ? num_blocks - 1 : 1;
  const int64_t first_tile = num_blocks > 1 ? static_cast<int64_t>(block) - 1 : 0;
  if (first_tile < 0) return;  // block 0 of a multi-block grid
  for (int64_t tl = first_tile; tl < tiles; tl += blocks) {
    int64_t ti, tj;
    if (!upper_pair_tile(tl, nt, &ti, &tj)) continue;  // block-uniform: the pair's other tile compares it
    const int64_t i = ti * kTile + threadIdx.x, j = tj * kTile + threadIdx.x;
    const int64_t mine = i < a.N ? load_index(a.state_indices, a.idx_int64, i) : -1;
    __syncthreads();  // the previous tile's reads of keys are done
    keys[threadIdx.x] = j < a.N ? load_index(a.state_indices, a.idx_int64, j) : -1;
    __syncthreads();
    bool dup = false;
    if (mine >= 0) {  // negative: padding, touches no row
      for (int c = 0; c < kTile; ++c)
        dup |= keys[c] == mine && (tj != ti || c != static_cast<int>(threadIdx.x));
    }
    if (dup) atomicExch(a.error_word, static_cast<int>(DeviceError::kStateSlotConflict));
  }
  __syncthreads();  // keys free for the caller
}

// Loads 8 consecutive elements (bf16) of a row as floats.
__device__ inline void load8_bf16(const bf16* p, bool vec, float (&x)[8]) {
  if (vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __bfloat162float(p[i]);
  }
}

__device__ inline void store8_bf16(bf16* p, const float (&x)[8]) {
  uint4 u;
  u.x = pack_bf16(x[0], x[1]);
  u.y = pack_bf16(x[2], x[3]);
  u.z = pack_bf16(x[4], x[5]);
  u.w = pack_bf16(x[6], x[7]);
  *reinterpret_cast<uint4*>(p) = u;
}

// 8 floats as 8 fp16 (round to nearest), for one 16-byte store.
__device__ inline uint4 pack8_f16(const float (&x)[8]) {
  return make_uint4(pack_f16(x[0], x[1]), pack_f16(x[2], x[3]), pack_f16(x[4], x[5]), pack_f16(x[6], x[7]));
}

// 8 consecutive fp32 values (16-byte aligned) as two 16-byte loads.
__device__ inline void load8_f32(const float* p, float (&x)[8]) {
  const float4 u0 = *reinterpret_cast<const float4*>(p), u1 = *reinterpret_cast<const float4*>(p + 4);
  x[0] = u0.x, x[1] = u0.y, x[2] = u0.z, x[3] = u0.w, x[4] = u1.x, x[5] = u1.y, x[6] = u1.z, x[7] = u1.w;
}

// A pair of q or k elements (one 32-bit register: low half first) as floats: fp16 (l2-normalised) or
// bf16 (raw), chosen per call.
__device__ inline float2 qk2_float2(uint32_t u, bool fp16) {
  if (fp16) return __half22float2(*reinterpret_cast<const __half2*>(&u));
  // bf16 is the high half of an fp32: one shift or mask per element (the intrinsic's high half took a
  // PRMT and a shift)
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

// q and k in shared memory: two consecutive elements.
__device__ inline float2 load_qk2(const uint16_t* p, bool fp16) {
  return qk2_float2(*reinterpret_cast<const uint32_t*>(p), fp16);
}

__device__ inline void load8_qk(const uint16_t* p, bool fp16, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = qk2_float2(w[i], fp16);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// The 16-bit record element (r, col) of a C-row tile (KT, QT, KD: ChunkRecord's SW128 images).
__device__ inline bf16* record_element(bf16* tile, int r, int col) {
  return tile + sw128_element<kChunk>(r, col);
}

// b of the lane's two fragment rows 16 I + g, 16 I + g + 8, for store_lk_*: read once by the
// caller (a warp's two blocks of one row block share them), rather than per fragment element, which
// the compiler cannot hoist past the L stores (sL may alias sB for all it knows).
__device__ inline float2 lk_row_b(const float* sB, int I, int lane) {
  const int r = 16 * I + (lane >> 2);
  return make_float2(sB[r], sB[r + 8]);
}

// The lane's fragment pairs of block (I, J), J <= I, in MQK's staged packed image (tri64_element): pair
// (nt, hh) is the element (16 I + g + 8 hh, 16 J + 8 nt + 2 t).  Column +8 is the next core matrix of the
// K step (128 bytes on) and row +8 the next row group (256 bytes on): one address a block for the four
// pairs.  A warp's store of one pair covers one core matrix (rows g, 16-byte rows): conflict-free.
// test_layouts.cpp (SharedMemoryLayout.MqkFragmentPairs) checks both properties.
struct MqkPairs {
  uint32_t* p0;                                                 // (nt = 0, hh = 0)
  static constexpr int kColStep = 128 / 4, kRowStep = 256 / 4;  // in 32-bit words
  __device__ MqkPairs(bf16* mqk, int I, int J, int lane) {
    p0 = reinterpret_cast<uint32_t*>(mqk + tri64_element(16 * I + (lane >> 2), 16 * J + 2 * (lane & 3)));
  }
  __device__ uint32_t* at(int nt, int hh) const { return p0 + nt * kColStep + hh * kRowStep; }
};
static_assert(kChunk == 64, "MqkPairs: MQK is a 64 x 64 packed triangle");

// Writes off-diagonal block (I, J), J < I, of L (fp32, smem) and MQK (fp16, its staged record image;
// `scale` includes MQK's shift) from mma accumulators (2 n-tiles).  `b`: lk_row_b(sB, I, lane).  Every
// column of the block is left of every row, so no element is masked (the masks of the general form,
// which the compiler cannot drop for a runtime J < I, were ~20 instructions a block).
template <int D>
__device__ inline void store_lk_offdiag(const float (&accL)[2][4], const float (&accM)[2][4], float2 b,
                                        float* sL, bf16* mqk, float scale, int I, int J, int lane) {
  constexpr int ldt = PrepareSmem<D>::kLdT;
  static_assert(ldt % 2 == 0, "a lane's L pair (even column) is one 8-byte store");
  const int g = lane >> 2, t = lane & 3;
  float* l = sL + (16 * I + g) * ldt + 16 * J + 2 * t;
  const MqkPairs m(mqk, I, J, lane);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float bi = hh ? b.y : b.x;  // sB[i]
      *reinterpret_cast<float2*>(l + 8 * hh * ldt + 8 * nt) =
          make_float2(bi * accL[nt][2 * hh], bi * accL[nt][2 * hh + 1]);
      *m.at(nt, hh) = pack_f16(scale * accM[nt][2 * hh], scale * accM[nt][2 * hh + 1]);
    }
  }
}

// The same for diagonal block (I, I): L strictly lower, MQK lower with its diagonal.  Row g + 8 hh against
// column 8 nt + 2 t (+1): the n-tile-1 pairs of rows 0-7 are above the diagonal (zeros, no products), the
// n-tile-0 pairs of rows 8-15 below it (unmasked), and the other two compare 2 t (+1) with g alike, so
// three predicates serve the block.  The values are those of the general masked form (a masked element
// is 0.f there too).
template <int D>
__device__ inline void store_lk_diag(const float (&accL)[2][4], const float (&accM)[2][4], float2 b,
                                     float* sL, bf16* mqk, float scale, int I, int lane) {
  constexpr int ldt = PrepareSmem<D>::kLdT;
  const int g = lane >> 2, t = lane & 3;
  float* l = sL + (16 * I + g) * ldt + 16 * I + 2 * t;
  const MqkPairs m(mqk, I, I, lane);
  const bool lt0 = 2 * t < g, lt1 = 2 * t + 1 < g, le0 = 2 * t <= g;  // j < i, j + 1 < i, j <= i
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float* lp = l + 8 * hh * ldt + 8 * nt;
      if (nt > hh) {  // above the diagonal
        *reinterpret_cast<float2*>(lp) = make_float2(0.f, 0.f);
        *m.at(nt, hh) = 0u;  // pack_f16(0.f, 0.f)
        continue;
      }
      const float bi = hh ? b.y : b.x;  // sB[i]
      const float l0 = bi * accL[nt][2 * hh], l1 = bi * accL[nt][2 * hh + 1];
      const float m0 = scale * accM[nt][2 * hh], m1 = scale * accM[nt][2 * hh + 1];
      if (nt < hh) {  // below the diagonal
        *reinterpret_cast<float2*>(lp) = make_float2(l0, l1);
        *m.at(nt, hh) = pack_f16(m0, m1);
      } else {
        *reinterpret_cast<float2*>(lp) = make_float2(lt0 ? l0 : 0.f, lt1 ? l1 : 0.f);
        *m.at(nt, hh) = pack_f16(le0 ? m0 : 0.f, lt0 ? m1 : 0.f);  // j + 1 <= i: j < i
      }
    }
  }
}

// Diagonal block I on tf32 tensor cores, factorised around its row 7 (factors up to 2^half-span).
// kF16: q and k are held as fp16 (l2-normalised) rather than raw bf16 (a template argument so that
// the loop carries one conversion path, not both predicated).
template <int D, bool kF16>
__device__ inline void lk_block_diag_tf32(const uint16_t* sQ, const uint16_t* sK, const float* sG,
                                          const float* sB, float* sL, bf16* mqk, float scale, int I,
                                          int lane) {
  constexpr int ldf = PrepareSmem<D>::kLdF, ldh = PrepareSmem<D>::kLdH;
  const int g = lane >> 2, t = lane & 3;
  float accL[2][4] = {}, accM[2][4] = {};
  // The k index of an m16n8k8 step is permuted (any permutation applied to both operands leaves the
  // product unchanged): lane t's k = t and t + 4 are the adjacent columns 8s + 2t, 8s + 2t + 1, so each
  // operand pair is one 8-byte G read and one 16-bit q / k pair.  Those pairs (rows g and g + 8 of the
  // block, which are A's rows and B's n columns alike) come for two k steps at once by one ldmatrix.x4
  // a tensor instead of eight 4-byte LDS: matrices (rows 0-7 | 8-15) x (columns 16sp | 16sp + 8), so
  // register 2u + h holds row g + 8h, columns 16sp + 8u + 2t, +1 (step 2sp + u; lane rows
  // 16I + (lane & 15), columns 8 (lane >> 4)).
  const int lane_off = (16 * I + (lane & 15)) * ldh + 8 * (lane >> 4);
  const uint32_t k_lane = smem_addr(sK + lane_off), q_lane = smem_addr(sQ + lane_off);
  // G of the lane's rows g (g + 8 at + 8 ldf) and of the reference row, at its column pair 2t of the
  // step: pointers advanced once a step pair (indexing by 16 sp + 8 u recomputed both row addresses in
  // every iteration).
  const float* grow = sG + (16 * I + g) * ldf + 2 * t;
  const float* gref = sG + (16 * I + 7) * ldf + 2 * t;
#pragma unroll 2
  for (int sp = 0; sp < D / 16; ++sp, grow += 16, gref += 16) {
    uint32_t kr[4], qr[4];
    ldmatrix_x4(kr, k_lane + 32 * sp);  // 16 columns (32 bytes) a step pair
    ldmatrix_x4(qr, q_lane + 32 * sp);
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // columns c0 = 8 (2 sp + u) + 2t, c0 + 1
      const float2 gr = *reinterpret_cast<const float2*>(gref + 8 * u);
      uint32_t ak[4], aq[4], bk[2][2];
      // a[hr]: (g + 8 hr, k = t) -> column c0; a[2 + hr]: k = t + 4 -> c0 + 1.  Row g + 8 hr is also B's n
      // column g of n-tile hr (b0: k = t -> c0, b1: k = t + 4 -> c0 + 1), whose factor 2^(G_ref - G_row) is
      // taken as 2^-(G_row - G_ref): the same bits (round-to-nearest is sign-symmetric, and 2^-0 = 2^+0), the
      // negation an operand modifier of MUFU.EX2, so one FADD an element instead of two.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float2 gg = *reinterpret_cast<const float2*>(grow + 8 * hr * ldf + 8 * u);
        const float d0 = gg.x - gr.x, d1 = gg.y - gr.y;
        const float e0 = fast_exp2(d0), e1 = fast_exp2(d1);
        const float2 kk = qk2_float2(kr[2 * u + hr], kF16), qq = qk2_float2(qr[2 * u + hr], kF16);
        ak[hr] = tf32_operand(kk.x * e0);
        ak[2 + hr] = tf32_operand(kk.y * e1);
        aq[hr] = tf32_operand(qq.x * e0);
        aq[2 + hr] = tf32_operand(qq.y * e1);
        bk[hr][0] = tf32_operand(kk.x * fast_exp2(-d0));
        bk[hr][1] = tf32_operand(kk.y * fast_exp2(-d1));
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_tf32(accL[nt], ak, bk[nt][0], bk[nt][1]);
        mma_tf32(accM[nt], aq, bk[nt][0], bk[nt][1]);
      }
    }
  }
  store_lk_diag<D>(accL, accM, lk_row_b(sB, I, lane), sL, mqk, scale, I, lane);
}

// An operand pair x 2^e of an off-diagonal L / MQK factor (both factors are <= 1).  kF16
// (l2-normalised q and k, held as fp16 in smem): the decay pair is rounded to half2 once and each
// operand pair is one HMUL2, a third of the instructions of converting to fp32, scaling and
// rounding to bf16; fp16's 11-bit mantissa is finer than bf16's 8 (terms under fp16's 2^-24 flush,
// far below the block's O(1) entries).  Raw (unnormalised) q and k need bf16's range.
template <bool kF16>
struct DecayPair;
// apply() takes the operand pair as loaded (one ldmatrix register: low half first).
template <>
struct DecayPair<true> {
  __half2 e;
  __device__ DecayPair(float e0, float e1) : e(__floats2half2_rn(e0, e1)) {}
  __device__ uint32_t apply(uint32_t u) const {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&u), e);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
};
template <>
struct DecayPair<false> {
  float e0, e1;
  __device__ DecayPair(float x0, float x1) : e0(x0), e1(x1) {}
  __device__ uint32_t apply(uint32_t u) const {
    const float2 x = qk2_float2(u, false);
    return pack_bf16(x.x * e0, x.y * e1);
  }
};

template <bool kF16>
__device__ inline void mma_factor(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    mma_f16(d, a, b0, b1);
  } else {
    mma_bf16(d, a, b0, b1);
  }
}

// Off-diagonal blocks (I, J0) and, when kTwo, (I, J0 + 1) of L and MQK on tensor cores, factorised
// around the row before block I (ref = 16 I - 1): A = k_i 2^(G_i - G_ref) (and q), B = k_j
// 2^(G_ref - G_j), both <= 1 for any gate.  A depends on I alone, so a warp that owns two blocks of
// a row block forms each A fragment once and uses it for both (kTwo).  The q / k fragments come by
// ldmatrix.x4 (one a tensor for A, one a block for B) rather than 4-byte LDS each; the decay factors are
// applied to the loaded registers exactly as before.  kTwo is a template argument: as a runtime flag
// its test in every k step cost a branch, two WARPSYNC and a NOP a step (~100 instructions a chunk-head).
template <int D, bool kF16, bool kTwo>
__device__ inline void lk_row_blocks(const uint16_t* sQ, const uint16_t* sK, const float* sG, const float* sB,
                                     float* sL, bf16* mqk, float scale, int I, int J0, int lane) {
  constexpr int ldf = PrepareSmem<D>::kLdF, ldh = PrepareSmem<D>::kLdH;
  const int g = lane >> 2, t = lane & 3;
  float accL[2][2][4] = {}, accM[2][2][4] = {};
  // A (rows 16I.., k columns 16s..): matrices (rows 0-7 | 8-15) x (columns 0-7 | 8-15) in the order
  // a0 .. a3, lane rows 16I + (lane & 15), columns 8 (lane >> 4).
  const int a_off = (16 * I + (lane & 15)) * ldh + 8 * (lane >> 4);
  const uint32_t k_a_lane = smem_addr(sK + a_off), q_a_lane = smem_addr(sQ + a_off);
  // B of block J (B[k][n] = k_J[n][k], k rows of the block are its n columns): matrices (n 0-7, k 0-7),
  // (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = bk[0][0], bk[0][1], bk[1][0], bk[1][1]; lane
  // rows 16 J0 + (lane & 7) + 8 (lane >> 4), columns 8 ((lane >> 3) & 1).
  const uint32_t k_b_lane =
      smem_addr(sK + (16 * J0 + (lane & 7) + 8 * (lane >> 4)) * ldh + 8 * ((lane >> 3) & 1));
  // G at the lane's column pair 2t of the step: the reference row, A's rows 16 I + g (+ 8 ldf: g + 8) and
  // B's n columns 16 J0 + g (+ 8 ldf per n-tile, + 16 ldf for block J0 + 1); pointers advanced once a
  // step (indexing by row and 16 s recomputed the three row addresses in every iteration).
  const float* gref = sG + (16 * I - 1) * ldf + 2 * t;
  const float* ga = sG + (16 * I + g) * ldf + 2 * t;
  const float* gb = sG + (16 * J0 + g) * ldf + 2 * t;
#pragma unroll 2
  for (int s = 0; s < D / 16; ++s, gref += 16, ga += 16, gb += 16) {
    uint32_t ak[4], aq[4];
    // G of the reference row at the step's two column pairs, read once for the A and every B fragment.
    const float2 grs[2] = {*reinterpret_cast<const float2*>(gref),
                           *reinterpret_cast<const float2*>(gref + 8)};
    ldmatrix_x4(ak, k_a_lane + 32 * s);  // 16 columns (32 bytes) a k step
    ldmatrix_x4(aq, q_a_lane + 32 * s);
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // a0: (g, 2t) a1: (g+8, 2t) a2: (g, 2t+8) a3: (g+8, 2t+8)
      const float2 gg = *reinterpret_cast<const float2*>(ga + (h & 1) * 8 * ldf + (h >> 1) * 8);
      const float2 gr = grs[h >> 1];
      const DecayPair<kF16> e(fast_exp2(gg.x - gr.x), fast_exp2(gg.y - gr.y));
      ak[h] = e.apply(ak[h]);
      aq[h] = e.apply(aq[h]);
    }
#pragma unroll
    for (int jb = 0; jb < 2; ++jb) {
      if (jb == 1 && !kTwo) break;
      uint32_t kj[4];  // block J0 + jb's k pairs, before the decay
      ldmatrix_x4(kj, k_b_lane + (16 * jb * ldh + 16 * s) * 2);
      uint32_t bk[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // b0: k rows 2t, 2t+1; b1: 2t+8, 2t+9; n col g
          const float2 gg = *reinterpret_cast<const float2*>(gb + (16 * jb + 8 * nt) * ldf + 8 * h);
          const float2 gr = grs[h];
          bk[nt][h] = DecayPair<kF16>(fast_exp2(gr.x - gg.x), fast_exp2(gr.y - gg.y)).apply(kj[2 * nt + h]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_factor<kF16>(accL[jb][nt], ak, bk[nt][0], bk[nt][1]);
        mma_factor<kF16>(accM[jb][nt], aq, bk[nt][0], bk[nt][1]);
      }
    }
  }
  const float2 b = lk_row_b(sB, I, lane);  // one read for both blocks
  store_lk_offdiag<D>(accL[0], accM[0], b, sL, mqk, scale, I, J0, lane);
  if (kTwo) store_lk_offdiag<D>(accL[1], accM[1], b, sL, mqk, scale, I, J0 + 1, lane);
}

// Diagonal block I summed pairwise with 2^(G_i - G_j) <= 1: safe for any decay (slow path).
template <int D>
__device__ inline void lk_block_pairwise(const uint16_t* sQ, const uint16_t* sK, bool fp16, const float* sG,
                                         const float* sB, float* sL, bf16* mqk, float scale, int I,
                                         int lane) {
  constexpr int ldf = PrepareSmem<D>::kLdF, ldh = PrepareSmem<D>::kLdH;
  for (int ii = 0; ii < 16; ++ii) {
    const int i = 16 * I + ii;
    for (int jj = 0; jj < 16; ++jj) {
      const int j = 16 * I + jj;
      float pl = 0.f, pm = 0.f;
      if (jj <= ii) {
        for (int c = 2 * lane; c < D; c += 64) {
          const float2 gi = *reinterpret_cast<const float2*>(sG + i * ldf + c);
          const float2 gj = *reinterpret_cast<const float2*>(sG + j * ldf + c);
          const float2 ki = load_qk2(sK + i * ldh + c, fp16), kj = load_qk2(sK + j * ldh + c, fp16);
          const float2 qi = load_qk2(sQ + i * ldh + c, fp16);
          const float e0 = fast_exp2(gi.x - gj.x), e1 = fast_exp2(gi.y - gj.y);
          pl += ki.x * kj.x * e0 + ki.y * kj.y * e1;
          pm += qi.x * kj.x * e0 + qi.y * kj.y * e1;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          pl += __shfl_xor_sync(0xffffffffu, pl, o);
          pm += __shfl_xor_sync(0xffffffffu, pm, o);
        }
      }
      if (lane == 0) {
        sL[i * PrepareSmem<D>::kLdT + j] = (jj < ii) ? sB[i] * pl : 0.f;
        *reinterpret_cast<__half*>(mqk + tri64_element(i, j)) =
            __float2half_rn((jj <= ii) ? scale * pm : 0.f);
      }
    }
  }
}

// v - l t when i >= cc, else v unchanged: one step of tinv_diag_block's row i of column cc, predicated
// rather than selected.  The fma is the one `v -= l * t` contracts to under this build's flags (fmad on,
// no ftz: FFMA, not FFMA.FTZ).  Rows i < cc keep their initial +0 (i != cc), which the select
// `(i >= cc) ? v : 0.f` gave them, also for a non-finite L (the select discarded the NaN of inf * 0);
// rows i >= cc run the same fma chain, so the values are those of the select form.  ptxas merges the
// identical setp of a row into one compare, where the select took an FSEL a row (-56 a chunk-head).
__device__ inline float fms_if_ge(float v, float l, float t, int i, int cc) {
  asm("{\n .reg .pred p;\n setp.ge.s32 p, %1, %2;\n @p fma.rn.f32 %0, %3, %4, %0;\n}"
      : "+f"(v)
      : "r"(i), "r"(cc), "f"(-l), "f"(t));
  return v;
}

// Diagonal block I of T_inv = (I + L)^-1 by forward substitution, one column per lane (lanes 0-15),
// into registers: run by the warp that wrote L_II, right after it (L_II is warp-private until the
// block barrier), so the substitution overlaps the off-diagonal L blocks of the other warps.  The
// caller stores tcol into T_inv's own buffer right away.
template <int D>
__device__ inline void tinv_diag_block(const float* sL, float (&tcol)[16], int I, int cc) {
  constexpr int ldt = PrepareSmem<D>::kLdT;
  static_assert(ldt % 4 == 0, "rows of L must be 16-byte aligned");
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    // Row i of L_II, columns 0 .. i-1, as aligned float4 (explicit, so that no vector read reaches into
    // block (I, I-1), which another warp may be writing).
    float l[16];
    const float4* row = reinterpret_cast<const float4*>(sL + (16 * I + i) * ldt + 16 * I);
#pragma unroll
    for (int q = 0; 4 * q < i; ++q) {
      const float4 x = row[q];
      l[4 * q] = x.x, l[4 * q + 1] = x.y, l[4 * q + 2] = x.z, l[4 * q + 3] = x.w;
    }
    float v = (i == cc) ? 1.f : 0.f;  // rows above the column's diagonal (i < cc) stay 0
#pragma unroll
    for (int j = 0; j < i; ++j) v = fms_if_ge(v, l[j], tcol[j], i, cc);
    tcol[i] = v;
  }
}

// Off-diagonal block (I, J) = (J + d, J) of T_inv: X = sum_{M=J}^{I-1} L_IM T_MJ, then T_IJ = -T_II X, both
// on tf32 tensor cores with fp32 accumulation.  tf32 keeps fp16's 10-bit mantissa, the precision T_inv
// diag(b) is stored with (Tb, fp16) anyway; the fp32 range keeps any L finite.  X goes through
// the warp's scratch `xs` (pitch kLdT: T_inv's upper block (J, 3)) to turn from accumulator into operand
// layout.  One warp walks a column J (I = J+1
// .. 3): each T_MJ it reads is the diagonal (stored before the barrier) or one it wrote itself, so the chain
// needs no block barrier between its steps.
template <int D, int d>
__device__ inline void tinv_block(const float* sL, float* sTi, float* xs, int J, int lane) {
  constexpr int ldt = PrepareSmem<D>::kLdT;
  const int g = lane >> 2, t = lane & 3, I = J + d;
  float x[2][4] = {};
#pragma unroll
  for (int s = 0; s < 2 * d; ++s) {  // k-steps of 8 over columns 16J .. 16I-1 of L's row block I
    const int k0 = 16 * J + 8 * s;
    const float* lr = sL + (16 * I + g) * ldt + k0 + t;
    const uint32_t af[4] = {tf32_operand(lr[0]), tf32_operand(lr[8 * ldt]), tf32_operand(lr[4]),
                            tf32_operand(lr[8 * ldt + 4])};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float* tc = sTi + (k0 + t) * ldt + 16 * J + 8 * nt + g;
      mma_tf32(x[nt], af, tf32_operand(tc[0]), tf32_operand(tc[4 * ldt]));
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    xs[g * ldt + 8 * nt + 2 * t] = x[nt][0];
    xs[g * ldt + 8 * nt + 2 * t + 1] = x[nt][1];
    xs[(g + 8) * ldt + 8 * nt + 2 * t] = x[nt][2];
    xs[(g + 8) * ldt + 8 * nt + 2 * t + 1] = x[nt][3];
  }
  __syncwarp();
  float y[2][4] = {};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const float* tr = sTi + (16 * I + g) * ldt + 16 * I + 8 * s + t;
    const uint32_t af[4] = {tf32_operand(tr[0]), tf32_operand(tr[8 * ldt]), tf32_operand(tr[4]),
                            tf32_operand(tr[8 * ldt + 4])};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float* xc = xs + (8 * s + t) * ldt + 8 * nt + g;
      mma_tf32(y[nt], af, tf32_operand(xc[0]), tf32_operand(xc[4 * ldt]));
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float* o = sTi + (16 * I + g) * ldt + 16 * J + 8 * nt + 2 * t;
    o[0] = -y[nt][0];
    o[1] = -y[nt][1];
    o[8 * ldt] = -y[nt][2];
    o[8 * ldt + 1] = -y[nt][3];
  }
  __syncwarp();  // T_IJ visible to the warp's next block; xs free again
}

// cu_seqlens entry k after entry i, clamped into [0, T] exactly as sequence_span clamps it.  T < 2^31
// (checked on the host, check_cuda_sizes), so the clamped value is an int: one unsigned 64-bit compare
// instead of two signed clamps with branches.  One address, i times the entry size, serves both entry
// types (load_index computes one for each).
__device__ inline int clamped_cu(const PrefillArgs& a, uint32_t i, int k = 0) {
  // mul.wide.u32 spelled out: from C++ the 32 x 32 -> 64 product became a 64-bit one (extra adds of 0)
  uint64_t off;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(off) : "r"(i), "r"(a.cu_int64 ? 8u : 4u));
  const char* p = static_cast<const char*>(a.cu_seqlens) + off;
  const int64_t v = a.cu_int64 ? reinterpret_cast<const int64_t*>(p)[k]
                               : static_cast<int64_t>(reinterpret_cast<const int32_t*>(p)[k]);
  return static_cast<uint64_t>(v) <= static_cast<uint64_t>(a.T) ? static_cast<int>(v) : (v < 0 ? 0 : a.T);
}

// The chunk of a block: slot s holds chunk s - slot0 of sequence n (sequence_span's slot0), in 32
// bits: B, T and N are below 2^31 (check_cuda_sizes) and the grid's slots too (a grid dimension), so
// every token index, slot and length below fits an unsigned int and no 64-bit division is needed
// (values clamped into [0, T] are non-negative, so / kChunk is a shift).
struct PrepareChunk {
  uint32_t n;      // sequence
  uint32_t batch;  // batch row of the tokens
  uint32_t tok0;   // first token of the chunk (row-local)
  int rows;        // tokens of the chunk, 1..kChunk
};

// The chunk of a slot, by the whole block: the sequence of a slot is the number of sequences whose
// first slot is <= it, minus one (first slots increase for valid cu_seqlens; invalid ones are flagged by
// validate_device_inputs and the state pass then writes nothing).  One parallel round of loads
// instead of a chain of log2(N) dependent ones at every block's start.  Returns false for an unused
// slot.  Block-uniform (barriers inside).
__device__ inline bool slot_to_chunk_block(const PrefillArgs& a, uint32_t slot, PrepareChunk* out) {
  uint32_t n, batch, bos, len, slot0;
  if (!a.cu_seqlens) {
    const uint32_t per = (static_cast<uint32_t>(a.T) + kChunk - 1) / kChunk;
    if (per == 0) return false;
    n = batch = slot / per;
    if (n >= static_cast<uint32_t>(a.B)) return false;
    bos = 0;
    len = a.T;
    slot0 = n * per;
  } else {
    const uint32_t N = a.N > 0 ? a.N : 0;
    uint32_t count = 0;
#pragma unroll 1
    for (uint32_t base = 0; base < N; base += kPrepareThreads) {
      const uint32_t i = base + threadIdx.x;
      // floor(cu / C) + i < 2^32: no wrap in the compare
      count += __syncthreads_count(i < N && (static_cast<uint32_t>(clamped_cu(a, i)) / kChunk) + i <= slot);
    }
    if (count == 0) return false;
    n = count - 1;
    const int b0 = clamped_cu(a, n), e0 = clamped_cu(a, n, 1);
    batch = 0;
    bos = b0;
    len = (e0 < b0 ? b0 : e0) - b0;  // = sequence_span's clamp of cu[n + 1] into [b0, T]
    slot0 = static_cast<uint32_t>(b0) / kChunk + n;
  }
  // c = slot - slot0 in [0, ceil(len / C)) (len + C - 1 < 2^32)
  if (slot < slot0) return false;
  const uint32_t c = slot - slot0;
  if (c >= (len + kChunk - 1) / kChunk) return false;
  out->n = n;
  out->batch = batch;
  out->tok0 = bos + c * kChunk;
  out->rows = len - c * kChunk < kChunk ? static_cast<int>(len - c * kChunk) : kChunk;
  return true;
}

template <int D>
__global__ void __launch_bounds__(kPrepareThreads, 2) chunk_prepare_kernel(const PrefillArgs a) {
  static_assert(D == 64 || D == 128, "head dim");
  using SM = PrepareSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem + SM::kQ);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem + SM::kK);
  float* sG = reinterpret_cast<float*>(smem + SM::kG);
  int* sMax = reinterpret_cast<int*>(smem + SM::kMax);
  float* sL = reinterpret_cast<float*>(smem + SM::kL);
  float* sB = reinterpret_cast<float*>(smem + SM::kB);
  float* sTot = reinterpret_cast<float*>(smem + SM::kTot);
  float* sTi = reinterpret_cast<float*>(smem + SM::kTi);
  constexpr int ldf = SM::kLdF, ldh = SM::kLdH, ldt = SM::kLdT;
  constexpr int TPR = D / 8;                  // threads per row in the row-parallel phases
  constexpr int RPP = kPrepareThreads / TPR;  // rows per pass
  constexpr int PASSES = kChunk / RPP;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // A walk launched programmatically after this grid (launch_recurrence) may be scheduled once every
  // block here has started; it waits for this grid's completion (griddepcontrol.wait) before it reads
  // a record or the error word.  No effect on a plain launch.
  pdl_launch_dependents();
  // Block (h, y, z) is the r-th block of head h (kda_prepare_order.h); Y Z may exceed the slots by up to
  // Y - 1 blocks, which have nothing to do.
  const int h = blockIdx.x;
  const uint32_t r = blockIdx.y + gridDim.y * blockIdx.z;
  const uint32_t num_slots = static_cast<uint32_t>(a.num_slots);
  if (r >= num_slots) return;
  if (r == 0 && h == 0) validate_device_inputs(a);
  if (a.state_indices && h == 0)
    check_state_rows_distinct(a, r, num_slots, reinterpret_cast<int64_t*>(smem + SM::kQ));

  // The block's slot: head h's blocks take their slots so that every sequence's first chunks are
  // prepared last, their records still in L2 when the walk starts (kda_prepare_order.h).
  const uint32_t slot = prepare_cell_slot(num_slots - 1 - r, a.prep_order);
  PrepareChunk ch;
  if (!slot_to_chunk_block(a, slot, &ch)) return;
  // A padded sequence (negative pool row) needs no record: the walk touches neither its state nor its
  // records.  Only the index's sign matters, so one 32-bit load (the value, or an int64's high word)
  // is issued here and tested after phase 1: tested here, with the int32 value widened right after its
  // load, the round trip preceded every block's row copies (pool calls +0.3-0.7%, perf-notes v27).
  // The asm keeps the load in front of the staging copies; nothing global is written before the test.
  int pool_sign_word = 0;
  if (a.state_indices) {
    const char* p = static_cast<const char*>(a.state_indices) +
                    (a.idx_int64 ? 8 * static_cast<uint64_t>(ch.n) + 4 : 4 * static_cast<uint64_t>(ch.n));
    asm volatile("ld.global.b32 %0, [%1];" : "=r"(pool_sign_word) : "l"(p));
  }
  // Unsigned 32-bit batch row and tokens (see PrepareChunk): their products with the 64-bit strides
  // below are one wide multiply-add and one multiply-add each, not a full 64 x 64 product.
  const int64_t batch = ch.batch, tok0 = ch.tok0;
  const int rows = ch.rows;
  const float scale = a.scale;
  const bool qk16 = a.l2norm != 0;  // fp16 q/k in smem when normalised, raw bf16 otherwise
  char* rec = a.records + (static_cast<int64_t>(slot) * a.H + h) * ChunkRecord<D>::kBytes;
  const int c8 = (tid % TPR) * 8, rbase = tid / TPR;
  if (tid < 8) sMax[tid] = 0;  // ordered before the atomics by the first __syncthreads
  float kmax = 0.f, qn2max = 0.f, kn2max = 0.f;

  // ---- 1. load and preprocess -------------------------------------------------------------------
  // The chunk's raw q, k and g rows are first staged in shared memory: q and k in their final
  // buffers, bf16 g over L (dead until phase 3), fp32 g straight into G.  Each thread stages exactly
  // the 16-byte segments it preprocesses afterwards, so no barrier is needed in between.  When every
  // row is 16-byte aligned (the common case) the staging is cp.async, one round trip for the whole
  // chunk; otherwise a per-element copy loop (kept small and not unrolled: code size matters, the
  // kernel is sensitive to instruction-cache misses).
  const bool gated = a.gate_mode != kGatePrecomputed;
  const bool staged = a.vec_q && a.vec_k && a.vec_g;             // v is read by the walk only
  uint16_t* sGraw = reinterpret_cast<uint16_t*>(smem + SM::kL);  // bf16 g staging, pitch D
  static_assert(kChunk * D * 2 <= kChunk * PrepareSmem<D>::kLdT * 4, "bf16 g staging must fit over L");
  // Per-row beta as raw bits and the head's gate parameters are issued first, so that their round
  // trip overlaps the staging below (issued after it, exp(A_log) waited for its load on its own).
  // Rows past the end load the last row (never used) so that the loads carry no branch: a load
  // inside a per-pass branch made each pass wait for its own round trip.
  uint32_t bbits[PASSES];
  {
    // One byte address a pass for both element types (a 2- or 4-byte load from it).  Without a row
    // map the chunk's rows are consecutive tokens: the address is the first row's plus the 32-bit row
    // index times the byte stride, one wide multiply-add and one multiply-add.  Each case keeps its
    // own loads (and brow0 is opaque) so that the compiler does not fold the two back into one 64-bit
    // (tok0 + r) product a pass.
    const bool bf32 = a.beta_fp32 != 0;
    const int bsz = bf32 ? 4 : 2;
    const char* bbase = static_cast<const char*>(a.beta) + (batch * a.beta_sb + h) * bsz;
    const int64_t bst = a.beta_st * bsz;
    // bf16 bits in the high half are the same value as fp32
    auto load_beta = [&](const char* p) -> uint32_t {
      return bf32 ? *reinterpret_cast<const uint32_t*>(p) : *reinterpret_cast<const uint16_t*>(p);
    };
    if (a.token_rows == nullptr) {
      const char* brow0 = bbase + tok0 * bst;
      asm("" : "+l"(brow0));  // opaque: else brow0 + r bst is re-associated into a 64-bit (tok0 + r) bst
      __builtin_assume(__isGlobal(brow0));  // still a.beta's memory: global loads, not generic ones
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
        const uint32_t r = min(static_cast<uint32_t>(rbase + pass * RPP), static_cast<uint32_t>(rows - 1));
        bbits[pass] = load_beta(brow0 + static_cast<uint64_t>(r) * bst);
      }
    } else {
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
        const int r = rbase + pass * RPP;
        bbits[pass] = load_beta(bbase + mapped_row(a, tok0 + (r < rows ? r : rows - 1)) * bst);
      }
    }
  }
  const float A_log_h = gated ? a.A_log[h] : 0.f;
  // dt_bias of the thread's 8 columns (folded into the bounded gate's constant below).  Read only by
  // the bounded and softplus gates, so left unset for a precomputed gate (no zeroing, no branches).
  float gb[8];
  if (gated) {
#pragma unroll
    for (int i = 0; i < 8; ++i) gb[i] = a.dt_bias[h * D + c8 + i];
  }

  if (staged) {
    // Row offsets are hoisted: without a row map the thread's row advances by RPP tokens a pass, so
    // each tensor's address is one 64-bit add per pass (recomputing batch * sb + tok * st + h D
    // inside the per-pass branch cost ~100 instructions a pass).
    // h D + c8 and the row below as unsigned 32-bit values: zero- rather than sign-extended to 64 bits.
    const int gsz = a.g_fp32 ? 4 : 2;
    const int64_t col = static_cast<uint32_t>(h * D + c8);
    const char* qp = reinterpret_cast<const char*>(a.q + batch * a.q_sb + col);
    const char* kp = reinterpret_cast<const char*>(a.k + batch * a.k_sb + col);
    const char* gp = static_cast<const char*>(a.g) + (batch * a.g_sb + col) * gsz;
    const int64_t qst = a.q_st * 2, kst = a.k_st * 2, gst = a.g_st * gsz;
    // The thread's shared-memory destinations as 32-bit addresses, converted once (k's sits at a fixed
    // distance from q's), and each copy predicated rather than branched around: per-copy pointer
    // conversions re-read the CTA's shared window and the per-pass branches split the run of copies.
    // g's element type is a template argument (kG32), so that no copy of the other type issues
    // predicated off (together ~50 instructions a warp).
    const uint32_t sq = smem_addr(sQ + rbase * ldh + c8);
    const uint32_t sg = smem_addr(sG + rbase * ldf + c8), sgr = smem_addr(sGraw + rbase * D + c8);
    auto stage_row = [&](auto g32, int pass, int64_t tok, bool in) {
      constexpr bool kG32 = decltype(g32)::value;
      const char* g = gp + tok * gst;
      cp_async_16_shared_if(in, sq + pass * RPP * ldh * 2, qp + tok * qst);
      cp_async_16_shared_if(in, sq + (SM::kK - SM::kQ) + pass * RPP * ldh * 2, kp + tok * kst);
      if constexpr (kG32) {
        cp_async_16_shared_if(in, sg + pass * RPP * ldf * 4, g);
        cp_async_16_shared_if(in, sg + pass * RPP * ldf * 4 + 16, g + 16);
      } else {
        cp_async_16_shared_if(in, sgr + pass * RPP * D * 2, g);
      }
    };
    if (a.token_rows == nullptr) {
      const int64_t row0 = ch.tok0 + static_cast<uint32_t>(rbase);  // < T + RPP < 2^32
      qp += row0 * qst, kp += row0 * kst;
      gp += row0 * gst;
      auto passes = [&](auto g32) {
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
          stage_row(g32, pass, 0, rbase + pass * RPP < rows);
          qp += RPP * qst, kp += RPP * kst, gp += RPP * gst;
        }
      };
      if (a.g_fp32) {
        passes(std::true_type{});
      } else {
        passes(std::false_type{});
      }
    } else {
      // Row map: one row index load a pass, so the passes stay a loop (rows grow with pass: the first
      // row past the chunk ends it).  g's type is dispatched once, as in the contiguous case.
      auto mapped_passes = [&](auto g32) {
#pragma unroll 1
        for (int pass = 0; pass < PASSES; ++pass) {
          const int r = rbase + pass * RPP;
          if (r >= rows) break;
          stage_row(g32, pass, mapped_row(a, tok0 + r), true);
        }
      };
      if (a.g_fp32) {
        mapped_passes(std::true_type{});
      } else {
        mapped_passes(std::false_type{});
      }
    }
    cp_async_commit();
  } else {
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {
      const int r = rbase + pass * RPP;
      if (r >= rows) continue;
      const int64_t tok = mapped_row(a, tok0 + r);
      const uint16_t* q = reinterpret_cast<const uint16_t*>(a.q + batch * a.q_sb + tok * a.q_st + h * D + c8);
      const uint16_t* k = reinterpret_cast<const uint16_t*>(a.k + batch * a.k_sb + tok * a.k_st + h * D + c8);
      const int64_t go = batch * a.g_sb + tok * a.g_st + h * D + c8;
#pragma unroll 1
      for (int i = 0; i < 8; ++i) {
        sQ[r * ldh + c8 + i] = q[i];
        sK[r * ldh + c8 + i] = k[i];
        if (a.g_fp32) {
          sG[r * ldf + c8 + i] = static_cast<const float*>(a.g)[go + i];
        } else {
          sGraw[r * D + c8 + i] = reinterpret_cast<const uint16_t*>(a.g)[go + i];
        }
      }
    }
  }
  if (!a.beta_fp32) {
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) bbits[pass] <<= 16;
  }
  // Gate constants (log2 units).  Bounded: lower_bound sigmoid(e (g + dtb)) log2(e) with e = exp(A_log)
  // is lb2 / (1 + 2^(c1 g + c1 dtb)), c1 = -e log2(e), lb2 = lower_bound log2(e): one FFMA, two SFU ops
  // and an FADD and FMUL per element (the unfolded form took ~15 instructions with __expf's
  // denormal handling and the per-element mode branches).
  const int gate_mode = a.gate_mode;
  const float expA_h = gated ? expf(A_log_h) : 0.f;
  const float c1 = -expA_h * kLog2e, lb2 = a.lower_bound * kLog2e;
  if (gate_mode == kGateBounded) {
#pragma unroll
    for (int i = 0; i < 8; ++i) gb[i] *= c1;
  }
  if (staged) cp_async_wait<0>();

#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int r = rbase + pass * RPP;
    float xq[8], xk[8], xg[8];
    float b = 0.f;
    if (r < rows) {
      load8_qk(sQ + r * ldh + c8, false, xq);
      load8_qk(sK + r * ldh + c8, false, xk);
      if (a.g_fp32) {
        load8_f32(sG + r * ldf + c8, xg);
      } else {
        load8_qk(sGraw + r * D + c8, false, xg);
      }
      const float braw = __uint_as_float(bbits[pass]);  // bf16 bits sit in the high half
      b = a.beta_sigmoid ? fast_rcp(1.f + fast_exp2(-kLog2e * braw)) : braw;
      if (gate_mode == kGateBounded) {
#pragma unroll
        for (int i = 0; i < 8; ++i) xg[i] = lb2 * fast_rcp(1.f + fast_exp2(fmaf(xg[i], c1, gb[i])));
      } else if (gate_mode == kGateSoftplus) {
#pragma unroll
        for (int i = 0; i < 8; ++i) xg[i] = -expA_h * softplusf_(xg[i] + gb[i]) * kLog2e;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xg[i] *= kLog2e;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) xq[i] = xk[i] = xg[i] = 0.f;
    }
    float sq = 0.f, sk = 0.f;  // row norms^2; the TPR lanes of a row are adjacent
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sq += xq[i] * xq[i];
      sk += xk[i] * xk[i];
    }
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    qn2max = fmaxf(qn2max, qk16 ? 1.f : sq);
    kn2max = fmaxf(kn2max, qk16 ? 1.f : sk);
    if (qk16) {                                                              // x / sqrt(sum x^2 + 1e-6)
      const float iq = fast_rsqrt(sq + 1e-6f), ik = fast_rsqrt(sk + 1e-6f);  // >= 1e-6: a normal number
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xq[i] *= iq;
        xk[i] *= ik;
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) kmax = fmaxf(kmax, fabsf(xk[i]));
    // Normalised q, k go back as fp16.  Raw ones are the staged bf16 in place already (the same bits),
    // so only rows past the end are written (zeros).  One pack per pair: a pack chosen per call made
    // the compiler issue both conversions, predicated.
    if (qk16) {
      *reinterpret_cast<uint4*>(sQ + r * ldh + c8) = pack8_f16(xq);
      *reinterpret_cast<uint4*>(sK + r * ldh + c8) = pack8_f16(xk);
    } else if (r >= rows) {
      *reinterpret_cast<uint4*>(sQ + r * ldh + c8) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(sK + r * ldh + c8) = make_uint4(0u, 0u, 0u, 0u);
    }
    *reinterpret_cast<float4*>(sG + r * ldf + c8) = make_float4(xg[0], xg[1], xg[2], xg[3]);
    *reinterpret_cast<float4*>(sG + r * ldf + c8 + 4) = make_float4(xg[4], xg[5], xg[6], xg[7]);
    if (c8 == 0) sB[r] = b;
  }
  __syncthreads();
  if (pool_sign_word < 0) return;  // padded sequence (see above); block-uniform

  {  // cumulative decay: each of P parts scans RP rows of one column in registers, then adds the
     // totals of the parts before it
    constexpr int P = kPrepareThreads / D, RP = kChunk / P;
    const int col = tid % D, part = tid / D;
    atomicMax(&sMax[1], __float_as_int(kmax));  // non-negative floats order like their bits
    atomicMax(&sMax[3], __float_as_int(qn2max));
    atomicMax(&sMax[4], __float_as_int(kn2max));
    float x[RP];
#pragma unroll
    for (int i = 0; i < RP; ++i) x[i] = sG[(part * RP + i) * ldf + col];
#pragma unroll
    for (int i = 1; i < RP; ++i) x[i] += x[i - 1];
    sTot[part * D + col] = x[RP - 1];
    __syncthreads();
    float off = 0.f;
    for (int p = 0; p < part; ++p) off += sTot[p * D + col];
#pragma unroll
    for (int i = 0; i < RP; ++i) sG[(part * RP + i) * ldf + col] = x[i] + off;
  }
  __syncthreads();

  // ---- 2. gamma and the fp16 shifts (QT, KT, KD: phase 4b) ---------------------------------------------
  bf16* rKT = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kKT);
  bf16* rQT = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kQT);
  bf16* rKD = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kKD);
  bf16* rTb = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kTb);
  bf16* rMQK = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kMQK);
  bf16* sMQK = reinterpret_cast<bf16*>(smem + SM::kMqkSt);  // MQK's record image, stored after phase 3
  float* rGamma = reinterpret_cast<float*>(rec + ChunkRecord<D>::kGamma);
  // KD and MQK are stored in fp16 with power-of-two shifts: |KD| <= max|k| and
  // |MQK| <= scale |q_i| |k_j| (every decay factor is <= 1), so these bounds never overflow.
  // The shifts are formed by one warp, the last (it holds no gamma column at either D), and published in
  // sMax[5] and sMax[6] by the barrier below: every warp forming them took two IEEE square roots (with
  // their slow-path branches) and both shifts, ~40 instructions a warp.
  constexpr int kShiftWarp = kPrepareThreads / 32 - 1;
  static_assert(kShiftWarp * 32 >= D, "the shift warp holds no gamma column");
  static_assert(SM::kEnd - SM::kMax >= 7 * 4, "sMax holds the shifts at 5 and 6");
  if (warp == kShiftWarp) {
    const int shift_d = pow2_shift(__int_as_float(sMax[1]), 0);
    const int shift_m =
        pow2_shift(scale * sqrtf(__int_as_float(sMax[3])) * sqrtf(__int_as_float(sMax[4])), 14);
    if (lane == 0) {
      reinterpret_cast<int*>(rec + ChunkRecord<D>::kShifts)[1] = shift_m;
      reinterpret_cast<int*>(rec + ChunkRecord<D>::kShifts)[2] = shift_d;
      sMax[5] = shift_m;
      sMax[6] = shift_d;
    }
  }
  int over = 0;
  if (tid < D) {
    rGamma[tid] = fast_exp2(sG[(kChunk - 1) * ldf + tid]);
#pragma unroll
    for (int I = 0; I < kChunk / kSub; ++I) {
      const float gm = sG[(16 * I + 7) * ldf + tid];
      over |= (sG[(16 * I) * ldf + tid] - gm > kMaxHalfSpanLog2) |
              (gm - sG[(16 * I + 15) * ldf + tid] > kMaxHalfSpanLog2);
    }
  }
  // MQK's upper blocks are not in its packed image (the walk keeps them zero in its own): nothing to store.
  const bool pairwise_diag = __syncthreads_or(over) != 0;
  const float mqk_scale = scale * pow2i(-sMax[5]);  // MQK's scale with its shift

  // ---- 3. L and MQK blocks, and the diagonal blocks of T_inv ----------------------------------------
  {
    // Warps 0-3: diagonal block I = warp (tf32).  Warps 4-7: the six off-diagonal blocks, those of one
    // row block sharing their A fragments: (3,0)+(3,1) | (2,0)+(2,1) | (3,2) | (1,0).  With the A's
    // shared, a warp of two blocks issues about as much as a diagonal one.
    auto blocks = [&](auto f16) {
      constexpr bool kF16 = decltype(f16)::value;
      // The warp index as lane 0's: the same value, but ptxas then knows the branches below are
      // warp-uniform and drops the WARPSYNC it put before the mma of every off-diagonal loop trip
      // (it cannot tell that tid >> 5 is).  One SHFL a warp.
      const int wu = __shfl_sync(0xffffffffu, warp, 0);
      if (wu < 4) {
        if (!pairwise_diag) {
          lk_block_diag_tf32<D, kF16>(sQ, sK, sG, sB, sL, sMQK, mqk_scale, wu, lane);
        } else {
          lk_block_pairwise<D>(sQ, sK, kF16, sG, sB, sL, sMQK, mqk_scale, wu, lane);
        }
        __syncwarp();
        if (lane < 16) {
          float tcol[16];  // column `lane` of T_inv's diagonal block `wu`
          tinv_diag_block<D>(sL, tcol, wu, lane);
#pragma unroll
          for (int i = 0; i < 16; ++i) sTi[(16 * wu + i) * ldt + 16 * wu + lane] = tcol[i];
        }
      } else {
        const int q = wu - 4;  // (I, J0, two): (3,0,1) (2,0,1) (3,2,0) (1,0,0), by arithmetic, not selects
        if (q < 2) {
          lk_row_blocks<D, kF16, true>(sQ, sK, sG, sB, sL, sMQK, mqk_scale, 3 - q, 0, lane);
        } else {
          const int I = 7 - 2 * q;  // one block (I, I - 1)
          lk_row_blocks<D, kF16, false>(sQ, sK, sG, sB, sL, sMQK, mqk_scale, I, I - 1, lane);
        }
      }
    };
    if (qk16) {
      blocks(std::true_type{});
    } else {
      blocks(std::false_type{});
    }
  }
  fence_proxy_async_shared();  // MQK's staged writes, before the bulk copy reads them (async proxy)
  __syncthreads();
  if (tid == 0) {  // waited for (its shared-memory read) with Tb's before the block exits
    bulk_store(rMQK, sMQK, kTri64Bytes);
    bulk_store_commit();
  }

  // ---- 4. T_inv's off-diagonal blocks (warps 0-2) beside QT, KT, KD (warps 3-7) ---------------------
  // The column walks are a dependent chain on three warps; the record's QT / KT / KD need only q, k and
  // G, which T_inv no longer overwrites, so the other five warps form them meanwhile instead of waiting
  // at the barrier (before, they ran as phase 2 on all warps and the walks left five warps idle).
  if (warp < 3) {  // column J = warp: T_{J+1,J}, T_{J+2,J}, ... (3, 2 and 1 blocks)
    // Block distance d as a template argument: the k-steps unrolled, all fragment loads in flight.
    float* xs = sTi + 16 * warp * ldt + 48;  // upper block (J, 3)
    tinv_block<D, 1>(sL, sTi, xs, warp, lane);
    if (warp < 2) tinv_block<D, 2>(sL, sTi, xs, warp, lane);
    if (warp < 1) tinv_block<D, 3>(sL, sTi, xs, warp, lane);
  } else {
    // Threads 96-255: each keeps its 8 columns and takes every (160 / TPR)-th row.
    constexpr int kQtThreads = kPrepareThreads - 96, kQtRowStep = kQtThreads / TPR;
    static_assert(kQtThreads % TPR == 0, "a thread's columns stay the same from row to row");
    const int qu = tid - 96, qc8 = (qu % TPR) * 8;
    // KT = k 2^G (bf16: the walk's B operand of S KT^T) shares QT's exponential.
    float gl[8];  // G of the chunk's last row
    load8_f32(sG + (kChunk - 1) * ldf + qc8, gl);
    const int shift_d = sMax[6];  // formed in phase 2
#pragma unroll
    for (int i = 0; i < 8; ++i) gl[i] -= static_cast<float>(shift_d);  // 2^-shift_d of KD, in the exponent
    // Rows r0 + k kQtRowStep: kFull of them for every thread, one more for r0 < kChunk % kQtRowStep
    // (warps 3-4 at D = 128, warp 3 at D = 64).  Trip counts known at compile time: the loop over
    // r < kChunk had the compiler derive each warp's count (a division by the step) and test it for
    // an odd one, ~20 instructions a warp.
    constexpr int kFull = kChunk / kQtRowStep;
    const int r0 = qu / TPR;
    // q / k dtype as a template argument: one conversion path in the loop, not both predicated.
    auto qt_kd_passes = [&](auto f16) {
      constexpr bool kF16 = decltype(f16)::value;
      auto row = [&](int r) {
        float xq[8], xk[8], xd[8], xg[8];
        load8_qk(sQ + r * ldh + qc8, kF16, xq);
        load8_qk(sK + r * ldh + qc8, kF16, xk);
        load8_f32(sG + r * ldf + qc8, xg);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float gg = xg[i];
          const float e = fast_exp2(gg);
          xq[i] = scale * xq[i] * e;
          xd[i] = xk[i] * fast_exp2(gl[i] - gg);  // gl carries KD's shift
          xk[i] *= e;
        }
        store8_bf16(record_element(rQT, r, qc8), xq);
        *reinterpret_cast<uint4*>(record_element(rKD, r, qc8)) = pack8_f16(xd);
        store8_bf16(record_element(rKT, r, qc8), xk);
      };
#pragma unroll 2
      for (int k = 0; k < kFull; ++k) row(r0 + k * kQtRowStep);
      if (r0 < kChunk % kQtRowStep) row(r0 + kFull * kQtRowStep);
    };
    if (qk16) {
      qt_kd_passes(std::true_type{});
    } else {
      qt_kd_passes(std::false_type{});
    }
  }
  __syncthreads();
  // Tb = T_inv diag(b) 2^-shift_t in fp16 from the lower blocks only: the upper ones hold the column
  // walks' scratch (block (J, 3)) or were never written, and are zero in Tb.
  // Thread (rg, cg) = (tid / 16, tid % 16) holds rows rg + 16 i (row block i) x columns 4 cg .. 4 cg + 3
  // in registers from the max to the store: one 16-byte read a row (rows are 16-byte aligned; a half
  // warp reads one row's 256 contiguous bytes, conflict-free) and one 8-byte store a row of the lower
  // blocks (4 fp16 of one 16-byte row of a core matrix of the packed triangle), 4 + <= 4 accesses a
  // thread.  A half warp's stores of one row land in up to 8 core matrices of one bank group (8-way
  // conflicts): ~20 wavefronts a warp where the SW128 image's 4 stores took 8, ~100 more a chunk-head,
  // not measurable (chunk_prepare 214.9 -> 214.2 us on 8x2048 H16 with the packing, perf-notes v29).  4
  // columns, not 8: a thread reading 8 columns as two float4 would leave 32-byte gaps between the lanes of a
  // quarter warp (2-way bank conflicts).  Every image element is written once; the products are those of
  // column pairs.
  constexpr int kTbRows = kChunk * kChunk / 4 / kPrepareThreads;
  static_assert(kTbRows == 4 && kChunk / 4 == 16, "4 rows of 4 columns a thread, 16 threads a row");
  const int tid5 = thread_index_here();  // not tid (thread_index_here says why)
  // >> and &: tid5 is not known to be non-negative, and a signed / 16, % 16 took 5 instructions
  const int tb_rg = tid5 >> 4, tb_c4 = (tid5 & 15) * 4, tb_cb = tb_c4 / 16;  // tb_cb: column block
  float4 tbv[kTbRows];
  {
    const float4 bj = *reinterpret_cast<const float4*>(sB + tb_c4);
    const float* trow = sTi + tb_rg * ldt + tb_c4;  // row rg + 16 i at a constant offset
    float tmax = 0.f;
#pragma unroll
    for (int i = 0; i < kTbRows; ++i) {
      if (tb_cb <= i) {  // column block <= row block
        const float4 x = *reinterpret_cast<const float4*>(trow + 16 * i * ldt);
        tbv[i] = make_float4(x.x * bj.x, x.y * bj.y, x.z * bj.z, x.w * bj.w);
      } else {
        tbv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      tmax = fmaxf(tmax,
                   fmaxf(fmaxf(fabsf(tbv[i].x), fabsf(tbv[i].y)), fmaxf(fabsf(tbv[i].z), fabsf(tbv[i].w))));
    }
    // tmax is a non-negative float (never NaN: fmaxf drops NaN against 0), whose bits order like the
    // value: one REDUX instead of a 5-step shuffle tree.
    const unsigned wmax = __reduce_max_sync(0xffffffffu, __float_as_uint(tmax));
    if (lane == 0) atomicMax(&sMax[2], static_cast<int>(wmax));
  }
  __syncthreads();
  const int shift_t = pow2_shift(__int_as_float(sMax[2]), 1);  // |Tb 2^-shift_t| < 2
  // Tb's packed record image (the walk's B operand of VnT = XT Tb^T), over G (phase 4b was its last
  // reader): the blocks (i, tb_cb) with tb_cb <= i; the upper ones are not in the image.
  bf16* sTbSt = reinterpret_cast<bf16*>(smem + SM::kTbSt);
  {
    // Row rg + 16 i is two row groups (512 bytes, 256 elements) past row rg in the same K step.
    static_assert(kChunk == 64, "a 64 x 64 packed triangle");
    bf16* dst = sTbSt + tri64_element(tb_rg, tb_c4);
    const float st = pow2i(-shift_t);
#pragma unroll
    for (int i = 0; i < kTbRows; ++i) {
      if (tb_cb <= i) {
        *reinterpret_cast<uint2*>(dst + 256 * i) =
            make_uint2(pack_f16(tbv[i].x * st, tbv[i].y * st), pack_f16(tbv[i].z * st, tbv[i].w * st));
      }
    }
  }
  if (tid == 0) *reinterpret_cast<int*>(rec + ChunkRecord<D>::kShifts) = shift_t;
  fence_proxy_async_shared();  // the staged Tb image, before the bulk copy reads it (async proxy)
  __syncthreads();
  if (tid == 0) {
    bulk_store(rTb, sTbSt, kTri64Bytes);
    bulk_store_commit();
    bulk_store_wait_read();  // the block's shared memory lives until its last thread exits
  }
}

}  // namespace sm90
}  // namespace flashkda
