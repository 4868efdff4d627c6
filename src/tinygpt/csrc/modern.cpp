// Kernels for training the modern block (the llama layout) on x86 CPUs: RMSNorm with its gain, rotary
// positions on queries and keys (after the QK-norm on each head where the model has one) and SwiGLU's gate,
// forward and backward, on float32 or bfloat16 tensors (autocast's), computed in float32 (tinygpt/kernels.py
// wraps them for autograd).
//
// PyTorch runs each as a chain of element-wise operations, a pass over memory each, forward and backward:
// RMSNorm five, the rotary positions six (a negation, a concatenation, two products and a sum), SwiGLU's gate
// two and its gradient seven. At the widths a CPU trains (64-512) those passes cost more than the matrix
// products between them. Here each kernel reads its inputs once and writes its outputs once.
//
// The code is written once (modern_kernels.h) over a vector kind and compiled twice: for AVX2 with FMA (eight
// floats a register: every x86-64 CPU the kernels build for) and for AVX-512 F/BW/DQ/VL (sixteen), which a
// CPU that has it takes (simd_width says which, and lets a test take either). The AVX-512 path uses nothing
// past AVX-512 F and BW: bfloat16 goes to float32 and back with integer instructions, rounding to the nearest
// even as PyTorch does, with or without AVX-512 BF16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

namespace avx2 {

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static V set(float v) { return _mm256_set1_ps(v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }    // a b + c
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for whole numbers n in float32's exponent range
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  // the lanes' sum, in a tree that stays in registers (a row of a small head sums once, so this is on its path)
  static float sum(V v) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
  }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // bfloat16 is float32's top half: widened by a shift, and rounded back to the nearest even
  static V load(const at::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static void store(at::BFloat16* p, V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

#include "modern_kernels.h"

}  // namespace avx2

// Everything defined from here to the matching pop may use AVX-512; only a CPU that has it calls into it.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
#endif

namespace avx512 {

struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static V set(float v) { return _mm512_set1_ps(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load(const at::BFloat16* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static void store(at::BFloat16* p, V v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
  }
};

#include "modern_kernels.h"

}  // namespace avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// The vector width the kernels run at: 16 (AVX-512) where the CPU has it, else 8; a test may ask for 8.
std::atomic<int64_t> width{__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
                               ? 16
                               : 8};

// Sets the width (8, or 16 where the CPU has AVX-512) and returns it; 0 only reads it.
int64_t simd_width(int64_t n) {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  TORCH_CHECK(n == 0 || n == 8 || (n == 16 && avx512), "simd_width takes 8", avx512 ? " or 16" : "",
              " here (0 reads it), not ", n);
  if (n != 0) width = n;
  return width;
}

// f(avx2-or-avx512 tag, T()) for x's element type T (float or at::BFloat16) at the chosen width
template <typename F>
void dispatch(const at::Tensor& x, F f) {
  auto typed = [&](auto isa) { x.scalar_type() == at::kBFloat16 ? f(isa, at::BFloat16()) : f(isa, float()); };
  width == 16 ? typed(std::integral_constant<int, 16>()) : typed(std::integral_constant<int, 8>());
}

// The kernels of one width, by tag: the two namespaces' functions have the same names
#define TINYGPT_CALL(isa, name, ...) \
  (decltype(isa)::value == 16 ? avx512::name(__VA_ARGS__) : avx2::name(__VA_ARGS__))

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), what,
              " must be float32 or bfloat16 on the CPU");
}

void check_gain(const at::Tensor& w, int64_t n, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n, what,
              " must be ", n, " contiguous float32 values on the CPU");
}

// Rows of shares of a gain's gradient for N rows (one a SHARE_ROWS rows)
at::Tensor shares_for(int64_t N, int64_t C, bool any) {
  const int64_t rows = avx2::SHARE_ROWS;
  return at::empty({any ? (N + rows - 1) / rows : 0, C}, at::TensorOptions().dtype(at::kFloat));
}

// The gradient of a gain: its shares' sum, one after another (the same on any number of threads)
at::Tensor sum_shares(const at::Tensor& shares) {
  at::Tensor out = at::zeros({shares.size(1)}, shares.options());
  float* o = out.data_ptr<float>();
  const float* s = shares.data_ptr<float>();
  for (int64_t r = 0; r < shares.size(0); ++r)
    for (int64_t c = 0; c < shares.size(1); ++c) o[c] += s[r * shares.size(1) + c];
  return out;
}

// RMSNorm over x's last dimension (contiguous x): (y, rstd), y = x rstd w with rstd = 1 / sqrt(mean(x^2) + eps)
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x must be contiguous");
  const int64_t C = x.size(-1), N = x.numel() / std::max<int64_t>(C, 1);
  check_gain(w, C, "w");
  at::Tensor y = at::empty_like(x), rstd = at::empty({N}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto isa, auto type) {
    using T = decltype(type);
    TINYGPT_CALL(isa, rms_norm, x.data_ptr<T>(), w.data_ptr<float>(), static_cast<float>(eps), N, C,
                 y.data_ptr<T>(), rstd.data_ptr<float>());
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd) {
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && g.is_contiguous() && g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(),
              "x and grad must be contiguous, shaped and typed alike");
  const int64_t C = x.size(-1), N = x.numel() / std::max<int64_t>(C, 1);
  check_gain(w, C, "w");
  check_gain(rstd, N, "rstd");
  at::Tensor dx = at::empty_like(x), shares = shares_for(N, C, true);
  dispatch(x, [&](auto isa, auto type) {
    using T = decltype(type);
    TINYGPT_CALL(isa, rms_norm_backward, g.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<float>(),
                 rstd.data_ptr<float>(), N, C, dx.data_ptr<T>(), shares.data_ptr<float>());
  });
  return {dx, sum_shares(shares)};
}

