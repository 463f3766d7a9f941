// Host-side launcher of the sm90 prefill for one head dim: chunk_prepare over every (chunk slot,
// head), then state_recurrence over every (sequence, head, state slice), then (with checkpoints)
// checkpoint_advance, all on the caller's stream.  With context parallelism (a.seg_chunks > 0) the
// recurrence is four launches instead: the head walk (segment 0), the segment maps beside it,
// segment_scan, the segment walks.
// Grid sizes come from host-known sizes only (no read of cu_seqlens), so the call is graph-safe.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "flashkda/flashkda.h"
#include "sm90/kda_checkpoint_advance.cuh"
#include "sm90/kda_chunk_prepare.cuh"
#include "sm90/kda_segment_scan.cuh"
#include "sm90/kda_state_recurrence.cuh"

namespace flashkda {
namespace sm90 {

// Warps per state_recurrence block (each warp owns 16 state rows; a block handles 16 NW of the D
// rows of one head): 4 while the grid of 4-warp blocks (N H D / 64) fits in one wave of the GPU, so
// that few sequences x heads spread over more SMs, else 8 (D = 128), whose blocks share the record
// loads of a head between its two V halves (1- and 2-warp blocks were measured slower, 781 vs 712 us
// of state recurrence on 1x16384 H16, docs/perf-notes.md).
inline int state_block_warps(int64_t N, int64_t H, int64_t D, int num_sms) {
  for (int nw = 4; nw < 8; nw *= 2) {
    if (16 * nw <= D && N * H * (D / (16 * nw)) <= num_sms) return nw;
  }
  return D >= 128 ? 8 : 4;
}

template <int D, int NW, RecurrenceMode kMode = RecurrenceMode::kWhole>
Status launch_recurrence(const PrefillArgs& args, int num_sms, cudaStream_t stream) {
  constexpr bool kMap = kMode == RecurrenceMode::kSegmentMap;
  using SM = RecurrenceSmem<D, NW, kMap>;
  PrefillArgs a = args;
  auto kernel = state_recurrence_kernel<D, NW, kMode>;
  cudaError_t e = set_smem_limit_once<state_recurrence_kernel<D, NW, kMode>>(SM::kBytes);
  if (e != cudaSuccess) return cuda_status(e, "state_recurrence smem attribute");
  const bool per_sequence = kMode == RecurrenceMode::kWhole || kMode == RecurrenceMode::kSegmentHead;
  const int64_t gx = per_sequence ? a.N : static_cast<int64_t>(a.N) * a.max_segs;
  if (gx > 0x7fffffff) return Status::invalid("flashkda: problem too large for one launch");
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(a.H), (kMap ? 2 * D : D) / SM::kVs);
  // Longest sequences first pays only when the blocks come in more than one wave (the ranking costs
  // each block two barriers and N loads at its start): varlen H96 walk 353.6 -> 294.0 us.
  a.walk_longest_first = kMode == RecurrenceMode::kWhole && a.cu_seqlens != nullptr && a.N > 1 &&
                         a.N <= 32 * NW && gx * grid.y * grid.z > num_sms;
  // The 8-warp whole walk (always more blocks than SMs: state_block_warps) follows chunk_prepare with
  // programmatic stream serialisation: its blocks are placed and run their prologue (spans, longest-
  // first ranking) while chunk_prepare's last wave drains, then wait for it (griddepcontrol.wait).
  // Measured on an H100 (perf-notes v27): 16x64 H16 -4.5% a call (faster in 7 of 7 rounds), the large
  // batched rows within +-0.5%; earlier versions that also reordered the walk's first copies or took
  // the one-wave 4-warp walks and the segment maps along were slower there (v23, v24), so those launch
  // plainly (again measured at v32 with the kernel unchanged: 1x512 H16 +5%, the walk waiting out
  // chunk_prepare).
  // The segment maps follow the head walk the same way (launch_context_parallel), so that they run
  // beside it, and the segment walks follow segment_scan the same way, so that their launch and prologue
  // (spans, the pool row's load) overlap the scan (with the scan's own programmatic launch: 1x16384 H16
  // -0.66%, v32).  The head walk launches plainly: launched programmatically it measured +0.5% there.
  const bool pdl =
      ((kMode == RecurrenceMode::kWhole && NW == 8) || kMap || kMode == RecurrenceMode::kSegmentApply) &&
      a.walk_pdl;
  return launch_maybe_programmatic(kernel, grid, dim3(32 * NW), SM::kBytes, pdl, stream,
                                   "state_recurrence launch", a);
}

// Context parallelism: the head walk (segment 0 of every sequence, the 4-warp whole walk cut at
// seg_chunks, ending with S_1) with the maps of segments 1 .. nseg - 2 beside it (4-warp blocks, two
// per SM, launched programmatically so that they run on the SMs the head walk leaves), their scan from
// S_1, the walks of segments 1 .. nseg - 1.  Segment 0 used to be mapped too, its walk waiting for the
// scan like the others'; walking it at once removes its map and shortens every segment (one more of
// them for the same SMs: the head walk takes the SMs of one segment's maps).  With two segments at
// most there is nothing to map or scan.
template <int D>
Status launch_context_parallel(const PrefillArgs& a, int num_sms, cudaStream_t stream) {
  Status st = launch_recurrence<D, 4, RecurrenceMode::kSegmentHead>(a, num_sms, stream);
  if (!st.ok()) return st;
  if (a.max_segs >= 3) {
    st = launch_recurrence<D, 4, RecurrenceMode::kSegmentMap>(a, num_sms, stream);
    if (!st.ok()) return st;
    cudaError_t e = set_smem_limit_once<segment_scan_kernel<D>>(ScanSmem<D>::kBytes);
    if (e != cudaSuccess) return cuda_status(e, "segment_scan smem attribute");
    // Programmatic after the maps (which trigger at their start): the scan's blocks are placed on
    // the SMs that phase 1 leaves free and wait there for the maps' completion.
    st = launch_maybe_programmatic(
        segment_scan_kernel<D>, dim3(static_cast<unsigned>(a.N), static_cast<unsigned>(a.H), D / 16),
        dim3(scan_threads<D>()), ScanSmem<D>::kBytes, a.walk_pdl != 0, stream, "segment_scan launch", a);
    if (!st.ok()) return st;
  }
  return launch_recurrence<D, 4, RecurrenceMode::kSegmentApply>(a, num_sms, stream);
}

template <int D>
Status launch_prefill(const PrefillArgs& a, int num_sms, cudaStream_t stream) {
  using PS = PrepareSmem<D>;
  if (a.H <= 0) return Status::ok_status();
  // chunk_prepare also validates the index tensors (block 0), so it runs even with no chunk.
  auto prep = chunk_prepare_kernel<D>;
  cudaError_t e = set_smem_limit_once<chunk_prepare_kernel<D>>(PS::kBytes);
  if (e != cudaSuccess) return cuda_status(e, "chunk_prepare smem attribute");
  const int64_t slots = a.num_slots > 0 ? a.num_slots : 1;
  if (slots > 0x7fffffff || a.H > 65535) return Status::invalid("flashkda: problem too large for one launch");
  // (H, Y, Z): head fastest, then the slot order of kda_prepare_order.h; Y Z >= slots (Y, Z <= 65535).
  const unsigned gy = static_cast<unsigned>(slots < 65535 ? slots : 65535);
  dim3 grid(static_cast<unsigned>(a.H), gy, static_cast<unsigned>((slots + gy - 1) / gy));
  PrefillArgs pa = a;
  pa.num_slots = slots;
  pa.prep_order = prepare_order(a.cu_seqlens != nullptr, static_cast<uint32_t>(slots), a.N);
  Status st = Status::ok_status();
  if (a.dev_only != 2) {
    prep<<<grid, kPrepareThreads, PS::kBytes, stream>>>(pa);
    st = cuda_status(cudaGetLastError(), "chunk_prepare launch");
  }
  if (!st.ok() || a.N <= 0 || a.dev_only == 1) return st;
  if (a.seg_chunks > 0) {  // the segment walks write the checkpoints' chunk-boundary states
    st = launch_context_parallel<D>(a, num_sms, stream);
  } else {
    switch (a.walk_warps ? a.walk_warps : state_block_warps(a.N, a.H, D, num_sms)) {
      case 4:
        st = launch_recurrence<D, 4>(a, num_sms, stream);
        break;
      default:
        if constexpr (D >= 128) {
          st = launch_recurrence<D, 8>(a, num_sms, stream);
        } else {
          st = launch_recurrence<D, 4>(a, num_sms, stream);
        }
    }
  }
  if (!st.ok() || a.ckpt_offsets == nullptr || a.n_ckpt <= 0) return st;
  const int64_t blocks = static_cast<int64_t>(a.N) * a.n_ckpt * a.H * (D / AdvanceSmem<D>::kRows);
  if (blocks > 0x7fffffff)  // unreachable: validation refuses N x n_ckpt x H x V >= 2^31 first
    return Status::invalid(
        "flashkda: argument 'checkpoint_offsets': expected N x n_ckpt x H x (D / 64) "
        "below 2^31, got " +
        std::to_string(blocks));
  e = set_smem_limit_once<checkpoint_advance_kernel<D>>(sizeof(AdvanceSmem<D>));
  if (e != cudaSuccess) return cuda_status(e, "checkpoint_advance smem attribute");
  checkpoint_advance_kernel<D>
      <<<static_cast<unsigned>(blocks), kAdvanceWarps<D> * 32, sizeof(AdvanceSmem<D>), stream>>>(a);
  return cuda_status(cudaGetLastError(), "checkpoint_advance launch");
}

// Explicit instantiations live in kda_prefill_sm90_d{64,128}.cu.
Status launch_prefill_d64(const PrefillArgs& a, int num_sms, cudaStream_t stream);
Status launch_prefill_d128(const PrefillArgs& a, int num_sms, cudaStream_t stream);

}  // namespace sm90
}  // namespace flashkda
