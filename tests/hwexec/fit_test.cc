// The microbenchmark file and the calibration fit, on synthetic results with known answers.
#include <hdf5.h>

#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include <map>

#include "core/calibration.h"
#include "core/collective.h"
#include "hwexec/fit.h"
#include "hwexec/fit_host.h"
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
  EXPECT_EQ(r->collectives.size(), m.collectives.size());
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
  ASSERT_EQ(r->attention.size(), 1u);
  EXPECT_EQ(r->attention[0].dtype, "bf16");
  EXPECT_EQ(r->attention[0].kernel, "sdpa");
  ASSERT_EQ(r->attention[0].samples.size(), m.attention[0].samples.size());
  for (size_t i = 0; i < m.attention[0].samples.size(); ++i) {
    const AttentionSample& a = r->attention[0].samples[i];
    const AttentionSample& b = m.attention[0].samples[i];
    EXPECT_EQ(a.batch, b.batch);
    EXPECT_EQ(a.heads, b.heads);
    EXPECT_EQ(a.seq, b.seq);
    EXPECT_EQ(a.head_dim, b.head_dim);
    EXPECT_DOUBLE_EQ(a.fwd.seconds, b.fwd.seconds);
    EXPECT_DOUBLE_EQ(a.bwd.seconds_min, b.bwd.seconds_min);
  }
  // The host's Adam and copies (version 4); directions come back in name order.
  ASSERT_EQ(r->host_adam.size(), m.host_adam.size());
  for (size_t i = 0; i < m.host_adam.size(); ++i) {
    EXPECT_EQ(r->host_adam[i].elements, m.host_adam[i].elements);
    EXPECT_DOUBLE_EQ(r->host_adam[i].t.seconds, m.host_adam[i].t.seconds);
  }
  ASSERT_EQ(r->host_copies.size(), 2u);
  EXPECT_EQ(r->host_copies[0].direction, "to_device");
  EXPECT_EQ(r->host_copies[1].direction, "to_host");
  EXPECT_EQ(r->host_copies[1].gpus, 8);
  ASSERT_EQ(r->host_copies[1].samples.size(), m.host_copies[0].samples.size());
  EXPECT_DOUBLE_EQ(r->host_copies[1].samples[1].t.seconds, m.host_copies[0].samples[1].t.seconds);
}

TEST(HwexecMicro, VersionOneFilesWithoutAttentionStillRead) {
  TempDir dir;
  MicroResults m = synthetic_micro(h100());
  m.attention.clear();
  ASSERT_TRUE(write_micro(dir.file("v1.h5"), m).ok());
  // What version 1 wrote: no attention group, one group size per collective as an attribute,
  // version 1.
  hid_t f = H5Fopen(dir.file("v1.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Ldelete(f, "attention", H5P_DEFAULT), 0);
  for (const char* kind : {"all_reduce", "all_gather"}) {
    hid_t g = H5Gopen2(f, (std::string("collectives/") + kind).c_str(), H5P_DEFAULT);
    ASSERT_GE(g, 0) << kind;
    ASSERT_GE(H5Ldelete(g, "ranks", H5P_DEFAULT), 0);
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t attr = H5Acreate2(g, "ranks", H5T_NATIVE_LLONG, space, H5P_DEFAULT, H5P_DEFAULT);
    const long long ranks = m.collectives[0].ranks;
    H5Awrite(attr, H5T_NATIVE_LLONG, &ranks);
    H5Aclose(attr);
    H5Sclose(space);
    H5Gclose(g);
  }
  hid_t a = H5Aopen(f, "version", H5P_DEFAULT);
  long long v = 1;
  H5Awrite(a, H5T_NATIVE_LLONG, &v);
  H5Aclose(a);
  H5Fclose(f);
  Expected<MicroResults> r = read_micro(dir.file("v1.h5"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_TRUE(r->attention.empty());
  EXPECT_EQ(r->gemm.size(), 2u);
  ASSERT_EQ(r->collectives.size(), 2u);
  EXPECT_EQ(r->collectives[0].ranks, m.collectives[0].ranks);
  EXPECT_EQ(r->collectives[0].samples.size(), m.collectives[0].samples.size());
  // It still fits, without attention, and says so.
  Expected<Fit> fit = fit_micro(*r, h100(), "v1");
  ASSERT_TRUE(fit.ok()) << fit.error().message();
  EXPECT_FALSE(fit->attention.has_value());
  EXPECT_EQ(fit->calibration.compute.count("attention_fwd_efficiency"), 0u);
  bool noted = false;
  for (const std::string& n : fit->notes) noted = noted || n.find("attention: none") == 0;
  EXPECT_TRUE(noted);
}

TEST(HwexecFit, RecoversTheParametersTheTimesWereMadeWith) {
  const GpuSpec gpu = h100();
  const Truth truth;
  Expected<Fit> f = fit_micro(synthetic_micro(gpu, truth), gpu, "synthetic");
  ASSERT_TRUE(f.ok()) << f.error().message();
  const GpuCalibration& c = f->calibration;
  EXPECT_EQ(c.source, "synthetic");
  ASSERT_EQ(c.gemm_efficiency.count(Precision::kBf16), 1u);
  // The relative least squares over the four shapes (synthetic.h, gemm_fit_of): below the three
  // that run at the truth's efficiency, pulled down by the slow one (the largest e_i, the old
  // estimator, gave the truth exactly and priced the slow shape 33 % fast).
  const double e_bf16 = testing::gemm_fit_of(truth.bf16_efficiency);
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kBf16), e_bf16, 1e-9);
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kFp8), testing::gemm_fit_of(truth.fp8_efficiency),
              1e-9);
  EXPECT_NEAR(f->gemm[0].best_efficiency, truth.bf16_efficiency, 1e-9);
  // Three of four shapes are priced e / e_fit - 1 slow, the slow one 1 - e / (1.5 e_fit) fast.
  EXPECT_NEAR(f->gemm[0].median_error, truth.bf16_efficiency / e_bf16 - 1, 1e-9);
  EXPECT_NEAR(f->gemm[0].max_error, 1 - truth.bf16_efficiency / (1.5 * e_bf16), 1e-9);
  EXPECT_EQ(f->gemm[0].slower, 3);
  EXPECT_EQ(f->gemm[0].faster, 1);
  // A microbenchmark file alone leaves sustained (the training run's clock drop) built in.
  EXPECT_EQ(c.compute.count("sustained"), 0u);
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

  ASSERT_TRUE(f->attention.has_value());
  EXPECT_TRUE(f->attention->seq_half_fitted);
  auto rel = [](double got, double want) { return std::abs(got / want - 1); };
  EXPECT_LT(rel(c.compute.at("attention_fwd_efficiency"), truth.attention_fwd_efficiency), 1e-6);
  EXPECT_LT(rel(c.compute.at("attention_bwd_efficiency"), truth.attention_bwd_efficiency), 1e-6);
  EXPECT_LT(rel(c.compute.at("attention_seq_half"), truth.attention_seq_half), 1e-6);
  EXPECT_LT(f->attention->max_error, 1e-9);
}

