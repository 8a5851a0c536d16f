// nnexec bench and nnsim calibrate end to end: they run the binaries and look at what a user
// sees (exit status, output, files). Tests that need LibTorch or a GPU report Skipped without.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <optional>

#include <gtest/gtest.h>

#include "core/calibration.h"
#include "hwexec/micro.h"
#include "nnexec_info.h"
#include "process.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::nnexec_build;
using testing::nnexec_info;
using testing::NnexecInfo;
using testing::synthetic_micro;
using testing::TempDir;

using testing::contains;
using testing::run;
using testing::RunResult;
using testing::slurp;

std::optional<std::string> python_with_h5py(const TempDir& dir) {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    if (run(dir, python, {"-c", "import h5py"}).status == 0) return std::string(python);
  }
  return std::nullopt;
}

TEST(NnexecBench, CpuQuickWritesPlausibleFiguresReadableWithH5py) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  RunResult r = run(dir, NNEXEC_BINARY, {"bench", "--out", "micro.h5", "--quick"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "gemm fp32")) << r;

  Expected<MicroResults> m = read_micro(dir.file("micro.h5"));
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->device, "cpu");
  EXPECT_GE(m->threads, 1);
  ASSERT_FALSE(m->gemm.empty());
  EXPECT_EQ(m->gemm[0].precision, Precision::kBf16);  // name order: bf16, fp32
  for (const GemmSeries& s : m->gemm) {
    ASSERT_GE(s.samples.size(), 3u);
    for (const GemmSample& x : s.samples) {
      const double rate = x.flops() / x.t.seconds;
      // Any CPU of the last 15 years multiplies at more than 0.1 GFLOP/s, and no single node
      // at more than 100 TFLOP/s.
      EXPECT_GT(rate, 1e8) << to_string(s.precision) << " " << x.m;
      EXPECT_LT(rate, 1e14) << to_string(s.precision) << " " << x.m;
      EXPECT_LE(x.t.seconds_min, x.t.seconds);
    }
  }
  ASSERT_EQ(m->memory.size(), 4u);
  for (const MemorySeries& s : m->memory) {
    EXPECT_EQ(s.dtype, "fp32");
    for (const MemorySample& x : s.samples) {
      EXPECT_DOUBLE_EQ(x.bytes, x.elements * s.bytes_per_element);
      EXPECT_GT(x.bytes / x.t.seconds, 1e8) << s.op;   // > 0.1 GB/s
      EXPECT_LT(x.bytes / x.t.seconds, 1e13) << s.op;  // < 10 TB/s
    }
  }
  EXPECT_TRUE(m->collectives.empty());
  ASSERT_EQ(m->attention.size(), 1u);
  const AttentionSeries& at = m->attention[0];
  EXPECT_EQ(at.dtype, "fp32");
  EXPECT_TRUE(at.kernel == "sdpa" || at.kernel == "math") << at.kernel;
  ASSERT_EQ(at.samples.size(), 3u);
  for (const AttentionSample& x : at.samples) {
    EXPECT_GT(x.fwd.seconds, 0);
    EXPECT_GT(x.bwd.seconds, 0);
    EXPECT_LE(x.fwd.seconds_min, x.fwd.seconds);
    EXPECT_LT(x.flops() / x.fwd.seconds, 1e14) << x.seq;
  }
  EXPECT_TRUE(contains(r.out, "attention  fp32")) << r;
  // The host's Adam on this CPU, and no copies without GPUs.
  ASSERT_EQ(m->host_adam.size(), 2u);
  for (const HostAdamSample& x : m->host_adam) {
    const double rate = x.elements * kHostAdamBytesPerElement / x.t.seconds;
    EXPECT_GT(rate, 1e7) << x.elements;   // > 10 MB/s
    EXPECT_LT(rate, 1e13) << x.elements;  // < 10 TB/s
  }
  EXPECT_TRUE(m->host_copies.empty());
  EXPECT_TRUE(contains(r.out, "host adam  262144 weights")) << r;
  EXPECT_TRUE(contains(r.out, "host copies: skipped: they need GPUs")) << r;

  // The CPU file calibrates (relative to a GPU's datasheet) and sets the attention values.
  RunResult c =
      run(dir, NNSIM_BINARY, {"calibrate", "micro.h5", "--gpu", "h100-sxm5-80gb", "-o", "cal.h5"});
  ASSERT_EQ(c.status, 0) << c;
  EXPECT_TRUE(contains(c.out, "attention_fwd_efficiency ")) << c;
  Expected<Calibration> cal = load_calibration(dir.file("cal.h5"));
  ASSERT_TRUE(cal.ok()) << cal.error().message();
  const GpuCalibration& g = cal->gpus.at("h100-sxm5-80gb");
  ASSERT_EQ(g.compute.count("attention_fwd_efficiency"), 1u);
  EXPECT_GT(g.compute.at("attention_fwd_efficiency"), 0);
  EXPECT_LE(g.compute.at("attention_fwd_efficiency"), 1);
  ASSERT_EQ(g.compute.count("attention_bwd_efficiency"), 1u);
  EXPECT_GT(g.compute.at("attention_bwd_efficiency"), 0);

  std::optional<std::string> python = python_with_h5py(dir);
  if (!python) GTEST_SKIP() << "no python3 with h5py (apt-get install python3-h5py)";
  std::ofstream(dir.file("check.py")) << R"(import sys
