// Placeholder while the sm90 kernels are written.
#include "flashkda/flashkda.h"
#include "runtime/cuda_dispatch.h"
#include <cuda_runtime.h>
namespace flashkda {
Status cuda_device_supported(int) { return Status::unsupported_device("flashkda: sm90 kernels not built yet"); }
Status read_device_error(const void*, Stream, DeviceError* err) { if (err) *err = DeviceError::kNone; return Status::ok_status(); }
Status clear_device_error(void*, Stream) { return Status::ok_status(); }
namespace detail {
Status run_prefill_cuda(const PrefillParams&, const ProblemShape&, void*, Stream) { return Status::not_implemented("flashkda: sm90 kernels not built yet"); }
}
}
