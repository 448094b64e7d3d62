// A Llama-family decoder layer's decode step as one native call for XLA:CPU, through the XLA FFI
// (dayzero/kernels/cpu_layer.py says when it is taken and what it replaces):
//
//   dayzero_decoder_layer: x[M,D], attn_norm[D], wq[D,N*H], wk[D,K*H], wv[D,K*H], wo[N*H,D],
//     mlp_norm[D], w_gate[D,F], w_up[D,F], w_down[F,D], cos[M,R], sin[M,R], keys[B,K,H,S],
//     values[B,K,S,H], starts[B], num_new[B] (int32; the rest float32); attributes eps,
//     norm_offset, window -> y[M,D], keys, values (the cache results alias the cache operands)
//
// with M = B * T tokens (row b's T new tokens, num_new[b] of them real), computing
//
//   h = rms_norm(x) * attn_norm;  q, k, v = h @ wq, h @ wk, h @ wv;  RoPE on q and k (the
//   half-split pairs (i, i + R/2) of the first R dims);  attention as dayzero_attention_in_place
//   (k and v written into the cache at starts[b], then read with it);  x1 = x + attn @ wo;
//   h2 = rms_norm(x1) * mlp_norm;  y = x1 + (silu(h2 @ w_gate) * (h2 @ w_up)) @ w_down
//
// (each norm's scale is norm_offset + weight). The products run in RowsF32's eight-row passes,
// each weight split into row ranges that the threads claim, with the small steps between them
// (norms, RoPE, the gating, the partial sums) as one-item phases: the whole layer is one
// RunPhases call, handed to the pool's threads once, where the separate calls handed off at every
// product and XLA ran each small step as its own op.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "cpu_kernels.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using dayzero::kProductRows;

// Layers whose weights hold fewer floats than this run on the calling thread alone.
constexpr int64_t kMinParallelWeights = 1 << 16;

// Each product's parts come in this many sizes, halving: ``workers`` parts of each (see Split).
constexpr int kPartSizes = 3;

// y[M,N] = x[M,K] @ w[K,N], its K rows cut into ranges (bounds), each summed into its own partial
// [M,N]; Finish adds the partials.
struct Product {
  const float* x;
  const float* w;
  int64_t M, K, N;
  std::vector<int64_t> bounds{0, 0};
  std::vector<float> partials;

  Product(const float* x, const float* w, int64_t M, int64_t K, int64_t N) : x(x), w(w), M(M), K(K), N(N) {}

  int64_t parts() const { return static_cast<int64_t>(bounds.size()) - 1; }

  void Part(int64_t p) { dayzero::RowsF32(x, w, partials.data() + p * M * N, M, K, N, bounds[p], bounds[p + 1]); }

  // y = base + the partials' sum (base may be null: zero), over elements [begin, end) of M*N.
  void Finish(const float* base, float* y, int64_t begin = 0, int64_t end = -1) const {
    for (int64_t i = begin; i < (end < 0 ? M * N : end); ++i) {
      float sum = base == nullptr ? 0.0f : base[i];
      for (int64_t p = 0; p < parts(); ++p) sum += partials[p * M * N + i];
      y[i] = sum;
    }
  }
};

// Cuts a product's rows into parts that any thread may take: ``workers`` parts of each of
// kPartSizes sizes, each half the one before (one part where the product is under
// kMinParallelWeights, fewer sizes where its rows run out), on multiples of kProductRows.
// Why: the threads read at unequal speeds, and with one part each the first to finish waited
// for the other at the end of every product, 10-20 us a layer each time on SmolLM2 (measured
// with a cycle counter around the wait); the big parts first keep the rows' streams long, the
// small ones last even out the finish.
void Split(Product& p, int64_t workers) {
  p.bounds.assign(1, 0);
  int64_t sizes = p.K * p.N < kMinParallelWeights ? 0 : kPartSizes;
  while (sizes > 0 && workers * ((int64_t{1} << sizes) - 1) > p.K / kProductRows) --sizes;
  if (sizes == 0) {
    p.bounds.push_back(p.K);
  } else {
    const int64_t total = workers * ((int64_t{1} << sizes) - 1);  // in units of the smallest part
    int64_t units = 0;
    for (int64_t size = sizes - 1; size >= 0; --size)
      for (int64_t w = 0; w < workers; ++w) {
        units += int64_t{1} << size;
        p.bounds.push_back(units == total ? p.K : p.K * units / total / kProductRows * kProductRows);
      }
  }
  p.partials.assign(p.parts() * p.M * p.N, 0.0f);
}

