#include "core/training_time.h"

#include <cmath>

#include <gtest/gtest.h>

namespace nnsim {
namespace {

TEST(TrainingTime, CountsWholeStepsOfTheGlobalBatch) {
  // 1e9 tokens in steps of 2^20: 953.67 steps, so 954 whole ones.
  Expected<TrainingTime> t = training_time(1e9, 1 << 20, 2.5, 64);
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->steps, 954);
  EXPECT_DOUBLE_EQ(t->seconds, 954 * 2.5);
  EXPECT_DOUBLE_EQ(t->gpu_hours, 64 * 954 * 2.5 / 3600);
  EXPECT_EQ(t->gpus, 64);
  // A whole number of steps is not rounded up.
  EXPECT_EQ(training_time(4.0 * (1 << 20), 1 << 20, 1.0, 8)->steps, 4);
}

TEST(TrainingTime, RefusesWhatHasNoDuration) {
  EXPECT_FALSE(training_time(0, 1 << 20, 1.0, 8).ok());
  EXPECT_FALSE(training_time(-5, 1 << 20, 1.0, 8).ok());
  EXPECT_FALSE(training_time(1e9, 0, 1.0, 8).ok());
  EXPECT_FALSE(training_time(1e9, 1 << 20, 0, 8).ok());
  EXPECT_FALSE(training_time(1e9, 1 << 20, 1.0, 0).ok());
  Expected<TrainingTime> huge = training_time(1e30, 1, 1.0, 8);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().message().find("too many"), std::string::npos);
}

// Young's interval and the first-order loss (docs/simulator.md, "Time to train"), by hand: 1,000
// GPUs failing 1e-4 times a GPU-hour fail every 36,000 s; a 50 s checkpoint gives tau =
// sqrt(2 x 50 x 36,000) = 1,897.4 s, and the run loses 50 / tau + (tau / 2 + 300) / 36,000.
TEST(TrainingTime, FailuresCostYoungsIntervalToFirstOrder) {
  TrainingTime t = *training_time(1000.0 * (1 << 20), 1 << 20, 1000.0, 1000);
  FailureModel f;
  f.gpu_failures_per_hour = 1e-4;
  f.checkpoint_seconds = 50;
  f.restart_seconds = 300;
  Expected<FailureCost> c = failure_cost(t, f);
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_DOUBLE_EQ(c->mtbf_seconds, 36000.0);
  const double tau = std::sqrt(2 * 50 * 36000.0);
  EXPECT_DOUBLE_EQ(c->checkpoint_interval, tau);
  const double lost = 50 / tau + (tau / 2 + 300) / 36000.0;
  EXPECT_DOUBLE_EQ(c->lost_fraction, lost);
  EXPECT_DOUBLE_EQ(c->seconds, 1e6 / (1 - lost));
  EXPECT_DOUBLE_EQ(c->failures, c->seconds / 36000.0);
  EXPECT_DOUBLE_EQ(c->gpu_hours, 1000 * c->seconds / 3600);
  // A checkpoint is taken between steps: never more often than one a step.
  f.checkpoint_seconds = 1;
  EXPECT_DOUBLE_EQ(failure_cost(t, f)->checkpoint_interval, 1000.0);
  // Losing half the time or more is beyond the first-order estimate: refused.
  f.gpu_failures_per_hour = 1.0;
  Expected<FailureCost> hopeless = failure_cost(t, f);
  ASSERT_FALSE(hopeless.ok());
  EXPECT_NE(hopeless.error().message().find("fails every 3.6 s"), std::string::npos)
      << hopeless.error().message();
  // The default rate: Llama 3's 419 interruptions in 54 days on 16,384 GPUs.
  EXPECT_DOUBLE_EQ(FailureModel().gpu_failures_per_hour, 419.0 / (54 * 24 * 16384.0));
}

TEST(TrainingTime, ReadsTokenCountsAsTheFieldWritesThem) {
  EXPECT_DOUBLE_EQ(*parse_token_count("15T"), 15e12);
  EXPECT_DOUBLE_EQ(*parse_token_count("300B"), 300e9);
  EXPECT_DOUBLE_EQ(*parse_token_count("300G"), 300e9);
  EXPECT_DOUBLE_EQ(*parse_token_count("2.5e11"), 2.5e11);
  EXPECT_DOUBLE_EQ(*parse_token_count(" 1.2 M tokens "), 1.2e6);
  EXPECT_DOUBLE_EQ(*parse_token_count("40k"), 4e4);
  for (const char* bad : {"", "T", "3x", "15 TB", "15T words", "inf", "-5B", "0"}) {
    Expected<double> r = parse_token_count(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
  EXPECT_NE(parse_token_count("3x").error().message().find("e.g. 15T"), std::string::npos);
}

}  // namespace
}  // namespace nnsim
