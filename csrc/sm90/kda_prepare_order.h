// The dispatch order of chunk_prepare's blocks (kda_chunk_prepare.cuh).  Its grid is (H, Y, Z) with Y Z >=
// slots, dispatched in linear order, x fastest, so block (h, y, z) is the r-th of head h's blocks, r = y + Y
// z. The walk that follows reads each (sequence, head)'s records in chunk order from the moment chunk_prepare
// ends, when the records written last are still in L2, so the blocks dispatched last should prepare the
// first chunks of every sequence and head: block r prepares the slot of cell slots - 1 - r of a column-major
// walk over the slots laid out as rows of W (prepare_order: W is the slots a sequence spans when every
// sequence has one length, so that chunk c of sequence n is column c of row n).  For other lengths it is a
// permutation of the slots all the same.  Host-callable: tests/cpp/test_layouts.cpp checks that every slot
// is taken once and that, for equal lengths, the last blocks take every chunk 0.
#pragma once

#include <cstdint>

#include "sm90/kda_host_device.h"

namespace flashkda {
namespace sm90 {

// n / d for n < 2^31 by one wide multiply and a shift: m = ceil(2^(31 + l) / d) < 2^32 with l = ceil(log2 d);
// with m = 2^(31 + l) / d + e (0 <= e < 1), n m / 2^(31 + l) = n / d + n e / 2^(31 + l) and n e d < 2^(31 +
// l), so the floor is exact.  (A runtime 32-bit division is ~15 instructions a warp, in a prologue whose
// instructions pay ~1 : 1, perf-notes v24.)
struct Div31 {
  uint32_t mul, shift;
};
FLASHKDA_HOST_DEVICE Div31 make_div31(uint32_t d) {
  uint32_t l = 0;
  while (l < 31 && (1u << l) < d) ++l;
  const uint64_t p = uint64_t{1} << (31 + l);
  Div31 f;
  f.mul = static_cast<uint32_t>((p + d - 1) / d);
  f.shift = 31 + l;
  return f;
}
FLASHKDA_HOST_DEVICE uint32_t div31(uint32_t n, const Div31& f) {
  return static_cast<uint32_t>((static_cast<uint64_t>(n) * f.mul) >> f.shift);
}

// The slots as a matrix walked column by column (rows fastest): `cols` (W) slots a row, `rows` (R) =
// ceil(slots / W) rows, the last holding `full` (q) = slots - (R - 1) W of them, so columns below q hold
// R cells and the others R - 1.  Formed on the host (launch_prefill) with the divisions by R and R - 1.
struct PrepareOrder {
  uint32_t cols, rows, full;
  Div31 by_rows, by_rows1;
};

// A varlen grid has T / C + N + 1 slots, sequence n's first at floor(cu[n] / C) + n (sequence_span), so
// equal lengths L put them (slots - 1) / N = L / C + 1 apart; a fixed-length batch has N = B rows of
// ceil(T / C) slots.
FLASHKDA_HOST_DEVICE PrepareOrder prepare_order(bool varlen, uint32_t slots, int64_t N) {
  uint64_t w = slots;
  if (N > 0)
    w = varlen ? (slots > 0 ? (slots - 1) / static_cast<uint64_t>(N) : 0) : slots / static_cast<uint64_t>(N);
  PrepareOrder o;
  o.cols = w > 0 ? static_cast<uint32_t>(w) : 1u;
  o.rows = slots > 0 ? (slots + o.cols - 1) / o.cols : 1u;
  o.full = slots - (o.rows - 1) * o.cols;  // 1 .. cols (0 only when slots is)
  o.by_rows = make_div31(o.rows);
  o.by_rows1 = make_div31(o.rows > 1 ? o.rows - 1 : 1);
  return o;
}

// The slot of cell i (0 <= i < slots < 2^31) of the column-major walk.
FLASHKDA_HOST_DEVICE uint32_t prepare_cell_slot(uint32_t i, const PrepareOrder& o) {
  uint32_t row, col;
  if (i < o.full * o.rows) {
    col = div31(i, o.by_rows), row = i - col * o.rows;
  } else {  // rows >= 2 here: with one row, full = slots
    const uint32_t j = i - o.full * o.rows;
    col = div31(j, o.by_rows1);
    row = j - col * (o.rows - 1);
    col += o.full;
  }
  return row * o.cols + col;
}

}  // namespace sm90
}  // namespace flashkda
