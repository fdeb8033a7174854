// epkit._C: the host side of the `shm` transport.
//
// * ShmSegment: a POSIX shared-memory segment (mode 0600, O_EXCL creation,
//   unlink as soon as every rank has attached) mapped into this process.
// * 64-bit signal words inside a segment: load / store / fetch-add / CAS with
//   acquire/release ordering, and timed waits that release the GIL.
// * copy(): a bounds-checked memcpy between segments and host buffers, used
//   for one-sided puts.
//
// Every access is bounds- and alignment-checked against the segment; nothing
// writes past a mapping.

#include <pybind11/pybind11.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EPKIT_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define EPKIT_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define EPKIT_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace py = pybind11;

namespace {

[[noreturn]] void throw_os_error(const std::string &what, int err) {
    throw std::system_error(err, std::generic_category(), what);
}

class ShmSegment {
   public:
    ShmSegment(std::string name, size_t size, bool create) : name_(std::move(name)), size_(size) {
        if (name_.empty() || name_[0] != '/' || name_.find('/', 1) != std::string::npos) {
            throw std::invalid_argument("shm name must start with '/' and contain no other '/': got '" +
                                        name_ + "'");
        }
        if (size_ == 0) throw std::invalid_argument("shm segment size must be > 0");
        int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
        fd_ = ::shm_open(name_.c_str(), flags, S_IRUSR | S_IWUSR);
        if (fd_ < 0) throw_os_error("shm_open(" + name_ + ")", errno);
        if (create) {
            // shm_open's mode is filtered by the umask; make 0600 explicit.
            if (::fchmod(fd_, S_IRUSR | S_IWUSR) != 0 || ::ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
                int err = errno;
                ::close(fd_);
                ::shm_unlink(name_.c_str());
                throw_os_error("sizing shm segment " + name_, err);
            }
            owner_ = true;
        } else {
            struct stat st;
            if (::fstat(fd_, &st) != 0) {
                int err = errno;
                ::close(fd_);
                throw_os_error("fstat(" + name_ + ")", err);
            }
            if (static_cast<size_t>(st.st_size) < size_) {
                ::close(fd_);
                throw std::runtime_error("shm segment " + name_ + " holds " + std::to_string(st.st_size) +
                                         " bytes, expected " + std::to_string(size_));
            }
        }
        void *p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (p == MAP_FAILED) {
            int err = errno;
            ::close(fd_);
            if (create) ::shm_unlink(name_.c_str());
            throw_os_error("mmap(" + name_ + ")", err);
        }
        base_ = static_cast<uint8_t *>(p);
        // The mapping keeps the memory alive; the descriptor is not needed.
        ::close(fd_);
        fd_ = -1;
    }

    // Map an open descriptor of `size` bytes (an anonymous memfd passed by a peer): no name, nothing to unlink.
    // The descriptor stays the caller's to close; the mapping keeps the memory alive after it is closed.
    static ShmSegment *from_fd(int fd, size_t size, std::string label) {
        if (size == 0) throw std::invalid_argument("shm segment size must be > 0");
        struct stat st;
        if (::fstat(fd, &st) != 0) throw_os_error("fstat(" + label + ")", errno);
        if (static_cast<size_t>(st.st_size) < size) {
            throw std::runtime_error("shm segment " + label + " holds " + std::to_string(st.st_size) +
                                     " bytes, expected " + std::to_string(size));
        }
        void *p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) throw_os_error("mmap(" + label + ")", errno);
        return new ShmSegment(static_cast<uint8_t *>(p), size, std::move(label));
    }

    ~ShmSegment() { close(); }
    ShmSegment(const ShmSegment &) = delete;
    ShmSegment &operator=(const ShmSegment &) = delete;

    void close() {
        if (base_ != nullptr) {
            ::munmap(base_, size_);
            base_ = nullptr;
        }
    }

    // Removes the name; mappings stay valid. Idempotent.
    bool unlink() {
        if (unlinked_) return false;
        unlinked_ = true;
        return ::shm_unlink(name_.c_str()) == 0;
    }

    uintptr_t addr() const { return reinterpret_cast<uintptr_t>(checked_base()); }
    size_t size() const { return size_; }
    const std::string &name() const { return name_; }
    bool closed() const { return base_ == nullptr; }

    std::atomic<uint64_t> *word(size_t offset) const {
        if (offset % 8 != 0) {
            throw std::invalid_argument("signal offset " + std::to_string(offset) + " is not 8-byte aligned");
        }
        check_range(offset, 8);
        return reinterpret_cast<std::atomic<uint64_t> *>(checked_base() + offset);
    }

    uint8_t *bytes(size_t offset, size_t nbytes) const {
        check_range(offset, nbytes);
        return checked_base() + offset;
    }