TEST(HwexecFit, AttentionFromOneLengthKeepsTheBuiltInSeqHalf) {
  const GpuSpec gpu = h100();
  Truth truth;
  truth.attention_seq_half = ComputeModel::defaults_for(gpu).attention_seq_half;
  MicroResults micro = synthetic_micro(gpu, truth);
  auto& samples = micro.attention[0].samples;
  samples.erase(std::remove_if(samples.begin(), samples.end(),
                               [](const AttentionSample& x) { return x.seq != 4096; }),
                samples.end());
  ASSERT_EQ(samples.size(), 2u);  // head widths 128 and 64
  Expected<Fit> f = fit_micro(micro, gpu, "x");
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->attention.has_value());
  EXPECT_FALSE(f->attention->seq_half_fitted);
  EXPECT_EQ(f->calibration.compute.count("attention_seq_half"), 0u);
  EXPECT_NEAR(f->calibration.compute.at("attention_fwd_efficiency"), truth.attention_fwd_efficiency,
              1e-9);
  EXPECT_NEAR(f->calibration.compute.at("attention_bwd_efficiency"), truth.attention_bwd_efficiency,
              1e-9);
  bool noted = false;
  for (const std::string& n : f->notes) noted = noted || n.find("one sequence length") != n.npos;
  EXPECT_TRUE(noted);
}

