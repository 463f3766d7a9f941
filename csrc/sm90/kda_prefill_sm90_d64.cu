// Instantiation of the sm90 prefill for K = V = 64.
#include "sm90/kda_prefill_sm90.cuh"

namespace flashkda {
namespace sm90 {
Status launch_prefill_d64(const PrefillArgs& a, int num_sms, cudaStream_t stream) {
  return launch_prefill<64>(a, num_sms, stream);
}
}  // namespace sm90
}  // namespace flashkda
