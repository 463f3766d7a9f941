// Internal: the bridge from the torch-free API (api.cpp, plain C++) to the CUDA side.
#pragma once

#include <cstddef>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"

namespace flashkda {
namespace detail {

// Workspace header: 1024 int32 device error words (the prefill kernels use word 0, the decode
// kernels one per block; read_device_error reports the first non-zero one).
constexpr size_t kWorkspaceHeaderBytes = 4096;
constexpr int64_t kChunkTokens = 64;
// Bytes of one chunk record (sm90::ChunkRecord<D>): W, QT, KD [C][D] bf16, UT [D][C] bf16,
// MQK [C][C] bf16, gamma [D] fp32, a 128-byte tail (UT shift).
constexpr size_t chunk_record_bytes(int64_t d) {
  return static_cast<size_t>(4 * kChunkTokens * d * 2 + kChunkTokens * kChunkTokens * 2 + d * 4 + 128);
}

#if defined(FLASHKDA_WITH_CUDA)
// Validated params (can_implement passed) on CUDA tensors.
Status run_prefill_cuda(const PrefillParams& p, const ProblemShape& shape, void* workspace, Stream stream);
// Validated DecodeParams (can_implement_decode passed) on CUDA tensors; workspace: at least
// workspace_size_decode() bytes of device memory (the error word lives at offset 0).
Status run_decode_cuda(const DecodeParams& p, const DecodeShape& shape, void* workspace, Stream stream);
#endif

}  // namespace detail
}  // namespace flashkda
