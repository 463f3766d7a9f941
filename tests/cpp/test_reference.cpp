// Tests of the CPU reference: the chunked algebra against the recurrence, the context-parallel algebra
// (affine segment maps, their composition, split / scan / rerun), the preprocessing, the bf16
// helpers, and prefill_reference end to end (varlen, state aliasing, bf16 state, state pool,
// has_initial_state, row strides, chunked path).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "kda_test_util.h"

namespace flashkda {
namespace {

using reference::bf16_to_float;
using reference::float_to_bf16;

using test_util::bf16_to_doubles;
using test_util::kPoisonBf16;
using test_util::random_bf16;
using test_util::random_uniform;
using test_util::rel_err;

// ------------------------------------------------------------------------------------------------
// Core: chunked == recurrent

struct CoreInputs {
  std::vector<double> q, k, v, a, b, S0;
};

CoreInputs random_core(int64_t T, int64_t K, int64_t V, std::mt19937& rng, double min_log_decay) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  CoreInputs in;
  in.q.resize(T * K);
  in.k.resize(T * K);
  in.v.resize(T * V);
  in.a.resize(T * K);
  in.b.resize(T);
  in.S0.resize(V * K);
  for (auto& x : in.q) x = nd(rng);
  for (auto& x : in.k) x = nd(rng);
  for (auto& x : in.v) x = nd(rng);
  for (auto& x : in.a) x = min_log_decay * ud(rng);
  for (auto& x : in.b) x = ud(rng);
  for (auto& x : in.S0) x = 0.1 * nd(rng);
  for (int64_t t = 0; t < T; ++t) {
    reference::l2_normalize(&in.q[t * K], K);
    reference::l2_normalize(&in.k[t * K], K);
  }
  return in;
}

TEST(ReferenceCore, RecurrentOneTokenByHand) {
  // K = V = 2, one token: S <- S*exp(a); u = v - S k; S += b u k^T; o = scale S q.
  const double q[2] = {1.0, 2.0}, k[2] = {0.5, -1.0}, v[2] = {3.0, -2.0}, a[2] = {0.0, std::log(0.5)};
  const double b[1] = {0.25};
  double S[4] = {1.0, 2.0, 3.0, 4.0};  // rows v, columns k
  double o[2];
  reference::kda_recurrent(q, k, v, a, b, 1, 2, 2, 0.5, S, o);
  // decayed S = [[1, 1], [3, 2]]; S k = [-0.5, -0.5]; u = [3.5, -1.5]
  // S += 0.25 * u k^T = [[0.4375, -0.875], [-0.1875, 0.375]] -> [[1.4375, 0.125], [2.8125, 2.375]]
  EXPECT_DOUBLE_EQ(S[0], 1.4375);
  EXPECT_DOUBLE_EQ(S[1], 0.125);
  EXPECT_DOUBLE_EQ(S[2], 2.8125);
  EXPECT_DOUBLE_EQ(S[3], 2.375);
  EXPECT_DOUBLE_EQ(o[0], 0.5 * (1.4375 + 2 * 0.125));
  EXPECT_DOUBLE_EQ(o[1], 0.5 * (2.8125 + 2 * 2.375));
}

void expect_chunked_matches(int64_t T, int64_t K, int64_t V, int64_t C, double min_log_decay, uint32_t seed) {
  std::mt19937 rng(seed);
  CoreInputs in = random_core(T, K, V, rng, min_log_decay);
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  std::vector<double> S_rec = in.S0, S_chk = in.S0, o_rec(T * V), o_chk(T * V, std::nan(""));
  reference::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V, scale,
                           S_rec.data(), o_rec.data());
  reference::kda_chunked(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V, scale, C,
                         S_chk.data(), o_chk.data());
  EXPECT_LE(rel_err(o_chk, o_rec), 1e-10) << "T=" << T << " K=" << K << " C=" << C;
  EXPECT_LE(rel_err(S_chk, S_rec), 1e-10) << "T=" << T << " K=" << K << " C=" << C;
  for (double x : o_chk) ASSERT_TRUE(std::isfinite(x));
}

TEST(ReferenceCore, ChunkedMatchesRecurrentSmallHeadDim) {
  uint32_t seed = 100;
  for (int64_t C : {1, 3, 16, 64})
    for (int64_t T : {0, 1, 15, 16, 17, 63, 64, 65, 200}) expect_chunked_matches(T, 8, 8, C, -5.0, seed++);
}

TEST(ReferenceCore, ChunkedMatchesRecurrentHeadDim128) {
  uint32_t seed = 200;
  for (int64_t C : {1, 3, 16, 64})
    for (int64_t T : {0, 1, 15, 16, 17, 63, 64, 65, 200})
      expect_chunked_matches(T, 128, 128, C, -5.0, seed++);
}

TEST(ReferenceCore, ChunkedSafeUnderStrongDecay) {
  // Log decays down to -60 per token: exp(-G) alone would overflow double within a 64-chunk; the
  // pairwise exp(G_i - G_j) form never does.
  uint32_t seed = 300;
  for (int64_t C : {16, 64, 200}) expect_chunked_matches(200, 16, 16, C, -60.0, seed++);
  for (int64_t C : {7, 64}) expect_chunked_matches(130, 64, 32, C, -1.0, seed++);  // K != V in the core
}

TEST(ReferenceCore, ChunkedWithZeroDecayAndChunkLongerThanSequence) {
  std::mt19937 rng(311);
  CoreInputs in = random_core(10, 8, 4, rng, 0.0);  // a == 0 exactly
  std::vector<double> S1 = in.S0, S2 = in.S0, o1(40), o2(40);
  reference::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), 10, 8, 4, 0.3,
                           S1.data(), o1.data());
  reference::kda_chunked(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), 10, 8, 4, 0.3, 1000,
                         S2.data(), o2.data());
  EXPECT_LE(rel_err(o2, o1), 1e-12);
  EXPECT_LE(rel_err(S2, S1), 1e-12);
}

