// Row tiles: the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) repacked at load into
// tiles of 16 output features (issue 31's batched path; the K-quants' in qtiles_k.h).
// Included by qgemv.cpp (its QRows, block sizes and thread pool); the same bytes as the
// file's rows, in another order.
//
// Why: in the file's layout a block is 32 values of one output feature, so an integer dot
// product gives one int32 per (x row, feature, block), and each one needs its own
// conversion and scale: at 32 rows the 256-bit VNNI kernel ran 110-147 GOPS, a quarter of
// the CPU's dpbusd rate, its time in the per-block conversions, not the products. In a tile
// the 16 features' values for 4 neighbouring k sit side by side (64 bytes, one zmm), so one
// `dpbusd` against x's 4 bytes broadcast (a memory operand) adds 4 products to each of 16
// features: 8 of them cover a block, then one conversion and two FMAs scale 16 features.
// llama.cpp's AVX-512 path repacks Q4_0 / Q8_0 into interleaved rows for the same reason;
// the layout here is our own (16 features x 4 bytes, nibbles split low / high).
//
// A tile block (16 features x 32 values of block b; tile t is rows 16t .. 16t + 15 of the
// weight, so it is the 16 rows' bytes, contiguous, blocks in order):
//   d[16] f16 | m[16] f16 (Q4_1, Q5_1) | qh[16] u32 (Q5_0, Q5_1) | values
// values, per group g of 4 k (k = 4g .. 4g + 3) and feature c, 4 bytes at (g * 16 + c) * 4:
//   Q8_0: q ^ 0x80 (unsigned: dpbusd multiplies unsigned by signed, and x is the signed,
//         broadcast operand; sum (q + 128) x = sum q x + 128 sum x, so 128 s is taken off);
//   nibble types: 4 x 64 bytes, load j's low nibbles are group j, its high nibbles group
//         j + 4 (the file's byte 4j + i of a block holds elements 4j + i and 16 + 4j + i: the
//         repack moves bytes, never splits them);
//   qh (Q5): bit 8i + g = the fifth bit of element 4g + i, so group g's fifth bits are one
//         shift and one mask of the 16 features' words (bit g of each byte, moved to 0x10).
#pragma once

constexpr int kTileCols = 16;
constexpr int kTiledCode = 8;  // a tiled weight's type code = its block type's code + 8

inline bool tileable(int t) {
  return t == kQ8_0 || t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || is_k(t);
}
constexpr bool has_min(int t) { return t == kQ4_1 || t == kQ5_1; }
// byte offsets in a tile block
inline int tile_m_off() { return 32; }
inline int tile_qh_off(int t) { return has_min(t) ? 64 : 32; }
inline int tile_qs_off(int t) { return 32 + (has_min(t) ? 32 : 0) + (is_q5(t) ? 64 : 0); }
inline int64_t tile_block_bytes(int t) { return kTileCols * block_bytes(t); }

// The integer code of element e (0..31) of feature c in a tile block: Q8_0's signed q, the
// nibble types' 0..15 (Q5: 0..31).
inline int tile_code(const uint8_t* blk, int t, int c, int e) {
  const int g = e % 16 / 4, i = e % 4;
  const uint8_t* qs = blk + tile_qs_off(t);
  if (t == kQ8_0) return static_cast<int8_t>(qs[((e / 4) * kTileCols + c) * 4 + i] ^ 0x80);
  const uint8_t byte = qs[(g * kTileCols + c) * 4 + i];
  int v = e < 16 ? (byte & 0x0f) : (byte >> 4);
  if (is_q5(t)) {
    uint32_t qh;
    std::memcpy(&qh, blk + tile_qh_off(t) + 4 * c, 4);
    v |= static_cast<int>((qh >> (8 * i + e / 4)) & 1u) << 4;
  }
  return v;
}

