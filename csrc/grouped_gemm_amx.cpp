// Fused grouped GEMM for the CPU backend of epkit.grouped_gemm on CPUs with AMX (Intel AMX-BF16):
//
//   d[rows of task t, n] = cast( sum_k A_bf16[row, k] * W_bf16[g_t][n, k] )    (float32 accumulation)
//
// where A_bf16 / W_bf16 are the block-scaled operands dequantized to bfloat16 exactly as
// `epkit.quant`'s dequantizers followed by `.to(torch.bfloat16)`, i.e. the same operands the
// unfused cpu path multiplies (AMX, like every bf16 matmul on these CPUs, treats bf16
// denormals as zero). Nothing is materialised
// in memory at full size: a thread takes a chunk of one expert's rows (at most 512), dequantizes
// them into its own bf16 block, then takes panels of 128 weight rows (output columns),
// dequantizes each into AMX's VNNI tile layout in a cache-resident buffer, and multiplies every
// 32-row block of the activations against it with tile instructions (2 x 2 tiles of 16 x 16
// float32 accumulators, 32 k per step). See run() for how work is split over threads.
//
// Operand kinds: activations e4m3 + float32 1x128 scales (0) or bfloat16 (2); weights e4m3 +
// float32 128x128 block scales (0), MXFP4 e2m1 pairs + e8m0 1x32 scales (1), or bfloat16 (2).
// The output is float32 (0) or bfloat16 (1, round to nearest even). K must be a multiple of 32.
//
// amx_available() says whether this CPU and kernel allow AMX (CPUID + XCR0 + the Linux
// arch_prctl permission request for tile data); Python falls back to the unfused path when not.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "lowp.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define EPK_HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define EPK_HAVE_AMX 0
#endif

namespace py = pybind11;

namespace {

using namespace epk;

enum Kind : int { KIND_FP8 = 0, KIND_FP4 = 1, KIND_BF16 = 2 };

constexpr int64_t kPanel = 128;  // weight rows (output columns) per panel
constexpr int64_t kMBlock = 32;  // activation rows per register block (2 tiles of 16)

// Row stride (elements) of bf16 scratch rows: k plus one cache line, so that the 16 rows a tile
// load touches do not all fall into the same few L1 sets when k * 2 is a power of two.
inline int64_t padded_ld(int64_t k) { return k + 32; }

struct Task {
    int64_t group;
    uintptr_t a, sfa, d;  // base rows of this task's activations, their scales, its output
    int64_t rows;
    const int64_t *index;  // optional: row r of the task is row index[r] from the bases, else row r
    int64_t row(int64_t r) const { return index != nullptr ? index[r] : r; }
};

struct Problem {
    int a_kind, b_kind, out_dtype;
    int64_t a_rs, sfa_rs;            // activation row stride (bytes), scale row stride (floats)
    uintptr_t b, sfb;                // weights of group 0 and their scales
    int64_t b_gs, b_rs;              // weight group / row strides (bytes)
    int64_t sfb_gs, sfb_rs;          // scale group / row strides (elements)
    int64_t n, k;
    int64_t d_rs;                    // output row stride (elements)
    std::vector<Task> tasks;
};

#if EPK_HAVE_AMX

#define EPK_AMX \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512fp16,avx512bf16,avx2")))

bool amx_supported() {
    static const bool ok = []() {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
        if (!tile || !bf16 || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512dq") ||
            !__builtin_cpu_supports("avx512fp16") || !__builtin_cpu_supports("avx512bf16"))
            return false;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG + XTILEDATA enabled by the OS
        // Linux hands out the (large) tile data state only on request, once per process.
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-3: float32 accumulators (16 x 16); 4-5: activation rows (16 x 32 bf16);
// 6-7: weight columns in VNNI layout (16 k-pairs x 16 columns x 2 bf16).
EPK_AMX void configure_tiles() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    // GCC's ldtilecfg wrapper does not tell the compiler that it reads memory: keep the stores.
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

EPK_AMX void release_tiles() { _tile_release(); }

// 16 x 16 transpose of 32-bit elements: r[i][j] -> r[j][i].
EPK_AMX EPK_INLINE void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // per 128-bit lane L: u[4b + q] holds column 4L + q of rows 4b .. 4b + 3
    for (int b = 0; b < 4; ++b) {
        u[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
        u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
    }
    for (int q = 0; q < 4; ++q) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xEE);
        r[q] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + q] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

// 32 e4m3 codes times one float32 scale -> 32 bf16, equal to fp8_segment_avx512<OUT_BF16> (float32
// product, then round to nearest even) in about half the instructions: the codes become exact
// float16 values (their bits shifted into place: x * 2**-8, subnormals included), float16 -> float32
// and the * 256 are exact, and the hardware bf16 conversion rounds to nearest even. It flushes
// float32 denormals to zero, which AMX's bf16 multiply would do to those operands anyway. A vector
// holding a NaN code (0x7F / 0xFF, which the shift would turn into 480) takes the exact integer path.
EPK_AMX EPK_INLINE void fp8x32_bf16(uint16_t *out, const uint8_t *q, __m512 vs) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
    const __mmask32 nan_code = _mm256_cmpeq_epi8_mask(_mm256_and_si256(bytes, _mm256_set1_epi8(0x7F)),
                                                      _mm256_set1_epi8(0x7F));
    if (nan_code) {
        const __m256i a = _mm512_cvtepi32_epi16(bf16x16(_mm512_mul_ps(e4m3x16(_mm256_castsi256_si128(bytes)), vs)));
        const __m256i b =
            _mm512_cvtepi32_epi16(bf16x16(_mm512_mul_ps(e4m3x16(_mm256_extracti128_si256(bytes, 1)), vs)));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), a);
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 16), b);
        return;
    }
    const __m512i x = _mm512_cvtepu8_epi16(bytes);
    const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x7F)), 7),
                                      _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
    const __m512 k256 = _mm512_set1_ps(256.0f);
    const __m512 lo = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), k256), vs);
    const __m512 hi = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), k256), vs);
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// A row of k e4m3 codes with one float32 scale per 128 -> k bf16 values (k % 128 == 0).
EPK_AMX void fp8_row_bf16(uint16_t *out, const uint8_t *q, const float *s, int64_t k) {
    for (int64_t c = 0; c < k; c += 128) {
        const __m512 vs = _mm512_set1_ps(s[c / 128]);
        for (int64_t i = c; i < c + 128; i += 32) fp8x32_bf16(out + i, q + i, vs);
    }
}

