// nnsim compare and nnsim calibrate from run files, end to end: a tiny plan run on this CPU
// (nnexec run, 4 processes), calibrated from its own run file and compared with the simulator
// before and after. Tests that need LibTorch report Skipped without it.
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/plan.h"
#include "hwexec/micro.h"
#include "hwexec/run.h"
#include "nnexec_info.h"
#include "process.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::contains;
using testing::nnexec_build;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;
using json = nlohmann::json;

const std::string kModel = std::string(NNSIM_TEST_DATA) + "/tiny-gpt.yaml";
const std::string kTopo = std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml";
// tiny-gpt with per-head query and key norms and no biases.
const std::string kQkNorm = std::string(NNSIM_TEST_DATA) + "/tiny-gpt-qk-norm.yaml";

RunResult make_plan(const TempDir& dir, const std::string& out, int global_batch) {
  return run(dir, NNSIM_BINARY,
             {"plan", "--model", kModel, "--topo", kTopo, "--nodes", "2", "--tp", "2", "--pp", "2",
              "--global-batch", std::to_string(global_batch), "--precision", "fp32", "-o", out});
}

std::vector<std::string> compare_args(std::vector<std::string> extra) {
  std::vector<std::string> a = {"compare", "run.h5", "--topo", kTopo, "--nodes", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

TEST(NnsimCompare, CalibratingFromTheRunBringsTheSimulatorToTheMeasurement) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  ASSERT_EQ(make_plan(dir, "plan.json", 8).status, 0);
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--launch", "4", "--out", "run.h5", "--check"});
  ASSERT_EQ(r.status, 0) << r;

  // Calibrate from the run: a CPU run needs the GPU whose parameters it sets.
  r = run(dir, NNSIM_BINARY, {"calibrate", "run.h5", "-o", "calib.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "run.h5 was run on a CPU")) << r;
  r = run(dir, NNSIM_BINARY, {"calibrate", "run.h5", "--gpu", "a100-sxm4-80gb", "-o", "calib.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "gemm_efficiency_fp32")) << r;
  EXPECT_TRUE(contains(r.out, "memory_efficiency")) << r;

  r = run(dir, NNSIM_BINARY, compare_args({"--json", "raw.json"}));
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "attn.qkv")) << r;
  EXPECT_TRUE(contains(r.out, "iteration: measured")) << r;
  r = run(dir, NNSIM_BINARY,
          compare_args({"plan.json", "--calib", "calib.h5", "--json", "cal.json"}));
  ASSERT_EQ(r.status, 0) << r;
  const json raw = json::parse(slurp(dir.file("raw.json")));
  const json cal = json::parse(slurp(dir.file("cal.json")));

  // Every operator and collective of the run is in the comparison, with the calls the
  // simulator's program makes.
  Expected<RunResults> file = read_run(dir.file("run.h5"));
  ASSERT_TRUE(file.ok()) << file.error().message();
  std::set<std::pair<std::string, std::string>> ops;
  std::set<std::tuple<std::string, std::string, std::string>> colls;
  for (const RankResult& k : file->ranks) {
    for (const OpTime& o : k.ops) ops.insert({o.name, o.phase});
    for (const CollTime& c : k.collectives) colls.insert({c.kind, c.axes, c.label});
  }
  ASSERT_FALSE(ops.empty());
  for (const auto& [name, phase] : ops) {
    bool found = false;
    for (const json& o : cal["operators"]) {
      if (o["name"] != name || o["phase"] != phase) continue;
      found = true;
      EXPECT_GT(o["measured_s"].get<double>(), 0) << name << " " << phase;
      EXPECT_GT(o["simulated_s"].get<double>(), 0) << name << " " << phase;
      EXPECT_DOUBLE_EQ(o["simulated_calls"].get<double>(), o["measured_calls"].get<double>())
          << name << " " << phase;
    }
    EXPECT_TRUE(found) << name << " " << phase;
  }
  ASSERT_FALSE(colls.empty());
  for (const auto& [kind, axes, label] : colls) {
    bool found = false;
    for (const json& c : cal["collectives"]) {
      if (c["kind"] != kind || c["axes"] != axes || c["label"] != label) continue;
      found = true;
      EXPECT_GT(c["simulated_s"].get<double>(), 0) << kind << " " << axes << " " << label;
      EXPECT_DOUBLE_EQ(c["simulated_calls"].get<double>(), c["measured_calls"].get<double>())
          << kind << " " << axes << " " << label;
      EXPECT_DOUBLE_EQ(c["simulated_bytes"].get<double>(), c["measured_bytes"].get<double>())
          << kind << " " << axes << " " << label;
    }
    EXPECT_TRUE(found) << kind << " " << axes << " " << label;
  }

  // Before: the simulator times an A100, far from this CPU (memory-bound operators and
  // attention most of all). After: the GEMM efficiency is this CPU's best linear operator's and
  // the memory line is fitted to its memory-bound operators.
  // CPU times vary from run to run: over ten runs on one idle 2-core machine (2026-12-06) the
  // median error before was 0.55-0.66 and after 0.60-0.86 times that, across the bounds this
  // test had (above 0.6 before, below 0.7 times that after).
  const double ops_before = raw["summary"]["median_abs_op_error"].get<double>();
  const double ops_after = cal["summary"]["median_abs_op_error"].get<double>();
  EXPECT_GT(ops_before, 0.5) << raw.dump(1);
  EXPECT_LT(ops_after, ops_before) << cal.dump(1);
  // Each kind the memory line prices gets closer.
  auto kind_error = [](const json& j, const std::string& kind) {
    for (const json& k : j["operator_kinds"]) {
      if (k["kind"] == kind) return std::abs(k["error"].get<double>());
    }
    ADD_FAILURE() << "no operator kind " << kind;
    return 0.0;
  };
  for (const char* kind : {"norm", "activation", "dropout_add", "add"}) {
    EXPECT_LT(kind_error(cal, kind), kind_error(raw, kind)) << kind;
  }
  // The GEMMs: within half of the measurement after calibration. Not compared with before: the
  // A100 model prices these tiny GEMMs at about its kernel overhead, which lands near this CPU's
  // times by chance (0.26 in one run, above the calibrated 0.35 under a loaded machine).
  EXPECT_LT(cal["summary"]["median_abs_gemm_error"].get<double>(), 0.5) << cal.dump(1);
  EXPECT_LT(std::abs(cal["compute"]["error"].get<double>()),
            std::abs(raw["compute"]["error"].get<double>()));
  // The collectives: the run's all-reduces inside this one machine set the NVLink link's step
  // latency and curve (CPU sockets against NVLink before: 100x off).
  EXPECT_GT(raw["summary"]["median_abs_collective_error"].get<double>(), 0.9) << raw.dump(1);
  EXPECT_LT(cal["summary"]["median_abs_collective_error"].get<double>(), 0.6) << cal.dump(1);
  // The iteration: simulated in both and closer after.
  EXPECT_GT(raw["iteration"]["simulated_s"].get<double>(), 0);
  EXPECT_LT(std::abs(cal["iteration"]["error"].get<double>()),
            std::abs(raw["iteration"]["error"].get<double>()));
  EXPECT_EQ(cal["calibration"].get<std::string>().find("nnsim calibrate run.h5"), 0u)
      << cal["calibration"];
}

// tp2 + sequence parallelism + dp2 on tiny-gpt (biases, learned positions), without and with
// ZeRO: the run and the compiled program move the same bytes in every collective, so the
// collectives table pairs each of the run's rows with the program's.
struct BytesCase {
  const char* name;
  std::vector<std::string> flags;
  double shard;  // the ranks the norm gradients' sum is split over (ZeRO: dp)
  const std::string* model = &kModel;
  // The parameters whose gradients sequence parallelism (and split query and key norms) leave
  // as partial sums over tp. tiny-gpt: per layer both norms' weights and biases and the
  // row-parallel linears' biases (4 h + 2 h), the position table (s h) and the final norm (2 h).
  double norm_params = 4 * 6 * 64 + 32 * 64 + 2 * 64;
};

void PrintTo(const BytesCase& c, std::ostream* os) {
  *os << c.name;
}

class NnsimCompareBytes : public ::testing::TestWithParam<BytesCase> {};

TEST_P(NnsimCompareBytes, TheRunAndTheProgramMoveTheSameBytes) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const BytesCase& c = GetParam();
  TempDir dir;
  std::vector<std::string> plan = {"plan", "--model",        *c.model, "--topo",
                                   kTopo,  "--nodes",        "2",      "--tp",
                                   "2",    "--pp",           "1",      "--dp",
                                   "2",    "--global-batch", "4",      "--micro-batch",
                                   "1",    "--precision",    "fp32",   "--sequence-parallel",
                                   "-o",   "plan.json"};
  plan.insert(plan.end(), c.flags.begin(), c.flags.end());
  RunResult r = run(dir, NNSIM_BINARY, plan);
  ASSERT_EQ(r.status, 0) << r;
  r = run(dir, NNEXEC_BINARY,
          {"run", "--plan", "plan.json", "--launch", "4", "--out", "run.h5", "--iterations", "1",
           "--warmup", "0"});
  ASSERT_EQ(r.status, 0) << r;
  r = run(dir, NNSIM_BINARY, compare_args({"--json", "c.json"}));
  ASSERT_EQ(r.status, 0) << r;
  const json j = json::parse(slurp(dir.file("c.json")));

  // Byte totals per collective kind (over the axes; means over all ranks).
  std::map<std::string, std::pair<double, double>> kinds;
  for (const json& t : j["traffic"]) {
    kinds[t["kind"]].first += t["measured_bytes"].get<double>();
    kinds[t["kind"]].second += t["simulated_bytes"].get<double>();
  }
  EXPECT_EQ(kinds.size(), 3u) << j["traffic"].dump(1);  // all-gather, all-reduce, reduce-scatter
  for (const auto& [kind, b] : kinds) {
    EXPECT_GT(b.first, 0) << kind;
    EXPECT_DOUBLE_EQ(b.first, b.second) << kind;
  }
  // Per collective (kind, axes, label): calls and bytes.
  std::map<std::tuple<std::string, std::string, std::string>, double> bytes;
  for (const json& t : j["collectives"]) {
    EXPECT_DOUBLE_EQ(t["measured_calls"].get<double>(), t["simulated_calls"].get<double>())
        << t.dump(1);
    EXPECT_DOUBLE_EQ(t["measured_bytes"].get<double>(), t["simulated_bytes"].get<double>())
        << t.dump(1);
    bytes[{t["kind"], t["axes"], t["label"]}] = t["simulated_bytes"].get<double>();
  }
  // The gradient sum over tp, in fp32; with ZeRO each rank sums the share of them in its shard.
  const double norm_sync = c.norm_params * 4 / c.shard;
  EXPECT_DOUBLE_EQ((bytes[{"all_reduce", "tp", "norm grad sync"}]), norm_sync);
  // The loss summed over the replicas: one fp32 scalar.
  EXPECT_DOUBLE_EQ((bytes[{"all_reduce", "dp", "loss"}]), 4);
  // The tensor-parallel reductions are paired by the operator that reads their result.
  EXPECT_GT((bytes[{"reduce_scatter", "tp", "attn.residual"}]), 0);
}

INSTANTIATE_TEST_SUITE_P(Plans, NnsimCompareBytes,
                         ::testing::Values(BytesCase{"tp2_sp_dp2", {}, 1},
                                           BytesCase{"zero1_tp2_sp_dp2", {"--zero", "1"}, 2},
                                           // Without biases: per layer the two norms' weights
                                           // (2 h) and the query and key norms' (2 d, d = 16),
                                           // the position table and the final norm (h).
                                           BytesCase{"qk_norm_zero1_tp2_sp_dp2",
                                                     {"--zero", "1"},
                                                     2,
                                                     &kQkNorm,
                                                     4 * (2 * 64 + 2 * 16) + 32 * 64 + 64}),
                         [](const ::testing::TestParamInfo<BytesCase>& i) {
                           return std::string(i.param.name);
                         });

// Pipelines whose transfers do not go to the next or previous stage: interleaved chunks (stage
// 1's first chunk feeds stage 0's second) and a head spanning the stages (the last stage feeds
// the other stages' shards). Every send and receive the run measured is priced by the simulator,
// between the two ranks the program moves it, for the bytes the program moves.
struct PipelineCase {
  const char* name;
  std::vector<std::string> flags;
};

void PrintTo(const PipelineCase& c, std::ostream* os) {
  *os << c.name;
}

class NnsimComparePipeline : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(NnsimComparePipeline, EverySendAndReceiveIsPriced) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const PipelineCase& c = GetParam();
  TempDir dir;
  std::vector<std::string> plan = {
      "plan", "--model",     kModel, "--topo", kTopo,      "--nodes",        "1", "--tp",
      "1",    "--pp",        "2",    "--dp",   "1",        "--global-batch", "4", "--micro-batch",
      "1",    "--precision", "fp32", "-o",     "plan.json"};
  plan.insert(plan.end(), c.flags.begin(), c.flags.end());
  RunResult r = run(dir, NNSIM_BINARY, plan);
  ASSERT_EQ(r.status, 0) << r;
  r = run(dir, NNEXEC_BINARY,
          {"run", "--plan", "plan.json", "--launch", "2", "--out", "run.h5", "--iterations", "1",
           "--warmup", "0"});
  ASSERT_EQ(r.status, 0) << r;
  r = run(dir, NNSIM_BINARY,
          {"compare", "run.h5", "--topo", kTopo, "--nodes", "1", "--json", "c.json"});
  ASSERT_EQ(r.status, 0) << r;
  const size_t from = r.out.find("collectives ("), to = r.out.find("communication by kind");
  ASSERT_NE(from, std::string::npos) << r;
  ASSERT_NE(to, std::string::npos) << r;
  EXPECT_FALSE(contains(r.out.substr(from, to - from), "n/a")) << r;

  const json j = json::parse(slurp(dir.file("c.json")));
  std::set<std::pair<std::string, std::string>> rows;
  double priced = 0;  // the rows' simulated time summed over the ranks that run them
  for (const json& t : j["collectives"]) {
    if (t["kind"] != "send" && t["kind"] != "recv") continue;
    rows.insert({t["kind"].get<std::string>(), t["label"].get<std::string>()});
    ASSERT_FALSE(t["simulated_s"].is_null()) << t.dump(1);
    EXPECT_GT(t["simulated_s"].get<double>(), 0) << t.dump(1);
    EXPECT_GT(t["measured_bytes"].get<double>(), 0) << t.dump(1);
    EXPECT_DOUBLE_EQ(t["measured_bytes"].get<double>(), t["simulated_bytes"].get<double>())
        << t.dump(1);
    EXPECT_DOUBLE_EQ(t["measured_calls"].get<double>(), t["simulated_calls"].get<double>())
        << t.dump(1);
    if (t["kind"] == "send") priced += t["simulated_s"].get<double>() * t["ranks"].get<int>();
  }
  // Activations and gradients both ways.
  for (const char* kind : {"send", "recv"}) {
    EXPECT_TRUE(rows.count({kind, "activation"})) << kind << "\n" << j["collectives"].dump(1);
    EXPECT_TRUE(rows.count({kind, "gradient"})) << kind << "\n" << j["collectives"].dump(1);
  }
  // The measured calls priced add up to the program's own transfers (the traffic table's
  // simulated time: every send step of every rank, between its lane's devices).
  double program = 0;
  for (const json& t : j["traffic"]) {
    if (t["kind"] == "send") program += t["simulated_s"].get<double>() * j["ranks"].get<int>();
  }
  EXPECT_GT(program, 0);
  EXPECT_NEAR(priced, program, 1e-9 * program) << j["traffic"].dump(1);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, NnsimComparePipeline,
    ::testing::Values(PipelineCase{"interleaved_vpp2_pp2",
                                   {"--vpp", "2", "--schedule", "interleaved"}},
                      PipelineCase{"shard_head_pp2", {"--shard-head"}}),
    [](const ::testing::TestParamInfo<PipelineCase>& i) { return std::string(i.param.name); });

// A run file of `plan` whose ranks each ran one operator (no LibTorch needed).
void write_small_run(const std::string& path, const Plan& plan) {
  RunResults r;
  r.plan_json = plan_to_json(plan);
  r.plan_name = plan.name;
  r.world = plan.mesh.num_ranks();
  for (const MeshAxis& a : plan.mesh.axes) r.mesh_axes.push_back(a.name);
  for (int k = 0; k < r.world; ++k) {
    RankResult x;
    x.rank = k;
    x.coordinates = plan.mesh.coordinates(k);
    x.iteration_seconds = {0.5};
    x.ops = {{"attn.qkv", "fwd", 2, 0.25}};
    r.ranks.push_back(x);
  }
  ASSERT_TRUE(write_run(path, r).ok());
}

TEST(NnsimCompare, BadInputsSayWhatIsWrong) {
  TempDir dir;
  RunResult r = run(dir, NNSIM_BINARY, compare_args({}));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "run.h5: not an HDF5 file")) << r;

  // Another kind of HDF5 file.
  ASSERT_EQ(
      run(dir, NNSIM_BINARY, {"calibration", "export", "--gpu", "h100-sxm5-80gb", "-o", "run.h5"})
          .status,
      0);
  r = run(dir, NNSIM_BINARY, compare_args({}));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "run.h5: attribute 'format' of / is \"nnsim-calibration\"")) << r;
  r = run(dir, NNSIM_BINARY, {"calibrate", "run.h5", "--gpu", "h100-sxm5-80gb", "-o", "c.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "run.h5: attribute 'format' of / is \"nnsim-calibration\"")) << r;

  // A run of one plan compared with another.
  ASSERT_EQ(make_plan(dir, "plan.json", 8).status, 0);
  ASSERT_EQ(make_plan(dir, "other.json", 16).status, 0);
  Expected<Plan> plan = load_plan(dir.file("plan.json"));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  write_small_run(dir.file("run.h5"), *plan);
  r = run(dir, NNSIM_BINARY, compare_args({"other.json"}));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "other.json: differs from the plan run.h5 ran")) << r;
  EXPECT_TRUE(contains(r.err, "first in field 'training'")) << r;

  // The same plan given explicitly is fine; a calibration without the topology's GPU is named.
  r = run(dir, NNSIM_BINARY, compare_args({"plan.json", "--calib", "c.h5"}));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "c.h5")) << r;
  ASSERT_EQ(
      run(dir, NNSIM_BINARY, {"calibration", "export", "--gpu", "h100-sxm5-80gb", "-o", "h.h5"})
          .status,
      0);
  r = run(dir, NNSIM_BINARY, compare_args({"plan.json", "--calib", "h.h5"}));
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "h.h5 has no entry for a100-sxm4-80gb (it has: h100-sxm5-80gb)"))
      << r;
  // Operators the run has and the simulator's program has more of are all listed.
  EXPECT_TRUE(contains(r.out, "mlp.fc1")) << r;
  // calibrate: one microbenchmark file at most; with a run file, the GEMMs pool and the memory
  // line comes from the microbenchmark when the run has no memory-bound operator.
  const GpuSpec h100 = *find_gpu("h100-sxm5-80gb");
  ASSERT_TRUE(write_micro(dir.file("m1.h5"), testing::synthetic_micro(h100)).ok());
  ASSERT_TRUE(write_micro(dir.file("m2.h5"), testing::synthetic_micro(h100)).ok());
  r = run(dir, NNSIM_BINARY, {"calibrate", "m1.h5", "m2.h5", "-o", "c.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "m1.h5 and m2.h5 are both microbenchmark files")) << r;
  r = run(dir, NNSIM_BINARY, {"calibrate", "m1.h5", "run.h5", "--gpu", h100.name, "-o", "c.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "m1.h5 run.h5 -> c.h5 (h100-sxm5-80gb)")) << r;
  // bf16: m1.h5's four shapes, the relative least squares of synthetic.h's 0.7 (gemm_fit_of).
  EXPECT_NEAR(testing::gemm_fit_of(0.7), 0.6576, 5e-5);
  EXPECT_TRUE(contains(r.out, "gemm_efficiency_bf16 0.6576 ")) << r;
  EXPECT_TRUE(contains(r.out, "gemm_efficiency_fp32 ")) << r;
  EXPECT_TRUE(contains(r.out, "memory_efficiency    0.85  (")) << r;
  EXPECT_TRUE(contains(r.out, "; from m1.h5)")) << r;

  // The topology must hold the plan's ranks.
  r = run(dir, NNSIM_BINARY, {"compare", "run.h5", "--topo", kTopo});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "--nodes")) << r;
}

}  // namespace
}  // namespace nnsim::hwexec
