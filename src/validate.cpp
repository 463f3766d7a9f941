// Argument validation of the public API (can_implement for prefill, can_implement_decode for the
// recurrent decode path) and the small TensorRef helpers.
//
// Both check the arguments in a fixed order and return the first problem they find as
// "flashkda: argument '<name>': expected <what>, got <what>".  They never abort and never write;
// they read host memory only (the values of CPU cu_seqlens / token rows / state indices / checkpoint
// offsets / accepted-token counts; the kernels check the values of CUDA ones).  The token inputs (q,
// k, v, g, beta, out, gate parameters, scalars, token_rows) are checked by shared functions, so
// prefill and decode report them alike.  With token_rows, dim 1 of the token tensors is the row
// count R and T is the logical token count (the length of token_rows).  Stride rules follow
// PyTorch's notion of contiguity: the stride of a dimension of size <= 1 is never looked at.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"
#include "runtime/cuda_dispatch.h"

namespace flashkda {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
    case DType::kOther:
      return "other";
  }
  return "unknown";
}

const char* gate_mode_name(GateMode m) {
  switch (m) {
    case GateMode::kBounded:
      return "bounded";
    case GateMode::kSoftplus:
      return "softplus";
    case GateMode::kPrecomputed:
      return "precomputed";
  }
  return "unknown";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kBool:
      return 1;
    case DType::kOther:
      return 0;
  }
  return 0;
}

int64_t TensorRef::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  const int r = std::min(ndim, kMaxRank);
  for (int i = 0; i < r; ++i) n *= sizes[i];
  return n;
}

TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> sizes, DeviceType device,
                          int device_index) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(sizes.size());  // a rank > kMaxRank is kept so that validation rejects it
  t.device = device;
  t.device_index = device_index;
  int i = 0;
  for (int64_t s : sizes) {
    if (i >= kMaxRank) break;
    t.sizes[i++] = s;
  }
  const int r = std::min(t.ndim, kMaxRank);
  int64_t stride = 1;
  for (int d = r - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= std::max<int64_t>(t.sizes[d], 1);
  }
  return t;
}

TensorRef make_strided_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                                  std::initializer_list<int64_t> strides, DeviceType device,
                                  int device_index) {
  TensorRef t = make_tensor_ref(data, dtype, sizes, device, device_index);
  int i = 0;
  for (int64_t s : strides) {
    if (i >= kMaxRank || i >= t.ndim) break;
    t.strides[i++] = s;
  }
  return t;
}

namespace detail {

// T: the kernels round a fixed-length batch's T up to whole chunks in int (T + C - 1), so T stays
// C - 1 below 2^31 (no input that large fits a GPU today; the bound keeps the arithmetic exact anyway).
Status cuda_size_limits(int64_t B, int64_t T, int64_t H, int64_t N) {
  constexpr int64_t kMaxGridY = 65535, kMaxInt = 0x7fffffff, kMaxT = kMaxInt - (kChunkTokens - 1);
  if (H > kMaxGridY) {
    return Status::invalid("flashkda: argument 'q': expected at most " + std::to_string(kMaxGridY) +
                           " heads (dim 2) on CUDA, got H = " + std::to_string(H));
  }
  if (B > kMaxInt || T > kMaxT || N > kMaxInt) {
    return Status::invalid(
        "flashkda: argument 'q': expected B and the sequence count N below 2^31, T below 2^31 - " +
        std::to_string(kChunkTokens - 1) + " on CUDA, got B = " + std::to_string(B) +
        ", T = " + std::to_string(T) + ", N = " + std::to_string(N));
  }
  return Status::ok_status();
}

}  // namespace detail

