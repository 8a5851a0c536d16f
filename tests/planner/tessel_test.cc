// Tessel's repetend search: shortest period under memory limits, valid unrolled orders, sharded
// blocks inside a pipeline, and the errors.
#include "planner/tessel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace nnsim {
namespace {

// A p-stage pipeline, one segment per device: F keeps one unit, B (or BI and BW) frees it.
TesselProblem pipeline(int p, int m, bool split = false) {
  TesselProblem q;
  q.devices = p;
  q.micro_batches = m;
  std::vector<int> forward(p), backward(p);
  for (int s = 0; s < p; ++s) {
    forward[s] = static_cast<int>(q.blocks.size());
    q.blocks.push_back({BlockKind::kForward, s, {s}, 1.0, 1.0, {}, 0.0, {}});
    if (s > 0) q.blocks.back().after = {forward[s - 1]};
  }
  for (int s = p - 1; s >= 0; --s) {
    backward[s] = static_cast<int>(q.blocks.size());
    const std::vector<int> after =
        s == p - 1 ? std::vector<int>{forward[s]} : std::vector<int>{backward[s + 1], forward[s]};
    if (split) {
      q.blocks.push_back({BlockKind::kBackwardInput, s, {s}, 1.0, -0.5, after, 0.0, {}});
      q.blocks.push_back({BlockKind::kBackwardWeight, s, {s}, 1.0, -0.5, {backward[s]}, 0.0, {}});
    } else {
      q.blocks.push_back({BlockKind::kBackward, s, {s}, 2.0, -1.0, after, 0.0, {}});
    }
  }
  return q;
}

TEST(Tessel, OneFOneBMemoryGivesOneFOneBSteadyState) {
  const int p = 4, m = 8;
  TesselProblem q = pipeline(p, m);
  for (int d = 0; d < p; ++d) q.memory_limit.push_back(p - d);  // 1F1B's in-flight counts
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  // No bubble in steady state: a period is one forward and one backward per device.
  EXPECT_NEAR(s->period, 3.0, 3.0 * q.precision + 1e-9);
  EXPECT_DOUBLE_EQ(s->lower_bound, 3.0);
  // As short as 1F1B's (m + p - 1)(F + B) and within the memory limits.
  EXPECT_LE(s->makespan, (m + p - 1) * 3.0 * (1 + q.precision) + 1e-9);
  for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
  Expected<OrdersRun> again = run_orders(q, s->orders);
  ASSERT_TRUE(again.ok()) << again.error().message();
  EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
}

TEST(Tessel, TightMemoryLengthensThePeriod) {
  TesselProblem q = pipeline(4, 6);
  q.memory_limit.assign(4, 1.0);  // one micro-batch at a time on every device
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  // Device 0 holds its activation for a whole round trip: 4 forwards and 4 backwards.
  EXPECT_NEAR(s->period, 12.0, 12.0 * q.precision + 1e-9);
  for (double peak : s->peak_bytes) EXPECT_LE(peak, 1.0 + 1e-9);
  q.memory_limit.assign(4, 0.5);
  Expected<TesselSchedule> none = tessel_search(q);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message().find("memory limit"), std::string::npos);
}

TEST(Tessel, SplitBackwardFillsTheBubbleAtOneFOneBMemory) {
  const int p = 4, m = 8;
  TesselProblem q = pipeline(p, m, /*split=*/true);
  q.memory_limit.assign(p, p);  // 1F1B's peak (the first stage's) on every device, as ZB-H1
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_NEAR(s->period, 3.0, 3.0 * q.precision + 1e-9);
  // Shorter than 1F1B's 33 units: weight gradients fill the fill and drain.
  EXPECT_LT(s->makespan, (m + p - 1) * 3.0);
  for (double peak : s->peak_bytes) EXPECT_LE(peak, p + 1e-9);
}

// The head of the pipeline sharded over every device (Tessel's M shape): segment p runs on all
// devices at once after the last stage's forward and before its backward.
TesselProblem sharded_head(int p, int m) {
  TesselProblem q = pipeline(p, m);
  std::vector<int> all(p);
  for (int d = 0; d < p; ++d) all[d] = d;
  const int last_forward = p - 1, last_backward = p;
  const int head_f = static_cast<int>(q.blocks.size());
  q.blocks.push_back({BlockKind::kForward, p, all, 1.0, 0.5, {last_forward}, 0.0, {}});
  q.blocks.push_back({BlockKind::kBackward, p, all, 1.0, -0.5, {head_f}, 0.0, {}});
  q.blocks[last_backward].after.push_back(head_f + 1);
  return q;
}

