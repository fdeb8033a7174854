// epkit._C_cuda: the host and device side of the `nvshmem` transport.
//
// Bootstrap: rank 0 calls get_unique_id(), the bytes travel over
// torch.distributed, every rank calls init(uid, rank, world_size). Or, where
// torch's symmetric memory already runs NVSHMEM in the process, attach() joins
// that job (job_status() tells which).
// Memory: symmetric allocations (malloc/free), peer pointers (nvshmem_ptr) for
// ranks in the same NVLink domain.
// One-sided ops, launched on a caller-given CUDA stream so they order with the
// caller's kernels: put_signal (putmem + 64-bit signal, SET or ADD), signal_op
// (a 64-bit signal alone, after a system fence), signal_wait (device-side timed
// wait on a local signal word) and signal_wait_all (one timed wait over a
// strided array of words, one per source rank).
//
// Built by setup.py with nvcc -rdc=true for sm_90 and device-linked against
// libnvshmem_device.a from the nvidia-nvshmem wheel.

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

void check_cuda(cudaError_t err, const char *what) {
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
    }
}

bool g_initialized = false;
bool g_finalized = false;  // NVSHMEM may not be initialised again in a process once finalized

void require_init(const char *what) {
    if (!g_initialized) throw std::runtime_error(std::string(what) + ": call init() first");
}

// NVSHMEM binds to the calling thread's current CUDA context. Finding none, its init only bootstraps and
// still returns 0, and the next NVSHMEM call exits the process. So make the current device's primary
// context current first (cudaSetDevice does on CUDA 12+; cudaFree(nullptr) forces it on any runtime).
void ensure_cuda_context(const char *what) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), what);
    check_cuda(cudaSetDevice(device), what);
    check_cuda(cudaFree(nullptr), what);
}

// After an init call: the job must be running, not just bootstrapped, before anything else touches it.
void require_running(const char *what) {
    int status = nvshmemx_init_status();
    if (status < NVSHMEM_STATUS_IS_INITIALIZED) {
        throw std::runtime_error(std::string(what) + ": NVSHMEM is not running after init (status " +
                                 std::to_string(status) + "); was a CUDA device usable in this thread?");
    }
}

int parse_cmp(const std::string &s) {
    if (s == "==" || s == "eq") return NVSHMEM_CMP_EQ;
    if (s == "!=" || s == "ne") return NVSHMEM_CMP_NE;
    if (s == ">=" || s == "ge") return NVSHMEM_CMP_GE;
    if (s == ">" || s == "gt") return NVSHMEM_CMP_GT;
    if (s == "<=" || s == "le") return NVSHMEM_CMP_LE;
    if (s == "<" || s == "lt") return NVSHMEM_CMP_LT;
    throw std::invalid_argument("unknown comparison '" + s + "': use one of == != >= > <= <");
}

int parse_signal_op(const std::string &s) {
    if (s == "set") return NVSHMEM_SIGNAL_SET;
    if (s == "add") return NVSHMEM_SIGNAL_ADD;
    throw std::invalid_argument("unknown signal op '" + s + "': use 'set' or 'add'");
}

// True when the optional `guard` word (a local device word: the buffer's sticky word, set by a failed
// stream-ordered wait) is set: the put or signal behind that wait must not happen.
__device__ bool guarded(const uint64_t *guard) {
    return guard != nullptr && *reinterpret_cast<const volatile uint64_t *>(guard) != 0;
}

// One block copies `nbytes` to `pe` and then updates the signal word there; the
// signal is visible only after the data (put-with-signal ordering).
__global__ void put_signal_kernel(void *dst, const void *src, size_t nbytes, uint64_t *sig, uint64_t value,
                                  int sig_op, int pe, const uint64_t *guard) {
    // One read for the whole block: the word may be set while the block runs (a failed wait on another
    // stream), and threads that read it at different times would split the block-wide put and hang it.
    __shared__ bool skip;
    if (threadIdx.x == 0) skip = guarded(guard);
    __syncthreads();
    if (skip) return;
    nvshmemx_putmem_signal_block(dst, src, nbytes, sig, value, sig_op, pe);
}

