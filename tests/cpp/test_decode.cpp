// Tests of the serving state paths on CPU: the recurrent decode / speculative decode of decode.h
// (reference against prefill_reference, which is itself tested against an independent
// implementation in test_reference.cpp), its validation (every rejected input names the argument and
// writes nothing), and the checkpoint states of prefill (spec section 5).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "kda_test_util.h"

namespace flashkda {
namespace {

using reference::bf16_to_float;
using reference::float_to_bf16;

constexpr uint16_t kOutSentinel = 0x1234;
constexpr float kPoolSentinel = -12345.0f;

using test_util::kPoisonBf16;
using test_util::random_bf16;
using test_util::rel_err;

// Token inputs of a decode / prefill problem (H = 2 heads unless a factory says otherwise).
struct Tokens : test_util::TokenProblem<Tokens> {
  Tokens() {
    H = 2;
    N = 0;
  }
  void fill(uint32_t seed) {
    std::mt19937 rng(seed);
    fill_tokens(rng);
  }
};

// A state pool [P, H, D, D] in fp32 or bf16.
struct Pool {
  int64_t P = 0, H = 0, D = 0;
  DType dtype = DType::kFloat32;
  std::vector<float> f32;
  std::vector<uint16_t> b16;

  Pool(int64_t P_, int64_t H_, int64_t D_, DType dt, uint32_t seed) : P(P_), H(H_), D(D_), dtype(dt) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    const size_t n = static_cast<size_t>(P * H * D * D);
    if (dtype == DType::kFloat32) {
      f32.resize(n);
      for (auto& x : f32) x = nd(rng);
    } else {
      b16.resize(n);
      for (auto& x : b16) x = float_to_bf16(nd(rng));
    }
  }
  size_t row_numel() const { return static_cast<size_t>(H * D * D); }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : b16.data(); }
  TensorRef ref() { return make_tensor_ref(data(), dtype, {P, H, D, D}); }
  double at(int64_t row, size_t i) const {
    const size_t off = static_cast<size_t>(row) * row_numel() + i;
    return dtype == DType::kFloat32 ? f32[off] : bf16_to_float(b16[off]);
  }
  std::vector<double> row_values(int64_t row) const {
    std::vector<double> r(row_numel());
    for (size_t i = 0; i < r.size(); ++i) r[i] = at(row, i);
    return r;
  }
  bool same_row(const Pool& o, int64_t row) const {
    const size_t n = row_numel(), off = static_cast<size_t>(row) * n;
    if (dtype == DType::kFloat32) return std::memcmp(&f32[off], &o.f32[off], n * 4) == 0;
    return std::memcmp(&b16[off], &o.b16[off], n * 2) == 0;
  }
  bool bitwise_equal(const Pool& o) const { return f32 == o.f32 && b16 == o.b16; }
};

void expect_ok(const Status& s) { ASSERT_TRUE(s.ok()) << s.message; }

// ---------------------------------------------------------------------------------------------
// Plain decode (1-D indices) is a prefill on the pool rows: the same arithmetic, bit for bit.

void check_one_dim_equals_prefill(Tokens tk, DType pool_dtype, const std::vector<int32_t>& slots, int64_t P,
                                  uint32_t seed) {
  Pool pool(P, tk.H, tk.D, pool_dtype, seed);
  Pool expect = pool;
  std::vector<int32_t> idx = slots;

  DecodeParams d;
  tk.set_tokens(&d);
  d.state_pool = pool.ref();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {tk.N});
  expect_ok(reference::decode_reference(d));
  const std::vector<uint16_t> out_decode = tk.out;

  tk.out.assign(tk.out.size(), kPoisonBf16);
  PrefillParams p;
  tk.set_tokens(&p);
  p.initial_state = expect.ref();
  p.final_state = p.initial_state;
  p.state_indices = make_tensor_ref(idx.data(), DType::kInt32, {tk.N});
  expect_ok(reference::prefill_reference(p));

  EXPECT_EQ(out_decode, tk.out);
  EXPECT_TRUE(pool.bitwise_equal(expect));
  for (size_t i = 0; i < out_decode.size(); ++i) ASSERT_NE(out_decode[i], kPoisonBf16) << i;
}

TEST(DecodeReference, PlainDecodeEqualsPrefillOnThePool) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    check_one_dim_equals_prefill(Tokens::fixed(4, 1, 2, 64, 11), dt, {5, 0, 3, 6}, 7, 12);
    check_one_dim_equals_prefill(Tokens::fixed(3, 1, 1, 128, 13), dt, {2, -1, 0}, 3, 14);  // padded row
    check_one_dim_equals_prefill(Tokens::fixed(2, 3, 2, 64, 15), dt, {1, 0}, 2, 16);       // T > 1
    check_one_dim_equals_prefill(Tokens::varlen_of({2, 0, 1, 3}, 2, 64, 17), dt, {4, 1, -3, 0}, 5, 18);
  }
}

TEST(DecodeReference, PaddedRequestZeroesOutputAndTouchesNoState) {
  Tokens tk = Tokens::fixed(3, 1, 2, 64, 21);
  Pool pool(4, 2, 64, DType::kFloat32, 22);
  const Pool before = pool;
  std::vector<int64_t> idx = {-1, 2, -7};
  DecodeParams d;
  tk.set_tokens(&d);
  d.state_pool = pool.ref();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt64, {3});
  expect_ok(run_decode(d, nullptr, 0));
  const size_t per_req = static_cast<size_t>(tk.H * tk.D);
  for (size_t i = 0; i < per_req; ++i) {
    ASSERT_EQ(tk.out[i], 0u);
    ASSERT_EQ(tk.out[2 * per_req + i], 0u);
    ASSERT_NE(tk.out[per_req + i], kPoisonBf16);
  }
  for (int64_t r : {0, 1, 3}) EXPECT_TRUE(pool.same_row(before, r)) << r;
  EXPECT_FALSE(pool.same_row(before, 2));
}

// ---------------------------------------------------------------------------------------------
// Speculative decode (2-D indices): the state after token t of request n must land in
// pool[idx[n, t]], equal to the checkpoint of a prefill started from the read slot.

struct SpecCase {
  Tokens tk;
  std::vector<int32_t> idx;  // [N, S]
  std::vector<int32_t> acc;  // [N]
  int64_t S = 0, P = 0;
};

