// DeepEP's expert exchange: the router's hit probabilities against enumeration, and the flows it
// decomposes into against the all-to-all it replaces.
#include "core/collective.h"

#include <functional>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

namespace nnsim {
namespace {

// Every (groups chosen, experts chosen) pair equally likely within its groups' choice, as the
// routing model assumes: the fraction of outcomes that pick one of experts [0, held).
double enumerate_hits(int experts, int per_token, int groups, int topk, int held) {
  const int size = experts / groups;
  double hits = 0, weight_all = 0;
  std::vector<int> chosen_groups;
  std::function<void(int)> pick_groups = [&](int from) {
    if (static_cast<int>(chosen_groups.size()) == topk) {
      std::vector<int> pool;
      for (int g : chosen_groups) {
        for (int e = g * size; e < (g + 1) * size; ++e) pool.push_back(e);
      }
      // Subsets of per_token experts of the pool, each equally likely.
      double subsets = 0, hit = 0;
      std::vector<int> chosen;
      std::function<void(size_t)> pick = [&](size_t i) {
        if (static_cast<int>(chosen.size()) == per_token) {
          subsets += 1;
          for (int e : chosen) {
            if (e < held) {
              hit += 1;
              break;
            }
          }
          return;
        }
        for (size_t j = i; j < pool.size(); ++j) {
          chosen.push_back(pool[j]);
          pick(j + 1);
          chosen.pop_back();
        }
      };
      pick(0);
      hits += hit / subsets;
      weight_all += 1;
      return;
    }
    for (int g = from; g < groups; ++g) {
      chosen_groups.push_back(g);
      pick_groups(g + 1);
      chosen_groups.pop_back();
    }
  };
  pick_groups(0);
  return hits / weight_all;
}

TEST(ExpertRouting, HitProbabilitiesMatchEnumeration) {
  struct Case {
    int experts, per_token, groups, topk, held;
  };
  for (const Case& c : std::vector<Case>{{8, 2, 1, 1, 2},   // no group limit
                                         {8, 2, 4, 2, 1},   // part of a group
                                         {8, 2, 4, 2, 2},   // one whole group
                                         {8, 2, 4, 2, 4},   // two groups
                                         {12, 3, 3, 2, 4},  // one of three groups
                                         {16, 4, 8, 4, 4},  // DeepSeek-V3's shape, scaled
                                         {16, 4, 8, 4, 1}}) {
    const ExpertRouting r{static_cast<double>(c.experts), static_cast<double>(c.per_token), 1,
                          static_cast<double>(c.groups), static_cast<double>(c.topk)};
    EXPECT_NEAR(expert_hit_probability(r, c.held),
                enumerate_hits(c.experts, c.per_token, c.groups, c.topk, c.held), 1e-12)
        << c.experts << " experts, top-" << c.per_token << ", " << c.topk << " of " << c.groups
        << " groups, " << c.held << " held";
  }
  const ExpertRouting r{8, 2, 1, 4, 2};
  EXPECT_EQ(expert_hit_probability(r, 8), 1);
  EXPECT_EQ(expert_hit_probability(r, 0), 0);
}

struct TwoNodes : ::testing::Test {
  void SetUp() override {
    Expected<Topology> t = load_topology("dgx-h100-superpod");
    ASSERT_TRUE(t.ok());
    Expected<Topology> r = resize_topology(*t, 2);
    ASSERT_TRUE(r.ok());
    topo = *r;
    gpus.resize(16);
    std::iota(gpus.begin(), gpus.end(), 0);
  }
  Topology topo;
  std::vector<int> gpus;
};

// 64 experts, top-8, in 2 groups of which a token uses 1 (node-limited routing to one node):
// a token crosses to the other node with probability 1/2, once, to the GPU of its own index.
TEST_F(TwoNodes, ExpertExchangeCrossesOncePerTokenAndNode) {
  const Network net(topo);
  const ExpertRouting routing{64, 8, 1, 2, 1};
  const double bytes = 8 * 1024.0 * 1024;  // a GPU's routed copies: 8 per token
  const double token_bytes = bytes / 8;
  CollectiveFlows c = decompose_collective(CollectiveKind::kExpertExchange, gpus, bytes,
                                           Algorithm::kAuto, net, CommModel::ideal(), routing);
  ASSERT_EQ(c.algorithm, "expert exchange");
  double across = 0, within = 0;
  for (const Flow& f : c.flows) {
    const bool crosses = topo.node_of(f.src) != topo.node_of(f.dst);
    if (crosses) {
      EXPECT_EQ(topo.local_index(f.src), topo.local_index(f.dst));
      EXPECT_NEAR(f.bytes, 0.5 * token_bytes, 1e-9 * token_bytes);
      across += f.bytes;
    } else {
      within += f.bytes;
    }
  }
  EXPECT_NEAR(across, 16 * 0.5 * token_bytes, 1e-9 * across);
  // Within a node: from each GPU to each other, its own and the forwarded tokens that have an
  // expert there (2 nodes x the hit probability of 4 experts).
  const double to_gpu = expert_hit_probability(routing, 4);
  EXPECT_NEAR(within, 2 * 8 * 7 * 2 * token_bytes * to_gpu, 1e-9 * within);
  // NCCL's all-to-all sends each of the 8 copies: half of them cross, 8x the exchange's bytes.
  CollectiveFlows a = decompose_collective(CollectiveKind::kAllToAll, gpus, bytes, Algorithm::kAuto,
                                           net, CommModel::ideal());
  double a2a_across = 0;
  for (const Flow& f : a.flows) {
    if (topo.node_of(f.src) != topo.node_of(f.dst)) a2a_across += f.bytes;
  }
  EXPECT_NEAR(a2a_across, 16 * bytes / 2, 1e-9 * a2a_across);
  LinkLoadScratch s;
  EXPECT_LT(isolated_seconds(c, net, s), 0.5 * isolated_seconds(a, net, s));
}

TEST_F(TwoNodes, ExpertExchangeWithoutRoutingIsTheAllToAll) {
  const Network net(topo);
  CollectiveFlows c = decompose_collective(CollectiveKind::kExpertExchange, gpus, 1e6,
                                           Algorithm::kAuto, net, CommModel::ideal());
  CollectiveFlows a = decompose_collective(CollectiveKind::kAllToAll, gpus, 1e6, Algorithm::kAuto,
                                           net, CommModel::ideal());
  EXPECT_EQ(c.algorithm, "all-to-all");
  ASSERT_EQ(c.flows.size(), a.flows.size());
  for (size_t i = 0; i < c.flows.size(); ++i) EXPECT_EQ(c.flows[i].bytes, a.flows[i].bytes);
}

}  // namespace
}  // namespace nnsim