bool has_note(const Fit& f, const char* text) {
  for (const std::string& n : f.notes) {
    if (n.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(HwexecFit, AttentionOutsideTheModelsFormFallsBackWithANote) {
  const GpuSpec gpu = h100();
  // Longer sequences slower per FLOP: a negative slope, seq_half 0.
  MicroResults flat = synthetic_micro(gpu);
  for (AttentionSample& x : flat.attention[0].samples) x.fwd.seconds *= 1 + x.seq / 1024;
  Expected<Fit> f = fit_micro(flat, gpu, "x");
  ASSERT_TRUE(f.ok()) << f.error().message();
  EXPECT_TRUE(f->attention->seq_half_fitted);
  EXPECT_EQ(f->calibration.compute.at("attention_seq_half"), 0);
  EXPECT_TRUE(has_note(*f, "does not fall with the sequence length"));
  // Time per FLOP falling like 1/s^2: the line's intercept is negative; built-in seq_half kept.
  MicroResults steep = synthetic_micro(gpu);
  for (AttentionSample& x : steep.attention[0].samples) {
    x.fwd.seconds *= (16384 / x.seq) * (16384 / x.seq);
  }
  f = fit_micro(steep, gpu, "x");
  ASSERT_TRUE(f.ok()) << f.error().message();
  EXPECT_FALSE(f->attention->seq_half_fitted);
  EXPECT_EQ(f->calibration.compute.count("attention_seq_half"), 0u);
  EXPECT_GT(f->calibration.compute.at("attention_fwd_efficiency"), 0);
  EXPECT_TRUE(has_note(*f, "falls faster"));
}

TEST(HwexecFit, AttentionFasterThanThePeakOnAGpuIsAnError) {
  const GpuSpec gpu = h100();
  Truth truth;
  truth.attention_fwd_efficiency = 1.5;
  Expected<Fit> f = fit_micro(synthetic_micro(gpu, truth), gpu, "x");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message().find("attention forward"), std::string::npos)
      << f.error().message();
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
  compute.sustained = 1;  // a microbenchmark runs at its short-run clock
  // 4096^3 bf16 ran at the truth's efficiency; the fit is the least squares over it and the slow
  // shape (synthetic.h), so the model prices it truth / fit times its measured time.
  const GemmSample& x = micro.gemm[0].samples[1];
  const double e = Truth{}.bf16_efficiency;
  EXPECT_NEAR(gemm_seconds(x.m, x.n, x.k, Precision::kBf16, gpu, compute),
              x.t.seconds * e / testing::gemm_fit_of(e), 1e-9 * x.t.seconds);
  // A ring all-reduce of 64 MiB over 8 GPUs: 14 steps + the volume at the fitted efficiency.
  const CollectiveSample& y = micro.collectives[0].samples[4];
  const double volume = 2.0 * 7 / 8 * y.bytes;
  const double t = 14 * comm.nvlink.step_latency +
                   volume / (gpu.nvlink_bandwidth * comm.nvlink.efficiency(y.bytes, true));
  EXPECT_NEAR(t, y.t.seconds, 1e-9 * y.t.seconds);
  // Causal attention at 1024 tokens, forward and backward, without the per-kernel overhead the
  // benchmark's times leave out.
  compute.kernel_overhead = 0;
  const AttentionSample& a = micro.attention[0].samples[1];
  Op op;
  op.kind = OpKind::kAttention;
  op.causal = true;
  PieceShape shape;
  shape.seq = a.seq;
  shape.head_dim = a.head_dim;
  EXPECT_NEAR(op_seconds(op, Pass::kForward, a.flops(), 0, shape, Precision::kBf16, gpu, compute),
              a.fwd.seconds, 1e-6 * a.fwd.seconds);
  EXPECT_NEAR(
      op_seconds(op, Pass::kBackwardInput, 2 * a.flops(), 0, shape, Precision::kBf16, gpu, compute),
      a.bwd.seconds, 1e-6 * a.bwd.seconds);
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
  micro.attention.clear();
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

TEST_F(HwexecBadFile, AttentionErrorsNameTheGroup) {
  hid_t f = open();
  H5Ldelete(f, "attention/bf16/bwd_seconds", H5P_DEFAULT);
  H5Fclose(f);
  const std::string e = error();
  EXPECT_NE(e.find("m.h5: /attention/bf16: dataset 'bwd_seconds' is missing"), std::string::npos)
      << e;
}

TEST(HwexecFit, TheLargestGroupSetsTheLinkAndTheSmallerOnesCheckIt) {
  const GpuSpec gpu = h100();
  Truth truth;
  truth.smaller_groups = {2, 4};
  const MicroResults m = synthetic_micro(gpu, truth);
  ASSERT_EQ(m.collectives.size(), 6u);
  // The file keeps every group size, in the order measured.
  TempDir dir;
  ASSERT_TRUE(write_micro(dir.file("m.h5"), m).ok());
  Expected<MicroResults> r = read_micro(dir.file("m.h5"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  ASSERT_EQ(r->collectives.size(), 6u);
  std::vector<std::pair<std::string, int>> series;
  for (const CollectiveSeries& s : r->collectives) series.push_back({s.kind, s.ranks});
  EXPECT_EQ(series, (std::vector<std::pair<std::string, int>>{{"all_gather", 8},
                                                              {"all_gather", 2},
                                                              {"all_gather", 4},
                                                              {"all_reduce", 8},
                                                              {"all_reduce", 2},
                                                              {"all_reduce", 4}}));

  Expected<Fit> f = fit_micro(*r, gpu, "groups");
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->nvlink.has_value());
  EXPECT_EQ(f->nvlink->ranks, 8);
  // The same parameters as from the 8-GPU group alone.
  Expected<Fit> alone = fit_micro(synthetic_micro(gpu, Truth{}), gpu, "8");
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(f->calibration.nvlink->step_latency, alone->calibration.nvlink->step_latency);
  ASSERT_EQ(f->calibration.nvlink->curve.size(), alone->calibration.nvlink->curve.size());
  // Every group against the fitted model. The all-reduces of 2 and 4 GPUs come from the same
  // link, so the model times them exactly at the curve's sizes, and within the smallest
  // message's bandwidth term below them. The all-gathers show the one-curve model's error (their
  // own efficiency is flat), for every group size alike.
  ASSERT_EQ(f->nvlink->checks.size(), 6u);
  std::map<int, double> all_gather_error;
  for (const LinkFit::GroupCheck& c : f->nvlink->checks) {
    EXPECT_EQ(c.samples, 6);
    if (c.kind == "all_reduce") {
      EXPECT_LT(c.median_error, 1e-9) << c.ranks;
      EXPECT_LT(c.max_error, 0.01) << c.ranks;
    } else {
      all_gather_error[c.ranks] = c.median_error;
    }
  }
  ASSERT_EQ(all_gather_error.size(), 3u);
  for (const auto& [ranks, error] : all_gather_error) {
    EXPECT_GT(error, 0.01) << ranks;
    EXPECT_LT(error, 0.1) << ranks;
  }

  // A group that is not the model (its collectives 1.5 times as long) shows in the check.
  MicroResults skewed = m;
  for (CollectiveSeries& s : skewed.collectives) {
    if (s.ranks == 2) {
      for (CollectiveSample& x : s.samples) x.t.seconds *= 1.5;
    }
  }
  f = fit_micro(skewed, gpu, "skewed");
  ASSERT_TRUE(f.ok()) << f.error().message();
  bool checked = false;
  for (const LinkFit::GroupCheck& c : f->nvlink->checks) {
    if (c.ranks != 2 || c.kind != "all_reduce") continue;
    checked = true;
    EXPECT_NEAR(c.median_error, 1.0 / 3, 1e-6);
  }
  EXPECT_TRUE(checked);
}

// The host's side of offloading, against dgx-h100-superpod's node.host: each figure from its
// largest size, relative to the topology's memory bandwidth or a GPU's way to the host.
TEST(HwexecFitHost, RecoversTheHostsEfficienciesFromTheLargestSizes) {
  const MicroResults m = synthetic_micro(h100());
  Expected<Topology> pod = load_topology("dgx-h100-superpod");
  ASSERT_TRUE(pod.ok()) << pod.error().message();
  Expected<HostFit> f = fit_host(m, "m.h5", *pod);
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->memory_efficiency && f->to_host_efficiency && f->to_device_efficiency);
  EXPECT_NEAR(*f->memory_efficiency, 0.3, 1e-12);
  EXPECT_NEAR(*f->to_host_efficiency, 0.8, 1e-12);
  EXPECT_NEAR(*f->to_device_efficiency, 0.85, 1e-12);
  EXPECT_EQ(f->link_bandwidth, 64e9);
  EXPECT_EQ(f->gpus, 8);
  EXPECT_TRUE(f->notes.empty());
  EXPECT_TRUE(has_host_series(m));
  EXPECT_FALSE(has_host_series(MicroResults{}));
}

TEST(HwexecFitHost, BadTopologiesAndFewerGpusAreNamed) {
  MicroResults m = synthetic_micro(h100());
  Expected<Topology> pod = load_topology("dgx-h100-superpod");
  ASSERT_TRUE(pod.ok()) << pod.error().message();
  // No host described.
  Topology bare = *pod;
  bare.has_host = false;
  Expected<HostFit> f = fit_host(m, "m.h5", bare);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message().find("describes none: add node.host"), std::string::npos)
      << f.error().message();
  // A memory slower than the measured Adam: the topology is not the machine.
  Topology slow = *pod;
  slow.host.memory_bandwidth = 100e9;
  f = fit_host(m, "m.h5", slow);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message().find("correct node.host.memory_bandwidth"), std::string::npos)
      << f.error().message();
  // Four of the node's eight GPUs copying: a note, and where they beat the share, an error that
  // says to measure on all eight.
  for (HostCopySeries& s : m.host_copies) s.gpus = 4;
  f = fit_host(m, "m.h5", *pod);
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_EQ(f->notes.size(), 1u);
  EXPECT_NE(f->notes[0].find("ran on 4 GPUs at once"), std::string::npos) << f->notes[0];
  Topology narrow = *pod;
  narrow.host.link_bandwidth = 32e9;
  f = fit_host(m, "m.h5", narrow);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message().find("correct node.host.link_bandwidth, or measure on all 8 GPUs"),
            std::string::npos)
      << f.error().message();
}

}  // namespace
}  // namespace nnsim::hwexec
