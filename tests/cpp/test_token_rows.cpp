// Tests of token_rows (PrefillParams and DecodeParams, CPU reference): logical token t of a varlen
// call reads its inputs from, and writes its output to, row token_rows[t] of dim 1 of the token
// tensors; rows no token maps to are neither read nor written.  Checked against the same call on
// the gathered (unmapped) inputs, bit for bit: the map must change where tokens live, nothing else.
// Rejected maps name 'token_rows' and write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "kda_test_util.h"

namespace flashkda {
namespace {

using test_util::kPoisonBf16;

constexpr uint16_t kOutSentinel = 0x1234;  // unmapped output rows must keep it
constexpr float kStateSentinel = -12345.0f;

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

std::vector<float> random_states(int64_t rows, int64_t H, int64_t D, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  std::vector<float> s(static_cast<size_t>(rows * H * D * D));
  for (auto& x : s) x = nd(rng);
  return s;
}

// A random injective map of T logical tokens onto R >= T rows.
std::vector<int64_t> scattered_map(int64_t T, int64_t R, uint32_t seed) {
  std::vector<int64_t> rows(static_cast<size_t>(R));
  std::iota(rows.begin(), rows.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(static_cast<size_t>(T));
  return rows;
}

// The logical tokens of a varlen `tk` placed at rows map[t] of [1, R, H, D] buffers.  The rows no
// token maps to hold NaN inputs (reading one would poison an output) and a sentinel output.
struct Mapped {
  int64_t R = 0, H = 0, D = 0;
  std::vector<uint16_t> q, k, v, g, beta, out;
  std::vector<int64_t> rows64;
  std::vector<int32_t> rows32;

  Mapped(const Tokens& tk, const std::vector<int64_t>& map, int64_t R_)
      : R(R_), H(tk.H), D(tk.D), rows64(map) {
    const size_t row = static_cast<size_t>(H * D);
    for (auto* b : {&q, &k, &v, &g}) b->assign(static_cast<size_t>(R) * row, kPoisonBf16);
    beta.assign(static_cast<size_t>(R * H), kPoisonBf16);
    out.assign(static_cast<size_t>(R) * row, kOutSentinel);
    for (size_t t = 0; t < map.size(); ++t) {
      const size_t dst = static_cast<size_t>(map[t]);
      std::copy_n(&tk.q[t * row], row, &q[dst * row]);
      std::copy_n(&tk.k[t * row], row, &k[dst * row]);
      std::copy_n(&tk.v[t * row], row, &v[dst * row]);
      std::copy_n(&tk.g[t * row], row, &g[dst * row]);
      std::copy_n(&tk.beta[t * H], H, &beta[dst * H]);
      rows32.push_back(static_cast<int32_t>(map[t]));
    }
  }
  // The token tensors, gate parameters and cu_seqlens (from tk), and the map as token_rows.
  template <class Params>
  void set(Params* p, Tokens& tk, DType map_dtype = DType::kInt64) {
    p->q = make_tensor_ref(q.data(), DType::kBFloat16, {1, R, H, D});
    p->k = make_tensor_ref(k.data(), DType::kBFloat16, {1, R, H, D});
    p->v = make_tensor_ref(v.data(), DType::kBFloat16, {1, R, H, D});
    p->g = make_tensor_ref(g.data(), DType::kBFloat16, {1, R, H, D});
    p->beta = make_tensor_ref(beta.data(), DType::kBFloat16, {1, R, H});
    p->A_log = make_tensor_ref(tk.A_log.data(), DType::kFloat32, {H});
    p->dt_bias = make_tensor_ref(tk.dt_bias.data(), DType::kFloat32, {H, D});
    p->out = make_tensor_ref(out.data(), DType::kBFloat16, {1, R, H, D});
    p->cu_seqlens = make_tensor_ref(tk.cu.data(), DType::kInt32, {tk.N + 1});
    const int64_t T = static_cast<int64_t>(rows64.size());
    p->token_rows = map_dtype == DType::kInt32 ? make_tensor_ref(rows32.data(), DType::kInt32, {T})
                                               : make_tensor_ref(rows64.data(), DType::kInt64, {T});
  }
  // Output row map[t] equals row t of the gathered output; every other row kept the sentinel.
  void expect_scattered(const std::vector<uint16_t>& gathered_out) const {
    const size_t row = static_cast<size_t>(H * D);
    std::vector<bool> mapped(static_cast<size_t>(R), false);
    for (size_t t = 0; t < rows64.size(); ++t) {
      const size_t r = static_cast<size_t>(rows64[t]);
      mapped[r] = true;
      for (size_t i = 0; i < row; ++i) {
        ASSERT_EQ(out[r * row + i], gathered_out[t * row + i])
            << "token " << t << " (row " << r << ") i=" << i;
        ASSERT_NE(out[r * row + i], kOutSentinel) << "token " << t << " was not written";
      }
    }
    for (size_t r = 0; r < mapped.size(); ++r) {
      if (mapped[r]) continue;
      for (size_t i = 0; i < row; ++i) ASSERT_EQ(out[r * row + i], kOutSentinel) << "unmapped row " << r;
    }
  }
};

void expect_ok(const Status& s) { ASSERT_TRUE(s.ok()) << s.message; }

// ---------------------------------------------------------------------------------------------
// Prefill

// A prefill on a state pool (padding, has_initial_state, checkpoints), gathered and mapped.
struct PrefillCase {
  Tokens tk;
  int64_t P = 6;
  std::vector<int32_t> slots;
  std::vector<uint8_t> has;
  std::vector<int32_t> offsets;  // [N, 2]
};

void check_prefill_map(PrefillCase c, const std::vector<int64_t>& map, int64_t R, DType map_dtype) {
  Tokens& tk = c.tk;
  const int64_t N = tk.N, H = tk.H, D = tk.D;
  const std::vector<float> pool0 = random_states(c.P, H, D, 7);
  std::vector<float> pool_a = pool0, pool_b = pool0;
  std::vector<float> ck_a(static_cast<size_t>(N * 2 * H * D * D), kStateSentinel), ck_b = ck_a;
  auto common = [&](PrefillParams* p, std::vector<float>* pool, std::vector<float>* ck) {
    p->initial_state = make_tensor_ref(pool->data(), DType::kFloat32, {c.P, H, D, D});
    p->final_state = p->initial_state;
    p->state_indices = make_tensor_ref(c.slots.data(), DType::kInt32, {N});
    p->has_initial_state = make_tensor_ref(c.has.data(), DType::kBool, {N});
    p->checkpoint_offsets = make_tensor_ref(c.offsets.data(), DType::kInt32, {N, 2});
    p->checkpoint_state = make_tensor_ref(ck->data(), DType::kFloat32, {N, 2, H, D, D});
  };

  PrefillParams a;  // gathered: logical token t is row t
  tk.set_tokens(&a);
  common(&a, &pool_a, &ck_a);
  expect_ok(reference::prefill_reference(a));

  Mapped m(tk, map, R);
  PrefillParams b;
  m.set(&b, tk, map_dtype);
  common(&b, &pool_b, &ck_b);
  ProblemShape sh;
  expect_ok(can_implement(b, &sh));
  EXPECT_EQ(sh.T, static_cast<int64_t>(map.size()));
  EXPECT_EQ(sh.rows, R);
  EXPECT_EQ(sh.total_tokens, static_cast<int64_t>(map.size()));
  expect_ok(reference::prefill_reference(b));
  m.expect_scattered(tk.out);
  EXPECT_EQ(pool_a, pool_b);
  EXPECT_EQ(0, std::memcmp(ck_a.data(), ck_b.data(), ck_a.size() * 4));
  // run() on CPU tensors is the same reference
  std::vector<float> pool_c = pool0, ck_c(ck_a.size(), kStateSentinel);
  Mapped m2(tk, map, R);
  PrefillParams cp;
  m2.set(&cp, tk, map_dtype);
  common(&cp, &pool_c, &ck_c);
  expect_ok(run(cp, nullptr, 0));
  EXPECT_EQ(m.out, m2.out);
  EXPECT_EQ(pool_a, pool_c);
}

PrefillCase prefill_case(uint32_t seed) {
  PrefillCase c;
  c.tk = Tokens::varlen_of({5, 0, 3, 1, 4}, 2, 64, seed);
  c.slots = {4, 1, -1, 0, 2};  // sequence 2 is padding: its rows are zeroed
  c.has = {1, 0, 1, 1, 0};
  c.offsets = {2, 5, /**/ 0, 0, /**/ 1, 3, /**/ 0, 1, /**/ 4, 4};
  return c;
}

TEST(TokenRows, PrefillIdentityMapEqualsNoMap) {
  PrefillCase c = prefill_case(100);
  std::vector<int64_t> identity(static_cast<size_t>(c.tk.T));
  std::iota(identity.begin(), identity.end(), 0);
  for (DType dt : {DType::kInt32, DType::kInt64}) check_prefill_map(c, identity, c.tk.T, dt);
}

TEST(TokenRows, PrefillScatteredMapEqualsGatherRunScatter) {
  PrefillCase c = prefill_case(101);
  const int64_t T = c.tk.T;
  for (uint32_t seed : {1u, 2u, 3u}) {
    check_prefill_map(c, scattered_map(T, T + 9, seed), T + 9, seed % 2 ? DType::kInt32 : DType::kInt64);
  }
  // reversed order on exactly T rows, and a map that leaves the first rows alone
  std::vector<int64_t> rev(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) rev[t] = T - 1 - t;
  check_prefill_map(c, rev, T, DType::kInt64);
  std::vector<int64_t> tail(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) tail[t] = 5 + t;
  check_prefill_map(c, tail, T + 5, DType::kInt32);
}

TEST(TokenRows, PrefillChunkedPathAndNoTokens) {
  // the chunked core (chunk_size > 0) honours the map too
  Tokens tk = Tokens::varlen_of({40, 7}, 1, 64, 102);
  std::vector<float> h0 = random_states(2, 1, 64, 103), fa(h0.size(), kStateSentinel), fb = fa;
  PrefillParams a;
  tk.set_tokens(&a);
  a.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {2, 1, 64, 64});
  a.final_state = make_tensor_ref(fa.data(), DType::kFloat32, {2, 1, 64, 64});
  expect_ok(reference::prefill_reference(a, 16));
  const std::vector<int64_t> map = scattered_map(tk.T, 60, 104);
  Mapped m(tk, map, 60);
  PrefillParams b;
  m.set(&b, tk);
  b.initial_state = a.initial_state;
  b.final_state = make_tensor_ref(fb.data(), DType::kFloat32, {2, 1, 64, 64});
  expect_ok(reference::prefill_reference(b, 16));
  m.expect_scattered(tk.out);
  EXPECT_EQ(fa, fb);

  // no logical tokens at all (T = 0, R = 4): nothing read or written but the final states
  Tokens z = Tokens::varlen_of({0, 0}, 1, 64, 105);
  Mapped mz(z, {}, 4);
  PrefillParams pz;
  mz.set(&pz, z);
  std::vector<float> fz(h0.size(), kStateSentinel);
  pz.initial_state = a.initial_state;
  pz.final_state = make_tensor_ref(fz.data(), DType::kFloat32, {2, 1, 64, 64});
  expect_ok(reference::prefill_reference(pz));
  mz.expect_scattered({});
  EXPECT_EQ(fz, h0);
}

TEST(TokenRows, WorkspaceIsSizedForTheLogicalTokens) {
  PrefillCase c = prefill_case(106);
  const int64_t R = 1000;  // many more rows than the 13 logical tokens
  Mapped m(c.tk, scattered_map(c.tk.T, R, 9), R);
  PrefillParams p;
  m.set(&p, c.tk);
  ASSERT_TRUE(can_implement(p).ok()) << can_implement(p).message;
  EXPECT_EQ(workspace_size(p), workspace_size(c.tk.T, c.tk.H, c.tk.N, c.tk.D));
  EXPECT_LT(workspace_size(p), workspace_size(R, c.tk.H, c.tk.N, c.tk.D));
}

// ---------------------------------------------------------------------------------------------
// Decode

struct DecodeCase {
  Tokens tk;
  int64_t P = 0, S = 0;  // S = 0: 1-D indices
  std::vector<int32_t> idx, acc;
};

void check_decode_map(DecodeCase c, const std::vector<int64_t>& map, int64_t R, DType map_dtype) {
  Tokens& tk = c.tk;
  const int64_t N = tk.N, H = tk.H, D = tk.D;
  const std::vector<float> pool0 = random_states(c.P, H, D, 8);
  std::vector<float> pool_a = pool0, pool_b = pool0;
  auto common = [&](DecodeParams* d, std::vector<float>* pool) {
    d->state_pool = make_tensor_ref(pool->data(), DType::kFloat32, {c.P, H, D, D});
    if (c.S > 0) {
      d->ssm_state_indices = make_tensor_ref(c.idx.data(), DType::kInt32, {N, c.S});
      d->num_accepted_tokens = make_tensor_ref(c.acc.data(), DType::kInt32, {N});
    } else {
      d->ssm_state_indices = make_tensor_ref(c.idx.data(), DType::kInt32, {N});
    }
  };
  DecodeParams a;
  tk.set_tokens(&a);
  common(&a, &pool_a);
  expect_ok(reference::decode_reference(a));

  Mapped m(tk, map, R);
  DecodeParams b;
  m.set(&b, tk, map_dtype);
  common(&b, &pool_b);
  DecodeShape sh;
  expect_ok(can_implement_decode(b, &sh));
  EXPECT_EQ(sh.T, static_cast<int64_t>(map.size()));
  EXPECT_EQ(sh.rows, R);
  expect_ok(run_decode(b, nullptr, 0));
  m.expect_scattered(tk.out);
  EXPECT_EQ(pool_a, pool_b);
}

TEST(TokenRows, DecodeIdentityMapEqualsNoMap) {
  DecodeCase c{Tokens::varlen_of({1, 1, 1, 1}, 2, 64, 200), 6, 0, {5, 0, -1, 3}, {}};
  std::vector<int64_t> identity = {0, 1, 2, 3};
  for (DType dt : {DType::kInt32, DType::kInt64}) check_decode_map(c, identity, 4, dt);
}

TEST(TokenRows, DecodeScatteredMapEqualsGatherRunScatter) {
  // plain decode, one token per request (the padded request's row is zeroed)
  DecodeCase plain{Tokens::varlen_of({1, 1, 1, 1}, 2, 64, 201), 6, 0, {5, 0, -1, 3}, {}};
  check_decode_map(plain, {7, 2, 9, 0}, 10, DType::kInt64);
  check_decode_map(plain, {3, 2, 1, 0}, 4, DType::kInt32);
  // plain decode with several tokens per request
  DecodeCase multi{Tokens::varlen_of({2, 0, 3, 1}, 2, 64, 202), 5, 0, {4, 1, 0, -1}, {}};
  check_decode_map(multi, scattered_map(6, 11, 4), 11, DType::kInt32);
  // speculative decode (2-D indices): padding, a skipped write, a read slot the request does not write
  DecodeCase spec{Tokens::varlen_of({2, 0, 3, 1}, 2, 64, 203),
                  14,
                  3,
                  {0, 1, 2, /**/ 3, 4, 5, /**/ 6, 7, 8, /**/ 9, -1, 11},
                  {3, 2, 1, 1}};
  check_decode_map(spec, scattered_map(6, 6, 5), 6, DType::kInt64);
  check_decode_map(spec, scattered_map(6, 20, 6), 20, DType::kInt32);
}

// ---------------------------------------------------------------------------------------------
// Validation: every rejection names 'token_rows' (or cu_seqlens for a count mismatch) and writes
// nothing, for prefill and decode alike.

class TokenRowsValidation : public ::testing::Test {
 protected:
  static constexpr int64_t R = 12;

