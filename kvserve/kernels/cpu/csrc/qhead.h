// The float-x product on Q8_0 in the file's rows (the LM head's path where the build has no
// row tiles; tiles: qtiles.h's tile_gemv16). Included by qgemv.cpp inside its anonymous
// namespace; a file of its own so that qgemv.cpp stays readable.
#pragma once

// The float-x product on Q8_0 (the LM head's table in SmolLM2's file): the weight blocks
// widened to float in registers, x kept in float32. Why beside the integer path: with x
// quantized to 8 bits, the head's logits moved enough to change the demo's greedy answer
// (the final norm's outliers set each block's scale); this reads the same 34 bytes per 32
// weights and rounds nothing but the float sums.
template <int R>
inline void row_dots_f(const uint8_t* w, const float* x, int64_t x_stride, int64_t nb,
                       float* acc) {
#ifdef KVQ_AVX2
  __m256 v0[R], v1[R];
  for (int r = 0; r < R; ++r) v0[r] = v1[r] = _mm256_setzero_ps();
  auto step = [&](int64_t b, __m256* v) {
    const uint8_t* blk = w + b * 34;
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    __m256 wf[4];
    for (int j = 0; j < 4; ++j)
      wf[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * j))));
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * x_stride + b * kQK;
      __m256 p = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
      p = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xb + 8), p);
      p = _mm256_fmadd_ps(wf[2], _mm256_loadu_ps(xb + 16), p);
      p = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xb + 24), p);
      v[r] = _mm256_fmadd_ps(p, d, v[r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    step(b, v0);
    step(b + 1, v1);
  }
  if (b < nb) step(b, v0);
  for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(v0[r], v1[r]));
#else
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 34;
    const float d = half_to_float(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * x_stride + b * kQK;
      float sum = 0.f;
      for (int j = 0; j < kQK; ++j) sum += static_cast<float>(q[j]) * xb[j];
      acc[r] += d * sum;
    }
  }
#endif
}

// out[r, :n] = x[r] W^T + b (mode 0) or += (mode 1), W Q8_0 rows, x float32.
inline void f32x_rows(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                      int64_t n, int64_t k, const float* bias, float* out, int64_t out_stride,
                      int mode, int num_threads) {
  const int64_t nb = k / kQK, row_bytes = nb * 34;
  const int64_t unit = out_unit(rows);
  kvpar::parallel_for((n + unit - 1) / unit, num_threads, [&](int64_t tile) {
    for (int64_t o = tile * unit; o < n && o < (tile + 1) * unit; ++o) {
      if (o + kPrefetchRows < n) {
        const uint8_t* ahead = w + (o + kPrefetchRows) * row_bytes;
        for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(ahead + at);
      }
      const float b = bias != nullptr ? bias[o] : 0.f;
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t cnt = rows - r0 < 4 ? rows - r0 : 4;
        const float* xr = x + r0 * x_stride;
        float acc[4];
        switch (cnt) {
          case 4: row_dots_f<4>(w + o * row_bytes, xr, x_stride, nb, acc); break;
          case 3: row_dots_f<3>(w + o * row_bytes, xr, x_stride, nb, acc); break;
          case 2: row_dots_f<2>(w + o * row_bytes, xr, x_stride, nb, acc); break;
          default: row_dots_f<1>(w + o * row_bytes, xr, x_stride, nb, acc); break;
        }
        for (int64_t r = 0; r < cnt; ++r) {
          float* y = out + (r0 + r) * out_stride + o;
          *y = mode == 0 ? acc[r] + b : *y + acc[r] + b;
        }
      }
    }
  });
}