// The n x k weight's rows (the file's layout) as tiles into dst (n a multiple of 16).
template <int T>
void pack_tiles(const uint8_t* src, int64_t n, int64_t k, uint8_t* dst) {
  const int64_t nb = k / kQK, bb = block_bytes(T), rb = nb * bb, tb = tile_block_bytes(T);
  for (int64_t t = 0; t < n / kTileCols; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = dst + (t * nb + b) * tb;
      for (int c = 0; c < kTileCols; ++c) {
        const uint8_t* blk = src + (t * kTileCols + c) * rb + b * bb;
        std::memcpy(out + 2 * c, blk, 2);
        if (has_min(T)) std::memcpy(out + tile_m_off() + 2 * c, blk + 2, 2);
        const int off = has_min(T) ? 4 : 2;  // the file's qh (Q5) or values
        uint8_t* qs = out + tile_qs_off(T);
        if (T == kQ8_0) {
          for (int e = 0; e < kQK; ++e)
            qs[((e / 4) * kTileCols + c) * 4 + e % 4] = blk[2 + e] ^ 0x80;
          continue;
        }
        const uint8_t* nib = blk + off + (is_q5(T) ? 4 : 0);
        for (int e = 0; e < 16; ++e) qs[((e / 4) * kTileCols + c) * 4 + e % 4] = nib[e];
        if (is_q5(T)) {
          uint32_t qh, packed = 0;
          std::memcpy(&qh, blk + off, 4);
          for (int e = 0; e < kQK; ++e)
            packed |= ((qh >> e) & 1u) << (8 * (e % 4) + e / 4);
          std::memcpy(out + tile_qh_off(T) + 4 * c, &packed, 4);
        }
      }
    }
}

// The inverse of pack_tiles: the tiles back in the file's rows.
template <int T>
void unpack_tiles(const uint8_t* src, int64_t n, int64_t k, uint8_t* dst) {
  const int64_t nb = k / kQK, bb = block_bytes(T), rb = nb * bb, tb = tile_block_bytes(T);
  for (int64_t t = 0; t < n / kTileCols; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* in = src + (t * nb + b) * tb;
      for (int c = 0; c < kTileCols; ++c) {
        uint8_t* blk = dst + (t * kTileCols + c) * rb + b * bb;
        std::memcpy(blk, in + 2 * c, 2);
        if (has_min(T)) std::memcpy(blk + 2, in + tile_m_off() + 2 * c, 2);
        const int off = has_min(T) ? 4 : 2;
        const uint8_t* qs = in + tile_qs_off(T);
        if (T == kQ8_0) {
          for (int e = 0; e < kQK; ++e)
            blk[2 + e] = qs[((e / 4) * kTileCols + c) * 4 + e % 4] ^ 0x80;
          continue;
        }
        uint8_t* nib = blk + off + (is_q5(T) ? 4 : 0);
        for (int e = 0; e < 16; ++e) nib[e] = qs[((e / 4) * kTileCols + c) * 4 + e % 4];
        if (is_q5(T)) {
          uint32_t packed, qh = 0;
          std::memcpy(&packed, in + tile_qh_off(T) + 4 * c, 4);
          for (int e = 0; e < kQK; ++e)
            qh |= ((packed >> (8 * (e % 4) + e / 4)) & 1u) << e;
          std::memcpy(blk + off, &qh, 4);
        }
      }
    }
}

// Feature `row` of a tiled weight as float32 (gguf.quants' values, as dequant_row).
template <int T>
void dequant_tile_row(const uint8_t* w, int64_t k, int64_t row, float* y) {
  const int64_t nb = k / kQK, tb = tile_block_bytes(T);
  const int c = static_cast<int>(row % kTileCols);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + (row / kTileCols * nb + b) * tb;
    const float d = half_to_float(blk + 2 * c);
    const float m = has_min(T) ? half_to_float(blk + tile_m_off() + 2 * c) : 0.f;
    for (int e = 0; e < kQK; ++e) {
      const int q = tile_code(blk, T, c, e);
      float v;
      if (T == kQ8_0) v = d * static_cast<float>(q);
      else if (T == kQ4_0) v = d * static_cast<float>(q - 8);
      else if (T == kQ5_0) v = d * static_cast<float>(q - 16);
      else v = d * static_cast<float>(q) + m;
      y[b * kQK + e] = v;
    }
  }
}

