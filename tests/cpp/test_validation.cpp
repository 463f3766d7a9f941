// Tests of can_implement(): every invalid input is reported (code, argument name, "expected ...,
// got ..." message) and nothing is written by can_implement, run() or prefill_reference(); valid
// inputs pass and fill ProblemShape.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"
#include "flashkda/reference.h"
#include "runtime/cuda_dispatch.h"

namespace flashkda {
namespace {

constexpr uint16_t kOutSentinel = 0x1234;
constexpr float kStateSentinel = -12345.0f;

// A valid fixed-length problem B=2, T=8, H=2, K=V=64 (bounded gate, fp32 states), plus spare
// buffers that tests point arguments at.  The contents are small random-free constants: only
// validation and the no-write guarantee are under test.
class Validation : public ::testing::Test {
 protected:
  static constexpr int64_t B = 2, T = 8, H = 2, D = 64;

  void SetUp() override {
    const size_t n = B * T * H * D;
    q.assign(n, 0x3f80);
    k.assign(n, 0x3f80);
    v.assign(n, 0x3f80);
    g.assign(n, 0x0000);
    beta.assign(B * T * H, 0x0000);
    A_log.assign(H, 0.0f);
    dt_bias.assign(H * D, 0.0f);
    out.assign(n, kOutSentinel);
    big_out.assign(4 * n, kOutSentinel);
    h0.assign(B * H * D * D, 0.5f);
    // A state buffer large enough for pools and overlapping views: written only if a bug.
    states.assign(8 * H * D * D, kStateSentinel);
    spare_f32.assign(4 * n, 0.0f);
    spare_16.assign(4 * n, 0);
  }

  PrefillParams valid() {
    PrefillParams p;
    p.q = make_tensor_ref(q.data(), DType::kBFloat16, {B, T, H, D});
    p.k = make_tensor_ref(k.data(), DType::kBFloat16, {B, T, H, D});
    p.v = make_tensor_ref(v.data(), DType::kBFloat16, {B, T, H, D});
    p.g = make_tensor_ref(g.data(), DType::kBFloat16, {B, T, H, D});
    p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {B, T, H});
    p.A_log = make_tensor_ref(A_log.data(), DType::kFloat32, {H});
    p.dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {H, D});
    p.out = make_tensor_ref(out.data(), DType::kBFloat16, {B, T, H, D});
    p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {B, H, D, D});
    p.final_state = make_tensor_ref(states.data(), DType::kFloat32, {B, H, D, D});
    return p;
  }

  // The same problem as a varlen batch of one row with the given boundaries.
  PrefillParams valid_varlen(std::vector<int32_t> cu_values) {
    cu = std::move(cu_values);
    const int64_t n_seq = static_cast<int64_t>(cu.size()) - 1;
    PrefillParams p = valid();
    const int64_t total = B * T;
    p.q = make_tensor_ref(q.data(), DType::kBFloat16, {1, total, H, D});
    p.k = make_tensor_ref(k.data(), DType::kBFloat16, {1, total, H, D});
    p.v = make_tensor_ref(v.data(), DType::kBFloat16, {1, total, H, D});
    p.g = make_tensor_ref(g.data(), DType::kBFloat16, {1, total, H, D});
    p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {1, total, H});
    p.out = make_tensor_ref(out.data(), DType::kBFloat16, {1, total, H, D});
    p.initial_state = TensorRef();
    p.final_state = make_tensor_ref(states.data(), DType::kFloat32, {n_seq, H, D, D});
    p.cu_seqlens = make_tensor_ref(cu.data(), DType::kInt32, {n_seq + 1});
    return p;
  }

  bool untouched() const {
    for (uint16_t x : out)
      if (x != kOutSentinel) return false;
    for (uint16_t x : big_out)
      if (x != kOutSentinel) return false;
    for (float x : states)
      if (x != kStateSentinel) return false;
    return true;
  }

  // The params must be rejected with `code`, naming `arg`, by can_implement, prefill_reference and
  // run, and none of them may write.
  void expect_rejected(const PrefillParams& p, Status::Code code, const std::string& arg) {
    ProblemShape shape;
    shape.B = -7;
    const Status s = can_implement(p, &shape);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(code)) << s.message;
    const std::string prefix = "flashkda: argument '" + arg + "': expected ";
    EXPECT_EQ(s.message.rfind(prefix, 0), 0u) << "message: " << s.message << "\nwanted prefix: " << prefix;
    EXPECT_NE(s.message.find(", got "), std::string::npos) << s.message;
    EXPECT_EQ(shape.B, -7) << "ProblemShape must be left alone on error";

    const Status r = reference::prefill_reference(p);
    EXPECT_EQ(static_cast<int>(r.code), static_cast<int>(code));
    EXPECT_EQ(r.message, s.message);
    char ws[512];
    const Status rr = run(p, ws, sizeof(ws));
    EXPECT_EQ(static_cast<int>(rr.code), static_cast<int>(code));
    EXPECT_EQ(rr.message, s.message);
    EXPECT_TRUE(untouched()) << "an output buffer was written on error";
  }

  void expect_invalid(const PrefillParams& p, const std::string& arg) {
    expect_rejected(p, Status::Code::kInvalidArgument, arg);
  }

  std::vector<uint16_t> q, k, v, g, beta, out, big_out, spare_16;
  std::vector<float> A_log, dt_bias, h0, states, spare_f32;
  std::vector<int32_t> cu;
};

