#include "core/memory_check.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/units.h"

namespace nnsim {

std::vector<LaneMemoryPeak> lane_memory_peaks(const Program& program) {
  std::vector<LaneMemoryPeak> out;
  for (const Lane& lane : program.lanes) {
    LaneMemoryPeak p;
    const double base = lane.memory.total();
    double level = 0;
    int in_flight = 0;
    p.peak = base;
    for (size_t b = 0; b < lane.blocks.size(); ++b) {
      const BlockTemplate& t = program.templates[lane.blocks[b].template_index];
      // A micro-batch enters with its first forward pass (repeated forwards: pass 0).
      if (t.kind == BlockKind::kForward && lane.blocks[b].block.pass == 0) ++in_flight;
      if (base + level + t.peak_bytes > p.peak) {
        p.peak = base + level + t.peak_bytes;
        p.activations = level + t.peak_bytes;
        p.in_flight = in_flight;
        p.block = static_cast<int>(b);
      }
      level += t.kept_bytes;
      if (t.kind == BlockKind::kBackward || t.kind == BlockKind::kBackwardWeight ||
          lane.blocks[b].paired) {
        --in_flight;
      }
    }
    out.push_back(p);
  }
  return out;
}

std::string describe_memory_parts(const StaticMemory& memory, double activations,
                                  const std::string& activations_note) {
  struct Part {
    double bytes;
    std::string what;
    std::string note;
  };
  std::vector<Part> parts = {
      {activations, "activations", activations_note},
      {memory.weights, "weights", ""},
      {memory.gradients, "gradients", ""},
      {memory.optimizer, "optimizer state", ""},
      {memory.gathered, "ZeRO-3 gathered weights and gradients", ""},
      {memory.pipeline_buffers, "pipeline receive buffers", ""},
      {memory.comm_buffers + memory.runtime, "NCCL buffers and runtime", ""}};
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.bytes > b.bytes; });
  std::string out;
  for (const Part& part : parts) {
    if (part.bytes <= 0) continue;
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", part.what, format_bytes(part.bytes));
    if (!part.note.empty()) out += " " + part.note;
  }
  return out;
}

NodeHostMemory busiest_host_memory(const Program& program) {
  std::vector<double> per_node(program.topology.nodes, 0.0);
  bool any = false;
  for (const Lane& lane : program.lanes) {
    if (lane.host_bytes <= 0) continue;
    any = true;
    for (int rank : lane.ranks) {
      for (int r = 0; r < program.replicas; ++r) {
        const int gpu = program.gpu_of_rank[program.rank_in_replica(rank, r)];
        per_node[program.topology.node_of(gpu)] += lane.host_bytes;
      }
    }
  }
  if (!any) return {};
  const auto busiest = std::max_element(per_node.begin(), per_node.end());
  return {*busiest, static_cast<int>(busiest - per_node.begin())};
}

std::string describe_host_contents(const Plan& plan) {
  std::string what = plan.optimizer.offload_params ? "parameters, gradients and optimizer state"
                     : plan.optimizer.offload_fraction > 0 ? "optimizer state and gradient copies"
                                                           : "";
  if (plan.offloads_activations()) what += what.empty() ? "activations" : " and activations";
  return what;
}

namespace {

Status check_host_memory_fits(const Program& program) {
  const NodeHostMemory host = busiest_host_memory(program);
  if (host.node < 0 || host.bytes <= program.topology.host.memory) return Status::Ok();
  const Plan& plan = program.plan;
  std::string fixes;
  if (plan.optimizer.offload_fraction > 0) {
    fixes +=
        "a smaller optimizer.offload_fraction (--optimizer-offload), optimizer sharding "
        "(--zero 1..3), ";
  }
  if (plan.activation_offload_layers > 0) {
    fixes += "fewer activation_offload_layers (--activation-offload), ";
  }
  if (!plan.activation_offload_modules.empty()) {
    fixes += "fewer activation_offload_modules (--offload-modules), ";
  }
  return Error(fmt::format(
      "the plan does not fit in host memory: node {}'s GPUs keep {} of offloaded {} there, but "
      "it has {}: {} over.\n"
      "  try {}or more nodes",
      host.node, format_bytes(host.bytes), describe_host_contents(plan),
      format_bytes(program.topology.host.memory),
      format_bytes(host.bytes - program.topology.host.memory), fixes));
}

}  // namespace

Status check_memory_fits(const Program& program) {
  if (Status s = check_host_memory_fits(program); !s) return s;
  const double capacity = program.topology.gpu.hbm_bytes;
  auto peaks = lane_memory_peaks(program);
  size_t worst = 0;
  for (size_t i = 0; i < peaks.size(); ++i) {
    if (peaks[i].peak > peaks[worst].peak) worst = i;
  }
  const LaneMemoryPeak& p = peaks[worst];
  if (p.peak <= capacity) return Status::Ok();
  const Lane& lane = program.lanes[worst];
  const std::string what = describe_memory_parts(
      lane.memory, p.activations,
      fmt::format("({} micro-batch{} in flight)", p.in_flight, p.in_flight == 1 ? "" : "es"));
  std::string where;
  for (const auto& [axis, v] : lane.slice) {
    where += fmt::format("{}{}={}", where.empty() ? "" : ",", axis, v);
  }
  return Error(fmt::format(
      "the plan does not fit in memory: GPU {} ({}) needs {} but has {} ({}): {} over.\n"
      "  largest parts: {}.\n"
      "  try activation recomputation (--recompute selective or full), optimizer sharding "
      "(--zero 1..3), more pipeline or tensor parallelism{}, {}{}or a smaller micro-batch",
      lane.gpus.front(), where.empty() ? "every stage" : where, format_bytes(p.peak),
      format_bytes(capacity), program.topology.gpu.name, format_bytes(p.peak - capacity), what,
      // A mixture of experts can also spread its experts.
      program.plan.model.moe() ? ", expert parallelism (--ep)" : "",
      // A cluster with a host can take optimizer state the plan keeps on the GPUs.
      program.topology.has_host && program.plan.optimizer.offload_fraction < 1 &&
              lane.memory.optimizer > 0
          ? "optimizer offloading (--optimizer-offload), "
          : "",
      // And, on one pipeline stage without recomputation, activations (as Megatron-Core does).
      program.topology.has_host && program.plan.framework == "megatron" &&
              program.plan.segments.size() == 1 && program.plan.recompute.empty() &&
              program.plan.recycle == 1 &&
              program.plan.activation_offload_layers + 1 < program.plan.model.layers
          ? "activation offloading (--activation-offload), "
          : ""));
}

}  // namespace nnsim
