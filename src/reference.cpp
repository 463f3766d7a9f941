// FlashKDA CPU reference (see include/flashkda/reference.h and ../shared/kda_spec.md).
//
// Plain loops in double.  The chunked core writes every product of decays as one exponential of a
// difference, exp(G_i - G_j) with i >= j (or exp(G_last - G_j)), which is <= 1 whenever the log
// decays are <= 0, so it never overflows whatever the chunk size or the decay strength.
#include "flashkda/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "reference_access.h"

namespace flashkda {
namespace reference {

// ---------------------------------------------------------------------------------------------
// Cores

void kda_recurrent(const double* q, const double* k, const double* v, const double* a, const double* b,
                   int64_t T, int64_t K, int64_t V, double scale, double* S, double* o) {
  std::vector<double> decay(K);
  for (int64_t t = 0; t < T; ++t) {
    const double* qt = q + t * K;
    const double* kt = k + t * K;
    const double* vt = v + t * V;
    for (int64_t c = 0; c < K; ++c) decay[c] = std::exp(a[t * K + c]);
    for (int64_t r = 0; r < V; ++r) {
      double* Sr = S + r * K;
      double sk = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        Sr[c] *= decay[c];
        sk += Sr[c] * kt[c];
      }
      const double bu = b[t] * (vt[r] - sk);
      double sq = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        Sr[c] += bu * kt[c];
        sq += Sr[c] * qt[c];
      }
      o[t * V + r] = scale * sq;
    }
  }
}

namespace {

// The state-independent quantities of one chunk of c <= C tokens (spec section 3), shared by the
// chunked form and the chunk maps: G (cumulative log decay), L = strict_lower(diag(b) kt kb^T) and,
// when q is given, Mqk = lower_incl(scale qt kb^T), both with pairwise decays exp(G_i - G_j) <= 1;
// W = (I + L)^-1 diag(b) kt and U = (I + L)^-1 diag(b) V by forward substitution; and
// Kend = k exp(G_last - G).
struct ChunkLocal {
  std::vector<double> G, L, Mqk, W, U, Kend;
  ChunkLocal(int64_t C, int64_t K, int64_t V)
      : G(C * K), L(C * C), Mqk(C * C), W(C * K), U(C * V), Kend(C * K) {}
};

void chunk_local(const double* qc, const double* kc, const double* vc, const double* ac, const double* bc,
                 int64_t c, int64_t C, int64_t K, int64_t V, double scale, ChunkLocal* x) {
  std::vector<double>&G = x->G, &L = x->L, &Mqk = x->Mqk, &W = x->W, &U = x->U, &Kend = x->Kend;
  for (int64_t kk = 0; kk < K; ++kk) {
    double acc = 0.0;
    for (int64_t i = 0; i < c; ++i) {
      acc += ac[i * K + kk];
      G[i * K + kk] = acc;
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      double lk = 0.0, qk = 0.0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double e = std::exp(G[i * K + kk] - G[j * K + kk]);
        lk += kc[i * K + kk] * kc[j * K + kk] * e;
        if (qc != nullptr) qk += qc[i * K + kk] * kc[j * K + kk] * e;
      }
      L[i * C + j] = j < i ? bc[i] * lk : 0.0;
      Mqk[i * C + j] = scale * qk;
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t kk = 0; kk < K; ++kk) {
      double y = bc[i] * kc[i * K + kk] * std::exp(G[i * K + kk]);
      for (int64_t j = 0; j < i; ++j) y -= L[i * C + j] * W[j * K + kk];
      W[i * K + kk] = y;
    }
    for (int64_t r = 0; r < V; ++r) {
      double y = bc[i] * vc[i * V + r];
      for (int64_t j = 0; j < i; ++j) y -= L[i * C + j] * U[j * V + r];
      U[i * V + r] = y;
    }
  }
  const double* Gl = &G[(c - 1) * K];
  for (int64_t i = 0; i < c; ++i)
    for (int64_t kk = 0; kk < K; ++kk) Kend[i * K + kk] = kc[i * K + kk] * std::exp(Gl[kk] - G[i * K + kk]);
}

}  // namespace

