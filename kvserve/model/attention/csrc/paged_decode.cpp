// Decode attention over a paged KV cache, for the CPU: one query token per sequence, read
// straight from the cache blocks its block table names (no gather into a new tensor), in any
// storage format of kvserve/kv/quant.py: float32, bfloat16, float16, fp8 (e4m3, e5m2), int8
// and int4 (KIVI). Quantized rows are decoded one token row at a time into a D-float buffer
// that stays in L1 and is used by every query head of the group: no dequantized copy of the
// cache is ever written.
//
// Built at first use by kvserve/model/attention/cpu_paged.py with the machine's compiler
// (-O3 -march=native -fopenmp) and called through ctypes with raw pointers: no torch headers,
// so it compiles in about a second. OpenMP resolves to the libgomp torch has already loaded,
// so the kernel shares torch's thread count (torch.set_num_threads). Plain C++ loops only (the
// compiler vectorizes them for whatever the CPU has) and GCC/Clang's __builtin_prefetch: no
// intrinsics, no instruction set assumed.
//
// Layout (what kvserve/kv/quant.py's codecs allocate, per layer):
//   q        [n, H, D] float32, row stride q_stride (elements) between sequences
//   k, v     [num_blocks, block_size, Hkv, D] float32 / bfloat16 / float16 (raw bits) / fp8
//            bytes / int8 codes; int4: [num_blocks, block_size, Hkv, D/2] bytes (channel 2i in
//            the low nibble, 2i+1 in the high one)
//   k_sz     int8: [num_blocks, block_size, Hkv, groups, 2] fp16 (scale, zero) per token, head
//            and group of D/groups channels; int4: [num_blocks, Hkv, D, 2] (keys per channel
//            over the block's tokens)
//   v_sz     int8 and int4: [num_blocks, block_size, Hkv, groups, 2] fp16
//   k_res    int4: the KIVI residual [rows, block_size, Hkv, D] (float32/bfloat16/float16) of
//            the blocks still filling; res_rows [n, table_stride] int64, the row of each table
//            entry, -1 = read the codes (null: none)
//   tables   [n, table_stride] int64 block ids; starts [n] int64 first visible key position
//            (sliding windows; null: 0); lens [n] int64 tokens to attend to
//   out      [n, H, D] float32, contiguous
//   new_k, new_v  (float kinds, optional) the step's new K/V row per sequence, [n, Hkv, D] in
//            the cache's own type, row strides new_k_stride / new_v_stride (elements): each is
//            stored at position lens[s] - 1 of its sequence before that sequence is read
//            (saves the caller a scatter per layer; null: the caller stored them)
// Query head h reads KV head h / (H / Hkv) (grouped-query attention). Softmax runs online
// (running max and sum per head, flash-attention style) in float32, block by block. Table
// entries before starts[s] / block_size and past the length are never read (NULL_BLOCK there
// is fine).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

constexpr int kMaxGroup = 64;        // query heads per KV head
constexpr int kMaxGroupDim = 16384;  // (H / Hkv) * D floats of accumulator per work item
constexpr int kMaxBlock = 256;       // tokens per cache block
constexpr int kMaxDim = 1024;        // head_dim of a decoded row

enum Kind : int32_t { F32 = 0, BF16 = 1, F16 = 2, FP8_E4M3 = 3, FP8_E5M2 = 4, INT8 = 5, INT4 = 6 };

struct Args {
  const float* q;
  const void* k;
  const void* v;
  const uint16_t* k_sz;
  const uint16_t* v_sz;
  const void* k_res;
  const int64_t* res_rows;
  const int64_t* tables;
  const int64_t* starts;
  const int64_t* lens;
  float* out;
  int64_t q_stride, table_stride, n, H, Hkv, D, block_size, groups;
  int32_t kind, res_kind;
  float scale, k_scale, v_scale;
  const void* new_k;
  const void* new_v;
  int64_t new_k_stride, new_v_stride;
};

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

