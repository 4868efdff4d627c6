// The modern block's element-wise training kernels, written once over a vector kind `Vec` that the including
// file defines: modern.cpp includes this file twice, in namespace avx2 (Vec: eight floats in AVX2 registers)
// and in namespace avx512 (sixteen, compiled for AVX-512 by a target pragma around the inclusion), so the
// same code is compiled for each instruction set and the CPU picks one at run time. No include guard, on
// purpose; it needs <ATen/ATen.h>, <ATen/Parallel.h> and <cmath> included before.
//
// Every kernel reads float32 or bfloat16 (autocast's) and computes in float32. A row whose length is not a
// multiple of the vector's goes through a buffer at its end (get, put), so any width works.

using V = Vec::V;
constexpr int W = Vec::W;

// e^x (Cephes' expf, as training.cpp's exp8: x = n ln 2 + r, a degree-6 polynomial in r, 2^n in the
// exponent bits), within ~2 ulp; inputs below -87 give ~1e-38 rather than 0.
inline V exp(V x) {
  x = Vec::min(Vec::max(x, Vec::set(-87.0f)), Vec::set(88.0f));
  const V n = Vec::round(Vec::mul(x, Vec::set(1.44269504088896341f)));
  V r = Vec::fnma(n, Vec::set(0.693359375f), x);
  r = Vec::fnma(n, Vec::set(-2.12194440e-4f), r);
  V p = Vec::set(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = Vec::fma(p, r, Vec::set(c));
  p = Vec::fma(p, Vec::mul(r, r), Vec::add(r, Vec::set(1.0f)));
  return Vec::mul(p, Vec::pow2(n));
}

inline V sigmoid(V x) { return Vec::div(Vec::set(1.0f), Vec::add(Vec::set(1.0f), exp(Vec::sub(Vec::zero(), x)))); }

// W values of p[i ..] as float32, zeros past n
template <typename T>
inline V get(const T* p, int64_t n, int64_t i) {
  if (i + W <= n) return Vec::load(p + i);
  T buffer[W] = {};
  for (int64_t j = i; j < n; ++j) buffer[j - i] = p[j];
  return Vec::load(buffer);
}

// v into p[i ..], up to n
template <typename T>
inline void put(T* p, int64_t n, int64_t i, V v) {
  if (i + W <= n) return Vec::store(p + i, v);
  T buffer[W];
  Vec::store(buffer, v);
  for (int64_t j = i; j < n; ++j) p[j] = buffer[j - i];
}

// 1 / sqrt(mean(x^2) + eps) over a row of n
template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  V squares = Vec::zero();
  for (int64_t i = 0; i < n; i += W) {
    const V v = get(x, n, i);
    squares = Vec::fma(v, v, squares);
  }
  return 1.0f / std::sqrt(Vec::sum(squares) / static_cast<float>(n) + eps);
}

// The gradient of y = x r w (r = inverse_rms(x)) over a row of n, given dy(i) (the upstream gradient's W values
// at i): dx = r (w dy - x^ mean(x^ w dy)) with x^ = x r, and dw += dy x^ (the row's share of w's gradient).
template <typename T, typename Grad>
inline void norm_backward(const T* x, const float* w, float r, int64_t n, Grad dy, T* dx, float* dw) {
  const V rv = Vec::set(r);
  V dot = Vec::zero();
  for (int64_t i = 0; i < n; i += W) {
    const V xhat = Vec::mul(get(x, n, i), rv), g = dy(i);
    dot = Vec::fma(Vec::mul(xhat, get(w, n, i)), g, dot);
    put(dw, n, i, Vec::fma(g, xhat, get(dw, n, i)));
  }
  const V mean = Vec::set(Vec::sum(dot) / static_cast<float>(n));
  for (int64_t i = 0; i < n; i += W) {
    const V xhat = Vec::mul(get(x, n, i), rv);
    put(dx, n, i, Vec::mul(rv, Vec::fnma(xhat, mean, Vec::mul(get(w, n, i), dy(i)))));
  }
}

// Rows for one share of a weight's gradient: a fixed split, so that the sum comes out the same on any
// number of threads.
constexpr int64_t SHARE_ROWS = 64;

