// layers.rotary.apply_rope in C++, shared by the GEMV (which rotates q/k in its own call) and
// the one-call quantized decode step (qdecode.cpp).
#pragma once

#include <cstdint>

namespace {

// layers.rotary.apply_rope in place: each head of head_dim in y[r, 0:cols) rotated by cs[r]
// (cos | sin halves).
inline void rope_rows(float* y, int64_t y_stride, int64_t rows, int64_t cols, int64_t head_dim,
                      const float* cs, int64_t cs_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict cos = cs + r * cs_stride;
    const float* __restrict sin = cos + half;
    for (int64_t h0 = 0; h0 + head_dim <= cols; h0 += head_dim) {
      float* __restrict a = y + r * y_stride + h0;
      float* __restrict b = a + half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = a[j], x2 = b[j];
        a[j] = x1 * cos[j] - x2 * sin[j];
        b[j] = x2 * cos[j] + x1 * sin[j];
      }
    }
  }
}

}  // namespace
