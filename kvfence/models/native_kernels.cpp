// kvfence's opt-in CPU kernels (float32, and bfloat16 weights and KV with float32 arithmetic), built on first
// use by models/native_kernels.py.
//
// What it knows: RMSNorm rows; decode attention reading the paged KV pool in place (float32 or bfloat16 pools);
// causal attention of fresh prompts over their own new K/V; RoPE and SiLU * up of prefill rows;
// projections (y = x W^T) from weights packed once into k-major panels (AVX-512 or AVX2 FMA kernels where the
// CPU has them, plain C++ elsewhere; bfloat16 panels through AMX tiles where the CPU has AMX-BF16 and K is a
// multiple of 32, else through AVX512_BF16's dot product where the CPU has it, the same sums by float FMAs
// where it does not); SiLU and
// softmax through a vector exp; and a whole Llama-family decode step (every layer, one token per sequence)
// built from those, so a step is one call instead of a few hundred torch ops (and several greedy steps, argmax
// between them, in one call). Every output element is computed by the same sequence of float operations
// whatever its batch-mates are (no split that depends on the batch size), so a sequence's logits do not
// depend on which other sequences share its step.
//
// bfloat16: weights and the KV pool hold bfloat16; activations, the residual stream, norms, RoPE, softmax and
// every accumulation stay float32; a projection's input row is rounded to bfloat16 (as a bfloat16 model's
// activations are) and each product pair summed into a float32 accumulator (VDPBF16PS's order: the odd
// element's product, then the even one's); K/V are rounded to bfloat16 (nearest even, as torch) when stored.
//
// What it does not know: prefill beyond the projections, fresh prompts' causal attention, RoPE and SiLU (no cached
// prefix), float16, devices other than the CPU, or model
// variants beyond the Llama-family switches the Python side passes (q/k/v, o, MLP biases; Qwen3's q/k norms).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define KVF_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
// CPUs with AVX2 and FMA but not AVX-512 (e.g. AMD Zen 2/3, Intel before Skylake-SP): the panel kernels, the
// vector exp and decode attention in 8-lane registers, with the same float operations per output element as
// the AVX-512 and plain C++ paths (see each kernel)
#include <immintrin.h>
#define KVF_AVX2 1
#endif
#if (defined(KVF_AVX512) && !defined(__AVX512BF16__)) || defined(KVF_AVX2)
// AVX-512 without AVX512_BF16 (e.g. Intel Ice Lake and Cascade Lake), and AVX2: a bfloat16 product's x rows are
// widened to floats once per call, so that the panel kernel's broadcasts of x are loads (folded into its FMAs on
// AVX-512) instead of a bfloat16 -> float conversion per row and k on the ports the FMAs share; on AVX2 this
// also frees the registers that held each row's widened pair, so a pass takes 4 rows instead of 2 and widens
// each weight for twice the rows. Widening is exact, so the sums are the same bits.
#define KVF_WIDEN_X 1
#endif

namespace {

using bf16_t = uint16_t;  // a bfloat16's bits (torch's at::BFloat16 layout)
#ifdef KVF_WIDEN_X
using panel_x_t = float;  // what a bfloat16 panel kernel reads x as: the bfloat16 values, widened (see above)
#else
using panel_x_t = bf16_t;
#endif

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) {
  const uint32_t u = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float -> bfloat16, round to nearest even; a NaN stays a (quiet) NaN: torch's rounding
inline bf16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<bf16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, int64_t n, bf16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
}

// --- work sharing that does not wait for a descheduled thread ---------------------------------------------------
// at::parallel_for (OpenMP underneath) gives each thread a fixed share of a range and ends at a barrier, so when a
// busy neighbour deschedules one thread its partner waits for it (spinning, then sleeping) before the step goes
// on. run_chunks instead hands out fixed chunks of the range from one atomic counter: the calling thread and
// the pool's helper threads each take the next chunk until none is left, and the caller then waits only for
// chunks another thread has taken and not finished. A helper that is not running when a job starts takes no part
// in it. Which thread computes a chunk never changes what is computed: each output element is still the same
// float operations, so the results are bit-identical to one thread's.
//
// Waiting: a helper spins for spin_count() pause iterations (libgomp's variables, rule and unit) for the next
// job, then sleeps on a futex.
// Threads in use: at::get_num_threads() at each call (the caller and get_num_threads() - 1 helpers).

inline void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// libgomp's rule: $GOMP_SPINCOUNT when set (a count, or "infinite"), else 0 with OMP_WAIT_POLICY=PASSIVE, else 300,000
int64_t spin_count() {
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (spin != nullptr && *spin != '\0') {
    if (std::strncmp(spin, "infinit", 7) == 0) return INT64_MAX;
    const long long v = std::strtoll(spin, nullptr, 10);
    return v < 0 ? 0 : static_cast<int64_t>(v);
  }
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (policy != nullptr && (std::strcmp(policy, "PASSIVE") == 0 || std::strcmp(policy, "passive") == 0)) return 0;
  return 300000;
}

class ChunkPool {
 public:
  // f(begin, end) over [0, n) in chunks of `chunk` items (the last may be shorter), each chunk exactly once
  template <typename F>
  void run(int64_t n, int64_t chunk, const F& f) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    const int threads = at::get_num_threads();
    if (chunks <= 1 || threads <= 1 || at::in_parallel_region() || !busy_.try_lock()) {
      f(0, n);
      return;
    }
    std::lock_guard<std::mutex> guard(busy_, std::adopt_lock);
    start_helpers(threads - 1);
    job_ = Job{[](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f, n, chunk};
    done_.store(0, std::memory_order_relaxed);
    // the word: how many helpers may take part (bits 32+) and how many chunks are left (bits 0-31)
    work_.store((uint64_t(threads - 1) << 32) | uint64_t(chunks), std::memory_order_release);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&seq_);
    work(-1);
    for (int64_t i = 0; done_.load(std::memory_order_acquire) < chunks; ++i) {
      if (i < 4096) {
        cpu_relax();
      } else {
        sched_yield();  // a helper took a chunk and was descheduled: let it run
      }
    }
  }

 private:
  struct Job {
    void (*call)(const void*, int64_t, int64_t);
    const void* ctx;
    int64_t n, chunk;
  };

  // take chunks until none is left; helper `id` (-1: the caller) only while the job admits that many helpers
  void work(int id) {
    uint64_t w = work_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t left = w & 0xFFFFFFFFu;
      if (left == 0 || (id >= 0 && uint64_t(id) >= (w >> 32))) return;
      if (!work_.compare_exchange_weak(w, w - 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // chunk left - 1 is ours: the job cannot change until it is done (the caller waits for it)
      const Job j = job_;
      const int64_t begin = int64_t(left - 1) * j.chunk;
      j.call(j.ctx, begin, std::min(j.n, begin + j.chunk));
      done_.fetch_add(1, std::memory_order_release);
      w = work_.load(std::memory_order_acquire);
    }
  }

  void start_helpers(int n) {
    while (static_cast<int>(helpers_.size()) < n) {
      const int id = static_cast<int>(helpers_.size());
      helpers_.emplace_back([this, id] { helper(id); });
      helpers_.back().detach();  // lives as long as the process (the pool is never destroyed)
    }
  }

  void helper(int id) {
    const int64_t spins = spin_count();
    uint32_t seen = seq_.load(std::memory_order_acquire);
    for (;;) {
      int64_t i = 0;
      while (seq_.load(std::memory_order_acquire) == seen && i < spins) {
        cpu_relax();
        ++i;
      }
      if (seq_.load(std::memory_order_acquire) == seen) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (seq_.load(std::memory_order_seq_cst) == seen) futex_wait(&seq_, seen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = seq_.load(std::memory_order_acquire);
      work(id);
    }
  }

  std::mutex busy_;  // one job at a time; a second caller meanwhile runs its range alone
  std::vector<std::thread> helpers_;
  Job job_{};
  std::atomic<uint64_t> work_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> seq_{0};  // bumped for each job; the helpers' futex
  std::atomic<int> sleepers_{0};
};

ChunkPool& chunk_pool() {
  static ChunkPool* pool = new ChunkPool();  // never destroyed: its helpers outlive static destruction
  return *pool;
}

template <typename F>
inline void run_chunks(int64_t n, int64_t chunk, const F& f) {
  chunk_pool().run(n, chunk, f);
}

// sum over d of a[d] * b[d]; 16 independent partial sums so the compiler vectorises without reassociating
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[16] = {0};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[d + j] * to_f32(b[d + j]);
  }
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; d < n; ++d) s += a[d] * to_f32(b[d]);
  return s;
}

// --- vector exp ---------------------------------------------------------------------------------------------
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) by Cephes' degree-6
// polynomial (about 1 ulp on [-ln2/2, ln2/2]); x is clamped to where float exp neither overflows nor
// underflows, in an order that lets a NaN through. Every element goes through the same instructions
// (tails by masked loads and stores), so the result of an element does not depend on its neighbours.

// the clamp, log2(e), ln 2 in two parts, and the polynomial's coefficients (highest degree first), shared by the
// 16- and 8-lane versions
constexpr float kExpMax = 88.3762626647949f, kExpMin = -87.3365447505531f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef KVF_AVX512
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(kExpMax), _mm512_max_ps(_mm512_set1_ps(kExpMin), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);  // y * 2^n
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 bfloat16s widened exactly to floats
inline __m512 widen_bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// 16 floats from memory, or 16 bfloat16s widened exactly to floats
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) { return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// 16 floats -> 16 bfloat16s, round_bf16's rounding (nearest even; a NaN becomes 0x7FC0)
inline __m256i round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// the sum of a's 16 lanes, added in pairs (i, i + 8), then (i, i + 4), (i, i + 2), (0, 1): GCC's
// _mm512_reduce_add_ps, written out so that hsum16x16's sums are the same bits with any compiler
inline float hsum16(__m512 a) {
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), _mm512_castps512_ps256(a));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1)));
}

// lane i = hsum16 of the 16 floats at v + 16 * i (i < 16), the same pairs in the same order: blocks of 4 lanes
// pair (b0, b2) and (b1, b3), then the two halves, then lanes (0, 2) and (1, 3), then (0, 1); vector i's sum
// lands in lane 4 * (i % 4) + i / 4, which the last permute undoes
inline __m512 hsum16x16(const float* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_loadu_ps(v + 32 * i), y = _mm512_loadu_ps(v + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0xEE), _mm512_shuffle_f32x4(x, y, 0x44));
  }
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i from = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(from, d);
}
#endif

#ifdef KVF_AVX2
// exp16's steps on 8 lanes; 2^n as two power-of-two factors (n is in [-126, 128] after the clamp, so each
// factor's exponent field stays normal and the first product is exact): one rounding, as scalef's
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(kExpMax), _mm256_max_ps(_mm256_set1_ps(kExpMin), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

// the mask of lanes [0, min(n, 8)) for AVX2's masked loads and stores
inline __m256i tail_mask8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))), lane);
}

// the sum of a's 8 lanes, (i, i + 4) then (i, i + 2) then (0, 1): hsum16's last three steps
inline float hsum8(__m256 a) {
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

// s[i] = exp(s[i] - m) for i < n; returns their sum (in lane order, then across lanes: the same for any caller)
inline float exp_shifted_sum(float* s, int64_t n, float m) {
#ifdef KVF_AVX512
  __m512 total = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    _mm512_mask_storeu_ps(s + i, k, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(total);
#elif defined(KVF_AVX2)
  __m256 total = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i k = tail_mask8(n - i);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), mv)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + i, k, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum8(total);
#else
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - m));
  return total;
#endif
}

// a[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, for i < n
inline void silu_mul(const float* g, const float* u, float* a, int64_t n) {
#ifdef KVF_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
    const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_mask_storeu_ps(a + i, k, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(k, u + i)));
  }
#elif defined(KVF_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i k = tail_mask8(n - i);
    const __m256 gv = _mm256_maskload_ps(g + i, k);
    const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_maskstore_ps(a + i, k, _mm256_mul_ps(sig, _mm256_maskload_ps(u + i, k)));
  }
