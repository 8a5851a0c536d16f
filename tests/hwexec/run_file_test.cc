// The run file read back (read_run), and the calibration fit from run files on synthetic runs
// with known answers: operator times made from the simulator's own formulas with chosen
// parameters, so a correct fit recovers exactly those parameters.
#include <hdf5.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include "core/layout.h"
#include "core/opgraph.h"
#include "core/program.h"
#include "hwexec/fit.h"
#include "hwexec/fit_network.h"
#include "hwexec/run.h"
#include "process.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::contains;
using testing::run;
using testing::synthetic_micro;
using testing::TempDir;

RunResults two_ranks() {
  RunResults r;
  r.plan_json = "{\"name\": \"two\"}";
  r.plan_name = "two";
  r.options.iterations = 2;
  r.options.warmup = 1;
  r.options.check = true;
  r.options.seed = 7;
  r.world = 2;
  r.torch_version = "1.13.0";
  r.mesh_axes = {"dp", "tp"};
  RankResult a;
  a.rank = 0;
  a.host = "node-a";
  a.coordinates = {0, 0};
  a.iteration_seconds = {0.25, 0.5};
  a.losses = {4.5, 4.25};
  a.ops = {
      {"attn.qkv", "fwd", 8, 0.01}, {"attn.qkv", "bwd", 8, 0.02}, {"optimizer", "step", 1, 3e-3}};
  a.collectives = {{"all_reduce", "tp", "attn.proj", 4096, 8, 0.003}};
  a.parameters = 1000;
  a.peak_rss_bytes = 1e8;
  a.checked = true;
  a.has_loss = true;
  a.check_loss = 4.5;
  a.reference_loss = 4.5;
  a.checks = {{"layers.0.attn.qkv.weight", 6144, 1e-9, 0.5, true}};
  RankResult b = a;
  b.rank = 1;
  b.host = "node b";  // names may hold spaces
  b.coordinates = {0, 1};
  b.iteration_seconds = {0.375, 0.25};
  b.losses = {};
  b.has_loss = false;
  b.collectives.push_back({"all_reduce", "dp", "grad", 8000, 1, 0.0125});
  b.checks = {{"layers.0.attn.qkv.weight", 6144, 2e-9, 0.5, true},
              {"head.proj.weight", 8192, 0.25, 0.5, false}};
  r.ranks = {a, b};
  return r;
}

TEST(RunFile, WriteReadRoundTripKeepsEveryTable) {
  TempDir dir;
  const RunResults w = two_ranks();
  ASSERT_TRUE(write_run(dir.file("run.h5"), w).ok());
  Expected<RunResults> r = read_run(dir.file("run.h5"));
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_EQ(r->device, "cpu");
  EXPECT_EQ(r->dtype, "fp32");
  EXPECT_EQ(r->plan_json, w.plan_json);
  EXPECT_EQ(r->plan_name, "two");
  EXPECT_EQ(r->world, 2);
  EXPECT_EQ(r->torch_version, "1.13.0");
  EXPECT_EQ(r->mesh_axes, w.mesh_axes);
  EXPECT_EQ(r->options.iterations, 2);
  EXPECT_EQ(r->options.warmup, 1);
  EXPECT_EQ(r->options.seed, 7u);
  EXPECT_TRUE(r->options.check);
  ASSERT_EQ(r->ranks.size(), 2u);
  EXPECT_EQ(r->iteration_seconds(), (std::vector<double>{0.375, 0.5}));
  for (size_t i = 0; i < 2; ++i) {
    const RankResult &got = r->ranks[i], &want = w.ranks[i];
    EXPECT_EQ(got.rank, want.rank);
    EXPECT_EQ(got.host, want.host);
    EXPECT_EQ(got.coordinates, want.coordinates);
    EXPECT_EQ(got.iteration_seconds, want.iteration_seconds);
    EXPECT_EQ(got.losses, want.losses);
    EXPECT_EQ(got.parameters, want.parameters);
    EXPECT_EQ(got.peak_rss_bytes, want.peak_rss_bytes);
    ASSERT_EQ(got.ops.size(), want.ops.size());
    for (size_t k = 0; k < got.ops.size(); ++k) {
      EXPECT_EQ(got.ops[k].name, want.ops[k].name);
      EXPECT_EQ(got.ops[k].phase, want.ops[k].phase);
      EXPECT_EQ(got.ops[k].calls, want.ops[k].calls);
      EXPECT_EQ(got.ops[k].seconds, want.ops[k].seconds);
    }
    ASSERT_EQ(got.collectives.size(), want.collectives.size());
    for (size_t k = 0; k < got.collectives.size(); ++k) {
      EXPECT_EQ(got.collectives[k].kind, want.collectives[k].kind);
      EXPECT_EQ(got.collectives[k].axes, want.collectives[k].axes);
      EXPECT_EQ(got.collectives[k].label, want.collectives[k].label);
      EXPECT_EQ(got.collectives[k].bytes, want.collectives[k].bytes);
      EXPECT_EQ(got.collectives[k].calls, want.collectives[k].calls);
      EXPECT_EQ(got.collectives[k].seconds, want.collectives[k].seconds);
    }
    ASSERT_EQ(got.checks.size(), want.checks.size());
    for (size_t k = 0; k < got.checks.size(); ++k) {
      EXPECT_EQ(got.checks[k].name, want.checks[k].name);
      EXPECT_EQ(got.checks[k].max_abs_error, want.checks[k].max_abs_error);
      EXPECT_EQ(got.checks[k].ok, want.checks[k].ok);
    }
  }
  // Rank 1's head.proj shard failed the check: the file says so and so does the reader.
  EXPECT_FALSE(w.check_passed());
  EXPECT_FALSE(r->check_passed());
  EXPECT_EQ(hdf5_format(dir.file("run.h5")).value(), "nnexec-run");
}