   private:
    ShmSegment(uint8_t *base, size_t size, std::string label)
        : name_(std::move(label)), size_(size), base_(base), unlinked_(true) {}

    uint8_t *checked_base() const {
        if (base_ == nullptr) throw std::runtime_error("shm segment " + name_ + " is closed");
        return base_;
    }
    void check_range(size_t offset, size_t nbytes) const {
        if (offset > size_ || nbytes > size_ - offset) {
            throw std::out_of_range("range [" + std::to_string(offset) + ", " +
                                    std::to_string(offset + nbytes) + ") is outside shm segment " + name_ +
                                    " of " + std::to_string(size_) + " bytes");
        }
    }

    std::string name_;
    size_t size_;
    int fd_ = -1;
    uint8_t *base_ = nullptr;
    bool owner_ = false;
    bool unlinked_ = false;
};

enum class Cmp { EQ, NE, GE, GT, LE, LT };

Cmp parse_cmp(const std::string &s) {
    if (s == "==" || s == "eq") return Cmp::EQ;
    if (s == "!=" || s == "ne") return Cmp::NE;
    if (s == ">=" || s == "ge") return Cmp::GE;
    if (s == ">" || s == "gt") return Cmp::GT;
    if (s == "<=" || s == "le") return Cmp::LE;
    if (s == "<" || s == "lt") return Cmp::LT;
    throw std::invalid_argument("unknown comparison '" + s + "': use one of == != >= > <= <");
}

inline bool compare(uint64_t v, Cmp cmp, uint64_t target) {
    switch (cmp) {
        case Cmp::EQ: return v == target;
        case Cmp::NE: return v != target;
        case Cmp::GE: return v >= target;
        case Cmp::GT: return v > target;
        case Cmp::LE: return v <= target;
        case Cmp::LT: return v < target;
    }
    return false;
}

// Spins briefly, then backs off with growing sleeps (capped at 200us) so a
// waiting rank does not starve the rank it waits for on a 2-core machine.
// Returns true and the observed value when the condition holds.
// Waits until *w <cmp> target (true, *seen = the value) or `timeout_s` passes (false, *seen = the last
// value). With `abort` set, a nonzero *abort also ends the wait (false, *seen = 0, *notice = *abort);
// one spin/yield/sleep backoff for the whole wait either way.
bool wait_word(const std::atomic<uint64_t> *w, Cmp cmp, uint64_t target, double timeout_s, uint64_t *seen,
               const std::atomic<uint64_t> *abort = nullptr, uint64_t *notice = nullptr) {
    using clock = std::chrono::steady_clock;
    // Clamp so inf/NaN/huge timeouts cannot overflow the duration cast (NaN compares false: clamped too).
    if (!(timeout_s < 1e9)) timeout_s = 1e9;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                             std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
    long sleep_ns = 1000;
    for (uint64_t iter = 0;; ++iter) {
        uint64_t v = w->load(std::memory_order_acquire);
        if (compare(v, cmp, target)) {
            *seen = v;
            return true;
        }
        if (abort != nullptr) {
            uint64_t a = abort->load(std::memory_order_acquire);
            if (a != 0) {
                *seen = v;
                *notice = a;
                return false;
            }
        }
        if (iter < 256) {
            EPKIT_CPU_RELAX();
            continue;
        }
        if (clock::now() >= deadline) {
            *seen = v;
            return false;
        }
        if (iter < 1024) {
            std::this_thread::yield();
            continue;
        }
        struct timespec ts{0, sleep_ns};
        ::nanosleep(&ts, nullptr);
        sleep_ns = sleep_ns < 200000 ? sleep_ns * 2 : 200000;
    }
}

[[noreturn]] void raise_timeout(const std::string &msg) {
    PyErr_SetString(PyExc_TimeoutError, msg.c_str());
    throw py::error_already_set();
}

}  // namespace

