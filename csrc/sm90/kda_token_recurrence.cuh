// Token-by-token KDA recurrence (spec section 2) on state rows held in registers.  Shared by the
// decode / speculative-decode kernels (kda_decode_latency.cuh, kda_decode_pipelined.cuh) and the
// prefill's checkpoint_advance kernel (kda_checkpoint_advance.cuh).
//
// Why row-parallel: every row v of S (V x K) evolves on its own,
//   s_v <- s_v * exp(a);  u_v = b (v_v - s_v . k);  s_v <- s_v + u_v k;  o_v = s_v . (scale q),
// so a state can be split over any number of threads and blocks with no exchange, and a decode step
// is a pure stream of the state through registers (read once, written once per write slot).
//
// Thread layout: one row of D fp32 is split over LPR = D / 16 adjacent lanes, 16 columns each; lane
// j of a row group holds columns 4 j + 4 LPR i + c (i, c < 4), so each of the four float4 loads of a
// row group reads one contiguous segment of 4 LPR floats of the row (coalesced).  A warp covers
// 32 / LPR rows at a time and each thread holds two rows, so a block of kWarps warps holds
// kRowsPerBlock rows (at the decode kernels' kTokenWarps = 4: 32 for D = 128, 64 for D = 64).
// A token is preprocessed by one warp (q, k, gate; D / 32 columns per lane, l2 norms by warp
// shuffles) into a shared TokenBuf, from which every row group runs it.
#pragma once

#include "sm90/kda_common.cuh"

