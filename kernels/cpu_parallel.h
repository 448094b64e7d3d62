// Work sharing for the native CPU kernels (cpu_matvec.cc, cpu_attention.cc, cpu_layer.cc): a call's
// items are claimed from a shared counter by the calling thread and by tasks put on XLA's intra-op
// pool.
#ifndef DAYZERO_KERNELS_CPU_PARALLEL_H_
#define DAYZERO_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace dayzero {

// One stage of RunPhases: ``count`` items, run(i) for each, in any order and on any thread.
struct Phase {
  int64_t count;
  std::function<void(int64_t)> run;
};

// The state of one RunPhases call, shared with the pool's tasks: a task that starts after the
// call returned finds every phase done, no item left, and touches nothing else.
struct PhasedItems {
  std::vector<Phase> phases;
  std::unique_ptr<std::atomic<int64_t>[]> next, done;

  explicit PhasedItems(std::vector<Phase> list)
      : phases(std::move(list)), next(new std::atomic<int64_t>[phases.size()]),
        done(new std::atomic<int64_t>[phases.size()]) {
    for (size_t p = 0; p < phases.size(); ++p) next[p] = 0, done[p] = 0;
  }

  // Claims and runs items phase by phase, waiting at the end of each for the others' items; a
  // pool task (not ``caller``) returns without waiting at the end of the last one, to the pool.
  void Work(bool caller) {
    for (size_t p = 0; p < phases.size(); ++p) {
      const int64_t count = phases[p].count;
      for (int64_t i; (i = next[p].fetch_add(1, std::memory_order_relaxed)) < count;) {
        phases[p].run(i);
        done[p].fetch_add(1, std::memory_order_release);
      }
      if (!caller && p + 1 == phases.size()) return;
      while (done[p].load(std::memory_order_acquire) < count) std::this_thread::yield();
    }
  }
};

// Runs ``phases`` in order, every item of one done before any of the next starts, on the caller
// and up to workers - 1 tasks on ``pool``, which are handed off once for the whole list rather
// than once per phase. The caller claims items too, so it never waits on an item nobody has
// started: a pool thread busy elsewhere (XLA runs independent thunks on the same pool) cannot
// deadlock a call, and a task that starts late joins the phase under way (it finds the earlier
// ones done). Returns when the last phase is done.
inline void RunPhases(xla::ffi::ThreadPool& pool, int64_t workers, std::vector<Phase> phases) {
  workers = std::min<int64_t>(workers, std::max<int64_t>(pool.num_threads(), 1));
  if (workers <= 1) {
    for (const Phase& phase : phases)
      for (int64_t i = 0; i < phase.count; ++i) phase.run(i);
    return;
  }
  auto items = std::make_shared<PhasedItems>(std::move(phases));
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([items] { items->Work(false); });
  items->Work(true);
}

// Runs run(i) for every i in [0, count) on at most ``workers`` threads (the caller among them):
// RunPhases with one phase.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, int64_t workers, std::function<void(int64_t)> run) {
  if (count <= 0) return;
  std::vector<Phase> one;
  one.push_back({count, std::move(run)});
  RunPhases(pool, std::min(workers, count), std::move(one));
}

}  // namespace dayzero

#endif  // DAYZERO_KERNELS_CPU_PARALLEL_H_
