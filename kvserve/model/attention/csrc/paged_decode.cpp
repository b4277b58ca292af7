// Decode attention over a paged KV cache, for the CPU: one query token per sequence, read
// straight from the cache blocks its block table names (no gather into a new tensor).
//
// Built at first use by kvserve/model/attention/cpu_paged.py with the machine's compiler
// (-O3 -march=native -fopenmp) and called through ctypes with raw pointers: no torch headers,
// so it compiles in about a second. OpenMP resolves to the libgomp torch has already loaded,
// so the kernel shares torch's thread count (torch.set_num_threads).
//
// Layout (what kvserve/kv/tensors.py allocates and torch_backend.py reads):
//   q        [n, H, D] float32, row stride q_stride (elements) between sequences
//   k, v     [num_blocks, block_size, Hkv, D] float32 or bfloat16 (raw uint16 bits)
//   tables   [n, table_stride] int64 block ids; lens [n] int64 tokens to attend to
//   out      [n, H, D] float32, contiguous
// Query head h reads KV head h / (H / Hkv) (grouped-query attention). Softmax runs online
// (running max and sum per head, flash-attention style) in float32, block by block.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxGroupDim = 16384;  // (H / Hkv) * D floats of accumulator per work item
constexpr int kMaxBlock = 256;       // tokens per cache block

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename KV>
void decode(const float* q, int64_t q_stride, const KV* k, const KV* v, const int64_t* tables,
            int64_t table_stride, const int64_t* lens, float* out, int64_t n, int64_t H,
            int64_t Hkv, int64_t D, int64_t block_size, float scale) {
  const int64_t G = H / Hkv;
  const int64_t token_stride = Hkv * D;
  const int64_t block_stride = block_size * token_stride;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      float acc[kMaxGroupDim];
      float qs[kMaxGroupDim];
      float scores[kMaxBlock];
      float m[64], l[64];
      const float* qrow = q + s * q_stride + hk * G * D;
      for (int64_t g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          qs[g * D + d] = qrow[g * D + d] * scale;
          acc[g * D + d] = 0.f;
        }
      }
      const int64_t len = lens[s];
      const int64_t* table = tables + s * table_stride;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t base = table[start / block_size] * block_stride + hk * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float bmax = -INFINITY;
          for (int64_t j = 0; j < count; ++j) {
            const KV* kj = k + base + j * token_stride;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kj, d);
            scores[j] = dot;
            bmax = dot > bmax ? dot : bmax;
          }
          const float m_new = bmax > m[g] ? bmax : m[g];
          const float rescale = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first block
          float* ag = acc + g * D;
          float sum = 0.f;
          for (int64_t j = 0; j < count; ++j) {
            scores[j] = std::exp(scores[j] - m_new);
            sum += scores[j];
          }
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
          for (int64_t j = 0; j < count; ++j) {
            const KV* vj = v + base + j * token_stride;
            const float p = scores[j];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vj, d);
          }
          l[g] = l[g] * rescale + sum;
          m[g] = m_new;
        }
      }
      float* orow = out + (s * H + hk * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) orow[g * D + d] = acc[g * D + d] * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

int kvserve_paged_decode_abi_version() { return 1; }

// kv_dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 when a size is beyond the kernel's
// fixed buffers (the caller checks these first and never gets here).
int kvserve_paged_decode(const float* q, int64_t q_stride, const void* k, const void* v,
                         int kv_dtype, const int64_t* tables, int64_t table_stride,
                         const int64_t* lens, float* out, int64_t n, int64_t H, int64_t Hkv,
                         int64_t D, int64_t block_size, float scale) {
  if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > 64 || (H / Hkv) * D > kMaxGroupDim ||
      block_size > kMaxBlock)
    return -1;
  if (kv_dtype == 0)
    decode(q, q_stride, static_cast<const float*>(k), static_cast<const float*>(v), tables,
           table_stride, lens, out, n, H, Hkv, D, block_size, scale);
  else
    decode(q, q_stride, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
           tables, table_stride, lens, out, n, H, Hkv, D, block_size, scale);
  return 0;
}

}  // extern "C"