// ------------------------------------------------------------------------------------------------
// Core: context parallelism (affine segment maps, composition, split / scan / rerun)

// S_out = S_in M + Bm for S_in [V, K], M [K, K], Bm [V, K].
std::vector<double> apply_map(const std::vector<double>& S_in, const std::vector<double>& M,
                              const std::vector<double>& Bm, int64_t K, int64_t V) {
  std::vector<double> S = Bm;
  for (int64_t r = 0; r < V; ++r)
    for (int64_t j = 0; j < K; ++j)
      for (int64_t c = 0; c < K; ++c) S[r * K + c] += S_in[r * K + j] * M[j * K + c];
  return S;
}

struct SegmentMap {
  std::vector<double> M, B;
};

SegmentMap segment_map(const CoreInputs& in, int64_t t0, int64_t t1, int64_t K, int64_t V) {
  SegmentMap m{std::vector<double>(K * K, std::nan("")), std::vector<double>(V * K, std::nan(""))};
  // data() + offset, not &x[offset]: an empty segment of an empty input must not index the vector.
  reference::kda_segment_map(nullptr, in.k.data() + t0 * K, in.v.data() + t0 * V, in.a.data() + t0 * K,
                             in.b.data() + t0, t1 - t0, K, V, m.M.data(), m.B.data());
  return m;
}

TEST(ReferenceContextParallel, OneTokenMapByHand) {
  // M = diag(e^a) (I - b k k^T), B = b v k^T.
  const double k[2] = {0.6, -0.8}, v[3] = {1.0, -2.0, 0.5}, a[2] = {-0.5, -2.0}, b[1] = {0.7};
  double M[4], Bm[6];
  reference::kda_segment_map(nullptr, k, v, a, b, 1, 2, 3, M, Bm);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 2; ++c)
      EXPECT_NEAR(M[r * 2 + c], std::exp(a[r]) * ((r == c ? 1.0 : 0.0) - b[0] * k[r] * k[c]), 1e-15);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 2; ++c) EXPECT_NEAR(Bm[r * 2 + c], b[0] * v[r] * k[c], 1e-15);
  reference::kda_segment_map(nullptr, k, v, a, b, 0, 2, 3, M, Bm);  // empty: (I, 0)
  EXPECT_EQ(M[0], 1.0);
  EXPECT_EQ(M[1], 0.0);
  EXPECT_EQ(M[2], 0.0);
  EXPECT_EQ(M[3], 1.0);
  for (double x : Bm) EXPECT_EQ(x, 0.0);
}

TEST(ReferenceContextParallel, SegmentMapAppliedEqualsRecurrence) {
  uint32_t seed = 1600;
  for (int64_t D : {8, 32})
    for (double min_a : {-1.0, -20.0})
      for (int64_t T : {0, 1, 17, 200}) {
        std::mt19937 rng(seed++);
        const int64_t K = D, V = D + (D == 8 ? 3 : 0);  // K != V once
        CoreInputs in = random_core(T, K, V, rng, min_a);
        const SegmentMap m = segment_map(in, 0, T, K, V);
        std::vector<double> S = in.S0, o(T * V);
        reference::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V,
                                 0.5, S.data(), o.data());
        EXPECT_LE(rel_err(apply_map(in.S0, m.M, m.B, K, V), S), 1e-12) << "T=" << T << " D=" << D;
        // B alone is the state reached from S_in = 0.
        std::vector<double> Z(V * K, 0.0);
        reference::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V,
                                 0.5, Z.data(), o.data());
        EXPECT_LE(rel_err(m.B, Z), 1e-12) << "T=" << T << " D=" << D;
      }
}

TEST(ReferenceContextParallel, ComposedMapsEqualMapOfUnion) {
  uint32_t seed = 1700;
  const int64_t T = 200;
  for (int64_t D : {8, 32})
    for (double min_a : {-1.0, -20.0})
      for (int64_t t1 : {0, 1, 17, 100, 199, 200}) {
        std::mt19937 rng(seed++);
        CoreInputs in = random_core(T, D, D, rng, min_a);
        const SegmentMap m1 = segment_map(in, 0, t1, D, D), m2 = segment_map(in, t1, T, D, D);
        const SegmentMap m = segment_map(in, 0, T, D, D);
        // (M1, B1) then (M2, B2) = (M1 M2, B1 M2 + B2); M1 M2 is M2 applied to the "state" M1.
        const std::vector<double> zeroK(D * D, 0.0);
        EXPECT_LE(rel_err(apply_map(m1.M, m2.M, zeroK, D, D), m.M), 1e-12) << "t1=" << t1;
        EXPECT_LE(rel_err(apply_map(m1.B, m2.M, m2.B, D, D), m.B), 1e-12) << "t1=" << t1;
      }
}

TEST(ReferenceContextParallel, ChunkMapEqualsSegmentMap) {
  uint32_t seed = 1800;
  for (int64_t D : {8, 32})
    for (double min_a : {-1.0, -20.0})
      for (int64_t C : {1, 3, 16, 64})
        for (int64_t T : {0, 1, 17, 65, 200}) {
          std::mt19937 rng(seed++);
          const int64_t K = D, V = D == 8 ? 5 : D;
          CoreInputs in = random_core(T, K, V, rng, min_a);
          const SegmentMap m = segment_map(in, 0, T, K, V);
          std::vector<double> M(K * K, std::nan("")), Bm(V * K, std::nan(""));
          reference::kda_chunk_map(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V,
                                   C, M.data(), Bm.data());
          EXPECT_LE(rel_err(M, m.M), 1e-10) << "T=" << T << " D=" << D << " C=" << C;
          EXPECT_LE(rel_err(Bm, m.B), 1e-10) << "T=" << T << " D=" << D << " C=" << C;
        }
}