void kda_chunked(const double* q, const double* k, const double* v, const double* a, const double* b,
                 int64_t T, int64_t K, int64_t V, double scale, int64_t C, double* S, double* o) {
  C = std::max<int64_t>(1, std::min(C, T));  // a chunk never needs more rows than the sequence
  ChunkLocal cl(C, K, V);
  const std::vector<double>&G = cl.G, &Mqk = cl.Mqk, &W = cl.W, &U = cl.U, &Kend = cl.Kend;
  std::vector<double> Vn(C * V);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t c = std::min<int64_t>(C, T - t0);
    const double* qc = q + t0 * K;
    chunk_local(qc, k + t0 * K, v + t0 * V, a + t0 * K, b + t0, c, C, K, V, scale, &cl);
    // Vn = U - W S0^T
    for (int64_t i = 0; i < c; ++i) {
      for (int64_t r = 0; r < V; ++r) {
        double ws = 0.0;
        for (int64_t kk = 0; kk < K; ++kk) ws += W[i * K + kk] * S[r * K + kk];
        Vn[i * V + r] = U[i * V + r] - ws;
      }
    }
    // O = qt S0^T + Mqk Vn
    for (int64_t i = 0; i < c; ++i) {
      for (int64_t r = 0; r < V; ++r) {
        double x = 0.0;
        for (int64_t kk = 0; kk < K; ++kk) x += qc[i * K + kk] * std::exp(G[i * K + kk]) * S[r * K + kk];
        x *= scale;
        for (int64_t j = 0; j <= i; ++j) x += Mqk[i * C + j] * Vn[j * V + r];
        o[(t0 + i) * V + r] = x;
      }
    }
    // S1 = S0 * exp(G_last) + Vn^T (k * exp(G_last - G))
    const double* Gl = &G[(c - 1) * K];
    for (int64_t r = 0; r < V; ++r) {
      for (int64_t kk = 0; kk < K; ++kk) {
        double x = S[r * K + kk] * std::exp(Gl[kk]);
        for (int64_t i = 0; i < c; ++i) x += Vn[i * V + r] * Kend[i * K + kk];
        S[r * K + kk] = x;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Context parallelism: affine segment maps, their composition, and the split / scan / rerun driver

namespace {

// M <- identity [K, K], Bm <- 0 [V, K].
void init_map(int64_t K, int64_t V, double* M, double* Bm) {
  std::fill(M, M + K * K, 0.0);
  for (int64_t r = 0; r < K; ++r) M[r * K + r] = 1.0;
  std::fill(Bm, Bm + V * K, 0.0);
}

// X [R, K] <- X Mc  with Mc [K, K] (row-major); tmp holds K doubles.
void right_multiply(double* X, int64_t R, int64_t K, const double* Mc, std::vector<double>& tmp) {
  for (int64_t r = 0; r < R; ++r) {
    double* x = X + r * K;
    std::fill(tmp.begin(), tmp.end(), 0.0);
    for (int64_t j = 0; j < K; ++j) {
      const double xj = x[j];
      for (int64_t c = 0; c < K; ++c) tmp[c] += xj * Mc[j * K + c];
    }
    std::copy(tmp.begin(), tmp.end(), x);
  }
}

}  // namespace

void kda_segment_map(const double* /*q*/, const double* k, const double* v, const double* a, const double* b,
                     int64_t T, int64_t K, int64_t V, double* M, double* Bm) {
  init_map(K, V, M, Bm);
  std::vector<double> decay(K);
  for (int64_t t = 0; t < T; ++t) {
    const double* kt = k + t * K;
    const double* vt = v + t * V;
    for (int64_t c = 0; c < K; ++c) decay[c] = std::exp(a[t * K + c]);
    // One row x of [M; Bm]: x <- x diag(e^a); x <- x + b (y - x.k) k^T, with y = 0 for rows of M
    // (x diag(e^a) (I - b k k^T)) and y = v_t[r] for row r of Bm (the same plus b v_t[r] k^T).
    auto step = [&](double* x, double y) {
      double xk = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        x[c] *= decay[c];
        xk += x[c] * kt[c];
      }
      const double bu = b[t] * (y - xk);
      for (int64_t c = 0; c < K; ++c) x[c] += bu * kt[c];
    };
    for (int64_t r = 0; r < K; ++r) step(M + r * K, 0.0);
    for (int64_t r = 0; r < V; ++r) step(Bm + r * K, vt[r]);
  }
}

void kda_chunk_map(const double* /*q*/, const double* k, const double* v, const double* a, const double* b,
                   int64_t T, int64_t K, int64_t V, int64_t C, double* M, double* Bm) {
  init_map(K, V, M, Bm);
  C = std::max<int64_t>(1, std::min(C, T));
  ChunkLocal cl(C, K, V);
  const std::vector<double>&G = cl.G, &W = cl.W, &U = cl.U, &Kend = cl.Kend;
  std::vector<double> Mc(K * K), Bc(V * K), tmp(K);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t c = std::min<int64_t>(C, T - t0);
    chunk_local(nullptr, k + t0 * K, v + t0 * V, a + t0 * K, b + t0, c, C, K, V, 0.0, &cl);
    // M_c = diag(exp(G_last)) - W^T kd; B_c = U^T kd (kd = Kend).
    const double* Gl = &G[(c - 1) * K];
    for (int64_t r = 0; r < K; ++r) {
      for (int64_t cc = 0; cc < K; ++cc) {
        double x = r == cc ? std::exp(Gl[cc]) : 0.0;
        for (int64_t i = 0; i < c; ++i) x -= W[i * K + r] * Kend[i * K + cc];
        Mc[r * K + cc] = x;
      }
    }
    for (int64_t r = 0; r < V; ++r) {
      for (int64_t cc = 0; cc < K; ++cc) {
        double x = 0.0;
        for (int64_t i = 0; i < c; ++i) x += U[i * V + r] * Kend[i * K + cc];
        Bc[r * K + cc] = x;
      }
    }
    // Compose: (M, Bm) then (Mc, Bc) = (M Mc, Bm Mc + Bc).
    right_multiply(M, K, K, Mc.data(), tmp);
    right_multiply(Bm, V, K, Mc.data(), tmp);
    for (int64_t i = 0; i < V * K; ++i) Bm[i] += Bc[i];
  }
}

void kda_context_parallel(const double* q, const double* k, const double* v, const double* a, const double* b,
                          int64_t T, int64_t K, int64_t V, double scale, const int64_t* bounds,
                          int64_t num_segments, double* S, double* o) {
  (void)T;  // bounds[num_segments] == T
  const int64_t P = num_segments;
  // 1. Every segment's map, independently (in parallel on a GPU).
  std::vector<double> Ms(P * K * K), Bs(P * V * K);
  for (int64_t s = 0; s < P; ++s) {
    const int64_t t0 = bounds[s], n = bounds[s + 1] - bounds[s];
    kda_segment_map(q + t0 * K, k + t0 * K, v + t0 * V, a + t0 * K, b + t0, n, K, V, &Ms[s * K * K],
                    &Bs[s * V * K]);
  }
  // 2. Sequential scan: start[s + 1] = start[s] M_s + B_s.
  std::vector<double> start((P + 1) * V * K), tmp(K);
  std::copy(S, S + V * K, start.begin());
  for (int64_t s = 0; s < P; ++s) {
    double* next = &start[(s + 1) * V * K];
    std::copy(&start[s * V * K], &start[(s + 1) * V * K], next);
    right_multiply(next, V, K, &Ms[s * K * K], tmp);
    for (int64_t i = 0; i < V * K; ++i) next[i] += Bs[s * V * K + i];
  }
  // 3. Rerun every segment from its start state for the outputs (in parallel on a GPU).
  std::vector<double> Ss(V * K);
  for (int64_t s = 0; s < P; ++s) {
    const int64_t t0 = bounds[s], n = bounds[s + 1] - bounds[s];
    std::copy(&start[s * V * K], &start[(s + 1) * V * K], Ss.begin());
    kda_recurrent(q + t0 * K, k + t0 * K, v + t0 * V, a + t0 * K, b + t0, n, K, V, scale, Ss.data(),
                  o + t0 * V);
  }
  std::copy(&start[P * V * K], &start[(P + 1) * V * K], S);
}

void kda_context_parallel(const double* q, const double* k, const double* v, const double* a, const double* b,
                          int64_t T, int64_t K, int64_t V, double scale, int64_t num_segments, double* S,
                          double* o) {
  const int64_t P = std::max<int64_t>(1, num_segments);
  std::vector<int64_t> bounds(P + 1);
  for (int64_t s = 0; s <= P; ++s) bounds[s] = s * T / P;
  kda_context_parallel(q, k, v, a, b, T, K, V, scale, bounds.data(), P, S, o);
}

// ---------------------------------------------------------------------------------------------
// Preprocessing

namespace {

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

double softplus(double x) {
  // log(1 + e^x) without overflow: x + log1p(e^-x) for x > 0 (-> x for large x).
  if (x > 0) return x + std::log1p(std::exp(-x));
  return std::log1p(std::exp(x));
}

}  // namespace

void l2_normalize(double* x, int64_t n) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss + 1e-6);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

