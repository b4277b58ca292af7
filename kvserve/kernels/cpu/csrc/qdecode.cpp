// The one-call decode step on block-quantized weights: every decoder layer of a batch-1..4
// decode step in one C++ call, each layer
//   x = RMSNorm(h); qkv = x W_qkv^T + b; RoPE(q, k); attention (the paged kernel: store k/v,
//   attend q); h += o W_o^T + b; x = RMSNorm(h); m = act(x gate^T) * (x up^T); h += m W_d^T
// with the projections on qgemv.cpp's kernel (kvserve_qgemv_packed) and attention on the paged
// decode kernel, both by function pointer (they live in their own libraries), and the norm and
// RoPE from the headers the GEMV uses: the same functions, in the same order, on the same
// buffers as the layer-by-layer path (kvserve/layers/quant_linear.py), so the same bits.
//
// Why: at batch 1 SmolLM2's 30 layers are ~120 kernel calls and their Python between them
// (views, argument packing, the attention backend's dispatch): ~3 ms of an 11 ms step on
// an AVX-512 EPYC, where llama.cpp's whole step is 6.8 ms. kvserve/layers/quant_decode.py
// prepares every argument array once and fills in the rows and the residual stream here.
#include <cstdint>
#include <cstring>

#include "rms.h"
#include "rope.h"

extern "C" {

int kvserve_qdecode_abi_version() { return 2; }

// a: n_layers, rows, h (the residual stream, updated in place), h_stride, hidden, cos_sin,
// cs_stride, layers (int64* per layer: norm1 weight, qkv args list, its length, paged args,
// o args, norm2 weight, gate_up args, down args; the qgemv argument arrays as BoundQGemv
// lays them out, their x and out buffers fixed but for o and down, whose out is h; qkv is
// one array per part of a stacked weight, each writing its columns, the first at column 0),
// paged_fn, qgemv_fn, eps bits, x (scratch [rows, hidden]), rope_cols, head_dim.
// Returns 0, or 1 + 4 * layer + the failing stage (0 qkv, 1 attention, 2 o, 3 MLP).
int kvserve_qdecode_layers(const int64_t* a) {
  using fn_t = int (*)(const void*);
  const int64_t n_layers = a[0], rows = a[1], h_stride = a[3], hidden = a[4];
  float* h = reinterpret_cast<float*>(a[2]);
  const float* cos_sin = reinterpret_cast<const float*>(a[5]);
  const int64_t cs_stride = a[6];
  int64_t* const* layers = reinterpret_cast<int64_t* const*>(a[7]);
  const fn_t paged = reinterpret_cast<fn_t>(a[8]);
  const fn_t qgemv = reinterpret_cast<fn_t>(a[9]);
  float eps;
  const int32_t bits = static_cast<int32_t>(a[10]);
  std::memcpy(&eps, &bits, sizeof eps);
  float* x = reinterpret_cast<float*>(a[11]);
  const int64_t rope_cols = a[12], head_dim = a[13];
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t* L = layers[l];
    int64_t* const* qkv = reinterpret_cast<int64_t* const*>(L[1]);
    int64_t* o = reinterpret_cast<int64_t*>(L[4]);
    int64_t* gu = reinterpret_cast<int64_t*>(L[6]);
    int64_t* down = reinterpret_cast<int64_t*>(L[7]);
    const int err = static_cast<int>(1 + 4 * l);
    rms_norm_rows(h, h_stride, rows, hidden, reinterpret_cast<const float*>(L[0]), eps, x,
                  hidden);
    for (int64_t p = 0; p < L[2]; ++p) {
      qkv[p][0] = a[11], qkv[p][1] = hidden, qkv[p][2] = rows;
      if (qgemv(qkv[p]) != 0) return err;
    }
    rope_rows(reinterpret_cast<float*>(qkv[0][8]), qkv[0][9], rows, rope_cols, head_dim,
              cos_sin, cs_stride);
    if (paged(reinterpret_cast<const void*>(L[3])) != 0) return err + 1;
    o[2] = rows, o[8] = a[2], o[9] = h_stride;
    if (qgemv(o) != 0) return err + 2;
    rms_norm_rows(h, h_stride, rows, hidden, reinterpret_cast<const float*>(L[5]), eps, x,
                  hidden);
    gu[0] = a[11], gu[1] = hidden, gu[2] = rows;
    down[2] = rows, down[8] = a[2], down[9] = h_stride;
    if (qgemv(gu) != 0 || qgemv(down) != 0) return err + 3;
  }
  return 0;
}

}  // extern "C"
