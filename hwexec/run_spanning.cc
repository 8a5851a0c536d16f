// Segments spanning pipeline stages (run_spanning.h).
#include "hwexec/run_spanning.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "hwexec/run_layout.h"

namespace nnsim::hwexec {

namespace {

// `rank`'s coordinates with those order `o` fixes: its counterpart in that order.
int rank_in_order(const Plan& plan, int rank, int o) {
  std::vector<int> c = plan.mesh.coordinates(rank);
  for (const auto& [axis, v] : plan.schedule[o].devices) c[plan.mesh.axis_index(axis)] = v;
  return plan.mesh.rank_of(c);
}

bool holds(const Plan& plan, int segment, int rank) {
  return in_slice(plan.mesh, plan.segments[segment].devices, plan.mesh.coordinates(rank));
}

int order_of(const Plan& plan, int rank) {
  const std::vector<int> c = plan.mesh.coordinates(rank);
  for (std::size_t o = 0; o < plan.schedule.size(); ++o) {
    if (in_slice(plan.mesh, plan.schedule[o].devices, c)) return static_cast<int>(o);
  }
  return -1;
}

// The first order (schedule index) the segment runs on; -1: none.
int first_order(const Plan& plan, int segment, int rank) {
  for (std::size_t o = 0; o < plan.schedule.size(); ++o) {
    if (holds(plan, segment, rank_in_order(plan, rank, static_cast<int>(o)))) {
      return static_cast<int>(o);
    }
  }
  return -1;
}

}  // namespace

std::vector<std::string> pipeline_axes_of(const Plan& plan) {
  std::set<std::string> pp;
  for (const DeviceOrder& o : plan.schedule) {
    for (const auto& [a, c] : o.devices) pp.insert(a);
  }
  return {pp.begin(), pp.end()};
}

bool spans_orders(const Plan& plan, int segment) {
  for (const std::string& a : pipeline_axes_of(plan)) {
    if (plan.mesh.axis_size(a) > 1 && !plan.segments[segment].devices.count(a)) return true;
  }
  return false;
}

bool any_spanning(const Plan& plan) {
  for (std::size_t s = 0; s < plan.segments.size(); ++s) {
    if (spans_orders(plan, static_cast<int>(s))) return true;
  }
  return false;
}

TransferEnds transfer_ends(const Plan& plan, int rank, int from, int to) {
  TransferEnds e;
  const bool has_from = holds(plan, from, rank), has_to = holds(plan, to, rank);
  const int source = first_order(plan, from, rank);
  if (has_to) {
    if (has_from) {
      e.local = true;
    } else if (source >= 0) {
      e.recv_from = rank_in_order(plan, rank, source);
    }
  }
  if (has_from && source == order_of(plan, rank)) {
    for (std::size_t o = 0; o < plan.schedule.size(); ++o) {
      const int peer = rank_in_order(plan, rank, static_cast<int>(o));
      if (peer != rank && holds(plan, to, peer) && !holds(plan, from, peer)) {
        e.send_to.push_back(peer);
      }
    }
  }
  return e;
}

VocabSplit vocab_split(const Plan& plan, int rank, const std::string& op,
                       const std::vector<int>& tp_group, const std::string& tp_axes) {
  VocabSplit v;
  const std::vector<std::string> axes = split_axes(plan, op, Dim::kVocab);
  const std::vector<std::string> pp = pipeline_axes_of(plan);
  auto pipeline = [&](const std::string& a) {
    return std::find(pp.begin(), pp.end(), a) != pp.end();
  };
  for (const std::string& a : axes) v.ways *= plan.mesh.axis_size(a);
  if (std::none_of(axes.begin(), axes.end(), pipeline)) {
    // Tensor parallelism only: the executor's tensor-parallel group, as before.
    v.per_axis.push_back({tp_group, tp_axes, false});
    v.group = tp_group;
    v.axes = tp_axes;
    return v;
  }
  v.pipeline = true;
  const Mesh& mesh = plan.mesh;
  const std::vector<int> coords = mesh.coordinates(rank);
  // The shard: the coordinates along the split's axes, the first one outermost.
  v.index = 0;
  for (const std::string& a : axes) {
    v.index = v.index * mesh.axis_size(a) + coords[mesh.axis_index(a)];
  }
  for (const MeshAxis& a : mesh.axes) {  // mesh order, as the program's conversions
    if (std::find(axes.begin(), axes.end(), a.name) == axes.end() || a.size == 1) continue;
    v.per_axis.push_back({mesh.ranks_along(rank, {a.name}), a.name, pipeline(a.name)});
    v.axes += (v.axes.empty() ? "" : "+") + a.name;
  }
  v.group = mesh.ranks_along(rank, axes);
  return v;
}

std::optional<Refusal> check_spanning_runnable(const Plan& plan) {
  for (std::size_t si = 0; si < plan.segments.size(); ++si) {
    const Segment& s = plan.segments[si];
    if (!spans_orders(plan, static_cast<int>(si))) continue;
    const std::string field = fmt::format("segments[{}]", si);
    if (s.end_layer > s.first_layer) {
      return Refusal{
          field + ".devices",
          fmt::format("segment '{}' spans several pipeline stages with layers [{}, {}), which "
                      "is not supported yet (only the embedding's and the head's segments "
                      "without layers, as --shard-embedding and --shard-head write them, may "
                      "span them); give it a pipeline coordinate",
                      s.name, s.first_layer, s.end_layer)};
    }
  }
  // Sequence parallelism with a spanning embedding whose partial sums no operator of its own
  // reads (rotary or ALiBi positions, no dropout): the first stage's input gradient goes whole
  // to the embedding's other stages, which the executor does as a scatter-gather (each tp rank
  // sends its slice, the receivers all-gather), as the program does with it on.
  bool sequence_parallel = false;
  for (const PartitionRule& r : plan.partition) {
    if (!match_pattern(r.match, "attn.norm")) continue;
    for (const DimSplit& d : r.splits) sequence_parallel = d.dim == Dim::kSeq && !d.axes.empty();
  }
  for (std::size_t si = 0; si < plan.segments.size() && sequence_parallel; ++si) {
    const Segment& s = plan.segments[si];
    if (s.embedding && spans_orders(plan, static_cast<int>(si)) &&
        plan.model.position != PositionKind::kLearned && !plan.model.dropout &&
        !plan.comm.pp_scatter_gather) {
      return Refusal{
          "communication.pp_scatter_gather",
          fmt::format("false with sequence parallelism, {} positions and the embedding's "
                      "segment '{}' spanning the pipeline stages is not supported yet (the "
                      "first stage would send the embedding's other stages its whole input "
                      "gradient); set it true",
                      to_string(plan.model.position), s.name)};
    }
  }
  return std::nullopt;
}

}  // namespace nnsim::hwexec
