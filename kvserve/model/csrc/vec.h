// Generic float vectors for kvserve's C++ kernels: vf holds kLanes floats, which the compiler
// maps onto one of the CPU's registers: 16 where it may use AVX-512, 8 with AVX/AVX2, else 4
// (SSE, NEON). Why not always 16: without AVX-512, GCC lowers a 64-byte generic vector
// through the stack, and the paged decode kernel built for AVX2 ran ~9x slower than for
// AVX-512 on the same CPU, not ~2x. Included by the kernels' sources (cpu_ext.py hashes it
// into their build key); internal linkage, so two libraries built for different widths can
// be loaded side by side.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

}  // namespace
