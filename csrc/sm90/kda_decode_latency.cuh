// decode_latency_kernel: decode / speculative decode for calls with few requests (batch 1-15 at
// H = 16), where a call is not a stream but one chain of dependent round trips, and what counts is
// how short that chain is:  [wait for the previous kernel] -> read slot (num_accepted -> index
// entry) -> state slice -> the tokens' math -> stores -> [grid done].  Everything that does not depend
// on the read slot (the span, the tokens' raw inputs, the gate parameters, the index and token-row
// checks) is issued beside it, and the next kernel's launch overlaps this one (programmatic
// dependent launch).  Many requests go to the pipelined kernel (kda_decode_pipelined.cuh), which
// streams the state at a higher bandwidth but has a longer chain per item.
//
// Grid: one block per (request, head, row slice) of kRowsPerBlock rows (D = 128: 16 rows of 8 KB
// with one row per thread, 32 rows with two), plus ceil(N / 4) checker blocks, at most
// kDecodeErrorSlots blocks in all (one wave; the host picks the smaller slices when they fit).
// State block (4 warps, no roles): each thread holds 16 columns of kR state rows in registers
// (kda_token_recurrence.cuh layout: the row's D / 16 lanes are adjacent); warp w preprocesses token
// w of a group of 4 (l2norm, gate, beta, k.q) into shared memory and one block barrier, which also
// gathers the request's checks, publishes them; then every thread runs the group's tokens on its
// rows (advance_rows) and stores out and (spec) the write slot's state straight from registers.
// Checker block: warp w runs the pool-row conflict check of requests 4 c + w (c = checker index),
// off the state blocks' chain.
// Shared memory: 4 preprocessed tokens (6 KB for D = 128) + their beta, rows and write slots.
// Registers: 16 kR state + 13 raw token + 4 kR v values per thread, 128 at 4 blocks per SM (kR = 2
// spills 8-28 bytes).
//
// Errors: as the pipelined kernel (kda_decode_sm90.cuh): a bad request writes nothing, its code and
// any conflict go to the block's error word, and every call rewrites all the error words.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "sm90/kda_decode_pipelined.cuh"  // the fallback for calls too large for one wave
#include "sm90/kda_decode_sm90.cuh"

namespace flashkda {
namespace sm90 {

constexpr int kLatencyWarps = 4;
constexpr int kLatencyThreads = kLatencyWarps * 32;
constexpr int kLatencyTokens = kLatencyWarps;  // tokens per block barrier: one per warp

template <int D, int kR>
struct LatencyLayout {
  static_assert(kR == 1 || kR == 2, "state rows per thread");
  static constexpr int kLanesPerRow = TokenLayout<D>::kLanesPerRow;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kRowsPerBlock = kR * kLatencyWarps * kRowsPerWarp;  // D = 128: 16 / 32
  static constexpr int kSlices = D / kRowsPerBlock;
  static_assert(D % kRowsPerBlock == 0, "row slices tile the state");
  // Row r (< kR) of the thread: slice base + r * (rows / kR) + warp rows + lane row.
  __device__ static int row(int slice, int r, int warp, int lane) {
    return slice * kRowsPerBlock + r * (kRowsPerBlock / kR) + warp * kRowsPerWarp + lane / kLanesPerRow;
  }
  // Blocks of a call: the state blocks, then one checker block per 4 requests; none for a plain
  // decode of one request (one write slot, its read slot: nothing can conflict), whose chain would
  // otherwise end on the checker block's.
  static int64_t state_blocks(int64_t N, int64_t H) { return N * H * kSlices; }
  static int64_t checker_blocks(int64_t N, bool spec) {
    return N == 1 && !spec ? 0 : (N + kLatencyWarps - 1) / kLatencyWarps;
  }
  static int64_t grid(int64_t N, int64_t H, bool spec) {
    return state_blocks(N, H) + checker_blocks(N, spec);
  }
};

// Checker block b (>= state_blocks) of a one-wave decode kernel (this one and kda_decode_fixed.cuh):
// warp w runs the pool-row conflict check of requests 4 c + w, 4 c + w + 4 C, ... (c = b - state
// blocks, C = the checker blocks); returns kStateSlotConflict if any of them conflicts, else 0.
__device__ inline int one_wave_checker_error(const DecodeArgs& a, int64_t b, int64_t state_blocks, int warp,
                                             int lane) {
  int err = 0;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) - state_blocks) * kLatencyWarps;
  for (int64_t n = (b - state_blocks) * kLatencyWarps + warp; n < a.N; n += stride) {
    if (decode_request_conflicts(a, n, lane)) err = static_cast<int>(DeviceError::kStateSlotConflict);
  }
  return err;
}

