// PyTorch binding of the torch-free FlashKDA API: the ops torch.ops.flashkda.*.
//
// This is a plain shared library (no pybind): `torch.ops.load_library(path)` runs the static
// registrations below.  The prefill ops funnel into one function, run_prefill(), that turns the
// at::Tensors into flashkda::TensorRefs, lets flashkda::can_implement() judge them (so the error
// names the argument, the expected and the given value), and then calls flashkda::run() on the
// current stream; the decode op does the same in decode_impl() (flashkda::can_implement_decode,
// flashkda::run_decode).  Status codes map onto Python exceptions:
//   kInvalidArgument -> ValueError, kNotImplemented -> NotImplementedError, others -> RuntimeError.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flashkda/decode.h"
#include "flashkda/flashkda.h"

#if defined(FLASHKDA_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace flashkda_torch {
namespace {

using flashkda::DType;
using flashkda::Status;
using flashkda::TensorRef;

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    case c10::ScalarType::Bool:
      return DType::kBool;
    default:
      return DType::kOther;
  }
}

// torch's name of a dtype ("int16", "float8_e4m3fn"), as a string that outlives the call (errors
// name the dtype a caller gave when flashkda has no DType for it).
const char* torch_dtype_name(c10::ScalarType t) {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
      const auto t = static_cast<c10::ScalarType>(i);
      try {
        v.push_back(c10::getDtypeNames(t).first);
      } catch (const std::exception&) {  // a dtype torch has no Python name for
        v.push_back(c10::toString(t));
      }
    }
    return v;
  }();
  const int i = static_cast<int>(t);
  return i >= 0 && i < static_cast<int>(names.size()) && !names[i].empty() ? names[i].c_str()
                                                                           : c10::toString(t);
}

// Describes `t` (named `name` in errors).  A tensor the TensorRef cannot describe at all (rank
// above kMaxRank, a device other than CPU/CUDA) is reported here; everything else is judged by
// flashkda::can_implement.
TensorRef to_ref(const at::Tensor& t, const char* name) {
  TensorRef r;
  if (!t.defined()) return r;  // ndim = -1: "not given"
  TORCH_CHECK_VALUE(t.dim() <= flashkda::kMaxRank, "flashkda: argument '", name, "': expected at most ",
                    flashkda::kMaxRank, " dimensions, got ", t.dim(), " (shape ", t.sizes(), ")");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "flashkda: argument '", name,
                    "': expected a CPU or CUDA tensor, got one on ", t.device());
  r.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  r.dtype = to_dtype(t.scalar_type());
  if (r.dtype == DType::kOther) r.other_dtype_name = torch_dtype_name(t.scalar_type());
  r.ndim = static_cast<int>(t.dim());
  for (int i = 0; i < r.ndim; ++i) {
    r.sizes[i] = t.size(i);
    r.strides[i] = t.stride(i);
  }
  r.device = t.device().is_cuda() ? flashkda::DeviceType::kCUDA : flashkda::DeviceType::kCPU;
  r.device_index = t.device().is_cuda() ? t.device().index() : 0;
  return r;
}

TensorRef to_ref(const c10::optional<at::Tensor>& t, const char* name) {
  return t.has_value() ? to_ref(*t, name) : TensorRef{};
}

void throw_status(const Status& s) {
  switch (s.code) {
    case Status::Code::kOk:
      return;
    case Status::Code::kInvalidArgument:
      TORCH_CHECK_VALUE(false, s.message);
    case Status::Code::kNotImplemented:
      TORCH_CHECK_NOT_IMPLEMENTED(false, s.message);
    default:
      TORCH_CHECK(false, s.message);
  }
}

flashkda::GateMode parse_gate_mode(c10::string_view mode) {
  if (mode == "bounded") return flashkda::GateMode::kBounded;
  if (mode == "softplus") return flashkda::GateMode::kSoftplus;
  if (mode == "precomputed") return flashkda::GateMode::kPrecomputed;
  TORCH_CHECK_VALUE(false, "flashkda: argument 'gate_mode': expected one of 'bounded', 'softplus', ",
                    "'precomputed', got '", std::string(mode.data(), mode.size()), "'");
  return flashkda::GateMode::kBounded;
}

