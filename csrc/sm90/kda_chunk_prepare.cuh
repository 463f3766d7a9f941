// chunk_prepare: everything of a 64-token chunk that does not depend on the recurrent state.
//
// Grid: (chunk slots, H).  Block: 256 threads = 8 warps, no warp specialisation; phases are
// separated by __syncthreads:
//   1. load q, k, g, v, beta of the chunk (rows past the sequence end are zero: inert tokens),
//      l2-normalise q and k, gate -> log decay, cumulative decay G (log2 units, fp32), beta.
//   2. write QT = scale q 2^G, KD = k 2^(G_last - G), gamma = 2^G_last to the chunk record; keep
//      b k 2^G (bf16) for W.  Every exponent here is <= 0.
//   3. L = strict_lower(diag(b) kt kb^T) and MQK = lower_incl(qt kb^T) on tensor cores, per 16x16
//      block (I, J).  Off-diagonal blocks use the reference row 16I-1 (the row before block I):
//      A = k_i 2^(G_i - G_ref), B = k_j 2^(G_ref - G_j), both <= 1 for any gate.  Diagonal blocks use
//      row 16I+7; when a chunk's half-span exceeds kMaxHalfSpanLog2 they are summed pairwise instead.
//   4. T_inv = (I + L)^-1 in fp32: 16x16 diagonal blocks by forward substitution (one warp each),
//      then the off-diagonal blocks level by level, T_IJ = -T_II sum_M L_IM T_MJ.
//   5. W = T_inv (b kt) and UT = (T_inv (b v))^T on tensor cores, written to the record.
// Shared memory (D = 128): q, k, G fp32 3 x 33.8 KB, b v and b kt bf16 2 x 17.4 KB, L and T_inv fp32
// 2 x 16.6 KB, T_inv bf16 9.2 KB: about 179 KB, one block per SM.
#pragma once

#include "sm90/kda_common.cuh"

