#include "core/training_time.h"

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
