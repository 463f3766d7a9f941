// Public API entry points: workspace sizing and dispatch of run() to the CPU reference or the
// sm90 kernels.  Validation lives in validate.cpp; the CUDA side in cuda_runtime_glue.cu.
#include <cstring>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "runtime/cuda_dispatch.h"

namespace flashkda {

size_t workspace_size(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim) {
  // Header (device error word) + one chunk record per (chunk slot, head).  The slot count bound
  // total/C + N + 1 covers both varlen (see sm90::num_chunk_slots) and fixed-length batches.
  if (total_tokens < 0 || num_heads < 0 || num_seqs < 0) return detail::kWorkspaceHeaderBytes;
  const int64_t slots = total_tokens / detail::kChunkTokens + num_seqs + 1;
  return detail::kWorkspaceHeaderBytes +
         static_cast<size_t>(slots) * static_cast<size_t>(num_heads) * detail::chunk_record_bytes(head_dim);
}

size_t workspace_size(const PrefillParams& p) {
  ProblemShape s;
  if (!can_implement(p, &s).ok()) return detail::kWorkspaceHeaderBytes;
  return workspace_size(s.total_tokens, s.H, s.N, s.K);
}

Status run(const PrefillParams& p, void* workspace, size_t workspace_bytes, Stream stream) {
  ProblemShape shape;
  Status st = can_implement(p, &shape);
  if (!st.ok()) return st;
  if (p.q.device == DeviceType::kCPU) return reference::prefill_reference(p, 0);
  const size_t need = workspace_size(shape.total_tokens, shape.H, shape.N, shape.K);
  if (workspace == nullptr || workspace_bytes < need) {
    return Status::invalid("flashkda: argument 'workspace': expected at least " + std::to_string(need) +
                           " bytes of device memory, got " + std::to_string(workspace_bytes) +
                           (workspace == nullptr ? " (null pointer)" : ""));
  }
#if defined(FLASHKDA_WITH_CUDA)
  return detail::run_prefill_cuda(p, shape, workspace, stream);
#else
  (void)stream;
  return Status::not_implemented(
      "flashkda: CUDA tensors given, but this build of flashkda has no CUDA kernels");
#endif
}

const char* device_error_name(DeviceError e) {
  switch (e) {
    case DeviceError::kNone:
      return "none";
    case DeviceError::kBadCuSeqlens:
      return "cu_seqlens is not non-decreasing from 0 to the token count";
    case DeviceError::kBadStateIndex:
      return "state_indices holds a value outside [0, P) (negative = padding)";
    case DeviceError::kBadTokenRow:
      return "token_rows holds a value outside [0, rows)";
    case DeviceError::kBadCheckpointOffset:
      return "checkpoint_offsets holds a value outside [0, sequence length] or decreasing along a row";
    case DeviceError::kBadAcceptedCount:
      return "num_accepted_tokens holds a value outside [1, S]";
    case DeviceError::kStateSlotConflict:
      return "ssm_state_indices writes a pool row twice, or a row one request writes is read by another";
  }
  return "unknown device error";
}

bool built_with_cuda() {
#if defined(FLASHKDA_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

#if !defined(FLASHKDA_WITH_CUDA)
Status cuda_device_supported(int device_index) {
  (void)device_index;
  return Status::unsupported_device(
      "flashkda: CUDA tensors given, but this build of flashkda has no CUDA kernels");
}
Status read_device_error(const void*, Stream, DeviceError* err) {
  if (err) *err = DeviceError::kNone;
  return Status::not_implemented("flashkda: read_device_error needs a CUDA build");
}
Status clear_device_error(void*, Stream) {
  return Status::not_implemented("flashkda: clear_device_error needs a CUDA build");
}
#endif

}  // namespace flashkda
