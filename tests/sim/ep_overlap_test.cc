// Paired blocks: Megatron-Core's combined 1F1B (communication.ep_overlap) and DualPipeV's pairs
// written in the orders: which blocks pair, what the pair's template runs, and that the
// simulator and the estimator hide the expert all-to-alls behind the other block's compute.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/memory_check.h"
#include "core/model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/schedule_gen.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace nnsim {
namespace {

Topology nodes(int n) {
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  Expected<Topology> r = resize_topology(*t, n);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  return *r;
}

// Qwen3-30B-A3B cut to 4 layers, its 128 experts over 16 GPUs on two nodes: every all-to-all
// crosses InfiniBand.
ModelSpec small_moe() {
  Expected<ModelSpec> m = load_model("qwen3-30b-a3b");
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message());
  m->layers = 4;
  return *m;
}

// 4 micro-batches of one sequence per replica by default.
MegatronOptions options(bool overlap, int global_batch = 64) {
  MegatronOptions o;
  o.ep = 16;
  o.global_batch = global_batch;
  o.zero = 1;
  o.ep_overlap = overlap;
  return o;
}

// Two pipeline stages of the model at 8 layers on four nodes, 8 micro-batches per replica.
ModelSpec eight_layers() {
  ModelSpec m = small_moe();
  m.layers = 8;
  return m;
}
MegatronOptions two_stages(bool overlap) {
  MegatronOptions o = options(overlap, 128);
  o.pp = 2;
  return o;
}

Program compile(const ModelSpec& m, const Topology& t, const MegatronOptions& o) {
  Expected<Plan> plan = build_megatron_plan(m, t, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  Expected<Program> prog = compile_plan(*plan, t);
  EXPECT_TRUE(prog.ok()) << (prog.ok() ? "" : prog.error().message());
  return *prog;
}

SimResult run(const Program& p) {
  Expected<SimResult> r = simulate(p);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message());
  return *r;
}

// The estimator, which runs the expert stream too, within 10 % of the simulation.
void expect_estimated(const Program& program, const SimResult& simulated) {
  EXPECT_NEAR(estimate_program(program).iteration_time, simulated.iteration_time,
              0.1 * simulated.iteration_time);
}

int hideable(const BlockTemplate& t) {
  int n = 0;
  for (const Step& s : t.steps) {
    n += s.kind == StepKind::kCollective && (s.collective == CollectiveKind::kAllToAll ||
                                             s.collective == CollectiveKind::kExpertExchange);
  }
  return n;
}

// Without a pipeline the forward of micro-batch i + 1 pairs with the backward of i (Megatron's
// combined_1f1b_schedule_for_no_pipelining): F0, F1+B0, F2+B1, F3+B2, B3. Every all-to-all of
// the two blocks is launched on the expert stream and waited for once, each block's steps keep
// their order, and a block's own steps carry its member.
TEST(EpOverlap, PairsEachForwardWithThePreviousBackwardWithoutAPipeline) {
  const Program p = compile(small_moe(), nodes(2), options(true));
  ASSERT_EQ(p.lanes.size(), 1u);
  const Lane& lane = p.lanes[0];
  ASSERT_EQ(lane.blocks.size(), 5u);
  EXPECT_EQ(to_string(lane.blocks[0]), "F0@0");
  EXPECT_EQ(to_string(lane.blocks[1]), "F1@0+B0@0");
  EXPECT_EQ(to_string(lane.blocks[3]), "F3@0+B2@0");
  EXPECT_EQ(to_string(lane.blocks[4]), "B3@0");
  const BlockTemplate& forward = p.templates[lane.blocks[0].template_index];
  const BlockTemplate& backward = p.templates[lane.blocks[4].template_index];
  const BlockTemplate& pair = p.templates[lane.blocks[1].template_index];
  EXPECT_TRUE(pair.paired);
  EXPECT_EQ(lane.blocks[2].template_index, lane.blocks[1].template_index);  // shared
  EXPECT_EQ(hideable(pair), 0);
  std::map<int, int> launched, waited;  // tag -> count
  std::vector<int> labels[2];           // each member's compute labels in order
  for (const Step& s : pair.steps) {
    if (s.kind == StepKind::kCommLaunch) {
      EXPECT_EQ(waited.count(s.tag), 0u);
      ++launched[s.tag];
    }
    if (s.kind == StepKind::kCommWait) {
      EXPECT_EQ(launched[s.tag], 1);
      ++waited[s.tag];
    }
    if (s.kind == StepKind::kCompute) labels[s.member].push_back(s.label);
  }
  EXPECT_EQ(static_cast<int>(launched.size()), hideable(forward) + hideable(backward));
  EXPECT_EQ(launched.size(), waited.size());
  for (const auto& [tag, n] : waited) EXPECT_EQ(n, 1) << tag;
  for (int member : {0, 1}) {
    std::vector<int> own;
    for (const Step& s : (member == 0 ? forward : backward).steps) {
      if (s.kind == StepKind::kCompute) own.push_back(s.label);
    }
    EXPECT_EQ(labels[member], own) << member;
  }
  // The forward's attention runs beside the backward's first exchange: the backward starts.
  EXPECT_EQ(pair.steps.front().member, 1);
}

