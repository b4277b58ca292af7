// The statistic of decoder.rms_norm, shared by the GEMV (which norms rows before its dots) and
// the panel GEMM (which scales its accumulators by it, the norm's weight folded into W).
#pragma once

#include <cmath>
#include <cstdint>

namespace {

// 1 / sqrt(mean(x^2) + eps) of a row of k floats (decoder.rms_norm's statistic): the squares
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

}  // namespace
