// The row moves of collectives/_details/ep_rows.py on CPU. Fused row reductions for combine:
//
//   out[t, :] = cast( sum_{k < K, src[t,k] != 0} (w[t,k] *) float(src[t,k][:]) + sum_b float(bias_b[t, :]) )
//
// in float32, k ascending, then biases in order; each product is rounded before
// the add (no FMA contraction: the file is compiled with -ffp-contract=off), so
// results are bitwise equal to the torch formulation
//   acc = zeros; for k: acc += w[:, k] * rows_k; for b: acc += b; out = acc.to(dtype).
// With groups (group_end[k] != 0: term k ends a group; the last term ends one) the terms of each group are
// summed as above, the group's sum is cast to the output dtype and back (a partial sum of that dtype, as if
// written out and read again), and the groups' sums that had a row are added in order: the two-level combine
// of a hierarchy (a host's rows, then the hosts) in one pass, with no partial in memory.
// Rows are given as raw addresses (0 = no row), which lets combine read straight
// from shared-memory receive regions with no staging copy.

#include <atomic>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "lowp.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using epk::bf16_to_f32;
using epk::f32_to_bf16;

enum DType : int { F32 = 0, BF16 = 1 };

template <int DT>
EPK_INLINE float load_as(const void *row, int64_t h) {
    if (DT == BF16) return bf16_to_f32(static_cast<const uint16_t *>(row)[h]);
    return static_cast<const float *>(row)[h];
}

// The block kernel is inlined into each ISA clone of reduce_range (so it is vectorised for that ISA).
#define EPK_BLOCK EPK_INLINE

// Rows [0, num_rows) split into contiguous ranges over up to num_threads threads (>= min_rows each), the
// threads of parallel.h (an OpenMP team shared with torch's workers; in a forked child the caller and pooled helpers).
template <typename Fn>
void for_row_ranges(int64_t num_rows, int num_threads, int64_t min_rows, const Fn &fn) {
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_rows / min_rows));
    epk::parallel_chunks(num_rows, static_cast<int>(n), (num_rows + n - 1) / n, fn);
}

void check_dtype(int d, const char *what) {
    if (d != F32 && d != BF16) throw std::invalid_argument(std::string(what) + ": dtype code must be 0 (f32) or 1 (bf16)");
}

// One block of CH columns [h0, h0 + n) of token t's output, the accumulator in registers: each source row
// is read once and the output written once (no float32 row buffer in memory). n == CH lets the compiler
// unroll and vectorise the column loops; the tail block passes n < CH. Per element the operations and
// their order are those of the formula above (0, then each product rounded and added, k ascending).
constexpr int64_t CH = 64;

