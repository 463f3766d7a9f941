// decode_pipelined_kernel: the decode / speculative-decode path on a state pool (spec section 4)
// as a persistent, warp-specialised pipeline, for calls with many requests (few requests go to
// kda_decode_latency.cuh).  Math and register layout: kda_token_recurrence.cuh (each consumer
// thread holds 16 columns of two state rows in registers).
//
// Why: a decode step is a pure state stream (64 KB read + 64 KB written per request and head for
// D = 128 fp32), so its speed is the number of state bytes in flight per SM.  One block per
// (request, head, row slice) keeps a chain of dependent round trips per block (index -> state ->
// stores) with only 16 KB in flight per block: 61-71% of copy bandwidth (perf-notes d1-d5).  Here
// each block walks many work items and a producer warp keeps kDecodeStages items' state in flight.
//
// Work item: (request n, head h, row slice): kRowsPerBlock = 32 (D = 128) or 64 (D = 64) rows of the
// [V, K] state, one contiguous 16 KB (fp32) / 8 KB (bf16) run of the pool row, moved by one TMA bulk
// copy.  Block b walks items b, b + G, b + 2G, ... (G = gridDim.x <= 2 per SM, kDecodeErrorSlots).
//
// Warp roles (224 threads, 2 blocks per SM):
//   warp 4, producer: resolves 32 items at a time, one per lane (cu_seqlens, num_accepted, the read
//     slot, every index entry and token row checked, beta, exp(A_log)) into a shared table, so the
//     chain of dependent index loads is paid once per 32 items; then per item: waits for a free
//     stage (`empty`), TMA bulk copy of the state slice (completing on the stage's `full` mbarrier),
//     bulk copies (or cp.async) of the raw q, k, g, v of up to kStageTokens tokens and of dt_bias
//     (on `tfull`).
//   warp 6, prep: per item, after `tfull` (the state may still be in flight), preprocesses the staged tokens
//   (l2norm, gate, beta) once
//     into the stage's token buffers and arrives on `ready`.
//   warp 5, checker: the pool-row conflict check of the requests the block owns (n = b mod G), a
//     chain of L2 round trips kept off the other warps' paths.
//   warps 0-3, consumers: wait `ready`, copy the state slice into registers, run the staged tokens
//     from the stage's buffers, release the stage (`empty`), write out and the state (directly from
//     registers: stores need no staging; streaming st.global.cs on fp32 pools, kStreamStateStores).
//     Tokens past the stage (long requests) are loaded and preprocessed by each consumer warp itself.
// Shared memory (D = 128, fp32 pool): 3 stages x (16 KB state + 4 staged tokens: 4.4 KB raw + 6 KB
// preprocessed + dt_bias + item) + 32-item table + per-warp token buffers = 92 KB; 124-128 registers.
//
// Errors: a bad request (cu_seqlens pair, num_accepted, an index >= P, a token row) writes nothing
// and its code goes to the block's error word; conflicts between requests are reported the same
// way.  The error words: block b writes words b, b + G, ... < kDecodeErrorSlots of the workspace
// every call (its code, then zeros), so all of them are rewritten by every call and the host needs no
// clearing memset before it (read_device_error returns the first non-zero word).
#pragma once

#include <cuda_runtime.h>

#include "sm90/kda_decode_sm90.cuh"

