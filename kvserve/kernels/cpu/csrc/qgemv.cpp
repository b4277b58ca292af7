// Matrix products on GGUF block-quantized weights, kept in their file layout: y = x W^T (+ b)
// for W in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K, x float32.
//
// Why: a batch-1 decode step reads every weight once, so its speed is bytes per weight. Q4_1
// is 5 bits a weight (20 bytes per 32) against fp32's 32: dequantizing at load (what kvserve
// did) read 6.4x the bytes the file holds.
//
// Design (the block formats are ggml's public spec; the kernel is our own): each row of x is
// quantized to 8-bit blocks of 32 (one float scale dx = amax / 127 and the block's integer sum
// per block), then every weight block is an integer dot product of 32 bytes:
//   Q8_0 (f16 d, 32 x int8 q):             sum_i d q_i dx u_i = d dx sum(q u)
//   Q4_0 (f16 d, 16 bytes of nibbles):     d (q - 8)          -> d dx (sum(q u) - 8 sum(u))
//   Q4_1 (f16 d, f16 m, 16 bytes):          d q + m            -> d dx sum(q u) + m dx sum(u)
// where the nibbles are element j = low nibble of byte j, element 16 + j = its high nibble.
// The integer products run as AVX2 `maddubs` (u8 x s8 -> pairs of int16; for Q8_0 the signs
// are moved onto x first: |q| * sign(u, q)) then `madd` into int32, or, where the CPU has
// AVX-512 VNNI (with VL) or AVX-VNNI, one `dpbusd` instead of the two. No int16 overflow:
// a pair is at most 2 * 128 * 127 = 32512 (Q8_0) or 2 * 15 * 127 = 3810 (nibbles).
// The ISA is the build's: cpu_ext.py builds with -march=native or $KVSERVE_CPU_ISA's cap
// (x86-64-v3 = AVX2 without VNNI), so one source gives the AVX2 and the VNNI paths; a plain
// C++ loop is the fallback for any other CPU.
//
// The K-quants (super-blocks of 256 values; what llama.cpp's Q4_K_M files hold) run on the
// same 8-bit x blocks of 32. Why kept in their format: dequantized at load they were 32 bits a
// weight again, against 4.5 (Q4_K) and 6.6 (Q6_K).
//   Q4_K (f16 d, f16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j, 128 bytes of nibbles):
//     sub-block j of 32 is d sc_j q - dmin m_j, its nibbles the low (j even) or high (j odd)
//     halves of bytes 32 (j / 2) .. + 31  -> d sc_j dx sum(q u) - dmin m_j dx sum(u)
//   Q5_K (f16 d, f16 dmin, Q4_K's 12 scale bytes, 32 bytes qh, 128 bytes of nibbles): as
//     Q4_K with a fifth bit: value i of sub-block j has bit j of qh[i] as its bit 4
//   Q6_K (128 bytes ql, 64 bytes qh, 16 x int8 scales of 16 values, f16 d): d sc (q - 32),
//     q = 4 low bits from ql | 2 high bits from qh; q - 32 is signed, so as Q8_0 the signs are
//     moved onto x (|q - 32| <= 32) and each int32 of the dot (4 neighbouring values, one
//     scale) is scaled by its 16-value group's d sc dx in float.
// On AVX2 and AVX-512 builds x has one scale per 256 values for these types (llama.cpp's
// Q8_K does the same), so the AVX2 row dot adds a super-block's sub-blocks as integers
// (qgemv_kquants.h).
//
// Each weight row (a few hundred bytes) is read from memory once and then reused from L1 for
// every row of x in a cache tile, up to 4 rows at a time in registers (qgemv_rows). Threads
// claim units of 16 output features from parallel.h's pool (no barrier waiting on a
// descheduled thread), torch's thread count of them.
//
// Modes as gemv.cpp: 0 out = xW^T + b; 1 out += xW^T + b; 2 out = silu(g) * u;
// 3 out = gelu_tanh(g) * u, W = [gate; up] (2n rows).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVQ_AVX2 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVQ_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kQK = 32;   // values per block (of x; of W for the 32-value types)
constexpr int64_t kQKK = 256;  // values per K-quant super-block
#ifndef KVQ_PREFETCH_ROWS
#define KVQ_PREFETCH_ROWS 8
#endif
constexpr int64_t kPrefetchRows = KVQ_PREFETCH_ROWS;  // weight rows prefetched ahead
enum QType {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kQ5_0 = 5, kQ5_1 = 6, kQ5_K = 7
};
constexpr int kNumTypes = 8;

