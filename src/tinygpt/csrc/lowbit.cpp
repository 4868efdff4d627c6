// Matrix-vector products for decoding on x86 CPUs with AVX2, FMA and F16C: float32, float16,
// bfloat16, int8 and int4 weights.
//
// Decoding multiplies one row of activations by each weight matrix, so the time is spent streaming
// the weights. These kernels read the weights once per call, for up to a few rows of activations.
// float32, float16 and bfloat16 weights (widened in registers) multiply float32 activations; int8 and packed
// 4-bit weights multiply activations quantized to int8 in blocks of 32 (one scale per block, as
// llama.cpp's Q8_0 activations): a few integer instructions per 32 products, with one float
// multiply-add per block (for int8 a row's, for 4 bits a group of eight rows'). Each output is
// computed by one thread, in the same order whatever the number of rows or threads, so a row's
// result does not depend on the batch it is in. DecodePlan, at the end, is a whole decode step.
//
// Layouts (tinygpt/kernels.py builds them):
//   float32, float16, bfloat16: weight (N, K), as nn.Linear keeps it.
//   int8: q in -127..127 and a float32 scale per row, w = q * scale, for groups of 8 rows (the last
//         one padded): weight (groups, K / 32, 256) int8, each block's 256 bytes eight chunks of 4
//         inputs (row j's four at 4j); scales (N) float32.
//   int4: codes 0..15 with a float16 scale and minimum per block of 32 inputs, w = q * scale + minimum,
//         for groups of 8 rows (the last one padded): weight (groups, K / 32, 128) uint8, each block's
//         128 bytes four chunks of 8 inputs (row j's four bytes at 4j, inputs 8c + i in the low half
//         of byte i and 8c + 4 + i in the high half); params (groups, K / 32, 16) float16, each
//         block's 8 scales, then its 8 minimums.
// K must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Asks for the weights ahead of the ones being read, a cache line per call: 8 KB ahead into L2, 1 KB
// ahead into L1. On the Zen 3 the hardware's own prefetcher left float32 weights streaming at 12-15
// GB/s, 14-17 with one request 2 KB ahead into L1, and the 12 x 768 model's decode 0-25% faster in
// every format (no clear change on the baby model); on the README's Xeon with AMX the second request,
// far ahead into L2, streamed SmolLM2-135M's float32 matrices 1.10-1.13x faster again than the one
// (2 threads, paired rounds). Four float32 weight rows at a time do without it (tile_float).
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + 8192, _MM_HINT_T1);
  _mm_prefetch(static_cast<const char*>(p) + 1024, _MM_HINT_T0);
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

// tile_float computes RW x RX sums at once: RW rows of weights against RX rows of activations. Every
// sum takes the same two accumulators in the same order whatever the tile, so a row's result does
// not depend on its batch. The integer kernels (group_i8, group_u4) take eight weight rows
// against one row of activations instead: each 32-bit lane of their integer sums is one weight row's
// (four of its inputs against the same four activations, broadcast), so a block of 32 inputs ends in
// one float multiply-add for all eight rows and no row's sum needs folding across lanes.

// float32, float16 or bfloat16 weights against float32 activations (rows K apart); K a multiple of 8.
// A bfloat16 is a float32's upper half: widening is a shift, so no CPU needs bfloat16 arithmetic here.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::Half* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
inline __m256 load8(const at::BFloat16* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// total[i * RX + r] = weight row i . activation row r, rows K apart. Two accumulators a sum: a float
// multiply-add per 32 bytes of float32 weights leaves the memory, not the adds, to wait for, and
// two leave registers for a tile of four. A weight block is loaded (and widened) once for every
// activation row. One weight row streams with the software prefetch. At one row of activations,
// which is faster for float32 weights depends on the CPU (float_rows_at_one below).
template <int RW, int RX, typename W>
inline void tile_float(const W* w, const float* x, int64_t K, float (&total)[RW * RX]) {
  __m256 acc[RW][RX][2];
  for (auto& row : acc) for (auto& a : row) a[0] = a[1] = _mm256_setzero_ps();
  auto step = [&](int64_t k, int j) {  // inputs k .. k + 7 into each sum's accumulator j
    __m256 wv[RW];
    for (int i = 0; i < RW; ++i) wv[i] = load8(w + i * K + k);
    for (int r = 0; r < RX; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int i = 0; i < RW; ++i) acc[i][r][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][r][j]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (RW == 1) prefetch(w + k);
    step(k, 0);
    step(k + 8, 1);
  }
  if (k < K) step(k, 0);
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) total[i * RX + r] = hsum(_mm256_add_ps(acc[i][r][0], acc[i][r][1]));
  }
}

