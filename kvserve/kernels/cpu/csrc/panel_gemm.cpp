// y = x W^T (+ bias) (+ residual) for float32, on W packed in panels of 32 output features
// ([panels][K][32], zero past N: kvserve/kernels/cpu/panel_gemm.py packs it), for the decode-sized
// GEMMs of a CPU step (a few to a few hundred rows). Two more epilogues fuse the element-wise
// work around a decoder layer's projections:
// - norm: x's rows RMS-normed first (layers.norm.rms_norm, rounded as the separate norm rounds)
//   into a buffer of the call's own, which stays in cache for the tiles;
// - act: W's columns come in pairs of vectors, gate then up (pack's `gated` order), and the
//   tile writes act(gate) * up (SiLU or GELU-tanh): the [rows, 2 x intermediate] product of
//   the gate/up GEMM is never stored.
// Why: at batch 64 the separate norm, SiLU and product passes cost ~1.5 ms of a ~27 ms step.
//
// Why a GEMM of our own: at 64 rows oneDNN and MKL reach their speed only with the weights in
// cache. In an engine step the weights arrive from DRAM (each step reads all of them, and the
// K/V on top, more than the L3 keeps), and there the projections ran ~1.5x slower than in a
// loop on one layer's weights. This kernel streams each panel once: a tile of rows keeps its
// accumulators for two vectors of the panel (all 32 columns with AVX-512, 16 with AVX2) in
// registers over all of K (the panel stays in cache for the other tiles of rows), and while
// it computes it asks for the next panel, its lines spread evenly over the panel's tiles and
// their steps of K.
//
// Built at first use with the machine's compiler (kvserve/kernels/cpu/cpu_ext.py) and called through
// ctypes. Generic vectors (vec.h) sized for the instruction set it is built for; OpenMP over
// panels on torch's threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include <omp.h>

#include "rms.h"
#include "vec.h"

namespace {

constexpr int kPanel = 32;                // output features per panel
constexpr int kVecs = kPanel / kLanes;    // vectors per panel row: 2, 4 or 8
// A tile covers two vectors of a panel (the whole panel with AVX-512, a half with AVX2, a
// quarter with SSE): rows x 2 accumulators, 16 of the 32 registers with AVX-512, 12 of the 16
// with fewer (the weight vectors and the broadcast need the rest). Why not the whole panel
// everywhere: with AVX2 that left room for 3 rows, so 64 rows were 22 tiles that each read the
// panel's 64 KB again (more than the L1), and the kernel ran 40-50% slower than MKL; a half
// panel's lines are 32 KB at K = 512, which an L1 of 48 KB mostly keeps for all the tiles of
// rows (SSE's quarter panel reads half of each of the same lines: 32 KB too).
constexpr int kTileVecs = 2;
constexpr int kTileCols = kTileVecs * kLanes;  // output features per tile: 32, 16 or 8
constexpr int kParts = kVecs / kTileVecs;  // tiles across a panel: 1, 2 or 4
constexpr int kTileRows = kLanes == 16 ? 8 : 6;
// Rows per block: all panels run over one block of rows before the next, so that the block's
// x (192 x K floats) stays in L2 while the weights stream past it; without blocks a prefill's
// x was read again from L3 for every panel.
constexpr int64_t kBlockRows = 192;

enum Act : int32_t { kNone = 0, kSiluMul = 1, kGeluTanhMul = 2 };

struct Args {
  const float* x;         // [rows, k], row stride x_stride
  const float* w;         // [panels, k, 32]
  const float* bias;      // [cols] (in W's column order) or null
  const float* residual;  // [rows, n], row stride residual_stride, or null (not with act)
  float* out;             // [rows, n], row stride out_stride (may be residual itself)
  int64_t x_stride, rows, k, n, residual_stride, out_stride;
  int32_t threads;
  int32_t act;    // Act: W's columns are (gate, up) pairs of kLanes each; n = the gated width
  int64_t cols;   // W's columns (n without act; with act 2 x n rounded up to pairs)
  const float* norm;  // [k]: x's rows are RMS-normed with this weight first; or null
  float eps;          // the norm's epsilon
};

// Rows m0 .. m0 + R of panel p; asks for up to next_bytes of `next` on the way.
template <int R>
void tile(const Args& a, int64_t m0, int64_t p, int part, const char* next,
          int64_t next_bytes) {
  vf acc[R][kTileVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vf{};
  const float* w = a.w + p * a.k * kPanel + part * kTileCols;
  const float* x = a.x + m0 * a.x_stride;
  // next_bytes / 64 lines, spread evenly over the k steps (a running credit, as in
  // Bresenham's line): one line every few steps with many tiles, two a step with one tile.
  const int64_t lines = next_bytes / 64;
  int64_t asked = 0, credit = 0;
  for (int64_t kk = 0; kk < a.k; ++kk) {
    vf wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = loadv(w + kk * kPanel + v * kLanes);
    credit += lines;
    while (credit >= a.k) {
      __builtin_prefetch(next + asked, 0, 2);
      asked += 64;
      credit -= a.k;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float b = x[r * a.x_stride + kk];
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] += b * wv[v];
    }
  }
  const int64_t col0 = p * kPanel + part * kTileCols;
  const int64_t cols = std::min<int64_t>(kTileCols, a.cols - col0);
  for (int r = 0; r < R; ++r) {
    float y[kTileCols];
    for (int v = 0; v < kTileVecs; ++v) storev(y + v * kLanes, acc[r][v]);
    if (a.bias)
      for (int64_t c = 0; c < cols; ++c) y[c] += a.bias[col0 + c];
    float* out = a.out + (m0 + r) * a.out_stride;
    if (a.act != kNone) {  // the tile's two vectors are a gate and its up: kLanes outputs
      const vf g = loadv(y), u = loadv(y + kLanes);
      storev(y, (a.act == kSiluMul ? silu(g) : gelu_tanh(g)) * u);
      const int64_t at = col0 / 2;
      std::memcpy(out + at, y, std::min<int64_t>(kLanes, a.n - at) * sizeof(float));
      continue;
    }
    if (a.residual) {
      const float* res = a.residual + (m0 + r) * a.residual_stride + col0;
      for (int64_t c = 0; c < cols; ++c) y[c] += res[c];
    }
    std::memcpy(out + col0, y, cols * sizeof(float));
  }
}

}  // namespace