// q . k over D floats: sixteen lanes of partial sums (a generic 16-float vector, which the
// compiler maps onto whatever registers the CPU has: one AVX-512 register, two AVX2 ones),
// reduced by halving with vector adds. Why not `omp simd reduction`: GCC summed its 16 lanes
// as one chain of dependent scalar adds through the stack, per dot product, which was the
// kernel's largest cost at batch 1 and ~15% of it at batch 64.
typedef float v16f __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__clang__) || __GNUC__ >= 12
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline float hsum(v16f x) {
  const v8f a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#else  // GCC < 12 has no __builtin_shufflevector: full-width shuffles (~8% slower here)
typedef int32_t v16i __attribute__((vector_size(64)));

inline float hsum(v16f x) {
  x += __builtin_shuffle(x, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}
#endif

inline float dot(const float* q, const float* k, int64_t D) {
  v16f acc = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc += load16(q + d) * load16(k + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += q[d] * k[d];
  return s;
}

// Ask for one block's rows of one KV head (`rows` rows of `row_bytes` every `stride` bytes)
// before they are needed. Why: a block's rows are a new address stream the hardware
// prefetcher has not seen, and in a running engine they come from DRAM, not cache (the weights
// and the other layers' KV pass through the cache between two reads of one layer): without
// this the kernel stalled on the K and V loads for ~60% of its time at batch 64.
inline void prefetch_rows(const char* p, int64_t rows, int64_t row_bytes, int64_t stride) {
  for (int64_t t = 0; t < rows; ++t, p += stride)
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

template <int K>
void decode(const Args& a) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D, bs = a.block_size, groups = a.groups;
  const int64_t G = H / Hkv;
  // Elements (bytes for int4 codes) per token row and per block of the K/V data.
  const int64_t row_width = K == INT4 ? D / 2 : D;
  const int64_t token_stride = Hkv * row_width;
  const int64_t block_stride = bs * token_stride;
  const int64_t sz_token = Hkv * groups * 2;  // fp16 per token of the per-token scales
  const float q_mul = a.scale * a.k_scale;    // fp8's per-layer scales fold into q and out
  constexpr int64_t esize = K == F32 ? 4 : (K == BF16 || K == F16) ? 2 : 1;  // bytes
  // Work items: one sequence with all its KV heads when there are enough sequences to share
  // out: a head's rows sit next to the other heads' in every block (same pages, neighbouring
  // lines that the hardware prefetchers bring along), so the later heads of an item find part
  // of theirs in cache (batch 64 x ~200 tokens: 10.0 -> 8.8 ms of attention per step); else
  // one (sequence, KV head) pair, so that a single sequence still uses every thread.
  const int64_t per_item = a.n >= 4 * omp_get_max_threads() ? Hkv : 1;
  const int64_t parts = Hkv / per_item;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < a.n * parts; ++item) {
    const int64_t s = item / parts;
    const int64_t hk0 = item % parts * per_item;
    if constexpr (K == F32 || K == BF16 || K == F16) {
      if (a.new_k) {  // this item's heads of the sequence's new token, then read them
        const int64_t pos = a.lens[s] - 1;
        const int64_t at = a.tables[s * a.table_stride + pos / bs] * block_stride +
                           pos % bs * token_stride + hk0 * row_width;
        const int64_t bytes = per_item * row_width * esize;
        std::memcpy(static_cast<char*>(const_cast<void*>(a.k)) + at * esize,
                    static_cast<const char*>(a.new_k) + (s * a.new_k_stride + hk0 * D) * esize,
                    bytes);
        std::memcpy(static_cast<char*>(const_cast<void*>(a.v)) + at * esize,
                    static_cast<const char*>(a.new_v) + (s * a.new_v_stride + hk0 * D) * esize,
                    bytes);
      }
    }
    for (int64_t hk = hk0; hk < hk0 + per_item; ++hk) {
      float acc[kMaxGroupDim];
      float qs[kMaxGroupDim];
      float scores[kMaxGroup * kMaxBlock];
      float m[kMaxGroup], l[kMaxGroup];
      float kbuf[kMaxDim], vbuf[kMaxDim];
      float ks[kMaxDim], kz[kMaxDim];  // int4: the block's per-channel key scale and zero
      const float* qrow = a.q + s * a.q_stride + hk * G * D;
      for (int64_t g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t at = K == INT4 ? nibble_order(d, D) : d;
          qs[g * D + at] = qrow[g * D + d] * q_mul;
          acc[g * D + d] = 0.f;
        }
      }
      const int64_t len = a.lens[s];
      const int64_t first = a.starts ? a.starts[s] : 0;
      const int64_t* table = a.tables + s * a.table_stride;
      for (int64_t b = first / bs; b * bs < len; ++b) {
        const int64_t lo = b * bs < first ? first - b * bs : 0;
        const int64_t hi = len - b * bs < bs ? len - b * bs : bs;
        const int64_t count = hi - lo;
        if (count <= 0) continue;
        const int64_t block = table[b];
        const int64_t base = block * block_stride + hk * row_width;
        // The next block's rows of this head, asked for one row per row used here (a burst
        // of a whole block fills the line-fill buffers and stalls on the prefetches).
        const char* next_k = nullptr;
        const char* next_v = nullptr;
        if ((b + 1) * bs < len) {
          const int64_t next = (table[b + 1] * block_stride + hk * row_width) * esize;
          next_k = static_cast<const char*>(a.k) + next;
          next_v = static_cast<const char*>(a.v) + next;
        }
        const int64_t row_bytes = row_width * esize, row_stride = token_stride * esize;
        // rows of the next block to ask for per row of this one (all of it by the last row)
        const int64_t per_row = (bs + count - 1) / count;
        const int64_t res_row = (K == INT4 && a.res_rows) ? a.res_rows[s * a.table_stride + b]
                                                          : -1;
        if constexpr (K == INT4) {
          if (res_row < 0) {
            const uint16_t* sz = a.k_sz + (block * Hkv + hk) * D * 2;
            for (int64_t d = 0; d < D; ++d) {
              ks[nibble_order(d, D)] = f16_to_float(sz[2 * d]);
              kz[nibble_order(d, D)] = f16_to_float(sz[2 * d + 1]);
            }
          }
        }
        // scores[g * count + j] = q_g . k_j for the block's visible tokens.
        for (int64_t j = 0; j < count; ++j) {
          const int64_t t = lo + j;
          const int64_t off = base + t * token_stride;
          if (next_k && j * per_row < bs)
            prefetch_rows(next_k + j * per_row * row_stride,
                          std::min(per_row, bs - j * per_row), row_bytes, row_stride);
          const float* krow;
          if constexpr (K == F32 || K == BF16 || K == F16) {
            krow = float_row<K>(a.k, off, D, kbuf);
          } else if constexpr (K == FP8_E4M3 || K == FP8_E5M2) {
            const uint8_t* c = static_cast<const uint8_t*>(a.k) + off;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d)
              kbuf[d] = K == FP8_E4M3 ? e4m3_to_float(c[d]) : e5m2_to_float(c[d]);
            krow = kbuf;
          } else if constexpr (K == INT8) {
            affine_row<false>(static_cast<const uint8_t*>(a.k) + off,
                              a.k_sz + (block * bs + t) * sz_token + hk * groups * 2, D, groups,
                              kbuf);
            krow = kbuf;
          } else {  // INT4 keys: per channel over the block, or the residual row
            if (res_row >= 0) {  // exact keys in channel order: into nibble order
              const float* r = residual_row(a.res_kind, a.k_res,
                                            ((res_row * bs + t) * Hkv + hk) * D, D, vbuf);
              for (int64_t d = 0; d < D; ++d) kbuf[nibble_order(d, D)] = r[d];
            } else {
              const uint8_t* c = static_cast<const uint8_t*>(a.k) + off;
              const int64_t half = D / 2;
#pragma omp simd
              for (int64_t i = 0; i < half; ++i) {
                kbuf[i] = static_cast<float>(c[i] & 0x0f) * ks[i] + kz[i];
                kbuf[half + i] = static_cast<float>(c[i] >> 4) * ks[half + i] + kz[half + i];
              }
            }
            krow = kbuf;
          }
          for (int64_t g = 0; g < G; ++g) scores[g * count + j] = dot(qs + g * D, krow, D);
        }
        // Online softmax: rescale what the earlier blocks accumulated.
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores + g * count;
          float bmax = -INFINITY;
          for (int64_t j = 0; j < count; ++j) bmax = sg[j] > bmax ? sg[j] : bmax;
          const float m_new = bmax > m[g] ? bmax : m[g];
          const float rescale = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first block
          float sum = 0.f;
          for (int64_t j = 0; j < count; ++j) {
            sg[j] = std::exp(sg[j] - m_new);
            sum += sg[j];
          }
          float* ag = acc + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
          l[g] = l[g] * rescale + sum;
          m[g] = m_new;
        }
        for (int64_t j = 0; j < count; ++j) {
          const int64_t t = lo + j;
          const int64_t off = base + t * token_stride;
          if (next_v && j * per_row < bs)
            prefetch_rows(next_v + j * per_row * row_stride,
                          std::min(per_row, bs - j * per_row), row_bytes, row_stride);
          const float* vrow;
          if constexpr (K == F32 || K == BF16 || K == F16) {
            vrow = float_row<K>(a.v, off, D, vbuf);
          } else if constexpr (K == FP8_E4M3 || K == FP8_E5M2) {
            const uint8_t* c = static_cast<const uint8_t*>(a.v) + off;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d)
              vbuf[d] = K == FP8_E4M3 ? e4m3_to_float(c[d]) : e5m2_to_float(c[d]);
            vrow = vbuf;
          } else {
            affine_row<K == INT4>(static_cast<const uint8_t*>(a.v) + off,
                                  a.v_sz + (block * bs + t) * sz_token + hk * groups * 2, D,
                                  groups, vbuf);
            vrow = vbuf;
          }
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * count + j];
            float* ag = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vrow[d];
          }
        }
      }
      float* orow = a.out + (s * H + hk * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? a.v_scale / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d)
          orow[g * D + d] = acc[g * D + (K == INT4 ? nibble_order(d, D) : d)] * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