// tile_rows computes RW x RX sums with one accumulator each (tile_float's two would not fit AVX2's 16
// registers at 3 x 4): for inputs longer than a few rows (a prompt), where a weight block loaded once
// feeds four activation rows and an activation block three weight rows. Every sum is one accumulator
// in the same order whatever the tile, so a row's result does not depend on the other rows either.
template <int RW, int RX, typename W>
inline void tile_rows(const W* w, const float* x, int64_t K, float (&total)[RW * RX], const W* ahead) {
  __m256 acc[RW][RX];
  for (auto& row : acc) for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (ahead != nullptr && k % 16 == 0) {
      for (int i = 0; i < RW; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * K + k), _MM_HINT_T0);
    }
    __m256 wv[RW];
    for (int i = 0; i < RW; ++i) wv[i] = load8(w + i * K + k);
    for (int r = 0; r < RX; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int i = 0; i < RW; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) total[i * RX + r] = hsum(acc[i][r]);
  }
}

// int8 weights, eight rows at once (a group of int8_group's layout), against one row of activation
// codes x and its block scales xs: out[0 .. 7], before the rows' scales.
inline void group_i8(const int8_t* w, const int8_t* x, const float* xs, int64_t blocks, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * 256;
    const int8_t* xb = x + b * kBlock;
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {  // inputs 4c .. 4c + 3 of the block
      if (c % 2 == 0) prefetch(wb + 32 * c);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      int32_t four;
      std::memcpy(&four, xb + 4 * c, 4);
      // maddubs multiplies unsigned by signed bytes: |w| times x with w's sign, each pair <= 2 * 127 * 127
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(_mm256_set1_epi32(four), wv));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(xs[b]), _mm256_cvtepi32_ps(sum), acc);
  }
  _mm256_storeu_ps(out, acc);
}

// 4-bit weights, eight rows at once (a group of int4_pack's layout), against one row of activation
// codes x, its block scales xs and block sums xsum (scale times the sum of codes): out[0 .. 7]. The
// block's minimums take a second multiply-add.
inline void group_u4(const uint8_t* w, const uint16_t* params, const int8_t* x, const float* xs,
                     const float* xsum, int64_t blocks, float* out) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps(), offset = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * 128;
    const int8_t* xb = x + b * kBlock;
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // inputs 8c .. 8c + 7 of the block: low halves 8c + 0..3, high 8c + 4..7
      if (c % 2 == 0) prefetch(wb + 32 * c);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      int32_t lo_x, hi_x;
      std::memcpy(&lo_x, xb + 8 * c, 4);
      std::memcpy(&hi_x, xb + 8 * c + 4, 4);
      const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(raw, low4), _mm256_set1_epi32(lo_x));
      const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), _mm256_set1_epi32(hi_x));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones));  // codes <= 15: no pair saturates
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 16 * b)));
    const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 16 * b + 8)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xs[b])), _mm256_cvtepi32_ps(sum), acc);
    offset = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[b]), offset);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc, offset));
}

void check_input(const at::Tensor& x, const at::Tensor& w, int64_t K, int64_t multiple = kBlock) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "tinygpt lowbit kernels run on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) float32");
  TORCH_CHECK(x.size(1) == K && K % multiple == 0, "x has ", x.size(1), " columns; the weight takes ", K,
              " (a multiple of ", multiple, ")");
}

// A layer's bias as the kernels add it: float32 and contiguous, `values` null where there is none.
struct FloatBias {
  at::Tensor tensor;
  const float* values;
  explicit FloatBias(const c10::optional<at::Tensor>& bias)
      : tensor(bias.has_value() ? bias->contiguous().to(at::kFloat) : at::Tensor()),
        values(tensor.defined() ? tensor.data_ptr<float>() : nullptr) {}
};

