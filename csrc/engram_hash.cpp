// epkit.engram_hash on CPU (backend "cpu"):
//
//   out[l, t, (k-1)*K + j] = (XOR_{k' <= k} ids[t, k'] * mult[l, k']) mod d[l, k-1, j] + off[l, (k-1)*K + j]
//
// with int64 wrapping products and floor-mod, by the division-free scheme of
// epkit._details.engram_cpu.float_mod_table (its table [L, 6, H] float64 comes in as an address: rows c21, c42,
// 1/d, d, offset, 1.5 * 2**52). Every value but 1/d and y * (1/d) is an exact integer in float64 (y < 2**53), and
// the quotient's one or two roundings leave it the floor or one above, which the fix-up corrects: the result is
// the reference's bits with or without fused multiply-adds. A block of 16 tokens has its mixes made and split
// first (a loop over tokens), then 4 heads at a time go through vector operations for every token of the block,
// the step's constants held in registers (GCC vector extensions of 256 bits, native on AVX2: wider ones are
// lowered lane by lane there, with scalar compares and spills; an x86-64-v4 / x86-64-v3 (AVX2 + FMA) / generic
// clone is picked at load time). Chunks of tokens go to the threads of parallel.h with the GIL
// released.

#include <pybind11/pybind11.h>

// The vector helpers below are always inlined into their ISA clone: no vector crosses a call boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
// The one file where contraction is wanted: every value is an exact integer in float64 but the reciprocal product,
// whose single rounding under an FMA still leaves q the floor or one above (the other sources: -ffp-contract=off).
#pragma GCC optimize("fp-contract=fast")

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

struct Hash {
    int32_t *out;
    const int32_t *ids;
    const int64_t *mult;
    const double *table;
    int64_t tokens, orders, heads_per_order, layers;  // orders = N - 1
    int chunk_bits;                                   // the table's split: x = a2 * 2**(2c) + a1 * 2**c + a0
};

constexpr int kLanes = 4;  // heads per vector step; a head count that is not a multiple is padded
typedef double v4d __attribute__((vector_size(kLanes * sizeof(double))));
typedef int64_t v4l __attribute__((vector_size(kLanes * sizeof(int64_t))));
typedef int32_t v4i __attribute__((vector_size(kLanes * sizeof(int32_t))));
#define EPK_VEC_INLINE inline __attribute__((always_inline))

// One layer's constants per head, padded to whole vectors (padding heads: d = 1, so every value stays finite),
// interleaved by vector step: step i's c21, c42, 1/d, d, offset are the 5 * kLanes doubles from i * 5 * kLanes
// (one stream of loads per step). Read with unaligned vector loads (nothing relies on the allocator's alignment).
struct Layer {
    std::vector<double> consts;
    double magic;
};

// Unaligned vector types for loads and stores: a store of int32 lanes cannot alias the double constants, so the
// compiler keeps them in registers (a memcpy into the output could alias anything and made it reload them).
typedef double v4d_u __attribute__((vector_size(kLanes * sizeof(double)), aligned(alignof(double))));
typedef int32_t v4i_u __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(alignof(int32_t))));

EPK_VEC_INLINE v4d load4(const double *p) { return *reinterpret_cast<const v4d_u *>(p); }

Layer layer_tables(const Hash &p, int64_t l) {
    const int64_t kh = p.heads_per_order, h_all = p.orders * kh, steps = (kh + kLanes - 1) / kLanes;
    const double *tab = p.table + l * 6 * h_all;
    Layer t;
    t.magic = tab[5 * h_all];
    t.consts.assign(static_cast<size_t>(p.orders * steps * 5 * kLanes), 0.0);
    for (int64_t k = 0; k < p.orders; ++k) {
        for (int64_t s = 0; s < steps; ++s) {
            double *at = t.consts.data() + (k * steps + s) * 5 * kLanes;
            for (int r = 0; r < 5; ++r) {
                for (int64_t j = 0; j < kLanes; ++j) {
                    const int64_t head = s * kLanes + j;
                    const double pad = (r == 2 || r == 3) ? 1.0 : 0.0;
                    at[r * kLanes + j] = head < kh ? tab[r * h_all + k * kh + head] : pad;
                }
            }
        }
    }
    return t;
}

constexpr int64_t kBlock = 16;  // tokens whose mixes are split in one (vectorised) pass

