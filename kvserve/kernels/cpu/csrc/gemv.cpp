// Small-batch fp32 matrix-vector products for the CPU: y = x W^T (+ b), for a few rows of x.
//
// Why: at batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
// weights once. MKL's and oneDNN's GEMMs are built for many rows; at one row they reached
// about half of what the CPU can read. Here OpenMP splits the output features across torch's
// threads (contiguous ranges, so each thread streams its own slab of W), each block of 4
// weight rows is read from memory once and then reused from L1 for every row of x, and the
// epilogues a decoder needs are fused: bias, the residual add (y written into the residual
// stream), and the gated MLP's act(gate) * up on a [gate; up] weight.
//
// Two more per-layer passes are folded into the call, because at batch 1 each separate torch
// op costs more in dispatch than in arithmetic: the RMSNorm of x before the projection
// (`norm_w`: x_i * rsqrt(mean(x^2) + eps) * w_i, statistics in float32 as Hugging Face's), and
// rotate-half RoPE over the first `rope_cols` output features after it (the q and k heads of
// a fused qkv projection; cos | sin halves per row in `cos_sin`).
//
// Built at first use by kvserve/kernels/cpu/cpu_ext.py (-O3 -march=native -fopenmp) and called
// through ctypes with raw pointers (kvserve/kernels/cpu/gemv.py). Plain C++: the inner loops are
// `omp simd` reductions the compiler vectorizes for whatever the CPU has (AVX2, AVX-512).
//
// Layout:
//   x    [rows, k] float32, row stride x_stride (elements), unit stride along k
//   w    [n_w, k] float32, contiguous (n_w = n, or 2n for the gated modes: [gate; up])
//   bias [n_w] float32 or null
//   out  [rows, n] float32, row stride out_stride, unit stride along n
// Modes: 0 out = xW^T + b; 1 out += xW^T + b; 2 out = silu(g) * u; 3 out = gelu_tanh(g) * u,
// where g, u are the gate and up halves of xW^T + b.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rms.h"
#include "rope.h"

namespace {

constexpr int64_t kBlock = 4;  // weight rows per work item

#ifndef KVSERVE_LANES
#define KVSERVE_LANES 16
#endif
constexpr int kLanes = KVSERVE_LANES;  // floats per step: 16 = one 64-byte line of each row
#ifndef KVSERVE_PREFETCH_BLOCKS
#define KVSERVE_PREFETCH_BLOCKS 1
#endif

// acc[j] = dot(x, w + j * k) for j < 4. Lane-wise partial sums (no loop-carried reduction, so
// the compiler keeps them in vector registers), one cache line of each row per step, and a
// software prefetch of the same line KVSERVE_PREFETCH_BLOCKS blocks ahead: the hardware
// prefetcher alone left the loads waiting on L3.
inline void dot4(const float* __restrict x, const float* __restrict w, int64_t k,
                 float* acc) {
  const float* __restrict w0 = w;
  const float* __restrict w1 = w + k;
  const float* __restrict w2 = w + 2 * k;
  const float* __restrict w3 = w + 3 * k;
  const int64_t ahead = KVSERVE_PREFETCH_BLOCKS * kBlock * k;
  float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
  int64_t i0 = 0;
  for (; i0 + kLanes <= k; i0 += kLanes) {
    for (int l = 0; l < kLanes; l += 16) {
      __builtin_prefetch(w0 + i0 + l + ahead);
      __builtin_prefetch(w1 + i0 + l + ahead);
      __builtin_prefetch(w2 + i0 + l + ahead);
      __builtin_prefetch(w3 + i0 + l + ahead);
    }
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float xv = x[i0 + j];
      a0[j] += xv * w0[i0 + j];
      a1[j] += xv * w1[i0 + j];
      a2[j] += xv * w2[i0 + j];
      a3[j] += xv * w3[i0 + j];
    }
  }
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int j = 0; j < kLanes; ++j) {
    s0 += a0[j];
    s1 += a1[j];
    s2 += a2[j];
    s3 += a3[j];
  }
  for (int64_t i = i0; i < k; ++i) {
    s0 += x[i] * w0[i];
    s1 += x[i] * w1[i];
    s2 += x[i] * w2[i];
    s3 += x[i] * w3[i];
  }
  acc[0] = s0;
  acc[1] = s1;
  acc[2] = s2;
  acc[3] = s3;
}

