// A Llama-family decoder layer's decode step as one native call for XLA:CPU, through the XLA FFI
// (dayzero/kernels/cpu_layer.py says when it is taken and what it replaces):
//
//   dayzero_decoder_layer: x[M,D], attn_norm[D], wq[D,N*H], sq, wk[D,K*H], sk, wv[D,K*H], sv,
//     wo[N*H,D], so, mlp_norm[D], w_gate[D,F], s_gate, w_up[D,F], s_up, w_down[F,D], s_down,
//     cos[M,R], sin[M,R], keys[B,K,H,S], values[B,K,S,H], starts[B], num_new[B] (int32; the
//     rest float32 but the weights); attributes eps, norm_offset, window, groups[7]
//     -> y[M,D], keys, values (the cache results alias the cache operands)
//
// Each weight w[In,Out] is float32 (its scale s unused), int8 with one scale per output column
// (s[Out]), or int4 with one scale per ``group`` rows of each column (s[In/group, Out]; groups[i]
// is weight i's group, 0 for the other kinds), as kernels/cpu_matvec.cc multiplies them.
//
// with M = B * T tokens (row b's T new tokens, num_new[b] of them real), computing
//
//   h = rms_norm(x) * attn_norm;  q, k, v = h @ wq, h @ wk, h @ wv;  RoPE on q and k (the
//   half-split pairs (i, i + R/2) of the first R dims);  attention as dayzero_attention_in_place
//   (k and v written into the cache at starts[b], then read with it);  x1 = x + attn @ wo;
//   h2 = rms_norm(x1) * mlp_norm;  y = x1 + (silu(h2 @ w_gate) * (h2 @ w_up)) @ w_down
//
// (each norm's scale is norm_offset + weight). The products run in cpu_matvec.cc's eight-row
// passes, each weight split into row ranges that the threads claim (Split), the small steps
// between them (norms, RoPE, the cache write, the partial sums) as one-item phases and the gating
// in slices: the whole layer is one RunPhases call, handed to the pool's threads once, where the
// separate calls handed off at every product and XLA ran each small step as its own op.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
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

// One weight [K,N] as stored: float32, int8 (scale [N]) or int4 (scale [K/group, N]).
struct Weight {
  ffi::DataType type;
  const void* data;
  const float* scale;
  int64_t group;
};

// y[M,N] = x[M,K] @ w[K,N], its K rows cut into ranges (bounds), each summed into its own partial
// [M,N]; Finish adds the partials (and scales them by column for int8, and puts int4's columns
// back in order).
struct Product {
  const float* x;
  Weight w;
  int64_t M, K, N;
  std::vector<int64_t> bounds{0, 0};
  std::vector<float> partials;

  Product(const float* x, Weight w, int64_t M, int64_t K, int64_t N) : x(x), w(w), M(M), K(K), N(N) {}

  int64_t parts() const { return static_cast<int64_t>(bounds.size()) - 1; }

  void Part(int64_t p) {
    float* acc = partials.data() + p * M * N;
    if (w.type == ffi::DataType::S8)
      dayzero::RowsInt8(x, static_cast<const int8_t*>(w.data), acc, M, K, N, bounds[p], bounds[p + 1]);
    else if (w.type == ffi::DataType::S4)
      dayzero::RowsInt4(x, static_cast<const uint8_t*>(w.data), w.scale, acc, M, K, N, w.group, bounds[p],
                        bounds[p + 1]);
    else
      dayzero::RowsF32(x, static_cast<const float*>(w.data), acc, M, K, N, bounds[p], bounds[p + 1]);
  }

