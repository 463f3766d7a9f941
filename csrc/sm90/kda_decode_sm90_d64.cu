// Instantiation of the sm90 decode kernels for K = V = 64, fp32 and bf16 state pools.
#include "sm90/kda_decode_stream.cuh"

namespace flashkda {
namespace sm90 {
Status launch_decode_d64(const DecodeArgs& a, bool state_f32, DecodeKernel kernel, bool pdl, int num_sms,
                         cudaStream_t stream) {
  return state_f32 ? launch_decode_kernel<64, true>(a, kernel, pdl, num_sms, stream)
                   : launch_decode_kernel<64, false>(a, kernel, pdl, num_sms, stream);
}
}  // namespace sm90
}  // namespace flashkda