void check_spec_against_prefill_checkpoints(SpecCase c, DType pool_dtype, uint32_t seed) {
  Tokens& tk = c.tk;
  const int64_t N = tk.N, H = tk.H, D = tk.D, S = c.S;
  Pool pool(c.P, H, D, pool_dtype, seed);
  const Pool before = pool;

  DecodeParams d;
  tk.set_tokens(&d);
  d.state_pool = pool.ref();
  d.ssm_state_indices = make_tensor_ref(c.idx.data(), DType::kInt32, {N, S});
  d.num_accepted_tokens = make_tensor_ref(c.acc.data(), DType::kInt32, {N});
  DecodeShape shape;
  expect_ok(can_implement_decode(d, &shape));
  EXPECT_TRUE(shape.spec);
  EXPECT_EQ(shape.slots, S);
  EXPECT_EQ(shape.P, c.P);
  expect_ok(reference::decode_reference(d));
  const std::vector<uint16_t> out_decode = tk.out;

  // Prefill from the read slots with a checkpoint after every token: offsets min(t + 1, len).
  const size_t row_n = static_cast<size_t>(H * D * D);
  std::vector<float> h0(static_cast<size_t>(N) * row_n, 0.0f);
  std::vector<uint8_t> has(static_cast<size_t>(N), 1);
  std::vector<int32_t> offsets(static_cast<size_t>(N * S));
  std::vector<int32_t> read(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    read[n] = c.idx[n * S + c.acc[n] - 1];
    if (read[n] >= 0) {
      for (size_t i = 0; i < row_n; ++i) h0[n * row_n + i] = static_cast<float>(before.at(read[n], i));
    }
    for (int64_t t = 0; t < S; ++t)
      offsets[n * S + t] = static_cast<int32_t>(std::min<int64_t>(t + 1, tk.len(n)));
  }
  std::vector<int32_t> slot_of(static_cast<size_t>(N));  // padded requests: negative index
  for (int64_t n = 0; n < N; ++n) slot_of[n] = read[n] >= 0 ? static_cast<int32_t>(n) : -1;
  std::vector<float> ckpt(static_cast<size_t>(N * S) * row_n, std::nanf(""));
  tk.out.assign(tk.out.size(), kPoisonBf16);
  PrefillParams p;
  tk.set_tokens(&p);
  p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {N, H, D, D});
  p.state_indices = make_tensor_ref(slot_of.data(), DType::kInt32, {N});
  p.checkpoint_offsets = make_tensor_ref(offsets.data(), DType::kInt32, {N, S});
  p.checkpoint_state = make_tensor_ref(ckpt.data(), DType::kFloat32, {N, S, H, D, D});
  expect_ok(reference::prefill_reference(p));
  EXPECT_EQ(out_decode, tk.out);  // the same start state (exact in fp32) and the same arithmetic
  for (size_t i = 0; i < out_decode.size(); ++i) ASSERT_NE(out_decode[i], kPoisonBf16) << i;

  std::vector<bool> written(static_cast<size_t>(c.P), false);
  for (int64_t n = 0; n < N; ++n) {
    if (read[n] < 0) continue;
    for (int64_t t = 0; t < tk.len(n); ++t) {
      const int32_t w = c.idx[n * S + t];
      if (w < 0) continue;
      written[w] = true;
      const std::vector<double> got = pool.row_values(w);
      std::vector<double> want(row_n);
      for (size_t i = 0; i < row_n; ++i) want[i] = ckpt[(n * S + t) * row_n + i];
      if (pool_dtype == DType::kFloat32) {
        for (size_t i = 0; i < row_n; ++i) ASSERT_EQ(got[i], want[i]) << "request " << n << " token " << t;
      } else {
        EXPECT_LE(rel_err(got, want), 4e-3) << "request " << n << " token " << t;
      }
    }
  }
  for (int64_t r = 0; r < c.P; ++r) {
    if (!written[r]) EXPECT_TRUE(pool.same_row(before, r)) << "pool row " << r << " was written";
  }
}

TEST(DecodeReference, SpecDecodeEveryAcceptanceCount) {
  const int64_t num_spec = 3, T = num_spec + 1, N = 4, H = 2, D = 64;
  uint32_t seed = 100;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (int32_t a0 = 1; a0 <= T; ++a0) {
      SpecCase c;
      c.tk = Tokens::fixed(N, T, H, D, seed++);
      c.S = T;
      c.P = N * T + 2;
      // request n owns pool rows [n*T, n*T + T) in a shuffled order; acceptance counts cycle
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t t = 0; t < T; ++t) c.idx.push_back(static_cast<int32_t>(n * T + (t * 3 + n) % T));
        c.acc.push_back(static_cast<int32_t>((a0 - 1 + n) % T + 1));
      }
      check_spec_against_prefill_checkpoints(c, dt, seed++);
    }
  }
}

TEST(DecodeReference, SpecDecodePaddingSkippedWritesAndVarlen) {
  uint32_t seed = 200;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    {  // fixed: padded request (negative read slot), skipped writes (negative write slots)
      SpecCase c;
      c.tk = Tokens::fixed(3, 3, 2, 64, seed++);
      c.S = 3;
      c.P = 9;
      c.idx = {0, 1, 2, /**/ -1, 4, 5, /**/ 6, -1, 8};
      c.acc = {2, 1, 3};  // request 1 reads idx[1, 0] = -1: padded (its rows 4, 5 stay untouched)
      check_spec_against_prefill_checkpoints(c, dt, seed++);
    }
    {  // varlen: token counts 3, 1, 0, 4 with S = 4 slots; read slots beyond the written columns
      SpecCase c;
      c.tk = Tokens::varlen_of({3, 1, 0, 4}, 2, 64, seed++);
      c.S = 4;
      c.P = 20;
      c.idx = {0, 1, 2, 3, /**/ 4, 5, 6, 7, /**/ 8, 9, 10, 11, /**/ 12, 13, -1, 15};
      c.acc = {4, 3, 2, 1};
      check_spec_against_prefill_checkpoints(c, dt, seed++);
    }
    {  // head dim 128
      SpecCase c;
      c.tk = Tokens::fixed(2, 2, 1, 128, seed++);
      c.S = 2;
      c.P = 4;
      c.idx = {3, 1, 0, 2};
      c.acc = {2, 1};
      check_spec_against_prefill_checkpoints(c, dt, seed++);
    }
  }
}

