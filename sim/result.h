// What one simulated iteration produced: time, throughput, per-GPU breakdown and memory, and
// (on request) every task with its start and end for traces.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/program.h"

namespace nnsim {

// Where a stretch of a device's time went. The parts add up to the iteration time.
struct Breakdown {
  double compute = 0;
  double recompute = 0;
  double optimizer = 0;
  std::map<std::string, double> exposed_comm;  // by group: "tp", "cp", "dp", "pp", ...
  double bubble = 0;  // waiting on other devices' compute, and idle at the end
  double total_exposed_comm() const;
};

struct MemoryPoint {
  double time = 0;
  double bytes = 0;
};

// One lane: the devices that run the same program in lockstep (a pipeline stage's
// tensor/context-parallel ranks in one replica). All its GPUs have the same figures.
struct LaneReport {
  std::string name;       // "pp=3"
  std::vector<int> gpus;  // its GPUs in replica 0
  std::vector<int> ranks;
  double finish_time = 0;  // when its last step ended
  Breakdown breakdown;
  StaticMemory static_memory;
  double peak_activations = 0;  // bytes above static memory at the peak
  double peak_memory = 0;       // static + peak activations
  std::vector<MemoryPoint> memory_timeline;
  double parameters = 0;  // held per device
};

enum class TaskKind : uint8_t {
  kCompute,
  kRecompute,
  kOptimizer,
  kCollective,    // blocking collective on the compute stream
  kRecvWait,      // compute stream waiting for a transfer
  kDpWait,        // compute stream waiting for the data-parallel stream
  kTransfer,      // a pipeline transfer in flight (on the sender's send stream)
  kDpCollective,  // a collective on the data-parallel stream
  kSendWait,      // compute stream waiting for its own blocking send to complete
  kCommWait,      // compute stream waiting for the expert communication stream (a pair's)
  kHostCopy,      // an activation copy to the host or back, on its stream
  kHostCopyWait,  // compute stream waiting for activation copies (activation offloading)
};
std::string_view to_string(TaskKind k);

// kExpertComm: a paired block's expert all-to-alls (Plan comm.ep_overlap). kOffload, kReload:
// activation offloading's copies to the host and back (Plan::offloads_activations).
enum class Stream : uint8_t {
  kCompute,
  kDataParallel,
  kPipelineSend,
  kExpertComm,
  kOffload,
  kReload
};
std::string_view to_string(Stream s);

struct TaskRecord {
  int lane = 0;
  Stream stream = Stream::kCompute;
  TaskKind kind = TaskKind::kCompute;
  double start = 0;
  double end = 0;
  int label = -1;     // Program::labels
  int block = -1;     // index into the lane's blocks (-1: prologue/epilogue)
  double bytes = 0;   // communication bytes per device
  double flops = 0;   // model FLOPs per device
  double memory = 0;  // device memory after the task, bytes
  uint32_t axes = 0;  // collective group axes
};

enum class Fidelity { kSymmetric, kFull };
std::string_view to_string(Fidelity f);

struct SimResult {
  double iteration_time = 0;
  double tokens_per_second = 0;
  double model_flops_per_gpu = 0;  // model FLOP/s per GPU (Megatron convention, no recompute)
  double mfu = 0;                  // model_flops_per_gpu / peak
  double peak_flops_per_gpu = 0;   // dense peak for the plan's precision
  int num_gpus = 0;
  int micro_batches = 0;
  Fidelity fidelity = Fidelity::kSymmetric;
  int simulated_lanes = 0;
  int replicas_simulated = 0;
  std::vector<LaneReport> lanes;       // replica 0's lanes
  std::vector<std::string> labels;     // Program::labels
  std::vector<std::string> lane_axes;  // Program axis names by bit, for TaskRecord::axes
  std::vector<TaskRecord> tasks;       // when recorded
  // Simulator statistics.
  uint64_t activities = 0;
  double wall_seconds = 0;
};

// The lane whose peak memory is highest, and the figures of the worst GPU.
const LaneReport& worst_memory_lane(const SimResult& r);

}  // namespace nnsim
