// Row tiles for the K-quants (Q4_K, Q6_K): the super-blocks of 16 output features repacked at
// load, as qtiles.h does for the 32-value types. Included by qtiles.h (its tile layout names,
// QRows, the K-quants' scale helpers of qgemv_kquants.h).
//
// Why: in the file's layout the row kernel ran ~108 GOPS on SmolLM2's Q4_K / Q6_K ffn_down at
// 32 rows against ~340 for the Q5_0 tiles beside them (a Q4_K_M file's other projections), so
// at batch 32 the down projections were half of a step's matrix time.
//
// A tile super-block is the 16 features' super-blocks b (tile t = rows 16t .. 16t + 15, each
// row's super-blocks in order), the same bytes moved (the file's 6-bit Q4_K scales stay
// packed; the kernel unpacks them for 16 features at once):
//   Q4_K (2304 bytes): d[16] f16 | dmin[16] f16 | byte i (0..11) of feature c's packed scales
//     at 64 + 16 i + c | nibbles: for pair p (0..3: sub-blocks 2p, 2p + 1) and group g (0..7),
//     feature c's file bytes qs[32p + 4g .. + 3] at 256 + 512 p + (16 g + c) 4: their low
//     nibbles are values 4g .. 4g + 3 of sub-block 2p, their high ones of sub-block 2p + 1;
//   Q6_K (3360 bytes): d[16] f16 | scale i (0..15) of feature c at 32 + 16 i + c | ql: for
//     half h (0..1), q (0..1) and group g, feature c's file bytes ql[64h + 32q + 4g .. + 3] at
//     288 + ((2h + q) 8 + g) 64 + 4c (low nibbles: value 32 s + 4g .. of half h for s = q, high
//     nibbles for s = q + 2) | qh: for h and g, feature c's qh[32h + 4g .. + 3] at
//     2336 + (8h + g) 64 + 4c (bits 2s, 2s + 1: the code's fifth and sixth bits for s).
// So one 64-byte load is 4 neighbouring values of 16 features, one `dpbusd` against x's 4
// bytes broadcast, as in qtiles.h. Q6_K's scales cover 16 values and x's blocks 32: the two
// halves of an x block are accumulated apart, and q - 32 needs the sum of x's first half,
// computed once a call (QRows.h).
#pragma once

// f(file offset in a feature's super-block, tile offset, bytes) for feature c's pieces.
template <int T, class F>
inline void for_each_k_piece(int c, F f) {
  if constexpr (T == kQ4_K) {
    f(0, 2 * c, 2);
    f(2, 32 + 2 * c, 2);
    for (int i = 0; i < 12; ++i) f(4 + i, 64 + 16 * i + c, 1);
    for (int p = 0; p < 4; ++p)
      for (int g = 0; g < 8; ++g) f(16 + 32 * p + 4 * g, 256 + 512 * p + (16 * g + c) * 4, 4);
  } else {
    f(208, 2 * c, 2);
    for (int i = 0; i < 16; ++i) f(192 + i, 32 + 16 * i + c, 1);
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 8; ++g) {
        for (int q = 0; q < 2; ++q)
          f(64 * h + 32 * q + 4 * g, 288 + ((2 * h + q) * 8 + g) * 64 + 4 * c, 4);
        f(128 + 32 * h + 4 * g, 2336 + (8 * h + g) * 64 + 4 * c, 4);
      }
  }
}

// f(offset in feature `row`'s row of the file's layout, offset in the tiled weight, bytes)
// for every piece of that feature's super-blocks.
template <int T, class F>
inline void for_each_row_piece(int64_t k, int64_t row, F f) {
  const int64_t nb = k / kQKK, tb = tile_block_bytes(T), bb = block_bytes(T);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t tile = (row / kTileCols * nb + b) * tb;
    for_each_k_piece<T>(static_cast<int>(row % kTileCols), [&](int file, int at, int len) {
      f(b * bb + file, tile + at, len);
    });
  }
}

// Feature `row` of a K-tiled weight in the file's layout (its super-blocks) into out.
template <int T>
void k_tile_row_blocks(const uint8_t* w, int64_t k, int64_t row, uint8_t* out) {
  for_each_row_piece<T>(k, row, [&](int64_t file, int64_t at, int len) {
    std::memcpy(out + file, w + at, len);
  });
}

