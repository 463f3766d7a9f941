// Helpers shared by the GoogleTest files: random bf16 data, the relative-error metric of
// kda_spec.md section 6, and TokenProblem, the token inputs of a prefill / decode call (contiguous
// buffers, fixed-length [B, T] or varlen with cu_seqlens and B = 1, K = V = D).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"

namespace flashkda {
namespace test_util {

constexpr uint16_t kPoisonBf16 = 0x7fc1;  // a NaN: any element left unwritten shows up

inline double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline std::vector<double> bf16_to_doubles(const std::vector<uint16_t>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = reference::bf16_to_float(x[i]);
  return r;
}

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, double sd = 1.0) {
  std::normal_distribution<float> nd(0.0f, static_cast<float>(sd));
  std::vector<uint16_t> r(n);
  for (auto& x : r) x = reference::float_to_bf16(nd(rng));
  return r;
}

inline std::vector<float> random_uniform(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> ud(lo, hi);
  std::vector<float> r(n);
  for (auto& x : r) x = ud(rng);
  return r;
}

// Random bf16 q, k, v, g, beta (N(0, 1)), A_log and dt_bias (U(0, 1)), out poisoned.  `Derived`
// (CRTP) may add buffers: its fill(seed) is what the factories call.
template <class Derived>
struct TokenProblem {
  int64_t B = 1, T = 0, H = 1, D = 64, N = 1;
  bool varlen = false;
  std::vector<int32_t> cu;
  std::vector<uint16_t> q, k, v, g, beta, out;
  std::vector<float> A_log, dt_bias;

  static Derived fixed(int64_t B, int64_t T, int64_t H, int64_t D, uint32_t seed) {
    Derived p;
    p.B = B;
    p.T = T;
    p.H = H;
    p.D = D;
    p.N = B;
    p.fill(seed);
    return p;
  }
  static Derived varlen_of(const std::vector<int32_t>& lengths, int64_t H, int64_t D, uint32_t seed) {
    Derived p;
    p.varlen = true;
    p.cu.assign(1, 0);
    for (int32_t l : lengths) p.cu.push_back(p.cu.back() + l);
    p.B = 1;
    p.T = p.cu.back();
    p.H = H;
    p.D = D;
    p.N = static_cast<int64_t>(lengths.size());
    p.fill(seed);
    return p;
  }
  int64_t bos(int64_t n) const { return varlen ? cu[n] : 0; }
  int64_t len(int64_t n) const { return varlen ? cu[n + 1] - cu[n] : T; }
  int64_t row(int64_t n) const { return varlen ? 0 : n; }

  void fill_tokens(std::mt19937& rng) {
    const size_t n = static_cast<size_t>(B * T * H * D);
    q = random_bf16(n, rng);
    k = random_bf16(n, rng);
    v = random_bf16(n, rng);
    g = random_bf16(n, rng);
    beta = random_bf16(static_cast<size_t>(B * T * H), rng);
    A_log = random_uniform(static_cast<size_t>(H), rng, 0.0f, 1.0f);
    dt_bias = random_uniform(static_cast<size_t>(H * D), rng, 0.0f, 1.0f);
    out.assign(n, kPoisonBf16);
  }

  // q, k, v, g, beta, A_log, dt_bias, out and cu_seqlens of a PrefillParams or DecodeParams.
  template <class Params>
  void set_tokens(Params* p) {
    p->q = make_tensor_ref(q.data(), DType::kBFloat16, {B, T, H, D});
    p->k = make_tensor_ref(k.data(), DType::kBFloat16, {B, T, H, D});
    p->v = make_tensor_ref(v.data(), DType::kBFloat16, {B, T, H, D});
    p->g = make_tensor_ref(g.data(), DType::kBFloat16, {B, T, H, D});
    p->beta = make_tensor_ref(beta.data(), DType::kBFloat16, {B, T, H});
    p->A_log = make_tensor_ref(A_log.data(), DType::kFloat32, {H});
    p->dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {H, D});
    p->out = make_tensor_ref(out.data(), DType::kBFloat16, {B, T, H, D});
    if (varlen) p->cu_seqlens = make_tensor_ref(cu.data(), DType::kInt32, {N + 1});
  }
};

}  // namespace test_util
}  // namespace flashkda
