// kvfence's opt-in CPU kernels (float32), built on first use by models/native_kernels.py.
//
// What it knows: RMSNorm rows; decode attention reading the paged KV pool in place; small-batch
// projections (y = x W^T) that stream each weight row once for every batch row; and a whole Llama-family
// decode step (every layer, one token per sequence) built from those, so a step is one call instead of a
// few hundred torch ops. Every output element is computed by the same sequence of float operations
// whatever its batch-mates are (no split that depends on the batch size), so a sequence's logits do not
// depend on which other sequences share its step.
//
// What it does not know: prefill, dtypes other than float32, devices other than the CPU, or model
// variants beyond the Llama-family switches the Python side passes (q/k/v, o, MLP biases; Qwen3's q/k norms).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVF_AVX2 1
#endif

namespace {

// sum over d of a[d] * b[d]; 16 independent partial sums so the compiler vectorises without reassociating
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// --- small-batch projections ------------------------------------------------------------------------------
// y[b, n] = sum_k x[b, k] w[n, k]. Each (b, n) has one 8-lane accumulator over k in steps of 8, reduced in a
// fixed lane order, then the k % 8 tail; tiles only decide which (b, n) share a pass over memory:
// R batch rows x C weight rows with R * C = 8 accumulators (R = 8, 4, 2, 1), so a weight row is read once
// per group of up to 8 batch rows.

#ifdef KVF_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                      // lanes (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));             // (0+4 + 2+6, 1+5 + 3+7, ...)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));      // total
  return _mm_cvtss_f32(s);
}

template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  // x: R rows of K (stride ldx); w: C rows of K (contiguous); out[r * ldo + c]
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += x[r * ldx + kk] * w[c * K + kk];
      out[r * ldo + c] = s;
    }
  }
}
#else
template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float lane[8] = {0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) lane[j] += x[r * ldx + k + j] * w[c * K + k + j];
      float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      for (; k < K; ++k) s += x[r * ldx + k] * w[c * K + k];
      out[r * ldo + c] = s;
    }
  }
}
#endif

template <int R, int C>
void rows_times_weights(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                        int64_t ldy) {
  // R batch rows against weight rows n0..n1: full C-wide tiles, then the last columns one at a time
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<R, C>(x, ldx, w + n * K, K, y + n, ldy);
  for (; n < n1; ++n) tile<R, 1>(x, ldx, w + n * K, K, y + n, ldy);
}

// y [B, N] = x [B, K] @ w[N, K]^T (+ bias) (+ residual); B any (groups of 8, 4, 2, 1 rows), split over N
void small_linear_into(const float* x, int64_t B, int64_t K, const float* w, int64_t N, const float* bias,
                       const float* residual, float* y) {
  TORCH_CHECK(residual != y, "small_linear_into: the residual must not be the output");
  // at least 16 weight rows per thread: below that a thread's start-up costs more than its share
  // weight rows in blocks of about 32 KB, each block taken by every row group while it is in L1/L2
  const int64_t block = std::max<int64_t>(8, (32 << 10) / (4 * std::max<int64_t>(K, 1)) / 8 * 8);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += block) {
      const int64_t ne = std::min(n1, nb + block);
      int64_t b = 0;
      for (; b + 8 <= B; b += 8) rows_times_weights<8, 1>(x + b * K, K, w, K, nb, ne, y + b * N, N);
      for (; b + 4 <= B; b += 4) rows_times_weights<4, 2>(x + b * K, K, w, K, nb, ne, y + b * N, N);
      for (; b + 2 <= B; b += 2) rows_times_weights<2, 4>(x + b * K, K, w, K, nb, ne, y + b * N, N);
      for (; b < B; ++b) rows_times_weights<1, 8>(x + b * K, K, w, K, nb, ne, y + b * N, N);
    }
    if (bias != nullptr || residual != nullptr) {
      for (int64_t r = 0; r < B; ++r) {
        float* yr = y + r * N;
        if (bias != nullptr)
          for (int64_t n = n0; n < n1; ++n) yr[n] += bias[n];
        if (residual != nullptr)
          for (int64_t n = n0; n < n1; ++n) yr[n] = residual[r * N + n] + yr[n];
      }
    }
  });
}

// --- RMSNorm -------------------------------------------------------------------------------------------------

void rms_norm_into(const float* x, int64_t T, int64_t E, const float* w, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * E;
    const float r = 1.f / std::sqrt(dot(row, row, E) / static_cast<float>(E) + eps);
    float* o = out + t * E;
    if (w != nullptr) {
      for (int64_t i = 0; i < E; ++i) o[i] = w[i] * (row[i] * r);
    } else {
      for (int64_t i = 0; i < E; ++i) o[i] = row[i] * r;
    }
  }
}