// out (M, N) = rows' sums plus bias[n] (when given), for tile_float. Each thread takes whole weight
// rows, and for each one its M outputs up to 4 rows at a time: rows(n, m, total) fills total
// (float[R], R = 4, 2 or 1) with the sums of outputs (m, n) .. (m + R - 1, n). Where M is 1 and
// four(n, total) is given, it fills total[0 .. 3] with outputs (0, n) .. (0, n + 3) instead.
template <typename Rows, typename Four = std::nullptr_t>
at::Tensor for_each_output(int64_t M, int64_t N, int64_t K, const at::TensorOptions& options,
                           const c10::optional<at::Tensor>& bias, Rows rows, Four four = nullptr) {
  at::Tensor out = at::empty({M, N}, options);
  const FloatBias b(bias);
  const float* bp = b.values;
  float* op = out.data_ptr<float>();
  auto store = [&](int64_t n, int64_t m, const auto& total) {
    for (size_t r = 0; r < std::size(total); ++r) {
      op[(m + r) * N + n] = total[r] + (bp ? bp[n] : 0.0f);
    }
  };
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / K), [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if constexpr (!std::is_null_pointer_v<Four>) {
      for (; M == 1 && n + 4 <= n1; n += 4) {
        float total[4];
        four(n, total);
        for (int r = 0; r < 4; ++r) store(n + r, 0, std::array<float, 1>{total[r]});
      }
    }
    for (; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        float total[4];
        rows(n, m, total);
        store(n, m, total);
      }
      for (; m + 2 <= M; m += 2) {
        float total[2];
        rows(n, m, total);
        store(n, m, total);
      }
      if (m < M) {
        float total[1];
        rows(n, m, total);
        store(n, m, total);
      }
    }
  });
  return out;
}

// How many float32 weight rows float_linear reads at a time against one row of activations: 4 or 1,
// the same sums bit for bit either way. The 12 x 768 model's 49 products at one row, 2 threads, GB/s
// (medians of 21-31 interleaved rounds): on the Zen 3 (AVX2 only) four rows without the prefetch
// 28.7 against one row's 23.1 (with the prefetch on each of the four, 24.5); on the Zen 4 (AVX-512)
// one row 37.2 against four's 28.2 (the baby model's 25: 37.2 against 26.1). So four rows where the
// CPU lacks AVX-512; float_rows(n) sets it and returns the last setting (tests take both). float16
// weights read four rows at a time slowed to 0.77x on the Zen 3, so 16-bit weights keep one row.
std::atomic<int64_t> float_rows_at_one{__builtin_cpu_supports("avx512f") ? 1 : 4};

int64_t float_rows(int64_t rows) {
  TORCH_CHECK(rows == 0 || rows == 1 || rows == 4, "float_rows takes 1 or 4 (0 reads the setting)");
  return rows ? float_rows_at_one.exchange(rows) : float_rows_at_one.load();
}

// Up to this many rows of activations are decoding rows (quantize.INT8_KERNEL_ROWS): tile_float's
// sums, the same bit for bit at any number of rows up to it. More rows (a prompt) take tile_rows, unless
// the caller asks for decoding rows (a speculative step's verification: each row as a step alone gets it).
constexpr int64_t kDecodingRows = 8;

// out (M, N) = x (M, K) times weight (N, K) transposed, plus bias, for M > kDecodingRows: each thread
// takes whole groups of three weight rows and, for each, every row of x four at a time (the three
// rows' 3 K weights stay in L1 while x streams past them from L2).
template <typename W>
at::Tensor prompt_rows(const at::Tensor& x, const W* wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const FloatBias b(bias);
  const float* bp = b.values;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // RW weight rows from n against RX activation rows from m, into out
  auto tile = [&](auto rw, auto rx, int64_t n, int64_t m) {
    constexpr int RW = decltype(rw)::value, RX = decltype(rx)::value;
    float total[RW * RX];
    // a group's first tile asks for the next group's weights, in L1 by the time the group's last tile is done
    tile_rows<RW, RX>(wp + n * K, xp + m * K, K, total, m == 0 && n + 2 * RW <= N ? wp + (n + RW) * K : nullptr);
    for (int i = 0; i < RW; ++i) {
      for (int r = 0; r < RX; ++r) op[(m + r) * N + n + i] = total[i * RX + r] + (bp ? bp[n + i] : 0.0f);
    }
  };
  auto rows = [&](auto rw, int64_t n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile(rw, std::integral_constant<int, 4>{}, n, m);
    for (; m < M; ++m) tile(rw, std::integral_constant<int, 1>{}, n, m);
  };
  at::parallel_for(0, (N + 2) / 3, std::max<int64_t>(1, 4096 / (M * K / 64 + 1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = 3 * g;
      if (n + 3 <= N) {
        rows(std::integral_constant<int, 3>{}, n);
      } else {
        for (int64_t i = n; i < N; ++i) rows(std::integral_constant<int, 1>{}, i);
      }
    }
  });
  return out;
}