// RMSNorm over N rows of C (x and y contiguous): y = x r w, rstd[row] = r
template <typename T>
void rms_norm(const T* x, const float* w, float eps, int64_t N, int64_t C, T* y, float* rstd) {
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / C), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * C;
      const float r = rstd[row] = inverse_rms(xr, C, eps);
      const V rv = Vec::set(r);
      for (int64_t i = 0; i < C; i += W) put(y + row * C, C, i, Vec::mul(Vec::mul(get(xr, C, i), rv), get(w, C, i)));
    }
  });
}

// RMSNorm's gradients: dx (N, C), and w's as shares (one row of C a SHARE_ROWS rows, zeroed here) to add up
template <typename T>
void rms_norm_backward(const T* g, const T* x, const float* w, const float* rstd, int64_t N, int64_t C, T* dx,
                       float* shares) {
  at::parallel_for(0, (N + SHARE_ROWS - 1) / SHARE_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* dw = shares + s * C;
      std::fill_n(dw, C, 0.0f);
      for (int64_t row = s * SHARE_ROWS; row < std::min(N, (s + 1) * SHARE_ROWS); ++row) {
        const T* gr = g + row * C;
        norm_backward(x + row * C, w, rstd[row], C, [&](int64_t i) { return get(gr, C, i); }, dx + row * C, dw);
      }
    }
  });
}

// Where the rotary kernels find a (B, T, H, D) tensor's heads: row n = (b, t) of N = B T at b batch + t row,
// its heads `head` apart. The angles' cos and sin are (R, D) float32, R the positions (row n at n % R) or B T.
template <typename T>
struct Heads {
  const T* data;
  int64_t T_, batch, row, head;
  const T* at(int64_t n, int64_t h) const { return data + n / T_ * batch + n % T_ * row + h * head; }  // once a row
};

// One head turned by its angles (c, s: D values, each frequency twice): y = m cos + rotate_half(m) sin with
// m(at, i) the head's W values at at + i (at: 0, or D / 2 for the second half), for the pairs (i, i + D / 2).
template <typename T, typename M>
inline void turn(M m, const float* c, const float* s, int64_t D, T* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += W) {
    const V a = m(0, i), b = m(half, i), cv = get(c, half, i), sv = get(s, half, i);
    put(y, half, i, Vec::fnma(b, sv, Vec::mul(a, cv)));
    put(y + half, half, i, Vec::fma(a, sv, Vec::mul(b, cv)));
  }
}

// Rotary positions on q or k, after the QK-norm where w is given: y (N, H, D) contiguous, rstd (N, H) with w.
template <typename T>
void rotary(Heads<T> x, int64_t N, int64_t H, int64_t D, const float* w, float eps, const float* cos,
            const float* sin, int64_t R, T* y, float* rstd) {
  const int64_t half = D / 2;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / (H * D)), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float *c = cos + (n % R) * D, *s = sin + (n % R) * D;
      const T* xn = x.at(n, 0);
      for (int64_t h = 0; h < H; ++h) {
        const T* xh = xn + h * x.head;
        T* yh = y + (n * H + h) * D;
        if (w == nullptr) {
          turn([&](int64_t at, int64_t i) { return get(xh + at, half, i); }, c, s, D, yh);
          continue;
        }
        const float r = rstd[n * H + h] = inverse_rms(xh, D, eps);
        const V rv = Vec::set(r);
        turn([&](int64_t at, int64_t i) { return Vec::mul(Vec::mul(get(xh + at, half, i), rv), get(w + at, half, i)); },
             c, s, D, yh);
      }
    }
  });
}

// The turn back of one head's gradient at i (the turn's gradient, its angle's negative): on the pairs
// (i, i + D / 2), da = dy_a cos + dy_b sin and db = dy_b cos - dy_a sin
template <typename T>
inline void turn_back(const T* g, const float* c, const float* s, int64_t half, int64_t i, V& da, V& db) {
  const V ga = get(g, half, i), gb = get(g + half, half, i), cv = get(c, half, i), sv = get(s, half, i);
  da = Vec::fma(gb, sv, Vec::mul(ga, cv));
  db = Vec::fnma(ga, sv, Vec::mul(gb, cv));
}