// 1F1B's orders for a p-stage pipeline of one segment per device (whole or split backward: BW
// right after BI). With a head segment (on every device), its forward and backward of
// micro-batch i go just before each device's backward of i.
std::vector<std::vector<Block>> one_f_one_b(int p, int m, bool split = false, int head = -1) {
  std::vector<std::vector<Block>> orders(p);
  for (int d = 0; d < p; ++d) {
    const int warmup = std::min(m, p - d);
    int f = 0;
    for (; f < warmup; ++f) orders[d].push_back({BlockKind::kForward, f, d});
    for (int b = 0; b < m; ++b) {
      if (head >= 0) {
        orders[d].push_back({BlockKind::kForward, b, head});
        orders[d].push_back({BlockKind::kBackward, b, head});
      }
      if (split) {
        orders[d].push_back({BlockKind::kBackwardInput, b, d});
        orders[d].push_back({BlockKind::kBackwardWeight, b, d});
      } else {
        orders[d].push_back({BlockKind::kBackward, b, d});
      }
      if (f < m) orders[d].push_back({BlockKind::kForward, f++, d});
    }
  }
  return orders;
}

TEST(Tessel, ShardedHeadBeatsOneFOneBAtItsMemory) {
  const int p = 4, m = 8;
  TesselProblem q = sharded_head(p, m);
  Expected<OrdersRun> baseline = run_orders(q, one_f_one_b(p, m, false, p));
  ASSERT_TRUE(baseline.ok()) << baseline.error().message();
  q.memory_limit = baseline->peak_bytes;
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_LT(s->makespan, baseline->makespan);
  for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
  // Every device runs the head blocks of every micro-batch, in the same order.
  std::vector<std::vector<Block>> head(p);
  for (int d = 0; d < p; ++d) {
    for (const Block& b : s->orders[d]) {
      if (b.segment == p) head[d].push_back(b);
    }
    EXPECT_EQ(head[d].size(), 2u * m);
    EXPECT_EQ(head[d], head[0]);
  }
}

// Tessel's K shape (a two-branch model, e.g. multimodal): branch A's two stages on devices 0
// and 1, branch B's on 2 and 3, joined by a block sharded over all four (segment 4), then the
// backward mirrored. Forwards keep one unit, the joined block half a unit on every device.
TesselProblem k_shape(int m) {
  TesselProblem q;
  q.devices = 4;
  q.micro_batches = m;
  const std::vector<int> all = {0, 1, 2, 3};
  q.blocks = {
      {BlockKind::kForward, 0, {0}, 1.0, 1.0, {}, 0.0, {}},        // 0
      {BlockKind::kForward, 1, {1}, 1.0, 1.0, {0}, 0.0, {}},       // 1
      {BlockKind::kForward, 2, {2}, 1.0, 1.0, {}, 0.0, {}},        // 2
      {BlockKind::kForward, 3, {3}, 1.0, 1.0, {2}, 0.0, {}},       // 3
      {BlockKind::kForward, 4, all, 1.0, 0.5, {1, 3}, 0.0, {}},    // 4: the join
      {BlockKind::kBackward, 4, all, 1.0, -0.5, {4}, 0.0, {}},     // 5
      {BlockKind::kBackward, 1, {1}, 2.0, -1.0, {5, 1}, 0.0, {}},  // 6
      {BlockKind::kBackward, 0, {0}, 2.0, -1.0, {6, 0}, 0.0, {}},  // 7
      {BlockKind::kBackward, 3, {3}, 2.0, -1.0, {5, 3}, 0.0, {}},  // 8
      {BlockKind::kBackward, 2, {2}, 2.0, -1.0, {8, 2}, 0.0, {}},  // 9
  };
  return q;
}

