// Rewrites the per-device block orders of a plan with a schedule generator (`nnsim schedule
// --generator`, and the builder for the list-scheduled ones). Closed-form generators (GPipe,
// 1F1B, interleaved 1F1B) depend only on the pipeline's shape; the list-scheduled ones (ZB-H1,
// ZB-H2, ZB-V, Merak) are timed with the plan's own compiled costs: the plan is compiled once
// with a provisional order, each segment's forward, backward, weight-gradient and recompute
// times and activation bytes are read from it, and the order is list-scheduled with them.
#pragma once

#include <optional>

#include "core/error.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/schedules.h"
#include "planner/tessel.h"

namespace nnsim {

// `memory_limit`: bytes per GPU the schedule may use (static memory included); by default each
// generator's own (1F1B's peak for ZB-H1 and ZB-V, about twice it for ZB-H2). `compile`: the
// cost model the blocks are timed with; give the one the plan will be simulated with, or the
// orders fit other costs (a list schedule tight in one model can idle a block in another).
Expected<Plan> generate_schedule(const Plan& plan, const Topology& topo, ScheduleKind kind,
                                 std::optional<double> memory_limit = std::nullopt,
                                 const CompileOptions& compile = {});

// Tessel's search (`nnsim schedule --search`) for the plan's own placement of segments on
// schedule orders, whatever it is (segments on any orders, several segments per order, a
// segment spanning several orders). Blocks are timed with the plan's compiled costs (the plan
// must compile with its current orders); each order may hold the activation bytes
// `memory_limit` leaves beside its static memory, by default as many as the plan's current
// schedule peaks at, so the result never needs more memory than the input. Tried with the
// backward whole and split into input- and weight-gradient blocks; the shorter wins. When
// neither beats the plan's own orders (which fit the limit), the plan comes back unchanged.
struct SearchedSchedule {
  Plan plan;
  TesselSchedule tessel;  // in seconds of the plan's compiled block costs
  // What was searched: one micro-batch's blocks with their compiled times, activation bytes and
  // transfer times between devices (the pipeline sends, priced on the topology), and the room.
  TesselProblem problem;
  bool split_backward = false;
  double input_makespan = 0;  // the plan's current orders, timed the same way
  // The search found nothing faster than the plan's own orders within the memory limit, so
  // `plan` is the input, unchanged.
  bool kept_input = false;
};
Expected<SearchedSchedule> search_schedule(const Plan& plan, const Topology& topo,
                                           std::optional<double> memory_limit = std::nullopt,
                                           const CompileOptions& compile = {});

}  // namespace nnsim