TEST(RunFile, BadFilesNameTheFileAndTheObject) {
  TempDir dir;
  Expected<RunResults> r = read_run(dir.file("missing.h5"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.error().message(), "missing.h5: not an HDF5 file")) << r.error().message();

  ASSERT_TRUE(write_micro(dir.file("micro.h5"), synthetic_micro(*find_gpu("h100-sxm5-80gb"))).ok());
  r = read_run(dir.file("micro.h5"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.error().message(),
                       "micro.h5: attribute 'format' of / is \"nnexec-micro\" (must be "
                       "\"nnexec-run\""))
      << r.error().message();

  // A table without one of its datasets; a file without a rank.
  ASSERT_TRUE(write_run(dir.file("run.h5"), two_ranks()).ok());
  {
    hid_t f = H5Fopen(dir.file("run.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    ASSERT_GE(H5Ldelete(f, "ranks/1/ops/seconds", H5P_DEFAULT), 0);
    H5Fclose(f);
  }
  r = read_run(dir.file("run.h5"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.error().message(), "run.h5: /ranks/1/ops: dataset 'seconds' is missing"))
      << r.error().message();

  ASSERT_TRUE(write_run(dir.file("run2.h5"), two_ranks()).ok());
  {
    hid_t f = H5Fopen(dir.file("run2.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(H5Ldelete(f, "ranks/0", H5P_DEFAULT), 0);
    H5Fclose(f);
  }
  r = read_run(dir.file("run2.h5"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.error().message(), "run2.h5: /ranks has 1 ranks, attribute 'ranks'"))
      << r.error().message();
}

// ---------------------------------------------------------------- the fit from run files

struct RunTruth {
  double fwd_efficiency = 0.6;  // linear forwards; the backwards run slower
  double bwd_efficiency = 0.45;
  double memory_efficiency = 0.3;
  double kernel_overhead = 20e-6;
};

// A plan from `nnsim plan` for the tiny model: tp 2 (so the pieces are partitioned), pp 2.
Plan tiny_plan() {
  TempDir dir;
  const std::string data = NNSIM_TEST_DATA;
  auto r = run(dir, NNSIM_BINARY,
               {"plan", "--model", data + "/tiny-gpt.yaml", "--topo", data + "/tiny-node2.yaml",
                "--nodes", "2", "--tp", "2", "--pp", "2", "--global-batch", "8", "--precision",
                "fp32", "-o", "plan.json"});
  EXPECT_EQ(r.status, 0) << r;
  Expected<Plan> p = load_plan(dir.file("plan.json"));
  EXPECT_TRUE(p.ok()) << p.error().message();
  return *p;
}

// Every rank runs every operator 3 times an iteration at the truth's rates; attention, the
// embedding and the loss take a time no formula gives (the fit must leave them out).
RunResults synthetic_run(const Plan& plan, const GpuSpec& gpu, const RunTruth& truth) {
  ComputeModel ideal = ComputeModel::defaults_for(gpu);
  ideal.gemm_efficiency = {{Precision::kFp32, 1.0}};
  ideal.sustained = 1;
  const double traffic = ComputeModel::defaults_for(gpu).elementwise_traffic;
  const double bw = truth.memory_efficiency * gpu.hbm_bandwidth;
  ModelSpec model = plan.model;
  model.precision = plan.precision;
  const OpGraph graph = lower_model(model, plan.micro_batch);
  RunResults r;
  r.plan_json = plan_to_json(plan);
  r.plan_name = plan.name;
  r.world = plan.mesh.num_ranks();
  for (const MeshAxis& a : plan.mesh.axes) r.mesh_axes.push_back(a.name);
  for (int rank = 0; rank < r.world; ++rank) {
    RankResult k;
    k.rank = rank;
    k.coordinates = plan.mesh.coordinates(rank);
    k.iteration_seconds = {1.0};
    for (const GraphPart* part : graph.parts()) {
      const std::vector<OpPartition> parts = *resolve_partitions(*part, plan);
      for (size_t i = 0; i < part->ops.size(); ++i) {
        const Op& op = part->ops[i];
        double fwd = 1e-3, bwd = 2e-3;
        if (op.kind == OpKind::kLinear) {
          const PieceShape s = linear_piece_shape(op, parts[i], plan.mesh);
          const Precision p = Precision::kFp32;
          fwd = gemm_seconds(s.m, s.n, s.k, p, gpu, ideal) / truth.fwd_efficiency;
          bwd = (gemm_seconds(s.m, s.k, s.n, p, gpu, ideal) +
                 gemm_seconds(s.k, s.n, s.m, p, gpu, ideal)) /
                truth.bwd_efficiency;
        } else if (op.kind == OpKind::kNorm || op.kind == OpKind::kActivation ||
                   op.kind == OpKind::kDropoutAdd || op.kind == OpKind::kAdd) {
          const double f = parts[i].factor(op.dims, plan.mesh);
          const int bwd_kernels = op.bwd_weight_flops > 0 ? 2 : 1;
          fwd = truth.kernel_overhead + op.fwd_bytes / f * traffic / bw;
          bwd = bwd_kernels * truth.kernel_overhead + op.bwd_bytes / f * traffic / bw;
        }
        k.ops.push_back({op.name, "fwd", 3, 3 * fwd});
        k.ops.push_back({op.name, "bwd", 3, 3 * bwd});
      }
    }
    k.ops.push_back({"optimizer", "step", 1, 5e-3});
    r.ranks.push_back(k);
  }
  return r;
}

TEST(HwexecFitRun, RecoversTheParametersTheOperatorTimesWereMadeWith) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  const RunTruth truth;
  Expected<RunPoints> points = run_points(synthetic_run(plan, gpu, truth), plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  EXPECT_TRUE(points->notes.empty());
  // Five linear operators (qkv, proj, fc1, fc2, head.proj) x 2 phases x 4 ranks.
  EXPECT_EQ(points->gemm.size(), 5u * 2 * 4);
  Expected<Fit> f = fit_all(nullptr, "", {*points}, gpu, "synthetic run");
  ASSERT_TRUE(f.ok()) << f.error().message();
  const GpuCalibration& c = f->calibration;
  EXPECT_EQ(c.source, "synthetic run");
  ASSERT_EQ(c.gemm_efficiency.size(), 1u);
  // The relative least squares sum e_i^2 / sum e_i over as many forwards (0.6) as backwards
  // (0.45): 0.536, between them (the largest e_i, the old estimator, took the forwards' 0.6 and
  // priced every backward 25 % fast).
  const double f_e = truth.fwd_efficiency, b_e = truth.bwd_efficiency;
  const double e = (f_e * f_e + b_e * b_e) / (f_e + b_e);
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kFp32), e, 1e-9);
  ASSERT_EQ(f->gemm.size(), 1u);
  EXPECT_TRUE(contains(f->gemm[0].best, " fwd, rank ")) << f->gemm[0].best;
  EXPECT_NEAR(f->gemm[0].best_efficiency, f_e, 1e-9);
  // The backwards are priced 1 - 0.45 / 0.536 = 16 % fast, the forwards 12 % slow.
  EXPECT_NEAR(f->gemm[0].max_error, 1 - b_e / e, 1e-9);
  EXPECT_NEAR(f->gemm[0].median_error, 0.5 * (f_e / e - 1 + 1 - b_e / e), 1e-9);
  EXPECT_EQ(f->gemm[0].slower, 20);
  EXPECT_EQ(f->gemm[0].faster, 20);
  // The efficiency holds the run's own clock: sustained 1 in the file.
  EXPECT_EQ(c.compute.at("sustained"), 1.0);
  EXPECT_NEAR(c.compute.at("memory_efficiency"), truth.memory_efficiency, 1e-9);
  EXPECT_NEAR(c.compute.at("kernel_overhead"), truth.kernel_overhead, 1e-12);
  // The bandwidth holds with nnexec's unfused traffic, which the file carries with it (a
  // Megatron plan's default is the fused 1.0).
  EXPECT_EQ(c.compute.at("elementwise_traffic"),
            ComputeModel::defaults_for(gpu).elementwise_traffic);
  EXPECT_EQ(default_compute_model(plan, gpu).elementwise_traffic, 1.0);
  ASSERT_TRUE(f->memory.has_value());
  EXPECT_EQ(f->memory->from, "run.h5");
  EXPECT_LT(f->memory->max_error, 1e-9);
  EXPECT_FALSE(c.nvlink.has_value());
}

TEST(HwexecFitRun, SplitBackwardPhasesAreTheirTwoGemms) {
  // A zero-bubble run times a linear's input-gradient GEMM (bwd_input) apart from its
  // weight-gradient GEMM (bwd_weight): made here from the same truth, each is a point of its own
  // GEMM, and the fit is the unsplit run's.
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  const RunTruth truth;
  RunResults run = synthetic_run(plan, gpu, truth);
  ComputeModel ideal = ComputeModel::defaults_for(gpu);
  ideal.gemm_efficiency = {{Precision::kFp32, 1.0}};
  ideal.sustained = 1;
  ModelSpec model = plan.model;
  model.precision = plan.precision;
  const OpGraph graph = lower_model(model, plan.micro_batch);
  std::map<std::string, PieceShape> linear;
  for (const GraphPart* part : graph.parts()) {
    const std::vector<OpPartition> parts = *resolve_partitions(*part, plan);
    for (size_t i = 0; i < part->ops.size(); ++i) {
      if (part->ops[i].kind == OpKind::kLinear) {
        linear[part->ops[i].name] = linear_piece_shape(part->ops[i], parts[i], plan.mesh);
      }
    }
  }
  ASSERT_EQ(linear.size(), 5u);
  for (RankResult& k : run.ranks) {
    std::vector<OpTime> ops;
    for (const OpTime& o : k.ops) {
      auto it = linear.find(o.name);
      if (o.phase != "bwd" || it == linear.end()) {
        ops.push_back(o);
        continue;
      }
      const PieceShape& s = it->second;
      const double input = gemm_seconds(s.m, s.k, s.n, Precision::kFp32, gpu, ideal);
      const double weight = gemm_seconds(s.k, s.n, s.m, Precision::kFp32, gpu, ideal);
      ops.push_back({o.name, "bwd_input", o.calls, o.calls * input / truth.bwd_efficiency});
      ops.push_back({o.name, "bwd_weight", o.calls, o.calls * weight / truth.bwd_efficiency});
    }
    k.ops = ops;
  }
  Expected<RunPoints> points = run_points(run, plan, gpu, "zb.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  // Five linear operators x 3 phases x 4 ranks.
  EXPECT_EQ(points->gemm.size(), 5u * 3 * 4);
  Expected<Fit> f = fit_all(nullptr, "", {*points}, gpu, "zb");
  ASSERT_TRUE(f.ok()) << f.error().message();
  // Each backward is two points here (input and weight gradient, both at 0.45) against one
  // forward (0.6): the least squares weighs the backwards twice, (f^2 + 2 b^2) / (f + 2 b) = 0.51,
  // and the forwards are priced 0.6 / 0.51 - 1 = 18 % slow.
  const double f_e = truth.fwd_efficiency, b_e = truth.bwd_efficiency;
  const double e = (f_e * f_e + 2 * b_e * b_e) / (f_e + 2 * b_e);
  EXPECT_NEAR(f->calibration.gemm_efficiency.at(Precision::kFp32), e, 1e-9);
  EXPECT_NEAR(f->gemm[0].max_error, f_e / e - 1, 1e-9);
}

// nnexec run emulates fp8 (bf16 GEMMs on fp8-rounded values): its GEMM times are not fp8's.
TEST(HwexecFitRun, RefusesAnEmulatedFp8Run) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  RunResults run = synthetic_run(plan, gpu, RunTruth{});
  run.dtype = "fp8";
  Expected<RunPoints> points = run_points(run, plan, gpu, "fp8.h5");
  ASSERT_FALSE(points.ok());
  EXPECT_NE(points.error().message().find("fp8.h5: the run computed in fp8, which nnexec run "
                                          "emulates"),
            std::string::npos)
      << points.error().message();
}

TEST(HwexecFitRun, WithAMicrobenchmarkFileGemmsPoolAndTheRunSetsTheMemoryLine) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("h100-sxm5-80gb");
  RunTruth truth;
  truth.memory_efficiency = 0.2;  // the micro file's kernels say 0.85
  Expected<RunPoints> points = run_points(synthetic_run(plan, gpu, truth), plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  const testing::Truth micro_truth;
  const MicroResults micro = synthetic_micro(gpu, micro_truth);
  Expected<Fit> f = fit_all(&micro, "micro.h5", {*points}, gpu, "both");
  ASSERT_TRUE(f.ok()) << f.error().message();
  const GpuCalibration& c = f->calibration;
  // bf16 from the micro file's shapes, fp32 from the run's linears (each the relative least
  // squares of its points: synthetic.h's gemm_fit_of, and forwards and backwards pooled).
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kBf16),
              testing::gemm_fit_of(micro_truth.bf16_efficiency), 1e-9);
  const double f_e = truth.fwd_efficiency, b_e = truth.bwd_efficiency;
  EXPECT_NEAR(c.gemm_efficiency.at(Precision::kFp32), (f_e * f_e + b_e * b_e) / (f_e + b_e), 1e-9);
  // Free line below HBM: fitted as it is, the micro file's bandwidth not needed.
  ASSERT_TRUE(f->memory.has_value());
  EXPECT_FALSE(f->memory->fixed_bandwidth);
  EXPECT_NEAR(c.compute.at("memory_efficiency"), truth.memory_efficiency, 1e-9);
  EXPECT_NEAR(c.compute.at("kernel_overhead"), truth.kernel_overhead, 1e-12);
  EXPECT_TRUE(c.nvlink.has_value());  // links: from the microbenchmark file only
  bool said = false;
  for (const std::string& n : f->notes)
    said = said || contains(n, "micro.h5's kernels are not used");
  EXPECT_TRUE(said);
}

