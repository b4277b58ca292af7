// Row tiles for the K-quants (Q4_K, Q5_K, Q6_K): the super-blocks of 16 output features repacked at
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
//   Q5_K (2816 bytes): d, dmin and the packed scales as Q4_K's | then for group g (0..7) one
//     chunk of 320 bytes at 256 + 320 g: feature c's file bytes qs[32p + 4g .. + 3] at + 64p
//     + 4c for pair p (0..3; as Q4_K's: low nibbles sub-block 2p, high ones 2p + 1) and its
//     qh[4g .. + 3] at + 256 + 4c (bit j: the fifth bit of sub-block j's value). A decode
//     reads the chunks in order, the fifth bits loaded once for the 8 sub-blocks (Q6_K's
//     lesson below);
//   Q6_K (3360 bytes): d[16] f16 | scale i (0..15) of feature c at 32 + 16 i + c | then for
//     half h (0..1) and group g (0..7) one chunk of 192 bytes at 288 + (8h + g) 192: feature
//     c's file bytes ql[64h + 4g .. + 3] at + 4c, ql[64h + 32 + 4g .. + 3] at + 64 + 4c (low
//     nibbles: values 4g .. of sub-blocks 0 and 1 of half h, high nibbles of sub-blocks 2 and
//     3) and qh[32h + 4g .. + 3] at + 128 + 4c (bits 2s, 2s + 1: the fifth and sixth bits of
//     sub-block s's codes). The chunks are read in address order, each once: the 4 codes of a
//     chunk come from its 3 loads (with the codes of one sub-block at a time, as before, the
//     ql bytes were read twice and the qh bytes four times, out of order, and a decode from
//     memory ran at a third of its speed from L2: 8 against 24 GB/s on one Zen 4 core).
// So one 64-byte load is 4 neighbouring values of 16 features, one `dpbusd` against x's 4
// bytes broadcast, as in qtiles.h. Q6_K's scales cover 16 values and x's blocks 32: the two
// halves of an x block are accumulated apart, and q - 32 needs the sum of x's first half,
// computed once a call (QRows.h).
#pragma once

// f(file offset in a feature's super-block, tile offset, bytes) for feature c's pieces.
template <int T, class F>
inline void for_each_k_piece(int c, F f) {
  if constexpr (has_k_min(T)) {
    f(0, 2 * c, 2);
    f(2, 32 + 2 * c, 2);
    for (int i = 0; i < 12; ++i) f(4 + i, 64 + 16 * i + c, 1);
    if constexpr (T == kQ4_K) {
      for (int p = 0; p < 4; ++p)
        for (int g = 0; g < 8; ++g) f(16 + 32 * p + 4 * g, 256 + 512 * p + (16 * g + c) * 4, 4);
    } else {
      for (int g = 0; g < 8; ++g) {
        for (int p = 0; p < 4; ++p) f(48 + 32 * p + 4 * g, 256 + 320 * g + 64 * p + 4 * c, 4);
        f(16 + 4 * g, 256 + 320 * g + 256 + 4 * c, 4);
      }
    }
  } else {
    f(208, 2 * c, 2);
    for (int i = 0; i < 16; ++i) f(192 + i, 32 + 16 * i + c, 1);
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 8; ++g) {
        const int chunk = 288 + (8 * h + g) * 192;
        for (int q = 0; q < 2; ++q) f(64 * h + 32 * q + 4 * g, chunk + 64 * q + 4 * c, 4);
        f(128 + 32 * h + 4 * g, chunk + 128 + 4 * c, 4);
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

// Many rows (a prefill): tile `tile`'s super-blocks decoded once a call into 8-bit codes and
// float scales (KCodes), then every 8 rows of x run on them as on Q8_0's tiles: loads and
// dpbusd, no bit work. Why: inline, each 8 rows redid the unpacking (Q5_K's fifth bits, Q6_K's
// high bits: 5-7 ops a 64-byte vector against Q4_K's 3) and at 512 rows Q5_K / Q6_K ran 25%
// below Q4_K; decoded, it is done once for all rows, and Q4_K sheds its nibble masks too.
// q: sub-block j's group g (values 32j + 4g .. + 3 of the 16 features) at (8j + g) 64, its
// unsigned codes (Q6_K's before - 32); sc: per sub-block two vectors of 16 floats: d sc_j and
// dmin m_j (Q4_K, Q5_K), or d sc of its first and second 16 values (Q6_K).
struct KCodes {
  uint8_t* q;
  float* sc;
};

#ifdef KVQ_TILE512
inline __m512 bytes_to_ps(__m128i v, bool is_signed) {
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// The 16 features' d sc_j and dmin m_j of sub-block j (Q4_K's and Q5_K's packed 6-bit
// scales: byte i of feature c at 64 + 16 i + c), dv and mv the features' d and dmin.
__attribute__((always_inline)) inline void k4_scales512(const uint8_t* sb, int j, __m512 dv,
                                                        __m512 mv, __m512* dsc, __m512* dm) {
  auto s_row = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * i));
  };
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0f), top = _mm_set1_epi8(0x30);
  __m128i sc, m;
  if (j < 4) {  // q4k_scale_min for 16 features
    sc = _mm_and_si128(s_row(j), m6);
    m = _mm_and_si128(s_row(j + 4), m6);
  } else {
    sc = _mm_or_si128(_mm_and_si128(s_row(j + 4), m4),
                      _mm_and_si128(_mm_srli_epi16(s_row(j - 4), 2), top));
    m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s_row(j + 4), 4), m4),
                     _mm_and_si128(_mm_srli_epi16(s_row(j), 2), top));
  }
  *dsc = _mm512_mul_ps(dv, bytes_to_ps(sc, false));
  *dm = _mm512_mul_ps(mv, bytes_to_ps(m, false));
}

