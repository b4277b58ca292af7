// A work-claiming thread pool: parallel_for(n_chunks, num_threads, fn) runs fn(i) for every
// i < n_chunks on up to num_threads threads, the caller one of them (issue 31).
//
// Why not OpenMP's `parallel for`: its fork/join returns when every thread of the team has
// *arrived*, and with static scheduling each thread owns a fixed share. Beside one busy
// process on a 2-core machine a descheduled team thread held every call for its time slice
// (milliseconds), and a batch-1 decode step makes ~120 calls. Here chunks are claimed from
// an atomic counter and the call returns once every chunk is *done* (a done counter): a
// thread that is not running claims nothing and the others take its share; one that wakes
// after the call finds no work and waits again. Chunks are small (callers size them to a few
// microseconds), so a thread descheduled mid-chunk costs one chunk.
//
// Waiting workers spin for KVSERVE_POOL_SPIN_US microseconds (default 50: a decode step's
// calls come back to back) and then sleep on a futex, so an idle pool burns no core.
// One pool per process: the first library loaded that includes this keeps it, and every
// later one is handed its `kvserve_pool_run` (`kvserve_pool_share`, called by cpu_ext.py at
// load). With a pool per library a decode step's attention (paged_decode) and projections
// (qgemv) each woke their own worker: three threads on two cores, a pool's worker spinning
// while the other's ran. A call while the pool is busy (another Python thread's call) runs
// every chunk on its caller. A child process after fork() gets a fresh pool (the parent's
// threads are not in it).
//
// KVSERVE_CPU_POOL=omp makes parallel_for an OpenMP `parallel for` (static schedule) over
// the same chunks (batch-1 decode beside a busy process: bench_contention.py, in git
// history before commit c558855).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVP_PAUSE() _mm_pause()
#else
#define KVP_PAUSE() std::this_thread::yield()
#endif

namespace kvpar {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

inline bool use_openmp() {
  static const bool omp = [] {
    const char* v = std::getenv("KVSERVE_CPU_POOL");
    return v != nullptr && std::strcmp(v, "omp") == 0;
  }();
  return omp;
}

inline int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* v = std::getenv("KVSERVE_POOL_SPIN_US");
    const long us = v != nullptr ? std::atol(v) : 50;
    return static_cast<int64_t>(us < 0 ? 0 : us) * 1000;
  }();
  return ns;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Pool {
 public:
  Pool() : pid_(getpid()) {}
  // Workers never exit: the library stays loaded for the process's life.

  pid_t pid() const { return pid_; }

  void run(int64_t n, int threads, ChunkFn fn, void* ctx) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || threads <= 1 || n <= 1 || n >= (int64_t{1} << 24)) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    grow(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    threads_.store(threads, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = (gen_.load(std::memory_order_relaxed) + 1) & 0xffffu;
    // the claim word: generation (16 bits) | chunk count (24) | next chunk (24)
    claim_.store((g << 48) | (static_cast<uint64_t>(n) << 24), std::memory_order_release);
    gen_.store(static_cast<uint32_t>(g), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAKE_PRIVATE, INT32_MAX,
              nullptr, nullptr, 0);
    work(g);
    // every chunk claimed: wait until the others' are done (a chunk is microseconds)
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) KVP_PAUSE();
      else std::this_thread::yield();
    }
  }

 private:
  // Claim and run chunks of generation g until none is left; a stale g claims nothing.
  void work(uint64_t g) {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      for (;;) {
        if ((c >> 48) != g || (c & 0xffffffu) >= ((c >> 24) & 0xffffffu)) return;
        if (claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
          break;
      }
      fn_(ctx_, static_cast<int64_t>(c & 0xffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void grow(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      const int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
      workers_.back().detach();
    }
  }

  void loop(int id) {
    uint32_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        const int64_t until = now_ns() + spin_ns();
        while ((g = gen_.load(std::memory_order_acquire)) == seen && now_ns() < until)
          for (int i = 0; i < 64; ++i) KVP_PAUSE();
        while (g == seen) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAIT_PRIVATE, seen,
                  nullptr, nullptr, 0);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          g = gen_.load(std::memory_order_acquire);
        }
      }
      seen = g;
      // a worker beyond the call's thread count sits this one out (the caller is thread 0)
      if (id + 1 < threads_.load(std::memory_order_relaxed)) work(g);
    }
  }

  const pid_t pid_;
  std::mutex busy_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> threads_{0};
  std::atomic<int> sleepers_{0};
  ChunkFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

inline Pool& pool() {
  static std::atomic<Pool*> p{nullptr};
  static std::mutex m;
  Pool* cur = p.load(std::memory_order_acquire);
  if (cur == nullptr || cur->pid() != getpid()) {
    std::lock_guard<std::mutex> lock(m);
    cur = p.load(std::memory_order_acquire);
    if (cur == nullptr || cur->pid() != getpid()) {
      cur = new Pool();  // after fork the parent's pool (and its threads) is left behind
      p.store(cur, std::memory_order_release);
    }
  }
  return *cur;
}

// fn(i) for i < n_chunks as an OpenMP `parallel for` (static schedule) on torch's team.
template <class F>
void omp_for(int64_t n_chunks, int num_threads, const F& fn) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t i = 0; i < n_chunks; ++i) fn(i);
}

using RunFn = void (*)(int64_t n, int threads, ChunkFn fn, void* ctx);
// Another library's pool, where cpu_ext.py shared it (null: this library's own)
inline std::atomic<RunFn>& shared_run() {
  static std::atomic<RunFn> run{nullptr};
  return run;
}

// fn(i) for i < n_chunks on up to num_threads threads (the caller included); returns when
// all are done. fn: any callable taking int64_t.
template <class F>
void parallel_for(int64_t n_chunks, int num_threads, const F& fn) {
  if (n_chunks <= 0) return;
  if (use_openmp()) {
    omp_for(n_chunks, num_threads, fn);
    return;
  }
  const ChunkFn chunk = [](void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
  void* ctx = const_cast<void*>(static_cast<const void*>(&fn));
  if (const RunFn run = shared_run().load(std::memory_order_acquire)) {
    run(n_chunks, num_threads, chunk, ctx);
    return;
  }
  pool().run(n_chunks, num_threads, chunk, ctx);
}

}  // namespace kvpar

// (Defined here, not inline: each library includes this header in its one source file.)
extern "C" {
// This library's pool, for another library to run its chunks on (see above).
__attribute__((used)) void kvserve_pool_run(int64_t n, int threads, kvpar::ChunkFn fn, void* ctx) {
  kvpar::pool().run(n, threads, fn, ctx);
}
// Run this library's parallel_for on `run` (another library's kvserve_pool_run).
__attribute__((used)) void kvserve_pool_share(kvpar::RunFn run) {
  kvpar::shared_run().store(run, std::memory_order_release);
}
}