namespace flashkda {
namespace sm90 {

constexpr int kTokenWarps = 4;

template <int D, int kWarps = kTokenWarps>
struct TokenLayout {
  static_assert(D == 64 || D == 128, "head dim");
  static constexpr int kLanesPerRow = D / 16;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  // Each thread holds two rows (32 fp32 registers): twice the bytes per dependent-latency chain of
  // a block, which is what bounds a decode step (measured: 1 row per thread reached ~50% of copy
  // bandwidth at batch 64-256).
  static constexpr int kRowsPerThread = 2;
  static constexpr int kRowsPerBlock = kRowsPerThread * kWarps * kRowsPerWarp;  // 32 / 64 at 4 warps
  static constexpr int kColsPerLane = D / 32;                                   // preprocessing split
  // Row r (< kRowsPerThread) of the thread: slice base + r * kRowsPerBlock / 2 + warp rows + lane row.
  __device__ static int row(int slice, int r, int warp, int lane) {
    return slice * kRowsPerBlock + r * (kRowsPerBlock / kRowsPerThread) + warp * kRowsPerWarp +
           lane / kLanesPerRow;
  }
};

// Per-warp shared buffer of one preprocessed token.
template <int D>
struct TokenBuf {
  float q[D];      // scale * l2norm(q)
  float k[D];      // l2norm(k)
  float decay[D];  // exp(a)
  float kq;        // k . q of the two above, when asked for (advance_rows: o = S' q + u (k . q))
  float pad[3];    // keeps arrays of TokenBuf 16-byte aligned for the float4 reads
};

// The state columns a lane owns: 4 j + 4 LPR i + c.
template <int D>
__device__ inline int token_col(int j, int i) {
  return 4 * j + 4 * TokenLayout<D>::kLanesPerRow * i;
}

template <int PC>
__device__ inline void load_bf16_run(const bf16* p, bool vec, float (&x)[PC]) {
  static_assert(PC == 2 || PC == 4, "columns per lane");
  if (vec) {
    if constexpr (PC == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
    } else {
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
      x[0] = a.x, x[1] = a.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < PC; ++i) x[i] = __bfloat162float(p[i]);
  }
}

// Raw inputs of one token for one warp: D / 32 columns of q, k, g per lane and beta, issued
// together so their latencies overlap.
template <int D>
struct TokenRaw {
  float q[D / 32], k[D / 32], g[D / 32];
  float beta;
};

template <int D, class A>
__device__ inline void load_token(const A& a, int64_t batch, int64_t row, int h, int lane, TokenRaw<D>& t) {
  constexpr int PC = D / 32;
  const int c0 = lane * PC;
  load_bf16_run<PC>(a.q + batch * a.q_sb + row * a.q_st + h * D + c0, a.vec_q, t.q);
  load_bf16_run<PC>(a.k + batch * a.k_sb + row * a.k_st + h * D + c0, a.vec_k, t.k);
  const int64_t go = batch * a.g_sb + row * a.g_st + h * D + c0;
  if (a.g_fp32) {
#pragma unroll
    for (int i = 0; i < PC; ++i) t.g[i] = static_cast<const float*>(a.g)[go + i];
  } else {
    load_bf16_run<PC>(static_cast<const bf16*>(a.g) + go, a.vec_g, t.g);
  }
  t.beta = load_scalar(a.beta, a.beta_fp32, batch * a.beta_sb + row * a.beta_st + h);
}

// Per-head gate parameters of the lane's D / 32 preprocessing columns: exp(A_log[h]) and dt_bias
// (unused by the precomputed gate, whose A_log / dt_bias may be null).
template <int D, class A>
__device__ inline void load_gate_params(const A& a, int h, int lane, float* expA, float (&dtb)[D / 32]) {
  constexpr int PC = D / 32;
  const bool gated = a.gate_mode != kGatePrecomputed;
  *expA = gated ? expf(a.A_log[h]) : 0.f;
#pragma unroll
  for (int i = 0; i < PC; ++i) dtb[i] = gated ? a.dt_bias[h * D + lane * PC + i] : 0.f;
}

// Preprocesses a loaded token into a shared buffer (spec section 2) and returns b.  kWithKq: also
// buf.kq = k . q of the buffered (normalised, scaled) q and k, for advance_rows: the raw dot product
// reduces in the same shuffle rounds as the two norms, then takes both scales.
template <int D, bool kWithKq = false, class A>
__device__ inline float preprocess_token(const A& a, const TokenRaw<D>& t, float expA_h,
                                         const float (&dtb)[D / 32], TokenBuf<D>& buf, int lane) {
  constexpr int PC = D / 32;
  float q[PC], k[PC], d[PC];
  float sq = 0.f, sk = 0.f, kq = 0.f;
#pragma unroll
  for (int i = 0; i < PC; ++i) {
    q[i] = t.q[i];
    k[i] = t.k[i];
    sq += q[i] * q[i];
    sk += k[i] * k[i];
    if constexpr (kWithKq) kq += q[i] * k[i];
    d[i] = fast_exp2(gate_log_decay(a.gate_mode, t.g[i], expA_h, dtb[i], a.lower_bound) * kLog2e);
  }
  if (a.l2norm || kWithKq) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
      if constexpr (kWithKq) kq += __shfl_xor_sync(0xffffffffu, kq, o);
    }
  }
  float qs = a.scale, ks = 1.f;
  if (a.l2norm) {
    qs *= rsqrtf(sq + 1e-6f);  // x / sqrt(sum x^2 + 1e-6), as the prefill
    ks = rsqrtf(sk + 1e-6f);
  }
  const int c0 = lane * PC;
#pragma unroll
  for (int i = 0; i < PC; ++i) {
    buf.q[c0 + i] = q[i] * qs;
    buf.k[c0 + i] = k[i] * ks;
    buf.decay[c0 + i] = d[i];
  }
  if constexpr (kWithKq) {
    if (lane == 0) buf.kq = kq * qs * ks;
  }
  return a.beta_sigmoid ? sigmoidf_(t.beta) : t.beta;
}

// One token on all kR rows of the thread at once, from the token's decay, k and q columns of the
// thread (token_col order): the rows' dot products run interleaved with two partial sums each
// (independent chains instead of one 16-long dependent chain per row).  o[r] = output of row r.
// The output needs no second reduction after the update: with S' = d S (decayed row) and
// u = b (v - S' k), the new row is S' + u k^T, so o = (S' + u k^T) q = S' q + u (k . q); S' k and S' q
// reduce together (one shuffle round trip per token instead of two on the dependent chain).
// k and q may come unscaled, with their scales ks and qs applied after the reduction (kq = k . q of
// the unscaled columns); callers whose k and q are already scaled pass ks = qs = 1, which the compiler
// folds away (exact).
template <int D, int kR>
__device__ __forceinline__ void advance_rows_columns(float (&s)[kR][16], const float4 (&d4)[4],
                                                     const float4 (&k4)[4], const float4 (&q4)[4], float qs,
                                                     float ks, float kq, float b, const float (&v)[kR],
                                                     float (&o)[kR]) {
  constexpr int LPR = TokenLayout<D>::kLanesPerRow;
  float pred[kR], sq[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) {
    float p0 = 0.f, p1 = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[q][4 * i + 0] *= d4[i].x;
      s[q][4 * i + 1] *= d4[i].y;
      s[q][4 * i + 2] *= d4[i].z;
      s[q][4 * i + 3] *= d4[i].w;
      p0 += s[q][4 * i] * k4[i].x + s[q][4 * i + 2] * k4[i].z;
      p1 += s[q][4 * i + 1] * k4[i].y + s[q][4 * i + 3] * k4[i].w;
      o0 += s[q][4 * i] * q4[i].x + s[q][4 * i + 2] * q4[i].z;
      o1 += s[q][4 * i + 1] * q4[i].y + s[q][4 * i + 3] * q4[i].w;
    }
    pred[q] = p0 + p1;
    sq[q] = o0 + o1;
  }