// A directly addressable peer (nvshmem_ptr non-null: NVLink, or this PE): the copy spread over many blocks
// with 16-byte vector accesses where both addresses allow, then signal_after_kernel on the same stream (stream
// order: the copy has completed when the signal kernel starts). One block alone reaches about 1% of the
// device's copy bandwidth. Each block reads the guard once: a guard already set by an earlier wait on this
// stream stops every block; one set meanwhile by another stream retires the buffer, and the signal kernel,
// reading it again, then sends nothing, so no receiver takes a partial copy for a complete one.
__global__ void put_chunks_kernel(char *dst, const char *src, size_t nbytes, const uint64_t *guard) {
    __shared__ bool skip;
    if (threadIdx.x == 0) skip = guarded(guard);
    __syncthreads();
    if (skip) return;
    const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
    const size_t head = vec ? nbytes / 16 : 0;
    const int4 *s4 = reinterpret_cast<const int4 *>(src);
    int4 *d4 = reinterpret_cast<int4 *>(dst);
    for (size_t i = tid; i < head; i += stride) d4[i] = s4[i];
    for (size_t i = head * 16 + tid; i < nbytes; i += stride) dst[i] = src[i];
}

// The signal of a put_chunks_kernel copy (one thread): a system fence, then the signal, unless guarded.
__global__ void signal_after_kernel(uint64_t *sig, uint64_t value, int sig_op, int pe, const uint64_t *guard) {
    if (guarded(guard)) return;
    __threadfence_system();
    nvshmemx_signal_op(sig, value, sig_op, pe);
}

// Blocks of a put_chunks_kernel launch: enough 256-thread blocks for 64 KiB each, at most 1056 (132 SMs x 8).
unsigned put_blocks(size_t nbytes) {
    size_t blocks = (nbytes + (64u << 10) - 1) / (64u << 10);
    return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1056 ? 1056 : blocks));
}

__device__ bool compare(uint64_t v, int cmp, uint64_t target) {
    switch (cmp) {
        case NVSHMEM_CMP_EQ: return v == target;
        case NVSHMEM_CMP_NE: return v != target;
        case NVSHMEM_CMP_GE: return v >= target;
        case NVSHMEM_CMP_GT: return v > target;
        case NVSHMEM_CMP_LE: return v <= target;
        case NVSHMEM_CMP_LT: return v < target;
    }
    return false;
}

// Polls the local signal word until the condition holds or `timeout_ns` passes
// (globaltimer), so a dead peer cannot hang the stream forever. result[0] gets
// the last value seen, result[1] = 1 on timeout (the host checks it).
__global__ void signal_wait_kernel(uint64_t *sig, int cmp, uint64_t value, uint64_t timeout_ns, uint64_t *result) {
    if (threadIdx.x != 0) return;
    uint64_t start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    uint64_t v = nvshmem_signal_fetch(sig);
    while (!compare(v, cmp, value)) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
            result[0] = v;
            result[1] = 1;
            return;
        }
        __nanosleep(100);
        v = nvshmem_signal_fetch(sig);
    }
    result[0] = v;
    result[1] = 0;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Seconds -> nanoseconds for the device waits, clamped to [0, 1e6 s] (NaN -> 0) so the cast is defined.
uint64_t timeout_to_ns(double timeout_s) {
    if (!(timeout_s > 0)) return 0;
    if (timeout_s > 1e6) timeout_s = 1e6;
    return static_cast<uint64_t>(timeout_s * 1e9);
}

void require_pe(int pe, const char *what) {
    int n = nvshmem_n_pes();
    if (pe < 0 || pe >= n) {
        throw std::invalid_argument(std::string(what) + ": pe " + std::to_string(pe) + " outside [0, " +
                                    std::to_string(n) + ")");
    }
}

// One thread sets/adds `value` to the 64-bit word `sig` (a symmetric address) on `pe`. The system
// fence first makes this stream's earlier writes (kernels before this one, including stores into
// peers' memory through nvshmem_ptr views) visible before the signal can be observed.
__global__ void signal_op_kernel(uint64_t *sig, uint64_t value, int sig_op, int pe, const uint64_t *guard) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || guarded(guard)) return;
    __threadfence_system();
    nvshmemx_signal_op(sig, value, sig_op, pe);
}