// One head's gradients through the turn and the QK-norm: norm_backward's with the turn back of dy for its
// upstream gradient, recomputed in the second pass rather than kept (two passes over the head, not three)
template <typename T>
inline void turned_norm_backward(const T* g, const T* x, const float* w, float r, const float* c, const float* s,
                                 int64_t D, T* dx, float* dw) {
  const int64_t half = D / 2;
  const V rv = Vec::set(r);
  V dot = Vec::zero(), da, db;
  for (int64_t i = 0; i < half; i += W) {
    turn_back(g, c, s, half, i, da, db);
    const V xa = Vec::mul(get(x, half, i), rv), xb = Vec::mul(get(x + half, half, i), rv);
    dot = Vec::fma(Vec::mul(xa, get(w, half, i)), da, Vec::fma(Vec::mul(xb, get(w + half, half, i)), db, dot));
    put(dw, half, i, Vec::fma(da, xa, get(dw, half, i)));
    put(dw + half, half, i, Vec::fma(db, xb, get(dw + half, half, i)));
  }
  const V mean = Vec::set(Vec::sum(dot) / static_cast<float>(D));
  for (int64_t i = 0; i < half; i += W) {
    turn_back(g, c, s, half, i, da, db);
    const V xa = Vec::mul(get(x, half, i), rv), xb = Vec::mul(get(x + half, half, i), rv);
    put(dx, half, i, Vec::mul(rv, Vec::fnma(xa, mean, Vec::mul(get(w, half, i), da))));
    put(dx + half, half, i, Vec::mul(rv, Vec::fnma(xb, mean, Vec::mul(get(w + half, half, i), db))));
  }
}

// rotary's gradients: dx (N, H, D) contiguous and, with w, w's as shares (as rms_norm_backward's)
template <typename T>
void rotary_backward(Heads<T> g, Heads<T> x, int64_t N, int64_t H, int64_t D, const float* w, const float* rstd,
                     const float* cos, const float* sin, int64_t R, T* dx, float* shares) {
  const int64_t half = D / 2;
  at::parallel_for(0, (N + SHARE_ROWS - 1) / SHARE_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* dw = w == nullptr ? nullptr : shares + s * D;
      if (dw != nullptr) std::fill_n(dw, D, 0.0f);
      for (int64_t n = s * SHARE_ROWS; n < std::min(N, (s + 1) * SHARE_ROWS); ++n) {
        const float *c = cos + (n % R) * D, *sn = sin + (n % R) * D;
        const T *gn = g.at(n, 0), *xn = x.at(n, 0);
        for (int64_t h = 0; h < H; ++h) {
          const T* gh = gn + h * g.head;
          T* dxh = dx + (n * H + h) * D;
          if (dw != nullptr) {
            turned_norm_backward(gh, xn + h * x.head, w, rstd[n * H + h], c, sn, D, dxh, dw);
            continue;
          }
          for (int64_t i = 0; i < half; i += W) {
            V da, db;
            turn_back(gh, c, sn, half, i, da, db);
            put(dxh, half, i, da);
            put(dxh + half, half, i, db);
          }
        }
      }
    }
  });
}

// SwiGLU's gate over n values: h = silu(a) b = a b sigmoid(a)
template <typename T>
void swiglu(const T* a, const T* b, int64_t n, T* h) {
  at::parallel_for(0, (n + W - 1) / W, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * W; i < std::min(n, end * W); i += W) {
      const V av = get(a, n, i);
      put(h, n, i, Vec::mul(Vec::mul(av, sigmoid(av)), get(b, n, i)));
    }
  });
}

// Its gradients: da = dh b s (1 + a (1 - s)) with s = sigmoid(a), db = dh a s
template <typename T>
void swiglu_backward(const T* dh, const T* a, const T* b, int64_t n, T* da, T* db) {
  at::parallel_for(0, (n + W - 1) / W, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * W; i < std::min(n, end * W); i += W) {
      const V av = get(a, n, i), g = get(dh, n, i), s = sigmoid(av);
      const V slope = Vec::fma(Vec::mul(av, s), Vec::sub(Vec::set(1.0f), s), s);  // s + a s (1 - s)
      put(da, n, i, Vec::mul(Vec::mul(g, get(b, n, i)), slope));
      put(db, n, i, Vec::mul(g, Vec::mul(av, s)));
    }
  });
}
