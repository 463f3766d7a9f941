// The automatic context-parallel plan (detail::auto_segment_chunks, src/api.cpp): when the prefill
// cuts few sequences x heads into segments and how long they are.  The kernels' launches rely on
// its bounds: the head walk plus the maps of the middle segments, and the segment walks, each fit
// in one wave of the GPU's SMs with an SM to spare (the map grid's waiting block), and every
// segment is at least kCpMinSegmentChunks long (the workspace's bound on segment slots).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "runtime/cuda_dispatch.h"

namespace {

using flashkda::detail::auto_segment_chunks;
using flashkda::detail::forced_segment_chunks;
using flashkda::detail::kCpMaxSeqHeads;
using flashkda::detail::kCpMinSegmentChunks;
using flashkda::detail::kMaxForcedSegmentChunks;
using flashkda::detail::segment_area_bytes;

TEST(ContextParallelPlan, TheIssueCasesOnAnH100) {
  // 1x16384 H16 (b = 32 four-warp blocks a segment): 5 segments of 52 chunks (4 of 64 before the head
  // walk); 1x65536 H16: 5 of 205.
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 256, 132), 52);
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 1024, 132), 205);
  // Batched rows stay sequence-parallel (N H > 32), as does a short sequence (fewer than 3 segments).
  EXPECT_EQ(auto_segment_chunks(8, 16, 128, 256, 132), 0);
  EXPECT_EQ(auto_segment_chunks(1, 64, 128, 128, 132), 0);
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 8, 132), 0);
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 64, 132), 0);   // 2 x 32 chunks: two segments at most
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 96, 132), 32);  // 3 x 32: the fewest that split
}

TEST(ContextParallelPlan, EveryPlanFitsOneWaveAndTheWorkspaceBound) {
  for (int sms : {8, 78, 114, 132, 144}) {
    for (int64_t d : {64, 128}) {
      for (int64_t n = 1; n <= kCpMaxSeqHeads; ++n) {
        for (int64_t h = 1; n * h <= kCpMaxSeqHeads + 8; ++h) {
          for (int64_t chunks : {1, 31, 64, 65, 96, 97, 200, 256, 1000, 1024, 5000}) {
            const int64_t len = auto_segment_chunks(n, h, d, chunks, sms);
            if (n * h > kCpMaxSeqHeads) {
              EXPECT_EQ(len, 0) << n << "x" << h;
              continue;
            }
            if (len == 0) continue;
            const int64_t b = n * h * (d / 64);  // blocks of one segment's walk (one an SM)
            const int64_t nseg = (chunks + len - 1) / len;
            EXPECT_GE(len, kCpMinSegmentChunks)
                << n << "x" << h << " d" << d << " c" << chunks << " sms" << sms;
            EXPECT_GE(nseg, 3) << n << "x" << h << " d" << d << " c" << chunks << " sms" << sms;
            // Phase 1: the head walk (b SMs) and the maps of segments 1 .. nseg - 2 (b SMs each, two map
            // blocks an SM) plus the waiting map block; phase 3: the walks of segments 1 .. nseg - 1.
            EXPECT_LE((nseg - 1) * b + 1, sms)
                << n << "x" << h << " d" << d << " c" << chunks << " sms" << sms;
          }
        }
      }
    }
  }
}

TEST(ContextParallelPlan, NoSplitWithoutRoom) {
  // b = 64 blocks on 100 SMs: two segments at most, which would walk the sequence twice over in turn.
  EXPECT_EQ(auto_segment_chunks(1, 32, 128, 1024, 100), 0);
  EXPECT_EQ(auto_segment_chunks(1, 16, 128, 1024, 1), 0);
  EXPECT_EQ(auto_segment_chunks(0, 16, 128, 1024, 132), 0);
  EXPECT_EQ(auto_segment_chunks(1, 0, 128, 1024, 132), 0);
}

// The dev switch's value is clamped: the kernels take the segment length as an int and the
// workspace bound multiplies it by the chunk length, so a huge value must not wrap either (a
// length of 2^32 + 1 read as int is 1: the workspace would reserve one slot a sequence while the
// kernels cut it into many).
TEST(ContextParallelPlan, ForcedSegmentLengthIsClamped) {
  const char* saved = std::getenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS");
  const std::string keep = saved ? saved : "";
  setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "4294967297", 1);
  EXPECT_EQ(forced_segment_chunks(), kMaxForcedSegmentChunks);
  EXPECT_LE(kMaxForcedSegmentChunks, int64_t{0x7fffffff});
  // One slot a sequence (the sequences are far shorter than a segment), not an overflowed count.
  EXPECT_EQ(segment_area_bytes(int64_t{1} << 30, 2, 3, 64), size_t{3} * 2 * 3 * 64 * 64 * sizeof(float));
  setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "9223372036854775807", 1);
  EXPECT_EQ(forced_segment_chunks(), kMaxForcedSegmentChunks);
  setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "5", 1);
  EXPECT_EQ(forced_segment_chunks(), 5);
  setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", "off", 1);
  EXPECT_EQ(forced_segment_chunks(), -1);
  if (saved) {
    setenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS", keep.c_str(), 1);
  } else {
    unsetenv("FLASHKDA_PREFILL_SEGMENT_CHUNKS");
  }
}

}  // namespace
