// Shared-memory layouts of the sm90 kernels that the CPU can check: the SW128 tile of the wgmma
// operands (csrc/sm90/kda_sw128.h), against the hardware's 128-byte swizzle as the PTX ISA defines
// it, and the properties the kernels rely on (a permutation of the tile's 16-byte pieces, whole
// pieces per 8-row group, no bank conflict for 8 rows of one piece column); the record tiles, which
// are SW128 images, and the packed triangles (Tb, MQK: tri64) with the walk's descriptors of them; and
// chunk_prepare's staging of them: no bank conflict for the mma fragment stores. Also the longest-first walk
// order (csrc/sm90/kda_walk_order.h): every (sequence, head) once; and chunk_prepare's dispatch order
// (csrc/sm90/kda_prepare_order.h): every (slot, head) once, every sequence's first chunks last.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "sm90/kda_pair_tiles.h"
#include "sm90/kda_prepare_order.h"
#include "sm90/kda_sw128.h"
#include "sm90/kda_walk_order.h"

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

TEST(SharedMemoryLayout, RecordTilesAreSw128Images) {
  // chunk_prepare writes each 16-bit record element at sw128_element (ChunkRecord), and
  // state_recurrence bulk-copies the tile and reads it there: the element map must be the piece map
  // plus the element's place in its piece, a permutation of the tile, and a slice of rows of the UT
  // tile [D][C] (v0 a multiple of 8, as the state slices are) must be the contiguous run of the
  // slice's own image.
  auto check = [](auto rows_tag, int cols) {
    constexpr int R = decltype(rows_tag)::value;
    std::set<int> seen;
    for (int r = 0; r < R; ++r) {
      for (int col = 0; col < cols; ++col) {
        const int e = flashkda::sm90::sw128_element<R>(r, col);
        EXPECT_EQ(e, sw128_offset<R>(r, col & ~7) / 2 + (col & 7)) << "row " << r << " column " << col;
        EXPECT_EQ(flashkda::sm90::sw128_offset_rows(R, r, col & ~7), sw128_offset<R>(r, col & ~7));
        seen.insert(e);
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), R * cols);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), R * cols - 1);
  };
  check(std::integral_constant<int, 64>{}, 128);  // W, QT, KD at D = 128
  check(std::integral_constant<int, 64>{}, 64);   // MQK, and the D = 64 tiles
  check(std::integral_constant<int, 128>{}, 64);  // UT at D = 128
  for (int v0 = 0; v0 < 128; v0 += 64) {
    for (int r = 0; r < 64; ++r) {
      for (int col = 0; col < 64; ++col) {
        EXPECT_EQ(flashkda::sm90::sw128_element<128>(v0 + r, col),
                  v0 * 64 + flashkda::sm90::sw128_element<64>(r, col));
      }
    }
  }
}

// Shared memory has 32 banks of 4 bytes; the bank of a 16-bit element offset.
int bank_of(int element) { return (element * 2 / 4) % 32; }

TEST(SharedMemoryLayout, MqkFragmentPairs) {
  // chunk_prepare stores an MQK block's fragment pairs (rows 16 I + g + 8 hh, columns 16 J + 8 nt + 2 t,
  // + 1) into its packed triangle from one element offset e (MqkPairs, kda_chunk_prepare.cuh): column + 8
  // is e + 64 (the next core matrix, 128 bytes), row + 8 is e + 128 (the next row group, 256 bytes), and
  // the pair's second element is e + 1.  A warp's store of one pair writes 32 different banks.
  using flashkda::sm90::tri64_element;
  for (int I = 0; I < 4; ++I) {
    for (int J = 0; J <= I; ++J) {
      for (int lane = 0; lane < 32; ++lane) {
        const int r = 16 * I + lane / 4, c = 16 * J + 2 * (lane % 4);
        const int e = tri64_element(r, c);
        EXPECT_EQ(tri64_element(r, c + 1), e + 1) << "row " << r << " column " << c;
        EXPECT_EQ(tri64_element(r, c + 8), e + 64) << "row " << r << " column " << c;
        EXPECT_EQ(tri64_element(r + 8, c), e + 128) << "row " << r << " column " << c;
        EXPECT_EQ(tri64_element(r + 8, c + 8), e + 192) << "row " << r << " column " << c;
      }
      for (int nt = 0; nt < 2; ++nt) {
        for (int hh = 0; hh < 2; ++hh) {
          std::set<int> banks;
          for (int lane = 0; lane < 32; ++lane)
            banks.insert(
                bank_of(tri64_element(16 * I + lane / 4 + 8 * hh, 16 * J + 8 * nt + 2 * (lane % 4))));
          EXPECT_EQ(banks.size(), 32u)
              << "block (" << I << ", " << J << ") pair (" << nt << ", " << hh << ")";
        }
      }
    }
  }
}

