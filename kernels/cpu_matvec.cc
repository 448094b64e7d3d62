// Few-row matrix products with int8, int4 and float32 weights for XLA:CPU decode, called through
// the XLA FFI (dayzero/kernels/cpu_matvec.py builds and registers this file; its docstring says why).
//
//   dayzero_matvec_i8:  y[M,N] = (x[M,K] @ float(w[K,N])) * scale[N]           (x, scale, y float32)
//   dayzero_matvec_i4:  y[M,N] = sum over k of x[:,k] * float(w[k,:]) * scale[k / group, :]
//   dayzero_matvec_f32: y[M,N] = x[M,K] @ w[K,N]                               (all float32)
//
// w's rows are streamed in order and converted to float in registers, never written out: the
// product reads one byte (int8) or half a byte (int4) per weight, where XLA:CPU's own dot would
// first write the fp32 matrix. XLA hands an int4 array over packed, two values per byte, the
// even-indexed value in the low nibble (checked in tests/test_cpu_matvec.py).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>
#include "cpu_kernels.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using W = int8_t;  // the weights' element type

// Rows of w a part streams per pass: the partial sums are read and written once per kRows rows.
constexpr int64_t kRows = dayzero::kProductRows;

// acc[M,N] += x[:, k0:k1] @ w[k0:k1, :], each pass taking one row from each eighth of the range
// (eight contiguous streams, as RowsF32 says why), the last (k1 - k0) % kRows rows one at a time.
void Rows(const float* x, const W* __restrict w, float* __restrict acc, int64_t M, int64_t K, int64_t N, int64_t k0,
          int64_t k1) {
  const int64_t stride = (k1 - k0) / kRows;
  for (int64_t j = 0; j < stride; ++j) {
    const W* __restrict rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = w + (k0 + r * stride + j) * N;
    const W *w0 = rows[0], *w1 = rows[1], *w2 = rows[2], *w3 = rows[3], *w4 = rows[4], *w5 = rows[5], *w6 = rows[6],
            *w7 = rows[7];
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k0 + j;
      const float x0 = xm[0], x1 = xm[stride], x2 = xm[2 * stride], x3 = xm[3 * stride], x4 = xm[4 * stride],
                  x5 = xm[5 * stride], x6 = xm[6 * stride], x7 = xm[7 * stride];
      float* __restrict a = acc + m * N;
      int64_t n = 0;
#if DAYZERO_SIMD
      // 32 columns a step, their sums held in registers through the pass, each weight converted
      // in a register (cpu_simd.h). SmolLM2's int8 decode on AVX2 (AMD EPYC, 2 cores): 1.88x fp32
      // with this block, 1.45x with the loop below alone (auto-vectorized, eight products added
      // per column; bench/quant.py).
      using dayzero::kLanes;
      constexpr int kVecs = 32 / kLanes;
      const dayzero::Vec xr[kRows] = {dayzero::Broadcast(x0), dayzero::Broadcast(x1), dayzero::Broadcast(x2),
                                      dayzero::Broadcast(x3), dayzero::Broadcast(x4), dayzero::Broadcast(x5),
                                      dayzero::Broadcast(x6), dayzero::Broadcast(x7)};
      for (; n + 32 <= N; n += 32) {
        dayzero::Vec sums[kVecs];
        for (int c = 0; c < kVecs; ++c) sums[c] = dayzero::Load(a + n + c * kLanes);
        for (int r = 0; r < kRows; ++r)
          for (int c = 0; c < kVecs; ++c)
            sums[c] = dayzero::MulAdd(xr[r], dayzero::LoadInt8(rows[r] + n + c * kLanes), sums[c]);
        for (int c = 0; c < kVecs; ++c) dayzero::Store(a + n + c * kLanes, sums[c]);
      }
#endif
      for (; n < N; ++n)  // every column without vectors, else the last N % 32
        a[n] += (x0 * static_cast<float>(w0[n]) + x1 * static_cast<float>(w1[n])) + (x2 * static_cast<float>(w2[n]) +
                x3 * static_cast<float>(w3[n])) + ((x4 * static_cast<float>(w4[n]) + x5 * static_cast<float>(w5[n])) +
                (x6 * static_cast<float>(w6[n]) + x7 * static_cast<float>(w7[n])));
    }
  }
  int64_t k = k0 + kRows * stride;
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
      float* __restrict a = acc + m * N;
      const W* __restrict wr = w + k * N;
      for (int64_t n = 0; n < N; ++n) a[n] += xv * static_cast<float>(wr[n]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kSplit = 32;  // int4 partial sums: each block of 32 columns held evens first, then odds
#elif DAYZERO_SIMD
constexpr int64_t kSplit = 16;  // AVX2: blocks of 16 columns, evens first
#else
constexpr int64_t kSplit = 0;  // no vectors: int4 partial sums in column order
#endif

// The column whose sum an int4 partial holds at position p of a row of N (see kSplit).
inline int64_t SplitColumn(int64_t p, int64_t N) {
  if (kSplit == 0 || p >= N / kSplit * kSplit) return p;
  const int64_t offset = p % kSplit, half = kSplit / 2;
  return p - offset + (offset < half ? 2 * offset : 2 * (offset - half) + 1);
}

// acc[M,N] += sum over k in [k0, k1) of x[:,k] * float(w[k,:]) * scale[k / group, :], w int4
// packed two per byte, acc in SplitColumn's order. Rows are taken kRows at a time, every pass
// inside one group (k0 and group are multiples of kRows; the caller checks): the pass's sum is
// scaled once per column.
void RowsI4(const float* x, const uint8_t* __restrict w, const float* __restrict scale, float* __restrict acc,
            int64_t M, int64_t K, int64_t N, int64_t group, int64_t k0, int64_t k1) {
  const int64_t row_bytes = N / 2;
  for (int64_t k = k0; k < k1; k += kRows) {
    const uint8_t* __restrict rows = w + k * row_bytes;
    const float* __restrict s = scale + (k / group) * N;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      float* __restrict a = acc + m * N;
      int64_t n = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // 32 columns (16 bytes of each row) per step: each byte widened to a 32-bit lane, its low
      // nibble (even column) and high nibble (odd column) looked up in a table of the 16 signed
      // values as floats. Sums stay split into evens and odds; the scales are split to match.
      // Every 64 bytes of a row, the next pass's rows are prefetched: the hardware prefetchers
      // see kRows short streams (a SmolLM2 row is 0.1-24 KB), and asking for the next pass's
      // lines while this one computes measured 1.3-1.5x faster (30 layers of SmolLM2 shapes and
      // the head: 5.1-5.6 ms against 7.3-8.1 ms, min of 100; the same prefetch did not speed up
      // the int8 kernel, whose rows are twice as long).
      const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
      const __m512i low = _mm512_set1_epi32(0x0F);
      const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
      __m512 xr[kRows];
      for (int r = 0; r < kRows; ++r) xr[r] = _mm512_set1_ps(xm[r]);
      for (; n + kSplit <= N; n += kSplit) {
        __m512 even_sum = _mm512_setzero_ps(), odd_sum = _mm512_setzero_ps();
        if (n % 128 == 0 && k + kRows < k1)  // 128 columns: 64 bytes, a cache line
          for (int r = 0; r < kRows; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(rows + (r + kRows) * row_bytes + n / 2), _MM_HINT_T0);
        for (int r = 0; r < kRows; ++r) {
          const __m512i b = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * row_bytes + n / 2)));
          even_sum = _mm512_fmadd_ps(xr[r], _mm512_permutexvar_ps(_mm512_and_si512(b, low), values), even_sum);
          odd_sum = _mm512_fmadd_ps(xr[r], _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values), odd_sum);
        }
        const __m512 s0 = _mm512_loadu_ps(s + n), s1 = _mm512_loadu_ps(s + n + 16);
        _mm512_storeu_ps(a + n, _mm512_fmadd_ps(even_sum, _mm512_permutex2var_ps(s0, evens, s1), _mm512_loadu_ps(a + n)));
        _mm512_storeu_ps(a + n + 16,
                         _mm512_fmadd_ps(odd_sum, _mm512_permutex2var_ps(s0, odds, s1), _mm512_loadu_ps(a + n + 16)));
      }