// x (B, T, H, D), its last dimension contiguous, as rows (b, t) of H heads
template <typename T>
avx2::Heads<T> heads_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, what, " must be (B, T, H, D), its last dimension contiguous");
  return {x.data_ptr<T>(), x.size(1), x.stride(0), x.stride(1), x.stride(2)};
}

void check_angles(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& x) {
  const int64_t D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "rotary positions need an even head_dim, not ", D);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(1) == D && (t->size(0) == x.size(1) || t->size(0) == x.size(0) * x.size(1)),
                "cos and sin must be (T, D) or (B T, D) contiguous float32");
}

// Rotary positions on x (B, T, H, D) after an RMSNorm over each head with gain w where w is given (the
// QK-norm): (y (B, T, H, D) contiguous, rstd (B, T, H); empty without w)
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 4, "x must be (B, T, H, D)");
  check_angles(cos, sin, x);
  const int64_t N = x.size(0) * x.size(1), H = x.size(2), D = x.size(3);
  if (w) check_gain(*w, D, "w");
  at::Tensor y = at::empty(x.sizes(), x.options()), rstd = at::empty({w ? N * H : 0}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto isa, auto type) {
    using T = decltype(type);
    const auto xh = heads_of<T>(x, "x");
    TINYGPT_CALL(isa, rotary, {xh.data, xh.T_, xh.batch, xh.row, xh.head}, N, H, D, w ? w->data_ptr<float>() : nullptr,
                 static_cast<float>(eps), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), y.data_ptr<T>(),
                 rstd.data_ptr<float>());
  });
  return {y, rstd.view({x.size(0), x.size(1), w ? H : 0})};
}

// rotary's gradients: (dx (B, T, H, D) contiguous, dw; empty without w). x (the input) only with w: without
// the norm the turn is linear, its gradient the turn back.
std::tuple<at::Tensor, at::Tensor> rotary_backward(const at::Tensor& g, const std::optional<at::Tensor>& x,
                                                   const std::optional<at::Tensor>& w, const at::Tensor& rstd,
                                                   const at::Tensor& cos, const at::Tensor& sin) {
  check_float(g, "grad");
  TORCH_CHECK(g.dim() == 4, "grad must be (B, T, H, D)");
  TORCH_CHECK(w.has_value() == x.has_value(), "x goes with w (the QK-norm's gain), and only with it");
  TORCH_CHECK(!x || (x->sizes() == g.sizes() && x->scalar_type() == g.scalar_type()),
              "grad must be shaped and typed as x (B, T, H, D)");
  check_angles(cos, sin, g);
  const int64_t N = g.size(0) * g.size(1), H = g.size(2), D = g.size(3);
  if (w) {
    check_gain(*w, D, "w");
    check_gain(rstd, N * H, "rstd");
  }
  at::Tensor dx = at::empty(g.sizes(), g.options()), shares = shares_for(N, D, w.has_value());
  dispatch(g, [&](auto isa, auto type) {
    using T = decltype(type);
    const auto gh = heads_of<T>(g, "grad"), xh = heads_of<T>(x ? *x : g, "x");
    TINYGPT_CALL(isa, rotary_backward, {gh.data, gh.T_, gh.batch, gh.row, gh.head},
                 {xh.data, xh.T_, xh.batch, xh.row, xh.head}, N, H, D, w ? w->data_ptr<float>() : nullptr,
                 rstd.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), dx.data_ptr<T>(),
                 shares.data_ptr<float>());
  });
  return {dx, w ? sum_shares(shares) : shares};
}

void check_gate(const at::Tensor& a, const at::Tensor& b, const char* what) {
  check_float(a, "a");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
              what, " must be contiguous, shaped and typed alike");
}

// SwiGLU's gate: silu(a) * b
at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b) {
  check_gate(a, b, "a and b");
  at::Tensor h = at::empty_like(a);
  dispatch(a, [&](auto isa, auto type) {
    using T = decltype(type);
    TINYGPT_CALL(isa, swiglu, a.data_ptr<T>(), b.data_ptr<T>(), a.numel(), h.data_ptr<T>());
  });
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b) {
  check_gate(a, b, "a and b");
  const at::Tensor g = grad.to(a.scalar_type()).contiguous();
  check_gate(a, g, "a and grad");
  at::Tensor da = at::empty_like(a), db = at::empty_like(b);
  dispatch(a, [&](auto isa, auto type) {
    using T = decltype(type);
    TINYGPT_CALL(isa, swiglu_backward, g.data_ptr<T>(), a.data_ptr<T>(), b.data_ptr<T>(), a.numel(),
                 da.data_ptr<T>(), db.data_ptr<T>());
  });
  return {da, db};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinygpt_lowbit, m) {
  m.def("simd_width(int n) -> int", &simd_width);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor? w, float eps, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rotary_backward(Tensor grad, Tensor? x, Tensor? w, Tensor rstd, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor a, Tensor b) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tinygpt_lowbit, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("rotary", &rotary);
  m.impl("rotary_backward", &rotary_backward);
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}