#pragma unroll
  for (int off = LPR / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int q = 0; q < kR; ++q) {
      pred[q] += __shfl_xor_sync(0xffffffffu, pred[q], off);
      sq[q] += __shfl_xor_sync(0xffffffffu, sq[q], off);
    }
  }
#pragma unroll
  for (int q = 0; q < kR; ++q) {
    const float u = b * (v[q] - ks * pred[q]);
    o[q] = qs * sq[q] + u * ks * qs * kq;
    const float uk = u * ks;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[q][4 * i + 0] += uk * k4[i].x;
      s[q][4 * i + 1] += uk * k4[i].y;
      s[q][4 * i + 2] += uk * k4[i].z;
      s[q][4 * i + 3] += uk * k4[i].w;
    }
  }
}

// advance_rows_columns with the token from a shared buffer (scaled q and k, buf.kq): its columns are
// read once for every row of the thread.
template <int D, int kR>
__device__ inline void advance_rows(float (&s)[kR][16], const TokenBuf<D>& buf, int j, float b,
                                    const float (&v)[kR], float (&o)[kR]) {
  float4 d4[4], k4[4], q4[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = token_col<D>(j, i);
    d4[i] = *reinterpret_cast<const float4*>(&buf.decay[col]);
    k4[i] = *reinterpret_cast<const float4*>(&buf.k[col]);
    q4[i] = *reinterpret_cast<const float4*>(&buf.q[col]);
  }
  advance_rows_columns<D, kR>(s, d4, k4, q4, 1.f, 1.f, buf.kq, b, v, o);
}

// advance_rows for a state that is advanced and not read out (checkpoint_advance): q is not loaded,
// k stands in for it, so the output's sums are dead code the compiler removes.
template <int D, int kR>
__device__ inline void advance_rows_state_only(float (&s)[kR][16], const TokenBuf<D>& buf, int j, float b,
                                               const float (&v)[kR]) {
  float4 d4[4], k4[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = token_col<D>(j, i);
    d4[i] = *reinterpret_cast<const float4*>(&buf.decay[col]);
    k4[i] = *reinterpret_cast<const float4*>(&buf.k[col]);
  }
  float o[kR];
  advance_rows_columns<D, kR>(s, d4, k4, k4, 1.f, 1.f, 0.f, b, v, o);
}

// State row I/O: 16 columns of one row, fp32 (four float4) or bf16 (four 8-byte pieces).
template <int D, bool kF32>
__device__ inline void load_state_row(const void* row, int j, float (&s)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = token_col<D>(j, i);
    if constexpr (kF32) {
      const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(row) + col);
      s[4 * i] = x.x, s[4 * i + 1] = x.y, s[4 * i + 2] = x.z, s[4 * i + 3] = x.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(row) + col);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      s[4 * i] = a.x, s[4 * i + 1] = a.y, s[4 * i + 2] = b.x, s[4 * i + 3] = b.y;
    }
  }
}

// kStream: streaming stores (st.global.cs, evict-first): the many-request kernels write states that the
// call does not read again, so their lines need not displace the states still to be read.  They take it
// for fp32 pools only (kStreamStateStores): on an H100, spec 1+3 fp32 -0.8% at N = 64 and 256, plain
// fp32 at parity; bf16 pools split (N = 64 -1%, N = 256 +1%, every round; perf-notes v37).
template <bool kF32>
constexpr bool kStreamStateStores = kF32;
template <int D, bool kF32, bool kStream = false>
__device__ inline void store_state_row(void* row, int j, const float (&s)[16]) {
  static_assert(!kStream || kF32, "streaming state stores are for fp32 pools (kStreamStateStores)");
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = token_col<D>(j, i);
    if constexpr (kF32) {
      float4* p = reinterpret_cast<float4*>(static_cast<float*>(row) + col);
      const float4 v = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
      if constexpr (kStream) {
        __stcs(p, v);
      } else {
        *p = v;
      }
    } else {
      uint2 u;
      u.x = pack_bf16(s[4 * i], s[4 * i + 1]);
      u.y = pack_bf16(s[4 * i + 2], s[4 * i + 3]);
      *reinterpret_cast<uint2*>(static_cast<bf16*>(row) + col) = u;
    }
  }
}

