// Kernels for training on x86 CPUs with AVX2 and FMA, in float32: GELU (also on bfloat16 tensors, as
// autocast gives it), the head's cross-entropy and causal self-attention, forward and backward
// (tinygpt/kernels.py wraps them for autograd). The modern block's norms, rotary positions and SwiGLU
// are modern.cpp's.
//
// GELU, both forms. GPT-2's, x/2 (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3): PyTorch's CPU
// kernel computes tanh with a general-purpose vector function, at 2-3 times the cost of its exact
// GELU; here the identity 1/2 (1 + tanh(u)) = 1 / (1 + e^(-2u)) leaves one exponential and one
// division for eight values, and no subtraction of nearly equal numbers for negative inputs. The
// exact one, x Phi(x): PyTorch's forward is nearly as fast as this one, but its backward computes
// erf and the density's exponential apart, where here one exponential serves both.
//
// Attention. PyTorch's CPU flash-attention kernel is made for long sequences; for the short
// contexts and small heads a model trains on a CPU (64-512 positions, 32-64 dimensions a head) it
// runs at a fraction of the machine's speed. Here each (batch, head) pair is one thread's work: its
// rows are copied into scratch buffers padded to multiples of eight (positions and dimensions), the
// T x T products are register tiles of 4 rows x 8 (scores) or 4 rows x 16 (the rest), and the T x T
// probabilities live in the scratch only (backward recomputes them from the log-sum-exp the forward
// keeps, as flash attention does). Tensors are (B, H, T, D) float32 with the last dimension
// contiguous (such as the views of c_attn's output the model passes); keys and values may have fewer
// heads, each serving H / H_kv query heads (grouped-query attention: a key/value head and its query
// heads are then one thread's work). The output comes back as a (B, H, T, D) view of a (B, T, H, D)
// buffer, so the transpose back to (B, T, C) copies nothing, and the gradients as one
// (B, T, (H + 2 H_kv) D) buffer: q's, k's and v's side by side, c_attn's output layout, so that nothing
// concatenates them on the way back to c_attn (the modern block's three projections take views of it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// e^x for eight floats (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, 2^n in the
// exponent bits), within ~2 ulp; inputs below -87 give ~1e-38 rather than 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The sum of v's eight lanes, first to last.
inline float lane_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.0f;
  for (float x : lanes) sum += x;
  return sum;
}

// The largest of v's eight lanes.
inline float lane_max(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
}

// ---- GELU ----------------------------------------------------------------------------------------

inline __m256 set(float v) { return _mm256_set1_ps(v); }

// GELU's two factors at x: y = x * phi, dy/dx = phi + x * slope.
struct Factors {
  __m256 phi, slope;
};

// GPT-2's tanh form. These are always inlined: a call returns both factors through memory, and the
// forward pass would compute a slope it does not use.
[[gnu::always_inline]] inline Factors tanh_factors(__m256 x) {
  const __m256 x2 = _mm256_mul_ps(x, x);
  // 2u = 2 sqrt(2/pi) (x + 0.044715 x^3); s = 1 / (1 + e^(-2u))
  const __m256 two_u =
      _mm256_mul_ps(_mm256_mul_ps(set(1.5957691216057308f), x), _mm256_fmadd_ps(set(0.044715f), x2, set(1.0f)));
  const __m256 s = _mm256_div_ps(set(1.0f), _mm256_add_ps(set(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), two_u))));
  // d(2u)/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2), and ds/d(2u) = s (1 - s)
  const __m256 du = _mm256_mul_ps(set(1.5957691216057308f), _mm256_fmadd_ps(set(0.134145f), x2, set(1.0f)));
  return {s, _mm256_mul_ps(_mm256_mul_ps(s, _mm256_sub_ps(set(1.0f), s)), du)};
}

