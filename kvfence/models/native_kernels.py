"""The opt-in C++ kernels (CPU, float32): decode attention that reads the paged KV pool in place, and RMSNorm.

What it knows: RMSNorm of each row in one pass (weight * (x * rsqrt(mean(x^2) + eps)), the order
transformers uses; one call instead of the ~9 ops torch's CPU rms_norm dispatches). Decode attention:
for a batch of one query token per sequence it computes, per (sequence, KV head), the scores of that
head's G = H / Hkv query heads against every key of the sequence's context, read slot by slot from
the flat pool views through the batch's page table, an exact two-pass softmax (max, then exp and
sum, in float32) and the weighted sum of the values. There is no contiguous copy of the context (no
gather, no per-step append), and each (sequence, KV head) is computed by the same loop whatever its
batch-mates are, so a row's output does not depend on the batch. Work is split over (sequence, KV
head) with `at::parallel_for`.

The kernels are compiled on first use with torch's C++ extension builder (g++ and ninja needed;
about a minute on two cores, then cached under torch's extensions directory), which is why it is
opt-in (`ModelConfig.kernels = "native"`, `--kernels native`): the default engine and the fast
test suite never pay for the build.

What it does not know: prefill attention, masks other than "the first kv_len keys", dtypes other than
float32, or devices other than the CPU; callers keep the torch path for those.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

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
  const int64_t G = H / Hkv;
  auto out = torch::empty({B, H, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * Dv);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      const int64_t L = ln[b];
      scores.resize(G * L);
      const float* qb = qp + (b * H + hk * G) * D;  // the G query heads that read KV head hk
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = pg[b * P + t / page_size] * page_size + t % page_size;
        const float* kt = kp + (slot * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qb + g * D, kt, D) * sc;
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
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = pg[b * P + t / page_size] * page_size + t % page_size;
        const float* vt = vp + (slot * Hkv + hk) * Dv;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + t];
          float* a = acc.data() + g * Dv;
          for (int64_t d = 0; d < Dv; ++d) a[d] += w * vt[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        std::copy(acc.begin() + g * Dv, acc.begin() + (g + 1) * Dv, op + (b * H + hk * G + g) * Dv);
      }
    }
  });
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
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * E;
      const float r = 1.f / std::sqrt(dot(row, row, E) / static_cast<float>(E) + e);
      float* o = op + t * E;
      for (int64_t i = 0; i < E; ++i) o[i] = wp[i] * (row[i] * r);
    }
  });
  return out;
}
"""


class NativeKernelsUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, no ninja, a build error)."""


@functools.cache
def load() -> Any:
    """Build (first use) or load the extension module (`paged_decode_attention`, `rms_norm`)."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="kvfence_native_kernels_v3",
            cpp_sources=[_SOURCE],
            functions=["paged_decode_attention", "rms_norm"],
            extra_cflags=["-O3", "-march=native"],
            verbose=False,
        )
    except Exception as e:  # the builder raises RuntimeError, OSError, subprocess errors, ImportError
        raise NativeKernelsUnavailable(f"cannot build the native decode attention kernel: {e}") from e
    return module


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache: [S, Hkv, D]; v_cache: [S, Hkv, Dv] flat pool views (this step's K/V stored);
    kv_pages: [B, P] pages of each context; kv_lens: [B] context lengths -> [B, H, Dv]."""
    return load().paged_decode_attention(q, k_cache, v_cache, kv_pages, kv_lens, int(page_size), float(scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, E] float32; weight: [E] -> [T, E], as transformers orders it: weight * (x * rsqrt(mean(x^2) + eps))."""
    return load().rms_norm(x, weight, float(eps))
