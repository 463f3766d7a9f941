// latency_floor: the shortest a batch-1 decode call can be on this GPU, measured the way
// bench/bench_decode.py times calls (20 launches back to back in one CUDA graph, events around the
// replay, time / 20, median of 7 x 50 replays), for kernels that do less and less of a decode step:
//   empty           an empty kernel, 129 blocks of 128 threads (launch + grid completion alone)
//   empty+pdl       the same launched with programmatic stream serialisation, griddepcontrol.wait /
//                   launch_dependents at the top (what the decode kernels do)
//   chain+pdl       + the decode step's dependent memory chain without math: an index load, then
//                   each thread's 64 bytes of state at that row (a 1 MB pool row, H = 16, D = 128 fp32),
//                   then the state stored back (the state was written by the previous launch: in L2)
//   chain           the same without PDL
//   lean+pdl        a whole plain decode step (H = 16, D = 128, fp32 pool, bounded gate, l2norm, beta
//                   sigmoid) with nothing else: one block per (head, 16-row slice), one state row per
//                   thread over 8 lanes, every lane loads and preprocesses the 16 token columns it
//                   needs itself (norms reduced over the row's 8 lanes: no shared memory, no block
//                   barrier), a 12-field parameter block, one error word per block from thread 0
//   lean+pdl+args   the same kernel reading its fields from a 512-byte parameter block (the size of the
//                   library's DecodeArgs): the constant-cache misses of a larger parameter block
//   lean+pdl+sync   the same plus a block barrier before the error word and 1024 error words rewritten
//                   per call, as the library's kernels do
//   lean            lean without PDL
//   library+pdl     the library's decode_latency_kernel on the same inputs (plain decode, fixed layout)
//   library fixed   the library's decode_fixed_layout_kernel on the same inputs
//   spec 1+3        the latency and fixed-layout kernels on a batch-1 spec decode of 4 tokens
// Build: add -Iinclude -Icsrc to the nvcc line below (the library rung includes its kernel header).
// The distance between these and fla's / our batch-1 times tells how much of a call is launch and
// memory latency that no kernel design removes.
// Usage (sm_90 machine): nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/latency_floor.cu
//   -Iinclude -Icsrc --expt-relaxed-constexpr -o /tmp/latency_floor && /tmp/latency_floor
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "sm90/kda_decode_fixed.cuh"  // the library's batch-1 kernels, for the same-binary rungs

constexpr int kBlocks = 129, kThreads = 128, kCalls = 20;
constexpr int kRowFloats = 16 * 128 * 128;  // one pool row: H = 16 heads of 128 x 128 fp32

__global__ void empty_kernel(int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
}

__global__ void chain_kernel(int pdl, const int* idx, float* pool) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  if (blockIdx.x >= kBlocks - 1) return;  // the decode kernel's checker block does no state work
  const int row = idx[0];
  float4* p = reinterpret_cast<float4*>(pool + static_cast<size_t>(row) * kRowFloats) +
              (blockIdx.x * kThreads + threadIdx.x) * 4;
  float4 s[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = p[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i].x *= 0.999f;
    p[i] = s[i];
  }
}

// ---------------------------------------------------------------------------------------------
// lean: a complete plain decode step and nothing more (see the header).  The math is the spec's:
// s <- s exp(a); u = b (v - s.k); s <- s + u k; o = s.(scale q) = s_decayed.q' + u (k.q').
struct LeanArgs {
  const unsigned short *q, *k, *v, *g, *beta;  // bf16 bits, [N, H, D] / [N, H]
  unsigned short* out;
  const float *A_log, *dt_bias;
  float* pool;  // [P, H, D, D]
  const int* idx;
  int* err;
  int H, P;
  float scale, lower_bound;
};
struct LeanArgsPadded {  // 512 bytes, the fields spread over it like a large argument struct
  LeanArgs a;
  char pad[512 - sizeof(LeanArgs)];
};

// The library's bit-level helpers (kda_common.cuh, kda_decode_latency.cuh), so that the rungs do the
// same instructions as the kernels.
using flashkda::sm90::bf16_bits_hi;
using flashkda::sm90::bf16_bits_lo;
using flashkda::sm90::fast_exp2;
using flashkda::sm90::fast_rcp;