#else
  for (int64_t i = 0; i < n; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

// --- projections ----------------------------------------------------------------------------------------------
// y[b, n] = sum_k x[b, k] w[n, k], with w packed once into panels of kPanel output columns laid out k-major
// ([ceil(N / kPanel), K, kPanel], zero past N): a panel is read contiguously and shared by a group of up to 8
// batch rows while it sits in L1/L2. Each output element is one FMA chain over k = 0..K-1 in order, whatever
// the row group or the batch, so a row's result does not depend on its batch-mates.

constexpr int64_t kPanel = 32;

// Software prefetch in the panel kernels. A decode step streams each panel from DRAM once with only a few
// cycles of arithmetic per 64 bytes, and the hardware prefetchers alone held a 2-thread 8-row step of the 100M
// preset to ~50 GB/s of this Zen 5 box's ~80 (docs/benchmarks.md, "software prefetch"). So each k step (128
// bytes of a panel, float32 or bfloat16) also asks for the two lines kPrefetchAhead bytes further on, as long as
// they lie before `pf_end`: the end of the panels the caller reads in order (its chunk). nullptr: no prefetch,
// for a panel an earlier group of rows has just brought into the cache. Prefetches change no arithmetic.
constexpr int64_t kPrefetchAhead = 8192;

// how many of a kernel's first k steps (128 bytes of panel each, from `panel`) prefetch inside [.., pf_end)
inline int64_t prefetch_steps(const void* panel, int64_t steps, const void* pf_end) {
  if (pf_end == nullptr) return 0;
  const int64_t room = static_cast<const char*>(pf_end) - static_cast<const char*>(panel) - kPrefetchAhead;
  return room <= 0 ? 0 : std::min(steps, room / 128);
}

#if defined(KVF_AVX512) || defined(KVF_AVX2)
// always inlined: GCC 12 dropped every prefetch of an always-inlined AVX2 pass that called it as a plain inline
// function (no prefetcht0 left in the build)
[[gnu::always_inline]] inline void prefetch_step(const char* ahead, int64_t step) {
  _mm_prefetch(ahead + step * 128, _MM_HINT_T0);
  _mm_prefetch(ahead + step * 128 + 64, _MM_HINT_T0);
}
#endif

#ifdef KVF_AVX2
// AVX2 has 16 ymm registers, too few for 8 rows x 32 columns of accumulators: a panel kernel takes its rows in
// groups of RS and the panel's columns in groups of 8 * NC, and k in blocks of kPanelBlock steps (16 KiB of
// panel at most) so that each pass after the first over a block reads it from L1; a pass keeps its accumulators
// in registers over the block and in `acc` ([R, kPanel] floats) between blocks. Every output element is still
// one FMA chain over k in order. The passes are always inlined into panel_passes (a lambda, not a function
// pointer, carries them there): reached through a pointer, GCC inlined them or not depending on the size of
// unrelated code (an out-of-line float32 pass ran at 46-50 GFLOP/s against 67-79 inlined, 32 rows of the 100M
// preset's gate_up).
constexpr int64_t kPanelBlock = 64;

// float32 panels: rows [RS] x columns c0..c0 + 8 * NC of acc, over k in [k0, k1)
template <int RS, int NC>
[[gnu::always_inline]] inline void panel_pass_avx2(const float* x, int64_t K, const float* panel, int64_t k0,
                                                   int64_t k1, int64_t c0, float* acc, int64_t kp) {
  __m256 a[RS][NC];
  for (int r = 0; r < RS; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + c0 + 8 * c);
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchAhead;
  for (int64_t k = k0; k < k1; ++k) {
    if (k < kp) prefetch_step(ahead, k);
    __m256 xv[RS];
    for (int r = 0; r < RS; ++r) xv[r] = _mm256_broadcast_ss(x + r * K + k);
    for (int c = 0; c < NC; ++c) {
      const __m256 w = _mm256_loadu_ps(panel + k * kPanel + c0 + 8 * c);
      for (int r = 0; r < RS; ++r) a[r][c] = _mm256_fmadd_ps(xv[r], w, a[r][c]);
    }
  }
  for (int r = 0; r < RS; ++r)
    for (int c = 0; c < NC; ++c) _mm256_store_ps(acc + r * kPanel + c0 + 8 * c, a[r][c]);
}

// bfloat16 panels, k pairs j in [k0, k1): a 32-byte load is 8 columns' (even k, odd k) weights, widened exactly
// by a shift (even) and a mask (odd); x's rows are already floats (KVF_WIDEN_X), broadcast by loads; the odd k's
// product is added first, as VDPBF16PS does
template <int RS, int NC>
[[gnu::always_inline]] inline void panel_pass_bf16_avx2(const float* x, int64_t Kp, const bf16_t* panel, int64_t k0,
                                                        int64_t k1, int64_t c0, float* acc, int64_t kp) {
  __m256 a[RS][NC];
  for (int r = 0; r < RS; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + c0 + 8 * c);
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchAhead;
  for (int64_t j = k0; j < k1; ++j) {
    if (j < kp) prefetch_step(ahead, j);
    if constexpr (RS <= 2) {  // each row's pair broadcast once, then column group by column group
      __m256 xe[RS], xo[RS];
      for (int r = 0; r < RS; ++r) {
        xo[r] = _mm256_broadcast_ss(x + r * Kp + 2 * j + 1);
        xe[r] = _mm256_broadcast_ss(x + r * Kp + 2 * j);
      }
      for (int c = 0; c < NC; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (j * kPanel + c0 + 8 * c) * 2));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
        for (int r = 0; r < RS; ++r) a[r][c] = _mm256_fmadd_ps(xe[r], we, _mm256_fmadd_ps(xo[r], wo, a[r][c]));
      }
    } else {  // every column group's weights widened once, then row by row
      __m256 we[NC], wo[NC];
      for (int c = 0; c < NC; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (j * kPanel + c0 + 8 * c) * 2));
        we[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        wo[c] = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
      }
      for (int r = 0; r < RS; ++r) {
        const __m256 xo = _mm256_broadcast_ss(x + r * Kp + 2 * j + 1);
        for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(xo, wo[c], a[r][c]);
        const __m256 xe = _mm256_broadcast_ss(x + r * Kp + 2 * j);
        for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(xe, we[c], a[r][c]);
      }
    }
  }
  for (int r = 0; r < RS; ++r)
    for (int c = 0; c < NC; ++c) _mm256_store_ps(acc + r * kPanel + c0 + 8 * c, a[r][c]);
}

// R rows (a panel kernel's row count) over `steps` k steps (float32 k, or bfloat16 k pairs; x's rows `ldx`
// elements apart) as passes of RS rows x 8 * NC columns per block of k; only the first pass over a block
// prefetches, up to pf_end
template <int R, int RS, int NC, typename X, typename T, typename Pass>
inline void panel_passes(const X* x, int64_t ldx, int64_t steps, const T* panel, int64_t cols, float* y, int64_t ldy,
                         const T* pf_end, Pass pass) {
  static_assert(R % RS == 0, "whole row groups");
  alignas(32) float acc[R * kPanel];
  const int64_t kp = prefetch_steps(panel, steps, pf_end);
  for (int64_t k0 = 0; k0 < steps; k0 += kPanelBlock) {
    const int64_t k1 = std::min(steps, k0 + kPanelBlock);
    for (int r0 = 0; r0 < R; r0 += RS)
      for (int64_t c0 = 0; c0 < cols; c0 += 8 * NC)
        pass(x + r0 * ldx, ldx, panel, k0, k1, c0, acc + r0 * kPanel, r0 == 0 && c0 == 0 ? kp : 0);
  }
  for (int r = 0; r < R; ++r) std::copy(acc + r * kPanel, acc + r * kPanel + cols, y + r * ldy);
}
#endif

template <int R>
inline void panel_rows(const float* x, int64_t K, const float* panel, int64_t cols, float* y, int64_t ldy,
                       const float* pf_end) {
  // x: R rows of K; panel: [K, kPanel]; y[r * ldy + j] for j < cols
#ifdef KVF_AVX512
  static_assert(kPanel * sizeof(float) == 128, "a k step is 128 bytes of panel");
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchAhead;
  const int64_t kp = prefetch_steps(panel, K, pf_end);
  for (int64_t k = 0; k < K; ++k) {
    if (k < kp) prefetch_step(ahead, k);
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel), w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, tail_mask(cols), acc[r][0]);
    if (cols > 16) _mm512_mask_storeu_ps(y + r * ldy + 16, tail_mask(cols - 16), acc[r][1]);
  }
#elif defined(KVF_AVX2)
  constexpr int RS = R < 4 ? R : 4;  // 4 rows x 16 columns: 8 accumulators, 4 broadcasts, a weight
  panel_passes<R, RS, 2>(x, K, K, panel, cols, y, ldy, pf_end, [](auto... a) { panel_pass_avx2<RS, 2>(a...); });
#else
  (void)pf_end;
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = std::fma(x[r * K + k], panel[k * kPanel + j], acc[r][j]);
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + cols, y + r * ldy);
#endif
}

// bfloat16 panels: [ceil(N / kPanel), Kp / 2, kPanel, 2] (Kp = K rounded up to even, zero-padded), i.e. for each
// pair of k the kPanel columns' two weights side by side: one 64-byte load is 16 columns' pairs, the operand
// layout of VDPBF16PS. x: R rows of Kp bfloat16 values (as floats where KVF_WIDEN_X). Each output is one chain
// over the k pairs in order, adding the odd k's product then the even k's (products of two bfloat16s are exact
// in float32).
template <int R>
inline void panel_rows_bf16(const panel_x_t* x, int64_t Kp, const bf16_t* panel, int64_t cols, float* y, int64_t ldy,
                            const bf16_t* pf_end) {
#ifdef KVF_AVX512
  static_assert(2 * kPanel * sizeof(bf16_t) == 128, "a k pair is 128 bytes of panel");
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(panel) + kPrefetchAhead;
  const int64_t jp = prefetch_steps(panel, Kp / 2, pf_end);
  for (int64_t j = 0; j < Kp / 2; ++j) {
    if (j < jp) prefetch_step(ahead, j);
    const __m512i w0 = _mm512_loadu_si512(panel + j * 2 * kPanel), w1 = _mm512_loadu_si512(panel + j * 2 * kPanel + 32);
#if defined(__AVX512BF16__)
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * Kp + 2 * j, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, (__m512bh)w1);
    }
#else
    const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
    const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(to_f32(x[r * Kp + 2 * j])), xo = _mm512_set1_ps(to_f32(x[r * Kp + 2 * j + 1]));
      acc[r][0] = _mm512_fmadd_ps(xe, w0e, _mm512_fmadd_ps(xo, w0o, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(xe, w1e, _mm512_fmadd_ps(xo, w1o, acc[r][1]));
    }
#endif
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, tail_mask(cols), acc[r][0]);
    if (cols > 16) _mm512_mask_storeu_ps(y + r * ldy + 16, tail_mask(cols - 16), acc[r][1]);
  }
#elif defined(KVF_AVX2)
  // 1-2 rows x 32 columns (8 accumulators at most, 4 broadcasts, a weight pair), or 4 rows x 16 columns (8
  // accumulators, 4 widened weights, a broadcast)
  constexpr int RS = R < 4 ? R : 4, NC = RS < 4 ? 4 : 2;
  panel_passes<R, RS, NC>(x, Kp, Kp / 2, panel, cols, y, ldy, pf_end,
                          [](auto... a) { panel_pass_bf16_avx2<RS, NC>(a...); });
#else
  (void)pf_end;
  float acc[R][kPanel] = {};
  for (int64_t j = 0; j < Kp / 2; ++j)
    for (int r = 0; r < R; ++r) {
      const float xe = to_f32(x[r * Kp + 2 * j]), xo = to_f32(x[r * Kp + 2 * j + 1]);
      for (int64_t c = 0; c < kPanel; ++c) {
        const bf16_t* w = panel + (j * kPanel + c) * 2;
        acc[r][c] = std::fma(xe, to_f32(w[0]), std::fma(xo, to_f32(w[1]), acc[r][c]));
      }
    }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + cols, y + r * ldy);
#endif
}

// columns n0..n0+cols-1 of every row of y [B, N]: + bias, then residual + (the order the torch forward uses)
inline void add_bias_residual(int64_t B, int64_t n0, int64_t cols, int64_t N, const float* bias, const float* residual,
                              float* y) {
  for (int64_t r = 0; r < B; ++r) {
    float* yr = y + r * N;
    if (bias != nullptr)
      for (int64_t n = n0; n < n0 + cols; ++n) yr[n] += bias[n];
    if (residual != nullptr)
      for (int64_t n = n0; n < n0 + cols; ++n) yr[n] = residual[r * N + n] + yr[n];
  }
}

// AMX (TDPBF16PS) for bfloat16 panels, where the build and the CPU have it and Linux grants the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM): the bfloat16 panels already hold, for each pair of k, each column's two
// weights side by side, which is the layout of AMX's B operand (16 k pairs x 16 columns a tile). A tile
// product sums its 16 k pairs in the hardware's own order, which is not VDPBF16PS's (the bits differ from the
// AVX-512 path's in the last places), so once a process has AMX it takes it for every bfloat16 projection whose K
// is a multiple of 32, at every batch size: a row's result still depends only on that row (each output row
// of a tile product is its own row's sums), never on its batch-mates. Rows go in tiles of 16 (zero rows past
// the batch).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(KVF_AVX512)
#define KVF_AMX 1
#include <cpuid.h>

constexpr int kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM (Linux 5.16+)
constexpr int kXfeatureXtiledata = 18;

bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    if (const char* off = std::getenv("KVFENCE_NATIVE_AMX"); off != nullptr && std::strcmp(off, "0") == 0) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles: 0, 1 = C (`rows` rows x 16 float32 columns: the panel's columns 0-15, 16-31); 2 = A (`rows` rows x 16
// k pairs); 3, 4 = B (16 k pairs x 16 columns x 2). Each C row is its own A row's sums, whatever `rows` is.
inline void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = t < 3 ? rows : 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// y[r * ldy + j] (r < rows, j < cols) of `rows` (the tiles' configured rows) rows of x (bfloat16, ldx apart, Kp
// each) times one panel
inline void panel_tile_bf16(const bf16_t* x, int64_t Kp, int64_t ldx, const bf16_t* panel, int64_t cols, float* y,
                            int64_t ldy, int64_t rows) {
  alignas(64) float out[16][kPanel];
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t j0 = 0; j0 < Kp / 2; j0 += 16) {
    _tile_loadd(2, x + 2 * j0, ldx * sizeof(bf16_t));
    _tile_loadd(3, panel + j0 * 2 * kPanel, 2 * kPanel * sizeof(bf16_t));
    _tile_loadd(4, panel + j0 * 2 * kPanel + 32, 2 * kPanel * sizeof(bf16_t));
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, &out[0][0], kPanel * sizeof(float));
  _tile_stored(1, &out[0][16], kPanel * sizeof(float));
  for (int64_t r = 0; r < rows; ++r) std::copy(out[r], out[r] + cols, y + r * ldy);
}
#endif