namespace {

// ---------------------------------------------------------------------------------------------
// Formatting

std::string list_str(const int64_t* v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

int rank_of(const TensorRef& t) { return std::min(std::max(t.ndim, 0), kMaxRank); }
std::string shape_str(const TensorRef& t) { return list_str(t.sizes, rank_of(t)); }
std::string strides_str(const TensorRef& t) { return list_str(t.strides, rank_of(t)); }
std::string shape_str(std::initializer_list<int64_t> s) {
  std::vector<int64_t> v(s);
  return list_str(v.data(), static_cast<int>(v.size()));
}

std::string device_str(DeviceType d, int index) {
  return (d == DeviceType::kCPU ? std::string("cpu") : std::string("cuda")) + ":" + std::to_string(index);
}

std::string float_str(double x) {
  std::ostringstream os;
  os.precision(9);
  os << x;
  return os.str();
}

Status bad(const char* name, const std::string& expected, const std::string& got) {
  return Status::invalid(std::string("flashkda: argument '") + name + "': expected " + expected + ", got " +
                         got);
}

// The dtype of a given tensor as errors name it: the caller's own name for a dtype flashkda has no
// DType for (TensorRef::other_dtype_name), else flashkda's.
std::string given_dtype_name(const TensorRef& t) {
  if (t.dtype == DType::kOther && t.other_dtype_name != nullptr) return t.other_dtype_name;
  return dtype_name(t.dtype);
}

// ---------------------------------------------------------------------------------------------
// Building blocks.  Each returns ok or the error for argument `name`.

Status check_given(const char* name, const TensorRef& t, const char* layout) {
  if (!t.defined()) return bad(name, std::string("a tensor ") + layout, "none");
  return Status::ok_status();
}

Status check_rank(const char* name, const TensorRef& t, int rank, const char* layout) {
  if (t.ndim != rank) {
    return bad(name, "rank " + std::to_string(rank) + " " + layout,
               "rank " + std::to_string(t.ndim) + (t.ndim <= kMaxRank ? " " + shape_str(t) : std::string()));
  }
  for (int i = 0; i < rank; ++i) {
    if (t.sizes[i] < 0) return bad(name, "non-negative sizes", shape_str(t));
  }
  return Status::ok_status();
}

Status check_dtype(const char* name, const TensorRef& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return Status::ok_status();
  }
  std::string exp = "dtype ";
  int i = 0;
  for (DType d : allowed) {
    if (i++) exp += " or ";
    exp += dtype_name(d);
  }
  return bad(name, exp, given_dtype_name(t));
}

Status check_shape(const char* name, const TensorRef& t, std::initializer_list<int64_t> expected,
                   const char* labels) {
  int i = 0;
  bool same = t.ndim == static_cast<int>(expected.size());
  for (int64_t e : expected) {
    if (!same) break;
    if (t.sizes[i++] != e) same = false;
  }
  if (!same) return bad(name, "shape " + shape_str(expected) + " " + labels, shape_str(t));
  return Status::ok_status();
}

// The last two dims form a contiguous [H, D] block (D = sizes[r-1]); the outer strides are free
// but non-negative.  For rank 3 (beta) only the last dim must be contiguous.
Status check_token_block(const char* name, const TensorRef& t, bool two_inner_dims, const char* what) {
  const int r = t.ndim;
  bool ok = t.sizes[r - 1] <= 1 || t.strides[r - 1] == 1;
  if (two_inner_dims) ok = ok && (t.sizes[r - 2] <= 1 || t.strides[r - 2] == t.sizes[r - 1]);
  const int outer = two_inner_dims ? r - 2 : r - 1;
  for (int i = 0; i < outer; ++i) ok = ok && (t.sizes[i] <= 1 || t.strides[i] >= 0);
  if (!ok) {
    std::string exp = "strides [";
    for (int i = 0; i < outer; ++i) exp += i ? ", >=0" : ">=0";
    if (two_inner_dims) exp += ", " + std::to_string(t.sizes[r - 1]);
    exp += ", 1] (" + std::string(what) + ")";
    return bad(name, exp, "strides " + strides_str(t));
  }
  return Status::ok_status();
}

bool is_contiguous(const TensorRef& t) {
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.sizes[d] == 0) return true;
    if (t.sizes[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.sizes[d];
  }
  return true;
}

Status check_contiguous(const char* name, const TensorRef& t) {
  if (!is_contiguous(t)) return bad(name, "a contiguous tensor", "strides " + strides_str(t));
  return Status::ok_status();
}

Status check_data(const char* name, const TensorRef& t) {
  const int64_t n = t.numel();
  if (t.data == nullptr && n != 0) {
    return bad(name, "a non-null data pointer", "null with " + std::to_string(n) + " elements");
  }
  return Status::ok_status();
}

// Output [B, T, H, V] with a contiguous [H, V] block: the (batch, token) placement must not make two
// tokens share memory (sufficient test: sorted by stride, each dim clears the extent of the inner).
Status check_no_self_overlap(const char* name, const TensorRef& t) {
  struct Dim {
    int64_t size, stride;
  };
  std::vector<Dim> dims;
  for (int i = 0; i < 2; ++i) {
    if (t.sizes[i] > 1) dims.push_back({t.sizes[i], t.strides[i]});
  }
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  int64_t extent = t.sizes[2] * t.sizes[3];
  for (const Dim& d : dims) {
    if (d.stride < extent)
      return bad(name, "non-overlapping batch and token strides", "strides " + strides_str(t));
    extent = d.stride * d.size;
  }
  return Status::ok_status();
}

#define FLASHKDA_TRY(expr)     \
  do {                         \
    Status _st = (expr);       \
    if (!_st.ok()) return _st; \
  } while (0)
int64_t read_index(const TensorRef& t, int64_t i) {
  const char* base = static_cast<const char*>(t.data);
  const int64_t off = i * t.strides[0];
  if (t.dtype == DType::kInt32) return reinterpret_cast<const int32_t*>(base)[off];
  return reinterpret_cast<const int64_t*>(base)[off];
}

// Element (i, j) of a 2-D int32 / int64 tensor.
int64_t read_index2(const TensorRef& t, int64_t i, int64_t j) {
  const char* base = static_cast<const char*>(t.data);
  const int64_t off = i * t.strides[0] + j * t.strides[1];
  if (t.dtype == DType::kInt32) return reinterpret_cast<const int32_t*>(base)[off];
  return reinterpret_cast<const int64_t*>(base)[off];
}

// First and one-past-last byte a non-empty strided tensor can touch (non-negative strides, as
// validated); for a contiguous tensor exactly the bytes it occupies.
void extent(const TensorRef& t, uintptr_t* lo, uintptr_t* hi) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.sizes[i] - 1) * t.strides[i];
  *lo = reinterpret_cast<uintptr_t>(t.data);
  *hi = *lo + static_cast<uintptr_t>(last + 1) * dtype_size(t.dtype);
}

// Whether the extents of two given, non-empty tensors intersect (exact for contiguous ones; strided
// views that interleave without sharing a byte count as overlapping).
bool overlaps(const TensorRef& a, const TensorRef& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  uintptr_t alo, ahi, blo, bhi;
  extent(a, &alo, &ahi);
  extent(b, &blo, &bhi);
  return alo < bhi && blo < ahi;
}

// Whether two given tensors are the same view: same memory, dtype, sizes and strides.
bool same_view(const TensorRef& a, const TensorRef& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.sizes[i] != b.sizes[i] || a.strides[i] != b.strides[i]) return false;
  }
  return true;
}

using NamedRef = std::pair<const char*, const TensorRef*>;

struct TokenDims {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0;
};

