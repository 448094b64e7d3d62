// Few-row matrix products with int8 weights for XLA:CPU decode, called through the XLA FFI
// (dayzero/kernels/cpu_matvec.py builds and registers this file; its docstring says why).
//
//   dayzero_matvec_i8:  y[M,N] = (x[M,K] @ float(w[K,N])) * scale[N]   (x, scale, y float32)
//
// w's rows are streamed in order and converted to float in registers, never written out: the
// product reads one byte per weight, where XLA:CPU's own dot would first write the fp32 matrix.
#include <algorithm>
#include <atomic>
#include <memory>
#include <cstdint>
#include <thread>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using W = int8_t;  // the weights' element type

// Rows of w a part streams per pass: the partial sums are read and written once per kRows rows.
constexpr int64_t kRows = 8;

// acc[M,N] += x[:, k0:k1] @ w[k0:k1, :], streaming w's rows in order (contiguous reads).
void Rows(const float* x, const W* __restrict w, float* __restrict acc, int64_t M, int64_t K, int64_t N, int64_t k0,
          int64_t k1) {
  int64_t k = k0;
  for (; k + kRows <= k1; k += kRows) {
    const W* __restrict w0 = w + k * N;
    const W* __restrict w1 = w0 + N;
    const W* __restrict w2 = w1 + N;
    const W* __restrict w3 = w2 + N;
    const W* __restrict w4 = w3 + N;
    const W* __restrict w5 = w4 + N;
    const W* __restrict w6 = w5 + N;
    const W* __restrict w7 = w6 + N;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      const float x0 = xm[0], x1 = xm[1], x2 = xm[2], x3 = xm[3], x4 = xm[4], x5 = xm[5], x6 = xm[6], x7 = xm[7];
      float* __restrict a = acc + m * N;
      for (int64_t n = 0; n < N; ++n)
        a[n] += (x0 * static_cast<float>(w0[n]) + x1 * static_cast<float>(w1[n])) + (x2 * static_cast<float>(w2[n]) +
                x3 * static_cast<float>(w3[n])) + ((x4 * static_cast<float>(w4[n]) + x5 * static_cast<float>(w5[n])) +
                (x6 * static_cast<float>(w6[n]) + x7 * static_cast<float>(w7[n])));
    }
  }
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
      float* __restrict a = acc + m * N;
      const W* __restrict wr = w + k * N;
      for (int64_t n = 0; n < N; ++n) a[n] += xv * static_cast<float>(wr[n]);
    }
}

// Work is cut into parts (ranges of w's rows, each summed into its own partial) that the
// calling thread and the pool's threads claim from a shared counter. The caller claims parts
// too, so it never waits on a part nobody has started: a pool thread busy elsewhere (XLA runs
// independent thunks on the same pool) cannot deadlock a call. The state is shared: a task the
// pool starts after the call returned finds no part left.
struct Job {
  const float* x;
  const W* w;
  int64_t M, K, N, parts;
  std::vector<float> partial;  // [parts, M, N]
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      Rows(x, w, partial.data() + p * M * N, M, K, N, K * p / parts, K * (p + 1) / parts);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void Run(ffi::ThreadPool pool, const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t K,
         int64_t N) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Small products stay on the calling thread: a hand-off costs more than the work.
  const int64_t parts = (K * N < (1 << 16) || K < 2 * kRows) ? 1 : std::min<int64_t>(threads, K / kRows);
  auto job = std::make_shared<Job>();
  job->x = x, job->w = w, job->M = M, job->K = K, job->N = N, job->parts = parts;
  job->partial.assign(parts * M * N, 0.0f);
  for (int64_t t = 1; t < parts; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
  for (int64_t i = 0; i < M * N; ++i) {
    float sum = 0;
    for (int64_t p = 0; p < parts; ++p) sum += job->partial[p * M * N + i];
    y[i] = sum * scale[i % N];
  }
}

ffi::Error MatvecI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || scale.element_count() != wd[1])
    return ffi::Error::InvalidArgument("dayzero_matvec_i8: shapes must be x[M,K], w[K,N], scale[N]");
  Run(pool, x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data(), xd[0], xd[1], wd[1]);
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
