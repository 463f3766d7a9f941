// decode_plain_stream_kernel: plain decode (one token a request, 1-D indices) of many requests in the
// serving engines' canonical layout (fixed_layout_call), as a stream of state slices.  The pipelined
// kernel (kda_decode_pipelined.cuh) handles every other many-request call; for this one, the most
// common serving call, a simpler structure keeps more bytes in flight per SM:
//   - no warp roles and no block barrier inside the loop: each of the 4 warps of a block walks the
//     block's items on its own rows and preprocesses each item's token itself (D / 32 columns a
//     lane, norms over the warp) into its own TokenBuf;
//   - a software pipeline per warp: while item i is computed and stored, the state rows of item
//     i + G are in flight (raw registers, converted at use: a use of a loaded value stalls the warp,
//     see kda_decode_latency.cuh) and the index entry and token bits of item i + 2G are loading.
// Measured without math (bench/bw_ceiling.cu): loads of the next slice issued before the stores of
// this one, 4 blocks of 128 threads per SM, reach 90% of memcpy on this pattern at N = 256; the
// pipelined kernel's items walk producer -> TMA -> prep -> consumers with 2 blocks per SM (86%).
//
// Work item: (request n, head h, slice of kRowsPerBlock rows) = LatencyLayout<D, 2> (D = 128: 32 rows,
// one contiguous 16 KB fp32 run of the pool row; each thread holds 16 columns of 2 rows).
// Grid: C = ceil(N / 4) checker blocks first (fixed_checker_block: the int32 conflict check), then G
// state blocks, C + G = kStreamBlocksPerSm per SM so that every block is resident at once (the
// checkers do not delay any state block); state block b walks items b - C, b - C + G, ...
// Shared memory: 4 TokenBuf (6.2 KB at D = 128).  Registers: 2 x 32 state words + 2 item records of
// ~15 words, 128 at 4 blocks per SM.
// Errors: as the other decode kernels: a request whose slot is >= P writes nothing and reports
// kBadStateIndex, a padded one (slot < 0) zeroes its output; every call rewrites every error word.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "sm90/kda_decode_fixed.cuh"

namespace flashkda {
namespace sm90 {

constexpr int kStreamBlocksPerSm = 4;
constexpr int kStreamRows = 2;  // state rows a thread

// One state row's 16 columns of a thread as loaded words (fp32: 16, bf16: 8 pairs).
template <bool kF32>
struct RawStateRow {
  uint32_t w[kF32 ? 16 : 8];
};

template <int D, bool kF32>
__device__ __forceinline__ void issue_state_row(const void* row, int j, RawStateRow<kF32>& r) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = token_col<D>(j, i);
    if constexpr (kF32) {
      const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const float*>(row) + col);
      r.w[4 * i] = x.x, r.w[4 * i + 1] = x.y, r.w[4 * i + 2] = x.z, r.w[4 * i + 3] = x.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(row) + col);
      r.w[2 * i] = u.x, r.w[2 * i + 1] = u.y;
    }
  }
}

template <bool kF32>
__device__ __forceinline__ void state_row_floats(const RawStateRow<kF32>& r, float (&s)[16]) {
#pragma unroll
  for (int e = 0; e < (kF32 ? 16 : 8); ++e) {
    if constexpr (kF32) {
      s[e] = __uint_as_float(r.w[e]);
    } else {
      s[2 * e] = bf16_bits_lo(r.w[e]), s[2 * e + 1] = bf16_bits_hi(r.w[e]);
    }
  }
}

// What a warp loads for one item two items ahead: the read slot, the token's bits for its lane, the
// value entries of the thread's rows and the head's gate parameters (raw, used an item later).
template <int D>
struct StreamItem {
  FixedTokenBits<D> tok;
  uint32_t v[kStreamRows];
  float dtb[D / 32];
  float a_log;
  int read;         // idx[n]
  int n, h, slice;  // the item (computed, not loaded)
};

