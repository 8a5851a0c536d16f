#include "planner/stage_partition.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "core/layout.h"
#include "core/memory_check.h"
#include "core/units.h"
#include "planner/estimator.h"

namespace nnsim {

namespace {

struct SegmentTimes {
  double layers = 0;  // layers' forward, backward and any uniform recomputation
  double other = 0;
};

// Per segment: the slowest variant of each block kind, summed over the kinds.
std::vector<SegmentTimes> segment_times(const Program& p) {
  const std::vector<TemplateTime> times = template_times(p);
  std::map<std::pair<int, int>, TemplateTime> worst;  // (segment, kind) -> slowest variant
  for (size_t t = 0; t < p.templates.size(); ++t) {
    const auto key = std::make_pair(p.templates[t].segment, static_cast<int>(p.templates[t].kind));
    TemplateTime& w = worst[key];
    const TemplateTime& x = times[t];
    if (x.layers + x.layers_recompute + x.other > w.layers + w.layers_recompute + w.other) w = x;
  }
  std::vector<SegmentTimes> out(p.plan.segments.size());
  for (const auto& [key, t] : worst) {
    out[key.first].layers += t.layers + t.layers_recompute;
    out[key.first].other += t.other;
  }
  return out;
}

int lane_of_segment(const Program& p, int segment) {
  for (size_t l = 0; l < p.lanes.size(); ++l) {
    for (const auto& b : p.lanes[l].blocks) {
      if (b.block.segment == segment) return static_cast<int>(l);
    }
  }
  return -1;
}

// A layer's parameters on one device, each weight divided by its split factors (tensor
// parallelism splits most of a block; expert parallelism its experts).
Expected<double> layer_parameters_per_device(const Program& p) {
  Expected<std::vector<OpPartition>> parts = resolve_partitions(p.graph.layer, p.plan);
  if (!parts) return parts.error();
  double params = 0;
  for (size_t i = 0; i < p.graph.layer.ops.size(); ++i) {
    for (const TensorSpec& w : p.graph.layer.ops[i].weights) {
      params += w.elements / (*parts)[i].factor(w.dims, p.plan.mesh);
    }
  }
  return params;
}

}  // namespace

Expected<std::vector<StageCosts>> measure_stage_costs(const Program& plain,
                                                      const Program& recomputed) {
  const auto& segments = plain.plan.segments;
  if (plain.graph.model.mixed_layers()) {
    return Error(fmt::format(
        "stage costs: model '{}' has dense and expert blocks; the partitioner prices layers of "
        "one block shape (pin the stages' layers instead)",
        plain.graph.model.name));
  }
  if (segments.size() != recomputed.plan.segments.size()) {
    return Error("stage costs: the two programs have different segments");
  }
  for (size_t s = 0; s < segments.size(); ++s) {
    for (size_t o = s + 1; o < segments.size(); ++o) {
      if (lane_of_segment(plain, static_cast<int>(s)) ==
          lane_of_segment(plain, static_cast<int>(o))) {
        return Error(
            "stage costs: a device holds several segments (virtual stages); the "
            "partitioner handles one segment per stage");
      }
    }
  }
  const std::vector<SegmentTimes> t0 = segment_times(plain);
  const std::vector<SegmentTimes> t1 = segment_times(recomputed);
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(plain);
  const Expected<double> per_device = layer_parameters_per_device(plain);
  if (!per_device) return per_device.error();
  const double layer_params = *per_device;
  std::vector<StageCosts> out;
  for (size_t s = 0; s < segments.size(); ++s) {
    const int n = segments[s].end_layer - segments[s].first_layer;
    const int lane = lane_of_segment(plain, static_cast<int>(s));
    if (n < 1 || lane < 0) {
      return Error(fmt::format("stage costs: segment {} has no layers or no device", s));
    }
    const Lane& ln = plain.lanes[lane];
    StageCosts c;
    c.layer_seconds = t0[s].layers / n;
    c.recompute_seconds = std::max(0.0, (t1[s].layers - t0[s].layers) / n);
    c.other_seconds = t0[s].other;
    const double static_bytes =
        ln.memory.weights + ln.memory.gradients + ln.memory.optimizer + ln.memory.gathered;
    c.static_per_layer = ln.parameters > 0 ? static_bytes / ln.parameters * layer_params : 0;
    const int first = segments[s].first_layer;
    c.activation_per_layer = plain.layer_activation_bytes.at(first);
    c.activation_per_recomputed_layer = recomputed.layer_activation_bytes.at(first);
    c.in_flight = std::max(1, peaks[lane].in_flight);
    c.fixed_bytes =
        peaks[lane].peak - n * (c.static_per_layer + c.in_flight * c.activation_per_layer);
    out.push_back(c);
  }
  return out;
}

namespace {

// One stage holding `n` layers: the fewest recomputed layers that make it fit, and its time.
struct StageChoice {
  bool fits = false;
  int recomputed = 0;
  double seconds = 0;
};

StageChoice choose(const StageCosts& c, int n, double capacity) {
  StageChoice ch;
  const double need =
      c.fixed_bytes + n * (c.static_per_layer + c.in_flight * c.activation_per_layer);
  const double saved_per_layer =
      c.in_flight * (c.activation_per_layer - c.activation_per_recomputed_layer);
  int k = 0;
  if (need > capacity) {
    if (saved_per_layer <= 0) return ch;
    k = static_cast<int>(std::ceil((need - capacity) / saved_per_layer - 1e-9));
    if (k > n) return ch;
  }
  ch.fits = true;
  ch.recomputed = k;
  ch.seconds = c.other_seconds + n * c.layer_seconds + k * c.recompute_seconds;
  return ch;
}

// Lexicographic objective: the slowest stage, then the layers recomputed in all.
struct Score {
  double slowest = std::numeric_limits<double>::infinity();
  int recomputed = 0;
  bool operator<(const Score& o) const {
    if (std::isinf(slowest) || std::isinf(o.slowest)) return slowest < o.slowest;
    // Times within a part in a million are equal (they come from sums of the same costs).
    if (std::abs(slowest - o.slowest) > 1e-6 * std::max(slowest, o.slowest)) {
      return slowest < o.slowest;
    }
    return recomputed < o.recomputed;
  }
};

}  // namespace

Expected<StagePartition> partition_stages(const std::vector<StageCosts>& stages, int layers,
                                          double capacity) {
  const int p = static_cast<int>(stages.size());
  if (p < 1 || layers < p) {
    return Error(fmt::format("cannot split {} layers over {} stages", layers, p));
  }
  // best[s][k]: stages s.. holding the last k layers; choice[s][k]: layers of stage s.
  std::vector<std::vector<Score>> best(p + 1, std::vector<Score>(layers + 1));
  std::vector<std::vector<int>> pick(p, std::vector<int>(layers + 1, -1));
  best[p][0] = Score{0, 0};
  for (int s = p - 1; s >= 0; --s) {
    const int later = p - 1 - s;  // stages after s, each needing a layer
    for (int k = 1; k <= layers; ++k) {
      for (int n = 1; n + later <= k; ++n) {
        const Score& rest = best[s + 1][k - n];
        if (std::isinf(rest.slowest)) continue;
        const StageChoice ch = choose(stages[s], n, capacity);
        if (!ch.fits) continue;
        Score sc{std::max(rest.slowest, ch.seconds), rest.recomputed + ch.recomputed};
        // Strictly better only: on ties the smallest n (earlier stages hold more micro-batches).
        if (sc < best[s][k]) {
          best[s][k] = sc;
          pick[s][k] = n;
        }
      }
    }
  }
  if (std::isinf(best[0][layers].slowest)) {
    return Error(fmt::format(
        "no split of {} layers over {} stages fits in {} per GPU, even recomputing every layer",
        layers, p, format_bytes(capacity)));
  }
  StagePartition out;
  out.slowest_stage_seconds = best[0][layers].slowest;
  int k = layers;
  for (int s = 0; s < p; ++s) {
    const int n = pick[s][k];
    out.layers.push_back(n);
    out.recomputed.push_back(choose(stages[s], n, capacity).recomputed);
    k -= n;
  }
  return out;
}

Expected<std::vector<int>> recompute_to_fit(const Program& program, std::vector<int> recomputed,
                                            double saved_per_layer, double capacity) {
  const auto& segments = program.plan.segments;
  if (recomputed.size() != segments.size()) {
    return Error("recompute_to_fit: one count per segment expected");
  }
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(program);
  for (size_t l = 0; l < program.lanes.size(); ++l) {
    const double excess = peaks[l].peak - capacity;
    if (excess <= 0) continue;
    std::vector<int> mine;  // the lane's segments
    for (const auto& b : program.lanes[l].blocks) {
      if (std::find(mine.begin(), mine.end(), b.block.segment) == mine.end()) {
        mine.push_back(b.block.segment);
      }
    }
    const double saved = std::max(1, peaks[l].in_flight) * saved_per_layer;
    bool room = false;
    for (int s : mine) room |= recomputed[s] < segments[s].end_layer - segments[s].first_layer;
    if (saved <= 0 || !room) {
      return Error(fmt::format("GPU {} needs {} more than {} even recomputing every layer",
                               program.lanes[l].gpus.front(), format_bytes(excess),
                               format_bytes(capacity)));
    }
    const int more = std::max(1, static_cast<int>(std::ceil(excess / saved - 1e-9)));
    for (int s : mine) {
      const int n = segments[s].end_layer - segments[s].first_layer;
      recomputed[s] = std::min(n, recomputed[s] + more);
    }
  }
  return recomputed;
}

}  // namespace nnsim