struct Options {
  flashkda::GateMode gate_mode = flashkda::GateMode::kBounded;
  bool use_qk_l2norm = true;
  bool use_beta_sigmoid = true;
  double scale = 0.0;
  double lower_bound = -5.0;
};

// The token inputs and flags that prefill and decode share (PrefillParams and DecodeParams have the
// same member names for them).
template <class Params>
void set_token_args(Params* p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, const at::Tensor& out,
                    const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                    const c10::optional<at::Tensor>& cu_seqlens, const c10::optional<at::Tensor>& token_rows,
                    const Options& opt) {
  p->q = to_ref(q, "q");
  p->k = to_ref(k, "k");
  p->v = to_ref(v, "v");
  p->g = to_ref(g, "g");
  p->beta = to_ref(beta, "beta");
  p->A_log = to_ref(A_log, "A_log");
  p->dt_bias = to_ref(dt_bias, "dt_bias");
  p->out = to_ref(out, "out");
  p->cu_seqlens = to_ref(cu_seqlens, "cu_seqlens");
  p->token_rows = to_ref(token_rows, "token_rows");
  p->gate_mode = opt.gate_mode;
  p->use_qk_l2norm = opt.use_qk_l2norm;
  p->use_beta_sigmoid = opt.use_beta_sigmoid;
  p->scale = static_cast<float>(opt.scale);
  p->lower_bound = static_cast<float>(opt.lower_bound);
}

// The caller's workspace: any dtype, contiguous, on q's device.  CPU calls need none (an undefined or
// empty tensor gives a null pointer and 0 bytes).
struct WorkspaceView {
  void* ptr = nullptr;
  size_t bytes = 0;
};
WorkspaceView workspace_view(const at::Tensor& workspace, const at::Tensor& q) {
  WorkspaceView w;
  if (!workspace.defined() || workspace.numel() == 0) return w;
  TORCH_CHECK_VALUE(workspace.device() == q.device(), "flashkda: argument 'workspace': expected a tensor on ",
                    q.device(), " (the device of q), got one on ", workspace.device());
  TORCH_CHECK_VALUE(workspace.is_contiguous(),
                    "flashkda: argument 'workspace': expected a contiguous tensor, ", "got strides ",
                    workspace.strides());
  w.ptr = workspace.data_ptr();
  w.bytes = static_cast<size_t>(workspace.numel()) * workspace.element_size();
  return w;
}

// The current stream of q's device (null for CPU tensors).
flashkda::Stream current_stream(const at::Tensor& q) {
#if defined(FLASHKDA_TORCH_CUDA)
  if (q.is_cuda()) {
    return reinterpret_cast<flashkda::Stream>(c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  }
#endif
  (void)q;
  return nullptr;
}

// The prefill params of an op call (every prefill op, and prefill_check, builds them here).
flashkda::PrefillParams prefill_params(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& out, const c10::optional<at::Tensor>& A_log,
    const c10::optional<at::Tensor>& dt_bias, const c10::optional<at::Tensor>& initial_state,
    const c10::optional<at::Tensor>& final_state, const c10::optional<at::Tensor>& cu_seqlens,
    const c10::optional<at::Tensor>& state_indices, const c10::optional<at::Tensor>& has_initial_state,
    const c10::optional<at::Tensor>& checkpoint_offsets, const c10::optional<at::Tensor>& checkpoint_state,
    const c10::optional<at::Tensor>& token_rows, const Options& opt) {
  flashkda::PrefillParams p;
  set_token_args(&p, q, k, v, g, beta, out, A_log, dt_bias, cu_seqlens, token_rows, opt);
  p.initial_state = to_ref(initial_state, "initial_state");
  p.final_state = to_ref(final_state, "final_state");
  p.state_indices = to_ref(state_indices, "state_indices");
  p.has_initial_state = to_ref(has_initial_state, "has_initial_state");
  p.checkpoint_offsets = to_ref(checkpoint_offsets, "checkpoint_offsets");
  p.checkpoint_state = to_ref(checkpoint_state, "checkpoint_state");
  return p;
}

// The one path every prefill op takes.
void run_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, const at::Tensor& out, const at::Tensor& workspace,
                 const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                 const c10::optional<at::Tensor>& initial_state, const c10::optional<at::Tensor>& final_state,
                 const c10::optional<at::Tensor>& cu_seqlens, const c10::optional<at::Tensor>& state_indices,
                 const c10::optional<at::Tensor>& has_initial_state,
                 const c10::optional<at::Tensor>& checkpoint_offsets,
                 const c10::optional<at::Tensor>& checkpoint_state,
                 const c10::optional<at::Tensor>& token_rows, const Options& opt) {
  const flashkda::PrefillParams p =
      prefill_params(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, cu_seqlens,
                     state_indices, has_initial_state, checkpoint_offsets, checkpoint_state, token_rows, opt);
  flashkda::ProblemShape shape;
  throw_status(flashkda::can_implement(p, &shape));

  // At least workspace_size() bytes on the GPU.
  const WorkspaceView ws = workspace_view(workspace, q);
  if (q.is_cuda()) {
    const size_t need = flashkda::workspace_size(shape.total_tokens, shape.H, shape.N, shape.K);
    TORCH_CHECK_VALUE(ws.bytes >= need, "flashkda: argument 'workspace': expected at least ", need,
                      " bytes on ", q.device(), " (flashkda.get_workspace_size), got ", ws.bytes, " bytes");
  }
  throw_status(flashkda::run(p, ws.ptr, ws.bytes, current_stream(q)));
}