double gate_log_decay(GateMode mode, double g, double A_log_h, double dt_bias_hk, double lower_bound) {
  switch (mode) {
    case GateMode::kBounded:
      return lower_bound * sigmoid(std::exp(A_log_h) * (g + dt_bias_hk));
    case GateMode::kSoftplus:
      return -std::exp(A_log_h) * softplus(g + dt_bias_hk);
    case GateMode::kPrecomputed:
      return g;
  }
  return g;
}

double beta_activation(bool use_sigmoid, double beta) { return use_sigmoid ? sigmoid(beta) : beta; }

// ---------------------------------------------------------------------------------------------
// bf16

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even (overflows into the exponent / to inf correctly)
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace detail {

// double -> bf16 with a single rounding (to nearest even): round to float with round-to-odd first
// (float keeps 16 more bits than bf16, so the second rounding sees a correct sticky bit).
uint16_t double_to_bf16(double d) {
  if (std::isnan(d)) return float_to_bf16(static_cast<float>(d));
  float f = static_cast<float>(d);
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;  // odd
    std::memcpy(&f, &u, 4);
  } else if (std::isinf(f) && std::isfinite(d)) {
    // |d| is beyond FLT_MAX, hence beyond the bf16 rounding threshold too.
    return d > 0 ? 0x7f80 : 0xff80;
  }
  return float_to_bf16(f);
}

}  // namespace detail