int kvserve_paged_decode_abi_version() { return 3; }

// Returns 0, or -1 when a size is beyond the kernel's fixed buffers or the format is unknown
// (the caller checks these first and never gets here).
int kvserve_paged_decode(const Args* a) {
  const int64_t Hkv = a->Hkv;
  if (Hkv <= 0 || a->H % Hkv != 0 || a->H / Hkv > kMaxGroup ||
      (a->H / Hkv) * a->D > kMaxGroupDim || a->D > kMaxDim || a->block_size > kMaxBlock ||
      a->block_size <= 0)
    return -1;
  if (a->new_k && (a->kind != F32 && a->kind != BF16 && a->kind != F16 || !a->new_v))
    return -1;
  if ((a->kind == INT8 || a->kind == INT4) && (a->groups <= 0 || a->D % a->groups != 0 ||
                                               (a->kind == INT4 && (a->D / a->groups) % 2 != 0)))
    return -1;
  switch (a->kind) {
    case F32: decode<F32>(*a); return 0;
    case BF16: decode<BF16>(*a); return 0;
    case F16: decode<F16>(*a); return 0;
    case FP8_E4M3: decode<FP8_E4M3>(*a); return 0;
    case FP8_E5M2: decode<FP8_E5M2>(*a); return 0;
    case INT8: decode<INT8>(*a); return 0;
    case INT4: decode<INT4>(*a); return 0;
    default: return -1;
  }
}

}  // extern "C"