// fwd: the fused "Kimi" configuration (bounded gate, q/k l2norm, beta sigmoid).
void fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
              const at::Tensor& beta, double scale, const at::Tensor& out, const at::Tensor& workspace,
              const at::Tensor& A_log, const at::Tensor& dt_bias, double lower_bound,
              const c10::optional<at::Tensor>& initial_state, const c10::optional<at::Tensor>& final_state,
              const c10::optional<at::Tensor>& cu_seqlens) {
  const Options opt{flashkda::GateMode::kBounded, /*use_qk_l2norm=*/true, /*use_beta_sigmoid=*/true, scale,
                    lower_bound};
  run_prefill(q, k, v, g, beta, out, workspace, A_log, dt_bias, initial_state, final_state, cu_seqlens,
              c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, opt);
}

void prefill_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& out, const at::Tensor& workspace, double scale,
                  c10::string_view gate_mode, const c10::optional<at::Tensor>& A_log,
                  const c10::optional<at::Tensor>& dt_bias, double lower_bound, bool use_qk_l2norm,
                  bool use_beta_sigmoid, const c10::optional<at::Tensor>& initial_state,
                  const c10::optional<at::Tensor>& final_state, const c10::optional<at::Tensor>& cu_seqlens,
                  const c10::optional<at::Tensor>& state_indices,
                  const c10::optional<at::Tensor>& has_initial_state,
                  const c10::optional<at::Tensor>& checkpoint_offsets,
                  const c10::optional<at::Tensor>& checkpoint_state,
                  const c10::optional<at::Tensor>& token_rows) {
  const Options opt{parse_gate_mode(gate_mode), use_qk_l2norm, use_beta_sigmoid, scale, lower_bound};
  run_prefill(q, k, v, g, beta, out, workspace, A_log, dt_bias, initial_state, final_state, cu_seqlens,
              state_indices, has_initial_state, checkpoint_offsets, checkpoint_state, token_rows, opt);
}

// prefill_check: what prefill would say of these arguments, without running it or needing a
// workspace (flashkda.serving.kda_step checks every group of a step before the first one writes).
void prefill_check_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& out, double scale, c10::string_view gate_mode,
    const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias, double lower_bound,
    bool use_qk_l2norm, bool use_beta_sigmoid, const c10::optional<at::Tensor>& initial_state,
    const c10::optional<at::Tensor>& final_state, const c10::optional<at::Tensor>& cu_seqlens,
    const c10::optional<at::Tensor>& state_indices, const c10::optional<at::Tensor>& has_initial_state,
    const c10::optional<at::Tensor>& checkpoint_offsets, const c10::optional<at::Tensor>& checkpoint_state,
    const c10::optional<at::Tensor>& token_rows) {
  const Options opt{parse_gate_mode(gate_mode), use_qk_l2norm, use_beta_sigmoid, scale, lower_bound};
  throw_status(flashkda::can_implement(prefill_params(
      q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, cu_seqlens, state_indices,
      has_initial_state, checkpoint_offsets, checkpoint_state, token_rows, opt)));
}