namespace flashkda {
namespace sm90 {

// Tokens per item whose raw inputs the producer stages, and the stages per block that fit two blocks
// per SM with them.  Plain decode uses the same layout: a 1-token layout with 5 stages measured no
// faster (perf-notes d6d: the stage count is not what bounds an item).
constexpr int kStageTokens = 4;
constexpr int kDecodeStages = 3;
constexpr int kDecodeProducerWarp = kTokenWarps;
constexpr int kDecodeCheckerWarp = kTokenWarps + 1;
constexpr int kDecodePrepWarp = kTokenWarps + 2;
constexpr int kDecodeThreads = (kTokenWarps + 3) * 32;
constexpr int kDecodeBlocksPerSm = 2;

// What the producer resolves for one work item.
struct DecodeItem {
  int64_t batch, bos, len, read;  // read < 0: padded request
  int64_t row[kStageTokens];      // input/output row of the first tokens
  int64_t slot[kStageTokens];     // spec: write slot of the first tokens (-1: none)
  float beta[kStageTokens];       // raw beta of the first tokens
  float expA;                     // exp(A_log[h]) (0 for the precomputed gate)
  int err;                        // DeviceError code, 0 when the request is valid
  int64_t n;
  int h, slice;
  int nstaged;  // tokens whose raw inputs are in the stage
};

template <int D, bool kF32>
struct DecodeStage {
  static constexpr int kRows = TokenLayout<D>::kRowsPerBlock;
  static constexpr int kStateBytes = kRows * D * (kF32 ? 4 : 2);
  alignas(128) unsigned char state[kStateBytes];
  alignas(16) bf16 q[kStageTokens][D];
  alignas(16) bf16 k[kStageTokens][D];
  alignas(16) unsigned char g[kStageTokens][D * 4];  // fp32 or bf16 as given
  alignas(16) bf16 v[kStageTokens][kRows];
  alignas(16) float dtb[D];
  TokenBuf<D> tok[kStageTokens];  // the staged tokens, preprocessed by the prep warp
  float tok_beta[kStageTokens];
  DecodeItem info;
};

template <int D, bool kF32>
struct DecodeSmem {
  DecodeStage<D, kF32> stage[kDecodeStages];
  DecodeItem tab[32];
  TokenBuf<D> own[kTokenWarps];   // per consumer warp: tokens past the stage
  uint64_t full[kDecodeStages];   // state slice landed (TMA bytes; the producer's lane 0)
  uint64_t tfull[kDecodeStages];  // item record + raw tokens landed (producer lanes' cp.async)
  uint64_t ready[kDecodeStages];  // staged tokens preprocessed (prep warp)
  uint64_t empty[kDecodeStages];  // consumers done with the stage
  int err;
  uint32_t param_touch;  // touch_decode_params' sum (never read)
};

// ---- cp.async primitives (sm_90; the mbarrier and TMA bulk ones are in kda_common.cuh) ------------
// The barrier tracks this thread's earlier cp.async copies (pending count +1, then an arrival when
// they land: a net zero, so the thread still arrives itself).
__device__ inline void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Copies `bytes` (a multiple of `align`) from global to shared memory with the warp's lanes, in
// cp.async pieces of `align` bytes (16, 8, 4), or synchronously for 2-byte aligned rows.
__device__ inline void copy_row_async(void* dst, const void* src, int bytes, int align, int lane) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (align >= 16) {
    for (int o = lane * 16; o < bytes; o += 32 * 16) cp_async<16>(d + o, s + o);
  } else if (align == 8) {
    for (int o = lane * 8; o < bytes; o += 32 * 8) cp_async<8>(d + o, s + o);
  } else if (align == 4) {
    for (int o = lane * 4; o < bytes; o += 32 * 4) cp_async<4>(d + o, s + o);
  } else {
    for (int o = lane * 2; o < bytes; o += 32 * 2)
      *reinterpret_cast<uint16_t*>(d + o) = *reinterpret_cast<const uint16_t*>(s + o);
  }
}

// ---- the producer's per-item resolution -------------------------------------------------------------
// One lane per item; every load here depends at most on cu_seqlens -> num_accepted -> index, and the
// 32 lanes' chains overlap.  Mirrors the checks of the latency kernel (decode_span,
// decode_read_slot, decode_entries_error) so the semantics are identical.
template <int D>
__device__ inline DecodeItem resolve_decode_item(const DecodeArgs& a, int64_t item, int stage_tokens) {
  constexpr int kSlices = D / TokenLayout<D>::kRowsPerBlock;
  DecodeItem it;
  const int64_t per_request = static_cast<int64_t>(a.H) * kSlices;
  it.n = item / per_request;
  const int64_t rem = item % per_request;
  it.h = static_cast<int>(rem / kSlices);
  it.slice = static_cast<int>(rem % kSlices);
  it.read = -1;
  it.nstaged = 0;
  it.expA = 0.f;
  // The read slot's loads depend on n alone: issued first, they overlap the span's (its index load is
  // the round trip that gates the state copy).
  const ReadSlotLoad rs = decode_read_slot_load(a, it.n);
  int err =
      decode_span(a, it.n, &it.batch, &it.bos, &it.len) ? 0 : static_cast<int>(DeviceError::kBadCuSeqlens);
  const int ns = err == 0 ? static_cast<int>(it.len < stage_tokens ? it.len : stage_tokens) : 0;
  // Everything that depends only on the span is issued before the read slot is checked: A_log, the
  // rows and write slots of the staged tokens, and beta at rows bos + t when there is no token_rows
  // map (always in bounds; discarded on an error).
  const bool gated = a.gate_mode != kGatePrecomputed;
  const float a_log = gated ? a.A_log[it.h] : 0.f;
#pragma unroll
  for (int t = 0; t < kStageTokens; ++t) {
    it.row[t] = 0;
    it.slot[t] = -1;
    it.beta[t] = 0.f;
    if (t < ns) {
      if (a.token_rows != nullptr) {
        it.row[t] = load_index(a.token_rows, a.rows_int64, it.bos + t);
      } else {
        it.row[t] = it.bos + t;
        it.beta[t] = load_scalar(a.beta, a.beta_fp32, it.batch * a.beta_sb + it.row[t] * a.beta_st + it.h);
      }
      if (a.spec && t < a.slots) it.slot[t] = slot_at(a, it.n, t);
    }
  }
  if (err == 0) err = decode_read_slot_check(a, rs, it.len, &it.read);
  if (err == 0) {
#pragma unroll
    for (int t = 0; t < kStageTokens; ++t) {
      if (t < ns) {
        if (it.row[t] < 0 || it.row[t] >= a.num_rows) err = static_cast<int>(DeviceError::kBadTokenRow);
        if (it.slot[t] >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
      }
    }
    // The remaining entries: index entries beyond the staged ones (every entry of the request's row
    // must be < P) and token rows beyond them.
    for (int64_t e = a.spec ? ns : 1; e < a.slots; ++e) {
      if (slot_at(a, it.n, e) >= a.pool_rows) err = static_cast<int>(DeviceError::kBadStateIndex);
    }
    if (a.token_rows != nullptr) {
      for (int64_t t = ns; t < it.len; ++t) {
        const int64_t r = load_index(a.token_rows, a.rows_int64, it.bos + t);
        if (r < 0 || r >= a.num_rows) err = static_cast<int>(DeviceError::kBadTokenRow);
      }
    }
  }
  if (err == 0 && it.read >= 0 && a.token_rows != nullptr) {
#pragma unroll
    for (int t = 0; t < kStageTokens; ++t) {
      if (t < ns)
        it.beta[t] = load_scalar(a.beta, a.beta_fp32, it.batch * a.beta_sb + it.row[t] * a.beta_st + it.h);
    }
  }
  it.expA = gated ? expf(a_log) : 0.f;
  it.nstaged = ns;
  it.err = err;
  return it;
}

// Producer: per item, the stage's state slice (TMA bulk, first: the long transfer) completing on
// `full`, and the item record plus the staged tokens' raw inputs (TMA bulk copies when every row is
// 16-byte aligned, else cp.async pieces) completing on `tfull`, so the prep warp works on the tokens
// while the state is still in flight.
template <int D, bool kF32>
__device__ inline void issue_decode_item(const DecodeArgs& a, const DecodeItem& it, DecodeStage<D, kF32>& st,
                                         uint64_t* full, uint64_t* tfull, int lane) {
  using Stage = DecodeStage<D, kF32>;
  constexpr int R = Stage::kRows;
  const bool live = it.err == 0 && it.read >= 0 && it.len > 0;
  if (lane == 0) {
    if (live) {
      const int64_t head_rows = static_cast<int64_t>(a.H) * D;
      const char* src =
          static_cast<const char*>(a.pool) +
          ((it.read * head_rows + static_cast<int64_t>(it.h) * D + static_cast<int64_t>(it.slice) * R) * D) *
              (kF32 ? 4 : 2);
      mbar_arrive_expect_tx(full, Stage::kStateBytes);
      if (a.load_evict_first) {  // read once a call (host rule: decode_load_evict_first)
        bulk_load_evict_first(st.state, src, Stage::kStateBytes, full);
      } else {
        bulk_load(st.state, src, Stage::kStateBytes, full);
      }
    } else {
      mbar_arrive(full);
    }
  }
  {  // the record, one 4-byte word per lane (a struct copy by one lane is ~20 dependent smem ops)
    static_assert(sizeof(DecodeItem) % 4 == 0, "record copied in words");
    const uint32_t* src = reinterpret_cast<const uint32_t*>(&it);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&st.info);
    for (int w = lane; w < static_cast<int>(sizeof(DecodeItem) / 4); w += 32) dst[w] = src[w];
  }
  const int align = min(min(min(a.align_q, a.align_k), min(a.align_g, a.align_v)), a.align_dtb);
  const bool gated = a.gate_mode != kGatePrecomputed;
  if (live && align >= 16) {
    // Every row 16-byte aligned (the usual case): TMA bulk copies on `tfull` with their byte counts,
    // lane t < nstaged for token t's four rows, lane 31 for dt_bias; few instructions per item.
    const int ge = a.g_fp32 ? 4 : 2;
    const int h = it.h;
    if (lane < it.nstaged) {
      const int t = lane;
      const int64_t row = it.row[t];
      mbar_arrive_expect_tx(tfull, static_cast<uint32_t>(D * 2 * 2 + D * ge + R * 2));
      bulk_load(st.q[t], a.q + it.batch * a.q_sb + row * a.q_st + static_cast<int64_t>(h) * D, D * 2, tfull);
      bulk_load(st.k[t], a.k + it.batch * a.k_sb + row * a.k_st + static_cast<int64_t>(h) * D, D * 2, tfull);
      bulk_load(st.g[t],
                static_cast<const char*>(a.g) +
                    (it.batch * a.g_sb + row * a.g_st + static_cast<int64_t>(h) * D) * ge,
                D * ge, tfull);
      bulk_load(st.v[t],
                a.v + it.batch * a.v_sb + row * a.v_st + static_cast<int64_t>(h) * D +
                    static_cast<int64_t>(it.slice) * R,
                R * 2, tfull);
    } else if (lane == 31 && gated) {
      mbar_arrive_expect_tx(tfull, D * 4);
      bulk_load(st.dtb, a.dt_bias + static_cast<int64_t>(h) * D, D * 4, tfull);
    } else {
      mbar_arrive(tfull);
    }
    return;
  }
  if (live) {
    const int h = it.h;
    for (int t = 0; t < it.nstaged; ++t) {
      const int64_t row = it.row[t];
      copy_row_async(st.q[t], a.q + it.batch * a.q_sb + row * a.q_st + static_cast<int64_t>(h) * D, D * 2,
                     a.align_q, lane);
      copy_row_async(st.k[t], a.k + it.batch * a.k_sb + row * a.k_st + static_cast<int64_t>(h) * D, D * 2,
                     a.align_k, lane);
      const int ge = a.g_fp32 ? 4 : 2;
      copy_row_async(st.g[t],
                     static_cast<const char*>(a.g) +
                         (it.batch * a.g_sb + row * a.g_st + static_cast<int64_t>(h) * D) * ge,
                     D * ge, a.align_g, lane);
      copy_row_async(st.v[t],
                     a.v + it.batch * a.v_sb + row * a.v_st + static_cast<int64_t>(h) * D +
                         static_cast<int64_t>(it.slice) * R,
                     R * 2, a.align_v, lane);
    }
    if (gated) copy_row_async(st.dtb, a.dt_bias + static_cast<int64_t>(h) * D, D * 4, a.align_dtb, lane);
  }
  cp_async_mbar_arrive(tfull);
  mbar_arrive(tfull);
}

// The raw inputs of staged token t (this lane's D / 32 columns) and its beta.
template <int D, bool kF32>
__device__ inline void stage_token_raw(const DecodeArgs& a, const DecodeStage<D, kF32>& st,
                                       const DecodeItem& info, int t, int lane, TokenRaw<D>& raw) {
  constexpr int PC = D / 32;
  const int c = lane * PC;  // vector loads: the stage rows are 16-byte aligned
  load_bf16_run<PC>(&st.q[t][c], true, raw.q);
  load_bf16_run<PC>(&st.k[t][c], true, raw.k);
  if (a.g_fp32) {
    const float* g = reinterpret_cast<const float*>(st.g[t]) + c;
    if constexpr (PC == 4) {
      const float4 x = *reinterpret_cast<const float4*>(g);
      raw.g[0] = x.x, raw.g[1] = x.y, raw.g[2] = x.z, raw.g[3] = x.w;
    } else {
      const float2 x = *reinterpret_cast<const float2*>(g);
      raw.g[0] = x.x, raw.g[1] = x.y;
    }
  } else {
    load_bf16_run<PC>(reinterpret_cast<const bf16*>(st.g[t]) + c, true, raw.g);
  }
  raw.beta = info.beta[t];
}

template <int D, bool kF32>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeBlocksPerSm)
    decode_pipelined_kernel(const __grid_constant__ DecodeArgs a, const int64_t total_items) {
  using TL = TokenLayout<D>;
  using Stage = DecodeStage<D, kF32>;
  using StateT = typename std::conditional<kF32, float, bf16>::type;
  constexpr int PC = TL::kColsPerLane;
  constexpr int kR = TL::kRowsPerThread;
  constexpr int R = Stage::kRows;
  static_assert(Stage::kStateBytes % 16 == 0, "TMA bulk copies move multiples of 16 bytes");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Smem = DecodeSmem<D, kF32>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t G = gridDim.x;
  if (tid == 0) {
    for (int s = 0; s < kDecodeStages; ++s) {
      mbar_init(&sm.full[s], 1);                  // the producer's lane 0 (+ TMA bytes)
      mbar_init(&sm.tfull[s], 32);                // the producer's lanes
      mbar_init(&sm.ready[s], 32);                // the prep warp's lanes
      mbar_init(&sm.empty[s], kTokenWarps * 32);  // every consumer thread
    }
    sm.err = 0;
    *reinterpret_cast<volatile uint32_t*>(&sm.param_touch) = touch_decode_params(a);
    fence_mbarrier_init();
  }
  __syncthreads();
  decode_wait_previous_kernel();  // the set-up above overlaps the previous kernel's tail

  if (warp == kDecodeProducerWarp) {
    // ---------------------------------------------------------------- producer
    int64_t k = 0;  // items issued
    for (int64_t first = blockIdx.x; first < total_items; first += 32 * G) {
      const int64_t mine = first + lane * G;
      if (mine < total_items) sm.tab[lane] = resolve_decode_item<D>(a, mine, kStageTokens);
      __syncwarp();
      const int64_t left = (total_items - first + G - 1) / G;
      const int cnt = static_cast<int>(left < 32 ? left : 32);
      for (int l = 0; l < cnt; ++l, ++k) {
        const int s = static_cast<int>(k % kDecodeStages);
        if (k >= kDecodeStages) mbar_wait(&sm.empty[s], static_cast<uint32_t>((k / kDecodeStages - 1) & 1));
        const DecodeItem& it = sm.tab[l];
        if (lane == 0 && it.err != 0) atomicCAS(&sm.err, 0, it.err);
        issue_decode_item<D, kF32>(a, it, sm.stage[s], &sm.full[s], &sm.tfull[s], lane);
      }
      __syncwarp();  // the table is rewritten by the next 32 items
    }
  } else if (warp == kDecodeCheckerWarp) {
    // ---------------------------------------------------------------- checker
    // Pool-row conflicts of the requests this block owns (n = b mod G): a chain of L2 round trips per
    // request, off the producer's path.
    for (int64_t n = blockIdx.x; n < a.N; n += G) {
      if (decode_request_conflicts(a, n, lane) && lane == 0)
        atomicCAS(&sm.err, 0, static_cast<int>(DeviceError::kStateSlotConflict));
    }
  } else if (warp == kDecodePrepWarp) {
    // ---------------------------------------------------------------- prep
    // The staged tokens of every item: l2norm, gate, beta into the stage's token buffers, once per
    // item instead of once per consumer warp, and off the consumers' per-item chain.
    int64_t k = 0;
    for (int64_t item = blockIdx.x; item < total_items; item += G, ++k) {
      const int s = static_cast<int>(k % kDecodeStages);
      mbar_wait(&sm.tfull[s], static_cast<uint32_t>((k / kDecodeStages) & 1));  // not the state
      Stage& st = sm.stage[s];
      const DecodeItem& info = st.info;
      if (info.err == 0 && info.read >= 0 && info.len > 0) {
        float dtb[PC];
#pragma unroll
        for (int i = 0; i < PC; ++i) dtb[i] = a.gate_mode != kGatePrecomputed ? st.dtb[lane * PC + i] : 0.f;
        const int nstaged = info.nstaged;
        const float expA = info.expA;
#pragma unroll
        for (int t = 0; t < kStageTokens; ++t) {
          if (t < nstaged) {
            TokenRaw<D> raw;
            stage_token_raw<D, kF32>(a, st, info, t, lane, raw);
            const float bt = preprocess_token<D, true>(a, raw, expA, dtb, st.tok[t], lane);
            if (lane == 0) st.tok_beta[t] = bt;
          }
        }
      }
      mbar_arrive(&sm.ready[s]);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    const int j = lane % TL::kLanesPerRow;
    const int64_t head_rows = static_cast<int64_t>(a.H) * D;
    StateT* pool = static_cast<StateT*>(a.pool);
    TokenBuf<D>& own = sm.own[warp];
    int64_t k = 0;
    for (int64_t item = blockIdx.x; item < total_items; item += G, ++k) {
      const int s = static_cast<int>(k % kDecodeStages);
      const uint32_t parity = static_cast<uint32_t>((k / kDecodeStages) & 1);
      mbar_wait(&sm.tfull[s], parity);  // record and raw v (also implied by `ready`; for clarity)
      mbar_wait(&sm.ready[s], parity);
      mbar_wait(&sm.full[s], parity);  // the state slice
      Stage& st = sm.stage[s];
      // Scalars of the item in registers (the stage is released before the stores).
      const DecodeItem& info = st.info;
      const int64_t batch = info.batch, bos = info.bos, len = info.len, read = info.read, n = info.n;
      const int h = info.h, slice = info.slice, nstaged = info.nstaged, err = info.err;
      if (err != 0 || len == 0) {
        mbar_arrive(&sm.empty[s]);
        continue;
      }
      int vrow[kR], local[kR];
#pragma unroll
      for (int q = 0; q < kR; ++q) {
        vrow[q] = TL::row(slice, q, warp, lane);
        local[q] = vrow[q] - slice * R;
      }
      const int64_t out_col = static_cast<int64_t>(h) * D;
      if (read < 0) {  // padded request: zero its outputs, touch no state
        if (j == 0) {
          for (int64_t t = 0; t < len; ++t) {
            const int64_t row = t < nstaged ? info.row[t] : mapped_row(a, bos + t);
            bf16* o = a.out + batch * a.out_sb + row * a.out_st + out_col;
#pragma unroll
            for (int q = 0; q < kR; ++q) o[vrow[q]] = __float2bfloat16_rn(0.f);
          }
        }
        mbar_arrive(&sm.empty[s]);
        continue;
      }
      float sreg[kR][16];
#pragma unroll
      for (int q = 0; q < kR; ++q)
        load_state_row<D, kF32>(st.state + static_cast<size_t>(local[q]) * D * (kF32 ? 4 : 2), j, sreg[q]);
      // The staged tokens straight from the stage's preprocessed buffers; out and (spec) the state
      // stores of token t are issued after all of the stage's reads of that token.
      for (int t = 0; t < nstaged; ++t) {
        float vt[kR], o[kR];
#pragma unroll
        for (int q = 0; q < kR; ++q) vt[q] = __bfloat162float(st.v[t][local[q]]);
        const int64_t row = info.row[t], w = info.slot[t];
        advance_rows<D, kR>(sreg, st.tok[t], j, st.tok_beta[t], vt, o);
        if (t == nstaged - 1) mbar_arrive(&sm.empty[s]);  // this thread's last read of the stage
        bf16* orow = a.out + batch * a.out_sb + row * a.out_st + out_col;
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o[q]);
          if (w >= 0)
            store_state_row<D, kF32, kStreamStateStores<kF32>>(pool + (w * head_rows + out_col + vrow[q]) * D,
                                                               j, sreg[q]);
        }
      }
      // Tokens past the stage (requests longer than kStageTokens): one at a time, straight from
      // global memory, each warp for itself.
      for (int64_t t = nstaged; t < len; ++t) {
        __syncwarp();  // the warp's buffer is rewritten
        const int64_t row = mapped_row(a, bos + t);
        TokenRaw<D> raw;
        load_token<D>(a, batch, row, h, lane, raw);
        float vt[kR];
        const int64_t vb = batch * a.v_sb + row * a.v_st + out_col;
#pragma unroll
        for (int q = 0; q < kR; ++q) vt[q] = __bfloat162float(a.v[vb + vrow[q]]);
        const int64_t w = a.spec ? slot_at(a, n, t) : -1;
        float expA_h, dtb[PC];
        load_gate_params<D>(a, h, lane, &expA_h, dtb);
        const float bt = preprocess_token<D, true>(a, raw, expA_h, dtb, own, lane);
        __syncwarp();
        bf16* orow = a.out + batch * a.out_sb + row * a.out_st + out_col;
        float o[kR];
        advance_rows<D, kR>(sreg, own, j, bt, vt, o);
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          if (j == 0) orow[vrow[q]] = __float2bfloat16_rn(o[q]);
          if (w >= 0)
            store_state_row<D, kF32, kStreamStateStores<kF32>>(pool + (w * head_rows + out_col + vrow[q]) * D,
                                                               j, sreg[q]);
        }
      }
      if (!a.spec) {
#pragma unroll
        for (int q = 0; q < kR; ++q)
          store_state_row<D, kF32, kStreamStateStores<kF32>>(
              pool + (read * head_rows + out_col + vrow[q]) * D, j, sreg[q]);
      }
    }
  }

  // Every error word is rewritten by every call (see the header comment).
  __syncthreads();
  if (tid == 0) write_decode_error_words(a, sm.err);
}

template <int D, bool kF32>
Status launch_decode_pipelined(const DecodeArgs& a, int num_sms, bool pdl, cudaStream_t stream) {
  constexpr int kSlices = D / TokenLayout<D>::kRowsPerBlock;
  const int64_t total = static_cast<int64_t>(a.N) * a.H * kSlices;
  int64_t grid = static_cast<int64_t>(num_sms) * kDecodeBlocksPerSm;
  if (grid > kDecodeErrorSlots) grid = kDecodeErrorSlots;
  if (grid > total) grid = total;
  if (grid < 1) grid = 1;
  const size_t smem = sizeof(DecodeSmem<D, kF32>);
  const cudaError_t e = set_smem_limit_once<decode_pipelined_kernel<D, kF32>>(static_cast<int>(smem));
  if (e != cudaSuccess) return cuda_status(e, "decode_pipelined_kernel attribute");
  return launch_decode_grid(decode_pipelined_kernel<D, kF32>, grid, kDecodeThreads, smem, pdl, stream,
                            "decode_pipelined_kernel launch", a, total);
}

}  // namespace sm90
}  // namespace flashkda
