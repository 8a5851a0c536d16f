#include "core/calibration.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace nnsim {
namespace {

std::string temp_path(const char* name) {
  return std::string(::testing::TempDir()) + "/" + name;
}

TEST(Calibration, RoundTripsAndOverridesOnlyWhatItSets) {
  GpuSpec gpu = *find_gpu("h100-sxm5-80gb");
  ComputeModel compute = ComputeModel::defaults_for(gpu);
  CommModel comm = CommModel::defaults_for(gpu);
  Calibration c;
  c.gpus["h100-sxm5-80gb"] = describe_models(compute, comm, "test");
  c.gpus["h100-sxm5-80gb"].compute["sustained"] = 0.5;
  c.gpus["h100-sxm5-80gb"].gemm_efficiency[Precision::kFp8] = 0.6;
  const std::string path = temp_path("cal.h5");
  ASSERT_TRUE(save_calibration(path, c).ok());
  Expected<Calibration> back = load_calibration(path);
  ASSERT_TRUE(back.ok()) << back.error().message();
  ASSERT_EQ(back->gpus.count("h100-sxm5-80gb"), 1u);
  EXPECT_EQ(back->gpus.at("h100-sxm5-80gb").source, "test");

  ComputeModel m = ComputeModel::defaults_for(gpu);
  CommModel n = CommModel::defaults_for(gpu);
  apply_calibration(*back, "h100-sxm5-80gb", m, n);
  EXPECT_DOUBLE_EQ(m.sustained, 0.5);
  EXPECT_DOUBLE_EQ(m.gemm_efficiency.at(Precision::kFp8), 0.6);
  EXPECT_DOUBLE_EQ(m.memory_efficiency, compute.memory_efficiency);
  ASSERT_EQ(n.nvlink.curve.size(), comm.nvlink.curve.size());
  EXPECT_DOUBLE_EQ(n.nvlink.curve[3].efficiency, comm.nvlink.curve[3].efficiency);
  EXPECT_DOUBLE_EQ(n.network.step_latency, comm.network.step_latency);

  // Another GPU's models are left alone.
  ComputeModel a100 = ComputeModel::defaults_for(*find_gpu("a100-sxm4-80gb"));
  CommModel a100_comm = CommModel::defaults_for(*find_gpu("a100-sxm4-80gb"));
  const double before = a100.sustained;
  apply_calibration(*back, "a100-sxm4-80gb", a100, a100_comm);
  EXPECT_DOUBLE_EQ(a100.sustained, before);
}

// A hypothetical GPU (a what-if part named after itself) takes its base's entry, unless the file
// has one of its own.
TEST(Calibration, AHypotheticalGpuTakesItsBasesEntry) {
  const GpuSpec h100 = *find_gpu("h100-sxm5-80gb");
  GpuSpec b200 = h100;
  b200.name = "b200";
  b200.dense_flops[Precision::kBf16] = 2250e12;
  Calibration c;
  c.gpus["h100-sxm5-80gb"] = describe_models(ComputeModel::defaults_for(h100),
                                             CommModel::defaults_for(h100), "measured on H100s");
  c.gpus["h100-sxm5-80gb"].compute["sustained"] = 0.5;
  ComputeModel m = ComputeModel::defaults_for(b200);
  CommModel n = CommModel::defaults_for(b200);
  apply_calibration(c, b200, m, n);
  EXPECT_DOUBLE_EQ(m.sustained, 0.5);
  c.gpus["b200"] = c.gpus["h100-sxm5-80gb"];
  c.gpus["b200"].compute["sustained"] = 0.7;
  apply_calibration(c, b200, m, n);
  EXPECT_DOUBLE_EQ(m.sustained, 0.7);
}

TEST(Calibration, RejectsFilesThatAreNotCalibrations) {
  const std::string path = temp_path("not.h5");
  { std::ofstream(path) << "hello"; }
  auto r = load_calibration(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("not an HDF5 file"), std::string::npos);

  Calibration c;
  c.gpus["a100-sxm4-80gb"].compute["sustained"] = -1;
  const std::string bad = temp_path("bad.h5");
  ASSERT_TRUE(save_calibration(bad, c).ok());
  r = load_calibration(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("'sustained' is negative"), std::string::npos)
      << r.error().message();

  Calibration unknown;
  unknown.gpus["a100-sxm4-81gb"].compute["sustained"] = 0.9;
  ASSERT_TRUE(save_calibration(bad, unknown).ok());
  r = load_calibration(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("did you mean 'a100-sxm4-80gb'"), std::string::npos)
      << r.error().message();
}

}  // namespace
}  // namespace nnsim