// One activation row -> k bf16 values.
EPK_AMX void a_row(const Problem &p, const Task &t, int64_t r, uint16_t *out) {
    const int64_t row = t.row(r);
    const uint8_t *src = reinterpret_cast<const uint8_t *>(t.a) + row * p.a_rs;
    if (p.a_kind == KIND_BF16) {
        std::memcpy(out, src, p.k * 2);
    } else {
        fp8_row_bf16(out, src, reinterpret_cast<const float *>(t.sfa) + row * p.sfa_rs, p.k);
    }
}

// Weight row n of group g -> k bf16 values (zeros past the last row).
EPK_AMX void b_row(const Problem &p, int64_t g, int64_t n, uint16_t *out) {
    if (n >= p.n) {
        std::memset(out, 0, p.k * 2);
        return;
    }
    const uint8_t *src = reinterpret_cast<const uint8_t *>(p.b) + g * p.b_gs + n * p.b_rs;
    char *o = reinterpret_cast<char *>(out);
    if (p.b_kind == KIND_BF16) {
        std::memcpy(out, src, p.k * 2);
    } else if (p.b_kind == KIND_FP8) {
        fp8_row_bf16(out, src, reinterpret_cast<const float *>(p.sfb) + g * p.sfb_gs + (n / 128) * p.sfb_rs, p.k);
    } else {
        const uint8_t *s = reinterpret_cast<const uint8_t *>(p.sfb) + g * p.sfb_gs + n * p.sfb_rs;
        fp4_row_avx512<OUT_BF16>(o, src, s, p.k);
    }
}

// Weight rows [n0, n0 + kPanel) of group g in tile order: for each pair of 16-column tiles
// (32 output columns) and each 32-k step, two 1 KiB tiles whose row i holds k-pair i of the
// 16 columns (VNNI). `rows` is a 16 x k bf16 scratch.
EPK_AMX void pack_panel(const Problem &p, int64_t g, int64_t n0, uint16_t *rows, uint8_t *packed) {
    const int64_t ksteps = p.k / 32;
    const int64_t ld = padded_ld(p.k);
    for (int64_t j = 0; j < kPanel / 16; ++j) {  // 16-column tile j of the panel
        for (int64_t c = 0; c < 16; ++c) b_row(p, g, n0 + 16 * j + c, rows + c * ld);
        for (int64_t ks = 0; ks < ksteps; ++ks) {
            __m512i r[16];
            for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(rows + c * ld + ks * 32);
            transpose16(r);
            uint8_t *tile = packed + (((j / 2) * ksteps + ks) * 2 + (j % 2)) * 1024;
            for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 64 * i, r[i]);
        }
    }
}