template <int kMode>  // bits: 1 sync + 1024 error words, 2 constant decay (no gate SFU work), 4 split prep,
                      // 8 no output store, 16 ~48 KB of never-taken code between the loads and the math
__device__ __forceinline__ void lean_step(const LeanArgs& a, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  constexpr int D = 128;
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int err = 0;
  if (b < kBlocks - 1) {
    const int n = b / (a.H * 8), h = (b / 8) % a.H, slice = b % 8;
    const int row = slice * 16 + warp * 4 + lane / 8, j = lane & 7;
    const int slot = a.idx[n];  // the read slot: the state's address waits on it
    // Everything else that depends on n alone, as bits (a use would stall the warp).
    const size_t tok = (static_cast<size_t>(n) * a.H + h) * D;
    uint2 qb[4], kb[4], gb[4];
    float4 db[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 4 * j + 32 * i;
      qb[i] = *reinterpret_cast<const uint2*>(a.q + tok + col);
      kb[i] = *reinterpret_cast<const uint2*>(a.k + tok + col);
      gb[i] = *reinterpret_cast<const uint2*>(a.g + tok + col);
      db[i] = *reinterpret_cast<const float4*>(a.dt_bias + h * D + col);
    }
    const uint32_t betab = a.beta[static_cast<size_t>(n) * a.H + h];
    const uint32_t vbits = a.v[tok + row];
    const float alog = a.A_log[h];
    float s[16];
    const bool ok = slot >= 0 && slot < a.P;
    if (slot >= a.P) err = 2;
    const float* srow = a.pool + ((static_cast<size_t>(ok ? slot : 0) * a.H + h) * D + row) * D;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 x = *reinterpret_cast<const float4*>(srow + 4 * j + 32 * i);
      s[4 * i] = x.x, s[4 * i + 1] = x.y, s[4 * i + 2] = x.z, s[4 * i + 3] = x.w;
    }
    if constexpr ((kMode & 16) != 0) {
      if (a.H < 0) {  // never taken: code size / layout (instruction cache) only
#pragma unroll
        for (int c = 0; c < 3000; ++c) {
          s[c & 15] = fmaf(s[(c + 5) & 15], 1.0001f, static_cast<float>(c));
          if ((c & 255) == 255) a.pool[c] = s[c & 15];
        }
      }
    }
    // Token preprocessing while the state is in flight: the row group's 8 lanes hold all D columns.
    float q[16], k[16], d[16], sq = 0.f, sk = 0.f, kq = 0.f;
    const float c1 = -__expf(alog) * 1.4426950408889634f, lb2 = a.lower_bound * 1.4426950408889634f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[4 * i] = bf16_bits_lo(qb[i].x), q[4 * i + 1] = bf16_bits_hi(qb[i].x),
            q[4 * i + 2] = bf16_bits_lo(qb[i].y), q[4 * i + 3] = bf16_bits_hi(qb[i].y);
      k[4 * i] = bf16_bits_lo(kb[i].x), k[4 * i + 1] = bf16_bits_hi(kb[i].x),
            k[4 * i + 2] = bf16_bits_lo(kb[i].y), k[4 * i + 3] = bf16_bits_hi(kb[i].y);
      if constexpr ((kMode & 4) == 0) {
        const float gg[4] = {bf16_bits_lo(gb[i].x), bf16_bits_hi(gb[i].x), bf16_bits_lo(gb[i].y),
                             bf16_bits_hi(gb[i].y)};
        const float dd[4] = {db[i].x, db[i].y, db[i].z, db[i].w};
#pragma unroll
        for (int c = 0; c < 4; ++c)
          d[4 * i + c] = (kMode & 2) ? 0.99f + 1e-3f * gg[c]
                                     : fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (gg[c] + dd[c]))));
      }
    }
    if constexpr ((kMode & 4) != 0) {
      // Lane L computes the decay of columns 4 L .. 4 L + 3 (its own g / dt_bias load), and the warp
      // exchanges them through its own shared buffer (no block barrier).
      __shared__ __align__(16) float dsm[4][128];
      const uint2 g4 = *reinterpret_cast<const uint2*>(a.g + tok + 4 * lane);
      const float4 b4 = *reinterpret_cast<const float4*>(a.dt_bias + h * D + 4 * lane);
      const float gg[4] = {bf16_bits_lo(g4.x), bf16_bits_hi(g4.x), bf16_bits_lo(g4.y), bf16_bits_hi(g4.y)};
      const float dd[4] = {b4.x, b4.y, b4.z, b4.w};
      float4 r;
      r.x = fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (gg[0] + dd[0]))));
      r.y = fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (gg[1] + dd[1]))));
      r.z = fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (gg[2] + dd[2]))));
      r.w = fast_exp2(lb2 * fast_rcp(1.f + fast_exp2(c1 * (gg[3] + dd[3]))));
      *reinterpret_cast<float4*>(&dsm[warp][4 * lane]) = r;
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(&dsm[warp][4 * j + 32 * i]);
        d[4 * i] = x.x, d[4 * i + 1] = x.y, d[4 * i + 2] = x.z, d[4 * i + 3] = x.w;
      }
    }
