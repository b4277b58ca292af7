// Decode attention over a paged KV cache, for the CPU: one query token per sequence, read
// straight from the cache blocks its block table names (no gather into a new tensor), in any
// storage format of kvserve/kv/quant.py: float32, bfloat16, float16, fp8 (e4m3, e5m2), int8
// and int4 (KIVI). Quantized rows are decoded a chunk of rows at a time into D-float buffers
// that stay in L1 and are read by every query head of the group: no dequantized copy of the
// cache is ever written. Scores, softmax and the value sums work on 8 or 16 rows at a time in
// vector registers (see chunk_scores, expv, add_values).
//
// Built at first use by kvserve/attention/cpu_paged.py with the machine's compiler
// (-O3 -march=native -fopenmp) and called through ctypes with raw pointers: no torch headers,
// so it compiles in about a second. OpenMP resolves to the libgomp torch has already loaded,
// so the kernel shares torch's thread count (torch.set_num_threads). Plain C++ loops, GCC/Clang
// vector extensions (the compiler lowers them to whatever the CPU has) and __builtin_prefetch: no
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
//            stored at position lens[s] - 1 of its sequence, all of them before any row is
//            read (rows may share a table: a sequence's verification rows read each other's)
//            (saves the caller a scatter per layer; null: the caller stored them)
// Query head h reads KV head h / (H / Hkv) (grouped-query attention). Softmax runs online
// (running max and sum per head, flash-attention style) in float32, a tile of whole blocks
// (up to 256 tokens) at a time; a long context in parts of 512 tokens run as work items of
// their own and merged in the kernel (split-K, see kSplitTokens). Table entries before
// starts[s] / block_size and past the length are never read (NULL_BLOCK there is fine).
// Beside it: paged_formats.h (the storage formats as float rows), paged_tiles.h (the score and
// value kernels, the prefetcher).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "paged_formats.h"  // the storage formats as float rows
#include "paged_tiles.h"    // scores, value sums, prefetching
#include "parallel.h"
#include "vec.h"

