// Instantiation of the sm90 decode kernel for K = V = 128, fp32 and bf16 state pools.
#include "sm90/kda_decode_pipelined.cuh"
#include "sm90/kda_decode_sm90.cuh"

namespace flashkda {
namespace sm90 {
Status launch_decode_d128(const DecodeArgs& a, bool state_f32, bool pipelined, bool pdl, int num_sms,
                          cudaStream_t stream) {
  if (pipelined) {
    return state_f32 ? launch_decode_pipelined<128, true>(a, num_sms, pdl, stream)
                     : launch_decode_pipelined<128, false>(a, num_sms, pdl, stream);
  }
  return state_f32 ? launch_decode<128, true>(a, stream) : launch_decode<128, false>(a, stream);
}
}  // namespace sm90
}  // namespace flashkda
