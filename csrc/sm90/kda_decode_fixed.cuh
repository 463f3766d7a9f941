// decode_fixed_layout_kernel: decode / speculative decode of a few requests in the serving engines'
// canonical layout (q, k, v, g, out contiguous [N, T, H, D], beta [N, T, H], 1 <= T <= 4 tokens a
// request, bf16 g and beta, int32 indices; fixed_layout_call).  Like decode_latency_kernel
// (kda_decode_latency.cuh, whose grid and launch it shares) a call is one chain of dependent round
// trips, [wait] -> read slot -> state -> math -> stores -> [grid done]; at batch 1 each scheduler runs
// one warp, so every instruction on that chain is exposed latency, and this kernel keeps the chain's
// executed path short:
//   - 32-bit token offsets and no layout or dtype branches (a request's tokens start at n T);
//   - plain decode of one token (kPlainOne, its own instantiation with no spec or several-token code):
//     no block barrier.  Every warp preprocesses the token itself: q and k of the thread's own 16
//     columns stay in registers with their norms over the row's lanes; only the decay is split over
//     the lanes (D / 32 columns each) and exchanged through the warp's buffer;
//   - otherwise (spec decode, or several tokens): warp t preprocesses token t (D / 32 columns a
//     lane), one block barrier publishes them;
//   - the checker blocks' code is out of line (fixed_checker_block), so the state blocks' path is
//     contiguous from the entry, and a plain call of one request has no checker block at all;
//   - the request's checks (read slot, every index entry) are loaded by every thread, so the error
//     code is the same in the whole block without a reduction, and thread 0 writes the error words.
// Measured in bench/latency_floor.cu (H200, batch 1, H16, fp32 pool, per call in a graph of 20): the
// bare index -> state -> store chain 1.7 us, a whole step written with nothing else 1.70 us (2.27 us
// when each lane computes the decay of its own 16 columns: 4x the SFU work), the latency kernel 3.4 us,
// this kernel 2.41-2.45 us (perf-notes d9).
//
// Grid: LatencyLayout (one block per (request, head, row slice), then ceil(N / 4) checker blocks for
// the pool-row conflicts, none for plain N = 1; at most kDecodeErrorSlots blocks).  State block: 4 warps, no
// roles; each thread holds 16 columns of kR state rows in registers (kda_token_recurrence.cuh layout). Shared
// memory: 4 TokenBuf (6.2 KB at D = 128).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "sm90/kda_decode_latency.cuh"  // the bit loaders, and the kernels for the other calls

