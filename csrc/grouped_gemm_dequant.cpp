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
// raw addresses with element strides. The row loops exist twice: generic C++, and AVX-512
// (16 elements per step), picked at run time.

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
