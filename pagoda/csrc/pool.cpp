// The kernels' thread pool (see parallel.h for why it is not OpenMP).
//
// A job is published by bumping `generation_`; each worker spins on it for up to the spin time
// (PAGODA_KERNEL_SPIN_US, default 50 us), then sleeps on it with a futex. `sleepers_` counts
// the sleeping workers so that publishing costs a wake-up syscall only when one sleeps (both
// sides use sequentially consistent atomics, so a worker either sees the new generation before
// it sleeps or is counted and woken). `state_` holds the job's closed bit and the number of
// workers inside it: a worker joins by incrementing it (and backs out if the job is closed);
// the caller closes the job when its own share is done and waits (spinning 20 us, then on a
// futex, woken by the last worker out) only while someone is still inside; the next job opens
// only once a late worker has backed out of the closed one.
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGODA_PAUSE() _mm_pause()
#else
#define PAGODA_PAUSE() std::this_thread::yield()
#endif

namespace pagoda {
namespace {

using Clock = std::chrono::steady_clock;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  if (word->load() == expected) std::this_thread::yield();
#endif
}

void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

std::chrono::microseconds spin_time() {
  const char* env = std::getenv("PAGODA_KERNEL_SPIN_US");
  return std::chrono::microseconds(env ? std::atoi(env) : 50);
}

class Pool {
 public:
  void run(int n, JobFn fn, void* ctx) {
    std::lock_guard<std::mutex> lock(run_mutex_);
    grow(n - 1);
    fn_ = fn;
    ctx_ = ctx;
    reopen();
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) futex_wake_all(&generation_);
    fn(ctx);
    const uint32_t inside = state_.fetch_or(kClosed) & ~kClosed;
    if (inside != 0) wait_for_workers();
  }

 private:
  static constexpr uint32_t kClosed = 1u << 31;

  void grow(int wanted) {
    while (static_cast<int>(threads_.size()) < wanted) {
      // NOTE: the generation is read here, not by the thread: its first job may be published
      // before it starts.
      const uint32_t seen = generation_.load();
      threads_.emplace_back([this, seen] { loop(seen); });
      threads_.back().detach();
    }
  }

  void loop(uint32_t seen) {
    const auto spin = spin_time();
    for (;;) {
      seen = wait_for_job(seen, spin);
      // Join only an open job; fn_ and ctx_ are read after joining, and stay valid until the
      // count of workers inside drops to zero.
      if ((state_.fetch_add(1) & kClosed) == 0) fn_(ctx_);
      if (state_.fetch_sub(1) == (kClosed | 1u) && caller_sleeps_.load()) futex_wake_all(&state_);
    }
  }

  uint32_t wait_for_job(uint32_t seen, std::chrono::microseconds spin) {
    const auto deadline = Clock::now() + spin;
    for (int i = 0;; ++i) {
      const uint32_t g = generation_.load(std::memory_order_acquire);
      if (g != seen) return g;
      if ((i & 63) == 63 && Clock::now() > deadline) break;
      PAGODA_PAUSE();
    }
    sleepers_.fetch_add(1);
    uint32_t g = generation_.load();
    while (g == seen) {
      futex_wait(&generation_, seen);
      g = generation_.load();
    }
    sleepers_.fetch_sub(1);
    return g;
  }

  // Opens the next job: closed with no one inside -> open, empty.
  // NOTE: a compare-exchange, not a store: a worker that saw the previous job late may be
  // between its join (count + 1) and its back-out (count - 1) of that closed job; a plain
  // store of 0 lost its count, its back-out then wrapped the count around, and the next
  // caller waited forever (found by back-to-back calls from pagoda_decoder_stack_bf16).
  void reopen() {
    for (uint32_t expected = kClosed; !state_.compare_exchange_weak(expected, 0); expected = kClosed) PAGODA_PAUSE();
  }

  // Waits until no worker is inside the (closed) job: a short spin, then a futex sleep.
  void wait_for_workers() {
    const auto deadline = Clock::now() + std::chrono::microseconds(20);
    for (int i = 0;; ++i) {
      if (state_.load(std::memory_order_acquire) == kClosed) return;
      if ((i & 63) == 63 && Clock::now() > deadline) break;
      PAGODA_PAUSE();
    }
    caller_sleeps_.store(true);
    for (uint32_t s = state_.load(); s != kClosed; s = state_.load()) futex_wait(&state_, s);
    caller_sleeps_.store(false);
  }

  std::mutex run_mutex_;
  std::vector<std::thread> threads_;
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<uint32_t> state_{kClosed};  // kClosed | workers inside the job
  std::atomic<bool> caller_sleeps_{false};
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

// NOTE: never destroyed: detached workers may still be waiting on it when the process exits.
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

std::atomic<int> g_threads{1};

}  // namespace

void run_on_workers(int n, JobFn fn, void* ctx) { pool().run(n, fn, ctx); }
int num_threads() { return g_threads.load(std::memory_order_relaxed); }
void set_num_threads(int n) { g_threads.store(n > 0 ? n : 1); }

}  // namespace pagoda

extern "C" void pagoda_set_num_threads(int n) { pagoda::set_num_threads(n); }
