// List-scheduled pipelines in unit time: the closed forms of 1F1B and the zero-bubble schedules,
// memory limits held, dependencies respected.
#include "planner/list_schedule.h"

#include <algorithm>
#include <map>

#include <gtest/gtest.h>

#include "core/schedule_check.h"

namespace nnsim {
namespace {

ListScheduleProblem pipeline(int p, int m) {
  ListScheduleProblem q;
  q.devices = p;
  q.micro_batches = m;
  for (int s = 0; s < p; ++s) q.device_of_segment.push_back(s);
  return q;
}

// Peak bytes each device holds when it runs its order (a forward keeps `a`, BI frees all but
// `w`, BW or B frees the rest).
std::vector<double> peak_bytes(const ListSchedule& ls, const ListScheduleProblem& q) {
  std::vector<double> peaks;
  for (const auto& order : ls.orders) {
    double level = 0, peak = 0;
    for (const Block& b : order) {
      const double a = q.forward_bytes[b.segment], w = q.weight_input_bytes[b.segment];
      if (b.kind == BlockKind::kForward) level += a;
      if (b.kind == BlockKind::kBackward) level -= a;
      if (b.kind == BlockKind::kBackwardInput) level -= a - w;
      if (b.kind == BlockKind::kBackwardWeight) level -= w;
      peak = std::max(peak, level);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

void expect_valid(const ListSchedule& ls, const ListScheduleProblem& q) {
  std::vector<OrderView> views;
  for (size_t d = 0; d < ls.orders.size(); ++d)
    views.push_back({"d" + std::to_string(d), ls.orders[d]});
  const int segments = static_cast<int>(q.device_of_segment.size());
  std::vector<int> next(segments, -1);
  for (int s = 0; s + 1 < segments; ++s) next[s] = s + 1;
  Status st = check_schedule(views, segments, q.micro_batches, next, q.device_of_segment);
  EXPECT_TRUE(st.ok()) << st.error().message();
}

TEST(ListSchedule, OneFOneBLimitsGiveTheOneFOneBMakespan) {
  // Stage s holds p - s micro-batches: (m + p - 1) (F + B) with F = 1, B = 2.
  ListScheduleProblem q = pipeline(4, 16);
  q.in_flight_limit = {4, 3, 2, 1};
  Expected<ListSchedule> ls = list_schedule(q);
  ASSERT_TRUE(ls.ok()) << ls.error().message();
  EXPECT_DOUBLE_EQ(ls->makespan, (16 + 4 - 1) * 3.0);
  expect_valid(*ls, q);
}

TEST(ListSchedule, ZeroBubbleH1IsAThirdOfOneFOneBsBubbleAtItsMemory) {
  // F = BI = BW = 1; a forward keeps 1, its weight-gradient inputs 0.4. Every device may hold
  // what 1F1B's first stage holds (p micro-batches).
  for (int p : {4, 8}) {
    const int m = 4 * p;
    ListScheduleProblem q = pipeline(p, m);
    q.split_backward = true;
    q.forward_bytes.assign(p, 1.0);
    q.weight_input_bytes.assign(p, 0.4);
    q.memory_limit.assign(p, p * 1.0);
    Expected<ListSchedule> ls = list_schedule(q);
    ASSERT_TRUE(ls.ok()) << ls.error().message();
    const double work = 3.0 * m;
    const double one_f_one_b_bubble = (p - 1) * 3.0;                     // (p - 1)(F + B + W)
    EXPECT_DOUBLE_EQ(ls->makespan - work, one_f_one_b_bubble / 3) << p;  // (p - 1)(F + B - W)
    for (double peak : peak_bytes(*ls, q)) EXPECT_LE(peak, p * 1.0 + 1e-9);
    expect_valid(*ls, q);
  }
}

TEST(ListSchedule, MemoryLimitsBindAndNeverStopProgress) {
  ListScheduleProblem q = pipeline(4, 16);
  q.split_backward = true;
  q.forward_bytes.assign(4, 1.0);
  q.weight_input_bytes.assign(4, 0.4);
  q.memory_limit.assign(4, 1.0);  // one micro-batch at a time: no pipelining at all
  Expected<ListSchedule> ls = list_schedule(q);
  ASSERT_TRUE(ls.ok()) << ls.error().message();
  for (double peak : peak_bytes(*ls, q)) EXPECT_LE(peak, 1.0 + 1e-9);
  EXPECT_GT(ls->makespan, 16 * 3.0 * 2);  // far slower than a full pipeline
  expect_valid(*ls, q);
}

TEST(ListSchedule, VShapeRunsBothChunksOfEachDevice) {
  // ZB-V's placement: device d holds segments d and 2p - 1 - d, each half a stage.
  const int p = 4, m = 16;
  ListScheduleProblem q;
  q.devices = p;
  q.micro_batches = m;
  q.device_of_segment = {0, 1, 2, 3, 3, 2, 1, 0};
  q.split_backward = true;
  q.forward.assign(8, 0.5);
  q.backward_input.assign(8, 0.5);
  q.backward_weight.assign(8, 0.5);
  q.forward_bytes.assign(8, 0.5);
  q.weight_input_bytes.assign(8, 0.2);
  q.memory_limit.assign(p, p * 1.0);  // 1F1B's first-stage peak
  Expected<ListSchedule> ls = list_schedule(q);
  ASSERT_TRUE(ls.ok()) << ls.error().message();
  expect_valid(*ls, q);
  // The only bubble left is the last device waiting for the first forward to reach it, (p - 1)
  // half-stage forwards (1F1B: 3 (p - 1)).
  EXPECT_DOUBLE_EQ(ls->makespan - 3.0 * m, (p - 1) * 0.5);
  for (double peak : peak_bytes(*ls, q)) EXPECT_LE(peak, p * 1.0 + 1e-9);
}

TEST(ListSchedule, MerakRecomputesWhileWaitingForTheGradient) {
  // Recompute on every stage but the last, as its own block before the backward.
  const int p = 4, m = 8;
  ListScheduleProblem q = pipeline(p, m);
  q.in_flight_limit = {4, 3, 2, 1};
  q.recompute = {true, true, true, false};
  Expected<ListSchedule> ls = list_schedule(q);
  ASSERT_TRUE(ls.ok()) << ls.error().message();
  expect_valid(*ls, q);
  for (int d = 0; d < p; ++d) {
    std::map<int, size_t> recompute_at, backward_at;
    for (size_t i = 0; i < ls->orders[d].size(); ++i) {
      const Block& b = ls->orders[d][i];
      if (b.kind == BlockKind::kRecompute) recompute_at[b.micro_batch] = i;
      if (b.kind == BlockKind::kBackward) backward_at[b.micro_batch] = i;
    }
    EXPECT_EQ(recompute_at.size(), d < p - 1 ? static_cast<size_t>(m) : 0u) << d;
    for (const auto& [mb, i] : recompute_at) EXPECT_LT(i, backward_at[mb]) << d << " " << mb;
  }
  // Unit recompute off the critical path: faster than recomputing inside each backward
  // (1F1B with B = 3: (m + p - 1) x 4).
  EXPECT_LT(ls->makespan, (m + p - 1) * 4.0);
}

}  // namespace
}  // namespace nnsim