template <int D>
__device__ __forceinline__ void load_stream_item(const DecodeArgs& a, int item, int warp, int lane,
                                                 StreamItem<D>& it) {
  using L = LatencyLayout<D, kStreamRows>;
  constexpr int PC = D / 32;
  const int H = static_cast<int>(a.H), per_request = H * L::kSlices;
  it.n = item / per_request;
  const int rem = item - it.n * per_request;
  it.h = rem / L::kSlices;
  it.slice = rem - it.h * L::kSlices;
  const int tok_head = it.n * H + it.h;  // T = 1: the token of request n
  it.read = static_cast<const int*>(a.idx)[it.n];
  load_fixed_token<D>(a, tok_head, lane, true, it.tok);
  const unsigned short* v = reinterpret_cast<const unsigned short*>(a.v);
#pragma unroll
  for (int q = 0; q < kStreamRows; ++q) it.v[q] = v[tok_head * D + L::row(it.slice, q, warp, lane)];
  const bool gated = a.gate_mode != kGatePrecomputed;
  it.a_log = gated ? a.A_log[it.h] : 0.f;
#pragma unroll
  for (int i = 0; i < PC; ++i) it.dtb[i] = gated ? a.dt_bias[it.h * D + lane * PC + i] : 0.f;
}

// Issues the loads of an item's state rows (clamped into the pool: a slot >= P is reported, never
// read past the pool; a padded item loads nothing).
template <int D, bool kF32>
__device__ __forceinline__ void issue_stream_state(const DecodeArgs& a, const StreamItem<D>& it, int warp,
                                                   int lane, RawStateRow<kF32> (&raw)[kStreamRows]) {
  using L = LatencyLayout<D, kStreamRows>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  if (it.read < 0) return;
  const int64_t r = it.read < a.pool_rows ? it.read : a.pool_rows - 1;
  const StateT* pool = static_cast<const StateT*>(a.pool);
  const int64_t head = (r * a.H + it.h) * D;
#pragma unroll
  for (int q = 0; q < kStreamRows; ++q)
    issue_state_row<D, kF32>(pool + (head + L::row(it.slice, q, warp, lane)) * D, lane % L::kLanesPerRow,
                             raw[q]);
}

template <int D, bool kF32>
__global__ void __launch_bounds__(kLatencyThreads, kStreamBlocksPerSm)
    decode_plain_stream_kernel(const __grid_constant__ DecodeArgs a, const int checkers) {
  using L = LatencyLayout<D, kStreamRows>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  __shared__ __align__(16) FixedSmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  decode_block_setup(a, &sm.err, &sm.param_touch);

  const int b = static_cast<int>(blockIdx.x);
  if (b < checkers) {
    fixed_checker_block(a, b, checkers, &sm.err);
    return;
  }
  const int G = static_cast<int>(gridDim.x) - checkers;
  const int items = static_cast<int>(a.N) * static_cast<int>(a.H) * L::kSlices;  // < 2^31: fixed_layout_call
  const int j = lane % L::kLanesPerRow;
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;
  StateT* pool = static_cast<StateT*>(a.pool);
  const bool gated = a.gate_mode != kGatePrecomputed;
  int err = 0;

  int item = b - checkers;  // < items: the host launches at most `items` state blocks
  StreamItem<D> cur, nxt;
  RawStateRow<kF32> cur_s[kStreamRows], nxt_s[kStreamRows];
  load_stream_item<D>(a, item, warp, lane, cur);
  if (item + G < items) load_stream_item<D>(a, item + G, warp, lane, nxt);
  issue_stream_state<D, kF32>(a, cur, warp, lane, cur_s);
  for (; item < items; item += G) {
    // 1. This item's token into the warp's buffer (its bits were loaded two items ago).
    const float expA = gated ? expf(cur.a_log) : 0.f;
    const float beta = prep_fixed_token<D>(a, cur.tok, expA, cur.dtb, sm.tok[warp], lane);
    float vt[kStreamRows];
#pragma unroll
    for (int q = 0; q < kStreamRows; ++q) vt[q] = bf16_bits_lo(cur.v[q]);
    const int read = cur.read, n = cur.n, h = cur.h, slice = cur.slice;
    __syncwarp();
    // 2. The next item's state (its slot was loaded an item ago), then the bits of the one after.
    if (item + G < items) issue_stream_state<D, kF32>(a, nxt, warp, lane, nxt_s);
    if (item + 2 * G < items) load_stream_item<D>(a, item + 2 * G, warp, lane, cur);
    // 3. This item: the token on the thread's rows, out and the state stored back in place.
    bf16* out = a.out + static_cast<int64_t>(n) * head_rows + h * D;
    if (read >= a.pool_rows) {
      err = static_cast<int>(DeviceError::kBadStateIndex);  // writes nothing
    } else if (read < 0) {  // padded request: zero its outputs, touch no state
#pragma unroll
      for (int q = 0; q < kStreamRows; ++q)
        if (j == 0) out[L::row(slice, q, warp, lane)] = __float2bfloat16_rn(0.f);
    } else {
      float s[kStreamRows][16], o[kStreamRows];
#pragma unroll
      for (int q = 0; q < kStreamRows; ++q) state_row_floats<kF32>(cur_s[q], s[q]);
      advance_rows<D, kStreamRows>(s, sm.tok[warp], j, beta, vt, o);
#pragma unroll
      for (int q = 0; q < kStreamRows; ++q) {
        const int row = L::row(slice, q, warp, lane);
        if (j == 0) out[row] = __float2bfloat16_rn(o[q]);
        store_state_row<D, kF32>(pool + ((static_cast<int64_t>(read) * head_rows) + h * D + row) * D, j,
                                 s[q]);
      }
    }
    __syncwarp();  // the buffer is rewritten by the next item's preprocessing
                   // 4. Rotate: the next item's state and bits become current.
#pragma unroll
    for (int q = 0; q < kStreamRows; ++q) cur_s[q] = nxt_s[q];
    const StreamItem<D> t = cur;
    cur = nxt;
    nxt = t;
  }
  if (err != 0) atomicCAS(&sm.err, 0, err);
  __syncthreads();
  if (tid == 0) write_decode_error_words(a, sm.err);
}