TEST(SharedMemoryLayout, PackedTrianglesAreTheWalksOperands) {
  // Tb and MQK records are packed triangles (tri64_offset): the 10 lower 16 x 16 blocks, each element
  // once, in kTri64Bytes, which the walk copies as they are.  Its wgmma of K step ks (tri64_desc: start
  // tri64_step_record(ks), LBO 128 along K, SBO 256 between row groups; N = 64 - 16 ks) reads B row n
  // (the tile's row 16 ks + n), column kk of the step at the no-swizzle canonical address, which must be
  // where the element is, inside its step.
  namespace s9 = flashkda::sm90;
  std::set<int> seen;
  for (int ks = 0; ks < 4; ++ks) {
    const int begin = s9::tri64_step_record(ks), end = s9::tri64_step_record(ks + 1);
    EXPECT_EQ(end - begin, (64 - 16 * ks) * 32) << "a step holds its rows' 32 bytes";
    EXPECT_EQ(begin % 16, 0);
    for (int n = 0; n < 64 - 16 * ks; ++n) {
      for (int kk = 0; kk < 16; ++kk) {
        const int r = 16 * ks + n, col = 16 * ks + kk;
        const int canonical = begin + (n / 8) * 256 + (kk / 8) * 128 + (n % 8) * 16 + (kk % 8) * 2;
        EXPECT_EQ(s9::tri64_offset(r, col), canonical) << "row " << r << " column " << col;
        EXPECT_GE(canonical, begin);
        EXPECT_LT(canonical, end);
        EXPECT_EQ(s9::tri64_element(r, col) * 2, canonical);
        seen.insert(canonical);
      }
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()) * 2, s9::kTri64Bytes) << "every byte of the image, once";
  // The walk's m64n16k16 blocks (triangle_product_first): block (J, ks) read at tri64_block(J, ks) with the
  // same LBO / SBO must be the tile's rows 16 J .., columns 16 ks .. .
  for (int J = 0; J < 4; ++J) {
    for (int ks = 0; ks <= J; ++ks) {
      for (int n = 0; n < 16; ++n) {
        for (int kk = 0; kk < 16; ++kk) {
          const int addr =
              s9::tri64_block(J, ks) + (n / 8) * 256 + (kk / 8) * 128 + (n % 8) * 16 + (kk % 8) * 2;
          EXPECT_EQ(addr, s9::tri64_offset(16 * J + n, 16 * ks + kk)) << "block (" << J << ", " << ks << ")";
        }
      }
    }
  }
  // Every element of the lower blocks is one of those (the steps' rows are exactly the lower blocks').
  int lower = 0;
  for (int r = 0; r < 64; ++r) {
    for (int col = 0; col < 64; ++col) lower += (col / 16 <= r / 16);
  }
  EXPECT_EQ(lower * 2, s9::kTri64Bytes);
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

// chunk_prepare stages W [C][D] as its record image (sw128_element) and stores
// them with TMA bulk copies; W's staging writes are the mma fragment stores of phase 5.
template <int kCols, int kRows>
void check_staged_tile() {
  std::set<int> seen;
  for (int r = 0; r < kRows; ++r) {
    for (int col = 0; col < kCols; ++col) {
      const int off = flashkda::sm90::sw128_element<kRows>(r, col);
      EXPECT_EQ((off % (kRows * 64)) / 64, r) << "an element stays in its row's 128-byte line";
      EXPECT_EQ(off % 8, col % 8) << "a 16-byte piece moves whole";
      seen.insert(off);
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), kRows * kCols) << "a permutation of the tile";
  // The fragment stores of phase 5: lane (g, t) writes the 4 bytes at (r0 + g, c0 + 2 t), for every
  // 8-row group r0 and every piece column c0; the warp's 32 words must be in 32 different banks.
  for (int r0 = 0; r0 < kRows; r0 += 8) {
    for (int c0 = 0; c0 < kCols; c0 += 8) {
      std::set<int> banks;
      for (int g = 0; g < 8; ++g) {
        for (int t = 0; t < 4; ++t)
          banks.insert(bank_of(flashkda::sm90::sw128_element<kRows>(r0 + g, c0 + 2 * t)));
      }
      EXPECT_EQ(banks.size(), 32u) << "fragment store, rows " << r0 << "-" << r0 + 7 << ", column " << c0;
    }
  }
}

TEST(SharedMemoryLayout, StagedRecordTilesAreConflictFree) {
  check_staged_tile<128, 64>();  // W (C x D, D = 128)
  check_staged_tile<64, 64>();   // W at D = 64
}

}  // namespace