// The exact form: phi is the normal distribution's Phi(x) = erfc(-x / sqrt 2) / 2 and the slope its
// density e^(-x^2 / 2) / sqrt(2 pi). erfc(z) for z = |x| / sqrt 2 is t P(t) e^(-z^2), t = 1 / (1 + p z)
// and P of degree 4 (Abramowitz and Stegun 7.1.26: within 1.5e-7 of erf, about as close as float32's
// 1 + erf(x / sqrt 2) in PyTorch's GELU comes near its left tail); the density reuses the exponential.
[[gnu::always_inline]] inline Factors erf_factors(__m256 x) {
  const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(set(-0.0f), x), set(0.70710678118654752f));
  const __m256 t = _mm256_div_ps(set(1.0f), _mm256_fmadd_ps(set(0.3275911f), z, set(1.0f)));
  __m256 p = _mm256_fmadd_ps(set(1.061405429f), t, set(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, set(1.421413741f));
  p = _mm256_fmadd_ps(p, t, set(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, set(0.254829592f));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), z));
  const __m256 half_erfc = _mm256_mul_ps(_mm256_mul_ps(set(0.5f), t), _mm256_mul_ps(p, e));
  const __m256 left = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 phi = _mm256_blendv_ps(_mm256_sub_ps(set(1.0f), half_erfc), half_erfc, left);
  return {phi, _mm256_mul_ps(set(0.3989422804014327f), e)};
}

template <bool Tanh>
[[gnu::always_inline]] inline Factors factors(__m256 x) {
  return Tanh ? tanh_factors(x) : erf_factors(x);
}

// Eight values in registers as float32: float32 as they are, bfloat16 widened (its bits are float32's
// top half), and back, bfloat16 rounded to the nearest even as PyTorch rounds (GELU's values are finite).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// y[i .. i + 8) = f(x[i .. i + 8)) for every block of eight of n values (xs: one or two inputs of n,
// float32 or bfloat16 as y, computed in float32), four blocks at a time where it can: f is a long
// chain of dependent steps, and four independent ones side by side keep the CPU's units busy. The
// last, partial block goes through a buffer of eight (masked stores are slow on AMD's CPUs).
template <int N, typename T, typename F>
void each_eight(const T* const (&xs)[N], T* y, int64_t n, F f) {
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (; b + 4 <= end && 8 * (b + 4) <= n; b += 4) {
      __m256 in[4][N];
      for (int u = 0; u < 4; ++u)
        for (int k = 0; k < N; ++k) in[u][k] = load8(xs[k] + 8 * (b + u));
      for (int u = 0; u < 4; ++u) store8(y + 8 * (b + u), f(in[u]));
    }
    for (; b < end; ++b) {
      const int64_t i = 8 * b, left = n - i;
      __m256 in[N];
      if (left >= 8) {
        for (int k = 0; k < N; ++k) in[k] = load8(xs[k] + i);
        store8(y + i, f(in));
        continue;
      }
      T buffer[8] = {};
      for (int k = 0; k < N; ++k) {
        for (int64_t j = 0; j < left; ++j) buffer[j] = xs[k][i + j];
        in[k] = load8(buffer);
      }
      store8(buffer, f(in));
      for (int64_t j = 0; j < left; ++j) y[i + j] = buffer[j];
    }
  });
}

void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be contiguous float32 on the CPU");
}

template <bool Tanh, typename T>
void gelu_into(const at::Tensor& x, at::Tensor& y) {
  const T* const xs[1] = {x.data_ptr<T>()};
  each_eight(xs, y.data_ptr<T>(), x.numel(), [](const __m256 (&in)[1]) {
    return _mm256_mul_ps(in[0], factors<Tanh>(in[0]).phi);
  });
}

template <bool Tanh, typename T>
void gelu_backward_into(const at::Tensor& grad, const at::Tensor& x, at::Tensor& out) {
  const T* const xs[2] = {x.data_ptr<T>(), grad.data_ptr<T>()};
  each_eight(xs, out.data_ptr<T>(), x.numel(), [](const __m256 (&in)[2]) {
    const Factors f = factors<Tanh>(in[0]);
    return _mm256_mul_ps(in[1], _mm256_fmadd_ps(in[0], f.slope, f.phi));
  });
}

// GELU's tensors: contiguous float32 or bfloat16 on the CPU (bfloat16 is what a Linear layer gives
// under autocast), computed in float32 either way.
void check_gelu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous(), what, " must be contiguous float32 or bfloat16 on the CPU");
}

// f(T(), form) for x's element type T (float or at::BFloat16) and the form asked for (form::value: tanh)
template <typename F>
void gelu_dispatch(const at::Tensor& x, bool tanh, F f) {
  auto with_form = [&](auto type) { tanh ? f(type, std::true_type()) : f(type, std::false_type()); };
  x.scalar_type() == at::kBFloat16 ? with_form(at::BFloat16()) : with_form(float());
}