// ---------------------------------------------------------------------------------------------
// Valid inputs

TEST_F(Validation, ValidFixedLengthFillsShape) {
  ProblemShape s;
  Status st = can_implement(valid(), &s);
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_EQ(s.B, B);
  EXPECT_EQ(s.T, T);
  EXPECT_EQ(s.H, H);
  EXPECT_EQ(s.K, D);
  EXPECT_EQ(s.V, D);
  EXPECT_EQ(s.N, B);
  EXPECT_EQ(s.total_tokens, B * T);
  EXPECT_FALSE(s.varlen);
  EXPECT_TRUE(can_implement(valid()).ok());  // shape pointer optional
}

TEST_F(Validation, ValidVarlenFillsShape) {
  ProblemShape s;
  Status st = can_implement(valid_varlen({0, 3, 3, 10, 16}), &s);
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_EQ(s.B, 1);
  EXPECT_EQ(s.T, 16);
  EXPECT_EQ(s.N, 4);
  EXPECT_EQ(s.total_tokens, 16);
  EXPECT_TRUE(s.varlen);
  std::vector<int64_t> cu64 = {0, 16};
  PrefillParams p = valid_varlen({0, 16});
  p.cu_seqlens = make_tensor_ref(cu64.data(), DType::kInt64, {2});
  EXPECT_TRUE(can_implement(p).ok());
}

TEST_F(Validation, ValidVariants) {
  {  // head dim 128, T == 0 and B == 0
    std::vector<uint16_t> z(1);
    for (int64_t bb : {0, 3}) {
      PrefillParams p;
      p.q = make_tensor_ref(z.data(), DType::kBFloat16, {bb, 0, 4, 128});
      p.k = p.q;
      p.v = p.q;
      p.g = p.q;
      p.out = p.q;
      p.beta = make_tensor_ref(z.data(), DType::kBFloat16, {bb, 0, 4});
      p.gate_mode = GateMode::kPrecomputed;
      ProblemShape s;
      Status st = can_implement(p, &s);
      EXPECT_TRUE(st.ok()) << st.message;
      EXPECT_EQ(s.K, 128);
      EXPECT_EQ(s.N, bb);
    }
  }
  {  // N == 0 with cu_seqlens == [0] (T == 0), null pointers for empty tensors
    int32_t zero = 0;
    PrefillParams p;
    p.q = make_tensor_ref(nullptr, DType::kBFloat16, {1, 0, 2, 64});
    p.k = p.q;
    p.v = p.q;
    p.g = p.q;
    p.out = p.q;
    p.beta = make_tensor_ref(nullptr, DType::kFloat32, {1, 0, 2});
    p.gate_mode = GateMode::kPrecomputed;
    p.cu_seqlens = make_tensor_ref(&zero, DType::kInt32, {1});
    p.final_state = make_tensor_ref(nullptr, DType::kFloat32, {0, 2, 64, 64});
    ProblemShape s;
    Status st = can_implement(p, &s);
    EXPECT_TRUE(st.ok()) << st.message;
    EXPECT_EQ(s.N, 0);
  }
  {  // precomputed gate ignores A_log / dt_bias (even bad ones); fp32 g and beta; flat dt_bias
    PrefillParams p = valid();
    p.gate_mode = GateMode::kPrecomputed;
    p.A_log = TensorRef();
    p.dt_bias = make_tensor_ref(spare_f32.data(), DType::kInt32, {3});
    p.g = make_tensor_ref(spare_f32.data(), DType::kFloat32, {B, T, H, D});
    p.beta = make_tensor_ref(spare_f32.data(), DType::kFloat32, {B, T, H});
    Status st = can_implement(p);
    EXPECT_TRUE(st.ok()) << st.message;
    p = valid();
    p.gate_mode = GateMode::kSoftplus;
    p.dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {H * D});
    st = can_implement(p);
    EXPECT_TRUE(st.ok()) << st.message;
  }
  {  // in-place state, bf16 states, state pool with padding, has_initial_state, scalars
    PrefillParams p = valid();
    p.initial_state = p.final_state;
    EXPECT_TRUE(can_implement(p).ok());
    p.initial_state.dtype = p.final_state.dtype = DType::kBFloat16;
    EXPECT_TRUE(can_implement(p).ok());
    int64_t idx[2] = {-1, 5};
    p = valid();
    p.initial_state = make_tensor_ref(states.data(), DType::kFloat32, {7, H, D, D});
    p.final_state = p.initial_state;
    p.state_indices = make_tensor_ref(idx, DType::kInt64, {2});
    Status st = can_implement(p);
    EXPECT_TRUE(st.ok()) << st.message;
    int64_t pad[2] = {-1, -1};
    p.state_indices.data = pad;
    EXPECT_TRUE(can_implement(p).ok());
    bool has[2] = {true, false};
    p.has_initial_state = make_tensor_ref(has, DType::kBool, {2});
    EXPECT_TRUE(can_implement(p).ok());
    p = valid();
    p.scale = 0.0f;  // K^-0.5
    p.lower_bound = -5.0f;
    EXPECT_TRUE(can_implement(p).ok());
    p.scale = 0.25f;
    p.lower_bound = -1e-3f;
    EXPECT_TRUE(can_implement(p).ok());
    p.initial_state = TensorRef();
    p.final_state = TensorRef();
    EXPECT_TRUE(can_implement(p).ok());
  }
}