#elif DAYZERO_SIMD
      // AVX2: 32 columns (16 bytes of each row) per step, as two blocks of 16 (kSplit), each
      // byte widened to a 32-bit lane. A nibble v becomes a float without a conversion: the bits
      // of v ^ 8 (0-15, the two's complement value plus 8) under the exponent of 2^23 read as
      // 2^23 + 8 + value, and one subtraction leaves the value. Four sums (two blocks, evens and
      // odds) in flight rather than two: the FMA chains of one block were what held it back.
      // SmolLM2 int4-all decode (bench/quant.py, two runs minutes apart): 79.4 tok/s with one
      // block of 16 and a conversion, 86.2 with this.
      const __m256i low = _mm256_set1_epi32(0x0F), magic_bits = _mm256_set1_epi32(0x4B000008);
      const __m256 magic = _mm256_set1_ps(8388616.0f);  // 2^23 + 8
      const __m256i by_parity = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
      auto value = [&](__m256i nibbles) {
        return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_xor_si256(nibbles, magic_bits)), magic);
      };
      // acc's block of 16 at column c += the block's evens and odds sums times their scales
      // (each 8 scales as [evens, odds], then the two halves' evens together and odds together).
      auto scaled = [&](int64_t c, __m256 even, __m256 odd) {
        const __m256 s0 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + c), by_parity);
        const __m256 s1 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + c + 8), by_parity);
        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(even, _mm256_permute2f128_ps(s0, s1, 0x20), _mm256_loadu_ps(a + c)));
        _mm256_storeu_ps(a + c + 8,
                         _mm256_fmadd_ps(odd, _mm256_permute2f128_ps(s0, s1, 0x31), _mm256_loadu_ps(a + c + 8)));
      };
      __m256 xr[kRows];
      for (int r = 0; r < kRows; ++r) xr[r] = _mm256_set1_ps(xm[r]);
      for (; n + 2 * kSplit <= N; n += 2 * kSplit) {
        __m256 even0 = _mm256_setzero_ps(), odd0 = _mm256_setzero_ps();
        __m256 even1 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
        if (n % 128 == 0 && k + kRows < k1)
          for (int r = 0; r < kRows; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(rows + (r + kRows) * row_bytes + n / 2), _MM_HINT_T0);
        for (int r = 0; r < kRows; ++r) {
          const uint8_t* p = rows + r * row_bytes + n / 2;
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
          even0 = _mm256_fmadd_ps(xr[r], value(_mm256_and_si256(b0, low)), even0);
          odd0 = _mm256_fmadd_ps(xr[r], value(_mm256_srli_epi32(b0, 4)), odd0);
          even1 = _mm256_fmadd_ps(xr[r], value(_mm256_and_si256(b1, low)), even1);
          odd1 = _mm256_fmadd_ps(xr[r], value(_mm256_srli_epi32(b1, 4)), odd1);
        }
        scaled(n, even0, odd0), scaled(n + kSplit, even1, odd1);
      }
      if (n + kSplit <= N) {  // a last block of 16 (N % 32 >= 16): the same, alone
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        for (int r = 0; r < kRows; ++r) {
          const __m256i b = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + r * row_bytes + n / 2)));
          even = _mm256_fmadd_ps(xr[r], value(_mm256_and_si256(b, low)), even);
          odd = _mm256_fmadd_ps(xr[r], value(_mm256_srli_epi32(b, 4)), odd);
        }
        scaled(n, even, odd);
        n += kSplit;
      }