// GELU(x), in GPT-2's tanh form or the exact one
at::Tensor gelu(const at::Tensor& x, bool tanh) {
  check_gelu(x, "x");
  at::Tensor y = at::empty_like(x);
  gelu_dispatch(x, tanh, [&](auto type, auto form) { gelu_into<decltype(form)::value, decltype(type)>(x, y); });
  return y;
}

at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& x, bool tanh) {
  check_gelu(x, "x");
  check_gelu(grad, "grad");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "grad must be shaped and typed as x");
  at::Tensor out = at::empty_like(x);
  gelu_dispatch(x, tanh, [&](auto type, auto form) {
    gelu_backward_into<decltype(form)::value, decltype(type)>(grad, x, out);
  });
  return out;
}

// ---- cross-entropy -------------------------------------------------------------------------------

// Row r of logits (N, V) against its target t[r]: returns lse - logits[r][t[r]] (N,) with lse the
// row's log-sum-exp and, with grad, turns the row in place into the loss's gradient times the row's
// weight: w[r] (softmax - one-hot(t[r])). A row is read three times while it sits in the cache (its
// maximum, then e^(x - max) and their sum, then the scale) with one exponential an element, where
// PyTorch's log-sum-exp and a softmax from it make five passes, two exponentials an element and a
// temporary as large as the logits. A NaN anywhere in a row makes its loss NaN (the maximum alone
// would drop it).
at::Tensor cross_entropy_rows_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights, bool grad) {
  check_contiguous(logits, "logits");
  check_contiguous(weights, "weights");
  TORCH_CHECK(logits.dim() == 2, "logits must be (N, V)");
  const int64_t N = logits.size(0), V = logits.size(1), full = V / 8 * 8;
  TORCH_CHECK(targets.device().is_cpu() && targets.scalar_type() == at::kLong && targets.is_contiguous() &&
                  targets.dim() == 1 && targets.size(0) == N && weights.numel() == N,
              "targets must be (N,) int64 and weights (N,) float32, for the logits' N rows");
  const int64_t* t = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(t[r] >= 0 && t[r] < V, "target ", t[r], " is out of range for ", V, " classes");
  at::Tensor ce = at::empty({N}, logits.options());
  float* x = logits.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* out = ce.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = x + r * V;
      __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
      for (int64_t j = 0; j < full; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      float m = lane_max(top);
      bool bad = _mm256_movemask_ps(nan) != 0;
      for (int64_t j = full; j < V; ++j) {
        m = std::max(m, row[j]);
        bad = bad || std::isnan(row[j]);
      }
      const float target = row[t[r]];
      const __m256 shift = _mm256_set1_ps(m);
      __m256 total = _mm256_setzero_ps();
      for (int64_t j = 0; j < full; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
        if (grad) _mm256_storeu_ps(row + j, e);
        total = _mm256_add_ps(total, e);
      }
      float sum = lane_sum(total);
      for (int64_t j = full; j < V; ++j) {
        const float e = std::exp(row[j] - m);
        if (grad) row[j] = e;
        sum += e;
      }
      out[r] = bad ? std::numeric_limits<float>::quiet_NaN() : m + std::log(sum) - target;
      if (!grad) continue;
      const float scale = w[r] / sum;
      const __m256 s8 = _mm256_set1_ps(scale);
      for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), s8));
      for (int64_t j = full; j < V; ++j) row[j] *= scale;
      row[t[r]] -= w[r];
    }
  });
  return ce;
}

// ---- attention ----------------------------------------------------------------------------------

inline int64_t eights(int64_t n) { return (n + 7) / 8 * 8; }

// A matrix in scratch: rows x cols floats, row-major, both padded (multiples of 8). Zeroed when its
// shape changes only: every head of a call has the same, and the kernels overwrite what they use,
// so the padding of a loaded head stays zero.
struct Mat {
  std::vector<float> data;
  int64_t cols = 0;
  void reset(int64_t rows, int64_t c) {
    if (c == cols && static_cast<int64_t>(data.size()) == rows * c) return;
    cols = c;
    data.assign(rows * c, 0.0f);
  }
  float* operator[](int64_t r) { return data.data() + r * cols; }
  const float* operator[](int64_t r) const { return data.data() + r * cols; }
};

// n floats from src to dst (a head's row: too short for memcpy's call to pay)
inline void copy_row(const float* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_loadu_ps(src + d));
  for (; d < n; ++d) dst[d] = src[d];
}

