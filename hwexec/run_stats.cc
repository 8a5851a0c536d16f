#include "hwexec/run_stats.h"

#include <algorithm>

#include "hwexec/cpu_memory.h"

#ifdef NNSIM_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include "hwexec/nccl_comm.h"
#endif

namespace nnsim::hwexec {

MemoryProbe::MemoryProbe(int cuda_device) : cuda_(cuda_device) {
  counts_ = cuda_ >= 0 || count_cpu_memory();
}

void MemoryProbe::reset() {
  if (!counts_) return;
  restart();
  peak_ = read().live;
  reserved_peak_ = -1;
}

std::pair<double, double> MemoryProbe::sample() {
  if (!counts_) return {-1, -1};
  const Reading r = read();
  restart();
  peak_ = std::max(peak_, r.window_peak);
  return {r.live, r.window_peak};
}

double MemoryProbe::peak() {
  if (counts_) sample();
  return peak_;
}

MemoryProbe::Reading MemoryProbe::read() {
#ifdef NNSIM_TORCH_HAS_CUDA
  if (cuda_ >= 0) {
    const auto st =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(cuda_));
    // [0]: the small and large pools together.
    reserved_peak_ = std::max(reserved_peak_, static_cast<double>(st.reserved_bytes[0].peak));
    return {static_cast<double>(st.allocated_bytes[0].current),
            static_cast<double>(st.allocated_bytes[0].peak)};
  }
#endif
  return {cpu_allocated_bytes(), cpu_peak_bytes()};
}

void MemoryProbe::restart() {
#ifdef NNSIM_TORCH_HAS_CUDA
  if (cuda_ >= 0) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(cuda_));
    return;
  }
#endif
  reset_cpu_peak();
}

Mark RunStats::mark(void* on) {
  Mark m;
  m.colls = pending_colls.size();
  if (events == nullptr) {
    m.t = RunClock::now();
    return m;
  }
#ifdef NNSIM_TORCH_HAS_CUDA
  Expected<int> e = events->record(on ? on : stream);
  if (!e) throw RunFailure{e.error().message()};
  m.event = *e;
  return m;
#else
  (void)on;
  throw RunFailure{"CUDA events in a build without CUDA"};
#endif
}

double RunStats::seconds(const Mark& a, const Mark& b) const {
  if (events == nullptr) return std::chrono::duration<double>(b.t - a.t).count();
#ifdef NNSIM_TORCH_HAS_CUDA
  Expected<double> s = events->elapsed(a.event, b.event);
  if (!s) throw RunFailure{s.error().message()};
  return *s;
#else
  throw RunFailure{"CUDA events in a build without CUDA"};
#endif
}

void RunStats::op(const std::string& name, const char* phase, const Mark& a, const Mark& b,
                  bool minus_collectives) {
  if (!recording) return;
  pending_ops.push_back({name, phase, a, b, minus_collectives});
  if (memory_timeline && memory->counts()) {
    const auto [live, peak] = memory->sample();
    memory_samples.push_back({name, phase, live, peak});
  }
}

void RunStats::resolve() {
  std::vector<double> coll_seconds;
  for (const PendingColl& p : pending_colls) {
    coll_seconds.push_back(seconds(p.a, p.b));
    CollTime& c = colls[{p.kind, p.axes, p.label, p.bytes}];
    c.kind = p.kind;
    c.axes = p.axes;
    c.label = p.label;
    c.bytes = p.bytes;
    c.calls += 1;
    c.seconds += coll_seconds.back();
  }
  for (const PendingOp& p : pending_ops) {
    double s = seconds(p.a, p.b);
    if (p.minus_collectives) {
      for (std::size_t i = p.a.colls; i < p.b.colls; ++i) s -= coll_seconds[i];
    }
    OpTime& o = ops[{p.name, p.phase}];
    o.name = p.name;
    o.phase = p.phase;
    o.calls += 1;
    o.seconds += s;
  }
  pending_ops.clear();
  pending_colls.clear();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (events) events->reset();
#endif
}

}  // namespace nnsim::hwexec