#endif
      for (; n < N; ++n) {  // every column without vectors, else the last N % kSplit
        float sum = 0;
        for (int r = 0; r < kRows; ++r) {
          const uint8_t byte = rows[r * row_bytes + n / 2];
          const int nibble = (n % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
          sum += xm[r] * static_cast<float>(nibble < 8 ? nibble : nibble - 16);
        }
        a[n] += sum * s[n];
      }
    }
  }
}

}  // namespace

namespace dayzero {

// acc[M,N] += x[:, k0:k1] @ w[k0:k1, :] for float32 w, kRows rows per pass (k0 and k1 - k0 are
// multiples of kRows; the caller checks). Each 32 columns' partial sums stay in registers through
// the pass (two with AVX-512, four with AVX2; cpu_simd.h). With AVX-512, XLA:CPU's own dot of the
// same few-row products read the weights 1.3x slower (30 layers of SmolLM2's projections and the
// head, all read from memory, min of 60: 12.5-15.0 ms against 16.9-17.5 ms); prefetching the next
// pass, as the int4 kernel does, did not help here.
//
// The pass's rows are not consecutive but one from each eighth of [k0, k1): each of the
// eight reads goes through its own contiguous stretch of memory, which the hardware prefetchers
// follow, where eight consecutive rows of a short matrix (a SmolLM2 row of 576 floats is 2.3 KB)
// restart all eight streams every pass. SmolLM2's decode on a 2-core AMD EPYC (AVX2), in one
// process: 18.8 ms a token against 20.8 with consecutive rows (best of 8 runs each, interleaved).
void RowsF32(const float* x, const float* __restrict w, float* __restrict acc, int64_t M, int64_t K, int64_t N,
             int64_t k0, int64_t k1) {
  constexpr int64_t kRows = kProductRows;
  const int64_t stride = (k1 - k0) / kRows;  // rows per stream: pass j reads rows k0 + r * stride + j
  for (int64_t j = 0; j < stride; ++j) {
    const float* __restrict row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = w + (k0 + r * stride + j) * N;
    for (int64_t m = 0; m < M; ++m) {
      float xm[kRows];
      for (int r = 0; r < kRows; ++r) xm[r] = x[m * K + k0 + r * stride + j];
      float* __restrict a = acc + m * N;
      int64_t n = 0;
#if DAYZERO_SIMD
      using dayzero::kLanes;
      constexpr int kVecs = 32 / kLanes;  // 32 columns a step: two vectors (AVX-512) or four (AVX2)
      dayzero::Vec xr[kRows];
      for (int r = 0; r < kRows; ++r) xr[r] = dayzero::Broadcast(xm[r]);
      for (; n + 32 <= N; n += 32) {
        dayzero::Vec sums[kVecs];
        for (int c = 0; c < kVecs; ++c) sums[c] = dayzero::Load(a + n + c * kLanes);
        for (int r = 0; r < kRows; ++r)
          for (int c = 0; c < kVecs; ++c)
            sums[c] = dayzero::MulAdd(xr[r], dayzero::Load(row[r] + n + c * kLanes), sums[c]);
        for (int c = 0; c < kVecs; ++c) dayzero::Store(a + n + c * kLanes, sums[c]);
      }
#endif
      for (; n < N; ++n) {  // every column without vectors, else the last N % 32
        float sum = a[n];
        for (int r = 0; r < kRows; ++r) sum += xm[r] * row[r][n];
        a[n] = sum;
      }
    }
  }
}

void RowsInt8(const float* x, const int8_t* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1) {
  ::Rows(x, w, acc, M, K, N, k0, k1);
}

void RowsInt4(const float* x, const uint8_t* w, const float* scale, float* acc, int64_t M, int64_t K, int64_t N,
              int64_t group, int64_t k0, int64_t k1) {
  ::RowsI4(x, w, scale, acc, M, K, N, group, k0, k1);
}

int64_t Int4Column(int64_t p, int64_t N) { return ::SplitColumn(p, N); }

}  // namespace dayzero

