// The float vector the native CPU kernels (cpu_matvec.cc, cpu_attention.cc) compute with: 16 lanes
// with AVX-512, 8 with AVX2 and FMA (AMD's Zen 2 and 3, Intel before Skylake-SP: no AVX-512),
// none otherwise (kLanes 0: the kernels' scalar loops do all the work). The kernels are written
// once against these few functions, so both widths run the same code, which the tests check on
// whichever machine runs them.
#ifndef DAYZERO_KERNELS_CPU_SIMD_H_
#define DAYZERO_KERNELS_CPU_SIMD_H_

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace dayzero {

#if defined(__AVX512F__)
#define DAYZERO_SIMD 1
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline Vec LoadInt8(const int8_t* p) {  // kLanes int8 values as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Accumulator registers a kernel may hold at once (of 32), leaving room for its operands.
constexpr int kAccumulators = 16;
#elif defined(__AVX2__) && defined(__FMA__)
#define DAYZERO_SIMD 1
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec LoadInt8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
constexpr int kAccumulators = 8;  // of 16
#else
#define DAYZERO_SIMD 0
constexpr int kLanes = 0;
#endif

}  // namespace dayzero

#endif  // DAYZERO_KERNELS_CPU_SIMD_H_
