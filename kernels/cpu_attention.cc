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
#include "cpu_kernels.h"
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

struct Shape {
  int64_t B, K, M, H, S, T;
};

#if DAYZERO_SIMD
using dayzero::kAccumulators;
using dayzero::kLanes;
using dayzero::Vec;

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
//
// Eight dims at a time, each row's sums built up in ``scores`` over the dims' runs of n positions
// read straight through: eight sequential streams. Blocks of a few positions over all H dims,
// their sums in registers, read H runs at once, 16 KiB apart in a cache of 4096 positions: more
// streams than the prefetchers follow, on the same cache sets. SmolLM2's attention over 2048
// positions (30 layers, one call each, 2-core AMD EPYC, runs alternating): 5.5-6.0 ms (one run
// 8.4) against 7.8-8.1 with those blocks.
void Scores(const float* q, const float* kh, float* scores, int64_t M, int64_t H, int64_t S, int64_t n) {
  std::fill(scores, scores + M * n, 0.0f);
  constexpr int kDims = 8;
  int64_t h = 0;
  for (; h + kDims <= H; h += kDims)
    for (int64_t r = 0; r < M; ++r) {
      const float* qr = q + r * H + h;
      float* sr = scores + r * n;
      int64_t j = 0;
#if DAYZERO_SIMD
      Vec qv[kDims];
      for (int d = 0; d < kDims; ++d) qv[d] = dayzero::Broadcast(qr[d]);
      for (; j + kLanes <= n; j += kLanes) {
        Vec sum = dayzero::Load(sr + j);
        for (int d = 0; d < kDims; ++d) sum = dayzero::MulAdd(qv[d], dayzero::Load(kh + (h + d) * S + j), sum);
        dayzero::Store(sr + j, sum);
      }
#endif
      for (; j < n; ++j) {  // without vectors every position, else the last n % kLanes
        float sum = sr[j];
        for (int d = 0; d < kDims; ++d) sum += qr[d] * kh[(h + d) * S + j];
        sr[j] = sum;
      }
    }
  for (; h < H; ++h)  // the last H % 8 dims
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < n; ++j) scores[r * n + j] += q[r * H + h] * kh[h * S + j];
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
    // Read as bytes: GCC vectorizes no loop that loads a bool next to floats.
    const uint8_t* visible = reinterpret_cast<const uint8_t*>(seen[r]);
    float* sr = scores + r * n;
    float top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) top = std::max(top, visible[j] ? sr[j] : kNegInf);
    float sum = 0.0f;
    if (top != kNegInf) {  // else nothing is visible: l = 0 and no value is read
      // The exp of every position (of 0 where hidden: a score there may be NaN), then the hidden
      // ones zeroed: with the exp taken only where visible, perf showed the loop running one
      // position at a time.
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float e = dayzero::Exp(visible[j] != 0 ? sr[j] - top : 0.0f);
        sr[j] = visible[j] != 0 ? e : 0.0f;
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

}  // namespace

namespace dayzero {

// The positions of the cache that a mask shows, cut into pieces for the threads: each (b, k)
// group's range from the first to the last visible position, in ``parts`` pieces per group
// (enough for every thread to have two when the groups are few, as in one sequence's decode with
// its few key heads; at least a chunk each, on chunk boundaries from the range's start). Planned
// from the mask alone; the queries and the cache are bound later (Bind), so that a caller can
// count the pieces before it has computed them.
class CachePieces {
 public:
  CachePieces(const Shape& d, const bool* mask, int64_t threads) : d_(d), mask_(mask), lo_(d.B), hi_(d.B) {
    const int64_t groups = d.B * d.K;
    int64_t positions = 0;
    for (int64_t b = 0; b < d.B; ++b) VisibleRange(d, mask, b, &lo_[b], &hi_[b]), positions += hi_[b] - lo_[b];
    const int64_t longest = *std::max_element(hi_.begin(), hi_.end()) - *std::min_element(lo_.begin(), lo_.end());
    const int64_t most = std::max<int64_t>(longest / kChunk, 1);
    parts_ = std::clamp<int64_t>((2 * std::max<int64_t>(threads, 1) + groups - 1) / groups, 1, most);
    items_ = groups * parts_;
    // A few hundred positions stay on one thread: a hand-off costs more than the work.
    parallel_ = positions * d.K >= kMinParallelKeys;
    im_.resize(items_ * d.M), il_.resize(items_ * d.M), io_.resize(items_ * d.M * d.H);
  }

  // q [B,K,M,H] (scaled), keys [B,K,H,S], values [B,K,S,H].
  void Bind(const float* q, const float* keys, const float* values) { q_ = q, keys_ = keys, values_ = values; }
  int64_t items() const { return items_; }
  bool parallel() const { return parallel_; }

  void Piece(int64_t i) {
    const int64_t g = i / parts_, part = i % parts_, b = g / d_.K, span = hi_[b] - lo_[b];
    const int64_t chunks = (span + kChunk - 1) / kChunk;
    const int64_t s0 = std::min(hi_[b], lo_[b] + chunks * part / parts_ * kChunk);
    const int64_t s1 = std::min(hi_[b], lo_[b] + chunks * (part + 1) / parts_ * kChunk);
    const int64_t M = d_.M, MH = d_.M * d_.H;
    RangeStats(d_, q_, keys_, values_, mask_, b, g % d_.K, s0, s1, im_.data() + i * M, il_.data() + i * M,
               io_.data() + i * MH);
  }

