// Fused block-scaled dequantization for the CPU grouped GEMMs (epkit.grouped_gemm, cpu backend):
//
//   FP8 (e4m3):  out[b, r, c] = cast( float(q[b, src, c]) * scale[b, src / row_block, c / col_block] )
//   MXFP4:       out[b, r, c] = cast( e2m1(nibble c of packed[b, src, c / 2]) * 2**(e8m0[b, src, c / 32] - 127) )
//
// with src = row_index[r] (optional int64 array; a fused row gather) or r. One float32
// multiply per element (no FMA: -ffp-contract=off), then the cast to float32 (no-op) or
// bfloat16 (round to nearest even, NaN -> 0x7FC0), so the result is bitwise equal to
// `epkit.quant.dequant_*(...).to(dtype)` for every non-NaN value. e4m3 -> float32 is exact
// (integer shifts; e4m3 subnormals through an exact int -> float conversion); the e8m0 scale
// 2**(e - 127) is built from its bits (e = 0 gives the float32 denormal 2**-127, e = 255 +inf,
// as torch.pow(2.0, e - 127.0) does in float32).
//
// Several jobs (e.g. all experts' weights and all live activation rows) run in one pass: their
// rows are concatenated and split over std::threads with the GIL released. Tensors come as
// raw addresses with element strides. The row loops exist three times: generic C++, AVX-512
// (16 elements per step, lowp.h) and AVX2 (8 per step, below), picked at run time; all three
// do the same float32 operations, so they give the same bits.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "lowp.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

using namespace epk;

struct Job {
    int kind;  // 0 = fp8, 1 = mxfp4
    int out_dtype;
    uintptr_t out, q, scale;
    int64_t batches, rows, k;
    int64_t out_bs, out_rs;  // element strides of out (batch, row)
    int64_t q_bs, q_rs;      // byte strides of q / packed (batch, row)
    int64_t s_bs, s_rs;      // element strides of scale (batch, row block); its columns are contiguous
    int64_t row_block, col_block;
    uintptr_t row_index;  // optional int64 [rows]: source row of each output row (0 = identity)
};

#if defined(__x86_64__) && defined(__GNUC__)
#define EPK_AVX2 __attribute__((target("avx2")))

// 8 e4m3 codes -> 8 exact float32 values (lowp.h's e4m3_to_f32, 8 lanes at a time).
EPK_AVX2 EPK_INLINE __m256 e4m3x8(const uint8_t *q) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(q)));
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256 normal =
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub =
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(mag, _mm256_set1_epi32(7))), _mm256_set1_ps(0.001953125f));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);  // exponent field 0
    __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    const __m256i is_nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
    v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_castsi256_ps(is_nan));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

// float32 -> bf16 bits in the low 16 bits of each 32-bit lane (RNE, NaN -> 0x7FC0; lowp.h's f32_to_bf16).
EPK_AVX2 EPK_INLINE __m256i bf16x8(__m256 y) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    // |u| > 0x7F800000 as signed compares (both sides are non-negative)
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 lanes of bf16 bits (low halves) -> 8 contiguous bf16 values.
EPK_AVX2 EPK_INLINE void store_bf16x8(void *out, __m256i w) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out), _mm256_castsi256_si128(packed));
}

template <int OUT>
EPK_AVX2 void fp8_row_avx2(char *o, const uint8_t *q, const float *s, int64_t k, int64_t col_block) {
    const int64_t esz = OUT == OUT_BF16 ? 2 : 4;
    for (int64_t c = 0; c < k; c += col_block) {
        const int64_t len = std::min(col_block, k - c);
        const float sc = s[c / col_block];
        const __m256 vs = _mm256_set1_ps(sc);
        char *oc = o + c * esz;
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
            const __m256 y = _mm256_mul_ps(e4m3x8(q + c + i), vs);
            if (OUT == OUT_BF16)
                store_bf16x8(oc + i * 2, bf16x8(y));
            else
                _mm256_storeu_ps(reinterpret_cast<float *>(oc) + i, y);
        }
        if (i < len) fp8_segment<OUT>(oc + i * esz, q + c + i, sc, len - i);
    }
}

// e2m1 codes (4 bits a lane) -> their values times vs: the magnitude by the 3-bit code, the sign from bit 3
// (lowp.h's e2m1_to_f32).
EPK_AVX2 EPK_INLINE __m256 e2m1x8(__m256i code, __m256 vs) {
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256 m = _mm256_permutevar8x32_ps(table, code);  // uses the low 3 bits of each lane
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(m), sign)), vs);
}