// A float32 value cast to the output dtype and back (bf16: round to nearest even, NaN -> 0x7FC0).
template <int OUT>
EPK_INLINE float as_out(float v) {
    return OUT == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

template <int SRC, int OUT, int BIAS>
EPK_BLOCK void reduce_block(int64_t t, int64_t h0, int64_t n, void *out, const int64_t *src, int64_t K, int64_t H,
                            const float *weights, const uintptr_t *bias, int64_t num_bias, const uint8_t *group_end) {
    float acc[CH], tot[CH];
    for (int64_t j = 0; j < n; ++j) acc[j] = tot[j] = 0.0f;
    bool any = false;  // the group so far has a row
    for (int64_t k = 0; k < K; ++k) {
        const int64_t addr = src[t * K + k];
        if (addr != 0) {
            const void *row = reinterpret_cast<const void *>(addr);
            any = true;
            if (weights != nullptr) {
                const float w = weights[t * K + k];
                for (int64_t j = 0; j < n; ++j) {
                    const float p = w * load_as<SRC>(row, h0 + j);
                    acc[j] = acc[j] + p;
                }
            } else {
                for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + load_as<SRC>(row, h0 + j);
            }
        }
        if (group_end != nullptr && group_end[k] != 0) {
            if (any)
                for (int64_t j = 0; j < n; ++j) tot[j] = tot[j] + as_out<OUT>(acc[j]);
            for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
            any = false;
        }
    }
    if (group_end != nullptr)
        for (int64_t j = 0; j < n; ++j) acc[j] = tot[j];
    for (int64_t b = 0; b < num_bias; ++b) {
        const char *base = reinterpret_cast<const char *>(bias[b]) + t * H * (BIAS == BF16 ? 2 : 4);
        for (int64_t j = 0; j < n; ++j) acc[j] = acc[j] + load_as<BIAS>(base, h0 + j);
    }
    if (OUT == BF16) {
        uint16_t *o = static_cast<uint16_t *>(out) + t * H + h0;
        for (int64_t j = 0; j < n; ++j) o[j] = f32_to_bf16(acc[j]);
    } else {
        float *o = static_cast<float *>(out) + t * H + h0;
        for (int64_t j = 0; j < n; ++j) o[j] = acc[j];
    }
}

// The source rows of a token are scattered (rows of other ranks' regions, in routing order): the hardware
// prefetcher cannot guess the next token's rows and starts over on each 4 KiB page, so while a block of token t
// is summed, the same columns of token t + 1's rows are prefetched (one token ahead is about a microsecond).
template <int SRC>
EPK_INLINE void prefetch_block(const int64_t *next, int64_t K, int64_t h0) {
    constexpr int64_t bytes = CH * (SRC == BF16 ? 2 : 4);
    for (int64_t k = 0; k < K; ++k) {
        if (next[k] == 0) continue;
        const char *p = reinterpret_cast<const char *>(next[k]) + h0 * (SRC == BF16 ? 2 : 4);
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
    }
}

template <int SRC, int OUT, int BIAS>
EPK_BLOCK void reduce_range_t(int64_t t0, int64_t t1, void *out, const int64_t *src, int64_t K, int64_t H, const float *weights,
                    const std::vector<uintptr_t> &bias, const uint8_t *group_end) {
    const uintptr_t *b = bias.data();
    const int64_t nb = static_cast<int64_t>(bias.size()), full = H - H % CH;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t *next = t + 1 < t1 ? src + (t + 1) * K : nullptr;
        for (int64_t h0 = 0; h0 < full; h0 += CH) {
            if (next != nullptr) prefetch_block<SRC>(next, K, h0);
            reduce_block<SRC, OUT, BIAS>(t, h0, CH, out, src, K, H, weights, b, nb, group_end);
        }
        if (full < H) reduce_block<SRC, OUT, BIAS>(t, full, H - full, out, src, K, H, weights, b, nb, group_end);
    }
}