namespace flashkda {
namespace sm90 {

constexpr int kFixedMaxTokens = kLatencyWarps;  // tokens a request (spec decode: 1 + 3 drafts), one a warp
template <int D, int kR>
using FixedLayout = LatencyLayout<D, kR>;  // the same grid as the latency kernel

template <int D>
struct FixedSmem {
  // Preprocessed tokens: T = 1, warp w's own copy in tok[w]; T > 1, token t (by warp t) in tok[t].
  TokenBuf<D> tok[kLatencyWarps];
  float beta[kLatencyWarps];  // b of tok[w]
  int err;                    // checker blocks' reduction
  uint32_t param_touch;       // touch_decode_params' sum (never read)
};

// Whether a call can run on the fixed-layout kernel (host side; the grid size is checked separately):
// the serving engines' canonical decode tensors, so that the kernel's executed path has no runtime
// layout or dtype branches and 32-bit token offsets (a batch-1 call is one warp per scheduler: every
// instruction on the chain is exposed latency; ncu: ~770 executed instructions a warp in the generic
// latency kernel).  q, k, v, g, out contiguous [N, T, H, D] with 16-byte aligned rows, g and beta bf16,
// beta [N, T, H], int32 indices and num_accepted_tokens, 1 <= T <= 4.
inline bool fixed_layout_call(const DecodeArgs& a, int D) {
  if (a.cu_seqlens != nullptr || a.token_rows != nullptr || a.T < 1 || a.T > kFixedMaxTokens) return false;
  if (a.g_fp32 || a.beta_fp32 || a.idx_int64 || (a.spec && a.acc_int64)) return false;
  if (!a.vec_q || !a.vec_k || !a.vec_g) return false;
  const int64_t st = static_cast<int64_t>(a.H) * D, sb = a.T * st;
  if (a.q_st != st || a.k_st != st || a.v_st != st || a.g_st != st || a.out_st != st) return false;
  if (a.q_sb != sb || a.k_sb != sb || a.v_sb != sb || a.g_sb != sb || a.out_sb != sb) return false;
  if (a.beta_st != a.H || a.beta_sb != a.T * a.H) return false;
  return static_cast<int64_t>(a.N) * sb < (int64_t{1} << 31) &&
         static_cast<int64_t>(a.N) * a.slots < (int64_t{1} << 31);
}

// One token's inputs for one lane (D / 32 columns: bf16 pairs of q, k, g) and beta, as loaded bits.
template <int D>
struct FixedTokenBits {
  static constexpr int kPairs = D / 64;
  uint32_t q[kPairs], k[kPairs], g[kPairs];
  uint32_t beta;
};

// Loads one token's bits for one lane; q and k only when `with_qk` (T = 1 loads the thread's own
// columns of q and k instead, in the row-group layout).
template <int D>
__device__ __forceinline__ void load_fixed_token(const DecodeArgs& a, int tok_head, int lane, bool with_qk,
                                                 FixedTokenBits<D>& t) {
  constexpr int P = FixedTokenBits<D>::kPairs;
  const int off = tok_head * D + lane * 2 * P;  // 32-bit: checked by fixed_layout_call
  const uint32_t* q = reinterpret_cast<const uint32_t*>(a.q + off);
  const uint32_t* k = reinterpret_cast<const uint32_t*>(a.k + off);
  const uint32_t* g = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(a.g) + off);
  if constexpr (P == 2) {
    const uint2 gg = *reinterpret_cast<const uint2*>(g);
    t.g[0] = gg.x, t.g[1] = gg.y;
    if (with_qk) {
      const uint2 qq = *reinterpret_cast<const uint2*>(q), kk = *reinterpret_cast<const uint2*>(k);
      t.q[0] = qq.x, t.q[1] = qq.y, t.k[0] = kk.x, t.k[1] = kk.y;
    }
  } else {
    t.g[0] = g[0];
    if (with_qk) t.q[0] = q[0], t.k[0] = k[0];
  }
  t.beta = static_cast<const unsigned short*>(a.beta)[tok_head];
}

// Stores a lane's PC = D / 32 consecutive columns (times `scale`) as one float4 or float2.
template <int PC>
__device__ __forceinline__ void store_lane_columns(float* p, const float (&x)[PC], float scale) {
  static_assert(PC == 2 || PC == 4, "columns per lane");
  if constexpr (PC == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0] * scale, x[1] * scale, x[2] * scale, x[3] * scale);
  } else {
    *reinterpret_cast<float2*>(p) = make_float2(x[0] * scale, x[1] * scale);
  }
}

// The decay of the lane's D / 32 columns into buf.decay, and beta (returned).  The bounded gate is
// folded as in chunk_prepare: log2 decay = lb2 / (1 + 2^(c1 (g + dt_bias))), c1 = -exp(A_log) log2 e,
// lb2 = lower_bound log2 e (one FFMA, two SFU ops and an FMUL a column).
template <int D>
__device__ __forceinline__ float prep_fixed_decay(const DecodeArgs& a, const FixedTokenBits<D>& t, float expA,
                                                  const float (&dtb)[D / 32], TokenBuf<D>& buf, int lane) {
  constexpr int P = FixedTokenBits<D>::kPairs, PC = 2 * P;
  float d[PC], g[PC];
#pragma unroll
  for (int i = 0; i < P; ++i) g[2 * i] = bf16_bits_lo(t.g[i]), g[2 * i + 1] = bf16_bits_hi(t.g[i]);
  // One branch on the mode for all columns (a branch a column puts the other modes' code, ~50
  // instructions of softplus each, between the bounded gate's columns on the chain).
  if (__builtin_expect(a.gate_mode == kGateBounded, 1)) {
    const float c1 = -expA * kLog2e, lb2 = a.lower_bound * kLog2e;
#pragma unroll
    for (int e = 0; e < PC; ++e) d[e] = fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (g[e] + dtb[e]))));
  } else {
#pragma unroll
    for (int e = 0; e < PC; ++e)
      d[e] = fast_exp2(gate_log_decay(a.gate_mode, g[e], expA, dtb[e], a.lower_bound) * kLog2e);
  }
  store_lane_columns<PC>(&buf.decay[lane * PC], d, 1.f);
  const float x = bf16_bits_lo(t.beta);
  return a.beta_sigmoid ? fast_rcp(1.f + fast_exp2(-x * kLog2e)) : x;
}