TEST_F(Validation, ValidStridedViews) {
  PrefillParams p = valid();
  // token stride larger than H*D, batch stride free, beta row-strided, out row-strided
  p.q = make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {B, T, H, D}, {T * 300, 300, D, 1});
  p.k = make_strided_tensor_ref(spare_16.data() + 7, DType::kBFloat16, {B, T, H, D}, {0, 300, D, 1});
  p.beta = make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {B, T, H}, {T * 300, 300, 1});
  p.out = make_strided_tensor_ref(big_out.data(), DType::kBFloat16, {B, T, H, D}, {H * D, B * H * D, D, 1});
  Status st = can_implement(p);
  EXPECT_TRUE(st.ok()) << st.message;
  // a size-1 head dim may carry any stride (as PyTorch views do)
  PrefillParams p1;
  p1.q = make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {1, 4, 1, 64}, {256, 64, 9999, 1});
  p1.k = p1.q;
  p1.v = p1.q;
  p1.g = p1.q;
  p1.out = make_tensor_ref(big_out.data(), DType::kBFloat16, {1, 4, 1, 64});
  p1.beta = make_tensor_ref(spare_16.data(), DType::kBFloat16, {1, 4, 1});
  p1.gate_mode = GateMode::kPrecomputed;
  st = can_implement(p1);
  EXPECT_TRUE(st.ok()) << st.message;
}

// ---------------------------------------------------------------------------------------------
// Invalid inputs

TEST_F(Validation, MissingQ) {
  PrefillParams p = valid();
  p.q = TensorRef();
  expect_invalid(p, "q");
}

TEST_F(Validation, WrongDtypeQ) {
  PrefillParams p = valid();
  p.q.dtype = DType::kFloat32;
  expect_invalid(p, "q");
  EXPECT_EQ(can_implement(p).message, "flashkda: argument 'q': expected dtype bfloat16, got float32");
  // A dtype flashkda has no name for is reported by the caller's name for it.
  p.q.dtype = DType::kOther;
  p.q.other_dtype_name = "int16";
  expect_invalid(p, "q");
  EXPECT_EQ(can_implement(p).message, "flashkda: argument 'q': expected dtype bfloat16, got int16");
  p.q.other_dtype_name = nullptr;
  EXPECT_EQ(can_implement(p).message, "flashkda: argument 'q': expected dtype bfloat16, got other");
}

TEST_F(Validation, WrongRankK) {
  PrefillParams p = valid();
  p.k = make_tensor_ref(k.data(), DType::kBFloat16, {B * T, H, D});
  expect_invalid(p, "k");
}

TEST_F(Validation, VShapeMismatch) {
  PrefillParams p = valid();
  p.v = make_tensor_ref(v.data(), DType::kBFloat16, {B, T - 1, H, D});
  expect_invalid(p, "v");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'v': expected shape [2, 8, 2, 64] (B, T, H of q, V), got [2, 7, 2, 64]");
}

// The CUDA launch limits (checked for CUDA tensors, before anything runs): the heads fit one grid
// dimension, B and N an int, and T an int with room to round up to whole chunks.
TEST(CudaSizeLimits, EdgesNameQ) {
  using flashkda::detail::cuda_size_limits;
  constexpr int64_t kMaxInt = 0x7fffffff;
  EXPECT_TRUE(cuda_size_limits(1, 1, 65535, 1).ok());
  EXPECT_TRUE(cuda_size_limits(kMaxInt, kMaxInt - 63, 1, kMaxInt).ok());
  const Status h = cuda_size_limits(1, 1, 65536, 1);
  EXPECT_EQ(static_cast<int>(h.code), static_cast<int>(Status::Code::kInvalidArgument));
  EXPECT_EQ(h.message, "flashkda: argument 'q': expected at most 65535 heads (dim 2) on CUDA, got H = 65536");
  const Status t = cuda_size_limits(1, kMaxInt - 62, 1, 1);
  EXPECT_EQ(static_cast<int>(t.code), static_cast<int>(Status::Code::kInvalidArgument));
  EXPECT_EQ(
      t.message,
      "flashkda: argument 'q': expected B and the sequence count N below 2^31, T below 2^31 - 63 on CUDA, "
      "got B = 1, T = 2147483585, N = 1");
  EXPECT_FALSE(cuda_size_limits(kMaxInt + 1, 1, 1, 1).ok());
  EXPECT_FALSE(cuda_size_limits(1, 1, 1, kMaxInt + 1).ok());
}

