// The recurrent decode / speculative decode path (include/flashkda/decode.h, spec section 4):
// workspace sizing, dispatch (CPU tensors: the reference below; CUDA tensors: the sm90 decode kernel
// through detail::run_decode_cuda), and the CPU reference.  Validation lives in validate.cpp
// (can_implement_decode).
//
// Reference order of work, per request n and head h: read the start state (the read slot), then run
// the token recurrence one token at a time, writing the state after token t to its write slot (2-D
// indices) or after the last token to the one slot (1-D).  A request's read slot may be one of its
// own write slots: the state is read before any write.  Validation guarantees that no pool row is
// written twice and that no request reads a row another request writes, so the requests are
// independent and the result does not depend on the order they are processed in.  With token_rows,
// logical token t reads and writes row token_rows[t] of dim 1.
#include "flashkda/decode.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "flashkda/reference.h"
#include "reference_access.h"
#include "runtime/cuda_dispatch.h"

namespace flashkda {

size_t workspace_size_decode(const DecodeParams& p) {
  (void)p;
  return detail::kWorkspaceHeaderBytes;  // reserved for the kernel's error word
}

Status run_decode(const DecodeParams& p, void* workspace, size_t workspace_bytes, Stream stream) {
  DecodeShape shape;
  Status st = can_implement_decode(p, &shape);
  if (!st.ok()) return st;
  if (p.q.device == DeviceType::kCPU) return reference::decode_reference(p);
  const size_t need = workspace_size_decode(p);
  if (workspace == nullptr || workspace_bytes < need) {
    return Status::invalid("flashkda: argument 'workspace': expected at least " + std::to_string(need) +
                           " bytes of device memory (workspace_size_decode), got " +
                           std::to_string(workspace_bytes) + (workspace == nullptr ? " (null pointer)" : ""));
  }
#if defined(FLASHKDA_WITH_CUDA)
  return detail::run_decode_cuda(p, shape, workspace, stream);
#else
  (void)stream;
  return Status::not_implemented(
      "flashkda: CUDA tensors given, but this build of flashkda has no CUDA kernels");
#endif
}

namespace reference {

Status decode_reference(const DecodeParams& p) {
  DecodeShape sh;
  Status st = can_implement_decode(p, &sh);
  if (!st.ok()) return st;
  // can_implement put every given tensor on q's device: one check covers them all.
  if (p.q.device != DeviceType::kCPU) {
    return Status::invalid(
        "flashkda: argument 'q': expected a CPU tensor (the reference runs on the host), got a CUDA tensor");
  }

  using detail::load_index;
  using detail::load_index2;
  using detail::offset4;
  using detail::token_row;
  const int64_t H = sh.H, K = sh.K, V = sh.V, N = sh.N;
  const double scale = p.scale > 0 ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(K));
  const TensorRef& pool = p.state_pool;
  const TensorRef& idx = p.ssm_state_indices;
  uint16_t* out = static_cast<uint16_t*>(p.out.data);

  detail::HeadInputs in;
  std::vector<double> S(V * K), o;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = sh.varlen ? 0 : n;
    const int64_t bos = sh.varlen ? load_index(p.cu_seqlens, n) : 0;
    const int64_t L = sh.varlen ? load_index(p.cu_seqlens, n + 1) - bos : sh.T;
    const int64_t read_slot =
        sh.spec ? load_index2(idx, n, load_index(p.num_accepted_tokens, n) - 1) : load_index(idx, n);

    if (read_slot < 0) {  // padded request: zero output, no state read or written
      for (int64_t t = 0; t < L; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < V; ++r) out[offset4(p.out, row, token_row(p, bos + t), h, r)] = 0;
      continue;
    }

    o.assign(L * V, 0.0);
    for (int64_t h = 0; h < H; ++h) {
      detail::load_head_inputs(p, row, bos, L, h, K, V, &in);
      const int64_t read_off = (read_slot * H + h) * V * K;  // the pool is contiguous [P, H, V, K]
      for (int64_t i = 0; i < V * K; ++i) S[i] = detail::load_real(pool, read_off + i);

      for (int64_t t = 0; t < L; ++t) {
        kda_recurrent(&in.q[t * K], &in.k[t * K], &in.v[t * V], &in.a[t * K], &in.b[t], 1, K, V, scale,
                      S.data(), &o[t * V]);
        if (sh.spec) {
          const int64_t w = load_index2(idx, n, t);
          if (w >= 0) {
            const int64_t off = (w * H + h) * V * K;
            for (int64_t i = 0; i < V * K; ++i) detail::store_real(pool, off + i, S[i]);
          }
        }
      }
      if (!sh.spec) {
        for (int64_t i = 0; i < V * K; ++i) detail::store_real(pool, read_off + i, S[i]);
      }
      for (int64_t t = 0; t < L; ++t)
        for (int64_t r = 0; r < V; ++r)
          out[offset4(p.out, row, token_row(p, bos + t), h, r)] = detail::double_to_bf16(o[t * V + r]);
    }
  }
  return Status::ok_status();
}

}  // namespace reference
}  // namespace flashkda
