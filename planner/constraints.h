// User constraints that prune the plan search (YAML; docs/constraints.md), in the spirit of
// nnScaler's: restrict how operators may be partitioned, pin stages and recomputation, limit
// schedules, stages, bubbles and memory, and say where groups may sit on the cluster.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/opgraph.h"
#include "core/plan.h"
#include "core/program.h"
#include "planner/megatron.h"

namespace nnsim {

// How the operators a pattern matches may be partitioned.
struct OperatorConstraint {
  std::string match = "*";     // operator name pattern ("attn.*", "mlp.fc1", "*")
  std::optional<OpKind> kind;  // and only operators of this kind
  // And only these layers' operators, [first, end) (the embedding and head are outside every
  // layer range); unset: layers, embedding and head.
  std::optional<std::pair<int, int>> layers;
  std::vector<Dim> forbid;        // dimensions they may not be split along
  std::vector<Dim> allow;         // if non-empty, the only dimensions they may be split along
  std::optional<int> max_degree;  // most ways they may be split in all
  bool replicate = false;         // they may not be split at all
  int line = 0;                   // where it was written (for messages)
};

struct Constraints {
  std::string file;                     // for messages
  std::optional<double> memory_cap;     // bytes per GPU (below the GPU's capacity)
  std::vector<ScheduleKind> schedules;  // allowed (empty: all)
  std::optional<int> max_stages;        // pipeline stages
  std::optional<double> max_bubble;     // fraction of the iteration
  bool tp_within_node = false;          // tensor-parallel groups inside one node
  bool ep_within_node = false;          // expert-parallel groups (their all-to-alls) likewise
  std::vector<OperatorConstraint> operators;
  std::vector<int> stage_layers;               // pinned layers per pipeline stage
  std::optional<RecomputeMode> recompute;      // pinned recomputation
  std::vector<RecomputeMode> stage_recompute;  // pinned, per pipeline stage
  std::vector<std::string> recompute_modules;  // operators always recomputed
  std::vector<std::string> offload_modules;    // Megatron-Core modules every plan offloads
  std::vector<std::pair<int, std::vector<int>>> stage_nodes;  // stage -> nodes it must use
  std::vector<int> avoid_gpus;                                // GPUs no rank may use
  std::vector<int> avoid_nodes;                               // nodes no rank may use
};

Expected<Constraints> load_constraints(const std::string& path);
Expected<Constraints> parse_constraints(const std::string& yaml, const std::string& name);

// The first constraint a plan breaks, by name ("tp_within_node", "operators[1] (attn.*)", ...),
// or "" when it obeys them all. `estimated_bubble` and `peak_memory` come from the estimator.
std::string violated_constraint(const Constraints& c, const Plan& plan, const Program& program,
                                double estimated_bubble, double peak_memory);

}  // namespace nnsim