// One head's (T, D) rows of a (B, H, T, D) tensor into m (Tp, Dp), zero-padded.
void load_head(const at::Tensor& t, int64_t b, int64_t h, int64_t Tp, int64_t Dp, Mat& m) {
  const int64_t T = t.size(2), D = t.size(3);
  m.reset(Tp, Dp);
  const float* base = t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
  for (int64_t i = 0; i < T; ++i) copy_row(base + i * t.stride(2), m[i], D);
}

void store_head(const Mat& m, at::Tensor& t, int64_t b, int64_t h) {
  const int64_t T = t.size(2), D = t.size(3);
  float* base = t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
  for (int64_t i = 0; i < T; ++i) copy_row(m[i], base + i * t.stride(2), D);
}

void transpose(const Mat& m, int64_t rows, int64_t cols, Mat& out) {
  out.reset(cols, rows);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c][r] = m[r][c];
}

// out[i0 + r][j .. j + W) = scale * x[i0 + r] . columns j .. j + W of cols (Dp, Tp), for r < 4: four
// rows of x against W = 8 or 16 columns (4 x W / 8 independent sums; eight keep both FMA units busy).
template <int W>
void dot_tile(const Mat& x, int64_t i0, const Mat& cols, int64_t Dp, int64_t j, float scale, Mat& out) {
  constexpr int n = W / 8;
  __m256 acc[4][n];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < n; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dp; ++d) {
    __m256 col[n];
    for (int c = 0; c < n; ++c) col[c] = _mm256_loadu_ps(cols[d] + j + 8 * c);
    for (int r = 0; r < 4; ++r) {
      const __m256 xr = _mm256_set1_ps(x[i0 + r][d]);
      for (int c = 0; c < n; ++c) acc[r][c] = _mm256_fmadd_ps(xr, col[c], acc[r][c]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < n; ++c)
      _mm256_storeu_ps(out[i0 + r] + j + 8 * c, _mm256_mul_ps(_mm256_set1_ps(scale), acc[r][c]));
}

// dot_tile for every block of eight columns below j_end, sixteen at a time where it can
void dot_tiles(const Mat& x, int64_t i0, const Mat& cols, int64_t Dp, int64_t j_end, float scale, Mat& out) {
  int64_t j = 0;
  for (; j + 16 <= j_end; j += 16) dot_tile<16>(x, i0, cols, Dp, j, scale, out);
  if (j < j_end) dot_tile<8>(x, i0, cols, Dp, j, scale, out);
}

// out[i0 + r] = sum over k in [k0, k1) of A(i0 + r, k) * rows[k], for r < 4, where A(i, k) is a[i][k],
// or a[k][i] when transposed (so that dK and dV need no transposed copy of dS and P): four output
// rows, 16 dimensions at a time (the last chunk 8 where Dp is not a multiple of 16).
template <bool transposed>
void row_tiles(const Mat& a, int64_t i0, const Mat& rows, int64_t k0, int64_t k1, int64_t Dp, Mat& out) {
  auto weight = [&](int r, int64_t k) { return _mm256_set1_ps(transposed ? a[k][i0 + r] : a[i0 + r][k]); };
  int64_t c = 0;
  for (; c + 16 <= Dp; c += 16) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 v0 = _mm256_loadu_ps(rows[k] + c), v1 = _mm256_loadu_ps(rows[k] + c + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 w = weight(r, k);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(out[i0 + r] + c, acc[r][0]);
      _mm256_storeu_ps(out[i0 + r] + c + 8, acc[r][1]);
    }
  }
  if (c < Dp) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 v = _mm256_loadu_ps(rows[k] + c);
      for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(weight(r, k), v, acc[r]);
    }
    for (int r = 0; r < 4; ++r) _mm256_storeu_ps(out[i0 + r] + c, acc[r]);
  }
}

// Row i of s (scores, already scaled) to probabilities e^(s - shift) over keys 0 .. i, 0 after;
// returns their sum. shift: the row's max (forward) or its log-sum-exp (backward, sum ~1).
float probabilities(float* s, int64_t i, int64_t Tp, float shift) {
  const __m256 m = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < Tp; j += 8) {
    __m256 e = _mm256_setzero_ps();
    if (j <= i) {
      e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      if (j + 7 > i) {  // the diagonal's block: keys after i are not seen
        alignas(32) float keep[8];
        for (int k = 0; k < 8; ++k) keep[k] = j + k <= i ? 1.0f : 0.0f;
        e = _mm256_mul_ps(e, _mm256_load_ps(keep));
      }
    }
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  return lane_sum(total);
}