// whether bfloat16 projections with this K run on AMX tiles in this process
inline bool amx_applies(int64_t K) {
#ifdef KVF_AMX
  return K % 32 == 0 && amx_ready();
#else
  (void)K;
  return false;
#endif
}

// One panel of output columns for every row of the batch: rows in groups of 8, 4, 2, 1 (the same chain per
// output whatever the group), then bias and residual. The first group streams the panel in and prefetches up
// to pf_end (the end of the caller's chunk of panels); the later groups find it in the cache.
template <typename XT, typename WT, typename Rows8, typename Rows4, typename Rows2, typename Rows1>
inline void panel_all_rows(const XT* x, int64_t B, int64_t Kx, const WT* panel, int64_t n0, int64_t cols, int64_t N,
                           const float* bias, const float* residual, float* y, const WT* pf_end, Rows8 r8, Rows4 r4,
                           Rows2 r2, Rows1 r1) {
  int64_t b = 0;
  const WT* pf = pf_end;
  for (; b + 8 <= B; b += 8, pf = nullptr) r8(x + b * Kx, Kx, panel, cols, y + b * N + n0, N, pf);
  for (; b + 4 <= B; b += 4, pf = nullptr) r4(x + b * Kx, Kx, panel, cols, y + b * N + n0, N, pf);
  for (; b + 2 <= B; b += 2, pf = nullptr) r2(x + b * Kx, Kx, panel, cols, y + b * N + n0, N, pf);
  for (; b < B; ++b, pf = nullptr) r1(x + b * Kx, Kx, panel, cols, y + b * N + n0, N, pf);
  add_bias_residual(B, n0, cols, N, bias, residual, y);
}

// Panels a chunk of a projection's work (panel_chunk): about `bytes` of weights, so that a thread reads that much
// in address order before it jumps (the hardware prefetchers, and the kernels' own prefetch, which stops at the
// chunk's end, restart at each jump), but at least 4 chunks a thread, so that the last ones balance the
// threads. The prefill products group panels by 256 KiB (their cache blocking). A decode step (panel_grain)
// streams its weights from DRAM with little arithmetic per byte: 512 KiB chunks at every batch size. With the
// prefetch, a scratch benchmark of the 100M preset's step projections (2 threads) took 2.6-2.8 ms at 8 rows
// against 3.0-3.9 ms with 256 KiB chunks, and 8.0-8.3 ms at 32 rows against 9.0-10.3 ms with the one panel a
// chunk used before from 16 rows on (docs/benchmarks.md, "software prefetch").
inline int64_t panel_chunk(int64_t panels, int64_t panel_bytes, int64_t bytes = int64_t{256} << 10) {
  const int64_t per_thread = panels / (4 * int64_t{at::get_num_threads()});
  return std::max<int64_t>(1, std::min(bytes / panel_bytes, per_thread));
}

inline int64_t panel_grain(int64_t panels, int64_t panel_bytes) { return panel_chunk(panels, panel_bytes, int64_t{512} << 10); }

// y [B, N] = x [B, K] @ w^T (+ bias) (+ residual), w as float32 packed panels (pack_panels); split over panels
void packed_linear_into(const float* x, int64_t B, int64_t K, const float* packed, int64_t N, const float* bias,
                        const float* residual, float* y) {
  TORCH_CHECK(residual == nullptr || residual != y, "packed_linear_into: the residual must not be the output");
  if (B == 0) return;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  run_chunks(panels, panel_grain(panels, K * kPanel * int64_t{sizeof(float)}), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      panel_all_rows(x, B, K, packed + p * K * kPanel, n0, std::min(kPanel, N - n0), N, bias, residual, y,
                     packed + p1 * K * kPanel, panel_rows<8>, panel_rows<4>, panel_rows<2>, panel_rows<1>);
    }
  });
}

// The same with bfloat16 panels (pack_panels of a bfloat16 weight): x rounded to bfloat16 first, zero-padded
// to an even K
void packed_linear_into(const float* x, int64_t B, int64_t K, const bf16_t* packed, int64_t N, const float* bias,
                        const float* residual, float* y) {
  TORCH_CHECK(residual == nullptr || residual != y, "packed_linear_into: the residual must not be the output");
  if (B == 0) return;
  const int64_t Kp = K + (K & 1), panels = (N + kPanel - 1) / kPanel;
  const bool amx = amx_applies(K);
  // AMX: rows 32 elements further apart than Kp, so that a tile's 16 rows do not share one L1 set when Kp * 2
  // bytes is a multiple of 4 KiB
  const int64_t ldx = amx ? Kp + 32 : Kp;
  std::vector<bf16_t> xb(B * ldx, 0);
  for (int64_t b = 0; b < B; ++b) store_row(x + b * K, K, xb.data() + b * ldx);
#ifdef KVF_WIDEN_X
  std::vector<float> xw(amx ? 0 : B * Kp);  // ldx is Kp here
  for (int64_t i = 0; i < static_cast<int64_t>(xw.size()); ++i) xw[i] = to_f32(xb[i]);
  const panel_x_t* xp = xw.data();
#else
  const panel_x_t* xp = xb.data();
#endif
  run_chunks(panels, panel_grain(panels, Kp * kPanel * int64_t{sizeof(bf16_t)}), [&](int64_t p0, int64_t p1) {
#ifdef KVF_AMX
    if (amx) {
      // per thread and per call (oneDNN may have changed it since): rows in tiles of 16, then the rest
      int configured = 0;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        for (int64_t b0 = 0; b0 < B; b0 += 16) {
          const int rows = static_cast<int>(std::min<int64_t>(16, B - b0));
          if (rows != configured) amx_configure(configured = rows);
          panel_tile_bf16(xb.data() + b0 * ldx, Kp, ldx, packed + p * Kp * kPanel, cols, y + b0 * N + n0, N, rows);
        }
        add_bias_residual(B, n0, cols, N, bias, residual, y);
      }
      _tile_release();
      return;
    }
#endif
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      panel_all_rows(xp, B, Kp, packed + p * Kp * kPanel, n0, std::min(kPanel, N - n0), N, bias, residual, y,
                     packed + p1 * Kp * kPanel, panel_rows_bf16<8>, panel_rows_bf16<4>, panel_rows_bf16<2>,
                     panel_rows_bf16<1>);
    }
  });
}

// --- many-row bfloat16 products on the panels (prefill) -------------------------------------------------------
#ifdef KVF_AVX512
// the bfloat16 epilogue of one row's columns n0..n0+cols-1: y = round(round(sum + bias) + residual) (torch's
// bfloat16 F.linear, then `residual + y`); out: the row's float32 sums
inline void gemm_epilogue_row(const float* out, int64_t n0, int64_t cols, const float* bias, const bf16_t* residual_row,
                              bf16_t* y_row) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = tail_mask(cols - c);
    __m512 v = _mm512_maskz_loadu_ps(k, out + c);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + n0 + c));
    __m256i h = round_bf16x16(v);
    if (residual_row != nullptr) {
      const __m512 res = widen_bf16x16(_mm256_maskz_loadu_epi16(k, residual_row + n0 + c));
      h = round_bf16x16(_mm512_add_ps(res, widen_bf16x16(h)));
    }
    _mm256_mask_storeu_epi16(y_row + n0 + c, k, h);
  }
}
#else
inline void gemm_epilogue_row(const float* out, int64_t n0, int64_t cols, const float* bias, const bf16_t* residual_row,
                              bf16_t* y_row) {
  for (int64_t c = 0; c < cols; ++c) {
    const bf16_t h = round_bf16(bias != nullptr ? out[c] + bias[n0 + c] : out[c]);
    y_row[n0 + c] = residual_row != nullptr ? round_bf16(to_f32(residual_row[n0 + c]) + to_f32(h)) : h;
  }
}
#endif

// y [M, N] = x [M, K] @ w^T for bfloat16 x and bfloat16 panels on AMX, for prefill chunks (M in the hundreds or
// thousands), without unpacking the weight: the product reads the panels the decode step reads (one copy of the
// weights). Cache blocking: the work is split over groups of panels (about 512 KiB of weights each, which stay
// in the core's L2); a group runs every block of up to ~1 MiB of x's rows (in L2 while the group's panels go
// through it), so each weight panel comes from DRAM once per call and x from the last-level cache once per
// group. Within a panel, rows go in pairs of 16-row tiles (four C tiles: 2 row tiles x the panel's 2 column
// tiles, each B tile load shared by both row tiles). Each C row is its own x row's sums over k in the same
// order as panel_tile_bf16's (16 k pairs a step, in order), so a row's products are the bits the decode step
// computes for it, whatever M is. Epilogue as torch's bfloat16 F.linear then `residual + y`: the float32 sum
// (+ bias) is rounded to bfloat16, then added to the residual and rounded again.
#ifdef KVF_AMX

// tiles 0, 1 = C of rows 0-15 (r0 rows), 2, 3 = C of rows 16-31 (r1 rows, 0: unused); 4, 5 = their A; 6, 7 = B
inline void amx_configure_pair(int r0, int r1) {
  TileConfig cfg;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// out [32][kPanel] float32 (rows r0 + r1 as configured) = rows of x (ldx apart, Kp each) times one panel
template <bool kTwo>
inline void panel_tile_pair(const bf16_t* x, int64_t Kp, int64_t ldx, const bf16_t* panel, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  if (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const bf16_t* x1 = x + 16 * ldx;
  for (int64_t j0 = 0; j0 < Kp / 2; j0 += 16) {
    _tile_loadd(6, panel + j0 * 2 * kPanel, 2 * kPanel * sizeof(bf16_t));
    _tile_loadd(7, panel + j0 * 2 * kPanel + 32, 2 * kPanel * sizeof(bf16_t));
    _tile_loadd(4, x + 2 * j0, ldx * sizeof(bf16_t));
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwo) {
      _tile_loadd(5, x1 + 2 * j0, ldx * sizeof(bf16_t));
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, kPanel * sizeof(float));
  _tile_stored(1, out + 16, kPanel * sizeof(float));
  if (kTwo) {
    _tile_stored(2, out + 16 * kPanel, kPanel * sizeof(float));
    _tile_stored(3, out + 16 * kPanel + 16, kPanel * sizeof(float));
  }
}

// y [M, N] bfloat16 (rows ldy apart) = round(round(x [M, Kp] @ panels^T + bias) + residual); xb: bfloat16 rows ldx
// apart, zero past K; bias [N] float32 or null; residual [M, N] bfloat16 (rows N apart) or null
void panel_gemm_bf16_into(const bf16_t* xb, int64_t M, int64_t Kp, int64_t ldx, const bf16_t* packed, int64_t N,
                          const float* bias, const bf16_t* residual, bf16_t* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_bytes = Kp * kPanel * int64_t{sizeof(bf16_t)};
  const int64_t group = std::max<int64_t>(1, (int64_t{512} << 10) / panel_bytes);
  const int64_t row_block = std::max<int64_t>(32, ((int64_t{1} << 20) / (ldx * int64_t{sizeof(bf16_t)})) / 32 * 32);
  run_chunks(panels, group, [&](int64_t p0, int64_t p1) {
    alignas(64) float out[32 * kPanel];
    int c0 = -1, c1 = -1;  // the tile configuration in place (per thread and per call: oneDNN may change it)
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t p = p0; p < p1; ++p) {
        const bf16_t* panel = packed + p * Kp * kPanel;
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        for (int64_t r = m0; r < m1; r += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, m1 - r));
          const int r0 = std::min(rows, 16), r1 = rows - r0;
          if (r0 != c0 || r1 != c1) amx_configure_pair(c0 = r0, c1 = r1);
          if (r1 > 0)
            panel_tile_pair<true>(xb + r * ldx, Kp, ldx, panel, out);
          else
            panel_tile_pair<false>(xb + r * ldx, Kp, ldx, panel, out);
          for (int i = 0; i < rows; ++i)
            gemm_epilogue_row(out + i * kPanel, n0, cols, bias, residual == nullptr ? nullptr : residual + (r + i) * N,
                              y + (r + i) * N);
        }
      }
    }
    _tile_release();
  });
}
#endif

