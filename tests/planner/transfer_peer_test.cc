// The other end of each pipeline transfer of a compiled program, rank by rank
// (core/transfer_peer.h): interleaved chunks that wrap from the last stage to the first, the
// tensor-parallel place and the data-parallel replica kept, and a head spanning the stages fed
// from the last stage.
#include "core/transfer_peer.h"

#include <set>
#include <string>

#include <gtest/gtest.h>

#include "core/model.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "planner/schedules.h"

namespace nnsim {
namespace {

Program compile(const std::string& model, const std::string& topology, int nodes,
                const MegatronOptions& o) {
  Expected<ModelSpec> m = load_model(model);
  EXPECT_TRUE(m.ok());
  Expected<Topology> t = load_topology(topology);
  EXPECT_TRUE(t.ok());
  Expected<Topology> sized = resize_topology(*t, nodes);
  EXPECT_TRUE(sized.ok());
  Expected<Plan> plan = build_megatron_plan(*m, *sized, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  if (!plan.ok()) return Program{};
  Expected<Program> prog = compile_plan(*plan, *sized);
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return prog.ok() ? *prog : Program{};
}

TEST(TransferPeer, InterleavedChunksWrapToTheFirstStageInTheSameReplicaAndPlace) {
  MegatronOptions o;
  o.tp = 2;
  o.pp = 2;
  o.vpp = 2;
  o.dp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  o.global_batch = 4;  // 2 micro-batches per replica
  const Program prog = compile("gpt3-1.3b", "dgx-h100-superpod", 1, o);
  ASSERT_EQ(prog.lanes.size(), 2u);
  const Mesh& mesh = prog.plan.mesh;
  const int pp = mesh.axis_index("pp"), tp = mesh.axis_index("tp"), dp = mesh.axis_index("dp");
  ASSERT_GE(pp, 0);
  ASSERT_GE(tp, 0);
  ASSERT_GE(dp, 0);
  int wrapped = 0, transfers = 0;
  for (int rank = 0; rank < mesh.num_ranks(); ++rank) {
    const std::vector<int> c = mesh.coordinates(rank);
    EXPECT_EQ(replica_of(prog, rank), c[dp]);
    const int lane = lane_of(prog, rank);
    ASSERT_EQ(lane, c[pp]) << "rank " << rank;  // one order per stage
    for (const BlockInstance& b : prog.lanes[lane].blocks) {
      for (const Step& s : prog.templates[b.template_index].steps) {
        const int peer = transfer_peer(prog, rank, s);
        if (s.kind != StepKind::kSend && s.kind != StepKind::kRecv) {
          EXPECT_EQ(peer, -1);
          continue;
        }
        ++transfers;
        ASSERT_GE(peer, 0);
        const std::vector<int> p = mesh.coordinates(peer);
        EXPECT_EQ(lane_of(prog, peer), s.peer_lane);
        EXPECT_NE(p[pp], c[pp]);
        EXPECT_EQ(p[tp], c[tp]) << "rank " << rank << " pairs with another tp place";
        EXPECT_EQ(p[dp], c[dp]) << "rank " << rank << " pairs with another replica";
        // Stage 1's first chunk hands its output to stage 0's second chunk: no next stage.
        if (c[pp] == 1 && s.kind == StepKind::kSend && !s.gradient) ++wrapped;
      }
    }
  }
  EXPECT_GT(transfers, 0);
  EXPECT_GT(wrapped, 0);
}

TEST(TransferPeer, ASpanningHeadIsFedFromTheLastStage) {
  MegatronOptions o;
  o.pp = 4;
  o.avoid_gpus = {4, 5, 6, 7};
  o.global_batch = 8;
  o.shard_head = true;
  const Program prog = compile("llama3-8b", "dgx-h100-superpod", 1, o);
  ASSERT_EQ(prog.lanes.size(), 4u);
  const int head = static_cast<int>(prog.plan.segments.size()) - 1;
  ASSERT_TRUE(prog.plan.segments[head].head);
  const int last = prog.lanes[3].ranks.front();
  // The last stage's last layers send their output to the other three stages' head shards.
  std::set<int> fed;
  for (const BlockInstance& b : prog.lanes[3].blocks) {
    for (const Step& s : prog.templates[b.template_index].steps) {
      if (s.kind == StepKind::kSend && s.peer_segment == head) {
        fed.insert(transfer_peer(prog, last, s));
      }
    }
  }
  EXPECT_EQ(fed, (std::set<int>{prog.lanes[0].ranks.front(), prog.lanes[1].ranks.front(),
                                prog.lanes[2].ranks.front()}));
  // And each of those receives it from the last stage.
  for (int l = 0; l < 3; ++l) {
    const int rank = prog.lanes[l].ranks.front();
    int recvs = 0;
    for (const BlockInstance& b : prog.lanes[l].blocks) {
      for (const Step& s : prog.templates[b.template_index].steps) {
        if (s.kind != StepKind::kRecv || b.block.segment != head) continue;
        ++recvs;
        EXPECT_EQ(transfer_peer(prog, rank, s), last) << "lane " << l;
      }
    }
    EXPECT_GT(recvs, 0) << "lane " << l;
  }
}

}  // namespace
}  // namespace nnsim
