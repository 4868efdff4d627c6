// int8 and int4 matrix-vector products for decoding on x86 CPUs with AVX2, FMA and F16C.
//
// Decoding multiplies one row of activations by each weight matrix, so the time is spent streaming
// the weights. These kernels read int8 or packed 4-bit weights once per call and multiply them by
// activations quantized to int8 in blocks of 32 (one scale per block, as llama.cpp's Q8_0
// activations): four integer instructions per 32 products, with one float multiply-add per block.
// Each output is computed by one thread, in the same order whatever the number of rows or threads,
// so a row's result does not depend on the batch it is in.
//
// Layouts (tinygpt/kernels.py builds them):
//   int8: weight (N, K) int8 in -127..127, scales (N) float32: w = q * scale.
//   int4: weight (N, K / 2) uint8, two codes 0..15 a byte: in each block of 32 inputs, byte j holds
//         input j in its low half and input j + 16 in its high half; params (N, 2, K / 32) float16,
//         each row's block scales, then its block minimums: w = q * scale + minimum.
// K must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of K floats to int8 codes, a scale per block (absmax / 127) and each block's sum of codes
// times its scale (what a weight block's minimum multiplies).
void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* sum) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float s = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    __m256i codes[4];
    for (int i = 0; i < 4; ++i) {
      codes[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; the permute puts them back)
    __m256i lo = _mm256_packs_epi32(codes[0], codes[1]);
    __m256i hi = _mm256_packs_epi32(codes[2], codes[3]);
    __m256i bytes = _mm256_packs_epi16(lo, hi);
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), bytes);
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
    scale[b] = s;
    sum[b] = s * hsum(_mm256_cvtepi32_ps(total));
  }
}

struct Quantized {
  at::Tensor codes, scales, sums;
};

Quantized quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  Quantized r{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, blocks}, x.options()),
              at::empty({M, blocks}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = r.codes.data_ptr<int8_t>();
  float* sp = r.scales.data_ptr<float>();
  float* up = r.sums.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, qp + m * K, sp + m * blocks, up + m * blocks);
  });
  return r;
}

// sum over one block of 32: int8 weight codes times int8 activation codes, as 8 float lanes
inline __m256 block_dot_i8(const int8_t* w, const int8_t* x) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  // maddubs multiplies unsigned by signed bytes: |w| times x with w's sign, each pair <= 2 * 127 * 127
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// the same for a block of 4-bit codes (16 bytes) against 32 activation codes
inline __m256 block_dot_u4(const uint8_t* w, const int8_t* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(codes, xv);  // codes <= 15: no pair saturates
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// One output: a row of int8 weights against a row of activation codes and their block scales. Four
// accumulators, so that each multiply-add does not wait for the one before it.
inline float row_i8(const int8_t* w, const int8_t* x, const float* xs, int64_t blocks) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    acc[b & 3] = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + b), block_dot_i8(w + b * kBlock, x + b * kBlock), acc[b & 3]);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// The same for 4-bit weights: scale and minimum of block b at scales[b], minimums[b] (float16).
inline float row_u4(const uint8_t* w, const uint16_t* scales, const uint16_t* minimums, const int8_t* x,
                    const float* xs, const float* xsum, int64_t blocks) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 offset = _mm256_setzero_ps();  // sum over blocks of minimum * sum(x)
  alignas(32) float combined[8];
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {  // eight blocks' scales converted and combined at once
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums + b)));
    _mm256_store_ps(combined, _mm256_mul_ps(s, _mm256_loadu_ps(xs + b)));
    offset = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + b), offset);
    for (int j = 0; j < 8; ++j) {
      const int64_t k = b + j;
      acc[j & 3] = _mm256_fmadd_ps(_mm256_broadcast_ss(combined + j),
                                   block_dot_u4(w + k * (kBlock / 2), x + k * kBlock), acc[j & 3]);
    }
  }
  float tail = 0.0f;
  for (; b < blocks; ++b) {
    acc[b & 3] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(scales[b]) * xs[b]),
                                 block_dot_u4(w + b * (kBlock / 2), x + b * kBlock), acc[b & 3]);
    tail += _cvtsh_ss(minimums[b]) * xsum[b];
  }
  const __m256 total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  return hsum(_mm256_add_ps(total, offset)) + tail;
}

void check_input(const at::Tensor& x, const at::Tensor& w, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "tinygpt lowbit kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) float32");
  TORCH_CHECK(x.size(1) == K && K % kBlock == 0, "x has ", x.size(1), " columns; the weight takes ", K,
              " (a multiple of 32)");
}

int64_t grain(int64_t K) { return std::max<int64_t>(1, 32768 / K); }  // rows a thread takes at least

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = weight.size(0), K = weight.size(1);
  check_input(x_in, weight, K);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "weight must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be (N,) float32");
  const at::Tensor x = x_in.contiguous(), ws_t = scales.contiguous();
  const at::Tensor b_t = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0), blocks = K / kBlock;
  const Quantized xq = quantize_rows(x);
  at::Tensor out = at::empty({M, N}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* ws = ws_t.data_ptr<float>();
  const float* bp = b_t.defined() ? b_t.data_ptr<float>() : nullptr;
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* sp = xq.scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        op[m * N + n] = row_i8(wp + n * K, qp + m * K, sp + m * blocks, blocks) * ws[n] + (bp ? bp[n] : 0.0f);
      }
    }
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& params,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = weight.size(0), K = 2 * weight.size(1), blocks = K / kBlock;
  check_input(x_in, weight, K);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() && params.numel() == N * 2 * blocks,
              "params must be (N, 2, K / 32) float16");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor b_t = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0);
  const Quantized xq = quantize_rows(x);
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  const float* bp = b_t.defined() ? b_t.data_ptr<float>() : nullptr;
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* sp = xq.scales.data_ptr<float>();
  const float* up = xq.sums.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* p = pp + n * 2 * blocks;
      for (int64_t m = 0; m < M; ++m) {
        op[m * N + n] = row_u4(wp + n * (K / 2), p, p + blocks, qp + m * K, sp + m * blocks, up + m * blocks, blocks) +
                        (bp ? bp[n] : 0.0f);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tinygpt_lowbit, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, Tensor params, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tinygpt_lowbit, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
