// epkit.gather_rows on CPU (backend "cpu"): out[i] = x[index[i]] (row_bytes each), a zero row where index[i] == -1.
//
// Rows are copied as bytes, so every dtype is bit-exact. Output rows are cut into chunks that the threads
// of parallel.h take in turn, with the GIL released. The rows are random, so the
// hardware prefetcher cannot guess the next one (and on a new 4 KiB page it starts over): each thread runs a
// software prefetch kPrefetchAhead bytes ahead of its copy in the stream of source rows it will read, a line at
// a time as it copies, so that a steady number of lines is in flight across row boundaries (not for a source
// small enough to be in the caches). When the output is
// larger than the caches and its rows are whole 64-byte lines, rows are written with non-temporal (streaming)
// stores: no line of `out` is read before it is overwritten, as in a large memcpy. An index outside [-1, N)
// writes a zero row and is reported back (the caller raises). gather_rows_by_address copies the same way from a
// list of raw row addresses (0: a zero row): the one-sided Engram lookup's reads out of the owners' shards.

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
// A source of at most this many bytes is read without the prefetch cursor: it is likely in the caches, where the
// cursor's bookkeeping costs more than it hides (4 MiB gathers: ~1.3x slower with it, measured).
constexpr int64_t kCachedSourceBytes = 8 << 20;

enum Store : int { PLAIN = 0, STREAM_AVX2 = 1, STREAM_AVX512 = 2, CACHED = 3 };


// Where row i of the output comes from: a row of x by index, or a raw address (gather_rows_by_address). at(i) is
// the source row, or nullptr for a zero row; bad(i) says whether that zero row stands for an invalid index.
template <typename Idx>
struct IndexRows {
    const char *x;
    const Idx *index;
    int64_t n, rb;
    inline const char *at(int64_t i) const {
        const int64_t src = static_cast<int64_t>(index[i]);
        return src >= 0 && src < n ? x + src * rb : nullptr;
    }
    inline bool bad(int64_t i) const { return static_cast<int64_t>(index[i]) != -1; }
    inline int64_t source_bytes() const { return n * rb; }
};

struct AddressRows {
    const int64_t *addrs;
    inline const char *at(int64_t i) const { return reinterpret_cast<const char *>(addrs[i]); }
    inline bool bad(int64_t) const { return false; }  // address 0: a zero row asked for
    inline int64_t source_bytes() const { return INT64_MAX; }  // rows anywhere (other processes' shards)
};

// The prefetch cursor of one thread's range of output rows: the stream of the source rows it will read, a line at a
// time (rows that read nothing are skipped). line() prefetches the next line.
template <typename Rows>
struct Prefetcher {
    const Rows &rows;
    int64_t rb, row, end;         // the next row to enter the stream, and the range's end
    const char *p = nullptr;      // the next line of the row being prefetched
    int64_t left = 0;             // bytes of that row not yet prefetched

