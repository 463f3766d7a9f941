// Shared-memory layouts of the sm90 kernels that the CPU can check: the SW128 tile of the wgmma
// operands (csrc/sm90/kda_sw128.h), against the hardware's 128-byte swizzle as the PTX ISA defines
// it, and the properties the kernels rely on (a permutation of the tile's 16-byte pieces, whole
// pieces per 8-row group, no bank conflict for 8 rows of one piece column).
#include <gtest/gtest.h>

#include <set>

#include "sm90/kda_sw128.h"

namespace {

using flashkda::sm90::sw128_offset;

// The hardware's swizzle on a byte address relative to a 1024-byte-aligned base: bits [4, 7) are
// XOR-ed with bits [7, 10) (CuTe Swizzle<3, 4, 3>), applied to the row-major address within a half.
int hardware_swizzle(int addr) { return addr ^ (((addr >> 7) & 7) << 4); }

template <int R, int Cols>
void check_tile() {
  std::set<int> seen;
  for (int r = 0; r < R; ++r) {
    for (int c8 = 0; c8 < Cols; c8 += 8) {
      const int off = sw128_offset<R>(r, c8);
      const int half = c8 / 64;
      const int linear = half * R * 128 + r * 128 + (c8 % 64) * 2;  // unswizzled, row-major in a half
      EXPECT_EQ(off, hardware_swizzle(linear)) << "row " << r << " column " << c8;
      EXPECT_EQ(off % 16, 0);
      EXPECT_GE(off, 0);
      EXPECT_LT(off, R * Cols * 2);
      EXPECT_EQ(off / (R * 128), half) << "a piece stays in its column half";
      EXPECT_EQ((off % (R * 128)) / 128, r) << "a piece stays in its row (the 128-byte line)";
      seen.insert(off);
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), R * Cols / 8) << "the pieces are a permutation of the tile";
  // 8 consecutive rows (one swizzle group) of one piece column land in 8 different 16-byte bank
  // groups: the cp.async writes of a column and the 8-row core-matrix reads are conflict-free.
  for (int r0 = 0; r0 < R; r0 += 8) {
    for (int c8 = 0; c8 < Cols; c8 += 8) {
      std::set<int> banks;
      for (int r = r0; r < r0 + 8; ++r) banks.insert((sw128_offset<R>(r, c8) % 128) / 16);
      EXPECT_EQ(banks.size(), 8u) << "rows " << r0 << "-" << r0 + 7 << ", column " << c8;
    }
  }
}

TEST(SharedMemoryLayout, Sw128TileMatchesTheHardwareSwizzle) {
  check_tile<64, 128>();  // W, QT, KD, v, kt (C x D, D = 128)
  check_tile<64, 64>();   // MQK, Tb (C x C), and the D = 64 tiles
}

TEST(SharedMemoryLayout, Sw128KStepsStayInsideTheAtom) {
  // A K-major k16 step advances the descriptor's start by 32 bytes (ks < 4 inside a half): the
  // hardware then swizzles start + row * 128 + piece * 16, which must be where the loader put the
  // piece (8 ks + piece) of that row.  Holds because the start offset only touches bits [5, 7).
  for (int ks = 0; ks < 4; ++ks) {
    for (int r = 0; r < 64; ++r) {
      for (int p = 0; p < 2; ++p) {
        const int hw = hardware_swizzle(32 * ks + r * 128 + 16 * p);
        EXPECT_EQ(hw, sw128_offset<64>(r, 16 * ks + 8 * p)) << "k-step " << ks << " row " << r;
      }
    }
  }
}

}  // namespace