constexpr bool is_k(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }
// Q4_K and Q5_K: d sc q - dmin m, the same 6-bit scales and mins (Q5_K's fifth bits beside)
constexpr bool has_k_min(int type) { return type == kQ4_K || type == kQ5_K; }

// f(std::integral_constant<int, T>{}) for the block type code t (checked by the caller): the
// one switch from a type code to the templates of every entry point.
template <class F>
inline void with_type(int t, F f) {
  switch (t) {
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ6_K: return f(std::integral_constant<int, kQ6_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    default: return f(std::integral_constant<int, kQ5_1>{});
  }
}
// bytes per block (of 32 values, or of 256 for the K-quants)
inline int64_t block_bytes(int type) {
  switch (type) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    case kQ5_K: return 176;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    default: return 0;
  }
}
inline int64_t values_per_block(int type) { return is_k(type) ? kQKK : kQK; }
inline int64_t row_bytes_of(int type, int64_t k) {
  return k / values_per_block(type) * block_bytes(type);
}
inline bool bad_k(int type, int64_t k) { return k <= 0 || k % values_per_block(type) != 0; }

// Q5_0 / Q5_1: the nibbles as Q4_0 / Q4_1 (after d, or d and m) behind 4 bytes qh whose bit i
// is element i's fifth bit; Q5_0 = d (q - 16), Q5_1 = d q + m. The value of element i:
inline int q5_value(const uint8_t* qs, uint32_t qh, int i) {
  const int nib = i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4);
  return nib | static_cast<int>(((qh >> i) & 1u) << 4);
}
constexpr bool is_q5(int t) { return t == kQ5_0 || t == kQ5_1; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef KVQ_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// One row of x as 8-bit blocks: q[k], per block the scale d and s = d * sum(q). `group`
// blocks share one scale (their amax): 8 for the AVX2 K-quant rows, which sum a super-block's
// sub-blocks as integers (llama.cpp's Q8_K has one scale per 256 values too); 1 elsewhere.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s, int64_t group) {
  for (int64_t g = 0; g < k / kQK; g += group) {
    float amax = 0.f;
    for (int64_t i = g * kQK; i < (g + group) * kQK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float db = amax / 127.f;
    const float id = db > 0.f ? 1.f / db : 0.f;
    for (int64_t b = g; b < g + group; ++b) {
      int sum = 0;
      for (int64_t i = b * kQK; i < (b + 1) * kQK; ++i) {
        const int v = static_cast<int>(std::nearbyint(x[i] * id));  // |v| <= 127
        q[i] = static_cast<int8_t>(v);
        sum += v;
      }
      d[b] = db;
      s[b] = db * static_cast<float>(sum);
    }
  }
}

struct QRows {  // the quantized rows of x
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k, nb;
  const float* h = nullptr;  // per block d * the sum of its first 16 q (Q6_K tiles only)
};

// The K-quants' row dot (qgemv_kquants.h, included below the row_dots of the other types).
template <int R, int T>
inline void row_dots_k(const uint8_t* w, const QRows& x, float* acc);

#ifdef KVQ_AVX2
inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 int32 sums of 4 products each
#ifdef KVQ_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#endif
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// 0x10 in byte i where bit i of the 4 bytes at p is set (Q5's fifth bits): byte i takes qh's
// byte i / 8, then tests its bit i % 8.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// acc[r] = dot(W row, x row r) for r < R: the weight blocks loaded once, R rows of x each.
// Two blocks per step into two sets of accumulators: at one row a single chain of FMAs (and
// of the offset's scalar adds) waited on its own latency, not on memory.
template <int R, int T>
inline void row_dots(const uint8_t* w, const QRows& x, float* acc) {
  if constexpr (is_k(T)) return row_dots_k<R, T>(w, x, acc);
  __m256 v0[R], v1[R];
  float c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    v0[r] = v1[r] = _mm256_setzero_ps();
    c0[r] = c1[r] = 0.f;
  }
  const int64_t bb = block_bytes(T);
  const __m256i low = _mm256_set1_epi8(0x0f);
  auto step = [&](int64_t b, __m256* v, float* corr) {
    const uint8_t* blk = w + b * bb;
    const float dw = half_to_float(blk);
    __m256i wq;
    float mw = 0.f;
    if (T == kQ8_0) {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      const int off = (T == kQ4_0 || T == kQ5_0) ? 2 : 4;
      if (T == kQ4_1 || T == kQ5_1) mw = half_to_float(blk + 2);
      const int qoff = is_q5(T) ? off + 4 : off;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qoff));
      const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
      wq = _mm256_and_si256(both, low);  // elements 0..15 low nibbles, 16..31 high
      if (is_q5(T)) wq = _mm256_or_si256(wq, fifth_bits(blk + off));
    }
    const __m256i wabs = T == kQ8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * x.nb + b;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at * kQK));
      if (T == kQ8_0) xq = _mm256_sign_epi8(xq, wq);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wabs, xq));
      v[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x.d[at]), v[r]);
      if (T == kQ4_0) corr[r] -= 8.f * dw * x.s[at];
      if (T == kQ5_0) corr[r] -= 16.f * dw * x.s[at];
      if (T == kQ4_1 || T == kQ5_1) corr[r] += mw * x.s[at];
    }
  };
  int64_t b = 0;
  for (; b + 2 <= x.nb; b += 2) {
    step(b, v0, c0);
    step(b + 1, v1, c1);
  }
  if (b < x.nb) step(b, v0, c0);
  for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(v0[r], v1[r])) + c0[r] + c1[r];
}
#else
template <int R, int T>
inline void row_dots(const uint8_t* w, const QRows& x, float* acc) {
  if constexpr (is_k(T)) return row_dots_k<R, T>(w, x, acc);
  const int64_t bb = block_bytes(T);
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const float dw = half_to_float(blk);
    const float mw = (T == kQ4_1 || T == kQ5_1) ? half_to_float(blk + 2) : 0.f;
    int8_t wq[kQK];
    if (T == kQ8_0) {
      std::memcpy(wq, blk + 2, kQK);
    } else if (is_q5(T)) {
      const int off = T == kQ5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, blk + off, 4);
      for (int j = 0; j < kQK; ++j) wq[j] = static_cast<int8_t>(q5_value(blk + off + 4, qh, j));
    } else {
      const uint8_t* qs = blk + (T == kQ4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) {
        wq[j] = static_cast<int8_t>(qs[j] & 0x0f);
        wq[j + 16] = static_cast<int8_t>(qs[j] >> 4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * x.nb + b;
      const int8_t* xq = x.q + at * kQK;
      int sum = 0;
      for (int j = 0; j < kQK; ++j) sum += static_cast<int>(wq[j]) * xq[j];
      acc[r] += dw * x.d[at] * static_cast<float>(sum);
      if (T == kQ4_0) acc[r] -= 8.f * dw * x.s[at];
      if (T == kQ5_0) acc[r] -= 16.f * dw * x.s[at];
      if (T == kQ4_1 || T == kQ5_1) acc[r] += mw * x.s[at];
    }
  }
}
#endif

