// Warpgroup MMA (sm_90a wgmma) primitives: the shared-memory matrix descriptor of a 128-byte-
// swizzled tile, the fence / commit / wait of the async group, and the register-A instruction
// forms the state recurrence uses (A from registers, B from shared memory, fp32 accumulators).
//
// Tile layout ("SW128"): a 16-bit matrix of R rows and 64 h columns is stored as h column halves of
// R x 128 bytes (64 elements per row), each half 1024-byte aligned; inside a half, the 16-byte piece
// c (0..7) of row r sits at r * 128 + ((c ^ (r & 7)) * 16).  The XOR is the hardware's 128-byte
// swizzle (it is applied to address bits [4, 7) from bits [7, 10)), so 8 consecutive rows of one
// piece column hit 8 different bank groups for both the cp.async writes and the wgmma reads.
// The same bytes serve both majors:
// - K-major B (B[k][n] = X[n][k], X rows = n): a k16 step is +32 bytes inside a half, the next half
//   at +R * 128; the 8-row groups of n are 1024 bytes apart (SBO); LBO unused.
// - N-major B (B[k][n] = X[k][n], X rows = k, transposed instruction form): a k16 step is +2048 bytes
//   (two 8-row groups, SBO = 1024), and the next 64 n (the other half) is LBO = R * 128 bytes away.
#pragma once

#include <cstdint>

#include "sm90/kda_sw128.h"  // sw128_offset: the tile layout below

namespace flashkda {
namespace sm90 {

// Matrix descriptor (PTX "shared memory matrix descriptor"): start address, leading and stride byte
// offsets (all >> 4), layout type 1 = 128-byte swizzle in bits [62, 64).  The start address may be
// offset by multiples of 16 bytes inside a 1024-byte-aligned atom (the k16 steps of a K-major tile):
// the swizzle is computed from the absolute address bits, so the atom's base must be 1024-aligned.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((saddr & 0x3ffff) >> 4) |
         static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fff) << 16 |
         static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fff) << 32 | static_cast<uint64_t>(1) << 62;
}

// Orders this thread's generic-proxy shared-memory writes (cp.async included) before async-proxy
// reads (wgmma) that a following barrier publishes.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Register accesses before it are ordered before the wgmma that follow (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// D(64 x 64, fp32) += scale_a A(64 x 16, bf16, registers) B(16 x 64, bf16, shared memory).
template <int kScaleA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs(float (&d)[8][4], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  static_assert(kScaleA == 1 || kScaleA == -1, "scale-a is +-1");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, %37, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kScaleA), "n"(kTransB));
}

// D(64 x 64, fp32) += scale_a A(64 x 16, fp16, registers) B(16 x 64, fp16, shared memory).
template <int kScaleA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_f16_rs(float (&d)[8][4], const uint32_t (&a)[4],
                                                       uint64_t desc_b) {
  static_assert(kScaleA == 1 || kScaleA == -1, "scale-a is +-1");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, %37, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kScaleA), "n"(kTransB));
}

// D(64 x 128, fp32) += scale_a A(64 x 16, fp16, registers) B(16 x 128, fp16, shared memory).
template <int kScaleA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[16][4], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  static_assert(kScaleA == 1 || kScaleA == -1, "scale-a is +-1");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, %69, 1, %70;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kScaleA), "n"(kTransB));
}

}  // namespace sm90
}  // namespace flashkda