inline float dot1(const float* __restrict x, const float* __restrict w, int64_t k) {
  float a = 0.f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < k; ++i) a += x[i] * w[i];
  return a;
}

// acc[j] = dot(x, W[o0 + j]) for j < cnt (cnt <= 4)
inline void dots(const float* x, const float* w, int64_t o0, int64_t cnt, int64_t k,
                 float* acc) {
  if (cnt == kBlock) {
    dot4(x, w + o0 * k, k, acc);
  } else {
    for (int64_t j = 0; j < cnt; ++j) acc[j] = dot1(x, w + (o0 + j) * k, k);
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

inline float gelu_tanh(float g) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * g * (1.f + std::tanh(c * (g + 0.044715f * g * g * g)));
}

}  // namespace

extern "C" {

int kvserve_gemv_abi_version() { return 5; }

}  // extern "C"

namespace {

// out[r, :n] (=, or += for mode 1) x[r] W^T + b, or (modes 2 and 3, W = [gate; up]) act(x
// gate^T) * (x up^T), for the `rows` rows of x. Its loop is an orphaned `omp for`: called
// inside a parallel region the threads share the weight blocks (and meet at its end), called
// outside one it runs on the calling thread.
void gemv_rows(const float* x, int64_t x_stride, int64_t rows, const float* w,
               const float* bias, int64_t n, int64_t k, float* out, int64_t out_stride,
               int mode) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const bool gated = mode >= 2;
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t o0 = blk * kBlock;
    const int64_t cnt = n - o0 < kBlock ? n - o0 : kBlock;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * x_stride;
      float* yr = out + r * out_stride + o0;
      float acc[kBlock];
      dots(xr, w, o0, cnt, k, acc);
      if (bias != nullptr)
        for (int64_t j = 0; j < cnt; ++j) acc[j] += bias[o0 + j];
      if (!gated) {
        if (mode == 0)
          for (int64_t j = 0; j < cnt; ++j) yr[j] = acc[j];
        else
          for (int64_t j = 0; j < cnt; ++j) yr[j] += acc[j];
        continue;
      }
      float up[kBlock];
      dots(xr, w, n + o0, cnt, k, up);
      if (bias != nullptr)
        for (int64_t j = 0; j < cnt; ++j) up[j] += bias[n + o0 + j];
      if (mode == 2)
        for (int64_t j = 0; j < cnt; ++j) yr[j] = silu(acc[j]) * up[j];
      else
        for (int64_t j = 0; j < cnt; ++j) yr[j] = gelu_tanh(acc[j]) * up[j];
    }
  }
}

}  // namespace