void expect_context_parallel_matches(const CoreInputs& in, int64_t T, int64_t K, int64_t V,
                                     const std::vector<int64_t>* bounds, int64_t P, const char* what) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  std::vector<double> S_rec = in.S0, S_cp = in.S0, o_rec(T * V), o_cp(T * V, std::nan(""));
  reference::kda_recurrent(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V, scale,
                           S_rec.data(), o_rec.data());
  if (bounds) {
    reference::kda_context_parallel(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V,
                                    scale, bounds->data(), P, S_cp.data(), o_cp.data());
  } else {
    reference::kda_context_parallel(in.q.data(), in.k.data(), in.v.data(), in.a.data(), in.b.data(), T, K, V,
                                    scale, P, S_cp.data(), o_cp.data());
  }
  for (double x : o_cp) ASSERT_TRUE(std::isfinite(x)) << what;
  EXPECT_LE(rel_err(o_cp, o_rec), 1e-10) << what << " T=" << T << " K=" << K << " P=" << P;
  EXPECT_LE(rel_err(S_cp, S_rec), 1e-10) << what << " T=" << T << " K=" << K << " P=" << P;
}

TEST(ReferenceContextParallel, EqualSegmentsMatchRecurrent) {
  uint32_t seed = 1900;
  for (int64_t D : {8, 32})
    for (double min_a : {-1.0, -20.0})
      for (int64_t T : {0, 1, 17, 200})
        for (int64_t P : {1, 2, 3, 7}) {
          std::mt19937 rng(seed++);
          CoreInputs in = random_core(T, D, D, rng, min_a);
          expect_context_parallel_matches(in, T, D, D, nullptr, P, "equal");
        }
}

TEST(ReferenceContextParallel, UnevenAndEmptySegmentsMatchRecurrent) {
  uint32_t seed = 2000;
  const std::vector<std::vector<int64_t>> splits = {{0, 200},
                                                    {0, 0, 200},
                                                    {0, 200, 200},
                                                    {0, 1, 199, 200},
                                                    {0, 0, 0, 57, 57, 58, 200, 200},
                                                    {0, 13, 26, 100, 101, 150, 199, 200}};
  for (int64_t D : {8, 32})
    for (double min_a : {-1.0, -20.0})
      for (const auto& bounds : splits) {
        std::mt19937 rng(seed++);
        CoreInputs in = random_core(200, D, D, rng, min_a);
        expect_context_parallel_matches(in, 200, D, D, &bounds, static_cast<int64_t>(bounds.size()) - 1,
                                        "uneven");
      }
  std::mt19937 rng(seed++);
  CoreInputs in = random_core(40, 16, 24, rng, -3.0);  // K != V
  const std::vector<int64_t> bounds = {0, 5, 5, 31, 40};
  expect_context_parallel_matches(in, 40, 16, 24, &bounds, 4, "K!=V");
}

// ------------------------------------------------------------------------------------------------
// Preprocessing