// The same product without AMX, on panel_rows_bf16 (packed_linear's own kernel: AVX512_BF16's VDPBF16PS, or the
// same sums by AVX-512, AVX2 or plain float FMAs), so a row's sums are again the bits the decode step computes
// for it. The AMX version's cache blocking at half the sizes (panel groups of ~256 KiB, row blocks of ~512 KiB:
// an AVX512_BF16 CPU without AMX, e.g. Zen 4, may have 1 MiB of L2 a core), rows in groups of 8 inside; x:
// [M, Kp] bfloat16 rows Kp apart (K even: x itself). On an AVX2 CPU (Zen 3) torch's bfloat16 F.linear, the
// alternative, ran at ~20 GFLOP/s against these kernels' ~85 (docs/benchmarks.md, "AVX2").
void panel_gemm_bf16_dot_into(const bf16_t* xb, int64_t M, int64_t Kp, const bf16_t* packed, int64_t N,
                              const float* bias, const bf16_t* residual, bf16_t* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // panel groups as panel_chunk's (~256 KiB, at least 4 a thread: e.g. 24 panels at K = 768 would otherwise
  // leave one thread a last large group)
  const int64_t group = panel_chunk(panels, Kp * kPanel * int64_t{sizeof(bf16_t)});
  const int64_t row_block = std::max<int64_t>(8, ((int64_t{512} << 10) / (Kp * int64_t{sizeof(panel_x_t)})) / 8 * 8);
#ifdef KVF_WIDEN_X
  std::vector<float> xw(M * Kp);
  run_chunks(M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * Kp; i < m1 * Kp; ++i) xw[i] = to_f32(xb[i]);
  });
  const panel_x_t* xp = xw.data();
#else
  const panel_x_t* xp = xb;
#endif
  run_chunks(panels, group, [&](int64_t p0, int64_t p1) {
    alignas(64) float out[8 * kPanel];
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t p = p0; p < p1; ++p) {
        const bf16_t* panel = packed + p * Kp * kPanel;
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        for (int64_t r = m0; r < m1;) {
          const int64_t rows = m1 - r >= 8 ? 8 : m1 - r >= 4 ? 4 : m1 - r >= 2 ? 2 : 1;
          const panel_x_t* xr = xp + r * Kp;
          const bf16_t* pf = r == 0 ? packed + p1 * Kp * kPanel : nullptr;  // the group's first pass: from DRAM
          if (rows == 8) panel_rows_bf16<8>(xr, Kp, panel, kPanel, out, kPanel, pf);
          else if (rows == 4) panel_rows_bf16<4>(xr, Kp, panel, kPanel, out, kPanel, pf);
          else if (rows == 2) panel_rows_bf16<2>(xr, Kp, panel, kPanel, out, kPanel, pf);
          else panel_rows_bf16<1>(xr, Kp, panel, kPanel, out, kPanel, pf);
          for (int64_t i = 0; i < rows; ++i)
            gemm_epilogue_row(out + i * kPanel, n0, cols, bias, residual == nullptr ? nullptr : residual + (r + i) * N,
                              y + (r + i) * N);
          r += rows;
        }
      }
    }
  });
}

// whether panel_gemm_bf16 runs here for this K: AMX tiles (K a multiple of 32), else panel_rows_bf16 (K even)
inline bool panel_gemm_applies(int64_t K) {
#ifdef KVF_AMX
  if (amx_applies(K)) return true;
  if (amx_ready()) return false;  // AMX takes the other K's products too in packed_linear: no mixing (see above)
#endif
  return K % 2 == 0;
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

// One (sequence, KV head) unit: the G query heads that read KV head hk, against the sequence's L keys and
// values read page by page from the pool (no contiguous copy); an exact two-pass softmax in float32.
template <typename T>
struct Unit {
  const float* q;         // [G, D]
  const T* k;             // the pool: [S, Hkv, D] (float32 or bfloat16)
  const T* v;             // [S, Hkv, Dv]
  const int64_t* pages;   // the sequence's page table
  int64_t L, page_size, Hkv, hk;
  float scale;
  float* out;             // [G, Dv]
};

// each of the G rows of s [G, L]: softmax in place (max, exp and sum, scale)
inline void softmax_rows(float* s, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * L;
    float m = row[0];
    for (int64_t t = 1; t < L; ++t) m = std::max(m, row[t]);
    const float inv = 1.f / exp_shifted_sum(row, L, m);
    for (int64_t t = 0; t < L; ++t) row[t] *= inv;
  }
}

// f(t, row) for each of the unit's tokens t = 0..L-1, row = its (slot, KV head) row of the pool; page by page,
// so no division per token
template <typename T, typename F>
inline void for_each_token(const Unit<T>& u, F&& f) {
  for (int64_t t0 = 0; t0 < u.L; t0 += u.page_size) {
    const int64_t first = u.pages[t0 / u.page_size] * u.page_size, n = std::min(u.page_size, u.L - t0);
    for (int64_t i = 0; i < n; ++i) f(t0 + i, (first + i) * u.Hkv + u.hk);
  }
}

template <typename T>
void attend_generic(const Unit<T>& u, int64_t G, int64_t D, int64_t Dv, float* s, float* acc) {
  for_each_token(u, [&](int64_t t, int64_t row) {
    for (int64_t g = 0; g < G; ++g) s[g * u.L + t] = dot(u.q + g * D, u.k + row * D, D) * u.scale;
  });
  softmax_rows(s, G, u.L);
  std::fill(acc, acc + G * Dv, 0.f);
  for_each_token(u, [&](int64_t t, int64_t row) {
    const T* vt = u.v + row * Dv;
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * u.L + t];
      float* a = acc + g * Dv;
      for (int64_t d = 0; d < Dv; ++d) a[d] += w * to_f32(vt[d]);
    }
  });
  std::copy(acc, acc + G * Dv, u.out);
}

#ifdef KVF_AVX512
// The same unit with D = Dv = 16 * NV and the G queries and G output rows held in registers: a key or value
// row is loaded once for all G heads.
template <typename T, int NV, int G>
void attend_avx512(const Unit<T>& u, float* s) {
  constexpr int64_t D = 16 * NV;
  __m512 q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) q[g][j] = _mm512_loadu_ps(u.q + g * D + 16 * j);
  for_each_token(u, [&](int64_t t, int64_t row) {
    __m512 k[NV];
    for (int j = 0; j < NV; ++j) k[j] = load16(u.k + row * D + 16 * j);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
      for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(q[g][j], k[j], acc);
      s[g * u.L + t] = hsum16(acc) * u.scale;
    }
  });
  softmax_rows(s, G, u.L);
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = _mm512_setzero_ps();
  for_each_token(u, [&](int64_t t, int64_t row) {
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16(u.v + row * D + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * u.L + t]);
      for (int j = 0; j < NV; ++j) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(u.out + g * D + 16 * j, a[g][j]);
}

template <typename T>
using AttendFn = void (*)(const Unit<T>&, float*);

// All Hkv KV heads of one sequence at once (u.hk unused; u.q, u.out: the sequence's [H, D]), with the same
// float operations per output as attend_avx512<T, NV, G> for each head, so the bits are the same: a slot's
// row holds every head's key (Hkv * D contiguous elements), so reading whole rows streams each page once in
// address order instead of one head's 2-line slice of each row per pass. The scores of 16 tokens are summed
// together (hsum16x16: the pairs hsum16 adds, 16 sums a vector). s [H, L]; acc [H, 256]: the 16 tokens'
// product vectors, then the G * Hkv output rows (too many for the registers), which then go to u.out. The values'
// pass (attend_values) takes 4 tokens of a page (D <= 64; one at D = 128) per load and store of an output row,
// each output the same FMA chain in token order: on a scratch harness (4 sequences x 192 tokens, 12/4 heads,
// D = 64, bfloat16), 57 -> 42 ns a token with the pools in cache, 132-157 -> 101-121 on shuffled pages from
// DRAM, no change (71-78) on pages in order.
// acc[h * D + d] += sum over KT consecutive slot rows t (from vrow, rows Hkv * D apart) of p[h * L + t] v_t[hk, d]
// for every query head h (KV head hk = h / G), one FMA per token in order between one load and one store
template <typename T, int NV, int G, int KT>
inline void attend_values(const T* vrow, int64_t Hkv, const float* p, int64_t L, float* acc) {
  constexpr int64_t D = 16 * NV;
  for (int64_t hk = 0; hk < Hkv; ++hk) {
    __m512 v[KT][NV];
    for (int tt = 0; tt < KT; ++tt)
      for (int j = 0; j < NV; ++j) v[tt][j] = load16(vrow + tt * Hkv * D + hk * D + 16 * j);
    for (int g = 0; g < G; ++g) {
      const int64_t h = hk * G + g;
      __m512 w[KT];
      for (int tt = 0; tt < KT; ++tt) w[tt] = _mm512_set1_ps(p[h * L + tt]);
      float* a = acc + h * D;
      for (int j = 0; j < NV; ++j) {
        __m512 x = _mm512_loadu_ps(a + 16 * j);
        for (int tt = 0; tt < KT; ++tt) x = _mm512_fmadd_ps(w[tt], v[tt][j], x);  // tokens in order
        _mm512_storeu_ps(a + 16 * j, x);
      }
    }
  }
}

template <typename T, int NV, int G>
void attend_seq_avx512(const Unit<T>& u, float* s, float* acc) {
  constexpr int64_t D = 16 * NV;
  const int64_t Hkv = u.Hkv, H = G * Hkv, L = u.L;
  const __m512 scale = _mm512_set1_ps(u.scale);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const T* krow = u.k + (u.pages[t / u.page_size] * u.page_size + t % u.page_size) * Hkv * D;
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        __m512 k[NV];
        for (int j = 0; j < NV; ++j) k[j] = load16(krow + hk * D + 16 * j);
        for (int g = 0; g < G; ++g) {
          const float* qg = u.q + (hk * G + g) * D;
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
          for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], a);
          _mm512_storeu_ps(acc + ((hk * G + g) * 16 + i) * 16, a);
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* part = acc + h * 256;
      if (n < 16) std::fill(part + n * 16, part + 256, 0.f);  // lanes past the sequence: computed, not stored
      _mm512_mask_storeu_ps(s + h * L + t0, tail_mask(n), _mm512_mul_ps(hsum16x16(part), scale));
    }
  }
  softmax_rows(s, H, L);
  std::fill(acc, acc + H * D, 0.f);
  // a page's tokens at a time (their values in registers) per load and store of an output row; at D = 128 two
  // tokens' values took 16 zmm and the 0.5B's batch-8 step got ~5% slower, so one there
  constexpr int kTokens = NV <= 4 ? 4 : 1;
  for (int64_t t0 = 0; t0 < L; t0 += u.page_size) {
    const int64_t first = u.pages[t0 / u.page_size] * u.page_size, n = std::min(u.page_size, L - t0);
    int64_t i = 0;
    for (; i + kTokens <= n; i += kTokens)
      attend_values<T, NV, G, kTokens>(u.v + (first + i) * Hkv * D, Hkv, s + t0 + i, L, acc);
    for (; i < n; ++i) attend_values<T, NV, G, 1>(u.v + (first + i) * Hkv * D, Hkv, s + t0 + i, L, acc);
  }
  std::copy(acc, acc + H * D, u.out);
}

template <typename T>
using AttendSeqFn = void (*)(const Unit<T>&, float*, float*);

// the sequence-major twin of attend_kernel's choice (the same shapes), or nullptr
template <typename T>
AttendSeqFn<T> attend_seq_kernel(int64_t D, int64_t Dv, int64_t G) {
  if (D != Dv) return nullptr;
  if (D == 64) {
    switch (G) {
      case 1: return attend_seq_avx512<T, 4, 1>;
      case 2: return attend_seq_avx512<T, 4, 2>;
      case 3: return attend_seq_avx512<T, 4, 3>;
      case 4: return attend_seq_avx512<T, 4, 4>;
    }
  }
  if (D == 128) {
    switch (G) {
      case 1: return attend_seq_avx512<T, 8, 1>;
      case 2: return attend_seq_avx512<T, 8, 2>;
    }
    if (std::is_same<T, bf16_t>::value) {
      switch (G) {
        case 3: return attend_seq_avx512<T, 8, 3>;
        case 4: return attend_seq_avx512<T, 8, 4>;
      }
    }
  }
  return nullptr;
}

// the register-held variant for this head shape, or nullptr (then the generic loops): up to 16 zmm of
// queries and as many of outputs
template <typename T>
AttendFn<T> attend_kernel(int64_t D, int64_t Dv, int64_t G) {
  if (D != Dv) return nullptr;
  if (D == 64) {
    switch (G) {
      case 1: return attend_avx512<T, 4, 1>;
      case 2: return attend_avx512<T, 4, 2>;
      case 3: return attend_avx512<T, 4, 3>;
      case 4: return attend_avx512<T, 4, 4>;
    }
  }
  if (D == 128) {
    switch (G) {
      case 1: return attend_avx512<T, 8, 1>;
      case 2: return attend_avx512<T, 8, 2>;
    }
    // bfloat16 pools only: 3 and 4 query heads per KV head (e.g. 12/4 heads) hold more zmm than there are (the
    // compiler spills some), still several times the generic loops' speed; float32 keeps the generic loops'
    // bits for these shapes
    if (std::is_same<T, bf16_t>::value) {
      switch (G) {
        case 3: return attend_avx512<T, 8, 3>;
        case 4: return attend_avx512<T, 8, 4>;
      }
    }
  }
  return nullptr;
}
#endif

#ifdef KVF_AVX2
// 8 floats from memory, or 8 bfloat16s widened exactly to floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// lane i = the sum of v[i]'s 8 lanes (horizontal adds in a fixed order)
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low halves | high halves]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The AVX2 attention kernels' float operations, shared so that a unit and a whole sequence compute the same bits:
// a[g] = query g's (rows D apart from q) 8-lane partial products with key row kr, 8 columns at a time in order
template <typename T, int G>
inline void key_partials8(const float* q, const T* kr, int64_t D, __m256* a) {
  for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
  for (int64_t j = 0; j < D / 8; ++j) {
    const __m256 kj = load8(kr + 8 * j);
    for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * j), kj, a[g]);
  }
}