// What a block's integer sum is off by, per unit of x's s = dx sum(q_x): Q4_0 - 8, Q5_0 - 16,
// Q8_0 - 128 where the values are stored plus 128 and multiplied as such (dpbusd).
template <int T>
constexpr float tile_offset(bool shifted) {
  return T == kQ4_0 ? -8.f : T == kQ5_0 ? -16.f : (T == kQ8_0 && shifted) ? -128.f : 0.f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVQ_TILE512 1
// f[r] += the 16 features' dots with x row r0 + r over block b (R rows).
template <int T, int R>
inline void tile_block512(const uint8_t* blk, const QRows& x, int64_t r0, int64_t b, __m512* f) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  const uint8_t* qs = blk + tile_qs_off(T);
  const int32_t* xg[R];
  for (int r = 0; r < R; ++r)
    xg[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + b * kQK);
  auto dot_group = [&](__m512i w, int g) {
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(xg[r][g]));
  };
  if constexpr (T == kQ8_0) {
    for (int g = 0; g < 8; ++g) dot_group(_mm512_loadu_si512(qs + 64 * g), g);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i qh = _mm512_setzero_si512();
    if constexpr (is_q5(T)) qh = _mm512_loadu_si512(blk + tile_qh_off(T));
    const __m512i bit5 = _mm512_set1_epi8(0x10);
    for (int j = 0; j < 4; ++j) {
      const __m512i nib = _mm512_loadu_si512(qs + 64 * j);
      __m512i lo = _mm512_and_si512(nib, low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
      if constexpr (is_q5(T)) {  // group j's bits at bit j of each byte, group j + 4's at j + 4
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(qh, 4 - j), bit5));
        hi = _mm512_or_si512(hi, j == 0 ? _mm512_and_si512(qh, bit5)
                                        : _mm512_and_si512(_mm512_srli_epi32(qh, j), bit5));
      }
      dot_group(lo, j);
      dot_group(hi, j + 4);
    }
  }
  const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  __m512 mw = _mm512_setzero_ps();
  if constexpr (has_min(T))
    mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  constexpr float off = tile_offset<T>(true);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * x.nb + b;
    __m512 t = _mm512_cvtepi32_ps(acc[r]);
    if constexpr (off != 0.f)
      t = _mm512_fmadd_ps(t, _mm512_set1_ps(x.d[at]), _mm512_set1_ps(off * x.s[at]));
    else
      t = _mm512_mul_ps(t, _mm512_set1_ps(x.d[at]));
    f[r] = _mm512_fmadd_ps(dw, t, f[r]);
    if constexpr (has_min(T)) f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[at]), f[r]);
  }
}

// The 16 features of tile `tile` against rows r0 .. r0 + R - 1: out[r][0..16)
template <int T, int R>
inline void tile_rows(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0, float* out) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  const int64_t tb = tile_block_bytes(T);
  const uint8_t* base = w + tile * x.nb * tb;
  for (int64_t b = 0; b < x.nb; ++b) {
    if (R <= 4 && b + 4 < x.nb) {  // decode: the next blocks from memory
      const uint8_t* ahead = base + (b + 4) * tb;
      for (int64_t at = 0; at < tb; at += 64) __builtin_prefetch(ahead + at);
    }
    tile_block512<T, R>(base + b * tb, x, r0, b, f);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kTileCols, f[r]);
}
#endif

#include "qtiles_avx2.h"

// The LM head's path (kvserve_qgemv_f32x on Q8_0 tiles): x in 16-bit blocks of 32 (scale
// amax / 32767: every value within 1.5e-5 of its block's largest, where 8-bit x had moved
// the logits enough to change a greedy answer), the weight's bytes widened to int16 in
// registers, `vpdpwssd` (2 products per int32 lane; half dpbusd's rate, still twice the
// float FMA's). A 64-byte group (16 features x 4 k) widens to two zmm of 8 features, each
// feature in two lanes (k 0-1, k 2-3) against x's 4 values broadcast as one qword.
struct X16 {  // the 16-bit rows of x: q[rows * k], d[rows * nb]
  const int16_t* q;
  const float* d;
  int64_t k, nb;
};

