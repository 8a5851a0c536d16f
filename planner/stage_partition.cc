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

// Per segment, of the slowest variant of each block kind summed over the kinds: the layers'
// time split by block shape (planner/estimator.h, TemplateTime) and the rest.
struct SegmentTimes {
  double layers = 0;               // layers' forward, backward and any uniform recomputation
  std::vector<double> block_only;  // per block shape, with several (TemplateTime::block_only)
  double other = 0;
};

std::vector<SegmentTimes> segment_times(const Program& p) {
  const std::vector<TemplateTime> times = template_times(p);
  std::map<std::pair<int, int>, TemplateTime> worst;  // (segment, kind) -> slowest variant
  for (size_t t = 0; t < p.templates.size(); ++t) {
    if (p.templates[t].paired) continue;  // its forward and backward are templates too
    const auto key = std::make_pair(p.templates[t].segment, static_cast<int>(p.templates[t].kind));
    TemplateTime& w = worst[key];
    const TemplateTime& x = times[t];
    if (x.layers + x.layers_recompute + x.other > w.layers + w.layers_recompute + w.other) w = x;
  }
  std::vector<SegmentTimes> out(p.plan.segments.size());
  for (const auto& [key, t] : worst) {
    SegmentTimes& o = out[key.first];
    o.layers += t.layers + t.layers_recompute;
    o.block_only.resize(t.block_only.size(), 0);
    for (size_t b = 0; b < t.block_only.size(); ++b) o.block_only[b] += t.block_only[b];
    o.other += t.other;
  }
  return out;
}

// The lane running each segment (the first, for a segment spanning several; -1: none).
std::vector<int> segment_lanes(const Program& p) {
  std::vector<int> out(p.plan.segments.size(), -1);
  for (size_t l = 0; l < p.lanes.size(); ++l) {
    for (const auto& b : p.lanes[l].blocks) {
      const size_t s = static_cast<size_t>(b.block.segment);
      if (s < out.size() && out[s] < 0) out[s] = static_cast<int>(l);
    }
  }
  return out;
}

// A layer's parameters on one device, each weight divided by its split factors (tensor
// parallelism splits most of a block; expert parallelism its experts).
Expected<double> layer_parameters_per_device(const Program& p, const GraphPart& part) {
  Expected<std::vector<OpPartition>> parts = resolve_partitions(part, p.plan);
  if (!parts) return parts.error();
  double params = 0;
  for (size_t i = 0; i < part.ops.size(); ++i) {
    for (const TensorSpec& w : part.ops[i].weights) {
      params += w.elements / (*parts)[i].factor(w.dims, p.plan.mesh);
    }
  }
  return params;
}

// The time of a segment's `shape_n` layers of block shape `b`, of its `n`: their own operators
// and their share of what every shape has.
double shape_seconds(const SegmentTimes& t, int n, int shape_n, size_t b) {
  if (shape_n == n) return t.layers;
  double shared = t.layers;
  for (double only : t.block_only) shared -= only;
  return shared * shape_n / n + (b < t.block_only.size() ? t.block_only[b] : 0);
}

// A block shape no stage holds keeps zero costs; one some stages lack gets the mean of the rest.
void fill_missing(std::vector<StageCosts>& out, const std::vector<bool>& has, size_t shape) {
  LayerCosts mean;
  int n = 0;
  for (size_t s = 0; s < out.size(); ++s) {
    if (!has[s]) continue;
    const LayerCosts& c = out[s].blocks[shape];
    mean.seconds += c.seconds;
    mean.recompute_seconds += c.recompute_seconds;
    mean.static_bytes += c.static_bytes;
    mean.activation_bytes += c.activation_bytes;
    mean.recomputed_activation_bytes += c.recomputed_activation_bytes;
    ++n;
  }
  if (n == 0) return;
  for (size_t s = 0; s < out.size(); ++s) {
    if (has[s]) continue;
    LayerCosts& c = out[s].blocks[shape];
    c.seconds = mean.seconds / n;
    c.recompute_seconds = mean.recompute_seconds / n;
    c.static_bytes = mean.static_bytes / n;
    c.activation_bytes = mean.activation_bytes / n;
    c.recomputed_activation_bytes = mean.recomputed_activation_bytes / n;
  }
}

}  // namespace