// A phase running every part of ``products``, cut by Split: the biggest parts of all the products
// first, the smallest last (part i of each product is no smaller than part i + 1).
dayzero::Phase Parts(const std::vector<Product*>& products, int64_t workers) {
  std::vector<std::pair<Product*, int64_t>> items;
  for (Product* p : products) Split(*p, workers);
  int64_t most = 0;
  for (const Product* p : products) most = std::max(most, p->parts());
  for (int64_t first = 0; first < most; first += workers)
    for (Product* p : products)
      for (int64_t i = first; i < std::min(first + workers, p->parts()); ++i) items.emplace_back(p, i);
  const int64_t count = static_cast<int64_t>(items.size());
  return {count, [items = std::move(items)](int64_t i) { items[i].first->Part(items[i].second); }};
}

// A phase of ``workers`` items, run(begin, end) over equal slices of [0, count).
dayzero::Phase Slices(int64_t count, int64_t workers, std::function<void(int64_t, int64_t)> run) {
  return {workers, [=, run = std::move(run)](int64_t i) { run(count * i / workers, count * (i + 1) / workers); }};
}

// A phase of one item.
dayzero::Phase Step(std::function<void()> run) {
  return {1, [run = std::move(run)](int64_t) { run(); }};
}

// y[m,:] = x[m,:] / sqrt(mean(x[m,:]^2) + eps) * (offset + weight) for M rows of D.
void RmsNorm(const float* x, const float* weight, float eps, float offset, int64_t M, int64_t D, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * D;
    float squares = 0.0f;
    for (int64_t i = 0; i < D; ++i) squares += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[m * D + i] = (offset + weight[i]) * (row[i] * inverse);
  }
}