// The walk's longest-first order: the ranks are a permutation, non-increasing in length with ties
// by index, and the (N, H) grid's blocks take every (sequence, head) exactly once.
TEST(PairTiles, EveryUpperTileOnceInRowOrder) {
  // The linear order visits every (ti <= tj) exactly once, row by row, and skips the others.
  for (int64_t nt : {1, 2, 3, 7, 70, 391}) {
    int64_t want_i = 0, want_j = 0, visited = 0;
    for (int64_t tl = 0; tl < flashkda::sm90::pair_tile_count(nt); ++tl) {
      int64_t ti = -1, tj = -1;
      if (!flashkda::sm90::upper_pair_tile(tl, nt, &ti, &tj)) {
        ASSERT_GT(ti, tj) << "nt " << nt << " tile " << tl;
        continue;
      }
      ASSERT_EQ(ti, want_i) << "nt " << nt << " tile " << tl;
      ASSERT_EQ(tj, want_j) << "nt " << nt << " tile " << tl;
      if (++want_j == nt) want_j = ++want_i;
      ++visited;
    }
    ASSERT_EQ(visited, nt * (nt + 1) / 2);
    ASSERT_EQ(want_i, nt);
  }
}

TEST(WalkOrder, LongestFirstTakesEverySequenceAndHeadOnce) {
  std::mt19937 rng(7);
  const std::vector<std::vector<int64_t>> fixed = {{1300, 547, 2048, 963, 271, 3063},
                                                   {64, 200, 64, 0, 200, 1, 130},
                                                   std::vector<int64_t>(40, 5),
                                                   {0},
                                                   {7, 7}};
  std::vector<std::vector<int64_t>> cases = fixed;
  for (int k = 0; k < 20; ++k) {  // random lengths with many ties and zeros, up to the 256 threads of a block
    std::vector<int64_t> lens(1 + rng() % 256);
    for (auto& l : lens) l = static_cast<int64_t>(rng() % 5) * 64 + (rng() % 3);
    cases.push_back(lens);
  }
  for (const auto& lens : cases) {
    const int N = static_cast<int>(lens.size());
    std::vector<int> seq_of_rank(N, -1);
    for (int i = 0; i < N; ++i) {
      const int r = flashkda::sm90::length_rank(lens.data(), N, i);
      ASSERT_GE(r, 0);
      ASSERT_LT(r, N);
      ASSERT_EQ(seq_of_rank[r], -1) << "two sequences share rank " << r;
      seq_of_rank[r] = i;
    }
    for (int r = 1; r < N; ++r) {
      const int a = seq_of_rank[r - 1], b = seq_of_rank[r];
      EXPECT_TRUE(lens[a] > lens[b] || (lens[a] == lens[b] && a < b)) << "ranks " << r - 1 << ", " << r;
    }
    for (int H : {1, 3, 16}) {
      std::set<std::pair<int, int>> taken;
      for (int64_t y = 0; y < H; ++y) {
        for (int64_t x = 0; x < N; ++x) {
          int64_t rank;
          int head;
          flashkda::sm90::longest_first_block(x, y, N, H, &rank, &head);
          ASSERT_GE(rank, 0);
          ASSERT_LT(rank, N);
          ASSERT_GE(head, 0);
          ASSERT_LT(head, H);
          taken.insert({seq_of_rank[rank], head});
        }
      }
      EXPECT_EQ(static_cast<int>(taken.size()), N * H) << "N " << N << " H " << H;
    }
    // The first blocks dispatched (x fastest) take the longest sequence's heads.
    int64_t rank;
    int head;
    flashkda::sm90::longest_first_block(0, 0, N, 16, &rank, &head);
    EXPECT_EQ(rank, 0);
    EXPECT_EQ(head, 0);
  }
}

