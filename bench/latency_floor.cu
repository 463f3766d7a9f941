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
// The distance between these and fla's / our batch-1 times tells how much of a call is launch and
// memory latency that no kernel design removes.
// Usage (sm_90 machine): nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/latency_floor.cu
//   -o /tmp/latency_floor && /tmp/latency_floor
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "cuda_check.h"

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

template <class K, class... Args>
static void launch(cudaStream_t st, bool pdl, K kernel, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kBlocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
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
  CHECK(cudaGetLastError());
  CHECK(cudaFree(pool));
  CHECK(cudaFree(idx));
  return 0;
}