  // y = base + the product (base may be null: zero), over elements [begin, end) of M*N (for
  // int4, the partials' positions [begin, end): whole 32-column blocks keep Int4Column's
  // permutation inside the range). By row and column: no division per element.
  void Finish(const float* base, float* y, int64_t begin = 0, int64_t end = -1) const {
    end = end < 0 ? M * N : end;
    const int64_t MN = M * N;
    for (int64_t row = begin / N; row < M && row * N < end; ++row) {
      const int64_t first = std::max<int64_t>(begin - row * N, 0), last = std::min<int64_t>(end - row * N, N);
      const float* in = base == nullptr ? nullptr : base + row * N;
      float* out = y + row * N;
      for (int64_t n = first; n < last; ++n) {
        float sum = 0.0f;
        for (int64_t p = 0; p < parts(); ++p) sum += partials[p * MN + row * N + n];
        const int64_t column = w.type == ffi::DataType::S4 ? dayzero::Int4Column(n, N) : n;
        if (w.type == ffi::DataType::S8) sum *= w.scale[column];
        out[column] = in == nullptr ? sum : in[column] + sum;
      }
    }
  }
};

// Cuts a product's rows into parts that any thread may take: ``workers`` parts of each of
// kPartSizes sizes, each half the one before (one part on one worker or where the product is
// under kMinParallelWeights, fewer sizes where its rows run out), on multiples of kProductRows.
// Why: the threads read at unequal speeds, and with one part each the first to finish waited
// for the other at the end of every product, 10-20 us a layer each time on SmolLM2 (measured
// with a cycle counter around the wait); the big parts first keep the rows' streams long, the
// small ones last even out the finish.
void Split(Product& p, int64_t workers) {
  p.bounds.assign(1, 0);
  int64_t sizes = workers <= 1 || p.K * p.N < kMinParallelWeights ? 0 : kPartSizes;
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

// A phase of ``workers`` items, run(begin, end) over about equal slices of [0, count) that start
// on multiples of 32 (an int4 product's Finish keeps whole blocks of columns in one slice).
dayzero::Phase Slices(int64_t count, int64_t workers, std::function<void(int64_t, int64_t)> run) {
  auto bound = [=](int64_t i) { return i == workers ? count : count * i / workers / 32 * 32; };
  return {workers, [=, run = std::move(run)](int64_t i) { run(bound(i), bound(i + 1)); }};
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

// Weight i of the layer as a Weight, or an error naming what is wrong with it: ``w`` [In,Out]
// float32, int8 with ``scale`` [Out], or int4 with ``scale`` [In/group, Out] (group a multiple of
// 8 dividing In, Out a multiple of 32: the sums' order stays inside a slice, see Finish).
ffi::ErrorOr<Weight> Check(const char* name, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale, int64_t group, int64_t In,
                           int64_t Out) {
  const ffi::DataType type = w.element_type();
  bool ok = w.element_count() == In * Out;
  if (type == ffi::DataType::S8)
    ok = ok && scale.element_count() == Out;
  else if (type == ffi::DataType::S4)
    ok = ok && group > 0 && group % kProductRows == 0 && In % group == 0 && Out % 32 == 0 &&
         scale.element_count() == In / group * Out;
  else
    ok = ok && type == ffi::DataType::F32;
  if (!ok) {
    const std::string message = std::string("dayzero_decoder_layer: weight ") + name +
                                " must be float32, int8 with a scale per column, or int4 with a scale per group "
                                "of rows (see cpu_layer.cc)";
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(message));
  }
  return Weight{type, w.untyped_data(), scale.typed_data(), group};
}

ffi::Error DecoderLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> attn_norm,
                        ffi::AnyBuffer wq, ffi::Buffer<ffi::F32> sq, ffi::AnyBuffer wk, ffi::Buffer<ffi::F32> sk,
                        ffi::AnyBuffer wv, ffi::Buffer<ffi::F32> sv, ffi::AnyBuffer wo, ffi::Buffer<ffi::F32> so,
                        ffi::Buffer<ffi::F32> mlp_norm, ffi::AnyBuffer w_gate, ffi::Buffer<ffi::F32> s_gate,
                        ffi::AnyBuffer w_up, ffi::Buffer<ffi::F32> s_up, ffi::AnyBuffer w_down,
                        ffi::Buffer<ffi::F32> s_down, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                        ffi::Buffer<ffi::F32> keys_in, ffi::Buffer<ffi::F32> values_in, ffi::Buffer<ffi::S32> starts,
                        ffi::Buffer<ffi::S32> num_new, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::F32> keys_out, ffi::ResultBuffer<ffi::F32> values_out, float eps,
                        float norm_offset, int64_t window, ffi::Span<const int64_t> groups) {
  const auto xd = x.dimensions(), qd = wq.dimensions(), kd = keys_in.dimensions(), gd = w_gate.dimensions(),
             cd = cos.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || kd.size() != 4 || gd.size() != 2 || cd.size() != 2 || groups.size() != 7)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: needs x[M,D], wq[D,N*H], w_gate[D,F], cos[M,R], "
                                       "keys[B,K,H,S] and 7 groups");
  const int64_t M = xd[0], D = xd[1], B = starts.element_count(), K = kd[1], H = kd[2], S = kd[3];
  const int64_t NH = qd[1], KH = K * H, N = H > 0 ? NH / H : 0, F = gd[1], R = cd[1];
  if (B <= 0 || M % B || H <= 0 || NH % H || K <= 0 || N % K || R % 2 || R > H || D % kProductRows ||
      NH % kProductRows || F % kProductRows)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: needs M a multiple of B, N a multiple of K, an even "
                                       "R <= H, and D, N*H and F multiples of 8");
  if (qd[0] != D || attn_norm.element_count() != D || mlp_norm.element_count() != D || gd[0] != D ||
      cd[0] != M || sin.element_count() != M * R || values_in.element_count() != B * K * S * H ||
      num_new.element_count() != B)
    return ffi::Error::InvalidArgument("dayzero_decoder_layer: shapes disagree (see cpu_layer.cc)");
  const ffi::ErrorOr<Weight> checked[7] = {
      Check("q", wq, sq, groups[0], D, NH),          Check("k", wk, sk, groups[1], D, KH),
      Check("v", wv, sv, groups[2], D, KH),          Check("o", wo, so, groups[3], NH, D),
      Check("gate", w_gate, s_gate, groups[4], D, F), Check("up", w_up, s_up, groups[5], D, F),
      Check("down", w_down, s_down, groups[6], F, D)};
  for (const auto& c : checked)
    if (c.has_error()) return c.error();
  const int64_t T = M / B;
  const int64_t weights = D * (NH + 2 * KH) + NH * D + 3 * D * F;
  const int64_t workers = weights < kMinParallelWeights ? 1 : std::max<int64_t>(pool.num_threads(), 1);

  const float* xp = x.typed_data();
  std::vector<float> h(M * D), q(M * NH), k(M * KH), v(M * KH), attn(M * NH), x1(M * D), gate(M * F), up(M * F);
  Product pq(h.data(), *checked[0], M, D, NH), pk(h.data(), *checked[1], M, D, KH),
      pv(h.data(), *checked[2], M, D, KH), po(attn.data(), *checked[3], M, NH, D),
      pg(h.data(), *checked[4], M, D, F), pu(h.data(), *checked[5], M, D, F), pd(gate.data(), *checked[6], M, F, D);
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
                                  .Arg<ffi::AnyBuffer>()         // wq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sq
                                  .Arg<ffi::AnyBuffer>()         // wk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sk
                                  .Arg<ffi::AnyBuffer>()         // wv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sv
                                  .Arg<ffi::AnyBuffer>()         // wo
                                  .Arg<ffi::Buffer<ffi::F32>>()  // so
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                  .Arg<ffi::AnyBuffer>()         // w_gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s_gate
                                  .Arg<ffi::AnyBuffer>()         // w_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s_up
                                  .Arg<ffi::AnyBuffer>()         // w_down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s_down
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
                                  .Attr<int64_t>("window")
                                  .Attr<ffi::Span<const int64_t>>("groups"));