TEST(DecodeReference, SpecDecodeReadSlotAliasesAWriteSlot) {
  // acc = 2: the read slot idx[n, 1] is also token 1's write slot; the start state must be read
  // before token 0 and token 1 are written.  Compare with the same call reading a separate copy.
  Tokens tk = Tokens::fixed(1, 3, 2, 64, 300);
  Pool pool(6, 2, 64, DType::kFloat32, 301);
  Pool copy = pool;
  const size_t row_n = pool.row_numel();
  std::memcpy(&copy.f32[5 * row_n], &pool.f32[1 * row_n], row_n * 4);  // row 5 = row 1
  std::vector<int32_t> idx = {0, 1, 2}, idx_copy = {0, 5, 2}, acc = {2};
  DecodeParams d;
  tk.set_tokens(&d);
  d.state_pool = pool.ref();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {1, 3});
  d.num_accepted_tokens = make_tensor_ref(acc.data(), DType::kInt32, {1});
  expect_ok(reference::decode_reference(d));
  const std::vector<uint16_t> out1 = tk.out;
  d.state_pool = copy.ref();
  d.ssm_state_indices.data = idx_copy.data();
  expect_ok(reference::decode_reference(d));
  EXPECT_EQ(out1, tk.out);
  EXPECT_TRUE(pool.same_row(copy, 0));
  EXPECT_TRUE(pool.same_row(copy, 2));
  EXPECT_EQ(0, std::memcmp(&pool.f32[1 * row_n], &copy.f32[5 * row_n], row_n * 4));
}

TEST(DecodeReference, SpecDecodeChainsLikeOneLongSequence) {
  // Step 1 accepts 2 of 3 tokens; step 2 continues from that slot.  The pool state after step 2's
  // tokens equals a prefill of the accepted stream (2 tokens of step 1 + step 2's tokens).
  const int64_t H = 2, D = 64;
  Tokens s1 = Tokens::fixed(1, 3, H, D, 400), s2 = Tokens::fixed(1, 3, H, D, 401);
  s2.A_log = s1.A_log;  // one layer: the same gate parameters in both steps
  s2.dt_bias = s1.dt_bias;
  Pool pool(3, H, D, DType::kFloat32, 402);
  const Pool before = pool;
  std::vector<int32_t> idx = {0, 1, 2}, acc1 = {1}, acc2 = {2};
  DecodeParams d;
  s1.set_tokens(&d);
  d.state_pool = pool.ref();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {1, 3});
  d.num_accepted_tokens = make_tensor_ref(acc1.data(), DType::kInt32, {1});
  expect_ok(run_decode(d, nullptr, 0));
  s2.set_tokens(&d);
  d.num_accepted_tokens.data = acc2.data();  // 2 accepted: the state after step 1's token 1 (row 1)
  expect_ok(run_decode(d, nullptr, 0));

  Tokens all = Tokens::fixed(1, 5, H, D, 0);  // the accepted stream: s1[0:2] + s2[0:3]
  auto concat = [](std::vector<uint16_t>* dst, const std::vector<uint16_t>& a, size_t na,
                   const std::vector<uint16_t>& b) {
    dst->assign(a.begin(), a.begin() + static_cast<long>(na));
    dst->insert(dst->end(), b.begin(), b.end());
  };
  const size_t tok = static_cast<size_t>(H * D);
  concat(&all.q, s1.q, 2 * tok, s2.q);
  concat(&all.k, s1.k, 2 * tok, s2.k);
  concat(&all.v, s1.v, 2 * tok, s2.v);
  concat(&all.g, s1.g, 2 * tok, s2.g);
  concat(&all.beta, s1.beta, 2 * H, s2.beta);
  all.A_log = s1.A_log;
  all.dt_bias = s1.dt_bias;
  all.out.assign(5 * tok, kPoisonBf16);
  std::vector<float> h0(before.f32.begin(), before.f32.begin() + static_cast<long>(pool.row_numel()));
  std::vector<float> ht(h0.size());
  PrefillParams p;
  all.set_tokens(&p);
  p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {1, H, D, D});
  p.final_state = make_tensor_ref(ht.data(), DType::kFloat32, {1, H, D, D});
  expect_ok(reference::prefill_reference(p));
  // equal up to the fp32 rounding of the state between the two decode calls
  std::vector<double> want(ht.begin(), ht.end()), got = pool.row_values(2);
  EXPECT_LE(rel_err(got, want), 1e-6);
  std::vector<double> o_want(3 * tok), o_got(3 * tok);
  for (size_t i = 0; i < 3 * tok; ++i) {
    o_want[i] = bf16_to_float(all.out[2 * tok + i]);
    o_got[i] = bf16_to_float(s2.out[i]);
  }
  EXPECT_LE(rel_err(o_got, o_want), 1e-2);
}

TEST(DecodeReference, GateModesAndFlagsMatchPrefill) {
  uint32_t seed = 500;
  for (GateMode gm : {GateMode::kBounded, GateMode::kSoftplus, GateMode::kPrecomputed}) {
    for (bool flags : {true, false}) {
      Tokens tk = Tokens::fixed(2, 2, 2, 64, seed++);
      if (gm == GateMode::kPrecomputed) {
        for (auto& x : tk.g) x = float_to_bf16(-std::fabs(bf16_to_float(x)));
      }
      if (!flags) {  // unnormalised q/k are unstable: shrink them; beta already activated
        for (auto& x : tk.q) x = float_to_bf16(bf16_to_float(x) * 0.1f);
        for (auto& x : tk.k) x = float_to_bf16(bf16_to_float(x) * 0.1f);
        for (auto& x : tk.beta) x = float_to_bf16(std::fabs(bf16_to_float(x)) * 0.3f);
      }
      Pool pool(3, 2, 64, DType::kFloat32, seed++);
      Pool expect = pool;
      std::vector<int32_t> idx = {2, 0};
      DecodeParams d;
      tk.set_tokens(&d);
      d.gate_mode = gm;
      d.use_qk_l2norm = d.use_beta_sigmoid = flags;
      d.scale = flags ? 0.0f : 0.3f;
      d.lower_bound = -3.0f;
      d.state_pool = pool.ref();
      d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {2});
      expect_ok(reference::decode_reference(d));
      const std::vector<uint16_t> out1 = tk.out;
      PrefillParams p;
      tk.set_tokens(&p);
      p.gate_mode = gm;
      p.use_qk_l2norm = p.use_beta_sigmoid = flags;
      p.scale = d.scale;
      p.lower_bound = -3.0f;
      p.initial_state = expect.ref();
      p.final_state = p.initial_state;
      p.state_indices = make_tensor_ref(idx.data(), DType::kInt32, {2});
      expect_ok(reference::prefill_reference(p));
      EXPECT_EQ(out1, tk.out);
      EXPECT_TRUE(pool.bitwise_equal(expect));
    }
  }
}