// A token's raw inputs as bits (decode's latency kernel; checkpoint_advance copies q, k and g by
// cp.async and takes beta's bits and the conversions from here): loaded without a conversion, so that
// no use follows each load and all of a thread's loads are in flight together; token_from_bits
// converts them where they are used.
__device__ inline float bf16_bits_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ inline float bf16_bits_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// One token's raw inputs for one warp (the lane's D / 32 columns of q, k, g, and beta), as bits.
template <int D>
struct TokenBits {
  static constexpr int PC = D / 32;
  uint32_t q[PC / 2], k[PC / 2];  // bf16 pairs
  uint32_t g[PC];                 // fp32 bits, or bf16 pairs in g[0 .. PC / 2)
  uint32_t beta;                  // fp32 bits, or bf16 bits in the low half
};

template <int PC>
__device__ inline void load_bf16_bits(const bf16* p, bool vec, uint32_t* w) {
  if (vec) {
    if constexpr (PC == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x, w[1] = u.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
  } else {  // 2-byte aligned rows (rare): packed at once
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < PC / 2; ++i)
      w[i] = static_cast<uint32_t>(h[2 * i]) | (static_cast<uint32_t>(h[2 * i + 1]) << 16);
  }
}

// beta of (batch, row, head h) as bits: fp32 bits, or bf16 bits in the low half.
template <class A>
__device__ inline uint32_t load_beta_bits(const A& a, int64_t batch, int64_t row, int h) {
  const int64_t bo = batch * a.beta_sb + row * a.beta_st + h;
  return a.beta_fp32 ? static_cast<const uint32_t*>(a.beta)[bo]
                     : static_cast<uint32_t>(static_cast<const unsigned short*>(a.beta)[bo]);
}

template <int D, class A>
__device__ inline void load_token_bits(const A& a, int64_t batch, int64_t row, int h, int lane,
                                       TokenBits<D>& t) {
  constexpr int PC = D / 32;
  const int c0 = lane * PC;
  load_bf16_bits<PC>(a.q + batch * a.q_sb + row * a.q_st + h * D + c0, a.vec_q, t.q);
  load_bf16_bits<PC>(a.k + batch * a.k_sb + row * a.k_st + h * D + c0, a.vec_k, t.k);
  const int64_t go = batch * a.g_sb + row * a.g_st + h * D + c0;
  if (a.g_fp32) {
    const uint32_t* g = static_cast<const uint32_t*>(a.g) + go;
#pragma unroll
    for (int i = 0; i < PC; ++i) t.g[i] = g[i];
  } else {
    load_bf16_bits<PC>(static_cast<const bf16*>(a.g) + go, a.vec_g, t.g);
  }
  t.beta = load_beta_bits(a, batch, row, h);
}

template <int D, class A>
__device__ inline TokenRaw<D> token_from_bits(const A& a, const TokenBits<D>& t) {
  constexpr int PC = D / 32;
  TokenRaw<D> r;
#pragma unroll
  for (int i = 0; i < PC / 2; ++i) {
    r.q[2 * i] = bf16_bits_lo(t.q[i]), r.q[2 * i + 1] = bf16_bits_hi(t.q[i]);
    r.k[2 * i] = bf16_bits_lo(t.k[i]), r.k[2 * i + 1] = bf16_bits_hi(t.k[i]);
  }
  if (a.g_fp32) {
#pragma unroll
    for (int i = 0; i < PC; ++i) r.g[i] = __uint_as_float(t.g[i]);
  } else {
#pragma unroll
    for (int i = 0; i < PC / 2; ++i) r.g[2 * i] = bf16_bits_lo(t.g[i]), r.g[2 * i + 1] = bf16_bits_hi(t.g[i]);
  }
  r.beta = a.beta_fp32 ? __uint_as_float(t.beta) : bf16_bits_lo(t.beta);
  return r;
}

}  // namespace sm90
}  // namespace flashkda