#include "qgemv_kquants.h"

// acc[r] = dot(W row, x row r0 + r) for r < cnt (cnt <= 4).
template <int T>
inline void chunk_dots(const uint8_t* w, const QRows& x, int64_t r0, int64_t cnt, float* acc) {
  const QRows c{x.q + r0 * x.k, x.d + r0 * x.nb, x.s + r0 * x.nb, x.k, x.nb};
  switch (cnt) {
    case 4: row_dots<4, T>(w, c, acc); break;
    case 3: row_dots<3, T>(w, c, acc); break;
    case 2: row_dots<2, T>(w, c, acc); break;
    default: row_dots<1, T>(w, c, acc); break;
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

inline float gelu_tanh(float g) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * g * (1.f + std::tanh(c * (g + 0.044715f * g * g * g)));
}

// Cache tiles (issue 31): a unit of work is kOutTile output features (with up's, gated),
// claimed by a thread of the pool (parallel.h); inside it the rows of x run in tiles of
// x_tile_rows(k), each tile against every weight row of the unit, 4 rows at a time in
// registers (chunk_dots). Why: untiled, past ~100 rows the 8-bit x (k bytes a row) no
// longer stayed in L2 and was streamed from L3 once per output feature; tiled, a tile of x
// stays in L2 and the unit's weight rows (16 x 360-1632 bytes) in L1 while the tile runs.
// At a few rows (decode) there is one x tile and this is the plain row-by-row loop.
constexpr int64_t kOutTile = 16;
// At a few rows (decode) a unit is 256 output features: a unit's claim and its done count are
// two atomics on lines both threads write, and at 16 features (~6 KB of Q4_1) they were a
// visible part of a small projection's call (SmolLM2 Q4_1 at batch 1, 2-vCPU EPYC: the 30
// layers 5.0-6.7 -> 4.6-5.9 ms at 64). At 1B each unit is also one stream the prefetchers
// follow, and a thread's streams restart at every unit: 64 -> 256 features took the 1B
// Q4_K_M model's 16 layers from 21.5 to 19.1 ms a step (on 2 MiB pages; Zen 4, 2 threads).
// Past a few rows the cache tiles keep their 16 (the unit's weight rows stay in L1 while an
// x tile runs).
constexpr int64_t kDecodeTile = 256;
inline int64_t out_unit(int64_t rows) { return rows <= 4 ? kDecodeTile : kOutTile; }
#ifndef KVQ_XTILE_BYTES
#define KVQ_XTILE_BYTES (96 << 10)
#endif
#ifndef KVQ_XTILE_MAX
#define KVQ_XTILE_MAX 64  // `kvserve bench kernels --kernel qgemm --untiled` builds a huge one
#endif

inline int64_t x_tile_rows(int64_t k) {  // multiple of 4 in [4, 64]: its int8 rows in L2
  const int64_t r = int64_t{KVQ_XTILE_BYTES} / (k > 0 ? k : 1) / 4 * 4;
  return r < 4 ? 4 : r > int64_t{KVQ_XTILE_MAX} ? int64_t{KVQ_XTILE_MAX} : r;
}

template <int T>
void qgemv_rows(const QRows& x, int64_t rows, const uint8_t* w, const float* bias, int64_t n,
                float* out, int64_t out_stride, int mode, int num_threads) {
  const int64_t row_bytes = row_bytes_of(T, x.k);
  const bool gated = mode >= 2;
  const int64_t xt = x_tile_rows(x.k);
  const int64_t unit = out_unit(rows);
  kvpar::parallel_for((n + unit - 1) / unit, num_threads, [&](int64_t tile) {
    const int64_t o0 = tile * unit, o1 = o0 + unit < n ? o0 + unit : n;
    for (int64_t x0 = 0; x0 < rows; x0 += xt) {
      const int64_t x1 = x0 + xt < rows ? x0 + xt : rows;
      for (int64_t o = o0; o < o1; ++o) {
        // Software prefetch of the weight rows kPrefetchRows ahead (and of up's), on the
        // first x tile (the others find the unit's rows in cache): streamed from DRAM
        // without it, a decode step's weights came at ~6 GB/s, the loads waiting on memory
        // between short bursts of arithmetic.
        if (x0 == 0 && o + kPrefetchRows < n) {
          const uint8_t* ahead = w + (o + kPrefetchRows) * row_bytes;
          for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(ahead + at);
          if (gated) {
            const uint8_t* up_ahead = w + (n + o + kPrefetchRows) * row_bytes;
            for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(up_ahead + at);
          }
        }
        const float b = bias != nullptr ? bias[o] : 0.f;
        const float bu = bias != nullptr && gated ? bias[n + o] : 0.f;
        for (int64_t r0 = x0; r0 < x1; r0 += 4) {
          const int64_t cnt = x1 - r0 < 4 ? x1 - r0 : 4;
          float acc[4], up[4];
          chunk_dots<T>(w + o * row_bytes, x, r0, cnt, acc);
          if (!gated) {
            for (int64_t r = 0; r < cnt; ++r) {
              float* y = out + (r0 + r) * out_stride + o;
              *y = mode == 0 ? acc[r] + b : *y + acc[r] + b;
            }
            continue;
          }
          chunk_dots<T>(w + (n + o) * row_bytes, x, r0, cnt, up);
          for (int64_t r = 0; r < cnt; ++r) {
            const float g = acc[r] + b;
            out[(r0 + r) * out_stride + o] = (mode == 2 ? silu(g) : gelu_tanh(g)) * (up[r] + bu);
          }
        }
      }
    }
  });
}

#include "qtiles.h"

#include "qdequant.h"

#include "qhead.h"

// A type code with a kernel (a block type, or a tileable one + kTiledCode) and a valid k.
inline bool known_type(int type, int64_t k) {
  const int base = type >= kTiledCode ? type - kTiledCode : type;
  return base >= 0 && base < kNumTypes && !bad_k(base, k)
      && (type < kTiledCode || tileable(base));
}

}  // namespace

