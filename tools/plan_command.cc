#include "tools/plan_command.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/memory_check.h"
#include "core/model.h"
#include "core/plan.h"
#include "core/training_time.h"
#include "core/units.h"
#include "sim/sensitivity.h"
#include "sim/simulator.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {
namespace {

std::string csv_escape(const std::string& s) {
  return s.find(',') == std::string::npos ? s : "\"" + s + "\"";
}

int run_search(PlanArgs& a, const ModelSpec& model, const Topology& topo) {
  Expected<SearchOptions> options = search_options(a, model);
  if (!options) return fail(options.error().message());
  SearchOptions& so = *options;
  Progress progress("searching");
  so.progress = [&progress](const std::string& phase, size_t done, size_t all) {
    const double f = static_cast<double>(done) / all;
    if (phase == "estimating") progress.update(0.75 * f);
    if (phase == "balancing stages") progress.update(0.75 + 0.1 * f);
    if (phase == "placing ranks") progress.update(0.85 + 0.025 * f);
    if (phase == "scheduling") progress.update(0.875 + 0.025 * f);
    if (phase == "simulating") progress.update(0.9 + 0.1 * f);
  };
  Expected<SearchResult> r = search_plans(model, topo, so);
  progress.done();
  if (!r) return fail(r.error().message());
  std::printf("searched %zu candidates (%zu compiled and estimated, %zu confirmed by simulation)\n",
              r->enumerated, r->evaluated, r->confirmed);
  if (r->balanced > 0) {
    std::printf("stages re-partitioned for %zu pipelines; %zu beat their uniform split\n",
                r->balanced, r->balanced_better);
  }
  if (r->placements_tried > 0) {
    std::printf("%zu other rank placements tried for the best plans\n", r->placements_tried);
  }
  if (r->schedules_tried > 0) {
    std::printf(
        "%zu other pipeline schedules (zero bubble, DualPipeV, Merak, Tessel) tried for the best "
        "pipelined plans\n",
        r->schedules_tried);
  }
  if (r->recompute_schedules_tried > 0) {
    std::printf(
        "%zu zero-bubble, Merak and V schedules tried with per-stage recomputation and "
        "re-partitioned stages\n",
        r->recompute_schedules_tried);
  }
  if (r->sub_pipelined_tried > 0) {
    std::printf("%zu plans tried with sub-pipelined tensor parallelism (Merak)\n",
                r->sub_pipelined_tried);
  }
  if (r->ep_overlap_tried > 0) {
    std::printf(
        "%zu plans tried with combined 1F1B (expert all-to-alls beside another "
        "micro-batch's compute)\n",
        r->ep_overlap_tried);
  }
  std::printf("%4s  %-60s %11s %11s %10s %6s\n", "rank", "plan", "estimated", "simulated",
              "peak mem", "MFU");
  int rank = 0;
  for (const Candidate& c : r->ranked) {
    const double mfu =
        c.simulated ? c.estimate.mfu * c.estimate.iteration_time / *c.simulated : c.estimate.mfu;
    std::printf("%4d  %-60s %11s %11s %10s %5.1f%%\n", ++rank, c.describe().c_str(),
                format_seconds(c.estimate.iteration_time).c_str(),
                c.simulated ? format_seconds(*c.simulated).c_str() : "-",
                format_bytes(c.estimate.peak_memory).c_str(), 100 * mfu);
  }
  if (!r->other_placements_of_best.empty()) {
    const auto& others = r->other_placements_of_best;
    std::printf("the best plan placed otherwise (%zu placements, mesh axes outermost first):\n",
                others.size());
    for (size_t i = 0; i < others.size(); ++i) {
      // The closest few, and the worst for scale.
      if (i >= 5 && i + 1 < others.size()) continue;
      const Candidate& c = others[i];
      std::printf(
          "      %-24s %11s  %+.1f%%\n", c.placement.c_str(),
          format_seconds(c.estimate.iteration_time).c_str(),
          100 * (c.estimate.iteration_time / r->ranked.front().estimate.iteration_time - 1));
    }
  }
  if (r->other_placements_of_best.empty() && r->best_per_placement.size() > 1) {
    std::printf("best plan per rank placement:\n");
    for (const Candidate& c : r->best_per_placement) {
      std::printf("      %-60s %11s  (%s)\n", c.describe().c_str(),
                  format_seconds(c.time()).c_str(), c.placement.c_str());
    }
  }
  if (!r->rejected.empty()) {
    std::printf("faster plans that lost:\n");
    for (const Candidate& c : r->rejected) {
      if (c.estimate.iteration_time >= r->ranked.front().time()) continue;
      std::printf("      %-60s %11s  %s\n", c.describe().c_str(),
                  format_seconds(c.estimate.iteration_time).c_str(), c.status.c_str());
    }
  }
  std::printf("candidates removed:");
  for (const auto& [why, n] : r->rejections) std::printf(" %s %zu;", why.c_str(), n);
  std::printf("\n");
  if (r->rank_pairs > 0) {
    std::printf("estimator vs simulator: %zu of %zu pairs of confirmed plans ranked differently\n",
                r->rank_disagreements, r->rank_pairs);
  }
  if (a.train_token_count) {
    // The best plan's time is its simulated one where confirmed.
    const Candidate& best = r->ranked.front();
    Expected<TrainingTime> t = training_time(
        *a.train_token_count, static_cast<double>(r->best.global_batch) * r->best.model.seq_len,
        best.time(), r->best.mesh.num_ranks());
    if (!t) return fail("--train-tokens: " + t.error().message());
    if (Status st = add_failure_cost(*t, a.failure_model); !st) return fail(st.error().message());
    std::printf("the best plan (%s) trains %s\n", best.simulated ? "simulated" : "estimated",
                describe_training(*t).c_str());
  }
  if (a.sensitivity > 0) {
    // Against the best plan's simulated step: the confirming simulation's, else one now.
    const Candidate& best = r->ranked.front();
    std::optional<double> baseline = best.simulated;
    if (!baseline) {
      Expected<Program> prog = compile_plan(r->best, topo, a.o.costs);
      Expected<SimResult> sim = prog ? simulate(*prog) : Expected<SimResult>(prog.error());
      if (!sim) return fail(fmt::format("{}: {}", r->best.name, sim.error().message()));
      baseline = sim->iteration_time;
    }
    Expected<Sensitivity> s =
        run_sensitivity(r->best, topo, a.o.costs, {}, a.sensitivity, *baseline);
    if (!s) return fail(s.error().message());
    std::printf("the best plan simulated: %s a step\n", format_seconds(*baseline).c_str());
    print_sensitivity(*s);
  }
  note_unvalidated_moe(r->best.model);
  note_unvalidated_hybrid(r->best.model);
  note_hypothetical_gpu(topo.gpu);
  std::string error;
  if (!a.csv.empty()) {
    std::string csv =
        "rank,plan,tp,pp,vpp,cp,ep,etp,dp,micro_batch,sequence_parallel,recompute,zero,schedule,"
        "placement,stage_layers,recompute_layers,estimated_s,simulated_s,peak_memory_bytes,mfu,"
        "status\n";
    int k = 0;
    auto row = [&](const Candidate& c, const std::string& rank_text) {
      const MegatronOptions& o = c.options;
      csv += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                         rank_text, csv_escape(c.describe()), o.tp, o.pp, o.vpp, o.cp, o.ep,
                         o.expert_tp == 0 ? o.tp : o.expert_tp, o.dp, o.micro_batch,
                         o.sequence_parallel ? 1 : 0, to_string(o.recompute), o.zero,
                         to_string(o.schedule), c.placement, fmt::join(o.stage_layers, ";"),
                         fmt::join(o.recompute_layers, ";"), c.estimate.iteration_time,
                         c.simulated ? fmt::format("{}", *c.simulated) : "", c.estimate.peak_memory,
                         c.estimate.mfu, csv_escape(c.status));
    };
    for (const Candidate& c : r->ranked) row(c, std::to_string(++k));
    for (const Candidate& c : r->rejected) row(c, "");
    if (!write_file(a.csv, csv, &error)) return fail(error);
  }
  if (!write_file(a.output, plan_to_json(r->best), &error)) return fail(error);
  std::printf("wrote %s: %s\n", a.output.c_str(), r->best.name.c_str());
  return 0;
}

