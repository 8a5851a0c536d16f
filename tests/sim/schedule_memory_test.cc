// Peak activation memory per pipeline stage against each schedule's in-flight micro-batch count
// (issue 5): a stage that holds n micro-batches' activations at once peaks at n times one
// micro-batch's activations, plus at most one block's transient. Simulated on the
// communication-free cluster with the uniform model (4 layers per stage, a head of 128 logits).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/model.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/megatron.h"
#include "sim/simulator.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

struct StageMemory {
  double peak = 0;         // peak activation bytes of the stage
  double micro_batch = 0;  // activation bytes one micro-batch keeps on it (all its chunks)
  double min_chunk = 0;    // the smallest and largest a chunk (segment) keeps
  double max_chunk = 0;
  double transient = 0;          // the largest extra any block holds while it runs
  std::map<int, double> chunks;  // segment -> the activation bytes its forward keeps
};

constexpr int kStages = 4;
constexpr int kMicroBatches = 8;

std::vector<StageMemory> simulate_stages(ScheduleKind kind, int chunks) {
  MegatronOptions o;
  o.pp = kStages;
  o.vpp = chunks;
  o.global_batch = kMicroBatches;
  o.schedule = kind;
  const Topology t = communication_free_node(kStages);
  o.costs = matmul_only(t);
  // Any failure returns no stages, which the tests' size checks report.
  const std::optional<Plan> plan = testing::uniform_plan(t, o);
  if (!plan) return {};
  const std::optional<testing::SimulatedRun> run = testing::compile_and_simulate(*plan, t);
  if (!run) return {};
  const Program& prog = run->program;

  // A block kind of a segment may have several templates (variants); each segment's forward
  // keeps the same bytes in all of them.
  std::vector<StageMemory> out(prog.lanes.size());
  std::map<std::pair<int, int>, double> kept_by_segment;  // (lane, segment) -> bytes
  for (const BlockTemplate& b : prog.templates) {
    StageMemory& s = out[b.lane];
    // A forward's peak includes what it keeps; what rises above that is transient.
    const double transient = b.peak_bytes - std::max(0.0, b.kept_bytes);
    s.transient = std::max(s.transient, transient);
    if (b.kind == BlockKind::kForward) kept_by_segment[{b.lane, b.segment}] = b.kept_bytes;
  }
  for (StageMemory& s : out) s.min_chunk = 1e300;
  for (const auto& [key, kept] : kept_by_segment) {
    StageMemory& s = out[key.first];
    s.micro_batch += kept;
    s.chunks[key.second] = kept;
    s.min_chunk = std::min(s.min_chunk, kept);
    s.max_chunk = std::max(s.max_chunk, kept);
  }
  for (size_t l = 0; l < out.size(); ++l) out[l].peak = run->result.lanes[l].peak_activations;
  return out;
}

// The stage holds exactly `n` micro-batches' activations at its peak.
void expect_holds(const StageMemory& s, double n, const std::string& what) {
  EXPECT_GE(s.peak, n * s.micro_batch * (1 - 1e-9)) << what;
  EXPECT_LE(s.peak, n * s.micro_batch + s.transient + 1) << what;
  // The transient is well under one micro-batch, so n is told apart from n + 1.
  EXPECT_LT(s.transient, 0.5 * s.micro_batch) << what;
}

TEST(ScheduleMemory, GpipeHoldsEveryMicroBatch) {
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kGpipe, 1);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  for (int s = 0; s < kStages; ++s)
    expect_holds(st[s], kMicroBatches, "stage " + std::to_string(s));
}

TEST(ScheduleMemory, OneFOneBStageHoldsStagesLessItsIndex) {
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kOneFOneB, 1);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  for (int s = 0; s < kStages; ++s) expect_holds(st[s], kStages - s, "stage " + std::to_string(s));
}

TEST(ScheduleMemory, InterleavedHoldsItsWarmUpPlusOneChunk) {
  // Megatron's interleaved 1F1B with v chunks: stage s runs 2(p - s - 1) + (v - 1) p warm-up
  // chunk forwards, then one more before each backward.
  const int v = 2;
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kInterleaved, v);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  for (int s = 0; s < kStages; ++s) {
    const int chunks_in_flight = 2 * (kStages - s - 1) + (v - 1) * kStages + 1;
    const StageMemory& m = st[s];
    const std::string what = "stage " + std::to_string(s);
    EXPECT_GE(m.peak, chunks_in_flight * m.min_chunk * (1 - 1e-9)) << what;
    EXPECT_LE(m.peak, chunks_in_flight * m.max_chunk + m.transient + 1) << what;
    // The bounds for n chunks stay below n + 1 chunks, so the count is pinned.
    EXPECT_LT(m.transient + chunks_in_flight * (m.max_chunk - m.min_chunk), m.min_chunk) << what;
  }
}

TEST(ScheduleMemory, ZeroBubbleH1StaysWithinOneFOneBsFirstStage) {
  // Qi et al.: ZB-H1 keeps 1F1B's peak, p micro-batches, on every stage; the first stage reaches
  // it.
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kZbH1, 1);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  expect_holds(st[0], kStages, "stage 0");
  for (int s = 1; s < kStages; ++s) {
    EXPECT_LE(st[s].peak, kStages * st[s].micro_batch + st[s].transient + 1) << s;
  }
}

TEST(ScheduleMemory, ZeroBubbleH2HoldsTwiceTheStagesLessOneOnTheFirst) {
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kZbH2, 1);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  expect_holds(st[0], 2 * kStages - 1, "stage 0");
  for (int s = 1; s < kStages; ++s) {
    EXPECT_LE(st[s].peak, (2 * kStages - 1) * st[s].micro_batch + st[s].transient + 1) << s;
  }
}

TEST(ScheduleMemory, ZeroBubbleVHoldsTheVShapedOneFOneBsBytes) {
  // The V-shaped 1F1B the ZB-V generator is held to (docs/schedules.md): segment j keeps at most
  // 2p - j micro-batches, so stage r (segments r and 2p - 1 - r) holds 2p + 1 chunks of half a
  // stage, p + 1/2 stages' worth. Every stage gets the largest of those byte counts (the later
  // stages spend the room on weight-gradient inputs held back), and the largest one reaches it.
  const std::vector<StageMemory> st = simulate_stages(ScheduleKind::kZbV, 2);
  ASSERT_EQ(st.size(), static_cast<size_t>(kStages));
  const int segments = 2 * kStages;
  double budget = 0;
  for (const StageMemory& s : st) {
    ASSERT_EQ(s.chunks.size(), 2u);
    double v_shaped = 0;
    for (const auto& [segment, kept] : s.chunks) v_shaped += (segments - segment) * kept;
    budget = std::max(budget, v_shaped);
  }
  double highest = 0;
  for (int s = 0; s < kStages; ++s) {
    EXPECT_LE(st[s].peak, budget + st[s].transient + 1) << s;
    highest = std::max(highest, st[s].peak);
  }
  EXPECT_GE(highest, budget * (1 - 1e-9));
}

}  // namespace
}  // namespace nnsim