// 1F1B within each branch (the first stage warms up with two forwards, the second with one),
// the joined block's forward and backward of micro-batch i just before each device's backward of
// i.
std::vector<std::vector<Block>> k_shape_one_f_one_b(int m) {
  std::vector<std::vector<Block>> orders(4);
  for (int d = 0; d < 4; ++d) {
    const int warmup = std::min(m, 2 - d % 2);
    int f = 0;
    for (; f < warmup; ++f) orders[d].push_back({BlockKind::kForward, f, d});
    for (int b = 0; b < m; ++b) {
      orders[d].push_back({BlockKind::kForward, b, 4});
      orders[d].push_back({BlockKind::kBackward, b, 4});
      orders[d].push_back({BlockKind::kBackward, b, d});
      if (f < m) orders[d].push_back({BlockKind::kForward, f++, d});
    }
  }
  return orders;
}

TEST(Tessel, TwoBranchesJoinedByAShardedBlock) {
  const int m = 8;
  TesselProblem q = k_shape(m);
  Expected<OrdersRun> baseline = run_orders(q, k_shape_one_f_one_b(m));
  ASSERT_TRUE(baseline.ok()) << baseline.error().message();
  q.memory_limit = baseline->peak_bytes;
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  // Every device works 5 units a micro-batch (its branch's forward and backward, the join's two
  // halves); within 1F1B's memory the repetend takes 6 (measured: 50 units against 1F1B's 56).
  EXPECT_DOUBLE_EQ(s->lower_bound, 5.0);
  EXPECT_GE(s->period, 5.0);
  EXPECT_LE(s->period, 6.0 * (1 + q.precision) + 1e-9);
  EXPECT_LT(s->makespan, baseline->makespan);
  for (int d = 0; d < 4; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
  // The orders are valid on their own (dependencies, every block once, no deadlock) and run in
  // the makespan the search reports.
  Expected<OrdersRun> again = run_orders(q, s->orders);
  ASSERT_TRUE(again.ok()) << again.error().message();
  EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
  std::printf("K shape, 8 micro-batches: 1F1B %.1f units, Tessel %.1f (period %.2f)\n",
              baseline->makespan, s->makespan, s->period);
}

TEST(Tessel, EightDevicesWithAShardedHead) {
  const int p = 8, m = 16;
  TesselProblem q = sharded_head(p, m);
  Expected<OrdersRun> baseline = run_orders(q, one_f_one_b(p, m, false, p));
  ASSERT_TRUE(baseline.ok()) << baseline.error().message();
  q.memory_limit = baseline->peak_bytes;
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_LT(s->makespan, baseline->makespan);
  for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
}

TEST(Tessel, DeterministicSchedules) {
  TesselProblem q = sharded_head(4, 6);
  q.memory_limit.assign(4, 3.0);
  Expected<TesselSchedule> a = tessel_search(q);
  Expected<TesselSchedule> b = tessel_search(q);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->orders, b->orders);
  EXPECT_EQ(a->lag, b->lag);
}

// Two stages with a transfer of d between them (F0 -> F1 and B1 -> B0).
TesselProblem two_stages_with_transfer(int m, double d) {
  TesselProblem q = pipeline(2, m);
  // Blocks: F0, F1, B1 (after F1), B0 (after B1, F0).
  q.blocks[1].transfer = {d};
  q.blocks[3].transfer = {d, 0.0};
  return q;
}

// One micro-batch at a time: device 0 holds its activation for the whole round trip, F + d + F +
// B + d + B, so the period and the iteration grow by 2d.
TEST(Tessel, TransferTimeLengthensTheRoundTrip) {
  const int m = 4;
  for (double d : {0.0, 0.5, 1.25}) {
    TesselProblem q = two_stages_with_transfer(m, d);
    q.memory_limit.assign(2, 1.0);
    Expected<TesselSchedule> s = tessel_search(q);
    ASSERT_TRUE(s.ok()) << s.error().message();
    const double round_trip = 6.0 + 2 * d;
    EXPECT_NEAR(s->period, round_trip, round_trip * q.precision + 1e-9) << d;
    EXPECT_NEAR(s->makespan, m * round_trip, 1e-9) << d;
    Expected<OrdersRun> again = run_orders(q, s->orders);
    ASSERT_TRUE(again.ok()) << again.error().message();
    EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
  }
}