// Under tensor and sequence parallelism the routed tokens are all-gathered over tp after the
// dispatch's all-to-all and reduce-scattered before the combine's: an exchange takes them with
// it onto the expert stream, as Megatron-Core's dispatch and combine nodes do.
TEST(EpOverlap, AnExchangeTakesItsTensorParallelCollectivesAlong) {
  MegatronOptions o = options(true, 128);
  o.tp = 2;
  o.ep = 8;
  o.sequence_parallel = true;
  const Program p = compile(small_moe(), nodes(2), o);
  const Lane& lane = p.lanes[0];
  ASSERT_TRUE(lane.blocks[1].paired);
  const BlockTemplate& pair = p.templates[lane.blocks[1].template_index];
  int all_to_all = 0, tensor_parallel = 0;
  for (const Step& s : pair.steps) {
    if (s.kind != StepKind::kCommLaunch) continue;
    if (s.collective == CollectiveKind::kAllToAll) {
      ++all_to_all;
    } else {
      ++tensor_parallel;
      EXPECT_TRUE(s.collective == CollectiveKind::kAllGather ||
                  s.collective == CollectiveKind::kReduceScatter);
      EXPECT_EQ(p.axes_name(s.axes), "tp");
    }
  }
  EXPECT_GT(all_to_all, 0);
  EXPECT_EQ(tensor_parallel, all_to_all);  // one beside each all-to-all
  EXPECT_GT(run(p).iteration_time, 0);
}

// Megatron-Core's --moe-shared-expert-overlap: the shared expert's compute moves beside the
// expert exchange next to it (the dispatch in a forward, the exchange before it in a backward),
// keeping its seconds; less of the all-to-alls is exposed.
TEST(EpOverlap, TheSharedExpertComputesBesideTheAllToAll) {
  Expected<ModelSpec> m = load_model("deepseek-moe-16b");
  ASSERT_TRUE(m.ok());
  m->layers = 3;
  const Topology t = nodes(2);
  MegatronOptions o = options(false, 128);
  const Program plain = compile(*m, t, o);
  o.moe_shared_expert_overlap = true;
  const Program overlapped = compile(*m, t, o);
  const double slow = 1 + overlapped.compute_model.comm_interference;
  for (size_t i = 0; i < plain.templates.size(); ++i) {
    double before = 0, after = 0;
    int shared = 0, beside = 0;
    for (const Step& s : plain.templates[i].steps) {
      if (s.kind == StepKind::kCompute) before += s.seconds;
    }
    for (const Step& s : overlapped.templates[i].steps) {
      if (s.kind == StepKind::kCompute) {
        after += s.seconds;
        shared += overlapped.labels[s.label].rfind("moe.shared.", 0) == 0;
      }
      if (s.kind == StepKind::kCollective && s.collective == CollectiveKind::kAllToAll &&
          s.seconds > 0) {
        after += s.seconds / slow;
        ++beside;
      }
    }
    EXPECT_EQ(shared, 0) << i;
    EXPECT_EQ(beside, 2) << i;  // the two expert blocks' shared experts (the first is dense)
    // Within its layer: beside the dispatch of a forward (right after the routing), beside the
    // exchange before the routing's backward in a backward.
    const std::vector<Step>& steps = overlapped.templates[i].steps;
    const bool forward = overlapped.templates[i].kind == BlockKind::kForward;
    for (size_t k = 1; k + 1 < steps.size(); ++k) {
      if (steps[k].kind != StepKind::kCollective || steps[k].seconds == 0) continue;
      const Step& around = forward ? steps[k - 1] : steps[k + 1];
      EXPECT_EQ(overlapped.labels[around.label], "moe.dispatch") << i << " " << k;
    }
    EXPECT_NEAR(after, before, 1e-9 * before) << i;
  }
  const SimResult a = run(plain);
  const SimResult b = run(overlapped);
  EXPECT_LT(b.lanes[0].breakdown.exposed_comm.at("ep"), a.lanes[0].breakdown.exposed_comm.at("ep"));
  EXPECT_LT(b.iteration_time, a.iteration_time);
  // Without a shared expert there is nothing to move: the plan file is refused at compilation;
  // beside ep_overlap it is refused when read.
  Expected<Plan> mixtral = build_megatron_plan(small_moe(), t, options(false));
  ASSERT_TRUE(mixtral.ok()) << mixtral.error().message();
  mixtral->comm.moe_shared_expert_overlap = true;
  Expected<Program> refused = compile_plan(*mixtral, t);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("communication.moe_shared_expert_overlap"),
            std::string::npos);
  std::string text = plan_to_json(*mixtral);
  text.replace(text.find("\"moe_shared_expert_overlap\": true"), 33,
               "\"moe_shared_expert_overlap\": true, \"ep_overlap\": true");
  Expected<Plan> both = parse_plan(text, "plan.json");
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.error().message().find("moe_shared_expert_overlap"), std::string::npos);
}