namespace {

constexpr int kMaxGroup = 64;        // query heads per KV head
constexpr int kMaxGroupDim = 16384;  // (H / Hkv) * D floats of accumulator per work item
constexpr int kMaxDim = 1024;        // head_dim of a decoded row

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

constexpr int64_t kThreadBytes = int64_t{1} << 20;  // see decode's parallel region

// Split-K ("flash-decoding", issue 49): a sequence's keys are cut into parts of kSplitTokens
// tokens (whole tiles), counted from its first visible block; each part of a (rows, KV heads)
// item is a work item of its own that leaves its softmax state (max, sum, unnormalised value
// sums) in scratch, and whichever finishes a head's last part merges them (log-sum-exp). Why:
// at batch 1 the items were one per KV head, and SmolLM2's 3 on 2 threads left a core idle a
// third of the attention time. Why the cut depends on nothing but the sequence's start and
// this constant (not the batch, the threads, nor the rows that share the keys): a verification
// row must keep the bits of the same row decoded alone. Its parts are the same operations as
// alone, and the parts past its own length (there for its group's longer rows) are empty
// (max -inf), which the merge skips. Why 512 tokens (issue 49's split-K pass in the retired
// notebook, `git show 9b55a61:docs/benchmarks.md`; the kernel alone in SmolLM2's shape on 2
// threads): 1,024 leaves a 1,000-token context in 3
// items (no gain there: 2.5 ms for 30 layers against 2.1 with 512), 256 doubles the items
// and merges for no better balance (about the same as 512); a part of 512 float32 tokens of
// one KV head (64 channels) is 256 kB of K/V, well above a work item's claim and merge cost.
// A build may set another (-DKVSERVE_SPLIT_TOKENS=N: `kvserve bench kernels --kernel attention
// --cxxflags -DKVSERVE_SPLIT_TOKENS=N`).
#ifndef KVSERVE_SPLIT_TOKENS
#define KVSERVE_SPLIT_TOKENS 512
#endif
constexpr int64_t kSplitTokens = KVSERVE_SPLIT_TOKENS;

// Speculative decoding's verification rows: consecutive rows of one sequence at consecutive
// positions (lengths one apart, the same window start, the same blocks as far as the shorter
// reads). Each run of such rows (at most `most`, the work item's room for query heads) is one
// work item, its rows' query heads side by side, so every key and value row is read once for
// all of them instead of once a row: at 4,000 tokens of context a row's keys and values are
// most of a decode step. Each row's result keeps the bits it has alone: its scores and value
// sums are the same operations in the same order, the keys past its own length get -inf
// (weight 0: adding 0 * v to a sum, or a tile of them, changes no bit). `group_start` gets
// the first row of each run, then n.
inline void verification_rows(const Args& a, bool allowed, int64_t most,
                              std::vector<int64_t>& group_start) {
  group_start.clear();
  for (int64_t s = 0; s < a.n; ++s) {
    const int64_t p = s - 1;
    bool joins = allowed && s > 0 && s - group_start.back() < most &&
                 a.lens[s] == a.lens[p] + 1 && (!a.starts || a.starts[s] == a.starts[p]);
    if (joins) {
      const int64_t from = (a.starts ? a.starts[s] : 0) / a.block_size;
      const int64_t used = (a.lens[p] + a.block_size - 1) / a.block_size;
      joins = std::memcmp(a.tables + p * a.table_stride + from,
                          a.tables + s * a.table_stride + from,
                          static_cast<size_t>(used - from) * sizeof(int64_t)) == 0;
    }
    if (!joins) group_start.push_back(s);
  }
  group_start.push_back(a.n);
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
  // out, read a block at a time (a token's heads are neighbours, so a block of the item is one
  // contiguous run that the hardware prefetchers follow: batch 64 x ~200 tokens, 0.73 -> 0.5 ms
  // per layer); else one (sequence, KV head) pair, so that a single sequence still uses every
  // thread.
  const int64_t per_item =
      a.n >= 4 * omp_get_max_threads() && H * D <= kMaxGroupDim && H <= kMaxGroup ? Hkv : 1;
  const int64_t kv_items = Hkv / per_item;  // items of a group of rows, before the split
  const int64_t heads = per_item * G;  // query heads of an item
  // Threads only where the K/V the step reads outweighs a fork/join (~10-20 us, ~1 MB read):
  // at batch 1 with a short context the team's wake-up cost more than the work, and after
  // the region its threads spin on the cores the quantized kernels' pool then needs (the
  // one-call quantized step: 8.4 -> 5.5-6.9 ms of SmolLM2's 30 layers on a 2-core EPYC).
  int64_t tokens = 0;
  for (int64_t s = 0; s < a.n; ++s) tokens += a.lens[s];
  // Rows that share their keys (verification_rows): row g of the work items' groups is
  // rows [group_start[g], group_start[g + 1]).
  thread_local std::vector<int64_t> group_start;
  verification_rows(a, K != INT4, std::min(kMaxGroup / heads, kMaxGroupDim / (heads * D)),
                    group_start);
  const int64_t n_groups = static_cast<int64_t>(group_start.size()) - 1;
  // (the items read it through this pointer: by its name a pool thread would get its own)
  const int64_t* const groups_at = group_start.data();
  // The split (see kSplitTokens): group g's items are items_at[g] .. items_at[g + 1] - 1,
  // kv_items x its parts, (KV heads, part) in that order; its parts' states (when more than
  // one) at states_at[g], and left[g * kv_items + i] counts the parts of its KV-head item i
  // still running.
  const int64_t tile_blocks = std::max<int64_t>(1, kTile / bs);
  const int64_t part_blocks = std::max<int64_t>(1, kSplitTokens / (tile_blocks * bs)) *
                              tile_blocks;
  thread_local std::vector<int64_t> plan;
  thread_local std::vector<int32_t> left_counts;
  thread_local std::vector<float> scratch;
  plan.resize(2 * (n_groups + 1));
  left_counts.resize(n_groups * kv_items);
  int64_t* const items_at = plan.data();
  int64_t* const states_at = items_at + n_groups + 1;
  items_at[0] = states_at[0] = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t s = groups_at[g + 1] - 1;  // the group's longest row
    const int64_t from = (a.starts ? a.starts[s] : 0) / bs;
    const int64_t splits = std::max<int64_t>(1, ((a.lens[s] + bs - 1) / bs - from +
                                                 part_blocks - 1) / part_blocks);
    items_at[g + 1] = items_at[g] + kv_items * splits;
    const int64_t nh = (groups_at[g + 1] - groups_at[g]) * heads;
    states_at[g + 1] = states_at[g] + (splits > 1 ? kv_items * splits * nh * (D + 2) : 0);
    for (int64_t i = 0; i < kv_items; ++i)
      left_counts[g * kv_items + i] = static_cast<int32_t>(splits);
  }
  if (static_cast<int64_t>(scratch.size()) < states_at[n_groups])
    scratch.resize(states_at[n_groups]);
  int32_t* const left = left_counts.data();
  float* const states = scratch.data();
  const int64_t n_items = items_at[n_groups];
  const bool threaded = n_items > 1 && tokens * token_stride * esize * 2 >= kThreadBytes;
  // Output rows of an item's nh query heads from its `splits` parts' states at st (part p's at
  // st + p * nh * (D + 2): nh maxima, nh sums, nh x D value sums): the log-sum-exp merge, in
  // part order, parts a head does not see (max -inf) skipped. With one part seen this is
  // out = acc * (v_scale / sum), the bits of the kernel before the split (exp(0) = 1).
  const auto merge = [&](const float* st, int64_t splits, int64_t s0, int64_t hk0, int64_t nh) {
    const int64_t ps = nh * (D + 2);
    float o[kMaxDim];
    for (int64_t h = 0; h < nh; ++h) {
      float mx = -INFINITY;
      for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, st[p * ps + h]);
      float sum = 0.f;
      bool any = false;
      for (int64_t p = 0; p < splits; ++p) {
        const float* part = st + p * ps;
        if (part[h] == -INFINITY) continue;
        const float w = std::exp(part[h] - mx);
        const float* ac = part + 2 * nh + h * D;
        if (any) {
          for (int64_t d = 0; d < D; ++d) o[d] += ac[d] * w;
          sum += part[nh + h] * w;
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = ac[d] * w;
          sum = part[nh + h] * w;
          any = true;
        }
      }
      float* orow = a.out + ((s0 + h / heads) * H + hk0 * G + h % heads) * D;
      const float inv = sum > 0.f ? a.v_scale / sum : 0.f;
      for (int64_t d = 0; d < D; ++d)
        orow[d] = any ? o[K == INT4 ? nibble_order(d, D) : d] * inv : 0.f;
    }
  };
  // Items are claimed from parallel.h's pool (OpenMP's team, after its region, spun on the
  // cores the quantized kernels' pool needed: batch-32 steps ~20% slower than passive).
  // Every row's new K/V first, then any row reads: rows of one sequence (speculative
  // decoding's verification, a row per drafted token at consecutive positions) read each
  // other's, so a row stored by the item that reads it would race with the threads reading
  // it as context. A token row of all heads is contiguous (a few hundred bytes).
  if constexpr (K == F32 || K == BF16 || K == F16) {
    if (a.new_k) {
      const int64_t bytes = Hkv * row_width * esize;
      for (int64_t s = 0; s < a.n; ++s) {
        const int64_t pos = a.lens[s] - 1;
        const int64_t at = a.tables[s * a.table_stride + pos / bs] * block_stride +
                           pos % bs * token_stride;
        std::memcpy(static_cast<char*>(const_cast<void*>(a.k)) + at * esize,
                    static_cast<const char*>(a.new_k) + s * a.new_k_stride * esize, bytes);
        std::memcpy(static_cast<char*>(const_cast<void*>(a.v)) + at * esize,
                    static_cast<const char*>(a.new_v) + s * a.new_v_stride * esize, bytes);
      }
    }
  }
  const auto run_item = [&](int64_t item) {
    const int64_t g = std::upper_bound(items_at, items_at + n_groups + 1, item) - items_at - 1;
    const int64_t splits = (items_at[g + 1] - items_at[g]) / kv_items;
    const int64_t kv_item = (item - items_at[g]) / splits, split = (item - items_at[g]) % splits;
    // rows s0 .. s0 + R - 1, the last the longest (its table and length are read)
    const int64_t s0 = groups_at[g];
    const int64_t R = groups_at[g + 1] - s0;
    const int64_t s = s0 + R - 1;
    const int64_t hk0 = kv_item * per_item;
    const int64_t nh = R * heads;  // query heads of the item, row r's at r * heads ..
    // Per query head h of the item (query head hk0 * G + h % heads of row s0 + h / heads):
    // its running softmax max and sum, value accumulator (the state `merge` reads: on the
    // stack with one part, else the part's place in scratch), scaled query (int4: in nibble
    // order), this tile's scores (at h * kScoreStride).
    float own[2 * kMaxGroup + kMaxGroupDim];
    float* const parts_state = states + states_at[g] + kv_item * splits * nh * (D + 2);
    float* const state = splits == 1 ? own : parts_state + split * nh * (D + 2);
    float* const m = state;
    float* const l = state + nh;
    float* const acc = state + 2 * nh;
    float qs[kMaxGroupDim];
    float scores[kMaxGroup * kScoreStride];
    // a chunk's decoded rows (float32 reads the cache itself)
    float bufs[(K == F32 ? 1 : kChunk) * kMaxDim];
    float tmp[kMaxDim];
    float ks[kMaxDim], kz[kMaxDim];  // int4: the block's per-channel key scale and zero
    const float* rows[kChunk];
    for (int64_t h = 0; h < nh; ++h) {
      const float* qrow = a.q + (s0 + h / heads) * a.q_stride + (hk0 * G + h % heads) * D;
      m[h] = -INFINITY;
      l[h] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = K == INT4 ? nibble_order(d, D) : d;
        qs[h * D + at] = qrow[d] * q_mul;
        acc[h * D + d] = 0.f;
      }
    }
    const int64_t len = a.lens[s];
    const int64_t first = a.starts ? a.starts[s] : 0;
    const int64_t* table = a.tables + s * a.table_stride;
    const int64_t row_bytes = per_item * row_width * esize, row_stride = token_stride * esize;
    // Visible token rows [lo, lo + count) of table entry b.
    const auto visible = [&](int64_t b, int64_t& lo, int64_t& count) {
      lo = b * bs < first ? first - b * bs : 0;
      count = (len - b * bs < bs ? len - b * bs : bs) - lo;
    };
    // Table entry b's rows of this item in `data` (K or V) as the next block to ask for
    // (none for b < 0), spread over `calls` kernel calls on the current block.
    Ahead ahead;
    int64_t ask_per_call = 0;
    const auto start_ahead = [&](const void* data, int64_t b, int64_t calls) {
      ahead.start(b < 0 ? nullptr
                        : static_cast<const char*>(data) +
                              (table[b] * block_stride + hk0 * row_width) * esize,
                  bs, row_bytes, row_stride);
      ask_per_call = (ahead.total + calls - 1) / calls;
    };
    // Token t's key row of KV head hk in `block` as D floats (int4: in nibble order, with ks
    // / kz of that head loaded; res_row: the block's KIVI residual row or -1); buf: where to
    // decode it.
    const auto key_row = [&](int64_t block, int64_t res_row, int64_t hk, int64_t t,
                             float* buf) -> const float* {
      const int64_t off = block * block_stride + t * token_stride + hk * row_width;
      if constexpr (K <= FP8_E5M2) {
        return elementwise_row<K>(a.k, off, D, buf);
      } else if constexpr (K == INT8) {
        affine_row<false>(static_cast<const uint8_t*>(a.k) + off,
                          a.k_sz + (block * bs + t) * sz_token + hk * groups * 2, D, groups,
                          buf);
        return buf;
      } else {  // INT4 keys: per channel over the block, or the residual row
        if (res_row >= 0) {  // exact keys in channel order: into nibble order
          const float* r = residual_row(a.res_kind, a.k_res,
                                        ((res_row * bs + t) * Hkv + hk) * D, D, tmp);
          for (int64_t d = 0; d < D; ++d) buf[nibble_order(d, D)] = r[d];
        } else {
          const uint8_t* c = static_cast<const uint8_t*>(a.k) + off;
          const int64_t half = D / 2;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            buf[i] = static_cast<float>(c[i] & 0x0f) * ks[i] + kz[i];
            buf[half + i] = static_cast<float>(c[i] >> 4) * ks[half + i] + kz[half + i];
          }
        }
        return buf;
      }
    };
    const auto value_row = [&](int64_t block, int64_t hk, int64_t t, float* buf) -> const float* {
      const int64_t off = block * block_stride + t * token_stride + hk * row_width;
      if constexpr (K <= FP8_E5M2) {
        return elementwise_row<K>(a.v, off, D, buf);
      } else {
        affine_row<K == INT4>(static_cast<const uint8_t*>(a.v) + off,
                              a.v_sz + (block * bs + t) * sz_token + hk * groups * 2, D,
                              groups, buf);
        return buf;
      }
    };
    // add(p, acc, nt) over the item's query heads of KV head hk, nt <= 4 of one row at a time
    // (a row's heads of hk are consecutive): the V pass's value sums, p at tile position `at`
    const auto value_heads = [&](int64_t hk, int64_t at, auto&& add) {
      for (int64_t r = 0; r < R; ++r) {
        const int64_t end = r * heads + (hk - hk0 + 1) * G;
        for (int64_t h = end - G; h < end; h += 4) {
          ahead.ask(ask_per_call);
          add(scores + h * kScoreStride + at, acc + h * D,
              static_cast<int>(std::min<int64_t>(4, end - h)));
        }
      }
    };
    // Tiles of whole blocks, up to kTile tokens: all the tile's scores first (K pass), one
    // softmax update per head, then the value sums (V pass). Why tiles, not blocks: the
    // online softmax's per-head work (max, rescale of the accumulator, sum) ran once per block
    // of 16 tokens and, being short dependent chains, cost about as much as the dot products.
    // this part's blocks (the tiles of the item before the split, from the first visible)
    const int64_t part_first = first / bs + split * part_blocks;
    const int64_t end_block = std::min((len + bs - 1) / bs, part_first + part_blocks);
    for (int64_t b0 = part_first; b0 < end_block; b0 += tile_blocks) {
      const int64_t b1 = std::min(b0 + tile_blocks, end_block);
      // K pass: scores[h * kScoreStride + pos + j] = q_h . k_j, the tile's visible rows packed
      // one after another; a chunk of kChunk rows at a time (decoded once, read by every
      // query head of the group).
      int64_t pos = 0;
      for (int64_t b = b0; b < b1; ++b) {
        int64_t lo, count;
        visible(b, lo, count);
        if (count <= 0) continue;
        const int64_t block = table[b];
        const int64_t res_row = (K == INT4 && a.res_rows) ? a.res_rows[s * a.table_stride + b]
                                                          : -1;
        // next: the tile's next K block, else its first V block
        start_ahead(b + 1 < b1 ? a.k : a.v, b + 1 < b1 ? b + 1 : b0,
                    (count + kChunk - 1) / kChunk * nh);
        for (int64_t j0 = 0; j0 < count; j0 += kChunk) {
          const int64_t mrows = std::min(kChunk, count - j0);
          for (int64_t hk = hk0; hk < hk0 + per_item; ++hk) {
            if constexpr (K == INT4) {
              if (res_row < 0) {
                const uint16_t* sz = a.k_sz + (block * Hkv + hk) * D * 2;
                for (int64_t d = 0; d < D; ++d) {
                  ks[nibble_order(d, D)] = f16_to_float(sz[2 * d]);
                  kz[nibble_order(d, D)] = f16_to_float(sz[2 * d + 1]);
                }
              }
            }
            // Rows whose scores of this chunk came from the strided kernel (bit r). A row
            // takes the kernel its decode alone takes: the strided one where it sees the whole
            // chunk (or none of it: masked), else chunk_scores (their bits differ).
            uint64_t strided = 0;
            if constexpr (K == F32) {
              if (mrows == kChunk && (D == 64 || D == 128)) {  // a whole chunk: strided rows
                const float* r0 = static_cast<const float*>(a.k) + block * block_stride +
                                  (lo + j0) * token_stride + hk * D;
                const int64_t chunk_first = b * bs + lo + j0;  // token of the chunk's row 0
                for (int64_t r = 0; r < R; ++r) {
                  const int64_t seen = a.lens[s0 + r] - chunk_first;
                  if (seen > 0 && seen < kChunk) continue;
                  strided |= uint64_t{1} << r;
                  for (int64_t h = r * heads + (hk - hk0) * G;
                       h < r * heads + (hk - hk0 + 1) * G; ++h) {
                    ahead.ask(ask_per_call);
                    storev(scores + h * kScoreStride + pos + j0,
                           D == 64 ? chunk_scores_strided<64>(qs + h * D, r0, token_stride)
                                   : chunk_scores_strided<128>(qs + h * D, r0, token_stride));
                  }
                }
                if (strided == (R == 64 ? ~uint64_t{0} : (uint64_t{1} << R) - 1)) continue;
              }
            }
            for (int64_t j = 0; j < mrows; ++j)
              rows[j] = key_row(block, res_row, hk, lo + j0 + j,
                                bufs + (K == F32 ? 0 : j * kMaxDim));
            for (int64_t j = mrows; j < kChunk; ++j) rows[j] = rows[0];  // lanes overwritten
            for (int64_t r = 0; r < R; ++r) {
              if (strided >> r & 1) continue;
              for (int64_t h = r * heads + (hk - hk0) * G; h < r * heads + (hk - hk0 + 1) * G;
                   ++h) {
                ahead.ask(ask_per_call);
                storev(scores + h * kScoreStride + pos + j0, chunk_scores(qs + h * D, rows, D));
              }
            }
          }
        }
        pos += count;
      }
      const int64_t n_rows = pos;
      if (n_rows == 0) continue;
      // Online softmax, once per tile: rescale what the earlier tiles accumulated. A row
      // shorter than the item's longest hides the tile's keys past its own length (-inf: no
      // weight, and a tile it sees none of leaves its max, sum and values as they were).
      const int64_t tile_first = std::max(b0 * bs, first);  // token of the tile's score 0
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = scores + h * kScoreStride;
        for (int64_t j = std::max<int64_t>(0, a.lens[s0 + h / heads] - tile_first); j < n_rows;
             ++j)
          sh[j] = -INFINITY;
        for (int64_t j = n_rows; j % kChunk != 0; ++j) sh[j] = -INFINITY;  // padding lanes
        vf vmax = loadv(sh);
        for (int64_t j0 = kChunk; j0 < n_rows; j0 += kChunk) {
          const vf x = loadv(sh + j0);
          const vi more = x > vmax;  // masks, not ?: (which not every compiler takes on vectors)
          vmax = (vf)(((vi)x & more) | ((vi)vmax & ~more));
        }
        const float bmax = hmax(vmax);
        const float m_new = bmax > m[h] ? bmax : m[h];
        const float rescale = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first tile
        vf sum = {};
        for (int64_t j0 = 0; j0 < n_rows; j0 += kChunk) {
          const vf e = expv(loadv(sh + j0) - m_new);
          storev(sh + j0, e);
          sum += e;
        }
        float* ah = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] *= rescale;
        l[h] = l[h] * rescale + hsum(sum);
        m[h] = m_new;
      }
      // V pass: acc_h += p_hj v_j, a chunk of rows at a time, each kLanes channels of acc_h
      // held in a register over the chunk's rows.
      pos = 0;
      for (int64_t b = b0; b < b1; ++b) {
        int64_t lo, count;
        visible(b, lo, count);
        if (count <= 0) continue;
        const int64_t block = table[b];
        // next: the tile's next V block, else the next tile's first K block
        start_ahead(b + 1 < b1 ? a.v : a.k, b + 1 < end_block ? b + 1 : -1,
                    (count + kChunk - 1) / kChunk * per_item * R * ((G + 3) / 4));
        for (int64_t j0 = 0; j0 < count; j0 += kChunk) {
          const int64_t mrows = std::min(kChunk, count - j0);
          for (int64_t hk = hk0; hk < hk0 + per_item; ++hk) {
            if constexpr (K == F32) {
              if (D == 64 || D == 128) {  // strided rows
                const float* r0 = static_cast<const float*>(a.v) + block * block_stride +
                                  (lo + j0) * token_stride + hk * D;
                value_heads(hk, pos + j0, [&](const float* p, float* ah, int nt) {
                  if (D == 64) add_values_strided_n<64>(nt, ah, p, r0, token_stride, mrows);
                  else add_values_strided_n<128>(nt, ah, p, r0, token_stride, mrows);
                });
                continue;
              }
            }
            for (int64_t j = 0; j < mrows; ++j)
              rows[j] = value_row(block, hk, lo + j0 + j, bufs + (K == F32 ? 0 : j * kMaxDim));
            value_heads(hk, pos + j0, [&](const float* p, float* ah, int nt) {
              switch (nt) {
                case 4: add_values<4>(ah, D, p, kScoreStride, rows, mrows); break;
                case 3: add_values<3>(ah, D, p, kScoreStride, rows, mrows); break;
                case 2: add_values<2>(ah, D, p, kScoreStride, rows, mrows); break;
                default: add_values<1>(ah, D, p, kScoreStride, rows, mrows); break;
              }
            });
          }
        }
        pos += count;
      }
    }
    // The last part of the KV heads' item to finish merges (its acquire sees every part's
    // state, each released by its own decrement).
    if (splits == 1)
      merge(state, 1, s0, hk0, nh);
    else if (__atomic_sub_fetch(left + g * kv_items + kv_item, 1, __ATOMIC_ACQ_REL) == 0)
      merge(parts_state, splits, s0, hk0, nh);
  };
  if (threaded)
    kvpar::parallel_for(n_items, omp_get_max_threads(), run_item);
  else
    for (int64_t item = 0; item < n_items; ++item) run_item(item);
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
  if (a->new_k && ((a->kind != F32 && a->kind != BF16 && a->kind != F16) || !a->new_v))
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
