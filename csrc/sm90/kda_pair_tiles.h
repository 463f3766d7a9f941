// The tiles of an nt x nt grid of sequence-pair tiles, as chunk_prepare deals them over its blocks
// for the N x N pool-row comparisons (check_state_rows_distinct, kda_chunk_prepare.cuh): linear
// index tl is tile (tl / nt, tl % nt), and only the upper ones (ti <= tj) are compared, so every
// pair of sequences is looked at once.  Host-callable so that the CPU tests
// (tests/cpp/test_layouts.cpp) check that every upper tile is visited exactly once.
#pragma once

#include <cstdint>

#include "sm90/kda_host_device.h"

namespace flashkda {
namespace sm90 {

// Number of linear tile indices of an nt x nt grid (half of them below the diagonal, skipped).
FLASHKDA_HOST_DEVICE int64_t pair_tile_count(int64_t nt) { return nt * nt; }

// Tile (ti, tj) of linear index tl < pair_tile_count(nt); false for a tile below the diagonal.
FLASHKDA_HOST_DEVICE bool upper_pair_tile(int64_t tl, int64_t nt, int64_t* ti, int64_t* tj) {
  *ti = tl / nt;
  *tj = tl % nt;
  return *ti <= *tj;
}

}  // namespace sm90
}  // namespace flashkda