int run_plan(PlanArgs& a) {
  if (a.sensitivity > 0) {
    if (!a.search) {
      return fail(
          "--sensitivity needs a simulated plan: search (--search), or simulate the built plan "
          "(nnsim --topo TOPO plan.json --sensitivity F)");
    }
    if (Status st = check_sensitivity_option(a.sensitivity); !st) return fail(st.error().message());
  }
  if (!a.train_tokens.empty()) {
    if (!a.search) {
      return fail(
          "--train-tokens needs an iteration time: search (--search), or simulate the built "
          "plan (nnsim --topo TOPO plan.json --train-tokens N)");
    }
    Expected<double> n = parse_token_count(a.train_tokens);
    if (!n) return fail("--train-tokens: " + n.error().message());
    a.train_token_count = *n;
  }
  Expected<std::optional<FailureModel>> failures =
      read_failure_options(a.failures, !a.train_tokens.empty());
  if (!failures) return fail(failures.error().message());
  a.failure_model = *failures;
  Expected<ModelSpec> model = load_plan_model(a);
  if (!model) return fail(model.error().message());
  Expected<Topology> topo = load_topology_sized(a.topo, a.nodes, a.topo_set);
  if (!topo) return fail(topo.error().message());
  if (a.search) return run_search(a, *model, *topo);
  Expected<Plan> plan = build_megatron_plan(*model, *topo, a.o);
  if (!plan) return fail(plan.error().message());
  // The plan must compile on its topology: check now rather than at simulation time.
  Expected<Program> prog = compile_plan(*plan, *topo, a.o.costs);
  if (!prog) return fail(prog.error().message());
  std::string error;
  if (!write_file(a.output, plan_to_json(*plan), &error)) return fail(error);
  std::printf("wrote %s: %s\n", a.output.c_str(), plan->name.c_str());
  if (Status fits = check_memory_fits(*prog); !fits) {
    std::fprintf(stderr, "nnsim: warning: %s\n", fits.error().message().c_str());
  }
  return 0;
}

