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
      if (t.kind == BlockKind::kBackward || t.kind == BlockKind::kBackwardWeight) --in_flight;
    }
    out.push_back(p);
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
  const StaticMemory& m = lane.memory;
  std::vector<std::pair<double, std::string>> parts = {
      {p.activations,
       fmt::format("activations {} ({} micro-batch{} in flight)", format_bytes(p.activations),
                   p.in_flight, p.in_flight == 1 ? "" : "es")},
      {m.optimizer, "optimizer state " + format_bytes(m.optimizer)},
      {m.weights, "weights " + format_bytes(m.weights)},
      {m.gradients, "gradients " + format_bytes(m.gradients)},
      {m.comm_buffers + m.runtime,
       "communication buffers and runtime " + format_bytes(m.comm_buffers + m.runtime)},
  };
  if (m.pipeline_buffers > 0) {
    parts.emplace_back(m.pipeline_buffers,
                       "pipeline receive buffers " + format_bytes(m.pipeline_buffers));
  }
  if (m.gathered > 0) {
    parts.emplace_back(m.gathered,
                       "ZeRO-3's gathered weights and gradients " + format_bytes(m.gathered));
  }
  std::sort(parts.begin(), parts.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string what;
  for (const auto& [bytes, text] : parts) what += (what.empty() ? "" : ", ") + text;
  std::string where;
  for (const auto& [axis, v] : lane.slice) {
    where += fmt::format("{}{}={}", where.empty() ? "" : ",", axis, v);
  }
  return Error(fmt::format(
      "the plan does not fit in memory: GPU {} ({}) needs {} but has {} ({}): {} over.\n"
      "  largest parts: {}.\n"
      "  try activation recomputation (--recompute selective or full), optimizer sharding "
      "(--zero 1..3), more pipeline or tensor parallelism, or a smaller micro-batch",
      lane.gpus.front(), where.empty() ? "every stage" : where, format_bytes(p.peak),
      format_bytes(capacity), program.topology.gpu.name, format_bytes(p.peak - capacity), what));
}

}  // namespace nnsim
