// The GEMM time of docs/cost-model.md: the precision's best rate, the sustained factors, and fp8
// on GPUs with and without fp8 tensor cores.
#include "core/cost_model.h"

#include <gtest/gtest.h>

#include "core/gpu.h"
#include "core/opgraph.h"

namespace nnsim {
namespace {

GpuSpec gpu(const char* name) {
  auto g = find_gpu(name);
  EXPECT_TRUE(g.ok()) << name;
  return g.ok() ? *g : GpuSpec{};
}

// One shape in every precision: its tile and wave quantization and short-k factor cancel in the
// ratios below.
constexpr double kM = 8192, kN = 6144, kK = 16384;

TEST(CostModel, SustainedFp8SlowsOnlyFp8Gemms) {
  const GpuSpec h100 = gpu("h100-sxm5-80gb");
  ComputeModel m = ComputeModel::defaults_for(h100);
  const double bf16 = gemm_seconds(kM, kN, kK, Precision::kBf16, h100, m);
  const double fp8 = gemm_seconds(kM, kN, kK, Precision::kFp8, h100, m);
  ComputeModel full_clock = m;
  full_clock.sustained_fp8 = 1;
  EXPECT_NEAR(fp8, gemm_seconds(kM, kN, kK, Precision::kFp8, h100, full_clock) / m.sustained_fp8,
              1e-12 * fp8);
  EXPECT_DOUBLE_EQ(bf16, gemm_seconds(kM, kN, kK, Precision::kBf16, h100, full_clock));
  // Twice bf16's peak at the microbenchmarks' best rates, times the fp8 clock drop.
  const double ratio = (1979e12 * (1402.6 / 1979) * m.sustained_fp8) / (989e12 * (794.5 / 989));
  EXPECT_NEAR(bf16 / fp8, ratio, 1e-9 * ratio);
  EXPECT_LT(m.sustained_fp8, 1.0);
}

TEST(CostModel, Fp8WithoutFp8TensorCoresRunsAsBf16) {
  const GpuSpec a100 = gpu("a100-sxm4-80gb");
  ComputeModel m = ComputeModel::defaults_for(a100);
  m.sustained_fp8 = 0.5;  // no fp8 cores: the fp8 factor does not apply
  EXPECT_DOUBLE_EQ(gemm_seconds(kM, kN, kK, Precision::kFp8, a100, m),
                   gemm_seconds(kM, kN, kK, Precision::kBf16, a100, m));
}

// Experts' grouped GEMMs: G GEMMs of m/G rows each, so few tokens per expert run below the
// rate of one GEMM over all of them (tile and wave quantization of the small ones).
TEST(CostModel, GroupedGemmsArePricedPerGroup) {
  const GpuSpec h100 = gpu("h100-sxm5-80gb");
  const ComputeModel m = ComputeModel::defaults_for(h100);
  Op op;
  op.kind = OpKind::kLinear;
  PieceShape grouped;
  grouped.m = 8 * 200;  // 200 tokens for each of 8 experts
  grouped.n = 4096;
  grouped.k = 14336;
  grouped.groups = 8;
  const double flops = 2 * grouped.m * grouped.n * grouped.k;
  const double t = op_seconds(op, Pass::kForward, flops, 0, grouped, Precision::kBf16, h100, m);
  EXPECT_DOUBLE_EQ(
      t, 8 * gemm_seconds(200, 4096, 14336, Precision::kBf16, h100, m) + m.kernel_overhead);
  PieceShape one = grouped;
  one.groups = 1;
  EXPECT_GT(t, op_seconds(op, Pass::kForward, flops, 0, one, Precision::kBf16, h100, m));
  // The weight gradient sums over each expert's rows.
  const double w =
      op_seconds(op, Pass::kBackwardWeight, flops, 0, grouped, Precision::kBf16, h100, m);
  EXPECT_DOUBLE_EQ(
      w, 8 * gemm_seconds(14336, 4096, 200, Precision::kBf16, h100, m) + m.kernel_overhead);
}

}  // namespace
}  // namespace nnsim
