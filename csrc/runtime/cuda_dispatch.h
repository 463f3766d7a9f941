// Internal: the bridge from the torch-free API (api.cpp, plain C++) to the CUDA side.
#pragma once

#include <cstddef>

#include "flashkda/flashkda.h"

namespace flashkda {
namespace detail {

// Workspace header: int32 device error word at offset 0; the rest is reserved.
constexpr size_t kWorkspaceHeaderBytes = 256;

#if defined(FLASHKDA_WITH_CUDA)
// Validated params (can_implement passed) on CUDA tensors.
Status run_prefill_cuda(const PrefillParams& p, const ProblemShape& shape, void* workspace, Stream stream);
#endif

}  // namespace detail
}  // namespace flashkda
