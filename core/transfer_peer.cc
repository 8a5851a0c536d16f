#include "core/transfer_peer.h"

#include <algorithm>

namespace nnsim {

int replica_of(const Program& prog, int rank) {
  const int dp = prog.plan.mesh.axis_index(kDataParallelAxis);
  return dp < 0 ? 0 : prog.plan.mesh.coordinates(rank)[dp];
}

int lane_of(const Program& prog, int rank) {
  const int r0 = prog.rank_in_replica(rank, 0);
  for (size_t l = 0; l < prog.lanes.size(); ++l) {
    const std::vector<int>& ranks = prog.lanes[l].ranks;
    if (std::find(ranks.begin(), ranks.end(), r0) != ranks.end()) return static_cast<int>(l);
  }
  return -1;
}

int transfer_peer(const Program& prog, int rank, const Step& step) {
  if (step.kind != StepKind::kSend && step.kind != StepKind::kRecv) return -1;
  const int lane = lane_of(prog, rank);
  if (lane < 0) return -1;
  // The compiler names the peer lane; a step naming only the segment goes to its first lane
  // (the segment's source lane, Compiler::source_lane).
  const int peer_lane = step.peer_lane >= 0      ? step.peer_lane
                        : step.peer_segment >= 0 ? prog.lanes_of_segment[step.peer_segment].front()
                                                 : -1;
  if (peer_lane < 0) return -1;
  const std::vector<int>& mine = prog.lanes[lane].ranks;
  const std::vector<int>& theirs = prog.lanes[peer_lane].ranks;
  const auto at = std::find(mine.begin(), mine.end(), prog.rank_in_replica(rank, 0)) - mine.begin();
  if (at >= static_cast<std::ptrdiff_t>(theirs.size())) return -1;
  return prog.rank_in_replica(theirs[at], replica_of(prog, rank));
}

}  // namespace nnsim
