// Softmax statistics of a few queries over a contiguous float32 KV cache, for XLA:CPU decode,
// called through the XLA FFI (dayzero/kernels/cpu_attention.py says why and what it replaces).
//
//   dayzero_cached_attention: q[B,K,M,H], keys[B,K,H,S], values[B,K,S,H], mask[B,T,S] (bool)
//     -> m[B,K,M], l[B,K,M], o[B,K,M,H] (all float32)
//
// Query row r of group (b, k) is query token r % T (the caller's [B, K, G*T, H] layout). Over the
// positions s that mask[b, r % T, s] shows: m = max of the scores q.k_s, l = sum of exp(score - m),
// o = sum of exp(score - m) * v_s. A row that sees nothing gets m = -inf, l = 0, o = 0 (what
// dayzero.kernels.tiles.merge_stats takes for an empty block). Hidden positions are never read
// into o, so whatever the cache holds there (NaN included) cannot leak in.
//
// Only positions from the first to the last any row of b shows are read. Each (b, k) group's
// positions are cut into pieces that the threads take (several per group when the groups are
// fewer than the threads), read a 512-position chunk at a time with the chunks' statistics
// merged as they come; the pieces are merged in order at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Positions read at a time (a chunk): 512 keys of 64 dims are 128 KiB of keys and as much of values.
constexpr int64_t kChunk = 512;
// Fewer keys than this (positions x key heads, all rows together) are read by the calling thread.
constexpr int64_t kMinParallelKeys = 1024;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 in float32 (Cephes' polynomial after a split into n ln 2 + r; relative error
// ~1e-7), written without branches or calls so that the loops using it vectorize.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + shift) - shift;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

struct Shape {
  int64_t B, K, M, H, S, T;
};

#if defined(__AVX512F__)
// kRows rows' scores for positions [j, j + 16 kVecs): the kRows x kVecs sums stay in registers
// through all H dims (row and vector counts are template arguments so that they can). Each dim's
// keys are a row of positions S apart, so a block reads H short runs: wider blocks make longer runs.
template <int kRows, int kVecs>
void ScoreBlock(const float* q, const float* kh, float* scores, int64_t H, int64_t S, int64_t n, int64_t j) {
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; ++h) {
    __m512 keys[kVecs];
    for (int c = 0; c < kVecs; ++c) keys[c] = _mm512_loadu_ps(kh + h * S + j + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * H + h]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_fmadd_ps(qv, keys[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(scores + r * n + j + 16 * c, acc[r][c]);
}

// kRows rows' outputs o[r, :] = sum over visible j of p[r, j] * values[j, :], H = 16 x kVecs: the
// kRows x kVecs sums stay in registers while the value rows stream by, each loaded once.
template <int kRows, int kVecs>
void ValueBlock(const float* p, const float* values, const bool* const* seen, float* o, int64_t n) {
  constexpr int64_t H = 16 * kVecs;
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < kRows; ++r) {
      if (!seen[r][j]) continue;  // never read a hidden value: 0 * NaN would be NaN
      const __m512 pv = _mm512_set1_ps(p[r * n + j]);
      for (int c = 0; c < kVecs; ++c)
        acc[r][c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(values + j * H + 16 * c), acc[r][c]);
    }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(o + r * H + 16 * c, acc[r][c]);
}

// ValueBlock over all M rows, kBlock rows at a time.
template <int kVecs>
void ValueRows(const float* p, const float* values, const bool* const* seen, float* o, int64_t M, int64_t n) {
  constexpr int kBlock = 16 / kVecs;  // at most 16 accumulator registers
  int64_t r = 0;
  for (; r + kBlock <= M; r += kBlock) ValueBlock<kBlock, kVecs>(p + r * n, values, seen + r, o + r * 16 * kVecs, n);
  for (; r < M; ++r) ValueBlock<1, kVecs>(p + r * n, values, seen + r, o + r * 16 * kVecs, n);
}
#endif

// scores[r, j] = q[r, :] . keys[:, j] for M rows and n positions, keys [H, S] (a row of positions
// per dim, the first at ``kh``).
void Scores(const float* q, const float* kh, float* scores, int64_t M, int64_t H, int64_t S, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  // 64 positions a block (runs of 256 bytes per dim), rows three at a time (12 sums, 4 keys).
  for (; j + 64 <= n; j += 64) {
    int64_t r = 0;
    for (; r + 3 <= M; r += 3) ScoreBlock<3, 4>(q + r * H, kh, scores + r * n, H, S, n, j);
    for (; r < M; ++r) ScoreBlock<1, 4>(q + r * H, kh, scores + r * n, H, S, n, j);
  }
  for (; j + 16 <= n; j += 16)
    for (int64_t r = 0; r < M; ++r) ScoreBlock<1, 1>(q + r * H, kh, scores + r * n, H, S, n, j);
#endif
  for (int64_t r = 0; r < M; ++r)  // without AVX-512 every position, else the last n % 16
    for (int64_t jj = j; jj < n; ++jj) {
      float sum = 0.0f;
      for (int64_t h = 0; h < H; ++h) sum += q[r * H + h] * kh[h * S + jj];
      scores[r * n + jj] = sum;
    }
}

// o[r, :] = sum over visible j of p[r, j] * values[j, :] for M rows, values [n, H]. Hidden
// positions are skipped, never read: 0 * NaN would be NaN.
void Values(const float* p, const float* values, const bool* const* seen, float* o, int64_t M, int64_t H,
            int64_t n) {
#if defined(__AVX512F__)
  switch (H) {
    case 64: return ValueRows<4>(p, values, seen, o, M, n);
    case 128: return ValueRows<8>(p, values, seen, o, M, n);
    case 256: return ValueRows<16>(p, values, seen, o, M, n);
  }
#endif
  std::fill(o, o + M * H, 0.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < n; ++j) {
      if (!seen[r][j]) continue;
      const float pj = p[r * n + j];
      for (int64_t h = 0; h < H; ++h) o[r * H + h] += pj * values[j * H + h];
    }
}

// The statistics of the M query rows of group (b, k) over positions [s0, s1) into m, l, o;
// ``scores`` holds M x (s1 - s0) floats, ``seen`` M row pointers.
void ChunkStats(const Shape& d, const float* q, const float* keys, const float* values, const bool* mask, int64_t b,
                int64_t k, int64_t s0, int64_t s1, float* m, float* l, float* o, float* scores, const bool** seen) {
  const int64_t n = s1 - s0, M = d.M;
  const int64_t group = b * d.K + k;
  Scores(q + group * M * d.H, keys + group * d.H * d.S + s0, scores, M, d.H, d.S, n);
  for (int64_t r = 0; r < M; ++r) {
    seen[r] = mask + (b * d.T + r % d.T) * d.S + s0;
    float* sr = scores + r * n;
    float top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) top = std::max(top, seen[r][j] ? sr[j] : kNegInf);
    float sum = 0.0f;
    if (top != kNegInf) {  // else nothing is visible: l = 0 and no value is read
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sr[j] = seen[r][j] ? ExpNonPositive(sr[j] - top) : 0.0f;
        sum += sr[j];
      }
    }
    m[r] = top, l[r] = sum;
  }
  Values(scores, values + (group * d.S + s0) * d.H, seen, o, M, d.H, n);
}

