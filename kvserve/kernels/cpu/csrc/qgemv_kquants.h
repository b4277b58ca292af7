// The K-quants (Q4_K, Q5_K, Q6_K) for qgemv.cpp, which includes this inside its anonymous
// namespace
// (after QRows, half_to_float, dot_u8s8 and hsum): the packed scales, the Q6_K codes and the
// row dots on the 8-bit x blocks of 32; the layouts and the arithmetic are in qgemv.cpp's
// header comment. A file of its own so that qgemv.cpp stays readable; no code of its own
// besides what the K types need.
#pragma once

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes: j < 4 the low 6
// bits of bytes j and j + 4; above, 4 bits from byte j + 4 and the top 2 of bytes j - 4, j.
inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K's (4-bit) or Q5_K's (5-bit) code of value i (0..31) of sub-block j of a super-block
// (Q5_K: qh at 16, nibbles at 48; Q4_K: nibbles at 16).
template <int T>
inline int k4_code(const uint8_t* blk, int j, int i) {
  const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16) + 32 * (j / 2);
  const int nib = j % 2 ? qs[i] >> 4 : qs[i] & 0x0f;
  if constexpr (T == kQ5_K) return nib | (((blk[16 + i] >> j) & 1) << 4);
  return nib;
}

// Q6_K's 6-bit code of value l (0..255) of a super-block, unsigned (0..63).
inline int q6k_code(const uint8_t* blk, int l) {
  const int h = l / 128, r = l % 128, s = r / 32, i = r % 32;
  const uint8_t* ql = blk + 64 * h;
  const int lo = r < 64 ? ql[r] & 0x0f : ql[r - 64] >> 4;
  const int hi = (blk[128 + 32 * h + i] >> (2 * s)) & 3;
  return lo | (hi << 4);
}

#ifdef KVQ_AVX2
// Q4_K's 8 scales (bytes 0..7 of the low half) and 8 mins (bytes 8..15) from its 12 packed
// bytes, with 32-bit masks instead of 16 branches (q4k_scale_min's rule, 4 sub-blocks at once).
inline __m128i q4k_scales_mins(const uint8_t* s) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                        static_cast<int>(m_lo), static_cast<int>(m_hi));
}

// 16 int16 lanes: lanes 0..7 int8 a of v, lanes 8..15 int8 b: the scale of each int16 pair
// sum that maddubs gives for 32 values (a: values 0..15, b: values 16..31).
inline __m256i scale16(__m128i v, int a, int b) {
  const __m128i idx = _mm_set_epi64x(0x0101010101010101ll * b, 0x0101010101010101ll * a);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(v, idx));
}

// The shuffle control that copies int16 lane j (bytes 2j, 2j + 1) into every int16 lane.
constexpr int16_t pick16(int j) { return static_cast<int16_t>(((2 * j + 1) << 8) | (2 * j)); }