// The walk forms each wgmma's descriptor as its tile's base descriptor plus the k step's offset
// (desc_offset): that must equal the descriptor of the full address for every 16-byte-aligned shared
// address a block can have, for each offset the walk adds (XT's / OT's K-major k steps, KD's N-major
// steps, the packed triangles' m64n16k16 blocks).
TEST(SharedMemoryLayout, DescriptorOffsetsEqualFullAddressDescriptors) {
  using namespace flashkda::sm90;
  std::vector<uint32_t> sw_offsets, tri_offsets;
  for (int ks = 0; ks < 8; ++ks) sw_offsets.push_back((ks >> 2) * (64 * 128) + (ks & 3) * 32);
  for (int ks = 0; ks < 4; ++ks) sw_offsets.push_back(ks * 2048);
  for (int J = 0; J < 4; ++J) {
    for (int ks = 0; ks <= J; ++ks) tri_offsets.push_back(tri64_block(J, ks));
  }
  constexpr uint32_t kSharedBytes = 232448;  // the most dynamic shared memory a block may have (sm_90)
  int checked = 0;
  for (uint32_t a = 0; a < kSharedBytes; a += 16) {
    for (uint32_t off : sw_offsets) {
      if (a + off >= kSharedBytes) continue;
      for (uint32_t lbo : {16u, 64u * 128u}) {
        ASSERT_EQ(desc_offset(sw128_desc(a, lbo, 1024), off), sw128_desc(a + off, lbo, 1024))
            << a << " + " << off;
      }
      ++checked;
    }
    for (uint32_t off : tri_offsets) {
      if (a + off >= kSharedBytes) continue;
      ASSERT_EQ(desc_offset(tri64_desc(a), off), tri64_desc(a + off)) << a << " + " << off;
      ++checked;
    }
  }
  EXPECT_GT(checked, 300000);
  // Why no offset carries out of the start address field (bits 0-13, address >> 4): every shared
  // address is below 2^18.
  EXPECT_LT((kSharedBytes - 1) >> 4, 1u << 14);
}

// div31 is n / d for every n < 2^31: every d up to 2^16 at the edges of its quotients, random pairs beyond.
TEST(PrepareOrder, Div31IsExact) {
  std::mt19937 rng(7);
  for (uint32_t d = 1; d <= 65536; ++d) {
    const flashkda::sm90::Div31 f = flashkda::sm90::make_div31(d);
    for (uint32_t n : {0u, 1u, d - 1, d, d + 1, 2 * d - 1, 2 * d, 0x7fffffffu, 0x7fffffffu - d,
                       (0x7fffffffu / d) * d, (0x7fffffffu / d) * d - 1}) {
      if (n > 0x7fffffffu) continue;
      ASSERT_EQ(flashkda::sm90::div31(n, f), n / d) << n << " / " << d;
    }
    for (int k = 0; k < 16; ++k) {
      const uint32_t n = rng() & 0x7fffffffu;
      ASSERT_EQ(flashkda::sm90::div31(n, f), n / d) << n << " / " << d;
    }
  }
  for (int k = 0; k < 200000; ++k) {
    const uint32_t d = 1 + (rng() & 0x7ffffffeu), n = rng() & 0x7fffffffu;
    ASSERT_EQ(flashkda::sm90::div31(n, flashkda::sm90::make_div31(d)), n / d) << n << " / " << d;
  }
}