// f[r] += d sc_j dx sum(q u) - dmin m_j dx sum(u) for sub-block j's integer dots acc[r] (x
// block b = b8 + j of row r0 + r).
template <int R>
__attribute__((always_inline)) inline void k4_add512(const uint8_t* sb, const QRows& x,
                                                     int64_t r0, int64_t b8, int j, __m512 dv,
                                                     __m512 mv, const __m512i* acc, __m512* f) {
  __m512 dsc, dm;
  k4_scales512(sb, j, dv, mv, &dsc, &dm);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * x.nb + b8 + j;
    f[r] = _mm512_fmadd_ps(dsc, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]),
                                              _mm512_set1_ps(x.d[at])), f[r]);
    f[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(x.s[at]), f[r]);
  }
}

inline __m512 ph_to_ps512(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// f[r] += the 16 features' dots with x rows r0.. over Q4_K tile super-block `sb`, whose first
// x block is b8.
template <int R>
inline void q4k_super512(const uint8_t* sb, const QRows& x, int64_t r0, int64_t b8, __m512* f) {
  const __m512 dv = ph_to_ps512(sb), mv = ph_to_ps512(sb + 32);
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
    k4_add512<R>(sb, x, r0, b8, 2 * p, dv, mv, lo, f);
    k4_add512<R>(sb, x, r0, b8, 2 * p + 1, dv, mv, hi, f);
  }
}

// Each byte's bits 0..3 from lo and bits 4..7 from hi, then masked to `keep`: two ops where
// and, and, or were three (vpternlogd 0xE4: the third operand, 0x0f a byte, selects lo).
inline __m512i merge_nibbles512(__m512i lo, __m512i hi, __m512i keep) {
  return _mm512_and_si512(_mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x0f), 0xE4),
                          keep);
}

// qh shifted so that its bit j lies at bit 4 of each byte (j <= 7: a shift within 16 bits by
// at most 4 never moves a neighbour byte's bit there); the other bits are to be masked off.
inline __m512i fifth_bit512(__m512i qh, int j) {
  return j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
}