// The n x k weight's rows as K tiles into dst, and back (qtiles.h's pack_tiles and
// unpack_tiles for the K-quants).
template <int T>
void pack_tiles_k(const uint8_t* src, int64_t n, int64_t k, uint8_t* dst) {
  for (int64_t row = 0; row < n; ++row)
    for_each_row_piece<T>(k, row, [&](int64_t file, int64_t at, int len) {
      std::memcpy(dst + at, src + row * row_bytes_of(T, k) + file, len);
    });
}

template <int T>
void unpack_tiles_k(const uint8_t* src, int64_t n, int64_t k, uint8_t* dst) {
  for (int64_t row = 0; row < n; ++row)
    k_tile_row_blocks<T>(src, k, row, dst + row * row_bytes_of(T, k));
}

// Per row of x and block of 32, dx * the sum of the block's first 16 codes (Q6_K's halves).
inline void half_sums(const QRows& x, int64_t rows, float* h) {
  for (int64_t i = 0; i < rows * x.nb; ++i) {
    int sum = 0;
    for (int e = 0; e < 16; ++e) sum += x.q[i * kQK + e];
    h[i] = x.d[i] * static_cast<float>(sum);
  }
}

#ifdef KVQ_TILE512
inline __m512 bytes_to_ps(__m128i v, bool is_signed) {
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// f[r] += the 16 features' dots with x rows r0.. over Q4_K tile super-block `sb`, whose first
// x block is b8.
template <int R>
inline void q4k_super512(const uint8_t* sb, const QRows& x, int64_t r0, int64_t b8, __m512* f) {
  const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
  const __m512 mv =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
  auto s_row = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * i));
  };
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0f), top = _mm_set1_epi8(0x30);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int p = 0; p < 4; ++p) {
    __m512i lo[R], hi[R];
    const int32_t* xl[R];
    const int32_t* xh[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = hi[r] = _mm512_setzero_si512();
      xl[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + (b8 + 2 * p) * kQK);
      xh[r] = xl[r] + kQK / 4;
    }
    const uint8_t* qs = sb + 256 + 512 * p;
    for (int g = 0; g < 8; ++g) {
      const __m512i nib = _mm512_loadu_si512(qs + 64 * g);
      const __m512i l = _mm512_and_si512(nib, low);
      const __m512i h = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_dpbusd_epi32(lo[r], l, _mm512_set1_epi32(xl[r][g]));
        hi[r] = _mm512_dpbusd_epi32(hi[r], h, _mm512_set1_epi32(xh[r][g]));
      }
    }
    __m512 dsc[2], dm[2];
    for (int s = 0; s < 2; ++s) {  // q4k_scale_min for 16 features
      const int j = 2 * p + s;
      __m128i sc, m;
      if (j < 4) {
        sc = _mm_and_si128(s_row(j), m6);
        m = _mm_and_si128(s_row(j + 4), m6);
      } else {
        sc = _mm_or_si128(_mm_and_si128(s_row(j + 4), m4),
                          _mm_and_si128(_mm_srli_epi16(s_row(j - 4), 2), top));
        m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s_row(j + 4), 4), m4),
                         _mm_and_si128(_mm_srli_epi16(s_row(j), 2), top));
      }
      dsc[s] = _mm512_mul_ps(dv, bytes_to_ps(sc, false));
      dm[s] = _mm512_mul_ps(mv, bytes_to_ps(m, false));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.nb + b8 + 2 * p;
      f[r] = _mm512_fmadd_ps(dsc[0], _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r]),
                                                   _mm512_set1_ps(x.d[at])), f[r]);
      f[r] = _mm512_fnmadd_ps(dm[0], _mm512_set1_ps(x.s[at]), f[r]);
      f[r] = _mm512_fmadd_ps(dsc[1], _mm512_mul_ps(_mm512_cvtepi32_ps(hi[r]),
                                                   _mm512_set1_ps(x.d[at + 1])), f[r]);
      f[r] = _mm512_fnmadd_ps(dm[1], _mm512_set1_ps(x.s[at + 1]), f[r]);
    }
  }
}