// chunk_prepare's blocks take every slot exactly once (a head's blocks walk the cells), whatever the order.
TEST(PrepareOrder, EverySlotOnce) {
  for (uint32_t slots : {1u, 2u, 7u, 64u, 265u, 1000u, 4099u}) {
    for (int64_t N : {0, 1, 2, 3, 8, 64, 5000}) {
      for (bool varlen : {true, false}) {
        const flashkda::sm90::PrepareOrder o = flashkda::sm90::prepare_order(varlen, slots, N);
        ASSERT_GE(o.cols, 1u);
        ASSERT_GE(o.full, 1u);
        ASSERT_LE(o.full, o.cols);
        ASSERT_EQ(static_cast<uint64_t>(o.rows - 1) * o.cols + o.full, slots);
        std::set<uint32_t> taken;
        for (uint32_t i = 0; i < slots; ++i) {
          const uint32_t slot = flashkda::sm90::prepare_cell_slot(i, o);
          ASSERT_LT(slot, slots) << "slots " << slots << " N " << N << " cell " << i;
          taken.insert(slot);
        }
        EXPECT_EQ(taken.size(), slots) << "slots " << slots << " N " << N << " varlen " << varlen;
      }
    }
  }
}

// With equal lengths (varlen: multiples of the chunk, so that sequence n's first slot, floor(cu[n] / C) + n,
// is n (L / C + 1); fixed-length batches: any length, ceil(T / C) slots a row) the blocks dispatched last
// (block r takes cell slots - 1 - r) take chunk 0 of every sequence, with the varlen grid's spare last slot;
// the N blocks before them chunk 1.
TEST(PrepareOrder, EqualLengthsEndWithTheFirstChunks) {
  constexpr int64_t C = 64;
  for (bool varlen : {true, false}) {
    for (int64_t N : {1, 3, 8}) {
      for (int64_t L : {64, 192, 2048, 100}) {
        if (varlen && L % C != 0) continue;
        const int64_t per = (L + C - 1) / C;
        const uint32_t slots =
            static_cast<uint32_t>(varlen ? N * L / C + N + 1 : N * per);  // num_chunk_slots
        const flashkda::sm90::PrepareOrder o = flashkda::sm90::prepare_order(varlen, slots, N);
        const int64_t stride = varlen ? L / C + 1 : per;
        // the slots of the cells taken by the blocks dispatched k0 .. k1 - 1 places from the end
        auto cells = [&](uint32_t k0, uint32_t k1) {
          std::set<uint32_t> got;
          for (uint32_t k = k0; k < k1; ++k) got.insert(flashkda::sm90::prepare_cell_slot(k, o));
          return got;
        };
        const uint32_t group0 = static_cast<uint32_t>(N + (varlen ? 1 : 0));
        std::set<uint32_t> chunk0, chunk1;
        for (int64_t n = 0; n < N; ++n) {
          chunk0.insert(static_cast<uint32_t>(n * stride));
          chunk1.insert(static_cast<uint32_t>(n * stride + 1));
        }
        if (varlen) chunk0.insert(slots - 1);
        EXPECT_EQ(cells(0, group0), chunk0) << "varlen " << varlen << " N " << N << " L " << L;
        if (per >= 2) {
          EXPECT_EQ(cells(group0, group0 + static_cast<uint32_t>(N)), chunk1)
              << "varlen " << varlen << " N " << N << " L " << L;
        }
      }
    }
  }
}