// The stream kernel's grid for this call: checker blocks + state blocks, or 0 when it does not apply
// (not a plain one-token call in the canonical layout, or too many requests for every checker block
// to be resident beside at least one state block per SM).
template <int D>
int64_t plain_stream_grid(const DecodeArgs& a, int num_sms, int64_t* checkers) {
  using L = LatencyLayout<D, kStreamRows>;
  if (a.spec || a.T != 1 || !fixed_layout_call(a, D)) return 0;
  *checkers = (a.N + kLatencyWarps - 1) / kLatencyWarps;
  int64_t resident = static_cast<int64_t>(num_sms) * kStreamBlocksPerSm;
  if (resident > kDecodeErrorSlots) resident = kDecodeErrorSlots;
  int64_t state_blocks = resident - *checkers;
  if (state_blocks < num_sms) return 0;
  const int64_t items = static_cast<int64_t>(a.N) * a.H * L::kSlices;
  if (items >= (int64_t{1} << 31)) return 0;
  if (state_blocks > items) state_blocks = items;
  return *checkers + state_blocks;
}

// Launches the stream kernel on the grid plain_stream_grid chose (grid >= 1).
template <int D, bool kF32>
Status launch_decode_plain_stream(const DecodeArgs& a, int64_t grid, int64_t checkers, bool pdl,
                                  cudaStream_t stream) {
  return launch_decode_grid(decode_plain_stream_kernel<D, kF32>, grid, kLatencyThreads, 0, pdl, stream,
                            "decode_plain_stream_kernel", a, static_cast<int>(checkers));
}

// Kernel choice and launch for one head dim and state dtype (see DecodeKernel): kAuto takes the
// fixed-layout kernel when the call is in that layout and fits one wave, else (plain decode of one
// token in that layout) the stream kernel when its checker blocks fit, else the latency kernel when
// its one wave fits, else the pipelined kernel.  Forcing a kernel the call cannot use falls through
// to the next one in that order.
template <int D, bool kF32>
Status launch_decode_kernel(const DecodeArgs& a, DecodeKernel kernel, bool pdl, int num_sms,
                            cudaStream_t stream) {
  if (kernel == DecodeKernel::kAuto || kernel == DecodeKernel::kFixedLayout) {
    const int fixed = fixed_rows_per_thread<D>(a);
    if (fixed == 1) return launch_decode_fixed_layout<D, kF32, 1>(a, pdl, stream);
    if (fixed == 2) return launch_decode_fixed_layout<D, kF32, 2>(a, pdl, stream);
  }
  if (kernel != DecodeKernel::kPipelined && kernel != DecodeKernel::kLatency) {
    int64_t checkers = 0;
    const int64_t grid = plain_stream_grid<D>(a, num_sms, &checkers);
    if (grid > 0) return launch_decode_plain_stream<D, kF32>(a, grid, checkers, pdl, stream);
  }
  const int rows = kernel == DecodeKernel::kPipelined ? 0 : latency_rows_per_thread<D>(a);
  if (rows == 1) return launch_decode_latency<D, kF32, 1>(a, pdl, stream);
  if (rows == 2) return launch_decode_latency<D, kF32, 2>(a, pdl, stream);
  return launch_decode_pipelined<D, kF32>(a, num_sms, pdl, stream);
}

}  // namespace sm90
}  // namespace flashkda