// Compiled for several ISAs; the loader picks the best one for this CPU at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void reduce_range(int64_t t0, int64_t t1, uintptr_t out, int out_dtype, const int64_t *src, int64_t K, int64_t H,
                  int src_dtype, const float *weights, const std::vector<uintptr_t> &bias, int bias_dtype,
                  const uint8_t *group_end) {
    void *o = reinterpret_cast<void *>(out);
    const int code = src_dtype * 4 + out_dtype * 2 + bias_dtype;
    switch (code) {
#define EPK_CASE(S, O, B)                                                        \
    case S * 4 + O * 2 + B:                                                    \
        reduce_range_t<S, O, B>(t0, t1, o, src, K, H, weights, bias, group_end); \
        break;
        EPK_CASE(0, 0, 0) EPK_CASE(0, 0, 1) EPK_CASE(0, 1, 0) EPK_CASE(0, 1, 1)
        EPK_CASE(1, 0, 0) EPK_CASE(1, 0, 1) EPK_CASE(1, 1, 0) EPK_CASE(1, 1, 1)
#undef EPK_CASE
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
// bfloat16 source rows on an AVX2 CPU, hidden a multiple of CH: the same operations in the same order as
// reduce_block (0, then each product w * x rounded and added, k ascending, then the biases; the cast rounds to
// nearest even with NaN -> 0x7FC0), written with AVX2 so that the 64-column accumulator stays in eight registers.
#define EPK_AVX2 __attribute__((target("avx2"))) inline
EPK_AVX2 __m256 bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

EPK_AVX2 __m256i bf16_bits_x8(__m256 v) {  // f32_to_bf16 per lane, in the low 16 bits of each 32-bit lane
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// STREAM: the output rows are written with streaming stores (a result too large for the caches, read later by
// someone else: the cache lines need not be read for ownership first), 32-byte aligned; a fence ends the range.
// A group's sum cast to the output dtype and back (as_out).
template <int OUT>
EPK_AVX2 __m256 as_out_x8(__m256 v) {
    return OUT == BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits_x8(v), 16)) : v;
}

template <int OUT, int BIAS, bool STREAM>
__attribute__((target("avx2"))) void reduce_range_bf16_avx2(int64_t t0, int64_t t1, void *out, const int64_t *src, int64_t K,
                                                            int64_t H, const float *weights, const uintptr_t *bias,
                                                            int64_t nb, const uint8_t *group_end) {
    alignas(32) float tot[CH];  // the groups' sums so far (groups only): in L1, the accumulator stays in registers
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t *next = t + 1 < t1 ? src + (t + 1) * K : nullptr;
        for (int64_t h0 = 0; h0 < H; h0 += CH) {
            if (next != nullptr) prefetch_block<BF16>(next, K, h0);
            __m256 acc[8];
            for (auto &a : acc) a = _mm256_setzero_ps();
            if (group_end != nullptr)
                for (int i = 0; i < 8; ++i) _mm256_store_ps(tot + 8 * i, _mm256_setzero_ps());
            bool any = false;
            for (int64_t k = 0; k < K; ++k) {
                const int64_t addr = src[t * K + k];
                if (addr != 0) {
                    any = true;
                    const uint16_t *row = reinterpret_cast<const uint16_t *>(addr) + h0;
                    if (weights != nullptr) {
                        const __m256 w = _mm256_set1_ps(weights[t * K + k]);
                        for (int i = 0; i < 8; ++i)
                            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(w, bf16x8(row + 8 * i)));
                    } else {
                        for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], bf16x8(row + 8 * i));
                    }
                }
                if (group_end != nullptr && group_end[k] != 0) {
                    for (int i = 0; i < 8; ++i) {
                        if (any) _mm256_store_ps(tot + 8 * i, _mm256_add_ps(_mm256_load_ps(tot + 8 * i), as_out_x8<OUT>(acc[i])));
                        acc[i] = _mm256_setzero_ps();
                    }
                    any = false;
                }
            }
            if (group_end != nullptr)
                for (int i = 0; i < 8; ++i) acc[i] = _mm256_load_ps(tot + 8 * i);
            for (int64_t b = 0; b < nb; ++b) {
                if (BIAS == BF16) {
                    const uint16_t *base = reinterpret_cast<const uint16_t *>(bias[b]) + t * H + h0;
                    for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], bf16x8(base + 8 * i));
                } else {
                    const float *base = reinterpret_cast<const float *>(bias[b]) + t * H + h0;
                    for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], _mm256_loadu_ps(base + 8 * i));
                }
            }
            if (OUT == BF16) {
                uint16_t *o = static_cast<uint16_t *>(out) + t * H + h0;
                for (int i = 0; i < 8; i += 2) {
                    const __m256i packed = _mm256_packus_epi32(bf16_bits_x8(acc[i]), bf16_bits_x8(acc[i + 1]));
                    __m256i *dst = reinterpret_cast<__m256i *>(o + 8 * i);
                    if (STREAM) _mm256_stream_si256(dst, _mm256_permute4x64_epi64(packed, 0xD8));
                    else _mm256_storeu_si256(dst, _mm256_permute4x64_epi64(packed, 0xD8));
                }
            } else {
                float *o = static_cast<float *>(out) + t * H + h0;
                for (int i = 0; i < 8; ++i) {
                    if (STREAM) _mm256_stream_ps(o + 8 * i, acc[i]);
                    else _mm256_storeu_ps(o + 8 * i, acc[i]);
                }
            }
        }
    }
}

// The AVX2 kernel for these rows, or false (another layout or CPU: reduce_range then).
template <bool STREAM>
void reduce_bf16_avx2(int64_t t0, int64_t t1, void *o, int out_dtype, const int64_t *src, int64_t K, int64_t H,
                      const float *weights, const uintptr_t *b, int64_t nb, int bias_dtype, const uint8_t *g) {
    if (out_dtype == BF16) {
        if (bias_dtype == BF16) reduce_range_bf16_avx2<BF16, BF16, STREAM>(t0, t1, o, src, K, H, weights, b, nb, g);
        else reduce_range_bf16_avx2<BF16, F32, STREAM>(t0, t1, o, src, K, H, weights, b, nb, g);
    } else {
        if (bias_dtype == BF16) reduce_range_bf16_avx2<F32, BF16, STREAM>(t0, t1, o, src, K, H, weights, b, nb, g);
        else reduce_range_bf16_avx2<F32, F32, STREAM>(t0, t1, o, src, K, H, weights, b, nb, g);
    }
    if (STREAM) _mm_sfence();  // the streamed rows are visible before the call returns
}

