// Splitting a loop over threads for the CPU kernels of epkit._C (gather_rows.cpp, engram_hash.cpp).
//
// [0, n) is cut into chunks of `chunk` items that the calling thread and up to `num_threads - 1` helper threads
// take from one atomic counter. The caller never waits for a helper to be scheduled: on a machine shared with
// other jobs a new thread can wait milliseconds for a core, and meanwhile the caller takes every chunk itself.
// It returns once every chunk taken is finished. Helpers are detached and keep the counter alive through a
// shared_ptr; one that starts late finds no chunk left and exits without touching the caller's data. `fn` must
// not throw. No thread outlives the call's chunks doing work, so nothing is left behind across fork().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <system_error>
#include <thread>

namespace epk {

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
    struct State {
        std::atomic<int64_t> next{0}, done{0};
    };
    auto state = std::make_shared<State>();
    auto work = [state, n, chunk, chunks, &fn]() {
        for (int64_t c = state->next.fetch_add(1); c < chunks; c = state->next.fetch_add(1)) {
            fn(c * chunk, std::min(n, (c + 1) * chunk));
            state->done.fetch_add(1, std::memory_order_release);
        }
    };
    for (int64_t i = 0; i < helpers; ++i) {
        try {
            // a helper calls fn only for a chunk it took before the counter ran out, and the caller waits for
            // that chunk below: fn (and what it refers to) is alive whenever a helper calls it
            std::thread(work).detach();
        } catch (const std::system_error &) {
            break;  // no thread to be had: the caller takes the chunks
        }
    }
    work();
    while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace epk