// The checks common to prefill and decode, in this order: q (defines B, T, H, K); the device of
// every given tensor (`others`: the op's remaining tensors, in the order errors should name them);
// k, v; the head dims; g, beta, out; the gate parameters and the scalars.  `Params` is PrefillParams
// or DecodeParams (the same member names).
template <class Params>
Status check_token_inputs(const Params& p, std::initializer_list<NamedRef> others, TokenDims* d) {
  // The labels say where each expected size comes from: when q itself is the wrong tensor, the error
  // names the first tensor that disagrees with it, and the label points back at q.
  const char* kBTHK = "(B, T, H, K of q)";

  // ---- q defines B, T, H, K.
  FLASHKDA_TRY(check_given("q", p.q, "[B, T, H, K]"));
  FLASHKDA_TRY(check_rank("q", p.q, 4, "[B, T, H, K]"));
  FLASHKDA_TRY(check_dtype("q", p.q, {DType::kBFloat16}));
  const int64_t B = p.q.sizes[0], T = p.q.sizes[1], H = p.q.sizes[2], K = p.q.sizes[3];
  if (H < 1) return bad("q", "H >= 1 heads", "H=" + std::to_string(H));
  FLASHKDA_TRY(check_token_block("q", p.q, true, "each token's [H, K] block contiguous"));

  // ---- devices: every given tensor where q is.
  {
    const bool gate_params = p.gate_mode != GateMode::kPrecomputed;
    std::vector<NamedRef> all = {
        {"k", &p.k},
        {"v", &p.v},
        {"g", &p.g},
        {"beta", &p.beta},
        {"A_log", gate_params ? &p.A_log : nullptr},
        {"dt_bias", gate_params ? &p.dt_bias : nullptr},
        {"out", &p.out},
    };
    all.insert(all.end(), others.begin(), others.end());
    for (const auto& a : all) {
      if (a.second == nullptr || !a.second->defined()) continue;
      if (a.second->device != p.q.device || a.second->device_index != p.q.device_index) {
        return bad(a.first, "device " + device_str(p.q.device, p.q.device_index) + " (that of q)",
                   device_str(a.second->device, a.second->device_index));
      }
    }
    if (p.q.device == DeviceType::kCUDA) {
      if (p.q.device_index < 0) return bad("q", "a CUDA device index >= 0", std::to_string(p.q.device_index));
      Status st = cuda_device_supported(p.q.device_index);
      if (!st.ok()) return st;
    } else if (p.q.device != DeviceType::kCPU) {
      return bad("q", "device cpu or cuda", "device type " + std::to_string(static_cast<int>(p.q.device)));
    }
  }
  FLASHKDA_TRY(check_data("q", p.q));

  // ---- k, v
  FLASHKDA_TRY(check_given("k", p.k, "[B, T, H, K]"));
  FLASHKDA_TRY(check_rank("k", p.k, 4, "[B, T, H, K]"));
  FLASHKDA_TRY(check_dtype("k", p.k, {DType::kBFloat16}));
  FLASHKDA_TRY(check_shape("k", p.k, {B, T, H, K}, kBTHK));
  FLASHKDA_TRY(check_token_block("k", p.k, true, "each token's [H, K] block contiguous"));
  FLASHKDA_TRY(check_data("k", p.k));

  FLASHKDA_TRY(check_given("v", p.v, "[B, T, H, V]"));
  FLASHKDA_TRY(check_rank("v", p.v, 4, "[B, T, H, V]"));
  FLASHKDA_TRY(check_dtype("v", p.v, {DType::kBFloat16}));
  const int64_t V = p.v.sizes[3];
  FLASHKDA_TRY(check_shape("v", p.v, {B, T, H, V}, "(B, T, H of q, V)"));
  FLASHKDA_TRY(check_token_block("v", p.v, true, "each token's [H, V] block contiguous"));
  FLASHKDA_TRY(check_data("v", p.v));

  // ---- head dims (a valid KDA problem the kernels do not cover: not_implemented)
  if (K != 64 && K != 128) {
    return Status::not_implemented("flashkda: argument 'q': expected head dim K == V in {64, 128}, got K=" +
                                   std::to_string(K) + ", V=" + std::to_string(V));
  }
  if (V != K) {
    return Status::not_implemented("flashkda: argument 'v': expected head dim K == V in {64, 128}, got K=" +
                                   std::to_string(K) + ", V=" + std::to_string(V));
  }

  // ---- g, beta, out
  FLASHKDA_TRY(check_given("g", p.g, "[B, T, H, K]"));
  FLASHKDA_TRY(check_rank("g", p.g, 4, "[B, T, H, K]"));
  FLASHKDA_TRY(check_dtype("g", p.g, {DType::kBFloat16, DType::kFloat32}));
  FLASHKDA_TRY(check_shape("g", p.g, {B, T, H, K}, kBTHK));
  FLASHKDA_TRY(check_token_block("g", p.g, true, "each token's [H, K] block contiguous"));
  FLASHKDA_TRY(check_data("g", p.g));

  FLASHKDA_TRY(check_given("beta", p.beta, "[B, T, H]"));
  FLASHKDA_TRY(check_rank("beta", p.beta, 3, "[B, T, H]"));
  FLASHKDA_TRY(check_dtype("beta", p.beta, {DType::kBFloat16, DType::kFloat32}));
  FLASHKDA_TRY(check_shape("beta", p.beta, {B, T, H}, "(B, T, H of q)"));
  FLASHKDA_TRY(check_token_block("beta", p.beta, false, "each token's [H] row contiguous"));
  FLASHKDA_TRY(check_data("beta", p.beta));

  FLASHKDA_TRY(check_given("out", p.out, "[B, T, H, V]"));
  FLASHKDA_TRY(check_rank("out", p.out, 4, "[B, T, H, V]"));
  FLASHKDA_TRY(check_dtype("out", p.out, {DType::kBFloat16}));
  FLASHKDA_TRY(check_shape("out", p.out, {B, T, H, V}, "(B, T, H of q, V of v)"));
  FLASHKDA_TRY(check_token_block("out", p.out, true, "each token's [H, V] block contiguous"));
  FLASHKDA_TRY(check_no_self_overlap("out", p.out));
  FLASHKDA_TRY(check_data("out", p.out));

  // ---- gate parameters and scalars
  if (p.gate_mode != GateMode::kBounded && p.gate_mode != GateMode::kSoftplus &&
      p.gate_mode != GateMode::kPrecomputed) {
    return bad("gate_mode", "bounded, softplus or precomputed",
               std::to_string(static_cast<int>(p.gate_mode)));
  }
  if (p.gate_mode != GateMode::kPrecomputed) {
    const std::string why = std::string(" (required by the ") + gate_mode_name(p.gate_mode) + " gate)";
    FLASHKDA_TRY(check_given("A_log", p.A_log, ("[H] float32" + why).c_str()));
    FLASHKDA_TRY(check_rank("A_log", p.A_log, 1, "[H]"));
    FLASHKDA_TRY(check_dtype("A_log", p.A_log, {DType::kFloat32}));
    FLASHKDA_TRY(check_shape("A_log", p.A_log, {H}, "(H)"));
    FLASHKDA_TRY(check_contiguous("A_log", p.A_log));
    FLASHKDA_TRY(check_data("A_log", p.A_log));

    FLASHKDA_TRY(check_given("dt_bias", p.dt_bias, ("[H, K] float32" + why).c_str()));
    FLASHKDA_TRY(check_dtype("dt_bias", p.dt_bias, {DType::kFloat32}));
    const bool shape_ok = (p.dt_bias.ndim == 2 && p.dt_bias.sizes[0] == H && p.dt_bias.sizes[1] == K) ||
                          (p.dt_bias.ndim == 1 && p.dt_bias.sizes[0] == H * K);
    if (!shape_ok) {
      return bad("dt_bias", "shape " + shape_str({H, K}) + " (H, K) or " + shape_str({H * K}) + " (H*K)",
                 p.dt_bias.ndim >= 0 && p.dt_bias.ndim <= kMaxRank
                     ? shape_str(p.dt_bias)
                     : "rank " + std::to_string(p.dt_bias.ndim));
    }
    FLASHKDA_TRY(check_contiguous("dt_bias", p.dt_bias));
    FLASHKDA_TRY(check_data("dt_bias", p.dt_bias));
  }
  if (p.gate_mode == GateMode::kBounded) {
    const float lb = p.lower_bound;
    if (!std::isfinite(lb) || !(lb >= -5.0f && lb < 0.0f)) {
      return bad("lower_bound", "a finite value in [-5, 0)", float_str(lb));
    }
  }
  // Negative scales are rejected rather than replaced: the kernels bound MQK by |scale| |q| |k|, and
  // a silent K^-0.5 for a negative value would differ from what the caller asked for.
  if (!std::isfinite(p.scale) || p.scale < 0.0f) {
    return bad("scale", "a finite value > 0, or 0 for K^-0.5", float_str(p.scale));
  }

  d->B = B;
  d->T = T;
  d->H = H;
  d->K = K;
  d->V = V;
  return Status::ok_status();
}