import h5py
with h5py.File(sys.argv[1], "r") as f:
    fmt = f.attrs["format"]
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    assert fmt == "nnexec-micro", fmt
    assert int(f.attrs["version"]) == 4
    g = f["gemm/fp32"]
    rate = 2 * g["m"][()] * g["n"][()] * g["k"][()] / g["seconds"][()]
    assert abs(rate / g["flop_per_s"][()] - 1).max() < 1e-9, rate
    a = f["memory/add"]
    assert (a["bytes"][()] == 12 * a["elements"][()]).all()
    t = f["attention/fp32"]
    flops = 4 * t["batch"][()] * t["heads"][()] * t["seq"][()] ** 2 * t["head_dim"][()]
    assert abs(flops / t["flops"][()] - 1).max() < 1e-9
    assert (t["bwd_seconds"][()] > 0).all()
    h = f["host_adam"]
    assert abs(h["bytes_per_s"][()] * h["seconds"][()] / h["elements"][()] - 28).max() < 1e-9
    print("ok %.1f GFLOP/s" % (rate.max() / 1e9))
)";
  RunResult check = run(dir, *python, {"check.py", "micro.h5"});
  EXPECT_EQ(check.status, 0) << check;
  EXPECT_TRUE(contains(check.out, "ok ")) << check;
}

// The tests learn what the GPUs allow from `nnexec info` (tests/hwexec/nnexec_info.h): its
// lines on a GPU machine, on one whose LibTorch has no CUDA, and on a CPU machine.
TEST(NnexecInfo, ReadsTheVersionsAndTheGpuLine) {
  const NnexecInfo gpu = testing::parse_nnexec_info(
      "LibTorch   2.5.1+cu124\nCUDA+NCCL  built in, NCCL 2.21.5\n"
      "GPUs       8 x NVIDIA H100 80GB HBM3\n");
  EXPECT_EQ(gpu.torch_version, "2.5.1+cu124");
  EXPECT_EQ(gpu.nccl_version, "2.21.5");
  EXPECT_TRUE(gpu.gpus.usable);
  EXPECT_EQ(gpu.gpus.devices, 8);
  EXPECT_EQ(gpu.gpus.name, "NVIDIA H100 80GB HBM3");
  const NnexecInfo nccl_only = testing::parse_nnexec_info(
      "LibTorch   1.13.0\nCUDA+NCCL  built in, NCCL 2.28.9\n"
      "GPUs       1 x NVIDIA H200 (LibTorch here has no CUDA: only NCCL can use them)\n");
  EXPECT_EQ(nccl_only.gpus.devices, 1);
  EXPECT_EQ(nccl_only.gpus.name, "NVIDIA H200");
  const NnexecInfo cpu = testing::parse_nnexec_info(
      "LibTorch   not built in\nCUDA+NCCL  not built in\n"
      "GPUs       none usable: cudaErrorInsufficientDriver: CUDA driver version is "
      "insufficient for CUDA runtime version\n");
  EXPECT_EQ(cpu.torch_version, "");
  EXPECT_EQ(cpu.nccl_version, "");
  EXPECT_FALSE(cpu.gpus.usable);
  EXPECT_EQ(cpu.gpus.reason,
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
            "version");
  const NnexecInfo odd = testing::parse_nnexec_info("GPUs       many\n");
  EXPECT_FALSE(odd.gpus.usable);
  EXPECT_NE(odd.gpus.reason.find("did not read: 'many'"), std::string::npos) << odd.gpus.reason;
  // And the nnexec under test agrees with what CMake says it was built with.
  EXPECT_EQ(nnexec_info().torch_version.empty(), !nnexec_build().torch) << nnexec_info().text;
  EXPECT_EQ(nnexec_info().nccl_version.empty(), !nnexec_build().cuda) << nnexec_info().text;
}