// Results of at least this many bytes are written with streaming stores.
constexpr int64_t STREAM_BYTES = 8 << 20;

// The AVX2 kernel for these rows, or false (another layout or CPU: reduce_range then). `total_bytes`: the whole
// output's (all threads' ranges).
bool reduce_range_fast(int64_t t0, int64_t t1, uintptr_t out, int out_dtype, const int64_t *src, int64_t K, int64_t H,
                       int src_dtype, const float *weights, const std::vector<uintptr_t> &bias, int bias_dtype,
                       int64_t total_bytes, const uint8_t *group_end) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (!avx2 || src_dtype != BF16 || H % CH != 0) return false;
    void *o = reinterpret_cast<void *>(out);
    const uintptr_t *b = bias.data();
    const int64_t nb = static_cast<int64_t>(bias.size());
    if (total_bytes >= STREAM_BYTES && (out & 31) == 0)  // H % 64 == 0: every row and block is 32-byte aligned too
        reduce_bf16_avx2<true>(t0, t1, o, out_dtype, src, K, H, weights, b, nb, bias_dtype, group_end);
    else
        reduce_bf16_avx2<false>(t0, t1, o, out_dtype, src, K, H, weights, b, nb, bias_dtype, group_end);
    return true;
}
#else
bool reduce_range_fast(int64_t, int64_t, uintptr_t, int, const int64_t *, int64_t, int64_t, int, const float *,
                       const std::vector<uintptr_t> &, int, int64_t, const uint8_t *) {
    return false;
}
#endif

}  // namespace

void register_reduce_rows(py::module_ &m) {
    m.def(
        "reduce_rows",
        [](uintptr_t out, int out_dtype, uintptr_t src_addrs, int64_t T, int64_t K, int64_t H, int src_dtype,
           uintptr_t weights, std::vector<uintptr_t> bias, int bias_dtype, int num_threads, uintptr_t group_end) {
            check_dtype(out_dtype, "out");
            check_dtype(src_dtype, "src");
            check_dtype(bias_dtype, "bias");
            if (T < 0 || K < 0 || H < 0) throw std::invalid_argument("negative size");
            if (T == 0 || H == 0) return;
            if (out == 0 || (K > 0 && src_addrs == 0)) throw std::invalid_argument("null pointer");
            const int64_t *src = reinterpret_cast<const int64_t *>(src_addrs);
            const float *w = reinterpret_cast<const float *>(weights);
            const uint8_t *g = reinterpret_cast<const uint8_t *>(group_end);
            if (g != nullptr && K > 0 && g[K - 1] == 0) throw std::invalid_argument("group_end: the last term must end a group");
            py::gil_scoped_release release;
            const int64_t total = T * H * (out_dtype == BF16 ? 2 : 4);
            for_row_ranges(T, num_threads, 16, [&](int64_t a, int64_t b) {
                if (!reduce_range_fast(a, b, out, out_dtype, src, K, H, src_dtype, w, bias, bias_dtype, total, g))
                    reduce_range(a, b, out, out_dtype, src, K, H, src_dtype, w, bias, bias_dtype, g);
            });
        },
        py::arg("out"), py::arg("out_dtype"), py::arg("src_addrs"), py::arg("num_tokens"), py::arg("k"),
        py::arg("hidden"), py::arg("src_dtype"), py::arg("weights"), py::arg("bias"), py::arg("bias_dtype"),
        py::arg("num_threads"), py::arg("group_end") = 0,
        "out[t] = cast(sum_k (w[t,k] *) row(t,k) + sum biases) in float32, k ascending; rows by address (0 = none); "
        "group_end (uint8 [K] address, 0 = none): each group's sum cast to the output dtype before the groups add.");
}

