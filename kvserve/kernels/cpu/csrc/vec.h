// Generic float vectors for kvserve's C++ kernels: vf holds kLanes floats, which the compiler
// maps onto one of the CPU's registers: 16 where it may use AVX-512, 8 with AVX/AVX2, else 4
// (SSE, NEON). Why not always 16: without AVX-512, GCC lowers a 64-byte generic vector
// through the stack, and the paged decode kernel built for AVX2 ran ~9x slower than for
// AVX-512 on the same CPU, not ~2x. Included by the kernels' sources (cpu_ext.py hashes it
// into their build key); internal linkage, so two libraries built for different widths can
// be loaded side by side. Also expv and the gated activations on it (silu, gelu_tanh), which
// more than one kernel needs (panel_gemm's epilogue, the quantized tiles').
#pragma once

#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp of kLanes floats <= 0 (paged_decode: a score minus the running max; panel_gemm: -|x| in
// SiLU and GELU), or -inf -> 0; NaN stays NaN. Cephes' expf: round x / ln 2 to n, a
// polynomial on the remainder, times 2^n; within a few ulp of std::exp, which the decode
// kernel called once per score as a scalar function. Needs IEEE rounding as written (no
// -ffast-math: the shifter's add and subtract would fold away).
inline vf expv(vf x) {
  const vi under = x < -87.3365f;  // e^x below FLT_MIN: 0
  x = (vf)(((vi)x & ~under) | ((vi)(vf{} - 87.3365f) & under));
  const vf shifter = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * 1.44269504088896341f + shifter;
  const vf n = t - shifter;
  const vi ni = (vi)t - 0x4b400000;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vf scale = (vf)((vu)(ni + 127) << 23);  // 2^n (unsigned: a NaN's n is garbage)
  return (vf)((vi)(p * scale) & ~under);
}

constexpr int32_t kSignBit = INT32_MIN;

// x * sigmoid(x) = x / (1 + e^-x), with e = exp(-|x|) <= 1 (expv's range): sigmoid(|x|) =
// 1 / (1 + e), sigmoid(-|x|) = e / (1 + e).
inline vf silu(vf x) {
  const vf e = expv((vf)((vi)x | kSignBit));  // -|x|: the sign bit set
  const vf s = 1.f / (1.f + e);
  const vi neg = x < 0.f;
  return x * (vf)(((vi)(e * s) & neg) | ((vi)s & ~neg));
}

// 0.5 x (1 + tanh(y)), y = c (x + 0.044715 x^3); tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = exp(-2|y|).
inline vf gelu_tanh(vf x) {
  const vf y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const vf e = expv((vf)((vi)(y + y) | kSignBit));
  const vf t = (1.f - e) / (1.f + e);  // tanh(|y|)
  return 0.5f * x * (1.f + (vf)((vi)t | ((vi)y & kSignBit)));
}

}  // namespace