// --- decode attention over the paged pool ---------------------------------------------------------------------

// q [B, H, D]; k_pool [S, Hkv, D]; v_pool [S, Hkv, Dv]; pages [B, P]; lens [B] -> out [B, H, Dv]
void paged_attention_into(const float* qp, int64_t B, int64_t H, int64_t D, const float* kp, const float* vp,
                          int64_t Hkv, int64_t Dv, const int64_t* pg, int64_t P, const int64_t* ln,
                          int64_t page_size, float sc, float* op) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * Dv);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      const int64_t L = ln[b];
      scores.resize(G * L);
      const float* qb = qp + (b * H + hk * G) * D;  // the G query heads that read KV head hk
      for (int64_t t0 = 0; t0 < L; t0 += page_size) {  // page by page: no division per key
        const int64_t first = pg[b * P + t0 / page_size] * page_size, n = std::min(page_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* kt = kp + ((first + i) * Hkv + hk) * D;
          for (int64_t g = 0; g < G; ++g) scores[g * L + t0 + i] = dot(qb + g * D, kt, D) * sc;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float m = s[0];
        for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      for (int64_t t0 = 0; t0 < L; t0 += page_size) {
        const int64_t first = pg[b * P + t0 / page_size] * page_size, n = std::min(page_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* vt = vp + ((first + i) * Hkv + hk) * Dv;
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * L + t0 + i];
            float* a = acc.data() + g * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] += w * vt[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        std::copy(acc.begin() + g * Dv, acc.begin() + (g + 1) * Dv, op + (b * H + hk * G + g) * Dv);
      }
    }
  });
}

const float* opt_ptr(const torch::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<float>(); }

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor");
}

}  // namespace

// q: [B, H, D]; k_pool: [S, Hkv, D]; v_pool: [S, Hkv, Dv]; pages: [B, P] int64; lens: [B] int64 -> [B, H, Dv]
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor pages, torch::Tensor lens, int64_t page_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_pool.dtype() == torch::kFloat32 && v_pool.dtype() == torch::kFloat32,
              "native decode attention runs on float32");
  TORCH_CHECK(pages.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "pages and lens must be int64");
  q = q.contiguous();
  k_pool = k_pool.contiguous();
  v_pool = v_pool.contiguous();
  pages = pages.contiguous();
  lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(1), Dv = v_pool.size(2), P = pages.size(1);
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  auto out = torch::empty({B, H, Dv}, q.options());
  paged_attention_into(q.data_ptr<float>(), B, H, D, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), Hkv, Dv,
                       pages.data_ptr<int64_t>(), P, ln, page_size, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// RMSNorm of each row of x [T, E] (float32): w * (x * rsqrt(mean(x^2) + eps)), in one pass over the row
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 && x.dim() == 2, "rms_norm: float32 [T, E]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t T = x.size(0), E = x.size(1);
  TORCH_CHECK(w.numel() == E, "rms_norm: weight size");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    rms_norm_into(xp + begin * E, end - begin, E, wp, static_cast<float>(eps), op + begin * E);
  });
  return out;
}

// x [B, K] @ w [N, K]^T (+ bias [N], empty for none) -> [B, N]
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  x = x.contiguous();
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x [B, K], w [N, K]");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == w.size(0), "small_linear: bias size");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  small_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), w.size(0), opt_ptr(bias),
                    nullptr, y.data_ptr<float>());
  return y;
}