// Write the valid part of a 32 x 32 float32 block (task rows m0.., output columns col..) to d.
EPK_AMX void store_block(const Problem &p, const Task &t, const float *c, int64_t m0, int64_t col, int64_t nrows,
                         int64_t ncols) {
    const int esz = p.out_dtype == OUT_BF16 ? 2 : 4;
    const __mmask16 mk0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
    const __mmask16 mk1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
    for (int64_t r = 0; r < nrows; ++r) {
        char *o = reinterpret_cast<char *>(t.d) + (t.row(m0 + r) * p.d_rs + col) * esz;
        const __m512 lo = _mm512_load_ps(c + r * 32), hi = _mm512_load_ps(c + r * 32 + 16);
        if (p.out_dtype == OUT_BF16) {
            _mm256_mask_storeu_epi16(o, mk0, _mm512_cvtepi32_epi16(bf16x16(lo)));
            _mm256_mask_storeu_epi16(o + 32, mk1, _mm512_cvtepi32_epi16(bf16x16(hi)));
        } else {
            _mm512_mask_storeu_ps(o, mk0, lo);
            _mm512_mask_storeu_ps(o + 64, mk1, hi);
        }
    }
}

// a: the task's activations, rows padded to a multiple of 32 (bf16, row stride padded_ld(k)).
// Blocking: for each 32-row block of activations, k is walked in chunks of kKChunk steps (512 k);
// the block's chunk (32 KiB) stays in L1 while the panel's four 32-column sub-panels stream past
// it from L2 (contiguous 2 KiB per k step, which the hardware prefetcher follows). Partial sums
// wait in `acc` (32 rows x 128 columns float32, 16 KiB) between chunks.
constexpr int64_t kKChunk = 16;

EPK_AMX void panel_gemm(const Problem &p, const Task &t, const uint16_t *a, const uint8_t *packed, int64_t n0,
                        float *cbuf, float *acc) {
    const int64_t ksteps = p.k / 32, lda = padded_ld(p.k) * 2;
    const int64_t subpanels = std::min<int64_t>(kPanel / 32, (p.n - n0 + 31) / 32);
    for (int64_t m0 = 0; m0 < t.rows; m0 += kMBlock) {
        const uint8_t *a0 = reinterpret_cast<const uint8_t *>(a) + m0 * lda;
        const uint8_t *a1 = a0 + 16 * lda;
        for (int64_t kc = 0; kc < ksteps; kc += kKChunk) {
            const int64_t kend = std::min(ksteps, kc + kKChunk);
            const bool first = kc == 0, last = kend == ksteps;
            for (int64_t sp = 0; sp < subpanels; ++sp) {
                const uint8_t *bp = packed + sp * ksteps * 2048;
                float *c = acc + sp * 32 * 32;
                if (first) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, c, 128);
                    _tile_loadd(1, c + 16, 128);
                    _tile_loadd(2, c + 16 * 32, 128);
                    _tile_loadd(3, c + 16 * 32 + 16, 128);
                }
                for (int64_t ks = kc; ks < kend; ++ks) {
                    _tile_loadd(4, a0 + ks * 64, lda);
                    _tile_loadd(5, a1 + ks * 64, lda);
                    _tile_loadd(6, bp + ks * 2048, 64);
                    _tile_loadd(7, bp + ks * 2048 + 1024, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                float *dst = last ? cbuf : c;
                _tile_stored(0, dst, 128);
                _tile_stored(1, dst + 16, 128);
                _tile_stored(2, dst + 16 * 32, 128);
                _tile_stored(3, dst + 16 * 32 + 16, 128);
                if (last) {
                    const int64_t col = n0 + 32 * sp;
                    store_block(p, t, cbuf, m0, col, std::min<int64_t>(kMBlock, t.rows - m0),
                                std::min<int64_t>(32, p.n - col));
                }
            }
        }
    }
}

struct AlignedFree {
    void operator()(void *ptr) const { std::free(ptr); }
};
using Buffer = std::unique_ptr<uint8_t, AlignedFree>;

Buffer aligned_buffer(size_t bytes) {
    void *ptr = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
    if (ptr == nullptr) throw std::bad_alloc();
    return Buffer(static_cast<uint8_t *>(ptr));
}