extern "C" {

// The n x k weight's rows (type t's blocks, the file's layout) as row tiles into dst (the
// same number of bytes). Returns 0, or 1 for a type without tiles, a bad k or n % 16 != 0.
// unpack != 0: the inverse (row tiles back into the file's rows). dst == src repacks in
// place: tile t holds the bytes of rows 16t .. 16t + 15 in both layouts, so one tile's rows
// are copied aside at a time (a load never holds a weight twice: freed copies of whole
// tensors stayed in the allocator's arenas, +36 MB resident on SmolLM2 Q4_1).
int kvserve_qtile_pack(const uint8_t* src, int type, int64_t n, int64_t k, uint8_t* dst,
                       int unpack) {
  if (type < 0 || type >= kNumTypes || !tileable(type) || bad_k(type, k) || n < 0
      || n % kTileCols != 0)
    return 1;
  const int64_t tile = kTileCols * row_bytes_of(type, k);
  auto f = [&](auto pack, auto un) {
    auto run = unpack ? un : pack;
    if (src != dst) return run(src, n, k, dst);
    std::vector<uint8_t> aside(static_cast<size_t>(tile));
    for (int64_t t = 0; t < n / kTileCols; ++t) {
      std::memcpy(aside.data(), src + t * tile, static_cast<size_t>(tile));
      run(aside.data(), kTileCols, k, dst + t * tile);
    }
  };
  with_type(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (is_k(T)) f(pack_tiles_k<T>, unpack_tiles_k<T>);
    else f(pack_tiles<T>, unpack_tiles<T>);
  });
  return 0;
}