void register_shm_transport(py::module_ &m) {

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const std::system_error &e) {
            py::object err = py::module_::import("builtins").attr("OSError")(e.code().value(), e.what());
            PyErr_SetObject(PyExc_OSError, err.ptr());
        }
    });

    py::class_<ShmSegment>(m, "ShmSegment")
        .def(py::init<std::string, size_t, bool>(), py::arg("name"), py::arg("size"), py::arg("create"),
             "Create (O_EXCL, mode 0600) or attach a POSIX shared-memory segment and map it.")
        .def_static("from_fd", &ShmSegment::from_fd, py::arg("fd"), py::arg("size"), py::arg("label"),
                    "Map `size` bytes of an open descriptor (e.g. a memfd a peer passed over a Unix socket); the "
                    "segment has no name and the descriptor stays the caller's to close.")
        .def_property_readonly("addr", &ShmSegment::addr, "Base address of the mapping.")
        .def_property_readonly("size", &ShmSegment::size)
        .def_property_readonly("name", &ShmSegment::name)
        .def_property_readonly("closed", &ShmSegment::closed)
        .def("unlink", &ShmSegment::unlink, "Remove the segment's name (mappings stay valid). Idempotent.")
        .def("close", &ShmSegment::close, "Unmap the segment. Views into it must not be used afterwards.")
        .def(
            "load",
            [](const ShmSegment &s, size_t off) { return s.word(off)->load(std::memory_order_acquire); },
            py::arg("offset"), "Acquire-load the 64-bit word at byte `offset`.")
        .def(
            "store",
            [](const ShmSegment &s, size_t off, uint64_t v) { s.word(off)->store(v, std::memory_order_release); },
            py::arg("offset"), py::arg("value"), "Release-store `value` into the 64-bit word at `offset`.")
        .def(
            "fetch_add",
            [](const ShmSegment &s, size_t off, uint64_t v) {
                return s.word(off)->fetch_add(v, std::memory_order_acq_rel);
            },
            py::arg("offset"), py::arg("value"), "Atomically add; returns the previous value.")
        .def(
            "compare_exchange",
            [](const ShmSegment &s, size_t off, uint64_t expected, uint64_t desired) {
                uint64_t e = expected;
                bool ok = s.word(off)->compare_exchange_strong(e, desired, std::memory_order_acq_rel);
                return py::make_tuple(ok, e);
            },
            py::arg("offset"), py::arg("expected"), py::arg("desired"),
            "Atomic CAS; returns (swapped, value seen).")
        .def(
            "wait_until",
            [](const ShmSegment &s, size_t off, const std::string &cmp, uint64_t value, double timeout_s) {
                Cmp c = parse_cmp(cmp);
                const std::atomic<uint64_t> *w = s.word(off);
                uint64_t seen = 0;
                bool ok;
                {
                    py::gil_scoped_release release;
                    ok = wait_word(w, c, value, timeout_s, &seen);
                }
                if (!ok) {
                    raise_timeout("timed out after " + std::to_string(timeout_s) + " s waiting for word at " +
                                  std::to_string(off) + " of " + s.name() + " " + cmp + " " +
                                  std::to_string(value) + " (last seen " + std::to_string(seen) + ")");
                }
                return seen;
            },
            py::arg("offset"), py::arg("cmp"), py::arg("value"), py::arg("timeout"),
            "Wait (GIL released) until word(offset) <cmp> value; raises TimeoutError after `timeout` s.")
        .def(
            "wait_until_or_abort",
            [](const ShmSegment &s, size_t off, const std::string &cmp, uint64_t value, size_t abort_off,
               double timeout_s) {
                Cmp c = parse_cmp(cmp);
                const std::atomic<uint64_t> *w = s.word(off);
                const std::atomic<uint64_t> *a = s.word(abort_off);
                uint64_t seen = 0, notice = 0;
                bool ok;
                {
                    py::gil_scoped_release release;
                    ok = wait_word(w, c, value, timeout_s, &seen, a, &notice);
                }
                return py::make_tuple(ok ? 0 : (notice != 0 ? 1 : 2), notice != 0 ? notice : seen);
            },
            py::arg("offset"), py::arg("cmp"), py::arg("value"), py::arg("abort_offset"), py::arg("timeout"),
            "Wait (GIL released) until word(offset) <cmp> value, or the word at abort_offset turns nonzero, or "
            "`timeout` s pass: returns (0, value) / (1, the abort word) / (2, last value seen); never raises "
            "for a timeout.")
        .def(
            "write",
            [](const ShmSegment &s, size_t off, uintptr_t src, size_t nbytes) {
                uint8_t *dst = s.bytes(off, nbytes);
                py::gil_scoped_release release;
                std::memcpy(dst, reinterpret_cast<const void *>(src), nbytes);
            },
            py::arg("offset"), py::arg("src_addr"), py::arg("nbytes"),
            "Copy `nbytes` from host address `src_addr` into the segment at `offset`.")
        .def(
            "read",
            [](const ShmSegment &s, size_t off, uintptr_t dst, size_t nbytes) {
                const uint8_t *src = s.bytes(off, nbytes);
                py::gil_scoped_release release;
                std::memcpy(reinterpret_cast<void *>(dst), src, nbytes);
            },
            py::arg("offset"), py::arg("dst_addr"), py::arg("nbytes"),
            "Copy `nbytes` from the segment at `offset` to host address `dst_addr`.");

    m.def(
        "shm_exists",
        [](const std::string &name) {
            int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
            if (fd < 0) return false;
            ::close(fd);
            return true;
        },
        py::arg("name"), "Whether a shared-memory segment of that name exists.");
}