namespace {

void copy_range(int64_t i0, int64_t i1, const int64_t *dst, const int64_t *src, int64_t row_bytes) {
    for (int64_t i = i0; i < i1; ++i) {
        if (dst[i] == 0 || src[i] == 0) continue;  // a skipped row (fixed-shape row lists mark unused slots 0)
        std::memcpy(reinterpret_cast<void *>(dst[i]), reinterpret_cast<const void *>(src[i]),
                    static_cast<size_t>(row_bytes));
    }
}

}  // namespace

void register_gather_by_address(py::module_ &m) {
    m.def(
        "copy_rows_by_address",
        [](uintptr_t dst_addrs, uintptr_t src_addrs, int64_t num_rows, int64_t row_bytes, int num_threads,
           uintptr_t guard) {
            if (num_rows < 0 || row_bytes < 0) throw std::invalid_argument("negative size");
            if (num_rows == 0 || row_bytes == 0) return;
            if (dst_addrs == 0 || src_addrs == 0) throw std::invalid_argument("null pointer");
            if (guard != 0 && reinterpret_cast<const std::atomic<int64_t> *>(guard)->load() != 0) return;
            const int64_t *d = reinterpret_cast<const int64_t *>(dst_addrs);
            const int64_t *s = reinterpret_cast<const int64_t *>(src_addrs);
            py::gil_scoped_release release;
            for_row_ranges(num_rows, num_threads, 64,
                           [&](int64_t lo, int64_t hi) { copy_range(lo, hi, d, s, row_bytes); });
        },
        py::arg("dst_addrs"), py::arg("src_addrs"), py::arg("num_rows"), py::arg("row_bytes"), py::arg("num_threads"),
        py::arg("guard") = 0,
        "Row i: copy row_bytes from address src_addrs[i] to dst_addrs[i] (int64 address arrays; rows must not "
        "overlap); a row where either address is 0 is skipped. Nothing is copied if the int64 word at `guard` "
        "(0: none) is nonzero.");
}

// A dispatch's routing layout in one pass over topk_idx [T, K] (int64): in_rank[t, r] = 1 when one of token
// t's experts lives on rank r (expert / L), per_rank[r] the tokens with in_rank[t, r], per_expert[e] the
// (token, slot) pairs naming e; -1 names no expert. The caller checks the ids first (its message names the
// entry); another value here is std::out_of_range (an IndexError). The outputs are zeroed here.
void register_dispatch_layout(py::module_ &m) {
    m.def(
        "dispatch_layout",
        [](uintptr_t topk_idx, int64_t T, int64_t K, int64_t L, int64_t W, int64_t E, uintptr_t in_rank,
           uintptr_t per_rank, uintptr_t per_expert) {
            if (T < 0 || K < 0 || L < 1 || W < 1 || E != L * W) throw std::invalid_argument("dispatch_layout: bad sizes");
            const int64_t *idx = reinterpret_cast<const int64_t *>(topk_idx);
            uint8_t *in = reinterpret_cast<uint8_t *>(in_rank);
            int32_t *pr = reinterpret_cast<int32_t *>(per_rank);
            int32_t *pe = reinterpret_cast<int32_t *>(per_expert);
            py::gil_scoped_release release;
            if (T > 0) std::memset(in, 0, static_cast<size_t>(T * W));
            std::memset(pr, 0, static_cast<size_t>(W) * sizeof(int32_t));
            std::memset(pe, 0, static_cast<size_t>(E) * sizeof(int32_t));
            for (int64_t t = 0; t < T; ++t) {
                uint8_t *row = in + t * W;
                for (int64_t k = 0; k < K; ++k) {
                    const int64_t e = idx[t * K + k];
                    if (e == -1) continue;
                    if (e < -1 || e >= E) throw std::out_of_range("dispatch_layout: an expert id outside [-1, E)");
                    pe[e] += 1;
                    const int64_t r = e / L;
                    pr[r] += row[r] == 0;
                    row[r] = 1;
                }
            }
        },
        py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_local_experts"),
        py::arg("world_size"), py::arg("num_experts"), py::arg("in_rank"), py::arg("per_rank"), py::arg("per_expert"),
        "A dispatch's routing layout in one pass: in_rank [T, W] bool, per_rank [W] int32, per_expert [E] int32 "
        "(addresses of contiguous CPU tensors; topk_idx [T, K] int64, -1 = no expert).");
}