namespace {

using dayzero::RowsF32;

// Sums parts of w's rows (ranges whose boundaries are multiples of ``align`` rows, each summed
// into its own partial by ``rows``) on the pool and the calling thread into y[M,N], times
// ``column_scale`` (per column; none for int4, whose parts are scaled per group and ``split``: in
// SplitColumn's order). Where neither applies (float32) the first part sums into y itself.
void Run(ffi::ThreadPool pool, std::function<void(float*, int64_t, int64_t)> rows, const float* column_scale,
         float* y, int64_t M, int64_t K, int64_t N, int64_t align, bool split) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Small products stay on the calling thread: a hand-off costs more than the work.
  const int64_t parts = (K * N < (1 << 16) || K < 2 * kRows) ? 1 : std::min<int64_t>(threads, K / kRows);
  const int64_t MN = M * N;
  const bool direct = !split && column_scale == nullptr;
  std::vector<float> partial((parts - direct) * MN, 0.0f);
  if (direct) std::fill(y, y + MN, 0.0f);
  auto sums = [&](int64_t p) {  // where part p sums
    return direct ? (p == 0 ? y : partial.data() + (p - 1) * MN) : partial.data() + p * MN;
  };
  auto bound = [=](int64_t p) { return p == parts ? K : (K * p / parts) / align * align; };
  dayzero::ParallelFor(pool, parts, parts, [&](int64_t p) { rows(sums(p), bound(p), bound(p + 1)); });
  if (direct) {  // y holds part 0's sums: add the others'
    for (int64_t p = 1; p < parts; ++p) {
      const float* part = sums(p);
      for (int64_t i = 0; i < MN; ++i) y[i] += part[i];
    }
    return;
  }
  for (int64_t row = 0; row < M; ++row)  // by row and column: no division per element
    for (int64_t n = 0; n < N; ++n) {
      float sum = 0;
      for (int64_t p = 0; p < parts; ++p) sum += partial[p * MN + row * N + n];
      const int64_t column = split ? SplitColumn(n, N) : n;
      y[row * N + column] = column_scale == nullptr ? sum : sum * column_scale[column];
    }
}

