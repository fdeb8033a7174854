// epkit.gather_rows on CPU (backend "cpu"): out[i] = x[index[i]] (row_bytes each), a zero row where index[i] == -1.
//
// Rows are copied as bytes, so every dtype is bit-exact. Output rows are cut into chunks that the calling
// thread and helper threads take in turn (parallel.h), with the GIL released. The rows are random, so the
// hardware prefetcher cannot guess the next one (and on a new 4 KiB page it starts over): each thread runs a
// software prefetch kPrefetchAhead bytes ahead of its copy in the stream of source rows it will read, a line at
// a time as it copies, so that a steady number of lines is in flight across row boundaries. When the output is
// larger than the caches and its rows are whole 64-byte lines, rows are written with non-temporal (streaming)
// stores: no line of `out` is read before it is overwritten, as in a large memcpy. An index outside [-1, N)
// writes a zero row and is reported back (the caller raises).

#include <pybind11/pybind11.h>

#include "parallel.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

constexpr int64_t kPrefetchAhead = 2048;   // bytes of the source-row stream prefetched ahead of the copy
constexpr int64_t kLine = 64;              // the cache line, the unit of prefetching and of a streaming row
constexpr int64_t kStreamBytes = 8 << 20;  // outputs at least this large are written with streaming stores

enum Store : int { PLAIN = 0, STREAM_AVX2 = 1, STREAM_AVX512 = 2 };

// The prefetch cursor of one thread's range of output rows: the stream of the source rows it will read, a line at a
// time (rows that read nothing, padding or an index outside [0, n), are skipped). line() prefetches the next line.
template <typename Idx>
struct Prefetcher {
    const char *x;
    const Idx *index;
    int64_t n, rb, row, end;      // the next row to enter the stream, and the range's end
    const char *p = nullptr;      // the next line of the row being prefetched
    int64_t left = 0;             // bytes of that row not yet prefetched

    inline void line() {
        while (left <= 0) {
            if (row >= end) return;
            const int64_t src = static_cast<int64_t>(index[row++]);
            if (src >= 0 && src < n) p = x + src * rb, left = rb;
        }
        __builtin_prefetch(p, 0, 3);
        p += kLine;
        left -= kLine;
    }

    void advance(int64_t bytes) {
        for (; bytes > 0; bytes -= kLine) line();
    }
};

#if defined(__x86_64__) && defined(__GNUC__)
// A row of whole lines, streamed a line at a time, each line copied after the prefetch moves one line on.
template <typename Idx>
__attribute__((target("avx512f"))) void stream_row_avx512(char *dst, const char *src, int64_t bytes,
                                                          Prefetcher<Idx> &pf) {
    for (int64_t o = 0; o < bytes; o += kLine) {
        pf.line();
        const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void *>(src + o));
        _mm512_stream_si512(reinterpret_cast<__m512i *>(dst + o), v);
    }
}

template <typename Idx>
__attribute__((target("avx2"))) void stream_row_avx2(char *dst, const char *src, int64_t bytes, Prefetcher<Idx> &pf) {
    int64_t o = 0;
    for (; o + 2 * kLine <= bytes; o += 2 * kLine) {  // two lines a step: loads first, then stores
        pf.line();
        pf.line();
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o + 32));
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o + 64));
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o + 96));
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o), a);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o + 32), b);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o + 64), c);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o + 96), d);
    }
    if (o < bytes) {  // a last odd line
        pf.line();
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + o + 32));
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o), a);
        _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o + 32), b);
    }
}

__attribute__((target("avx2"))) void zero_row_stream(char *dst, int64_t bytes) {
    const __m256i z = _mm256_setzero_si256();
    for (int64_t o = 0; o < bytes; o += 32) _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + o), z);
}

void fence() { _mm_sfence(); }
#else
template <typename Idx>
void stream_row_avx512(char *dst, const char *src, int64_t bytes, Prefetcher<Idx> &pf) {
    pf.advance(bytes);
    std::memcpy(dst, src, bytes);
}
template <typename Idx>
void stream_row_avx2(char *dst, const char *src, int64_t bytes, Prefetcher<Idx> &pf) {
    pf.advance(bytes);
    std::memcpy(dst, src, bytes);
}
void zero_row_stream(char *dst, int64_t bytes) { std::memset(dst, 0, bytes); }
void fence() {}
#endif

