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
// Bytes of one chunk record (sm90::ChunkRecord<D>): KT, QT, KD [C][D] 16-bit, TB and MQK [C][C] fp16
// lower-triangular, packed to their 10 nonzero 16 x 16 blocks (5120 bytes each: sm90::kTri64Bytes),
// gamma [D] fp32, a 128-byte tail (the shifts).
constexpr int64_t kTriTileBytes = 5120;
constexpr size_t chunk_record_bytes(int64_t d) {
  return static_cast<size_t>(3 * kChunkTokens * d * 2 + 2 * kTriTileBytes + d * 4 + 128);
}

// Context parallelism of the CUDA prefill (few sequences x heads: each sequence is cut into
// segments walked in parallel, kda_segment_scan.cuh).  It is chosen only when N H <= kCpMaxSeqHeads
// and with segments of at least kCpMinSegmentChunks chunks, so its workspace area (three D x D fp32
// blocks per segment slot and head) is bounded by floor(T / (C kCpMinSegmentChunks)) + min(N,
// kCpMaxSeqHeads / H) slots: monotone in T and N, so a workspace sized for the largest step still
// fits every smaller one.
constexpr int64_t kCpMaxSeqHeads = 32;
constexpr int64_t kCpMinSegmentChunks = 32;
// Dev switch FLASHKDA_PREFILL_SEGMENT_CHUNKS=<L> (L >= 1): force context parallelism with segments
// of L chunks on every call (tests of the segment path on small inputs);
// workspace_size() then reserves the larger area that needs.  =off: never (A/B benchmarks).
// Returns L (at most kMaxForcedSegmentChunks), -1 for off, 0 when unset (the automatic choice).
constexpr int64_t kMaxForcedSegmentChunks = int64_t{1} << 30;
int64_t forced_segment_chunks();
// The automatic context-parallel plan: segment length in chunks for num_seqs x num_heads sequences of
// at most chunks_max chunks on `sms` SMs, 0 for the sequence-parallel walk (api.cpp says why).
int64_t auto_segment_chunks(int64_t num_seqs, int64_t num_heads, int64_t head_dim, int64_t chunks_max,
                            int sms);
// The launch limits validation checks for CUDA tensors (validate.cpp): H on one grid dimension,
// B, T, N as int (T with room to round up to whole chunks).
Status cuda_size_limits(int64_t B, int64_t T, int64_t H, int64_t N);
// Bytes of the context-parallel area that follows the chunk records.
size_t segment_area_bytes(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim);
// Bytes of the chunk-record area: one record per (chunk slot, head), with total / C + N + 1 slots.
inline size_t record_area_bytes(int64_t total_tokens, int64_t num_heads, int64_t num_seqs, int64_t head_dim) {
  const int64_t slots = total_tokens / kChunkTokens + num_seqs + 1;
  return static_cast<size_t>(slots) * static_cast<size_t>(num_heads) * chunk_record_bytes(head_dim);
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