inline void quantize_row16(const float* x, int64_t k, int16_t* q, float* d) {
  for (int64_t b = 0; b < k / kQK; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.f;
    for (int i = 0; i < kQK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float db = amax / 32767.f, id = db > 0.f ? 1.f / db : 0.f;
    for (int i = 0; i < kQK; ++i) q[b * kQK + i] = static_cast<int16_t>(std::nearbyint(xb[i] * id));
    d[b] = db;
  }
}

#ifdef KVQ_TILE512
template <int R>
inline void tile_rows16(const uint8_t* w, const X16& x, int64_t tile, int64_t r0, float* out) {
  __m512 fa[R], fb[R];
  for (int r = 0; r < R; ++r) fa[r] = fb[r] = _mm512_setzero_ps();
  const int64_t tb = tile_block_bytes(kQ8_0);
  const uint8_t* base = w + tile * x.nb * tb;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i dup_a = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i dup_b = _mm512_add_epi32(dup_a, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = base + b * tb;
    if (R <= 4 && b + 4 < x.nb) {
      const uint8_t* ahead = blk + 4 * tb;
      for (int64_t at = 0; at < tb; at += 64) __builtin_prefetch(ahead + at);
    }
    __m512i ia[R], ib[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(blk + 32 + 64 * g), flip);
      const __m512i wa = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(q));
      const __m512i wb = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(q, 1));
      for (int r = 0; r < R; ++r) {
        int64_t four;
        std::memcpy(&four, x.q + (r0 + r) * x.k + b * kQK + 4 * g, 8);
        const __m512i xb = _mm512_set1_epi64(four);
        ia[r] = _mm512_dpwssd_epi32(ia[r], wa, xb);
        ib[r] = _mm512_dpwssd_epi32(ib[r], wb, xb);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 da = _mm512_permutexvar_ps(dup_a, dw), db = _mm512_permutexvar_ps(dup_b, dw);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * x.nb + b]);
      fa[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia[r]), dx), da, fa[r]);
      fb[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ib[r]), dx), db, fb[r]);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(fa[r], even, fb[r]),
                                     _mm512_permutex2var_ps(fa[r], odd, fb[r]));
    _mm512_storeu_ps(out + r * kTileCols, sum);
  }
}
#endif

template <int R>
inline void tile_rows16_any(const uint8_t* w, const X16& x, int64_t tile, int64_t r0, float* out) {
#ifdef KVQ_TILE512
  tile_rows16<R>(w, x, tile, r0, out);
#else
  const int64_t tb = tile_block_bytes(kQ8_0);
  for (int r = 0; r < R * kTileCols; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = w + (tile * x.nb + b) * tb;
    for (int c = 0; c < kTileCols; ++c) {
      const float d = half_to_float(blk + 2 * c);
      for (int r = 0; r < R; ++r) {
        const int16_t* xq = x.q + (r0 + r) * x.k + b * kQK;
        int sum = 0;
        for (int e = 0; e < kQK; ++e) sum += tile_code(blk, kQ8_0, c, e) * xq[e];
        out[r * kTileCols + c] += static_cast<float>(sum) * x.d[(r0 + r) * x.nb + b] * d;
      }
    }
  }
#endif
}

constexpr int kTileRows16 = 6;