// [lo, hi): the positions from the first to the last that any query row of b shows.
void VisibleRange(const Shape& d, const bool* mask, int64_t b, int64_t* lo, int64_t* hi) {
  *lo = d.S, *hi = 0;
  for (int64_t t = 0; t < d.T; ++t) {
    const bool* row = mask + (b * d.T + t) * d.S;
    for (int64_t s = 0; s < d.S; ++s)
      if (row[s]) *lo = std::min(*lo, s), *hi = std::max(*hi, s + 1);
  }
  if (*hi <= *lo) *lo = *hi = 0;
}

// Statistics (m2, l2, o2) of M rows merged into (m, l, o), both rescaled to their shared maximum.
void MergeInto(float* m, float* l, float* o, const float* m2, const float* l2, const float* o2, int64_t M,
               int64_t H) {
  for (int64_t r = 0; r < M; ++r) {
    if (m2[r] == kNegInf) continue;  // nothing visible there: nothing to add
    const float top = std::max(m[r], m2[r]);
    const float old_scale = m[r] == kNegInf ? 0.0f : std::exp(m[r] - top), new_scale = std::exp(m2[r] - top);
    l[r] = l[r] * old_scale + l2[r] * new_scale;
    for (int64_t h = 0; h < H; ++h) o[r * H + h] = o[r * H + h] * old_scale + o2[r * H + h] * new_scale;
    m[r] = top;
  }
}