TEST(NnexecBench, CudaWithoutAGpuSaysWhy) {
  const CudaProbe probe = nnexec_info().gpus;
  if (probe.usable) GTEST_SKIP() << "a GPU is usable here (" << probe.name << ")";
  TempDir dir;
  RunResult r = run(dir, NNEXEC_BINARY, {"bench", "--out", "m.h5", "--device", "cuda"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "--device cuda: no usable GPU: ")) << r;
  EXPECT_TRUE(contains(r.err, probe.reason)) << r;
  if (nnexec_build().cuda) {
    // The runtime's own error name, e.g. cudaErrorInsufficientDriver without a driver.
    EXPECT_TRUE(contains(r.err, "cudaError")) << r;
  }
  EXPECT_FALSE(std::ifstream(dir.file("m.h5")).good());
}

TEST(NnexecBench, CudaQuickOnAGpu) {
  const CudaProbe probe = nnexec_info().gpus;
  if (!probe.usable) GTEST_SKIP() << "no usable GPU: " << probe.reason;
  if (!nnexec_build().torch_cuda) GTEST_SKIP() << "LibTorch here has no CUDA";
  TempDir dir;
  RunResult r = run(dir, NNEXEC_BINARY, {"bench", "--out", "m.h5", "--device", "cuda", "--quick"});
  ASSERT_EQ(r.status, 0) << r;
  Expected<MicroResults> m = read_micro(dir.file("m.h5"));
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->device, "cuda");
  bool bf16 = false;
  for (const GemmSeries& s : m->gemm) {
    if (s.precision != Precision::kBf16) continue;
    bf16 = true;
    double best = 0;
    for (const GemmSample& x : s.samples) best = std::max(best, x.flops() / x.t.seconds);
    EXPECT_GT(best, 1e12);  // any tensor-core GPU: > 1 TFLOP/s in bf16
  }
  EXPECT_TRUE(bf16);
  ASSERT_EQ(m->attention.size(), 1u);
  EXPECT_EQ(m->attention[0].dtype, "bf16");
  for (const AttentionSample& x : m->attention[0].samples) {
    EXPECT_GT(x.fwd.seconds, 0);
    EXPECT_GT(x.bwd.seconds, 0);
  }
  RunResult c = run(dir, NNSIM_BINARY, {"calibrate", "m.h5", "-o", "cal.h5"});
  if (contains(c.err, "is not a catalog GPU")) GTEST_SKIP() << c.err;
  EXPECT_EQ(c.status, 0) << c;
  EXPECT_TRUE(contains(c.out, "attention_fwd_efficiency ")) << c;
}