// Preprocesses one whole token into `buf` (T > 1; the same quantities as preprocess_token<D, true>):
// the decay and beta as prep_fixed_decay, and q, k of the lane's D / 32 columns with their norms and
// k.q reduced over the warp.  Returns beta.
template <int D>
__device__ __forceinline__ float prep_fixed_token(const DecodeArgs& a, const FixedTokenBits<D>& t, float expA,
                                                  const float (&dtb)[D / 32], TokenBuf<D>& buf, int lane) {
  constexpr int P = FixedTokenBits<D>::kPairs, PC = 2 * P;
  const float beta = prep_fixed_decay<D>(a, t, expA, dtb, buf, lane);
  float q[PC], k[PC];
  float sq = 0.f, sk = 0.f, kq = 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    q[2 * i] = bf16_bits_lo(t.q[i]), q[2 * i + 1] = bf16_bits_hi(t.q[i]);
    k[2 * i] = bf16_bits_lo(t.k[i]), k[2 * i + 1] = bf16_bits_hi(t.k[i]);
  }
#pragma unroll
  for (int e = 0; e < PC; ++e) sq += q[e] * q[e], sk += k[e] * k[e], kq += q[e] * k[e];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    sk += __shfl_xor_sync(0xffffffffu, sk, o);
    kq += __shfl_xor_sync(0xffffffffu, kq, o);
  }
  float qs = a.scale, ks = 1.f;
  if (a.l2norm) {
    qs *= rsqrtf(sq + 1e-6f);  // x / sqrt(sum x^2 + 1e-6), as the other kernels
    ks = rsqrtf(sk + 1e-6f);
  }
  store_lane_columns<PC>(&buf.q[lane * PC], q, qs);
  store_lane_columns<PC>(&buf.k[lane * PC], k, ks);
  if (lane == 0) buf.kq = kq * qs * ks;
  return beta;
}

// The read slot of request m in the fixed layout when m is valid and not padded (the checks of
// decode_read_slot for len = T, int32 indices and counts), else -1.
__device__ __forceinline__ int fixed_valid_read_slot(const DecodeArgs& a, int m) {
  const int S = static_cast<int>(a.slots);
  int col = 0;
  if (a.spec) {
    const int acc = static_cast<const int*>(a.num_accepted)[m];
    if (acc < 1 || acc > S || a.T > S) return -1;
    col = acc - 1;
  }
  const int r = static_cast<const int*>(a.idx)[m * S + col];
  return r < a.pool_rows ? r : -1;
}

// decode_request_conflicts for the fixed layout (len = T <= 4 tokens, int32 indices and counts):
// the same rules with 32-bit offsets, request n's write slots in registers and no division (the
// generic check's 64-bit index arithmetic made a spec checker block as long as the state chain).
__device__ inline bool fixed_request_conflicts(const DecodeArgs& a, int n, int lane) {
  const int read = fixed_valid_read_slot(a, n);
  if (read < 0) return false;
  const int T = static_cast<int>(a.T), S = static_cast<int>(a.slots);
  const int* idx = static_cast<const int*>(a.idx);
  int wn[kFixedMaxTokens];
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) wn[t] = a.spec && t < T ? idx[n * S + t] : -1;
  bool conflict = false;