extern "C" {

// n: output features (gate rows in the gated modes). norm_w: RMSNorm x first (null: no);
// cos_sin: RoPE over out[:, 0:rope_cols) after (null: no; modes 0 and 1 only). Returns 0, or 1
// for a bad mode or RoPE layout.
int kvserve_gemv_f32(const float* x, int64_t x_stride, int64_t rows, const float* w,
                     const float* bias, int64_t n, int64_t k, float* out, int64_t out_stride,
                     int mode, int num_threads, const float* norm_w, float eps,
                     const float* cos_sin, int64_t cs_stride, int64_t rope_cols,
                     int64_t head_dim) {
  if (mode < 0 || mode > 3) return 1;
  if (cos_sin != nullptr &&
      (mode > 1 || head_dim <= 0 || head_dim % 2 || rope_cols % head_dim || rope_cols > n))
    return 1;
  thread_local std::vector<float> normed;
  if (norm_w != nullptr) {
    normed.resize(static_cast<size_t>(rows * k));
    rms_norm_rows(x, x_stride, rows, k, norm_w, eps, normed.data(), k);
    x = normed.data();
    x_stride = k;
  }
#pragma omp parallel num_threads(num_threads)
  gemv_rows(x, x_stride, rows, w, bias, n, k, out, out_stride, mode);
  if (cos_sin != nullptr) rope_rows(out, out_stride, rows, rope_cols, head_dim, cos_sin, cs_stride);
  return 0;
}

// The rest of a decoder layer after attention, at a few rows, in one parallel region:
// residual += o W_o^T + b_o; x = RMSNorm(residual); m = act(x gate^T + b_g) * (x up^T + b_u);
// residual += m W_d^T + b_d. Three GEMV calls and their Python around them become one call
// (threads meet at a barrier between phases instead of forking and joining three times).
// a: o, o_stride, rows, residual, r_stride, w_o, b_o, hidden, q_size, norm_w, eps bits,
// w_gu, b_gu, inter, mode (2 SiLU, 3 GELU-tanh), w_d, b_d, m (scratch [rows, inter]),
// num_threads.
int kvserve_gemv_mlp_block(const int64_t* a) {
  auto f = [](int64_t v) { return reinterpret_cast<const float*>(v); };
  const float* o = f(a[0]);
  const int64_t o_stride = a[1], rows = a[2], r_stride = a[4], hidden = a[7], q_size = a[8];
  float* residual = reinterpret_cast<float*>(a[3]);
  float eps;
  const int32_t bits = static_cast<int32_t>(a[10]);
  std::memcpy(&eps, &bits, sizeof eps);
  const int64_t inter = a[13];
  const int mode = static_cast<int>(a[14]);
  float* m = reinterpret_cast<float*>(a[17]);
  if (mode != 2 && mode != 3) return 1;
  thread_local std::vector<float> normed;
  normed.resize(static_cast<size_t>(rows * hidden));
  float* x = normed.data();
#pragma omp parallel num_threads(static_cast<int>(a[18]))
  {
    gemv_rows(o, o_stride, rows, f(a[5]), f(a[6]), hidden, q_size, residual, r_stride, 1);
#pragma omp single
    rms_norm_rows(residual, r_stride, rows, hidden, f(a[9]), eps, x, hidden);
    gemv_rows(x, hidden, rows, f(a[11]), f(a[12]), inter, hidden, m, inter, mode);
    gemv_rows(m, inter, rows, f(a[15]), f(a[16]), hidden, inter, residual, r_stride, 1);
  }
  return 0;
}

int kvserve_gemv_packed(const int64_t* a) {
  float eps;
  const int32_t bits = static_cast<int32_t>(a[12]);
  std::memcpy(&eps, &bits, sizeof eps);
  auto f = [](int64_t v) { return reinterpret_cast<const float*>(v); };
  return kvserve_gemv_f32(f(a[0]), a[1], a[2], f(a[3]), f(a[4]), a[5], a[6],
                          reinterpret_cast<float*>(a[7]), a[8], static_cast<int>(a[9]),
                          static_cast<int>(a[10]), f(a[11]), eps, f(a[13]), a[14], a[15],
                          a[16]);
}

// A decode step's decoder layers at a few rows, one C call for all of them (cpu_decode.py): per
// layer the bound qkv GEMV (input norm, RoPE) into the qkv scratch its arguments name, the paged
// decode kernel (its arguments, prepared for the step, read q and the new K/V from that
// scratch and write the attention output), then the MLP block on the residual stream. The
// Python between these calls was ~10% of a batch-1 step.
// a: n_layers, rows, hidden (residual [rows, H]), hidden_stride, cos_sin, cs_stride,
// qkv_args (int64_t* per layer: BoundGemv arrays), paged_args (void* per layer), mlp_args
// (int64_t* per layer: BoundMLPBlock arrays), paged_fn. A non-zero return leaves the layers
// before the failing one done (their K/V stored, hidden updated), as the layer path would have
// left them; the arguments are checked when bound, so it does not happen in practice.
int kvserve_decode_layers(const int64_t* a) {
  using paged_fn_t = int (*)(const void*);
  const int64_t n_layers = a[0], rows = a[1], hidden_stride = a[3];
  const int64_t hidden = a[2], cos_sin = a[4], cs_stride = a[5];
  int64_t* const* qkv = reinterpret_cast<int64_t* const*>(a[6]);
  const void* const* paged = reinterpret_cast<const void* const*>(a[7]);
  int64_t* const* mlp = reinterpret_cast<int64_t* const*>(a[8]);
  const paged_fn_t paged_fn = reinterpret_cast<paged_fn_t>(a[9]);
  for (int64_t l = 0; l < n_layers; ++l) {
    int64_t* q = qkv[l];
    q[0] = hidden, q[1] = hidden_stride, q[2] = rows, q[13] = cos_sin, q[14] = cs_stride;
    if (kvserve_gemv_packed(q) != 0) return 1;
    if (paged_fn(paged[l]) != 0) return 2;
    int64_t* m = mlp[l];
    m[2] = rows, m[3] = hidden, m[4] = hidden_stride;
    if (kvserve_gemv_mlp_block(m) != 0) return 3;
  }
  return 0;
}

// layers.norm.rms_norm on rows of x into out, and the RoPE of the first `cols` columns of y in
// place: the element-wise work around the GEMMs of the layers that run MKL or oneDNN (more than
// gemv's few rows), which as torch ops cost ~0.2 ms per layer at 64 rows (several passes and
// dispatches each) against ~10 us here. Rows are shared out across threads.
// Threads from 128K elements (a prefill's rows): a batch-32 decode's 32 x 576 take ~5 us on
// one thread, less than a team's wake-up, and the team then spun on the cores the quantized
// kernels' pool needed.
constexpr int64_t kThreadElems = int64_t{1} << 17;

int kvserve_rms_norm_f32(const float* x, int64_t x_stride, int64_t rows, int64_t k,
                         const float* w, float eps, float* out, int64_t out_stride,
                         int num_threads) {
  if (k <= 0 || rows < 0) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= kThreadElems)
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_rows(x + r * x_stride, x_stride, 1, k, w, eps, out + r * out_stride, out_stride);
  return 0;
}

