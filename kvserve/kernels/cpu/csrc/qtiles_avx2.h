// Row tiles on AVX2 without AVX-512 VNNI (issue 48): qtiles.h's kernel for the 32-value block
// types on the same tile layout (one repack for every build), for the AVX2-only CPUs and the
// AVX-512 parts without VNNI (Skylake-X: their 256-bit AVX2 code). Included by qtiles.h; the
// K-quants' are in qtiles_k_avx2.h.
//
// Why: without these, a build lacking VNNI held its weights in the file's rows, and a 512-row
// prefill ran at 0.60-0.70x llama.cpp's AVX2 build (the row kernel's per-block conversions,
// or MKL on a dequantized copy). The tiles' point (4 neighbouring k of 16 features side by
// side, x's 4 bytes broadcast, one conversion per block for 16 features) holds without VNNI.
//
// dpbusd (4 u8 x s8 products into an int32 lane) is here two steps: `vpmaddubsw` (weights the
// unsigned operand, x's 4 bytes broadcast the signed one: pairs of products into int16) and
// `vpmaddwd` by ones (pairs of int16 into int32). maddubs saturates at 32767, so the int16
// pair sums of several groups of 4 k are added as int16 only as far as they cannot reach it:
// a pair is at most 2 * code * 127 (|x| <= 127: quantize_row), so 8 groups of 4-bit codes
// (30480), 4 of 5-bit (31496), 2 of 6-bit (32004) before one vpmaddwd widens them. Q8_0's
// codes are signed: as in qgemv.cpp's row dot, |q| is the unsigned operand and q's sign is
// moved onto x (sign_epi8), at most 2 * 128 * 127 = 32512 a pair, widened every group.
// A 64-byte tile group (16 features x 4 k) is two ymm: features 0..7 and 8..15, run as two
// halves, each in passes of kRows256 rows of x (an int16 and an int32 accumulator and a float
// sum a row: 12 of the 16 ymm registers with the weights and x's broadcast).
#pragma once

#if defined(KVQ_AVX2) && !defined(KVQ_TILE512)
#define KVQ_TILE256 1

constexpr int kRows256 = 4;  // rows of x a pass

// Groups of 4 k whose maddubs pair sums stay int16 before they are widened (see above).
template <int T>
constexpr int int16_groups() {
  return T == kQ8_0 ? 1 : (is_q5(T) || T == kQ5_K) ? 4 : T == kQ6_K ? 2 : 8;
}

// f(std::integral_constant<int, C>{}, r): rows r .. r + C - 1 of R, in passes of kRows256.
template <int R, class F>
__attribute__((always_inline)) inline void in_passes(F f) {
  constexpr int full = R / kRows256 * kRows256;
  for (int r = 0; r < full; r += kRows256) f(std::integral_constant<int, kRows256>{}, r);
  if constexpr (R % kRows256 != 0) f(std::integral_constant<int, R % kRows256>{}, full);
}

// The integer dots of 8 features with R rows of x over one block of 32 values (xg[r]: row r's
// block as 8 words of 4 bytes), fed a group of 4 k at a time: acc[r] holds 8 int32 sums.
template <int T, int R>
struct Dots256 {
  __m256i acc[R], part[R];
  int pending = 0;

  __attribute__((always_inline)) Dots256() {
    for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm256_setzero_si256();
  }
  // unsigned codes of group g (Q8_0: its signed q)
  __attribute__((always_inline)) void add(__m256i codes, const int32_t* const* xg, int g) {
    if constexpr (T == kQ8_0) {
      const __m256i mag = _mm256_sign_epi8(codes, codes);
      for (int r = 0; r < R; ++r) {
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xg[r][g]), codes);
        part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(mag, xs));
      }
    } else {
      for (int r = 0; r < R; ++r)
        part[r] = _mm256_add_epi16(part[r],
                                   _mm256_maddubs_epi16(codes, _mm256_set1_epi32(xg[r][g])));
    }
    if (++pending == int16_groups<T>()) flush();
  }
  __attribute__((always_inline)) void flush() {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(part[r], ones));
      part[r] = _mm256_setzero_si256();
    }
    pending = 0;
  }
};