// The pair holds about one micro-batch's activations, not two: the forward keeps its own as the
// backward frees its, and the blocks' transient buffers take turns. The device's peak stays
// within a fraction of a micro-batch's activations of the blocks' in sequence.
TEST(EpOverlap, APairHoldsOneMicroBatchsActivationsNotTwo) {
  const ModelSpec m = small_moe();
  const Topology t = nodes(2);
  const Program paired = compile(m, t, options(true));
  const Program plain = compile(m, t, options(false));
  const Lane& lane = paired.lanes[0];
  const BlockTemplate& forward = paired.templates[lane.blocks[0].template_index];
  const BlockTemplate& backward = paired.templates[lane.blocks[4].template_index];
  const BlockTemplate& pair = paired.templates[lane.blocks[1].template_index];
  EXPECT_DOUBLE_EQ(pair.kept_bytes, forward.kept_bytes + backward.kept_bytes);
  double micro_batch = 0;  // one micro-batch's layer activations
  for (double x : paired.layer_activation_bytes) micro_batch += x;
  ASSERT_GT(micro_batch, 0);
  const double with_pairs = lane_memory_peaks(paired)[0].peak;
  const double in_sequence = lane_memory_peaks(plain)[0].peak;
  EXPECT_GT(with_pairs, in_sequence - 0.1 * micro_batch);
  EXPECT_LT(with_pairs, in_sequence + 0.1 * micro_batch);
  EXPECT_LT(pair.peak_bytes, forward.peak_bytes + backward.peak_bytes - 0.5 * micro_batch);
}

// The all-to-alls cross InfiniBand; beside the other block's compute most of their wait goes
// (8 micro-batches: 14 of 16 blocks pair). The work is the same (compute differs by its slowdown
// beside communication), the step is shorter, and the estimator, which runs the expert stream
// too, agrees within 10 %.
TEST(EpOverlap, HidesTheAllToAllsBehindTheOtherBlocksCompute) {
  const ModelSpec m = small_moe();
  const Topology t = nodes(2);
  const SimResult plain = run(compile(m, t, options(false, 128)));
  const Program program = compile(m, t, options(true, 128));
  const SimResult paired = run(program);
  const double plain_wait = plain.lanes[0].breakdown.exposed_comm.at("ep");
  const double paired_wait = paired.lanes[0].breakdown.exposed_comm.count("ep")
                                 ? paired.lanes[0].breakdown.exposed_comm.at("ep")
                                 : 0.0;
  ASSERT_GT(plain_wait, 0.1 * plain.iteration_time);
  EXPECT_LT(paired_wait, 0.5 * plain_wait);
  EXPECT_LT(paired.iteration_time, plain.iteration_time - 0.3 * plain_wait);
  const double compute = plain.lanes[0].breakdown.compute;
  EXPECT_GE(paired.lanes[0].breakdown.compute, compute * (1 - 1e-9));
  EXPECT_LE(paired.lanes[0].breakdown.compute,
            compute * (1 + program.compute_model.comm_interference) + 1e-9);
  expect_estimated(program, paired);
  // Deterministic.
  EXPECT_EQ(run(program).iteration_time, paired.iteration_time);
}