template <int D>
struct LatencySmem {
  TokenBuf<D> tok[kLatencyTokens];  // preprocessed q, k, decay and k.q
  float beta[kLatencyTokens];
  int64_t row[kLatencyTokens];   // input/output row of the token
  int64_t slot[kLatencyTokens];  // spec: its write slot (-1: none)
  int err;
  uint32_t param_touch;  // touch_decode_params' sum (never read)
};

// Loaded values are kept as raw bits until the state slice's loads are issued: a warp issues in
// order and a use of a loaded value (even a bf16 -> fp32 shift or an int32 sign extension) stalls it
// until the value is back, so a conversion placed before the state load would put that load's round
// trip on the chain in front of it (measured at batch 1: four serial L2 round trips instead of two).
struct IndexBits {
  uint32_t lo, hi;  // hi: int64 indices only
};
__device__ inline IndexBits load_index_bits(const void* p, int is64, int64_t i) {
  IndexBits b;
  if (is64) {
    const uint2 u = static_cast<const uint2*>(p)[i];
    b.lo = u.x, b.hi = u.y;
  } else {
    b.lo = static_cast<const uint32_t*>(p)[i], b.hi = 0;
  }
  return b;
}
__device__ inline int64_t index_value(const IndexBits& b, int is64) {
  return is64 ? static_cast<int64_t>((static_cast<uint64_t>(b.hi) << 32) | b.lo)
              : static_cast<int64_t>(static_cast<int32_t>(b.lo));
}

// Issues the loads of tokens [c0, c0 + nt) of a request (nt <= kLatencyTokens): the value entries of
// the thread's rows for all of them, and token c0 + warp's q, k, g, beta and write slot for this warp
// to preprocess, all as bits.  Rows are clamped (mapped_row) and write slots read only below S, so
// this stays in bounds before the request's checks have passed.
template <int D, int kR>
__device__ inline void load_latency_group(const DecodeArgs& a, int64_t n, int64_t batch, int64_t bos,
                                          int64_t c0, int nt, int h, const int (&vrow)[kR], int warp,
                                          int lane, TokenBits<D>& bits, int64_t* my_row, IndexBits* my_slot,
                                          uint32_t (&vb)[kR][kLatencyTokens]) {
  const int64_t col = static_cast<int64_t>(h) * D;
  const unsigned short* v = reinterpret_cast<const unsigned short*>(a.v);
#pragma unroll
  for (int t = 0; t < kLatencyTokens; ++t) {
    if (t < nt) {
      const int64_t base = batch * a.v_sb + mapped_row(a, bos + c0 + t) * a.v_st + col;
#pragma unroll
      for (int q = 0; q < kR; ++q) vb[q][t] = v[base + vrow[q]];
    }
  }
  *my_row = 0;
  *my_slot = IndexBits{0xffffffffu, 0xffffffffu};  // -1 either way: no write
  if (warp < nt) {
    *my_row = mapped_row(a, bos + c0 + warp);
    load_token_bits<D>(a, batch, *my_row, h, lane, bits);
    if (a.spec && c0 + warp < a.slots)
      *my_slot = load_index_bits(a.idx, a.idx_int64, n * a.slots + c0 + warp);
  }
}

// Warp `warp` < nt preprocesses its token into the shared buffers (published by the caller's barrier).
template <int D>
__device__ inline void prep_latency_token(const DecodeArgs& a, const TokenBits<D>& bits, float expA,
                                          const float (&dtb)[D / 32], int64_t my_row,
                                          const IndexBits& my_slot, int nt, LatencySmem<D>& sm, int warp,
                                          int lane) {
  if (warp >= nt) return;
  const float bt = preprocess_token<D, true>(a, token_from_bits<D>(a, bits), expA, dtb, sm.tok[warp], lane);
  if (lane == 0) {
    sm.beta[warp] = bt;
    sm.row[warp] = my_row;
    sm.slot[warp] = index_value(my_slot, a.idx_int64);
  }
}