#pragma unroll
  for (int t1 = 0; t1 < kFixedMaxTokens; ++t1) {
#pragma unroll
    for (int t2 = t1 + 1; t2 < kFixedMaxTokens; ++t2) conflict |= wn[t1] >= 0 && wn[t1] == wn[t2];
  }
  for (int m = lane; m < a.N; m += 32) {
    if (m == n) continue;
    const int rm = fixed_valid_read_slot(a, m);
    if (rm < 0) continue;
    if (!a.spec) {  // 1-D: each request reads and writes its own row
      conflict |= rm == read;
      continue;
    }
#pragma unroll
    for (int u = 0; u < kFixedMaxTokens; ++u) {
      conflict |= wn[u] >= 0 && wn[u] == rm;  // n writes the row m reads
      const int wm = u < T ? idx[m * S + u] : -1;
      if (wm < 0) continue;
      conflict |= wm == read;  // m writes the row n reads
#pragma unroll
      for (int t = 0; t < kFixedMaxTokens; ++t) conflict |= wn[t] == wm;  // both write it
    }
  }
  return __any_sync(0xffffffffu, conflict);
}

// Checker block c of C of the fixed-layout kernels (this one: the blocks after the state blocks; the
// stream kernel, kda_decode_stream.cuh: the blocks before them): warp w checks requests 4 c + w,
// 4 c + w + 4 C, ...  Out of line, so that the state blocks' code is contiguous from the entry.
static __device__ __noinline__ void fixed_checker_block(const DecodeArgs& a, int c, int C, int* err_sm) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int stride = C * kLatencyWarps;
  int err = 0;
  for (int n = c * kLatencyWarps + warp; n < a.N; n += stride) {
    if (fixed_request_conflicts(a, n, lane)) err = static_cast<int>(DeviceError::kStateSlotConflict);
  }
  if (err != 0) atomicCAS(err_sm, 0, err);
  __syncthreads();
  if (tid == 0) write_decode_error_words(a, *err_sm);
}

// kPlainOne: compiled for plain decode of one token a request (T = 1, 1-D indices: the serving step
// of every running request), with neither the spec code nor the several-token path in the binary;
// otherwise T and spec are runtime values and every call takes the several-token path (warp t
// preprocesses token t, one block barrier), T = 1 included.
template <int D, bool kF32, int kR, bool kPlainOne>
// 4 blocks a SM: a 128-register cap.
__global__ void __launch_bounds__(kLatencyThreads, 4)
    decode_fixed_layout_kernel(const __grid_constant__ DecodeArgs a, const int64_t state_blocks) {
  using L = FixedLayout<D, kR>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = D / 32;
  __shared__ __align__(16) FixedSmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  decode_block_setup(a, &sm.err, &sm.param_touch);

  const int b = static_cast<int>(blockIdx.x);  // < kDecodeErrorSlots
  if (b >= state_blocks) {
    fixed_checker_block(a, b - static_cast<int>(state_blocks), static_cast<int>(gridDim.x - state_blocks),
                        &sm.err);
    return;
  }

  // ------------------------------------------------------------------ state block
  // b = (n H + h) kSlices + slice.  n = nh / H through the approximate fp32 reciprocal: the grid fits
  // one wave (nh < 1024, H <= 256), so (nh + 0.5) / H is at least 1 / 512 from an integer and the
  // reciprocal and product err by < 1e-3.  An integer division would put ~25 dependent instructions
  // in front of the first load.
  const int nh = b / L::kSlices, slice = b % L::kSlices;
  const int n = static_cast<int>((static_cast<float>(nh) + 0.5f) * fast_rcp(static_cast<float>(a.H)));
  const int h = nh - n * static_cast<int>(a.H);
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = L::row(slice, q, warp, lane);
  const int j = lane % L::kLanesPerRow;
  const int T = kPlainOne ? 1 : static_cast<int>(a.T), S = static_cast<int>(a.slots);
  const bool spec = !kPlainOne && a.spec;
  const int* idx = static_cast<const int*>(a.idx);
  StateT* pool = static_cast<StateT*>(a.pool);
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;

  // 1. Every load that depends on n alone, before any loaded value is used (a use stalls the warp):
  // the read slot's first load, the write slots (spec), the gate parameters, this warp's token (T = 1:
  // every warp preprocesses the token itself; T > 1: warp t preprocesses token t) and the thread's
  // value entries of all T tokens.
  const int first = spec ? static_cast<const int*>(a.num_accepted)[n] : idx[n];
  int wslot[kFixedMaxTokens];
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) wslot[t] = spec && t < T && t < S ? idx[n * S + t] : -1;
  const bool gated = a.gate_mode != kGatePrecomputed;
  const float a_log = gated ? a.A_log[h] : 0.f;
  float dtb[PC];