// A number written out in full ("0.5", "1"), nothing after it.
std::optional<double> parse_fraction(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

Expected<ModelSpec> load_plan_model(const PlanArgs& a, const std::vector<std::string>& more) {
  std::vector<FieldOverride> overrides;
  std::vector<std::string> texts = a.model_set;
  texts.insert(texts.end(), more.begin(), more.end());
  for (const std::string& text : texts) {
    Expected<FieldOverride> o = parse_field_override(text);
    if (!o) return Error("--model-set " + o.error().message());
    overrides.push_back(*o);
  }
  Expected<ModelSpec> model = load_model(a.model, overrides, "--model-set");
  if (!model) return model;
  if (!a.loss.empty()) {
    Expected<LossKernel> loss = parse_loss_kernel(a.loss);
    if (!loss) return Error("--loss: " + loss.error().message());
    model->loss = *loss;
  }
  return model;
}

Expected<SearchOptions> search_options(const PlanArgs& a, const ModelSpec& model) {
  SearchOptions so;
  so.global_batch = a.o.global_batch;
  so.precision = a.o.precision;
  so.framework = a.o.framework;
  so.tp_comm_overlap = a.o.tp_comm_overlap;
  so.tp_sub_batches = a.o.tp_sub_batches;
  so.moe_grouped_gemm = a.o.moe_grouped_gemm;
  so.moe_deepep = a.o.moe_deepep;
  so.ep_overlap = a.o.ep_overlap;
  so.moe_shared_expert_overlap = a.o.moe_shared_expert_overlap;
  so.optimizer_offload = a.o.optimizer_offload;
  so.offload_overlap = a.o.offload_overlap;
  so.offload_params = a.o.offload_params;
  so.offload_as_needed = a.offload_as_needed;
  so.activation_offload_as_needed = a.activation_offload == "auto";
  so.module_offload_as_needed = a.module_offload_auto;
  so.compile = a.o.costs;
  so.pins = a.pins;
  so.top = a.top;
  so.confirm = a.confirm;
  so.jobs =
      a.jobs > 0 ? a.jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!a.constraints.empty()) {
    Expected<Constraints> c = load_constraints(a.constraints);
    if (!c) return c.error();
    so.constraints = *c;
  }
  for (int g : a.o.avoid_gpus) so.constraints.avoid_gpus.push_back(g);
  if (Status st = check_recompute_modules(model, a.o.recompute_modules); !st) {
    return Error("--recompute-modules: " + st.error().message());
  }
  for (const std::string& m : a.o.recompute_modules) so.constraints.recompute_modules.push_back(m);
  if (Expected<std::vector<std::string>> m = offload_module_patterns(model, a.o.offload_modules);
      !m) {
    return Error("--offload-modules: " + m.error().message());
  }
  for (const std::string& m : a.o.offload_modules) so.constraints.offload_modules.push_back(m);
  so.simulate = [](const Program& p) -> Expected<double> {
    Expected<SimResult> r = simulate(p);
    if (!r) return r.error();
    return r->iteration_time;
  };
  return so;
}

