// Fused block-scaled dequantization for the CPU grouped GEMMs (epkit.gemm, cpu backend):
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
// raw addresses with element strides. The row loops exist twice: generic C++, and AVX-512
// (16 elements per step), picked at run time.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

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

enum OutDType : int { OUT_F32 = 0, OUT_BF16 = 1 };

#define EPK_INLINE inline __attribute__((always_inline))

EPK_INLINE float bits_to_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

EPK_INLINE uint32_t f32_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Round to nearest even; NaN -> 0x7FC0 (torch's scalar conversion).
EPK_INLINE uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_to_bits(f);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(nan ? 0x7FC0u : r);
}

// Exact e4m3 (fn: no inf, 0x7F / 0xFF are NaN) -> float32.
EPK_INLINE float e4m3_to_f32(uint8_t b) {
    const uint32_t mag = b & 0x7Fu;
    const uint32_t exp = mag >> 3, man = mag & 7u;
    // normal: 2**(exp - 7) * (1 + man / 8) -> float32 exponent field exp + 120
    const float normal = bits_to_f32(((exp + 120u) << 23) | (man << 20));
    // subnormal: man * 2**-9 (int -> float and the power-of-two multiply are exact)
    const float sub = static_cast<float>(static_cast<int32_t>(man)) * 0.001953125f;
    float v = exp == 0 ? sub : normal;
    v = mag == 0x7Fu ? bits_to_f32(0x7FC00000u) : v;
    return bits_to_f32(f32_to_bits(v) | ((static_cast<uint32_t>(b) & 0x80u) << 24));
}

EPK_INLINE float e8m0_to_f32(uint8_t e) {
    return bits_to_f32(e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23);
}

EPK_INLINE float e2m1_to_f32(uint32_t code) {
    // magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 by the 3-bit code; bit 3 is the sign
    const uint32_t m = code & 7u, e = m >> 1, f = m & 1u;
    const float normal = bits_to_f32(((e + 126u) << 23) | (f << 22));  // 2**(e-1) * (1 + f/2)
    const float v = e == 0 ? (f ? 0.5f : 0.0f) : normal;
    return bits_to_f32(f32_to_bits(v) | ((code & 8u) << 28));
}

// One row segment of `len` elements sharing scale `s` (generic code).
template <int OUT>
EPK_INLINE void fp8_segment(void *out, const uint8_t *q, float s, int64_t len) {
    if (OUT == OUT_BF16) {
        uint16_t *o = static_cast<uint16_t *>(out);
        for (int64_t i = 0; i < len; ++i) o[i] = f32_to_bf16(e4m3_to_f32(q[i]) * s);
    } else {
        float *o = static_cast<float *>(out);
        for (int64_t i = 0; i < len; ++i) o[i] = e4m3_to_f32(q[i]) * s;
    }
}

template <int OUT>
EPK_INLINE void fp4_segment(void *out, const uint8_t *p, float s, int64_t pairs) {
    if (OUT == OUT_BF16) {
        uint16_t *o = static_cast<uint16_t *>(out);
        for (int64_t i = 0; i < pairs; ++i) {
            const uint32_t b = p[i];
            o[2 * i] = f32_to_bf16(e2m1_to_f32(b & 15u) * s);
            o[2 * i + 1] = f32_to_bf16(e2m1_to_f32(b >> 4) * s);
        }
    } else {
        float *o = static_cast<float *>(out);
        for (int64_t i = 0; i < pairs; ++i) {
            const uint32_t b = p[i];
            o[2 * i] = e2m1_to_f32(b & 15u) * s;
            o[2 * i + 1] = e2m1_to_f32(b >> 4) * s;
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define EPK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))

// 16 e4m3 codes -> 16 exact float32 values.
EPK_AVX512 EPK_INLINE __m512 e4m3x16(__m128i bytes) {
    const __m512i x = _mm512_cvtepu8_epi32(bytes);
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512 normal =
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(mag, _mm512_set1_epi32(7))), _mm512_set1_ps(0.001953125f));
    __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// float32 -> bf16 bits in the low 16 bits of each 32-bit lane (RNE, NaN -> 0x7FC0).