#pragma unroll
  for (int i = 0; i < PC; ++i) dtb[i] = gated ? a.dt_bias[h * D + lane * PC + i] : 0.f;
  const int my_t = kPlainOne ? 0 : warp;
  FixedTokenBits<D> bits;
  if (my_t < T) load_fixed_token<D>(a, (n * T + my_t) * a.H + h, lane, !kPlainOne, bits);
  uint2 qrow[4], krow[4];  // kPlainOne: the q, k columns of the thread's state rows (4 bf16 each)
  if constexpr (kPlainOne) {
    const int base = (n * a.H + h) * D;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      qrow[i] = *reinterpret_cast<const uint2*>(a.q + base + token_col<D>(j, i));
      krow[i] = *reinterpret_cast<const uint2*>(a.k + base + token_col<D>(j, i));
    }
  }
  uint32_t vb[kR][kFixedMaxTokens];
  const unsigned short* v = reinterpret_cast<const unsigned short*>(a.v);
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) {
    if (t < T) {
#pragma unroll
      for (int q = 0; q < kR; ++q) vb[q][t] = v[((n * T + t) * a.H + h) * D + vrow[q]];
    }
  }
  // 2. The read slot (spec: idx[n, acc - 1], a second round trip), its checks, then the state rows
  // (clamped into the pool; used only if every check passes).  Every thread loads and checks the
  // same values, so err is the same in the whole block.
  int err = 0, read = first;
  if (spec) {
    if (first < 1 || first > S) err = static_cast<int>(DeviceError::kBadAcceptedCount);
    read = idx[n * S + (err == 0 ? first - 1 : 0)];
    if (err == 0 && read >= 0 && T > S) err = static_cast<int>(DeviceError::kBadStateIndex);
  }
  if (err == 0 && read >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
  float s[kR][16];
  if (read >= 0) {
    const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
#pragma unroll
    for (int q = 0; q < kR; ++q)
      load_state_row<D, kF32>(pool + (r * head_rows + h * D + vrow[q]) * D, j, s[q]);
  }
  // 3. While the state is in flight: the other index entries (spec: all S of the row) and the token.
  if (spec && err == 0) {
    for (int e = 0; e < S; ++e) {
      if (idx[n * S + e] >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
    }
  }
  const float expA = gated ? expf(a_log) : 0.f;
  bf16* out = a.out + h * D;
  if constexpr (kPlainOne) {
    // One token: every warp its own copy, no block barrier.  The decay is split over the lanes (D / 32
    // columns each: every lane computing its own 16 would be 4x the SFU work, measured +0.56 us at
    // batch 1) and exchanged through the warp's buffer; q, k and their norms stay in the row group.
    const float beta = prep_fixed_decay<D>(a, bits, expA, dtb, sm.tok[warp], lane);
    float4 q4[4], k4[4];  // unscaled: qs and ks are applied after the reductions
    float sq = 0.f, sk = 0.f, kq = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q4[i] = make_float4(bf16_bits_lo(qrow[i].x), bf16_bits_hi(qrow[i].x), bf16_bits_lo(qrow[i].y),
                          bf16_bits_hi(qrow[i].y));
      k4[i] = make_float4(bf16_bits_lo(krow[i].x), bf16_bits_hi(krow[i].x), bf16_bits_lo(krow[i].y),
                          bf16_bits_hi(krow[i].y));
      const float qc[4] = {q4[i].x, q4[i].y, q4[i].z, q4[i].w}, kc[4] = {k4[i].x, k4[i].y, k4[i].z, k4[i].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) sq += qc[c] * qc[c], sk += kc[c] * kc[c], kq += qc[c] * kc[c];
    }
#pragma unroll
    for (int off = L::kLanesPerRow / 2; off > 0; off >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, off);
      sk += __shfl_xor_sync(0xffffffffu, sk, off);
      kq += __shfl_xor_sync(0xffffffffu, kq, off);
    }
    float qs = a.scale, ks = 1.f;
    if (a.l2norm) {
      qs *= rsqrtf(sq + 1e-6f);
      ks = rsqrtf(sk + 1e-6f);
    }
    __syncwarp();
    if (err == 0) {
      if (read < 0) {  // padded request: zero its outputs, touch no state
#pragma unroll
        for (int r = 0; r < kR; ++r)
          if (j == 0) out[n * head_rows + vrow[r]] = __float2bfloat16_rn(0.f);
      } else {
        float4 d4[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          d4[i] = *reinterpret_cast<const float4*>(&sm.tok[warp].decay[token_col<D>(j, i)]);
        float vt[kR], o[kR];
#pragma unroll
        for (int r = 0; r < kR; ++r) vt[r] = bf16_bits_lo(vb[r][0]);
        advance_rows_columns<D, kR>(s, d4, k4, q4, qs, ks, kq, beta, vt, o);
        const int64_t w = spec ? wslot[0] : read;
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          if (j == 0) out[n * head_rows + vrow[r]] = __float2bfloat16_rn(o[r]);
          if (w >= 0) store_state_row<D, kF32>(pool + (w * head_rows + h * D + vrow[r]) * D, j, s[r]);
        }
      }
    }
    if (tid == 0) write_decode_error_words(a, err);
  } else {
    // Several tokens: warp t preprocesses token t, one block barrier publishes them.
    float beta = 0.f;
    if (my_t < T) beta = prep_fixed_token<D>(a, bits, expA, dtb, sm.tok[warp], lane);  // same in every lane
    if (lane == 0) sm.beta[warp] = beta;
    __syncthreads();

    if (err == 0) {
      if (read < 0) {  // padded request: zero its outputs, touch no state
        if (j == 0) {
          for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int q = 0; q < kR; ++q) out[(n * T + t) * head_rows + vrow[q]] = __float2bfloat16_rn(0.f);
          }
        }
      } else {
#pragma unroll
        for (int t = 0; t < kFixedMaxTokens; ++t) {
          if (t >= T) break;
          float vt[kR], o[kR];
#pragma unroll
          for (int q = 0; q < kR; ++q) vt[q] = bf16_bits_lo(vb[q][t]);
          advance_rows<D, kR>(s, sm.tok[t], j, sm.beta[t], vt, o);
#pragma unroll
          for (int q = 0; q < kR; ++q) {
            if (j == 0) out[(n * T + t) * head_rows + vrow[q]] = __float2bfloat16_rn(o[q]);
            if (wslot[t] >= 0)
              store_state_row<D, kF32>(
                  pool + (static_cast<int64_t>(wslot[t]) * head_rows + h * D + vrow[q]) * D, j, s[q]);
          }
        }
        if (!spec) {
#pragma unroll
          for (int q = 0; q < kR; ++q)
            store_state_row<D, kF32>(pool + (static_cast<int64_t>(read) * head_rows + h * D + vrow[q]) * D, j,
                                     s[q]);
        }
      }
    }
    if (tid == 0) write_decode_error_words(a, err);
  }
}

// The fixed-layout kernel's rows per thread for this call: as the latency kernel's (same grid), or 0
// when the call is not in the canonical layout.
template <int D>
int fixed_rows_per_thread(const DecodeArgs& a) {
  return fixed_layout_call(a, D) ? latency_rows_per_thread<D>(a) : 0;
}

template <int D, bool kF32, int kR>
Status launch_decode_fixed_layout(const DecodeArgs& a, bool pdl, cudaStream_t stream) {
  if (!a.spec && a.T == 1) {
    return launch_one_wave_decode<D, kR>(decode_fixed_layout_kernel<D, kF32, kR, true>,
                                         "decode_fixed_layout_kernel", a, pdl, stream);
  }
  return launch_one_wave_decode<D, kR>(decode_fixed_layout_kernel<D, kF32, kR, false>,
                                       "decode_fixed_layout_kernel", a, pdl, stream);
}

}  // namespace sm90
}  // namespace flashkda
