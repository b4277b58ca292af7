// The weights as float32, values as gguf.quants dequantizes them: whole weights (the
// dequantize path, tests) and the rows an embedding lookup reads, in the file's layout or in
// row tiles. Included by qgemv.cpp inside its anonymous namespace, after qtiles.h (the types'
// layouts, the tile readers); a file of its own so that qgemv.cpp stays readable.
#pragma once

// One weight row of k values as float32 into y; values as gguf.quants dequantizes them (the
// same float32 operations in the same order: d q, d (q - 8), d q + m; Q4_K / Q5_K (d sc) q
// - dmin m, Q6_K (d sc) (q - 32)).
template <int T>
void dequant_row(const uint8_t* w, int64_t k, float* y) {
  const int64_t nb = k / values_per_block(T), bb = block_bytes(T);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    if constexpr (has_k_min(T)) {
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        q4k_scale_min(blk + 4, j, &sc, &m);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
        float* yj = y + b * kQKK + 32 * j;
        for (int i = 0; i < 32; ++i) yj[i] = dl * static_cast<float>(k4_code<T>(blk, j, i)) - ml;
      }
      continue;
    } else if constexpr (T == kQ6_K) {
      const float d = half_to_float(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      float* yb = y + b * kQKK;
      for (int l = 0; l < kQKK; ++l)
        yb[l] = d * static_cast<float>(sc[l / 16]) * static_cast<float>(q6k_code(blk, l) - 32);
      continue;
    }
    float* yb = y + b * kQK;
    const float d = half_to_float(blk);
    if (T == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < kQK; ++j) yb[j] = d * static_cast<float>(q[j]);
    } else if (T == kQ4_0) {
      const uint8_t* qs = blk + 2;
      for (int j = 0; j < 16; ++j) {
        yb[j] = d * static_cast<float>((qs[j] & 0x0f) - 8);
        yb[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
    } else if (is_q5(T)) {
      const int off = T == kQ5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, blk + off, 4);
      if (T == kQ5_0) {
        for (int j = 0; j < kQK; ++j)
          yb[j] = d * static_cast<float>(q5_value(blk + off + 4, qh, j) - 16);
      } else {
        const float m = half_to_float(blk + 2);
        for (int j = 0; j < kQK; ++j)
          yb[j] = d * static_cast<float>(q5_value(blk + off + 4, qh, j)) + m;
      }
    } else {
      const float m = half_to_float(blk + 2);
      const uint8_t* qs = blk + 4;
      for (int j = 0; j < 16; ++j) {
        yb[j] = d * static_cast<float>(qs[j] & 0x0f) + m;
        yb[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    }
  }
}

// Rows ids[i] (or 0..n-1 when ids is null) of the n x k weight as float32 into out [count, k].
template <int T>
void dequant_rows(const uint8_t* w, int64_t k, const int64_t* ids, int64_t count, float* out,
                  int num_threads) {
  const int64_t rb = row_bytes_of(T, k);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * k >= 65536)
  for (int64_t i = 0; i < count; ++i)
    dequant_row<T>(w + (ids != nullptr ? ids[i] : i) * rb, k, out + i * k);
}

// Rows of a tiled weight (type = block type + kTiledCode), as dequant_rows (a K-quant row
// back in the file's layout first).
template <int T>
void dequant_tile_rows(const uint8_t* w, int64_t k, const int64_t* ids, int64_t count,
                       float* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * k >= 65536)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids != nullptr ? ids[i] : i;
    if constexpr (is_k(T)) {
      thread_local std::vector<uint8_t> blocks;
      blocks.resize(static_cast<size_t>(row_bytes_of(T, k)));
      k_tile_row_blocks<T>(w, k, row, blocks.data());
      dequant_row<T>(blocks.data(), k, out + i * k);
    } else {
      dequant_tile_row<T>(w, k, row, out + i * k);
    }
  }
}

// The rows of a weight of kernel type code `type` (checked by the caller: known_type).
void dequant_any(const uint8_t* w, int type, int64_t k, const int64_t* ids, int64_t count,
                 float* out, int num_threads) {
  const bool tiled = type >= kTiledCode;
  with_type(tiled ? type - kTiledCode : type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if (tiled) dequant_tile_rows<T>(w, k, ids, count, out, num_threads);
    else dequant_rows<T>(w, k, ids, count, out, num_threads);
  });
}