TEST(ReferencePreprocess, GateModesGiveNonPositiveDecay) {
  std::mt19937 rng(400);
  std::normal_distribution<double> nd(0.0, 3.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (int i = 0; i < 20000; ++i) {
    double g = nd(rng);
    if (i % 100 == 0) g = (i % 200 == 0 ? 1e4 : -1e4);  // extremes stay finite
    const double A = ud(rng) * 2 - 0.5, dt = ud(rng);
    const double lb = -5.0 * (0.01 + 0.99 * ud(rng));
    const double ab = reference::gate_log_decay(GateMode::kBounded, g, A, dt, lb);
    const double as = reference::gate_log_decay(GateMode::kSoftplus, g, A, dt, lb);
    ASSERT_TRUE(std::isfinite(ab));
    ASSERT_TRUE(std::isfinite(as)) << g;
    ASSERT_LE(ab, 0.0);
    ASSERT_GE(ab, lb);
    ASSERT_LE(as, 0.0);
    EXPECT_EQ(reference::gate_log_decay(GateMode::kPrecomputed, -std::fabs(g), A, dt, lb), -std::fabs(g));
  }
}

TEST(ReferencePreprocess, BoundedGateKnownValues) {
  // sigmoid(0) = 1/2
  EXPECT_DOUBLE_EQ(reference::gate_log_decay(GateMode::kBounded, 1.0, 0.0, -1.0, -5.0), -2.5);
  EXPECT_DOUBLE_EQ(reference::gate_log_decay(GateMode::kBounded, 0.25, 0.7, -0.25, -3.0), -1.5);
  // exp(log 2) * (0.5 + 0) = 1 -> -5 * sigmoid(1)
  EXPECT_NEAR(reference::gate_log_decay(GateMode::kBounded, 0.5, std::log(2.0), 0.0, -5.0),
              -5.0 * 0.7310585786300049, 1e-14);
  // saturation
  EXPECT_NEAR(reference::gate_log_decay(GateMode::kBounded, 100.0, 0.0, 0.0, -4.0), -4.0, 1e-14);
  EXPECT_NEAR(reference::gate_log_decay(GateMode::kBounded, -100.0, 0.0, 0.0, -4.0), 0.0, 1e-14);
}

TEST(ReferencePreprocess, SoftplusGateKnownValuesAndStable) {
  EXPECT_NEAR(reference::gate_log_decay(GateMode::kSoftplus, 0.0, 0.0, 0.0, -5.0), -std::log(2.0), 1e-15);
  EXPECT_NEAR(reference::gate_log_decay(GateMode::kSoftplus, 0.5, std::log(3.0), 0.5, -5.0),
              -3.0 * std::log1p(std::exp(1.0)), 1e-14);
  EXPECT_DOUBLE_EQ(reference::gate_log_decay(GateMode::kSoftplus, 1000.0, 0.0, 0.0, -5.0), -1000.0);
  EXPECT_DOUBLE_EQ(reference::gate_log_decay(GateMode::kSoftplus, 1e300, 0.0, 0.0, -5.0), -1e300);
  const double tiny = reference::gate_log_decay(GateMode::kSoftplus, -1000.0, 0.0, 0.0, -5.0);
  EXPECT_LE(tiny, 0.0);
  EXPECT_GT(tiny, -1e-300);
}

TEST(ReferencePreprocess, BetaAndL2Norm) {
  EXPECT_DOUBLE_EQ(reference::beta_activation(true, 0.0), 0.5);
  EXPECT_NEAR(reference::beta_activation(true, 2.0), 1.0 / (1.0 + std::exp(-2.0)), 1e-16);
  EXPECT_DOUBLE_EQ(reference::beta_activation(true, -800.0), 0.0);
  EXPECT_DOUBLE_EQ(reference::beta_activation(true, 800.0), 1.0);
  EXPECT_DOUBLE_EQ(reference::beta_activation(false, 0.3), 0.3);
  double x[2] = {3.0, 4.0};
  reference::l2_normalize(x, 2);
  EXPECT_DOUBLE_EQ(x[0], 3.0 / std::sqrt(25.0 + 1e-6));
  EXPECT_DOUBLE_EQ(x[1], 4.0 / std::sqrt(25.0 + 1e-6));
  double z[3] = {0.0, 0.0, 0.0};
  reference::l2_normalize(z, 3);  // the epsilon keeps zeros finite
  for (double e : z) EXPECT_EQ(e, 0.0);
}

TEST(ReferenceBf16, Conversions) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xc040), -3.0f);
  // ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  uint32_t snan_bits = 0x7f800001u;  // a NaN whose payload sits in the dropped bits
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(snan))));
  // every bf16 value round-trips
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), h);
  }
}

// ------------------------------------------------------------------------------------------------
// prefill_reference

// A self-contained problem: contiguous buffers, fixed-length [B, T] or varlen (B = 1), with fp32
// initial state h0 ~ 0.1 N(0, 1) and a poisoned final state ht.
struct Problem : test_util::TokenProblem<Problem> {
  std::vector<float> h0, ht;

  size_t state_numel() const { return static_cast<size_t>(N * H * D * D); }

  void fill(uint32_t seed) {
    std::mt19937 rng(seed);
    fill_tokens(rng);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    h0.resize(state_numel());
    for (auto& x : h0) x = nd(rng);
    poison();
  }
  void poison() {
    out.assign(static_cast<size_t>(B * T * H * D), kPoisonBf16);
    ht.assign(state_numel(), std::nanf(""));
  }

  PrefillParams params(bool with_h0 = true, bool with_ht = true) {
    PrefillParams p;
    set_tokens(&p);
    if (with_h0) p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {N, H, D, D});
    if (with_ht) p.final_state = make_tensor_ref(ht.data(), DType::kFloat32, {N, H, D, D});
    return p;
  }
};

void run_ok(const PrefillParams& p, int64_t chunk = 0) {
  Status s = reference::prefill_reference(p, chunk);
  ASSERT_TRUE(s.ok()) << s.message;
}

void expect_all_written(const std::vector<uint16_t>& out) {
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_FALSE(std::isnan(bf16_to_float(out[i]))) << "out[" << i << "]";
}

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// An independent straightforward implementation for a fixed-length problem (bounded gate, all
// flags on), written directly on the flat buffers.
void naive_prefill(const Problem& pr, float lower_bound, std::vector<double>* out, std::vector<double>* ht) {
  const int64_t B = pr.B, T = pr.T, H = pr.H, D = pr.D;
  out->assign(static_cast<size_t>(B * T * H * D), 0.0);
  ht->assign(pr.state_numel(), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> S(D * D);
      for (int64_t i = 0; i < D * D; ++i) S[i] = pr.h0[(b * H + h) * D * D + i];
      for (int64_t t = 0; t < T; ++t) {
        const int64_t base = ((b * T + t) * H + h) * D;
        std::vector<double> qv(D), kv(D), vv(D), dec(D);
        double qn = 0, kn = 0;
        for (int64_t i = 0; i < D; ++i) {
          qv[i] = bf16_to_float(pr.q[base + i]);
          kv[i] = bf16_to_float(pr.k[base + i]);
          vv[i] = bf16_to_float(pr.v[base + i]);
          qn += qv[i] * qv[i];
          kn += kv[i] * kv[i];
          const double x = std::exp(static_cast<double>(pr.A_log[h])) *
                           (bf16_to_float(pr.g[base + i]) + static_cast<double>(pr.dt_bias[h * D + i]));
          dec[i] = std::exp(lower_bound * sigmoid_d(x));
        }
        for (int64_t i = 0; i < D; ++i) {
          qv[i] /= std::sqrt(qn + 1e-6);
          kv[i] /= std::sqrt(kn + 1e-6);
        }
        const double bt = sigmoid_d(bf16_to_float(pr.beta[(b * T + t) * H + h]));
        for (int64_t r = 0; r < D; ++r)
          for (int64_t c = 0; c < D; ++c) S[r * D + c] *= dec[c];
        for (int64_t r = 0; r < D; ++r) {
          double sk = 0;
          for (int64_t c = 0; c < D; ++c) sk += S[r * D + c] * kv[c];
          const double u = vv[r] - sk;
          for (int64_t c = 0; c < D; ++c) S[r * D + c] += bt * u * kv[c];
        }
        for (int64_t r = 0; r < D; ++r) {
          double o = 0;
          for (int64_t c = 0; c < D; ++c) o += S[r * D + c] * qv[c];
          (*out)[base + r] = o / std::sqrt(static_cast<double>(D));
        }
      }
      for (int64_t i = 0; i < D * D; ++i) (*ht)[(b * H + h) * D * D + i] = S[i];
    }
  }
}

