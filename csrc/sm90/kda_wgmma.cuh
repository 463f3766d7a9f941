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

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "sm90/kda_sw128.h"  // sw128_offset, the descriptors: the tile layout below

namespace flashkda {
namespace sm90 {

// The matrix descriptors (sw128_desc, tri64_desc, desc_offset) are in kda_sw128.h, host-callable so that
// the CPU tests check them.

// Register accesses before it are ordered before the wgmma that follow (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Ties accumulator registers to this point of the asm order: the wgmma asm statements write their
// accumulators at issue as far as the compiler knows, and wgmma_wait names no register, so without
// this a read of an accumulator could legally be scheduled above the wait that makes it valid.  Put
// it after each wait, on the accumulators that wait completes (it emits no instruction).
template <int M>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[M][4]) {
#pragma unroll
  for (int j = 0; j < M; ++j) {
    asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
  }
}

// The register-A instruction forms, written once: FLASHKDA_WGMMA_RS(shape, type, N, d, a, desc_b)
// issues D(64 x N, fp32) += scale_a A(64 x 16, type, registers) B(16 x N, type, shared memory) with
// the enclosing template's kScaleA (+-1) and kTransB (1: N-major B).  N16 / N64 / N128 select the
// accumulator operand list (8, 32 or 64 fp32 registers a thread) and the A / descriptor operand indices.
// FLASHKDA_WGMMA_RS_FIRST is the same with scale-d = 0 (D = scale_a A B) and write-only accumulators.
#define FLASHKDA_WGMMA_D4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FLASHKDA_WGMMA_D_N64(d)                                                                       \
  FLASHKDA_WGMMA_D4(d, 0), FLASHKDA_WGMMA_D4(d, 1), FLASHKDA_WGMMA_D4(d, 2), FLASHKDA_WGMMA_D4(d, 3), \
      FLASHKDA_WGMMA_D4(d, 4), FLASHKDA_WGMMA_D4(d, 5), FLASHKDA_WGMMA_D4(d, 6), FLASHKDA_WGMMA_D4(d, 7)
// Write-only accumulators (scale-d = 0: D = A B, the old D neither read nor needed).
#define FLASHKDA_WGMMA_W4(d, j) "=f"(d[j][0]), "=f"(d[j][1]), "=f"(d[j][2]), "=f"(d[j][3])
#define FLASHKDA_WGMMA_W_N64(d)                                                                       \
  FLASHKDA_WGMMA_W4(d, 0), FLASHKDA_WGMMA_W4(d, 1), FLASHKDA_WGMMA_W4(d, 2), FLASHKDA_WGMMA_W4(d, 3), \
      FLASHKDA_WGMMA_W4(d, 4), FLASHKDA_WGMMA_W4(d, 5), FLASHKDA_WGMMA_W4(d, 6), FLASHKDA_WGMMA_W4(d, 7)
#define FLASHKDA_WGMMA_D_N128(d)                                                                       \
  FLASHKDA_WGMMA_D_N64(d), FLASHKDA_WGMMA_D4(d, 8), FLASHKDA_WGMMA_D4(d, 9), FLASHKDA_WGMMA_D4(d, 10), \
      FLASHKDA_WGMMA_D4(d, 11), FLASHKDA_WGMMA_D4(d, 12), FLASHKDA_WGMMA_D4(d, 13),                    \
      FLASHKDA_WGMMA_D4(d, 14), FLASHKDA_WGMMA_D4(d, 15)
// N16: the accumulator tile pair kT0, kT0 + 1 of the enclosing template (wgmma_m64n16k16_f16_rs).
#define FLASHKDA_WGMMA_D_N16(d) FLASHKDA_WGMMA_D4(d, kT0), FLASHKDA_WGMMA_D4(d, kT0 + 1)
#define FLASHKDA_WGMMA_W_N16(d) FLASHKDA_WGMMA_W4(d, kT0), FLASHKDA_WGMMA_W4(d, kT0 + 1)
#define FLASHKDA_WGMMA_REGS_N16 "%0, %1, %2, %3, %4, %5, %6, %7"
#define FLASHKDA_WGMMA_TAIL_N16 "{%8, %9, %10, %11}, %12, p, %13, 1, %14"
#define FLASHKDA_WGMMA_REGS_N64                                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHKDA_WGMMA_REGS_N128                                                                      \
  FLASHKDA_WGMMA_REGS_N64                                                                             \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, " \
  "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHKDA_WGMMA_TAIL_N64 "{%32, %33, %34, %35}, %36, p, %37, 1, %38"
#define FLASHKDA_WGMMA_TAIL_N128 "{%64, %65, %66, %67}, %68, p, %69, 1, %70"
// SCALE_D: 1 accumulates (read-write accumulators, FLASHKDA_WGMMA_D_), 0 overwrites (write-only,
// FLASHKDA_WGMMA_W_).
#define FLASHKDA_WGMMA_RS_SCALED(SCALE_D, OUTS, SHAPE, TYPE, N, d, a, desc_b)                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " #SCALE_D                                             \
               ", 0;\n"                                                                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" FLASHKDA_WGMMA_REGS_##N \
               "}, " FLASHKDA_WGMMA_TAIL_##N ";\n}\n"                                                   \
               : OUTS##N(d)                                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kScaleA), "n"(kTransB))
