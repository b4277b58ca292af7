// K-quant row tiles on AVX2 without AVX-512 VNNI (issue 48): qtiles_k.h's decoded codes (KCodes)
// made with 256-bit code, then the rows run on them with qtiles_avx2.h's maddubs dots.
// Included by qtiles_k.h (KCodes, the tile layout) after qtiles_avx2.h (Dots256, in_passes).
//
// Why decoded past kDirectRows rows: the inline super-block kernels of qtiles_k.h are AVX-512
// code; decoded, one super-block's codes (4 KiB) and scales sit in L1 for every row of x, and
// the bit work (Q5_K's fifth bits, Q6_K's high bits) is done once a call, not once a pass of
// kRows256 rows. A prefill decodes a whole tile once (tile_gemv's KCodes buffer), 5-8 rows one
// super-block at a time (k_tile_rows256). A decode's 1-4 rows of Q4_K run the direct kernel
// (q4k_direct256: the codes never written); Q6_K's and Q5_K's stay on the decoded codes (Q6_K:
// 1.4-1.75x its rows from DRAM already, 2048 x 8192 and 2048 x 2048, one thread).
#pragma once

#ifdef KVQ_TILE256
// The 16 features' packed Q4_K / Q5_K 6-bit scale (sc) and min (m) of sub-block j as bytes
// (byte i of feature c at 64 + 16 i + c: qtiles_k.h's k4_scales512, 16 features at once).
inline void k4_scale_bytes(const uint8_t* sb, int j, __m128i* sc, __m128i* m) {
  auto s_row = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * i));
  };
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0f), top = _mm_set1_epi8(0x30);
  if (j < 4) {
    *sc = _mm_and_si128(s_row(j), m6);
    *m = _mm_and_si128(s_row(j + 4), m6);
  } else {
    *sc = _mm_or_si128(_mm_and_si128(s_row(j + 4), m4),
                       _mm_and_si128(_mm_srli_epi16(s_row(j - 4), 2), top));
    *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s_row(j + 4), 4), m4),
                      _mm_and_si128(_mm_srli_epi16(s_row(j), 2), top));
  }
}

// out[0..16) = the 16 features' d (dv: two halves of 8) times their bytes v (signed or not).
inline void scaled_bytes(const __m256* dv, __m128i v, bool is_signed, float* out) {
  for (int h = 0; h < 2; ++h) {
    const __m128i part = h == 0 ? v : _mm_srli_si128(v, 8);
    const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(dv[h], _mm256_cvtepi32_ps(wide)));
  }
}

// qh shifted so that its bit j lies at bit 4 of each byte, masked (Q5_K's fifth bits; j <= 7:
// a shift within 16 bits by at most 4 never moves a neighbour byte's bit there).
inline __m256i fifth_bit256(__m256i qh, int j) {
  return _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4),
                          _mm256_set1_epi8(0x10));
}

// Tile super-block sb decoded into q (sub-block j's group g at (8j + g) 64: qtiles_k.h's
// KCodes layout) and sc (sub-block j's two vectors of 16 floats at 32 j).
template <int T>
void k_decode_super256(const uint8_t* sb, uint8_t* q, float* sc) {
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  auto put = [&](int j, int g, int h, __m256i v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (8 * j + g) * 64 + 32 * h), v);
  };
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256 dv[2] = {ph8_to_ps(sb), ph8_to_ps(sb + 16)};
  if constexpr (T == kQ6_K) {
    for (int j = 0; j < 16; ++j)  // scale j (16 values) of the 16 features
      scaled_bytes(dv, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * j)),
                   true, sc + 16 * j);
    const __m256i top = _mm256_set1_epi8(0x30);
    auto code = [&](__m256i nib, __m256i high) {  // 4 bits of nib | bits 4, 5 of high
      return _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_and_si256(high, top));
    };
    for (int half = 0; half < 2; ++half)
      for (int g = 0; g < 8; ++g)
        for (int h = 0; h < 2; ++h) {
          const uint8_t* chunk = sb + 288 + (8 * half + g) * 192 + 32 * h;
          const __m256i q0 = load(chunk), q1 = load(chunk + 64), hb = load(chunk + 128);
          put(4 * half, g, h, code(q0, _mm256_slli_epi16(hb, 4)));
          put(4 * half + 1, g, h, code(q1, _mm256_slli_epi16(hb, 2)));
          put(4 * half + 2, g, h, code(_mm256_srli_epi16(q0, 4), hb));
          put(4 * half + 3, g, h, code(_mm256_srli_epi16(q1, 4), _mm256_srli_epi16(hb, 2)));
        }
  } else {
    const __m256 mv[2] = {ph8_to_ps(sb + 32), ph8_to_ps(sb + 48)};
    for (int j = 0; j < 8; ++j) {
      __m128i s, m;
      k4_scale_bytes(sb, j, &s, &m);
      scaled_bytes(dv, s, false, sc + 32 * j);
      scaled_bytes(mv, m, false, sc + 32 * j + 16);
    }
    for (int g = 0; g < 8; ++g)
      for (int p = 0; p < 4; ++p)
        for (int h = 0; h < 2; ++h) {
          const uint8_t* nibs = T == kQ4_K ? sb + 256 + 512 * p + 64 * g + 32 * h
                                           : sb + 256 + 320 * g + 64 * p + 32 * h;
          const __m256i nib = load(nibs);
          __m256i lo = _mm256_and_si256(nib, low);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
          if constexpr (T == kQ5_K) {
            const __m256i qh = load(sb + 256 + 320 * g + 256 + 32 * h);
            lo = _mm256_or_si256(lo, fifth_bit256(qh, 2 * p));
            hi = _mm256_or_si256(hi, fifth_bit256(qh, 2 * p + 1));
          }
          put(2 * p, g, h, lo);
          put(2 * p + 1, g, h, hi);
        }
  }
}

