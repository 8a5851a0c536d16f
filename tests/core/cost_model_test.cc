// The GEMM time of docs/cost-model.md: the precision's best rate, the sustained factors, and fp8
// on GPUs with and without fp8 tensor cores.
#include "core/cost_model.h"

#include <gtest/gtest.h>

#include "core/comm_model.h"
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

// A hypothetical GPU keeps its base's measured behaviour whatever it is called: a "b200" drawn
// from an H200 with Blackwell's peaks has the H200's GEMM, attention and NCCL efficiencies, not
// the defaults of a GPU nnsim has no measurements of.
TEST(CostModel, AHypotheticalGpuKeepsItsBasesEfficiencies) {
  const GpuSpec h200 = gpu("h200-sxm-141gb");
  GpuSpec b200 = h200;
  b200.name = "b200";
  b200.dense_flops[Precision::kBf16] = 2250e12;
  b200.dense_flops[Precision::kFp8] = 4500e12;
  EXPECT_TRUE(b200.hopper());
  for (AttentionLibrary a : {AttentionLibrary::kFlash2, AttentionLibrary::kFused3}) {
    const ComputeModel base = ComputeModel::defaults_for(h200, a);
    const ComputeModel what_if = ComputeModel::defaults_for(b200, a);
    EXPECT_EQ(what_if.gemm_efficiency, base.gemm_efficiency);
    EXPECT_DOUBLE_EQ(what_if.sustained, base.sustained);
    EXPECT_DOUBLE_EQ(what_if.sustained_fp8, base.sustained_fp8);
    EXPECT_DOUBLE_EQ(what_if.attention_fwd_efficiency, base.attention_fwd_efficiency);
    EXPECT_DOUBLE_EQ(what_if.attention_bwd_efficiency, base.attention_bwd_efficiency);
  }
  EXPECT_DOUBLE_EQ(CommModel::defaults_for(b200).nvlink.max_efficiency,
                   CommModel::defaults_for(h200).nvlink.max_efficiency);
  // Twice the peak, the same efficiencies: half the time.
  const ComputeModel m = ComputeModel::defaults_for(h200);
  EXPECT_NEAR(gemm_seconds(kM, kN, kK, Precision::kFp8, b200, m),
              gemm_seconds(kM, kN, kK, Precision::kFp8, h200, m) * 1979 / 4500, 1e-15);
}

// Beside DeepEP's exchange compute runs on the SMs its 20 leave; beside NCCL's collectives it
// takes comm_interference longer.
TEST(CostModel, ComputeBesideDeepEpRunsOnTheSmsItLeaves) {
  const ComputeModel h100 = ComputeModel::defaults_for(gpu("h100-sxm5-80gb"));
  const ComputeModel a100 = ComputeModel::defaults_for(gpu("a100-sxm4-80gb"));
  EXPECT_EQ(h100.sms, 132);
  EXPECT_DOUBLE_EQ(interference_beside(h100, true), 20.0 / 112);
  EXPECT_DOUBLE_EQ(interference_beside(a100, true), 20.0 / 88);
  EXPECT_DOUBLE_EQ(interference_beside(h100, false), h100.comm_interference);
  ComputeModel tiny = h100;
  tiny.sms = 16;  // fewer SMs than DeepEP's: the generic figure
  EXPECT_DOUBLE_EQ(interference_beside(tiny, true), tiny.comm_interference);
}

// A sliding window: the fused kernel computes only the pairs the model attends to (its counted
// FLOPs), the unfused chain every score.
TEST(CostModel, OnlyAFusedKernelSkipsWhatASlidingWindowLeavesOut) {
  const GpuSpec h100 = gpu("h100-sxm5-80gb");
  const ComputeModel m = ComputeModel::defaults_for(h100);
  Op op;
  op.kind = OpKind::kAttention;
  PieceShape shape;
  shape.seq = 4096;
  shape.head_dim = 128;
  const double full = 4.0 * 4096 * 4096 * 32 * 128;
  op.causal = true;
  const double fused = op_seconds(op, Pass::kForward, full, 0, shape, Precision::kBf16, h100, m);
  op.attended_fraction = 0.25;
  const double fused_window =
      op_seconds(op, Pass::kForward, full * 0.25, 0, shape, Precision::kBf16, h100, m);
  EXPECT_NEAR(fused_window - m.kernel_overhead, (fused - m.kernel_overhead) * 0.25, 1e-12 * fused);
  op.causal = false;
  op.attended_fraction = 1;
  const double unfused = op_seconds(op, Pass::kForward, full, 0, shape, Precision::kBf16, h100, m);
  op.attended_fraction = 0.25;
  EXPECT_DOUBLE_EQ(op_seconds(op, Pass::kForward, full * 0.25, 0, shape, Precision::kBf16, h100, m),
                   unfused);
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

// One grouped-GEMM kernel (--moe-grouped-gemm): the groups' tiles share the waves, so small
// experts no longer each leave a partial last wave; the FLOPs are the same, and groups whose
// tiles fill whole waves on their own take the same time either way.
TEST(CostModel, OneGroupedKernelFillsTheWavesTogether) {
  const GpuSpec h100 = gpu("h100-sxm5-80gb");
  ComputeModel m = ComputeModel::defaults_for(h100);
  Op op;
  op.kind = OpKind::kLinear;
  PieceShape shape;
  shape.m = 16 * 128;  // 128 tokens for each of 16 experts
  shape.n = 2048;
  shape.k = 1408;
  shape.groups = 16;
  const double flops = 2 * shape.m * shape.n * shape.k;
  const double one_by_one =
      op_seconds(op, Pass::kForward, flops, 0, shape, Precision::kBf16, h100, m);
  shape.one_kernel = true;
  const double grouped = op_seconds(op, Pass::kForward, flops, 0, shape, Precision::kBf16, h100, m);
  EXPECT_LT(grouped, 0.8 * one_by_one);
  EXPECT_DOUBLE_EQ(
      grouped, gemm_seconds(128, 2048, 1408, Precision::kBf16, h100, m, 16) + m.kernel_overhead);
  EXPECT_DOUBLE_EQ(gemm_seconds(128, 2048, 1408, Precision::kBf16, h100, m, 1),
                   gemm_seconds(128, 2048, 1408, Precision::kBf16, h100, m));
  // One tile shape and GEMMs of exactly one full wave each: no difference.
  m.tiles = {{128, 128, 1.0}};
  const double rows = 128.0 * m.sms;  // sms tiles of 128 x 128 with n = 128
  EXPECT_DOUBLE_EQ(gemm_seconds(rows, 128, 4096, Precision::kBf16, h100, m, 4),
                   4 * gemm_seconds(rows, 128, 4096, Precision::kBf16, h100, m));
}

}  // namespace
}  // namespace nnsim