// The timeline shows the expert stream: every launched all-to-all runs there once, under the
// pair's name, and the compute stream's waits for it are comm-wait tasks.
TEST(EpOverlap, TheTraceShowsTheExpertStream) {
  const Program program = compile(small_moe(), nodes(2), options(true));
  SimOptions o;
  o.record_tasks = true;
  Expected<SimResult> r = simulate(program, o);
  ASSERT_TRUE(r.ok()) << r.error().message();
  int launched = 0;
  for (const BlockInstance& b : program.lanes[0].blocks) {
    for (const Step& s : program.templates[b.template_index].steps) {
      launched += s.kind == StepKind::kCommLaunch;
    }
  }
  int on_stream = 0, waits = 0;
  for (const TaskRecord& t : r->tasks) {
    if (t.stream == Stream::kExpertComm) {
      ++on_stream;
      EXPECT_EQ(t.kind, TaskKind::kCollective);
      EXPECT_TRUE(program.lanes[0].blocks[t.block].paired);
    }
    waits += t.kind == TaskKind::kCommWait;
  }
  EXPECT_EQ(on_stream, launched);
  EXPECT_GT(waits, 0);
  const std::string trace = chrome_trace_json(program, *r);
  EXPECT_NE(trace.find("\"expert-comm\""), std::string::npos);
  EXPECT_NE(trace.find("F1@0+B0@0 "), std::string::npos);
  EXPECT_NE(trace.find("\"comm-wait\""), std::string::npos);
}

// DeepEP's exchange holds 20 SMs: compute beside it takes 20/112 longer on an H100, more than
// beside NCCL's all-to-all, and never more than that on the whole.
TEST(EpOverlap, ComputeBesideDeepEpsExchangeRunsOnTheSmsItLeaves) {
  const ModelSpec m = small_moe();
  const Topology t = nodes(2);
  MegatronOptions o = options(false, 128);
  o.moe_deepep = true;
  const SimResult plain = run(compile(m, t, o));
  o.ep_overlap = true;
  const Program program = compile(m, t, o);
  const SimResult paired = run(program);
  const double compute = plain.lanes[0].breakdown.compute;
  const double slowed = paired.lanes[0].breakdown.compute - compute;
  EXPECT_GT(slowed, program.compute_model.comm_interference * 0.2 * compute);
  EXPECT_LE(slowed, 20.0 / 112 * compute);
  EXPECT_LT(paired.iteration_time, plain.iteration_time);
  expect_estimated(program, paired);
}

// With interleaved pipeline stages every stage pairs its steady-state blocks, the last stage's
// too (its forward and backward there belong to different chunks), and the pipeline runs
// through.
TEST(EpOverlap, InterleavedStagesPairOnEveryStage) {
  const ModelSpec m = eight_layers();
  const Topology t = nodes(4);
  MegatronOptions o = two_stages(true);
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  const Program program = compile(m, t, o);
  for (const Lane& lane : program.lanes) {
    int pairs = 0;
    for (const BlockInstance& b : lane.blocks) {
      pairs += b.paired;
      if (b.paired) {
        EXPECT_NE(b.block.micro_batch, b.partner.micro_batch);
        EXPECT_EQ(b.block.kind, BlockKind::kForward);
        EXPECT_EQ(b.partner.kind, BlockKind::kBackward);
      }
    }
    EXPECT_GT(pairs, 0);
  }
  // `nnsim schedule` regenerating the plan's orders writes the builder's, warm-up and all.
  Expected<Plan> built = build_megatron_plan(m, t, o);
  ASSERT_TRUE(built.ok()) << built.error().message();
  Expected<Plan> regenerated = generate_schedule(*built, t, ScheduleKind::kInterleaved);
  ASSERT_TRUE(regenerated.ok()) << regenerated.error().message();
  ASSERT_EQ(regenerated->schedule.size(), built->schedule.size());
  for (size_t i = 0; i < built->schedule.size(); ++i) {
    EXPECT_EQ(regenerated->schedule[i].blocks, built->schedule[i].blocks) << i;
  }
  o.ep_overlap = false;
  const SimResult plain = run(compile(m, t, o));
  const SimResult paired = run(program);
  EXPECT_LT(paired.iteration_time, plain.iteration_time);
  expect_estimated(program, paired);
}