// float_linear with float32 weights read `rows` (1 or 4) rows at a time at one row of x; 0: float_rows_at_one.
// decoding: tile_float's sums for any number of rows of x, not only up to kDecodingRows.
at::Tensor float_linear_rows(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                             int64_t rows, bool decoding = false) {
  const int64_t N = weight.size(0), K = weight.size(1);
  check_input(x_in, weight, K, 8);
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && weight.is_contiguous(),
              "weight must be contiguous float32, float16 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  auto run = [&](const auto* wp, auto... four) {
    return for_each_output(
        x.size(0), N, K, x.options(), bias,
        [&](int64_t n, int64_t m, auto& total) {
          tile_float<1, std::extent_v<std::remove_reference_t<decltype(total)>>>(wp + n * K, xp + m * K, K, total);
        },
        four...);
  };
  auto with_weights = [&](auto f) {  // f(the weights' pointer in their dtype)
    if (dtype == at::kFloat) return f(weight.data_ptr<float>());
    return dtype == at::kHalf ? f(weight.data_ptr<at::Half>()) : f(weight.data_ptr<at::BFloat16>());
  };
  if (x.size(0) > kDecodingRows && !decoding) {
    return with_weights([&](const auto* wp) { return prompt_rows(x, wp, N, bias); });
  }
  if (dtype == at::kFloat && (rows ? rows : float_rows_at_one.load()) == 4) {
    const float* wp = weight.data_ptr<float>();
    return run(wp, [&](int64_t n, float (&total)[4]) { tile_float<4, 1>(wp + n * K, xp, K, total); });
  }
  return with_weights([&](const auto* wp) { return run(wp); });
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return float_linear_rows(x, weight, bias, 0);
}

// out (M, N) for the integer kernels: each thread takes whole groups of eight weight rows, and for
// each group every row of x in turn (the group's weights stay in the cache from one row to the
// next); group(g, m, total) fills total[0 .. 7] with outputs (m, 8g .. 8g + 7), which get scale[n]
// (when given) and bias[n] (when given). The last group's padding rows are not stored.
template <typename Group>
at::Tensor for_each_group(int64_t M, int64_t N, int64_t K, const at::TensorOptions& options, const float* scale,
                          const c10::optional<at::Tensor>& bias, Group group) {
  at::Tensor out = at::empty({M, N}, options);
  const FloatBias b(bias);
  const float* bp = b.values;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 7) / 8, std::max<int64_t>(1, 4096 / K), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t rows = std::min<int64_t>(8, N - 8 * g);
      for (int64_t m = 0; m < M; ++m) {
        float total[8];
        group(g, m, total);
        for (int64_t r = 0, n = 8 * g; r < rows; ++r, ++n) {
          op[m * N + n] = total[r] * (scale ? scale[n] : 1.0f) + (bp ? bp[n] : 0.0f);
        }
      }
    }
  });
  return out;
}

void check_grouped(const at::Tensor& x, const at::Tensor& weight, int64_t N, at::ScalarType dtype, int64_t block_bytes) {
  const int64_t K = x.dim() == 2 ? x.size(1) : 0;
  check_input(x, weight, K);
  const int64_t groups = (N + 7) / 8, blocks = K / kBlock;
  TORCH_CHECK(N > 0 && weight.scalar_type() == dtype && weight.is_contiguous() && weight.dim() == 3 &&
                  weight.size(0) == groups && weight.size(1) == blocks && weight.size(2) == block_bytes,
              "weight must be (", groups, ", ", blocks, ", ", block_bytes, ") as kernels.py lays it out for ", N,
              " outputs of ", K, " inputs");
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  check_grouped(x_in, weight, N, at::kChar, 256);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be (N,) float32");
  const at::Tensor x = x_in.contiguous(), ws = scales.contiguous();
  const int64_t K = x.size(1), blocks = K / kBlock;
  const Quantized xq = quantize_rows(x);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* sp = xq.scales.data_ptr<float>();
  return for_each_group(x.size(0), N, K, x.options(), ws.data_ptr<float>(), bias, [&](int64_t g, int64_t m, float* total) {
    group_i8(wp + g * blocks * 256, qp + m * K, sp + m * blocks, blocks, total);
  });
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& params,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  check_grouped(x_in, weight, N, at::kByte, 128);
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(1), blocks = K / kBlock;
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() && params.dim() == 3 &&
                  params.size(0) == weight.size(0) && params.size(1) == blocks && params.size(2) == 16,
              "params must be int4_pack's float16 (groups, K / 32, 16)");
  const Quantized xq = quantize_rows(x);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>());
  const int8_t* qp = xq.codes.data_ptr<int8_t>();
  const float* sp = xq.scales.data_ptr<float>();
  const float* up = xq.sums.data_ptr<float>();
  return for_each_group(x.size(0), N, K, x.options(), nullptr, bias, [&](int64_t g, int64_t m, float* total) {
    group_u4(wp + g * blocks * 128, pp + g * blocks * 16, qp + m * K, sp + m * blocks, up + m * blocks, blocks, total);
  });
}

