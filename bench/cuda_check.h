// For the standalone CUDA benchmark programs (bw_ceiling.cu, latency_floor.cu): CHECK(call) stops
// with the file, line, call and CUDA error on the first failing runtime call; median_event_us times
// a piece of stream work with events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// Median over `reps` event-timed runs of run() on `stream`, in microseconds per unit (each run's
// time divided by `units`, the launches or calls it holds).  Warm-up is the caller's.
template <class F>
float median_event_us(F&& run, cudaStream_t stream, int reps, int units) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a, stream));
    run();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3f / units);
  }
  std::sort(t.begin(), t.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}