namespace flashkda {
namespace sm90 {

template <int D>
struct PrepareSmem {
  static constexpr int kLdF = D + 4;   // fp32 rows (q, k, G)
  static constexpr int kLdH = D + 8;   // bf16 rows (ldmatrix-friendly padding)
  static constexpr int kLdT = kChunk + 1;
  static constexpr int kLdTb = kChunk + 8;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kChunk * kLdF * 4;
  static constexpr int kG = kK + kChunk * kLdF * 4;
  static constexpr int kVb = kG + kChunk * kLdF * 4;
  static constexpr int kKtb = kVb + kChunk * kLdH * 2;
  static constexpr int kL = kKtb + kChunk * kLdH * 2;
  static constexpr int kTi = kL + kChunk * kLdT * 4;
  static constexpr int kTib = kTi + kChunk * kLdT * 4;
  static constexpr int kX = kTib + kChunk * kLdTb * 2;  // level scratch: 3 x 16 x 17 fp32
  static constexpr int kB = kX + 3 * 16 * 17 * 4;
  static constexpr int kBytes = kB + kChunk * 4;
};

constexpr int kPrepareThreads = 256;

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

// One 16x16 block (I, J) of L and MQK on tensor cores, factorised around reference row `ref`.
template <int D>
__device__ inline void lk_block_mma(const float* sQ, const float* sK, const float* sG, const float* sB, float* sL,
                                    bf16* mqk, float scale, int I, int J, int ref, int lane) {
  constexpr int ldf = PrepareSmem<D>::kLdF;
  const int g = lane >> 2, t = lane & 3;
  float accL[2][4] = {}, accM[2][4] = {};
  const float* gref = sG + ref * ldf;
#pragma unroll 2
  for (int s = 0; s < D / 16; ++s) {
    uint32_t ak[4], aq[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {  // a0: (g, 2t) a1: (g+8, 2t) a2: (g, 2t+8) a3: (g+8, 2t+8)
      const int row = 16 * I + g + (h & 1) * 8;
      const int col = 16 * s + 2 * t + (h >> 1) * 8;
      const float2 gg = *reinterpret_cast<const float2*>(sG + row * ldf + col);
      const float2 gr = *reinterpret_cast<const float2*>(gref + col);
      const float e0 = fast_exp2(gg.x - gr.x), e1 = fast_exp2(gg.y - gr.y);
      const float2 kk = *reinterpret_cast<const float2*>(sK + row * ldf + col);
      const float2 qq = *reinterpret_cast<const float2*>(sQ + row * ldf + col);
      ak[h] = pack_bf16(kk.x * e0, kk.y * e1);
      aq[h] = pack_bf16(qq.x * e0, qq.y * e1);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // b0: k rows 2t, 2t+1; b1: 2t+8, 2t+9; n col g
        const int row = 16 * J + 8 * nt + g;
        const int col = 16 * s + 2 * t + 8 * h;
        const float2 gg = *reinterpret_cast<const float2*>(sG + row * ldf + col);
        const float2 gr = *reinterpret_cast<const float2*>(gref + col);
        const float2 kk = *reinterpret_cast<const float2*>(sK + row * ldf + col);
        b[h] = pack_bf16(kk.x * fast_exp2(gr.x - gg.x), kk.y * fast_exp2(gr.y - gg.y));
      }
      mma_bf16(accL[nt], ak, b[0], b[1]);
      mma_bf16(accM[nt], aq, b[0], b[1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = 16 * I + g + 8 * hh;
      const int j = 16 * J + 8 * nt + 2 * t;
      const float l0 = (j < i) ? sB[i] * accL[nt][2 * hh] : 0.f;
      const float l1 = (j + 1 < i) ? sB[i] * accL[nt][2 * hh + 1] : 0.f;
      sL[i * PrepareSmem<D>::kLdT + j] = l0;
      sL[i * PrepareSmem<D>::kLdT + j + 1] = l1;
      const float m0 = (j <= i) ? scale * accM[nt][2 * hh] : 0.f;
      const float m1 = (j + 1 <= i) ? scale * accM[nt][2 * hh + 1] : 0.f;
      *reinterpret_cast<uint32_t*>(mqk + i * kChunk + j) = pack_bf16(m0, m1);
    }
  }
}

// Diagonal block I summed pairwise with 2^(G_i - G_j) <= 1: safe for any decay (slow path).
template <int D>
__device__ inline void lk_block_pairwise(const float* sQ, const float* sK, const float* sG, const float* sB,
                                         float* sL, bf16* mqk, float scale, int I, int lane) {
  constexpr int ldf = PrepareSmem<D>::kLdF;
  for (int ii = 0; ii < 16; ++ii) {
    const int i = 16 * I + ii;
    for (int jj = 0; jj < 16; ++jj) {
      const int j = 16 * I + jj;
      float pl = 0.f, pm = 0.f;
      if (jj <= ii) {
        for (int c = lane; c < D; c += 32) {
          const float e = fast_exp2(sG[i * ldf + c] - sG[j * ldf + c]);
          const float kj = sK[j * ldf + c] * e;
          pl += sK[i * ldf + c] * kj;
          pm += sQ[i * ldf + c] * kj;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          pl += __shfl_xor_sync(0xffffffffu, pl, o);
          pm += __shfl_xor_sync(0xffffffffu, pm, o);
        }
      }
      if (lane == 0) {
        sL[i * PrepareSmem<D>::kLdT + j] = (jj < ii) ? sB[i] * pl : 0.f;
        mqk[i * kChunk + j] = __float2bfloat16_rn((jj <= ii) ? scale * pm : 0.f);
      }
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kPrepareThreads, 1) chunk_prepare_kernel(const PrefillArgs a) {
  static_assert(D == 64 || D == 128, "head dim");
  using SM = PrepareSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  float* sQ = reinterpret_cast<float*>(smem + SM::kQ);
  float* sK = reinterpret_cast<float*>(smem + SM::kK);
  float* sG = reinterpret_cast<float*>(smem + SM::kG);
  bf16* sVb = reinterpret_cast<bf16*>(smem + SM::kVb);
  bf16* sKtb = reinterpret_cast<bf16*>(smem + SM::kKtb);
  float* sL = reinterpret_cast<float*>(smem + SM::kL);
  float* sTi = reinterpret_cast<float*>(smem + SM::kTi);
  bf16* sTib = reinterpret_cast<bf16*>(smem + SM::kTib);
  float* sX = reinterpret_cast<float*>(smem + SM::kX);
  float* sB = reinterpret_cast<float*>(smem + SM::kB);
  constexpr int ldf = SM::kLdF, ldh = SM::kLdH, ldt = SM::kLdT, ldtb = SM::kLdTb;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (blockIdx.x == 0 && blockIdx.y == 0) validate_device_inputs(a);

  int64_t n, c;
  if (!slot_to_chunk(a, blockIdx.x, &n, &c)) return;
  if (a.state_indices && load_index(a.state_indices, a.idx_int64, n) < 0) return;  // padded sequence
  const int h = blockIdx.y;
  const SeqSpan sp = sequence_span(a, n);
  const int64_t tok0 = sp.bos + c * kChunk;
  const int rows = (sp.len - c * kChunk < kChunk) ? static_cast<int>(sp.len - c * kChunk) : kChunk;
  const float scale = a.scale;
  char* rec = a.records + (static_cast<int64_t>(blockIdx.x) * a.H + h) * ChunkRecord<D>::kBytes;

  // ---- 1. load and preprocess ------------------------------------------------------------
  const float A_log_h = a.gate_mode == kGatePrecomputed ? 0.f : a.A_log[h];
  for (int e = tid; e < kChunk * (D / 8); e += kPrepareThreads) {
    const int r = e / (D / 8), c8 = (e % (D / 8)) * 8;
    float xq[8], xk[8], xg[8], xv[8];
    if (r < rows) {
      const int64_t tok = tok0 + r;
      load8_bf16(a.q + sp.batch * a.q_sb + tok * a.q_st + h * D + c8, a.vec_q, xq);
      load8_bf16(a.k + sp.batch * a.k_sb + tok * a.k_st + h * D + c8, a.vec_k, xk);
      load8_bf16(a.v + sp.batch * a.v_sb + tok * a.v_st + h * D + c8, a.vec_v, xv);
      const int64_t go = sp.batch * a.g_sb + tok * a.g_st + h * D + c8;
      if (a.g_fp32) {
        const float* gp = static_cast<const float*>(a.g) + go;
        if (a.vec_g) {
          const float4 u0 = *reinterpret_cast<const float4*>(gp), u1 = *reinterpret_cast<const float4*>(gp + 4);
          xg[0] = u0.x; xg[1] = u0.y; xg[2] = u0.z; xg[3] = u0.w;
          xg[4] = u1.x; xg[5] = u1.y; xg[6] = u1.z; xg[7] = u1.w;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) xg[i] = gp[i];
        }
      } else {
        load8_bf16(static_cast<const bf16*>(a.g) + go, a.vec_g, xg);
      }
      const float braw = load_scalar(a.beta, a.beta_fp32, sp.batch * a.beta_sb + tok * a.beta_st + h);
      const float b = a.beta_sigmoid ? sigmoidf_(braw) : braw;
      if (c8 == 0) sB[r] = b;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float dtb = a.gate_mode == kGatePrecomputed ? 0.f : a.dt_bias[h * D + c8 + i];
        xg[i] = gate_log_decay(a.gate_mode, xg[i], A_log_h, dtb, a.lower_bound) * kLog2e;
        xv[i] *= b;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) xq[i] = xk[i] = xg[i] = xv[i] = 0.f;
      if (c8 == 0) sB[r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sQ[r * ldf + c8 + i] = xq[i];
      sK[r * ldf + c8 + i] = xk[i];
      sG[r * ldf + c8 + i] = xg[i];
    }
    store8_bf16(sVb + r * ldh + c8, xv);
  }
  __syncthreads();

  if (a.l2norm) {  // one warp per row; x / sqrt(sum x^2 + 1e-6)
    for (int r = warp; r < 2 * kChunk; r += kPrepareThreads / 32) {
      float* x = (r < kChunk) ? (sQ + r * ldf) : (sK + (r - kChunk) * ldf);
      float ss = 0.f;
      for (int i = lane; i < D; i += 32) ss += x[i] * x[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float inv = rsqrtf(ss + 1e-6f);
      for (int i = lane; i < D; i += 32) x[i] *= inv;
    }
  }
  if (tid < D) {  // cumulative decay, one column per thread
    float run = 0.f;
    for (int r = 0; r < kChunk; ++r) {
      run += sG[r * ldf + tid];
      sG[r * ldf + tid] = run;
    }
  }
  for (int e = tid; e < kChunk * ldt; e += kPrepareThreads) sTi[e] = 0.f;
  __syncthreads();

  // ---- 2. QT, KD, gamma, b kt ----------------------------------------------------------------
  bf16* rW = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kW);
  bf16* rQT = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kQT);
  bf16* rKD = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kKD);
  bf16* rUT = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kUT);
  bf16* rMQK = reinterpret_cast<bf16*>(rec + ChunkRecord<D>::kMQK);
  float* rGamma = reinterpret_cast<float*>(rec + ChunkRecord<D>::kGamma);
  int over = 0;
  if (tid < D) {
    rGamma[tid] = fast_exp2(sG[(kChunk - 1) * ldf + tid]);
#pragma unroll
    for (int I = 0; I < kChunk / kSub; ++I) {
      const float gm = sG[(16 * I + 7) * ldf + tid];
      over |= (sG[(16 * I) * ldf + tid] - gm > kMaxHalfSpanLog2) | (gm - sG[(16 * I + 15) * ldf + tid] > kMaxHalfSpanLog2);
    }
  }
  for (int e = tid; e < kChunk * (D / 8); e += kPrepareThreads) {
    const int r = e / (D / 8), c8 = (e % (D / 8)) * 8;
    float xq[8], xd[8], xt[8];
    const float b = sB[r];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float gg = sG[r * ldf + c8 + i], gl = sG[(kChunk - 1) * ldf + c8 + i];
      const float eg = fast_exp2(gg);
      const float kk = sK[r * ldf + c8 + i];
      xq[i] = scale * sQ[r * ldf + c8 + i] * eg;
      xd[i] = kk * fast_exp2(gl - gg);
      xt[i] = b * kk * eg;
    }
    store8_bf16(rQT + r * D + c8, xq);
    store8_bf16(rKD + r * D + c8, xd);
    store8_bf16(sKtb + r * ldh + c8, xt);
  }
  // Upper blocks of MQK are zero (the state pass multiplies the whole 64x64 tile).
  for (int e = tid; e < kChunk * kChunk / 2; e += kPrepareThreads) {
    const int i = e / (kChunk / 2), j = (e % (kChunk / 2)) * 2;
    if ((j / 16) > (i / 16)) *reinterpret_cast<uint32_t*>(rMQK + i * kChunk + j) = 0u;
  }
  const bool pairwise_diag = __syncthreads_or(over) != 0;

