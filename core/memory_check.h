// Peak device memory of a compiled plan, found by walking every lane's blocks in order (the
// schedule fixes the order of allocations, so the peak does not depend on timing), and the
// out-of-memory diagnosis.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/program.h"

namespace nnsim {

struct LaneMemoryPeak {
  double peak = 0;         // bytes: static + activations + transient at the worst moment
  double activations = 0;  // activation bytes held at that moment (with transients)
  int in_flight = 0;       // micro-batch activations alive at that moment
  int block = -1;          // block at the peak (-1: before any block)
};

std::vector<LaneMemoryPeak> lane_memory_peaks(const Program& program);

// What a device holds at its peak, as "optimizer state 4.64 GiB, activations 1.74 GiB, ...":
// static memory by kind plus the activations held then, largest first, empty parts left out (the
// parts add up to the peak). `activations_note` follows the activations figure, e.g. "(3
// micro-batches in flight)".
std::string describe_memory_parts(const StaticMemory& memory, double activations,
                                  const std::string& activations_note = "");

// Host memory the busiest node's GPUs take with their offloaded optimizer shards (Plan
// optimizer.offload_fraction), bytes, and that node; {0, -1} without offloading.
struct NodeHostMemory {
  double bytes = 0;
  int node = -1;
};
NodeHostMemory busiest_host_memory(const Program& program);
// What a plan keeps in host memory, as "optimizer state and gradient copies and activations";
// empty without offloading.
std::string describe_host_contents(const Plan& plan);

// Error when a lane's peak exceeds the GPU's memory (which GPU, by how much, what dominates and
// what to try), or a node's offloaded optimizer state exceeds its host memory.
Status check_memory_fits(const Program& program);

}  // namespace nnsim