TEST(NnsimCalibrate, SyntheticFileRoundTripsIntoACalibrationFile) {
  TempDir dir;
  const GpuSpec gpu = *find_gpu("h100-sxm5-80gb");
  ASSERT_TRUE(write_micro(dir.file("micro.h5"), synthetic_micro(gpu)).ok());
  RunResult r = run(dir, NNSIM_BINARY, {"calibrate", "micro.h5", "-o", "cal.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "(h100-sxm5-80gb)")) << r;  // matched from the device name
  // bf16: the relative least squares over synthetic_micro's four shapes, three at 0.7 and one
  // 1.5 times slower (synthetic.h, gemm_fit_of); the best shape's 0.7 is printed as the best.
  EXPECT_NEAR(testing::gemm_fit_of(0.7), 0.6576, 5e-5);
  EXPECT_TRUE(contains(r.out, "gemm_efficiency_bf16 0.6576 ")) << r;
  EXPECT_TRUE(contains(r.out, "e 0.7, at 4096x4096x4096")) << r;
  EXPECT_TRUE(contains(r.out, "memory_efficiency    0.85 ")) << r;
  EXPECT_TRUE(contains(r.out, "attention_fwd_efficiency 0.55 ")) << r;
  EXPECT_TRUE(contains(r.out, "attention_seq_half   300 ")) << r;
  Expected<Calibration> c = load_calibration(dir.file("cal.h5"));
  ASSERT_TRUE(c.ok()) << c.error().message();
  ASSERT_EQ(c->gpus.count("h100-sxm5-80gb"), 1u);
  const GpuCalibration& g = c->gpus.at("h100-sxm5-80gb");
  EXPECT_TRUE(contains(g.source, "micro.h5")) << g.source;
  EXPECT_NEAR(g.gemm_efficiency.at(Precision::kBf16), testing::gemm_fit_of(0.7), 1e-9);
  EXPECT_EQ(g.compute.count("sustained"), 0u);  // a microbenchmark alone keeps the built-in
  EXPECT_NEAR(g.compute.at("kernel_overhead"), 5e-6, 1e-12);
  EXPECT_NEAR(g.compute.at("attention_bwd_efficiency"), 0.4, 1e-9);
  ASSERT_TRUE(g.nvlink.has_value());
  EXPECT_EQ(g.nvlink->curve.size(), 5u);
  // The file drives a simulation: nnsim accepts it.
  EXPECT_FALSE(g.network.has_value());
}

// The host's Adam and copies need a topology whose node.host they are relative to.
TEST(NnsimCalibrate, TheHostIsFittedAgainstTheTopologysHost) {
  TempDir dir;
  const GpuSpec gpu = *find_gpu("h100-sxm5-80gb");
  MicroResults m = synthetic_micro(gpu);
  ASSERT_TRUE(write_micro(dir.file("micro.h5"), m).ok());
  RunResult r = run(dir, NNSIM_BINARY, {"calibrate", "micro.h5", "-o", "cal.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "its host Adam and copies are not fitted without a topology")) << r;
  r = run(dir, NNSIM_BINARY,
          {"calibrate", "micro.h5", "--topo", "dgx-h100-superpod", "-o", "cal.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "host_memory_efficiency 0.3 ")) << r;
  EXPECT_TRUE(contains(r.out, "device_to_host_efficiency 0.8 ")) << r;
  EXPECT_TRUE(contains(r.out, "host_to_device_efficiency 0.85 ")) << r;
  Expected<Calibration> c = load_calibration(dir.file("cal.h5"));
  ASSERT_TRUE(c.ok()) << c.error().message();
  const GpuCalibration& g = c->gpus.at("h100-sxm5-80gb");
  EXPECT_NEAR(g.compute.at("host_memory_efficiency"), 0.3, 1e-12);
  EXPECT_NEAR(g.compute.at("device_to_host_efficiency"), 0.8, 1e-12);
  EXPECT_NEAR(g.compute.at("host_to_device_efficiency"), 0.85, 1e-12);
  EXPECT_TRUE(contains(g.source, "the host relative to dgx-h100-superpod's node.host")) << g.source;
  // A topology without a host, and a file without host series (nor runs), are refused.
  r = run(dir, NNSIM_BINARY, {"calibrate", "micro.h5", "--topo", "h200x8", "-o", "bad.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "h200x8 describes none: add node.host")) << r;
  m.host_adam.clear();
  m.host_copies.clear();
  ASSERT_TRUE(write_micro(dir.file("old.h5"), m).ok());
  r = run(dir, NNSIM_BINARY,
          {"calibrate", "old.h5", "--topo", "dgx-h100-superpod", "-o", "bad.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "old.h5 has neither")) << r;
  EXPECT_FALSE(std::ifstream(dir.file("bad.h5")).good());
}

TEST(NnsimCalibrate, BadInputsNameTheFileAndTheField) {
  TempDir dir;
  RunResult r = run(dir, NNSIM_BINARY, {"calibrate", "missing.h5", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "missing.h5: not an HDF5 file")) << r;

  // A calibration file is not a microbenchmark file.
  ASSERT_EQ(
      run(dir, NNSIM_BINARY, {"calibration", "export", "--gpu", "a100-sxm4-80gb", "-o", "other.h5"})
          .status,
      0);
  r = run(dir, NNSIM_BINARY, {"calibrate", "other.h5", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "other.h5: attribute 'format' of / is \"nnsim-calibration\"")) << r;

  const GpuSpec gpu = *find_gpu("h100-sxm5-80gb");
  MicroResults m = synthetic_micro(gpu);
  m.device_name = "NVIDIA GeForce RTX 4090";
  ASSERT_TRUE(write_micro(dir.file("rtx.h5"), m).ok());
  r = run(dir, NNSIM_BINARY, {"calibrate", "rtx.h5", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "rtx.h5: device 'NVIDIA GeForce RTX 4090' is not a catalog GPU"))
      << r;
  r = run(dir, NNSIM_BINARY, {"calibrate", "rtx.h5", "--gpu", "h100-sxm", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "--gpu: unknown GPU 'h100-sxm'")) << r;
  r = run(dir, NNSIM_BINARY, {"calibrate", "rtx.h5", "--gpu", "a100-sxm4-80gb", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "rtx.h5: gemm bf16")) << r;

  m.device = "cpu";
  m.device_name = "Some CPU";
  ASSERT_TRUE(write_micro(dir.file("cpu.h5"), m).ok());
  r = run(dir, NNSIM_BINARY, {"calibrate", "cpu.h5", "-o", "cal.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "cpu.h5 was measured on a CPU ('Some CPU')")) << r;
  EXPECT_TRUE(contains(r.err, "--gpu")) << r;
  EXPECT_FALSE(std::ifstream(dir.file("cal.h5")).good());
}

}  // namespace
}  // namespace nnsim::hwexec