// tokens t0..t0+n-1 (n <= 8) of `rows` query heads: each head's 8 partial-product vectors (part, 8 a head; lanes
// past n zeroed) summed (hsum8x8) and scaled into its row of s (rows L apart)
inline void flush_scores8(__m256* part, int64_t rows, int64_t t0, int64_t n, __m256 scale, float* s, int64_t L) {
  for (int64_t h = 0; h < rows; ++h) {
    __m256* ph = part + h * 8;
    for (int64_t i = n; i < 8; ++i) ph[i] = _mm256_setzero_ps();
    _mm256_maskstore_ps(s + h * L + t0, tail_mask8(n), _mm256_mul_ps(hsum8x8(ph), scale));
  }
}

// acc's G rows (D apart) += tokens t0..t0+n-1's values (vf [n, D], n <= 4) weighted by s's G rows (L apart): one
// load and store of an output row per n tokens, each output one FMA chain in token order
template <int G>
inline void add_values8(const float* s, int64_t L, int64_t t0, int64_t n, const float* vf, int64_t D, float* acc) {
  for (int g = 0; g < G; ++g) {
    __m256 w[4];
    for (int64_t tt = 0; tt < n; ++tt) w[tt] = _mm256_broadcast_ss(s + g * L + t0 + tt);
    float* a = acc + g * D;
    for (int64_t j = 0; j < D / 8; ++j) {
      __m256 x = _mm256_loadu_ps(a + 8 * j);
      for (int64_t tt = 0; tt < n; ++tt) x = _mm256_fmadd_ps(w[tt], _mm256_loadu_ps(vf + tt * D + 8 * j), x);
      _mm256_storeu_ps(a + 8 * j, x);
    }
  }
}

// `heads` consecutive KV heads of one sequence from u.hk on (u.q, u.out: their [heads * G, D] query and output
// rows) in 8-lane registers, D = Dv a multiple of 8, G query heads per KV head. One head (heads = 1) is the
// (sequence, KV head) unit; all Hkv heads (u.hk = 0) make a sequence one unit, whose slot rows (every head's key,
// Hkv * D contiguous elements) are then read once in address order instead of a 2-line slice of each row per
// head (attend_seq_avx512's reason, on 8 lanes). A key row is loaded once per 8 columns for a head's G queries,
// the partial products of 8 tokens are summed together (hsum8x8); the values' pass takes 4 tokens (widened once
// into `vf`) per load and store of an output row, each output one FMA chain in token order. So every output's
// float operations depend only on its own q, keys and values: the same bits whatever `heads` or the batch.
// s [heads * G, L]; acc [heads * G, D] then the output; vf [4, D]; part [heads * G, 8] vectors (32-byte aligned).
template <typename T, int G>
void attend_avx2(const Unit<T>& u, int64_t D, int64_t heads, float* s, float* acc, float* vf, __m256* part) {
  const int64_t L = u.L, H = G * heads;
  const __m256 scale = _mm256_set1_ps(u.scale);
  for_each_token(u, [&](int64_t t, int64_t row) {  // row: (slot, u.hk); the next heads follow it
    for (int64_t i = 0; i < heads; ++i) {
      __m256 a[G];
      key_partials8<T, G>(u.q + i * G * D, u.k + (row + i) * D, D, a);
      for (int g = 0; g < G; ++g) part[(i * G + g) * 8 + t % 8] = a[g];
    }
    if (t % 8 == 7) flush_scores8(part, H, t - 7, 8, scale, s, L);
  });
  if (L % 8 != 0) flush_scores8(part, H, L - L % 8, L % 8, scale, s, L);
  softmax_rows(s, H, L);
  std::fill(acc, acc + H * D, 0.f);
  const T* vrows[4];
  int64_t nt = 0, t_first = 0;
  auto values = [&](int64_t t0, int64_t n) {  // tokens t0..t0+n-1 (their (slot, u.hk) rows in vrows), head by head
    for (int64_t i = 0; i < heads; ++i) {
      for (int64_t tt = 0; tt < n; ++tt)
        for (int64_t j = 0; j < D / 8; ++j) _mm256_storeu_ps(vf + tt * D + 8 * j, load8(vrows[tt] + i * D + 8 * j));
      add_values8<G>(s + i * G * L, L, t0, n, vf, D, acc + i * G * D);
    }
  };
  for_each_token(u, [&](int64_t t, int64_t row) {
    if (nt == 0) t_first = t;
    vrows[nt++] = u.v + row * D;
    if (nt == 4) values(t_first, 4), nt = 0;
  });
  if (nt > 0) values(t_first, nt);
  std::copy(acc, acc + H * D, u.out);
}

// `vectors` __m256 in `buf`, 32-byte aligned
inline __m256* aligned_vectors(std::vector<float>& buf, int64_t vectors) {
  buf.resize(vectors * 8 + 8);
  const auto at = reinterpret_cast<std::uintptr_t>(buf.data());
  return reinterpret_cast<__m256*>((at + 31) & ~std::uintptr_t{31});
}

template <typename T>
using AttendAvx2Fn = void (*)(const Unit<T>&, int64_t, int64_t, float*, float*, float*, __m256*);

template <typename T>
AttendAvx2Fn<T> attend_avx2_kernel(int64_t D, int64_t Dv, int64_t G) {
  if (D != Dv || D % 8 != 0) return nullptr;
  switch (G) {
    case 1: return attend_avx2<T, 1>;
    case 2: return attend_avx2<T, 2>;
    case 3: return attend_avx2<T, 3>;
    case 4: return attend_avx2<T, 4>;
    case 5: return attend_avx2<T, 5>;
    case 6: return attend_avx2<T, 6>;
    case 7: return attend_avx2<T, 7>;
    case 8: return attend_avx2<T, 8>;
  }
  return nullptr;
}
#endif

// q [B, H, D]; k_pool [S, Hkv, D]; v_pool [S, Hkv, Dv]; pages [B, P]; lens [B] -> out [B, H, Dv]
template <typename T>
void paged_attention_into(const float* qp, int64_t B, int64_t H, int64_t D, const T* kp, const T* vp,
                          int64_t Hkv, int64_t Dv, const int64_t* pg, int64_t P, const int64_t* ln,
                          int64_t page_size, float sc, float* op) {
  const int64_t G = H / Hkv;
#ifdef KVF_AVX512
  const AttendFn<T> fast = attend_kernel<T>(D, Dv, G);
  // with a sequence or more for every thread, a unit is a whole sequence (every KV head: see attend_seq_avx512)
  const AttendSeqFn<T> seq = B >= 2 * at::get_num_threads() ? attend_seq_kernel<T>(D, Dv, G) : nullptr;
  if (seq != nullptr) {
    run_chunks(B, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores, acc;
      acc.resize(H * std::max<int64_t>(Dv, 256));
      for (int64_t b = begin; b < end; ++b) {
        const Unit<T> u{qp + b * H * D, kp, vp, pg + b * P, ln[b], page_size, Hkv, 0, sc, op + b * H * Dv};
        scores.resize(H * u.L);
        seq(u, scores.data(), acc.data());
      }
    });
    return;
  }
#endif
#ifdef KVF_AVX2
  const AttendAvx2Fn<T> fast = attend_avx2_kernel<T>(D, Dv, G);
  // with a sequence or more for every thread, a unit is a whole sequence (every KV head: see attend_avx2)
  if (fast != nullptr && B >= 2 * at::get_num_threads()) {
    run_chunks(B, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores, acc, vf, parts;
      acc.resize(H * Dv), vf.resize(4 * D);
      __m256* part = aligned_vectors(parts, H * 8);
      for (int64_t b = begin; b < end; ++b) {
        const Unit<T> u{qp + b * H * D, kp, vp, pg + b * P, ln[b], page_size, Hkv, 0, sc, op + b * H * Dv};
        scores.resize(H * u.L);
        fast(u, D, Hkv, scores.data(), acc.data(), vf.data(), part);
      }
    });
    return;
  }
#endif
  run_chunks(B * Hkv, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, acc, vf, parts;  // per thread, reused across chunks and calls
    acc.resize(G * Dv);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      const Unit<T> u{qp + (b * H + hk * G) * D, kp, vp, pg + b * P, ln[b], page_size, Hkv, hk, sc,
                   op + (b * H + hk * G) * Dv};
      scores.resize(G * u.L);
#ifdef KVF_AVX512
      if (fast != nullptr) {
        fast(u, scores.data());
        continue;
      }
#elif defined(KVF_AVX2)
      if (fast != nullptr) {
        vf.resize(4 * D);
        fast(u, D, 1, scores.data(), acc.data(), vf.data(), aligned_vectors(parts, G * 8));
        continue;
      }
#endif
      attend_generic(u, G, D, Dv, scores.data(), acc.data());
    }
  });
}

const float* opt_ptr(const torch::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<float>(); }

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor");
}

// a contiguous CPU tensor of element type T (float: float32, bf16_t: bfloat16)
template <typename T>
T* data_as(const torch::Tensor& t, const char* what) {
  constexpr bool f32 = std::is_same<T, float>::value;
  TORCH_CHECK(t.dtype() == (f32 ? torch::kFloat32 : torch::kBFloat16) && t.device().is_cpu() && t.is_contiguous(),
              what, f32 ? " must be a contiguous float32 CPU tensor" : " must be a contiguous bfloat16 CPU tensor");
  return static_cast<T*>(t.data_ptr());
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

// the panel tensor's shape for a weight [N, K] of element type T (see pack_panels)
template <typename T>
bool packed_as(const torch::Tensor& w, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  if (std::is_same<T, float>::value)
    return w.dim() == 3 && w.size(0) == panels && w.size(1) == K && w.size(2) == kPanel;
  return w.dim() == 4 && w.size(0) == panels && w.size(1) == (K + 1) / 2 && w.size(2) == kPanel && w.size(3) == 2;
}

template <typename T>
void paged_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& pages, const int64_t* ln, int64_t page_size, float sc,
                              torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  paged_attention_into<T>(q.data_ptr<float>(), B, H, D, data_as<T>(k_pool, "k pool"), data_as<T>(v_pool, "v pool"),
                          k_pool.size(1), v_pool.size(2), pages.data_ptr<int64_t>(), pages.size(1), ln, page_size, sc,
                          out.data_ptr<float>());
}

}  // namespace

// q: [B, H, D] (float32 or bfloat16); k_pool: [S, Hkv, D]; v_pool: [S, Hkv, Dv], both float32 or both bfloat16;
// pages: [B, P] int64; lens: [B] int64 -> [B, H, Dv] in q's dtype (float32 arithmetic throughout)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor pages, torch::Tensor lens, int64_t page_size, double scale) {
  TORCH_CHECK(k_pool.dtype() == v_pool.dtype() && (k_pool.dtype() == torch::kFloat32 || is_bf16(k_pool)) &&
                  (q.dtype() == torch::kFloat32 || is_bf16(q)),
              "native decode attention runs on float32 or bfloat16 pools");
  TORCH_CHECK(pages.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "pages and lens must be int64");
  const auto out_dtype = q.scalar_type();
  q = q.to(torch::kFloat32).contiguous();
  k_pool = k_pool.contiguous();
  v_pool = v_pool.contiguous();
  pages = pages.contiguous();
  lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t Hkv = k_pool.size(1), Dv = v_pool.size(2), P = pages.size(1);
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  auto out = torch::empty({B, H, Dv}, q.options());
  if (is_bf16(k_pool))
    paged_attention_dispatch<bf16_t>(q, k_pool, v_pool, pages, ln, page_size, static_cast<float>(scale), out);
  else
    paged_attention_dispatch<float>(q, k_pool, v_pool, pages, ln, page_size, static_cast<float>(scale), out);
  return out.to(out_dtype);
}

// RoPE (rotate-half) in place on bfloat16 heads: x [T, Hq, D] (heads D apart, rows any stride), cos and sin
// [n, D] bfloat16 tables (sin's first half negated), positions [T]: each head becomes
// round(round(x * cos) + roll(x, D / 2) * sin) with float32 arithmetic, the bits of torch's bfloat16
// `addcmul(x * cos, x.roll(D // 2, -1), sin)` (a product of two bfloat16s is exact in float32, so whether the
// last step is an FMA does not matter). One pass over x instead of four, and no gathered [T, 1, D] tables.
void rope_bf16_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  TORCH_CHECK(x.dim() == 3 && is_bf16(x) && x.device().is_cpu() && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_bf16_: x [T, Hq, D] bfloat16, heads contiguous");
  const int64_t T = x.size(0), Hq = x.size(1), D = x.size(2), ld = x.stride(0), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && is_bf16(cos) && is_bf16(sin) && cos.dim() == 2 && cos.size(1) == D &&
                  sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "rope_bf16_: cos, sin [n, D] bfloat16, contiguous");
  positions = positions.to(torch::kInt64).contiguous();
  TORCH_CHECK(positions.numel() == T, "rope_bf16_: one position per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_bf16_: position past the tables");
  bf16_t* xp = static_cast<bf16_t*>(x.data_ptr());  // strided rows (checked above), so not data_as
  const bf16_t* cp = data_as<bf16_t>(cos, "cos");
  const bf16_t* sp = data_as<bf16_t>(sin, "sin");
  run_chunks(T, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> h(D);
    for (int64_t t = begin; t < end; ++t) {
      const bf16_t* c = cp + pos[t] * D;
      const bf16_t* sn = sp + pos[t] * D;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        bf16_t* row = xp + t * ld + hq * D;
#ifdef KVF_AVX512
        if (half % 16 == 0 && D <= 256) {
          __m512 v[16];
          for (int64_t j = 0; j < D / 16; ++j) v[j] = load16(row + 16 * j);
          for (int64_t j = 0; j < D / 16; ++j) {
            const __m512 a = widen_bf16x16(round_bf16x16(_mm512_mul_ps(v[j], load16(c + 16 * j))));
            const __m512 r = v[(j + half / 16) % (D / 16)];
            const __m256i o = round_bf16x16(_mm512_add_ps(a, _mm512_mul_ps(r, load16(sn + 16 * j))));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * j), o);
          }
          continue;
        }