// The statistics of group (b, k)'s rows over positions [s0, s1) into (m, l, o), a chunk at a
// time. Scratch is per thread, so memory stays bounded whatever the batch and context.
void RangeStats(const Shape& d, const float* q, const float* keys, const float* values, const bool* mask, int64_t b,
                int64_t k, int64_t s0, int64_t s1, float* m, float* l, float* o) {
  thread_local std::vector<float> scratch;
  thread_local std::vector<const bool*> seen;
  const int64_t M = d.M, MH = d.M * d.H;
  scratch.resize(M * kChunk + 2 * M + MH);
  seen.resize(M);
  float* scores = scratch.data();
  float *cm = scores + M * kChunk, *cl = cm + M, *co = cl + M;
  std::fill(m, m + M, kNegInf), std::fill(l, l + M, 0.0f), std::fill(o, o + MH, 0.0f);
  for (int64_t s = s0; s < s1; s += kChunk) {
    ChunkStats(d, q, keys, values, mask, b, k, s, std::min(s + kChunk, s1), cm, cl, co, scores, seen.data());
    MergeInto(m, l, o, cm, cl, co, M, d.H);
  }
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                           ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> m_out,
                           ffi::ResultBuffer<ffi::F32> l_out, ffi::ResultBuffer<ffi::F32> o_out) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument(
        "dayzero_cached_attention: needs q[B,K,M,H], keys[B,K,H,S], values[B,K,S,H], mask[B,T,S]");
  const Shape d{qd[0], qd[1], qd[2], qd[3], kd[3], md[1]};
  if (kd[0] != d.B || kd[1] != d.K || kd[2] != d.H || vd[0] != d.B || vd[1] != d.K || vd[2] != d.S || vd[3] != d.H ||
      md[0] != d.B || md[2] != d.S || d.T <= 0 || d.M % d.T)
    return ffi::Error::InvalidArgument("dayzero_cached_attention: shapes disagree (q[B,K,G*T,H], keys[B,K,H,S], "
                                       "values[B,K,S,H], mask[B,T,S])");
  const bool* mp = reinterpret_cast<const bool*>(mask.typed_data());
  const int64_t groups = d.B * d.K, M = d.M, MH = d.M * d.H;
  std::vector<int64_t> lo(d.B), hi(d.B);
  int64_t positions = 0;
  for (int64_t b = 0; b < d.B; ++b) VisibleRange(d, mp, b, &lo[b], &hi[b]), positions += hi[b] - lo[b];
  // Work items: each group's range cut into ``parts`` pieces, enough for every thread to have two
  // when the groups are few (one sequence's decode: its few key heads), at least a chunk each.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t longest = *std::max_element(hi.begin(), hi.end()) - *std::min_element(lo.begin(), lo.end());
  const int64_t most = std::max<int64_t>(longest / kChunk, 1);
  const int64_t parts = std::clamp<int64_t>((2 * threads + groups - 1) / groups, 1, most);
  const int64_t items = groups * parts;
  std::vector<float> im(items * M), il(items * M), io(items * MH);
  // A few hundred positions stay on the calling thread: a hand-off costs more than the work.
  const int64_t workers = positions * d.K < kMinParallelKeys ? 1 : items;
  dayzero::ParallelFor(pool, items, workers, [&](int64_t i) {
    const int64_t g = i / parts, part = i % parts, b = g / d.K, span = hi[b] - lo[b];
    // Piece boundaries on chunk multiples from lo, so a piece's chunks are whole where they can be.
    const int64_t chunks = (span + kChunk - 1) / kChunk;
    const int64_t s0 = std::min(hi[b], lo[b] + chunks * part / parts * kChunk);
    const int64_t s1 = std::min(hi[b], lo[b] + chunks * (part + 1) / parts * kChunk);
    RangeStats(d, q.typed_data(), keys.typed_data(), values.typed_data(), mp, b, g % d.K, s0, s1, im.data() + i * M,
               il.data() + i * M, io.data() + i * MH);
  });
  // Merge each group's pieces in order.
  float* m = m_out->typed_data();
  float* l = l_out->typed_data();
  float* o = o_out->typed_data();
  std::fill(m, m + groups * M, kNegInf), std::fill(l, l + groups * M, 0.0f), std::fill(o, o + groups * MH, 0.0f);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t g = i / parts;
    MergeInto(m + g * M, l + g * M, o + g * MH, im.data() + i * M, il.data() + i * M, io.data() + i * MH, M, d.H);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_cached_attention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