// 1 where the build has the AVX-512 VNNI tile kernel (elsewhere tiles run a plain loop).
int kvserve_qtile_native() {
#ifdef KVQ_TILE512
  return 1;
#else
  return 0;
#endif
}

// Bit t set for each block type t whose tiles this build runs faster than the file's rows (the
// loader tiles those, qgemv.QGemv.tiles_pay): every tileable type on the AVX-512 VNNI kernel;
// on the AVX2 one (qtiles_avx2.h) Q4_0, Q4_1, Q5_0 and Q5_1: 2.0-2.4x the rows at 1 and 512
// rows of a 2048 x 2048 weight (Zen 4, x86-64-v3 build, 2 threads), and the 1B Q4_0 file's
// prefill 1.31x llama.cpp's AVX2 build. Not Q8_0: its tiles ran 1.4-1.7x its rows, but a Q8_0
// table is also the LM head's, whose float-x path on tiles (tile_rows16) has no AVX2 kernel
// yet. The K-quants since their decode runs Q4_K's direct kernel and no software prefetch
// (qtiles_k_avx2.h): the 1B files' batch-1 decode on tiles against rows 32-38 / 32 tok/s
// (Q4_K_M), 29-31 / 27 (Q5_K_M), 33-39 / 21-22 (Q6_K); their 512-token prefill 1.6-1.8x.
int kvserve_qtile_types() {
#if defined(KVQ_TILE512)
  int mask = 0;
  for (int t = 0; t < kNumTypes; ++t) mask |= tileable(t) ? 1 << t : 0;
  return mask;
#elif defined(KVQ_TILE256)
  int mask = 0;
  for (int t = 0; t < kNumTypes; ++t) mask |= tileable(t) && t != kQ8_0 ? 1 << t : 0;
  return mask;
#else
  return 0;
#endif
}