ffi::Error MatvecI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || scale.element_count() != wd[1])
    return ffi::Error::InvalidArgument("dayzero_matvec_i8: shapes must be x[M,K], w[K,N], scale[N]");
  const float* xp = x.typed_data();
  const W* wp = w.typed_data();
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  Run(pool, [=](float* acc, int64_t k0, int64_t k1) { Rows(xp, wp, acc, M, K, N, k0, k1); }, scale.typed_data(),
      y->typed_data(), M, K, N, 1, false);
  return ffi::Error::Success();
}

ffi::Error MatvecI4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (w.element_type() != ffi::S4 || xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("dayzero_matvec_i4: shapes must be x[M,K] f32, w[K,N] s4, scale[K/group,N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (group <= 0 || group % kRows || K % kRows || N % 2 || sd[1] != N || sd[0] != (K + group - 1) / group)
    return ffi::Error::InvalidArgument("dayzero_matvec_i4: needs K and group multiples of 8, N even, scale[K/group,N]");
  const float* xp = x.typed_data();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const float* sp = scale.typed_data();
  Run(pool, [=](float* acc, int64_t k0, int64_t k1) { RowsI4(xp, wp, sp, acc, M, K, N, group, k0, k1); }, nullptr,
      y->typed_data(), M, K, N, kRows, true);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_matvec_i8, MatvecI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

ffi::Error MatvecF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[1] % kRows)
    return ffi::Error::InvalidArgument("dayzero_matvec_f32: shapes must be x[M,K], w[K,N] with K a multiple of 8");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  Run(pool, [=](float* acc, int64_t k0, int64_t k1) { RowsF32(xp, wp, acc, M, K, N, k0, k1); }, nullptr,
      y->typed_data(), M, K, N, kRows, false);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_matvec_i4, MatvecI4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_matvec_f32, MatvecF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