// 8 packed bytes (16 e2m1 codes, low nibble first) sharing scale vs -> 16 outputs.
template <int OUT>
EPK_AVX2 EPK_INLINE void fp4_pairs8_avx2(char *out, const uint8_t *p, __m256 vs) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
    const __m256 lo = e2m1x8(_mm256_and_si256(x, _mm256_set1_epi32(15)), vs);
    const __m256 hi = e2m1x8(_mm256_srli_epi32(x, 4), vs);
    if (OUT == OUT_BF16) {
        const __m256i w = _mm256_or_si256(bf16x8(lo), _mm256_slli_epi32(bf16x8(hi), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), w);
    } else {
        const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
        _mm256_storeu_ps(reinterpret_cast<float *>(out), _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(reinterpret_cast<float *>(out) + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}

template <int OUT>
EPK_AVX2 void fp4_row_avx2(char *o, const uint8_t *p, const uint8_t *s, int64_t k) {
    const int64_t esz = OUT == OUT_BF16 ? 2 : 4;
    for (int64_t c = 0; c < k; c += 32) {
        const __m256 vs = _mm256_set1_ps(e8m0_to_f32(s[c / 32]));
        fp4_pairs8_avx2<OUT>(o + c * esz, p + c / 2, vs);
        fp4_pairs8_avx2<OUT>(o + (c + 16) * esz, p + c / 2 + 8, vs);
    }
}
#endif

enum Simd : int { GENERIC = 0, AVX2 = 1, AVX512 = 2 };

template <int OUT, int SIMD>
EPK_INLINE void run_rows(const Job &j, int64_t lo, int64_t hi) {
    const int64_t esz = OUT == OUT_BF16 ? 2 : 4;
    const int64_t *idx = reinterpret_cast<const int64_t *>(j.row_index);
    for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / j.rows, r = t % j.rows;
        const int64_t src = idx != nullptr ? idx[r] : r;
        char *o = reinterpret_cast<char *>(j.out) + (b * j.out_bs + r * j.out_rs) * esz;
        const uint8_t *q = reinterpret_cast<const uint8_t *>(j.q) + b * j.q_bs + src * j.q_rs;
        if (j.kind == 0) {
            const float *s = reinterpret_cast<const float *>(j.scale) + b * j.s_bs + (src / j.row_block) * j.s_rs;
#if defined(__x86_64__) && defined(__GNUC__)
            if constexpr (SIMD == AVX512) {
                fp8_row_avx512<OUT>(o, q, s, j.k, j.col_block);
                continue;
            } else if constexpr (SIMD == AVX2) {
                fp8_row_avx2<OUT>(o, q, s, j.k, j.col_block);
                continue;
            }
#endif
            for (int64_t c = 0; c < j.k; c += j.col_block)
                fp8_segment<OUT>(o + c * esz, q + c, s[c / j.col_block], std::min(j.col_block, j.k - c));
        } else {
            const uint8_t *s = reinterpret_cast<const uint8_t *>(j.scale) + b * j.s_bs + src * j.s_rs;
#if defined(__x86_64__) && defined(__GNUC__)
            if constexpr (SIMD == AVX512) {
                fp4_row_avx512<OUT>(o, q, s, j.k);
                continue;
            } else if constexpr (SIMD == AVX2) {
                fp4_row_avx2<OUT>(o, q, s, j.k);
                continue;
            }
#endif
            for (int64_t c = 0; c < j.k; c += 32) fp4_segment<OUT>(o + c * esz, q + c / 2, e8m0_to_f32(s[c / 32]), 16);
        }
    }
}

template <int SIMD>
void rows_of(const Job &j, int64_t lo, int64_t hi) {
    if (j.out_dtype == OUT_BF16)
        run_rows<OUT_BF16, SIMD>(j, lo, hi);
    else
        run_rows<OUT_F32, SIMD>(j, lo, hi);
}

#if defined(__x86_64__) && defined(__GNUC__)

bool have_avx512() {
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return ok;
}
#endif

using RowsFn = void (*)(const Job &, int64_t, int64_t);

// Rows [lo, hi) of the concatenation of all jobs' rows.
void run_span(const std::vector<Job> &jobs, RowsFn fn, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (const Job &j : jobs) {
        const int64_t n = j.batches * j.rows;
        const int64_t a = std::max(lo, base), b = std::min(hi, base + n);
        if (a < b && j.k > 0) fn(j, a - base, b - base);
        base += n;
    }
}

void run_jobs(const std::vector<Job> &jobs, int num_threads, bool simd) {
    RowsFn fn = rows_of<GENERIC>;
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd && have_avx512())
        fn = rows_of<AVX512>;
    else if (simd && __builtin_cpu_supports("avx2"))
        fn = rows_of<AVX2>;
#endif
    int64_t total = 0, elems = 0;
    for (const Job &j : jobs) {
        total += j.batches * j.rows;
        elems += j.batches * j.rows * j.k;
    }
    if (total == 0) return;
    // at least ~128 Ki elements per thread
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(num_threads, elems >> 17));
    if (n == 1) {
        run_span(jobs, fn, 0, total);
        return;
    }
    // Rows are handed out in chunks from a shared counter, so a thread that starts late (a
    // busy machine) simply takes fewer chunks instead of holding everyone up.
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(total / (8 * n), (int64_t{1} << 16) / std::max<int64_t>(1, elems / total)));
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        for (;;) {
            const int64_t a = next.fetch_add(chunk, std::memory_order_relaxed);
            if (a >= total) return;
            run_span(jobs, fn, a, std::min(total, a + chunk));
        }
    };
    std::vector<std::thread> pool;
    for (int64_t i = 1; i < n; ++i) pool.emplace_back(worker);
    worker();
    for (auto &th : pool) th.join();
}

