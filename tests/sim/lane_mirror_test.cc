// When a lane's per-rank collectives may run as their first rank's group alone: ranks on links
// of their own mirror; ranks sharing a NIC, or crossing another lane's other rank, do not; lanes
// whose ranks share links mirror together or not at all.
#include "sim/lane_mirror.h"

#include <gtest/gtest.h>

#include <memory>

#include <fmt/format.h>

#include "core/topology.h"

namespace nnsim {
namespace {

// Two nodes of four GPUs on one NVSwitch each; `nic_gpus` says which GPUs each of the node's
// NICs serves.
Topology two_nodes(const std::string& nic_gpus, int nics) {
  const std::string yaml = fmt::format(
      "name: t\ngpu: a100-sxm4-80gb\nnodes: 2\nnode:\n  gpus: 4\n"
      "  intra: {{kind: nvswitch, bandwidth: 300 GB/s, latency: 1 us}}\n"
      "  nics: {{count: {}, bandwidth: 25 GB/s, latency: 1 us, gpus: {}}}\n",
      nics, nic_gpus);
  Expected<Topology> t = parse_topology(yaml, "t.yaml");
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  return *t;
}

// Lanes of one simulation: each lane's per-rank all-reduces (one group per rank) and lane-wide
// all-reduces, with every link's uses.
class Lanes {
 public:
  explicit Lanes(const Topology& t)
      : net_(t), runner_(net_, hosts_, Algorithm::kRing, CommModel::ideal()) {}

  // A lane running an all-reduce of `bytes` over one group per rank.
  void add_lane(const std::vector<std::vector<int>>& rank_groups, double bytes = 1e8) {
    const int lane = static_cast<int>(per_lane_.size());
    per_lane_.emplace_back();
    PerRankCollective c{next_comm_++, {}};
    for (const auto& g : rank_groups) {
      comms_.push_back(
          std::make_unique<PreparedComm>(runner_.prepare({g}, CollectiveKind::kAllReduce, bytes)));
      crossings_.push_back(
          {comms_.back().get(), {lane, c.comm, static_cast<int>(c.groups.size())}});
      c.groups.push_back(comms_.back().get());
    }
    per_lane_.back().push_back(c);
  }
  // A collective of lane `lane` over all of `gpus` at once (a tensor-parallel one).
  void add_lane_wide(int lane, const std::vector<int>& gpus) {
    comms_.push_back(
        std::make_unique<PreparedComm>(runner_.prepare({gpus}, CollectiveKind::kAllReduce, 1e7)));
    crossings_.push_back({comms_.back().get(), {lane, next_comm_++}});
  }
  std::vector<bool> mirror() {
    LinkUses uses(net_.links().size());
    const std::vector<bool> all(net_.links().size(), true);
    for (const auto& [comm, use] : crossings_) uses.add(*comm, use, all);
    uses.sort_all();
    return lanes_mirroring_first_rank(per_lane_, net_, uses);
  }

 private:
  Network net_;
  std::vector<simgrid::s4u::Host*> hosts_;
  CollectiveRunner runner_;
  std::vector<std::unique_ptr<PreparedComm>> comms_;
  std::vector<std::pair<const PreparedComm*, LinkUse>> crossings_;
  std::vector<std::vector<PerRankCollective>> per_lane_;
  int next_comm_ = 0;
};

TEST(LaneMirror, RanksOnTheirOwnPortsAndNicsMirror) {
  // A lane of GPUs 0 and 1; each rank's data-parallel group reaches node 1 through its own NIC.
  Lanes lanes(two_nodes("[[0], [1], [2], [3]]", 4));
  lanes.add_lane({{0, 4}, {1, 5}});
  lanes.add_lane_wide(0, {0, 1});
  EXPECT_EQ(lanes.mirror(), std::vector<bool>{true});
}

TEST(LaneMirror, RanksSharingANicDoNot) {
  Lanes lanes(two_nodes("[[0, 1], [2, 3]]", 2));
  lanes.add_lane({{0, 4}, {1, 5}});
  EXPECT_EQ(lanes.mirror(), std::vector<bool>{false});
}

TEST(LaneMirror, GroupsOfOtherShapesDoNot) {
  Lanes lanes(two_nodes("[[0], [1], [2], [3]]", 4));
  lanes.add_lane({{0, 4}, {1, 5, 6}});
  EXPECT_EQ(lanes.mirror(), std::vector<bool>{false});
}

TEST(LaneMirror, AnotherLanesOtherRankOnTheSameNicStopsBoth) {
  // NIC 1 serves lane A's second rank (GPU 1) and lane B's first (GPU 2): run alone, each lane's
  // first rank would find its NIC to itself.
  Lanes lanes(two_nodes("[[0, 3], [1, 2]]", 2));
  lanes.add_lane({{0, 4}, {1, 5}});
  lanes.add_lane({{2, 6}, {3, 7}});
  EXPECT_EQ(lanes.mirror(), (std::vector<bool>{false, false}));
}

TEST(LaneMirror, LanesSharingLinksRankForRankMirrorTogether) {
  // NIC 0 serves both lanes' first ranks, NIC 1 both second ranks: alike.
  {
    Lanes lanes(two_nodes("[[0, 2], [1, 3]]", 2));
    lanes.add_lane({{0, 4}, {1, 5}});
    lanes.add_lane({{2, 6}, {3, 7}});
    EXPECT_EQ(lanes.mirror(), (std::vector<bool>{true, true}));
  }
  // Lane B also runs a collective of its second rank's GPU alone: NIC 1 now carries more than
  // NIC 0, and neither lane may drop its second rank.
  {
    Lanes lanes(two_nodes("[[0, 2], [1, 3]]", 2));
    lanes.add_lane({{0, 4}, {1, 5}});
    lanes.add_lane({{2, 6}, {3, 7}});
    lanes.add_lane_wide(1, {3, 7});
    EXPECT_EQ(lanes.mirror(), (std::vector<bool>{false, false}));
  }
}

}  // namespace
}  // namespace nnsim
