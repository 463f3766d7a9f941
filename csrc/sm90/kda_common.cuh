// Shared device code of the sm90 KDA prefill: the kernel argument block, the chunk-slot geometry
// used by both kernels, tensor-core (mma.sync m16n8k16 bf16) and ldmatrix wrappers, and the
// per-token preprocessing math (gate, beta).  Nothing here allocates or synchronises the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <string>
#include <utility>

#include "flashkda/flashkda.h"
#include "sm90/kda_prepare_order.h"  // PrepareOrder: chunk_prepare's slot order
#include "sm90/kda_sw128.h"          // kTri64Bytes: ChunkRecord's packed triangles

namespace flashkda {
namespace sm90 {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 64;  // tokens per chunk
constexpr int kSub = 16;    // sub-chunk (one mma row tile) inside a chunk
constexpr float kLog2e = 1.4426950408889634f;
// Diagonal 16x16 blocks of kt @ kb^T are factorised around the block's row 7: each factor is
// 2^(G_i - G_ref) or 2^(G_ref - G_j) (log2 units), at most 2^(half-span).  When every half-span of
// a chunk is <= 100 (2^100 ~ 1.3e30, under bf16's 3.4e38 even times a key entry) the tensor-core
// path is used; otherwise (only unbounded gates can get there: the bounded gate, |a| <= 5 nat a
// token, spans at most 8 * 5 * log2(e) ~ 58) those blocks are summed pairwise with 2^(G_i - G_j) <= 1.
constexpr float kMaxHalfSpanLog2 = 100.0f;

enum : int { kGateBounded = 0, kGateSoftplus = 1, kGatePrecomputed = 2 };

// Everything both kernels need, by value (a __grid_constant__-friendly POD).
struct PrefillArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const void* g;
  const void* beta;
  bf16* out;
  // Strides in elements: batch row (sb) and token (st).  Heads are contiguous inside a token.
  int64_t q_sb, q_st, k_sb, k_st, v_sb, v_st, g_sb, g_st, beta_sb, beta_st, out_sb, out_st;
  int g_fp32, beta_fp32;
  const float* A_log;    // [H]
  const float* dt_bias;  // [H * K]
  const void* h0;        // [N or P, H, V, K] or null
  void* ht;              // [N or P, H, V, K] or null
  int state_fp32;
  int h0_pairs;            // h0 aligned to two elements: paired (float2 / bf16x2) loads
  int ht_vec16;            // ht 16-byte aligned: the final state leaves in 16-byte stores
  const void* cu_seqlens;  // [N + 1] or null
  int cu_int64;
  const void* state_indices;  // [N] or null
  int idx_int64;
  int64_t pool_rows;              // first dim of the state tensors
  const bool* has_initial_state;  // [N] or null
  int B, T, H, N;                 // T: tokens per batch row (all tokens when varlen, B == 1)
  int gate_mode, l2norm, beta_sigmoid;
  float scale, lower_bound;
  int vec_q, vec_k, vec_v, vec_g, vec_out;  // 16-byte aligned rows: vector loads/stores allowed
  char* records;                            // workspace: one ChunkRecord per (slot, head)
  int* error_word;
  int64_t num_slots;  // chunk slots per head
  // chunk_prepare's slot order (kda_prepare_order.h), formed by launch_prefill from num_slots and N.
  PrepareOrder prep_order;
  // Optional row map: logical token t lives at row token_rows[t] of the token tensors (dim 1 has
  // num_rows rows).  T above counts logical tokens.
  const void* token_rows;
  int rows_int64;
  int64_t num_rows;
  // Optional checkpoints: ckpt_state[n, j] = state after ckpt_offsets[n, j] tokens of sequence n.
  const void* ckpt_offsets;  // [N, n_ckpt] or null
  int ckpt_int64;
  int n_ckpt;
  float* ckpt_state;  // [N, n_ckpt, H, V, K] fp32
  // Context parallelism (seg_chunks > 0, see kda_segment_scan.cuh): each sequence is cut into
  // segments of seg_chunks chunks, walked in parallel; the grid covers max_segs segments per
  // sequence.  seg_ws: per (segment slot, head) three D x D fp32 blocks: the segment's start state,
  // and the affine map of its walk, S_end = S_start A + L (L first, then A).
  float* seg_ws;
  int seg_chunks;
  int max_segs;
  // Whole walks only: blocks take (sequence, head) longest sequence first (set by the launch when
  // the grid is varlen, has 2 <= N <= the block's threads, and more blocks than SMs).
  int walk_longest_first;
  // Host side only: launch the 8-warp whole walk after chunk_prepare with programmatic stream
  // serialisation (default on; FLASHKDA_PREFILL_PDL=0 turns it off, a developer switch for A/B runs
  // and the bit-identity test).
  int walk_pdl;
  // Host side only, developer switches for bench/probe_sm_partition.py (FLASHKDA_PREFILL_ONLY,
  // FLASHKDA_PREFILL_WALK_WARPS): one stage alone (0 = a normal call, 1 = chunk_prepare only, 2 = the
  // recurrence and checkpoints only, reading the records already in the workspace), and the whole
  // walk's warps (4 or 8; 0 = state_block_warps' choice).  Zero-initialised args are a normal call.
  int dev_only;
  int walk_warps;
};

// ---------------------------------------------------------------------------------------------
// Chunk slots.  Sequence n owns slots [slot_base(n), slot_base(n) + ceil(len_n / C)).  With
// varlen, slot_base(n) = floor(cu[n] / C) + n: strictly increasing in n, disjoint ranges, and
// bounded by floor(T / C) + N + 1 slots in all, all of it known to the host without reading
// cu_seqlens (so grids are sized on the host, no sync).
// ---------------------------------------------------------------------------------------------
__host__ __device__ inline int64_t num_chunk_slots(bool varlen, int64_t B, int64_t T, int64_t N) {
  return varlen ? (T / kChunk + N + 1) : B * ((T + kChunk - 1) / kChunk);
}

__device__ inline int64_t load_index(const void* p, int is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Row of logical token `tok` in the input/output tensors: token_rows[tok] (clamped, the callers
// validate it first) or tok itself.
template <class A>
__device__ inline int64_t mapped_row(const A& a, int64_t tok) {
  if (a.token_rows == nullptr) return tok;
  const int64_t r = load_index(a.token_rows, a.rows_int64, tok);
  return r < 0 ? 0 : (r >= a.num_rows ? a.num_rows - 1 : r);
}

struct SeqSpan {
  int64_t batch;  // batch row of the tokens
  int64_t bos;    // first token (row-local)
  int64_t len;    // tokens
  int64_t slot0;  // first chunk slot
};

// Sequence n's span, clamped into [0, T] so that even bad cu_seqlens never index out of bounds
// (the kernels refuse to write when the prepare pass flagged them; see validate_device_inputs).
__device__ inline SeqSpan sequence_span(const PrefillArgs& a, int64_t n) {
  SeqSpan s;
  if (a.cu_seqlens) {
    int64_t b0 = load_index(a.cu_seqlens, a.cu_int64, n);
    int64_t e0 = load_index(a.cu_seqlens, a.cu_int64, n + 1);
    b0 = b0 < 0 ? 0 : (b0 > a.T ? a.T : b0);
    e0 = e0 < b0 ? b0 : (e0 > a.T ? a.T : e0);
    s.batch = 0;
    s.bos = b0;
    s.len = e0 - b0;
    s.slot0 = b0 / kChunk + n;
  } else {
    s.batch = n;
    s.bos = 0;
    s.len = a.T;
    s.slot0 = n * ((a.T + kChunk - 1) / kChunk);
  }
  return s;
}

// Context parallelism: the number of segments of a sequence of `len` tokens (at least one, so an
// empty sequence still copies its initial state to its final state), and the workspace slot of its
// segment s.  Slots are floor(first global token / segment tokens) + n + s: distinct across
// sequences (the next sequence starts at a slot >= floor(len / X) + 1 > nseg - 1 further) and below
// floor(B T / X) + N, which is what workspace_size reserves (detail::segment_area_bytes).
__device__ inline int num_segments(const PrefillArgs& a, int64_t len) {
  const int64_t nch = (len + kChunk - 1) / kChunk;
  const int64_t ns = (nch + a.seg_chunks - 1) / a.seg_chunks;
  return ns < 1 ? 1 : static_cast<int>(ns);
}

template <int D>
__device__ inline float* segment_block(const PrefillArgs& a, int64_t n, const SeqSpan& sp, int s, int h,
                                       int part) {
  const int64_t first_token = sp.batch * a.T + sp.bos;
  const int64_t slot = first_token / (static_cast<int64_t>(a.seg_chunks) * kChunk) + n + s;
  return a.seg_ws + ((slot * a.H + h) * 3 + part) * static_cast<int64_t>(D) * D;
}
enum : int { kSegStart = 0, kSegMapL = 1, kSegMapA = 2 };

// Whether sequence n starts from the initial state (h0 given, and has_initial_state[n] when given)
// rather than from zeros.
__device__ inline bool starts_from_h0(const PrefillArgs& a, int64_t n) {
  return a.h0 != nullptr && (a.has_initial_state == nullptr || a.has_initial_state[n]);
}

// A state_indices value as a row: negative = padding, and out of range (flagged already by
// chunk_prepare's validation) -1 too, so that it is never dereferenced.
__device__ inline int64_t pool_row_or_padding(const PrefillArgs& a, int64_t r) {
  return (r >= a.pool_rows) ? -1 : r;
}

// State row of sequence n in the state tensors (pool addressing); negative = padding.
__device__ inline int64_t state_row(const PrefillArgs& a, int64_t n) {
  if (!a.state_indices) return n;
  return pool_row_or_padding(a, load_index(a.state_indices, a.idx_int64, n));
}

// state_row in two steps, so that the load's round trip overlaps other work: issue_state_row_load
// loads the index's raw words (an asm load: the compiler widened an int32 index right after its load,
// which stalled the warp there), state_row_resolve forms the row once the caller has passed an asm
// barrier on the words (`asm volatile("" : "+r"(lo), "+r"(hi))`) placed after the work to overlap.
__device__ inline void issue_state_row_load(const PrefillArgs& a, int64_t n, uint32_t* lo, uint32_t* hi) {
  *lo = static_cast<uint32_t>(n);
  *hi = static_cast<uint32_t>(static_cast<uint64_t>(n) >> 32);
  if (!a.state_indices) return;
  if (a.idx_int64) {
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];"
                 : "=r"(*lo), "=r"(*hi)
                 : "l"(static_cast<const int64_t*>(a.state_indices) + n));
  } else {
    asm volatile("ld.global.u32 %0, [%1];"
                 : "=r"(*lo)
                 : "l"(static_cast<const int32_t*>(a.state_indices) + n));
  }
}

__device__ inline int64_t state_row_resolve(const PrefillArgs& a, uint32_t lo, uint32_t hi) {
  if (!a.state_indices) return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
  return pool_row_or_padding(a, a.idx_int64 ? static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo)
                                            : static_cast<int64_t>(static_cast<int32_t>(lo)));
}