flashkda::DecodeParams decode_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& out,
                                     const at::Tensor& state_pool, const at::Tensor& ssm_state_indices,
                                     const c10::optional<at::Tensor>& num_accepted_tokens,
                                     const c10::optional<at::Tensor>& cu_seqlens,
                                     const c10::optional<at::Tensor>& A_log,
                                     const c10::optional<at::Tensor>& dt_bias,
                                     const c10::optional<at::Tensor>& token_rows, const Options& opt) {
  flashkda::DecodeParams p;
  set_token_args(&p, q, k, v, g, beta, out, A_log, dt_bias, cu_seqlens, token_rows, opt);
  p.state_pool = to_ref(state_pool, "state_pool");
  p.ssm_state_indices = to_ref(ssm_state_indices, "ssm_state_indices");
  p.num_accepted_tokens = to_ref(num_accepted_tokens, "num_accepted_tokens");
  return p;
}

// decode_check: what decode would say of these arguments, without running it (see prefill_check).
void decode_check_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, const at::Tensor& out, const at::Tensor& state_pool,
                       const at::Tensor& ssm_state_indices,
                       const c10::optional<at::Tensor>& num_accepted_tokens,
                       const c10::optional<at::Tensor>& cu_seqlens, double scale, c10::string_view gate_mode,
                       const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                       double lower_bound, bool use_qk_l2norm, bool use_beta_sigmoid,
                       const c10::optional<at::Tensor>& token_rows) {
  const Options opt{parse_gate_mode(gate_mode), use_qk_l2norm, use_beta_sigmoid, scale, lower_bound};
  throw_status(flashkda::can_implement_decode(decode_params(q, k, v, g, beta, out, state_pool,
                                                            ssm_state_indices, num_accepted_tokens,
                                                            cu_seqlens, A_log, dt_bias, token_rows, opt)));
}

// decode: the recurrent path on a state pool (flashkda/decode.h).  CPU tensors run the reference
// (no workspace needed); CUDA tensors run the sm90 decode kernel and need `workspace` (at least
// get_decode_workspace_size() bytes on q's device: the device error word lives there).
void decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, const at::Tensor& out, const at::Tensor& state_pool,
                 const at::Tensor& ssm_state_indices, const c10::optional<at::Tensor>& num_accepted_tokens,
                 const c10::optional<at::Tensor>& cu_seqlens, double scale, c10::string_view gate_mode,
                 const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                 double lower_bound, bool use_qk_l2norm, bool use_beta_sigmoid,
                 const c10::optional<at::Tensor>& workspace, const c10::optional<at::Tensor>& token_rows) {
  const Options opt{parse_gate_mode(gate_mode), use_qk_l2norm, use_beta_sigmoid, scale, lower_bound};
  const flashkda::DecodeParams p =
      decode_params(q, k, v, g, beta, out, state_pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                    A_log, dt_bias, token_rows, opt);
  throw_status(flashkda::can_implement_decode(p));

  // The GPU needs at least workspace_size_decode() bytes (the device error word lives there).
  const bool has_ws = workspace.has_value() && workspace->defined();
  const WorkspaceView ws = has_ws ? workspace_view(*workspace, q) : WorkspaceView{};
  if (q.is_cuda()) {
    const size_t need = flashkda::workspace_size_decode(p);
    TORCH_CHECK_VALUE(has_ws, "flashkda: argument 'workspace': expected a uint8 tensor on ", q.device(),
                      " of at least ", need, " bytes (flashkda.get_decode_workspace_size()), got none");
    TORCH_CHECK_VALUE(ws.bytes >= need, "flashkda: argument 'workspace': expected at least ", need,
                      " bytes on ", q.device(), " (flashkda.get_decode_workspace_size()), got ", ws.bytes,
                      " bytes");
  }
  throw_status(flashkda::run_decode(p, ws.ptr, ws.bytes, current_stream(q)));
}