// token_rows [T] (optional, varlen layout only): logical token t reads its inputs from, and writes
// its output to, row token_rows[t] of dim 1 of the token tensors (R rows).  Shared by prefill and
// decode.  Sets *T to the logical token count (R when not given).  The values are checked when on
// the host (in [0, R), distinct); on CUDA the kernels check the range (DeviceError kBadTokenRow).
Status check_token_rows(const TensorRef& tr, bool varlen, int64_t B, int64_t R, int64_t* T) {
  *T = R;
  if (!tr.defined()) return Status::ok_status();
  if (!varlen) {
    return bad("token_rows", "cu_seqlens to be given with it (the varlen layout, B == 1)", "no cu_seqlens");
  }
  if (B != 1) {
    return bad("token_rows", "B == 1 (the varlen layout: q of shape [1, R, H, K])", "B=" + std::to_string(B));
  }
  FLASHKDA_TRY(check_rank("token_rows", tr, 1, "[T] (one row per logical token)"));
  FLASHKDA_TRY(check_dtype("token_rows", tr, {DType::kInt32, DType::kInt64}));
  FLASHKDA_TRY(check_contiguous("token_rows", tr));
  FLASHKDA_TRY(check_data("token_rows", tr));
  *T = tr.sizes[0];
  // Distinct values in [0, R) are at most R of them, whatever they are: checked from the shapes
  // (for CUDA tensors the values are the kernels' to check, and with R = 0 there is no row a kernel
  // could clamp a value into).
  if (*T > R) {
    return bad(
        "token_rows",
        "at most R = " + std::to_string(R) + " values (distinct rows of dim 1 of q, k, v, g, beta and out)",
        std::to_string(*T) + " values");
  }
  if (tr.device == DeviceType::kCPU) {
    std::unordered_map<int64_t, int64_t> user;  // row -> the token that maps to it
    user.reserve(static_cast<size_t>(*T));
    for (int64_t t = 0; t < *T; ++t) {
      const int64_t r = read_index(tr, t);
      if (r < 0 || r >= R) {
        return bad("token_rows",
                   "values in [0, " + std::to_string(R) + ") (rows of dim 1 of q, k, v, g, beta and out)",
                   "token_rows[" + std::to_string(t) + "] = " + std::to_string(r));
      }
      auto ins = user.emplace(r, t);
      if (!ins.second) {
        return bad("token_rows", "distinct values (each row read and written by one token)",
                   "token_rows[" + std::to_string(t) + "] = token_rows[" + std::to_string(ins.first->second) +
                       "] = " + std::to_string(r));
      }
    }
  }
  return Status::ok_status();
}