int kvserve_qgemv_abi_version() { return 9; }

// out[r, :n] = x[r] W^T + b (mode 0) or += (mode 1), W in Q8_0, x float32 kept in float (see
// row_dots_f). Returns 0, or 1 for a type other than Q8_0, a bad mode or k.
int kvserve_qgemv_f32x(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w,
                       int type, int64_t n, int64_t k, const float* bias, float* out,
                       int64_t out_stride, int mode, int num_threads) {
  if (type == kTiledCode + kQ8_0 && mode >= 0 && mode <= 1 && k > 0 && k % kQK == 0
      && rows >= 0 && n % kTileCols == 0) {
    tile_gemv16(x, x_stride, rows, w, n, k, bias, out, out_stride, mode, num_threads);
    return 0;
  }
  if (type != kQ8_0 || mode < 0 || mode > 1 || k <= 0 || k % kQK || rows < 0) return 1;
  f32x_rows(x, x_stride, rows, w, n, k, bias, out, out_stride, mode, num_threads);
  return 0;
}

// 2 where the build has the VNNI path, 1 the AVX2 one, 0 the plain C++ loop.
int kvserve_qgemv_isa() {
#if defined(KVQ_VNNI)
  return 2;
#elif defined(KVQ_AVX2)
  return 1;
#else
  return 0;
#endif
}