// cu_seqlens with no sequence while there are tokens: refused from the shapes for every device.
TEST_F(Validation, CuSeqlensWithoutSequencesButTokens) {
  PrefillParams p = valid();
  int32_t zero = 0;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {1, B * T, H, D});
  p.k = make_tensor_ref(k.data(), DType::kBFloat16, {1, B * T, H, D});
  p.v = make_tensor_ref(v.data(), DType::kBFloat16, {1, B * T, H, D});
  p.g = make_tensor_ref(g.data(), DType::kBFloat16, {1, B * T, H, D});
  p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {1, B * T, H});
  p.out = make_tensor_ref(out.data(), DType::kBFloat16, {1, B * T, H, D});
  p.initial_state = TensorRef{};
  p.final_state = TensorRef{};
  p.cu_seqlens = make_tensor_ref(&zero, DType::kInt32, {1});
  expect_invalid(p, "cu_seqlens");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'cu_seqlens': expected at least 2 elements [N+1] for T = 16 tokens, got [1]");
}

// When q is the tensor with the wrong size, no check of q alone fails; the first tensor compared
// with it is named, and the label says the expected sizes come from q.
TEST_F(Validation, QShapeMismatchPointsBackAtQ) {
  PrefillParams p = valid();
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {B, T - 1, H, D});
  expect_invalid(p, "k");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'k': expected shape [2, 7, 2, 64] (B, T, H, K of q), got [2, 8, 2, 64]");
  p = valid();
  p.out = make_tensor_ref(big_out.data(), DType::kBFloat16, {B, T, H + 1, D});
  expect_invalid(p, "out");
  EXPECT_EQ(
      can_implement(p).message,
      "flashkda: argument 'out': expected shape [2, 8, 2, 64] (B, T, H of q, V of v), got [2, 8, 3, 64]");
}

TEST_F(Validation, NonContiguousHeadBlock) {
  PrefillParams p = valid();
  p.q =
      make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {B, T, H, D}, {T * 4 * D, 4 * D, 2 * D, 1});
  expect_invalid(p, "q");
  p = valid();
  p.v = make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {B, T, H, D},
                                {T * H * D * 2, H * D * 2, D, 2});
  expect_invalid(p, "v");
}

TEST_F(Validation, NegativeTokenStride) {
  PrefillParams p = valid();
  p.g = make_strided_tensor_ref(g.data() + (T - 1) * H * D, DType::kBFloat16, {B, T, H, D},
                                {T * H * D, -H * D, D, 1});
  expect_invalid(p, "g");
}

TEST_F(Validation, BetaWrongShapeAndStride) {
  PrefillParams p = valid();
  p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {B, T, H + 1});
  expect_invalid(p, "beta");
  p = valid();
  p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {B, T, H, 1});
  expect_invalid(p, "beta");
  p = valid();
  p.beta = make_strided_tensor_ref(spare_16.data(), DType::kBFloat16, {B, T, H}, {T * H * 2, H * 2, 2});
  expect_invalid(p, "beta");
}

TEST_F(Validation, GFloat16) {
  PrefillParams p = valid();
  p.g.dtype = DType::kFloat16;
  expect_invalid(p, "g");
}

TEST_F(Validation, OutWrongDtype) {
  PrefillParams p = valid();
  p.out = make_tensor_ref(spare_f32.data(), DType::kFloat32, {B, T, H, D});
  expect_invalid(p, "out");
}

TEST_F(Validation, OutMissingOrOverlappingRows) {
  PrefillParams p = valid();
  p.out = TensorRef();
  expect_invalid(p, "out");
  p = valid();
  p.out = make_strided_tensor_ref(out.data(), DType::kBFloat16, {B, T, H, D}, {T * H * D, H * D / 2, D, 1});
  expect_invalid(p, "out");
}

TEST_F(Validation, HeadDim96NotImplemented) {
  PrefillParams p = valid();
  for (TensorRef* t : {&p.q, &p.k, &p.v, &p.g, &p.out})
    *t = make_tensor_ref(t->data, t->dtype, {B, T, H, 32});
  p.dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {H, 32});
  p.initial_state = p.final_state = TensorRef();
  expect_rejected(p, Status::Code::kNotImplemented, "q");
  for (TensorRef* t : {&p.q, &p.k, &p.v, &p.g, &p.out})
    *t = make_tensor_ref(spare_16.data(), t->dtype, {1, 4, 2, 96});
  p.beta = make_tensor_ref(beta.data(), DType::kBFloat16, {1, 4, 2});
  expect_rejected(p, Status::Code::kNotImplemented, "q");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'q': expected head dim K == V in {64, 128}, got K=96, V=96");
}