TEST(DecodeReference, RunDecodeIsTheReferenceOnCpu) {
  Tokens tk = Tokens::fixed(2, 2, 2, 64, 600);
  Pool a(4, 2, 64, DType::kBFloat16, 601);
  Pool b = a;
  std::vector<int32_t> idx = {3, 1, 0, 2}, acc = {1, 2};
  DecodeParams d;
  tk.set_tokens(&d);
  d.state_pool = a.ref();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {2, 2});
  d.num_accepted_tokens = make_tensor_ref(acc.data(), DType::kInt32, {2});
  EXPECT_GE(workspace_size_decode(d), 0u);
  expect_ok(run_decode(d, nullptr, 0));
  const std::vector<uint16_t> out1 = tk.out;
  d.state_pool = b.ref();
  expect_ok(reference::decode_reference(d));
  EXPECT_EQ(out1, tk.out);
  EXPECT_TRUE(a.bitwise_equal(b));
}

// ---------------------------------------------------------------------------------------------
// Decode validation: every rejection names the argument and writes nothing.

class DecodeValidation : public ::testing::Test {
 protected:
  static constexpr int64_t N = 3, T = 2, H = 2, D = 64, P = 8;

  void SetUp() override {
    tk = Tokens::fixed(N, T, H, D, 700);
    tk.out.assign(tk.out.size(), kOutSentinel);
    pool.assign(static_cast<size_t>(P * H * D * D), kPoolSentinel);
    idx = {0, 1, 2, 3, 4, 5};
    acc = {1, 2, 1};
  }

  DecodeParams valid_spec() {
    DecodeParams d;
    tk.set_tokens(&d);
    d.state_pool = make_tensor_ref(pool.data(), DType::kFloat32, {P, H, D, D});
    d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N, T});
    d.num_accepted_tokens = make_tensor_ref(acc.data(), DType::kInt32, {N});
    return d;
  }
  // Varlen: token counts 1, 0, 2 (cu_seqlens {0, 1, 1, 3}) with S = T = 2 slots per request.
  DecodeParams valid_varlen_spec() {
    DecodeParams d = valid_spec();
    d.q = make_tensor_ref(tk.q.data(), DType::kBFloat16, {1, 3, H, D});
    d.k = make_tensor_ref(tk.k.data(), DType::kBFloat16, {1, 3, H, D});
    d.v = make_tensor_ref(tk.v.data(), DType::kBFloat16, {1, 3, H, D});
    d.g = make_tensor_ref(tk.g.data(), DType::kBFloat16, {1, 3, H, D});
    d.beta = make_tensor_ref(tk.beta.data(), DType::kBFloat16, {1, 3, H});
    d.out = make_tensor_ref(tk.out.data(), DType::kBFloat16, {1, 3, H, D});
    d.cu_seqlens = make_tensor_ref(cu, DType::kInt32, {4});
    return d;
  }
  DecodeParams valid_plain() {
    DecodeParams d = valid_spec();
    d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N});
    d.num_accepted_tokens = TensorRef();
    return d;
  }

  bool untouched() const {
    for (uint16_t x : tk.out)
      if (x != kOutSentinel) return false;
    for (float x : pool)
      if (x != kPoolSentinel) return false;
    return true;
  }

  void expect_rejected(const DecodeParams& d, Status::Code code, const std::string& arg) {
    DecodeShape shape;
    shape.N = -7;
    const Status s = can_implement_decode(d, &shape);
    EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(code)) << s.message;
    const std::string prefix = "flashkda: argument '" + arg + "': expected ";
    EXPECT_EQ(s.message.rfind(prefix, 0), 0u) << "message: " << s.message << "\nwanted prefix: " << prefix;
    EXPECT_NE(s.message.find(", got "), std::string::npos) << s.message;
    EXPECT_EQ(shape.N, -7);
    const Status r = reference::decode_reference(d);
    EXPECT_EQ(r.message, s.message);
    const Status rr = run_decode(d, nullptr, 0);
    EXPECT_EQ(rr.message, s.message);
    EXPECT_TRUE(untouched()) << "an output was written on error";
  }
  void expect_invalid(const DecodeParams& d, const std::string& arg) {
    expect_rejected(d, Status::Code::kInvalidArgument, arg);
  }

  Tokens tk;
  std::vector<float> pool;
  std::vector<int32_t> idx, acc;
  int32_t cu[4] = {0, 1, 1, 3};
};

TEST_F(DecodeValidation, ValidInputsPass) {
  DecodeShape s;
  expect_ok(can_implement_decode(valid_spec(), &s));
  EXPECT_EQ(s.N, N);
  EXPECT_EQ(s.T, T);
  EXPECT_EQ(s.P, P);
  EXPECT_EQ(s.slots, T);
  EXPECT_TRUE(s.spec);
  EXPECT_FALSE(s.varlen);
  expect_ok(can_implement_decode(valid_plain(), &s));
  EXPECT_FALSE(s.spec);
  EXPECT_EQ(s.slots, 1);
  // negative write slots (even repeated), padded rows whose write slots repeat others
  idx = {0, -1, 2, -1, -5, 2};
  acc = {1, 1, 1};  // request 2 reads idx[2, 0] = -5: padded, so its slot 2 is never written
  expect_ok(can_implement_decode(valid_spec()));
  // varlen: request 0 (1 token) reads column 1, which it does not write; request 1 (no tokens) and
  // request 0 both read row 7, which nobody writes
  idx = {6, 7, 7, 3, 4, 5};
  acc = {2, 1, 1};
  expect_ok(can_implement_decode(valid_varlen_spec(), &s));
  EXPECT_TRUE(s.varlen);
  EXPECT_EQ(s.N, 3);
  EXPECT_EQ(s.T, 3);
  EXPECT_TRUE(untouched());
}

