// The plan search (`nnsim plan` with choices left open): every choice the user did not pin is
// enumerated (tensor, pipeline, context and data parallelism, virtual stages, micro-batch,
// recomputation, ZeRO stage, schedule, rank placement); candidates that cannot work are dropped
// early (degrees that do not divide, constraints, memory); the rest are compiled and ranked by
// the fast estimator (planner/estimator.h); the best are confirmed in the SimGrid simulation.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/constraints.h"
#include "planner/estimator.h"
#include "planner/megatron.h"

namespace nnsim {

// Choices the user pinned; unset ones are searched.
struct SearchPins {
  std::optional<int> tp, pp, dp, cp, ep, expert_tp, vpp, micro_batch, zero;
  std::optional<bool> sequence_parallel;
  std::optional<RecomputeMode> recompute;
  std::optional<ScheduleKind> schedule;
  std::optional<std::vector<std::string>> placement;
  std::optional<std::vector<int>> stage_layers;  // layers per segment (pp x vpp numbers)
};

struct SearchOptions {
  int global_batch = 0;
  std::optional<Precision> precision;
  std::string framework = "megatron";
  bool tp_comm_overlap = false;
  // Merak's sub-pipelined tensor parallelism: with k > 1 the best plans with tensor (or expert)
  // parallelism are also tried with k sub-batches per micro-batch (the training code must
  // support it; Megatron-LM does not).
  int tp_sub_batches = 1;
  bool moe_deepep = false;  // every candidate's token exchange through DeepEP
  // Combined 1F1B (comm.ep_overlap) tried for the best plans with expert parallelism.
  bool ep_overlap = false;
  // Candidates with expert parallelism run their shared expert beside the all-to-alls.
  bool moe_shared_expert_overlap = false;
  bool moe_grouped_gemm = false;  // every candidate's experts as one grouped-GEMM kernel
  // Every candidate's optimizer offloading (MegatronOptions optimizer_offload, offload_overlap).
  double optimizer_offload = 0;
  bool offload_overlap = false;
  // DeepSpeed's offload_param with it (MegatronOptions offload_params): ZeRO-3 only.
  bool offload_params = false;
  // Instead: a candidate that does not fit on its GPUs offloads the least fraction (in
  // hundredths) of its optimizer state that makes it fit, if any does; the same candidate
  // saving memory otherwise (more recomputation, ZeRO) is tried too.
  bool offload_as_needed = false;
  // A candidate on one pipeline stage without recomputation that does not fit on its GPUs
  // offloads the activations of the fewest first layers that makes it fit (MegatronOptions
  // activation_offload), if any does; recomputation is tried beside it.
  bool activation_offload_as_needed = false;
  // A candidate whose blocks are whole forwards and backwards (1F1B, interleaved, GPipe) that
  // does not fit on its GPUs offloads the activations of the fewest Megatron-Core modules, in
  // offloadable_modules' order and each lowering its peak, that make it fit (MegatronOptions
  // offload_modules), if any do.
  bool module_offload_as_needed = false;
  SearchPins pins;
  Constraints constraints;
  double memory_headroom = 0.1;  // fraction of GPU memory left free (without memory_cap)
  // The cost model candidates are compiled, estimated and scheduled with (a calibration file).
  CompileOptions compile;
  int top = 10;     // plans in the ranked table
  int confirm = 5;  // best estimates confirmed by simulation (0: none)
  int jobs = 1;
  // Called as work progresses: (phase, done, total). Phases: "estimating", "simulating".
  std::function<void(const std::string&, size_t, size_t)> progress;
  // Confirms a plan by simulation; returns the simulated iteration time. Supplied by the
  // caller (the planner library does not depend on the simulator).
  std::function<Expected<double>(const Program&)> simulate;
};

struct Candidate {
  MegatronOptions options;
  std::string placement;  // "tp-innermost", ...
  std::string status;     // "ok", or why it lost (does not fit, violates ..., invalid: ...)
  Estimate estimate;
  std::optional<double> simulated;  // SimGrid iteration time, for the confirmed ones
  double time() const { return simulated ? *simulated : estimate.iteration_time; }
  std::string describe() const;  // "tp8 pp16 vpp3 dp8 mb1 sp selective zero1 interleaved"
};

struct SearchResult {
  std::vector<Candidate> ranked;    // feasible, fastest first (confirmed ones by simulation)
  std::vector<Candidate> rejected;  // a sample of what lost, with why
  // The best feasible plan of each rank placement (what keeping tensor parallelism inside a
  // node, or not, costs).
  std::vector<Candidate> best_per_placement;
  // The best plan's degrees under every other placement evaluated, by estimate.
  std::vector<Candidate> other_placements_of_best;
  // How many candidates each reason removed ("does not fit in memory", "memory_cap", ...).
  std::vector<std::pair<std::string, size_t>> rejections;
  size_t enumerated = 0;
  size_t evaluated = 0;  // compiled and estimated
  size_t confirmed = 0;
  // Degrees whose stages were re-partitioned (planner/stage_partition.h), and how many of those
  // beat the uniform split of the same degrees (and joined the ranking).
  size_t balanced = 0;
  size_t balanced_better = 0;
  // Other rank placements (orders of the mesh axes) tried for the best plans.
  size_t placements_tried = 0;
  // Zero-bubble and Merak schedules tried for the best pipelined plans.
  size_t schedules_tried = 0;
  // Zero-bubble, Merak and V schedules tried with each stage (device) recomputing what it needs.
  size_t recompute_schedules_tried = 0;
  // Sub-pipelined variants (SearchOptions::tp_sub_batches) tried for the best plans.
  size_t sub_pipelined_tried = 0;
  size_t ep_overlap_tried = 0;  // combined-1F1B variants (SearchOptions::ep_overlap) tried
  // Pairs of confirmed plans whose order the estimator and the simulator disagree on.
  size_t rank_pairs = 0;
  size_t rank_disagreements = 0;
  Plan best;
};

// Fails (naming the constraints that emptied it) when nothing is feasible.
Expected<SearchResult> search_plans(const ModelSpec& model, const Topology& topology,
                                    const SearchOptions& options);

}  // namespace nnsim
