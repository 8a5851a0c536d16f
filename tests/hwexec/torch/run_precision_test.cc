// nnexec run's fp8 rounding (hwexec/run_model_ops.h), value by value. Compiled only where
// LibTorch is (NNSIM_HAVE_TORCH): the function lives with the executor's LibTorch pieces.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "hwexec/run_model_ops.h"

namespace nnsim::hwexec {
namespace {

// fp8 as Transformer Engine rounds: e4m3 (3 significand bits, normals from 2^-6, subnormals
// 2^-9 apart, largest 448) and e5m2 (2 bits, normals from 2^-14, subnormals 2^-16 apart,
// largest 57344), to nearest even, saturating.
TEST(NnexecRunFp8, RoundsAsTheFormats) {
  struct Example {
    bool e5m2;
    double x, want;
  };
  const double p = std::exp2(-9), q = std::exp2(-16);
  const std::vector<Example> examples = {
      {false, 1.0, 1.0},
      {false, 1.0625, 1.0},  // halfway: to the even 1.0
      {false, 1.1875, 1.25},
      {false, 0.3, 0.3125},  // spacing 2^-5 in [0.25, 0.5)
      {false, -0.3, -0.3125},
      {false, 500, 448},  // saturates
      {false, p, p},
      {false, p / 2, 0},  // the smallest subnormal; half of it
      {false, 1.5 * p, 2 * p},
      {true, 1.125, 1.0},  // halfway: even
      {true, 1.375, 1.5},
      {true, 0.3, 0.3125},  // spacing 2^-4 in [0.25, 0.5)
      {true, 100, 96},
      {true, 60000, 57344},  // spacing 16 in [64, 128); saturates
      {true, q, q},
      {true, q / 2, 0}};
  for (const Example& e : examples) {
    EXPECT_EQ(fp8_round(e.x, e.e5m2), e.want) << (e.e5m2 ? "e5m2" : "e4m3") << " of " << e.x;
  }
}

}  // namespace
}  // namespace nnsim::hwexec
