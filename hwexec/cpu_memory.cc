#include "hwexec/cpu_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace nnsim::hwexec {
namespace {

std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};

#ifndef NNSIM_TORCH_HAS_CUDA

void add(std::int64_t n) {
  const std::int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  std::int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// LibTorch 2.3 made allocate() non-const and added copy_data().
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define NNSIM_ALLOCATE_CONST
#define NNSIM_COPY_DATA                                                       \
  void copy_data(void* dest, const void* src, std::size_t n) const override { \
    std::memcpy(dest, src, n);                                                \
  }
#else
#define NNSIM_ALLOCATE_CONST const
#define NNSIM_COPY_DATA
#endif

// The allocations the counting allocator handed out, by address, with their sizes: freed through
// a plain deleter of the address, so that LibTorch's raw_allocate/raw_deallocate keep working.
std::mutex g_mutex;
std::unordered_map<void*, std::int64_t>* g_sizes = nullptr;  // allocated once, never freed
c10::DeleterFnPtr g_base_free = nullptr;

void counted_free(void* data) {
  if (data != nullptr) {
    std::int64_t bytes = 0;
    {
      const std::lock_guard<std::mutex> lock(g_mutex);
      auto it = g_sizes->find(data);
      if (it != g_sizes->end()) {
        bytes = it->second;
        g_sizes->erase(it);
      }
    }
    add(-bytes);
  }
  g_base_free(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(std::size_t n) NNSIM_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    const c10::Device device = inner.device();
    void* data = inner.release_context();  // the base's context is its data (raw_deleter)
    if (data != nullptr) {
      {
        const std::lock_guard<std::mutex> lock(g_mutex);
        (*g_sizes)[data] = static_cast<std::int64_t>(n);
      }
      add(static_cast<std::int64_t>(n));
    }
    return {data, data, &counted_free, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  NNSIM_COPY_DATA

 private:
  c10::Allocator* base_;
};

#endif

}  // namespace

bool count_cpu_memory() {
#ifdef NNSIM_TORCH_HAS_CUDA
  return false;
#else
  // Static lifetime, as LibTorch's allocator registry requires; priority above the default
  // allocator's so the registration holds.
  // The base must free by address alone (LibTorch's default CPU allocator does).
  static CountingAllocator* const counting = []() -> CountingAllocator* {
    c10::Allocator* base = c10::GetCPUAllocator();
    g_base_free = base->raw_deleter();
    if (g_base_free == nullptr) return nullptr;
    g_sizes = new std::unordered_map<void*, std::int64_t>();
    auto* a = new CountingAllocator(base);
    c10::SetCPUAllocator(a, /*priority=*/1);
    return a;
  }();
  return counting != nullptr && c10::GetCPUAllocator() == counting;
#endif
}

double cpu_allocated_bytes() {
  return static_cast<double>(g_live.load(std::memory_order_relaxed));
}

double cpu_peak_bytes() {
  return static_cast<double>(g_peak.load(std::memory_order_relaxed));
}

void reset_cpu_peak() {
  g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace nnsim::hwexec