// One thread's scratch: activation block, partial sums, packed panel, weight rows. Kept between
// calls in a small pool: fresh allocations of this size are fresh pages, and zeroing them on first
// touch (page faults) would cost a sizeable part of a call after anything that returned memory to
// the OS. Only memory is reused; every byte is written before it is read.
struct Scratch {
    size_t bytes = 0;
    Buffer mem;
};

class ScratchPool {
   public:
    Scratch take(size_t bytes) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (size_t i = 0; i < free_.size(); ++i) {
                if (free_[i].bytes >= bytes) {
                    Scratch s = std::move(free_[i]);
                    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
                    cached_ -= s.bytes;
                    return s;
                }
            }
        }
        Scratch s;
        s.bytes = bytes;
        s.mem = aligned_buffer(bytes);
        return s;
    }
    void give(Scratch s) {
        std::lock_guard<std::mutex> lock(mu_);
        if (cached_ + s.bytes > kMaxCached) return;  // freed here
        cached_ += s.bytes;
        free_.push_back(std::move(s));
    }

   private:
    static constexpr size_t kMaxCached = size_t{64} << 20;
    std::mutex mu_;
    std::vector<Scratch> free_;
    size_t cached_ = 0;
};

ScratchPool &scratch_pool() {
    static ScratchPool *pool = new ScratchPool();  // never destroyed: threads may outlive static teardown
    return *pool;
}

// Work items: a task is cut into chunks of at most kMChunk rows, and a chunk into `split` column
// ranges when there are fewer chunks than threads. Each item is independent (no barrier): its thread
// dequantizes the chunk's rows into its own bf16 block (duplicated `split` times, small next to the
// weights each item packs), then packs and multiplies its weight panels. Items are taken from one
// atomic counter, so a thread that is slowed down (a busy machine) just takes fewer items.
constexpr int64_t kMChunk = 512;

struct Item {
    Task task;  // the chunk: rows [0, task.rows) from its own bases / index offset
    int64_t panel_lo, panel_hi;
};

void run(const Problem &p, int num_threads) {
    if (p.n == 0) return;
    const int64_t panels = (p.n + kPanel - 1) / kPanel;
    std::vector<Task> chunks;
    for (const Task &t : p.tasks) {
        for (int64_t r0 = 0; r0 < t.rows; r0 += kMChunk) {
            Task c = t;
            c.rows = std::min(kMChunk, t.rows - r0);
            if (t.index != nullptr) {
                c.index = t.index + r0;
            } else {
                c.a += r0 * p.a_rs;
                c.sfa += r0 * p.sfa_rs * static_cast<int64_t>(sizeof(float));
                c.d += r0 * p.d_rs * (p.out_dtype == OUT_BF16 ? 2 : 4);
            }
            chunks.push_back(c);
        }
    }
    if (chunks.empty()) return;
    const int64_t nc = static_cast<int64_t>(chunks.size());
    const int64_t split = std::min<int64_t>(panels, std::max<int64_t>(1, (num_threads + nc - 1) / nc));
    std::vector<Item> items;
    for (const Task &c : chunks) {
        for (int64_t s = 0; s < split; ++s) items.push_back({c, panels * s / split, panels * (s + 1) / split});
    }
    const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, items.size())));
    const int64_t ld = padded_ld(p.k);
    int64_t rows_pad = 0;
    for (const Task &c : chunks) rows_pad = std::max(rows_pad, (c.rows + kMBlock - 1) / kMBlock * kMBlock);
    // Per-thread scratch, taken here so that no allocation can fail inside a worker.
    const size_t a_bytes = rows_pad * ld * 2, acc_bytes = 32 * kPanel * sizeof(float);
    const size_t packed_bytes = kPanel * p.k * 2, row_bytes = 16 * ld * 2;
    std::vector<Scratch> scratch;
    for (int i = 0; i < nt; ++i) scratch.push_back(scratch_pool().take(a_bytes + acc_bytes + packed_bytes + row_bytes));
    std::atomic<size_t> next{0};

    auto worker = [&](int tid) {
        configure_tiles();
        uint8_t *base = scratch[tid].mem.get();  // 64-byte aligned; every part size is a multiple of 64
        uint16_t *a = reinterpret_cast<uint16_t *>(base);
        float *acc = reinterpret_cast<float *>(base + a_bytes);
        uint8_t *packed = base + a_bytes + acc_bytes;
        uint16_t *rows = reinterpret_cast<uint16_t *>(base + a_bytes + acc_bytes + packed_bytes);
        alignas(64) float cbuf[32 * 32];
        for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
            const Item &it = items[i];
            const Task &t = it.task;
            const int64_t pad = (t.rows + kMBlock - 1) / kMBlock * kMBlock;
            for (int64_t r = 0; r < t.rows; ++r) a_row(p, t, r, a + r * ld);
            for (int64_t r = t.rows; r < pad; ++r) std::memset(a + r * ld, 0, p.k * 2);
            for (int64_t pi = it.panel_lo; pi < it.panel_hi; ++pi) {
                pack_panel(p, t.group, pi * kPanel, rows, packed);
                panel_gemm(p, t, a, packed, pi * kPanel, cbuf, acc);
            }
        }
        release_tiles();
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < nt; ++i) {
        try {
            pool.emplace_back(worker, i);
        } catch (const std::system_error &) {
            break;  // no more threads to be had: the ones running (and this one) take every item
        }
    }
    worker(0);
    for (auto &th : pool) th.join();
    for (Scratch &s : scratch) scratch_pool().give(std::move(s));
}