#endif
        for (int64_t d = 0; d < D; ++d) h[d] = to_f32(row[d]);
        for (int64_t d = 0; d < D; ++d) {
          const float a = to_f32(round_bf16(h[d] * to_f32(c[d])));
          row[d] = round_bf16(a + h[(d + half) % D] * to_f32(sn[d]));
        }
      }
    }
  });
}

// RoPE (rotate-half) in place on float32 heads: x [T, Hq, D] (heads D apart, rows any stride), cos and sin [n, D]
// float32 tables (sin's first half negated), positions [T]: each element becomes x[d] * cos[d] + x[d +- D/2] *
// sin[d], the expression (and so, compiled here, the bits) of the decode step's RoPE (decode_layers). One pass
// over x instead of torch's four, and no gathered [T, 1, D] tables.
void rope_f32_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  TORCH_CHECK(x.dim() == 3 && x.dtype() == torch::kFloat32 && x.device().is_cpu() && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "rope_f32_: x [T, Hq, D] float32, heads contiguous");
  const int64_t T = x.size(0), Hq = x.size(1), D = x.size(2), ld = x.stride(0), half = D / 2;
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rope_f32_: cos, sin [n, D] float32");
  positions = positions.to(torch::kInt64).contiguous();
  TORCH_CHECK(positions.numel() == T, "rope_f32_: one position per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_f32_: position past the tables");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  run_chunks(T, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> src(D);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * D;
      const float* sn = sp + pos[t] * D;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* dst = xp + t * ld + hq * D;
        std::copy(dst, dst + D, src.data());
        for (int64_t d = 0; d < half; ++d) dst[d] = src[d] * c[d] + src[d + half] * sn[d];
        for (int64_t d = half; d < D; ++d) dst[d] = src[d] * c[d] + src[d - half] * sn[d];
      }
    }
  });
}

// out[t, i] = silu(gate[t, i]) * up[t, i] for float32 [T, n] gate and up (rows any stride, columns contiguous),
// written into out [T, n] (likewise): the decode step's SiLU and product (silu_mul), rows split over threads
void silu_mul_into(torch::Tensor gate, torch::Tensor up, torch::Tensor out) {
  for (const torch::Tensor* t : {&gate, &up, &out})
    TORCH_CHECK(t->dim() == 2 && t->dtype() == torch::kFloat32 && t->device().is_cpu() && t->stride(1) == 1 &&
                    t->sizes() == gate.sizes(),
                "silu_mul_into: gate, up and out [T, n] float32, columns contiguous");
  const int64_t T = gate.size(0), n = gate.size(1);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t lg = gate.stride(0), lu = up.stride(0), lo = out.stride(0);
  run_chunks(T, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul(g + t * lg, u + t * lu, o + t * lo, n);
  });
}

// Causal attention of B fresh prompts of Q tokens each over their own keys (a prefill with no cached prefix):
// q [T, H, D], k and v [T, Hkv, D], all float32 or all bfloat16, T = B * Q rows in [B, Q] order (rows may be
// strided, e.g. views of the qkv projection; heads contiguous) -> out [T, H, D] in their dtype. Work is split
// over (sequence, KV head) units. A unit copies its keys (transposed: [D, Q], so a score vector is 16 keys) and
// values as float32 once, then takes its query rows in blocks: scores q . k over d in order, times scale, for
// keys 0..i only; an exact softmax per row (softmax_rows: max, exp and sum, scale); the probability-weighted sum
// of the values in float32, rounded to bfloat16 once for bfloat16. The float operations of a row depend only on
// that row, its sequence's keys and values, and Q (never on B or the thread count). torch's SDPA took 3.1 ms a
// layer for 8 x 128 bfloat16 tokens
// (12/4 heads, D = 64) here, plus copies of k and v into [B, Hkv, Q, D] and of the output back.
namespace {

constexpr int64_t kPrefillRows = 4;  // query rows a block (x G heads: the block's query vectors)

// c[r * ldc + i] = scale * sum_k a[r * lda + k] b[k * ldb + i] (over k in order, one FMA chain each) for NR rows
// of a and the 16 * NC columns i of b: each broadcast of a feeds NC FMAs, and the accumulators stay in registers.
// Both halves of the prefill attention are this product: scores (a: query vectors, b: transposed keys) and values
// (a: probabilities, b: widened values, scale 1, which is exact).
template <int NR, int NC>
inline void prefill_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float scale, float* c,
                         int64_t ldc) {
#ifdef KVF_AVX512
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NC];
    for (int i = 0; i < NC; ++i) bv[i] = _mm512_loadu_ps(b + k * ldb + 16 * i);
    for (int r = 0; r < NR; ++r) {
      const __m512 ak = _mm512_set1_ps(a[r * lda + k]);
      for (int i = 0; i < NC; ++i) acc[r][i] = _mm512_fmadd_ps(ak, bv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) _mm512_storeu_ps(c + r * ldc + 16 * i, _mm512_mul_ps(acc[r][i], _mm512_set1_ps(scale)));
#else
  float acc[NR][16 * NC] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < NR; ++r)
      for (int64_t i = 0; i < 16 * NC; ++i) acc[r][i] = std::fma(a[r * lda + k], b[k * ldb + i], acc[r][i]);
  for (int r = 0; r < NR; ++r)
    for (int64_t i = 0; i < 16 * NC; ++i) c[r * ldc + i] = acc[r][i] * scale;
#endif
}

// s[r * ld + j] = scale * qv[r] . k_j for NR query vectors (D apart) and keys j in [0, n) (n a multiple of 16,
// within kt's row length ld; kt: [D, ld]): 32 keys a pass, then 16
template <int NR>
inline void prefill_scores(const float* qv, int64_t D, const float* kt, int64_t ld, int64_t n, float scale, float* s) {
  int64_t j0 = 0;
  for (; j0 + 32 <= n; j0 += 32) prefill_tile<NR, 2>(qv, D, kt + j0, ld, D, scale, s + j0, ld);
  for (; j0 < n; j0 += 16) prefill_tile<NR, 1>(qv, D, kt + j0, ld, D, scale, s + j0, ld);
}

// o[r * D + d] = sum_{j < n} p[r * ld + j] vf[j * D + d] for NR probability rows and every d (D a multiple of 16):
// 64 columns a pass, then 16
template <int NR>
inline void prefill_values(const float* p, int64_t ld, const float* vf, int64_t D, int64_t n, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) prefill_tile<NR, 4>(p, ld, vf + d0, D, n, 1.f, o + d0, D);
  for (; d0 < D; d0 += 16) prefill_tile<NR, 1>(p, ld, vf + d0, D, n, 1.f, o + d0, D);
}

template <typename KV>
torch::Tensor causal_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t B, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(B >= 1 && T % B == 0 && k.size(0) == T && v.size(0) == T && v.size(1) == Hkv && k.size(2) == D &&
                  v.size(2) == D && Hkv >= 1 && H % Hkv == 0 && D % 16 == 0,
              "causal_prefill_attention: shapes (T = B * Q rows; H a multiple of Hkv; D a multiple of 16)");
  const int64_t Q = T / B, G = H / Hkv, Qp = (Q + 15) / 16 * 16, ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0);
  const float sc = static_cast<float>(scale);
  const KV* qp = static_cast<const KV*>(q.data_ptr());
  const KV* kp = static_cast<const KV*>(k.data_ptr());
  const KV* vp = static_cast<const KV*>(v.data_ptr());
  auto out = torch::empty({T, H, D}, q.options());
  KV* op = static_cast<KV*>(out.data_ptr());
  run_chunks(B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // kt's columns Q..Qp-1 (padding keys) stay zero from here on: a unit writes only columns 0..Q-1
    std::vector<float> kt(D * Qp), vf(Q * D), qv(kPrefillRows * G * D), sb(kPrefillRows * G * Qp), ob(kPrefillRows * G * D);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / Hkv, hk = unit % Hkv;
      for (int64_t j = 0; j < Q; ++j) {
        const KV* kr = kp + (b * Q + j) * ldk + hk * D;
        const KV* vr = vp + (b * Q + j) * ldv + hk * D;
        for (int64_t d = 0; d < D; ++d) {
          kt[d * Qp + j] = to_f32(kr[d]);
          vf[j * D + d] = to_f32(vr[d]);
        }
      }
      for (int64_t i0 = 0; i0 < Q; i0 += kPrefillRows) {
        const int64_t nr = std::min(kPrefillRows, Q - i0), n = i0 + nr, n16 = (n + 15) / 16 * 16;
        // query vectors of the block, row-major by (row, head): qv[(r * G + g) * D + d]
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t g = 0; g < G; ++g) {
            const KV* qr = qp + (b * Q + i0 + r) * ldq + (hk * G + g) * D;
            for (int64_t d = 0; d < D; ++d) qv[(r * G + g) * D + d] = to_f32(qr[d]);
          }
        const int64_t nq = nr * G;
        int64_t r4 = 0;
        for (; r4 + 4 <= nq; r4 += 4) prefill_scores<4>(qv.data() + r4 * D, D, kt.data(), Qp, n16, sc, sb.data() + r4 * Qp);
        for (; r4 < nq; ++r4) prefill_scores<1>(qv.data() + r4 * D, D, kt.data(), Qp, n16, sc, sb.data() + r4 * Qp);
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t g = 0; g < G; ++g) {
            float* row = sb.data() + (r * G + g) * Qp;
            softmax_rows(row, 1, i0 + r + 1);  // keys 0..i
            std::fill(row + i0 + r + 1, row + n, 0.f);  // the later keys weigh nothing
          }
        r4 = 0;
        for (; r4 + 4 <= nq; r4 += 4) prefill_values<4>(sb.data() + r4 * Qp, Qp, vf.data(), D, n, ob.data() + r4 * D);
        for (; r4 < nq; ++r4) prefill_values<1>(sb.data() + r4 * Qp, Qp, vf.data(), D, n, ob.data() + r4 * D);
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t g = 0; g < G; ++g) {
            KV* orow = op + ((b * Q + i0 + r) * H + hk * G + g) * D;
            store_row(ob.data() + (r * G + g) * D, D, orow);
          }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor causal_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t B, double scale) {
  for (const torch::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == q.scalar_type() && (is_bf16(*t) || t->dtype() == torch::kFloat32) &&
                    t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "causal_prefill_attention: q, k, v [T, heads, D], all float32 or all bfloat16, on the CPU, heads contiguous");
  return is_bf16(q) ? causal_prefill<bf16_t>(q, k, v, B, scale) : causal_prefill<float>(q, k, v, B, scale);
}

// RMSNorm of each row of x [T, E]: float32 x and w: w * (x * rsqrt(mean(x^2) + eps)), in one pass over the row;
// bfloat16 x (w float32 or bfloat16, bfloat16 values): as transformers orders a bfloat16 model's norm, the row
// normalised in float32 and rounded to bfloat16, then times w and rounded again -> x's dtype
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.dtype() == torch::kFloat32 || is_bf16(x)) &&
                  (w.dtype() == torch::kFloat32 || (is_bf16(x) && is_bf16(w))),
              "rms_norm: float32 [T, E] (weight float32), or bfloat16 [T, E] (weight float32 or bfloat16)");
  x = x.contiguous();
  w = w.to(torch::kFloat32).contiguous();
  const int64_t T = x.size(0), E = x.size(1);
  TORCH_CHECK(w.numel() == E, "rms_norm: weight size");
  auto out = torch::empty_like(x);
  const float* wp = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (is_bf16(x)) {
    const bf16_t* xp = data_as<bf16_t>(x, "x");
    bf16_t* op = data_as<bf16_t>(out, "out");
    run_chunks(T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(E);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < E; ++i) row[i] = to_f32(xp[t * E + i]);
        const float r = 1.f / std::sqrt(dot(row.data(), row.data(), E) / static_cast<float>(E) + e);
        bf16_t* o = op + t * E;
        for (int64_t i = 0; i < E; ++i) o[i] = round_bf16(wp[i] * to_f32(round_bf16(row[i] * r)));
      }
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  run_chunks(T, 16, [&](int64_t begin, int64_t end) {
    rms_norm_into(xp + begin * E, end - begin, E, wp, e, op + begin * E);
  });
  return out;
}

