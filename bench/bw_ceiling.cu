// bw_ceiling: the bandwidth a decode step's access pattern can reach at best, without any KDA math.
//
// A decode call reads and writes back, in place, one 16 KB slice (32 rows x 128 fp32 columns) per
// (request, head, slice) at pool rows picked by a random permutation (bench/bench_decode.py: pool of
// 8N rows, H = 16, D = 128).  Issue 6 judges the kernel against the device-to-device copy bandwidth;
// this program measures, on the same GPU, what plain streaming kernels reach on that exact pattern,
// so the distance between the decode kernel and the pattern's own ceiling is known:
//   memcpy      cudaMemcpyAsync device to device (the issue's reference, read + write bytes)
//   copy        a grid-stride float4 copy kernel, contiguous
//   rmw-rand    every thread loads its 8 float4 of a 16 KB slice at a random pool row, scales them
//               and stores them back in place (the decode pattern; loads of the next slice issued
//               before the stores of this one)
//   rmw-seq     the same on consecutive rows (pattern effect vs. random rows)
//   spec-rand   speculative decode 1 + 3: each slice is read once at a random row and written 4 times,
//               to 4 other random rows (one state per token), the next slice's loads issued first;
//               bytes = 5 slices an item, judged against memcpy's read + write bandwidth
//   tma-copy    persistent blocks move each slice by TMA: a bulk load into a 4-stage shared ring,
//               then a bulk store of the stage back in place (the SM never touches the data)
//   tma-rmw     the same with 4 warps scaling each stage in shared memory between the load and the
//               store (a decode kernel that stores its state through shared memory by TMA)
//   spec-tma    spec-rand's pattern by TMA: each slice bulk-loaded once and bulk-stored to its 4 write
//               rows from the same stage (the SM never touches the data)
//   spec-tma-pf the same, each block first reading its first K items into L2 (cp.async.bulk.prefetch.L2):
//               the call's first reads in one burst, not mixed into the writes
//   tma-copy-pf tma-copy (plain decode's 1 : 1 read-modify-write by TMA) with the same first-read burst
//   memset      cudaMemsetAsync of the copy's bytes: the write-only rate, for spec's 1 : 4 mix
//   *-cs        the same pattern with streaming cache hints (st.global.cs stores, ld.global.cs loads:
//               evict-first in L1 and L2), whether the pattern's ceiling is a cache-policy effect
//   spec-seq    spec-rand's kernel on consecutive rows (read rows 0..N-1, write rows N + 4 n + t):
//               what the random rows cost the write-heavy mix
//   spec-wonly  spec-rand's 4 writes an item without its read: the write side of the mix alone
//   spec-ronly  spec-rand's read an item without its writes: the read side alone; ronly + wonly (the two
//               run one after the other) is the mix's time if its reads and writes never met in DRAM
//   spec-phased the same bytes in grid-wide phases (one block an SM, cooperative launch): every block
//               bulk-loads S slices into shared memory, grid barrier, bulk-stores each to its 4 rows,
//               grid barrier, next round: a decode design that keeps DRAM reading or writing, not both
// The pool has F N rows (F = 8 by default, bench/bench_decode.py's pool; the second argument): a larger
// pool spreads the same bytes over more pages (the TLB's reach), a smaller one over fewer.
// Usage (sm_90 machine): nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/bw_ceiling.cu
//   -o /tmp/bw_ceiling && /tmp/bw_ceiling [N=256] [F=8]
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_check.h"

constexpr int kD = 128, kH = 16, kSliceRows = 32;
constexpr int kSliceFloats = kSliceRows * kD;  // 4096 floats = 16 KB
constexpr int kThreads = 128;                  // 8 float4 per thread per slice

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

constexpr int kPer = kSliceFloats / 4 / kThreads;          // 8 float4 per thread and slice
constexpr int kSlicesPerRequest = kH * (kD / kSliceRows);  // 64 slices of 16 KB in a pool row

// Item i = (request n, head h, slice s), n = i / kSlicesPerRequest: its 16 KB slice in pool row `row`.
__host__ __device__ inline float* slice_at(float* pool, int row, int item) {
  return pool + static_cast<size_t>(row) * kH * kD * kD +
         static_cast<size_t>(item % kSlicesPerRequest) * kSliceFloats;
}