  TokenRowsValidation() : tk(Tokens::varlen_of({3, 0, 2}, 2, 64, 300)), m(tk, {7, 0, 11, 4, 2}, R) {}
  void SetUp() override {
    pool.assign(static_cast<size_t>(4 * tk.H * tk.D * tk.D), kStateSentinel);
    fs.assign(static_cast<size_t>(tk.N * tk.H * tk.D * tk.D), kStateSentinel);
  }
  PrefillParams prefill() {
    PrefillParams p;
    m.set(&p, tk);
    p.final_state = make_tensor_ref(fs.data(), DType::kFloat32, {tk.N, tk.H, tk.D, tk.D});
    return p;
  }
  DecodeParams decode() {
    DecodeParams d;
    m.set(&d, tk);
    d.state_pool = make_tensor_ref(pool.data(), DType::kFloat32, {4, tk.H, tk.D, tk.D});
    d.ssm_state_indices = make_tensor_ref(slots, DType::kInt32, {3});
    return d;
  }
  bool untouched() const {
    for (uint16_t x : m.out)
      if (x != kOutSentinel) return false;
    for (float x : pool)
      if (x != kStateSentinel) return false;
    for (float x : fs)
      if (x != kStateSentinel) return false;
    return true;
  }
  // `edit` changes the (prefill or decode) params; both must be rejected with the same message.
  template <class Edit>
  void expect_invalid(Edit edit, const std::string& arg, const std::string& exact = "") {
    PrefillParams p = prefill();
    edit(&p);
    DecodeParams d = decode();
    edit(&d);
    const Status s = can_implement(p);
    EXPECT_EQ(s.code, Status::Code::kInvalidArgument) << s.message;
    const std::string prefix = "flashkda: argument '" + arg + "': expected ";
    EXPECT_EQ(s.message.rfind(prefix, 0), 0u) << s.message;
    EXPECT_NE(s.message.find(", got "), std::string::npos) << s.message;
    if (!exact.empty()) EXPECT_EQ(s.message, exact);
    EXPECT_EQ(reference::prefill_reference(p).message, s.message);
    EXPECT_EQ(run(p, nullptr, 0).message, s.message);
    const Status sd = can_implement_decode(d);
    EXPECT_EQ(sd.message, s.message);
    EXPECT_EQ(reference::decode_reference(d).message, s.message);
    EXPECT_EQ(run_decode(d, nullptr, 0).message, s.message);
    EXPECT_TRUE(untouched()) << "an output was written on error";
  }

