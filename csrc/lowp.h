// Low-precision number formats shared by the CPU kernels of epkit._C (grouped_gemm_dequant.cpp,
// grouped_gemm_amx.cpp, ep_rows.cpp): exact e4m3 / e2m1 / e8m0 -> float32 decoding,
// float32 -> bfloat16 rounding (nearest even, NaN -> 0x7FC0, torch's conversion), and the
// AVX-512 row dequantizers. Every function is inline; files that include this header keep
// their own anonymous namespaces.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace epk {

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

EPK_INLINE float bf16_to_f32(uint16_t b) { return bits_to_f32(static_cast<uint32_t>(b) << 16); }

}  // namespace epk