void add_plan_choices(CLI::App* cmd, PlanArgs& a) {
  cmd->add_option("--model", a.model, "model YAML file or preset name")->required();
  cmd->add_option("--topo", a.topo, "topology YAML file or preset name")->required();
  add_topo_set_option(cmd, a.topo_set);
  cmd->add_option("--model-set", a.model_set,
                  "replace a field of the model (what-if; repeatable), e.g. seq_len=32768, "
                  "layers=40")
      ->allow_extra_args(false);
  cmd->add_option("--tp", a.o.tp, "tensor-parallel degree");
  cmd->add_option("--pp", a.o.pp, "pipeline-parallel degree (stages)");
  cmd->add_option("--dp", a.o.dp, "data-parallel degree (default: GPUs / (tp pp cp))")
      ->check(at_least(1));
  cmd->add_option("--cp", a.o.cp, "context-parallel degree");
  cmd->add_option("--ep", a.o.ep,
                  "expert-parallel degree (mixture-of-experts models): experts spread over "
                  "this many of the data-parallel ranks");
  cmd->add_option("--etp", a.o.expert_tp,
                  "expert tensor-parallel degree: tp (default; experts split along their width) "
                  "or 1 (whole experts spread over the tensor-parallel ranks too)");
  cmd->add_option("--vpp", a.o.vpp, "model chunks per pipeline rank (interleaved)");
  cmd->add_flag("--sequence-parallel", a.o.sequence_parallel,
                "Megatron sequence parallelism inside tensor-parallel groups");
  cmd->add_flag("--shard-head", a.o.shard_head,
                "the head as a segment spanning every pipeline stage, vocabulary split "
                "over pp (1f1b, gpipe or tessel; builder only)");
  cmd->add_flag("--shard-embedding", a.o.shard_embedding,
                "the embedding as a segment spanning every pipeline stage, vocabulary "
                "split over pp (--schedule tessel; builder only)");
  cmd->add_option("--micro-batch", a.o.micro_batch, "sequences per micro-batch");
  cmd->add_option("--recycle", a.o.recycle,
                  "forward passes per micro-batch before its backward (AlphaFold's "
                  "recycling; gpipe, 1f1b or tessel; builder only)");
  cmd->add_option("--recompute", a.recompute, "none, selective or full");
  cmd->add_option("--zero", a.o.zero, "optimizer sharding stage 0-3");
  cmd->add_option("--schedule", a.schedule,
                  "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev (both with --vpp 2) or "
                  "merak");
  cmd->add_option("--precision", a.precision, "fp32, tf32, bf16, fp16 or fp8");
  cmd->add_option("--loss", a.loss,
                  "the training code's cross-entropy, replacing the model's: fused, "
                  "vocab_parallel (Megatron's default), unfused (PyTorch), loss_parallel "
                  "(PyTorch under tensor parallelism), flash_attn (llm-foundry)");
  cmd->add_option("--framework", a.o.framework,
                  "whose kernels and conventions: megatron, fsdp, deepspeed, other");
  cmd->add_flag("--tp-comm-overlap", a.o.tp_comm_overlap,
                "overlap tensor-parallel collectives with GEMMs (Transformer Engine)");
  cmd->add_flag("--moe-grouped-gemm", a.o.moe_grouped_gemm,
                "a mixture of experts' local experts as one grouped-GEMM kernel (Megatron-Core's "
                "--moe-grouped-gemm), not one GEMM after another");
  cmd->add_flag("--moe-deepep", a.o.moe_deepep,
                "a mixture of experts' tokens exchanged through DeepEP's kernels (Megatron-Core's "
                "--moe-enable-deepep): once per token and node across nodes, then over NVLink, "
                "instead of NCCL's all-to-all");
  cmd->add_flag("--ep-overlap", a.o.ep_overlap,
                "Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): a forward and "
                "the backward of another micro-batch run together, each one's expert all-to-alls "
                "beside the other's compute (with pipeline stages it needs --schedule interleaved; "
                "the search tries it for its best plans with --ep > 1)");
  cmd->add_flag("--moe-shared-expert-overlap", a.o.moe_shared_expert_overlap,
                "a mixture's shared expert computes beside the expert all-to-all next to it "
                "(Megatron-Core's --moe-shared-expert-overlap; the search applies it to plans "
                "with --ep > 1)");
  cmd->add_option("--tp-sub-batches", a.o.tp_sub_batches,
                  "Merak's sub-pipelined tensor parallelism: run each micro-batch as this many "
                  "sub-batches, one's collectives beside the next one's compute (the search "
                  "tries it for its best plans)")
      ->check(at_least(1));
  cmd->add_option("--zero3-persistence-threshold", a.o.zero3_persistence_threshold,
                  "DeepSpeed ZeRO-3: tensors of fewer elements stay whole on every GPU "
                  "(stage3_param_persistence_threshold; default 1e5)")
      ->check(at_least(0));
  cmd->add_option("--zero3-prefetch-elements", a.o.zero3_prefetch_elements,
                  "DeepSpeed ZeRO-3: parameter elements gathered ahead of the operator that "
                  "needs them (stage3_prefetch_bucket_size; default 5e7; DeepSpeed's 0, no "
                  "prefetch, is not modelled)")
      ->check(at_least(1));
  cmd->add_option("--optimizer-offload", a.optimizer_offload,
                  "fraction of each GPU's optimizer state kept and updated on the host "
                  "(Megatron-Core's --optimizer-cpu-offload --optimizer-offload-fraction, "
                  "DeepSpeed's offload_optimizer; with --framework fsdp, 1 only: FSDP's "
                  "CPUOffload, which moves the parameter and gradient shards too), or 'auto': "
                  "the search offloads what each plan "
                  "needs to fit; needs the topology's node.host");
  cmd->add_flag("--offload-overlap", a.o.offload_overlap,
                "with --optimizer-offload: copy gradients out, update and copy parameters back "
                "tensor by tensor, concurrently (Megatron-Core's "
                "--overlap-cpu-optimizer-d2h-h2d)");
  cmd->add_flag("--offload-params", a.o.offload_params,
                "with --framework deepspeed --zero 3 --optimizer-offload 1 (or auto): keep the "
                "parameter shards on the host too (DeepSpeed's offload_param to the CPU; FSDP's "
                "CPUOffload does it by itself)");
  cmd->add_option("--activation-offload", a.activation_offload,
                  "copy the activations of the model's first N layers to the host during the "
                  "forward and back during the backward (Megatron-Core's --cpu-offloading "
                  "--cpu-offloading-num-layers N): one pipeline stage, no recomputation; or "
                  "'auto': the search offloads the fewest layers that make each such plan fit; "
                  "needs the topology's node.host");
  cmd->add_option("--offload-modules", a.o.offload_modules,
                  "copy what these modules of every layer save for the backward to the host "
                  "and back (Megatron-Core's --fine-grained-activation-offloading "
                  "--offload-modules): attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, "
                  "expert_fc1, moe_act, or operator patterns; with pipelines and recomputation "
                  "too (the search keeps them in every plan); or 'auto': the search offloads "
                  "the fewest modules that make each plan fit; needs the topology's node.host")
      ->delimiter(',');
  cmd->add_option("--stage-layers", a.o.stage_layers,
                  "layers per segment (pp x vpp numbers), default as even as possible")
      ->delimiter(',');
  cmd->add_option("--placement", a.o.placement,
                  "rank order over the GPUs, outermost first (default pp,dp,cp,tp; with --ep, "
                  "ep just outside cp unless named); an axis may be split: tp:2,pp,dp,cp,tp "
                  "puts TP 8 as 2 x 4")
      ->delimiter(',');
  cmd->add_option("--avoid-gpus", a.o.avoid_gpus,
                  "GPUs (indices) no rank may use; the degrees use what is left")
      ->delimiter(',');
  cmd->add_option("--recompute-layers", a.o.recompute_layers,
                  "per segment, how many of its first layers are fully recomputed")
      ->delimiter(',');
  cmd->add_option("--recompute-modules", a.o.recompute_modules,
                  "operators (name patterns, e.g. attn.core,mlp.act) every layer recomputes on "
                  "top of --recompute, as Megatron-Core's --recompute-modules; the search "
                  "keeps them in every plan")
      ->delimiter(',');
  cmd->add_option("--constraints", a.constraints, "constraints file (YAML) for the search");
  cmd->add_option("--confirm", a.confirm, "best estimates confirmed by simulation (default 5)");
  cmd->add_option("--jobs", a.jobs, "candidates evaluated at once (default: cores)");
  cmd->add_option("--calib", a.calib,
                  "calibration file (HDF5): estimate, schedule and simulate with its cost "
                  "model");
}

