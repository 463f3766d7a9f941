// FlashKDA from C++: one KDA prefill through the installed library (find_package(flashkda)).
//
// Builds a small varlen problem in the fused "Kimi" configuration (bounded gate, q/k L2 norm, beta
// sigmoid), sequences of 5, 64 and 130 tokens, H = 2 heads, head dim 128, with random bf16 inputs
// made here.  q, k and v are read in place from one fused projection buffer [T, 3 * H * D] (a row
// stride larger than the row, as after a QKV projection): no copies.  Then:
//   * with a CUDA build of flashkda and a usable GPU (compute capability 9.0), flashkda::run on
//     device buffers, on a stream, followed by a read of the device error word;
//   * otherwise (or with --cpu), flashkda::run on host buffers: the same call runs the CPU reference.
// Prints a checksum and max |out| and exits 0 when every output is written and finite.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "flashkda/flashkda.h"

#if defined(FLASHKDA_EXAMPLE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 128;
const std::vector<int64_t> kSeqLens = {5, 64, 130};

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The problem, in host memory.
struct Problem {
  int64_t T = 0, N = 0, H = kHeads, D = kDim;
  int64_t row = 0;                  // elements per token of the fused projection buffer
  std::vector<uint16_t> proj;       // [T, 3 * H * D] bf16: q | k | v of each token
  std::vector<uint16_t> g;          // [T, H, D] bf16, raw gate input
  std::vector<uint16_t> beta;       // [T, H] bf16, beta logits
  std::vector<float> A_log;         // [H]
  std::vector<float> dt_bias;       // [H, D]
  std::vector<float> h0;            // [N, H, D, D] fp32, V-first
  std::vector<int32_t> cu_seqlens;  // [N + 1]
};

Problem make_problem(uint32_t seed) {
  Problem pb;
  pb.N = static_cast<int64_t>(kSeqLens.size());
  pb.cu_seqlens.push_back(0);
  for (int64_t n : kSeqLens) pb.cu_seqlens.push_back(pb.cu_seqlens.back() + static_cast<int32_t>(n));
  pb.T = pb.cu_seqlens.back();
  pb.row = 3 * pb.H * pb.D;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  pb.proj.resize(pb.T * pb.row);
  for (auto& x : pb.proj) x = to_bf16(normal(rng));
  pb.g.resize(pb.T * pb.H * pb.D);
  for (auto& x : pb.g) x = to_bf16(normal(rng));
  pb.beta.resize(pb.T * pb.H);
  for (auto& x : pb.beta) x = to_bf16(normal(rng));
  pb.A_log.resize(pb.H);
  for (auto& x : pb.A_log) x = uniform(rng);
  pb.dt_bias.resize(pb.H * pb.D);
  for (auto& x : pb.dt_bias) x = uniform(rng);
  pb.h0.resize(pb.N * pb.H * pb.D * pb.D);
  for (auto& x : pb.h0) x = 0.1f * normal(rng);
  return pb;
}

// Pointers to the problem's buffers (host or device) and to the outputs.
struct Buffers {
  void *proj, *g, *beta, *A_log, *dt_bias, *h0, *cu_seqlens, *out, *ht;
};

flashkda::PrefillParams make_params(const Problem& pb, const Buffers& b, flashkda::DeviceType dev,
                                    int index) {
  using flashkda::DType;
  const int64_t T = pb.T, H = pb.H, D = pb.D, HD = pb.H * pb.D;
  auto* proj = static_cast<uint16_t*>(b.proj);
  flashkda::PrefillParams p;
  // q, k, v: [1, T, H, D] slices of the fused buffer (token stride = row, each [H, D] block contiguous).
  p.q = flashkda::make_strided_tensor_ref(proj, DType::kBFloat16, {1, T, H, D}, {T * pb.row, pb.row, D, 1},
                                          dev, index);
  p.k = flashkda::make_strided_tensor_ref(proj + HD, DType::kBFloat16, {1, T, H, D},
                                          {T * pb.row, pb.row, D, 1}, dev, index);
  p.v = flashkda::make_strided_tensor_ref(proj + 2 * HD, DType::kBFloat16, {1, T, H, D},
                                          {T * pb.row, pb.row, D, 1}, dev, index);
  p.g = flashkda::make_tensor_ref(b.g, DType::kBFloat16, {1, T, H, D}, dev, index);
  p.beta = flashkda::make_tensor_ref(b.beta, DType::kBFloat16, {1, T, H}, dev, index);
  p.A_log = flashkda::make_tensor_ref(b.A_log, DType::kFloat32, {H}, dev, index);
  p.dt_bias = flashkda::make_tensor_ref(b.dt_bias, DType::kFloat32, {H, D}, dev, index);
  p.out = flashkda::make_tensor_ref(b.out, DType::kBFloat16, {1, T, H, D}, dev, index);
  p.initial_state = flashkda::make_tensor_ref(b.h0, DType::kFloat32, {pb.N, H, D, D}, dev, index);
  p.final_state = flashkda::make_tensor_ref(b.ht, DType::kFloat32, {pb.N, H, D, D}, dev, index);
  p.cu_seqlens = flashkda::make_tensor_ref(b.cu_seqlens, DType::kInt32, {pb.N + 1}, dev, index);
  p.gate_mode = flashkda::GateMode::kBounded;
  p.use_qk_l2norm = true;
  p.use_beta_sigmoid = true;
  p.scale = 0.f;  // K^-0.5
  p.lower_bound = -5.f;
  return p;
}

