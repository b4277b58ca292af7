// The score, softmax and value tiles of paged_decode.cpp: horizontal sums, the chunk kernels
// (kChunk key rows' scores as one vector; a tile's probabilities times value rows into the
// heads' accumulators, over row pointers or, for float32, strided rows) and the prefetcher
// that asks for the next block while one is worked on. Internal linkage (see vec.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

constexpr int kMaxBlock = 256;       // tokens per cache block

// vf: kLanes floats in one vector register (see vec.h); "why not omp simd reduction": GCC summed
// the lanes of each dot product as one chain of dependent scalar adds through the stack.
// x's lanes combined by op, halves at a time (once per tile and head: plain code is fine)
template <typename Op>
inline float hreduce(vf x, Op op) {
  float t[kLanes];
  std::memcpy(t, &x, sizeof t);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = op(t[i], t[i + w]);
  return t[0];
}
inline float hsum(vf x) { return hreduce(x, [](float a, float b) { return a + b; }); }
inline float hmax(vf x) { return hreduce(x, [](float a, float b) { return a > b ? a : b; }); }

// lanes of (a, b) by index, 0 .. kLanes - 1 from a, kLanes .. 2 kLanes - 1 from b
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC < 12 has no __builtin_shufflevector; its two-operand __builtin_shuffle is the same
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// Lane j of the result = the sum of x[j]'s lanes: kLanes horizontal sums as a transpose by
// halves (kLanes - 1 vector adds and twice as many two-register shuffles) instead of one
// reduction each.
#if defined(__AVX512F__)
inline vf transpose_sum(const vf* x) {
  vf y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: x[2i]'s halves added; 8-15: x[2i+1]'s
    y[i] = SHUF2(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF2(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                 30, 31);
  for (int i = 0; i < 4; ++i)  // four lanes each of x[4i .. 4i+3]
    z[i] = SHUF2(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                 27) +
           SHUF2(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                 31);
  for (int i = 0; i < 2; ++i)  // two lanes each of x[8i .. 8i+7]
    w[i] = SHUF2(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                 29) +
           SHUF2(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                 31);
  return SHUF2(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUF2(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif defined(__AVX__)
inline vf transpose_sum(const vf* x) {
  vf y[4], z[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: x[2i]'s halves added; 4-7: x[2i+1]'s
    y[i] = SHUF2(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUF2(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // two lanes each of x[4i .. 4i+3]
    z[i] = SHUF2(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           SHUF2(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return SHUF2(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         SHUF2(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
inline vf transpose_sum(const vf* x) {
  const vf y0 = SHUF2(x[0], x[1], 0, 1, 4, 5) + SHUF2(x[0], x[1], 2, 3, 6, 7);  // x0 x0 x1 x1
  const vf y1 = SHUF2(x[2], x[3], 0, 1, 4, 5) + SHUF2(x[2], x[3], 2, 3, 6, 7);  // x2 x2 x3 x3
  return SHUF2(y0, y1, 0, 2, 4, 6) + SHUF2(y0, y1, 1, 3, 5, 7);
}
#endif

constexpr int64_t kChunk = kLanes;  // token rows whose scores come out as one vector
// Tokens per tile (whole blocks; one block where a block is larger) and a head's room for
// the tile's scores: a block's last chunk may write kChunk lanes past its rows, and the
// softmax pads the tile to a whole chunk.
constexpr int64_t kTile = kMaxBlock;
constexpr int64_t kScoreStride = kTile + 2 * kChunk;

// Scores of q against kChunk rows of D floats. The channels are the outer loop so that the
// rows' sums are 16 independent chains of FMAs held in registers: row by row, each dot
// product was one chain of D / 16 dependent FMAs and the kernel waited on their latency.
// Not inlined (nor add_values): inside decode's loop nest the compiler spilled their
// accumulators to the stack (batch 64, one thread, data in cache: 0.60 -> 0.56 ms per layer).
__attribute__((noinline)) vf chunk_scores(const float* q, const float* const* rows, int64_t D) {
  vf x[kChunk];
#pragma GCC unroll 16
  for (int64_t j = 0; j < kChunk; ++j) x[j] = vf{};
  const int64_t Dv = D - D % kLanes;
  for (int64_t d = 0; d < Dv; d += kLanes) {
    const vf qd = loadv(q + d);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kChunk; ++j) x[j] += qd * loadv(rows[j] + d);
  }
  if (Dv < D) {
    for (int64_t j = 0; j < kChunk; ++j) {
      float tail = 0.f;
      for (int64_t d = Dv; d < D; ++d) tail += q[d] * rows[j][d];
      x[j][0] += tail;
    }
  }
  return transpose_sum(x);
}

// acc_t += sum_j p_t[j] v_j for NT query heads t (acc_t at acc + t * D, p_t at p + t *
// p_stride) over m rows v_j of D floats. Each kLanes channels of the NT accumulators stay in
// registers over the rows, every row load serves all NT heads, and even and odd rows sum in
// separate registers: one head's single running sum was a chain of dependent FMAs whose
// latency the kernel waited on.
template <int NT>
__attribute__((noinline)) void add_values(float* acc, int64_t D, const float* p, int64_t p_stride,
                       const float* const* rows, int64_t m) {
  const int64_t Dv = D - D % kLanes;
  for (int64_t d = 0; d < Dv; d += kLanes) {
    vf x[NT], y[NT];
    for (int t = 0; t < NT; ++t) {
      x[t] = loadv(acc + t * D + d);
      y[t] = vf{};
    }
    int64_t j = 0;
    for (; j + 2 <= m; j += 2) {
      const vf v0 = loadv(rows[j] + d), v1 = loadv(rows[j + 1] + d);
      for (int t = 0; t < NT; ++t) {
        x[t] += p[t * p_stride + j] * v0;
        y[t] += p[t * p_stride + j + 1] * v1;
      }
    }
    if (j < m) {
      const vf v0 = loadv(rows[j] + d);
      for (int t = 0; t < NT; ++t) x[t] += p[t * p_stride + j] * v0;
    }
    for (int t = 0; t < NT; ++t) storev(acc + t * D + d, x[t] + y[t]);
  }
  for (int t = 0; t < NT; ++t)
    for (int64_t d = Dv; d < D; ++d)
      for (int64_t j = 0; j < m; ++j) acc[t * D + d] += p[t * p_stride + j] * rows[j][d];
}

// Vector registers of the instruction set the file is built for (AVX-512: 32, else 16).
constexpr int kRegisters = kLanes == 16 ? 32 : 16;

// chunk_scores and add_values for float32 rows one `stride` apart (a block's rows of one KV
// head) and a head_dim known at compile time (64, 128): the rows' addresses are one register
// and an offset, the channel loops unrolled. Why: with an array of row pointers the compiler
// ran out of general registers (it parked pointers in vector ones) and zeroed the accumulators
// through the stack on every call. The kernel alone, 64 x 192 tokens, alternated: 0.87x the
// time with the K/V in cache, 0.94x from DRAM (AVX2 build: 0.91x, 0.96x).

template <int D>
__attribute__((noinline)) vf chunk_scores_strided(const float* q, const float* r0,
                                                  int64_t stride) {
  constexpr int V = D / kLanes;
  vf x[kChunk];
  if constexpr (kChunk + V + 1 <= kRegisters) {  // q in registers, each row's dot a chain
    vf qv[V];
    for (int v = 0; v < V; ++v) qv[v] = loadv(q + v * kLanes);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kChunk; ++j) {
      const float* r = r0 + j * stride;
      vf t = qv[0] * loadv(r);
      for (int v = 1; v < V; ++v) t += qv[v] * loadv(r + v * kLanes);
      x[j] = t;
    }
  } else {
    const vf q0 = loadv(q);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kChunk; ++j) x[j] = q0 * loadv(r0 + j * stride);
#pragma GCC unroll 16
    for (int d = kLanes; d < D; d += kLanes) {
      const vf qd = loadv(q + d);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kChunk; ++j) x[j] += qd * loadv(r0 + j * stride + d);
    }
  }
  return transpose_sum(x);
}

template <int NT, int D>
__attribute__((noinline)) void add_values_strided(float* acc, const float* p, int64_t p_stride,
                                                  const float* r0, int64_t stride, int64_t m) {
  // Channels a slice of S vectors at a time: NT x S accumulators, S row vectors and a
  // broadcast in registers (4 x 4 + 4 + 1 with AVX-512 and 64 channels: one slice).
  constexpr int V = D / kLanes;
  constexpr int fit = (kRegisters - 1) / (NT + 1);
  constexpr int S = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
  constexpr int W = S < V ? S : V;
  for (int v0 = 0; v0 < V; v0 += W) {
    vf x[NT][W];
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < W; ++v) x[t][v] = loadv(acc + t * D + (v0 + v) * kLanes);
    for (int64_t j = 0; j < m; ++j) {
      const float* r = r0 + j * stride + v0 * kLanes;
      vf rv[W];
      for (int v = 0; v < W; ++v) rv[v] = loadv(r + v * kLanes);
      for (int t = 0; t < NT; ++t) {
        const float pj = p[t * p_stride + j];
        for (int v = 0; v < W; ++v) x[t][v] += pj * rv[v];
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < W; ++v) storev(acc + t * D + (v0 + v) * kLanes, x[t][v]);
  }
}

// add_values_strided for nt (1 to 4) query heads, p's rows kScoreStride apart
template <int D>
void add_values_strided_n(int nt, float* acc, const float* p, const float* r0, int64_t stride,
                          int64_t m) {
  switch (nt) {
    case 4: add_values_strided<4, D>(acc, p, kScoreStride, r0, stride, m); break;
    case 3: add_values_strided<3, D>(acc, p, kScoreStride, r0, stride, m); break;
    case 2: add_values_strided<2, D>(acc, p, kScoreStride, r0, stride, m); break;
    default: add_values_strided<1, D>(acc, p, kScoreStride, r0, stride, m); break;
  }
}

// The next block's rows of a work item (`rows` rows of `row_bytes` every `stride` bytes),
// asked for a few cache lines at a time while the current block is worked on. Why at all: a
// block's rows are a new address stream the hardware prefetcher has not seen, and in a running
// engine they come from DRAM, not cache (the weights and the other layers' KV pass through the
// cache between two reads of one layer): without it the kernel stalled on the K and V loads
// for ~60% of its time at batch 64. Why a few at a time: a burst of a whole block (128 lines
// at batch 64) fills the core's line-fill buffers, and the burst itself stalls. Why into L2
// (locality 1: prefetcht2), not L1: in an engine ~80% of the kernel's own samples still sat on
// its prefetcht0 instructions, each holding a fill buffer until its line came from DRAM;
// batch 64 x ~192 tokens with K/V from DRAM 0.525 -> 0.427 ms per layer, 8 x 4,000 1.39 ->
// 1.27 (with K/V in cache 4% slower).
struct Ahead {
  const char* row = nullptr;  // the row of the next line to ask for
  int64_t stride = 0, row_bytes = 0, offset = 0, total = 0, done = 0;

  void start(const char* p, int64_t rows, int64_t bytes, int64_t row_stride) {
    row = p;
    stride = row_stride;
    row_bytes = bytes;
    offset = 0;
    total = p ? rows * ((bytes + 63) / 64) : 0;
    done = 0;
  }
  // The next n lines (all that are left with n >= total).
  void ask(int64_t n) {
    for (const int64_t end = std::min(total, done + n); done < end; ++done) {
      __builtin_prefetch(row + offset, 0, 1);  // to L2 (see above)
      offset += 64;
      if (offset >= row_bytes) {
        offset = 0;
        row += stride;
      }
    }
  }
};

}  // namespace