// ---------------------------------------------------------------------------------------------
// Per-chunk record in the workspace, written by chunk_prepare, read by state_recurrence.
// KT, QT, KD are stored as the SW128 shared-memory image their reader uses (kda_sw128.h:
// sw128_offset<rows>, 128-byte rows of 16-byte pieces XOR-swizzled by row & 7, 64-column halves
// one after the other), so that state_recurrence moves each tile with one TMA bulk copy; the
// lower-triangular TB and MQK as packed no-swizzle images (tri64_offset: their zero blocks omitted,
// 5120 of 8192 bytes), which the walk's wgmma read as they are.  The matrices below are listed by their
// logical row-major shape.
//   KT  [C][K]  = k * exp(G)
//   QT  [C][K]  = scale * q * exp(G)
//   KD  [C][K]  fp16 = k * exp(G_last - G) * 2^-KD_SHIFT
//   TB  [C][C]  fp16 = T_inv diag(b) * 2^-TB_SHIFT (block-lower, packed: tri64_offset; the walk forms
//               VnT = (v^T - S KT^T) TB^T itself from the raw v rows, so v is read once, by the walk,
//               and neither W = TB kt nor U = TB v is ever formed)
//   MQK [C][C]  fp16 = lower_incl(qt @ kb^T) * 2^-MQK_SHIFT (scale included; packed: tri64_offset)
//   GAMMA [K] fp32 = exp(G_last)
//   tail: int32 TB_SHIFT, MQK_SHIFT, KD_SHIFT (128 bytes).  The power-of-two shifts keep the fp16
//   values in range for any finite input; fp16's 11-bit mantissa is what keeps the error low.
// ---------------------------------------------------------------------------------------------
template <int D>
struct ChunkRecord {
  static constexpr int kKT = 0;
  static constexpr int kQT = kKT + kChunk * D * 2;
  static constexpr int kKD = kQT + kChunk * D * 2;
  static constexpr int kTb = kKD + kChunk * D * 2;
  static constexpr int kMQK = kTb + kTri64Bytes;  // Tb and MQK: packed triangles (kda_sw128.h)
  static constexpr int kGamma = kMQK + kTri64Bytes;
  static constexpr int kShifts = kGamma + D * 4;  // TB, MQK, KD shifts (int32)
  static constexpr int kBytes = kShifts + 128;
  static_assert(kBytes % 128 == 0, "records must keep 128-byte alignment");
};