// A plan written by hand may pair blocks whose pairs would wait on each other through the
// pipeline: plain 1F1B's last stage pairs a backward with the next forward, whose input comes
// from the previous stage's pair, which waits for that backward's gradient. Those pairs are
// split; the rest stay, and the pipeline runs through. The builder refuses the schedule.
TEST(EpOverlap, SplitsPairsThatWouldWaitOnEachOtherThroughThePipeline) {
  const ModelSpec m = eight_layers();
  const Topology t = nodes(4);
  MegatronOptions o = two_stages(false);
  Expected<Plan> plan = build_megatron_plan(m, t, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  plan->comm.ep_overlap = true;
  Expected<Program> p = compile_plan(*plan, t);
  ASSERT_TRUE(p.ok()) << p.error().message();
  ASSERT_EQ(p->lanes.size(), 2u);
  int pairs[2] = {0, 0};
  for (int l : {0, 1}) {
    for (const BlockInstance& b : p->lanes[l].blocks) pairs[l] += b.paired;
  }
  EXPECT_GT(pairs[0], 0);
  EXPECT_EQ(pairs[1], 0);
  const SimResult r = run(*p);
  EXPECT_GT(r.iteration_time, 0);
  o.ep_overlap = true;
  Expected<Plan> refused = build_megatron_plan(m, t, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--schedule interleaved"), std::string::npos);
}

// Plans nothing can pair, or that pair what they cannot, are refused with the field and the fix.
TEST(EpOverlap, RefusesPlansWithNothingToPair) {
  const Topology t = nodes(2);
  // A dense model has no all-to-alls: the builder names the flag.
  Expected<ModelSpec> dense = load_model("llama3-8b");
  ASSERT_TRUE(dense.ok());
  MegatronOptions o = options(true);
  o.ep = 1;
  Expected<Plan> refused = build_megatron_plan(*dense, t, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("--ep-overlap"), std::string::npos);
  // The same plan written by hand reaches the compiler, which names the plan field.
  o.ep_overlap = false;
  Expected<Plan> plan = build_megatron_plan(*dense, t, o);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  plan->comm.ep_overlap = true;
  Expected<Program> p = compile_plan(*plan, t);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("communication.ep_overlap"), std::string::npos);
  EXPECT_NE(p.error().message().find("expert parallelism"), std::string::npos);
  // One micro-batch per replica: no forward sits next to another micro-batch's backward.
  MegatronOptions one = options(true);
  one.global_batch = 16;
  Expected<Plan> single = build_megatron_plan(small_moe(), t, one);
  ASSERT_TRUE(single.ok()) << single.error().message();
  Expected<Program> q = compile_plan(*single, t);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.error().message().find("more than one micro-batch"), std::string::npos);
  // With Merak's sub-batches too: the builder refuses the two together.
  MegatronOptions both = options(true);
  both.tp_sub_batches = 2;
  both.micro_batch = 2;
  both.global_batch = 128;
  Expected<Plan> b = build_megatron_plan(small_moe(), t, both);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message().find("--tp-sub-batches"), std::string::npos);
}

// The plan file carries the field and refuses it beside sub-batches.
TEST(EpOverlap, PlanFileRoundTripsTheFieldAndRefusesItWithSubBatches) {
  Expected<Plan> plan = build_megatron_plan(small_moe(), nodes(2), options(true));
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  const std::string text = plan_to_json(*plan);
  EXPECT_NE(text.find("\"ep_overlap\": true"), std::string::npos);
  Expected<Plan> back = parse_plan(text, "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_TRUE(back->comm.ep_overlap);
  std::string both = text;
  both.replace(both.find("\"ep_overlap\": true"), 18,
               "\"ep_overlap\": true, \"tp_sub_batches\": 2");
  Expected<Plan> refused = parse_plan(both, "plan.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("ep_overlap"), std::string::npos);
  EXPECT_NE(refused.error().message().find("tp_sub_batches"), std::string::npos);
}

}  // namespace
}  // namespace nnsim

