// A lane's ranks run in lockstep (docs/simulator.md, "Lanes"). A collective along axes outside
// the lane (data parallel, typically) runs one group per rank of the lane: the same
// communication over other GPUs and links. When every rank's groups cross links that nothing
// but that rank's groups and the same lane-wide traffic crosses, each rank's groups advance
// exactly as the first rank's do, and simulating the first rank's alone gives the same times;
// the others would only multiply the flows SimGrid's bandwidth solver shares on every event.
#pragma once

#include <tuple>
#include <vector>

#include "core/network.h"
#include "sim/collective_runner.h"

namespace nnsim {

// One communication crossing one link.
struct LinkUse {
  int instance = -1;  // the simulated lane that runs it
  int comm = -1;      // which communication (an id per distinct prepared communication)
  int rank = -1;      // for a per-rank collective, the lane rank whose group this is; else -1
  double bytes = 0;   // what it moves over the link
  auto key() const { return std::tie(instance, comm, rank, bytes); }
  bool operator<(const LinkUse& o) const { return key() < o.key(); }
  bool operator==(const LinkUse& o) const { return key() == o.key(); }
};

// Every link's uses, sorted (LinkUses::add, then sort_all).
struct LinkUses {
  explicit LinkUses(size_t links) : by_link(links) {}
  std::vector<std::vector<LinkUse>> by_link;
  // `comm`'s use of every link it crosses that is `relevant` (indexed by link).
  void add(const PreparedComm& comm, LinkUse use, const std::vector<bool>& relevant);
  void sort_all();
};

// A collective that runs one group per rank of a lane: groups[p] prepared alone for rank p.
struct PerRankCollective {
  int comm = -1;
  std::vector<const PreparedComm*> groups;
};

// For each simulated lane (its per-rank collectives, by instance), whether they may all run
// their first rank's group alone. A lane may when, for every other rank p and collective, rank
// p's group matches the first rank's flow for flow (bytes, and links of the same bandwidth and
// latency hop by hop), and each of its links carries exactly what the matching link of the
// first rank's group carries, with rank p's groups in place of the first rank's: no other
// rank's per-rank group crosses it, and other lanes' rank-p groups only where those lanes may
// too.
std::vector<bool> lanes_mirroring_first_rank(
    const std::vector<std::vector<PerRankCollective>>& per_lane, const Network& net,
    const LinkUses& uses);

}  // namespace nnsim