// cu_seqlens [N+1] (then B == 1); values checked when on the host.  Sets *N.  T: the logical token
// count (the length of token_rows when given: `mapped`).
Status check_cu_seqlens(const TensorRef& cu, int64_t B, int64_t T, int64_t* N, bool mapped) {
  FLASHKDA_TRY(check_rank("cu_seqlens", cu, 1, "[N+1]"));
  FLASHKDA_TRY(check_dtype("cu_seqlens", cu, {DType::kInt32, DType::kInt64}));
  if (cu.sizes[0] < 1) return bad("cu_seqlens", "at least 1 element [N+1]", shape_str(cu));
  FLASHKDA_TRY(check_contiguous("cu_seqlens", cu));
  FLASHKDA_TRY(check_data("cu_seqlens", cu));
  if (B != 1) {
    return bad("cu_seqlens", "B == 1 (q of shape [1, total_tokens, H, K]) when cu_seqlens is given",
               "B=" + std::to_string(B));
  }
  *N = cu.sizes[0] - 1;
  // No sequence, yet tokens: cu_seqlens[N] == T cannot hold whatever its value.  Known from the
  // shapes, so it is refused here for every device (on CUDA the kernels would otherwise have no
  // request to find it in).
  if (*N == 0 && T != 0) {
    return bad("cu_seqlens",
               "at least 2 elements [N+1] for T = " + std::to_string(T) + " tokens" +
                   (mapped ? " (the length of token_rows)" : ""),
               shape_str(cu));
  }
  if (cu.device == DeviceType::kCPU) {
    const int64_t first = read_index(cu, 0);
    if (first != 0) return bad("cu_seqlens", "cu_seqlens[0] == 0", std::to_string(first));
    int64_t prev = first;
    for (int64_t i = 1; i <= *N; ++i) {
      const int64_t c = read_index(cu, i);
      if (c < prev) {
        return bad("cu_seqlens",
                   "non-decreasing values, cu_seqlens[" + std::to_string(i) + "] >= cu_seqlens[" +
                       std::to_string(i - 1) + "] = " + std::to_string(prev),
                   "cu_seqlens[" + std::to_string(i) + "] = " + std::to_string(c));
      }
      prev = c;
    }
    if (prev != T) {
      return bad("cu_seqlens",
                 "cu_seqlens[" + std::to_string(*N) + "] == T = " + std::to_string(T) +
                     (mapped ? " (the length of token_rows)" : ""),
                 std::to_string(prev));
    }
  }
  return Status::ok_status();
}

// Token count of sequence n (host cu_seqlens or the fixed length T).
int64_t seq_len(const TensorRef& cu, int64_t T, int64_t n) {
  if (!cu.defined()) return T;
  return read_index(cu, n + 1) - read_index(cu, n);
}

// CUDA launch limits that validation can see from the sizes (the kernels take B, T, H, N as int and
// put the heads on a grid dimension of at most 65535 blocks): reported here, before anything runs,
// rather than by the launcher after earlier kernels of the call have written.
Status check_cuda_sizes(const TensorRef& q, int64_t B, int64_t T, int64_t H, int64_t N) {
  if (q.device != DeviceType::kCUDA) return Status::ok_status();
  return detail::cuda_size_limits(B, T, H, N);
}

// Written tensor `name` must not share memory with tensor `other_name` (which the call writes too, or
// reads after writing `name`), judged by overlaps().
Status check_apart(const char* name, const TensorRef& t, const char* other_name, const TensorRef& other,
                   const char* why) {
  if (overlaps(t, other)) {
    return bad(name, std::string("no memory shared with ") + other_name + why,
               std::string("an overlap with ") + other_name);
  }
  return Status::ok_status();
}

// The kernels move states (pool rows, checkpoint states) in 16-byte pieces on CUDA.
Status check_aligned16_on_cuda(const char* name, const TensorRef& t) {
  const uintptr_t off = reinterpret_cast<uintptr_t>(t.data) & 15u;
  if (t.device == DeviceType::kCUDA && off != 0) {
    return bad(name, "a 16-byte aligned data pointer on CUDA",
               "one " + std::to_string(off) + " bytes past a 16-byte boundary");
  }
  return Status::ok_status();
}

// The token tensors' dims and the sequence layout, as prefill and decode both read them.
struct TokenLayout {
  int64_t B = 0, R = 0, H = 0, K = 0, V = 0;  // R: rows of dim 1 of the token tensors
  int64_t T = 0;                              // logical tokens (token_rows' length when given)
  int64_t N = 0;                              // sequences
  bool varlen = false;
};

// check_token_inputs, then token_rows and cu_seqlens (in that order).
template <class Params>
Status check_token_layout(const Params& p, std::initializer_list<NamedRef> others, TokenLayout* l) {
  TokenDims d;
  FLASHKDA_TRY(check_token_inputs(p, others, &d));
  l->B = d.B, l->R = d.T, l->H = d.H, l->K = d.K, l->V = d.V;
  l->N = d.B, l->T = d.T;
  l->varlen = p.cu_seqlens.defined();
  FLASHKDA_TRY(check_token_rows(p.token_rows, l->varlen, l->B, l->R, &l->T));
  if (l->varlen) FLASHKDA_TRY(check_cu_seqlens(p.cu_seqlens, l->B, l->T, &l->N, p.token_rows.defined()));
  return Status::ok_status();
}

// A per-sequence vector [N] (state_indices, has_initial_state, num_accepted_tokens).
Status check_per_sequence(const char* name, const TensorRef& t, int64_t N,
                          std::initializer_list<DType> dtypes) {
  FLASHKDA_TRY(check_rank(name, t, 1, "[N]"));
  FLASHKDA_TRY(check_dtype(name, t, dtypes));
  FLASHKDA_TRY(check_shape(name, t, {N}, "(N)"));
  FLASHKDA_TRY(check_contiguous(name, t));
  return check_data(name, t);
}

// A state pool [P, H, V, K] with P >= 1 (`with`: what makes the tensor a pool, for the message).
Status check_pool_shape(const char* name, const TensorRef& t, int64_t H, int64_t V, int64_t K,
                        const char* with) {
  if (t.sizes[0] < 1 || t.sizes[1] != H || t.sizes[2] != V || t.sizes[3] != K) {
    return bad(name,
               "shape [P, " + std::to_string(H) + ", " + std::to_string(V) + ", " + std::to_string(K) +
                   "] (P >= 1 pool rows, H, V, K)" + with,
               shape_str(t));
  }
  return Status::ok_status();
}

std::string at2(const char* name, int64_t i, int64_t j) {
  return std::string(name) + "[" + std::to_string(i) + ", " + std::to_string(j) + "]";
}
std::string at1(const char* name, int64_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

}  // namespace