#define FLASHKDA_WGMMA_RS(SHAPE, TYPE, N, d, a, desc_b) \
  FLASHKDA_WGMMA_RS_SCALED(1, FLASHKDA_WGMMA_D_, SHAPE, TYPE, N, d, a, desc_b)
#define FLASHKDA_WGMMA_RS_FIRST(SHAPE, TYPE, N, d, a, desc_b) \
  FLASHKDA_WGMMA_RS_SCALED(0, FLASHKDA_WGMMA_W_, SHAPE, TYPE, N, d, a, desc_b)

// D(64 x 64, fp32) += scale_a A(64 x 16, registers) B(16 x 64, shared memory); T = bf16 or fp16.
// kAccumulate = false: D = scale_a A B, the first product of an accumulation (scale-d = 0), so the
// accumulators need no zeroing (which, as register moves the compiler may place inside a batch, made
// ptxas inject a warpgroup.arrive: C7519).
template <typename T, int kScaleA, int kTransB, bool kAccumulate = true>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4],
                                                   uint64_t desc_b) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "bf16 or fp16 inputs");
  static_assert(kScaleA == 1 || kScaleA == -1, "scale-a is +-1");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (kAccumulate && kBf16) {
    FLASHKDA_WGMMA_RS("m64n64k16", "bf16", N64, d, a, desc_b);
  } else if constexpr (kAccumulate) {
    FLASHKDA_WGMMA_RS("m64n64k16", "f16", N64, d, a, desc_b);
  } else if constexpr (kBf16) {
    FLASHKDA_WGMMA_RS_FIRST("m64n64k16", "bf16", N64, d, a, desc_b);
  } else {
    FLASHKDA_WGMMA_RS_FIRST("m64n64k16", "f16", N64, d, a, desc_b);
  }
}

// D(64 x 128, fp32) += scale_a A(64 x 16, fp16, registers) B(16 x 128, fp16, shared memory).
template <int kScaleA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[16][4], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  static_assert(kScaleA == 1 || kScaleA == -1, "scale-a is +-1");
  FLASHKDA_WGMMA_RS("m64n128k16", "f16", N128, d, a, desc_b);
}

// D(64 x 16, fp32) += A(64 x 16, fp16, registers) B(16 x 16, fp16, shared memory, K-major) into the
// accumulator tiles kT0, kT0 + 1 (columns 8 kT0 .. 8 kT0 + 15) of a 64 x N accumulator: one 16 x 16
// block of a packed triangle (tri64), whose zero blocks are neither stored nor multiplied.
template <int kT0, bool kAccumulate = true, int M>
__device__ __forceinline__ void wgmma_m64n16k16_f16_rs(float (&d)[M][4], const uint32_t (&a)[4],
                                                       uint64_t desc_b) {
  static_assert(kT0 >= 0 && kT0 + 2 <= M && kT0 % 2 == 0, "a tile pair of the accumulator");
  constexpr int kScaleA = 1, kTransB = 0;  // the instruction forms' immediates: A as is, B K-major
  if constexpr (kAccumulate) {
    FLASHKDA_WGMMA_RS("m64n16k16", "f16", N16, d, a, desc_b);
  } else {
    FLASHKDA_WGMMA_RS_FIRST("m64n16k16", "f16", N16, d, a, desc_b);
  }
}

#undef FLASHKDA_WGMMA_RS
#undef FLASHKDA_WGMMA_RS_FIRST
#undef FLASHKDA_WGMMA_RS_SCALED
#undef FLASHKDA_WGMMA_W_N64
#undef FLASHKDA_WGMMA_W4
#undef FLASHKDA_WGMMA_TAIL_N128
#undef FLASHKDA_WGMMA_TAIL_N16
#undef FLASHKDA_WGMMA_REGS_N16
#undef FLASHKDA_WGMMA_W_N16
#undef FLASHKDA_WGMMA_D_N16
#undef FLASHKDA_WGMMA_TAIL_N64
#undef FLASHKDA_WGMMA_REGS_N128
#undef FLASHKDA_WGMMA_REGS_N64
#undef FLASHKDA_WGMMA_D_N128
#undef FLASHKDA_WGMMA_D_N64
#undef FLASHKDA_WGMMA_D4

}  // namespace sm90
}  // namespace flashkda