int kvserve_rope_f32(float* y, int64_t y_stride, int64_t rows, int64_t cols, int64_t head_dim,
                     const float* cos_sin, int64_t cs_stride, int num_threads) {
  if (head_dim <= 0 || head_dim % 2 || cols % head_dim) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= kThreadElems)
  for (int64_t r = 0; r < rows; ++r)
    rope_rows(y + r * y_stride, y_stride, 1, cols, head_dim, cos_sin + r * cs_stride, cs_stride);
  return 0;
}

// Row argmax for the sampler's greedy rows: the first maximum, or the first NaN where a row
// has one (NumPy's and torch's rule). Why here: NumPy's argmax runs on one thread, ~0.6 ms of
// a batch-64 step over 64 x 32k logits; rows split across threads, one pass each (a row is
// scanned again only to find its first NaN).
int64_t argmax_row(const float* p, int64_t n) {
  // 64 independent lanes: each keeps its running maximum, the block where it first reached
  // it, and whether it saw a NaN (registers, one pass, no dependent chain)
  float m[64];
  int32_t at[64] = {};
  int32_t nan[64] = {};
  for (float& v : m) v = -INFINITY;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
#pragma omp simd
    for (int j = 0; j < 64; ++j) {
      const float v = p[i + j];
      const bool more = v > m[j];
      m[j] = more ? v : m[j];
      at[j] = more ? static_cast<int32_t>(i) : at[j];
      nan[j] |= v != v;
    }
  }
  float top = -INFINITY;
  int64_t best = n;  // none yet
  int any_nan = 0;
  for (int j = 0; j < 64; ++j) any_nan |= nan[j];
  for (int64_t t = i; t < n; ++t) any_nan |= p[t] != p[t];
  if (any_nan) {
    for (int64_t t = 0; t < n; ++t)
      if (p[t] != p[t]) return t;
  }
  for (int j = 0; j < 64; ++j) {  // the first position of the maximum over the lanes
    const int64_t pos = static_cast<int64_t>(at[j]) + j;
    if (m[j] > top || (m[j] == top && pos < best)) {
      top = m[j];
      best = pos;
    }
  }
  for (; i < n; ++i)
    if (p[i] > top || best == n) {
      top = p[i];
      best = i;
    }
  return best == n ? 0 : best;
}

int kvserve_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t stride,
                       int64_t* out, int num_threads) {
  if (rows < 0 || cols <= 0) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 2)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, cols);
  return 0;
}

// Sum of p[0..n): reads a buffer once on num_threads threads (the benchmarks' read-bandwidth
// probe: a GEMV at batch 1 can go no faster than this over its weights).
double kvserve_read_sum_f32(const float* p, int64_t n, int num_threads) {
  double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
  {
    float acc[64] = {};  // 64 independent lanes: stays in registers, no dependency chain
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n / 64; ++i) {
      const float* q = p + i * 64;
      __builtin_prefetch(q + 1024);
      __builtin_prefetch(q + 1040);
      __builtin_prefetch(q + 1056);
      __builtin_prefetch(q + 1072);
#pragma omp simd
      for (int j = 0; j < 64; ++j) acc[j] += q[j];
    }
    for (int j = 0; j < 64; ++j) total += acc[j];
  }
  for (int64_t i = n / 64 * 64; i < n; ++i) total += p[i];
  return total;
}

}  // extern "C"