// ---------------------------------------------------------------------------------------------
// Tensor-core and shared-memory primitives.
// ---------------------------------------------------------------------------------------------
__device__ inline uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ inline uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, fp32 accumulators.
__device__ inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Same with fp16 inputs (used where operands are bounded by a per-chunk power-of-two scale).
__device__ inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A(16x8, row) * B(8x8, col) + D in tf32 (fp32 range, 10-bit mantissa).
__device__ inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x rounded to tf32 (nearest, ties away), low 13 bits zero: for values used as fp32 afterwards
// (the 3xTF32 hi / lo split).
__device__ inline uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// x as an mma .tf32 operand, rounded to nearest (ties away).  The tensor cores read only the top 19
// bits of a tf32 operand, so adding half a tf32 ulp to the bits is the whole rounding (a carry into
// the exponent is the correct round-up).  One integer add, where cvt.rna.tf32.f32 compiles on sm_90
// to a finiteness test plus the same predicated add.  x must be finite (an inf stays inf).
__device__ inline uint32_t tf32_operand(float x) { return __float_as_uint(x) + 0x1000u; }

// 2^e as a float, for |e| <= 126 (exact scaling).
__device__ inline float pow2i(int e) { return __int_as_float((127 + e) << 23); }

// 2^e with e clamped to [-126, 126]: for sums of shifts whose range is not bounded by construction
// (only reached for inputs whose values are themselves near fp32's limits).
__device__ inline float pow2i_sat(int e) { return pow2i(e < -126 ? -126 : (e > 126 ? 126 : e)); }

