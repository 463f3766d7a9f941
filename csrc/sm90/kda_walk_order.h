// The longest-first order of whole walks (state_recurrence, kda_state_recurrence.cuh): on varlen
// grids with more blocks than SMs, block (x, y) of the (N, H) grid takes head b % H of the sequence
// ranked b / H by length, b = x + N y, longest first and ties by index, so that the longest walks
// start in the first wave.  Host-callable so that the CPU tests (tests/cpp/test_layouts.cpp) check
// that every (sequence, head) is taken exactly once.
#pragma once

#include <cstdint>

#include "sm90/kda_host_device.h"

namespace flashkda {
namespace sm90 {

// Rank of sequence i among the n lengths: the number of longer ones plus equal ones of lower index
// (a permutation of 0 .. n - 1).
FLASHKDA_HOST_DEVICE int length_rank(const int64_t* lens, int n, int i) {
  const int64_t li = lens[i];
  int rank = 0;
  for (int j = 0; j < n; ++j) {
    const int64_t lj = lens[j];
    rank += (lj > li) || (lj == li && j < i);
  }
  return rank;
}

// The (rank, head) that block (x, y) of an (N, H) grid takes: blocks are dispatched x fastest, so
// consecutive blocks take the heads of one sequence, longest sequence first.
FLASHKDA_HOST_DEVICE void longest_first_block(int64_t x, int64_t y, int N, int H, int64_t* rank, int* head) {
  const int64_t b = x + static_cast<int64_t>(N) * y;
  *rank = b / H;
  *head = static_cast<int>(b % H);
}

}  // namespace sm90
}  // namespace flashkda