Store pick_store(uintptr_t out, int64_t rows, int64_t row_bytes) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (rows * row_bytes < kStreamBytes || row_bytes % kLine != 0 || out % kLine != 0) return PLAIN;
    if (__builtin_cpu_supports("avx512f")) return STREAM_AVX512;
    if (__builtin_cpu_supports("avx2")) return STREAM_AVX2;
#else
    (void)out, (void)rows, (void)row_bytes;
#endif
    return PLAIN;
}

template <typename Idx, Store S>
void gather_range(int64_t i0, int64_t i1, char *out, const char *x, const Idx *index, int64_t n, int64_t rb,
                  std::atomic<int64_t> &bad) {
    Prefetcher<Idx> pf{x, index, n, rb, i0, i1};
    pf.advance(kPrefetchAhead);
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t src = static_cast<int64_t>(index[i]);
        char *dst = out + i * rb;
        if (src < 0 || src >= n) {
            if (src != -1) {
                int64_t none = -1;
                bad.compare_exchange_strong(none, i);
            }
            if constexpr (S == PLAIN) {
                std::memset(dst, 0, static_cast<size_t>(rb));
            } else {
                zero_row_stream(dst, rb);
            }
            continue;
        }
        if constexpr (S == STREAM_AVX512) {
            stream_row_avx512(dst, x + src * rb, rb, pf);
        } else if constexpr (S == STREAM_AVX2) {
            stream_row_avx2(dst, x + src * rb, rb, pf);
        } else {
            pf.advance(rb);
            std::memcpy(dst, x + src * rb, static_cast<size_t>(rb));
        }
    }
    if constexpr (S != PLAIN) fence();
}

template <typename Idx>
void gather(uintptr_t out, uintptr_t x, uintptr_t index, int64_t m, int64_t n, int64_t rb, int num_threads,
            std::atomic<int64_t> &bad) {
    char *o = reinterpret_cast<char *>(out);
    const char *src = reinterpret_cast<const char *>(x);
    const Idx *idx = reinterpret_cast<const Idx *>(index);
    const Store s = pick_store(out, m, rb);
    // chunks of ~256 KiB of rows: below that a chunk handed to another thread costs more than it saves
    const int64_t chunk_rows = std::max<int64_t>(16, (256 << 10) / std::max<int64_t>(1, rb));
    epk::parallel_chunks(m, num_threads, chunk_rows, [&](int64_t lo, int64_t hi) {
        if (s == STREAM_AVX512) {
            gather_range<Idx, STREAM_AVX512>(lo, hi, o, src, idx, n, rb, bad);
        } else if (s == STREAM_AVX2) {
            gather_range<Idx, STREAM_AVX2>(lo, hi, o, src, idx, n, rb, bad);
        } else {
            gather_range<Idx, PLAIN>(lo, hi, o, src, idx, n, rb, bad);
        }
    });
}

}  // namespace

void register_gather_rows(py::module_ &m) {
    m.def(
        "gather_rows",
        [](uintptr_t out, uintptr_t x, uintptr_t index, int index_bytes, int64_t num_out, int64_t num_rows,
           int64_t row_bytes, int num_threads) -> int64_t {
            if (num_out < 0 || num_rows < 0 || row_bytes < 0) throw std::invalid_argument("negative size");
            if (index_bytes != 4 && index_bytes != 8) throw std::invalid_argument("index must be int32 or int64");
            if (num_out == 0 || row_bytes == 0) return -1;
            if (out == 0 || index == 0 || (num_rows > 0 && x == 0)) throw std::invalid_argument("null pointer");
            std::atomic<int64_t> bad{-1};
            py::gil_scoped_release release;
            if (index_bytes == 4) {
                gather<int32_t>(out, x, index, num_out, num_rows, row_bytes, num_threads, bad);
            } else {
                gather<int64_t>(out, x, index, num_out, num_rows, row_bytes, num_threads, bad);
            }
            return bad.load();
        },
        py::arg("out"), py::arg("x"), py::arg("index"), py::arg("index_bytes"), py::arg("num_out"),
        py::arg("num_rows"), py::arg("row_bytes"), py::arg("num_threads"),
        "out[i] = row index[i] of x (row_bytes bytes each; contiguous out and x, int32 or int64 index), a zero row "
        "where index[i] is -1. Returns -1, or the first position found whose index is outside [-1, num_rows) "
        "(its row is zeroed).");
}