// out[r, :n] = x[r] W^T + b (mode 0) or += (mode 1) on Q8_0 tiles, x in 16-bit blocks.
inline void tile_gemv16(const float* xf, int64_t x_stride, int64_t rows, const uint8_t* w,
                        int64_t n, int64_t k, const float* bias, float* out, int64_t out_stride,
                        int mode, int num_threads) {
  const int64_t nb = k / kQK;
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> d;
  q.resize(static_cast<size_t>(rows * k));
  d.resize(static_cast<size_t>(rows * nb));
  for (int64_t r = 0; r < rows; ++r)
    quantize_row16(xf + r * x_stride, k, q.data() + r * k, d.data() + r * nb);
  const X16 x{q.data(), d.data(), k, nb};
  const int64_t tiles = n / kTileCols, per_unit = kDecodeTile / kTileCols;
  kvpar::parallel_for((tiles + per_unit - 1) / per_unit, num_threads, [&](int64_t unit) {
    alignas(64) float acc[kTileRows16 * kTileCols];
    for (int64_t t = unit * per_unit; t < tiles && t < (unit + 1) * per_unit; ++t)
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows16) {
        const int64_t cnt = rows - r0 < kTileRows16 ? rows - r0 : kTileRows16;
        switch (cnt) {
          case 6: tile_rows16_any<6>(w, x, t, r0, acc); break;
          case 5: tile_rows16_any<5>(w, x, t, r0, acc); break;
          case 4: tile_rows16_any<4>(w, x, t, r0, acc); break;
          case 3: tile_rows16_any<3>(w, x, t, r0, acc); break;
          case 2: tile_rows16_any<2>(w, x, t, r0, acc); break;
          default: tile_rows16_any<1>(w, x, t, r0, acc); break;
        }
        for (int64_t r = 0; r < cnt; ++r) {
          float* y = out + (r0 + r) * out_stride + t * kTileCols;
          for (int c = 0; c < kTileCols; ++c) {
            const float b = bias != nullptr ? bias[t * kTileCols + c] : 0.f;
            const float v = acc[r * kTileCols + c] + b;
            y[c] = mode == 0 ? v : y[c] + v;
          }
        }
      }
  });
}

// The plain path: a CPU without AVX2 (AVX2 builds run qtiles_avx2.h; which types the loader
// tiles on each build: kvserve_qtile_types, qgemv.QGemv.tiles_pay).
template <int T, int R>
inline void tile_rows_plain(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0,
                            float* out) {
  const int64_t tb = tile_block_bytes(T);
  constexpr float off = tile_offset<T>(false);
  for (int r = 0; r < R * kTileCols; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = w + (tile * x.nb + b) * tb;
    for (int c = 0; c < kTileCols; ++c) {
      int code[kQK];
      for (int e = 0; e < kQK; ++e) code[e] = tile_code(blk, T, c, e);
      const float d = half_to_float(blk + 2 * c);
      const float m = has_min(T) ? half_to_float(blk + tile_m_off() + 2 * c) : 0.f;
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.nb + b;
        const int8_t* xq = x.q + (r0 + r) * x.k + b * kQK;
        int sum = 0;
        for (int e = 0; e < kQK; ++e) sum += code[e] * xq[e];
        out[r * kTileCols + c] +=
            d * (static_cast<float>(sum) * x.d[at] + off * x.s[at]) + m * x.s[at];
      }
    }
  }
}

#include "qtiles_k.h"

template <int T, int R>
inline void tile_rows_any(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0,
                          float* out) {
  if constexpr (is_k(T)) {
    k_tile_rows<T, R>(w, x, tile, r0, out);
  } else {
#if defined(KVQ_TILE512)
    tile_rows<T, R>(w, x, tile, r0, out);
#elif defined(KVQ_TILE256)
    tile_rows256<T, R>(w, x, tile, r0, out);
#else
    tile_rows_plain<T, R>(w, x, tile, r0, out);
#endif
  }
}

constexpr int kTileRows = 8;  // x rows per register tile (2 x 8 zmm accumulators)

template <int T>
inline void tile_chunk(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0, int64_t cnt,
                       float* out) {
  switch (cnt) {
    case 8: tile_rows_any<T, 8>(w, x, tile, r0, out); break;
    case 7: tile_rows_any<T, 7>(w, x, tile, r0, out); break;
    case 6: tile_rows_any<T, 6>(w, x, tile, r0, out); break;
    case 5: tile_rows_any<T, 5>(w, x, tile, r0, out); break;
    case 4: tile_rows_any<T, 4>(w, x, tile, r0, out); break;
    case 3: tile_rows_any<T, 3>(w, x, tile, r0, out); break;
    case 2: tile_rows_any<T, 2>(w, x, tile, r0, out); break;
    default: tile_rows_any<T, 1>(w, x, tile, r0, out); break;
  }
}

