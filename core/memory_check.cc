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

Status check_memory_fits(const Program& program) {
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
      "(--zero 1..3), more pipeline or tensor parallelism{}, or a smaller micro-batch",
      lane.gpus.front(), where.empty() ? "every stage" : where, format_bytes(p.peak),
      format_bytes(capacity), program.topology.gpu.name, format_bytes(p.peak - capacity), what,
      // A mixture of experts can also spread its experts.
      program.plan.model.moe() ? ", expert parallelism (--ep)" : ""));
}

}  // namespace nnsim