// 1F1B's memory (two micro-batches on device 0, one on device 1): device 0 holds each
// activation for the round trip F + d + F + B + d + B, two at a time, so the period is
// max(F + B, (6 + 2d) / 2); without a memory limit the lags hide the transfers and it stays at
// F + B. Either way the orders finish no later than 1F1B's with the same transfers.
TEST(Tessel, TransfersAtOneFOneBMemoryAndWithout) {
  const int m = 8;
  const double d = 0.5;
  TesselProblem q = two_stages_with_transfer(m, d);
  Expected<OrdersRun> baseline = run_orders(q, one_f_one_b(2, m));
  ASSERT_TRUE(baseline.ok()) << baseline.error().message();
  EXPECT_DOUBLE_EQ(baseline->peak_bytes[0], 2.0);
  EXPECT_DOUBLE_EQ(baseline->peak_bytes[1], 1.0);
  q.memory_limit = baseline->peak_bytes;
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  const double period = (6.0 + 2 * d) / 2;
  EXPECT_NEAR(s->period, period, period * q.precision + 1e-9);
  EXPECT_LE(s->makespan, baseline->makespan + 1e-9);
  for (int dev = 0; dev < 2; ++dev) EXPECT_LE(s->peak_bytes[dev], q.memory_limit[dev] + 1e-9);
  // The transfers are in the reported makespan: it is longer than without them.
  TesselProblem free_transfers = q;
  for (TesselBlock& b : free_transfers.blocks) b.transfer.clear();
  Expected<OrdersRun> without = run_orders(free_transfers, s->orders);
  ASSERT_TRUE(without.ok());
  EXPECT_LT(without->makespan, s->makespan);

  q.memory_limit.clear();
  Expected<TesselSchedule> free = tessel_search(q);
  ASSERT_TRUE(free.ok()) << free.error().message();
  EXPECT_NEAR(free->period, 3.0, 3.0 * q.precision + 1e-9);
  // Never faster than one micro-batch's round trip plus m - 1 periods of device 0's work.
  EXPECT_GE(free->makespan, 6.0 + 2 * d + (m - 1) * 3.0 - 1e-9);
  EXPECT_LT(free->makespan, s->makespan);
}

// On an ordinary pipeline the search's fill and drain are no worse than 1F1B's (list-scheduled
// where unrolling the repetend leaves them longer), with and without transfers: whole backward
// at 1F1B's memory, split at ZB-H1's.
TEST(Tessel, OrdinaryPipelineNoWorseThanOneFOneB) {
  for (const int p : {2, 4, 8}) {
    for (const double x : {0.0, 0.25}) {
      for (const bool split : {false, true}) {
        const int m = 2 * p;
        TesselProblem q = pipeline(p, m, split);
        for (TesselBlock& b : q.blocks) {
          b.transfer.clear();
          for (int a : b.after) b.transfer.push_back(q.blocks[a].segment == b.segment ? 0.0 : x);
        }
        Expected<OrdersRun> baseline = run_orders(q, one_f_one_b(p, m, split));
        ASSERT_TRUE(baseline.ok()) << baseline.error().message();
        q.memory_limit = baseline->peak_bytes;
        if (split) q.memory_limit.assign(p, p);  // ZB-H1's: 1F1B's first stage's on every one
        Expected<TesselSchedule> s = tessel_search(q);
        ASSERT_TRUE(s.ok()) << s.error().message();
        const std::string what = fmt::format("p {} transfer {} split {}", p, x, split);
        EXPECT_LE(s->makespan, baseline->makespan + 1e-9) << what;
        // Split, no transfers, ZB-H1's memory: ZB-H1's 3m + (p - 1) (only the first BI's
        // wait for the gradient; Qi et al.'s unit-time schedule), where the unrolled repetend
        // alone leaves more.
        if (split && x == 0) {
          EXPECT_DOUBLE_EQ(s->makespan, 3.0 * m + (p - 1)) << what;
          EXPECT_TRUE(s->ends_list_scheduled) << what;
        }
        for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << what;
        Expected<OrdersRun> again = run_orders(q, s->orders);
        ASSERT_TRUE(again.ok()) << again.error().message();
        EXPECT_EQ(again->makespan, s->makespan) << what;
      }
    }
  }
}

TEST(Tessel, DeterministicWithTransfers) {
  TesselProblem q = sharded_head(4, 6);
  q.memory_limit.assign(4, 3.0);
  for (TesselBlock& b : q.blocks) b.transfer.assign(b.after.size(), 0.3);
  Expected<TesselSchedule> a = tessel_search(q);
  Expected<TesselSchedule> b = tessel_search(q);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->orders, b->orders);
  EXPECT_EQ(a->lag, b->lag);
  EXPECT_EQ(a->start, b->start);
  EXPECT_EQ(a->makespan, b->makespan);
  EXPECT_EQ(a->period, b->period);
}