TEST_F(DecodeValidation, IndexOutOfRange) {
  idx[3] = P;
  expect_invalid(valid_spec(), "ssm_state_indices");
  EXPECT_EQ(
      can_implement_decode(valid_spec()).message,
      "flashkda: argument 'ssm_state_indices': expected values < P = 8 (pool rows; negative values mean "
      "padding), got ssm_state_indices[1, 1] = 8");
  idx[3] = 3;
  idx[1] = 100;
  expect_invalid(valid_plain(), "ssm_state_indices");
}

TEST_F(DecodeValidation, DuplicateWriteSlots) {
  idx = {0, 1, 2, 1, 4, 5};  // rows 0 and 1 both write pool row 1
  expect_invalid(valid_spec(), "ssm_state_indices");
  EXPECT_EQ(
      can_implement_decode(valid_spec()).message,
      "flashkda: argument 'ssm_state_indices': expected distinct non-negative write slots (each pool row "
      "written at most once per call), got ssm_state_indices[1, 1] = ssm_state_indices[0, 1] = 1");
  idx = {0, 0, 2, 3, 4, 5};  // within one row
  expect_invalid(valid_spec(), "ssm_state_indices");
  idx = {4, 1, 4, 3, 5, 6};  // 1-D: requests 0 and 2 share row 4
  expect_invalid(valid_plain(), "ssm_state_indices");
}

TEST_F(DecodeValidation, RowReadByOneRequestWrittenByAnother) {
  // varlen: request 0 (1 token) reads idx[0, 1] = 5 without writing it; request 2 writes row 5
  idx = {0, 5, 2, 3, 4, 5};
  acc = {2, 1, 1};
  expect_invalid(valid_varlen_spec(), "ssm_state_indices");
  EXPECT_EQ(can_implement_decode(valid_varlen_spec()).message,
            "flashkda: argument 'ssm_state_indices': expected no pool row read by one request and written by "
            "another (request 0 reads row 5), got row 5 written by request 2 (ssm_state_indices[2, 1])");
  // fixed layout: a request's read slot is one of its own write slots, so a cross read is also a
  // duplicate write
  idx = {0, 1, 2, 3, 4, 1};
  acc = {1, 1, 2};
  expect_invalid(valid_spec(), "ssm_state_indices");
}

TEST_F(DecodeValidation, NumAcceptedTokens) {
  acc[1] = 0;
  expect_invalid(valid_spec(), "num_accepted_tokens");
  acc[1] = T + 1;
  expect_invalid(valid_spec(), "num_accepted_tokens");
  EXPECT_EQ(
      can_implement_decode(valid_spec()).message,
      "flashkda: argument 'num_accepted_tokens': expected values in [1, 2] (1 + accepted drafts; S = slots "
      "per request), got num_accepted_tokens[1] = 3");
  acc[1] = 1;
  DecodeParams d = valid_spec();
  d.num_accepted_tokens = TensorRef();
  expect_invalid(d, "num_accepted_tokens");
  d = valid_plain();
  d.num_accepted_tokens = make_tensor_ref(acc.data(), DType::kInt32, {N});
  expect_invalid(d, "num_accepted_tokens");
  d = valid_spec();
  d.num_accepted_tokens.dtype = DType::kFloat32;
  expect_invalid(d, "num_accepted_tokens");
  d = valid_spec();
  d.num_accepted_tokens = make_tensor_ref(acc.data(), DType::kInt32, {N - 1});
  expect_invalid(d, "num_accepted_tokens");
}

TEST_F(DecodeValidation, IndexTensorShapesAndDtypes) {
  DecodeParams d = valid_spec();
  d.ssm_state_indices.dtype = DType::kFloat32;
  expect_invalid(d, "ssm_state_indices");
  d = valid_spec();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N, T, 1});
  expect_invalid(d, "ssm_state_indices");
  d = valid_spec();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N - 1, T + 1});  // S != T (fixed)
  expect_invalid(d, "ssm_state_indices");
  d = valid_plain();
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N + 1});
  expect_invalid(d, "ssm_state_indices");
  d = valid_spec();
  d.ssm_state_indices = make_strided_tensor_ref(idx.data(), DType::kInt32, {N, T}, {1, N});
  expect_invalid(d, "ssm_state_indices");
  d = valid_spec();
  d.ssm_state_indices = TensorRef();
  expect_invalid(d, "ssm_state_indices");
}

TEST_F(DecodeValidation, StatePool) {
  DecodeParams d = valid_spec();
  d.state_pool = TensorRef();
  expect_invalid(d, "state_pool");
  d = valid_spec();
  d.state_pool.dtype = DType::kFloat16;
  expect_invalid(d, "state_pool");
  d = valid_spec();
  d.state_pool = make_tensor_ref(pool.data(), DType::kFloat32, {P, H + 1, D, D / 2});
  expect_invalid(d, "state_pool");
  d = valid_spec();
  d.state_pool = make_tensor_ref(pool.data(), DType::kFloat32, {P * H, D, D});
  expect_invalid(d, "state_pool");
  d = valid_spec();
  d.state_pool = make_strided_tensor_ref(pool.data(), DType::kFloat32, {P, H, D, D},
                                         {H * D * D, D * D, 1, D});  // K-first: transposed
  expect_invalid(d, "state_pool");
  d = valid_spec();
  d.state_pool.device = DeviceType::kCUDA;
  expect_invalid(d, "state_pool");
  EXPECT_EQ(can_implement_decode(d).message,
            "flashkda: argument 'state_pool': expected device cpu:0 (that of q), got cuda:0");
}

TEST_F(DecodeValidation, OutSharingMemoryWithThePool) {
  DecodeParams d = valid_spec();
  d.out = make_tensor_ref(reinterpret_cast<uint16_t*>(pool.data()) + 8, DType::kBFloat16, {N, T, H, D});
  expect_invalid(d, "out");
  EXPECT_EQ(
      can_implement_decode(d).message,
      "flashkda: argument 'out': expected no memory shared with state_pool, got an overlap with state_pool");
}

TEST_F(DecodeValidation, OutSharingMemoryWithAnInput) {
  // A request's state rows are split over blocks that each read its whole q / k / g rows while the
  // others write their slices of out: out may not overlap them (K == V here, so out = q fits).
  DecodeParams d = valid_spec();
  d.out = d.q;
  d.out.data = tk.q.data();
  expect_invalid(d, "out");
  EXPECT_NE(can_implement_decode(d).message.find("got an overlap with q"), std::string::npos)
      << can_implement_decode(d).message;
  // v is read per row slice by the block that writes the same slice of out: out may be v.
  d = valid_spec();
  d.out = d.v;
  EXPECT_TRUE(can_implement_decode(d).ok()) << can_implement_decode(d).message;
}