// A whole tile's super-blocks decoded (tile_gemv's prefill path).
template <int T>
void k_decode_tile(const uint8_t* w, int64_t k, int64_t tile, const KCodes& c) {
  const int64_t nsb = k / kQKK, tb = tile_block_bytes(T);
  for (int64_t b = 0; b < nsb; ++b)
    k_decode_super256<T>(w + (tile * nsb + b) * tb, c.q + b * 8 * 8 * 64, c.sc + b * 8 * 32);
}

// f[r] += features 8h .. 8h + 7 of decoded codes q / scales sc (their first sub-block x's
// block j0; nj of them) against x rows r0 .. r0 + R - 1, as qtiles_k.h's k_codes_rows.
template <int T, int R>
__attribute__((always_inline)) inline void k_codes_half256(const uint8_t* q, const float* sc,
                                                           const QRows& x, int64_t r0,
                                                           int64_t j0, int64_t nj, int h,
                                                           __m256* f) {
  constexpr int kHalves = T == kQ6_K ? 2 : 1;
  for (int64_t j = 0; j < nj; ++j) {
    const int32_t* xg[R];
    for (int r = 0; r < R; ++r)
      xg[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + (j0 + j) * kQK);
    Dots256<T, R> dots[kHalves];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (8 * j + g) * 64 + 32 * h));
      dots[kHalves == 2 && g >= 4].add(v, xg, g);
    }
    for (auto& d : dots)
      if (d.pending != 0) d.flush();
    const __m256 s0 = _mm256_loadu_ps(sc + 32 * j + 8 * h);
    const __m256 s1 = _mm256_loadu_ps(sc + 32 * j + 16 + 8 * h);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.nb + j0 + j;
      const __m256 dx = _mm256_set1_ps(x.d[at]);
      if constexpr (T == kQ6_K) {  // q - 32: minus 32 times each half's sum of x
        const __m256 first = _mm256_set1_ps(-32.f * x.h[at]);
        const __m256 second = _mm256_set1_ps(-32.f * (x.s[at] - x.h[at]));
        f[r] = _mm256_fmadd_ps(
            s0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[0].acc[r]), dx, first), f[r]);
        f[r] = _mm256_fmadd_ps(
            s1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[kHalves - 1].acc[r]), dx, second),
            f[r]);
      } else {
        f[r] = _mm256_fmadd_ps(s0, _mm256_mul_ps(_mm256_cvtepi32_ps(dots[0].acc[r]), dx), f[r]);
        f[r] = _mm256_fnmadd_ps(s1, _mm256_set1_ps(x.s[at]), f[r]);
      }
    }
  }
}

// sums[h][r] += the codes' (x blocks j0 .. j0 + nj - 1) dots with rows r0 .. r0 + R - 1.
template <int T, int R>
inline void k_codes_add256(const uint8_t* q, const float* sc, const QRows& x, int64_t r0,
                           int64_t j0, int64_t nj, __m256 (*sums)[R]) {
  for (int h = 0; h < 2; ++h)
    in_passes<R>([&](auto rows, int r) {
      k_codes_half256<T, decltype(rows)::value>(q, sc, x, r0 + r, j0, nj, h, sums[h] + r);
    });
}

template <int R>
inline void store_sums256(__m256 (*sums)[R], float* out) {
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kTileCols + 8 * h, sums[h][r]);
}

// out[r][0..16) = the decoded tile's 16 features against x rows r0 .. r0 + R - 1.
template <int T, int R>
void k_codes_rows(const KCodes& c, const QRows& x, int64_t r0, float* out) {
  __m256 sums[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) sums[h][r] = _mm256_setzero_ps();
  k_codes_add256<T, R>(c.q, c.sc, x, r0, 0, x.nb, sums);
  store_sums256<R>(sums, out);
}

// Features 8h .. 8h + 7's bytes of v (unsigned) as floats.
inline __m256 half_bytes_ps(__m128i v, int h) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h == 0 ? v : _mm_srli_si128(v, 8)));
}