void check(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 && t.stride(3) == 1 &&
                  t.sizes() == like.sizes(),
              what, " must be (B, H, T, D) float32 on the CPU, shaped as q, its last dimension contiguous");
}

// k and v: (B, H_kv, T, D) as q but for their heads, whose number divides q's (grouped-query attention)
void check_keys(const at::Tensor& t, const at::Tensor& q, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 && t.stride(3) == 1 &&
                  t.size(0) == q.size(0) && t.size(1) > 0 && q.size(1) % t.size(1) == 0 && t.size(2) == q.size(2) &&
                  t.size(3) == q.size(3),
              what, " must be (B, H_kv, T, D) float32 on the CPU, H_kv dividing q's heads, its last dimension "
              "contiguous");
}

// (B, H, T, D) view of a fresh (B, T, H, D) buffer
at::Tensor heads_view(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
}

struct Scratch {
  Mat q, k, v, o, g, kt, vt, p, dp, out;
};

std::tuple<at::Tensor, at::Tensor> causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check(q, q, "q");
  check_keys(k, q, "k");
  check(v, k, "v");
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), T = q.size(2), D = q.size(3), Tp = eights(T),
                Dp = eights(D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::Tensor out = heads_view(q), lse = at::empty({B, H, T}, q.options());
  // a key/value head and the query heads it serves (H / H_kv of them) are one thread's work
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t bkv = begin; bkv < end; ++bkv) {
      const int64_t b = bkv / Hkv, hkv = bkv % Hkv;
      load_head(k, b, hkv, Tp, Dp, w.k);
      load_head(v, b, hkv, Tp, Dp, w.v);
      transpose(w.k, Tp, Dp, w.kt);
      for (int64_t h = hkv * (H / Hkv); h < (hkv + 1) * (H / Hkv); ++h) {
        load_head(q, b, h, Tp, Dp, w.q);
        w.p.reset(Tp, Tp);
        w.out.reset(Tp, Dp);
        float* lp = lse.data_ptr<float>() + (b * H + h) * T;
        for (int64_t i0 = 0; i0 < Tp; i0 += 4) {
          dot_tiles(w.q, i0, w.kt, Dp, std::min(Tp, eights(i0 + 4)), scale, w.p);
          for (int64_t i = i0; i < i0 + 4; ++i) {
            if (i >= T) {  // a padding row: no probabilities
              std::fill_n(w.p[i], Tp, 0.0f);
              continue;
            }
            float* row = w.p[i];
            __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
            int64_t j = 0;
            for (; j + 8 <= i + 1; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
            float m = lane_max(top);
            for (; j <= i; ++j) m = std::max(m, row[j]);
            const float sum = probabilities(row, i, Tp, m);
            const __m256 inv = _mm256_set1_ps(1.0f / sum);
            for (j = 0; j <= i; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(inv, _mm256_loadu_ps(row + j)));
            lp[i] = m + std::log(sum);
          }
          row_tiles<false>(w.p, i0, w.v, 0, std::min(i0 + 4, T), Dp, w.out);
        }
        store_head(w.out, out, b, h);
      }
    }
  });
  return {out, lse};
}

// into += from where add, else into = from (Tp x Dp each)
void accumulate(Mat& into, const Mat& from, bool add) {
  if (!add) {
    into = from;
    return;
  }
  for (size_t i = 0; i < into.data.size(); i += 8)
    _mm256_storeu_ps(&into.data[i], _mm256_add_ps(_mm256_loadu_ps(&into.data[i]), _mm256_loadu_ps(&from.data[i])));
}

