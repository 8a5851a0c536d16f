// The microbenchmark file and the calibration fit, on synthetic results with known answers.
#include <hdf5.h>

#include <cmath>

#include <gtest/gtest.h>

#include "core/calibration.h"
#include "core/collective.h"
#include "hwexec/fit.h"
#include "hwexec/micro.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::synthetic_micro;
using testing::TempDir;
using testing::Truth;

GpuSpec h100() {
  return *find_gpu("h100-sxm5-80gb");
}

TEST(HwexecMicro, WriteReadRoundTripKeepsEverySeries) {
  TempDir dir;
  const MicroResults m = synthetic_micro(h100());
  ASSERT_TRUE(write_micro(dir.file("m.h5"), m).ok());
  Expected<MicroResults> r = read_micro(dir.file("m.h5"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(r->device, "cuda");
  EXPECT_EQ(r->device_name, m.device_name);
  EXPECT_EQ(r->device_count, 8);
  ASSERT_EQ(r->gemm.size(), 2u);
  ASSERT_EQ(r->memory.size(), 2u);
  ASSERT_EQ(r->collectives.size(), 2u);
  // Groups come back in name order: bf16 before fp8, add before gelu, all_gather before
  // all_reduce.
  EXPECT_EQ(r->gemm[0].precision, Precision::kBf16);
  EXPECT_EQ(r->gemm[1].precision, Precision::kFp8);
  EXPECT_EQ(r->collectives[0].kind, "all_gather");
  for (size_t i = 0; i < m.gemm[0].samples.size(); ++i) {
    EXPECT_EQ(r->gemm[0].samples[i].m, m.gemm[0].samples[i].m);
    EXPECT_DOUBLE_EQ(r->gemm[0].samples[i].t.seconds, m.gemm[0].samples[i].t.seconds);
  }
  EXPECT_EQ(r->memory[0].samples.size(), m.memory[0].samples.size());
  EXPECT_DOUBLE_EQ(r->memory[0].bytes_per_element, 6.0);
  EXPECT_EQ(r->collectives[1].ranks, 8);
}

TEST(HwexecFit, RecoversTheParametersTheTimesWereMadeWith) {
  const GpuSpec gpu = h100();
  const Truth truth;
  Expected<Fit> f = fit_micro(synthetic_micro(gpu, truth), gpu, "synthetic");
  ASSERT_TRUE(f.ok()) << f.error().message();
  const GpuCalibration& c = f->calibration;
  EXPECT_EQ(c.source, "synthetic");
  ASSERT_EQ(c.gemm_efficiency.count(Precision::kBf16), 1u);
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kBf16), truth.bf16_efficiency, 1e-9);
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kFp8), truth.fp8_efficiency, 1e-9);
  // Three of four shapes match the model exactly; the slow one is 1/3 faster in the model.
  EXPECT_NEAR(f->gemm[0].median_error, 0, 1e-9);
  EXPECT_NEAR(f->gemm[0].max_error, 1 - 1 / 1.5, 1e-9);
  EXPECT_NEAR(c.compute.at("memory_efficiency"), truth.memory_efficiency, 1e-9);
  EXPECT_NEAR(c.compute.at("kernel_overhead"), truth.kernel_overhead, 1e-12);
  ASSERT_TRUE(f->memory.has_value());
  EXPECT_NEAR(f->memory->max_error, 0, 1e-9);

  ASSERT_TRUE(c.nvlink.has_value());
  const GpuCalibration::Link& l = *c.nvlink;
  EXPECT_NEAR(*l.step_latency, truth.alpha / (2 * (truth.ranks - 1)), 1e-15);
  ASSERT_EQ(l.curve.size(), truth.all_reduce_efficiency.size());
  for (size_t i = 0; i < l.curve.size(); ++i) {
    EXPECT_DOUBLE_EQ(l.curve[i].bytes, double(1 << 20) * std::pow(4.0, i));
    EXPECT_NEAR(l.curve[i].efficiency, truth.all_reduce_efficiency[i], 1e-9);
  }
  EXPECT_NEAR(*l.all_reduce_max_efficiency, 1.05, 1e-9);
  EXPECT_NEAR(*l.max_efficiency, truth.all_gather_efficiency, 1e-9);
  EXPECT_FALSE(c.network.has_value());  // one node: nothing about the network
}

TEST(HwexecFit, CalibratedModelReproducesTheMeasuredTimes) {
  // Simulated vs measured: with the fitted values, the simulator's formulas give back the
  // measured times of the shapes and sizes the fit matched.
  const GpuSpec gpu = h100();
  const MicroResults micro = synthetic_micro(gpu);
  Expected<Fit> f = fit_micro(micro, gpu, "synthetic");
  ASSERT_TRUE(f.ok()) << f.error().message();
  Calibration cal;
  cal.gpus[gpu.name] = f->calibration;
  ComputeModel compute = ComputeModel::defaults_for(gpu);
  CommModel comm = CommModel::defaults_for(gpu);
  apply_calibration(cal, gpu.name, compute, comm);
  compute.sustained = 1;                           // a microbenchmark runs at its short-run clock
  const GemmSample& x = micro.gemm[0].samples[1];  // 4096^3 bf16
  EXPECT_NEAR(gemm_seconds(x.m, x.n, x.k, Precision::kBf16, gpu, compute), x.t.seconds,
              1e-9 * x.t.seconds);
  // A ring all-reduce of 64 MiB over 8 GPUs: 14 steps + the volume at the fitted efficiency.
  const CollectiveSample& y = micro.collectives[0].samples[4];
  const double volume = 2.0 * 7 / 8 * y.bytes;
  const double t = 14 * comm.nvlink.step_latency +
                   volume / (gpu.nvlink_bandwidth * comm.nvlink.efficiency(y.bytes, true));
  EXPECT_NEAR(t, y.t.seconds, 1e-9 * y.t.seconds);
}