int64_t get_workspace_size(int64_t T_total, int64_t H, int64_t N) {
  TORCH_CHECK_VALUE(T_total >= 0, "flashkda: argument 'T_total': expected >= 0, got ", T_total);
  TORCH_CHECK_VALUE(H >= 1, "flashkda: argument 'H': expected >= 1, got ", H);
  TORCH_CHECK_VALUE(N >= 1, "flashkda: argument 'N': expected >= 1, got ", N);
  // The head dim is not known here: size for the largest one supported (128).
  return static_cast<int64_t>(flashkda::workspace_size(T_total, H, N, 128));
}

// Bytes of workspace a CUDA decode call needs (depends on nothing the host does not know up front).
int64_t get_decode_workspace_size() {
  return static_cast<int64_t>(flashkda::workspace_size_decode(flashkda::DecodeParams{}));
}

// Debugging aid: the device-side input error recorded in `workspace` by the last CUDA call that used
// it (0 = none, else a flashkda::DeviceError code).  Synchronises the current stream.
int64_t read_device_error_cpu(const at::Tensor& workspace) {
  (void)workspace;
  return 0;  // CPU calls validate every value on the host before writing anything.
}

void clear_device_error_cpu(const at::Tensor& workspace) { (void)workspace; }

#if defined(FLASHKDA_TORCH_CUDA)
int64_t read_device_error_cuda(const at::Tensor& workspace) {
  TORCH_CHECK_VALUE(workspace.is_cuda() && workspace.numel() > 0,
                    "flashkda: argument 'workspace': expected a non-empty CUDA tensor");
  const c10::cuda::CUDAGuard guard(workspace.device());
  auto stream = reinterpret_cast<flashkda::Stream>(
      c10::cuda::getCurrentCUDAStream(workspace.device().index()).stream());
  // Sized form: a workspace shorter than the 4096-byte error header is refused, not read past.
  const WorkspaceView w = workspace_view(workspace, workspace);
  flashkda::DeviceError err = flashkda::DeviceError::kNone;
  throw_status(flashkda::read_device_error(w.ptr, w.bytes, stream, &err));
  return static_cast<int64_t>(err);
}

void clear_device_error_cuda(const at::Tensor& workspace) {
  TORCH_CHECK_VALUE(workspace.is_cuda() && workspace.numel() > 0,
                    "flashkda: argument 'workspace': expected a non-empty CUDA tensor");
  const c10::cuda::CUDAGuard guard(workspace.device());
  auto stream = reinterpret_cast<flashkda::Stream>(
      c10::cuda::getCurrentCUDAStream(workspace.device().index()).stream());
  const WorkspaceView w = workspace_view(workspace, workspace);
  throw_status(flashkda::clear_device_error(w.ptr, w.bytes, stream));
}

// The CUDA dispatch of an op: `impl` on the device of its first tensor (q).  A CPU q with some CUDA
// argument also lands here: can_implement reports the device mismatch.  One wrapper for every op,
// so that the CUDA entry points cannot drift from the CPU ones' signatures (torch infers each op's
// schema from them).
template <typename Fn, Fn* impl>
struct OnDeviceOfQ;
template <typename... Rest, void (*impl)(const at::Tensor&, Rest...)>
struct OnDeviceOfQ<void(const at::Tensor&, Rest...), impl> {
  static void call(const at::Tensor& q, Rest... rest) {
    c10::optional<c10::cuda::CUDAGuard> guard;
    if (q.is_cuda()) guard.emplace(q.device());
    impl(q, rest...);
  }
};
#endif

bool built_with_cuda() {
#if defined(FLASHKDA_TORCH_CUDA)
  return flashkda::built_with_cuda();
#else
  return false;
#endif
}

}  // namespace
}  // namespace flashkda_torch

