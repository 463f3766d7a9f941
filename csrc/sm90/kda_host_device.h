// FLASHKDA_HOST_DEVICE: functions of the sm90 headers that the CPU tests also call (the SW128 layout,
// the walk order): __host__ __device__ under nvcc, plain inline for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define FLASHKDA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHKDA_HOST_DEVICE inline
#endif