TEST(HwexecFit, FasterThanTheDatasheetMeansTheWrongGpu) {
  // H100 measurements fitted against an A100: the bf16 GEMMs beat the A100's peak.
  const MicroResults micro = synthetic_micro(h100());
  Expected<Fit> f = fit_micro(micro, *find_gpu("a100-sxm4-80gb"), "x");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message().find("a100-sxm4-80gb's datasheet peak"), std::string::npos)
      << f.error().message();
  EXPECT_NE(f.error().message().find("--gpu"), std::string::npos);
}

TEST(HwexecFit, OneGpuHasNoLinkParametersAndSaysWhy) {
  MicroResults micro = synthetic_micro(h100());
  micro.collectives.clear();
  Expected<Fit> f = fit_micro(micro, h100(), "x");
  ASSERT_TRUE(f.ok()) << f.error().message();
  EXPECT_FALSE(f->calibration.nvlink.has_value());
  ASSERT_FALSE(f->notes.empty());
  EXPECT_NE(f->notes[0].find("collectives"), std::string::npos);
  micro.gemm.clear();
  micro.memory.clear();
  EXPECT_FALSE(fit_micro(micro, h100(), "x").ok());
}

TEST(HwexecFit, DeviceNamesMatchTheCatalog) {
  EXPECT_EQ(*match_catalog_gpu("NVIDIA H200"), "h200-sxm-141gb");
  EXPECT_EQ(*match_catalog_gpu("NVIDIA H100 80GB HBM3"), "h100-sxm5-80gb");
  EXPECT_EQ(*match_catalog_gpu("NVIDIA A100-SXM4-40GB"), "a100-sxm4-40gb");
  EXPECT_EQ(*match_catalog_gpu("NVIDIA A100 80GB PCIe"), "a100-pcie-80gb");
  Expected<std::string> unknown = match_catalog_gpu("NVIDIA GeForce RTX 4090");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.error().message().find("RTX 4090"), std::string::npos);
  EXPECT_NE(unknown.error().message().find("--gpu"), std::string::npos);
}

// Bad files: errors name the file and the object.
class HwexecBadFile : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(write_micro(path_, synthetic_micro(h100())).ok()); }
  // Opens the file for editing.
  hid_t open() { return H5Fopen(path_.c_str(), H5F_ACC_RDWR, H5P_DEFAULT); }
  std::string error() {
    Expected<MicroResults> r = read_micro(path_);
    EXPECT_FALSE(r.ok());
    return r.ok() ? "" : r.error().message();
  }
  TempDir dir_;
  std::string path_ = dir_.file("m.h5");
};

TEST_F(HwexecBadFile, MissingFile) {
  Expected<MicroResults> r = read_micro(dir_.file("nope.h5"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("nope.h5"), std::string::npos);
  EXPECT_NE(r.error().message().find("nnexec bench"), std::string::npos);
}

TEST_F(HwexecBadFile, WrongFormatName) {
  hid_t f = open();
  H5Adelete(f, "format");
  H5Fclose(f);
  const std::string e = error();
  EXPECT_NE(e.find("m.h5"), std::string::npos) << e;
  EXPECT_NE(e.find("'format'"), std::string::npos) << e;
  EXPECT_NE(e.find("nnexec-micro"), std::string::npos) << e;
}

TEST_F(HwexecBadFile, WrongVersion) {
  hid_t f = open();
  hid_t a = H5Aopen(f, "version", H5P_DEFAULT);
  long long v = 7;
  H5Awrite(a, H5T_NATIVE_LLONG, &v);
  H5Aclose(a);
  H5Fclose(f);
  const std::string e = error();
  EXPECT_NE(e.find("'version'"), std::string::npos) << e;
  EXPECT_NE(e.find("is 7"), std::string::npos) << e;
}

TEST_F(HwexecBadFile, MissingDatasetAndNonPositiveTime) {
  hid_t f = open();
  H5Ldelete(f, "gemm/bf16/k", H5P_DEFAULT);
  hid_t set = H5Dopen2(f, "memory/add/seconds", H5P_DEFAULT);
  std::vector<double> t(7, 1e-3);
  t[2] = 0;
  H5Dwrite(set, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data());
  H5Dclose(set);
  H5Fclose(f);
  std::string e = error();
  EXPECT_NE(e.find("/gemm/bf16"), std::string::npos) << e;
  EXPECT_NE(e.find("'k' is missing"), std::string::npos) << e;
  f = open();
  H5Ldelete(f, "gemm/bf16", H5P_DEFAULT);
  H5Fclose(f);
  e = error();
  EXPECT_NE(e.find("/memory/add/seconds: entry 2 is 0"), std::string::npos) << e;
}

}  // namespace
}  // namespace nnsim::hwexec
