// nnexec run's memory on a CPU (--memory-timeline, nnexec's CPU allocator counter) against the
// simulator's for the same plan: what stays between iterations (weights, gradients, optimizer
// state) must be the simulator's to the byte, up to the batch's token ids; the peak, which holds
// the executor's own activations, within a bound (docs/hwexec.md, "Memory").
#include <algorithm>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/model.h"
#include "hwexec/run.h"
#include "nnexec_info.h"
#include "process.h"

namespace nnsim::hwexec {
namespace {

using testing::nnexec_build;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;

struct MemoryCase {
  const char* name;
  int tp, pp, dp;
  const char* precision;
  std::vector<std::string> flags;
  const char* model = "small-gpt-memory.yaml";  // in tests/data
  int micro_batches = 2;                        // of 4 sequences, per replica
};

void PrintTo(const MemoryCase& c, std::ostream* os) {
  *os << c.name;
}

class NnexecRunMemory : public ::testing::TestWithParam<MemoryCase> {};

TEST_P(NnexecRunMemory, StaticMemoryIsTheSimulatorsAndThePeakNearIt) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const MemoryCase c = GetParam();
  const std::string model = std::string(NNSIM_TEST_DATA) + "/" + c.model;
  const int n = c.tp * c.pp * c.dp;
  const std::string topo =
      std::string(NNSIM_TEST_DATA) + (n == 1 ? "/tiny-node1.yaml" : "/tiny-node2.yaml");
  const std::string nodes = std::to_string(std::max(1, n / 2));
  TempDir dir;
  std::vector<std::string> plan = {"plan",
                                   "--model",
                                   model,
                                   "--topo",
                                   topo,
                                   "--nodes",
                                   nodes,
                                   "--tp",
                                   std::to_string(c.tp),
                                   "--pp",
                                   std::to_string(c.pp),
                                   "--dp",
                                   std::to_string(c.dp),
                                   "--micro-batch",
                                   "4",
                                   "--global-batch",
                                   std::to_string(4 * c.micro_batches * c.dp),
                                   "--precision",
                                   c.precision,
                                   "-o",
                                   "plan.json"};
  plan.insert(plan.end(), c.flags.begin(), c.flags.end());
  RunResult p = run(dir, NNSIM_BINARY, plan);
  ASSERT_EQ(p.status, 0) << p;
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--launch", std::to_string(n), "--out", "run.h5",
                     "--iterations", "1", "--warmup", "1", "--memory-timeline"});
  ASSERT_EQ(r.status, 0) << r;
  Expected<RunResults> file = read_run(dir.file("run.h5"));
  ASSERT_TRUE(file.ok()) << file.error().message();
  RunResult s =
      run(dir, NNSIM_BINARY,
          {"simulate", "plan.json", "--topo", topo, "--nodes", nodes, "--json", "s.json"});
  ASSERT_EQ(s.status, 0) << s;
  const nlohmann::json sim = nlohmann::json::parse(slurp(dir.file("s.json")));

  // Weights, gradients and optimizer state (ZeRO-3: the shards; the gathered units are freed
  // after use): after the optimizer step nothing else is live but the iteration's token ids
  // (int64, the global batch's 4 x micro_batches x dp sequences of 257) and the unfused
  // attention's cached causal mask (256 x 256 bools), taken off.
  const double inputs = 4.0 * c.micro_batches * c.dp * 257 * 8 + 256.0 * 256;
  double measured_static = 0, simulated_static = 0, simulated_peak = 0;
  for (const RankResult& k : file->ranks) {
    ASSERT_FALSE(k.memory.empty()) << "rank " << k.rank << ": no memory timeline";
    EXPECT_EQ(k.memory.back().name, "optimizer");
    EXPECT_GT(k.peak_allocated_bytes, k.memory.back().live_bytes);
    for (const OpMemory& m : k.memory) EXPECT_LE(m.live_bytes, k.peak_allocated_bytes);
    measured_static = std::max(measured_static, k.memory.back().live_bytes - inputs);
  }
  for (const nlohmann::json& lane : sim["lanes"]) {
    const nlohmann::json& m = lane["memory"];
    simulated_static = std::max(simulated_static, m["weights_bytes"].get<double>() +
                                                      m["gradients_bytes"].get<double>() +
                                                      m["optimizer_bytes"].get<double>());
    simulated_peak =
        std::max(simulated_peak, m["peak_bytes"].get<double>() - m["runtime_bytes"].get<double>() -
                                     m["comm_buffers_bytes"].get<double>());
  }
  EXPECT_NEAR(measured_static, simulated_static, 0.02 * simulated_static) << c.name;

  // The peak: both sides free what Megatron frees, operator by operator (docs/hwexec.md,
  // "Memory"). Beside the backward's whole gradients the executor's ZeRO 1-2 keep a gradient
  // chunk per rank (4 bytes a parameter over dp) and, in an fp32 plan, a master chunk (4 more),
  // where Megatron's distributed optimizer uses views of its gradient and parameter buffers:
  // those are taken off. All are then within 6.2 % (the worst: selective recomputation over
  // dp2); 7 % catches a regression of either side.
  const auto zero = std::find(c.flags.begin(), c.flags.end(), std::string("--zero"));
  const bool zero12 = zero != c.flags.end() && (zero[1] == "1" || zero[1] == "2");
  const double chunk_bytes = std::string(c.precision) == "fp32" ? 8 : 4;
  double measured_peak = 0, own_chunks = 0;
  for (const RankResult& k : file->ranks) {
    if (k.peak_allocated_bytes <= measured_peak) continue;
    measured_peak = k.peak_allocated_bytes;
    own_chunks = zero12 ? chunk_bytes * k.parameters / c.dp : 0.0;
  }
  EXPECT_NEAR(measured_peak - own_chunks, simulated_peak, 0.07 * simulated_peak) << c.name;
  // ZeRO-3 in a 16-bit plan gathers fp32 weights only where an operator reads them (the word
  // embedding's lookup, fp32 norms): beyond the simulator the executor holds less than one
  // layer's fp32 weights (writing them for the unit in use and the prefetched one too had put
  // the bf16 FSDP row 1.49 MiB over, two layers' worth).
  if (zero != c.flags.end() && zero[1] == "3" && std::string(c.precision) != "fp32") {
    Expected<ModelSpec> spec = load_model(model);
    ASSERT_TRUE(spec.ok()) << spec.error().message();
    EXPECT_LT(measured_peak - simulated_peak, 4.0 * static_cast<double>(spec->layer_parameters()))
        << c.name;
  }

  // nnsim compare reports the same two peaks.
  RunResult cmp = run(dir, NNSIM_BINARY,
                      {"compare", "run.h5", "--topo", topo, "--nodes", nodes, "--json", "c.json"});
  ASSERT_EQ(cmp.status, 0) << cmp;
  const nlohmann::json j = nlohmann::json::parse(slurp(dir.file("c.json")));
  EXPECT_DOUBLE_EQ(j["memory"]["measured_peak_bytes"].get<double>(), measured_peak);
  EXPECT_DOUBLE_EQ(j["memory"]["simulated_peak_bytes"].get<double>(), simulated_peak);
  EXPECT_TRUE(testing::contains(cmp.out, "peak memory of tensors")) << cmp;
  // ... and, from the timeline, the operator span the peak fell in: one of the run's.
  const std::string where = j["memory"]["measured_peak_operator"];
  bool known = false;
  for (const RankResult& k : file->ranks) {
    for (const OpMemory& m : k.memory) known |= m.name == where;
  }
  EXPECT_TRUE(known) << "'" << where << "'";
  EXPECT_TRUE(testing::contains(cmp.out, "measured peak during " + where)) << cmp;
  std::printf(
      "%s: static %.3f / %.3f MiB, peak %.3f / %.3f MiB (measured / simulated; the executor's own "
      "ZeRO chunks %.3f MiB)\n",
      c.name, measured_static / (1 << 20), simulated_static / (1 << 20), measured_peak / (1 << 20),
      simulated_peak / (1 << 20), own_chunks / (1 << 20));
}