    inline void line() {
        while (left <= 0) {
            if (row >= end) return;
            const char *src = rows.at(row++);
            if (src != nullptr) p = src, left = rb;
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
template <typename Rows>
__attribute__((target("avx512f"))) void stream_row_avx512(char *dst, const char *src, int64_t bytes,
                                                          Prefetcher<Rows> &pf) {
    for (int64_t o = 0; o < bytes; o += kLine) {
        pf.line();
        const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void *>(src + o));
        _mm512_stream_si512(reinterpret_cast<__m512i *>(dst + o), v);
    }
}

template <typename Rows>
__attribute__((target("avx2"))) void stream_row_avx2(char *dst, const char *src, int64_t bytes, Prefetcher<Rows> &pf) {
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
template <typename Rows>
void stream_row_avx512(char *dst, const char *src, int64_t bytes, Prefetcher<Rows> &pf) {
    pf.advance(bytes);
    std::memcpy(dst, src, bytes);
}
template <typename Rows>
void stream_row_avx2(char *dst, const char *src, int64_t bytes, Prefetcher<Rows> &pf) {
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

template <typename Rows, Store S>
void gather_range(int64_t i0, int64_t i1, char *out, const Rows &rows, int64_t rb, std::atomic<int64_t> &bad) {
    Prefetcher<Rows> pf{rows, rb, i0, i1};
    if constexpr (S != CACHED) pf.advance(kPrefetchAhead);
    for (int64_t i = i0; i < i1; ++i) {
        const char *src = rows.at(i);
        char *dst = out + i * rb;
        if (src == nullptr) {
            if (rows.bad(i)) {
                int64_t none = -1;
                bad.compare_exchange_strong(none, i);
            }
            if constexpr (S == PLAIN || S == CACHED) {
                std::memset(dst, 0, static_cast<size_t>(rb));
            } else {
                zero_row_stream(dst, rb);
            }
            continue;
        }
        if constexpr (S == STREAM_AVX512) {
            stream_row_avx512(dst, src, rb, pf);
        } else if constexpr (S == STREAM_AVX2) {
            stream_row_avx2(dst, src, rb, pf);
        } else {
            if constexpr (S == PLAIN) pf.advance(rb);
            std::memcpy(dst, src, static_cast<size_t>(rb));
        }
    }
    if constexpr (S == STREAM_AVX2 || S == STREAM_AVX512) fence();
}

template <typename Rows>
void gather(uintptr_t out, const Rows &rows, int64_t m, int64_t rb, int num_threads, std::atomic<int64_t> &bad) {
    char *o = reinterpret_cast<char *>(out);
    Store s = pick_store(out, m, rb);
    if (s == PLAIN && rows.source_bytes() <= kCachedSourceBytes) s = CACHED;
    // chunks of ~256 KiB of rows: below that a chunk handed to another thread costs more than it saves
    const int64_t chunk_rows = std::max<int64_t>(16, (256 << 10) / std::max<int64_t>(1, rb));
    epk::parallel_chunks(m, num_threads, chunk_rows, [&](int64_t lo, int64_t hi) {
        if (s == STREAM_AVX512) {
            gather_range<Rows, STREAM_AVX512>(lo, hi, o, rows, rb, bad);
        } else if (s == STREAM_AVX2) {
            gather_range<Rows, STREAM_AVX2>(lo, hi, o, rows, rb, bad);
        } else if (s == CACHED) {
            gather_range<Rows, CACHED>(lo, hi, o, rows, rb, bad);
        } else {
            gather_range<Rows, PLAIN>(lo, hi, o, rows, rb, bad);
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
            const char *src = reinterpret_cast<const char *>(x);
            if (index_bytes == 4) {
                const IndexRows<int32_t> rows{src, reinterpret_cast<const int32_t *>(index), num_rows, row_bytes};
                gather(out, rows, num_out, row_bytes, num_threads, bad);
            } else {
                const IndexRows<int64_t> rows{src, reinterpret_cast<const int64_t *>(index), num_rows, row_bytes};
                gather(out, rows, num_out, row_bytes, num_threads, bad);
            }
            return bad.load();
        },
        py::arg("out"), py::arg("x"), py::arg("index"), py::arg("index_bytes"), py::arg("num_out"),
        py::arg("num_rows"), py::arg("row_bytes"), py::arg("num_threads"),
        "out[i] = row index[i] of x (row_bytes bytes each; contiguous out and x, int32 or int64 index), a zero row "
        "where index[i] is -1. Returns -1, or the first position found whose index is outside [-1, num_rows) "
        "(its row is zeroed).");
    m.def(
        "gather_rows_by_address",
        [](uintptr_t out, uintptr_t addrs, int64_t num_rows, int64_t row_bytes, int num_threads) {
            if (num_rows < 0 || row_bytes < 0) throw std::invalid_argument("negative size");
            if (num_rows == 0 || row_bytes == 0) return;
            if (out == 0 || addrs == 0) throw std::invalid_argument("null pointer");
            const AddressRows rows{reinterpret_cast<const int64_t *>(addrs)};
            std::atomic<int64_t> bad{-1};
            py::gil_scoped_release release;
            gather(out, rows, num_rows, row_bytes, num_threads, bad);
        },
        py::arg("out"), py::arg("addrs"), py::arg("num_rows"), py::arg("row_bytes"), py::arg("num_threads"),
        "out[i] = bytes at addrs[i] (row_bytes each; int64 addresses), a zero row where addrs[i] == 0; rows copied "
        "as gather_rows copies them (a prefetch cursor ahead over the source rows, streaming stores for a large "
        "out).");
}