TEST_F(DecodeValidation, SpecWithoutTokensNeedsWriteSlots) {
  // Fixed layout, T = 0 tokens, 2-D indices [N, 0]: no slot to read from, reported as the index
  // shape (not as an impossible accepted-count range).
  DecodeParams d = valid_spec();
  d.q = make_tensor_ref(tk.q.data(), DType::kBFloat16, {N, 0, H, D});
  d.k = make_tensor_ref(tk.k.data(), DType::kBFloat16, {N, 0, H, D});
  d.v = make_tensor_ref(tk.v.data(), DType::kBFloat16, {N, 0, H, D});
  d.g = make_tensor_ref(tk.g.data(), DType::kBFloat16, {N, 0, H, D});
  d.beta = make_tensor_ref(tk.beta.data(), DType::kBFloat16, {N, 0, H});
  d.out = make_tensor_ref(tk.out.data(), DType::kBFloat16, {N, 0, H, D});
  d.ssm_state_indices = make_tensor_ref(idx.data(), DType::kInt32, {N, 0});
  expect_invalid(d, "ssm_state_indices");
  EXPECT_NE(can_implement_decode(d).message.find("T >= 1"), std::string::npos)
      << can_implement_decode(d).message;
}

TEST_F(DecodeValidation, VarlenTokenCountAboveSlots) {
  cu[1] = cu[2] = cu[3] = 3;  // request 0 has 3 tokens but only S = 2 write slots
  expect_invalid(valid_varlen_spec(), "ssm_state_indices");
  cu[3] = 2;  // decreasing
  expect_invalid(valid_varlen_spec(), "cu_seqlens");
  cu[1] = 1;
  cu[2] = cu[3] = 2;  // ends below T = 3
  expect_invalid(valid_varlen_spec(), "cu_seqlens");
}

TEST_F(DecodeValidation, TokenInputsAreCheckedLikePrefill) {
  DecodeParams d = valid_spec();
  d.q.dtype = DType::kFloat32;
  expect_invalid(d, "q");
  d = valid_spec();
  d.v = make_tensor_ref(tk.v.data(), DType::kBFloat16, {N, T + 1, H, D});
  expect_invalid(d, "v");
  d = valid_spec();
  d.A_log = TensorRef();
  expect_invalid(d, "A_log");
  d = valid_spec();
  d.lower_bound = 0.5f;
  expect_invalid(d, "lower_bound");
  d = valid_spec();
  d.out.dtype = DType::kFloat32;
  expect_invalid(d, "out");
  std::vector<uint16_t> wide(static_cast<size_t>(N * T * H * 96), 0);
  d = valid_spec();
  d.q = d.k = d.v = d.g = d.out = make_tensor_ref(wide.data(), DType::kBFloat16, {N, T, H, 96});
  expect_rejected(d, Status::Code::kNotImplemented, "q");
}

TEST_F(DecodeValidation, CudaTensorsNeedAWorkspace) {
  // CUDA tensors go to the sm90 decode kernel (no host check of the index values); without a usable
  // GPU in this build / machine they are refused.  Either way nothing is launched here: the
  // workspace is missing, and the pointers are host memory.
  for (bool spec : {true, false}) {
    DecodeParams d = spec ? valid_spec() : valid_plain();
    idx[3] = 100;  // out of range: for CUDA tensors the kernel's job (kBadStateIndex)
    for (TensorRef* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.A_log, &d.dt_bias, &d.out, &d.state_pool,
                         &d.ssm_state_indices, &d.num_accepted_tokens}) {
      if (t->defined()) t->device = DeviceType::kCUDA;
    }
    const Status s = run_decode(d, nullptr, 0);
    if (built_with_cuda() && cuda_device_supported(0).ok()) {
      EXPECT_TRUE(can_implement_decode(d).ok()) << can_implement_decode(d).message;
      EXPECT_EQ(s.code, Status::Code::kInvalidArgument) << s.message;
      EXPECT_EQ(s.message,
                "flashkda: argument 'workspace': expected at least 4096 bytes of device memory "
                "(workspace_size_decode), got 0 (null pointer)");
    } else {
      EXPECT_FALSE(s.ok());  // no usable GPU in this build / machine
      EXPECT_NE(s.code, Status::Code::kNotImplemented) << s.message;
    }
    idx[3] = 3;
    EXPECT_TRUE(untouched());
  }
  DecodeParams d;
  EXPECT_EQ(workspace_size_decode(d), 4096u);
}

// ---------------------------------------------------------------------------------------------
// Prefill checkpoint states (spec section 5)

struct CkptProblem {
  Tokens tk;
  std::vector<float> h0, ht, ckpt;
  std::vector<int32_t> offsets;
  int64_t n_ckpt = 0;