// Rows of one token's heads [s * kLanes, s * kLanes + kLanes) of one order, from its mix's chunks a2, a1, a0 and
// that step's constants (c21 = 2**c mod d, c42 = 2**(2c) mod d, 1/d, d, offset).
EPK_VEC_INLINE v4i head_rows(double a0, double a1, double a2, v4d c21, v4d c42, v4d inv, v4d d, v4d off, v4d magic) {
    const v4d zero = v4d{};
    const v4d y = (a0 + c21 * a1) + c42 * a2;  // exact: == mix (mod d)
    const v4d q = (magic + y * inv) - magic;   // round(y / d): floor or one above
    const v4d r = y - q * d;                   // exact, in (-d, d)
    const v4l neg = r < zero;                  // all ones where r < 0
    const v4d fix = (v4d)((v4l)d & neg);       // d where r < 0, else +0
    return __builtin_convertvector((r + off) + fix, v4i);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void hash_range(const Hash &p, const Layer &t, int64_t l, int64_t t0, int64_t t1) {
    const int64_t n = p.orders + 1, kh = p.heads_per_order, h_all = p.orders * kh;
    const int64_t steps = (kh + kLanes - 1) / kLanes, whole = kh / kLanes;  // whole: steps without padding
    const int cb = p.chunk_bits;
    const uint64_t mask = (uint64_t{1} << cb) - 1;
    const uint64_t *mult = reinterpret_cast<const uint64_t *>(p.mult + l * n);
    const double *__restrict consts = t.consts.data();
    const v4d magic = t.magic - v4d{};
    std::vector<double> parts_store(static_cast<size_t>(3 * p.orders * kBlock));  // a2, a1, a0 of [order][token]
    double *__restrict parts = parts_store.data();
    uint64_t mix[kBlock];
    for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
        const int64_t nb = std::min(kBlock, t1 - b0);
        const int32_t *x = p.ids + b0 * n;
        for (int64_t b = 0; b < nb; ++b) mix[b] = static_cast<uint64_t>(static_cast<int64_t>(x[b * n])) * mult[0];
        for (int64_t k = 0; k < p.orders; ++k) {  // mixes of the block, split into chunks as float64
            double *at = parts + k * 3 * kBlock;
            const uint64_t mk = mult[k + 1];
            for (int64_t b = 0; b < nb; ++b) {
                mix[b] ^= static_cast<uint64_t>(static_cast<int64_t>(x[b * n + k + 1])) * mk;
                at[b] = static_cast<double>(static_cast<int64_t>(mix[b]) >> (2 * cb));
                at[kBlock + b] = static_cast<double>(static_cast<int64_t>((mix[b] >> cb) & mask));
                at[2 * kBlock + b] = static_cast<double>(static_cast<int64_t>(mix[b] & mask));
            }
        }
        // One head step of one order at a time over the block's tokens: its five constant vectors stay in registers.
        int32_t *__restrict o = p.out + (l * p.tokens + b0) * h_all;
        for (int64_t k = 0; k < p.orders; ++k) {
            const double *at = parts + k * 3 * kBlock;
            for (int64_t s = 0; s < steps; ++s) {
                const double *c = consts + (k * steps + s) * 5 * kLanes;
                const v4d c21 = load4(c), c42 = load4(c + kLanes), inv = load4(c + 2 * kLanes);
                const v4d d = load4(c + 3 * kLanes), off = load4(c + 4 * kLanes);
                int32_t *dst = o + k * kh + s * kLanes;
                if (s < whole) {
                    for (int64_t b = 0; b < nb; ++b) {
                        *reinterpret_cast<v4i_u *>(dst + b * h_all) =
                            head_rows(at[2 * kBlock + b], at[kBlock + b], at[b], c21, c42, inv, d, off, magic);
                    }
                } else {  // the last, padded step: its real heads only
                    for (int64_t b = 0; b < nb; ++b) {
                        const v4i rows =
                            head_rows(at[2 * kBlock + b], at[kBlock + b], at[b], c21, c42, inv, d, off, magic);
                        for (int64_t j = 0; j < kh - whole * kLanes; ++j) dst[b * h_all + j] = rows[j];
                    }
                }
            }
        }
    }
}

}  // namespace

void register_engram_hash(py::module_ &m) {
    m.def(
        "engram_hash",
        [](uintptr_t out, uintptr_t ids, uintptr_t mult, uintptr_t table, int64_t tokens, int64_t n, int64_t heads,
           int64_t layers, int chunk_bits, int num_threads) {
            if (tokens < 0 || n < 2 || heads < 0 || layers < 0) throw std::invalid_argument("bad size");
            if (heads % (n - 1) != 0) throw std::invalid_argument("heads must be a multiple of N - 1");
            // the exactness bounds (|a1 * c21| <= 2**51, y < 2**53) are float_mod_table's, for its 21-bit split only
            if (chunk_bits != 21) throw std::invalid_argument("chunk_bits must be 21 (float_mod_table's split)");
            if (tokens == 0 || heads == 0 || layers == 0) return;
            if (out == 0 || ids == 0 || mult == 0 || table == 0) throw std::invalid_argument("null pointer");
            const Hash p{reinterpret_cast<int32_t *>(out), reinterpret_cast<const int32_t *>(ids),
                         reinterpret_cast<const int64_t *>(mult), reinterpret_cast<const double *>(table),
                         tokens, n - 1, heads / (n - 1), layers, chunk_bits};
            py::gil_scoped_release release;
            std::vector<Layer> tables;
            for (int64_t l = 0; l < layers; ++l) tables.push_back(layer_tables(p, l));
            // every layer of a chunk in one go: fewer chunks to hand out
            epk::parallel_chunks(tokens, num_threads, 1024, [&](int64_t a, int64_t b) {
                for (int64_t l = 0; l < layers; ++l) hash_range(p, tables[l], l, a, b);
            });
        },
        py::arg("out"), py::arg("ids"), py::arg("mult"), py::arg("table"), py::arg("tokens"), py::arg("n"),
        py::arg("heads"), py::arg("layers"), py::arg("chunk_bits"), py::arg("num_threads"),
        "out [L, T, H] int32 = Engram hash rows of ids [T, N] int32 with mult [L, N] int64 and float_mod_table's "
        "table [L, 6, H] float64 (all contiguous, by address) for its chunk_bits.");
}
