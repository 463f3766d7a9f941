// decode_plain_stream_kernel: plain decode (one token a request, 1-D indices) of many requests in the
// serving engines' canonical layout (fixed_layout_call), as a stream of state slices;
// decode_spec_stream_kernel (below): the same for speculative decode and several-token calls in that
// layout.  The pipelined kernel (kda_decode_pipelined.cuh) handles every other many-request call; for
// these, the common serving calls, a simpler structure keeps more bytes in flight per SM:
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

// Item -> (request n, head h, row slice) of a stream kernel's items (n-major, then head, then slice).
template <int D>
__device__ __forceinline__ void stream_item_coords(const DecodeArgs& a, int item, int& n, int& h,
                                                   int& slice) {
  using L = LatencyLayout<D, kStreamRows>;
  const int per_request = static_cast<int>(a.H) * L::kSlices;
  n = item / per_request;
  const int rem = item - n * per_request;
  h = rem / L::kSlices;
  slice = rem - h * L::kSlices;
}

// The start of a stream kernel's block: the block set-up, then, in the first `checkers` blocks, the
// pool-row conflict check in place of any state work.  Returns true for a checker block (done).
__device__ __forceinline__ bool stream_block_start(const DecodeArgs& a, int checkers, int* err,
                                                   uint32_t* param_touch) {
  decode_block_setup(a, err, param_touch);
  const int b = static_cast<int>(blockIdx.x);
  if (b >= checkers) return false;
  fixed_checker_block(a, b, checkers, err);
  return true;
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
  const int H = static_cast<int>(a.H);
  stream_item_coords<D>(a, item, it.n, it.h, it.slice);
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

// Issues the loads of the state rows of (pool slot `read`, head h, row slice): clamped into the pool (a
// slot >= P is reported, never read past the pool); a padded item (read < 0) loads nothing.  Shared by
// the plain and the spec stream kernels.
template <int D, bool kF32>
__device__ __forceinline__ void issue_stream_state(const DecodeArgs& a, int read, int h, int slice, int warp,
                                                   int lane, RawStateRow<kF32> (&raw)[kStreamRows]) {
  using L = LatencyLayout<D, kStreamRows>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  if (read < 0) return;
  const int64_t r = read < a.pool_rows ? read : a.pool_rows - 1;
  const StateT* pool = static_cast<const StateT*>(a.pool);
  const int64_t head = (r * a.H + h) * D;
#pragma unroll
  for (int q = 0; q < kStreamRows; ++q)
    issue_state_row<D, kF32>(pool + (head + L::row(slice, q, warp, lane)) * D, lane % L::kLanesPerRow,
                             raw[q]);
}

template <int D, bool kF32>
__global__ void __launch_bounds__(kLatencyThreads, kStreamBlocksPerSm)
    decode_plain_stream_kernel(const __grid_constant__ DecodeArgs a, const int checkers) {
  using L = LatencyLayout<D, kStreamRows>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  __shared__ __align__(16) FixedSmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (stream_block_start(a, checkers, &sm.err, &sm.param_touch)) return;
  const int b = static_cast<int>(blockIdx.x);
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
  issue_stream_state<D, kF32>(a, cur.read, cur.h, cur.slice, warp, lane, cur_s);
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
    if (item + G < items) issue_stream_state<D, kF32>(a, nxt.read, nxt.h, nxt.slice, warp, lane, nxt_s);
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
        store_state_row<D, kF32, kStreamStateStores<kF32>>(
            pool + ((static_cast<int64_t>(read) * head_rows) + h * D + row) * D, j, s[q]);
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

// A stream kernel's grid for this call (checker blocks + state blocks at `blocks_per_sm` blocks per SM),
// or 0 when there are too many requests for every checker block to be resident beside at least one
// state block per SM (the caller has checked that the call is the kernel's kind).
template <int D>
int64_t stream_grid(const DecodeArgs& a, int num_sms, int blocks_per_sm, int64_t* checkers) {
  using L = LatencyLayout<D, kStreamRows>;
  *checkers = (a.N + kLatencyWarps - 1) / kLatencyWarps;
  int64_t resident = static_cast<int64_t>(num_sms) * blocks_per_sm;
  if (resident > kDecodeErrorSlots) resident = kDecodeErrorSlots;
  int64_t state_blocks = resident - *checkers;
  if (state_blocks < num_sms) return 0;
  const int64_t items = static_cast<int64_t>(a.N) * a.H * L::kSlices;
  if (items >= (int64_t{1} << 31)) return 0;
  if (state_blocks > items) state_blocks = items;
  return *checkers + state_blocks;
}

// The plain stream kernel's grid, or 0 when the call is not a plain one-token call in the canonical
// layout or does not fit (stream_grid).
template <int D>
int64_t plain_stream_grid(const DecodeArgs& a, int num_sms, int64_t* checkers) {
  if (a.spec || a.T != 1 || !fixed_layout_call(a, D)) return 0;
  return stream_grid<D>(a, num_sms, kStreamBlocksPerSm, checkers);
}

// Launches the stream kernel on the grid plain_stream_grid chose (grid >= 1).
template <int D, bool kF32>
Status launch_decode_plain_stream(const DecodeArgs& a, int64_t grid, int64_t checkers, bool pdl,
                                  cudaStream_t stream) {
  return launch_decode_grid(decode_plain_stream_kernel<D, kF32>, grid, kLatencyThreads, 0, pdl, stream,
                            "decode_plain_stream_kernel", a, static_cast<int>(checkers));
}

// ---------------------------------------------------------------------------------------------
// decode_spec_stream_kernel: the same stream of state slices for every other call in the canonical
// layout too large for one wave, on bf16 pools: speculative decode (2-D indices, T <= 4 tokens a
// request) and plain decode of 2..4 tokens (1-D indices).  The state stays in registers across the
// request's tokens; its only state traffic is one read and, for spec decode, one write per token with
// a write slot (plain: one write of the final state).  Per warp, a three-stage software pipeline over
// items i, i + G, i + 2G:
//   - item i + 2G: the request's slots (num_accepted and the first 4 index entries) start loading;
//   - item i + G: its read slot is picked from those registers (the entry acc - 1; a load only when
//     acc > 4) and checked, and its state rows (raw registers) and its tokens' bits start loading;
//   - item i: warp t preprocesses token t (D / 32 columns a lane, into the block's TokenBuf of token t,
//     double-buffered by item parity), one block barrier an item publishes the tokens, then every warp
//     advances its rows token by token, storing out and each token's state.
// A request's three round trips (acc -> index entry -> state) thus lie under two items' math.
// Measured without math (bench/bw_ceiling.cu spec-rand, H200): read once and written 4 times at random
// rows, this pattern reaches 87% of memcpy's read + write bandwidth at N = 256 and 91-94% of a
// same-size memcpy at N = 64.
// Work item, grid and errors: as decode_plain_stream_kernel (LatencyLayout<D, 2>; checker blocks first,
// fixed_checker_block's spec-aware conflict check; the fixed kernel's per-request checks, so a request
// with a bad count or slot writes nothing, and a padded one zeroes its T outputs).
// Shared memory: 2 x 4 TokenBuf (12.4 KB at D = 128) and each warp's stage for the next item's q, k, g
// of its token and dt_bias (cp.async, 1.3 KB a warp).  Registers: 2 x 16 state words, two item records
// (~13 words each) and a slot record: 125-126, no spills, at the 128 cap of 4 blocks per SM.
// bf16 pools only: with fp32 state (2 x 32 words) it spills at 4 blocks per SM and measured slower
// than the pipelined kernel, which keeps fp32 spec calls (perf-notes d11: spec 1+3 N = 256 bf16 222 us
// vs 250, fp32 453 vs 389).

constexpr int kSpecStreamBlocksPerSm = 4;

// One warp's raw token bits of its next item, copied by cp.async so that they occupy no registers
// while the current item is computed.  Each lane copies, and later reads, only its own D / 32 columns.
template <int D>
struct SpecStreamStage {
  uint32_t q[D / 2], k[D / 2], g[D / 2];  // bf16 pairs of token w (warp w) of the next item
  float dtb[D];
};

template <int D>
struct SpecStreamSmem {
  // Item k's tokens in tok[k % 2] (token t by warp t), so that warp t can preprocess item k + 1's
  // token while the other warps still compute item k: one block barrier an item.
  TokenBuf<D> tok[2][kFixedMaxTokens];
  float beta[2][kFixedMaxTokens];
  SpecStreamStage<D> stage[kLatencyWarps];
  int err;
  uint32_t param_touch;
};

// A request's slots as loaded two items ahead, one value a lane: lane t < 4 holds idx[n, t] (-1 past
// S; 1-D: lane 0 holds idx[n]), lane 4 num_accepted[n] (spec decode).  Loaded as the same value in every
// lane they would be warp-uniform, and the compiler moves uniform values into uniform registers right
// after the load, waiting for it there (ncu: long_sb on R2UR): a round trip an item on the warp's path.
struct StreamSlots {
  int word;
};

__device__ __forceinline__ void load_stream_slots(const DecodeArgs& a, int n, int lane, StreamSlots& sl) {
  const int S = static_cast<int>(a.slots);
  const int* idx = static_cast<const int*>(a.idx);
  sl.word = -1;
  if (lane < kFixedMaxTokens && lane < S) sl.word = idx[n * S + lane];
  if (lane == kFixedMaxTokens && a.spec) sl.word = static_cast<const int*>(a.num_accepted)[n];
}

// The checks of decode_fixed_layout_kernel on an item's request: sets `read` (the read slot; the
// caller clamps its loads) and e[t] = idx[n, t] (t < 4), and returns the device error code (0: valid).
__device__ __forceinline__ int resolve_stream_slots(const DecodeArgs& a, int n, const StreamSlots& sl,
                                                    int (&e)[kFixedMaxTokens], int* read) {
  const int S = static_cast<int>(a.slots);
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t) e[t] = __shfl_sync(0xffffffffu, sl.word, t);
  if (!a.spec) {
    *read = e[0];
    return e[0] >= a.pool_rows ? static_cast<int>(DeviceError::kBadStateIndex) : 0;
  }
  const int acc = __shfl_sync(0xffffffffu, sl.word, kFixedMaxTokens);
  if (acc < 1 || acc > S) {
    *read = e[0];
    return static_cast<int>(DeviceError::kBadAcceptedCount);
  }
  const int* idx = static_cast<const int*>(a.idx);
  const int col = acc - 1;  // selects, not a dynamically indexed array (that would live in local memory)
  int r = col == 0 ? e[0] : col == 1 ? e[1] : col == 2 ? e[2] : e[3];
  if (col >= kFixedMaxTokens) r = idx[n * S + col];  // never: S == T <= 4 here (validate.cpp); kept
  *read = r;
  int err = 0;
  if (r >= 0 && a.T > S) err = static_cast<int>(DeviceError::kBadStateIndex);
  if (r >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
#pragma unroll
  for (int t = 0; t < kFixedMaxTokens; ++t)
    if (e[t] >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
  for (int c = kFixedMaxTokens; c < S; ++c)  // likewise never (the checks do not rely on S == T)
    if (idx[n * S + c] >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
  return err;
}

// An item: where it is, what its request's checks said, and the bits of its tokens that stay in
// registers: beta and the value entries (2-byte elements, below cp.async's 4 bytes).  They are spread
// one a lane (lane 0 of warp t: beta of token t; the value entries of the warp's 2 kRowsPerWarp rows
// of token t in lanes 2 kRowsPerWarp t, ...) and shuffled to their users at use.  A thread's own 8
// entries cost 8 registers; packed two to a register, the packing waited for each load right after
// it was issued (ncu: long_sb on the PRMT, ~4 round trips an item on the warp's path).
template <int D>
struct SpecStreamItem {
  using L = LatencyLayout<D, kStreamRows>;
  static constexpr int kValuesPerToken = kStreamRows * L::kRowsPerWarp;
  static constexpr int kValueRegs = kFixedMaxTokens * kValuesPerToken / 32;  // D = 128: 1, D = 64: 2
  static_assert(32 % kValuesPerToken == 0, "a token's value entries within one register of the lanes");
  int n, h, slice;
  int read, err;
  int w[kFixedMaxTokens];  // spec decode: the state after token t goes to row w[t] (< 0: not written)
  uint32_t beta;           // lane 0 of warp t: beta of token t
  uint32_t v[kValueRegs];  // entry f = 32 i + lane: token f / kValuesPerToken, row slot f % kValuesPerToken
  float a_log;             // lane 0 (not a uniform load, see StreamSlots)
};

// Starts the loads of an item's token inputs: q, k, g of token `warp` (the one this warp preprocesses)
// for the lane's columns and dt_bias into the warp's stage (cp.async, one commit group); beta and the
// value entries of every token for the thread's rows, and A_log, into the item's registers.
template <int D>
__device__ __forceinline__ void load_spec_stream_bits(const DecodeArgs& a, int T, int warp, int lane,
                                                      SpecStreamStage<D>& st, SpecStreamItem<D>& it) {
  using L = LatencyLayout<D, kStreamRows>;
  constexpr int P = D / 64, PC = D / 32;  // bf16 pairs / columns a lane
  const int H = static_cast<int>(a.H);
  const unsigned short* v = reinterpret_cast<const unsigned short*>(a.v);
  const unsigned short* beta = static_cast<const unsigned short*>(a.beta);
  const bf16* g = static_cast<const bf16*>(a.g);
  const bool gated = a.gate_mode != kGatePrecomputed;
  if (warp < T) {
    const int tok_head = (it.n * T + warp) * H + it.h;  // 32-bit: fixed_layout_call
    const int off = tok_head * D + lane * PC;           // 16-byte rows (fixed_layout_call): 4 P-byte aligned
    cp_async<4 * P>(&st.q[lane * P], a.q + off);
    cp_async<4 * P>(&st.k[lane * P], a.k + off);
    cp_async<4 * P>(&st.g[lane * P], g + off);
    if (gated) {
#pragma unroll
      for (int i = 0; i < PC; ++i) cp_async<4>(&st.dtb[lane * PC + i], a.dt_bias + it.h * D + lane * PC + i);
    }
  }
  it.beta = lane == 0 && warp < T ? beta[(it.n * T + warp) * H + it.h] : 0u;
  using I = SpecStreamItem<D>;
#pragma unroll
  for (int i = 0; i < I::kValueRegs; ++i) {
    const int f = 32 * i + lane, t = f / I::kValuesPerToken, slot = f % I::kValuesPerToken;
    const int row =
        L::row(it.slice, slot / L::kRowsPerWarp, warp, (slot % L::kRowsPerWarp) * L::kLanesPerRow);
    it.v[i] = t < T ? v[((it.n * T + t) * H + it.h) * D + row] : 0u;
  }
  it.a_log = gated && lane == 0 ? a.A_log[it.h] : 0.f;
  cp_async_commit();
}

template <int D>
__global__ void __launch_bounds__(kLatencyThreads, kSpecStreamBlocksPerSm)
    decode_spec_stream_kernel(const __grid_constant__ DecodeArgs a, const int checkers) {
  constexpr bool kF32 = false;  // bf16 pools (see above)
  using L = LatencyLayout<D, kStreamRows>;
  using StateT = bf16;
  constexpr int P = D / 64, PC = D / 32;
  __shared__ __align__(16) SpecStreamSmem<D> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (stream_block_start(a, checkers, &sm.err, &sm.param_touch)) return;
  const int b = static_cast<int>(blockIdx.x);
  const int G = static_cast<int>(gridDim.x) - checkers;
  const int per_request = static_cast<int>(a.H) * L::kSlices;
  const int items = static_cast<int>(a.N) * per_request;  // < 2^31: spec_stream_grid
  const int T = static_cast<int>(a.T);
  const bool spec = a.spec != 0;
  const int j = lane % L::kLanesPerRow;
  const int64_t head_rows = static_cast<int64_t>(a.H) * D;
  StateT* pool = static_cast<StateT*>(a.pool);
  const bool gated = a.gate_mode != kGatePrecomputed;
  SpecStreamStage<D>& stage = sm.stage[warp];
  int err = 0;

  // Resolves an item's slots and starts its loads: state rows (a padded or failed item loads no state)
  // and token bits.
  auto start_item = [&](int item, const StreamSlots& sl, SpecStreamItem<D>& it,
                        RawStateRow<kF32>(&raw)[kStreamRows]) {
    stream_item_coords<D>(a, item, it.n, it.h, it.slice);
    int e[kFixedMaxTokens];
    it.err = resolve_stream_slots(a, it.n, sl, e, &it.read);
#pragma unroll
    for (int t = 0; t < kFixedMaxTokens; ++t) it.w[t] = t < T ? e[t] : -1;
    if (it.err == 0) issue_stream_state<D, kF32>(a, it.read, it.h, it.slice, warp, lane, raw);
    load_spec_stream_bits<D>(a, T, warp, lane, stage, it);
  };

  int item = b - checkers;  // < items: the host launches at most `items` state blocks
  StreamSlots slots;        // of item + G (then of item + 2G)
  SpecStreamItem<D> nxt;    // item's record, then item + G's
  RawStateRow<kF32> cur_s[kStreamRows], nxt_s[kStreamRows];
  {
    StreamSlots first;
    load_stream_slots(a, item / per_request, lane, first);
    if (item + G < items) load_stream_slots(a, (item + G) / per_request, lane, slots);
    start_item(item, first, nxt, cur_s);
  }
  for (int k = 0; item < items; item += G, ++k) {
    const SpecStreamItem<D> it = nxt;
    const int buf = k & 1;
    // 1. Warp t preprocesses this item's token t (its bits landed in the warp's stage an item ago).
    cp_async_wait<0>();
    if (warp < T) {
      const float expA = gated ? expf(__shfl_sync(0xffffffffu, it.a_log, 0)) : 0.f;
      float dtb[PC];
#pragma unroll
      for (int i = 0; i < PC; ++i) dtb[i] = gated ? stage.dtb[lane * PC + i] : 0.f;
      FixedTokenBits<D> bits;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        bits.q[i] = stage.q[lane * P + i];
        bits.k[i] = stage.k[lane * P + i];
        bits.g[i] = stage.g[lane * P + i];
      }
      bits.beta = __shfl_sync(0xffffffffu, it.beta, 0);
      const float b = prep_fixed_token<D>(a, bits, expA, dtb, sm.tok[buf][warp], lane);
      if (lane == 0) sm.beta[buf][warp] = b;
    }
    // 2. The next item: its checks, state and token bits (the stage is this lane's own: read above);
    // the slots of the one after.
    if (item + G < items) start_item(item + G, slots, nxt, nxt_s);
    if (item + 2 * G < items) load_stream_slots(a, (item + 2 * G) / per_request, lane, slots);
    // Every warp's token of this item in tok[buf]; every warp done with item k - 1's tok[buf ^ 1]...
    // which is only rewritten after the next barrier.
    __syncthreads();
    // 3. This item: T tokens on the thread's rows, each token's out and state stored.
    bf16* out = a.out + static_cast<int64_t>(it.n) * T * head_rows + it.h * D;
    if (it.err != 0) {
      err = it.err;            // writes nothing
    } else if (it.read < 0) {  // padded request: zero its outputs, touch no state
      if (j == 0) {
        for (int t = 0; t < T; ++t) {
#pragma unroll
          for (int q = 0; q < kStreamRows; ++q)
            out[t * head_rows + L::row(it.slice, q, warp, lane)] = __float2bfloat16_rn(0.f);
        }
      }
    } else {
      float s[kStreamRows][16];
#pragma unroll
      for (int q = 0; q < kStreamRows; ++q) state_row_floats<kF32>(cur_s[q], s[q]);
#pragma unroll
      for (int t = 0; t < kFixedMaxTokens; ++t) {
        if (t >= T) break;
        float v[kStreamRows], o[kStreamRows];
#pragma unroll
        for (int q = 0; q < kStreamRows; ++q) {  // entry t kValuesPerToken + q kRowsPerWarp + lane row
          constexpr int kVT = SpecStreamItem<D>::kValuesPerToken;
          const int f = t * kVT + q * L::kRowsPerWarp + lane / L::kLanesPerRow;
          v[q] = bf16_bits_lo(__shfl_sync(0xffffffffu, it.v[(t * kVT) / 32], f % 32));
        }
        advance_rows<D, kStreamRows>(s, sm.tok[buf][t], j, sm.beta[buf][t], v, o);
        const int w = spec ? it.w[t] : (t == T - 1 ? it.read : -1);
#pragma unroll
        for (int q = 0; q < kStreamRows; ++q) {
          const int row = L::row(it.slice, q, warp, lane);
          if (j == 0) out[t * head_rows + row] = __float2bfloat16_rn(o[q]);
          if (w >= 0)
            store_state_row<D, kF32, kStreamStateStores<kF32>>(
                pool + (static_cast<int64_t>(w) * head_rows + it.h * D + row) * D, j, s[q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kStreamRows; ++q) cur_s[q] = nxt_s[q];
  }
  if (err != 0) atomicCAS(&sm.err, 0, err);
  __syncthreads();
  if (tid == 0) write_decode_error_words(a, sm.err);
}

// The spec stream kernel's grid, or 0 when the call is not a spec or several-token call in the canonical
// layout or does not fit (stream_grid).
template <int D>
int64_t spec_stream_grid(const DecodeArgs& a, int num_sms, int64_t* checkers) {
  if (!(a.spec || a.T > 1) || !fixed_layout_call(a, D)) return 0;
  return stream_grid<D>(a, num_sms, kSpecStreamBlocksPerSm, checkers);
}

template <int D>
Status launch_decode_spec_stream(const DecodeArgs& a, int64_t grid, int64_t checkers, bool pdl,
                                 cudaStream_t stream) {
  return launch_decode_grid(decode_spec_stream_kernel<D>, grid, kLatencyThreads, 0, pdl, stream,
                            "decode_spec_stream_kernel", a, static_cast<int>(checkers));
}

// Kernel choice and launch for one head dim and state dtype (see DecodeKernel): kAuto takes the
// fixed-layout kernel when the call is in that layout and fits one wave, else (in that layout) the
// plain stream kernel or (bf16 pools) the spec stream kernel when its checker blocks fit, else the latency
// kernel when its one wave fits, else the pipelined kernel.  Forcing a kernel the call cannot use falls
// through to the next one in that order.
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
    if constexpr (!kF32) {  // fp32 pools: the pipelined kernel (see decode_spec_stream_kernel)
      const int64_t spec_grid = spec_stream_grid<D>(a, num_sms, &checkers);
      if (spec_grid > 0) return launch_decode_spec_stream<D>(a, spec_grid, checkers, pdl, stream);
    }
  }
  const int rows = kernel == DecodeKernel::kPipelined ? 0 : latency_rows_per_thread<D>(a);
  if (rows == 1) return launch_decode_latency<D, kF32, 1>(a, pdl, stream);
  if (rows == 2) return launch_decode_latency<D, kF32, 2>(a, pdl, stream);
  return launch_decode_pipelined<D, kF32>(a, num_sms, pdl, stream);
}

}  // namespace sm90
}  // namespace flashkda
