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
// The K-quants' row dot (see the header): super-block by super-block, each 32-value
// sub-block one integer dot on one x block, alternating between two sets of accumulators.
template <int R, int T>
inline void row_dots_k(const uint8_t* w, const QRows& x, float* acc) {
  __m256 v0[R], v1[R];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    v0[r] = v1[r] = _mm256_setzero_ps();
    corr[r] = 0.f;
  }
  const __m256i low = _mm256_set1_epi8(0x0f);
  const int64_t nsb = x.nb / 8;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = w + sb * block_bytes(T);
    const int64_t xb = sb * 8;  // the first x block of this super-block
    if constexpr (has_k_min(T)) {
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      const uint8_t* qs = blk + (T == kQ5_K ? 48 : 16);
      // Q5_K's fifth bits, once a super-block (bit j of byte i: value i of sub-block j)
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i five = _mm256_set1_epi8(0x10);
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 (high)
        int sc0, m0, sc1, m1;
        q4k_scale_min(blk + 4, 2 * c, &sc0, &m0);
        q4k_scale_min(blk + 4, 2 * c + 1, &sc1, &m1);
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
        const float ds0 = d * sc0, ds1 = d * sc1, dm0 = dmin * m0, dm1 = dmin * m1;
        for (int r = 0; r < R; ++r) {
          const int64_t at = r * x.nb + xb + 2 * c;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at * kQK));
          const __m256i x1 =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (at + 1) * kQK));
          v0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q0, x0)),
                                  _mm256_set1_ps(ds0 * x.d[at]), v0[r]);
          v1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q1, x1)),
                                  _mm256_set1_ps(ds1 * x.d[at + 1]), v1[r]);
          corr[r] -= dm0 * x.s[at] + dm1 * x.s[at + 1];
        }
      }
    } else {  // Q6_K
      const float d = half_to_float(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
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
          // int32 lanes 0..3 hold values 0..15 (scale 2t), lanes 4..7 values 16..31 (2t + 1)
          const __m256 scv = _mm256_set_m128(_mm_set1_ps(d * sc[2 * t + 1]),
                                             _mm_set1_ps(d * sc[2 * t]));
          __m256* v = (s & 1) ? v1 : v0;
          for (int r = 0; r < R; ++r) {
            const int64_t at = r * x.nb + xb + t;
            const __m256i xq = _mm256_sign_epi8(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at * kQK)), wq);
            v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wabs, xq)),
                                   _mm256_mul_ps(scv, _mm256_set1_ps(x.d[at])), v[r]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(v0[r], v1[r])) + corr[r];
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