namespace {

using detail::double_to_bf16;
using detail::load_index;
using detail::load_index2;
using detail::load_real;
using detail::offset4;
using detail::store_real;
using detail::token_row;

bool load_bool(const TensorRef& t, int64_t i) {
  return static_cast<const uint8_t*>(t.data)[i * t.strides[0]] != 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The whole prefill

Status prefill_reference(const PrefillParams& p, int64_t chunk_size) {
  ProblemShape sh;
  Status st = can_implement(p, &sh);
  if (!st.ok()) return st;
  // can_implement put every given tensor on q's device: one check covers them all.
  if (p.q.device != DeviceType::kCPU) {
    return Status::invalid(
        "flashkda: argument 'q': expected a CPU tensor (the reference runs on the host), got a CUDA tensor");
  }
  if (chunk_size < 0) {
    return Status::invalid("flashkda: argument 'chunk_size': expected >= 0, got " +
                           std::to_string(chunk_size));
  }

  const int64_t H = sh.H, K = sh.K, V = sh.V, N = sh.N, n_ckpt = sh.num_checkpoints;
  const double scale = p.scale > 0 ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(K));
  float* ckpt_state = n_ckpt > 0 ? static_cast<float*>(p.checkpoint_state.data) : nullptr;

  detail::HeadInputs in;
  std::vector<double> o, S(V * K);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = sh.varlen ? 0 : n;
    const int64_t bos = sh.varlen ? load_index(p.cu_seqlens, n) : 0;
    const int64_t eos = sh.varlen ? load_index(p.cu_seqlens, n + 1) : sh.T;
    const int64_t L = eos - bos;
    const int64_t slot = p.state_indices.defined() ? load_index(p.state_indices, n) : n;

    if (slot < 0) {  // padding: zero output, no state read or write (checkpoints included)
      for (int64_t t = 0; t < L; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < V; ++r)
            static_cast<uint16_t*>(p.out.data)[offset4(p.out, row, token_row(p, bos + t), h, r)] = 0;
      continue;
    }
    const bool read_state =
        p.initial_state.defined() && (!p.has_initial_state.defined() || load_bool(p.has_initial_state, n));

    o.assign(L * V, 0.0);
    for (int64_t h = 0; h < H; ++h) {
      detail::load_head_inputs(p, row, bos, L, h, K, V, &in);

      const int64_t state_off = (slot * H + h) * V * K;  // states are contiguous [P, H, V, K]
      if (read_state) {
        for (int64_t i = 0; i < V * K; ++i) S[i] = load_real(p.initial_state, state_off + i);
      } else {
        std::fill(S.begin(), S.end(), 0.0);
      }

      // Tokens [t0, t1) advance S; checkpoints split the sequence into such segments.
      auto advance = [&](int64_t t0, int64_t t1) {
        const int64_t c = t1 - t0;
        if (c <= 0) return;
        if (chunk_size == 0) {
          kda_recurrent(&in.q[t0 * K], &in.k[t0 * K], &in.v[t0 * V], &in.a[t0 * K], &in.b[t0], c, K, V, scale,
                        S.data(), &o[t0 * V]);
        } else {
          kda_chunked(&in.q[t0 * K], &in.k[t0 * K], &in.v[t0 * V], &in.a[t0 * K], &in.b[t0], c, K, V, scale,
                      chunk_size, S.data(), &o[t0 * V]);
        }
      };
      int64_t done = 0;
      for (int64_t j = 0; j < n_ckpt; ++j) {
        const int64_t off = load_index2(p.checkpoint_offsets, n, j);
        advance(done, off);
        done = off;
        float* dst = ckpt_state + ((n * n_ckpt + j) * H + h) * V * K;  // contiguous [N, n_ckpt, H, V, K]
        for (int64_t i = 0; i < V * K; ++i) dst[i] = static_cast<float>(S[i]);
      }
      advance(done, L);

      for (int64_t t = 0; t < L; ++t)
        for (int64_t r = 0; r < V; ++r)
          static_cast<uint16_t*>(p.out.data)[offset4(p.out, row, token_row(p, bos + t), h, r)] =
              double_to_bf16(o[t * V + r]);
      if (p.final_state.defined()) {
        for (int64_t i = 0; i < V * K; ++i) store_real(p.final_state, state_off + i, S[i]);
      }
    }
  }
  return Status::ok_status();
}

}  // namespace reference
}  // namespace flashkda