#else

bool amx_supported() { return false; }
void run(const Problem &, int) { throw std::runtime_error("grouped_gemm_amx: built without AMX support"); }

#endif

}  // namespace

void register_grouped_gemm_amx(py::module_ &m) {
    m.def("amx_available", &amx_supported,
          "True when this CPU and OS allow AMX-BF16 tiles (the fused grouped GEMM can run).");
    m.def(
        "grouped_gemm_amx",
        [](int a_kind, int b_kind, int out_dtype, int64_t a_rs, int64_t sfa_rs, uintptr_t b, uintptr_t sfb,
           int64_t b_gs, int64_t b_rs, int64_t sfb_gs, int64_t sfb_rs, int64_t n, int64_t k, int64_t d_rs,
           const std::vector<std::tuple<int64_t, uintptr_t, uintptr_t, uintptr_t, int64_t, uintptr_t>> &tasks,
           int num_threads) {
            if (!amx_supported()) throw std::runtime_error("grouped_gemm_amx: AMX-BF16 is not available here");
            if (a_kind != KIND_FP8 && a_kind != KIND_BF16) throw std::invalid_argument("a_kind must be 0 or 2");
            if (b_kind < KIND_FP8 || b_kind > KIND_BF16) throw std::invalid_argument("b_kind must be 0, 1 or 2");
            if (out_dtype != OUT_F32 && out_dtype != OUT_BF16) throw std::invalid_argument("out_dtype must be 0 or 1");
            if (n < 0 || k <= 0 || k % 32) throw std::invalid_argument("k must be a positive multiple of 32");
            if ((a_kind == KIND_FP8 || b_kind == KIND_FP8) && k % 128)
                throw std::invalid_argument("fp8 operands need k to be a multiple of 128");
            Problem p{a_kind, b_kind, out_dtype, a_rs, sfa_rs, b, sfb, b_gs, b_rs, sfb_gs, sfb_rs, n, k, d_rs, {}};
            for (const auto &t : tasks) {
                Task task{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
                          reinterpret_cast<const int64_t *>(std::get<5>(t))};
                if (task.rows < 0) throw std::invalid_argument("negative row count");
                if (task.rows > 0) p.tasks.push_back(task);
            }
            py::gil_scoped_release release;
            run(p, num_threads);
        },
        py::arg("a_kind"), py::arg("b_kind"), py::arg("out_dtype"), py::arg("a_row_stride"),
        py::arg("sfa_row_stride"), py::arg("b"), py::arg("sfb"), py::arg("b_group_stride"), py::arg("b_row_stride"),
        py::arg("sfb_group_stride"), py::arg("sfb_row_stride"), py::arg("n"), py::arg("k"), py::arg("d_row_stride"),
        py::arg("tasks"), py::arg("num_threads"),
        "d[task rows] = A_bf16 @ W_bf16[group].T for each task (group, a address, sfa address, d address, rows, "
        "index address or 0): row r of a task is row index[r] (int64) from those bases, or row r without an index; "
        "kinds 0 = e4m3 + float32 block scales, 1 = MXFP4 (weights), 2 = bf16; out_dtype 0 = f32, 1 = bf16; "
        "a/b row strides in bytes, scale and d strides in elements. Operands are dequantized to bf16 exactly as "
        "epkit.quant does; products accumulate in float32 on AMX tiles.");
}