// f[i][r] += features 8 (h0 + i) .. + 7 of Q4_K tile super-block sb against x row r0 + r (its
// blocks b8 .. b8 + 7), straight from the nibbles: no codes written (issue 48: at 1-4 rows
// k_decode_super256 took 41% of a decode, more than the dots it fed). Each sub-block's int16
// pair sums (8 groups of 4-bit codes: at most 30480) become its int32 dot by madd, then the
// float steps of k_codes_half256 in its order (d sc_j times dot x.d, minus dmin m_j times x's
// block sum), so a row gives the same bits here as in a call of more rows (the decoded path):
// speculative verification rows must equal the row decoded alone (tests/test_spec_decode.py).
// Not Q5_K: read in this order (a pair of sub-blocks a pass) its 320-byte chunks are walked
// four times, and from DRAM the kernel ran at 0.4-0.7x its rows.
template <int R, int H>
__attribute__((always_inline)) inline void q4k_direct256(const uint8_t* sb, const QRows& x,
                                                         int64_t r0, int64_t b8, int h0,
                                                         __m256 (*f)[R]) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256i lo[H][R], hi[H][R];
  for (int i = 0; i < H; ++i)
    for (int r = 0; r < R; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_si256();
  // sub-blocks 2p, 2p + 1 into f, as the decoded path adds them
  auto add = [&](int p) {
    for (int s = 0; s < 2; ++s) {
      __m128i sc, m;
      k4_scale_bytes(sb, 2 * p + s, &sc, &m);
      for (int i = 0; i < H; ++i) {
        const int h = h0 + i;
        const __m256 s0 = _mm256_mul_ps(ph8_to_ps(sb + 16 * h), half_bytes_ps(sc, h));
        const __m256 s1 = _mm256_mul_ps(ph8_to_ps(sb + 32 + 16 * h), half_bytes_ps(m, h));
        for (int r = 0; r < R; ++r) {
          __m256i& part = s == 0 ? lo[i][r] : hi[i][r];
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(part, ones));
          part = _mm256_setzero_si256();
          const int64_t at = (r0 + r) * x.nb + b8 + 2 * p + s;
          f[i][r] = _mm256_fmadd_ps(s0, _mm256_mul_ps(dot, _mm256_set1_ps(x.d[at])), f[i][r]);
          f[i][r] = _mm256_fnmadd_ps(s1, _mm256_set1_ps(x.s[at]), f[i][r]);
        }
      }
    }
  };
  for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high ones)
    const int32_t* xl[R];
    for (int r = 0; r < R; ++r)
      xl[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + (b8 + 2 * p) * kQK);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const uint8_t* nibs = sb + 256 + 512 * p + 64 * g;
      for (int i = 0; i < H; ++i) {
        const __m256i nib =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibs + 32 * (h0 + i)));
        const __m256i l = _mm256_and_si256(nib, low);
        const __m256i u = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
        for (int r = 0; r < R; ++r) {
          lo[i][r] = _mm256_add_epi16(lo[i][r],
                                      _mm256_maddubs_epi16(l, _mm256_set1_epi32(xl[r][g])));
          hi[i][r] = _mm256_add_epi16(
              hi[i][r], _mm256_maddubs_epi16(u, _mm256_set1_epi32(xl[r][g + kQK / 4])));
        }
      }
    }
    add(p);
  }
}

constexpr int kDirectRows = 4;  // up to this many rows of x the direct kernels run

// out[r][0..16) = the tile's super-blocks (base) against x rows r0 .. r0 + R - 1 by the
// direct kernel: one row both halves of 8 features a pass (the x words broadcast once),
// more rows one half a pass (their accumulators fill the 16 registers). No software
// prefetch: the tiles are one sequential stream, which the hardware prefetchers follow; a
// prefetch of the next super-block (36 lines) took the 1B Q4_K_M model's Q4_K projections
// from 1.4x the rows' speed to 0.85x (one thread, weights from DRAM).
template <int T, int R>
inline void k_direct_rows256(const uint8_t* base, const QRows& x, int64_t r0, float* out) {
  constexpr int H = R == 1 ? 2 : 1;
  const int64_t nsb = x.nb / 8, tb = tile_block_bytes(T);
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 f[H][R];
    for (int i = 0; i < H; ++i)
      for (int r = 0; r < R; ++r) f[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) q4k_direct256<R, H>(base + b * tb, x, r0, 8 * b, h0, f);
    for (int i = 0; i < H; ++i)
      for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(out + r * kTileCols + 8 * (h0 + i), f[i][r]);
  }
}

// The same on a tile's super-blocks (base), one decoded at a time (a few rows), or by the
// direct kernel (Q4_K at up to kDirectRows rows).
template <int T, int R>
inline void k_tile_rows256(const uint8_t* base, const QRows& x, int64_t r0, float* out) {
  if constexpr (T == kQ4_K && R <= kDirectRows) {
    k_direct_rows256<T, R>(base, x, r0, out);
  } else {
    const int64_t nsb = x.nb / 8, tb = tile_block_bytes(T);
    alignas(64) uint8_t q[8 * 8 * 64];
    alignas(64) float sc[8 * 32];
    __m256 sums[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) sums[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
      k_decode_super256<T>(base + b * tb, q, sc);
      k_codes_add256<T, R>(q, sc, x, r0, 8 * b, 8, sums);
    }
    store_sums256<R>(sums, out);
  }
}
#endif
