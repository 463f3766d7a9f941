// Instantiation of the sm90 decode kernels for K = V = 128 and a bf16 state pool (one file per
// heavy template axis: head dim x pool dtype, so the four compile in parallel).
#include "sm90/kda_decode_stream.cuh"

namespace flashkda {
namespace sm90 {
template Status launch_decode_kernel<128, false>(const DecodeArgs&, DecodeKernel, bool, int, cudaStream_t);
}  // namespace sm90
}  // namespace flashkda
