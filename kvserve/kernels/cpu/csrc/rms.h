// layers.norm.rms_norm in C++, shared by the GEMV and the panel GEMM (which norm the rows of x
// before their dots, in the same call).
#pragma once

#include <cmath>
#include <cstdint>

namespace {

// 1 / sqrt(mean(x^2) + eps) of a row of k floats (layers.norm.rms_norm's statistic): the squares
// summed in 16 float lanes (vectorized), the lanes in double.
inline float inv_rms(const float* x, int64_t k, float eps) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  double ss = 0.0;
  for (int l = 0; l < 16; ++l) ss += lanes[l];
  for (; i < k; ++i) ss += static_cast<double>(x[i]) * x[i];
  return 1.f / std::sqrt(static_cast<float>(ss / k) + eps);
}

// layers.norm.rms_norm: x * rsqrt(mean(x^2) + eps) * w per row.
inline void rms_norm_rows(const float* x, int64_t x_stride, int64_t rows, int64_t k,
                          const float* w, float eps, float* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float inv = inv_rms(xr, k, eps);
    float* d = dst + r * dst_stride;
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) d[j] = (xr[j] * inv) * w[j];
  }
}

}  // namespace