extern "C" {

int kvserve_panel_abi_version() { return 2; }

int kvserve_panel_width() { return kPanel; }

// Columns of a gate or an up in pack's `gated` order (one vector).
int kvserve_panel_lanes() { return kLanes; }

// Returns 0, or -1 on sizes it cannot run (checked by the caller first).
int kvserve_panel_gemm(const Args* args) {
  if (args->rows < 0 || args->k <= 0 || args->n <= 0 || args->threads <= 0) return -1;
  // W's columns as pack lays them out for this build: n, or n gates and ups in pairs of
  // kLanes (a weight packed by a build of another vector width does not fit)
  const int64_t pairs = (args->n + kLanes - 1) / kLanes;
  if (args->cols != (args->act == kNone ? args->n : 2 * kLanes * pairs)) return -1;
  if (args->act != kNone && args->residual) return -1;
  Args a = *args;
  // the tiles read the normed rows (filled below, before any tile runs); not zeroed first:
  // every element is written
  std::unique_ptr<float[]> normed(a.norm ? new float[a.rows * a.k] : nullptr);
  if (a.norm) {
    a.x = normed.get();
    a.x_stride = a.k;
  }
  const int64_t panels = (a.cols + kPanel - 1) / kPanel;
  const int64_t panel_bytes = a.k * kPanel * static_cast<int64_t>(sizeof(float));
#pragma omp parallel num_threads(a.threads)
  {
    if (a.norm) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < a.rows; ++r)
        rms_norm_rows(args->x + r * args->x_stride, args->x_stride, 1, a.k, a.norm, a.eps,
                      normed.get() + r * a.k, a.k);
    }
    for (int64_t b0 = 0; b0 < a.rows; b0 += kBlockRows) {  // every thread runs every block
      const int64_t b1 = std::min(a.rows, b0 + kBlockRows);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        const char* next = p + 1 < panels
                               ? reinterpret_cast<const char*>(a.w) + (p + 1) * panel_bytes
                               : nullptr;
        // Each tile of the block asks for an equal share of the next panel. Why not all of it
        // in the first tile (as at first): two lines a step there asked for the panel ~8x
        // faster than a core's fill buffers bring lines from DRAM, and the tile stalled; spread
        // over the panel's tiles the batch-64 projections and LM head of an engine-like step
        // (K/V read between them) took 17.4 instead of 19.6 ms.
        const int64_t col0 = p * kPanel;
        const int parts = static_cast<int>(
            std::min<int64_t>(kParts, (a.cols - col0 + kTileCols - 1) / kTileCols));
        const int64_t tiles = (b1 - b0 + kTileRows - 1) / kTileRows * parts;
        const int64_t share = (panel_bytes / 64 + tiles - 1) / tiles * 64;  // bytes per tile
        int64_t t = 0;
        for (int part = 0; part < parts; ++part) {
          for (int64_t m0 = b0; m0 < b1; m0 += kTileRows, ++t) {
            const int64_t from = std::min(t * share, panel_bytes);
            const int64_t bytes = next ? std::min(share, panel_bytes - from) : 0;
            const char* ahead = next ? next + from : nullptr;
            switch (std::min<int64_t>(kTileRows, b1 - m0)) {
              case 8: tile<8>(a, m0, p, part, ahead, bytes); break;
              case 7: tile<7>(a, m0, p, part, ahead, bytes); break;
              case 6: tile<6>(a, m0, p, part, ahead, bytes); break;
              case 5: tile<5>(a, m0, p, part, ahead, bytes); break;
              case 4: tile<4>(a, m0, p, part, ahead, bytes); break;
              case 3: tile<3>(a, m0, p, part, ahead, bytes); break;
              case 2: tile<2>(a, m0, p, part, ahead, bytes); break;
              default: tile<1>(a, m0, p, part, ahead, bytes); break;
            }
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