EPK_AVX512 EPK_INLINE __m512i bf16x16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
}

template <int OUT>
EPK_AVX512 EPK_INLINE void fp8_segment_avx512(void *out, const uint8_t *q, float s, int64_t len) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512 y = _mm512_mul_ps(e4m3x16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q + i))), vs);
        if (OUT == OUT_BF16)
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(static_cast<uint16_t *>(out) + i),
                                _mm512_cvtepi32_epi16(bf16x16(y)));
        else
            _mm512_storeu_ps(static_cast<float *>(out) + i, y);
    }
    if (i < len) {
        char *o = static_cast<char *>(out) + i * (OUT == OUT_BF16 ? 2 : 4);
        fp8_segment<OUT>(o, q + i, s, len - i);
    }
}

// 16 packed bytes (32 e2m1 codes) sharing one scale -> 32 outputs.
template <int OUT>
EPK_AVX512 EPK_INLINE void fp4_block32_avx512(void *out, const uint8_t *p, float s) {
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                        -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    const __m512 vs = _mm512_set1_ps(s);
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)), table), vs);
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table), vs);
    if (OUT == OUT_BF16) {
        const __m512i w = _mm512_or_si512(bf16x16(lo), _mm512_slli_epi32(bf16x16(hi), 16));
        _mm512_storeu_si512(out, w);
    } else {
        const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        _mm512_storeu_ps(static_cast<float *>(out), _mm512_permutex2var_ps(lo, i0, hi));
        _mm512_storeu_ps(static_cast<float *>(out) + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
}

// Whole rows (called from generic code, so not inlined; the loops inside are AVX-512).
template <int OUT>
EPK_AVX512 void fp8_row_avx512(char *o, const uint8_t *q, const float *s, int64_t k, int64_t col_block) {
    const int64_t esz = OUT == OUT_BF16 ? 2 : 4;
    for (int64_t c = 0; c < k; c += col_block)
        fp8_segment_avx512<OUT>(o + c * esz, q + c, s[c / col_block], std::min(col_block, k - c));
}

template <int OUT>
EPK_AVX512 void fp4_row_avx512(char *o, const uint8_t *p, const uint8_t *s, int64_t k) {
    const int64_t esz = OUT == OUT_BF16 ? 2 : 4;
    for (int64_t c = 0; c < k; c += 32) fp4_block32_avx512<OUT>(o + c * esz, p + c / 2, e8m0_to_f32(s[c / 32]));
}
#endif

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

template <int OUT, bool SIMD>
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
            if constexpr (SIMD) {
                fp8_row_avx512<OUT>(o, q, s, j.k, j.col_block);
                continue;
            }
#endif
            for (int64_t c = 0; c < j.k; c += j.col_block)
                fp8_segment<OUT>(o + c * esz, q + c, s[c / j.col_block], std::min(j.col_block, j.k - c));
        } else {
            const uint8_t *s = reinterpret_cast<const uint8_t *>(j.scale) + b * j.s_bs + src * j.s_rs;
#if defined(__x86_64__) && defined(__GNUC__)
            if constexpr (SIMD) {
                fp4_row_avx512<OUT>(o, q, s, j.k);
                continue;
            }
#endif
            for (int64_t c = 0; c < j.k; c += 32) fp4_segment<OUT>(o + c * esz, q + c / 2, e8m0_to_f32(s[c / 32]), 16);
        }
    }
}

void rows_generic(const Job &j, int64_t lo, int64_t hi) {
    if (j.out_dtype == OUT_BF16)
        run_rows<OUT_BF16, false>(j, lo, hi);
    else
        run_rows<OUT_F32, false>(j, lo, hi);
}

#if defined(__x86_64__) && defined(__GNUC__)
void rows_avx512(const Job &j, int64_t lo, int64_t hi) {
    if (j.out_dtype == OUT_BF16)
        run_rows<OUT_BF16, true>(j, lo, hi);
    else
        run_rows<OUT_F32, true>(j, lo, hi);
}

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
    RowsFn fn = rows_generic;
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd && have_avx512()) fn = rows_avx512;
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