TEST_F(Validation, KNotEqualV) {
  PrefillParams p = valid();
  std::vector<uint16_t> big(B * T * H * 128);
  p.q = make_tensor_ref(big.data(), DType::kBFloat16, {B, T, H, 128});
  p.k = p.q;
  p.g = p.q;
  expect_rejected(p, Status::Code::kNotImplemented, "v");
}

TEST_F(Validation, HeadsZero) {
  PrefillParams p = valid();
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {B, T, 0, D});
  expect_invalid(p, "q");
}

TEST_F(Validation, NullDataWithElements) {
  PrefillParams p = valid();
  p.k.data = nullptr;
  expect_invalid(p, "k");
}

TEST_F(Validation, MissingALogForBoundedGate) {
  PrefillParams p = valid();
  p.A_log = TensorRef();
  expect_invalid(p, "A_log");
  p.gate_mode = GateMode::kSoftplus;
  expect_invalid(p, "A_log");
  p = valid();
  p.A_log.dtype = DType::kBFloat16;
  expect_invalid(p, "A_log");
}

TEST_F(Validation, DtBiasWrongSize) {
  PrefillParams p = valid();
  p.dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {H * D - 1});
  expect_invalid(p, "dt_bias");
  p.dt_bias = make_tensor_ref(dt_bias.data(), DType::kFloat32, {D, H});
  expect_invalid(p, "dt_bias");
  p.dt_bias = TensorRef();
  expect_invalid(p, "dt_bias");
}

TEST_F(Validation, LowerBoundOutOfRange) {
  PrefillParams p = valid();
  for (float lb : {-6.0f, 0.0f, 0.5f, std::numeric_limits<float>::quiet_NaN(),
                   -std::numeric_limits<float>::infinity()}) {
    p.lower_bound = lb;
    expect_invalid(p, "lower_bound");
  }
  p.gate_mode = GateMode::kSoftplus;  // only the bounded gate uses it
  EXPECT_TRUE(can_implement(p).ok());
}

TEST_F(Validation, ScaleNotFiniteOrNegative) {
  PrefillParams p = valid();
  p.scale = std::numeric_limits<float>::infinity();
  expect_invalid(p, "scale");
  p.scale = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(p, "scale");
  // A negative scale is refused, not silently replaced by K^-0.5 (0 is the way to ask for that).
  p.scale = -0.125f;
  expect_invalid(p, "scale");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'scale': expected a finite value > 0, or 0 for K^-0.5, got -0.125");
  p.scale = 0.0f;
  EXPECT_TRUE(can_implement(p).ok());
}

TEST_F(Validation, BadGateMode) {
  PrefillParams p = valid();
  p.gate_mode = static_cast<GateMode>(7);
  expect_invalid(p, "gate_mode");
}

TEST_F(Validation, CuSeqlensWithBatchTwo) {
  PrefillParams p = valid();
  cu = {0, 8};
  p.cu_seqlens = make_tensor_ref(cu.data(), DType::kInt32, {2});
  expect_invalid(p, "cu_seqlens");
}

TEST_F(Validation, CuSeqlensNotStartingAtZero) { expect_invalid(valid_varlen({1, 5, 16}), "cu_seqlens"); }

TEST_F(Validation, CuSeqlensDecreasing) {
  PrefillParams p = valid_varlen({0, 9, 4, 16});
  expect_invalid(p, "cu_seqlens");
  EXPECT_NE(can_implement(p).message.find("cu_seqlens[2] = 4"), std::string::npos)
      << can_implement(p).message;
}

TEST_F(Validation, CuSeqlensNotEndingAtT) {
  expect_invalid(valid_varlen({0, 5, 15}), "cu_seqlens");
  expect_invalid(valid_varlen({0, 5, 17}), "cu_seqlens");
}

TEST_F(Validation, CuSeqlensDtypeRankAndSize) {
  PrefillParams p = valid_varlen({0, 16});
  std::vector<float> fcu = {0.0f, 16.0f};
  p.cu_seqlens = make_tensor_ref(fcu.data(), DType::kFloat32, {2});
  expect_invalid(p, "cu_seqlens");
  p = valid_varlen({0, 16});
  p.cu_seqlens = make_tensor_ref(cu.data(), DType::kInt32, {1, 2});
  expect_invalid(p, "cu_seqlens");
  p.cu_seqlens = make_tensor_ref(cu.data(), DType::kInt32, {0});
  expect_invalid(p, "cu_seqlens");
  p.cu_seqlens = make_strided_tensor_ref(cu.data(), DType::kInt32, {2}, {2});
  expect_invalid(p, "cu_seqlens");
}

