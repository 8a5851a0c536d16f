// Pipeline memory as PyTorch's pipelining runtime holds it (communication
// .pp_buffers_per_micro_batch, on for fsdp plans): a receive buffer per micro-batch for each
// transfer a stage receives, and every micro-batch's stage output (the last stage's: its fp32
// logits) kept until the step ends. Two stages of the uniform model, 1F1B, four micro-batches,
// on the communication-free cluster.
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "core/topology.h"
#include "planner/megatron.h"
#include "tests/support/communication_free.h"
#include "tests/support/simulated_run.h"

namespace nnsim {
namespace {

using testing::communication_free_node;
using testing::matmul_only;

constexpr int kMicroBatches = 4;

struct PipelineRun {
  std::vector<StaticMemory> statics;  // per stage
  std::vector<double> peaks;          // per stage, bytes
};

PipelineRun simulate_fsdp_pipeline(bool per_micro_batch_buffers) {
  MegatronOptions o;
  o.pp = 2;
  o.global_batch = kMicroBatches;
  o.framework = "fsdp";
  const Topology t = communication_free_node(2);
  o.costs = matmul_only(t);
  std::optional<Plan> plan = testing::uniform_plan(t, o);
  if (!plan) return {};
  EXPECT_TRUE(plan->comm.pp_buffers_per_micro_batch) << "the fsdp builder's default";
  plan->comm.pp_buffers_per_micro_batch = per_micro_batch_buffers;
  const std::optional<testing::SimulatedRun> run = testing::compile_and_simulate(*plan, t);
  if (!run) return {};
  PipelineRun out;
  for (const auto& lane : run->program.lanes) out.statics.push_back(lane.memory);
  for (const auto& lane : run->result.lanes) out.peaks.push_back(lane.peak_memory);
  return out;
}

TEST(PipelineBuffers, TorchPipeliningHoldsABufferPerMicroBatchAndEveryOutput) {
  const PipelineRun torch = simulate_fsdp_pipeline(true);
  const PipelineRun megatron = simulate_fsdp_pipeline(false);
  ASSERT_EQ(torch.peaks.size(), 2u);
  ASSERT_EQ(megatron.peaks.size(), 2u);
  // The uniform model: micro-batch 1 x 2,048 tokens x hidden 2,048 in bf16; 128 logits a token.
  const double hidden_state = 2048.0 * 2048 * 2;
  const double fp32_logits = 2048.0 * 128 * 4;
  // Stage 0 receives the gradients of its output, stage 1 the activations of its input.
  for (int s = 0; s < 2; ++s) {
    EXPECT_DOUBLE_EQ(torch.statics[s].pipeline_buffers, kMicroBatches * hidden_state) << s;
    EXPECT_DOUBLE_EQ(megatron.statics[s].pipeline_buffers, 0.0) << s;
  }
  // Stage 0 peaks at its last backward: the buffers, and the four outputs it sent.
  EXPECT_NEAR(torch.peaks[0] - megatron.peaks[0], 2 * kMicroBatches * hidden_state, 1.0);
  // Stage 1 (one micro-batch in flight) peaks at its last backward too, holding every
  // micro-batch's logits; the input its first layer saves is the receive buffer itself.
  EXPECT_NEAR(torch.peaks[1] - megatron.peaks[1],
              kMicroBatches * (hidden_state + fp32_logits) - hidden_state, 1.0);
}

}  // namespace
}  // namespace nnsim