#pragma unroll
    for (int c = 0; c < 16; ++c) sq += q[c] * q[c], sk += k[c] * k[c], kq += q[c] * k[c];
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
      kq += __shfl_xor_sync(0xffffffffu, kq, o);
    }
    const float qs = a.scale * rsqrtf(sq + 1e-6f), ks = rsqrtf(sk + 1e-6f);
    const float beta = fast_rcp(1.f + __expf(-bf16_bits_lo(betab)));
    float pred = 0.f, sqo = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      s[c] *= d[c];
      pred += s[c] * k[c];
      sqo += s[c] * q[c];
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
      pred += __shfl_xor_sync(0xffffffffu, pred, o);
      sqo += __shfl_xor_sync(0xffffffffu, sqo, o);
    }
    const float u = beta * (bf16_bits_lo(vbits) - pred * ks);
    const float out = sqo * qs + u * kq * ks * qs;
    if (ok) {
      float* wrow = a.pool + ((static_cast<size_t>(slot) * a.H + h) * D + row) * D;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float kk[4] = {k[4 * i] * ks, k[4 * i + 1] * ks, k[4 * i + 2] * ks, k[4 * i + 3] * ks};
        *reinterpret_cast<float4*>(wrow + 4 * j + 32 * i) =
            make_float4(s[4 * i] + u * kk[0], s[4 * i + 1] + u * kk[1], s[4 * i + 2] + u * kk[2],
                        s[4 * i + 3] + u * kk[3]);
      }
    }
    if ((kMode & 8) == 0 && j == 0)
      a.out[tok + row] = static_cast<unsigned short>(__float_as_uint(ok ? out : 0.f) >> 16);
  }
  if constexpr ((kMode & 1) == 0) {
    if (tid == 0) a.err[b] = err;
  } else {
    __shared__ int e;
    if (tid == 0) e = 0;
    __syncthreads();
    if (err) atomicOr(&e, err);
    __syncthreads();
    if (tid == 0)
      for (int w = b; w < 1024; w += kBlocks) a.err[w] = w == b ? e : 0;
  }
}

__global__ void lean_kernel(const __grid_constant__ LeanArgs a, int pdl) { lean_step<0>(a, pdl); }
__global__ void lean_sync_kernel(const __grid_constant__ LeanArgs a, int pdl) { lean_step<1>(a, pdl); }
template <int kMode>
__global__ void lean_variant_kernel(const __grid_constant__ LeanArgs a, int pdl) {
  lean_step<kMode>(a, pdl);
}
__global__ void lean_padded_kernel(const __grid_constant__ LeanArgsPadded a, int pdl) {
  lean_step<0>(a.a, pdl);
}

template <class F>
static float graph_us(F&& launch) {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCalls; ++i) launch(st);
  CHECK(cudaStreamEndCapture(st, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(ge, st));
  const float us = median_event_us([&] { CHECK(cudaGraphLaunch(ge, st)); }, st, 350, kCalls);
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(st));
  return us;
}

