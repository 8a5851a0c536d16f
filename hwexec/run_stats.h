// What one rank of `nnexec run` records (docs/hwexec.md), internal to the LibTorch executor
// (run_torch.cc): the spans of its operators and collectives, resolved into per-operator and
// per-collective totals at each iteration's end, and the bytes of its live tensors.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "hwexec/run.h"

namespace nnsim::hwexec {

class CudaEvents;

// Thrown inside the executor, returned as an Error by run_rank.
struct RunFailure {
  std::string message;
};

inline void ok_or_throw(const Status& s) {
  if (!s) throw RunFailure{s.error().message()};
}

using RunClock = std::chrono::steady_clock;

// A point in time: the steady clock's on the CPU, a recorded CUDA event on a GPU. `colls` is how
// many collectives had been recorded before it (an operator's span can exclude them).
struct Mark {
  RunClock::time_point t;
  int event = -1;
  std::size_t colls = 0;
};

// The bytes of tensors live on the rank's device: nnexec's CPU counter (cpu_memory.h) or
// LibTorch's CUDA caching allocator, whose counts are kept on the host as tensors are made and
// freed.
class MemoryProbe {
 public:
  // A CPU rank counts when LibTorch lets it; a GPU rank (`cuda_device` >= 0) always can.
  explicit MemoryProbe(int cuda_device);
  bool counts() const { return counts_; }
  // The measured peaks start from what is live now.
  void reset();
  // {live now, the most live since the last reset or sample}; starts the next window.
  std::pair<double, double> sample();
  // The most live over all windows since reset(); -1 where nothing counts.
  double peak();
  double reserved_peak() const { return reserved_peak_; }

 private:
  struct Reading {
    double live, window_peak;
  };
  // One read of the counts (on a GPU, one copy of the caching allocator's statistics).
  Reading read();
  void restart();

  int cuda_ = -1;
  bool counts_ = false;
  double peak_ = -1, reserved_peak_ = -1;
};

// Spans of one iteration, resolved into per-operator and per-collective totals at its end (on a
// GPU, after the synchronize, when the events have completed).
struct RunStats {
  bool recording = false;
  CudaEvents* events = nullptr;  // null: steady clock
  void* stream = nullptr;        // the compute stream (GPU)
  std::map<std::pair<std::string, std::string>, OpTime> ops;
  std::map<std::tuple<std::string, std::string, std::string, double>, CollTime> colls;

  struct PendingOp {
    std::string name;
    const char* phase;
    Mark a, b;
    bool minus_collectives;
  };
  struct PendingColl {
    const char* kind;
    std::string axes, label;
    double bytes;
    Mark a, b;
  };
  std::vector<PendingOp> pending_ops;
  std::vector<PendingColl> pending_colls;
  // --memory-timeline: the memory at every operator span's end, of the last measured iteration.
  MemoryProbe* memory = nullptr;
  bool memory_timeline = false;
  std::vector<OpMemory> memory_samples;

  // Now, on `on` (a stream; the compute stream when null) on a GPU.
  Mark mark(void* on = nullptr);
  double seconds(const Mark& a, const Mark& b) const;
  // An operator's span; `minus_collectives`: without the collectives recorded inside it.
  void op(const std::string& name, const char* phase, const Mark& a, const Mark& b,
          bool minus_collectives = false);
  void coll(const char* kind, const std::string& axes, const std::string& label, double bytes,
            const Mark& a, const Mark& b) {
    if (recording) pending_colls.push_back({kind, axes, label, bytes, a, b});
  }
  // Adds the iteration's spans to the totals (on a GPU, after a synchronize).
  void resolve();
};

}  // namespace nnsim::hwexec