TEST(PrefillReference, MatchesNaiveImplementation) {
  Problem pr = Problem::fixed(2, 13, 3, 64, 500);
  PrefillParams p = pr.params();
  p.lower_bound = -4.5f;
  run_ok(p);
  expect_all_written(pr.out);
  std::vector<double> o_ref, ht_ref;
  naive_prefill(pr, -4.5f, &o_ref, &ht_ref);
  const std::vector<double> o = bf16_to_doubles(pr.out);
  for (size_t i = 0; i < o.size(); ++i) {
    ASSERT_NEAR(o[i], o_ref[i], std::ldexp(std::fabs(o_ref[i]), -8) + 1e-30) << i;  // bf16 rounding only
  }
  std::vector<double> ht(pr.ht.begin(), pr.ht.end());
  EXPECT_LE(rel_err(ht, ht_ref), 1e-6);
}

TEST(PrefillReference, RunOnCpuTensorsIsTheReference) {
  Problem pr = Problem::varlen_of({9, 0, 4}, 2, 64, 510);
  run_ok(pr.params());
  const std::vector<uint16_t> out1 = pr.out;
  const std::vector<float> ht1 = pr.ht;
  pr.poison();
  Status s = run(pr.params(), nullptr, 0);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(pr.out, out1);
  EXPECT_EQ(0, std::memcmp(pr.ht.data(), ht1.data(), ht1.size() * 4));
}

// Parameters of sequence n of a varlen problem, laid out as its own fixed-length [1, len] problem
// (reading the varlen buffers in place), writing to separate out / state buffers.
PrefillParams single_sequence(Problem& pr, int64_t n, std::vector<uint16_t>* out, std::vector<float>* ht) {
  const int64_t H = pr.H, D = pr.D, bos = pr.bos(n), L = pr.len(n);
  out->assign(static_cast<size_t>(L * H * D), kPoisonBf16);
  ht->assign(static_cast<size_t>(H * D * D), std::nanf(""));
  PrefillParams p;
  p.q = make_tensor_ref(pr.q.data() + bos * H * D, DType::kBFloat16, {1, L, H, D});
  p.k = make_tensor_ref(pr.k.data() + bos * H * D, DType::kBFloat16, {1, L, H, D});
  p.v = make_tensor_ref(pr.v.data() + bos * H * D, DType::kBFloat16, {1, L, H, D});
  p.g = make_tensor_ref(pr.g.data() + bos * H * D, DType::kBFloat16, {1, L, H, D});
  p.beta = make_tensor_ref(pr.beta.data() + bos * H, DType::kBFloat16, {1, L, H});
  p.A_log = make_tensor_ref(pr.A_log.data(), DType::kFloat32, {H});
  p.dt_bias = make_tensor_ref(pr.dt_bias.data(), DType::kFloat32, {H * D});  // the flat form
  p.out = make_tensor_ref(out->data(), DType::kBFloat16, {1, L, H, D});
  p.initial_state = make_tensor_ref(pr.h0.data() + n * H * D * D, DType::kFloat32, {1, H, D, D});
  p.final_state = make_tensor_ref(ht->data(), DType::kFloat32, {1, H, D, D});
  return p;
}

TEST(PrefillReference, VarlenEqualsEachSequenceAlone) {
  Problem pr = Problem::varlen_of({5, 0, 1, 17, 0, 33, 1}, 2, 64, 600);
  run_ok(pr.params());
  expect_all_written(pr.out);
  const int64_t H = pr.H, D = pr.D;
  for (int64_t n = 0; n < pr.N; ++n) {
    std::vector<uint16_t> out;
    std::vector<float> ht;
    run_ok(single_sequence(pr, n, &out, &ht));
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], pr.out[pr.bos(n) * H * D + i]) << "seq " << n;
    for (size_t i = 0; i < ht.size(); ++i) ASSERT_EQ(ht[i], pr.ht[n * H * D * D + i]) << "seq " << n;
    if (pr.len(n) == 0) {  // an empty sequence's final state is its initial state
      for (size_t i = 0; i < ht.size(); ++i) ASSERT_EQ(ht[i], pr.h0[n * H * D * D + i]);
    }
  }
}

TEST(PrefillReference, FixedBatchEqualsVarlen) {
  Problem fx = Problem::fixed(3, 20, 2, 64, 610);
  Problem vl = Problem::varlen_of({20, 20, 20}, 2, 64, 610);  // the same random buffers
  ASSERT_EQ(fx.q, vl.q);
  ASSERT_EQ(fx.h0, vl.h0);
  run_ok(fx.params());
  run_ok(vl.params());
  EXPECT_EQ(fx.out, vl.out);
  EXPECT_EQ(0, std::memcmp(fx.ht.data(), vl.ht.data(), fx.ht.size() * 4));
}

