// Host-side launcher of the sm90 prefill for one head dim: chunk_prepare over every (chunk slot,
// head), then state_recurrence over every (sequence, head, state slice), both on the caller's stream.
// Grid sizes come from host-known sizes only (no read of cu_seqlens), so the call is graph-safe.
#pragma once

#include <cuda_runtime.h>

#include "flashkda/flashkda.h"
#include "sm90/kda_chunk_prepare.cuh"
#include "sm90/kda_state_recurrence.cuh"

namespace flashkda {
namespace sm90 {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok_status();
  return Status::cuda_error(std::string("flashkda: ") + what + ": " + cudaGetErrorString(e));
}

// Whether the (N x H) state passes fill the GPU with 8-warp blocks; otherwise use 4-warp blocks
// (two per head) so that twice as many SMs work on the sequential part.
inline bool use_wide_state_blocks(int64_t N, int64_t H, int num_sms) { return N * H >= num_sms; }

template <int D, int NW>
Status launch_recurrence(const PrefillArgs& a, cudaStream_t stream) {
  using SM = RecurrenceSmem<D, NW>;
  auto kernel = state_recurrence_kernel<D, NW>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SM::kBytes);
  if (e != cudaSuccess) return cuda_status(e, "state_recurrence smem attribute");
  dim3 grid(static_cast<unsigned>(a.N), static_cast<unsigned>(a.H), D / SM::kVs);
  kernel<<<grid, 32 * NW, SM::kBytes, stream>>>(a);
  return cuda_status(cudaGetLastError(), "state_recurrence launch");
}

template <int D>
Status launch_prefill(const PrefillArgs& a, int num_sms, cudaStream_t stream) {
  using PS = PrepareSmem<D>;
  if (a.H <= 0) return Status::ok_status();
  // chunk_prepare also validates the index tensors (block 0), so it runs even with no chunk.
  auto prep = chunk_prepare_kernel<D>;
  cudaError_t e = cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, PS::kBytes);
  if (e != cudaSuccess) return cuda_status(e, "chunk_prepare smem attribute");
  const int64_t slots = a.num_slots > 0 ? a.num_slots : 1;
  if (slots > 0x7fffffff || a.H > 65535) return Status::invalid("flashkda: problem too large for one launch");
  dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(a.H));
  prep<<<grid, kPrepareThreads, PS::kBytes, stream>>>(a);
  Status st = cuda_status(cudaGetLastError(), "chunk_prepare launch");
  if (!st.ok() || a.N <= 0) return st;
  if constexpr (D == 128) {
    if (use_wide_state_blocks(a.N, a.H, num_sms)) return launch_recurrence<D, 8>(a, stream);
  }
  return launch_recurrence<D, 4>(a, stream);
}

// Explicit instantiations live in kda_prefill_sm90_d{64,128}.cu.
Status launch_prefill_d64(const PrefillArgs& a, int num_sms, cudaStream_t stream);
Status launch_prefill_d128(const PrefillArgs& a, int num_sms, cudaStream_t stream);

}  // namespace sm90
}  // namespace flashkda