  CkptProblem(Tokens t, std::vector<int32_t> offs, int64_t nc, uint32_t seed)
      : tk(std::move(t)), offsets(std::move(offs)), n_ckpt(nc) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    h0.resize(static_cast<size_t>(tk.N * row()));
    for (auto& x : h0) x = nd(rng);
    ht.assign(h0.size(), std::nanf(""));
    ckpt.assign(static_cast<size_t>(tk.N * n_ckpt * row()), std::nanf(""));
  }
  int64_t row() const { return tk.H * tk.D * tk.D; }
  PrefillParams params() {
    PrefillParams p;
    tk.set_tokens(&p);
    p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {tk.N, tk.H, tk.D, tk.D});
    p.final_state = make_tensor_ref(ht.data(), DType::kFloat32, {tk.N, tk.H, tk.D, tk.D});
    p.checkpoint_offsets = make_tensor_ref(offsets.data(), DType::kInt32, {tk.N, n_ckpt});
    p.checkpoint_state = make_tensor_ref(ckpt.data(), DType::kFloat32, {tk.N, n_ckpt, tk.H, tk.D, tk.D});
    return p;
  }
  // The final state of sequence n's first `len` tokens run alone (from its initial state).
  std::vector<float> prefix_state(int64_t n, int64_t len, int64_t chunk = 0) {
    const int64_t H = tk.H, D = tk.D, bos = tk.bos(n), r = tk.row(n);
    const size_t tok0 = static_cast<size_t>((r * tk.T + bos) * H);
    std::vector<uint16_t> out(static_cast<size_t>(len * H * D));
    std::vector<float> fs(static_cast<size_t>(row()));
    PrefillParams p;
    p.q = make_tensor_ref(tk.q.data() + tok0 * D, DType::kBFloat16, {1, len, H, D});
    p.k = make_tensor_ref(tk.k.data() + tok0 * D, DType::kBFloat16, {1, len, H, D});
    p.v = make_tensor_ref(tk.v.data() + tok0 * D, DType::kBFloat16, {1, len, H, D});
    p.g = make_tensor_ref(tk.g.data() + tok0 * D, DType::kBFloat16, {1, len, H, D});
    p.beta = make_tensor_ref(tk.beta.data() + tok0, DType::kBFloat16, {1, len, H});
    p.A_log = make_tensor_ref(tk.A_log.data(), DType::kFloat32, {H});
    p.dt_bias = make_tensor_ref(tk.dt_bias.data(), DType::kFloat32, {H, D});
    p.out = make_tensor_ref(out.data(), DType::kBFloat16, {1, len, H, D});
    p.initial_state = make_tensor_ref(h0.data() + n * row(), DType::kFloat32, {1, H, D, D});
    p.final_state = make_tensor_ref(fs.data(), DType::kFloat32, {1, H, D, D});
    Status s = reference::prefill_reference(p, chunk);
    EXPECT_TRUE(s.ok()) << s.message;
    return fs;
  }
  const float* ckpt_at(int64_t n, int64_t j) const {
    return &ckpt[static_cast<size_t>((n * n_ckpt + j) * row())];
  }
};

TEST(PrefillCheckpoints, EqualTheFinalStateOfThePrefixAlone) {
  // varlen with an empty sequence; offsets 0 (the initial state), interior, repeated, and the length
  CkptProblem c(Tokens::varlen_of({7, 0, 12, 1}, 2, 64, 800),
                {0, 3, 7, /**/ 0, 0, 0, /**/ 5, 5, 11, /**/ 1, 1, 1}, 3, 801);
  Status s = reference::prefill_reference(c.params());
  ASSERT_TRUE(s.ok()) << s.message;
  ProblemShape sh;
  ASSERT_TRUE(can_implement(c.params(), &sh).ok());
  EXPECT_EQ(sh.num_checkpoints, 3);
  for (int64_t n = 0; n < c.tk.N; ++n) {
    for (int64_t j = 0; j < c.n_ckpt; ++j) {
      const std::vector<float> want = c.prefix_state(n, c.offsets[n * 3 + j]);
      ASSERT_EQ(0, std::memcmp(c.ckpt_at(n, j), want.data(), want.size() * 4)) << "n=" << n << " j=" << j;
    }
    // the last checkpoint of sequences 0, 1 and 3 is at the end: the final state itself
    if (n != 2) EXPECT_EQ(0, std::memcmp(c.ckpt_at(n, 2), &c.ht[n * c.row()], c.row() * 4));
  }
  // outputs and final states are those of a call without checkpoints
  std::vector<uint16_t> out1 = c.tk.out;
  std::vector<float> ht1 = c.ht;
  PrefillParams p = c.params();
  p.checkpoint_offsets = TensorRef();
  p.checkpoint_state = TensorRef();
  c.tk.out.assign(c.tk.out.size(), kPoisonBf16);
  ASSERT_TRUE(reference::prefill_reference(p).ok());
  EXPECT_EQ(out1, c.tk.out);
  EXPECT_EQ(0, std::memcmp(ht1.data(), c.ht.data(), ht1.size() * 4));
}

TEST(PrefillCheckpoints, FixedLengthChunkedAndNoCheckpointColumns) {
  CkptProblem c(Tokens::fixed(2, 70, 1, 64, 810), {1, 64, 65, /**/ 0, 33, 70}, 3, 811);
  ASSERT_TRUE(reference::prefill_reference(c.params(), 16).ok());
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t j = 0; j < 3; ++j) {
      const std::vector<float> want = c.prefix_state(n, c.offsets[n * 3 + j]);
      std::vector<double> a(want.begin(), want.end()), b(c.ckpt_at(n, j), c.ckpt_at(n, j) + want.size());
      EXPECT_LE(rel_err(b, a), 1e-6) << n << " " << j;  // the chunked form: equal up to rounding
    }
  }
  CkptProblem z(Tokens::fixed(2, 5, 1, 64, 812), {}, 0, 813);  // n_ckpt = 0 is valid and writes nothing
  Status s = reference::prefill_reference(z.params());
  EXPECT_TRUE(s.ok()) << s.message;
}

TEST(PrefillCheckpoints, StatePoolPaddingAndHasInitialState) {
  Tokens tk = Tokens::varlen_of({4, 3, 5}, 2, 64, 820);
  Pool pool(5, 2, 64, DType::kFloat32, 821);
  const Pool before = pool;
  std::vector<int32_t> si = {3, -1, 0}, offsets = {0, 2, /**/ 1, 3, /**/ 0, 5};
  bool has[3] = {true, true, false};
  const int64_t row = 2 * 64 * 64;
  std::vector<float> ckpt(static_cast<size_t>(3 * 2 * row), kPoolSentinel);
  PrefillParams p;
  tk.set_tokens(&p);
  p.initial_state = pool.ref();
  p.final_state = p.initial_state;
  p.state_indices = make_tensor_ref(si.data(), DType::kInt32, {3});
  p.has_initial_state = make_tensor_ref(has, DType::kBool, {3});
  p.checkpoint_offsets = make_tensor_ref(offsets.data(), DType::kInt32, {3, 2});
  p.checkpoint_state = make_tensor_ref(ckpt.data(), DType::kFloat32, {3, 2, 2, 64, 64});
  expect_ok(reference::prefill_reference(p));
  // sequence 0 starts from pool row 3: checkpoint (0, 0) is that row
  EXPECT_EQ(0, std::memcmp(&ckpt[0], &before.f32[3 * row], row * 4));
  // padded sequence 1: rows untouched
  for (int64_t i = 2 * row; i < 4 * row; ++i) ASSERT_EQ(ckpt[i], kPoolSentinel);
  // sequence 2 starts from zeros (has_initial_state False); its last checkpoint is its final state
  for (int64_t i = 4 * row; i < 5 * row; ++i) ASSERT_EQ(ckpt[i], 0.0f);
  EXPECT_EQ(0, std::memcmp(&ckpt[5 * row], &pool.f32[0], row * 4));
}