// The power-of-two shift s with m * 2^-s < 2^target (m >= 0); 0 for m == 0.
__device__ inline int pow2_shift(float m, int target) {
  if (!(m > 0.f)) return 0;
  int e = ((__float_as_int(m) >> 23) & 0xff) - 127;  // floor(log2 m) for normal m
  int s = e + 1 - target;
  return s < -60 ? -60 : (s > 60 ? 60 : s);
}

__device__ inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Four 8 x 8 b16 matrices from mma-fragment registers (lane l: row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 of each) to shared memory, transposed: fragment (row, col) lands in row col of the
// stored matrix; lanes 8 m .. 8 m + 7 give the 8 row addresses of matrix m (16 bytes each).
__device__ inline void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// A fragment (16x16) of a row-major bf16 matrix in smem at (row0, col0), leading dim ld (elements).
__device__ inline void load_a_frag(uint32_t (&a)[4], const bf16* base, int ld, int row0, int col0, int lane) {
  const int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int c = col0 + (lane >> 4) * 8;
  ldmatrix_x4(a, smem_addr(base + r * ld + c));
}

// A fragment (16x16) of A = X^T where X is row-major [k][m] in smem: A(m, k) = X(k, m).
__device__ inline void load_a_frag_trans(uint32_t (&a)[4], const bf16* x, int ld, int m0, int k0, int lane) {
  const int mi = lane >> 3;
  const int kr = k0 + (lane & 7) + (mi >> 1) * 8;
  const int mc = m0 + (mi & 1) * 8;
  ldmatrix_x4_trans(a, smem_addr(x + kr * ld + mc));
}