TEST_F(Validation, StateWrongShape) {
  PrefillParams p = valid();
  p.final_state = make_tensor_ref(states.data(), DType::kFloat32, {B + 1, H, D, D});
  expect_invalid(p, "final_state");
  p = valid();
  p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {B, H, D, D / 2});
  expect_invalid(p, "initial_state");
  p = valid();
  p.initial_state = make_tensor_ref(h0.data(), DType::kFloat32, {B * H, D, D});
  expect_invalid(p, "initial_state");
}

TEST_F(Validation, StateWrongDtype) {
  PrefillParams p = valid();
  p.final_state.dtype = DType::kFloat16;
  expect_invalid(p, "final_state");
  p = valid();
  p.initial_state.dtype = DType::kFloat64;
  expect_invalid(p, "initial_state");
  p = valid();
  p.final_state.dtype = DType::kBFloat16;  // initial fp32, final bf16: must match
  expect_invalid(p, "final_state");
}

TEST_F(Validation, StateNotContiguous) {
  PrefillParams p = valid();
  p.final_state = make_strided_tensor_ref(states.data(), DType::kFloat32, {B, H, D, D},
                                          {H * D * D, D * D, 1, D});  // transposed [K, V]
  expect_invalid(p, "final_state");
}

TEST_F(Validation, InitialFinalPartialOverlap) {
  PrefillParams p = valid();
  p.initial_state = make_tensor_ref(states.data(), DType::kFloat32, {B, H, D, D});
  p.final_state = make_tensor_ref(states.data() + H * D * D, DType::kFloat32, {B, H, D, D});
  expect_invalid(p, "final_state");
  p.final_state = make_tensor_ref(states.data() + 1, DType::kFloat32, {B, H, D, D});
  expect_invalid(p, "final_state");
  p.final_state = make_tensor_ref(states.data() + B * H * D * D, DType::kFloat32, {B, H, D, D});
  EXPECT_TRUE(can_implement(p).ok());  // adjacent, no overlap
}

TEST_F(Validation, StateIndicesOutOfRange) {
  PrefillParams p = valid();
  int64_t idx[2] = {0, 3};
  p.initial_state = make_tensor_ref(states.data(), DType::kFloat32, {3, H, D, D});
  p.final_state = p.initial_state;
  p.state_indices = make_tensor_ref(idx, DType::kInt64, {2});
  expect_invalid(p, "state_indices");
  EXPECT_NE(can_implement(p).message.find("state_indices[1] = 3"), std::string::npos);
  int32_t idx32[2] = {2, 1000};
  p.state_indices = make_tensor_ref(idx32, DType::kInt32, {2});
  expect_invalid(p, "state_indices");
}

TEST_F(Validation, StateIndicesDuplicate) {
  PrefillParams p = valid();
  int32_t idx[2] = {1, 1};
  p.initial_state = make_tensor_ref(states.data(), DType::kFloat32, {3, H, D, D});
  p.final_state = p.initial_state;
  p.state_indices = make_tensor_ref(idx, DType::kInt32, {2});
  expect_invalid(p, "state_indices");
}

TEST_F(Validation, StateIndicesWithoutState) {
  PrefillParams p = valid();
  int32_t idx[2] = {0, 1};
  p.initial_state = TensorRef();
  p.final_state = TensorRef();
  p.state_indices = make_tensor_ref(idx, DType::kInt32, {2});
  expect_invalid(p, "state_indices");
}

TEST_F(Validation, StateIndicesWrongShapeOrDtype) {
  PrefillParams p = valid();
  int64_t idx[3] = {0, 1, 2};
  p.initial_state = make_tensor_ref(states.data(), DType::kFloat32, {3, H, D, D});
  p.final_state = p.initial_state;
  p.state_indices = make_tensor_ref(idx, DType::kInt64, {3});
  expect_invalid(p, "state_indices");
  p.state_indices = make_tensor_ref(idx, DType::kFloat64, {2});
  expect_invalid(p, "state_indices");
  p.state_indices = make_tensor_ref(idx, DType::kInt64, {2});
  p.final_state = make_tensor_ref(states.data(), DType::kFloat32, {0, H, D, D});  // a pool needs P >= 1
  p.initial_state = TensorRef();
  expect_invalid(p, "final_state");
}

TEST_F(Validation, HasInitialStateWrongDtypeOrShape) {
  PrefillParams p = valid();
  int32_t flags[2] = {1, 0};
  p.has_initial_state = make_tensor_ref(flags, DType::kInt32, {2});
  expect_invalid(p, "has_initial_state");
  bool has[3] = {true, true, true};
  p.has_initial_state = make_tensor_ref(has, DType::kBool, {3});
  expect_invalid(p, "has_initial_state");
}