// Rotates the first R dims of each of the ``heads`` heads of H dims in every row of x [M, heads*H]
// by that row's cos and sin [M, R]: dim i < R/2 pairs with i + R/2 (HF Llama's half split).
void Rope(float* x, const float* cos, const float* sin, int64_t M, int64_t heads, int64_t H, int64_t R) {
  const int64_t half = R / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < heads; ++n) {
      float* v = x + (m * heads + n) * H;
      const float* c = cos + m * R;
      const float* s = sin + m * R;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

ffi::Error DecoderLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> attn_norm,
                        ffi::Buffer<ffi::F32> wq, ffi::Buffer<ffi::F32> wk, ffi::Buffer<ffi::F32> wv,
                        ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> w_gate,
                        ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::F32> w_down, ffi::Buffer<ffi::F32> cos,
                        ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> keys_in, ffi::Buffer<ffi::F32> values_in,
                        ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> num_new, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::F32> keys_out, ffi::ResultBuffer<ffi::F32> values_out, float eps,
                        float norm_offset, int64_t window) {
  const auto xd = x.dimensions(), qd = wq.dimensions(), kd = keys_in.dimensions(), gd = w_gate.dimensions(),
             cd = cos.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || kd.size() != 4 || gd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: needs x[M,D], wq[D,N*H], w_gate[D,F], cos[M,R], "
                                       "keys[B,K,H,S]");
  const int64_t M = xd[0], D = xd[1], B = starts.element_count(), K = kd[1], H = kd[2], S = kd[3];
  const int64_t NH = qd[1], KH = K * H, N = H > 0 ? NH / H : 0, F = gd[1], R = cd[1];
  if (B <= 0 || M % B || H <= 0 || NH % H || K <= 0 || N % K || R % 2 || R > H || D % kProductRows ||
      NH % kProductRows || F % kProductRows)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: needs M a multiple of B, N a multiple of K, an even "
                                       "R <= H, and D, N*H and F multiples of 8");
  if (qd[0] != D || attn_norm.element_count() != D || mlp_norm.element_count() != D ||
      wk.element_count() != D * KH || wv.element_count() != D * KH || wo.element_count() != NH * D ||
      gd[0] != D || w_up.element_count() != D * F || w_down.element_count() != F * D || cd[0] != M ||
      sin.element_count() != M * R || values_in.element_count() != B * K * S * H || num_new.element_count() != B)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: shapes disagree (see cpu_layer.cc)");
  const int64_t T = M / B;
  const int64_t weights = D * (NH + 2 * KH) + NH * D + 3 * D * F;
  const int64_t workers = weights < kMinParallelWeights ? 1 : std::max<int64_t>(pool.num_threads(), 1);

  const float* xp = x.typed_data();
  std::vector<float> h(M * D), q(M * NH), k(M * KH), v(M * KH), attn(M * NH), x1(M * D), gate(M * F), up(M * F);
  Product pq(h.data(), wq.typed_data(), M, D, NH), pk(h.data(), wk.typed_data(), M, D, KH),
      pv(h.data(), wv.typed_data(), M, D, KH), po(attn.data(), wo.typed_data(), M, NH, D),
      pg(h.data(), w_gate.typed_data(), M, D, F), pu(h.data(), w_up.typed_data(), M, D, F),
      pd(gate.data(), w_down.typed_data(), M, F, D);
  // The cache is read and written through the results, which alias the cache operands.
  dayzero::InPlaceAttention attention({B, T, N, K, H, S, window}, starts.typed_data(), num_new.typed_data(),
                                      workers);
  float* keys = keys_out->typed_data();
  float* values = values_out->typed_data();
  std::vector<dayzero::Phase> phases{
      Step([&] { RmsNorm(xp, attn_norm.typed_data(), eps, norm_offset, M, D, h.data()); }),
      Parts({&pq, &pk, &pv}, workers),
      Step([&] {
        pq.Finish(nullptr, q.data()), pk.Finish(nullptr, k.data()), pv.Finish(nullptr, v.data());
        Rope(q.data(), cos.typed_data(), sin.typed_data(), M, N, H, R);
        Rope(k.data(), cos.typed_data(), sin.typed_data(), M, K, H, R);
        attention.Prepare(q.data(), k.data(), v.data(), keys, values, 1.0f / std::sqrt(static_cast<float>(H)));
      }),
      {attention.pieces(), [&](int64_t i) { attention.Piece(i); }},
      Step([&] { attention.Finish(nullptr, attn.data()); }),
      Parts({&po}, workers),
      Step([&] {
        po.Finish(xp, x1.data());
        RmsNorm(x1.data(), mlp_norm.typed_data(), eps, norm_offset, M, D, h.data());
      }),
      Parts({&pg, &pu}, workers),
      // The gating in slices, one a thread, with an exp that vectorizes: a 1536-wide SiLU of
      // libm exp calls on one thread while the other waited showed as the longest wait of the
      // layer (cycle counter around the waits).
      Slices(M * F, workers, [&](int64_t begin, int64_t end) {
        pg.Finish(nullptr, gate.data(), begin, end), pu.Finish(nullptr, up.data(), begin, end);
        for (int64_t i = begin; i < end; ++i) gate[i] = gate[i] / (1.0f + dayzero::Exp(-gate[i])) * up[i];
      }),
      Parts({&pd}, workers),
      Step([&] { pd.Finish(x1.data(), y->typed_data()); }),
  };
  dayzero::RunPhases(pool, workers, std::move(phases));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dayzero_decoder_layer, DecoderLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::F32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // values
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_new
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // keys
                                  .Ret<ffi::Buffer<ffi::F32>>()  // values
                                  .Attr<float>("eps")
                                  .Attr<float>("norm_offset")
                                  .Attr<int64_t>("window"));