// B fragments for two n-tiles (n0..n0+15) and k0..k0+15 where B(k, n) = X(n, k), X row-major [n][k]
// (the "col" operand layout).  b[0], b[1]: n-tile n0; b[2], b[3]: n-tile n0 + 8.
__device__ inline void load_b_frag_nk(uint32_t (&b)[4], const bf16* x, int ld, int n0, int k0, int lane) {
  const int n = n0 + (lane & 7) + (lane >> 4) * 8;
  const int kc = k0 + ((lane >> 3) & 1) * 8;
  ldmatrix_x4(b, smem_addr(x + n * ld + kc));
}

// Same fragments where B is stored row-major [k][n] (n contiguous).
__device__ inline void load_b_frag_kn(uint32_t (&b)[4], const bf16* x, int ld, int n0, int k0, int lane) {
  const int kr = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int nc = n0 + (lane >> 4) * 8;
  ldmatrix_x4_trans(b, smem_addr(x + kr * ld + nc));
}

// A 16-byte cp.async to a shared-memory address (cp_async<16> converts its pointer to one): the
// generic-to-shared conversion of each copy's pointer re-reads the CTA's shared window (S2UR SR_CgaCtaId and
// ~5 more instructions a copy in the SASS), which a run of copies from one base converts once.
__device__ inline void cp_async_16_shared(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

// cp_async_16_shared when `p`, as one predicated copy: a run of conditional copies without a branch
// around each.
__device__ inline void cp_async_16_shared_if(bool p, uint32_t smem, const void* gmem) {
  asm volatile(
      "{\n"
      " .reg .pred p;\n"
      " setp.ne.b32 p, %2, 0;\n"
      " @p cp.async.cg.shared.global [%0], [%1], 16;\n"
      "}\n" ::"r"(smem),
      "l"(gmem), "r"(static_cast<int>(p))
      : "memory");
}

// cp.async of kBytes from global to shared memory (16: .cg, cached in L2 only; 8, 4: .ca).  The
// memory clobbers keep the compiler from moving shared-memory accesses across the copy, the commit or
// the wait.
template <int kBytes>
__device__ inline void cp_async(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    cp_async_16_shared(smem_addr(smem), gmem);
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "n"(kBytes)
                 : "memory");
  }
}
__device__ inline void cp_async_16(void* smem, const void* gmem) { cp_async<16>(smem, gmem); }
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- mbarrier and TMA bulk copy primitives (sm_90) ---------------------------------------------------
__device__ inline void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ inline void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar))
               : "memory");
}
__device__ inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra "
      "WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// TMA bulk copy global -> shared (16-byte aligned, a multiple of 16 bytes), completing on `bar`.