// The thread's part of a slice into registers, and back scaled by 0.999 (in place in `x`: a stand-in
// for the state update, so that stored values change between writes).  kCs: streaming (evict-first)
// loads and stores, ld.global.cs / st.global.cs.
template <bool kCs>
__device__ __forceinline__ void load_slice(const float4* p, float4 (&x)[kPer]) {
#pragma unroll
  for (int j = 0; j < kPer; ++j)
    x[j] = kCs ? __ldcs(p + threadIdx.x + j * kThreads) : p[threadIdx.x + j * kThreads];
}
template <bool kCs>
__device__ __forceinline__ void store_scaled(float4* p, float4 (&x)[kPer]) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    float4& v = x[j];
    v.x *= 0.999f, v.y *= 0.999f, v.z *= 0.999f, v.w *= 0.999f;
    if constexpr (kCs) {
      __stcs(p + threadIdx.x + j * kThreads, v);
    } else {
      p[threadIdx.x + j * kThreads] = v;
    }
  }
}

// Item i = (request n, head h, slice s); its slice starts at pool row rows[n], head h, slice s.
template <bool kCs>
__global__ void __launch_bounds__(kThreads) rmw_kernel(float* pool, const int* rows, int items) {
  auto base = [&](int item) {
    return reinterpret_cast<float4*>(slice_at(pool, rows[item / kSlicesPerRequest], item));
  };
  int item = blockIdx.x;
  if (item >= items) return;
  float4 cur[kPer];
  float4* p = base(item);
  load_slice<kCs>(p, cur);
  while (true) {
    const int next = item + gridDim.x;
    float4 nxt[kPer];
    float4* q = nullptr;
    if (next < items) {
      q = base(next);
      load_slice<kCs>(q, nxt);
    }
    store_scaled<kCs>(p, cur);
    if (next >= items) break;
#pragma unroll
    for (int j = 0; j < kPer; ++j) cur[j] = nxt[j];
    p = q;
    item = next;
  }
}

// Speculative decode 1 + 3: item i's slice read at rows[n], written to wrows[4 n + t], t = 0..3.
// kLoad = false: no loads at all (the slice's registers hold a constant): the pattern's write side alone.
// kStore = false: no stores (the loaded values feed a sum that is stored only if it is NaN, which the
// pool's finite contents never give, so the loads are not dead code): the read side alone.
template <bool kCs, bool kLoad = true, bool kStore = true>
__global__ void __launch_bounds__(kThreads)
    spec_kernel(float* pool, const int* rows, const int* wrows, int items) {
  int item = blockIdx.x;
  if (item >= items) return;
  auto at = [&](int row, int it) { return reinterpret_cast<float4*>(slice_at(pool, row, it)); };
  float4 cur[kPer];
  if constexpr (kLoad) {
    load_slice<kCs>(at(rows[item / kSlicesPerRequest], item), cur);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) cur[j] = make_float4(1.f, 2.f, 3.f, 4.f);
  }
  while (true) {
    const int next = item + gridDim.x;
    float4 nxt[kPer];
    if constexpr (kLoad) {
      if (next < items) load_slice<kCs>(at(rows[next / kSlicesPerRequest], next), nxt);
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j) nxt[j] = cur[j];
    }
    const int n = item / kSlicesPerRequest;
    if constexpr (kStore) {
#pragma unroll
      for (int t = 0; t < 4; ++t) store_scaled<kCs>(at(wrows[4 * n + t], item), cur);
    } else {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) sum += cur[j].x + cur[j].y + cur[j].z + cur[j].w;
      if (sum != sum) pool[threadIdx.x] = sum;
    }
    if (next >= items) break;
#pragma unroll
    for (int j = 0; j < kPer; ++j) cur[j] = nxt[j];
    item = next;
  }
}

// ---- TMA variants: a single producer lane per block issues every bulk copy ----------------------
constexpr int kTmaStages = 4;
constexpr int kSliceBytes = kSliceFloats * 4;
struct TmaSmem {
  alignas(128) float buf[kTmaStages][kSliceFloats];
  unsigned long long full[kTmaStages];  // the slice landed (TMA bytes)
  unsigned long long done[kTmaStages];  // the 128 scaling threads are done with it
};

