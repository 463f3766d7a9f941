// The upper-triangular tiles (ti <= tj) of an nt x nt tile grid in row order, as chunk_prepare deals
// them over its blocks for the N x N pool-row comparisons (check_state_rows_distinct,
// kda_chunk_prepare.cuh).  Host-callable so that the CPU tests (tests/cpp/test_layouts.cpp) check
// that every pair of tiles is visited exactly once.
#pragma once

#include <cmath>
#include <cstdint>

#include "sm90/kda_host_device.h"

namespace flashkda {
namespace sm90 {

// Number of tiles ti <= tj of an nt x nt grid.
FLASHKDA_HOST_DEVICE int64_t upper_tile_count(int64_t nt) { return nt * (nt + 1) / 2; }

// Tile (ti, tj) of linear index tl < upper_tile_count(nt): row ti holds tiles (ti, ti .. nt-1), and
// the rows before it hold ti nt - ti (ti - 1) / 2.  A closed form in double, then exact integer
// corrections (the rounding of the square root moves it by at most one row).
FLASHKDA_HOST_DEVICE void upper_tile(int64_t tl, int64_t nt, int64_t* ti_out, int64_t* tj_out) {
  const double b = 2.0 * static_cast<double>(nt) + 1.0;
  int64_t ti = static_cast<int64_t>((b - sqrt(b * b - 8.0 * static_cast<double>(tl))) / 2.0);
  ti = ti < 0 ? 0 : (ti >= nt ? nt - 1 : ti);
  while (ti > 0 && ti * nt - ti * (ti - 1) / 2 > tl) --ti;
  while (ti + 1 < nt && (ti + 1) * nt - (ti + 1) * ti / 2 <= tl) ++ti;
  *ti_out = ti;
  *tj_out = ti + (tl - (ti * nt - ti * (ti - 1) / 2));
}

}  // namespace sm90
}  // namespace flashkda