// w [N, K] -> float32: [ceil(N / kPanel), K, kPanel], kPanel output columns per panel, k-major, zero past N;
// bfloat16: [ceil(N / kPanel), ceil(K / 2), kPanel, 2], the columns' k pairs side by side, zero past N and K
torch::Tensor pack_panels(torch::Tensor w) {
  TORCH_CHECK((w.dtype() == torch::kFloat32 || is_bf16(w)) && w.device().is_cpu() && w.dim() == 2,
              "pack_panels: w [N, K], float32 or bfloat16, on the CPU");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  if (!is_bf16(w)) {
    auto padded = torch::zeros({panels * kPanel, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();  // [panels, K, kPanel]
  }
  const int64_t Kp = K + (K & 1);
  auto padded = torch::zeros({panels * kPanel, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({panels, kPanel, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // [panels, Kp / 2, kPanel, 2]
}

// x [B, K] (float32 or bfloat16) @ w^T (+ bias [N]) (+ residual [B, N]; empty tensors for none) -> [B, N] in x's
// dtype, w given as pack_panels(w) with N rows (float32 or bfloat16 panels); float32 accumulation
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias,
                            torch::Tensor residual) {
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == torch::kFloat32 || is_bf16(x)), "packed_linear: x [B, K] float32 or bf16");
  const auto out_dtype = x.scalar_type();
  x = x.to(torch::kFloat32).contiguous();
  bias = bias.to(torch::kFloat32).contiguous();
  const int64_t B = x.size(0), K = x.size(1);
  const bool bf = is_bf16(packed);
  TORCH_CHECK(bf ? packed_as<bf16_t>(packed, N, K) : packed_as<float>(packed, N, K),
              "packed_linear: packed must be pack_panels of a [N, K] weight");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "packed_linear: bias size");
  const float* rp = nullptr;
  if (residual.numel() != 0) {
    residual = residual.to(torch::kFloat32).contiguous();
    TORCH_CHECK(residual.dim() == 2 && residual.size(0) == B && residual.size(1) == N, "packed_linear: residual [B, N]");
    rp = residual.data_ptr<float>();
  }
  auto y = torch::empty({B, N}, x.options());
  if (bf)
    packed_linear_into(x.data_ptr<float>(), B, K, data_as<bf16_t>(packed, "packed weight"), N, opt_ptr(bias), rp,
                       y.data_ptr<float>());
  else
    packed_linear_into(x.data_ptr<float>(), B, K, data_as<float>(packed, "packed weight"), N, opt_ptr(bias), rp,
                       y.data_ptr<float>());
  return y.to(out_dtype);
}

// x [M, K] bfloat16 @ w^T (+ bias [N]) (+ residual [M, N] bfloat16; empty tensors for none) -> [M, N] bfloat16,
// w given as bfloat16 pack_panels(w) with N rows, on AMX tiles (amx_bf16() true and K a multiple of 32) or else on
// panel_rows_bf16 (K even; panel_gemm_bf16_applies says which K run here):
// float32 sums, rounded to bfloat16 (with the bias), then added to the residual and rounded (torch's
// `residual + F.linear(x, w, b)` in bfloat16). For prefill chunks: see panel_gemm_bf16_into.
torch::Tensor panel_gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias,
                              torch::Tensor residual) {
  TORCH_CHECK(x.dim() == 2 && is_bf16(x) && x.device().is_cpu(), "panel_gemm_bf16: x [M, K] bfloat16 on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(is_bf16(packed) && packed_as<bf16_t>(packed, N, K), "panel_gemm_bf16: packed must be bfloat16 "
              "pack_panels of a [N, K] weight");
  TORCH_CHECK(panel_gemm_applies(K), "panel_gemm_bf16: needs K even (a multiple of 32 where AMX-BF16 "
              "is in use)");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "panel_gemm_bf16: bias size");
  if (bias.numel() != 0) bias = bias.to(torch::kFloat32).contiguous();
  const bf16_t* rp = nullptr;
  if (residual.numel() != 0) {
    TORCH_CHECK(is_bf16(residual) && residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N,
                "panel_gemm_bf16: residual [M, N] bfloat16");
    residual = residual.contiguous();
    rp = data_as<bf16_t>(residual, "residual");
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (!amx_applies(K)) {
    x = x.contiguous();
    panel_gemm_bf16_dot_into(data_as<bf16_t>(x, "x"), M, K, data_as<bf16_t>(packed, "packed weight"), N,
                             opt_ptr(bias), rp, data_as<bf16_t>(y, "y"));
    return y;
  }
#ifdef KVF_AMX
  // rows 32 elements further apart than K (as packed_linear_into's AMX path), so that a tile's 16 rows do not
  // share one L1 set when K * 2 bytes is a multiple of 4 KiB
  const int64_t ldx = K + 32;
  std::vector<bf16_t> xb(M * ldx);
  x = x.contiguous();
  const bf16_t* xp = data_as<bf16_t>(x, "x");
  for (int64_t m = 0; m < M; ++m) std::memcpy(xb.data() + m * ldx, xp + m * K, K * sizeof(bf16_t));
  panel_gemm_bf16_into(xb.data(), M, K, ldx, data_as<bf16_t>(packed, "packed weight"), N, opt_ptr(bias), rp,
                       data_as<bf16_t>(y, "y"));
#endif
  return y;
}

namespace {

// llama_decode_layers for weights and pools of element type T (float: float32, bf16_t: bfloat16)
template <typename T>
void decode_layers(float* xp, int64_t B, int64_t E, const std::vector<torch::Tensor>& layer_weights,
                   const float* cp, const float* sp, int64_t D, std::vector<torch::Tensor>& k_pools,
                   std::vector<torch::Tensor>& v_pools, const int64_t* sl, const int64_t* pg, int64_t P,
                   const int64_t* ln, int64_t page_size, int64_t H, int64_t Hkv, float sc, float e) {
  constexpr int64_t kFields = 12;
  const int64_t L = static_cast<int64_t>(k_pools.size());
  const int64_t Hq = H + Hkv, QKV = (H + 2 * Hkv) * D;
  const torch::Tensor& down0 = layer_weights[10];
  const int64_t I = std::is_same<T, float>::value ? down0.size(1) : 2 * down0.size(1);  // down_w: K = I (rounded up to even in bf16)
  std::vector<float> h(B * std::max(E, I)), qkv(B * QKV), rot(B * Hq * D), q(B * H * D), attn(B * H * D),
      gu(B * 2 * I), res(B * E);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* W = layer_weights.data() + l * kFields;
    for (int64_t i : {0, 7}) check_f32(W[i], "a layer's norm weight");
    for (int64_t i : {2, 4, 5, 6, 9, 11}) TORCH_CHECK(W[i].numel() == 0 || W[i].dtype() == torch::kFloat32 && W[i].is_contiguous(), "biases and q/k norms must be float32");
    TORCH_CHECK(packed_as<T>(W[1], QKV, E) && packed_as<T>(W[3], E, H * D) && packed_as<T>(W[8], 2 * I, E) &&
                    packed_as<T>(W[10], E, I),
                "llama_decode_layers: projections must be packed (pack_panels) to their shapes, in the pools' dtype");
    T* kp = data_as<T>(k_pools[l], "k pool");
    T* vp = data_as<T>(v_pools[l], "v pool");
    TORCH_CHECK(k_pools[l].size(1) == Hkv && k_pools[l].size(2) == D && v_pools[l].size(2) == D &&
                    v_pools[l].size(0) == k_pools[l].size(0),
                "pool view shape");
    const int64_t S = k_pools[l].size(0);
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sl[b] >= 0 && sl[b] < S, "slot outside the pool");
    const T* w_qkv = data_as<T>(W[1], "qkv_w");
    const T* w_o = data_as<T>(W[3], "o_w");
    const T* w_gu = data_as<T>(W[8], "gate_up_w");
    const T* w_down = data_as<T>(W[10], "down_w");

    // attention: norm, q/k/v, (q/k norms), RoPE, store K/V, attend, o + residual
    rms_norm_into(xp, B, E, W[0].data_ptr<float>(), e, h.data());
    packed_linear_into(h.data(), B, E, w_qkv, QKV, opt_ptr(W[2]), nullptr, qkv.data());
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
        for (int64_t d = 0; d < D / 2; ++d) dst[d] = src[d] * c[d] + src[d + D / 2] * s[d];
        for (int64_t d = D / 2; d < D; ++d) dst[d] = src[d] * c[d] + src[d - D / 2] * s[d];
      }
      store_row(rot.data() + (b * Hq + H) * D, Hkv * D, kp + sl[b] * Hkv * D);
      store_row(qkv.data() + b * QKV + Hq * D, Hkv * D, vp + sl[b] * Hkv * D);
    }
    // queries: the first H heads of each row of rot, which is [B, Hq, D]; gather them to [B, H, D]
    for (int64_t b = 0; b < B; ++b) std::copy(rot.data() + b * Hq * D, rot.data() + (b * Hq + H) * D, q.data() + b * H * D);
    paged_attention_into<T>(q.data(), B, H, D, kp, vp, Hkv, D, pg, P, ln, page_size, sc, attn.data());
    std::copy(xp, xp + B * E, res.data());
    packed_linear_into(attn.data(), B, H * D, w_o, E, opt_ptr(W[4]), res.data(), xp);

    // MLP: norm, gate/up, SiLU(gate) * up, down + residual
    rms_norm_into(xp, B, E, W[7].data_ptr<float>(), e, h.data());
    packed_linear_into(h.data(), B, E, w_gu, 2 * I, opt_ptr(W[9]), nullptr, gu.data());
    for (int64_t b = 0; b < B; ++b) silu_mul(gu.data() + b * 2 * I, gu.data() + b * 2 * I + I, h.data() + b * I, I);
    std::copy(xp, xp + B * E, res.data());
    packed_linear_into(h.data(), B, I, w_down, E, opt_ptr(W[11]), res.data(), xp);
  }
}

}  // namespace

// One decode step of a Llama-family model through every layer: x [B, E] float32 (embedded tokens) -> [B, E]
// float32 after the last layer (before the final norm). Per layer, `layer_weights` holds 12 tensors in this
// order (empty tensors for what the model lacks): input_norm, qkv_w, qkv_b, o_w, o_b, q_norm, k_norm,
// post_norm, gate_up_w, gate_up_b, down_w, down_b; the four *_w projections packed by pack_panels (float32
// or bfloat16 panels, the pools' dtype), the rest float32. cos/sin: [B, D] float32 (sin with its first half
// negated); k_pools/v_pools: per layer, the flat [S, Hkv, D] pool views; slots [B]: where this step's K/V go;
// pages [B, P], lens [B] (lens include this step's token).
torch::Tensor llama_decode_layers(torch::Tensor x, std::vector<torch::Tensor> layer_weights, torch::Tensor cos,
                                  torch::Tensor sin, std::vector<torch::Tensor> k_pools,
                                  std::vector<torch::Tensor> v_pools, torch::Tensor slots, torch::Tensor pages,
                                  torch::Tensor lens, int64_t page_size, int64_t H, int64_t Hkv, double scale,
                                  double eps) {
  constexpr int64_t kFields = 12;
  const int64_t L = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(layer_weights.size()) == L * kFields &&
                  static_cast<int64_t>(v_pools.size()) == L,
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
  TORCH_CHECK(H % Hkv == 0 && D % 2 == 0 && cos.size(0) == B && sin.size(0) == B, "llama_decode_layers: shapes");
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  if (is_bf16(k_pools[0]))
    decode_layers<bf16_t>(x.data_ptr<float>(), B, E, layer_weights, cos.data_ptr<float>(), sin.data_ptr<float>(), D,
                          k_pools, v_pools, slots.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), P, ln, page_size,
                          H, Hkv, sc, e);
  else
    decode_layers<float>(x.data_ptr<float>(), B, E, layer_weights, cos.data_ptr<float>(), sin.data_ptr<float>(), D,
                         k_pools, v_pools, slots.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), P, ln, page_size, H,
                         Hkv, sc, e);
  return x;
}

// A Llama-family model's weights as the decode step reads them, checked once where the object is made (Python
// holds one per model: native_kernels.LlamaWeights). embed [V, E] in the weights' dtype, or empty when tied (rows
// then come from the head's panels); head: pack_panels of the [V, E] lm_head; layers: 12 per layer in
// LAYER_FIELDS order (see llama_decode_layers); norm [E] float32; H query and Hkv KV heads.
struct LlamaWeights {
  torch::Tensor embed, head, norm;
  std::vector<torch::Tensor> layers;
  int64_t vocab_size, num_heads, num_kv_heads;
  double scale, eps;

  LlamaWeights(torch::Tensor embed_, torch::Tensor head_, int64_t V, std::vector<torch::Tensor> layers_,
               torch::Tensor norm_, int64_t H, int64_t Hkv, double scale_, double eps_)
      : embed(std::move(embed_)), head(std::move(head_)), norm(std::move(norm_)), layers(std::move(layers_)),
        vocab_size(V), num_heads(H), num_kv_heads(Hkv), scale(scale_), eps(eps_) {
    check_f32(norm, "norm");
    const int64_t E = norm.size(0);
    TORCH_CHECK(norm.dim() == 1 && V >= 1 && H >= 1 && Hkv >= 1 && H % Hkv == 0,
                "LlamaWeights: norm must be [E]; the head counts must divide");
    TORCH_CHECK(!layers.empty() && layers.size() % 12 == 0, "LlamaWeights: 12 weights per layer");
    TORCH_CHECK(is_bf16(head) ? packed_as<bf16_t>(head, V, E) : packed_as<float>(head, V, E),
                "LlamaWeights: head must be pack_panels of a [V, E] weight");
    TORCH_CHECK(embed.numel() == 0 || (embed.dim() == 2 && embed.size(0) == V && embed.size(1) == E &&
                                       embed.scalar_type() == head.scalar_type()),
                "LlamaWeights: embed must be [V, E] in the head's dtype, or empty (tied)");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()) / 12; }
};