// AlphaFold's recycling (Tessel's 3F1B case): the forward runs through the pipeline three times,
// then the backward once.
TEST(Tessel, RecycledBlocksChainThePasses) {
  const int p = 3;
  const std::vector<TesselBlock> base = pipeline(p, 1).blocks;
  const std::vector<TesselBlock> blocks = recycled_blocks(base, 3, 0.25);
  ASSERT_EQ(blocks.size(), 4u * p);  // three passes of p forwards, p backwards
  for (int pass = 0; pass < 3; ++pass) {
    for (int s = 0; s < p; ++s) {
      const TesselBlock& f = blocks[pass * p + s];
      EXPECT_EQ(f.kind, BlockKind::kForward);
      EXPECT_EQ(f.devices, std::vector<int>{s});
      // Every pass runs the plan's segment, named by its pass; earlier passes keep nothing.
      EXPECT_EQ(f.segment, s);
      EXPECT_EQ(f.pass, pass);
      EXPECT_DOUBLE_EQ(f.bytes, pass == 2 ? 1.0 : 0.0);
      EXPECT_DOUBLE_EQ(std::max(f.peak, f.bytes), 1.0);
      if (s > 0) {
        EXPECT_EQ(f.after, std::vector<int>{pass * p + s - 1});
      } else if (pass > 0) {
        // The next pass starts from the last stage's output, after the recycling transfer.
        EXPECT_EQ(f.after, std::vector<int>{(pass - 1) * p + p - 1});
        EXPECT_DOUBLE_EQ(f.transfer_after(0), 0.25);
      } else {
        EXPECT_TRUE(f.after.empty());
      }
    }
  }
  // The backward needs the last pass's forwards.
  EXPECT_EQ(blocks[3 * p].kind, BlockKind::kBackward);
  EXPECT_EQ(blocks[3 * p].segment, p - 1);
  EXPECT_EQ(blocks[3 * p].after, std::vector<int>{3 * p - 1});
  EXPECT_EQ(recycled_blocks(base, 1).size(), base.size());
}

TEST(Tessel, RecycledForwardsHaveNoBubble) {
  for (const int p : {2, 4}) {
    const int m = 2 * p, r = 3;
    TesselProblem q = pipeline(p, m);
    q.blocks = recycled_blocks(q.blocks, r);
    // 1F1B's first stage's, plus the earlier pass running: every device may hold p + 1.
    q.memory_limit.assign(p, p + 1);
    Expected<TesselSchedule> s = tessel_search(q);
    ASSERT_TRUE(s.ok()) << s.error().message();
    // The busiest device's work per micro-batch: 3F + B = 3 + 2.
    EXPECT_DOUBLE_EQ(s->lower_bound, 5.0);
    EXPECT_NEAR(s->period, 5.0, 5.0 * q.precision + 1e-9) << p;
    for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
    // Every device runs every pass of every micro-batch once.
    for (int d = 0; d < p; ++d) EXPECT_EQ(s->orders[d].size(), static_cast<size_t>(4 * m)) << d;
    Expected<OrdersRun> again = run_orders(q, s->orders);
    ASSERT_TRUE(again.ok()) << again.error().message();
    EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
    // No faster than the busiest device's work.
    EXPECT_GE(s->makespan, m * 5.0 - 1e-9);
    EXPECT_LE(s->makespan, s->ends_incumbent);
    Expected<TesselSchedule> a = tessel_search(q);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->orders, s->orders);
    EXPECT_EQ(a->lag, s->lag);
    EXPECT_EQ(a->start, s->start);
    EXPECT_EQ(a->makespan, s->makespan);
  }
}