// The same over a Q5_K tile super-block. A decode (R <= 2) walks the chunks in order, the 8
// sub-blocks' dots in 8 accumulators a row; more rows take one pair of sub-blocks at a time
// (2 accumulators a row, as Q4_K), rereading the fifth bits from L1.
template <int R>
inline void q5k_super512(const uint8_t* sb, const QRows& x, int64_t r0, int64_t b8, __m512* f) {
  const __m512 dv = ph_to_ps512(sb), mv = ph_to_ps512(sb + 32);
  const __m512i five = _mm512_set1_epi8(0x1f);  // a code's 5 bits
  auto xg = [&](int r, int j, int g) {
    return _mm512_set1_epi32(
        reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + (b8 + j) * kQK)[g]);
  };
  constexpr int kPairs = R <= 2 ? 4 : 1;  // pairs of sub-blocks per pass over the chunks
  for (int p0 = 0; p0 < 4; p0 += kPairs) {
    __m512i acc[2 * kPairs][R];
    for (int j = 0; j < 2 * kPairs; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const uint8_t* chunk = sb + 256 + 320 * g;
      const __m512i qh = _mm512_loadu_si512(chunk + 256);
      for (int i = 0; i < kPairs; ++i) {
        const int p = p0 + i;
        const __m512i nib = _mm512_loadu_si512(chunk + 64 * p);
        const __m512i l = merge_nibbles512(nib, fifth_bit512(qh, 2 * p), five);
        const __m512i h =
            merge_nibbles512(_mm512_srli_epi16(nib, 4), fifth_bit512(qh, 2 * p + 1), five);
        for (int r = 0; r < R; ++r) {
          acc[2 * i][r] = _mm512_dpbusd_epi32(acc[2 * i][r], l, xg(r, 2 * p, g));
          acc[2 * i + 1][r] = _mm512_dpbusd_epi32(acc[2 * i + 1][r], h, xg(r, 2 * p + 1, g));
        }
      }
    }
    for (int j = 0; j < 2 * kPairs; ++j)
      k4_add512<R>(sb, x, r0, b8, 2 * p0 + j, dv, mv, acc[j], f);
  }
}

// The same over a Q6_K tile super-block: x block b8 + 4h + s is sub-block s of half h. Per
// half, the 8 chunks in order, each giving its group's codes of the 4 sub-blocks (a decode:
// 8 accumulators a row, one per sub-block and 16-value half) or, with more rows, of one
// sub-block a pass (2 a row).
template <int R>
inline void q6k_super512(const uint8_t* sb, const QRows& x, int64_t r0, int64_t b8, __m512* f) {
  const __m512 dv = ph_to_ps512(sb);
  const __m512i six = _mm512_set1_epi8(0x3f);  // a code's 6 bits
  const __m128i* scales = reinterpret_cast<const __m128i*>(sb + 32);
  constexpr int kSubs = R <= 2 ? 4 : 1;
  for (int h = 0; h < 2; ++h)
    for (int s0 = 0; s0 < 4; s0 += kSubs) {
      __m512i acc[kSubs][2][R];
      for (int i = 0; i < kSubs; ++i)
        for (int r = 0; r < R; ++r) acc[i][0][r] = acc[i][1][r] = _mm512_setzero_si512();
      // unrolled: acc[i][g >= 4] must name registers (a loop over g kept the 16
      // accumulators on the stack, a load and a store around each dpbusd: half the speed)
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const uint8_t* chunk = sb + 288 + (8 * h + g) * 192;
        const __m512i c = _mm512_loadu_si512(chunk + 128);
        for (int i = 0; i < kSubs; ++i) {
          const int s = s0 + i;
          const __m512i q = _mm512_loadu_si512(chunk + 64 * (s & 1));
          const __m512i nib = s < 2 ? q : _mm512_srli_epi16(q, 4);
          __m512i hb;  // bits 2s, 2s + 1 of each byte of c at bits 4, 5
          if (s == 0) hb = _mm512_slli_epi16(c, 4);
          else if (s == 1) hb = _mm512_slli_epi16(c, 2);
          else if (s == 2) hb = c;
          else hb = _mm512_srli_epi16(c, 2);
          const __m512i code = merge_nibbles512(nib, hb, six);
          for (int r = 0; r < R; ++r) {
            const int32_t* xg = reinterpret_cast<const int32_t*>(
                x.q + (r0 + r) * x.k + (b8 + 4 * h + s) * kQK);
            __m512i& a = acc[i][g >= 4][r];
            a = _mm512_dpbusd_epi32(a, code, _mm512_set1_epi32(xg[g]));
          }
        }
      }
      for (int i = 0; i < kSubs; ++i) {
        const int64_t j = 4 * h + s0 + i;
        const __m512 lo_sc =
            _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j), true));
        const __m512 hi_sc =
            _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j + 1), true));
        for (int r = 0; r < R; ++r) {  // q - 32: minus 32 times each half's sum of x
          const int64_t at = (r0 + r) * x.nb + b8 + j;
          const __m512 dx = _mm512_set1_ps(x.d[at]);
          const __m512 first = _mm512_set1_ps(-32.f * x.h[at]);
          const __m512 second = _mm512_set1_ps(-32.f * (x.s[at] - x.h[at]));
          f[r] = _mm512_fmadd_ps(
              lo_sc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0][r]), dx, first), f[r]);
          f[r] = _mm512_fmadd_ps(
              hi_sc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1][r]), dx, second), f[r]);
        }
      }
    }
}