// One decode step of a Llama-family model through every layer: x [B, E] (embedded tokens) -> [B, E] after the
// last layer (before the final norm). Per layer, `layer_weights` holds 12 tensors in this order (empty
// tensors for what the model lacks): input_norm, qkv_w, qkv_b, o_w, o_b, q_norm, k_norm, post_norm,
// gate_up_w, gate_up_b, down_w, down_b. cos/sin: [B, D] (sin with its first half negated); k_pools/v_pools:
// per layer, the flat [S, Hkv, D] pool views; slots [B]: where this step's K/V go; pages [B, P], lens [B]
// (lens include this step's token).
torch::Tensor llama_decode_layers(torch::Tensor x, std::vector<torch::Tensor> layer_weights, torch::Tensor cos,
                                  torch::Tensor sin, std::vector<torch::Tensor> k_pools,
                                  std::vector<torch::Tensor> v_pools, torch::Tensor slots, torch::Tensor pages,
                                  torch::Tensor lens, int64_t page_size, int64_t H, int64_t Hkv, double scale,
                                  double eps) {
  constexpr int64_t kFields = 12;
  const int64_t L = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == L * kFields && static_cast<int64_t>(v_pools.size()) == L,
              "llama_decode_layers: 12 weights and two pool views per layer");
  x = x.contiguous().clone();
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && pages.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64,
              "slots, pages and lens must be int64");
  slots = slots.contiguous();
  pages = pages.contiguous();
  lens = lens.contiguous();
  const int64_t B = x.size(0), E = x.size(1), D = cos.size(1), P = pages.size(1);
  const int64_t Hq = H + Hkv, QKV = (H + 2 * Hkv) * D;
  TORCH_CHECK(H % Hkv == 0 && D % 2 == 0 && cos.size(0) == B && sin.size(0) == B, "llama_decode_layers: shapes");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  const int64_t I = layer_weights[8].size(0) / 2;
  std::vector<float> h(B * std::max(E, I)), qkv(B * QKV), rot(B * Hq * D), q(B * H * D), attn(B * H * D),
      gu(B * 2 * I), res(B * E);
  float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* W = layer_weights.data() + l * kFields;
    for (int64_t i : {0, 1, 3, 7, 8, 10}) check_f32(W[i], "a layer weight");
    torch::Tensor& kpool = k_pools[l];
    torch::Tensor& vpool = v_pools[l];
    check_f32(kpool, "k pool");
    check_f32(vpool, "v pool");
    TORCH_CHECK(kpool.size(1) == Hkv && kpool.size(2) == D && vpool.size(2) == D, "pool view shape");
    float* kp = kpool.data_ptr<float>();
    float* vp = vpool.data_ptr<float>();
    const int64_t S = kpool.size(0);
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sl[b] >= 0 && sl[b] < S, "slot outside the pool");

    // attention: norm, q/k/v, (q/k norms), RoPE, store K/V, attend, o + residual
    rms_norm_into(xp, B, E, W[0].data_ptr<float>(), e, h.data());
    small_linear_into(h.data(), B, E, W[1].data_ptr<float>(), QKV, opt_ptr(W[2]), nullptr, qkv.data());
    const float* qn = opt_ptr(W[5]);
    const float* kn = opt_ptr(W[6]);
    for (int64_t b = 0; b < B; ++b) {
      const float* c = cp + b * D;
      const float* s = sp + b * D;
      for (int64_t hd = 0; hd < Hq; ++hd) {
        float* src = qkv.data() + b * QKV + hd * D;
        if (qn != nullptr) rms_norm_into(src, 1, D, hd < H ? qn : kn, e, src);  // Qwen3: per-head q/k norm
        float* dst = rot.data() + (b * Hq + hd) * D;
        // rotate-half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (s holds -sin, sin)
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * c[d] + src[(d + D / 2) % D] * s[d];
      }
      std::copy(rot.data() + (b * Hq + H) * D, rot.data() + (b * Hq + Hq) * D, kp + sl[b] * Hkv * D);
      const float* v = qkv.data() + b * QKV + Hq * D;
      std::copy(v, v + Hkv * D, vp + sl[b] * Hkv * D);
    }
    // queries: the first H heads of each row of rot, which is [B, Hq, D]; gather them to [B, H, D]
    for (int64_t b = 0; b < B; ++b) std::copy(rot.data() + b * Hq * D, rot.data() + (b * Hq + H) * D, q.data() + b * H * D);
    paged_attention_into(q.data(), B, H, D, kp, vp, Hkv, D, pages.data_ptr<int64_t>(), P, ln, page_size, sc,
                         attn.data());
    std::copy(xp, xp + B * E, res.data());
    small_linear_into(attn.data(), B, H * D, W[3].data_ptr<float>(), E, opt_ptr(W[4]), res.data(), xp);

    // MLP: norm, gate/up, SiLU(gate) * up, down + residual
    rms_norm_into(xp, B, E, W[7].data_ptr<float>(), e, h.data());
    small_linear_into(h.data(), B, E, W[8].data_ptr<float>(), 2 * I, opt_ptr(W[9]), nullptr, gu.data());
    for (int64_t b = 0; b < B; ++b) {
      const float* g = gu.data() + b * 2 * I;
      float* a = h.data() + b * I;
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
    std::copy(xp, xp + B * E, res.data());
    small_linear_into(h.data(), B, I, W[10].data_ptr<float>(), E, opt_ptr(W[11]), res.data(), xp);
  }
  return x;
}
