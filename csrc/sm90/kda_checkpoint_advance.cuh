// checkpoint_advance: finishes the prefill's checkpoint states (spec section 5).
//
// state_recurrence stores, for checkpoint offset o of sequence n, the state at the start of chunk
// c = floor(o / C) (an exact chunk-boundary state).  This kernel advances it over the remaining
// r = o - C c < C tokens with the token recurrence (kda_token_recurrence.cuh), in place, so that
// checkpoint_state[n, j] equals the final state of running the first o tokens alone.  Chunk-aligned
// offsets (r = 0) need nothing and their blocks exit at once.
//
// Grid: N x n_ckpt x H x D / 64 row slices, one dimension, the checkpoint's index slowest.
// Block: kAdvanceWarps<D> warps (8 at D = 128, 4 at D = 64), 64 state rows; each thread holds 16 fp32
// columns of two rows (TokenLayout<D, kWarps>).
// Chunk scheme: all r <= 63 tokens are preprocessed at once, r / kWarps a warp.  With 16-byte rows the
// warps copy their tokens' q / k / g rows by cp.async into the tokens' own TokenBufs and the block's v
// values beside them, together with the state's loads; each warp then preprocesses its tokens in place.
// Shared memory (AdvanceSmem): 63 TokenBufs, the betas and the v values, 106 KB at D = 128 (two blocks
// an SM).  One barrier; then every thread runs the r tokens on its rows back to back, with no barrier
// and no global load.  So a checkpoint costs one memory round trip, one preprocessing pass and r token
// steps (~150 instructions a warp a token at D = 128).  Tokens 8 at a time, as the decode kernels take
// them, cost a round trip, a preprocessing pass and two barriers every 8 tokens (41 us against 34 us on
// 8x2048 H16 with offsets 42 tokens into a chunk, on an H100).
// Runs after state_recurrence on the same stream; does nothing when chunk_prepare flagged an input.
#pragma once

#include "sm90/kda_token_recurrence.cuh"