class CheckpointValidation : public ::testing::Test {
 protected:
  CheckpointValidation() : c(Tokens::varlen_of({4, 6}, 2, 64, 830), {0, 4, /**/ 2, 6}, 2, 831) {}
  void SetUp() override {
    c.tk.out.assign(c.tk.out.size(), kOutSentinel);
    c.ht.assign(c.ht.size(), kPoolSentinel);
    c.ckpt.assign(c.ckpt.size(), kPoolSentinel);
  }
  bool untouched() const {
    for (uint16_t x : c.tk.out)
      if (x != kOutSentinel) return false;
    for (float x : c.ht)
      if (x != kPoolSentinel) return false;
    for (float x : c.ckpt)
      if (x != kPoolSentinel) return false;
    return true;
  }
  void expect_invalid(const PrefillParams& p, const std::string& arg) {
    const Status s = can_implement(p);
    EXPECT_EQ(s.code, Status::Code::kInvalidArgument) << s.message;
    const std::string prefix = "flashkda: argument '" + arg + "': expected ";
    EXPECT_EQ(s.message.rfind(prefix, 0), 0u) << s.message;
    EXPECT_NE(s.message.find(", got "), std::string::npos) << s.message;
    EXPECT_EQ(reference::prefill_reference(p).message, s.message);
    char ws[512];
    EXPECT_EQ(run(p, ws, sizeof(ws)).message, s.message);
    EXPECT_TRUE(untouched());
  }
  CkptProblem c;
};

TEST_F(CheckpointValidation, ValidPasses) { expect_ok(can_implement(c.params())); }

TEST_F(CheckpointValidation, OffsetValues) {
  c.offsets = {0, 5, 2, 6};  // 5 > length 4 of sequence 0
  expect_invalid(c.params(), "checkpoint_offsets");
  EXPECT_EQ(
      can_implement(c.params()).message,
      "flashkda: argument 'checkpoint_offsets': expected values in [checkpoint_offsets[0, 0], length of "
      "sequence 0 = 4] (non-decreasing token offsets in each row), got checkpoint_offsets[0, 1] = 5");
  c.offsets = {0, 4, 3, 2};  // decreasing
  expect_invalid(c.params(), "checkpoint_offsets");
  c.offsets = {-1, 4, 2, 6};  // negative
  expect_invalid(c.params(), "checkpoint_offsets");
}

TEST_F(CheckpointValidation, ShapesDtypesAndPairs) {
  PrefillParams p = c.params();
  p.checkpoint_offsets.dtype = DType::kFloat32;
  expect_invalid(p, "checkpoint_offsets");
  p = c.params();
  p.checkpoint_offsets = make_tensor_ref(c.offsets.data(), DType::kInt32, {1, 4});
  expect_invalid(p, "checkpoint_offsets");
  p = c.params();
  p.checkpoint_offsets = make_tensor_ref(c.offsets.data(), DType::kInt32, {4});
  expect_invalid(p, "checkpoint_offsets");
  p = c.params();
  p.checkpoint_state.dtype = DType::kBFloat16;
  expect_invalid(p, "checkpoint_state");
  p = c.params();
  p.checkpoint_state = make_tensor_ref(c.ckpt.data(), DType::kFloat32, {2, 1, 2, 64, 64});
  expect_invalid(p, "checkpoint_state");
  p = c.params();
  p.checkpoint_state = make_tensor_ref(c.ckpt.data(), DType::kFloat32, {2, 2, 2 * 64, 64});
  expect_invalid(p, "checkpoint_state");
  p = c.params();
  p.checkpoint_state = TensorRef();
  expect_invalid(p, "checkpoint_state");
  p = c.params();
  p.checkpoint_offsets = TensorRef();
  expect_invalid(p, "checkpoint_offsets");
  p = c.params();
  p.checkpoint_state = make_tensor_ref(c.ht.data(), DType::kFloat32, {2, 1, 2, 64, 64});  // = final_state
  p.checkpoint_offsets = make_tensor_ref(c.offsets.data(), DType::kInt32, {2, 1});
  expect_invalid(p, "checkpoint_state");
  p = c.params();
  p.checkpoint_state.device = DeviceType::kCUDA;
  expect_invalid(p, "checkpoint_state");
}

TEST_F(CheckpointValidation, OutApartFromCheckpointsAndInputs) {
  // out over checkpoint_state's buffer, and (checkpoints read the inputs after out and the states are
  // written) out or final_state over k.
  PrefillParams p = c.params();
  p.out.data = c.ckpt.data();
  expect_invalid(p, "out");
  p = c.params();
  p.out.data = p.k.data;
  expect_invalid(p, "out");
  EXPECT_EQ(
      can_implement(p).message,
      "flashkda: argument 'out': expected no memory shared with k (checkpoints read the inputs after it is "
      "written), got an overlap with k");
  p = c.params();
  p.k.data = c.ht.data();  // k read from inside final_state's buffer (k is far smaller than a state)
  expect_invalid(p, "final_state");
  // Without checkpoints, out may share memory with the inputs (they are read before it is written).
  p = c.params();
  p.out.data = p.k.data;
  p.checkpoint_offsets = TensorRef();
  p.checkpoint_state = TensorRef();
  EXPECT_TRUE(can_implement(p).ok()) << can_implement(p).message;
}

TEST_F(CheckpointValidation, CudaOffsetValuesAreLeftToTheKernel) {
  c.offsets = {0, 5, 2, 6};  // 5 > length 4: on the host an error, on the device the kernel's job
  PrefillParams p = c.params();
  for (TensorRef* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.A_log, &p.dt_bias, &p.out, &p.initial_state,
                       &p.final_state, &p.cu_seqlens, &p.checkpoint_offsets, &p.checkpoint_state}) {
    t->device = DeviceType::kCUDA;
  }
  const Status s = can_implement(p);
  if (built_with_cuda() && cuda_device_supported(0).ok()) {
    EXPECT_TRUE(s.ok()) << s.message;  // (kBadCheckpointOffset on the device; not run: host pointers)
  } else {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.code, Status::Code::kNotImplemented) << s.message;
    char ws[512];
    EXPECT_FALSE(run(p, ws, sizeof(ws)).ok());
  }
  EXPECT_TRUE(untouched());
}

}  // namespace
}  // namespace flashkda
