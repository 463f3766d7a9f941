// The 128-byte-swizzled ("SW128") shared-memory tile layout of the wgmma operands (kda_wgmma.cuh), their
// matrix descriptors, and the staged record tiles of chunk_prepare, host-callable so that the CPU tests check
// them (tests/cpp/test_layouts.cpp) against the hardware's swizzle definition and for the bank-conflict
// properties the kernels rely on.  The chunk records (ChunkRecord) are stored as these images.
//
// A 16-bit matrix of R rows and 64 h columns is stored as h column halves of R x 128 bytes, each
// half 1024-byte aligned; inside a half, the 16-byte piece c (0..7) of row r sits at
// r * 128 + ((c ^ (r & 7)) * 16).  That is the unswizzled (row-major within a half) byte address A
// with bits [4, 7) XOR-ed with bits [7, 10), which is what the hardware applies to the absolute
// address (PTX ISA, wgmma shared-memory layouts, 128B swizzling: CuTe's Swizzle<3, 4, 3>), hence
// the 1024-byte alignment of every half.
#pragma once

#include <cstdint>

#include "sm90/kda_host_device.h"

namespace flashkda {
namespace sm90 {

// Byte offset of the 16-byte piece holding elements [c8, c8 + 8) of row r in a SW128 tile of `rows`
// rows (a multiple of 8).
FLASHKDA_HOST_DEVICE int sw128_offset_rows(int rows, int r, int c8) {
  return (c8 >> 6) * (rows * 128) + r * 128 + ((((c8 & 63) >> 3) ^ (r & 7)) << 4);
}

// The same with the row count known at compile time.
template <int R>
FLASHKDA_HOST_DEVICE int sw128_offset(int r, int c8) {
  static_assert(R % 8 == 0, "a half holds whole 8-row swizzle groups");
  return sw128_offset_rows(R, r, c8);
}

// Element offset of the 16-bit element (r, col) in a SW128 tile of R rows.  The byte offset is
// non-negative, so >> 1 halves it: a signed / 2 compiles to a rounding add and a shift.
template <int R>
FLASHKDA_HOST_DEVICE int sw128_element(int r, int col) {
  return (sw128_offset<R>(r, col & ~7) >> 1) + (col & 7);
}

// Lower-triangular 64 x 64 tiles (Tb, MQK: zero where column block > row block, in 16 x 16 blocks) as
// packed K-major images without swizzle ("tri64"), in the record and in the walk's shared memory alike,
// the wgmma's no-swizzle canonical layout of 8-row x 16-byte core matrices.  K step ks (columns 16 ks ..
// 16 ks + 15, one k16 B operand) holds only rows 16 ks .. 63 (the others are zero): core matrix (row group
// g = r / 8, column piece p = (col / 8) & 1) at (g - 2 ks) * 256 + p * 128, row r & 7 at 16 bytes within
// it (descriptor: LBO = 128 between the pieces along K, SBO = 256 between row groups).  The steps follow
// each other: 2048 + 1536 + 1024 + 512 = 5120 bytes for the 8192 of a full tile.  The walk multiplies it
// in m64n16k16 blocks: its output's column block J takes steps 0 .. J, B's row block J of step ks being
// 512 (J - ks) bytes into the step (triangle_product_first, kda_state_recurrence.cuh).
constexpr int kTri64Bytes = 5120;

// Where K step ks starts (bytes): the sum of the earlier steps, 2048 - 512 j each.
FLASHKDA_HOST_DEVICE constexpr int tri64_step_record(int ks) { return 2048 * ks - 256 * ks * (ks - 1); }

// Byte offset of the 16-bit element (r, col), col / 16 <= r / 16, in the packed image.
FLASHKDA_HOST_DEVICE constexpr int tri64_offset(int r, int col) {
  return tri64_step_record(col >> 4) + ((r >> 3) - 2 * (col >> 4)) * 256 + ((col >> 3) & 1) * 128 +
         (r & 7) * 16 + (col & 7) * 2;
}
// Element offset.
FLASHKDA_HOST_DEVICE constexpr int tri64_element(int r, int col) { return tri64_offset(r, col) >> 1; }
// Where the 16 x 16 block (row block J, K step ks), ks <= J, starts: the walk's m64n16k16 B operand for
// its output's column block J and K step ks (rows 16 J .. of the step, 256 bytes a row group).
FLASHKDA_HOST_DEVICE constexpr int tri64_block(int J, int ks) {
  return tri64_step_record(ks) + 512 * (J - ks);
}
static_assert(tri64_step_record(4) == kTri64Bytes, "the four steps fill the packed tile");

// Matrix descriptor (PTX "shared memory matrix descriptor"): start address, leading and stride byte
// offsets (all >> 4), layout type in bits [62, 64) (0: no swizzle, 1: 128-byte swizzle).
FLASHKDA_HOST_DEVICE uint64_t smem_desc(uint32_t saddr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                        uint32_t layout) {
  return static_cast<uint64_t>((saddr & 0x3ffff) >> 4) |
         static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fff) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fff) << 32 | static_cast<uint64_t>(layout) << 62;
}

// A SW128 tile's descriptor.  The start address may be offset by multiples of 16 bytes inside a
// 1024-byte-aligned atom (the k16 steps of a K-major tile): the swizzle is computed from the absolute
// address bits, so the atom's base must be 1024-aligned.
FLASHKDA_HOST_DEVICE uint64_t sw128_desc(uint32_t saddr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return smem_desc(saddr, lbo_bytes, sbo_bytes, 1);
}

// Descriptor of one K step of a packed-triangle tile's shared image (tri64, above): no swizzle (K-major
// core matrices of 8 rows x 16 bytes), LBO = 128 bytes between the step's two core matrices along K,
// SBO = 256 bytes between row groups; 16-byte alignment suffices.
FLASHKDA_HOST_DEVICE uint64_t tri64_desc(uint32_t saddr) { return smem_desc(saddr, 128, 256, 0); }

// The descriptor of the same tile `bytes` further on (a multiple of 16): the start address field (bits
// [0, 14), address >> 4) advances; it cannot carry into the fields above, since every shared address
// is below 2^18.  Forming each k step's descriptor from its tile's base this way takes one add where
// sw128_desc / tri64_desc of the full address took five uniform instructions a wgmma (~200 a chunk
// on the walk's one warp per scheduler).
FLASHKDA_HOST_DEVICE uint64_t desc_offset(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

}  // namespace sm90
}  // namespace flashkda
