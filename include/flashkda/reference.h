// FlashKDA CPU reference: the obvious code of ../shared/kda_spec.md, accumulating in double.
//
// Two layers:
//  * per-(sequence, head) cores on already preprocessed double inputs: the token recurrence of spec
//    section 2 and the chunked form of section 3.  Tests check that they agree to ~1e-10, which
//    validates the algebra the GPU kernels use.
//  * prefill_reference(params): the whole op on CPU tensors (preprocessing, varlen, state pool,
//    bf16/fp32 state, bf16 output, checkpoint states), used by the CPU dispatch of the ops and by
//    flashkda::run; decode_reference(params): the recurrent decode / speculative decode of decode.h
//    on CPU tensors (used by flashkda::run_decode).
#pragma once

#include <cstdint>
#include <vector>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"

namespace flashkda {
namespace reference {

// One (sequence, head).  Row-major, token-major inputs:
//   q, k, a (log decay, <= 0): [T, K];  v: [T, V];  b (activated beta): [T];
//   S: [V, K] in/out (V-first state);  o: [T, V] out.
void kda_recurrent(const double* q, const double* k, const double* v, const double* a, const double* b,
                   int64_t T, int64_t K, int64_t V, double scale, double* S, double* o);

// The same function computed chunk by chunk (spec section 3) with chunk size C >= 1, with the
// triangular inverse by forward substitution.  Equal to kda_recurrent up to rounding.
void kda_chunked(const double* q, const double* k, const double* v, const double* a, const double* b,
                 int64_t T, int64_t K, int64_t V, double scale, int64_t C, double* S, double* o);

// Context parallelism (the blueprint of an intra-GPU sequence-splitting kernel; spec section 3,
// perf_model.md "affine chunk map").  Per token the state update is affine in S:
//   S' = S diag(e^a_t) (I - b_t k_t k_t^T) + b_t v_t k_t^T  =  S M_t + B_t,
// so a segment of tokens maps S_in -> S_out = S_in M + B with M [K, K] and B [V, K] (both row-major),
// and maps compose as (M1, B1) then (M2, B2) = (M1 M2, B1 M2 + B2).  The map does not depend on q
// (q is accepted, unused, and may be null, so every core takes the same arguments).  T == 0 gives
// (I, 0).
//
// kda_segment_map: token by token, i.e. the recurrence run on the augmented state [M; B] (K + V
// rows) from [I; 0], with values 0 for the M rows and v_t for the B rows.
void kda_segment_map(const double* q, const double* k, const double* v, const double* a, const double* b,
                     int64_t T, int64_t K, int64_t V, double* M, double* Bm);

// The same map as the product of per-chunk maps built from the chunked-form quantities of spec
// section 3 with chunk size C >= 1: M_c = diag(gamma_c) - W^T kd, B_c = U^T kd, where
// gamma_c = exp(G_last), kd_i = k_i * exp(G_last - G_i).  Equal to kda_segment_map up to rounding.
void kda_chunk_map(const double* q, const double* k, const double* v, const double* a, const double* b,
                   int64_t T, int64_t K, int64_t V, int64_t C, double* M, double* Bm);

// kda_recurrent computed by context parallelism: tokens [bounds[s], bounds[s+1]) form segment s
// (bounds: num_segments + 1 non-decreasing offsets from 0 to T; empty segments allowed).  Every
// segment's map is computed independently (kda_segment_map), a sequential scan of the maps from the
// initial S gives each segment's start state, and each segment is then rerun from its start state
// (kda_recurrent) to write its outputs.  S (in/out) ends as the scan's last state.  Equal to
// kda_recurrent on the whole sequence up to rounding.
void kda_context_parallel(const double* q, const double* k, const double* v, const double* a, const double* b,
                          int64_t T, int64_t K, int64_t V, double scale, const int64_t* bounds,
                          int64_t num_segments, double* S, double* o);
// The same with num_segments (>= 1; less is taken as 1) near-equal segments: bounds[s] = s * T /
// num_segments (some are empty when T < num_segments).
void kda_context_parallel(const double* q, const double* k, const double* v, const double* a, const double* b,
                          int64_t T, int64_t K, int64_t V, double scale, int64_t num_segments, double* S,
                          double* o);

// Preprocessing of spec section 2, per token and head (double math).
void l2_normalize(double* x, int64_t n);  // x <- x / sqrt(sum x^2 + 1e-6)
double gate_log_decay(GateMode mode, double g, double A_log_h, double dt_bias_hk, double lower_bound);
double beta_activation(bool use_sigmoid, double beta);

// The whole prefill on CPU tensors.  Validates with can_implement() first (and so writes nothing
// on error).  `chunk_size` 0 uses the recurrence; > 0 the chunked core (for tests).
// With checkpoint_offsets / checkpoint_state it also writes the state after each checkpoint offset
// (the recurrence is run segment by segment, so a checkpoint is bit-identical to the final state of
// running that prefix alone when chunk_size is 0).
Status prefill_reference(const PrefillParams& p, int64_t chunk_size = 0);

// The whole decode (decode.h) on CPU tensors: validates with can_implement_decode() first (writes
// nothing on error), reads every request's start state, then runs the recurrence token by token,
// writing the state after each token to its slot (2-D indices) or after the last one (1-D).
Status decode_reference(const DecodeParams& p);

// bf16 helpers (round to nearest even; NaN stays NaN).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);

}  // namespace reference
}  // namespace flashkda