  // ---- 3. L and MQK blocks ---------------------------------------------------------------------
  // Blocks in order of cost; warp w takes blocks w and w + 8 of this list.
  {
    constexpr int kBlocks = 10;
    // (I, J) of block q in 4-bit fields: I = {3,3,3,2,2,1,3,2,1,0}, J = {0,1,2,0,1,0,3,2,1,0}.
    constexpr uint64_t kBlockI = 0x123122333ull, kBlockJ = 0x123010210ull;
    for (int q = warp; q < kBlocks; q += kPrepareThreads / 32) {
      const int I = static_cast<int>((kBlockI >> (4 * q)) & 15), J = static_cast<int>((kBlockJ >> (4 * q)) & 15);
      if (I != J) {
        lk_block_mma<D>(sQ, sK, sG, sB, sL, rMQK, scale, I, J, 16 * I - 1, lane);
      } else if (!pairwise_diag) {
        lk_block_mma<D>(sQ, sK, sG, sB, sL, rMQK, scale, I, J, 16 * I + 7, lane);
      } else {
        lk_block_pairwise<D>(sQ, sK, sG, sB, sL, rMQK, scale, I, lane);
      }
    }
  }
  __syncthreads();

  // ---- 4. T_inv = (I + L)^-1 ---------------------------------------------------------------------
  if (warp < 4 && lane < 16) {
    const int I = warp, cc = lane;
    float tcol[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float v = (i == cc) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) v -= sL[(16 * I + i) * ldt + 16 * I + j] * tcol[j];
      tcol[i] = (i >= cc) ? v : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) sTi[(16 * I + i) * ldt + 16 * I + cc] = tcol[i];
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {
    const int pairs = 4 - d;
    for (int e = tid; e < pairs * 256; e += kPrepareThreads) {  // X = sum_M L_IM T_MJ
      const int p = e >> 8, i = (e >> 4) & 15, j = e & 15;
      const int J = p, I = p + d;
      float x = 0.f;
      for (int m = 16 * J; m < 16 * I; ++m) x += sL[(16 * I + i) * ldt + m] * sTi[m * ldt + 16 * J + j];
      sX[p * 272 + i * 17 + j] = x;
    }
    __syncthreads();
    for (int e = tid; e < pairs * 256; e += kPrepareThreads) {  // T_IJ = -T_II X
      const int p = e >> 8, i = (e >> 4) & 15, j = e & 15;
      const int J = p, I = p + d;
      float x = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m) x += sTi[(16 * I + i) * ldt + 16 * I + m] * sX[p * 272 + m * 17 + j];
      sTi[(16 * I + i) * ldt + 16 * J + j] = -x;
    }
    __syncthreads();
  }
  for (int e = tid; e < kChunk * kChunk / 2; e += kPrepareThreads) {
    const int i = e / (kChunk / 2), j = (e % (kChunk / 2)) * 2;
    *reinterpret_cast<uint32_t*>(sTib + i * ldtb + j) = pack_bf16(sTi[i * ldt + j], sTi[i * ldt + j + 1]);
  }
  __syncthreads();

