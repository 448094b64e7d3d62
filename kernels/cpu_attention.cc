// Decode attention of a few queries over a contiguous float32 KV cache, for XLA:CPU, called through
// the XLA FFI (dayzero/kernels/cpu_attention.py says why and what it replaces).
//
//   dayzero_cached_attention: q[B,K,M,H], keys[B,K,H,S], values[B,K,S,H], mask[B,T,S] (bool)
//     -> m[B,K,M], l[B,K,M], o[B,K,M,H] (all float32)
//   dayzero_attention_in_place: q[B,T,N,H], k_new[B,T,K,H], v_new[B,T,K,H], keys[B,K,H,S],
//     values[B,K,S,H], starts[B], num_new[B] (int32), sinks[N]; attributes scale, window
//     -> out[B,T,N,H], keys, values (the cache results alias the cache operands): the new keys and
//     values written into the cache, then the whole attention of the step read from it, finished
//     (o / l, sinks joined); one call in place of the write, the new keys' own statistics, the
//     merge and the finish, each a separate XLA op otherwise.
//
// For dayzero_cached_attention:
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
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

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

#if DAYZERO_SIMD
using dayzero::kAccumulators;
using dayzero::kLanes;
using dayzero::Vec;

// kRows rows' scores for positions [j, j + kLanes kVecs): the kRows x kVecs sums stay in
// registers through all H dims (row and vector counts are template arguments so that they can).
// Each dim's keys are a row of positions S apart, so a block reads H short runs: wider blocks
// make longer runs.
template <int kRows, int kVecs>
void ScoreBlock(const float* q, const float* kh, float* scores, int64_t H, int64_t S, int64_t n, int64_t j) {
  Vec acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = dayzero::Zero();
  for (int64_t h = 0; h < H; ++h) {
    Vec keys[kVecs];
    for (int c = 0; c < kVecs; ++c) keys[c] = dayzero::Load(kh + h * S + j + kLanes * c);
    for (int r = 0; r < kRows; ++r) {
      const Vec qv = dayzero::Broadcast(q[r * H + h]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = dayzero::MulAdd(qv, keys[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) dayzero::Store(scores + r * n + j + kLanes * c, acc[r][c]);
}

// kRows rows' outputs o[r, :] = sum over visible j of p[r, j] * values[j, :], H = kLanes x kVecs:
// the kRows x kVecs sums stay in registers while the value rows stream by, each loaded once.
template <int kRows, int kVecs>
void ValueBlock(const float* p, const float* values, const bool* const* seen, float* o, int64_t n) {
  constexpr int64_t H = kLanes * kVecs;
  Vec acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = dayzero::Zero();
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < kRows; ++r) {
      if (!seen[r][j]) continue;  // never read a hidden value: 0 * NaN would be NaN
      const Vec pv = dayzero::Broadcast(p[r * n + j]);
      for (int c = 0; c < kVecs; ++c)
        acc[r][c] = dayzero::MulAdd(pv, dayzero::Load(values + j * H + kLanes * c), acc[r][c]);
    }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) dayzero::Store(o + r * H + kLanes * c, acc[r][c]);
}

// ValueBlock over all M rows of H = kLanes x kVecs, kBlock rows at a time; false (nothing done)
// where one row's sums would not fit the accumulator registers.
template <int kVecs>
bool ValueRows(const float* p, const float* values, const bool* const* seen, float* o, int64_t M, int64_t n) {
  if constexpr (kVecs > kAccumulators) {
    return false;
  } else {
    constexpr int kBlock = kAccumulators / kVecs;
    int64_t r = 0;
    for (; r + kBlock <= M; r += kBlock)
      ValueBlock<kBlock, kVecs>(p + r * n, values, seen + r, o + r * kLanes * kVecs, n);
    for (; r < M; ++r) ValueBlock<1, kVecs>(p + r * n, values, seen + r, o + r * kLanes * kVecs, n);
    return true;
  }
}
#endif

// scores[r, j] = q[r, :] . keys[:, j] for M rows and n positions, keys [H, S] (a row of positions
// per dim, the first at ``kh``).
void Scores(const float* q, const float* kh, float* scores, int64_t M, int64_t H, int64_t S, int64_t n) {
  int64_t j = 0;
#if DAYZERO_SIMD
  // Four vectors of positions a block (64 with AVX-512: runs of 256 bytes per dim), rows three
  // at a time with AVX-512 (12 sums, 4 keys), two with AVX2 (8 sums of its 16 registers).
  constexpr int kRowsAtOnce = kAccumulators >= 12 ? 3 : 2;
  constexpr int64_t kBlock = 4 * kLanes;
  for (; j + kBlock <= n; j += kBlock) {
    int64_t r = 0;
    for (; r + kRowsAtOnce <= M; r += kRowsAtOnce)
      ScoreBlock<kRowsAtOnce, 4>(q + r * H, kh, scores + r * n, H, S, n, j);
    for (; r < M; ++r) ScoreBlock<1, 4>(q + r * H, kh, scores + r * n, H, S, n, j);
  }
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t r = 0; r < M; ++r) ScoreBlock<1, 1>(q + r * H, kh, scores + r * n, H, S, n, j);
#endif
  for (int64_t r = 0; r < M; ++r)  // without vectors every position, else the last n % kLanes
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
#if DAYZERO_SIMD
  switch (H) {  // the head sizes models use, where one row's sums fit the registers
    case 64:
      if (ValueRows<64 / kLanes>(p, values, seen, o, M, n)) return;
      break;
    case 128:
      if (ValueRows<128 / kLanes>(p, values, seen, o, M, n)) return;
      break;
    case 256:
      if (ValueRows<256 / kLanes>(p, values, seen, o, M, n)) return;
      break;
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

// The statistics (m [B,K,M], l [B,K,M], o [B,K,M,H]) of queries ``q`` [B,K,M,H] over the positions
// of ``keys`` [B,K,H,S] / ``values`` [B,K,S,H] that ``mask`` [B,T,S] shows (see the file comment).
void CacheStats(ffi::ThreadPool& pool, const Shape& d, const float* q, const float* keys, const float* values,
                const bool* mask, float* m, float* l, float* o) {
  const int64_t groups = d.B * d.K, M = d.M, MH = d.M * d.H;
  std::vector<int64_t> lo(d.B), hi(d.B);
  int64_t positions = 0;
  for (int64_t b = 0; b < d.B; ++b) VisibleRange(d, mask, b, &lo[b], &hi[b]), positions += hi[b] - lo[b];
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
    RangeStats(d, q, keys, values, mask, b, g % d.K, s0, s1, im.data() + i * M, il.data() + i * M,
               io.data() + i * MH);
  });
  // Merge each group's pieces in order.
  std::fill(m, m + groups * M, kNegInf), std::fill(l, l + groups * M, 0.0f), std::fill(o, o + groups * MH, 0.0f);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t g = i / parts;
    MergeInto(m + g * M, l + g * M, o + g * MH, im.data() + i * M, il.data() + i * M, io.data() + i * MH, M, d.H);
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
  CacheStats(pool, d, q.typed_data(), keys.typed_data(), values.typed_data(),
             reinterpret_cast<const bool*>(mask.typed_data()), m_out->typed_data(), l_out->typed_data(),
             o_out->typed_data());
  return ffi::Error::Success();
}

// A decode step's whole attention over a contiguous cache it writes first (see the file comment):
// the T new keys and values of each row b go into slots starts[b] + j (those inside the cache),
// then query t of row b attends over the slots s < starts[b] + min(t + 1, num_new[b]) (and
// starts[b] + t - s < window when window > 0), new keys included: the visibility
// ``transformer.attention_masks`` gives the cached and the new keys together.
ffi::Error AttentionInPlace(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                            ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> keys_in,
                            ffi::Buffer<ffi::F32> values_in, ffi::Buffer<ffi::S32> starts,
                            ffi::Buffer<ffi::S32> num_new, ffi::Buffer<ffi::F32> sinks,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> keys_out,
                            ffi::ResultBuffer<ffi::F32> values_out, float scale, int64_t window) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), kd = keys_in.dimensions();
  if (qd.size() != 4 || nd.size() != 4 || kd.size() != 4)
    return ffi::Error::InvalidArgument("dayzero_attention_in_place: needs q[B,T,N,H], k_new/v_new[B,T,K,H], "
                                       "keys[B,K,H,S], values[B,K,S,H]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = nd[2], S = kd[3];
  if (K <= 0 || N % K || nd[0] != B || nd[1] != T || nd[3] != H || v_new.element_count() != B * T * K * H ||
      kd[0] != B || kd[1] != K || kd[2] != H || values_in.element_count() != B * K * S * H ||
      starts.element_count() != B || num_new.element_count() != B || sinks.element_count() != N)
    return ffi::Error::InvalidArgument("dayzero_attention_in_place: shapes disagree (q[B,T,N,H], k_new and v_new "
                                       "[B,T,K,H], keys[B,K,H,S], values[B,K,S,H], starts[B], num_new[B], sinks[N])");
  const int64_t G = N / K;
  // The cache is read and written through the results, which alias the cache operands.
  float* keys = keys_out->typed_data();
  float* values = values_out->typed_data();
  const int32_t* start = starts.typed_data();
  const int32_t* count = num_new.typed_data();
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < T; ++j) {
      const int64_t s = start[b] + j;
      if (s < 0 || s >= S) continue;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t from = ((b * T + j) * K + k) * H + h;
          keys[((b * K + k) * H + h) * S + s] = kn[from];
          values[((b * K + k) * S + s) * H + h] = vn[from];
        }
    }
  std::vector<char> mask(B * T * S, 0);  // char, not vector<bool>: CacheStats reads bool bytes
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t hi = std::min<int64_t>(S, start[b] + std::min<int64_t>(t + 1, count[b]));
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start[b] + t - window + 1) : 0;
      for (int64_t s = lo; s < hi; ++s) mask[(b * T + t) * S + s] = 1;
    }
  // Queries as [B,K,G*T,H], scaled: row g * T + t of group (b, k) is head k * G + g of token t.
  const Shape d{B, K, G * T, H, S, T};
  std::vector<float> qg(B * N * T * H), m(B * K * G * T), l(m.size()), o(qg.size());
  const float* qp = q.typed_data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        float* row = qg.data() + ((b * K + n / G) * G * T + (n % G) * T + t) * H;
        const float* from = qp + ((b * T + t) * N + n) * H;
        for (int64_t h = 0; h < H; ++h) row[h] = from[h] * scale;
      }
  CacheStats(pool, d, qg.data(), keys, values, reinterpret_cast<const bool*>(mask.data()), m.data(), l.data(),
             o.data());
  // o / l back in [B,T,N,H]. A sink joins as statistics (sink, 1, 0): a key of value zero, merged
  // like any piece (MergeInto skips a sink of -inf: none).
  const float* sink = sinks.typed_data();
  const float one = 1.0f;
  const std::vector<float> zeros(H, 0.0f);
  float* y = out->typed_data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t r = (b * K + n / G) * G * T + (n % G) * T + t;
        MergeInto(&m[r], &l[r], &o[r * H], &sink[n], &one, zeros.data(), 1, H);
        const float inverse = l[r] > 0 ? 1.0f / l[r] : 0.0f;
        float* to = y + ((b * T + t) * N + n) * H;
        for (int64_t h = 0; h < H; ++h) to[h] = o[r * H + h] * inverse;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_attention_in_place, AttentionInPlace,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