// The same over a Q6_K tile super-block: x block b8 + 4h + s is sub-block s of half h.
template <int R>
inline void q6k_super512(const uint8_t* sb, const QRows& x, int64_t r0, int64_t b8, __m512* f) {
  const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
  const __m512i low = _mm512_set1_epi8(0x0f), bits56 = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const int64_t j = 4 * h + s;
      __m512i alo[R], ahi[R];
      const int32_t* xg[R];
      for (int r = 0; r < R; ++r) {
        alo[r] = ahi[r] = _mm512_setzero_si512();
        xg[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + (b8 + j) * kQK);
      }
      const uint8_t* ql = sb + 288 + (2 * h + (s & 1)) * 8 * 64;
      const uint8_t* qh = sb + 2336 + 8 * h * 64;
      for (int g = 0; g < 8; ++g) {
        const __m512i q = _mm512_loadu_si512(ql + 64 * g);
        const __m512i nib = s < 2 ? _mm512_and_si512(q, low)
                                  : _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
        const __m512i c = _mm512_loadu_si512(qh + 64 * g);
        __m512i hb;  // bits 2s, 2s + 1 of each byte at bits 4, 5
        if (s == 0) hb = _mm512_slli_epi16(c, 4);
        else if (s == 1) hb = _mm512_slli_epi16(c, 2);
        else if (s == 2) hb = c;
        else hb = _mm512_srli_epi16(c, 2);
        const __m512i code = _mm512_or_si512(nib, _mm512_and_si512(hb, bits56));
        for (int r = 0; r < R; ++r) {
          __m512i& acc = g < 4 ? alo[r] : ahi[r];
          acc = _mm512_dpbusd_epi32(acc, code, _mm512_set1_epi32(xg[r][g]));
        }
      }
      const __m128i* scales = reinterpret_cast<const __m128i*>(sb + 32);
      const __m512 lo_sc = _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j), true));
      const __m512 hi_sc =
          _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j + 1), true));
      for (int r = 0; r < R; ++r) {  // q - 32: minus 32 times each half's sum of x
        const int64_t at = (r0 + r) * x.nb + b8 + j;
        const __m512 dx = _mm512_set1_ps(x.d[at]);
        const __m512 first = _mm512_set1_ps(-32.f * x.h[at]);
        const __m512 second = _mm512_set1_ps(-32.f * (x.s[at] - x.h[at]));
        f[r] = _mm512_fmadd_ps(lo_sc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(alo[r]), dx, first),
                               f[r]);
        f[r] = _mm512_fmadd_ps(hi_sc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ahi[r]), dx, second),
                               f[r]);
      }
    }
}
#endif

// The 16 features of K tile `tile` against x rows r0 .. r0 + R - 1: out[r][0..16).
template <int T, int R>
inline void k_tile_rows(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0, float* out) {
  const int64_t nsb = x.nb / 8, tb = tile_block_bytes(T);
  const uint8_t* base = w + tile * nsb * tb;
#ifdef KVQ_TILE512
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    if (R <= 4 && b + 1 < nsb) {  // decode: the next super-block from memory
      const uint8_t* ahead = base + (b + 1) * tb;
      for (int64_t at = 0; at < tb; at += 64) __builtin_prefetch(ahead + at);
    }
    if constexpr (T == kQ4_K) q4k_super512<R>(base + b * tb, x, r0, 8 * b, f);
    else q6k_super512<R>(base + b * tb, x, r0, 8 * b, f);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kTileCols, f[r]);
#else
  // other builds: each feature's row back in the file's layout, then the row kernel
  thread_local std::vector<uint8_t> row;
  row.resize(static_cast<size_t>(row_bytes_of(T, x.k)));
  for (int c = 0; c < kTileCols; ++c) {
    k_tile_row_blocks<T>(w, x.k, tile * kTileCols + c, row.data());
    for (int64_t r = 0; r < R; r += 4) {
      float acc[4];
      const int64_t cnt = R - r < 4 ? R - r : 4;
      chunk_dots<T>(row.data(), x, r0 + r, cnt, acc);
      for (int64_t i = 0; i < cnt; ++i) out[(r + i) * kTileCols + c] = acc[i];
    }
  }
#endif
}