TEST_F(Validation, HasInitialStateWithoutInitialState) {
  PrefillParams p = valid();
  p.initial_state = TensorRef();
  bool has[2] = {true, true};
  p.has_initial_state = make_tensor_ref(has, DType::kBool, {2});
  expect_invalid(p, "has_initial_state");
}

TEST_F(Validation, OutSharingMemoryWithAState) {
  PrefillParams p = valid();
  // out over final_state's buffer (states), and over initial_state's (h0): rejected, naming out.
  p.out = make_tensor_ref(reinterpret_cast<uint16_t*>(states.data()) + 64, DType::kBFloat16, {B, T, H, D});
  expect_invalid(p, "out");
  EXPECT_EQ(can_implement(p).message,
            "flashkda: argument 'out': expected no memory shared with final_state, got an overlap with "
            "final_state");
  p = valid();
  p.out = make_tensor_ref(reinterpret_cast<uint16_t*>(h0.data()), DType::kBFloat16, {B, T, H, D});
  expect_invalid(p, "out");
  // A strided out whose last row ends before the state starts is apart from it.
  p = valid();
  p.final_state = make_tensor_ref(states.data() + B * T * H * D, DType::kFloat32, {B, H, D, D});
  p.out = make_strided_tensor_ref(reinterpret_cast<uint16_t*>(states.data()), DType::kBFloat16, {B, T, H, D},
                                  {T * H * D, H * D, D, 1});
  EXPECT_TRUE(can_implement(p).ok()) << can_implement(p).message;
}

// The state walk reads v's rows while it writes out and the final states (it forms U = T_inv diag(b) v
// itself): out may be v itself, not another view of its memory; final_state may not overlap v.
TEST_F(Validation, OutAndFinalStateAgainstV) {
  PrefillParams p = valid();
  p.out = make_tensor_ref(v.data(), DType::kBFloat16, {B, T, H, D});
  EXPECT_TRUE(can_implement(p).ok()) << can_implement(p).message;  // in place over v
  p = valid();
  std::vector<uint16_t> vbuf(B * T * H * D + 64, 0x3f80);
  p.v = make_tensor_ref(vbuf.data(), DType::kBFloat16, {B, T, H, D});
  p.out = make_tensor_ref(vbuf.data() + 64, DType::kBFloat16, {B, T, H, D});  // shifted by one head's rows
  expect_invalid(p, "out");
  EXPECT_EQ(
      can_implement(p).message,
      "flashkda: argument 'out': expected no memory shared with v (unless out is v itself: the state walk "
      "reads v while it writes out), got an overlap with v");
  for (uint16_t x : vbuf) ASSERT_EQ(x, 0x3f80) << "v's buffer was written on error";
  // The same memory with other (valid) strides is another view: tokens and batches swapped.
  p.out = make_strided_tensor_ref(vbuf.data(), DType::kBFloat16, {B, T, H, D}, {H * D, B * H * D, D, 1});
  expect_invalid(p, "out");
  EXPECT_NE(can_implement(p).message.find("expected no memory shared with v"), std::string::npos)
      << can_implement(p).message;
  p = valid();
  p.v = make_tensor_ref(reinterpret_cast<uint16_t*>(states.data()), DType::kBFloat16, {B, T, H, D});
  expect_invalid(p, "final_state");
}

TEST_F(Validation, MixedDevices) {
  PrefillParams p = valid();
  p.k.device = DeviceType::kCUDA;
  expect_invalid(p, "k");
  p = valid();
  p.final_state.device = DeviceType::kCUDA;
  expect_invalid(p, "final_state");
  p = valid();
  for (TensorRef* t :
       {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.A_log, &p.dt_bias, &p.out, &p.initial_state, &p.final_state})
    t->device = DeviceType::kCUDA;
  p.v.device_index = 1;  // cuda:1 among cuda:0
  expect_invalid(p, "v");
}

TEST_F(Validation, CudaTensorsWithoutUsableDevice) {
  if (built_with_cuda()) GTEST_SKIP() << "depends on the GPU present; covered by the CUDA tests";
  PrefillParams p = valid();
  for (TensorRef* t :
       {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.A_log, &p.dt_bias, &p.out, &p.initial_state, &p.final_state})
    t->device = DeviceType::kCUDA;
  const Status s = can_implement(p);
  EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(Status::Code::kUnsupportedDevice)) << s.message;
  char ws[512];
  EXPECT_FALSE(run(p, ws, sizeof(ws)).ok());
  EXPECT_TRUE(untouched());
}