  Tokens tk;
  Mapped m;
  std::vector<float> pool, fs;
  int32_t slots[3] = {0, 1, 3};
};

TEST_F(TokenRowsValidation, ValidPasses) {
  ProblemShape ps;
  expect_ok(can_implement(prefill(), &ps));
  EXPECT_EQ(ps.T, 5);
  EXPECT_EQ(ps.rows, R);
  EXPECT_EQ(ps.N, 3);
  DecodeShape ds;
  expect_ok(can_implement_decode(decode(), &ds));
  EXPECT_EQ(ds.T, 5);
  EXPECT_EQ(ds.rows, R);
  EXPECT_EQ(ds.total_tokens, 5);
  // without token_rows, rows == T
  PrefillParams p;
  tk.set_tokens(&p);
  expect_ok(can_implement(p, &ps));
  EXPECT_EQ(ps.rows, ps.T);
  EXPECT_TRUE(untouched());
}

TEST_F(TokenRowsValidation, ValuesOutOfRange) {
  m.rows64[2] = R;
  expect_invalid(
      [](auto*) {}, "token_rows",
      "flashkda: argument 'token_rows': expected values in [0, 12) (rows of dim 1 of q, k, v, g, beta "
      "and out), got token_rows[2] = 12");
  m.rows64[2] = -1;
  expect_invalid([](auto*) {}, "token_rows");
  m.rows32[4] = 100;  // int32
  expect_invalid(
      [this](auto* p) { p->token_rows = make_tensor_ref(m.rows32.data(), DType::kInt32, {5}); }, "token_rows",
      "flashkda: argument 'token_rows': expected values in [0, 12) (rows of dim 1 of q, k, v, g, beta "
      "and out), got token_rows[4] = 100");
}

TEST_F(TokenRowsValidation, Duplicates) {
  m.rows64[4] = 0;  // tokens 1 and 4 on row 0
  expect_invalid(
      [](auto*) {}, "token_rows",
      "flashkda: argument 'token_rows': expected distinct values (each row read and written by one "
      "token), got token_rows[4] = token_rows[1] = 0");
}

TEST_F(TokenRowsValidation, MoreTokensThanRows) {
  // T distinct rows need R >= T: refused from the shapes (on CUDA the values are the kernels' to
  // check, and with R = 0 there is no row they could clamp a bad value into).
  for (int64_t rows : {4, 0}) {
    auto fewer_rows = [rows](auto* p) {
      for (TensorRef* t : {&p->q, &p->k, &p->v, &p->g, &p->beta, &p->out}) t->sizes[1] = rows;
    };
    expect_invalid(fewer_rows, "token_rows",
                   "flashkda: argument 'token_rows': expected at most R = " + std::to_string(rows) +
                       " values (distinct rows of dim 1 of q, k, v, g, beta and out), got 5 values");
  }
}

TEST_F(TokenRowsValidation, DtypeRankContiguityDevice) {
  std::vector<float> f(5, 0.0f);
  expect_invalid([&](auto* p) { p->token_rows = make_tensor_ref(f.data(), DType::kFloat32, {5}); },
                 "token_rows", "flashkda: argument 'token_rows': expected dtype int32 or int64, got float32");
  expect_invalid(
      [this](auto* p) {
        p->token_rows = make_tensor_ref(m.rows64.data(), DType::kInt64, {5, 1});
      },
      "token_rows");
  std::vector<int64_t> wide = {7, -9, 0, -9, 11, -9, 4, -9, 2, -9};
  expect_invalid(
      [&](auto* p) { p->token_rows = make_strided_tensor_ref(wide.data(), DType::kInt64, {5}, {2}); },
      "token_rows");
  expect_invalid([](auto* p) { p->token_rows.device = DeviceType::kCUDA; }, "token_rows",
                 "flashkda: argument 'token_rows': expected device cpu:0 (that of q), got cuda:0");
  expect_invalid([](auto* p) { p->token_rows.data = nullptr; }, "token_rows");
}

TEST_F(TokenRowsValidation, NeedsCuSeqlens) {
  // without cu_seqlens (a fixed-length [1, R] call) a map is refused
  expect_invalid(
      [](auto* p) { p->cu_seqlens = TensorRef(); }, "token_rows",
      "flashkda: argument 'token_rows': expected cu_seqlens to be given with it (the varlen layout, B "
      "== 1), got no cu_seqlens");
}

TEST_F(TokenRowsValidation, CuSeqlensMustEndAtTheMapLength) {
  // cu_seqlens counts logical tokens: ending at R (the row count) instead of 5 is an error
  tk.cu = {0, 3, 3, static_cast<int32_t>(R)};
  expect_invalid(
      [](auto*) {}, "cu_seqlens",
      "flashkda: argument 'cu_seqlens': expected cu_seqlens[3] == T = 5 (the length of token_rows), got 12");
  // a map longer than the row count cannot be injective
  tk.cu = {0, 3, 3, 5};
  std::vector<int64_t> many = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0};
  tk.cu[3] = 13;
  expect_invalid([&](auto* p) { p->token_rows = make_tensor_ref(many.data(), DType::kInt64, {13}); },
                 "token_rows");
}

TEST_F(TokenRowsValidation, BatchOfTwoIsRejected) {
  // token_rows is a varlen-only argument: B must be 1
  expect_invalid(
      [this](auto* p) {
        for (TensorRef* t : {&p->q, &p->k, &p->v, &p->g, &p->out})
          *t = make_tensor_ref(t->data, t->dtype, {2, R / 2, 2, 64});
        p->beta = make_tensor_ref(p->beta.data, p->beta.dtype, {2, R / 2, 2});
      },
      "token_rows",
      "flashkda: argument 'token_rows': expected B == 1 (the varlen layout: q of shape [1, R, H, K]), got "
      "B=2");
}

}  // namespace
}  // namespace flashkda