TORCH_LIBRARY(flashkda, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
      "Tensor(c!) workspace, Tensor A_log, Tensor dt_bias, float lower_bound, Tensor? initial_state=None, "
      "Tensor(b!)? final_state=None, Tensor? cu_seqlens=None) -> ()");
  m.def("get_workspace_size(int T_total, int H, int N=1) -> int", &flashkda_torch::get_workspace_size);
  m.def(
      "prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, Tensor(c!) workspace, *, "
      "float scale=0.0, str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, "
      "float lower_bound=-5.0, bool use_qk_l2norm=True, bool use_beta_sigmoid=True, "
      "Tensor? initial_state=None, Tensor(b!)? final_state=None, Tensor? cu_seqlens=None, "
      "Tensor? state_indices=None, Tensor? has_initial_state=None, Tensor? checkpoint_offsets=None, "
      "Tensor(d!)? checkpoint_state=None, Tensor? token_rows=None) -> ()");
  m.def(
      "decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, Tensor(b!) state_pool, "
      "Tensor ssm_state_indices, *, Tensor? num_accepted_tokens=None, Tensor? cu_seqlens=None, "
      "float scale=0.0, str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, "
      "float lower_bound=-5.0, bool use_qk_l2norm=True, bool use_beta_sigmoid=True, "
      "Tensor(c!)? workspace=None, Tensor? token_rows=None) -> ()");
  m.def("get_decode_workspace_size() -> int", &flashkda_torch::get_decode_workspace_size);
  // The argument checks of prefill / decode alone: nothing runs, nothing is written, no workspace.
  m.def(
      "prefill_check(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor out, *, float scale=0.0, "
      "str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, float lower_bound=-5.0, "
      "bool use_qk_l2norm=True, bool use_beta_sigmoid=True, Tensor? initial_state=None, "
      "Tensor? final_state=None, Tensor? cu_seqlens=None, Tensor? state_indices=None, "
      "Tensor? has_initial_state=None, Tensor? checkpoint_offsets=None, Tensor? checkpoint_state=None, "
      "Tensor? token_rows=None) -> ()");
  m.def(
      "decode_check(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor out, Tensor state_pool, "
      "Tensor ssm_state_indices, *, Tensor? num_accepted_tokens=None, Tensor? cu_seqlens=None, "
      "float scale=0.0, str gate_mode=\"bounded\", Tensor? A_log=None, Tensor? dt_bias=None, "
      "float lower_bound=-5.0, bool use_qk_l2norm=True, bool use_beta_sigmoid=True, "
      "Tensor? token_rows=None) -> ()");
  m.def("read_device_error(Tensor workspace) -> int");
  m.def("clear_device_error(Tensor(a!) workspace) -> ()");
  m.def("built_with_cuda() -> bool", &flashkda_torch::built_with_cuda);
}

TORCH_LIBRARY_IMPL(flashkda, CPU, m) {
  m.impl("fwd", &flashkda_torch::fwd_impl);
  m.impl("prefill", &flashkda_torch::prefill_impl);
  m.impl("decode", &flashkda_torch::decode_impl);
  m.impl("prefill_check", &flashkda_torch::prefill_check_impl);
  m.impl("decode_check", &flashkda_torch::decode_check_impl);
  m.impl("read_device_error", &flashkda_torch::read_device_error_cpu);
  m.impl("clear_device_error", &flashkda_torch::clear_device_error_cpu);
}

#if defined(FLASHKDA_TORCH_CUDA)
TORCH_LIBRARY_IMPL(flashkda, CUDA, m) {
  using flashkda_torch::OnDeviceOfQ;
  m.impl("fwd", &OnDeviceOfQ<decltype(flashkda_torch::fwd_impl), &flashkda_torch::fwd_impl>::call);
  m.impl("prefill",
         &OnDeviceOfQ<decltype(flashkda_torch::prefill_impl), &flashkda_torch::prefill_impl>::call);
  m.impl("decode", &OnDeviceOfQ<decltype(flashkda_torch::decode_impl), &flashkda_torch::decode_impl>::call);
  m.impl(
      "prefill_check",
      &OnDeviceOfQ<decltype(flashkda_torch::prefill_check_impl), &flashkda_torch::prefill_check_impl>::call);
  m.impl("decode_check",
         &OnDeviceOfQ<decltype(flashkda_torch::decode_check_impl), &flashkda_torch::decode_check_impl>::call);
  m.impl("read_device_error", &flashkda_torch::read_device_error_cuda);
  m.impl("clear_device_error", &flashkda_torch::clear_device_error_cuda);
}
#endif
