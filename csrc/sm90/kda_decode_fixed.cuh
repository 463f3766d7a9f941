// decode_fixed_layout_kernel: decode / speculative decode of a few requests in the fixed layout
// (q, k, v, g, beta [N, T, H, ...], no cu_seqlens, no token_rows, 1 <= T <= 4 tokens a request): the
// serving engines' decode step.  Like decode_latency_kernel (kda_decode_latency.cuh) a call is one
// chain of dependent round trips, [wait] -> read slot -> state -> math -> stores -> [grid done], but
// this kernel has no block barrier and no shared buffer between warps on that chain:
//   - a request's tokens start at n T (fixed layout), so the token rows are loaded beside the read
//     slot, with no span lookup;
//   - every warp preprocesses all T tokens itself (lane l: D / 32 columns, l2 norms by shuffles) into
//     its own shared buffers, published by __syncwarp.  The work is 4x redundant over the warps,
//     but it overlaps the state load, and the warps never wait for each other;
//   - the request's checks (read slot, every index entry) are loaded by every thread, so the error code
//     is the same in the whole block without a reduction, and thread 0 writes the block's error words.
// Measured in bench/latency_floor.cu (H200, batch 1, H16, fp32 pool, per call in a graph of 20): a
// step written this way runs at the floor of the bare index -> state -> store chain (1.71 us), where
// the latency kernel takes 3.42 us; the preprocessing must be split over the lanes (D / 32 columns a
// lane): each lane computing the 16 state columns it needs itself (4x the SFU work) costs 0.56 us.
//
// Grid: one block per (request, head, row slice) (kRowsPerBlock = kR x 4 warps x 32 / (D / 16) rows;
// D = 128: 16 rows, kR = 2: 32), then ceil(N / 4) checker blocks (pool-row conflicts, off the state
// blocks' chain; a call with conflicts has unspecified rows and reports kStateSlotConflict), at most
// kDecodeErrorSlots blocks in all.  State block: 4 warps, no roles; each thread holds 16 columns of
// kR state rows in registers (kda_token_recurrence.cuh layout) and runs the tokens with advance_rows.
// Shared memory: 4 warps x 4 tokens of TokenBuf (24.8 KB at D = 128).
// Registers: T tokens' raw bits (9 a token at D = 128) + 16 kR state + the write slots.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "sm90/kda_decode_latency.cuh"  // the bit loaders, and the kernels for the other calls

namespace flashkda {
namespace sm90 {

constexpr int kFixedWarps = 4;
constexpr int kFixedThreads = kFixedWarps * 32;
constexpr int kFixedMaxTokens = 4;  // tokens a request (spec decode: 1 + 3 drafts)

template <int D, int kR>
struct FixedLayout {
  static_assert(kR == 1 || kR == 2, "state rows per thread");
  static constexpr int kLanesPerRow = TokenLayout<D>::kLanesPerRow;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kRowsPerBlock = kR * kFixedWarps * kRowsPerWarp;
  static constexpr int kSlices = D / kRowsPerBlock;
  static_assert(D % kRowsPerBlock == 0, "row slices tile the state");
  __device__ static int row(int slice, int r, int warp, int lane) {
    return slice * kRowsPerBlock + r * (kRowsPerBlock / kR) + warp * kRowsPerWarp + lane / kLanesPerRow;
  }
  static int64_t state_blocks(int64_t N, int64_t H) { return N * H * kSlices; }
  static int64_t grid(int64_t N, int64_t H) { return state_blocks(N, H) + (N + kFixedWarps - 1) / kFixedWarps; }
};

template <int D>
struct FixedSmem {
  TokenBuf<D> tok[kFixedWarps][kFixedMaxTokens];  // per warp: its preprocessed copy of the tokens
  int err;                                        // checker blocks' reduction
  uint32_t param_touch;                           // touch_decode_params' sum (never read)
};

// Whether a call can run on the fixed-layout kernel (host side; the grid size is checked separately).
inline bool fixed_layout_call(const DecodeArgs& a) {
  return a.cu_seqlens == nullptr && a.token_rows == nullptr && a.T >= 1 && a.T <= kFixedMaxTokens;
}

template <int D, bool kF32, int kR>
// 4 blocks a SM: a 128-register cap (without it ptxas chose 96 for kR = 1 and spilled).
__global__ void __launch_bounds__(kFixedThreads, 4)
    decode_fixed_layout_kernel(const __grid_constant__ DecodeArgs a, const int64_t state_blocks) {
  using L = FixedLayout<D, kR>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = D / 32;
  __shared__ __align__(16) FixedSmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    sm.err = 0;
    *reinterpret_cast<volatile uint32_t*>(&sm.param_touch) = touch_decode_params(a);
  }
  __syncthreads();
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  const int64_t b = blockIdx.x;
  if (b >= state_blocks) {
    // ---------------------------------------------------------------- checker block
    int err = 0;
    const int64_t stride = (static_cast<int64_t>(gridDim.x) - state_blocks) * kFixedWarps;
    for (int64_t n = (b - state_blocks) * kFixedWarps + warp; n < a.N; n += stride) {
      if (decode_request_conflicts(a, n, lane)) err = static_cast<int>(DeviceError::kStateSlotConflict);
    }
    if (err != 0) atomicCAS(&sm.err, 0, err);
    __syncthreads();
    if (tid == 0) write_decode_error_words(a, sm.err);
    return;
  }