// Three devices, four segments (device 0 runs the first and the last), the last device's memory
// for two micro-batches: the repetend needs a period of 13 against 8 of work, and the warm-up
// and cool-down are a large part of 3 micro-batches. Unrolled, and list-scheduled either way,
// they take 50; searched with the repetend fixed, 42.
TesselProblem folded_pipeline() {
  TesselProblem q;
  q.devices = 3;
  q.micro_batches = 3;
  const std::vector<int> device = {0, 1, 2, 0};
  const std::vector<double> forward = {2, 3, 3, 1}, backward = {2, 4, 4, 3};
  const std::vector<double> send = {1, 0, 0};  // F0 -> F1 and B1 -> B0 take 1
  for (int s = 0; s < 4; ++s) {
    q.blocks.push_back({BlockKind::kForward, s, {device[s]}, forward[s], 1.0, {}, 0.0, {}});
    if (s > 0) {
      q.blocks.back().after = {s - 1};
      q.blocks.back().transfer = {send[s - 1]};
    }
  }
  for (int s = 3; s >= 0; --s) {
    std::vector<int> after = {s};
    std::vector<double> transfer = {0.0};
    if (s < 3) {
      after.push_back(static_cast<int>(q.blocks.size()) - 1);
      transfer.push_back(send[s]);
    }
    q.blocks.push_back(
        {BlockKind::kBackward, s, {device[s]}, backward[s], -1.0, after, 0.0, transfer});
  }
  q.memory_limit = {3, 3, 2};
  return q;
}

// Recycling through a pipeline whose head spans every device: each pass ends with the head's
// forward on all devices at once.
TEST(Tessel, RecycledForwardsWithAShardedHead) {
  const int p = 4, m = 6, r = 3;
  TesselProblem q = sharded_head(p, m);
  const size_t base = q.blocks.size();
  q.blocks = recycled_blocks(q.blocks, r);
  ASSERT_EQ(q.blocks.size(), base + (r - 1) * (p + 1));
  q.memory_limit.assign(p, p + 2.0);
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  // Per device and micro-batch: three forwards of its stage and of the head, a backward of each.
  EXPECT_DOUBLE_EQ(s->lower_bound, 3 * 1.0 + 2.0 + 3 * 1.0 + 1.0);
  // No bubble: the head's blocks interleave with the stages' on every device.
  EXPECT_NEAR(s->period, s->lower_bound, s->lower_bound * q.precision);
  for (int d = 0; d < p; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
  Expected<OrdersRun> again = run_orders(q, s->orders);
  ASSERT_TRUE(again.ok()) << again.error().message();
  EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
  EXPECT_GE(s->makespan, m * s->lower_bound - 1e-9);
}

TEST(Tessel, SolverEndsBeatTheListSchedule) {
  TesselProblem q = folded_pipeline();
  Expected<TesselSchedule> s = tessel_search(q);
  ASSERT_TRUE(s.ok()) << s.error().message();
  EXPECT_TRUE(s->ends_searched);
  EXPECT_FALSE(s->ends_list_scheduled);
  EXPECT_DOUBLE_EQ(s->lower_bound, 8.0);
  EXPECT_NEAR(s->period, 13.0, 13.0 * q.precision);
  EXPECT_DOUBLE_EQ(s->ends_incumbent, 50.0);
  EXPECT_LT(s->makespan, s->ends_incumbent);
  EXPECT_DOUBLE_EQ(s->makespan, 42.0);
  for (int d = 0; d < q.devices; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9) << d;
  // The orders respect every dependency (they run without deadlock) and give the same makespan.
  Expected<OrdersRun> again = run_orders(q, s->orders);
  ASSERT_TRUE(again.ok()) << again.error().message();
  EXPECT_DOUBLE_EQ(again->makespan, s->makespan);
  EXPECT_EQ(again->peak_bytes, s->peak_bytes);
  // Without the second pass the list schedule stands.
  q.ends_rlimit = 0;
  Expected<TesselSchedule> listed = tessel_search(q);
  ASSERT_TRUE(listed.ok());
  EXPECT_FALSE(listed->ends_searched);
  EXPECT_DOUBLE_EQ(listed->makespan, 50.0);
  Expected<TesselSchedule> a = tessel_search(folded_pipeline());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->orders, s->orders);
}