inline void put_sc(float* sc, int64_t j, __m512 a, __m512 b) {
  _mm512_storeu_ps(sc + 32 * j, a);
  _mm512_storeu_ps(sc + 32 * j + 16, b);
}

template <int T>
void k_decode_tile(const uint8_t* w, int64_t k, int64_t tile, const KCodes& c) {
  const int64_t nsb = k / kQKK, tb = tile_block_bytes(T);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* sb = w + (tile * nsb + b) * tb;
    uint8_t* q = c.q + b * 8 * 8 * 64;
    auto put = [&](int j, int g, __m512i v) { _mm512_storeu_si512(q + (8 * j + g) * 64, v); };
    if constexpr (T == kQ6_K) {
      const __m512 dv = ph_to_ps512(sb);
      const __m128i* scales = reinterpret_cast<const __m128i*>(sb + 32);
      for (int j = 0; j < 8; ++j)
        put_sc(c.sc, 8 * b + j,
               _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j), true)),
               _mm512_mul_ps(dv, bytes_to_ps(_mm_loadu_si128(scales + 2 * j + 1), true)));
      const __m512i six = _mm512_set1_epi8(0x3f);
      for (int h = 0; h < 2; ++h)
        for (int g = 0; g < 8; ++g) {
          const uint8_t* chunk = sb + 288 + (8 * h + g) * 192;
          const __m512i hb = _mm512_loadu_si512(chunk + 128);
          const __m512i q0 = _mm512_loadu_si512(chunk), q1 = _mm512_loadu_si512(chunk + 64);
          put(4 * h, g, merge_nibbles512(q0, _mm512_slli_epi16(hb, 4), six));
          put(4 * h + 1, g, merge_nibbles512(q1, _mm512_slli_epi16(hb, 2), six));
          put(4 * h + 2, g, merge_nibbles512(_mm512_srli_epi16(q0, 4), hb, six));
          put(4 * h + 3, g,
              merge_nibbles512(_mm512_srli_epi16(q1, 4), _mm512_srli_epi16(hb, 2), six));
        }
    } else {
      const __m512 dv = ph_to_ps512(sb), mv = ph_to_ps512(sb + 32);
      for (int j = 0; j < 8; ++j) {
        __m512 dsc, dm;
        k4_scales512(sb, j, dv, mv, &dsc, &dm);
        put_sc(c.sc, 8 * b + j, dsc, dm);
      }
      const __m512i five = _mm512_set1_epi8(0x1f);
      for (int g = 0; g < 8; ++g)
        for (int p = 0; p < 4; ++p) {
          if constexpr (T == kQ4_K) {
            const __m512i nib = _mm512_loadu_si512(sb + 256 + 512 * p + 64 * g);
            put(2 * p, g, _mm512_and_si512(nib, low));
            put(2 * p + 1, g, _mm512_and_si512(_mm512_srli_epi16(nib, 4), low));
          } else {
            const uint8_t* chunk = sb + 256 + 320 * g;
            const __m512i qh = _mm512_loadu_si512(chunk + 256);
            const __m512i nib = _mm512_loadu_si512(chunk + 64 * p);
            put(2 * p, g, merge_nibbles512(nib, fifth_bit512(qh, 2 * p), five));
            put(2 * p + 1, g, merge_nibbles512(_mm512_srli_epi16(nib, 4),
                                               fifth_bit512(qh, 2 * p + 1), five));
          }
        }
    }
  }
}