inline __m256 ph8_to_ps(const uint8_t* p) {  // 8 f16 -> 8 floats
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// f[r] += features 8h .. 8h + 7 of tile block `blk` (x block b) against x row r0 + r.
template <int T, int R>
__attribute__((always_inline)) inline void tile_block256(const uint8_t* blk, const QRows& x,
                                                         int64_t r0, int64_t b, int h,
                                                         __m256* f) {
  const int32_t* xg[R];
  for (int r = 0; r < R; ++r)
    xg[r] = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * x.k + b * kQK);
  Dots256<T, R> dots;
  const uint8_t* qs = blk + tile_qs_off(T) + 32 * h;
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  if constexpr (T == kQ8_0) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // stored q ^ 0x80
    for (int g = 0; g < 8; ++g) dots.add(_mm256_xor_si256(load(qs + 64 * g), flip), xg, g);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0f), bit5 = _mm256_set1_epi8(0x10);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (is_q5(T)) qh = load(blk + tile_qh_off(T) + 32 * h);
    for (int j = 0; j < 4; ++j) {
      const __m256i nib = load(qs + 64 * j);
      __m256i lo = _mm256_and_si256(nib, low);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
      if constexpr (is_q5(T)) {  // group j's fifth bits at bit j of each byte, j + 4's at j + 4
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - j), bit5));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(qh, j), bit5));
      }
      dots.add(lo, xg, j);
      dots.add(hi, xg, j + 4);
    }
  }
  if (dots.pending != 0) dots.flush();
  const __m256 dw = ph8_to_ps(blk + 16 * h);
  __m256 mw = _mm256_setzero_ps();
  if constexpr (has_min(T)) mw = ph8_to_ps(blk + tile_m_off() + 16 * h);
  constexpr float off = tile_offset<T>(false);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * x.nb + b;
    __m256 t = _mm256_cvtepi32_ps(dots.acc[r]);
    if constexpr (off != 0.f)
      t = _mm256_fmadd_ps(t, _mm256_set1_ps(x.d[at]), _mm256_set1_ps(off * x.s[at]));
    else
      t = _mm256_mul_ps(t, _mm256_set1_ps(x.d[at]));
    f[r] = _mm256_fmadd_ps(dw, t, f[r]);
    if constexpr (has_min(T)) f[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[at]), f[r]);
  }
}

// The 16 features of tile `tile` against rows r0 .. r0 + R - 1: out[r][0..16), as
// qtiles.h's tile_rows.
template <int T, int R>
inline void tile_rows256(const uint8_t* w, const QRows& x, int64_t tile, int64_t r0,
                         float* out) {
  const int64_t tb = tile_block_bytes(T);
  const uint8_t* base = w + tile * x.nb * tb;
  for (int h = 0; h < 2; ++h)
    in_passes<R>([&](auto rows, int r) {
      constexpr int C = decltype(rows)::value;
      __m256 f[C];
      for (int i = 0; i < C; ++i) f[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < x.nb; ++b) {
        // decode of 2-4 rows: the next blocks from memory. Not at one row, where the hardware
        // prefetchers keep up with the one stream and the software prefetch cost 5% of the 1B
        // Q4_0 model's decode; at 4 rows it saved 14% (AVX2, 2 threads).
        if (R >= 2 && R <= 4 && h == 0 && b + 4 < x.nb) {
          const uint8_t* ahead = base + (b + 4) * tb;
          for (int64_t at = 0; at < tb; at += 64) __builtin_prefetch(ahead + at);
        }
        tile_block256<T, C>(base + b * tb, x, r0 + r, b, h, f);
      }
      for (int i = 0; i < C; ++i) _mm256_storeu_ps(out + (r + i) * kTileCols + 8 * h, f[i]);
    });
}
#endif