// The K-quants' row dot (see the header), on x quantized with one scale per 256 values
// (kvserve_qgemv's group of 8 blocks for this path, llama.cpp's Q8_K idea): a super-block's 8
// sub-blocks are summed as integers, maddubs's pair sums times the int16 sub-block scale
// (madd), and converted to float once a super-block, instead of a conversion, a float scale
// and an FMA per sub-block. No overflow: a pair sum is at most 2 * 31 * 127 (Q5_K) or
// 2 * 32 * 127 (Q6_K), times a scale <= 63 or 128, 8 sub-blocks: < 2^31.
template <int R, int T>
inline void row_dots_k(const uint8_t* w, const QRows& x, float* acc) {
  __m256 v[R], mins[R];
  for (int r = 0; r < R; ++r) v[r] = mins[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  const int64_t nsb = x.nb / 8;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = w + sb * block_bytes(T);
    const int64_t xb = sb * 8;  // the first x block of this super-block
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    float d;
    if constexpr (has_k_min(T)) {
      d = half_to_float(blk);
      const __m128i scm = q4k_scales_mins(blk + 4);
      const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(half_to_float(blk + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                          _mm_unpackhi_epi64(scm, scm))));
      for (int r = 0; r < R; ++r)  // dmin m_j dx_j sum(u_j), the 8 sub-blocks at once
        mins[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(x.s + r * x.nb + xb), mins[r]);
      // the 8 scales as int16 in both 128-bit lanes: one shuffle (pick16) broadcasts one
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
      const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
      // Q5_K's fifth bits, once a super-block (bit j of byte i: value i of sub-block j)
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i five = _mm256_set1_epi8(0x10);
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 (high)
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i q0 = _mm256_and_si256(bytes, low);
        __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        if constexpr (T == kQ5_K) {  // bits 2c and 2c + 1 of qh to bit 4 (2c <= 6: a shift
          // within 16 bits never carries a neighbour byte's bit into bit 4)
          const __m256i h0 = c < 2 ? _mm256_slli_epi16(qh, 4 - 2 * c)
                                   : _mm256_srli_epi16(qh, 2 * c - 4);
          const __m256i h1 = c < 2 ? _mm256_slli_epi16(qh, 3 - 2 * c)
                                   : _mm256_srli_epi16(qh, 2 * c - 3);
          q0 = _mm256_or_si256(q0, _mm256_and_si256(h0, five));
          q1 = _mm256_or_si256(q1, _mm256_and_si256(h1, five));
        }
        const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(pick16(2 * c)));
        const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(pick16(2 * c + 1)));
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (r * x.nb + xb + 2 * c) * kQK;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + kQK));
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, x0), s0);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, x1), s1);
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
        }
      }
    } else {  // Q6_K
      d = half_to_float(blk + 208);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m256i hi2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {  // 128 values: ql bytes 64h.., qh bytes 32h..
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        __m256i q[4];  // sub-block s of 32: 4 bits of ql0/ql1 (low, then high), bits 2s of qh
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), hi2));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), hi2));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                               _mm256_and_si256(qh, hi2));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), hi2));
        for (int s = 0; s < 4; ++s) {
          const int t = 4 * h + s;  // the sub-block of 32 in the super-block
          const __m256i wq = _mm256_sub_epi8(q[s], off);  // -32..31
          const __m256i wabs = _mm256_sign_epi8(wq, wq);
          const __m256i s16 = scale16(sc, 2 * t, 2 * t + 1);
          for (int r = 0; r < R; ++r) {
            const int64_t at = r * x.nb + xb + t;
            const __m256i xq = _mm256_sign_epi8(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at * kQK)), wq);
            isum[r] = _mm256_add_epi32(
                isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xq), s16));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                             _mm256_set1_ps(d * x.d[r * x.nb + xb]), v[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = hsum(v[r]) - hsum(mins[r]);
}

#else
// The K-quants' row dot, plain C++ (see the header).
template <int R, int T>
inline void row_dots_k(const uint8_t* w, const QRows& x, float* acc) {
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  const int64_t nsb = x.nb / 8;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = w + sb * block_bytes(T);
    for (int t = 0; t < 8; ++t) {  // sub-blocks of 32, one x block each
      int code[kQK];
      float dw[2], mw = 0.f;  // the scale of values 0..15 and 16..31; the min (Q4_K)
      if constexpr (has_k_min(T)) {
        int sc, m;
        q4k_scale_min(blk + 4, t, &sc, &m);
        for (int i = 0; i < kQK; ++i) code[i] = k4_code<T>(blk, t, i);
        dw[0] = dw[1] = half_to_float(blk) * sc;
        mw = half_to_float(blk + 2) * m;
      } else {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int i = 0; i < kQK; ++i) code[i] = q6k_code(blk, 32 * t + i) - 32;
        const float d = half_to_float(blk + 208);
        dw[0] = d * sc[2 * t];
        dw[1] = d * sc[2 * t + 1];
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * x.nb + sb * 8 + t;
        const int8_t* xq = x.q + at * kQK;
        int sum0 = 0, sum1 = 0;
        for (int i = 0; i < 16; ++i) sum0 += code[i] * xq[i];
        for (int i = 16; i < kQK; ++i) sum1 += code[i] * xq[i];
        acc[r] += x.d[at] * (dw[0] * static_cast<float>(sum0) + dw[1] * static_cast<float>(sum1));
        if constexpr (has_k_min(T)) acc[r] -= mw * x.s[at];
      }
    }
  }
}

#endif