  // ------------------------------------------------------------------ state block
  const int64_t per_request = static_cast<int64_t>(a.H) * L::kSlices;
  const int64_t n = b / per_request;
  const int h = static_cast<int>((b % per_request) / L::kSlices);
  const int slice = static_cast<int>(b % L::kSlices);
  int vrow[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) vrow[q] = L::row(slice, q, warp, lane);
  const int j = lane % L::kLanesPerRow;
  const int T = static_cast<int>(a.T);
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;
  const int64_t out_col = static_cast<int64_t>(h) * D;
  StateT* pool = static_cast<StateT*>(a.pool);

  // 1. Every load that depends on n alone, before any loaded value is used (a use stalls the warp):
  // the read slot's first load, the write slots (spec), the gate parameters, and all T tokens' raw
  // bits (q, k, g, beta: the lane's D / 32 columns; v: the thread's rows).
  const IndexBits first =
      a.spec ? load_index_bits(a.num_accepted, a.acc_int64, n) : load_index_bits(a.idx, a.idx_int64, n);
  const bool gated = a.gate_mode != kGatePrecomputed;
  const float a_log = gated ? a.A_log[h] : 0.f;
  float dtb[PC];
#pragma unroll
  for (int i = 0; i < PC; ++i) dtb[i] = gated ? a.dt_bias[h * D + lane * PC + i] : 0.f;
  TokenBits<D> bits[kFixedMaxTokens];
  IndexBits wslot[kFixedMaxTokens];
  uint32_t vb[kR][kFixedMaxTokens];
  const unsigned short* v = reinterpret_cast<const unsigned short*>(a.v);
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) {
    wslot[t] = IndexBits{0xffffffffu, 0xffffffffu};  // -1 either way: no write
    if (t < T) {
      load_token_bits<D>(a, n, t, h, lane, bits[t]);
      const int64_t base = n * a.v_sb + t * a.v_st + out_col;
#pragma unroll
      for (int q = 0; q < kR; ++q) vb[q][t] = v[base + vrow[q]];
      if (a.spec && t < a.slots) wslot[t] = load_index_bits(a.idx, a.idx_int64, n * a.slots + t);
    }
  }
  // 2. The read slot (spec: idx[n, acc - 1], a second round trip), then the state rows (clamped into
  // the pool; used only if every check passes).
  ReadSlotLoad rs;
  if (a.spec) {
    rs.acc = index_value(first, a.acc_int64);
    rs.slot = slot_at(a, n, rs.acc >= 1 && rs.acc <= a.slots ? rs.acc - 1 : 0);
  } else {
    rs.acc = 1;
    rs.slot = index_value(first, a.idx_int64);
  }
  int64_t read = -1;
  int err = decode_read_slot_check(a, rs, T, &read);
  float s[kR][16];
  if (read >= 0) {
    const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
#pragma unroll
    for (int q = 0; q < kR; ++q) load_state_row<D, kF32>(pool + (r * head_rows + out_col + vrow[q]) * D, j, s[q]);
  }
  // 3. While the state is in flight: the other index entries (every thread checks all of them, so
  // err is the same in the whole block) and this warp's copy of the tokens.
  if (err == 0) err = decode_entries_error(a, n, 0, T, 0, 1);
  const float expA = gated ? expf(a_log) : 0.f;
  float beta[kFixedMaxTokens];
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) {
    if (t < T) beta[t] = preprocess_token<D, true>(a, token_from_bits<D>(a, bits[t]), expA, dtb, sm.tok[warp][t], lane);
  }
  __syncwarp();

  if (err == 0) {
    if (read < 0) {  // padded request: zero its outputs, touch no state
      if (j == 0) {
        for (int t = 0; t < T; ++t) {
          bf16* o = a.out + n * a.out_sb + t * a.out_st + out_col;
#pragma unroll
          for (int q = 0; q < kR; ++q) o[vrow[q]] = __float2bfloat16_rn(0.f);
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < kFixedMaxTokens; ++t) {
        if (t >= T) break;
        float vt[kR], o[kR];
#pragma unroll
        for (int q = 0; q < kR; ++q) vt[q] = bf16_bits_lo(vb[q][t]);
        advance_rows<D, kR>(s, sm.tok[warp][t], j, beta[t], vt, o);
        bf16* orow = a.out + n * a.out_sb + t * a.out_st + out_col;
        const int64_t w = index_value(wslot[t], a.idx_int64);
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o[q]);
          if (w >= 0) store_state_row<D, kF32>(pool + (w * head_rows + out_col + vrow[q]) * D, j, s[q]);
        }
      }
      if (!a.spec) {
#pragma unroll
        for (int q = 0; q < kR; ++q)
          store_state_row<D, kF32>(pool + (read * head_rows + out_col + vrow[q]) * D, j, s[q]);
      }
    }
  }
  if (tid == 0) write_decode_error_words(a, err);
}