__device__ inline unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ inline void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra "
      "WAIT;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// One 16 KB slice global -> shared by TMA, completing on `bar` (whose expected bytes the caller set).
__device__ inline void bulk_load_slice(float* dst, const float* src, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(kSliceBytes), "r"(smem_u32(bar))
      : "memory");
}
// One 16 KB slice global -> L2 only (no shared destination, nothing to wait on): an early read of a slice
// that a later bulk_load_slice then finds in L2.
__device__ inline void prefetch_slice_l2(const float* src) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(kSliceBytes) : "memory");
}
// One 16 KB slice shared -> global by TMA, in the thread's current bulk group.
__device__ inline void bulk_store_slice(float* dst, const float* src) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_u32(src)),
               "r"(kSliceBytes)
               : "memory");
}

// wrows == nullptr: each slice is stored back in place; else to its request's 4 rows wrows[4 n + t].
// prefetch > kTmaStages: at its start the block also reads its items kTmaStages .. prefetch - 1 into L2
// (prefetch_slice_l2), so that the first grid x prefetch slices of the call are read in one burst before
// the writes build up, instead of mixed into them (the mix costs the spec pattern 12-15%: perf-notes v38,
// v39); prefetch x grid x 16 KB must stay well inside the L2 for the lines to be there when loaded.
__global__ void __launch_bounds__(160)
    rmw_tma_kernel(float* pool, const int* rows, const int* wrows, int items, int touch, int prefetch = 0) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  TmaSmem& sm = *reinterpret_cast<TmaSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = gridDim.x;
  const int mine = items > static_cast<int>(blockIdx.x) ? (items - blockIdx.x + G - 1) / G : 0;
  auto at = [&](const int* r, int k, int t) {
    const int item = blockIdx.x + k * G;
    const int n = item / kSlicesPerRequest;
    return slice_at(pool, r == rows ? r[n] : r[4 * n + t], item);
  };
  auto src = [&](int k) { return at(rows, k, 0); };
  if (tid == 0) {
    for (int s = 0; s < kTmaStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&sm.full[s])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;\n" ::"r"(smem_u32(&sm.done[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto load = [&](int k) {
    const int s = k % kTmaStages;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(&sm.full[s])),
                 "r"(kSliceBytes)
                 : "memory");
    bulk_load_slice(sm.buf[s], src(k), &sm.full[s]);
  };
  if (warp == 4) {
    if (lane == 0) {
      for (int k = 0; k < kTmaStages && k < mine; ++k) load(k);
      for (int k = kTmaStages; k < prefetch && k < mine; ++k) prefetch_slice_l2(src(k));
      for (int k = 0; k < mine; ++k) {
        const int s = k % kTmaStages;
        mbar_wait(touch ? &sm.done[s] : &sm.full[s], (k / kTmaStages) & 1);
        for (int t = 0; t < (wrows ? 4 : 1); ++t)
          bulk_store_slice(wrows ? at(wrows, k, t) : src(k), sm.buf[s]);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // Refill the stage of item k - 1 once its store has read it (one store left in flight).
        if (k >= 1 && k - 1 + kTmaStages < mine) {
          asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
          load(k - 1 + kTmaStages);
        }
      }
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  } else if (touch) {
    for (int k = 0; k < mine; ++k) {
      const int s = k % kTmaStages;
      mbar_wait(&sm.full[s], (k / kTmaStages) & 1);
      float4* b = reinterpret_cast<float4*>(sm.buf[s]);
#pragma unroll
      for (int j = 0; j < kSliceFloats / 4 / 128; ++j) {
        float4 v = b[tid + j * 128];
        v.x *= 0.999f, v.y *= 0.999f, v.z *= 0.999f, v.w *= 0.999f;
        b[tid + j * 128] = v;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the TMA store
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(&sm.done[s])) : "memory");
    }
  }
}