TEST(HwexecFitRun, FasterThanThePeakIsAnotherGpuOnAGpuAndCappedOnACpu) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  RunTruth truth;
  truth.fwd_efficiency = 1.5;
  RunResults gpu_run = synthetic_run(plan, gpu, truth);
  gpu_run.device = "cuda";
  Expected<RunPoints> points = run_points(gpu_run, plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  Expected<Fit> f = fit_all(nullptr, "", {*points}, gpu, "x");
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(contains(f.error().message(), "gemm fp32: ")) << f.error().message();
  EXPECT_TRUE(contains(f.error().message(), "is the file from another GPU (--gpu)?"))
      << f.error().message();

  // A CPU is not the GPU: its rate over the GPU's shape model is capped at 1, and said.
  points = run_points(synthetic_run(plan, gpu, truth), plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  f = fit_all(nullptr, "", {*points}, gpu, "x");
  ASSERT_TRUE(f.ok()) << f.error().message();
  EXPECT_EQ(f->calibration.gemm_efficiency.at(Precision::kFp32), 1.0);
  bool said = false;
  for (const std::string& n : f->notes)
    said = said || contains(n, "capped at 1 (measured on a CPU");
  EXPECT_TRUE(said);
}

// The link a synthetic run's collectives are made with: per latency step, and the efficiency of
// the bandwidth term (docs/hwexec.md).
struct LinkTruth {
  double step_latency = 5e-6;
  double efficiency = 0.5;
  double network_step_latency = 20e-6;
};

// The tiny plan's ranks 0-1 on one machine and 2-3 on another (tp inside, pp across): tp
// all-reduces at three sizes from the truth's link, and an all-reduce over pp (the tied
// embedding's gradient) at one size, all latency.
RunResults run_with_collectives(const Plan& plan, const GpuSpec& gpu, const LinkTruth& truth) {
  RunResults r = synthetic_run(plan, gpu, RunTruth{});
  for (RankResult& k : r.ranks) {
    k.host = k.rank < 2 ? "node-a" : "node-b";
    for (double bytes : {128.0, 1024.0 * 1024, 16.0 * 1024 * 1024}) {
      // 2 ranks: 2 latency steps; the ring moves 2(n-1)/n of the buffer, here all of it.
      const double t = 2 * truth.step_latency + bytes / (gpu.nvlink_bandwidth * truth.efficiency);
      // The slower ranks wait for the faster: the mean is over the ranks' own times.
      const double wait = k.rank % 2 == 0 ? 0 : 0.1 * t;
      k.collectives.push_back({"all_reduce", "tp", "attn.proj", bytes, 4, 4 * (t + wait)});
    }
    k.collectives.push_back(
        {"all_reduce", "pp", "embed.word", 64, 1, 2 * truth.network_step_latency});
    k.collectives.push_back({"send", "pp", "activation", 1e6, 4, 1.0});  // not a collective fit
  }
  return r;
}

TEST(HwexecFitRun, CollectivesFitTheLinkInsideAMachineAndTheNetworkLatencyAcross) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  const LinkTruth truth;
  Expected<RunPoints> points =
      run_points(run_with_collectives(plan, gpu, truth), plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  EXPECT_TRUE(points->hosts_known);
  ASSERT_EQ(points->same_host.size(), 1u);
  ASSERT_EQ(points->cross_host.size(), 1u);
  const CollectiveSeries& tp = points->same_host[0];
  EXPECT_EQ(tp.kind, "all_reduce");
  EXPECT_EQ(tp.ranks, 2);
  ASSERT_EQ(tp.samples.size(), 3u);
  // Mean over the two ranks' times (one waited 10 % longer), fastest the other's.
  const double t128 = 2 * truth.step_latency + 128 / (gpu.nvlink_bandwidth * truth.efficiency);
  EXPECT_NEAR(tp.samples[0].t.seconds, 1.05 * t128, 1e-12);
  EXPECT_NEAR(tp.samples[0].t.seconds_min, t128, 1e-12);

  Expected<Fit> f = fit_all(nullptr, "", {*points}, gpu, "run");
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->calibration.nvlink.has_value());
  const GpuCalibration::Link& nv = *f->calibration.nvlink;
  // The 128-byte all-reduce is all latency (its bandwidth term is under 1e-4 of it).
  EXPECT_NEAR(*nv.step_latency, 1.05 * truth.step_latency, 1e-4 * truth.step_latency);
  ASSERT_EQ(nv.curve.size(), 2u);
  for (const EfficiencyPoint& p : nv.curve) {
    // The mean time is 1.05 x the truth's; the latency taken off is the smallest size's.
    const double t =
        1.05 * (2 * truth.step_latency + p.bytes / (gpu.nvlink_bandwidth * truth.efficiency));
    EXPECT_NEAR(p.efficiency, p.bytes / (gpu.nvlink_bandwidth * (t - 1.05 * t128)),
                1e-9 * p.efficiency)
        << p.bytes;
    EXPECT_NEAR(p.efficiency, truth.efficiency / 1.05, 0.01 * truth.efficiency) << p.bytes;
  }
  // Across machines: one size, the step latency alone (the network's bandwidth is the
  // topology's, which a run file does not name).
  ASSERT_TRUE(f->calibration.network.has_value());
  EXPECT_NEAR(*f->calibration.network->step_latency, truth.network_step_latency, 1e-15);
  EXPECT_TRUE(f->calibration.network->curve.empty());
  EXPECT_FALSE(f->calibration.network->max_efficiency.has_value());

  // A file without hosts (written before nnexec recorded them): the collectives are not used,
  // and the fit says so.
  RunResults old = run_with_collectives(plan, gpu, truth);
  for (RankResult& k : old.ranks) k.host.clear();
  points = run_points(old, plan, gpu, "old.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  EXPECT_FALSE(points->hosts_known);
  f = fit_all(nullptr, "", {*points}, gpu, "old");
  ASSERT_TRUE(f.ok()) << f.error().message();
  EXPECT_FALSE(f->calibration.nvlink.has_value());
  EXPECT_FALSE(f->calibration.network.has_value());
  bool said = false;
  for (const std::string& n : f->notes) said = said || contains(n, "which machine each rank");
  EXPECT_TRUE(said);
}

// The network's bandwidth from collectives across machines, on the topology the machines stand
// for (nnsim calibrate --topo). tiny-node2's nodes join through NICs of 200 Gb/s (25e9 bytes/s):
// a pipeline all-reduce over 2 ranks on 2 machines is NCCL's ring of 2, whose 2 (n - 1) / n S =
// S bytes cross one NIC each way, in 2 latency steps. Its times are made from that alpha-beta
// model with a chosen step latency and efficiency, which the fit must recover.
struct NetworkTruth {
  double step_latency = 40e-6;
  double efficiency = 0.3;
  double nic_bandwidth = 200e9 / 8;
};

RunResults run_across_machines(const Plan& plan, const GpuSpec& gpu, const NetworkTruth& truth) {
  RunResults r = synthetic_run(plan, gpu, RunTruth{});
  for (RankResult& k : r.ranks) {
    k.host = k.rank < 2 ? "node-a" : "node-b";
    for (double bytes : {256.0, 1024.0 * 1024, 16.0 * 1024 * 1024, 64.0 * 1024 * 1024}) {
      const double t = 2 * truth.step_latency + bytes / (truth.nic_bandwidth * truth.efficiency);
      k.collectives.push_back({"all_reduce", "pp", "embed.word", bytes, 2, 2 * t});
    }
  }
  return r;
}

Topology tiny_topology(int nodes) {
  Expected<Topology> t = load_topology(std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml");
  EXPECT_TRUE(t.ok()) << t.error().message();
  Expected<Topology> sized = resize_topology(*t, nodes);
  EXPECT_TRUE(sized.ok()) << sized.error().message();
  return *sized;
}

TEST(HwexecFitRun, NetworkEfficiencyAndLatencyFromCollectivesAcrossMachinesOnATopology) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  const NetworkTruth truth;
  const RunResults run = run_across_machines(plan, gpu, truth);
  Expected<RunPoints> points = run_points(run, plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  ASSERT_TRUE(price_cross_host(run, plan, tiny_topology(2), "run.h5", *points).ok());
  ASSERT_EQ(points->cross_host.size(), 1u);
  ASSERT_EQ(points->cross_host_routes.size(), 1u);
  EXPECT_EQ(points->cross_host_routes[0].algorithm, "ring");
  EXPECT_EQ(points->cross_host_routes[0].steps, 2);
  EXPECT_NEAR(points->cross_host_routes[0].bandwidth, truth.nic_bandwidth,
              1e-9 * truth.nic_bandwidth);

  Expected<Fit> f = fit_all(nullptr, "", {*points}, gpu, "run");
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->calibration.network.has_value());
  const GpuCalibration::Link& net = *f->calibration.network;
  // The smallest size's time is taken as all latency: its bandwidth term (256 bytes at 7.5 GB/s,
  // 34 ns of 80 us) biases the step latency and the efficiencies by under 1e-3.
  EXPECT_NEAR(*net.step_latency, truth.step_latency, 1e-3 * truth.step_latency);
  ASSERT_EQ(net.curve.size(), 3u);
  for (const EfficiencyPoint& p : net.curve) {
    EXPECT_NEAR(p.efficiency, truth.efficiency, 1e-3 * truth.efficiency) << p.bytes;
  }
  EXPECT_NEAR(*net.all_reduce_max_efficiency, truth.efficiency, 1e-3 * truth.efficiency);
  EXPECT_NEAR(*net.max_efficiency, truth.efficiency, 1e-3 * truth.efficiency);

  // Without the topology: the step latency alone, and the fit says why.
  points = run_points(run, plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  f = fit_all(nullptr, "", {*points}, gpu, "run");
  ASSERT_TRUE(f.ok()) << f.error().message();
  ASSERT_TRUE(f->calibration.network.has_value());
  EXPECT_TRUE(f->calibration.network->curve.empty());
  bool said = false;
  for (const std::string& n : f->notes) said = said || contains(n, "give the topology");
  EXPECT_TRUE(said);
}

TEST(HwexecFitRun, NetworkFitRefusesATopologyThatDoesNotHoldTheRunsMachines) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  RunResults run = run_across_machines(plan, gpu, NetworkTruth{});
  Expected<RunPoints> points = run_points(run, plan, gpu, "run.h5");
  ASSERT_TRUE(points.ok()) << points.error().message();
  // One node of 2 GPUs for 4 ranks.
  Status s = price_cross_host(run, plan, tiny_topology(1), "run.h5", *points);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "--topo tiny-node2: its 1 node(s) of 2 GPUs (2 GPUs) "
                       "cannot hold the 4 ranks of run.h5; give --nodes 2"))
      << s.error().message();
  // The plan puts ranks 0-1 on node 0 and 2-3 on node 1: a run on one machine (pipeline
  // stages on one machine), with tensor-parallel ranks 0 and 1 on two, or on three machines, is
  // not of this topology. The error of a run whose ranks ran on `host(rank)`:
  auto error_on = [&](const std::function<std::string(int)>& host) {
    for (RankResult& k : run.ranks) k.host = host(k.rank);
    Expected<RunPoints> p = run_points(run, plan, gpu, "run.h5");
    if (!p.ok()) return "run_points: " + p.error().message();
    Status st = price_cross_host(run, plan, tiny_topology(2), "run.h5", *p);
    return st.ok() ? std::string("accepted") : st.error().message();
  };
  std::string e = error_on([](int) { return "solo"; });
  EXPECT_TRUE(contains(e,
                       "run.h5: ranks 0 and 2 ran on one machine ('solo') but the plan places "
                       "them on nodes 0 and 1 of tiny-node2 (2 GPUs a node)"))
      << e;
  EXPECT_TRUE(contains(e, "hosts disagree with the topology's nodes")) << e;
  e = error_on([](int r) { return r % 2 == 0 ? "node-a" : "node-b"; });
  EXPECT_TRUE(contains(e,
                       "run.h5: ranks 0 and 1 ran on different machines ('node-a' and 'node-b') "
                       "but the plan places both on node 0 of tiny-node2"))
      << e;
  e = error_on([](int r) { return r < 2 ? "node-a" : r == 2 ? "b" : "c"; });
  EXPECT_TRUE(contains(e,
                       "ranks 2 and 3 ran on different machines ('b' and 'c') but the plan "
                       "places both on node 1"))
      << e;
}