TEST(PrefillReference, ZeroLengthProblemsStillWriteFinalState) {
  {
    Problem pr = Problem::fixed(2, 0, 2, 64, 620);  // T == 0: final = initial
    run_ok(pr.params());
    EXPECT_EQ(0, std::memcmp(pr.ht.data(), pr.h0.data(), pr.h0.size() * 4));
    pr.poison();
    run_ok(pr.params(/*with_h0=*/false));  // no initial state: zeros
    for (float x : pr.ht) ASSERT_EQ(x, 0.0f);
  }
  {
    Problem pr = Problem::varlen_of({0, 0}, 1, 64, 621);
    run_ok(pr.params());
    EXPECT_EQ(0, std::memcmp(pr.ht.data(), pr.h0.data(), pr.h0.size() * 4));
  }
  {
    Problem pr = Problem::varlen_of({}, 1, 64, 622);  // N == 0, cu_seqlens == [0]
    run_ok(pr.params());
  }
  {
    Problem pr = Problem::fixed(0, 5, 1, 64, 623);  // B == 0
    run_ok(pr.params());
  }
}

TEST(PrefillReference, InPlaceStateAliasing) {
  Problem pr = Problem::varlen_of({12, 0, 7, 30}, 2, 64, 700);
  run_ok(pr.params());
  const std::vector<uint16_t> out_ref = pr.out;
  std::vector<float> state = pr.h0;
  pr.poison();
  PrefillParams p = pr.params();
  p.initial_state.data = state.data();
  p.final_state.data = state.data();
  run_ok(p);
  EXPECT_EQ(pr.out, out_ref);
  pr.poison();
  run_ok(pr.params());  // recompute ht (poison() cleared it)
  EXPECT_EQ(0, std::memcmp(state.data(), pr.ht.data(), state.size() * 4));
}

TEST(PrefillReference, Bf16State) {
  Problem pr = Problem::varlen_of({9, 1, 0, 40}, 2, 64, 710);
  std::vector<uint16_t> h0_b(pr.h0.size()), ht_b(pr.h0.size(), kPoisonBf16);
  for (size_t i = 0; i < pr.h0.size(); ++i) {
    h0_b[i] = float_to_bf16(pr.h0[i]);
    pr.h0[i] = bf16_to_float(h0_b[i]);  // the fp32 run starts from the same values
  }
  run_ok(pr.params());
  const std::vector<uint16_t> out_f = pr.out;
  pr.out.assign(pr.out.size(), kPoisonBf16);
  PrefillParams p = pr.params();
  p.initial_state = make_tensor_ref(h0_b.data(), DType::kBFloat16, {pr.N, pr.H, pr.D, pr.D});
  p.final_state = make_tensor_ref(ht_b.data(), DType::kBFloat16, {pr.N, pr.H, pr.D, pr.D});
  run_ok(p);
  EXPECT_EQ(pr.out, out_f);
  size_t exact = 0;
  for (size_t i = 0; i < ht_b.size(); ++i) {
    const float f = pr.ht[i], b = bf16_to_float(ht_b[i]);
    ASSERT_LE(std::fabs(b - f), std::ldexp(std::fabs(f), -8)) << i;  // one rounding to bf16
    exact += ht_b[i] == float_to_bf16(f);
  }
  EXPECT_GE(exact, ht_b.size() * 99 / 100);
  // bf16 in place
  std::vector<uint16_t> pool = h0_b;
  p.initial_state.data = pool.data();
  p.final_state.data = pool.data();
  run_ok(p);
  EXPECT_EQ(pool, ht_b);
}

TEST(PrefillReference, StatePoolIndicesAndPadding) {
  Problem pr = Problem::fixed(3, 11, 2, 64, 800);
  const int64_t H = pr.H, D = pr.D, row = H * D * D, P = 5;
  std::mt19937 rng(801);
  std::vector<float> pool = random_uniform(static_cast<size_t>(P * row), rng, -0.2f, 0.2f);
  const std::vector<float> pool0 = pool;
  const int64_t idx[3] = {3, -1, 0};

  // Baseline without a pool: the initial states are the pool rows.
  for (int64_t n = 0; n < 3; ++n) {
    const int64_t src = idx[n] >= 0 ? idx[n] : 1;
    std::copy(pool.begin() + src * row, pool.begin() + (src + 1) * row, pr.h0.begin() + n * row);
  }
  run_ok(pr.params());
  const std::vector<uint16_t> out_ref = pr.out;
  const std::vector<float> ht_ref = pr.ht;

  for (DType idx_type : {DType::kInt64, DType::kInt32}) {
    std::vector<int64_t> i64(idx, idx + 3);
    std::vector<int32_t> i32(idx, idx + 3);
    pool = pool0;
    pr.poison();
    PrefillParams p = pr.params();
    p.initial_state = make_tensor_ref(pool.data(), DType::kFloat32, {P, H, D, D});
    p.final_state = p.initial_state;  // in place
    p.state_indices = make_tensor_ref(idx_type == DType::kInt64 ? static_cast<void*>(i64.data()) : i32.data(),
                                      idx_type, {3});
    run_ok(p);
    const int64_t tok = pr.T * H * D;  // one batch row of out
    for (int64_t n = 0; n < 3; ++n) {
      for (int64_t i = 0; i < tok; ++i) {
        if (idx[n] < 0) {
          ASSERT_EQ(pr.out[n * tok + i], 0) << "padded sequence must give zeros";
        } else {
          ASSERT_EQ(pr.out[n * tok + i], out_ref[n * tok + i]);
        }
      }
    }
    for (int64_t r : {1, 2, 4})  // untouched rows, including the padded sequence's would-be row
      EXPECT_EQ(0, std::memcmp(&pool[r * row], &pool0[r * row], row * 4)) << "row " << r;
    EXPECT_EQ(0, std::memcmp(&pool[3 * row], &ht_ref[0 * row], row * 4));
    EXPECT_EQ(0, std::memcmp(&pool[0 * row], &ht_ref[2 * row], row * 4));
  }

  // Out of place: a separate output pool keeps its other rows.
  pool = pool0;
  std::vector<float> pool_out(pool.size(), -7.0f);
  std::vector<int64_t> i64(idx, idx + 3);
  pr.poison();
  PrefillParams p = pr.params();
  p.initial_state = make_tensor_ref(pool.data(), DType::kFloat32, {P, H, D, D});
  p.final_state = make_tensor_ref(pool_out.data(), DType::kFloat32, {P, H, D, D});
  p.state_indices = make_tensor_ref(i64.data(), DType::kInt64, {3});
  run_ok(p);
  EXPECT_EQ(pool, pool0);
  for (int64_t r : {1, 2, 4})
    for (int64_t i = 0; i < row; ++i) ASSERT_EQ(pool_out[r * row + i], -7.0f);
  EXPECT_EQ(0, std::memcmp(&pool_out[3 * row], &ht_ref[0], row * 4));

  // Only a final_state pool (no initial state): zero start, still written to the chosen rows.
  pool_out.assign(pool.size(), -7.0f);
  p.initial_state = TensorRef();
  run_ok(p);
  for (int64_t i = 0; i < row; ++i) ASSERT_EQ(pool_out[1 * row + i], -7.0f);
  for (int64_t i = 0; i < row; ++i) ASSERT_TRUE(std::isfinite(pool_out[0 * row + i]));
}