namespace flashkda {
namespace sm90 {

template <int D>
constexpr int kAdvanceWarps = D == 128 ? 8 : 4;  // 64 state rows a block for both head dims

template <int D>
struct AdvanceSmem {
  using TL = TokenLayout<D, kAdvanceWarps<D>>;
  static constexpr int kRows = TL::kRowsPerBlock;
  static constexpr int kMaxTokens = kChunk - 1;  // an offset is at most C - 1 tokens past its chunk start
  static_assert(kRows == 64, "the v staging gives each lane two of the block's rows");
  TokenBuf<D> tok[kMaxTokens];
  float beta[kMaxTokens + 1];                       // + 1: v's rows start 16-byte aligned
  alignas(16) unsigned short v[kMaxTokens][kRows];  // bf16 bits of v[token, block row]
};

template <int D>
__global__ void __launch_bounds__(kAdvanceWarps<D> * 32, 2) checkpoint_advance_kernel(const PrefillArgs a) {
  constexpr int kWarps = kAdvanceWarps<D>;
  using SM = AdvanceSmem<D>;
  using TL = typename SM::TL;
  constexpr int PC = TL::kColsPerLane;
  constexpr int kR = TL::kRowsPerThread;
  constexpr int kSlices = D / SM::kRows;
  constexpr int kPerWarp = (SM::kMaxTokens + kWarps - 1) / kWarps;  // tokens a warp preprocesses
  extern __shared__ __align__(16) unsigned char advance_smem[];
  SM& sm = *reinterpret_cast<SM*>(advance_smem);
  if (*reinterpret_cast<volatile int*>(a.error_word) != 0) return;  // bad inputs: write nothing

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;  // exits below are block-uniform
  // Block order: row slice fastest, then sequence, head, and the checkpoint's index j slowest (the
  // host checks that the grid fits 31 bits).  A checkpoint at a chunk boundary has nothing to do, and
  // which ones are is data the host cannot read; with j slowest the blocks of one j, alike in practice
  // (len / 3 and len in the bench), are dealt round-robin over the SMs together, not interleaved with
  // the exiting ones.  Interleaved (j faster than h), the working blocks of a one-wave grid can land
  // two on an SM and none on the next: ncu, 1x8192 H64, SMs active 56% of the kernel's cycles.
  uint32_t x = blockIdx.x;
  const int slice = static_cast<int>(x % kSlices);
  x /= kSlices;
  const int64_t n = x % static_cast<uint32_t>(a.N);
  x /= static_cast<uint32_t>(a.N);
  const int h = static_cast<int>(x % static_cast<uint32_t>(a.H));
  const int64_t e = n * a.n_ckpt + x / static_cast<uint32_t>(a.H);  // (sequence, checkpoint) pair
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = TL::row(slice, q, warp, lane);
  const int j = lane % TL::kLanesPerRow;
  if (state_row(a, n) < 0) return;  // padded sequence: its checkpoint rows stay untouched
  const SeqSpan sp = sequence_span(a, n);
  const int64_t o = load_index(a.ckpt_offsets, a.ckpt_int64, e);
  const int64_t first = (o / kChunk) * kChunk;  // tokens already in the stored state
  if (o <= first || o > sp.len) return;
  const int nt = static_cast<int>(o - first);  // 1 .. C - 1

  // Every load of the block in flight at once: the state rows, then the tokens.  With 16-byte rows
  // (the common layouts) each warp copies its tokens' q, k, g rows and the block's 64 v values by
  // cp.async into shared memory, the raw rows inside the token's own TokenBuf (q, k over decay[], g over
  // q[]), so that no register holds them: held in registers (8 tokens a warp) they spilled, and each
  // spill store waited for its load.
  float* base = a.ckpt_state + (e * a.H + h) * static_cast<int64_t>(D) * D;
  float s[kR][16];
#pragma unroll
  for (int q = 0; q < kR; ++q) load_state_row<D, true>(base + vrow[q] * D, j, s[q]);
  float expA, dtb[PC];
  load_gate_params<D>(a, h, lane, &expA, dtb);
  const unsigned short* vsrc = reinterpret_cast<const unsigned short*>(a.v);
  auto v_offset = [&](int64_t row) {  // v[row, h, the block's first row]
    return sp.batch * a.v_sb + row * a.v_st + static_cast<int64_t>(h) * D + slice * SM::kRows;
  };
  const int c0 = lane * PC;  // the lane's preprocessing columns
  if (a.vec_q && a.vec_k && a.vec_g && a.vec_v) {
    constexpr int kPieces = D / 8;  // 16-byte pieces of a bf16 row
    uint32_t beta_bits[kPerWarp];
#pragma unroll
    for (int u = 0; u < kPerWarp; ++u) {
      const int i = u * kWarps + warp;
      if (i < nt) {
        const int64_t row = mapped_row(a, sp.bos + first + i);
        unsigned char* tb = reinterpret_cast<unsigned char*>(&sm.tok[i]);
        const bf16* q = a.q + sp.batch * a.q_sb + row * a.q_st + static_cast<int64_t>(h) * D;
        const bf16* k = a.k + sp.batch * a.k_sb + row * a.k_st + static_cast<int64_t>(h) * D;
        const int64_t go = sp.batch * a.g_sb + row * a.g_st + static_cast<int64_t>(h) * D;
        for (int p = lane; p < kPieces; p += 32) {
          cp_async<16>(tb + 8 * D + 16 * p, q + 8 * p);
          cp_async<16>(tb + 10 * D + 16 * p, k + 8 * p);
        }
        if (a.g_fp32) {
          for (int p = lane; p < 2 * kPieces; p += 32)
            cp_async<16>(tb + 16 * p, static_cast<const float*>(a.g) + go + 4 * p);
        } else {
          for (int p = lane; p < kPieces; p += 32)
            cp_async<16>(tb + 16 * p, static_cast<const bf16*>(a.g) + go + 8 * p);
        }
        if (lane < SM::kRows / 8) cp_async<16>(&sm.v[i][8 * lane], vsrc + v_offset(row) + 8 * lane);
        beta_bits[u] = load_beta_bits(a, sp.batch, row, h);
      }
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();  // a warp's tokens were copied by all of its lanes
#pragma unroll
    for (int u = 0; u < kPerWarp; ++u) {
      const int i = u * kWarps + warp;
      if (i < nt) {
        const unsigned char* tb = reinterpret_cast<const unsigned char*>(&sm.tok[i]);
        TokenRaw<D> t;
        load_bf16_run<PC>(reinterpret_cast<const bf16*>(tb + 8 * D) + c0, true, t.q);
        load_bf16_run<PC>(reinterpret_cast<const bf16*>(tb + 10 * D) + c0, true, t.k);
        if (a.g_fp32) {
#pragma unroll
          for (int c = 0; c < PC; ++c) t.g[c] = reinterpret_cast<const float*>(tb)[c0 + c];
        } else {
          load_bf16_run<PC>(reinterpret_cast<const bf16*>(tb) + c0, true, t.g);
        }
        t.beta = a.beta_fp32 ? __uint_as_float(beta_bits[u]) : bf16_bits_lo(beta_bits[u]);
        __syncwarp();  // every lane has read its raw columns before any lane writes over them
        const float b = preprocess_token<D>(a, t, expA, dtb, sm.tok[i], lane);
        if (lane == 0) sm.beta[i] = b;
      }
    }
  } else {  // rows not 16-byte aligned (rare): a token at a time, its loads waited for
#pragma unroll 1
    for (int u = 0; u < kPerWarp; ++u) {
      const int i = u * kWarps + warp;
      if (i < nt) {
        const int64_t row = mapped_row(a, sp.bos + first + i);
        TokenRaw<D> t;
        load_token(a, sp.batch, row, h, lane, t);
        const int64_t vo = v_offset(row);
        sm.v[i][lane] = vsrc[vo + lane];
        sm.v[i][lane + 32] = vsrc[vo + lane + 32];
        const float b = preprocess_token<D>(a, t, expA, dtb, sm.tok[i], lane);
        if (lane == 0) sm.beta[i] = b;
      }
    }
  }
  __syncthreads();

  int lrow[kR];  // the thread's rows within the block's 64
#pragma unroll
  for (int q = 0; q < kR; ++q) lrow[q] = vrow[q] - slice * SM::kRows;
  for (int i = 0; i < nt; ++i) {
    float v[kR];
#pragma unroll
    for (int q = 0; q < kR; ++q) v[q] = bf16_bits_lo(sm.v[i][lrow[q]]);
    advance_rows_state_only<D, kR>(s, sm.tok[i], j, sm.beta[i], v);
  }
#pragma unroll
  for (int q = 0; q < kR; ++q) store_state_row<D, true>(base + vrow[q] * D, j, s[q]);
}

}  // namespace sm90
}  // namespace flashkda
