// Internal to the CPU reference (reference.cpp, decode.cpp): element access of strided CPU tensors and
// the per-(sequence, head) loading + preprocessing of token inputs, shared by prefill and decode.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"

namespace flashkda {
namespace reference {
namespace detail {

// double -> bf16 with a single rounding (to nearest even).
uint16_t double_to_bf16(double d);

inline double load_real(const TensorRef& t, int64_t off) {
  if (t.dtype == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(t.data)[off]);
  return static_cast<const float*>(t.data)[off];
}

inline void store_real(const TensorRef& t, int64_t off, double x) {
  if (t.dtype == DType::kBFloat16) {
    static_cast<uint16_t*>(t.data)[off] = double_to_bf16(x);
  } else {
    static_cast<float*>(t.data)[off] = static_cast<float>(x);
  }
}

// Element i of a 1-D int32 / int64 tensor, element (i, j) of a 2-D one.
inline int64_t load_index(const TensorRef& t, int64_t i) {
  const int64_t off = i * t.strides[0];
  if (t.dtype == DType::kInt32) return static_cast<const int32_t*>(t.data)[off];
  return static_cast<const int64_t*>(t.data)[off];
}
inline int64_t load_index2(const TensorRef& t, int64_t i, int64_t j) {
  const int64_t off = i * t.strides[0] + j * t.strides[1];
  if (t.dtype == DType::kInt32) return static_cast<const int32_t*>(t.data)[off];
  return static_cast<const int64_t*>(t.data)[off];
}

inline int64_t offset4(const TensorRef& t, int64_t b, int64_t s, int64_t h, int64_t d) {
  return b * t.strides[0] + s * t.strides[1] + h * t.strides[2] + d * t.strides[3];
}

// Row (dim 1 of the token tensors) of logical token s: token_rows[s] when the params map tokens to
// rows, else s.  `Params` is PrefillParams or DecodeParams.
template <class Params>
inline int64_t token_row(const Params& p, int64_t s) {
  return p.token_rows.defined() ? load_index(p.token_rows, s) : s;
}

// Preprocessed double inputs of logical tokens [bos, bos + L) of batch row `row`, head h (spec
// section 2: l2norm, gate, beta activation as the params say), read from their rows (token_row).
// `Params` is PrefillParams or DecodeParams.
struct HeadInputs {
  std::vector<double> q, k, v, a, b;  // [L, K], [L, K], [L, V], [L, K], [L]
};

template <class Params>
void load_head_inputs(const Params& p, int64_t row, int64_t bos, int64_t L, int64_t h, int64_t K, int64_t V,
                      HeadInputs* in) {
  const bool gate_params = p.gate_mode != GateMode::kPrecomputed;
  const float* A_log = gate_params ? static_cast<const float*>(p.A_log.data) : nullptr;
  const float* dt_bias = gate_params ? static_cast<const float*>(p.dt_bias.data) : nullptr;
  in->q.assign(L * K, 0.0);
  in->k.assign(L * K, 0.0);
  in->a.assign(L * K, 0.0);
  in->v.assign(L * V, 0.0);
  in->b.assign(L, 0.0);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t s = token_row(p, bos + t);
    for (int64_t c = 0; c < K; ++c) {
      in->q[t * K + c] = load_real(p.q, offset4(p.q, row, s, h, c));
      in->k[t * K + c] = load_real(p.k, offset4(p.k, row, s, h, c));
      const double g = load_real(p.g, offset4(p.g, row, s, h, c));
      in->a[t * K + c] =
          gate_params ? gate_log_decay(p.gate_mode, g, A_log[h], dt_bias[h * K + c], p.lower_bound) : g;
    }
    for (int64_t r = 0; r < V; ++r) in->v[t * V + r] = load_real(p.v, offset4(p.v, row, s, h, r));
    const int64_t boff = row * p.beta.strides[0] + s * p.beta.strides[1] + h * p.beta.strides[2];
    in->b[t] = beta_activation(p.use_beta_sigmoid, load_real(p.beta, boff));
    if (p.use_qk_l2norm) {
      l2_normalize(&in->q[t * K], K);
      l2_normalize(&in->k[t * K], K);
    }
  }
}

}  // namespace detail
}  // namespace reference
}  // namespace flashkda