bool check_status(const flashkda::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "flashkda_example: %s failed (code %d): %s\n", what, static_cast<int>(s.code),
               s.message.c_str());
  return false;
}

// Host path: the same flashkda::run, on host buffers (the CPU reference; no workspace needed).
bool run_on_host(const Problem& pb, std::vector<uint16_t>& out, std::vector<float>& ht) {
  Problem in = pb;  // the run reads the inputs through non-const pointers of TensorRef
  Buffers b{};
  b.proj = in.proj.data();
  b.g = in.g.data();
  b.beta = in.beta.data();
  b.A_log = in.A_log.data();
  b.dt_bias = in.dt_bias.data();
  b.h0 = in.h0.data();
  b.cu_seqlens = in.cu_seqlens.data();
  b.out = out.data();
  b.ht = ht.data();
  flashkda::PrefillParams p = make_params(in, b, flashkda::DeviceType::kCPU, 0);
  flashkda::ProblemShape shape;
  if (!check_status(flashkda::can_implement(p, &shape), "can_implement")) return false;
  std::printf("problem: N=%lld sequences, T=%lld tokens, H=%lld, K=V=%lld (varlen %s)\n",
              static_cast<long long>(shape.N), static_cast<long long>(shape.total_tokens),
              static_cast<long long>(shape.H), static_cast<long long>(shape.K), shape.varlen ? "yes" : "no");
  return check_status(flashkda::run(p, nullptr, 0), "run (CPU)");
}

#if defined(FLASHKDA_EXAMPLE_WITH_CUDA)
#define EXAMPLE_CUDA_CHECK(expr)                                                                    \
  do {                                                                                              \
    cudaError_t err_ = (expr);                                                                      \
    if (err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "flashkda_example: %s failed: %s (%s)\n", #expr, cudaGetErrorName(err_), \
                   cudaGetErrorString(err_));                                                       \
      return false;                                                                                 \
    }                                                                                               \
  } while (0)

// The first CUDA device, when flashkda's kernels can run on it (compute capability 9.0); else -1.
int usable_cuda_device() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    std::printf("no usable CUDA device (%s): running on the CPU\n", cudaGetErrorString(err));
    cudaGetLastError();  // reset the runtime's last-error state
    return -1;
  }
  if (count == 0) {
    std::printf("no CUDA device: running on the CPU\n");
    return -1;
  }
  flashkda::Status s = flashkda::cuda_device_supported(0);
  if (!s.ok()) {
    std::printf("CUDA device 0 not usable by flashkda (%s): running on the CPU\n", s.message.c_str());
    return -1;
  }
  return 0;
}

// Device buffers, freed on every exit path.
struct DeviceAllocs {
  std::vector<void*> ptrs;
  cudaStream_t stream = nullptr;
  ~DeviceAllocs() {
    for (void* p : ptrs) cudaFree(p);
    if (stream) cudaStreamDestroy(stream);
  }
};

// cudaMalloc `bytes` into *dst and, when src is given, copy src there on the example's stream (the
// run on that stream is ordered after the copy).
bool device_copy(DeviceAllocs& mem, void** dst, const void* src, size_t bytes) {
  EXAMPLE_CUDA_CHECK(cudaMalloc(dst, bytes > 0 ? bytes : 1));
  mem.ptrs.push_back(*dst);
  if (src != nullptr && bytes > 0) {
    EXAMPLE_CUDA_CHECK(cudaMemcpyAsync(*dst, src, bytes, cudaMemcpyHostToDevice, mem.stream));
  }
  return true;
}