void check(const Job &j) {
    if (j.kind != 0 && j.kind != 1) throw std::invalid_argument("kind must be 0 (fp8 e4m3) or 1 (mxfp4)");
    if (j.out_dtype != OUT_F32 && j.out_dtype != OUT_BF16)
        throw std::invalid_argument("out_dtype must be 0 (float32) or 1 (bfloat16)");
    if (j.batches < 0 || j.rows < 0 || j.k < 0) throw std::invalid_argument("negative size");
    if (j.row_block <= 0 || j.col_block <= 0) throw std::invalid_argument("row_block and col_block must be > 0");
    if (j.kind == 1 && (j.k % 32 || j.col_block != 32 || j.row_block != 1))
        throw std::invalid_argument("mxfp4: k must be a multiple of 32, col_block 32 and row_block 1");
    if (j.batches * j.rows > 0 && j.k > 0 && (j.out == 0 || j.q == 0 || j.scale == 0))
        throw std::invalid_argument("null pointer");
}

}  // namespace

void register_dequant(py::module_ &m) {
    m.def(
        "dequant_blocks",
        [](const std::vector<std::tuple<int, int, uintptr_t, int64_t, int64_t, uintptr_t, int64_t, int64_t, uintptr_t,
                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uintptr_t>> &specs,
           int num_threads, bool simd) {
            std::vector<Job> jobs;
            for (const auto &t : specs) {
                Job j{std::get<0>(t),  std::get<1>(t),  std::get<2>(t),  std::get<5>(t),  std::get<8>(t),
                      std::get<11>(t), std::get<12>(t), std::get<13>(t), std::get<3>(t),  std::get<4>(t),
                      std::get<6>(t),  std::get<7>(t),  std::get<9>(t),  std::get<10>(t), std::get<14>(t),
                      std::get<15>(t), std::get<16>(t)};
                check(j);
                jobs.push_back(j);
            }
            py::gil_scoped_release release;
            run_jobs(jobs, num_threads, simd);
        },
        py::arg("jobs"), py::arg("num_threads"), py::arg("simd") = true,
        "Run dequantization jobs in one threaded pass. Each job is a tuple (kind 0=fp8 e4m3 / 1=mxfp4, "
        "out_dtype 0=f32 / 1=bf16, out, out_batch_stride, out_row_stride, q, q_batch_stride, q_row_stride, "
        "scale, scale_batch_stride, scale_row_stride, batches, rows, k, row_block, col_block, row_index): "
        "out[b,r,c] = cast(value(q[b,src,c]) * scale[b, src/row_block, c/col_block]) with src = row_index[r] "
        "(int64 array address) or r when row_index is 0; strides in elements of each array. simd=False forces "
        "the generic loops (same bits; for tests).");
}