  // Each group's pieces merged in order into m [B,K,M], l [B,K,M], o [B,K,M,H].
  void Merge(float* m, float* l, float* o) const {
    const int64_t groups = d_.B * d_.K, M = d_.M, MH = d_.M * d_.H;
    std::fill(m, m + groups * M, kNegInf), std::fill(l, l + groups * M, 0.0f), std::fill(o, o + groups * MH, 0.0f);
    for (int64_t i = 0; i < items_; ++i) {
      const int64_t g = i / parts_;
      MergeInto(m + g * M, l + g * M, o + g * MH, im_.data() + i * M, il_.data() + i * M, io_.data() + i * MH, M,
                d_.H);
    }
  }

 private:
  Shape d_;
  const bool* mask_;
  std::vector<int64_t> lo_, hi_;
  int64_t parts_ = 1, items_ = 0;
  bool parallel_ = false;
  std::vector<float> im_, il_, io_;
  const float *q_ = nullptr, *keys_ = nullptr, *values_ = nullptr;
};

}  // namespace dayzero

namespace {

// The statistics (m [B,K,M], l [B,K,M], o [B,K,M,H]) of queries ``q`` [B,K,M,H] over the positions
// of ``keys`` [B,K,H,S] / ``values`` [B,K,S,H] that ``mask`` [B,T,S] shows (see the file comment).
void CacheStats(ffi::ThreadPool& pool, const Shape& d, const float* q, const float* keys, const float* values,
                const bool* mask, float* m, float* l, float* o) {
  dayzero::CachePieces pieces(d, mask, pool.num_threads());
  pieces.Bind(q, keys, values);
  dayzero::ParallelFor(pool, pieces.items(), pieces.parallel() ? pieces.items() : 1,
                       [&](int64_t i) { pieces.Piece(i); });
  pieces.Merge(m, l, o);
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
  // The cache is read and written through the results, which alias the cache operands.
  dayzero::InPlaceAttention attention({B, T, N, K, H, S, window}, starts.typed_data(), num_new.typed_data(),
                                      pool.num_threads());
  attention.Prepare(q.typed_data(), k_new.typed_data(), v_new.typed_data(), keys_out->typed_data(),
                    values_out->typed_data(), scale);
  dayzero::ParallelFor(pool, attention.pieces(), attention.parallel() ? attention.pieces() : 1,
                       [&](int64_t i) { attention.Piece(i); });
  attention.Finish(sinks.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

namespace dayzero {

InPlaceAttention::InPlaceAttention(const InPlaceShape& shape, const int32_t* starts, const int32_t* num_new,
                                   int64_t threads)
    : d_(shape), starts_(starts), num_new_(num_new), mask_(shape.B * shape.T * shape.S, 0) {
  const auto [B, T, N, K, H, S, window] = d_;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t hi = std::min<int64_t>(S, starts[b] + std::min<int64_t>(t + 1, num_new[b]));
      const int64_t lo = window > 0 ? std::max<int64_t>(0, starts[b] + t - window + 1) : 0;
      for (int64_t s = lo; s < hi; ++s) mask_[(b * T + t) * S + s] = 1;
    }
  qg_.resize(B * N * T * H), m_.resize(B * N * T), l_.resize(m_.size()), o_.resize(qg_.size());
  pieces_ = std::make_unique<CachePieces>(Shape{B, K, N / K * T, H, S, T}, reinterpret_cast<const bool*>(mask_.data()),
                                          threads);
}

InPlaceAttention::~InPlaceAttention() = default;

void InPlaceAttention::Prepare(const float* q, const float* k_new, const float* v_new, float* keys, float* values,
                               float scale) {
  const auto [B, T, N, K, H, S, window] = d_;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < T; ++j) {
      const int64_t s = starts_[b] + j;
      if (s < 0 || s >= S) continue;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t from = ((b * T + j) * K + k) * H + h;
          keys[((b * K + k) * H + h) * S + s] = k_new[from];
          values[((b * K + k) * S + s) * H + h] = v_new[from];
        }
    }
  // Queries as [B,K,G*T,H], scaled: row g * T + t of group (b, k) is head k * G + g of token t.
  const int64_t G = N / K;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        float* row = qg_.data() + ((b * K + n / G) * G * T + (n % G) * T + t) * H;
        const float* from = q + ((b * T + t) * N + n) * H;
        for (int64_t h = 0; h < H; ++h) row[h] = from[h] * scale;
      }
  pieces_->Bind(qg_.data(), keys, values);
}

int64_t InPlaceAttention::pieces() const { return pieces_->items(); }

bool InPlaceAttention::parallel() const { return pieces_->parallel(); }

void InPlaceAttention::Piece(int64_t i) { pieces_->Piece(i); }

void InPlaceAttention::Finish(const float* sinks, float* out) {
  const auto [B, T, N, K, H, S, window] = d_;
  const int64_t G = N / K;
  pieces_->Merge(m_.data(), l_.data(), o_.data());
  // o / l back in [B,T,N,H]. A sink joins as statistics (sink, 1, 0): a key of value zero, merged
  // like any piece (MergeInto skips a sink of -inf: none).
  const float one = 1.0f;
  const std::vector<float> zeros(H, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t r = (b * K + n / G) * G * T + (n % G) * T + t;
        if (sinks != nullptr) MergeInto(&m_[r], &l_[r], &o_[r * H], &sinks[n], &one, zeros.data(), 1, H);
        const float inverse = l_[r] > 0 ? 1.0f / l_[r] : 0.0f;
        float* to = out + ((b * T + t) * N + n) * H;
        for (int64_t h = 0; h < H; ++h) to[h] = o_[r * H + h] * inverse;
      }
}

}  // namespace dayzero

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