  // ---- 5. W = T_inv (b kt) [C x D] and UT = (T_inv (b v))^T [D x C] ---------------------------------
  const int g = lane >> 2, t = lane & 3;
  for (int u = warp; u < 4 * (D / 64); u += kPrepareThreads / 32) {
    const int I = u % 4, ng = u / 4;
    float acc[8][4] = {};
    for (int s = 0; s <= I; ++s) {
      uint32_t af[4];
      load_a_frag(af, sTib, ldtb, 16 * I, 16 * s, lane);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        uint32_t bf[4];
        load_b_frag_kn(bf, sKtb, ldh, 64 * ng + 16 * p, 16 * s, lane);
        mma_bf16(acc[2 * p], af, bf[0], bf[1]);
        mma_bf16(acc[2 * p + 1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = 64 * ng + 8 * nt + 2 * t;
      *reinterpret_cast<uint32_t*>(rW + (16 * I + g) * D + col) = pack_bf16(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<uint32_t*>(rW + (16 * I + g + 8) * D + col) = pack_bf16(acc[nt][2], acc[nt][3]);
    }
  }
  for (int u = warp; u < (D / 16) * 2; u += kPrepareThreads / 32) {
    const int mt = u >> 1, nh = u & 1;
    float acc[4][4] = {};
    const int ksteps = nh ? 4 : 2;  // T_inv^T(r', r) = 0 for r' > r
    for (int s = 0; s < ksteps; ++s) {
      uint32_t af[4];
      load_a_frag_trans(af, sVb, ldh, 16 * mt, 16 * s, lane);
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t bf[4];
        load_b_frag_nk(bf, sTib, ldtb, 32 * nh + 16 * p, 16 * s, lane);
        mma_bf16(acc[2 * p], af, bf[0], bf[1]);
        mma_bf16(acc[2 * p + 1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = 32 * nh + 8 * nt + 2 * t;
      *reinterpret_cast<uint32_t*>(rUT + (16 * mt + g) * kChunk + col) = pack_bf16(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<uint32_t*>(rUT + (16 * mt + g + 8) * kChunk + col) = pack_bf16(acc[nt][2], acc[nt][3]);
    }
  }
}

}  // namespace sm90
}  // namespace flashkda