// out[r][0..16) = the decoded tile's 16 features against x rows r0 .. r0 + R - 1: per
// sub-block 8 dpbusd a row (Q6_K: its two halves apart), then its scales as the inline
// kernels apply them.
template <int T, int R>
void k_codes_rows(const KCodes& c, const QRows& x, int64_t r0, float* out) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  constexpr int kHalves = T == kQ6_K ? 2 : 1;
  for (int64_t j = 0; j < x.nb; ++j) {
    __m512i acc[kHalves][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[kHalves - 1][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i v = _mm512_loadu_si512(c.q + (8 * j + g) * 64);
      for (int r = 0; r < R; ++r) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + j * kQK);
        __m512i& a = acc[kHalves == 2 && g >= 4][r];
        a = _mm512_dpbusd_epi32(a, v, _mm512_set1_epi32(xg[g]));
      }
    }
    const __m512 s0 = _mm512_loadu_ps(c.sc + 32 * j), s1 = _mm512_loadu_ps(c.sc + 32 * j + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.nb + j;
      const __m512 dx = _mm512_set1_ps(x.d[at]);
      if constexpr (T == kQ6_K) {  // q - 32: minus 32 times each half's sum of x
        const __m512 first = _mm512_set1_ps(-32.f * x.h[at]);
        const __m512 second = _mm512_set1_ps(-32.f * (x.s[at] - x.h[at]));
        f[r] = _mm512_fmadd_ps(s0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][r]), dx, first),
                               f[r]);
        f[r] = _mm512_fmadd_ps(s1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[1][r]), dx, second),
                               f[r]);
      } else {
        f[r] = _mm512_fmadd_ps(s0, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[0][r]), dx), f[r]);
        f[r] = _mm512_fnmadd_ps(s1, _mm512_set1_ps(x.s[at]), f[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kTileCols, f[r]);
}

#endif

#include "qtiles_k_avx2.h"

#if defined(KVQ_TILE512) || defined(KVQ_TILE256)
template <int T>
void k_codes_chunk(const KCodes& c, const QRows& x, int64_t r0, int64_t cnt, float* out) {
  switch (cnt) {
    case 8: k_codes_rows<T, 8>(c, x, r0, out); break;
    case 7: k_codes_rows<T, 7>(c, x, r0, out); break;
    case 6: k_codes_rows<T, 6>(c, x, r0, out); break;
    case 5: k_codes_rows<T, 5>(c, x, r0, out); break;
    case 4: k_codes_rows<T, 4>(c, x, r0, out); break;
    case 3: k_codes_rows<T, 3>(c, x, r0, out); break;
    case 2: k_codes_rows<T, 2>(c, x, r0, out); break;
    default: k_codes_rows<T, 1>(c, x, r0, out); break;
  }
}

// A thread's decoded tile (part 0: the tile, 1: a gated call's up tile), k wide.
inline KCodes k_codes_buffer(int part, int64_t k) {
  thread_local std::vector<uint8_t> q[2];
  thread_local std::vector<float> sc[2];
  q[part].resize(static_cast<size_t>(kTileCols * k));
  sc[part].resize(static_cast<size_t>(k / kQK * 2 * kTileCols));
  return KCodes{q[part].data(), sc[part].data()};
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
    else if constexpr (T == kQ5_K) q5k_super512<R>(base + b * tb, x, r0, 8 * b, f);
    else q6k_super512<R>(base + b * tb, x, r0, 8 * b, f);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kTileCols, f[r]);
#elif defined(KVQ_TILE256)
  k_tile_rows256<T, R>(base, x, r0, out);
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