TEST(ValidationHelpers, NamesSizesAndRefs) {
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(dtype_name(DType::kInt64), "int64");
  EXPECT_STREQ(dtype_name(DType::kBool), "bool");
  EXPECT_STREQ(gate_mode_name(GateMode::kBounded), "bounded");
  EXPECT_STREQ(gate_mode_name(GateMode::kSoftplus), "softplus");
  EXPECT_STREQ(gate_mode_name(GateMode::kPrecomputed), "precomputed");
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
  TensorRef t = make_tensor_ref(nullptr, DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  TensorRef s = make_strided_tensor_ref(nullptr, DType::kBFloat16, {2, 5}, {10, 1}, DeviceType::kCUDA, 3);
  EXPECT_EQ(s.strides[0], 10);
  EXPECT_EQ(s.device, DeviceType::kCUDA);
  EXPECT_EQ(s.device_index, 3);
  EXPECT_EQ(TensorRef().numel(), 0);
  EXPECT_FALSE(TensorRef().defined());
  EXPECT_EQ(make_tensor_ref(nullptr, DType::kFloat32, {}).numel(), 1);
}

}  // namespace
}  // namespace flashkda

// An engine sizes the prefill workspace once for its largest step (most tokens, most sequences) and
// reuses it: the size must never shrink when tokens or sequences grow, though the context-parallel
// area is only reserved for few sequences x heads (N H <= 32).
TEST(WorkspaceSize, MonotoneInTokensAndSequences) {
  for (int64_t d : {64, 128}) {
    for (int64_t h : {1, 2, 4, 16, 32, 33, 64}) {
      size_t prev_t = 0;
      for (int64_t t : {0, 1, 63, 64, 2047, 2048, 4096, 65536, 1 << 20}) {
        size_t prev_n = 0;
        for (int64_t n : {1, 2, 3, 8, 16, 17, 32, 33, 256}) {
          const size_t s = flashkda::workspace_size(t, h, n, d);
          EXPECT_GE(s, prev_n) << "T " << t << " H " << h << " N " << n << " D " << d;
          prev_n = s;
        }
        const size_t s1 = flashkda::workspace_size(t, h, 1, d);
        EXPECT_GE(s1, prev_t) << "T " << t << " H " << h << " D " << d;
        prev_t = s1;
      }
    }
  }
}

// The context-parallel area: one start state and one (L, A) map (3 D x D fp32) per segment slot and
// head, floor(T / 2048) + min(N, 32 / H) slots; none above 32 heads.  A record (D = 128): KT, QT, KD
// 3 x 64 x 128 x 2 bytes, Tb and MQK packed triangles 2 x 5120 (their 10 lower 16 x 16 blocks of 512
// bytes), gamma 128 x 4, the 128-byte shift tail.
TEST(WorkspaceSize, ReservesTheSegmentAreaForFewSequencesTimesHeads) {
  const size_t per_slot_head = 3 * 128 * 128 * sizeof(float);
  constexpr size_t kRecord = 3 * 64 * 128 * 2 + 2 * (10 * 16 * 16 * 2) + 128 * 4 + 128;
  static_assert(kRecord == 60032, "ChunkRecord<128>");
  const size_t records_16 = flashkda::workspace_size(16384, 16, 1) - flashkda::workspace_size(0, 16, 1);
  const size_t records_64 = flashkda::workspace_size(16384, 64, 1) - flashkda::workspace_size(0, 64, 1);
  EXPECT_EQ(records_16, (16384 / 64) * 16 * kRecord + (16384 / 2048) * 16 * per_slot_head);
  EXPECT_EQ(records_64, (16384 / 64) * 64 * kRecord);
  // N beyond 32 / H adds records only.
  EXPECT_EQ(flashkda::workspace_size(0, 16, 3) - flashkda::workspace_size(0, 16, 2), 16 * kRecord);
}

// The sized error-header operations refuse a workspace shorter than the header (or null) before any
// copy: nothing is read past it or written to it.
TEST(DeviceErrorHeader, SizedFormsRefuseAShortWorkspace) {
  std::vector<uint8_t> buf(4096, 0xAB);
  flashkda::DeviceError err = flashkda::DeviceError::kBadCuSeqlens;
  flashkda::Status s = flashkda::read_device_error(buf.data(), 16, nullptr, &err);
  EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(flashkda::Status::Code::kInvalidArgument));
  EXPECT_EQ(
      s.message,
      "flashkda: argument 'workspace': expected at least 4096 bytes of device memory (the error header), "
      "got 16");
  EXPECT_EQ(static_cast<int>(err), 0);
  s = flashkda::clear_device_error(buf.data(), 4095, nullptr);
  EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(flashkda::Status::Code::kInvalidArgument));
  s = flashkda::clear_device_error(nullptr, 4096, nullptr);
  EXPECT_EQ(
      s.message,
      "flashkda: argument 'workspace': expected at least 4096 bytes of device memory (the error header), "
      "got 4096 (null pointer)");
  for (uint8_t b : buf) ASSERT_EQ(b, 0xAB);
  if (!flashkda::built_with_cuda()) {  // a full header passes the size check; the op needs CUDA
    s = flashkda::clear_device_error(buf.data(), 4096, nullptr);
    EXPECT_EQ(static_cast<int>(s.code), static_cast<int>(flashkda::Status::Code::kNotImplemented));
  }
}