// Gradients of causal_attention: P = e^(S - lse) again, dP = dO V^T, dS = P (dP - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO (dK and dV summed over the query heads a key/value head
// serves); returned side by side, (B, T, (H + 2 H_kv) D): c_attn's output layout where H_kv = H.
at::Tensor causal_attention_backward(
    const at::Tensor& grad_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse) {
  check(q, q, "q");
  check_keys(k, q, "k");
  check(v, k, "v");
  check(out, q, "out");
  const at::Tensor grad = grad_in.stride(3) == 1 ? grad_in : grad_in.contiguous();
  check(grad, q, "grad");
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), T = q.size(2), D = q.size(3), Tp = eights(T),
                Dp = eights(D);
  TORCH_CHECK(lse.is_contiguous() && lse.numel() == B * H * T, "lse must be causal_attention's (B, H, T)");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // (B, T, H + 2 H_kv, D): dq, dk and dv as (B, heads, T, D) views of its parts
  at::Tensor grads = at::empty({B, T, H + 2 * Hkv, D}, q.options());
  at::Tensor dq = grads.narrow(2, 0, H).permute({0, 2, 1, 3}), dk = grads.narrow(2, H, Hkv).permute({0, 2, 1, 3}),
             dv = grads.narrow(2, H + Hkv, Hkv).permute({0, 2, 1, 3});
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    Mat dk_sum, dv_sum;
    std::vector<float> delta(Tp);
    for (int64_t bkv = begin; bkv < end; ++bkv) {
      const int64_t b = bkv / Hkv, hkv = bkv % Hkv, first = hkv * (H / Hkv);
      load_head(k, b, hkv, Tp, Dp, w.k);
      load_head(v, b, hkv, Tp, Dp, w.v);
      transpose(w.k, Tp, Dp, w.kt);
      transpose(w.v, Tp, Dp, w.vt);
      for (int64_t h = first; h < first + H / Hkv; ++h) {
        load_head(q, b, h, Tp, Dp, w.q);
        load_head(out, b, h, Tp, Dp, w.o);
        load_head(grad, b, h, Tp, Dp, w.g);
        w.p.reset(Tp, Tp);
        w.dp.reset(Tp, Tp);
        const float* lp = lse.data_ptr<float>() + (b * H + h) * T;
        for (int64_t i = 0; i < T; ++i) {
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s += w.g[i][d] * w.o[i][d];
          delta[i] = s;
        }
        for (int64_t i0 = 0; i0 < Tp; i0 += 4) {
          const int64_t j_end = std::min(Tp, eights(i0 + 4));
          dot_tiles(w.q, i0, w.kt, Dp, j_end, scale, w.p);
          dot_tiles(w.g, i0, w.vt, Dp, j_end, 1.0f, w.dp);
          for (int64_t i = i0; i < i0 + 4; ++i) {
            if (i >= T) {
              std::fill_n(w.p[i], Tp, 0.0f);
              std::fill_n(w.dp[i], Tp, 0.0f);
              continue;
            }
            probabilities(w.p[i], i, Tp, lp[i]);
            // dS, times scale for dQ and dK: 0 after the diagonal, where P is
            for (int64_t j = 0; j < Tp; ++j) w.dp[i][j] = w.p[i][j] * (w.dp[i][j] - delta[i]) * scale;
          }
        }
        // w.dp now holds scale * dS; dQ = (scale dS) K row tile by row tile
        w.out.reset(Tp, Dp);
        for (int64_t i0 = 0; i0 < Tp; i0 += 4) row_tiles<false>(w.dp, i0, w.k, 0, std::min(i0 + 4, T), Dp, w.out);
        store_head(w.out, dq, b, h);
        for (int64_t j0 = 0; j0 < Tp; j0 += 4) row_tiles<true>(w.dp, j0, w.q, j0, T, Dp, w.out);
        accumulate(dk_sum, w.out, h > first);
        for (int64_t j0 = 0; j0 < Tp; j0 += 4) row_tiles<true>(w.p, j0, w.g, j0, T, Dp, w.out);
        accumulate(dv_sum, w.out, h > first);
      }
      store_head(dk_sum, dk, b, hkv);
      store_head(dv_sum, dv, b, hkv);
    }
  });
  return grads.view({B, T, (H + 2 * Hkv) * D});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinygpt_lowbit, m) {
  m.def("gelu(Tensor x, bool tanh) -> Tensor");
  m.def("gelu_backward(Tensor grad, Tensor x, bool tanh) -> Tensor");
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor targets, Tensor weights, bool grad) -> Tensor");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)");
  m.def("causal_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) -> Tensor");
}

TORCH_LIBRARY_IMPL(tinygpt_lowbit, CPU, m) {
  m.impl("gelu", &gelu);
  m.impl("gelu_backward", &gelu_backward);
  m.impl("cross_entropy_rows_", &cross_entropy_rows_);
  m.impl("causal_attention", &causal_attention);
  m.impl("causal_attention_backward", &causal_attention_backward);
}