// Waits, in order, until each of the `count` local words sig[i * stride] satisfies `cmp value`, all
// under one deadline of `timeout_ns` (globaltimer). result[1] = 0 when every word did, else
// 1 + the index of the first word that timed out; result[0] = the last value seen of that word
// (of the last word on success). `sticky` (optional, a device word): a timeout sets it, and a wait
// that starts with it set returns at once with result[1] = UINT64_MAX, so the stream-ordered waits
// queued behind a failed one cost nothing instead of a full timeout each. `result` may be pinned host
// memory (the deferred checks read it after the stream passes an event). `abort_words` (0: none): the
// offset, in words, from each waited word to its abort word; an abort word that turns nonzero ends the
// wait at once as a failure of that word, with result[0] = the abort word (a peer that gave up says so
// there instead of leaving us to wait out the timeout). `skip_on_sticky` = 0: the wait runs even with
// sticky set (it still sets it on failure): waits that guard writes into a peer's memory must never be
// skipped.
__global__ void signal_wait_all_kernel(uint64_t *sig, uint64_t stride, int count, int cmp, uint64_t value,
                                       uint64_t timeout_ns, uint64_t *result, uint64_t *sticky,
                                       int64_t abort_words, int skip_on_sticky) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (skip_on_sticky && sticky != nullptr && *reinterpret_cast<volatile uint64_t *>(sticky) != 0) {
        result[0] = 0;
        result[1] = ~static_cast<uint64_t>(0);
        __threadfence_system();
        return;
    }
    const uint64_t start = globaltimer_ns();
    uint64_t v = 0;
    for (int i = 0; i < count; ++i) {
        uint64_t *word = sig + static_cast<uint64_t>(i) * stride;
        uint64_t *abort = abort_words != 0 ? word + abort_words : nullptr;
        uint64_t notice = 0;
        v = nvshmem_signal_fetch(word);
        while (!compare(v, cmp, value)) {
            if (abort != nullptr && (notice = nvshmem_signal_fetch(abort)) != 0) break;
            if (globaltimer_ns() - start > timeout_ns) break;
            __nanosleep(100);
            v = nvshmem_signal_fetch(word);
        }
        if (!compare(v, cmp, value)) {  // the peer gave up (notice), or the wait timed out
            result[0] = notice != 0 ? notice : v;
            result[1] = static_cast<uint64_t>(i) + 1;
            if (sticky != nullptr) *reinterpret_cast<volatile uint64_t *>(sticky) = 1;
            __threadfence_system();
            return;
        }
    }
    // Acquire side of the senders' fence: later reads of this stream see what the signals published.
    __threadfence_system();
    result[0] = v;
    result[1] = 0;
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
    m.doc() = "epkit NVSHMEM transport: bootstrap, symmetric memory, put-with-signal and signal waits";

    m.def("unique_id_size", []() { return sizeof(nvshmemx_uniqueid_t); });
    m.def(
        "set_device",
        [](int device) { check_cuda(cudaSetDevice(device), "cudaSetDevice"); },
        py::arg("device"),
        "Make `device` current for this thread in the CUDA runtime this extension uses (before init and launches).");
    m.def("get_unique_id", []() {
        nvshmemx_uniqueid_t uid;
        if (nvshmemx_get_uniqueid(&uid) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
        return py::bytes(reinterpret_cast<const char *>(&uid), sizeof(uid));
    }, "Rank 0: a fresh NVSHMEM unique id to broadcast to every rank.");
    m.def(
        "init",
        [](py::bytes uid_bytes, int rank, int world_size) {
            std::string raw = uid_bytes;
            if (raw.size() != sizeof(nvshmemx_uniqueid_t)) {
                throw std::invalid_argument("unique id has " + std::to_string(raw.size()) + " bytes, expected " +
                                            std::to_string(sizeof(nvshmemx_uniqueid_t)));
            }
            if (rank < 0 || rank >= world_size) {
                throw std::invalid_argument("rank " + std::to_string(rank) + " outside [0, " +
                                            std::to_string(world_size) + ")");
            }
            if (g_initialized) throw std::runtime_error("init: NVSHMEM is already initialised in this process");
            if (g_finalized) {
                throw std::runtime_error("init: NVSHMEM was finalized in this process and cannot be initialised again");
            }
            nvshmemx_uniqueid_t uid;
            std::memcpy(&uid, raw.data(), sizeof(uid));
            ensure_cuda_context("init: making a CUDA context current");
            nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
            if (nvshmemx_set_attr_uniqueid_args(rank, world_size, &uid, &attr) != 0) {
                throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
            }
            if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
                throw std::runtime_error("nvshmemx_init_attr failed");
            }
            require_running("init");
            g_initialized = true;
        },
        py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), "Join the NVSHMEM job (collective).");
    m.def("finalize", []() {
        if (g_initialized) {
            nvshmem_finalize();
            g_initialized = false;
            g_finalized = true;
        }
    });
    m.def(
        "job_status",
        []() { return nvshmemx_init_status(); },
        "The process's NVSHMEM state as the host library reports it (0 none, 1 bootstrapped, >= 2 running), "
        "whoever started it (this extension, torch's symmetric memory, the application).");
    m.def(
        "attach",
        []() {
            if (g_initialized) return;
            if (g_finalized) throw std::runtime_error("attach: NVSHMEM was finalized in this process");
            if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
                throw std::runtime_error("attach: no NVSHMEM job is running in this process to attach to");
            }
            // NVSHMEM 3.x allows further init calls by the PEs of the running job: this one joins it
            // (reference-counted, no new bootstrap) and registers this module's device state, which the
            // statically linked device library keeps per module; finalize() gives the reference back.
            ensure_cuda_context("attach: making a CUDA context current");
            nvshmem_init();
            require_running("attach");
            g_initialized = true;
        },
        "Join the NVSHMEM job another library in this process started (torch's symmetric memory), so that "
        "this extension's kernels can use it.");
    m.def("initialized", []() { return g_initialized; });
    m.def("finalized", []() { return g_finalized; }, "True once finalize() ran: init() cannot run again here.");
    m.def("my_pe", []() { require_init("my_pe"); return nvshmem_my_pe(); });
    m.def("n_pes", []() { require_init("n_pes"); return nvshmem_n_pes(); });
    m.def(
        "malloc",
        [](size_t nbytes) {
            require_init("malloc");
            void *p = nvshmem_malloc(nbytes);
            if (p == nullptr && nbytes > 0) {
                throw std::runtime_error("nvshmem_malloc(" + std::to_string(nbytes) + ") failed");
            }
            if (p != nullptr) {
                // Zero it, wait for the zeroing, and only then let any rank go on: a peer that returned
                // first could otherwise post signals or write data that a late memset here wipes.
                check_cuda(cudaMemset(p, 0, nbytes), "zeroing symmetric memory");
                check_cuda(cudaDeviceSynchronize(), "zeroing symmetric memory");
                nvshmem_barrier_all();
            }
            return reinterpret_cast<uintptr_t>(p);
        },
        py::arg("nbytes"), "Collective symmetric allocation, zero-filled; returns the device address.");
    m.def("free", [](uintptr_t ptr) {
        require_init("free");
        nvshmem_free(reinterpret_cast<void *>(ptr));
    });
    m.def(
        "peer_ptr",
        [](uintptr_t ptr, int pe) {
            require_init("peer_ptr");
            return reinterpret_cast<uintptr_t>(nvshmem_ptr(reinterpret_cast<void *>(ptr), pe));
        },
        py::arg("ptr"), py::arg("pe"), "Address of `ptr` on `pe` if directly addressable (NVLink), else 0.");
    m.def("barrier_all", []() {
        require_init("barrier_all");
        nvshmem_barrier_all();
    });
    m.def(
        "put_signal",
        [](uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t sig, uint64_t value, const std::string &op, int pe,
           uintptr_t stream, uintptr_t guard) {
            require_init("put_signal");
            int sig_op = parse_signal_op(op);
            auto s = reinterpret_cast<cudaStream_t>(stream);
            auto g = reinterpret_cast<const uint64_t *>(guard);
            void *peer = nvshmem_ptr(reinterpret_cast<void *>(dst), pe);
            if (peer != nullptr && nbytes > 0) {  // directly addressable: many blocks, then the signal
                put_chunks_kernel<<<put_blocks(nbytes), 256, 0, s>>>(
                    static_cast<char *>(peer), reinterpret_cast<const char *>(src), nbytes, g);
                check_cuda(cudaGetLastError(), "put_signal copy launch");
                signal_after_kernel<<<1, 1, 0, s>>>(reinterpret_cast<uint64_t *>(sig), value, sig_op, pe, g);
            } else {
                put_signal_kernel<<<1, 256, 0, s>>>(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src),
                                                    nbytes, reinterpret_cast<uint64_t *>(sig), value, sig_op, pe, g);
            }
            check_cuda(cudaGetLastError(), "put_signal launch");
        },
        py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("sig"), py::arg("value"), py::arg("op"),
        py::arg("pe"), py::arg("stream"), py::arg("guard") = 0,
        "On `stream`: copy nbytes to symmetric `dst` on `pe` (many blocks when `pe` is directly addressable), "
        "then set/add `value` to its signal word `sig`; no signal, and no copy, if the local device word `guard` "
        "(0: none) is nonzero when the kernels run.");
    m.def(
        "signal_wait",
        [](uintptr_t sig, const std::string &cmp, uint64_t value, double timeout_s, uintptr_t result,
           uintptr_t stream) {
            require_init("signal_wait");
            int c = parse_cmp(cmp);
            if (result == 0) throw std::invalid_argument("signal_wait needs a 2-word device result buffer");
            uint64_t timeout_ns = timeout_to_ns(timeout_s);
            signal_wait_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
                reinterpret_cast<uint64_t *>(sig), c, value, timeout_ns, reinterpret_cast<uint64_t *>(result));
            check_cuda(cudaGetLastError(), "signal_wait launch");
        },
        py::arg("sig"), py::arg("cmp"), py::arg("value"), py::arg("timeout"), py::arg("result"), py::arg("stream"),
        "On `stream`: wait until the local signal word satisfies `cmp value` or `timeout` s pass; "
        "result (2 device uint64) gets [last value, timed_out].");
    m.def(
        "signal_op",
        [](uintptr_t sig, uint64_t value, const std::string &op, int pe, uintptr_t stream, uintptr_t guard) {
            require_init("signal_op");
            int sig_op = parse_signal_op(op);
            require_pe(pe, "signal_op");
            if (sig == 0 || sig % alignof(uint64_t) != 0) {
                throw std::invalid_argument("signal_op needs an 8-byte aligned symmetric signal address");
            }
            signal_op_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
                reinterpret_cast<uint64_t *>(sig), value, sig_op, pe, reinterpret_cast<const uint64_t *>(guard));
            check_cuda(cudaGetLastError(), "signal_op launch");
        },
        py::arg("sig"), py::arg("value"), py::arg("op"), py::arg("pe"), py::arg("stream"), py::arg("guard") = 0,
        "On `stream`: after a system fence (earlier writes of the stream become visible first), set/add "
        "`value` to the symmetric 64-bit word `sig` on `pe`; not if the local device word `guard` (0: none) "
        "is nonzero when the kernel runs.");
    m.def(
        "signal_wait_all",
        [](uintptr_t sig, uint64_t stride, int count, const std::string &cmp, uint64_t value, double timeout_s,
           uintptr_t result, uintptr_t stream, uintptr_t sticky, int64_t abort_words, bool skip_on_sticky) {
            require_init("signal_wait_all");
            int c = parse_cmp(cmp);
            if (result == 0) throw std::invalid_argument("signal_wait_all needs a 2-word device result buffer");
            if (sig == 0 || sig % alignof(uint64_t) != 0) {
                throw std::invalid_argument("signal_wait_all needs an 8-byte aligned local signal address");
            }
            if (count < 0 || stride == 0) {
                throw std::invalid_argument("signal_wait_all: count must be >= 0 and stride >= 1 (in words), got " +
                                            std::to_string(count) + " and " + std::to_string(stride));
            }
            signal_wait_all_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
                reinterpret_cast<uint64_t *>(sig), stride, count, c, value, timeout_to_ns(timeout_s),
                reinterpret_cast<uint64_t *>(result), reinterpret_cast<uint64_t *>(sticky), abort_words,
                skip_on_sticky ? 1 : 0);
            check_cuda(cudaGetLastError(), "signal_wait_all launch");
        },
        py::arg("sig"), py::arg("stride"), py::arg("count"), py::arg("cmp"), py::arg("value"), py::arg("timeout"),
        py::arg("result"), py::arg("stream"), py::arg("sticky") = 0, py::arg("abort_words") = 0,
        py::arg("skip_on_sticky") = true,
        "On `stream`: wait until each local word sig[i * stride] (i < count, stride in 64-bit words) satisfies "
        "`cmp value`, under one deadline of `timeout` s; result (2 uint64, device or pinned host memory) gets "
        "[last value seen, 0 if all held else 1 + index of the first word that timed out]. `sticky` (0 or a "
        "device uint64): set on a timeout or an abort; a wait starting with it set returns at once with result[1] = "
        "UINT64_MAX (unless skip_on_sticky is False). `abort_words`: offset in words from each waited word to its "
        "abort word; a nonzero abort word fails the wait at once (result[0] = the abort word).");
}
