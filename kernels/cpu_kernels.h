// What the native CPU kernels' files share: a vectorizable exp, the products' row passes for
// float32, int8 and int4 weights (cpu_matvec.cc) and the in-place decode attention
// (cpu_attention.cc), which the native decoder layer (cpu_layer.cc) runs as pieces of its own
// phases rather than as calls of their own.
#ifndef DAYZERO_KERNELS_CPU_KERNELS_H_
#define DAYZERO_KERNELS_CPU_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace dayzero {

// exp(x) in float32 for x in [-87, 88] (clamped there: 0 and infinity are never reached), by
// Cephes' polynomial after a split into n ln 2 + r (relative error ~1e-7), written without
// branches or calls so that the loops using it vectorize (with -fno-trapping-math, which the
// build passes: GCC keeps a float-to-integer conversion scalar without it).
inline float Exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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

// Rows of w a product's pass streams (RowsF32's k0 and k1 - k0 are multiples of it).
constexpr int64_t kProductRows = 8;

// acc[M,N] += x[:, k0:k1] @ w[k0:k1, :] for float32 x [M,K] and w [K,N] (cpu_matvec.cc).
void RowsF32(const float* x, const float* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1);

// acc[M,N] += x[:, k0:k1] @ w[k0:k1, :] for int8 w, unscaled (the caller scales each column).
void RowsInt8(const float* x, const int8_t* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1);

// acc[M,N] += x[:, k0:k1] @ (w[k0:k1, :] scaled by scale[k / group, :]) for int4 w packed two per
// byte, acc's columns in Int4Column's order (k0 and group multiples of kProductRows).
void RowsInt4(const float* x, const uint8_t* w, const float* scale, float* acc, int64_t M, int64_t K, int64_t N,
              int64_t group, int64_t k0, int64_t k1);

// The column whose sum RowsInt4 leaves at position p of a row of N: a permutation inside each
// whole block of 16 or 32 columns (the vector width's, cpu_matvec.cc kSplit), the identity after.
int64_t Int4Column(int64_t p, int64_t N);

// The sizes of one in-place attention step: B rows of T new tokens, N query heads over K key
// heads of H dims, S cache slots; ``window`` > 0 limits how far back a query sees.
struct InPlaceShape {
  int64_t B, T, N, K, H, S, window;
};

class CachePieces;  // cpu_attention.cc: the cache's visible positions cut into pieces

// A decode step's attention over a contiguous float32 cache that it writes first
// (dayzero_attention_in_place; cpu_attention.cc says what each query sees). In three stages, so
// that a caller can spread the pieces over its threads: Prepare (one thread: the new keys and
// values written into ``keys`` [B,K,H,S] and ``values`` [B,K,S,H], the queries scaled), every
// Piece in any order and on any thread, then Finish (one thread: the pieces merged, sinks
// joined, the output [B,T,N,H] written). What the constructor plans depends only on the shape,
// starts and num_new, so the pieces are counted before q and the new keys exist.
class InPlaceAttention {
 public:
  InPlaceAttention(const InPlaceShape& shape, const int32_t* starts, const int32_t* num_new, int64_t threads);
  ~InPlaceAttention();
  // q [B,T,N,H], k_new and v_new [B,T,K,H] are read here; keys and values written.
  void Prepare(const float* q, const float* k_new, const float* v_new, float* keys, float* values, float scale);
  int64_t pieces() const;
  // Whether the pieces are worth other threads (a few hundred positions are not).
  bool parallel() const;
  void Piece(int64_t i);
  // sinks [N] or null.
  void Finish(const float* sinks, float* out);

 private:
  InPlaceShape d_;
  const int32_t* starts_;
  const int32_t* num_new_;
  std::vector<char> mask_;  // char, not vector<bool>: the pieces read bool bytes
  std::vector<float> qg_, m_, l_, o_;
  std::unique_ptr<CachePieces> pieces_;
};

}  // namespace dayzero

#endif  // DAYZERO_KERNELS_CPU_KERNELS_H_