namespace nnsim {
namespace {

MegatronOptions dual_pipe_v() {
  MegatronOptions o = two_stages(false);
  o.vpp = 2;
  o.schedule = ScheduleKind::kDualPipeV;
  return o;
}

// DualPipeV pairs what its orders pair, on both ranks, and nothing else: every pair of the
// program is one of the orders' "F+B", each the forward of one phase beside the backward of the
// other. Against ZB-V on the same V it waits less on the all-to-alls (across InfiniBand here
// they take longer than the compute beside them, and a third of the blocks run apart in the
// warm-up and cool-down of 8 micro-batches) and ends sooner, and the estimator agrees.
TEST(DualPipeV, PairsItsOrdersPairsAndHidesTheAllToAlls) {
  const ModelSpec m = eight_layers();
  const Topology t = nodes(4);
  Expected<Plan> plan = build_megatron_plan(m, t, dual_pipe_v());
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_FALSE(plan->comm.ep_overlap);
  const std::string text = plan_to_json(*plan);
  EXPECT_NE(text.find("F3@0+B1@3"), std::string::npos) << text;
  Expected<Program> program = compile_plan(*plan, t);
  ASSERT_TRUE(program.ok()) << program.error().message();
  ASSERT_EQ(program->lanes.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    int written = 0, paired = 0;
    for (const Block& b : plan->schedule[l].blocks) written += b.paired_with_next;
    for (const BlockInstance& b : program->lanes[l].blocks) {
      paired += b.paired;
      if (b.paired) {
        EXPECT_NE(b.block.segment, b.partner.segment) << to_string(b);
      }
    }
    EXPECT_GT(written, 0);
    EXPECT_EQ(paired, written) << l;
  }
  MegatronOptions zb = dual_pipe_v();
  zb.schedule = ScheduleKind::kZbV;
  const SimResult v = run(compile(m, t, zb));
  const SimResult dual = run(*program);
  double v_wait = 0, dual_wait = 0;
  for (size_t l = 0; l < 2; ++l) {
    v_wait += v.lanes[l].breakdown.exposed_comm.at("ep");
    const auto& e = dual.lanes[l].breakdown.exposed_comm;
    dual_wait += e.count("ep") ? e.at("ep") : 0.0;
  }
  EXPECT_LT(dual_wait, 0.75 * v_wait);
  EXPECT_LT(dual.iteration_time, v.iteration_time - 0.25 * (v_wait - dual_wait) / 2);
  expect_estimated(*program, dual);
}

// The builder names what DualPipeV cannot run with: automatic pairing on top of its own, the
// other overlaps of the all-to-alls, one chunk per rank and too few micro-batches.
TEST(DualPipeV, BuilderRefusesWhatItCannotRun) {
  const ModelSpec m = eight_layers();
  const Topology t = nodes(4);
  auto refusal = [&](const MegatronOptions& o) {
    Expected<Plan> p = build_megatron_plan(m, t, o);
    EXPECT_FALSE(p.ok());
    return p.ok() ? std::string() : p.error().message();
  };
  MegatronOptions o = dual_pipe_v();
  o.ep_overlap = true;
  EXPECT_NE(refusal(o).find("pairs its forwards and backwards itself, each one's expert "
                            "all-to-alls beside the other's compute; drop --ep-overlap"),
            std::string::npos)
      << refusal(o);
  o = dual_pipe_v();
  o.vpp = 1;
  EXPECT_NE(refusal(o).find("the dualpipev schedule runs two model chunks per pipeline rank in a "
                            "V; use --vpp 2 (got 1)"),
            std::string::npos)
      << refusal(o);
  o = dual_pipe_v();
  o.global_batch = 48;  // 3 micro-batches a replica, 4 needed
  EXPECT_NE(refusal(o).find("needs at least twice as many micro-batches as pipeline stages"),
            std::string::npos)
      << refusal(o);
}

}  // namespace
}  // namespace nnsim
