// The KV cache's storage formats (kvserve/kv/quant.py) as float32 rows, for paged_decode.cpp:
// the scalar conversions (bfloat16, float16, fp8 e4m3 / e5m2), one token row of an element-wise
// format, of an affine-coded one (int8, int4 with fp16 scale and zero per group) and of int4's
// KIVI residual. Branch-free and written for `omp simd`: they run once per decoded row, inside
// the kernel's inner loop. Internal linkage (see vec.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

enum Kind : int32_t { F32 = 0, BF16 = 1, F16 = 2, FP8_E4M3 = 3, FP8_E5M2 = 4, INT8 = 5, INT4 = 6 };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// c ? a : b on bit patterns, written as masks: GCC leaves a `?:` between floats or between
// shifted integers as control flow and then does not vectorize the loop around it.
inline uint32_t pick(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return b ^ ((a ^ b) & mask);
}

// IEEE half -> float without branches and without producing a float denormal (subnormal halves
// are an integer times 2^-24, converted exactly; FTZ/DAZ cannot touch them).
inline float f16_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t u = (em << 13) + (112u << 23);
  u = pick(em >= 0x7c00u, u + (112u << 23), u);  // inf / nan: exponent 255
  const uint32_t sub = float_to_bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return bits_to_float(pick(em < 0x400u, sub, u) | sign);
}

// fp8 e4m3fn (bias 7, no inf; 0x7f/0xff are NaN, never stored: quantize_fp8 saturates).
inline float e4m3_to_float(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;
  const uint32_t normal = (em << 20) + (120u << 23);
  const uint32_t sub = float_to_bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-9f);
  return bits_to_float(pick(em < 8u, sub, normal) | sign);
}

// fp8 e5m2 is the top byte of an IEEE half.
inline float e5m2_to_float(uint32_t c) { return f16_to_float(c << 8); }

// One token row of D values (one KV head) of a float-type cache into buf, or a pointer into
// the cache itself for float32.
template <int K>
inline const float* float_row(const void* base, int64_t offset, int64_t D, float* buf) {
  if constexpr (K == F32) {
    return static_cast<const float*>(base) + offset;
  } else if constexpr (K == BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buf[d] = bf16_to_float(p[d]);
    return buf;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buf[d] = f16_to_float(p[d]);
    return buf;
  }
}

// One token row of an element-wise format (float32, bfloat16, float16, fp8) as D floats: a
// pointer into the cache for float32, else the row decoded into buf.
template <int K>
inline const float* elementwise_row(const void* base, int64_t offset, int64_t D, float* buf) {
  if constexpr (K == FP8_E4M3 || K == FP8_E5M2) {
    const uint8_t* c = static_cast<const uint8_t*>(base) + offset;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d)
      buf[d] = K == FP8_E4M3 ? e4m3_to_float(c[d]) : e5m2_to_float(c[d]);
    return buf;
  } else {
    return float_row<K>(base, offset, D, buf);
  }
}

inline const float* residual_row(int32_t kind, const void* base, int64_t offset, int64_t D,
                                 float* buf) {
  if (kind == F32) return float_row<F32>(base, offset, D, buf);
  if (kind == BF16) return float_row<BF16>(base, offset, D, buf);
  return float_row<F16>(base, offset, D, buf);
}

// Affine codes of one token row, `groups` groups of D / groups channels, each with an fp16
// (scale, zero) pair: x = code * scale + zero (kv/quant.py's quantize_affine). Packed (int4)
// rows come out in the nibble order (see `nibble_order`): byte i's low nibble at i, its high
// one at D / 2 + i.
template <bool Packed>
inline void affine_row(const uint8_t* codes, const uint16_t* sz, int64_t D, int64_t groups,
                       float* buf) {
  const int64_t width = D / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = f16_to_float(sz[2 * g]);
    const float z = f16_to_float(sz[2 * g + 1]);
    if constexpr (Packed) {
      const int64_t at = g * width / 2;
      const uint8_t* c = codes + at;
      float* lo = buf + at;
      float* hi = buf + D / 2 + at;
#pragma omp simd
      for (int64_t i = 0; i < width / 2; ++i) {
        lo[i] = static_cast<float>(c[i] & 0x0f) * s + z;
        hi[i] = static_cast<float>(c[i] >> 4) * s + z;
      }
    } else {
      const uint8_t* c = codes + g * width;
      float* o = buf + g * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) o[d] = static_cast<float>(c[d]) * s + z;
    }
  }
}

// int4 rows are decoded in nibble order, channel d at nibble_order(d): the even channels (low
// nibbles) first, then the odd ones, so that unpacking writes two contiguous runs instead of
// interleaving (which does not vectorize). A dot product does not care about the order as long
// as q is in the same one, and the value accumulator is put back in channel order at the end.
inline int64_t nibble_order(int64_t d, int64_t D) { return d % 2 == 0 ? d / 2 : D / 2 + d / 2; }

}  // namespace