// spec-phased: one block an SM, all blocks co-resident (cooperative launch).  Round r: block b
// bulk-loads items [(r G + b) S, +S) into S shared slices (one mbarrier, S x 16 KB of transaction
// bytes), grid barrier, bulk-stores each slice to its request's 4 write rows and waits for the stores
// to complete, grid barrier.  So in each phase the DRAM sees only reads or only writes (up to the L2's
// write-back of the stores).  S = slices (dynamic shared memory S x 16 KB).
__global__ void __launch_bounds__(32, 1)
    spec_phased_kernel(float* pool, const int* rows, const int* wrows, int items, int slices) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* buf = reinterpret_cast<float*>(smem_raw);
  __shared__ unsigned long long full;
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const int G = gridDim.x;
  const int rounds = (items + G * slices - 1) / (G * slices);
  const bool leader = threadIdx.x == 0;
  if (leader) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&full)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncwarp();
  unsigned phase = 0;
  for (int r = 0; r < rounds; ++r) {
    const int first = (r * G + static_cast<int>(blockIdx.x)) * slices;
    const int count = ::max(0, ::min(slices, items - first));
    if (leader && count > 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(&full)),
                   "r"(count * kSliceBytes)
                   : "memory");
      for (int s = 0; s < count; ++s) {
        const int item = first + s;
        bulk_load_slice(buf + static_cast<size_t>(s) * kSliceFloats,
                        slice_at(pool, rows[item / kSlicesPerRequest], item), &full);
      }
      mbar_wait(&full, phase);
      phase ^= 1;
    }
    grid.sync();
    if (leader && count > 0) {
      for (int s = 0; s < count; ++s) {
        const int item = first + s;
        for (int t = 0; t < 4; ++t)
          bulk_store_slice(slice_at(pool, wrows[4 * (item / kSlicesPerRequest) + t], item),
                           buf + static_cast<size_t>(s) * kSliceFloats);
      }
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    grid.sync();
  }
}