CLI::App* add_plan_command(CLI::App& app, PlanArgs& a) {
  CLI::App* cmd = app.add_subcommand("plan", "build a fully pinned Megatron-style plan");
  cmd->add_option("--nodes", a.nodes, "resize the topology to this many nodes")->check(at_least(1));
  cmd->add_option("--global-batch", a.o.global_batch, "sequences per optimizer step")->required();
  add_plan_choices(cmd, a);
  cmd->add_option("-o,--output", a.output, "where to write plan.json")->required();
  cmd->add_flag("--search", a.search,
                "search the choices not given (implied when --tp or --pp is missing)");
  cmd->add_option("--top", a.top, "plans shown in the ranked table (default 10)");
  cmd->add_option("--csv", a.csv, "write the ranked and rejected plans as CSV");
  cmd->add_option("--train-tokens", a.train_tokens,
                  "also print how long the best plan takes to train this many tokens, e.g. 15T "
                  "or 300B (search only; checkpoints, evaluation and restarts not counted)");
  add_failure_options(cmd, a.failures);
  cmd->add_option("--sensitivity", a.sensitivity,
                  "also simulate the best plan with each resource (GPU compute, HBM bandwidth, "
                  "intra-node links, network bandwidth, latency) this many times as fast, one at a "
                  "time, e.g. 2 "
                  "(search only)")
      ->check(at_least(0, true));
  return cmd;
}

