// Pipeline schedules by list scheduling: the blocks of every micro-batch are run, device by
// device, in the order a priority rule picks among those whose inputs are ready, under a limit
// on the micro-batches whose activations a device holds. One rule with different limits and
// block kinds gives 1F1B, zero-bubble ZB-H1 / ZB-H2 (backward split into input and weight
// gradients, the weight gradients filling what would be bubbles), the V-shaped ZB-V and Merak's
// shifted critical path (recomputation issued while waiting for a gradient).
#pragma once

#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim {

struct ListScheduleProblem {
  int devices = 1;
  int micro_batches = 1;
  // Segments in pipeline order (segment s feeds s + 1) and the device that runs each.
  std::vector<int> device_of_segment;
  // Backward as input-gradient (BI) and weight-gradient (BW) blocks instead of one B.
  bool split_backward = false;
  // Segments whose activations are recomputed by an explicit R block before their backward.
  std::vector<bool> recompute;
  // Per device: at most this many (segment, micro-batch) activations alive at once (a forward
  // makes one; a B or BW frees it). 0: no limit.
  std::vector<int> in_flight_limit;
  // Per device: at most this many forwards ahead of the input-gradient backwards (the warm-up
  // depth). 0 or empty: no limit.
  std::vector<int> forward_lead_limit;
  // Per segment: the same, counted on that segment alone (a V placement needs room kept for the
  // deeper chunk, or the shallow one fills the device and nothing reaches the turn).
  std::vector<int> segment_lead_limit;
  // Per device: at most this many weight-gradient blocks wait; beyond it the oldest is as urgent
  // as a backward (ZB-H1 delays stage r's by r). Negative or empty: no limit.
  std::vector<int> weight_delay_limit;
  // A weight gradient that would still run when a backward arrives waits for the backward
  // instead (the backward is on the critical path of the stages before it).
  bool weight_waits_for_backward = false;
  // Durations per segment (any unit); empty: 1 each (B: 2 when not split).
  std::vector<double> forward, backward_input, backward_weight, recompute_time;
  // Memory instead of counts, when `memory_limit` (per device, bytes) is given: a forward keeps
  // forward_bytes[s]; BI frees all but weight_input_bytes[s], which BW (or B) frees.
  std::vector<double> memory_limit, forward_bytes, weight_input_bytes;
};

struct ListSchedule {
  std::vector<std::vector<Block>> orders;  // per device, its blocks in the order they run
  double makespan = 0;                     // in the problem's time unit, no communication
};

// Ties go to the lower device, then to older micro-batches, then to deeper segments. Fails when
// the limits leave a device unable to proceed.
Expected<ListSchedule> list_schedule(const ListScheduleProblem& problem);

}  // namespace nnsim