// nnsim calibrate --topo writes the network's efficiency into the calibration file, and nnsim
// compare --calib prices the run's collectives across machines with it: the simulated times of
// the synthetic run's pipeline all-reduces are the generating model's.
TEST(HwexecFitRun, CalibrateWithATopologyIsWhatCompareUses) {
  const Plan plan = tiny_plan();
  const GpuSpec gpu = *find_gpu("a100-sxm4-80gb");
  const NetworkTruth truth;
  TempDir dir;
  ASSERT_TRUE(write_run(dir.file("run.h5"), run_across_machines(plan, gpu, truth)).ok());
  const std::string topo = std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml";
  auto cal = run(dir, NNSIM_BINARY,
                 {"calibrate", "run.h5", "--topo", topo, "--nodes", "2", "-o", "calib.h5"});
  ASSERT_EQ(cal.status, 0) << cal;
  std::printf("%s", cal.out.c_str());  // the summary docs/hwexec.md shows
  EXPECT_TRUE(contains(cal.out, "network")) << cal;
  EXPECT_TRUE(contains(cal.out, "all_reduce (ring over 23.28 GiB/s at efficiency 1)")) << cal;
  Expected<Calibration> c = load_calibration(dir.file("calib.h5"));
  ASSERT_TRUE(c.ok()) << c.error().message();
  ASSERT_TRUE(c->gpus.count(gpu.name));
  ASSERT_TRUE(c->gpus.at(gpu.name).network.has_value());
  EXPECT_EQ(c->gpus.at(gpu.name).network->curve.size(), 3u);

  auto cmp = run(dir, NNSIM_BINARY,
                 {"compare", "run.h5", "--topo", topo, "--nodes", "2", "--calib", "calib.h5",
                  "--json", "c.json"});
  ASSERT_EQ(cmp.status, 0) << cmp;
  const nlohmann::json j = nlohmann::json::parse(testing::slurp(dir.file("c.json")));
  int rows = 0;
  for (const nlohmann::json& t : j["collectives"]) {
    if (t["kind"] != "all_reduce" || t["axes"] != "pp" || t["label"] != "embed.word") continue;
    ++rows;
    // Four sizes a call each per iteration (2 calls over 2 iterations), all priced with the
    // fitted latency and curve: within the fit's 1e-3.
    EXPECT_NEAR(t["simulated_s"].get<double>(), t["measured_s"].get<double>(),
                1e-3 * t["measured_s"].get<double>())
        << t.dump(1);
  }
  EXPECT_EQ(rows, 1);
  // The built-in network (efficiency up to 0.9, 6 us a step) is far from those times: the
  // match above is the calibration's.
  auto builtin = run(dir, NNSIM_BINARY,
                     {"compare", "run.h5", "--topo", topo, "--nodes", "2", "--json", "b.json"});
  ASSERT_EQ(builtin.status, 0) << builtin;
  const nlohmann::json b = nlohmann::json::parse(testing::slurp(dir.file("b.json")));
  for (const nlohmann::json& t : b["collectives"]) {
    if (t["kind"] != "all_reduce" || t["axes"] != "pp" || t["label"] != "embed.word") continue;
    EXPECT_LT(t["simulated_s"].get<double>(), 0.5 * t["measured_s"].get<double>()) << t.dump(1);
  }

  // A topology that cannot hold the run's ranks, and a GPU other than the topology's.
  auto small = run(dir, NNSIM_BINARY, {"calibrate", "run.h5", "--topo", topo, "-o", "x.h5"});
  EXPECT_NE(small.status, 0);
  EXPECT_TRUE(contains(small.err, "cannot hold the 4 ranks of run.h5; give --nodes 2")) << small;
  auto other = run(dir, NNSIM_BINARY,
                   {"calibrate", "run.h5", "--topo", topo, "--nodes", "2", "--gpu",
                    "h100-sxm5-80gb", "-o", "x.h5"});
  EXPECT_NE(other.status, 0);
  EXPECT_TRUE(contains(other.err, "--gpu h100-sxm5-80gb and --topo")) << other;
}

}  // namespace
}  // namespace nnsim::hwexec