std::vector<LayerTraits> layer_traits(const Program& plain, const Program& recomputed) {
  std::vector<LayerTraits> out(plain.graph.block_of_layer.size());
  for (size_t l = 0; l < out.size(); ++l) {
    out[l].block = plain.graph.block_of_layer[l];
    if (l < plain.layer_window_seconds.size() && l < recomputed.layer_window_seconds.size()) {
      out[l].window_seconds = plain.layer_window_seconds[l];
      out[l].recompute_window_seconds =
          recomputed.layer_window_seconds[l] - plain.layer_window_seconds[l];
    }
  }
  return out;
}

namespace {

// measure_stage_costs, or without `memory` its times alone (any segments a device).
Expected<std::vector<StageCosts>> measure_costs(const Program& plain, const Program& recomputed,
                                                bool memory) {
  const auto& segments = plain.plan.segments;
  if (segments.size() != recomputed.plan.segments.size()) {
    return Error("stage costs: the two programs have different segments");
  }
  const std::vector<int>& shape_of = plain.graph.block_of_layer;
  const size_t shapes = plain.graph.blocks.size();
  std::vector<SegmentTimes> t0 = segment_times(plain);
  std::vector<SegmentTimes> t1 = segment_times(recomputed);
  // Costs of layers attending fully: what the segments' windows saved goes back on.
  const std::vector<LayerTraits> traits = layer_traits(plain, recomputed);
  for (size_t s = 0; s < segments.size(); ++s) {
    for (int l = segments[s].first_layer;
         l < segments[s].end_layer && l < static_cast<int>(traits.size()); ++l) {
      t0[s].layers += traits[l].window_seconds;
      t1[s].layers += traits[l].window_seconds + traits[l].recompute_window_seconds;
    }
  }
  const std::vector<int> lanes = segment_lanes(plain);
  std::vector<LaneMemoryPeak> peaks;
  std::vector<double> shape_params(shapes, 0);  // a layer's parameters on one device
  if (memory) {
    peaks = lane_memory_peaks(plain);
    for (size_t b = 0; b < shapes; ++b) {
      const Expected<double> e = layer_parameters_per_device(plain, plain.graph.blocks[b]);
      if (!e) return e.error();
      shape_params[b] = *e;
    }
  }
  std::vector<StageCosts> out;
  std::vector<std::vector<bool>> has(shapes);  // per shape, per stage
  for (size_t s = 0; s < segments.size(); ++s) {
    const int first = segments[s].first_layer;
    const int n = segments[s].end_layer - first;
    const int lane = lanes[s];
    if (n < 1 || lane < 0 || segments[s].end_layer > static_cast<int>(shape_of.size())) {
      return Error(fmt::format("stage costs: segment {} has no layers or no device", s));
    }
    std::vector<int> shape_n(shapes, 0);
    for (int l = first; l < first + n; ++l) ++shape_n[shape_of[l]];
    for (size_t b = 0; b < shapes; ++b) has[b].push_back(shape_n[b] > 0);
    const Lane& ln = plain.lanes[lane];
    const double static_bytes =
        ln.memory.weights + ln.memory.gradients + ln.memory.optimizer + ln.memory.gathered;
    const double bytes_per_parameter = ln.parameters > 0 ? static_bytes / ln.parameters : 0;
    const double in_flight = memory ? std::max(1, peaks[lane].in_flight) : 1;
    StageCosts c;
    c.blocks.resize(shapes);
    c.device = lane;
    c.in_flight = static_cast<int>(in_flight);
    c.other_seconds = t0[s].other;
    double layer_bytes = 0;  // the stage's layers' share of its peak
    for (size_t b = 0; b < shapes; ++b) {
      const int k = shape_n[b];
      if (k == 0) continue;
      LayerCosts& lc = c.blocks[b];
      const double t = shape_seconds(t0[s], n, k, b);
      lc.seconds = t / k;
      lc.recompute_seconds = std::max(0.0, (shape_seconds(t1[s], n, k, b) - t) / k);
      if (!memory) continue;
      lc.static_bytes = bytes_per_parameter * shape_params[b];
      // Every layer of a shape keeps the same activations: the segment's first one's.
      const int l = static_cast<int>(
          std::find(shape_of.begin() + first, shape_of.begin() + first + n, static_cast<int>(b)) -
          shape_of.begin());
      lc.activation_bytes = plain.layer_activation_bytes.at(l);
      lc.recomputed_activation_bytes = recomputed.layer_activation_bytes.at(l);
      layer_bytes += k * (lc.static_bytes + in_flight * lc.activation_bytes);
    }
    if (memory) c.fixed_bytes = peaks[lane].peak - layer_bytes;
    out.push_back(c);
  }
  for (size_t b = 0; b < shapes; ++b) fill_missing(out, has[b], b);
  return out;
}

}  // namespace

