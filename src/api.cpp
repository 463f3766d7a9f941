// Public API entry points: workspace sizing and dispatch of run() to the CPU reference or the
// sm90 kernels.  Validation lives in validate.cpp; the CUDA side in cuda_runtime_glue.cu.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "runtime/cuda_dispatch.h"

namespace flashkda {

namespace detail {

int64_t forced_segment_chunks() {
  const char* e = std::getenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS");
  if (e == nullptr) return 0;
  if (std::strcmp(e, "off") == 0) return -1;
  const long long v = std::atoll(e);
  // Clamped to kMaxForcedSegmentChunks: the kernels take the length as an int, and the workspace
  // bound multiplies it by the chunk length.  Any value past a sequence's chunk count (< 2^25 for
  // T < 2^31) already means one segment, so the clamp changes no plan.
  return v > 0 ? std::min<int64_t>(static_cast<int64_t>(v), kMaxForcedSegmentChunks) : 0;
}

// With few sequences x heads the walk uses b = N H D / 64 blocks of the GPU's SMs.  Segment 0 is
// walked at once (the head walk, b SMs) beside the maps of segments 1 .. nseg - 2 (2 b blocks each,
// two per SM: b SMs each), and segments 1 .. nseg - 1 are walked after the scan (b SMs each): both
// phases fill (nseg - 1) b SMs, so nseg - 1 = (sms - 1) / b (one SM kept for the map grid's block
// that waits for the head walk).  Segments are at least kCpMinSegmentChunks long (the workspace
// bound), and the split needs three of them to pay (two are the head walk and one segment walk,
// back to back).
int64_t auto_segment_chunks(int64_t num_seqs, int64_t num_heads, int64_t head_dim, int64_t chunks_max,
                            int sms) {
  if (num_seqs <= 0 || num_heads <= 0 || head_dim < 64 || sms <= 1) return 0;
  if (num_seqs * num_heads > kCpMaxSeqHeads) return 0;
  const int64_t blocks = num_seqs * num_heads * (head_dim / 64);
  const int64_t nseg = (sms - 1) / blocks + 1;
  if (nseg < 3) return 0;
  const int64_t len = std::max(kCpMinSegmentChunks, (chunks_max + nseg - 1) / nseg);
  return chunks_max > 2 * len ? len : 0;
}

size_t segment_area_bytes(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim) {
  const int64_t forced = forced_segment_chunks();
  int64_t seg_chunks = kCpMinSegmentChunks, seqs = num_seqs;
  if (forced < 0) return 0;
  if (forced > 0) {
    seg_chunks = forced;
  } else {
    if (num_heads <= 0 || num_heads > kCpMaxSeqHeads) return 0;
    seqs = std::min(num_seqs, kCpMaxSeqHeads / num_heads);
  }
  const int64_t slots = total_tokens / (seg_chunks * kChunkTokens) + seqs;
  return static_cast<size_t>(slots) * static_cast<size_t>(num_heads) * 3 *
         static_cast<size_t>(head_dim * head_dim) * sizeof(float);
}

}  // namespace detail

size_t workspace_size(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim) {
  // Header (device error words), one chunk record per (chunk slot, head) (the slot count bound
  // total/C + N + 1 covers both varlen, see sm90::num_chunk_slots, and fixed-length batches), then
  // the context-parallel area.
  if (total_tokens < 0 || num_heads < 0 || num_seqs < 0) return detail::kWorkspaceHeaderBytes;
  return detail::kWorkspaceHeaderBytes +
         detail::record_area_bytes(total_tokens, num_heads, num_seqs, head_dim) +
         detail::segment_area_bytes(total_tokens, num_heads, num_seqs, head_dim);
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
      return "two sequences share a state_indices row (prefill), or ssm_state_indices writes a pool row "
             "twice, "
             "or a row one request writes is read by another (decode)";
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

namespace {
Status check_error_header(const void* workspace, size_t workspace_bytes) {
  if (workspace == nullptr || workspace_bytes < detail::kWorkspaceHeaderBytes) {
    return Status::invalid("flashkda: argument 'workspace': expected at least " +
                           std::to_string(detail::kWorkspaceHeaderBytes) +
                           " bytes of device memory (the error header), got " +
                           std::to_string(workspace_bytes) + (workspace == nullptr ? " (null pointer)" : ""));
  }
  return Status::ok_status();
}
}  // namespace

Status read_device_error(const void* workspace, size_t workspace_bytes, Stream stream, DeviceError* err) {
  if (err) *err = DeviceError::kNone;
  Status st = check_error_header(workspace, workspace_bytes);
  if (!st.ok()) return st;
  return read_device_error(workspace, stream, err);
}

Status clear_device_error(void* workspace, size_t workspace_bytes, Stream stream) {
  Status st = check_error_header(workspace, workspace_bytes);
  if (!st.ok()) return st;
  return clear_device_error(workspace, stream);
}

}  // namespace flashkda