template <int D, bool kF32, int kR>
__global__ void __launch_bounds__(kLatencyThreads, 4)
    decode_latency_kernel(const __grid_constant__ DecodeArgs a, const int64_t state_blocks) {
  using L = LatencyLayout<D, kR>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = D / 32;
  __shared__ __align__(16) LatencySmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  decode_block_setup(a, &sm.err, &sm.param_touch);

  int err = 0;
  const int64_t b = blockIdx.x;
  if (b >= state_blocks) {
    err = one_wave_checker_error(a, b, state_blocks, warp, lane);
  } else {
    // ---------------------------------------------------------------- state block
    const int64_t per_request = static_cast<int64_t>(a.H) * L::kSlices;
    const int64_t n = b / per_request;
    const int h = static_cast<int>((b % per_request) / L::kSlices);
    const int slice = static_cast<int>(b % L::kSlices);
    int vrow[kR];
#pragma unroll
    for (int q = 0; q < kR; ++q) vrow[q] = L::row(slice, q, warp, lane);
    const int j = lane % L::kLanesPerRow;
    const int64_t head_rows = static_cast<int64_t>(a.H) * D;  // state rows per pool row
    const int64_t out_col = static_cast<int64_t>(h) * D;
    StateT* pool = static_cast<StateT*>(a.pool);

    // 1. Every load that depends on n alone, issued before any loaded value is used: the read
    // slot's first load (plain: idx[n]; spec: num_accepted[n]), the gate parameters, the span and the
    // first token group (bits).
    const IndexBits first =
        a.spec ? load_index_bits(a.num_accepted, a.acc_int64, n) : load_index_bits(a.idx, a.idx_int64, n);
    const bool gated = a.gate_mode != kGatePrecomputed;
    const float a_log = gated ? a.A_log[h] : 0.f;
    float dtb[PC];
#pragma unroll
    for (int i = 0; i < PC; ++i) dtb[i] = gated ? a.dt_bias[h * D + lane * PC + i] : 0.f;
    int64_t batch, bos, len, read = -1;
    err = decode_span(a, n, &batch, &bos, &len) ? 0 : static_cast<int>(DeviceError::kBadCuSeqlens);
    int nt = static_cast<int>(len < kLatencyTokens ? len : kLatencyTokens);
    TokenBits<D> bits;
    int64_t my_row;
    IndexBits my_slot;
    uint32_t vb[kR][kLatencyTokens];
    load_latency_group<D, kR>(a, n, batch, bos, 0, nt, h, vrow, warp, lane, bits, &my_row, &my_slot, vb);
    // 2. The read slot (spec: idx[n, acc - 1]), then the state slice (clamped into the pool; used
    // only if every check passes).
    ReadSlotLoad rs;
    if (a.spec) {
      rs.acc = index_value(first, a.acc_int64);
      rs.slot = slot_at(a, n, rs.acc >= 1 && rs.acc <= a.slots ? rs.acc - 1 : 0);
    } else {
      rs.acc = 1;
      rs.slot = index_value(first, a.idx_int64);
    }
    if (err == 0) err = decode_read_slot_check(a, rs, len, &read);
    float s[kR][16];
    if (read >= 0) {
      const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
#pragma unroll
      for (int q = 0; q < kR; ++q)
        load_state_row<D, kF32>(pool + (r * head_rows + out_col + vrow[q]) * D, j, s[q]);
    }
    // 3. While the state is in flight: the request's other checks, split over the block, and the
    // first group's preprocessing; one barrier publishes both.
    if (err == 0) err = decode_entries_error(a, n, bos, len, tid, kLatencyThreads);
    const float expA = gated ? expf(a_log) : 0.f;
    prep_latency_token<D>(a, bits, expA, dtb, my_row, my_slot, nt, sm, warp, lane);
    const bool bad = __syncthreads_or(err != 0) != 0;  // block-uniform: a bad request writes nothing

    if (!bad && read < 0) {  // padded request: zero its outputs, touch no state
      if (j == 0) {
        for (int64_t t = 0; t < len; ++t) {
          bf16* o = a.out + batch * a.out_sb + mapped_row(a, bos + t) * a.out_st + out_col;
#pragma unroll
          for (int q = 0; q < kR; ++q) o[vrow[q]] = __float2bfloat16_rn(0.f);
        }
      }
    } else if (!bad && len > 0) {
      // 5. The tokens, a group at a time; the state stays in registers.
      for (int64_t c0 = 0;;) {
#pragma unroll
        for (int t = 0; t < kLatencyTokens; ++t) {  // unrolled: vb stays in registers
          if (t >= nt) break;
          float vt[kR], o[kR];
#pragma unroll
          for (int q = 0; q < kR; ++q) vt[q] = bf16_bits_lo(vb[q][t]);
          advance_rows<D, kR>(s, sm.tok[t], j, sm.beta[t], vt, o);
          bf16* orow = a.out + batch * a.out_sb + sm.row[t] * a.out_st + out_col;
          const int64_t w = sm.slot[t];
#pragma unroll
          for (int q = 0; q < kR; ++q) {
            if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o[q]);
            if (w >= 0) store_state_row<D, kF32>(pool + (w * head_rows + out_col + vrow[q]) * D, j, s[q]);
          }
        }
        c0 += nt;
        if (c0 >= len) break;
        // Requests longer than a group (long spec drafts, varlen): the next group, one round trip.
        __syncthreads();  // the buffers are rewritten
        nt = static_cast<int>(len - c0 < kLatencyTokens ? len - c0 : kLatencyTokens);
        load_latency_group<D, kR>(a, n, batch, bos, c0, nt, h, vrow, warp, lane, bits, &my_row, &my_slot, vb);
        prep_latency_token<D>(a, bits, expA, dtb, my_row, my_slot, nt, sm, warp, lane);
        __syncthreads();
      }
      if (!a.spec) {
#pragma unroll
        for (int q = 0; q < kR; ++q)
          store_state_row<D, kF32>(pool + (read * head_rows + out_col + vrow[q]) * D, j, s[q]);
      }
    }
  }

  if (err != 0) atomicCAS(&sm.err, 0, err);
  __syncthreads();
  if (tid == 0) write_decode_error_words(a, sm.err);
}