__device__ inline void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// bulk_load with an L2 evict-first policy: for data read once (a decode call's state slices), so that
// its lines leave L2 before the lines still to be read or written back.
__device__ inline void bulk_load_evict_first(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
      "[%3], "
      "%4;\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// TMA bulk copy shared -> global (16-byte aligned, a multiple of 16 bytes) in this thread's bulk
// group; the writes to the shared source must be ordered before it by fence.proxy.async (the copy
// reads through the async proxy), and the source must stay valid until bulk_store_wait_read.
__device__ inline void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ inline void bulk_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the committed bulk stores have read their shared-memory sources.
__device__ inline void bulk_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory writes before async-proxy reads (a bulk copy, a
// wgmma) that a following barrier publishes.
__device__ inline void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Programmatic dependent launch (griddepcontrol; both are no-ops when the grid was not launched with
// the programmatic-serialisation attribute).  pdl_launch_dependents: the next grid in the stream may be
// placed once every block of this one has executed it (or exited).  pdl_wait_primary: blocks until the
// grid this one was launched after has completed and its memory operations are visible.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void pdl_wait_primary() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Makes this thread's mbarrier.init visible to the async proxy (the TMA completing bytes on them)
// and, after a barrier, to the other threads of the cluster.
__device__ inline void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// 1/sqrt(x) on the SFU without the denormal-input guard of rsqrtf (two FSETP / FMUL pairs): for
// callers whose x is a normal number (the same result there).
__device__ inline float fast_rsqrt(float x) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// 2^x on the SFU (one MUFU.EX2; relative error ~2^-22, flushes denormal results to zero, which is
// harmless here: every use multiplies a value of at most a few units).
__device__ inline float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x on the SFU (rcp.approx.ftz: ~1 ulp; 1/inf = 0, which the gates rely on when 2^x overflows).
__device__ inline float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// Preprocessing math (spec section 2).  Gate results are in natural-log units.
// ---------------------------------------------------------------------------------------------
// The token recurrence's (and the CPU reference's) form of the gate; chunk_prepare folds the bounded
// gate's constants instead (one FFMA and two SFU ops per element, see phase 1 there).
__device__ inline float sigmoidf_(float x) { return __frcp_rn(1.0f + __expf(-x)); }
__device__ inline float softplusf_(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Log decay of one gate element (natural-log units); exp_A_log_h = exp(A_log[h]), hoisted by the
// caller (one per head).
__device__ inline float gate_log_decay(int mode, float g, float exp_A_log_h, float dt_bias_hk,
                                       float lower_bound) {
  if (mode == kGatePrecomputed) return g;
  const float x = g + dt_bias_hk;
  if (mode == kGateBounded) return lower_bound * sigmoidf_(exp_A_log_h * x);
  return -exp_A_log_h * softplusf_(x);
}

__device__ inline float load_scalar(const void* p, int is_fp32, int64_t i) {
  return is_fp32 ? static_cast<const float*>(p)[i] : __bfloat162float(static_cast<const bf16*>(p)[i]);
}

// ---------------------------------------------------------------------------------------------
// Host-side launch helpers.
// ---------------------------------------------------------------------------------------------
inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok_status();
  return Status::cuda_error(std::string("flashkda: ") + what + ": " + cudaGetErrorString(e));
}

// Launches a kernel, with programmatic stream serialisation when `pdl` (its set-up before
// griddepcontrol.wait overlaps the previous kernel's tail); the decode kernels and the prefill's
// 8-warp walk.
template <class... Params, class... Args>
Status launch_maybe_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, bool pdl,
                                 cudaStream_t stream, const char* what, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cuda_status(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}

// Raises a kernel's dynamic shared memory limit once per device and process (the attribute sticks;
// setting it on every call cost host time on the launch path).
template <auto Kernel>
cudaError_t set_smem_limit_once(int bytes) {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = 1ull << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

}  // namespace sm90
}  // namespace flashkda