// One decode step of a whole GPT in one call (tinygpt/fastpath.py builds the plan from a model whose
// Linear layers are tinygpt's kernels' or plain float32). At batch 1 a small model's step is ~15
// operators a layer, and from Python each costs more than its arithmetic (PyTorch's attention for
// one query alone ~50 us). Here a step is the kernels above for the Linear layers, ATen's GELU and
// SiLU, and the norms, rotary positions, attention for the one new query, the residual adds and the
// cache writes as plain loops, for rows that are each computed on their own (a row's logits do not
// depend on its batch). Both of model.py's layouts: GPT-2's (learned positions, LayerNorm, q, k and v
// in one matmul, a GELU MLP) and the llama family's (rotary positions, RMSNorm, q, k and v apart with
// fewer key/value heads than query heads, an optional RMSNorm on each head's queries and keys, and a
// SwiGLU, ReLU-squared or GELU MLP), the same loops for what the two share.
struct Linear {
  int64_t kind;  // 0: float32, float16 or bfloat16 weights, 1: int8 (aux: scales), 2: int4 (aux: params)
  int64_t out_features;
  at::Tensor weight, aux;
  c10::optional<at::Tensor> bias;
  int64_t rows = 0;  // float32 weight rows at a time at one row of x (float_linear_rows); 0: the CPU's default

  // decoding: every row of x takes the kernel a one-row step takes (float32's tile_float past 8 rows)
  at::Tensor operator()(const at::Tensor& x, bool decoding) const {
    if (kind == 0) return float_linear_rows(x, weight, bias, rows, decoding);
    if (kind == 1) return int8_linear(x, weight, aux, bias, out_features);
    return int4_linear(x, weight, aux, bias, out_features);
  }
};

struct Norm {
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  double eps;
};

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void check_float(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what,
              " must be ", n, " contiguous float32 values on the CPU");
}

struct DecodePlan : torch::CustomClassHolder {
  at::Tensor wte, wpe;  // (vocab, C), (block_size, C) or empty: rotary positions
  at::Tensor inv_freq;  // (head_dim / 2) rotary frequencies, or empty: learned positions
  double embed_scale;   // 1: the token embeddings as they are
  int64_t n_head, n_kv_head, head_dim;
  std::string mlp;  // GELU's approximate ("none", "tanh"), "swiglu" or "relu2"
  bool rms, fused, qk_norm;  // RMSNorm (else LayerNorm); q, k, v in one matmul (GPT-2); queries' and keys' norms
  std::vector<Norm> norms;      // each block's ln_1, ln_2 (then q_norm, k_norm), then ln_f
  std::vector<Linear> linears;  // each block's c_attn, c_proj, c_fc, c_proj (GPT-2) or q, k, v, o,
                                // (gate,) up, down (the llama layout), then lm_head

  DecodePlan(at::Tensor wte, at::Tensor wpe, at::Tensor inv_freq, double embed_scale, int64_t n_head,
             int64_t n_kv_head, int64_t head_dim, std::string mlp, bool rms, bool fused, bool qk_norm)
      : wte(std::move(wte)), wpe(std::move(wpe)), inv_freq(std::move(inv_freq)), embed_scale(embed_scale),
        n_head(n_head), n_kv_head(n_kv_head), head_dim(head_dim), mlp(std::move(mlp)), rms(rms), fused(fused),
        qk_norm(qk_norm) {
    TORCH_CHECK(this->wte.dim() == 2 && n_kv_head > 0 && n_head % n_kv_head == 0 && head_dim % 2 == 0,
                "embeddings (V, C), n_kv_head dividing n_head, an even head_dim");
    TORCH_CHECK(!fused || (n_head == n_kv_head && n_head * head_dim == this->wte.size(1)),
                "q, k and v in one matmul take n_head heads of C / n_head");
    TORCH_CHECK((this->wpe.numel() == 0) != (this->inv_freq.numel() == 0), "learned or rotary positions, one of them");
    check_float(this->wte, this->wte.numel(), "wte");
    if (this->wpe.numel()) {
      TORCH_CHECK(this->wpe.dim() == 2 && this->wpe.size(1) == this->wte.size(1), "wpe must be (block_size, C)");
      check_float(this->wpe, this->wpe.numel(), "wpe");
    } else {
      check_float(this->inv_freq, head_dim / 2, "inv_freq");
    }
  }