bool run_on_device(int dev, const Problem& pb, std::vector<uint16_t>& out, std::vector<float>& ht) {
  EXAMPLE_CUDA_CHECK(cudaSetDevice(dev));
  DeviceAllocs mem;
  EXAMPLE_CUDA_CHECK(cudaStreamCreateWithFlags(&mem.stream, cudaStreamNonBlocking));
  Buffers b{};
  auto bytes = [](const auto& v) { return v.size() * sizeof(v[0]); };
  if (!device_copy(mem, &b.proj, pb.proj.data(), bytes(pb.proj)) ||
      !device_copy(mem, &b.g, pb.g.data(), bytes(pb.g)) ||
      !device_copy(mem, &b.beta, pb.beta.data(), bytes(pb.beta)) ||
      !device_copy(mem, &b.A_log, pb.A_log.data(), bytes(pb.A_log)) ||
      !device_copy(mem, &b.dt_bias, pb.dt_bias.data(), bytes(pb.dt_bias)) ||
      !device_copy(mem, &b.h0, pb.h0.data(), bytes(pb.h0)) ||
      !device_copy(mem, &b.cu_seqlens, pb.cu_seqlens.data(), bytes(pb.cu_seqlens)) ||
      !device_copy(mem, &b.out, nullptr, bytes(out)) || !device_copy(mem, &b.ht, nullptr, bytes(ht))) {
    return false;
  }
  // Poison the outputs (all-ones bytes are NaN in bf16 and fp32) to see that every element is written.
  EXAMPLE_CUDA_CHECK(cudaMemsetAsync(b.out, 0xff, bytes(out), mem.stream));
  EXAMPLE_CUDA_CHECK(cudaMemsetAsync(b.ht, 0xff, bytes(ht), mem.stream));

  flashkda::PrefillParams p = make_params(pb, b, flashkda::DeviceType::kCUDA, dev);
  flashkda::ProblemShape shape;
  if (!check_status(flashkda::can_implement(p, &shape), "can_implement")) return false;
  // Sized from host-known numbers only: an engine sizes it once for its largest step and reuses it.
  const size_t ws_bytes = flashkda::workspace_size(shape.total_tokens, shape.H, shape.N, shape.K);
  void* workspace = nullptr;
  if (!device_copy(mem, &workspace, nullptr, ws_bytes)) return false;
  std::printf("problem: N=%lld sequences, T=%lld tokens, H=%lld, K=V=%lld, workspace %zu bytes\n",
              static_cast<long long>(shape.N), static_cast<long long>(shape.total_tokens),
              static_cast<long long>(shape.H), static_cast<long long>(shape.K), ws_bytes);

  if (!check_status(flashkda::run(p, workspace, ws_bytes, mem.stream), "run (CUDA)")) return false;
  EXAMPLE_CUDA_CHECK(cudaGetLastError());
  // The values of cu_seqlens are checked on the device; read the verdict (this synchronises).
  flashkda::DeviceError derr = flashkda::DeviceError::kNone;
  if (!check_status(flashkda::read_device_error(workspace, mem.stream, &derr), "read_device_error")) {
    return false;
  }
  if (derr != flashkda::DeviceError::kNone) {
    std::fprintf(stderr, "flashkda_example: device error %d: %s\n", static_cast<int>(derr),
                 flashkda::device_error_name(derr));
    return false;
  }
  EXAMPLE_CUDA_CHECK(cudaMemcpyAsync(out.data(), b.out, bytes(out), cudaMemcpyDeviceToHost, mem.stream));
  EXAMPLE_CUDA_CHECK(cudaMemcpyAsync(ht.data(), b.ht, bytes(ht), cudaMemcpyDeviceToHost, mem.stream));
  EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(mem.stream));
  return true;
}
#endif  // FLASHKDA_EXAMPLE_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  bool force_cpu = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--cpu") == 0) {
      force_cpu = true;
    } else {
      std::fprintf(stderr, "usage: %s [--cpu]\n", argv[0]);
      return 2;
    }
  }
  std::printf("flashkda built with CUDA kernels: %s\n", flashkda::built_with_cuda() ? "yes" : "no");
  const Problem pb = make_problem(2026);
  std::vector<uint16_t> out(pb.T * pb.H * pb.D, 0xffff);  // poisoned (NaN)
  std::vector<float> ht(pb.N * pb.H * pb.D * pb.D, std::nanf(""));

  bool ok = false;
  const char* where = "cpu";
#if defined(FLASHKDA_EXAMPLE_WITH_CUDA)
  const int dev = force_cpu ? -1 : usable_cuda_device();
  if (dev >= 0) {
    where = "cuda";
    ok = run_on_device(dev, pb, out, ht);
  } else {
    ok = run_on_host(pb, out, ht);
  }
#else
  (void)force_cpu;
  ok = run_on_host(pb, out, ht);
#endif
  if (!ok) return 1;

  double out_sum = 0, out_max = 0, ht_sum = 0;
  int64_t bad = 0;
  for (uint16_t h : out) {
    const double x = from_bf16(h);
    if (!std::isfinite(x)) ++bad;
    out_sum += x;
    out_max = std::fmax(out_max, std::fabs(x));
  }
  for (float x : ht) {
    if (!std::isfinite(x)) ++bad;
    ht_sum += x;
  }
  std::printf("ran on: %s\n", where);
  std::printf("out checksum: %.6f   max |out|: %.6f   final_state checksum: %.6f\n", out_sum, out_max,
              ht_sum);
  if (bad != 0 || out_max == 0.0) {
    std::fprintf(stderr, "flashkda_example: FAILED: %lld non-finite or unwritten values, max |out| %g\n",
                 static_cast<long long>(bad), out_max);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
