// How pagoda's kernels split work over threads: a small pool of their own.
//
// NOTE: not OpenMP. The kernels run between torch ops whose OpenMP pool the runner shrinks to
// one thread for small steps; a `num_threads(2)` region entered after that took milliseconds
// (libgomp re-forms the team), and even a warm passive team costs ~8 us to wake per region,
// with ~150 regions a decode step. This pool's workers spin briefly between calls (a decode
// step issues them microseconds apart), then sleep on a futex, so an idle engine costs nothing.
// Every job is a list of items handed out dynamically, and a worker joins a job only while it
// is open: the caller closes it once no item is left and waits only for workers still inside,
// so a worker the OS has descheduled (a busy machine) never holds a step up unless it holds an
// item. Invariants: one job runs at a time (callers are serialized by a mutex); the caller
// works too; a job of one item, or with one thread allowed, runs inline without the pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace pagoda {

using JobFn = void (*)(void* ctx);

// Runs fn(ctx) on the calling thread and on every pool worker that joins before the caller's
// own fn(ctx) returns; returns when all who joined are done. fn must share its work out
// dynamically (any number of callers, each taking items until none is left).
void run_on_workers(int n, JobFn fn, void* ctx);

// Threads a kernel may use (set from Python to torch's thread count at load).
int num_threads();
void set_num_threads(int n);

// Calls fn(i) for every i in [0, n), items handed out one at a time (uneven work), on at most
// max_threads threads.
template <typename F>
void parallel_items(int64_t n, F&& fn, int max_threads = 1 << 30) {
  const int threads = static_cast<int>(std::min<int64_t>(std::min(num_threads(), max_threads), n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Ctx {
    std::remove_reference_t<F>* fn;
    int64_t n;
    std::atomic<int64_t> next{0};
  } ctx{&fn, n};
  run_on_workers(threads, [](void* p) {
    auto* c = static_cast<Ctx*>(p);
    for (int64_t i = c->next.fetch_add(1); i < c->n; i = c->next.fetch_add(1)) (*c->fn)(i);
  }, &ctx);
}

// Calls fn(begin, end) over [0, n) in contiguous chunks, each a multiple of `grain` long (but
// the last), about kChunksPerThread per thread, handed out in order.
// NOTE: dynamic, not one range per thread: on a shared machine a descheduled worker would
// otherwise hold the whole call up for its range; now the others take its chunks.
constexpr int64_t kChunksPerThread = 8;

template <typename F>
void parallel_ranges(int64_t n, int64_t grain, F&& fn, int max_threads = 1 << 30) {
  const int64_t grains = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(std::min(num_threads(), max_threads), grains));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t step = std::max<int64_t>(1, grains / (threads * kChunksPerThread)) * grain;
  parallel_items((n + step - 1) / step, [&](int64_t i) { fn(i * step, std::min(n, (i + 1) * step)); }, threads);
}

}  // namespace pagoda