Status read_plan_choices(PlanArgs& a, const CLI::App& cmd) {
  // What the user pinned; the search explores the rest.
  auto given = [&](const char* name) { return cmd.count(name) > 0; };
  SearchPins& p = a.pins;
  if (given("--tp")) p.tp = a.o.tp;
  if (given("--pp")) p.pp = a.o.pp;
  if (given("--dp")) p.dp = a.o.dp;
  if (given("--cp")) p.cp = a.o.cp;
  if (given("--ep")) p.ep = a.o.ep;
  if (given("--etp")) p.expert_tp = a.o.expert_tp;
  if (given("--vpp")) p.vpp = a.o.vpp;
  if (given("--micro-batch")) p.micro_batch = a.o.micro_batch;
  if (given("--zero")) p.zero = a.o.zero;
  if (given("--sequence-parallel")) p.sequence_parallel = true;
  if (given("--stage-layers")) p.stage_layers = a.o.stage_layers;
  if (given("--placement")) p.placement = a.o.placement;
  if (given("--recompute")) {
    Expected<RecomputeMode> r = parse_recompute_mode(a.recompute);
    if (!r) return Error("--recompute: " + r.error().message());
    p.recompute = *r;
  }
  if (given("--schedule")) {
    Expected<ScheduleKind> s = parse_schedule_kind(a.schedule);
    if (!s) return Error("--schedule: " + s.error().message());
    p.schedule = *s;
  }
  if (!p.tp || !p.pp) a.search = true;
  if (a.optimizer_offload == "auto") {
    if (!a.search) {
      return Error(
          "--optimizer-offload auto lets the search offload what each plan needs; the builder "
          "takes a fraction (e.g. --optimizer-offload 0.5), or drop --tp/--pp to search");
    }
    a.offload_as_needed = true;
  } else if (!a.optimizer_offload.empty()) {
    std::optional<double> f = parse_fraction(a.optimizer_offload);
    if (!f) {
      return Error(
          fmt::format("--optimizer-offload '{}': expected a fraction from 0 to 1 or 'auto'",
                      a.optimizer_offload));
    }
    a.o.optimizer_offload = *f;
  }
  if (a.search && (given("--shard-head") || given("--shard-embedding"))) {
    return Error(
        "--shard-head and --shard-embedding are for the builder: give --tp and --pp (the "
        "search does not shard the head or the embedding)");
  }
  if (a.search && given("--recycle")) {
    return Error(
        "--recycle is for the builder: give --tp and --pp (the plan search does not place "
        "repeated forwards)");
  }
  if (a.activation_offload == "auto") {
    if (!a.search) {
      return Error(
          "--activation-offload auto lets the search offload what each plan needs; the builder "
          "takes a layer count (e.g. --activation-offload 8), or drop --tp/--pp to search");
    }
  } else if (!a.activation_offload.empty()) {
    const std::string& text = a.activation_offload;
    int n = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    if (ec != std::errc() || end != text.data() + text.size() || n < 0) {
      return Error(
          fmt::format("--activation-offload '{}': expected a number of layers or 'auto'", text));
    }
    if (a.search) {
      return Error(
          "--activation-offload with a layer count is for the builder: give --tp and --pp 1, "
          "or let the search choose with --activation-offload auto");
    }
    a.o.activation_offload = n;
  }
  if (a.o.offload_modules == std::vector<std::string>{"auto"}) {
    if (!a.search) {
      return Error(
          "--offload-modules auto lets the search offload what each plan needs; the builder "
          "takes module names (e.g. --offload-modules core_attn,expert_fc1), or drop --tp/--pp "
          "to search");
    }
    a.o.offload_modules.clear();
    a.module_offload_auto = true;
  }
  if (a.search && given("--recompute-layers")) {
    return Error(
        "--recompute-layers pins the builder's per-stage recomputation; the search chooses "
        "it (give --tp and --pp without --search to build a plan with it)");
  }
  Expected<RecomputeMode> rec = parse_recompute_mode(a.recompute);
  if (!rec) return Error("--recompute: " + rec.error().message());
  a.o.recompute = *rec;
  Expected<ScheduleKind> sched = parse_schedule_kind(a.schedule);
  if (!sched) return Error("--schedule: " + sched.error().message());
  a.o.schedule = *sched;
  if (!a.precision.empty()) {
    static const std::pair<const char*, Precision> kNames[] = {{"fp32", Precision::kFp32},
                                                               {"tf32", Precision::kTf32},
                                                               {"bf16", Precision::kBf16},
                                                               {"fp16", Precision::kFp16},
                                                               {"fp8", Precision::kFp8}};
    bool found = false;
    for (const auto& [name, precision] : kNames) {
      if (a.precision == name) {
        a.o.precision = precision;
        found = true;
      }
    }
    if (!found) return Error("--precision: expected one of fp32, tf32, bf16, fp16, fp8");
  }
  Expected<const Calibration*> calib = optional_calibration(a.calib, a.calibration);
  if (!calib) return calib.error();
  a.o.costs.calibration = *calib;
  return Status::Ok();
}

int run_plan_command(PlanArgs& a, const CLI::App& cmd) {
  if (Status st = read_plan_choices(a, cmd); !st) return fail(st.error().message());
  return run_plan(a);
}

}  // namespace nnsim::tool