namespace {

// row v of the weight [V, E] that `panels` packs (float32 [P, E, kPanel] or bfloat16 [P, E/2, kPanel, 2]), as floats
template <typename T>
void panel_row(const T* panels, int64_t v, int64_t E, float* out) {
  const int64_t p = v / kPanel, c = v % kPanel;
  if (std::is_same<T, float>::value) {
    for (int64_t e = 0; e < E; ++e) out[e] = to_f32(panels[(p * E + e) * kPanel + c]);
  } else {
    const int64_t E2 = (E + 1) / 2;
    for (int64_t e = 0; e < E; ++e) out[e] = to_f32(panels[((p * E2 + e / 2) * kPanel + c) * 2 + e % 2]);
  }
}

template <typename T>
torch::Tensor decode_step(const LlamaWeights& w, const torch::Tensor& ids, const torch::Tensor& cos_table,
                          const torch::Tensor& sin_table, const torch::Tensor& positions,
                          std::vector<torch::Tensor>& k_pools, std::vector<torch::Tensor>& v_pools,
                          const torch::Tensor& slots, const torch::Tensor& pages, const torch::Tensor& lens,
                          const torch::Tensor& logits_index, int64_t page_size) {
  const torch::Tensor &embed = w.embed, &head = w.head, &norm = w.norm;
  const int64_t V = w.vocab_size;
  const int64_t B = ids.size(0), E = norm.size(0), D = cos_table.size(1), n_pos = cos_table.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  auto x = torch::empty({B, E}, cos_table.options());
  auto cos = torch::empty({B, D}, cos_table.options());
  auto sin = torch::empty({B, D}, cos_table.options());
  float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(idp[b] >= 0 && idp[b] < V, "token id outside the vocabulary");
    TORCH_CHECK(pos[b] >= 0 && pos[b] < n_pos, "position outside the RoPE tables");
    if (embed.numel() == 0) {  // tied: the embedding is the head's weight
      panel_row(data_as<T>(head, "head"), idp[b], E, xp + b * E);
    } else {
      const T* row = data_as<T>(embed, "embedding") + idp[b] * E;
      for (int64_t i = 0; i < E; ++i) xp[b * E + i] = to_f32(row[i]);
    }
    std::copy_n(cos_table.data_ptr<float>() + pos[b] * D, D, cos.data_ptr<float>() + b * D);
    std::copy_n(sin_table.data_ptr<float>() + pos[b] * D, D, sin.data_ptr<float>() + b * D);
  }
  decode_layers<T>(xp, B, E, w.layers, cos.data_ptr<float>(), sin.data_ptr<float>(), D, k_pools, v_pools,
                   slots.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), pages.size(1), lens.data_ptr<int64_t>(),
                   page_size, w.num_heads, w.num_kv_heads, static_cast<float>(w.scale), static_cast<float>(w.eps));
  const int64_t N = logits_index.size(0);
  const int64_t* li = logits_index.data_ptr<int64_t>();
  std::vector<float> h(N * E);
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(li[r] >= 0 && li[r] < B, "logits row outside the batch");
    rms_norm_into(xp + li[r] * E, 1, E, norm.data_ptr<float>(), static_cast<float>(w.eps), h.data() + r * E);
  }
  auto logits = torch::empty({N, V}, cos_table.options());
  packed_linear_into(h.data(), N, E, data_as<T>(head, "head"), V, nullptr, nullptr, logits.data_ptr<float>());
  return logits;
}

}  // namespace

// A whole decode step in one call: token ids [B] -> float32 logits [N, V] of the rows `logits_index` [N].
// Embeds each token (from w.embed, or, when tied, from the head's panels), gathers its RoPE row from
// cos_table/sin_table [n, D] (float32) at `positions` [B], runs llama_decode_layers, the final RMSNorm of the
// wanted rows and the head. Weights and pools in one dtype (float32 or bfloat16); the same arithmetic as the
// separate calls.
torch::Tensor llama_decode_step(const LlamaWeights& w, torch::Tensor ids, torch::Tensor cos_table,
                                torch::Tensor sin_table, torch::Tensor positions, std::vector<torch::Tensor> k_pools,
                                std::vector<torch::Tensor> v_pools, torch::Tensor slots, torch::Tensor pages,
                                torch::Tensor lens, torch::Tensor logits_index, int64_t page_size) {
  const int64_t L = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(L == w.num_layers() && static_cast<int64_t>(v_pools.size()) == L,
              "llama_decode_step: two pool views per layer of the weights");
  for (torch::Tensor* t : {&ids, &positions, &slots, &pages, &lens, &logits_index}) {
    TORCH_CHECK(t->dtype() == torch::kInt64, "ids, positions, slots, pages, lens and logits_index must be int64");
    *t = t->contiguous();
  }
  check_f32(cos_table, "cos_table");
  check_f32(sin_table, "sin_table");
  const int64_t B = ids.size(0), P = pages.size(1);
  TORCH_CHECK(B >= 1 && positions.size(0) == B && slots.size(0) == B && lens.size(0) == B && pages.size(0) == B &&
                  sin_table.sizes() == cos_table.sizes() && cos_table.size(1) % 2 == 0,
              "llama_decode_step: shapes");
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= P * page_size, "context length outside the page table");
  }
  TORCH_CHECK(is_bf16(k_pools[0]) == is_bf16(w.head), "llama_decode_step: the pools must be in the weights' dtype");
  if (is_bf16(k_pools[0]))
    return decode_step<bf16_t>(w, ids, cos_table, sin_table, positions, k_pools, v_pools, slots, pages, lens,
                               logits_index, page_size);
  return decode_step<float>(w, ids, cos_table, sin_table, positions, k_pools, v_pools, slots, pages, lens,
                            logits_index, page_size);
}

namespace {

// numpy's argmax of one row (torch.argmax's answer too): the first maximum, or the first NaN when there is one
int64_t argmax_row(const float* v, int64_t n) {
  int64_t best = 0;
  float bv = v[0];
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    if (std::isnan(v[i])) return i;
    if (v[i] > bv) bv = v[i], best = i;
  }
  return best;
}

}  // namespace

// Up to `steps` greedy decode steps in one call, each the arithmetic of llama_decode_step, so that a small batch
// does not return to Python between tokens. ids [B]: each row's last token, at `positions` [B] (its context
// length before this call); step s runs the previous step's argmax at position + s, its K/V written to the slot
// its page table `pages` [B, P] gives (which must cover position + steps tokens). stop_ids / stop_offsets [B + 1]:
// row b stops on stop_ids[stop_offsets[b] .. stop_offsets[b + 1]); the call ends after the first step where any
// row samples one of its stops. Returns the sampled tokens [n, B] int64, n <= steps: row s is step s's argmax of
// each row's logits (numpy's tie rule: the first maximum, or the first NaN). The tables must cover every
// position it runs.
torch::Tensor llama_decode_burst(const LlamaWeights& w, torch::Tensor ids, torch::Tensor cos_table,
                                 torch::Tensor sin_table, torch::Tensor positions, std::vector<torch::Tensor> k_pools,
                                 std::vector<torch::Tensor> v_pools, torch::Tensor pages, torch::Tensor stop_ids,
                                 torch::Tensor stop_offsets, int64_t steps, int64_t page_size) {
  for (torch::Tensor* t : {&ids, &positions, &pages, &stop_ids, &stop_offsets}) {
    TORCH_CHECK(t->dtype() == torch::kInt64, "ids, positions, pages, stop_ids and stop_offsets must be int64");
    *t = t->contiguous();
  }
  const int64_t B = ids.size(0), P = pages.size(1);
  TORCH_CHECK(B >= 1 && steps >= 1 && positions.size(0) == B && pages.size(0) == B && stop_offsets.size(0) == B + 1,
              "llama_decode_burst: shapes");
  const int64_t* so = stop_offsets.data_ptr<int64_t>();
  TORCH_CHECK(so[0] == 0 && so[B] == stop_ids.size(0), "llama_decode_burst: stop_offsets must span stop_ids");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(so[b] <= so[b + 1], "llama_decode_burst: stop_offsets must not decrease");
  const int64_t* pos0 = positions.data_ptr<int64_t>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  TORCH_CHECK(!k_pools.empty() && page_size >= 1, "llama_decode_burst: pools and page size");
  const int64_t num_pages = k_pools[0].size(0) / page_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos0[b] >= 0 && pos0[b] + steps <= P * page_size, "llama_decode_burst: the page table is too short");
    for (int64_t i = 0; i <= (pos0[b] + steps - 1) / page_size; ++i) {  // every page the row reads or writes
      TORCH_CHECK(pg[b * P + i] >= 0 && pg[b * P + i] < num_pages,
                  "llama_decode_burst: the page table is too short or names a page outside the pool");
    }
  }
  const int64_t* stops = stop_ids.data_ptr<int64_t>();
  auto opts = ids.options();
  torch::Tensor cur = ids.clone(), pos = torch::empty({B}, opts), slots = torch::empty({B}, opts),
                lens = torch::empty({B}, opts), rows = torch::arange(B, opts);
  auto out = torch::empty({steps, B}, opts);
  int64_t* cp = cur.data_ptr<int64_t>();
  int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* lp = lens.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  int64_t n = 0;
  while (n < steps) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = pos0[b] + n;
      pp[b] = p;
      sp[b] = pg[b * P + p / page_size] * page_size + p % page_size;
      lp[b] = p + 1;
    }
    torch::Tensor logits =
        llama_decode_step(w, cur, cos_table, sin_table, pos, k_pools, v_pools, slots, pages, lens, rows, page_size);
    const float* lg = logits.data_ptr<float>();
    bool stop = false;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = argmax_row(lg + b * w.vocab_size, w.vocab_size);
      op[n * B + b] = cp[b] = t;
      stop = stop || std::find(stops + so[b], stops + so[b + 1], t) != stops + so[b + 1];
    }
    ++n;
    if (stop) break;
  }
  return out.narrow(0, 0, n).clone();
}

// whether bfloat16 projections whose K is a multiple of 32 run on AMX tiles in this process
bool amx_bf16() { return amx_applies(32); }

// whether panel_gemm_bf16 takes bfloat16 products with this K here (AMX tiles or VDPBF16PS)
bool panel_gemm_bf16_applies(int64_t K) { return panel_gemm_applies(K); }

// Python's view (torch's extension builder names the module). Every kernel runs without the GIL: arguments are
// converted and results returned with it held, the arithmetic runs with it released, so the server's event loop
// and other Python threads go on meanwhile (a 0.5B model's batch-32 step is ~0.3 s). The kernels touch no Python
// object; a TORCH_CHECK failure comes back as a Python exception as before.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<LlamaWeights>(m, "LlamaWeights", py::module_local())  // local: variant builds load side by side
      .def(py::init<torch::Tensor, torch::Tensor, int64_t, std::vector<torch::Tensor>, torch::Tensor, int64_t,
                    int64_t, double, double>(),
           py::arg("embed"), py::arg("head"), py::arg("vocab_size"), py::arg("layers"), py::arg("norm"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("scale"), py::arg("eps"))
      .def_readonly("embed", &LlamaWeights::embed)
      .def_readonly("head", &LlamaWeights::head)
      .def_readonly("norm", &LlamaWeights::norm)
      .def_readonly("layers", &LlamaWeights::layers)
      .def_readonly("vocab_size", &LlamaWeights::vocab_size)
      .def_readonly("num_heads", &LlamaWeights::num_heads)
      .def_readonly("num_kv_heads", &LlamaWeights::num_kv_heads)
      .def_readonly("scale", &LlamaWeights::scale)
      .def_readonly("eps", &LlamaWeights::eps)
      .def_property_readonly("num_layers", &LlamaWeights::num_layers);
#define KVFENCE_NO_GIL(f) m.def(#f, torch::wrap_pybind_function_no_gil(f), #f)
  KVFENCE_NO_GIL(paged_decode_attention);
  KVFENCE_NO_GIL(causal_prefill_attention);
  KVFENCE_NO_GIL(rms_norm);
  KVFENCE_NO_GIL(rope_bf16_);
  KVFENCE_NO_GIL(rope_f32_);
  KVFENCE_NO_GIL(silu_mul_into);
  KVFENCE_NO_GIL(pack_panels);
  KVFENCE_NO_GIL(packed_linear);
  KVFENCE_NO_GIL(panel_gemm_bf16);
  KVFENCE_NO_GIL(llama_decode_layers);
  KVFENCE_NO_GIL(llama_decode_step);
  KVFENCE_NO_GIL(llama_decode_burst);
  KVFENCE_NO_GIL(amx_bf16);
  KVFENCE_NO_GIL(panel_gemm_bf16_applies);
#undef KVFENCE_NO_GIL
}