INSTANTIATE_TEST_SUITE_P(
    Plans, NnexecRunMemory,
    ::testing::Values(
        MemoryCase{"fp32", 1, 1, 1, "fp32", {}}, MemoryCase{"bf16", 1, 1, 1, "bf16", {}},
        MemoryCase{"tp2", 2, 1, 1, "fp32", {}}, MemoryCase{"pp2", 1, 2, 1, "fp32", {}},
        // Sequence parallelism: the norms and residuals on the rank's slice, the linears'
        // gathered inputs dropped after the forward and gathered again for the backward.
        MemoryCase{"tp2_sp", 2, 1, 1, "fp32", {"--sequence-parallel"}},
        // Heads wider together than the hidden size (head_dim): Q, K, V and the attention's
        // output are 192 wide where the hidden state is 128.
        MemoryCase{"head_dim_tp2", 2, 1, 1, "fp32", {}, "small-head-dim-memory.yaml"},
        // Per-head query and key norms: their normalized Q and K kept beside the QKV output.
        MemoryCase{"qk_norm_tp2", 2, 1, 1, "fp32", {}, "small-qk-norm-memory.yaml"},
        // Norms after the attention and the MLP: each keeps its input, the row-parallel sums
        // (under sequence parallelism the rank's slice).
        MemoryCase{"post_norms_tp2", 2, 1, 1, "fp32", {}, "small-post-norms-memory.yaml"},
        MemoryCase{"post_norms_tp2_sp",
                   2,
                   1,
                   1,
                   "fp32",
                   {"--sequence-parallel"},
                   "small-post-norms-memory.yaml"},
        MemoryCase{"post_norms_recompute_full",
                   1,
                   1,
                   1,
                   "fp32",
                   {"--recompute", "full"},
                   "small-post-norms-memory.yaml"},
        // Latent attention: the latents and their norms' outputs, the core's fresh Q and K
        // beside the up-projections' outputs, and in the core's backward their gradients
        // (2026-12-06: -7.4 % before the simulator counted those). Under sequence parallelism
        // (-6.7 %) and with the core recomputed (-8.5 %) the executor holds more than this
        // bound: docs/hwexec.md, "Memory".
        MemoryCase{"mla", 1, 1, 1, "fp32", {}, "small-mla-memory.yaml"},
        MemoryCase{"mla_tp2", 2, 1, 1, "fp32", {}, "small-mla-memory.yaml"},
        // A mixture of experts: the routed copies, each expert's activations, the shared
        // expert's and the router's scores.
        MemoryCase{"moe_dp2", 1, 1, 2, "fp32", {}, "small-moe-memory.yaml"},
        // ... on the first of two stages, two micro-batches in flight: its peak is in the
        // combine's backward (the gathered gradient of the routed copies beside theirs), which
        // the experts' grouped GEMMs leave as the largest (2026-12-06: -8.3 % with a GEMM per
        // expert joined by cat, -4.9 % with the combine's transient the output's).
        MemoryCase{"moe_pp2", 1, 2, 1, "fp32", {}, "small-moe-memory.yaml"},
        // ... with expert parallelism: half the experts a rank, the copies exchanged.
        MemoryCase{"moe_ep2", 1, 1, 2, "fp32", {"--ep", "2"}, "small-moe-memory.yaml"},
        // ... with tensor-parallel experts (each a half of every expert's width), and under
        // sequence parallelism the copies of each rank's slice gathered over tp.
        // ... recomputed whole: the recomputation frees what the backward does not read (the
        // residuals' summands, the shared expert's output), as the first forward does
        // (2026-12-06: -9.0 % before, -3.6 % after).
        MemoryCase{"moe_recompute_full",
                   1,
                   1,
                   1,
                   "fp32",
                   {"--recompute", "full"},
                   "small-moe-memory.yaml"},
        MemoryCase{"moe_tp2", 2, 1, 1, "fp32", {}, "small-moe-memory.yaml"},
        MemoryCase{"moe_tp2_sp", 2, 1, 1, "fp32", {"--sequence-parallel"}, "small-moe-memory.yaml"},
        MemoryCase{"dp2_zero1", 1, 1, 2, "fp32", {"--zero", "1"}},
        // ZeRO-3: the fp32 shard is the master copy (4 bytes); between iterations both sides
        // hold the shards only, and through the iteration the unit in use and the one
        // prefetched (docs/hwexec.md, "Memory"). In bf16 the executor's gathers also write the
        // fp32 weights, 4 bytes a gathered parameter the simulator does not count.
        MemoryCase{"dp2_zero3", 1, 1, 2, "fp32", {"--zero", "3"}},
        MemoryCase{
            "dp2_deepspeed_zero3", 1, 1, 2, "fp32", {"--zero", "3", "--framework", "deepspeed"}},
        // ... every tensor gathered, tensor by tensor: the builder's 5e7 elements ahead (the
        // whole model here, gathered at its first operator), and 20,000 (an operator's tensors
        // and the next ones up to that, each released after its operator).
        MemoryCase{
            "dp2_deepspeed_zero3_every_tensor",
            1,
            1,
            2,
            "fp32",
            {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0"}},
        MemoryCase{"dp2_deepspeed_zero3_prefetch_20000",
                   1,
                   1,
                   2,
                   "fp32",
                   {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0",
                    "--zero3-prefetch-elements", "20000"}},
        MemoryCase{"bf16_fsdp_dp2", 1, 1, 2, "bf16", {"--zero", "3", "--framework", "fsdp"}},
        // Full recomputation: the loss's buffers are freed before the last layer is recomputed
        // (the program's backward peak, part by part).
        MemoryCase{"recompute_full", 1, 1, 1, "fp32", {"--recompute", "full"}},
        // ... stopping early, as PyTorch's checkpoint (FSDP plans): the recomputed activation
        // handed to the last linear's saved input, not copied (a copy was -7.1 %).
        MemoryCase{"fsdp_recompute_full_early_stop",
                   1,
                   1,
                   1,
                   "fp32",
                   {"--framework", "fsdp", "--recompute", "full"}},
        // Selective recomputation (the attention's scores and probabilities): a layer's
        // backward holds what it kept and what the recomputation brings back, not a whole
        // layer's activations on top of what it kept (that was +23.7 % here), on one stage and
        // on the first of two with two micro-batches in flight.
        MemoryCase{"recompute_selective_dp2", 1, 1, 2, "fp32", {"--recompute", "selective"}},
        MemoryCase{"pp2_recompute_selective", 1, 2, 1, "fp32", {"--recompute", "selective"}},
        // Zero-bubble split backwards, four micro-batches: between a BI block and its BW each
        // deferred linear layer holds its input and output gradient (Qi et al.'s M_W), not its
        // input gradient (autograd's leaf kept it, 2026-12-06: -8.6 and -17.4 % before).
        MemoryCase{
            "zb_h1_pp2", 1, 2, 1, "fp32", {"--schedule", "zb-h1"}, "small-gpt-memory.yaml", 4},
        MemoryCase{
            "zb_h2_pp2", 1, 2, 1, "fp32", {"--schedule", "zb-h2"}, "small-gpt-memory.yaml", 4},
        MemoryCase{
            "zb_h1_tp2_pp2", 2, 2, 1, "fp32", {"--schedule", "zb-h1"}, "small-gpt-memory.yaml", 4},
        // A stage's output freed once sent, as Megatron's deallocate_pipeline_outputs (it had
        // stayed to the next forward: -8.3 %).
        MemoryCase{"tp2_pp2", 2, 2, 1, "fp32", {}, "small-gpt-memory.yaml", 4}),
    [](const ::testing::TestParamInfo<MemoryCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace nnsim::hwexec