Status can_implement(const PrefillParams& p, ProblemShape* shape) {
  // ---- token tensors, then token_rows -> T (logical tokens), cu_seqlens -> N
  TokenLayout l;
  FLASHKDA_TRY(check_token_layout(p,
                                  {{"initial_state", &p.initial_state},
                                   {"final_state", &p.final_state},
                                   {"cu_seqlens", &p.cu_seqlens},
                                   {"state_indices", &p.state_indices},
                                   {"has_initial_state", &p.has_initial_state},
                                   {"checkpoint_offsets", &p.checkpoint_offsets},
                                   {"checkpoint_state", &p.checkpoint_state},
                                   {"token_rows", &p.token_rows}},
                                  &l));
  const int64_t B = l.B, R = l.R, H = l.H, K = l.K, V = l.V, N = l.N, T = l.T;
  const bool varlen = l.varlen;
  FLASHKDA_TRY(check_cuda_sizes(p.q, B, T, H, N));

  // ---- states
  const bool pooled = p.state_indices.defined();
  const std::pair<const char*, const TensorRef*> states[] = {{"initial_state", &p.initial_state},
                                                             {"final_state", &p.final_state}};
  int64_t P = N;  // rows of the state tensors
  for (const auto& s : states) {
    const char* name = s.first;
    const TensorRef& t = *s.second;
    if (!t.defined()) continue;
    FLASHKDA_TRY(check_rank(name, t, 4, pooled ? "[P, H, V, K]" : "[N, H, V, K]"));
    FLASHKDA_TRY(check_dtype(name, t, {DType::kFloat32, DType::kBFloat16}));
    if (pooled) {
      FLASHKDA_TRY(check_pool_shape(name, t, H, V, K, " with state_indices"));
    } else {
      FLASHKDA_TRY(check_shape(name, t, {N, H, V, K}, "(N, H, V, K)"));
    }
    FLASHKDA_TRY(check_contiguous(name, t));
    FLASHKDA_TRY(check_data(name, t));
    P = t.sizes[0];
  }
  if (p.initial_state.defined() && p.final_state.defined()) {
    const TensorRef& a = p.initial_state;
    const TensorRef& f = p.final_state;
    if (f.dtype != a.dtype) {
      return bad("final_state", std::string("dtype ") + dtype_name(a.dtype) + " (that of initial_state)",
                 dtype_name(f.dtype));
    }
    if (f.sizes[0] != a.sizes[0]) {
      return bad("final_state", "shape " + shape_str(a) + " (that of initial_state)", shape_str(f));
    }
    if (f.data != a.data && overlaps(a, f)) {
      return bad("final_state",
                 "either the same memory as initial_state (in-place update) or no overlap with it",
                 "a partial overlap");
    }
  }

  // ---- state_indices
  if (pooled) {
    const TensorRef& si = p.state_indices;
    FLASHKDA_TRY(check_per_sequence("state_indices", si, N, {DType::kInt32, DType::kInt64}));
    if (!p.initial_state.defined() && !p.final_state.defined()) {
      return bad("state_indices", "initial_state or final_state (the state pool) to be given with it",
                 "neither");
    }
    if (si.device == DeviceType::kCPU) {
      std::unordered_map<int64_t, int64_t> first_use;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t idx = read_index(si, n);
        if (idx < 0) continue;  // padding
        if (idx >= P) {
          return bad("state_indices",
                     "values in [0, " + std::to_string(P) + ") (pool rows) or negative (padding)",
                     "state_indices[" + std::to_string(n) + "] = " + std::to_string(idx));
        }
        auto ins = first_use.emplace(idx, n);
        if (!ins.second) {
          return bad("state_indices", "distinct non-negative values (one state slot per sequence)",
                     "state_indices[" + std::to_string(n) + "] = state_indices[" +
                         std::to_string(ins.first->second) + "] = " + std::to_string(idx));
        }
      }
    }
  }

  // ---- has_initial_state
  if (p.has_initial_state.defined()) {
    FLASHKDA_TRY(check_per_sequence("has_initial_state", p.has_initial_state, N, {DType::kBool}));
    if (!p.initial_state.defined()) {
      return bad("has_initial_state", "initial_state to be given with it (it selects who starts from it)",
                 "no initial_state");
    }
  }

  // ---- checkpoints (spec section 5)
  int64_t n_ckpt = 0;
  if (p.checkpoint_offsets.defined() || p.checkpoint_state.defined()) {
    const TensorRef& co = p.checkpoint_offsets;
    const TensorRef& cs = p.checkpoint_state;
    FLASHKDA_TRY(
        check_given("checkpoint_offsets", co, "[N, n_ckpt] int32/int64 (given with checkpoint_state)"));
    FLASHKDA_TRY(check_rank("checkpoint_offsets", co, 2, "[N, n_ckpt]"));
    FLASHKDA_TRY(check_dtype("checkpoint_offsets", co, {DType::kInt32, DType::kInt64}));
    n_ckpt = co.sizes[1];
    // The CUDA checkpoint pass launches N n_ckpt H (V / rows a block) blocks on one grid dimension;
    // N n_ckpt H V < 2^31 bounds it for every row slicing, checked here before any kernel writes.
    if (co.device == DeviceType::kCUDA && N > 0 && H > 0 && n_ckpt > ((int64_t{0x7fffffff} / N) / H) / V) {
      return bad("checkpoint_offsets", "N x n_ckpt x H x V below 2^31 on CUDA",
                 std::to_string(N) + " x " + std::to_string(n_ckpt) + " x " + std::to_string(H) + " x " +
                     std::to_string(V));
    }
    FLASHKDA_TRY(check_shape("checkpoint_offsets", co, {N, n_ckpt}, "(N, n_ckpt)"));
    FLASHKDA_TRY(check_contiguous("checkpoint_offsets", co));
    FLASHKDA_TRY(check_data("checkpoint_offsets", co));

    FLASHKDA_TRY(
        check_given("checkpoint_state", cs, "[N, n_ckpt, H, V, K] float32 (given with checkpoint_offsets)"));
    FLASHKDA_TRY(check_rank("checkpoint_state", cs, 5, "[N, n_ckpt, H, V, K]"));
    FLASHKDA_TRY(check_dtype("checkpoint_state", cs, {DType::kFloat32}));
    FLASHKDA_TRY(check_shape("checkpoint_state", cs, {N, n_ckpt, H, V, K}, "(N, n_ckpt, H, V, K)"));
    FLASHKDA_TRY(check_contiguous("checkpoint_state", cs));
    FLASHKDA_TRY(check_data("checkpoint_state", cs));
    FLASHKDA_TRY(check_aligned16_on_cuda("checkpoint_state", cs));
    for (const auto& s : states) {
      if (overlaps(cs, *s.second)) {
        return bad("checkpoint_state", std::string("no memory shared with ") + s.first, "an overlap");
      }
    }

    // Offset values: checked here for host tensors; the kernels check device ones
    // (DeviceError kBadCheckpointOffset).
    for (int64_t n = 0; co.device == DeviceType::kCPU && n < N; ++n) {
      const int64_t len = varlen ? seq_len(p.cu_seqlens, T, n) : T;
      int64_t prev = 0;
      for (int64_t j = 0; j < n_ckpt; ++j) {
        const int64_t off = read_index2(co, n, j);
        if (off < prev || off > len) {
          const std::string lo = j == 0 ? std::string("0") : at2("checkpoint_offsets", n, j - 1);
          return bad("checkpoint_offsets",
                     "values in [" + lo + ", length of sequence " + std::to_string(n) + " = " +
                         std::to_string(len) + "] (non-decreasing token offsets in each row)",
                     at2("checkpoint_offsets", n, j) + " = " + std::to_string(off));
        }
        prev = off;
      }
    }
  }

  // ---- out apart from what the call writes besides it; with checkpoints every written tensor apart
  // from the inputs too (the checkpoint pass reads them again after out and the states are written)
  for (const auto& s : states) FLASHKDA_TRY(check_apart("out", p.out, s.first, *s.second, ""));
  FLASHKDA_TRY(check_apart("out", p.out, "checkpoint_state", p.checkpoint_state, ""));
  // The state walk reads each chunk's v rows itself (it forms T_inv diag(b) (v - kt S^T)) while other blocks
  // write out and the final states: out may be v itself (a block writes exactly the slice of the rows
  // it has read) but no other view of v's memory, and final_state nothing of v.
  if (!same_view(p.out, p.v)) {
    FLASHKDA_TRY(check_apart("out", p.out, "v", p.v,
                             " (unless out is v itself: the state walk reads v while it writes out)"));
  }
  FLASHKDA_TRY(check_apart("final_state", p.final_state, "v", p.v,
                           " (the state walk reads v while it writes final states)"));
  if (n_ckpt > 0) {
    const NamedRef written[] = {
        {"out", &p.out}, {"final_state", &p.final_state}, {"checkpoint_state", &p.checkpoint_state}};
    const NamedRef inputs[] = {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"g", &p.g}, {"beta", &p.beta}};
    for (const auto& w : written) {
      for (const auto& in : inputs) {
        FLASHKDA_TRY(check_apart(w.first, *w.second, in.first, *in.second,
                                 " (checkpoints read the inputs after it is written)"));
      }
    }
  }

  if (shape) {
    shape->B = B;
    shape->T = T;
    shape->H = H;
    shape->K = K;
    shape->V = V;
    shape->N = N;
    shape->total_tokens = B * T;
    shape->varlen = varlen;
    shape->num_checkpoints = n_ckpt;
    shape->rows = R;
  }
  return Status::ok_status();
}