// The second pass never makes a schedule longer than the list schedule (or the unrolled
// repetend) it starts from, stays within the memory limit, and is skipped when that schedule
// is as short as any can be.
TEST(Tessel, SolverEndsNeverWorse) {
  std::vector<std::pair<std::string, TesselProblem>> cases;
  for (const int p : {2, 4}) {
    for (const bool split : {false, true}) {
      TesselProblem q = pipeline(p, 2 * p, split);
      q.memory_limit.assign(p, p);
      cases.emplace_back(fmt::format("pipeline p {} split {}", p, split), q);
    }
  }
  TesselProblem head = sharded_head(4, 6);
  head.memory_limit.assign(4, 3.0);
  cases.emplace_back("sharded head", head);
  for (TesselBlock& b : head.blocks) b.transfer.assign(b.after.size(), 0.3);
  cases.emplace_back("sharded head, transfers", head);
  TesselProblem two = two_stages_with_transfer(8, 0.5);
  two.memory_limit = {2.0, 1.0};
  cases.emplace_back("two stages, transfers", two);
  // Fewer micro-batches than the largest lag: no full period, every instance is the solver's.
  TesselProblem few = sharded_head(4, 2);
  few.memory_limit.assign(4, 3.0);
  cases.emplace_back("sharded head, 2 micro-batches", few);
  for (const int m : {1, 2}) {
    TesselProblem folded = folded_pipeline();
    folded.micro_batches = m;
    cases.emplace_back(fmt::format("folded, {} micro-batches", m), folded);
  }
  for (auto& [what, q] : cases) {
    Expected<TesselSchedule> s = tessel_search(q);
    ASSERT_TRUE(s.ok()) << what << ": " << s.error().message();
    TesselProblem without = q;
    without.ends_rlimit = 0;
    Expected<TesselSchedule> listed = tessel_search(without);
    ASSERT_TRUE(listed.ok()) << what;
    EXPECT_LE(s->makespan, listed->makespan) << what;
    EXPECT_DOUBLE_EQ(s->ends_incumbent, listed->makespan) << what;
    EXPECT_EQ(s->ends_searched, s->makespan < listed->makespan) << what;
    // 1F1B's and ZB-H1's makespans meet the lower bound (the last stage's first forward, its
    // work, the backward chain after it): no second pass is run.
    if (what.starts_with("pipeline")) {
      EXPECT_EQ(s->solver_calls, listed->solver_calls) << what;
    }
    for (int d = 0; d < q.devices; ++d) EXPECT_LE(s->peak_bytes[d], q.memory_limit[d] + 1e-9);
    Expected<OrdersRun> again = run_orders(q, s->orders);
    ASSERT_TRUE(again.ok()) << what << ": " << again.error().message();
    EXPECT_DOUBLE_EQ(again->makespan, s->makespan) << what;
  }
}

TEST(Tessel, BadProblemsAndOrdersAreNamed) {
  {
    TesselProblem q = pipeline(2, 2);
    q.blocks[1].transfer = {0.5, 0.5};  // F1 needs one block
    Expected<TesselSchedule> bad = tessel_search(q);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message().find("2 transfer times for 1 blocks"), std::string::npos)
        << bad.error().message();
    q.blocks[1].transfer = {-1.0};
    ASSERT_FALSE(tessel_search(q).ok());
  }
  TesselProblem q = pipeline(2, 2);
  q.blocks[0].after = {3};  // F0 after B0, which needs F0
  Expected<TesselSchedule> cycle = tessel_search(q);
  ASSERT_FALSE(cycle.ok());
  EXPECT_NE(cycle.error().message().find("cycle"), std::string::npos);

  q = pipeline(2, 2);
  q.blocks[1].devices = {5};
  ASSERT_FALSE(tessel_search(q).ok());

  q = pipeline(2, 2);
  // Device 0 waits for B0@0 first, which needs device 1's backward, which needs F0@0.
  std::vector<std::vector<Block>> orders = {{{BlockKind::kBackward, 0, 0},
                                             {BlockKind::kForward, 0, 0},
                                             {BlockKind::kForward, 1, 0},
                                             {BlockKind::kBackward, 1, 0}},
                                            {{BlockKind::kForward, 0, 1},
                                             {BlockKind::kBackward, 0, 1},
                                             {BlockKind::kForward, 1, 1},
                                             {BlockKind::kBackward, 1, 1}}};
  Expected<OrdersRun> dead = run_orders(q, orders);
  ASSERT_FALSE(dead.ok());
  EXPECT_NE(dead.error().message().find("device 0 waits forever at B0@0"), std::string::npos)
      << dead.error().message();
  orders[1].pop_back();
  Expected<OrdersRun> missing = run_orders(q, orders);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message().find("device 1 never runs B1@1"), std::string::npos)
      << missing.error().message();
}

}  // namespace
}  // namespace nnsim