// The library's own launch helper (the same cudaLaunchKernelEx set-up the decode kernels use).
template <class K, class... Args>
static void launch(cudaStream_t st, bool pdl, K kernel, Args... args) {
  const flashkda::Status s = flashkda::sm90::launch_maybe_programmatic(
      kernel, dim3(kBlocks), dim3(kThreads), 0, pdl, st, "latency_floor launch", args...);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message.c_str());
    std::exit(1);
  }
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  float* pool = nullptr;
  int* idx = nullptr;
  CHECK(cudaMalloc(&pool, 8 * static_cast<size_t>(kRowFloats) * 4));
  CHECK(cudaMemset(pool, 0x3c, 8 * static_cast<size_t>(kRowFloats) * 4));
  CHECK(cudaMalloc(&idx, sizeof(int)));
  const int row = 5;
  CHECK(cudaMemcpy(idx, &row, sizeof(int), cudaMemcpyHostToDevice));
  std::printf("%s: per launch, %d launches back to back in one graph, %d blocks x %d threads\n", prop.name,
              kCalls, kBlocks, kThreads);
  std::printf("empty           %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, false, empty_kernel, 0); }));
  std::printf("empty+pdl       %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, empty_kernel, 1); }));
  std::printf("chain           %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, false, chain_kernel, 0, (const int*)idx, pool); }));
  std::printf("chain+pdl       %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, chain_kernel, 1, (const int*)idx, pool); }));

  // lean rungs: H = 16, N = 1, random-ish token data (never zeros), the pool row of `row`.
  const int H = 16, D = 128;
  std::vector<unsigned short> hb(3 * H * D + H);
  for (size_t i = 0; i < hb.size(); ++i) {
    const float x = 0.5f * std::sin(0.37f * i + 0.1f);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    hb[i] = static_cast<unsigned short>(u >> 16);
  }
  unsigned short *tok = nullptr, *out = nullptr, *gbits = nullptr;
  float *alog = nullptr, *dtb = nullptr;
  int* err = nullptr;
  CHECK(cudaMalloc(&tok, hb.size() * 2));
  CHECK(cudaMemcpy(tok, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&gbits, H * D * 2));
  CHECK(cudaMemcpy(gbits, hb.data() + 7, H * D * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out, H * D * 2));
  CHECK(cudaMalloc(&alog, H * 4));
  CHECK(cudaMemset(alog, 0, H * 4));
  CHECK(cudaMalloc(&dtb, H * D * 4));
  CHECK(cudaMemset(dtb, 0, H * D * 4));
  CHECK(cudaMalloc(&err, 1024 * 4));
  LeanArgs la{tok, tok + H * D, tok + 2 * H * D, gbits, tok + 3 * H * D, out, alog, dtb, pool, idx, err,
              H,   8,           0.088f,          -5.f};
  LeanArgsPadded lp{};
  lp.a = la;
  std::printf("lean+pdl        %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_kernel, la, 1); }));
  std::printf("lean+pdl+args   %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_padded_kernel, lp, 1); }));
  std::printf("lean+pdl+sync   %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_sync_kernel, la, 1); }));
  std::printf("lean            %6.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, false, lean_kernel, la, 0); }));
  std::printf("lean+pdl const decay %5.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_variant_kernel<2>, la, 1); }));
  std::printf("lean+pdl split prep  %5.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_variant_kernel<4>, la, 1); }));
  std::printf("lean+pdl split+48KB  %5.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_variant_kernel<4 | 16>, la, 1); }));
  std::printf("lean+pdl no out      %5.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_variant_kernel<8>, la, 1); }));
  std::printf("lean+pdl (again) %5.2f us\n",
              graph_us([&](cudaStream_t s) { launch(s, true, lean_kernel, la, 1); }));
  {
    flashkda::sm90::DecodeArgs da = {};
    da.q = reinterpret_cast<const flashkda::sm90::bf16*>(la.q),
    da.k = reinterpret_cast<const flashkda::sm90::bf16*>(la.k);
    da.v = reinterpret_cast<const flashkda::sm90::bf16*>(la.v), da.g = la.g, da.beta = la.beta;
    da.out = reinterpret_cast<flashkda::sm90::bf16*>(out);
    da.q_sb = da.k_sb = da.v_sb = da.g_sb = da.out_sb = H * D, da.beta_sb = H;
    da.q_st = da.k_st = da.v_st = da.g_st = da.out_st = H * D, da.beta_st = H;
    da.vec_q = da.vec_k = da.vec_g = 1;
    da.align_q = da.align_k = da.align_g = da.align_v = da.align_dtb = 16;
    da.A_log = alog, da.dt_bias = dtb, da.pool = pool, da.pool_rows = 8, da.idx = idx, da.slots = 1;
    da.num_rows = 1, da.T = 1, da.H = H, da.N = 1;
    da.gate_mode = flashkda::sm90::kGateBounded, da.l2norm = 1, da.beta_sigmoid = 1;
    da.scale = la.scale, da.lower_bound = la.lower_bound, da.error_word = err;
    std::printf("library+pdl     %6.2f us\n", graph_us([&](cudaStream_t s) {
                  if (!flashkda::sm90::launch_decode_latency<128, true, 1>(da, true, s).ok()) std::exit(1);
                }));
    std::printf("library fixed   %6.2f us\n", graph_us([&](cudaStream_t s) {
                  if (!flashkda::sm90::launch_decode_fixed_layout<128, true, 1>(da, true, s).ok())
                    std::exit(1);
                }));
    std::printf("library fixed (again) %6.2f us\n", graph_us([&](cudaStream_t s) {
                  if (!flashkda::sm90::launch_decode_fixed_layout<128, true, 1>(da, true, s).ok())
                    std::exit(1);
                }));
    // spec 1+3 at batch 1: 4 tokens (the same bits repeated), write slots 1..4, num_accepted 4 (the
    // read slot is the row the previous call wrote last).
    const int T = 4;
    std::vector<unsigned short> hs(5 * T * H * D);
    for (size_t i = 0; i < hs.size(); ++i) hs[i] = hb[i % hb.size()];
    unsigned short* tok4 = nullptr;
    int *idx4 = nullptr, *acc4 = nullptr;
    CHECK(cudaMalloc(&tok4, hs.size() * 2));
    CHECK(cudaMemcpy(tok4, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&idx4, T * sizeof(int)));
    CHECK(cudaMalloc(&acc4, sizeof(int)));
    const int rows4[T] = {1, 2, 3, 4}, acc = T;
    CHECK(cudaMemcpy(idx4, rows4, sizeof(rows4), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(acc4, &acc, sizeof(int), cudaMemcpyHostToDevice));
    flashkda::sm90::DecodeArgs ds = da;
    const int64_t tsz = static_cast<int64_t>(T) * H * D;
    ds.q = reinterpret_cast<const flashkda::sm90::bf16*>(tok4);
    ds.k = ds.q + tsz, ds.v = ds.q + 2 * tsz, ds.g = tok4 + 3 * tsz, ds.beta = tok4 + 4 * tsz;
    CHECK(cudaMalloc(&ds.out, tsz * 2));
    ds.q_sb = ds.k_sb = ds.v_sb = ds.g_sb = ds.out_sb = tsz, ds.beta_sb = T * H;
    ds.idx = idx4, ds.num_accepted = acc4, ds.spec = 1, ds.slots = T, ds.T = T, ds.num_rows = T;
    std::printf("library latency spec 1+3 %6.2f us\n", graph_us([&](cudaStream_t s) {
                  if (!flashkda::sm90::launch_decode_latency<128, true, 1>(ds, true, s).ok()) std::exit(1);
                }));
    std::printf("library fixed spec 1+3 %6.2f us\n", graph_us([&](cudaStream_t s) {
                  if (!flashkda::sm90::launch_decode_fixed_layout<128, true, 1>(ds, true, s).ok())
                    std::exit(1);
                }));
  }
  std::vector<int> herr(1024);
  CHECK(cudaMemcpy(herr.data(), err, 1024 * 4, cudaMemcpyDeviceToHost));
  std::vector<unsigned short> hout(H * D);
  CHECK(cudaMemcpy(hout.data(), out, H * D * 2, cudaMemcpyDeviceToHost));
  double sum = 0;
  for (auto v : hout) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    sum += std::fabs(f);
  }
  std::printf("lean sanity: error word %d, sum |out| %.4g (finite, nonzero expected)\n", herr[0], sum);
  CHECK(cudaGetLastError());
  CHECK(cudaFree(pool));
  CHECK(cudaFree(idx));
  return 0;
}