template <class F>
static float time_us(F&& launch, int iters) {
  for (int i = 0; i < 3; ++i) launch();
  return median_event_us(
      [&] {
        for (int i = 0; i < iters; ++i) launch();
      },
      0, 7, iters);
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? std::atoi(argv[1]) : 256;
  const int F = argc > 2 ? std::atoi(argv[2]) : 8;
  if (N < 1 || F < 5) {
    std::fprintf(stderr, "usage: bw_ceiling [N >= 1] [F >= 5: pool rows per request]\n");
    return 2;
  }
  const int P = F * N;
  const size_t row_floats = static_cast<size_t>(kH) * kD * kD;
  const size_t pool_bytes = static_cast<size_t>(P) * row_floats * 4;
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  float* pool = nullptr;
  CHECK(cudaMalloc(&pool, pool_bytes));
  CHECK(cudaMemset(pool, 0x3c, pool_bytes));  // a finite non-zero pattern (not zeros)
  std::vector<int> perm(P);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int> seq(N);
  std::iota(seq.begin(), seq.end(), 0);
  int *rows_rand = nullptr, *rows_seq = nullptr;
  CHECK(cudaMalloc(&rows_rand, N * sizeof(int)));
  CHECK(cudaMalloc(&rows_seq, N * sizeof(int)));
  CHECK(cudaMemcpy(rows_rand, perm.data(), N * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(rows_seq, seq.data(), N * sizeof(int), cudaMemcpyHostToDevice));

  const size_t bytes_rw = static_cast<size_t>(N) * row_floats * 4 * 2;  // read + write
  const int items = N * kH * (kD / kSliceRows);
  std::printf(
      "%s, %d SMs, N = %d, pool %d rows (%zu MB): %zu MB read + written per call, %d slices of 16 KB\n",
      prop.name, sms, N, P, pool_bytes >> 20, bytes_rw >> 20, items);
  const size_t half = static_cast<size_t>(N) * row_floats * 4;
  float* src = pool;
  float* dst = pool + static_cast<size_t>(N) * row_floats;  // rows N..2N-1 (P = F N >= 5 N)
  const float t_memcpy =
      time_us([&] { CHECK(cudaMemcpyAsync(dst, src, half, cudaMemcpyDeviceToDevice)); }, 20);
  std::printf("memcpy          %8.1f us  %5.2f TB/s\n", t_memcpy, bytes_rw / t_memcpy * 1e-6);
  const float t_copy = time_us(
      [&] {
        copy_kernel<<<sms * 8, 256>>>(reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(dst),
                                      half / 16);
      },
      20);
  std::printf("copy kernel     %8.1f us  %5.2f TB/s\n", t_copy, bytes_rw / t_copy * 1e-6);
  for (int per_sm : {2, 4, 8, 16}) {
    const int grid = std::min(items, sms * per_sm);
    for (int r = 0; r < 3; ++r) {
      const int* rows = r == 1 ? rows_seq : rows_rand;
      const float t = time_us(
          [&] {
            if (r == 2) {
              rmw_kernel<true><<<grid, kThreads>>>(pool, rows, items);
            } else {
              rmw_kernel<false><<<grid, kThreads>>>(pool, rows, items);
            }
          },
          20);
      static const char* const kRmwNames[] = {"rand   ", "seq    ", "rand-cs"};
      std::printf("rmw-%s %2d/SM  %8.1f us  %5.2f TB/s  %5.1f%% of memcpy\n", kRmwNames[r], per_sm, t,
                  bytes_rw / t * 1e-6, 100.f * t_memcpy / t);
    }
  }
  {  // speculative decode 1 + 3: read at perm[n], write at perm[N + 4 n + t] (P = F N >= 5 N rows)
    int *wrows = nullptr, *wrows_seq = nullptr;
    CHECK(cudaMalloc(&wrows, 4 * N * sizeof(int)));
    CHECK(cudaMemcpy(wrows, perm.data() + N, 4 * N * sizeof(int), cudaMemcpyHostToDevice));
    std::vector<int> wseq(4 * N);
    std::iota(wseq.begin(), wseq.end(), N);  // rows N .. 5N - 1, consecutive
    CHECK(cudaMalloc(&wrows_seq, 4 * N * sizeof(int)));
    CHECK(cudaMemcpy(wrows_seq, wseq.data(), 4 * N * sizeof(int), cudaMemcpyHostToDevice));
    const size_t bytes_spec = static_cast<size_t>(N) * row_floats * 4 * 5;
    for (int per_sm : {2, 4, 8, 16}) {
      const int grid = std::min(items, sms * per_sm);
      float t_part[5] = {};
      for (int r = 0; r < 5; ++r) {
        const float t = time_us(
            [&] {
              if (r == 0) spec_kernel<false><<<grid, kThreads>>>(pool, rows_rand, wrows, items);
              if (r == 1) spec_kernel<false><<<grid, kThreads>>>(pool, rows_seq, wrows_seq, items);
              if (r == 2) spec_kernel<true><<<grid, kThreads>>>(pool, rows_rand, wrows, items);
              if (r == 3) spec_kernel<false, false><<<grid, kThreads>>>(pool, rows_rand, wrows, items);
              if (r == 4) spec_kernel<false, true, false><<<grid, kThreads>>>(pool, rows_rand, wrows, items);
            },
            20);
        t_part[r] = t;
        // write-only moves 4 of spec's 5 slices an item, read-only 1
        const double b = r == 3 ? bytes_spec * 0.8 : r == 4 ? bytes_spec * 0.2 : bytes_spec;
        static const char* const kSpecNames[] = {"rand   ", "seq    ", "rand-cs", "wonly  ", "ronly  "};
        std::printf("spec-%s %2d/SM %8.1f us  %5.2f TB/s  %5.1f%% of memcpy\n", kSpecNames[r], per_sm, t,
                    b / t * 1e-6, 100.f * (b / t) / (bytes_rw / t_memcpy));
      }
      const float t_sum = t_part[3] + t_part[4];
      std::printf("spec-ronly+wonly %2d/SM %6.1f us  %5.2f TB/s  %5.1f%% of memcpy (the two run apart)\n",
                  per_sm, t_sum, bytes_spec / t_sum * 1e-6,
                  100.f * (bytes_spec / t_sum) / (bytes_rw / t_memcpy));
    }
    CHECK(cudaFree(wrows_seq));
    CHECK(cudaFuncSetAttribute(rmw_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(sizeof(TmaSmem))));
    for (int per_sm : {1, 2, 3}) {
      const int grid = std::min(items, sms * per_sm);
      const float t = time_us(
          [&] { rmw_tma_kernel<<<grid, 160, sizeof(TmaSmem)>>>(pool, rows_rand, wrows, items, 0); }, 20);
      std::printf("spec-tma  %d/SM  %8.1f us  %5.2f TB/s  %5.1f%% of memcpy\n", per_sm, t,
                  bytes_spec / t * 1e-6, 100.f * (bytes_spec / t) / (bytes_rw / t_memcpy));
    }
    // The same with the call's first reads in one burst into L2 (K items a block, K x grid x 16 KB).
    for (int per_sm : {1, 2}) {
      const int grid = std::min(items, sms * per_sm);
      for (int pf : {6, 8, 12}) {
        const float t = time_us(
            [&] { rmw_tma_kernel<<<grid, 160, sizeof(TmaSmem)>>>(pool, rows_rand, wrows, items, 0, pf); },
            20);
        std::printf("spec-tma-pf K=%-2d %d/SM %8.1f us  %5.2f TB/s  %5.1f%% of memcpy (%zu MB read first)\n",
                    pf, per_sm, t, bytes_spec / t * 1e-6, 100.f * (bytes_spec / t) / (bytes_rw / t_memcpy),
                    (static_cast<size_t>(std::min(pf * grid, items)) * kSliceBytes) >> 20);
      }
    }
    for (int slices : {4, 8, 12}) {
      const int smem = slices * kSliceBytes;
      CHECK(cudaFuncSetAttribute(spec_phased_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      int per_sm = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, spec_phased_kernel, 32, smem));
      if (per_sm < 1) {
        std::printf("spec-phased S=%-2d does not fit an SM\n", slices);
        continue;
      }
      const int grid = sms;  // one block an SM, all co-resident
      int items_arg = items;
      void* args[] = {&pool, &rows_rand, &wrows, &items_arg, &slices};
      const float t = time_us(
          [&] {
            CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(spec_phased_kernel), dim3(grid),
                                              dim3(32), args, smem, 0));
          },
          20);
      std::printf("spec-phased S=%-2d %8.1f us  %5.2f TB/s  %5.1f%% of memcpy (%d rounds)\n", slices, t,
                  bytes_spec / t * 1e-6, 100.f * (bytes_spec / t) / (bytes_rw / t_memcpy),
                  (items + grid * slices - 1) / (grid * slices));
    }
    CHECK(cudaFree(wrows));
  }
  {  // write-only: the same bytes as the copy, written by a memset
    const float t = time_us([&] { CHECK(cudaMemsetAsync(dst, 0x3c, 2 * half)); }, 20);
    std::printf("memset          %8.1f us  %5.2f TB/s  %5.1f%% of memcpy\n", t, 2 * half / t * 1e-6,
                100.f * (2 * half / t) / (bytes_rw / t_memcpy));
  }
  CHECK(cudaFuncSetAttribute(rmw_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(sizeof(TmaSmem))));
  for (int per_sm : {1, 2, 3}) {
    const int grid = std::min(items, sms * per_sm);
    for (int touch = 0; touch < 2; ++touch) {
      const float t = time_us(
          [&] { rmw_tma_kernel<<<grid, 160, sizeof(TmaSmem)>>>(pool, rows_rand, nullptr, items, touch); },
          20);
      std::printf("tma-%s %d/SM  %8.1f us  %5.2f TB/s  %5.1f%% of memcpy\n", touch ? "rmw " : "copy", per_sm,
                  t, bytes_rw / t * 1e-6, 100.f * t_memcpy / t);
    }
  }
  {  // plain decode's 1 : 1 mix with the call's first reads in one burst into L2 (2 blocks an SM)
    const int grid = std::min(items, sms * 2);
    for (int pf : {6, 8, 12}) {
      const float t = time_us(
          [&] { rmw_tma_kernel<<<grid, 160, sizeof(TmaSmem)>>>(pool, rows_rand, nullptr, items, 0, pf); },
          20);
      std::printf("tma-copy-pf K=%-2d 2/SM %8.1f us  %5.2f TB/s  %5.1f%% of memcpy (%zu MB read first)\n", pf,
                  t, bytes_rw / t * 1e-6, 100.f * t_memcpy / t,
                  (static_cast<size_t>(std::min(pf * grid, items)) * kSliceBytes) >> 20);
    }
  }
  CHECK(cudaGetLastError());
  CHECK(cudaFree(pool));
  CHECK(cudaFree(rows_rand));
  CHECK(cudaFree(rows_seq));
  return 0;
}
