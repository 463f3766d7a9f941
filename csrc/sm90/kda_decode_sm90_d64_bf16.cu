// Instantiation of the sm90 decode kernels for K = V = 64 and a bf16 state pool (one file per
// heavy template axis: head dim x pool dtype, so the four compile in parallel).
#include "sm90/kda_decode_stream.cuh"

namespace flashkda {
namespace sm90 {
Status launch_decode_d64_bf16(const DecodeArgs& a, DecodeKernel kernel, bool pdl, int num_sms,
                              cudaStream_t stream) {
  return launch_decode_kernel<64, false>(a, kernel, pdl, num_sms, stream);
}
}  // namespace sm90
}  // namespace flashkda
