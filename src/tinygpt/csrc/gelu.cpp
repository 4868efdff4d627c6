// GPT-2's GELU, x/2 (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), and its gradient, for
// training on x86 CPUs with AVX2 and FMA, in float32.
//
// PyTorch's CPU kernel computes tanh with a general-purpose vector function, at 2-3 times the cost
// of its exact GELU; here the identity 1/2 (1 + tanh(u)) = 1 / (1 + e^(-2u)) leaves one exponential
// and one division for eight values, and no subtraction of nearly equal numbers for negative inputs.
// (The exact GELU gains nothing from the same treatment: PyTorch's is as fast.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>

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

inline __m256 set(float v) { return _mm256_set1_ps(v); }

// GELU's two factors at x: y = x * phi, dy/dx = phi + x * slope.
struct Factors {
  __m256 phi, slope;
};

inline Factors factors(__m256 x) {
  const __m256 x2 = _mm256_mul_ps(x, x);
  // 2u = 2 sqrt(2/pi) (x + 0.044715 x^3); s = 1 / (1 + e^(-2u))
  const __m256 two_u =
      _mm256_mul_ps(_mm256_mul_ps(set(1.5957691216057308f), x), _mm256_fmadd_ps(set(0.044715f), x2, set(1.0f)));
  const __m256 s = _mm256_div_ps(set(1.0f), _mm256_add_ps(set(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), two_u))));
  // d(2u)/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2), and ds/d(2u) = s (1 - s)
  const __m256 du = _mm256_mul_ps(set(1.5957691216057308f), _mm256_fmadd_ps(set(0.134145f), x2, set(1.0f)));
  return {s, _mm256_mul_ps(_mm256_mul_ps(s, _mm256_sub_ps(set(1.0f), s)), du)};
}

// y[i .. i + 8) = f(x[i .. i + 8)) for every block of eight of n values (xs: one or two inputs of n);
// the last, partial block goes through a buffer of eight (masked stores are slow on AMD's CPUs)
template <int N, typename F>
void eights(const float* const (&xs)[N], float* y, int64_t n, F f) {
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i = 8 * b, left = n - i;
      __m256 in[N];
      if (left >= 8) {
        for (int k = 0; k < N; ++k) in[k] = _mm256_loadu_ps(xs[k] + i);
        _mm256_storeu_ps(y + i, f(in));
        continue;
      }
      alignas(32) float buffer[8] = {};
      for (int k = 0; k < N; ++k) {
        for (int64_t j = 0; j < left; ++j) buffer[j] = xs[k][i + j];
        in[k] = _mm256_load_ps(buffer);
      }
      _mm256_store_ps(buffer, f(in));
      for (int64_t j = 0; j < left; ++j) y[i + j] = buffer[j];
    }
  });
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be contiguous float32 on the CPU");
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  check_float(x, "x");
  at::Tensor y = at::empty_like(x);
  const float* const xs[1] = {x.data_ptr<float>()};
  eights(xs, y.data_ptr<float>(), x.numel(), [&](const __m256 (&in)[1]) {
    return _mm256_mul_ps(in[0], factors(in[0]).phi);
  });
  return y;
}

at::Tensor gelu_tanh_backward(const at::Tensor& grad, const at::Tensor& x) {
  check_float(x, "x");
  check_float(grad, "grad");
  TORCH_CHECK(grad.sizes() == x.sizes(), "grad must be shaped as x");
  at::Tensor out = at::empty_like(x);
  const float* const xs[2] = {x.data_ptr<float>(), grad.data_ptr<float>()};
  eights(xs, out.data_ptr<float>(), x.numel(), [&](const __m256 (&in)[2]) {
    const Factors f = factors(in[0]);
    return _mm256_mul_ps(in[1], _mm256_fmadd_ps(in[0], f.slope, f.phi));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinygpt_lowbit, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor grad, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tinygpt_lowbit, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh);
  m.impl("gelu_tanh_backward", &gelu_tanh_backward);
}