// x [rows, k] float32 (row stride x_stride, unit along k); w: n_w rows of k / 32 (K-quants:
// k / 256) blocks of `type` (n_w = n, or 2n for the gated modes); bias [n_w] or null; out
// [rows, n] (row stride out_stride). k must be a multiple of 32 (K-quants: 256). Returns 0, or
// 1 for a bad type, mode or k.
// A type of kTiledCode + t is a weight of block type t in row tiles (qtiles.h, qtiles_k.h),
// n a multiple of 16.
int kvserve_qgemv(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w, int type,
                  int64_t n, int64_t k, const float* bias, float* out, int64_t out_stride,
                  int mode, int num_threads) {
  const bool tiled = type >= kTiledCode;
  const int base = tiled ? type - kTiledCode : type;
  if (base < 0 || base >= kNumTypes || mode < 0 || mode > 3 || bad_k(base, k) || rows < 0
      || (tiled && (!tileable(base) || n % kTileCols != 0)))
    return 1;
  const int64_t nb = k / kQK;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  q.resize(static_cast<size_t>(rows * k));
  d.resize(static_cast<size_t>(rows * nb));
  s.resize(static_cast<size_t>(rows * nb));
  // x's rows quantized in chunks of 8 rows across the threads (a prefill's 512 rows of 1536
  // took ~1 ms on one); the buffers are the caller's thread_locals, by pointer
  int8_t* qp = q.data();
  float *dp = d.data(), *sp = s.data();
#ifdef KVQ_AVX2
  // the K-quants' x: one scale per 256 values, as the AVX2 row dot sums a super-block's
  // sub-blocks as integers; the same on tiles (AVX-512 reads it per block; elsewhere tiles
  // run the row dot), so every layout of one build computes the same product
  const int64_t group = is_k(base) ? 8 : 1;
#else
  const int64_t group = 1;
#endif
  kvpar::parallel_for((rows + 7) / 8, rows > 8 ? num_threads : 1, [&](int64_t c) {
    for (int64_t r = c * 8; r < rows && r < (c + 1) * 8; ++r)
      quantize_row(x + r * x_stride, k, qp + r * k, dp + r * nb, sp + r * nb, group);
  });
  QRows xr{qp, dp, sp, k, nb};
  if (tiled && base == kQ6_K) {
    thread_local std::vector<float> h;
    h.resize(static_cast<size_t>(rows * nb));
    half_sums(xr, rows, h.data());
    xr.h = h.data();
  }
  with_type(base, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if (tiled) tile_gemv<T>(xr, rows, w, bias, n, out, out_stride, mode, num_threads);
    else qgemv_rows<T>(xr, rows, w, bias, n, out, out_stride, mode, num_threads);
  });
  return 0;
}

// kvserve_qgemv (a[12] == 0) or kvserve_qgemv_f32x (a[12] != 0) with its arguments in one
// array (qgemv.BoundQGemv's: a call passes one pointer, ~2 us less than twelve arguments):
// x, x_stride, rows, w, type, n, k, bias, out, out_stride, mode, num_threads, float_x.
int kvserve_qgemv_packed(const int64_t* a) {
  auto f = [](int64_t v) { return reinterpret_cast<const float*>(v); };
  auto call = a[12] != 0 ? kvserve_qgemv_f32x : kvserve_qgemv;
  return call(f(a[0]), a[1], a[2], reinterpret_cast<const uint8_t*>(a[3]),
              static_cast<int>(a[4]), a[5], a[6], f(a[7]), reinterpret_cast<float*>(a[8]),
              a[9], static_cast<int>(a[10]), static_cast<int>(a[11]));
}

// The n x k weight as float32 into out [n, k] (the prefill path: a GEMM on the dequantized
// copy); values as gguf.quants' (see dequant_row).
int kvserve_qdequant(const uint8_t* w, int type, int64_t n, int64_t k, float* out,
                     int num_threads) {
  if (!known_type(type, k) || n < 0) return 1;
  dequant_any(w, type, k, nullptr, n, out, num_threads);
  return 0;
}

// The embedding lookup on a quantized table: rows ids[0..count) of the n x k table as float32
// into out [count, k], the others never read. Why: the tied table is also the LM head's
// weight, so one quantized copy serves both (SmolLM2's is 49152 x 576: 113 MB in float32, 30
// in Q8_0). Returns 0, or 1 for a bad type or k, 2 for an id outside 0..n-1.
int kvserve_qembed(const uint8_t* w, int type, int64_t n, int64_t k, const int64_t* ids,
                   int64_t count, float* out, int num_threads) {
  if (!known_type(type, k) || count < 0) return 1;
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= n) return 2;
  dequant_any(w, type, k, ids, count, out, num_threads);
  return 0;
}

}  // extern "C"
