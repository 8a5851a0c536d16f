// Segments onto devices: the lanes (schedule orders) and which of them hold each segment.
#include "core/compiler.h"

#include <fmt/format.h>

namespace nnsim::detail {

namespace {

bool slice_contains(const MeshSlice& slice, const Mesh& mesh, const std::vector<int>& coord) {
  for (const auto& [axis, c] : slice) {
    if (coord[mesh.axis_index(axis)] != c) return false;
  }
  return true;
}

}  // namespace

Status Compiler::build_lanes() {
  const int dp_axis = mesh.axis_index(kDataParallelAxis);
  const int ranks = mesh.num_ranks();
  // Lanes: the schedule's slices within replica 0.
  lane_of_rank.assign(ranks, -1);
  for (size_t o = 0; o < plan.schedule.size(); ++o) {
    Lane lane;
    lane.slice = plan.schedule[o].devices;
    for (int r = 0; r < ranks; ++r) {
      auto c = mesh.coordinates(r);
      if (c[dp_axis] != 0 || !slice_contains(lane.slice, mesh, c)) continue;
      if (lane_of_rank[r] >= 0) {
        return Error(
            fmt::format("rank {} is in two schedule orders ({} and {}); give every "
                        "device exactly one order",
                        r, lane_of_rank[r], o));
      }
      lane_of_rank[r] = static_cast<int>(o);
      lane.ranks.push_back(r);
      lane.gpus.push_back(prog.gpu_of_rank[r]);
    }
    if (lane.ranks.empty()) {
      return Error(fmt::format("schedule order {} matches no device", o));
    }
    prog.lanes.push_back(std::move(lane));
  }
  for (int r = 0; r < ranks; ++r) {
    if (mesh.coordinates(r)[dp_axis] == 0 && lane_of_rank[r] < 0) {
      return Error(
          fmt::format("rank {} (coordinates {}) is in no schedule order; every device "
                      "needs one",
                      r, fmt::join(mesh.coordinates(r), ",")));
    }
  }
  // Axes a lane spans: the axes no schedule slice fixes (besides dp).
  lane_axes = 0;
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    if (static_cast<int>(a) == dp_axis) continue;
    bool fixed = false;
    for (const auto& o : plan.schedule) fixed = fixed || o.devices.count(mesh.axes[a].name) > 0;
    if (!fixed) lane_axes |= 1u << a;
  }
  // Each segment runs on the lanes whose devices are its devices: one, or several when its
  // slice leaves an axis the orders fix unfixed (a block spanning pipeline stages).
  lanes_of_segment.assign(plan.segments.size(), {});
  for (size_t s = 0; s < plan.segments.size(); ++s) {
    for (size_t o = 0; o < prog.lanes.size(); ++o) {
      auto c = mesh.coordinates(prog.lanes[o].ranks.front());
      if (!slice_contains(plan.segments[s].devices, mesh, c)) continue;
      // Every lane rank must be in the segment and vice versa (within replica 0).
      for (int r : prog.lanes[o].ranks) {
        if (!slice_contains(plan.segments[s].devices, mesh, mesh.coordinates(r))) {
          return Error(
              fmt::format("segment '{}' covers part of schedule order {} only; a "
                          "segment's devices must be whole orders",
                          plan.segments[s].name, o));
        }
      }
      lanes_of_segment[s].push_back(static_cast<int>(o));
    }
    if (lanes_of_segment[s].empty()) {
      return Error(
          fmt::format("segment '{}' is on no device of any schedule order", plan.segments[s].name));
    }
  }
  return Status::Ok();
}

}  // namespace nnsim::detail