Status can_implement_decode(const DecodeParams& p, DecodeShape* shape) {
  // ---- token tensors, then token_rows -> T (logical tokens), cu_seqlens -> N
  TokenLayout l;
  FLASHKDA_TRY(check_token_layout(p,
                                  {{"state_pool", &p.state_pool},
                                   {"ssm_state_indices", &p.ssm_state_indices},
                                   {"num_accepted_tokens", &p.num_accepted_tokens},
                                   {"cu_seqlens", &p.cu_seqlens},
                                   {"token_rows", &p.token_rows}},
                                  &l));
  const int64_t B = l.B, R = l.R, H = l.H, K = l.K, V = l.V, N = l.N, T = l.T;
  const bool varlen = l.varlen;
  FLASHKDA_TRY(check_cuda_sizes(p.q, B, T, H, N));

  // ---- state pool
  const TensorRef& pool = p.state_pool;
  FLASHKDA_TRY(check_given("state_pool", pool, "[P, H, V, K] float32/bfloat16"));
  FLASHKDA_TRY(check_rank("state_pool", pool, 4, "[P, H, V, K]"));
  FLASHKDA_TRY(check_dtype("state_pool", pool, {DType::kFloat32, DType::kBFloat16}));
  FLASHKDA_TRY(check_pool_shape("state_pool", pool, H, V, K, ""));
  FLASHKDA_TRY(check_aligned16_on_cuda("state_pool", pool));  // the decode kernels' 16-byte pieces
  FLASHKDA_TRY(check_contiguous("state_pool", pool));
  FLASHKDA_TRY(check_data("state_pool", pool));
  FLASHKDA_TRY(check_apart("out", p.out, "state_pool", pool, ""));
  // The decode kernels split a request's state rows over blocks that each read the whole q / k / g
  // rows and beta of its tokens while the others write their slices of out: out apart from them (v is
  // read per row slice, by the block that writes the same slice of out: out may be v).
  {
    const NamedRef inputs[] = {{"q", &p.q}, {"k", &p.k}, {"g", &p.g}, {"beta", &p.beta}};
    for (const auto& in : inputs) {
      FLASHKDA_TRY(check_apart("out", p.out, in.first, *in.second, " (read by the blocks that write out)"));
    }
  }
  const int64_t P = pool.sizes[0];

  // ---- ssm_state_indices: [N] or [N, S]
  const TensorRef& si = p.ssm_state_indices;
  FLASHKDA_TRY(check_given("ssm_state_indices", si, "[N] or [N, S] int32/int64"));
  if (si.ndim != 1 && si.ndim != 2) {
    return bad(
        "ssm_state_indices", "rank 1 [N] or rank 2 [N, S]",
        "rank " + std::to_string(si.ndim) + (si.ndim <= kMaxRank ? " " + shape_str(si) : std::string()));
  }
  FLASHKDA_TRY(check_dtype("ssm_state_indices", si, {DType::kInt32, DType::kInt64}));
  const bool spec = si.ndim == 2;
  int64_t S = 1;
  if (spec) {
    S = si.sizes[1];
    if (varlen) {
      if (si.sizes[0] != N || S < 1) {
        return bad("ssm_state_indices",
                   "shape [" + std::to_string(N) + ", S] (N requests, S >= 1 slots per request)",
                   shape_str(si));
      }
    } else {
      FLASHKDA_TRY(check_shape("ssm_state_indices", si, {N, T}, "(N, T): one write slot per token"));
      if (N > 0 && S < 1) {
        return bad("ssm_state_indices",
                   "shape [N, T] with T >= 1 (one write slot per token, the read slot among them)",
                   shape_str(si));
      }
    }
  } else {
    FLASHKDA_TRY(check_shape("ssm_state_indices", si, {N}, "(N)"));
  }
  FLASHKDA_TRY(check_contiguous("ssm_state_indices", si));
  FLASHKDA_TRY(check_data("ssm_state_indices", si));

  // ---- num_accepted_tokens: [N], with 2-D indices only
  const TensorRef& na = p.num_accepted_tokens;
  if (spec) {
    FLASHKDA_TRY(
        check_given("num_accepted_tokens", na, "[N] int32/int64 (required with 2-D ssm_state_indices)"));
    FLASHKDA_TRY(check_per_sequence("num_accepted_tokens", na, N, {DType::kInt32, DType::kInt64}));
  } else if (na.defined()) {
    return bad("num_accepted_tokens",
               "none with 1-D ssm_state_indices (it selects the read slot of 2-D ones)",
               "a tensor " + (na.ndim <= kMaxRank ? shape_str(na) : "of rank " + std::to_string(na.ndim)));
  }

  // ---- index values (host tensors only; the kernel checks device ones)
  if (p.q.device == DeviceType::kCPU) {
    // Range of every entry.
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < S; ++j) {
        const int64_t idx = spec ? read_index2(si, n, j) : read_index(si, n);
        if (idx >= P) {
          return bad("ssm_state_indices",
                     "values < P = " + std::to_string(P) + " (pool rows; negative values mean padding)",
                     (spec ? at2("ssm_state_indices", n, j) : at1("ssm_state_indices", n)) + " = " +
                         std::to_string(idx));
        }
      }
    }
    if (spec) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t acc = read_index(na, n);
        if (acc < 1 || acc > S) {
          return bad("num_accepted_tokens",
                     "values in [1, " + std::to_string(S) + "] (1 + accepted drafts; S = slots per request)",
                     at1("num_accepted_tokens", n) + " = " + std::to_string(acc));
        }
      }
    }
    // Read slot of each request (negative: padded), token counts, and the write slots.
    std::vector<int64_t> read_slot(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      read_slot[n] = spec ? read_index2(si, n, read_index(na, n) - 1) : read_index(si, n);
    }
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> writer;  // pool row -> (request, column)
    for (int64_t n = 0; n < N; ++n) {
      if (read_slot[n] < 0) continue;  // padded: nothing read or written
      const int64_t len = seq_len(p.cu_seqlens, T, n);
      if (spec && len > S) {
        return bad("ssm_state_indices",
                   std::to_string(len) + " write slots for request " + std::to_string(n) + " (one per token)",
                   std::to_string(S) + " columns");
      }
      const int64_t n_writes = spec ? len : 1;
      for (int64_t j = 0; j < n_writes; ++j) {
        const int64_t w = spec ? read_index2(si, n, j) : read_slot[n];
        if (w < 0) continue;  // skipped write
        auto ins = writer.emplace(w, std::make_pair(n, j));
        if (!ins.second) {
          const auto& prev = ins.first->second;
          const std::string a = spec ? at2("ssm_state_indices", n, j) : at1("ssm_state_indices", n);
          const std::string b =
              spec ? at2("ssm_state_indices", prev.first, prev.second) : at1("ssm_state_indices", prev.first);
          return bad("ssm_state_indices",
                     "distinct non-negative write slots (each pool row written at most once per call)",
                     a + " = " + b + " = " + std::to_string(w));
        }
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      if (read_slot[n] < 0) continue;
      auto it = writer.find(read_slot[n]);
      if (it != writer.end() && it->second.first != n) {
        const int64_t m = it->second.first;
        return bad("ssm_state_indices",
                   "no pool row read by one request and written by another (request " + std::to_string(n) +
                       " reads row " + std::to_string(read_slot[n]) + ")",
                   "row " + std::to_string(read_slot[n]) + " written by request " + std::to_string(m) + " (" +
                       (spec ? at2("ssm_state_indices", m, it->second.second) : at1("ssm_state_indices", m)) +
                       ")");
      }
    }
  }

  // CUDA index tensors: the kernel checks the values (DeviceError kBadStateIndex, kBadAcceptedCount,
  // kStateSlotConflict) and writes nothing on a bad one.

  if (shape) {
    shape->B = B;
    shape->T = T;
    shape->H = H;
    shape->K = K;
    shape->V = V;
    shape->N = N;
    shape->P = P;
    shape->slots = S;
    shape->total_tokens = B * T;
    shape->rows = R;
    shape->varlen = varlen;
    shape->spec = spec;
  }
  return Status::ok_status();
}

}  // namespace flashkda