// Launches a one-wave decode kernel (LatencyLayout<D, kR>: this one or the fixed-layout kernel); the
// caller checked that the grid fits (every block owns an error word).
template <int D, int kR, class Kernel>
Status launch_one_wave_decode(Kernel kernel, const char* name, const DecodeArgs& a, bool pdl,
                              cudaStream_t stream) {
  using L = LatencyLayout<D, kR>;
  const int64_t grid = L::grid(a.N, a.H, a.spec != 0);
  if (grid < 1 || grid > kDecodeErrorSlots) {
    return Status::invalid(std::string("flashkda: ") + name + ": expected at most " +
                           std::to_string(kDecodeErrorSlots) + " blocks, got " + std::to_string(grid));
  }
  return launch_decode_grid(kernel, grid, kLatencyThreads, 0, pdl, stream, name, a,
                            L::state_blocks(a.N, a.H));
}

template <int D, bool kF32, int kR>
Status launch_decode_latency(const DecodeArgs& a, bool pdl, cudaStream_t stream) {
  return launch_one_wave_decode<D, kR>(decode_latency_kernel<D, kF32, kR>, "decode_latency_kernel", a, pdl,
                                       stream);
}

// The latency kernel's row-per-thread count for this call: 1 (the finest slices) when its grid fits,
// else 2, else 0 (too many requests: the pipelined kernel).
template <int D>
int latency_rows_per_thread(const DecodeArgs& a) {
  if (LatencyLayout<D, 1>::grid(a.N, a.H, a.spec != 0) <= kDecodeErrorSlots) return 1;
  if (LatencyLayout<D, 2>::grid(a.N, a.H, a.spec != 0) <= kDecodeErrorSlots) return 2;
  return 0;
}

}  // namespace sm90
}  // namespace flashkda