  void norm(at::Tensor weight, c10::optional<at::Tensor> bias, double eps) {
    // a block's qk-norms are over head_dim features, every other norm over C
    const bool per_head = qk_norm && norms.size() % 4 >= 2;
    const int64_t n = per_head ? head_dim : wte.size(1);
    check_float(weight, n, "a norm's weight");
    if (bias) check_float(*bias, n, "a norm's bias");
    norms.push_back({std::move(weight), std::move(bias), eps});
  }

  void linear(int64_t kind, int64_t out_features, at::Tensor weight, at::Tensor aux, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "linear kind must be 0 (float), 1 (int8) or 2 (int4)");
    linears.push_back({kind, out_features, std::move(weight), std::move(aux), std::move(bias)});
  }

  // float32 weight rows each of the plan's float layers reads at a time at one row of activations: 1 or
  // 4, or 0, the CPU's default (float_rows)
  void float_rows(int64_t rows) {
    TORCH_CHECK(rows == 0 || rows == 1 || rows == 4, "a plan's float_rows takes 0, 1 or 4");
    for (Linear& l : linears) l.rows = rows;
  }

  int64_t norms_per_block() const { return qk_norm ? 4 : 2; }
  int64_t linears_per_block() const { return fused ? 4 : (mlp == "swiglu" ? 7 : 6); }

  // Each run of n values of x normalized in place into out: LayerNorm's mean and variance, or RMSNorm's
  // mean square, in double, in two passes.
  void normalize(const float* x, float* out, int64_t rows, int64_t n, const Norm& norm) const {
    const float *w = norm.weight.data_ptr<float>(), *b = norm.bias ? norm.bias->data_ptr<float>() : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * n;
      double mean = 0.0, squares = 0.0;
      if (!rms) {
        for (int64_t c = 0; c < n; ++c) mean += row[c];
        mean /= n;
      }
      for (int64_t c = 0; c < n; ++c) squares += (row[c] - mean) * (row[c] - mean);
      const float m = static_cast<float>(mean), rstd = static_cast<float>(1.0 / std::sqrt(squares / n + norm.eps));
      for (int64_t c = 0; c < n; ++c) out[r * n + c] = (row[c] - m) * rstd * w[c] + (b ? b[c] : 0.0f);
    }
  }

  at::Tensor normed(const at::Tensor& x, const Norm& n) const {
    at::Tensor out = at::empty_like(x);
    normalize(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), n);
    return out;
  }

  // Each of `heads` heads of row (head_dim values each) turned by position pos's angles, as model.rotate:
  // dimensions i and i + head_dim / 2 as a pair.
  void rotate(float* row, int64_t heads, int64_t pos) const {
    const int64_t half = head_dim / 2;
    const float* f = inv_freq.data_ptr<float>();
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos) * f[i], c = std::cos(angle), s = std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        float *a = row + h * head_dim + i, *b = a + half;
        const float x1 = *a, x2 = *b;
        *a = x1 * c - x2 * s;
        *b = x2 * c + x1 * s;
      }
    }
  }

  // q (B T, n_head * head_dim), k and v (B T, n_kv_head * head_dim), each row's heads side by side, at
  // strides q_row and kv_row between rows: row b T + t is sequence b's at position start[b] + t. Writes k
  // and v into the cache there and returns (B T, n_head * head_dim) the heads' attention of each row over
  // its sequence's positions 0 .. its own, side by side; query head h reads key/value head
  // h / (n_head / n_kv_head), as model.attention.
  at::Tensor attend(const float* qp, const float* kp_new, const float* vp_new, int64_t B, int64_t T, int64_t q_row,
                    int64_t kv_row, const at::Tensor& k_buf, const at::Tensor& v_buf, const int64_t* start) const {
    const int64_t H = n_head, KV = n_kv_head, D = head_dim, group = H / KV;
    float *kp = k_buf.data_ptr<float>(), *vp = v_buf.data_ptr<float>();
    const int64_t sb = k_buf.stride(0), sh = k_buf.stride(1), st = k_buf.stride(2);  // (B, KV, max_len, D)
    for (int64_t r = 0; r < B * T; ++r) {
      const int64_t at = (r / T) * sb + (start[r / T] + r % T) * st;
      for (int64_t h = 0; h < KV; ++h) {
        std::copy_n(kp_new + r * kv_row + h * D, D, kp + at + h * sh);
        std::copy_n(vp_new + r * kv_row + h * D, D, vp + at + h * sh);
      }
    }
    const int64_t longest = *std::max_element(start, start + B) + T;
    at::Tensor out = at::empty({B * T, H * D}, wte.options());
    float* op = out.data_ptr<float>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    at::parallel_for(0, B * T * H, std::max<int64_t>(1, 16384 / (longest * D)), [&](int64_t i0, int64_t i1) {
      std::vector<float> p(longest);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / H, b = r / T, h = i % H, g = h / group, seen = start[b] + r % T + 1;
        const float *q = qp + r * q_row + h * D, *keys = kp + b * sb + g * sh, *values = vp + b * sb + g * sh;
        float most = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < seen; ++t) most = std::max(most, p[t] = dot(q, keys + t * st, D) * scale);
        for (int64_t t = 0; t < seen; ++t) total += p[t] = std::exp(p[t] - most);
        float* y = op + r * H * D + h * D;
        std::fill_n(y, D, 0.0f);
        for (int64_t t = 0; t < seen; ++t) {
          const float* v = values + t * st;
          for (int64_t d = 0; d < D; ++d) y[d] += p[t] * v[d];
        }
        for (int64_t d = 0; d < D; ++d) y[d] /= total;
      }
    });
    return out;
  }

  // One block's attention on h (B T, C), the block's ln_1 output of B sequences' T rows, sequence b's at
  // positions start[b] .. start[b] + T - 1: its output projection's input.
  at::Tensor attention(const at::Tensor& h, int64_t B, const Linear* lin, const Norm* norm, const at::Tensor& keys,
                       const at::Tensor& values, const int64_t* start, bool decoding) const {
    const int64_t R = h.size(0), T = R / B, C = wte.size(1);
    if (fused) {  // GPT-2's c_attn: each row q, k, v with the heads side by side
      const at::Tensor qkv = lin[0](h, decoding);
      const float* p = qkv.data_ptr<float>();
      return attend(p, p + C, p + 2 * C, B, T, 3 * C, 3 * C, keys, values, start);
    }
    at::Tensor q = lin[0](h, decoding), k = lin[1](h, decoding);
    const at::Tensor v = lin[2](h, decoding);
    if (qk_norm) {  // over each head's features, before the rotation (Qwen3)
      q = normed(q.view({-1, head_dim}), norm[2]).view({R, -1});
      k = normed(k.view({-1, head_dim}), norm[3]).view({R, -1});
    }
    for (int64_t r = 0; r < R; ++r) {
      rotate(q.data_ptr<float>() + r * n_head * head_dim, n_head, start[r / T] + r % T);
      rotate(k.data_ptr<float>() + r * n_kv_head * head_dim, n_kv_head, start[r / T] + r % T);
    }
    const int64_t kv = n_kv_head * head_dim;
    return attend(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), B, T, n_head * head_dim, kv, keys,
                  values, start);
  }

  // One block's MLP on h (R, C), the block's ln_2 output: its down projection's input. ATen's GELU and SiLU
  // take a scalar path for what is left past their last vector of 8, and a tensor of several rows is cut in
  // other places than one row: decoding rows each take their own call, so that each gets a one-row step's bits.
  at::Tensor hidden(const at::Tensor& h, const Linear* lin, bool decoding) const {
    at::Tensor up = lin[0](h, decoding);  // SwiGLU's gate
    auto activate = [&](auto f) {
      if (!decoding || up.size(0) == 1) return f(up);
      for (int64_t r = 0; r < up.size(0); ++r) f(up[r]);
      return up;
    };
    if (mlp == "swiglu") return activate([](at::Tensor t) { return at::silu_(t); }).mul_(lin[1](h, decoding));
    if (mlp == "relu2") return at::relu_(up).square_();
    return activate([&](at::Tensor t) { return at::gelu_(t, mlp); });
  }

  static void add_into(at::Tensor& x, const at::Tensor& y) {
    float* xp = x.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
  }

  // The last norm's input (B T, C) after tokens (B, T) int64, sequence b's at positions start[b] .. start[b]
  // + T - 1; keys and values (n_layer, B, n_kv_head, max_len, head_dim) float32 get the tokens' there.
  at::Tensor forward(const at::Tensor& token, const std::vector<int64_t>& start, const at::Tensor& keys,
                     const at::Tensor& values, bool decoding) const {
    const int64_t per_block = linears_per_block(), layers = static_cast<int64_t>(linears.size()) / per_block;
    TORCH_CHECK(static_cast<int64_t>(linears.size()) == per_block * layers + 1 &&
                    static_cast<int64_t>(norms.size()) == norms_per_block() * layers + 1,
                "a decode plan needs each block's norms and linears, then a norm and the head");
    const int64_t B = token.size(0), T = token.dim() == 2 ? token.size(1) : 1, V = wte.size(0), C = wte.size(1);
    TORCH_CHECK(keys.dim() == 5 && keys.sizes() == values.sizes() && keys.strides() == values.strides() &&
                    keys.size(0) == layers && keys.size(2) == n_kv_head && keys.size(4) == head_dim &&
                    keys.stride(4) == 1 && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
                "keys and values must be (n_layer, B, n_kv_head, max_len, head_dim) float32");
    TORCH_CHECK((token.dim() == 1 || token.dim() == 2) && T > 0 && keys.size(1) == B, "tokens for each cached row");
    for (const int64_t pos : start) {
      TORCH_CHECK(pos >= 0 && pos + T <= keys.size(3) && (wpe.numel() == 0 || pos + T <= wpe.size(0)),
                  "tokens at positions inside the cache");
    }
    const at::Tensor ids = token.to(at::kLong).contiguous();
    at::Tensor x = at::empty({B * T, C}, wte.options());
    for (int64_t r = 0; r < B * T; ++r) {  // row b T + t: sequence b's token at start[b] + t
      const int64_t id = ids.data_ptr<int64_t>()[r];
      TORCH_CHECK(id >= 0 && id < V, "token id ", id, " is outside the vocabulary of ", V);
      const float* e = wte.data_ptr<float>() + id * C;
      const float* p = wpe.numel() ? wpe.data_ptr<float>() + (start[r / T] + r % T) * C : nullptr;
      float* xr = x.data_ptr<float>() + r * C;
      for (int64_t c = 0; c < C; ++c) xr[c] = e[c] * static_cast<float>(embed_scale) + (p ? p[c] : 0.0f);
    }
    const int64_t mlp_at = fused ? 2 : 4;  // the first MLP linear of a block
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* lin = &linears[per_block * l];
      const Norm* norm = &norms[norms_per_block() * l];
      const at::Tensor attended = attention(normed(x, norm[0]), B, lin, norm, keys.select(0, l), values.select(0, l),
                                            start.data(), decoding);
      add_into(x, lin[mlp_at - 1](attended, decoding));
      add_into(x, lin[per_block - 1](hidden(normed(x, norm[1]), lin + mlp_at, decoding), decoding));
    }
    return x;
  }

  // The logits (B, vocab) after tokens (B,) or (B, T) int64 at positions pos .. pos + T - 1 of each row (a
  // decode step, or a short prompt at pos 0: its last position's logits); keys and values (n_layer, B,
  // n_kv_head, max_len, head_dim) float32 get the tokens' there.
  at::Tensor step(const at::Tensor& token, int64_t pos, const at::Tensor& keys, const at::Tensor& values) const {
    const int64_t B = token.size(0), T = token.dim() == 2 ? token.size(1) : 1, C = wte.size(1);
    at::Tensor x = forward(token, std::vector<int64_t>(B, pos), keys, values, false);
    if (T > 1) x = x.view({B, T, C}).select(1, T - 1).contiguous();  // each sequence's last row
    return linears.back()(normed(x, norms.back()), false);
  }

  // The logits (B, T, vocab) of every one of tokens (B, T) int64, sequence b's at positions start[b] ..
  // start[b] + T - 1 (start (B,) int64): rows decoding at positions of their own (a server's batch), or a
  // speculative step's drafted tokens, verified at once. Each row's logits are, bit for bit, those of a step
  // that decodes it alone, with its keys and values in the cache: every row takes a one-row step's kernels.
  at::Tensor rows(const at::Tensor& token, const at::Tensor& start, const at::Tensor& keys,
                  const at::Tensor& values) const {
    TORCH_CHECK(token.dim() == 2 && start.dim() == 1 && start.size(0) == token.size(0),
                "tokens (B, T) and a start position (B,) for each row");
    const at::Tensor s = start.to(at::kLong).contiguous();
    const std::vector<int64_t> starts(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
    const at::Tensor x = forward(token, starts, keys, values, true);
    return linears.back()(normed(x, norms.back()), true).view({token.size(0), token.size(1), -1});
  }
};

}  // namespace

TORCH_LIBRARY(tinygpt_lowbit, m) {
  m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("float_rows(int rows) -> int", &float_rows);
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, Tensor params, Tensor? bias, int out_features) -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, std::string, bool, bool, bool>())
      .def("norm", &DecodePlan::norm)
      .def("linear", &DecodePlan::linear)
      .def("float_rows", &DecodePlan::float_rows)
      .def("step", &DecodePlan::step)
      .def("rows", &DecodePlan::rows);
}

TORCH_LIBRARY_IMPL(tinygpt_lowbit, CPU, m) {
  m.impl("float_linear", &float_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