TEST(PrefillReference, HasInitialStateFalseMeansZeroState) {
  Problem pr = Problem::varlen_of({10, 6, 0, 21}, 2, 64, 900);
  bool has[4] = {true, false, false, true};
  PrefillParams p = pr.params();
  p.has_initial_state = make_tensor_ref(has, DType::kBool, {4});
  run_ok(p);
  const std::vector<uint16_t> out1 = pr.out;
  const std::vector<float> ht1 = pr.ht;

  const int64_t row = pr.H * pr.D * pr.D;
  std::fill(pr.h0.begin() + 1 * row, pr.h0.begin() + 3 * row, 0.0f);
  pr.poison();
  run_ok(pr.params());
  EXPECT_EQ(pr.out, out1);
  EXPECT_EQ(0, std::memcmp(pr.ht.data(), ht1.data(), ht1.size() * 4));
  for (int64_t i = 0; i < row; ++i) ASSERT_EQ(ht1[2 * row + i], 0.0f);  // empty, no initial state
}

TEST(PrefillReference, RowStridedInputsMatchContiguous) {
  Problem pr = Problem::fixed(2, 9, 2, 64, 1000);
  run_ok(pr.params());
  const std::vector<uint16_t> out_ref = pr.out;
  const std::vector<float> ht_ref = pr.ht;

  // One fused projection buffer per token: [q | k | pad | v | g | beta | pad].
  const int64_t B = pr.B, T = pr.T, H = pr.H, D = pr.D, HD = H * D;
  const int64_t oq = 0, ok = HD, ov = 2 * HD + 5, og = 3 * HD + 5, ob = 4 * HD + 5;
  const int64_t ts = 4 * HD + H + 8, bs = T * ts + 11;
  std::vector<uint16_t> fused(static_cast<size_t>(B * bs), float_to_bf16(1e30f));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      uint16_t* dst = &fused[b * bs + t * ts];
      const int64_t src = (b * T + t) * HD;
      std::copy(&pr.q[src], &pr.q[src] + HD, dst + oq);
      std::copy(&pr.k[src], &pr.k[src] + HD, dst + ok);
      std::copy(&pr.v[src], &pr.v[src] + HD, dst + ov);
      std::copy(&pr.g[src], &pr.g[src] + HD, dst + og);
      std::copy(&pr.beta[(b * T + t) * H], &pr.beta[(b * T + t) * H] + H, dst + ob);
    }
  const int64_t ots = HD + 16, obs = T * ots + 7;
  std::vector<uint16_t> out(static_cast<size_t>(B * obs), kPoisonBf16);
  std::vector<float> ht(pr.ht.size(), std::nanf(""));

  PrefillParams p = pr.params();
  p.q = make_strided_tensor_ref(fused.data() + oq, DType::kBFloat16, {B, T, H, D}, {bs, ts, D, 1});
  p.k = make_strided_tensor_ref(fused.data() + ok, DType::kBFloat16, {B, T, H, D}, {bs, ts, D, 1});
  p.v = make_strided_tensor_ref(fused.data() + ov, DType::kBFloat16, {B, T, H, D}, {bs, ts, D, 1});
  p.g = make_strided_tensor_ref(fused.data() + og, DType::kBFloat16, {B, T, H, D}, {bs, ts, D, 1});
  p.beta = make_strided_tensor_ref(fused.data() + ob, DType::kBFloat16, {B, T, H}, {bs, ts, 1});
  p.out = make_strided_tensor_ref(out.data(), DType::kBFloat16, {B, T, H, D}, {obs, ots, D, 1});
  p.final_state = make_tensor_ref(ht.data(), DType::kFloat32, {pr.N, H, D, D});
  run_ok(p);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < HD; ++i) ASSERT_EQ(out[b * obs + t * ots + i], out_ref[(b * T + t) * HD + i]);
  // the padding between rows of out is left alone
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = HD; i < ots && b * obs + t * ots + i < static_cast<int64_t>(out.size()); ++i)
        ASSERT_EQ(out[b * obs + t * ots + i], kPoisonBf16);
  EXPECT_EQ(0, std::memcmp(ht.data(), ht_ref.data(), ht.size() * 4));
}

