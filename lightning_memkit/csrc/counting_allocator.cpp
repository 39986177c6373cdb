// The CPU allocator's own count of live bytes, across every thread: what torch.cuda.max_memory_allocated
// is on CUDA. torch.profiler's memory timeline sees only the threads it profiles, so a block that a
// collective's worker thread (gloo) allocates or frees is missed there; this wrapper, installed as the
// CPU allocator, counts every allocation and free wherever it happens. Tests only (lightning_memkit.testing).
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> highest{0};

// The wrapped allocator's blocks are "simple" (the context is the data pointer, freed by its raw
// deleter), and some kernels rely on that (raw_allocate): ours are too, so each block's size is kept here.
std::mutex sizes_mutex;
std::unordered_map<void*, int64_t> sizes;
c10::DeleterFnPtr wrapped_delete = nullptr;

void count(int64_t nbytes) {
  const int64_t now = live.fetch_add(nbytes) + nbytes;
  int64_t seen = highest.load();
  while (now > seen && !highest.compare_exchange_weak(seen, now)) {
  }
}

void release(void* data) {
  int64_t nbytes = 0;
  {
    std::lock_guard<std::mutex> guard(sizes_mutex);
    auto it = sizes.find(data);
    if (it != sizes.end()) {
      nbytes = it->second;
      sizes.erase(it);
    }
  }
  live.fetch_sub(nbytes);
  wrapped_delete(data);
}

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* wrapped) : wrapped(wrapped) {}

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = wrapped->allocate(nbytes);
    void* data = inner.get();
    if (nbytes == 0 || data == nullptr || inner.get_context() != data) {
      return inner;  // nothing allocated, or not a block this wrapper can take over
    }
    c10::Device device = inner.device();
    inner.release_context();  // ours now: freed by `release`, through the wrapped allocator's deleter
    {
      std::lock_guard<std::mutex> guard(sizes_mutex);
      sizes[data] = static_cast<int64_t>(nbytes);
    }
    count(static_cast<int64_t>(nbytes));
    return c10::DataPtr(data, data, &release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  c10::Allocator* wrapped;
};

CountingAllocator* installed = nullptr;

}  // namespace

void install() {
  if (installed == nullptr) {
    c10::Allocator* wrapped = c10::GetCPUAllocator();
    TORCH_CHECK(wrapped->raw_deleter() != nullptr, "the CPU allocator in use has no raw deleter to wrap");
    wrapped_delete = wrapped->raw_deleter();
    installed = new CountingAllocator(wrapped);  // kept for the process's life
    c10::SetCPUAllocator(installed, /*priority=*/100);
  }
}

bool is_installed() { return installed != nullptr; }
int64_t live_bytes() { return live.load(); }
int64_t peak_bytes() { return highest.load(); }
void reset_peak() { highest.store(live.load()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "Count every CPU allocation from now on (for the process's life).");
  m.def("is_installed", &is_installed);
  m.def("live_bytes", &live_bytes, "Bytes allocated since install and not yet freed.");
  m.def("peak_bytes", &peak_bytes, "The highest live_bytes since the last reset_peak.");
  m.def("reset_peak", &reset_peak, "Start a new peak from what is live now.");
}