// The bias, residual add or gated activation of a register tile's cnt x 16 sums (acc; up:
// the up half's) into out's rows, kLanes outputs a vector op: one output at a time (the
// scalar std::exp of SiLU, a branch on the mode) was ~10% of a 512-row gate | up projection.
inline void tile_epilogue(const float* acc, const float* up, int64_t cnt, const float* bias,
                          int64_t n, int64_t t, float* out, int64_t out_stride, int mode) {
  static_assert(kTileCols % kLanes == 0, "a tile's outputs are whole vectors");
  const int64_t o0 = t * kTileCols;
  for (int64_t r = 0; r < cnt; ++r) {
    float* y = out + r * out_stride + o0;
    for (int c = 0; c < kTileCols; c += kLanes) {
      vf v = loadv(acc + r * kTileCols + c);
      if (bias != nullptr) v += loadv(bias + o0 + c);
      if (mode == 0) {
        storev(y + c, v);
      } else if (mode == 1) {
        storev(y + c, loadv(y + c) + v);
      } else {
        vf u = loadv(up + r * kTileCols + c);
        if (bias != nullptr) u += loadv(bias + n + o0 + c);
        storev(y + c, (mode == 2 ? silu(v) : gelu_tanh(v)) * u);
      }
    }
  }
}

// qgemv_rows on a tiled weight (n a multiple of 16; gated: gate tiles then up tiles).
template <int T>
void tile_gemv(const QRows& x, int64_t rows, const uint8_t* w, const float* bias, int64_t n,
               float* out, int64_t out_stride, int mode, int num_threads) {
  const bool gated = mode >= 2;
  const int64_t tiles = n / kTileCols, xt = x_tile_rows(x.k);
  const int64_t per_unit = rows <= 4 ? kDecodeTile / kTileCols : 1;  // tiles per unit
  kvpar::parallel_for((tiles + per_unit - 1) / per_unit, num_threads, [&](int64_t unit) {
    alignas(64) float acc[kTileRows * kTileCols], up[kTileRows * kTileCols];
    const int64_t t1 = (unit + 1) * per_unit < tiles ? (unit + 1) * per_unit : tiles;
#if defined(KVQ_TILE512) || defined(KVQ_TILE256)
    // K-quants past one register tile of rows: the unit's one tile (per_unit is 1 here)
    // decoded once for all rows (qtiles_k.h's KCodes)
    const bool decoded = is_k(T) && rows > kTileRows;
    KCodes codes[2];
    if constexpr (is_k(T)) {
      for (int part = 0; decoded && part < (gated ? 2 : 1); ++part) {
        codes[part] = k_codes_buffer(part, x.k);
        k_decode_tile<T>(w, x.k, unit + part * tiles, codes[part]);
      }
    }
#endif
    for (int64_t x0 = 0; x0 < rows; x0 += xt) {
      const int64_t x1 = x0 + xt < rows ? x0 + xt : rows;
      for (int64_t t = unit * per_unit; t < t1; ++t) {
        for (int64_t r0 = x0; r0 < x1; r0 += kTileRows) {
          const int64_t cnt = x1 - r0 < kTileRows ? x1 - r0 : kTileRows;
#if defined(KVQ_TILE512) || defined(KVQ_TILE256)
          if constexpr (is_k(T)) {
            if (decoded) {
              k_codes_chunk<T>(codes[0], x, r0, cnt, acc);
              if (gated) k_codes_chunk<T>(codes[1], x, r0, cnt, up);
              tile_epilogue(acc, up, cnt, bias, n, t, out + r0 * out_stride, out_stride, mode);
              continue;
            }
          }
#endif
          tile_chunk<T>(w, x, t, r0, cnt, acc);
          if (gated) tile_chunk<T>(w, x, t + tiles, r0, cnt, up);
          tile_epilogue(acc, up, cnt, bias, n, t, out + r0 * out_stride, out_stride, mode);
        }
      }
    }
  });
}