Expected<std::vector<StageCosts>> measure_stage_costs(const Program& plain,
                                                      const Program& recomputed) {
  std::vector<int> lanes = segment_lanes(plain);
  std::sort(lanes.begin(), lanes.end());
  if (std::adjacent_find(lanes.begin(), lanes.end()) != lanes.end()) {
    return Error(
        "stage costs: a device holds several segments (virtual stages); the partitioner "
        "handles one segment per stage");
  }
  return measure_costs(plain, recomputed, true);
}

Expected<std::vector<StageCosts>> measure_segment_times(const Program& plain,
                                                        const Program& recomputed) {
  return measure_costs(plain, recomputed, false);
}

namespace {

// One stage holding `n` layers: the fewest recomputed layers that make it fit, and its time.
struct StageChoice {
  bool fits = false;
  int recomputed = 0;
  double seconds = 0;
};

// Sums over the layers before each one (entry l: layers 0..l-1).
struct LayerPrefix {
  std::vector<std::vector<int>> count;  // per block shape, the layers of that shape
  std::vector<double> window_seconds, recompute_window_seconds;

  LayerPrefix(const std::vector<LayerTraits>& layers, size_t shapes)
      : count(shapes, std::vector<int>(layers.size() + 1, 0)),
        window_seconds(layers.size() + 1, 0),
        recompute_window_seconds(layers.size() + 1, 0) {
    for (size_t l = 0; l < layers.size(); ++l) {
      for (size_t b = 0; b < shapes; ++b) {
        count[b][l + 1] = count[b][l] + (layers[l].block == static_cast<int>(b) ? 1 : 0);
      }
      window_seconds[l + 1] = window_seconds[l] + layers[l].window_seconds;
      recompute_window_seconds[l + 1] =
          recompute_window_seconds[l] + layers[l].recompute_window_seconds;
    }
  }
};

// How many block shapes the stages and layers name between them.
size_t shape_count(const std::vector<StageCosts>& stages, const std::vector<LayerTraits>& layers) {
  size_t n = 1;
  for (const StageCosts& s : stages) n = std::max(n, s.blocks.size());
  for (const LayerTraits& l : layers)
    n = std::max(n, static_cast<size_t>(std::max(0, l.block)) + 1);
  return n;
}

// One layer of block shape `b` on stage `c` (zero costs for a shape it was not measured with).
const LayerCosts& costs_of(const StageCosts& c, size_t b) {
  static const LayerCosts kNone;
  return b < c.blocks.size() ? c.blocks[b] : kNone;
}

// The stage holding layers [first, first + n), recomputing its first layers.
StageChoice choose(const StageCosts& c, const LayerPrefix& before, int first, int n,
                   double capacity) {
  const size_t shapes = before.count.size();
  // Layers of shape b among the stage's first k.
  const auto in_first = [&](size_t b, int k) {
    return before.count[b][first + k] - before.count[b][first];
  };
  StageChoice ch;
  double need = c.fixed_bytes;
  std::vector<double> saved_per_layer(shapes);  // what recomputing one layer of a shape frees
  size_t held = 0, only = 0;                    // shapes the stage holds; the last of them
  for (size_t b = 0; b < shapes; ++b) {
    const LayerCosts& lc = costs_of(c, b);
    const int nb = in_first(b, n);
    need += nb * (lc.static_bytes + c.in_flight * lc.activation_bytes);
    saved_per_layer[b] = c.in_flight * (lc.activation_bytes - lc.recomputed_activation_bytes);
    if (nb > 0) ++held, only = b;
  }
  int k = 0;
  if (need > capacity) {
    if (held <= 1) {
      const double saved = saved_per_layer[only];
      if (saved <= 0) return ch;
      k = static_cast<int>(std::ceil((need - capacity) / saved - 1e-9));
    } else {
      // The first k layers' savings grow with k (no shape keeps more when recomputed).
      const auto saved = [&](int k) {
        double sum = 0;
        for (size_t b = 0; b < shapes; ++b)
          sum += in_first(b, k) * std::max(0.0, saved_per_layer[b]);
        return sum;
      };
      const double excess = need - capacity;
      while (k <= n && saved(k) < excess * (1 - 1e-9)) ++k;
    }
    if (k > n) return ch;
  }
  ch.fits = true;
  ch.recomputed = k;
  ch.seconds = c.other_seconds;
  for (size_t b = 0; b < shapes; ++b) ch.seconds += in_first(b, n) * costs_of(c, b).seconds;
  for (size_t b = 0; b < shapes; ++b) {
    ch.seconds += in_first(b, k) * costs_of(c, b).recompute_seconds;
  }
  ch.seconds =
      ch.seconds - (before.window_seconds[first + n] - before.window_seconds[first]) -
      (before.recompute_window_seconds[first + k] - before.recompute_window_seconds[first]);
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

Expected<StagePartition> partition_stages(const std::vector<StageCosts>& stages,
                                          const std::vector<LayerTraits>& traits, double capacity) {
  const int p = static_cast<int>(stages.size());
  const int layers = static_cast<int>(traits.size());
  if (p < 1 || layers < p) {
    return Error(fmt::format("cannot split {} layers over {} stages", layers, p));
  }
  const LayerPrefix before(traits, shape_count(stages, traits));
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
        const StageChoice ch = choose(stages[s], before, layers - k, n, capacity);
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
    out.recomputed.push_back(choose(stages[s], before, layers - k, n, capacity).recomputed);
    k -= n;
  }
  return out;
}

std::vector<double> stage_seconds(const std::vector<StageCosts>& stages,
                                  const std::vector<LayerTraits>& traits,
                                  const std::vector<int>& layers) {
  const LayerPrefix before(traits, shape_count(stages, traits));
  const double unlimited = std::numeric_limits<double>::infinity();
  std::vector<double> out;
  int first = 0;
  for (size_t s = 0; s < stages.size() && s < layers.size(); ++s) {
    if (first + layers[s] > static_cast<int>(traits.size())) break;
    out.push_back(choose(stages[s], before, first, layers[s], unlimited).seconds);
    first += layers[s];
  }
  return out;
}

namespace {

// The busiest device's time and the slowest segment's of a split over virtual stages.
struct VirtualScore {
  double busiest = 0;
  double slowest = 0;
  // Lexicographic, equal within a part in a billion (sums of the same costs).
  bool operator<(const VirtualScore& o) const {
    const auto less = [](double a, double b) { return a < b * (1 - 1e-9); };
    if (less(busiest, o.busiest)) return true;
    if (less(o.busiest, busiest)) return false;
    return less(slowest, o.slowest);
  }
};

VirtualScore virtual_score(const std::vector<StageCosts>& segments,
                           const std::vector<LayerTraits>& traits, const std::vector<int>& layers) {
  const std::vector<double> t = stage_seconds(segments, traits, layers);
  std::map<int, double> device;
  VirtualScore out;
  for (size_t k = 0; k < t.size(); ++k) {
    device[segments[k].device] += t[k];
    out.slowest = std::max(out.slowest, t[k]);
  }
  for (const auto& [d, seconds] : device) out.busiest = std::max(out.busiest, seconds);
  return out;
}

}  // namespace

std::vector<int> balance_virtual_stages(const std::vector<StageCosts>& segments,
                                        const std::vector<LayerTraits>& traits,
                                        std::vector<int> layers) {
  const int n = static_cast<int>(segments.size());
  if (static_cast<int>(layers.size()) != n ||
      stage_seconds(segments, traits, layers).size() != layers.size()) {
    return layers;
  }
  VirtualScore now = virtual_score(segments, traits, layers);
  // Each pass moves the layer whose move helps most; a pass that finds none ends the search.
  const int passes = n * static_cast<int>(traits.size());
  for (int pass = 0; pass < passes; ++pass) {
    std::vector<int> pick;
    VirtualScore best = now;
    for (int from = 0; from < n; ++from) {
      // Every segment keeps a layer but the last, which may hold the head alone.
      if (layers[from] <= (from == n - 1 ? 0 : 1)) continue;
      for (int to = 0; to < n; ++to) {
        if (to == from) continue;
        std::vector<int> moved = layers;
        --moved[from];
        ++moved[to];
        const VirtualScore s = virtual_score(segments, traits, moved);
        if (s < best) {
          best = s;
          pick = std::move(moved);
        }
      }
    }
    if (pick.empty()) break;
    layers = std::move(pick);
    now = best;
  }
  return layers;
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
