// Splitting a loop over threads for the CPU kernels of epkit._C (gather_rows.cpp, engram_hash.cpp, ep_rows.cpp).
//
// [0, n) is cut into chunks of `chunk` items that up to `num_threads` threads take from one atomic counter.
// Built with OpenMP (setup.py adds -fopenmp where the compiler has it), the threads are an OpenMP team: the
// process's one libgomp, whose workers torch's own parallel ops (index_select, copy_) run on, so an epkit copy and
// the torch op beside it share the same warm workers instead of two sets of threads competing for the cores (on
// the 2-core CI machine a separate pool's helper and torch's spinning OpenMP workers took turns on one core: a
// 2-thread 8 MiB gather ran at 0.47-0.57x index_select in one benchmark run in three, 1.1-1.5x in the others).
// GNU OpenMP is not fork-safe: in a child forked after the parent started its OpenMP workers, the first parallel
// region waits forever (torch's own 2-thread index_select does, tested). So in a forked child, and in a build
// without OpenMP, the threads are the caller and helpers from a pool of epkit's own:
//
// helpers, after a job, watch for the next one for up to 1 ms and then sleep on a condition variable (starting a
// thread per call cost ~0.1-0.2 ms on a shared 2-core machine, as much as a whole 8 MiB copy; waking a sleeping
// one as much again, see spin_for_offer). The caller never waits for a helper to be scheduled: on a machine shared
// with other jobs a woken thread can wait milliseconds for a core, and meanwhile the caller takes every chunk
// itself. It returns once every chunk taken is finished. A helper that wakes late finds no chunk left and goes
// back to sleep without touching the caller's data (the counter lives in a shared_ptr the job holds). After fork()
// the child starts with an empty pool (pthread_atfork): the parent's sleeping helpers do not exist there (and the
// process that forks has threads: Python 3.12+ warns of fork in such a process).
//
// Either way an exception in a chunk is rethrown to the caller once every chunk is done.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace epk {

namespace detail {

// True in a process made by fork() (after this library was loaded): no OpenMP team there (see the header).
inline std::atomic<bool> &in_forked_child() {
    static std::atomic<bool> forked{false};
    return forked;
}

inline const bool kForkWatch = [] {
    ::pthread_atfork(nullptr, nullptr, [] { in_forked_child().store(true, std::memory_order_relaxed); });
    return true;
}();

inline void epk_cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

// Sleeping helper threads and the one job they help with (the latest offered; a helper busy with an older one
// looks again when it is done).
class Pool {
  public:
    static Pool &get() {
        static const bool registered = [] {
            ::pthread_atfork(nullptr, nullptr, [] { current() = new Pool(); });  // the old one: left as it was
            return true;
        }();
        (void)registered;
        return *current();
    }

    // Up to `helpers` threads call `job` (each once) as soon as they wake. Never blocks on a helper: when a helper
    // holds the lock (it just woke), nothing is offered and the caller takes every chunk itself.
    void offer(std::shared_ptr<const std::function<void()>> job, int64_t helpers) {
        {
            std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
            if (!lock.owns_lock()) return;
            job_ = std::move(job);
            wanted_ = helpers;
            ++generation_;
            offered_.store(generation_, std::memory_order_release);
            for (; threads_ < std::min<int64_t>(helpers, kMaxThreads); ++threads_) {
                try {
                    std::thread([this] { serve(); }).detach();
                } catch (const std::system_error &) {
                    break;  // no thread to be had: fewer helpers (the caller takes the chunks)
                }
            }
        }
        for (int64_t i = 0; i < helpers; ++i) cv_.notify_one();
    }

  private:
    static constexpr int64_t kMaxThreads = 64;
    static constexpr int64_t kSpinMicros = 1000;

    static Pool *&current() {
        static Pool *pool = new Pool();  // never freed: helpers sleep in it for the process's life
        return pool;
    }

    void serve() {
        uint64_t seen = 0;
        for (;;) {
            std::shared_ptr<const std::function<void()>> job;
            {
                std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
                if (!spin_for_offer(seen, lock)) lock.lock();
                cv_.wait(lock, [&] { return generation_ != seen && wanted_ > 0; });
                seen = generation_;
                --wanted_;
                job = job_;
            }
            (*job)();
        }
    }

    // Before sleeping, watch for the next offer for up to kSpinMicros and take the lock without blocking once there
    // is one (true: `lock` is held). A helper that sleeps, on the condition variable or on the mutex, leaves its
    // core idle, and waking an idle core (a halted vCPU on a VM) took longer than a whole 8 MiB gather on the
    // 2-core CI machine: 2-thread gathers ran on the caller alone (418 us, as on 1 thread; index_select 172 us).
    // 1 ms covers a few other ops between two calls (0.2 ms did not in the benchmark's interleaved rounds); it
    // costs at most that much of one core per call, as torch's OpenMP workers spin after theirs. The ranks of
    // epkit's multi-process runs use one thread and start no helper.
    bool spin_for_offer(uint64_t seen, std::unique_lock<std::mutex> &lock) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
        for (int i = 1;; ++i) {
            if (offered_.load(std::memory_order_acquire) != seen && lock.try_lock()) return true;
            epk_cpu_relax();
            if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return false;
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::shared_ptr<const std::function<void()>> job_;
    uint64_t generation_ = 0;
    std::atomic<uint64_t> offered_{0};  // generation_, readable without the lock (spinning helpers)
    int64_t wanted_ = 0, threads_ = 0;
};

// The chunks of [0, n) taken from one counter; `done` counts the finished ones, the first exception is kept.
struct ChunkState {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex error_mu;
    std::exception_ptr error;
};

template <typename Fn>
void take_chunks(ChunkState &state, int64_t n, int64_t chunk, int64_t chunks, const Fn &fn) {
    for (int64_t c = state.next.fetch_add(1); c < chunks; c = state.next.fetch_add(1)) {
        try {
            fn(c * chunk, std::min(n, (c + 1) * chunk));
        } catch (...) {
            std::lock_guard<std::mutex> lock(state.error_mu);
            if (!state.error) state.error = std::current_exception();
        }
        state.done.fetch_add(1, std::memory_order_release);
    }
}

}  // namespace detail

template <typename Fn>
void parallel_chunks(int64_t n, int num_threads, int64_t chunk, const Fn &fn) {
    if (n <= 0) return;
    chunk = std::max<int64_t>(1, chunk);
    const int64_t chunks = (n + chunk - 1) / chunk;
    const int64_t helpers = std::min<int64_t>(num_threads, chunks) - 1;
    if (helpers <= 0) {
        fn(int64_t{0}, n);
        return;
    }
#ifdef _OPENMP
    if (!detail::in_forked_child().load(std::memory_order_relaxed)) {
        detail::ChunkState state;
#pragma omp parallel num_threads(static_cast<int>(helpers + 1))
        detail::take_chunks(state, n, chunk, chunks, fn);
        if (state.error) std::rethrow_exception(state.error);
        return;
    }
#endif
    auto state = std::make_shared<detail::ChunkState>();
    // a helper calls fn only for a chunk it took before the counter ran out, and the caller waits for that chunk
    // below (a chunk that throws counts as done): fn (and what it refers to) is alive whenever a helper calls it
    const Fn *f = &fn;
    auto work = std::make_shared<const std::function<void()>>(
        [state, n, chunk, chunks, f]() { detail::take_chunks(*state, n, chunk, chunks, *f); });
    detail::Pool::get().offer(work, helpers);
    (*work)();
    while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
    if (state->error) std::rethrow_exception(state->error);
}

}  // namespace epk