TEST(PrefillReference, ChunkedPathMatchesRecurrentPath) {
  Problem pr = Problem::varlen_of({100, 0, 1, 65, 17}, 2, 128, 1100);
  run_ok(pr.params(), 0);
  const std::vector<double> out_ref = bf16_to_doubles(pr.out);
  const std::vector<double> ht_ref(pr.ht.begin(), pr.ht.end());
  for (int64_t C : {16, 64}) {
    pr.poison();
    run_ok(pr.params(), C);
    expect_all_written(pr.out);
    const std::vector<double> out = bf16_to_doubles(pr.out);
    size_t same = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], out_ref[i], 1e-2) << "C=" << C << " i=" << i;
      same += out[i] == out_ref[i];
    }
    EXPECT_GE(same, out.size() * 99 / 100);
    EXPECT_LE(rel_err(std::vector<double>(pr.ht.begin(), pr.ht.end()), ht_ref), 1e-6);
  }
}

TEST(PrefillReference, PrecomputedGateAndActivatedBetaMatchFusedPreprocessing) {
  Problem pr = Problem::varlen_of({23, 5, 0, 40}, 2, 64, 1200);
  PrefillParams p = pr.params();
  p.lower_bound = -3.0f;
  run_ok(p);
  const std::vector<double> out_ref = bf16_to_doubles(pr.out);
  const std::vector<double> ht_ref(pr.ht.begin(), pr.ht.end());

  const int64_t H = pr.H, D = pr.D;
  std::vector<float> a(pr.g.size()), b(pr.beta.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t h = static_cast<int64_t>(i / D) % H, c = static_cast<int64_t>(i % D);
    a[i] = static_cast<float>(reference::gate_log_decay(GateMode::kBounded, bf16_to_float(pr.g[i]),
                                                        pr.A_log[h], pr.dt_bias[h * D + c], -3.0));
  }
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<float>(reference::beta_activation(true, bf16_to_float(pr.beta[i])));
  pr.poison();
  p = pr.params();
  p.gate_mode = GateMode::kPrecomputed;
  p.A_log = TensorRef();
  p.dt_bias = TensorRef();
  p.use_beta_sigmoid = false;
  p.g = make_tensor_ref(a.data(), DType::kFloat32, {1, pr.T, H, D});
  p.beta = make_tensor_ref(b.data(), DType::kFloat32, {1, pr.T, H});
  run_ok(p);
  const std::vector<double> out = bf16_to_doubles(pr.out);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], out_ref[i], 1e-2) << i;
  EXPECT_LE(rel_err(std::vector<double>(pr.ht.begin(), pr.ht.end()), ht_ref), 1e-5);
}

TEST(PrefillReference, SoftplusGateAndNoL2NormRunFinite) {
  Problem pr = Problem::fixed(2, 30, 2, 64, 1300);
  PrefillParams p = pr.params();
  p.gate_mode = GateMode::kSoftplus;
  run_ok(p);
  expect_all_written(pr.out);
  for (float x : pr.ht) ASSERT_TRUE(std::isfinite(x));
  // Without l2norm the keys are scaled down so the recurrence stays contractive.
  for (auto& x : pr.k) x = float_to_bf16(bf16_to_float(x) * 0.05f);
  pr.poison();
  p = pr.params();
  p.use_qk_l2norm = false;
  run_ok(p);
  expect_all_written(pr.out);
}

TEST(PrefillReference, ExplicitScaleEqualsDefault) {
  Problem pr = Problem::fixed(1, 17, 2, 128, 1400);
  run_ok(pr.params());
  const std::vector<uint16_t> out_default = pr.out;
  pr.poison();
  PrefillParams p = pr.params();
  p.scale = static_cast<float>(1.0 / std::sqrt(128.0));  // == 2^-3.5 rounded to float
  run_ok(p);
  size_t same = 0;
  for (size_t i = 0; i < pr.out.size(); ++i) same += pr.out[i] == out_default[i];
  EXPECT_GE(same, pr.out.size() * 99 / 100);
  pr.poison();
  p.scale = 0.0f;  // 0: the default
  run_ok(p);
  EXPECT_EQ(pr.out, out_default);
  pr.poison();
  p.scale = 2.0f;  // scale enters linearly
  run_ok(p);
  const std::vector<double> o2 = bf16_to_doubles(pr.out), o1 = bf16_to_doubles(out_default);
  for (size_t i = 0; i < o1.size(); ++i)
    ASSERT_NEAR(o2[i], o1[i] * 2.0 * std::sqrt(128.0), std::fabs(o2[i]) * 1e-2 + 1e-20);
}

TEST(PrefillReference, RejectsInvalidArgumentsWithoutWriting) {
  Problem pr = Problem::fixed(1, 4, 1, 64, 1500);
  PrefillParams p = pr.params();
  p.lower_bound = 0.0f;
  Status s = reference::prefill_reference(p);
  EXPECT_EQ(s.code, Status::Code::kInvalidArgument);
  for (uint16_t x : pr.out) ASSERT_EQ(x, kPoisonBf16);
  for (float x : pr.ht) ASSERT_TRUE(std::isnan(x));
  p = pr.params();
  s = reference::prefill_reference(p, -1);
  EXPECT_EQ(s.code, Status::Code::kInvalidArgument);
  for (uint16_t x : pr.out) ASSERT_EQ(x, kPoisonBf16);
}

}  // namespace
}  // namespace flashkda