// The fixed-layout kernel's rows per thread for this call: 1 when its grid fits one error word per
// block, else 2, else 0 (not this kernel).
template <int D>
int fixed_rows_per_thread(const DecodeArgs& a) {
  if (!fixed_layout_call(a)) return 0;
  if (FixedLayout<D, 1>::grid(a.N, a.H) <= kDecodeErrorSlots) return 1;
  if (FixedLayout<D, 2>::grid(a.N, a.H) <= kDecodeErrorSlots) return 2;
  return 0;
}

template <int D, bool kF32, int kR>
Status launch_decode_fixed_layout(const DecodeArgs& a, bool pdl, cudaStream_t stream) {
  using L = FixedLayout<D, kR>;
  const int64_t grid = L::grid(a.N, a.H);
  if (grid < 1 || grid > kDecodeErrorSlots) {
    return Status::invalid("flashkda: decode fixed-layout kernel: expected at most " +
                           std::to_string(kDecodeErrorSlots) + " blocks, got " + std::to_string(grid));
  }
  return launch_decode_grid(decode_fixed_layout_kernel<D, kF32, kR>, grid, kFixedThreads, 0, pdl, stream,
                            "decode_fixed_layout_kernel launch", a, L::state_blocks(a.N, a.H));
}

// Kernel choice and launch for one head dim and state dtype (see DecodeKernel): kAuto takes the
// fixed-layout kernel when the call is in that layout and fits one wave, else the latency kernel
// when it fits, else the pipelined kernel.  Forcing a kernel the call cannot use falls through to
// the next one in that order.
template <int D, bool kF32>
Status launch_decode_kernel(const DecodeArgs& a, DecodeKernel kernel, bool pdl, int num_sms,
                            cudaStream_t stream) {
  if (kernel == DecodeKernel::kAuto || kernel == DecodeKernel::kFixedLayout) {
    const int fixed = fixed_rows_per_thread<D>(a);
    if (fixed == 1) return launch_decode_fixed_layout<D, kF32, 1>(a, pdl, stream);
    if (fixed == 2) return launch_decode_fixed_layout<D, kF32, 2>(a, pdl, stream);
  }
  const int rows = kernel == DecodeKernel::kPipelined ? 0 : latency_rows_per_thread<D>(a);
  if (rows == 1) return launch_decode_latency<D, kF32, 1>(a, pdl, stream);
  if (rows == 2) return launch_decode_latency<D, kF32, 2>(a, pdl, stream);
  return launch_decode_pipelined<D, kF32>(a, num_sms, pdl, stream);
}

}  // namespace sm90
}  // namespace flashkda
