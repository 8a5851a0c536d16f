#include "planner/megatron.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/suggest.h"
#include "planner/schedule_gen.h"

namespace nnsim {

Expected<RecomputeMode> parse_recompute_mode(const std::string& name) {
  if (name == "none") return RecomputeMode::kNone;
  if (name == "selective") return RecomputeMode::kSelective;
  if (name == "full") return RecomputeMode::kFull;
  return Error(fmt::format("unknown recompute mode '{}'{}", name,
                           suggest(name, {"none", "selective", "full"})));
}

std::string_view to_string(RecomputeMode m) {
  switch (m) {
    case RecomputeMode::kNone:
      return "none";
    case RecomputeMode::kSelective:
      return "selective";
    case RecomputeMode::kFull:
      return "full";
  }
  return "?";
}

std::vector<int> split_layers(int layers, int segments) {
  const int base = (layers + segments - 1) / segments;
  std::vector<int> out(segments, base);
  int deficit = base * segments - layers;
  // Take from the ends inwards: first, last, second, second to last, ...
  for (int i = 0; deficit > 0; ++i) {
    int idx = i % 2 == 0 ? i / 2 : segments - 1 - i / 2;
    if (idx < 0 || idx >= segments) idx = i % segments;
    if (out[idx] > 0) {
      --out[idx];
      --deficit;
    }
  }
  return out;
}

Expected<std::vector<int>> usable_gpus(const Topology& topo, const std::vector<int>& avoid) {
  std::vector<bool> avoided(topo.num_gpus(), false);
  std::vector<bool> node_hit(topo.nodes, false);
  for (int g : avoid) {
    if (g < 0 || g >= topo.num_gpus()) {
      return Error(fmt::format("GPU {} to avoid does not exist: topology '{}' has GPUs 0-{}", g,
                               topo.name, topo.num_gpus() - 1));
    }
    avoided[g] = true;
    node_hit[topo.node_of(g)] = true;
  }
  std::vector<int> out;
  for (bool partial : {false, true}) {
    for (int g = 0; g < topo.num_gpus(); ++g) {
      if (!avoided[g] && node_hit[topo.node_of(g)] == partial) out.push_back(g);
    }
  }
  return out;
}

Expected<Placement> placement_from_order(const Mesh& mesh, const std::vector<std::string>& order) {
  Placement placement;
  // Entries "axis" or "axis:size" (one part of a split axis, most significant first); an entry
  // without a size takes what the axis's sized entries leave.
  std::map<std::string, int> sized;
  std::map<std::string, int> unsized;
  std::vector<std::string> names;
  for (const auto& a : mesh.axes) names.push_back(a.name);
  for (const auto& entry : order) {
    const size_t colon = entry.find(':');
    const std::string axis = entry.substr(0, colon);
    if (mesh.axis_index(axis) < 0) {
      return Error(fmt::format("placement names axis '{}'{}", axis, suggest(axis, names)));
    }
    int size = 0;
    if (colon != std::string::npos) {
      size = std::atoi(entry.c_str() + colon + 1);
      if (size < 1) {
        return Error(fmt::format("placement entry '{}': the size must be at least 1", entry));
      }
      sized.try_emplace(axis, 1).first->second *= size;
    } else {
      ++unsized[axis];
    }
    placement.factors.push_back({axis, size});
  }
  for (const auto& a : mesh.axes) {
    const int n = a.size;
    const int given = sized.count(a.name) ? sized[a.name] : 1;
    if (unsized[a.name] > 1 || (!sized.count(a.name) && !unsized[a.name]) || n % given != 0 ||
        (!unsized[a.name] && given != n)) {
      return Error(fmt::format(
          "placement must cover each of {} once (an axis may be split as '{}:a', '{}' with a "
          "dividing its size); {} has size {}",
          fmt::join(names, ", "), a.name, a.name, a.name, n));
    }
    for (auto& f : placement.factors) {
      if (f.axis == a.name && f.size == 0) f.size = n / given;
    }
  }
  return placement;
}

Status check_recompute_modules(const ModelSpec& model, const std::vector<std::string>& modules) {
  if (modules.empty()) return Status::Ok();
  const OpGraph graph = lower_model(model, 1);
  std::vector<std::string> names;
  for (const GraphPart& part : graph.blocks) {
    for (const Op& op : part.ops) {
      if (std::find(names.begin(), names.end(), op.name) == names.end()) names.push_back(op.name);
    }
  }
  for (const std::string& m : modules) {
    if (std::none_of(names.begin(), names.end(),
                     [&](const std::string& n) { return match_pattern(m, n); })) {
      return Error(fmt::format("'{}' matches no operator of a layer{} (operators: {})", m,
                               suggest(m, names), fmt::join(names, ", ")));
    }
  }
  return Status::Ok();
}

Expected<std::vector<std::string>> offload_module_patterns(
    const ModelSpec& model, const std::vector<std::string>& modules) {
  // Megatron-Core's modules and the operators that run them (MLA's down projections are its
  // qkv_linear).
  static const std::map<std::string, std::vector<std::string>> kModules = {
      {"attn_norm", {"attn.norm"}},
      {"qkv_linear", {"attn.qkv", "attn.q", "attn.q_down", "attn.kv_down"}},
      {"core_attn", {"attn.core"}},
      {"attn_proj", {"attn.proj"}},
      {"mlp_norm", {"mlp.norm"}},
      {"expert_fc1", {"moe.fc1"}},
      {"moe_act", {"moe.act"}}};
  const OpGraph graph = lower_model(model, 1);
  std::vector<std::string> names;
  for (const GraphPart& part : graph.blocks) {
    for (const Op& op : part.ops) {
      if (std::find(names.begin(), names.end(), op.name) == names.end()) names.push_back(op.name);
    }
  }
  auto matches = [&](const std::string& pattern) {
    return std::any_of(names.begin(), names.end(),
                       [&](const std::string& n) { return match_pattern(pattern, n); });
  };
  std::vector<std::string> patterns;
  for (const std::string& m : modules) {
    auto known = kModules.find(m);
    const size_t before = patterns.size();
    if (known != kModules.end()) {
      for (const std::string& op : known->second) {
        if (matches(op)) patterns.push_back(op);
      }
    } else if (matches(m)) {
      patterns.push_back(m);
    }
    if (patterns.size() == before) {
      std::vector<std::string> choices;
      for (const auto& [name, ops] : kModules) choices.push_back(name);
      return Error(fmt::format(
          "'{}' {} (Megatron-Core's modules: {}; or an operator pattern: {})", m,
          known != kModules.end() ? "is a module this model's layers do not have"
                                  : "is no module and matches no operator of the model's layers",
          fmt::join(choices, ", "), fmt::join(names, ", ")));
    }
  }
  return patterns;
}

std::vector<std::string> offloadable_modules(const ModelSpec& model) {
  std::vector<std::string> out;
  for (const char* m :
       {"core_attn", "expert_fc1", "qkv_linear", "attn_proj", "moe_act", "mlp_norm", "attn_norm"}) {
    if (offload_module_patterns(model, {m})) out.emplace_back(m);
  }
  return out;
}

Mesh megatron_mesh(const MegatronOptions& o, int dp) {
  Mesh mesh;
  if (o.ep > 1) {
    mesh.axes = {{"dp", dp / o.ep}, {"pp", o.pp}, {"ep", o.ep}, {"cp", o.cp}, {"tp", o.tp}};
  } else {
    mesh.axes = {{"dp", dp}, {"pp", o.pp}, {"cp", o.cp}, {"tp", o.tp}};
  }
  return mesh;
}

std::vector<std::string> with_expert_axis(std::vector<std::string> order, int ep) {
  // What the order places of ep: the whole ("ep") or parts ("ep:2").
  int placed = 1;
  for (const std::string& a : order) {
    if (a == "ep") return order;
    if (a.rfind("ep:", 0) == 0) placed *= std::max(1, std::atoi(a.c_str() + 3));
  }
  if (ep > 1 && placed < ep) {
    auto cp = std::find_if(order.begin(), order.end(),
                           [](const std::string& a) { return a.rfind("cp", 0) == 0; });
    order.insert(cp, "ep");
  }
  return order;
}

namespace {

// Multi-token prediction modules (model.mtp_layers) split as the model does: their block's
// operators as the blocks', their lookup as the embedding's, their output projection and loss
// as the head's (glob rules, "*.norm" and the like, cover them already). Their 2h -> h
// projection is column-parallel over tp, its output gathered for the block (Megatron-Core's
// eh_proj).
void add_mtp_rules(const GraphPart& head, int tp, Plan& plan) {
  std::set<std::string> names;
  for (const Op& op : head.ops) names.insert(op.name);
  const size_t rules = plan.partition.size();
  for (size_t i = 0; i < rules; ++i) {
    const std::string& m = plan.partition[i].match;
    const std::string twin = m == "embed.word"  ? "mtp.embed"
                             : m == "head.proj" ? "mtp.head.proj"
                             : m == "loss"      ? "mtp.loss"
                                                : "mtp." + m;
    // A rule must match an operator: the module's block is one shape (with experts in a
    // mixture), and globs need no twin.
    if (m.find('*') != std::string::npos || !names.count(twin)) continue;
    PartitionRule r = plan.partition[i];
    r.match = twin;
    plan.partition.push_back(std::move(r));
  }
  if (tp > 1) plan.partition.push_back({"mtp.proj", {{Dim::kHidden, {"tp"}}}});
}

// The data-parallel degree: given, or what the usable GPUs leave the model-parallel ranks.
Expected<int> data_parallel_degree(const MegatronOptions& o, const Topology& topo, int gpus,
                                   bool avoiding) {
  const int model_parallel = o.tp * o.pp * o.cp;
  int dp = o.dp;
  if (dp <= 0 && avoiding) {
    dp = gpus / model_parallel;  // the GPUs left over stay idle
    if (dp < 1) {
      return Error(fmt::format("tp x pp x cp = {} needs more than the {} GPUs not avoided",
                               model_parallel, gpus));
    }
  }
  if (dp <= 0) {
    if (gpus % model_parallel != 0) {
      return Error(fmt::format(
          "tp x pp x cp = {} x {} x {} = {} does not divide the {} GPUs of topology '{}'; "
          "choose degrees whose product divides {}",
          o.tp, o.pp, o.cp, model_parallel, gpus, topo.name, gpus));
    }
    dp = gpus / model_parallel;
  }
  if (avoiding && dp * model_parallel > gpus) {
    return Error(fmt::format(
        "tp x pp x cp x dp = {} x {} x {} x {} = {} ranks, but only {} GPUs of topology '{}' are "
        "not avoided; lower the degrees",
        o.tp, o.pp, o.cp, dp, dp * model_parallel, gpus, topo.name));
  }
  if (!avoiding && dp * model_parallel != gpus) {
    return Error(fmt::format(
        "tp x pp x cp x dp = {} x {} x {} x {} = {} ranks, but topology '{}' has {} GPUs; "
        "adjust the degrees or resize the topology with --nodes",
        o.tp, o.pp, o.cp, dp, dp * model_parallel, topo.name, gpus));
  }
  return dp;
}

// Experts whole on every tensor-parallel rank, spread over them instead (--etp 1).
bool experts_folded(const ModelSpec& model, const MegatronOptions& o) {
  return model.moe() && o.tp > 1 && o.expert_tp == 1;
}

// The mixture-of-experts options against the model and the data-parallel degree.
Status check_expert_options(const ModelSpec& model, const MegatronOptions& o, int dp) {
  if (o.expert_tp != 0 && o.expert_tp != 1 && o.expert_tp != o.tp) {
    return Error(fmt::format(
        "--etp {}: the experts split over all the tensor-parallel ranks (--etp {}, the default) "
        "or none (--etp 1); other degrees are not supported",
        o.expert_tp, o.tp));
  }
  if (o.moe_deepep && !model.moe()) {
    return Error(
        fmt::format("--moe-deepep exchanges a mixture of experts' tokens, but model '{}' has none "
                    "(model.experts); drop the flag",
                    model.name));
  }
  if (o.ep_overlap && (!model.moe() || o.ep < 2)) {
    return Error(fmt::format(
        "--ep-overlap hides a mixture of experts' expert-parallel all-to-alls, but {}; drop the "
        "flag",
        model.moe() ? "--ep is 1 (no all-to-alls)"
                    : fmt::format("model '{}' has no experts (model.experts)", model.name)));
  }
  if (o.moe_grouped_gemm && !model.moe()) {
    return Error(fmt::format(
        "--moe-grouped-gemm groups a mixture of experts' GEMMs, but model '{}' has none "
        "(model.experts); drop the flag",
        model.name));
  }
  if (o.expert_tp == 1 && o.tp > 1 && !model.moe()) {
    return Error(fmt::format(
        "--etp 1 spreads experts over the tensor-parallel ranks, but model '{}' has none "
        "(model.experts); drop --etp",
        model.name));
  }
  if (experts_folded(model, o) && model.experts % (static_cast<int64_t>(o.ep) * o.tp) != 0) {
    return Error(fmt::format(
        "--etp 1 spreads the experts over ep x tp = {} x {} ranks, which does not divide the "
        "model's {} experts",
        o.ep, o.tp, model.experts));
  }
  if (o.ep > 1) {
    if (!model.moe()) {
      return Error(fmt::format(
          "--ep {} spreads experts over ranks, but model '{}' has none (model.experts); drop "
          "--ep or use a mixture-of-experts model",
          o.ep, model.name));
    }
    if (model.experts % o.ep != 0) {
      return Error(
          fmt::format("--ep {} does not divide the model's {} experts", o.ep, model.experts));
    }
    if (dp % o.ep != 0) {
      return Error(
          fmt::format("--ep {} must divide the data-parallel degree {} (expert-parallel ranks are "
                      "data-parallel ranks that share their experts); choose an ep that divides {}",
                      o.ep, dp, dp));
    }
  }
  return Status::Ok();
}

// The degrees against the model's heads and sequence, and the batch against the degrees.
Status check_shapes(const ModelSpec& model, const MegatronOptions& o, int dp) {
  if (model.heads % o.tp != 0) {
    return Error(
        fmt::format("--tp {} does not divide the model's {} attention heads", o.tp, model.heads));
  }
  if (model.kv_heads % o.tp != 0) {
    return Error(fmt::format("--tp {} does not divide the model's {} key/value heads", o.tp,
                             model.kv_heads));
  }
  if (model.has_layer_kind('M')) {
    // Megatron-Core splits a Mamba-2 mixer's heads by group of heads (B and C are per group).
    if (model.mamba_groups % o.tp != 0) {
      return Error(
          fmt::format("--tp {} does not divide the model's {} Mamba-2 groups "
                      "(mamba_groups); use a divisor of it",
                      o.tp, model.mamba_groups));
    }
    // Context parallelism gives each rank a share of its tensor-parallel rank's heads for the
    // whole sequence around the scan (Megatron-Core's MambaContextParallel); those heads' groups
    // split over cp or, fewer than cp, are repeated.
    const int64_t heads = model.mamba_heads / o.tp, groups = model.mamba_groups / o.tp;
    if (o.cp > 1 && heads % o.cp != 0) {
      return Error(
          fmt::format("--cp {} does not divide a tensor-parallel rank's {} Mamba-2 heads "
                      "(mamba_heads / tp); use a divisor of it",
                      o.cp, heads));
    }
    if (o.cp > 1 && groups % o.cp != 0 && o.cp % groups != 0) {
      return Error(
          fmt::format("--cp {} and a tensor-parallel rank's {} Mamba-2 groups "
                      "(mamba_groups / tp): one must divide the other",
                      o.cp, groups));
    }
  }
  if (model.has_layer_kind('G')) {
    // Megatron-Core splits a Gated DeltaNet mixer's query/key heads (and with each its value
    // heads) over tp, and over cp around the delta rule, which runs on the whole sequence.
    if (model.gdn_key_heads % o.tp != 0) {
      return Error(
          fmt::format("--tp {} does not divide the model's {} Gated DeltaNet key heads "
                      "(gdn_key_heads); use a divisor of it",
                      o.tp, model.gdn_key_heads));
    }
    const int64_t heads = model.gdn_key_heads / o.tp;
    if (o.cp > 1 && heads % o.cp != 0) {
      return Error(
          fmt::format("--cp {} does not divide a tensor-parallel rank's {} Gated DeltaNet key "
                      "heads (gdn_key_heads / tp); use a divisor of it",
                      o.cp, heads));
    }
  }
  if (o.global_batch < 1) {
    return Error("--global-batch is required (sequences per optimizer step, whole job)");
  }
  if (o.global_batch % (dp * o.micro_batch) != 0) {
    return Error(fmt::format(
        "global batch {} is not divisible by dp x micro-batch = {} x {} = {}; choose a global "
        "batch that is a multiple of {}",
        o.global_batch, dp, o.micro_batch, dp * o.micro_batch, dp * o.micro_batch));
  }
  const int64_t seq_split = static_cast<int64_t>(o.cp) * (o.sequence_parallel ? o.tp : 1);
  if (model.seq_len % seq_split != 0) {
    return Error(fmt::format("the sequence length {} is not divisible by the sequence split ({})",
                             model.seq_len, seq_split));
  }
  return Status::Ok();
}

// Schedule, overlap and pipeline-layout options: what each needs and what excludes what.
Status check_schedule_options(const ModelSpec& model, const MegatronOptions& o) {
  if (o.vpp > 1 && required_chunks(o.schedule) == 1) {
    return Error("--vpp > 1 needs --schedule interleaved (or zb-v or dualpipev with --vpp 2)");
  }
  if (required_chunks(o.schedule) == 2 && o.vpp != 2) {
    return Error(
        fmt::format("the {} schedule runs two model chunks per pipeline rank in a V; "
                    "use --vpp 2 (got {})",
                    to_string(o.schedule), o.vpp));
  }
  if (o.schedule == ScheduleKind::kDualPipeV &&
      (o.ep_overlap || o.moe_shared_expert_overlap || o.tp_sub_batches > 1)) {
    return Error(fmt::format(
        "the dualpipev schedule pairs its forwards and backwards itself, each one's expert "
        "all-to-alls beside the other's compute; drop {}",
        o.ep_overlap                  ? "--ep-overlap"
        : o.moe_shared_expert_overlap ? "--moe-shared-expert-overlap (it would hide them too)"
                                      : "--tp-sub-batches (it would hide them too)"));
  }
  if (o.zero < 0 || o.zero > 3) return Error("--zero must be 0, 1, 2 or 3");
  if (o.tp_sub_batches < 1) {
    return Error(fmt::format("--tp-sub-batches must be at least 1 (got {})", o.tp_sub_batches));
  }
  if (o.tp_sub_batches > 1 && o.tp_comm_overlap) {
    return Error(
        "--tp-sub-batches hides the tensor-parallel collectives behind another sub-batch's "
        "compute, --tp-comm-overlap behind their GEMMs; choose one");
  }
  if (o.ep_overlap && o.pp > 1 && o.schedule != ScheduleKind::kInterleaved) {
    return Error(fmt::format(
        "--ep-overlap with {} pipeline stages needs --schedule interleaved (with --vpp 2 or "
        "more): in a {} schedule each stage's pair of a forward and a backward waits for both "
        "its neighbours' pairs, halving the throughput; Megatron-Core's combined 1F1B likewise "
        "requires virtual stages",
        o.pp, to_string(o.schedule)));
  }
  if (o.moe_shared_expert_overlap && (model.shared_expert_ffn_hidden <= 0 || o.ep < 2)) {
    return Error(fmt::format(
        "--moe-shared-expert-overlap runs a shared expert beside the expert all-to-alls, but {}; "
        "drop the flag",
        model.shared_expert_ffn_hidden <= 0
            ? fmt::format("model '{}' has no shared expert (model.shared_expert_ffn_hidden)",
                          model.name)
            : std::string("--ep is 1 (no all-to-alls)")));
  }
  if (o.moe_shared_expert_overlap && o.ep_overlap) {
    return Error(
        "--moe-shared-expert-overlap and --ep-overlap both hide the all-to-alls, and "
        "Megatron-Core refuses them together; choose one");
  }
  if (o.tp_sub_batches > 1 && o.ep_overlap) {
    return Error(
        "--tp-sub-batches hides the all-to-alls behind another sub-batch's compute, "
        "--ep-overlap behind another micro-batch's; choose one");
  }
  if (o.micro_batch % o.tp_sub_batches != 0) {
    return Error(fmt::format(
        "--tp-sub-batches {} must divide the micro-batch ({} sequences): each sub-batch is a "
        "whole number of sequences",
        o.tp_sub_batches, o.micro_batch));
  }
  if (o.shard_head &&
      (o.vpp > 1 || (o.schedule != ScheduleKind::kOneFOneB && o.schedule != ScheduleKind::kGpipe &&
                     o.schedule != ScheduleKind::kTessel))) {
    return Error(fmt::format(
        "--shard-head places the head's blocks in the 1f1b, gpipe and tessel schedules only (one "
        "chunk per stage); got --schedule {}{}",
        to_string(o.schedule), o.vpp > 1 ? fmt::format(" --vpp {}", o.vpp) : ""));
  }
  if ((o.shard_head || o.shard_embedding) && model.head_uses_embedding()) {
    return Error(fmt::format(
        "{}: model '{}' uses its embedding matrix in the head (tied_embeddings: true, or "
        "multi-token prediction's lookup, mtp_layers), which a head or embedding sharded over "
        "the pipeline does not support yet; drop the flag or use a model without them",
        o.shard_head ? "--shard-head" : "--shard-embedding", model.name));
  }
  if (o.shard_embedding && (o.schedule != ScheduleKind::kTessel || o.vpp > 1 || o.pp < 2)) {
    return Error(
        "--shard-embedding needs --schedule tessel, one chunk per stage and at least 2 "
        "pipeline stages: the embedding's blocks join every stage, which only the schedule "
        "search places without stalling the pipeline");
  }
  if (o.recycle < 1) {
    return Error(fmt::format(
        "--recycle must be at least 1 (forward passes per micro-batch), not {}", o.recycle));
  }
  if (o.recycle > 1 && (o.shard_head || o.shard_embedding)) {
    return Error(
        "--recycle with --shard-head or --shard-embedding is not built yet; build the plan "
        "without the sharded segment, or write the orders and run nnsim schedule --search");
  }
  return Status::Ok();
}

// Layers per segment: the given ones, or as even as possible.
Expected<std::vector<int>> segment_layers(const ModelSpec& model, const MegatronOptions& o) {
  const int segments = o.pp * o.vpp;
  if (segments > model.layers) {
    return Error(fmt::format("pp x vpp = {} segments, but the model has only {} layers", segments,
                             model.layers));
  }
  // The pattern's own segments ('|'), unless --stage-layers gives others.
  const std::vector<int>& layout = model.pipeline_layout;
  if (o.stage_layers.empty() && !layout.empty() && static_cast<int>(layout.size()) != segments) {
    return Error(fmt::format(
        "the model's layer_pattern splits its layers into {} pipeline segments ('|': {}); pp x "
        "vpp = {}: use pp x vpp = {}, or give --stage-layers",
        layout.size(), fmt::join(layout, ","), segments, layout.size()));
  }
  std::vector<int> layers = !o.stage_layers.empty() ? o.stage_layers
                            : !layout.empty()       ? layout
                                                    : split_layers(model.layers, segments);
  if (static_cast<int>(layers.size()) != segments) {
    return Error(
        fmt::format("--stage-layers lists {} segments; pp x vpp = {}", layers.size(), segments));
  }
  if (std::accumulate(layers.begin(), layers.end(), 0) != model.layers) {
    return Error(fmt::format("--stage-layers adds up to {} layers; the model has {}",
                             std::accumulate(layers.begin(), layers.end(), 0), model.layers));
  }
  return layers;
}

// The plan's name: its model, degrees, schedule and every option that sets it apart.
std::string plan_name(const ModelSpec& model, const MegatronOptions& o, int dp) {
  std::string name = fmt::format(
      "{} tp{} pp{} dp{}{}{}{}{} {} recompute-{} zero{}", model.name, o.tp, o.pp, dp,
      o.ep > 1 ? fmt::format(" ep{}", o.ep) : "", experts_folded(model, o) ? " etp1" : "",
      o.cp > 1 ? fmt::format(" cp{}", o.cp) : "", o.vpp > 1 ? fmt::format(" vpp{}", o.vpp) : "",
      to_string(o.schedule), to_string(o.recompute), o.zero);
  if (!o.recompute_layers.empty()) {
    name += fmt::format(" recompute-layers {}", fmt::join(o.recompute_layers, ","));
  }
  if (!o.stage_recompute.empty()) {
    std::vector<std::string_view> modes;
    for (RecomputeMode m : o.stage_recompute) modes.push_back(to_string(m));
    name += fmt::format(" stage-recompute {}", fmt::join(modes, ","));
  }
  if (!o.recompute_modules.empty()) {
    name += fmt::format(" recompute-modules {}", fmt::join(o.recompute_modules, ","));
  }
  if (o.optimizer_offload > 0) {
    name +=
        fmt::format(" offload {:g}{}", o.optimizer_offload, o.offload_overlap ? " overlap" : "");
  }
  if (o.activation_offload > 0) name += fmt::format(" act-offload {}", o.activation_offload);
  if (!o.offload_modules.empty()) {
    name += fmt::format(" offload-modules {}", fmt::join(o.offload_modules, ","));
  }
  if (!o.stage_layers.empty()) {
    name += fmt::format(" layers {}", fmt::join(o.stage_layers, ","));
  }
  if (o.shard_head) name += " shard-head";
  if (o.shard_embedding) name += " shard-embedding";
  if (o.recycle > 1) name += fmt::format(" recycle{}", o.recycle);
  if (o.tp_sub_batches > 1) name += fmt::format(" tp-sub-batches{}", o.tp_sub_batches);
  if (o.moe_deepep) name += " deepep";
  if (o.moe_shared_expert_overlap) name += " shared-expert-overlap";
  if (o.ep_overlap) name += " ep-overlap";
  return name;
}

// Consecutive layers per segment, the embedding on the first and the head on the last, or each
// a segment of its own spanning the stages (--shard-embedding, --shard-head).
void add_segments(const ModelSpec& model, const MegatronOptions& o, const std::vector<int>& layers,
                  Plan& plan) {
  const int segments = o.pp * o.vpp;
  int first = 0;
  for (int i = 0; i < segments; ++i) {
    Segment s;
    s.name = o.vpp > 1
                 ? fmt::format("stage{}.chunk{}", rank_of_segment(o.schedule, i, o.pp), i / o.pp)
                 : fmt::format("stage{}", i);
    s.first_layer = first;
    s.end_layer = first + layers[i];
    first = s.end_layer;
    s.embedding = i == 0 && !o.shard_embedding;
    s.head = i == segments - 1 && !o.shard_head;
    s.devices = {{"pp", rank_of_segment(o.schedule, i, o.pp)}};
    plan.segments.push_back(s);
  }
  if (o.shard_head) {
    // No layers, every stage: its devices leave pp unfixed.
    Segment h;
    h.name = "head";
    h.first_layer = h.end_layer = model.layers;
    h.head = true;
    plan.segments.push_back(h);
  }
  if (o.shard_embedding) {
    Segment e;
    e.name = "embedding";
    e.embedding = true;
    plan.segments.push_back(e);
  }
}

// op-trans: Megatron tensor parallelism, sequence, context and expert parallelism.
void add_partition_rules(const ModelSpec& model, const MegatronOptions& o, Plan& plan) {
  const bool folded = experts_folded(model, o);
  auto rule = [&](const std::string& match, Dim d, std::vector<std::string> axes) {
    plan.partition.push_back({match, {{d, std::move(axes)}}});
  };
  if (o.cp > 1) rule("*", Dim::kSeq, {"cp"});
  if (o.ep > 1 || folded) {
    // Each expert-parallel rank runs its own sequences through the dense operators and holds
    // experts/ep of the experts: the routed tokens go to their expert's rank and back by
    // all-to-all (the change of layout between the two splits). Folded, the tensor-parallel
    // ranks hold different experts too.
    if (o.ep > 1) rule("*", Dim::kBatch, {"ep"});
    std::vector<std::string> axes;
    if (o.ep > 1) axes.emplace_back("ep");
    if (folded) axes.emplace_back("tp");
    for (const char* m : {"moe.fc1", "moe.act", "moe.fc2"}) {
      PartitionRule r{m, {{Dim::kExpert, axes}}};
      if (o.ep > 1) r.splits.insert(r.splits.begin(), DimSplit{Dim::kBatch, {}});
      plan.partition.push_back(r);
    }
  }
  if (o.tp > 1) {
    // Heads split over tp; multi-head latent attention's down-projections and latent norms stay
    // whole (Megatron-Core's "duplicated" linears).
    std::vector<std::string> heads;
    if (model.has_layer_kind('T') || model.has_layer_kind('*')) {
      heads = {"attn.qkv", "attn.core", "attn.proj"};
      if (model.qk_norm) heads.emplace_back("attn.qk_norm");
      if (model.attention_output_gate) heads.emplace_back("attn.gate");
      if (model.mla()) {
        heads = {model.q_lora_rank > 0 ? "attn.q_up" : "attn.q", "attn.kv_up", "attn.core",
                 "attn.proj"};
      }
    }
    // A hybrid model's Mamba-2 mixers: the input projection column-parallel, the scan and the
    // gated norm on each rank's heads, the output projection row-parallel.
    if (model.has_layer_kind('M')) {
      for (const char* m : {"ssm.in_proj", "ssm.scan", "ssm.gate_norm", "ssm.out_proj"}) {
        heads.emplace_back(m);
      }
    }
    // Gated DeltaNet mixers likewise.
    if (model.has_layer_kind('G')) {
      for (const char* m : {"gdn.in_proj", "gdn.scan", "gdn.gate_norm", "gdn.out_proj"}) {
        heads.emplace_back(m);
      }
    }
    for (const std::string& m : heads) rule(m, Dim::kHeads, {"tp"});
    // Experts split as the MLP they replace (Megatron's expert tensor parallelism), unless
    // folded (above).
    std::vector<std::string> mlp;
    // Dense MLPs (all of a dense model's blocks, some of a mixed mixture of experts', a hybrid
    // model's '-' layers).
    const bool dense_mlp =
        model.hybrid() ? model.has_layer_kind('-') : !model.moe() || model.mixed_layers();
    if (dense_mlp) mlp = {"mlp.fc1", "mlp.act", "mlp.fc2"};
    if (model.moe() && !folded) {
      for (const char* m : {"moe.fc1", "moe.act", "moe.fc2"}) mlp.emplace_back(m);
    }
    // A shared expert splits as a dense MLP does.
    if (model.shared_expert_ffn_hidden > 0) {
      for (const char* m : {"moe.shared.fc1", "moe.shared.act", "moe.shared.fc2"}) {
        mlp.emplace_back(m);
      }
    }
    for (const std::string& m : mlp) rule(m, Dim::kFfn, {"tp"});
    for (const char* m : {"embed.word", "head.proj", "loss"}) rule(m, Dim::kVocab, {"tp"});
  }
  if (o.shard_head && o.pp > 1) {
    std::vector<std::string> axes = {"pp"};
    if (o.tp > 1) axes.emplace_back("tp");
    for (const char* m : {"head.proj", "loss"}) rule(m, Dim::kVocab, axes);
  }
  if (o.shard_embedding) {
    std::vector<std::string> axes = {"pp"};
    if (o.tp > 1) axes.emplace_back("tp");
    rule("embed.word", Dim::kVocab, axes);
  }
  if (o.tp > 1) {
    if (o.sequence_parallel) {
      std::vector<std::string> axes =
          o.cp > 1 ? std::vector<std::string>{"cp", "tp"} : std::vector<std::string>{"tp"};
      rule("*.norm", Dim::kSeq, axes);
      rule("*.residual", Dim::kSeq, axes);
      if (model.post_norms) rule("*.post_norm", Dim::kSeq, axes);
      // Latent attention projects each GPU's share of the sequence down and normalizes it
      // there; the up-projections gather the latents over tp (Megatron-Core's MLA under
      // sequence parallelism: "duplicated" down-projections, column-parallel up-projections).
      if (model.mla()) {
        if (model.q_lora_rank > 0) {
          rule("attn.q_down", Dim::kSeq, axes);
          rule("attn.q_norm", Dim::kSeq, axes);
        }
        rule("attn.kv_down", Dim::kSeq, axes);
        rule("attn.kv_norm", Dim::kSeq, axes);
      }
      // Tokens are routed where they are, gathered over tp for the experts and their outputs
      // reduce-scattered back before the combine (Megatron's all-to-all token dispatcher).
      if (model.moe()) {
        for (const char* m : {"moe.router", "moe.dispatch", "moe.combine"})
          rule(m, Dim::kSeq, axes);
      }
      // The embedding's elementwise operators, where the model has them (a rule must match).
      if (model.position == PositionKind::kLearned) rule("embed.position", Dim::kSeq, axes);
      if (model.dropout) rule("embed.dropout", Dim::kSeq, axes);
    }
  }
  // Context parallelism over Mamba-2 layers: the scan runs on the whole sequence, its heads
  // split over tp and cp; the all-to-alls around it are the layout changes (Megatron-Core's
  // MambaContextParallel: the input projection's output in, the scan's output back).
  if (o.cp > 1 && model.has_layer_kind('M')) {
    std::vector<std::string> axes = {"cp"};
    if (o.tp > 1) axes.insert(axes.begin(), "tp");
    plan.partition.push_back({"ssm.scan", {{Dim::kSeq, {}}, {Dim::kHeads, axes}}});
  }
  // Gated DeltaNet's delta rule likewise (Megatron-Core's GatedDeltaNet: all-to-alls from
  // sequence to heads after the input projection and back before the output projection).
  if (o.cp > 1 && model.has_layer_kind('G')) {
    std::vector<std::string> axes = {"cp"};
    if (o.tp > 1) axes.insert(axes.begin(), "tp");
    plan.partition.push_back({"gdn.scan", {{Dim::kSeq, {}}, {Dim::kHeads, axes}}});
  }
}

// Recomputation per segment (--recompute-layers), per stage (Merak's, --stage-recompute) or for
// every layer, plus per-module patterns; multi-token prediction modules (the `head`'s operators)
// recompute as the last stage.
Status add_recompute_rules(const ModelSpec& model, const MegatronOptions& o, const GraphPart& head,
                           Plan& plan) {
  const int segments = o.pp * o.vpp;
  if (!o.recompute_layers.empty()) {
    if (static_cast<int>(o.recompute_layers.size()) != segments) {
      return Error(fmt::format("--recompute-layers lists {} segments; pp x vpp = {}",
                               o.recompute_layers.size(), segments));
    }
    for (int i = 0; i < segments; ++i) {
      const Segment& s = plan.segments[i];
      const int k = o.recompute_layers[i];
      if (k < 0 || k > s.end_layer - s.first_layer) {
        return Error(
            fmt::format("--recompute-layers: segment {} ({}) has {} layers; it cannot recompute {}",
                        i, s.name, s.end_layer - s.first_layer, k));
      }
      if (k > 0) plan.recompute.push_back({"*", s.first_layer, s.first_layer + k});
    }
  }
  if (!o.stage_recompute.empty() && static_cast<int>(o.stage_recompute.size()) != o.pp) {
    return Error(fmt::format("per-stage recomputation lists {} stages; pp = {}",
                             o.stage_recompute.size(), o.pp));
  }
  std::vector<RecomputeMode> stage_modes = o.stage_recompute;
  if (o.schedule == ScheduleKind::kMerak) {
    // Merak: the last stage runs each backward right after its forward and keeps its
    // activations; the others recompute, off the critical path.
    if (stage_modes.empty()) stage_modes.assign(o.pp, o.recompute);
    stage_modes.back() = RecomputeMode::kNone;
    if (o.pp < 2 || (std::all_of(stage_modes.begin(), stage_modes.end(),
                                 [](RecomputeMode m) { return m == RecomputeMode::kNone; }) &&
                     o.recompute_layers.empty())) {
      return Error(
          "the merak schedule moves recomputation off the critical path of a pipeline: give "
          "--pp 2 or more and --recompute selective or full");
    }
  }
  // The layers not fully recomputed above follow their stage's mode.
  auto pattern = [](RecomputeMode m) -> const char* {
    return m == RecomputeMode::kSelective ? "attn.core" : m == RecomputeMode::kFull ? "*" : nullptr;
  };
  if (o.recompute_layers.empty() && stage_modes.empty()) {
    if (const char* p = pattern(o.recompute)) plan.recompute.push_back({p, 0, model.layers});
  } else {
    for (int i = 0; i < segments; ++i) {
      const Segment& s = plan.segments[i];
      const RecomputeMode m =
          stage_modes.empty() ? o.recompute : stage_modes[rank_of_segment(o.schedule, i, o.pp)];
      const int first = s.first_layer + (o.recompute_layers.empty() ? 0 : o.recompute_layers[i]);
      const char* p = pattern(m);
      if (p && first < s.end_layer) plan.recompute.push_back({p, first, s.end_layer});
    }
  }
  for (const std::string& m : o.recompute_modules) plan.recompute.push_back({m, 0, model.layers});
  // Multi-token prediction modules (on the last stage) recompute as its blocks do: their rules
  // have no layers, which the head's operators follow.
  if (model.mtp_layers > 0) {
    const RecomputeMode last = stage_modes.empty() ? o.recompute : stage_modes.back();
    std::vector<std::string> patterns;
    if (const char* p = pattern(last)) patterns.emplace_back(p);
    patterns.insert(patterns.end(), o.recompute_modules.begin(), o.recompute_modules.end());
    for (const std::string& p : patterns) {
      // Only what the module's block has (a module of a mixed model has experts, not an MLP).
      const std::string twin = "mtp." + p;
      if (std::any_of(head.ops.begin(), head.ops.end(),
                      [&](const Op& op) { return match_pattern(twin, op.name); })) {
        plan.recompute.push_back({twin, 0, -1});
      }
    }
  }
  return Status::Ok();
}

// The framework's conventions: gradient and optimizer precision, ZeRO-3's gathers, buckets and
// overlaps.
Status set_framework_conventions(const MegatronOptions& o, int dp, Plan& plan) {
  plan.optimizer.zero = o.zero;
  // Megatron accumulates bf16 gradients in fp32; fp16 training keeps fp16 gradients.
  plan.optimizer.grad_bytes = plan.precision == Precision::kFp16 ? 2 : 4;
  if (plan.precision == Precision::kFp32 || plan.precision == Precision::kTf32) {
    plan.optimizer.grad_bytes = 4;
    plan.optimizer.state_bytes = 8;  // fp32 weights are the master copy: two moments only
    // ... and so is ZeRO-3's shard of them: 4 bytes a parameter, not a 16-bit copy's 2.
    plan.optimizer.weight_shard_bytes = 4;
  }
  // Other frameworks' precision conventions.
  if (o.framework == "fsdp") {
    // PyTorch FSDP with mixed precision: the sharded fp32 parameters are the master copy (the
    // optimizer state adds the two moments), gradients are sharded in fp32 and reduced in fp32
    // (MixedPrecision's default reduce_dtype in torchtitan and llm-foundry).
    plan.optimizer.weight_shard_bytes = 4;
    plan.optimizer.state_bytes = 8;
    plan.optimizer.grad_bytes = 4;
    plan.comm.grad_reduce_bytes = 4;
    // Under pipeline parallelism torchtitan does not reshard after forward, and PyTorch's
    // pipeline schedules skip resharding and gradient reduction after all but the last
    // micro-batch's backward: parameters stay gathered for the iteration.
    plan.optimizer.keep_gathered = o.zero == 3 && o.pp > 1;
    // PyTorch's tensor parallelism (DTensor) saves a sequence-parallel linear's gathered input
    // for the backward instead of gathering it again.
    plan.comm.save_gathered_inputs = true;
    // Pipeline schedules are PyTorch's (torchtitan): a receive buffer per micro-batch, and every
    // micro-batch's stage output kept for the step.
    plan.comm.pp_buffers_per_micro_batch = true;
    // Activation checkpointing by torch.utils.checkpoint without reentrant autograd
    // (llm-foundry's activation_checkpointing_reentrant: false, torchtitan), which stops each
    // recomputation once the backward's tensors are back.
    plan.recompute_early_stop = true;
  } else if (o.framework == "deepspeed" || o.framework == "other") {
    // DeepSpeed ZeRO and plain mixed precision: 16-bit weights and gradients, fp32 master copy
    // and moments (the 16 bytes per parameter of the ZeRO paper).
    plan.optimizer.grad_bytes = plan.precision == Precision::kFp32 ? 4 : 2;
    // DeepSpeed's ZeRO-3 fetches and partitions each parameter tensor on its own.
    plan.comm.zero3_per_tensor = o.framework == "deepspeed";
    plan.comm.zero3_regather_for_recompute = o.framework == "deepspeed";
    // DeepSpeed's stage3_param_persistence_threshold default (1e5 elements): biases and norm
    // scales stay whole on every GPU.
    if (o.framework == "deepspeed") {
      plan.comm.zero3_persistence_threshold =
          o.zero3_persistence_threshold >= 0 ? o.zero3_persistence_threshold : 1e5;
      // reduce_bucket_size's default: gradients reduced 5e8 elements at a time.
      plan.comm.zero3_reduce_bucket = 5e8;
      // stage3_prefetch_bucket_size's default: a tensor's gathers launched ahead of its
      // module until 5e7 elements are in flight.
      plan.comm.zero3_prefetch_elements =
          o.zero3_prefetch_elements >= 0 ? o.zero3_prefetch_elements : 5e7;
    }
  } else if (o.framework != "megatron") {
    return Error(fmt::format("unknown framework '{}'{}", o.framework,
                             suggest(o.framework, {"megatron", "fsdp", "deepspeed", "other"})));
  }
  // Megatron-Core's schedule without interleaving waits on each batched p2p exchange before the
  // next block (overlap_p2p_comm is off there: NeMo and Megatron Bridge turn it on only with
  // virtual pipeline stages), and DeepSpeed's pipeline engine sends with a blocking
  // torch.distributed.send. PyTorch's pipelining schedules (fsdp) wait on sends only later.
  plan.comm.pp_blocking_sends = o.pp > 1 && o.schedule == ScheduleKind::kOneFOneB &&
                                (o.framework == "megatron" || o.framework == "deepspeed");
  if (o.zero3_persistence_threshold >= 0 && (o.framework != "deepspeed" || o.zero != 3)) {
    return Error(fmt::format(
        "a ZeRO-3 persistence threshold is DeepSpeed's ZeRO-3 setting; this plan is {} with "
        "ZeRO-{} (use --framework deepspeed --zero 3, or drop the threshold)",
        o.framework, o.zero));
  }
  if (o.zero3_prefetch_elements >= 0 && (o.framework != "deepspeed" || o.zero != 3)) {
    return Error(fmt::format(
        "a ZeRO-3 prefetch bucket is DeepSpeed's ZeRO-3 setting; this plan is {} with ZeRO-{} "
        "(use --framework deepspeed --zero 3, or drop the prefetch bucket)",
        o.framework, o.zero));
  }
  if (o.optimizer_offload > 0) {
    plan.optimizer.offload_fraction = o.optimizer_offload;
    plan.optimizer.offload_overlap = o.offload_overlap;
    // Megatron's HybridDeviceOptimizer updates fp32 copies on the host and copies them back;
    // DeepSpeed's ZeRO-Offload copies back the 16-bit parameters.
    plan.optimizer.offload_param_bytes = o.framework == "megatron" ? 4 : 2;
    // FSDP's CPUOffload and DeepSpeed's offload_param: the shards themselves live on the host
    // (ZeRO-3 only).
    if (o.framework == "fsdp" || o.offload_params) {
      if (o.zero != 3) {
        return Error(fmt::format(
            "{} offloads ZeRO-3's parameter shards ({}); this plan is ZeRO-{}: use --zero 3",
            o.offload_params ? "--offload-params" : "--optimizer-offload with --framework fsdp",
            o.offload_params ? "DeepSpeed's offload_param" : "FSDP's CPUOffload", o.zero));
      }
      plan.optimizer.offload_params = true;
    }
  }
  plan.activation_offload_layers = o.activation_offload;
  if (!o.offload_modules.empty()) {
    Expected<std::vector<std::string>> ops = offload_module_patterns(plan.model, o.offload_modules);
    if (!ops) return Error("--offload-modules: " + ops.error().message());
    plan.activation_offload_modules = std::move(*ops);
  }
  // Megatron-Core's bucket: max(40M, 1M x dp) parameters.
  plan.comm.dp_bucket_bytes = std::max(40e6, 1e6 * dp) * plan.optimizer.grad_bytes;
  plan.comm.overlap_grad_reduce = o.overlap_grad_reduce;
  plan.comm.overlap_param_gather = o.overlap_param_gather;
  plan.comm.algorithm = o.algorithm;
  plan.comm.tp_overlap = o.tp_comm_overlap && o.tp > 1;
  plan.comm.tp_sub_batches = o.tp_sub_batches;
  plan.moe_grouped_gemm = o.moe_grouped_gemm;
  plan.moe_deepep = o.moe_deepep;
  plan.comm.ep_overlap = o.ep_overlap;
  plan.comm.moe_shared_expert_overlap = o.moe_shared_expert_overlap;
  return Status::Ok();
}

// The pipeline's block orders: a closed form, list-scheduled or searched.
Expected<Plan> add_schedule(Plan plan, const Topology& topo, const MegatronOptions& o, int dp) {
  const int segments = o.pp * o.vpp;
  const int micro_batches = o.global_batch / (dp * o.micro_batch);
  // Segments whose recomputation Merak's schedule issues as its own block.
  std::vector<bool> recompute_segments(segments, false);
  for (const RecomputeRule& r : plan.recompute) {
    for (int i = 0; i < segments; ++i) {
      const Segment& s = plan.segments[i];
      if (r.first_layer < s.end_layer && r.end_layer > s.first_layer) recompute_segments[i] = true;
    }
  }
  if (o.shard_embedding) {
    // A provisional order that any placement can run: one micro-batch at a time through every
    // segment, the joint blocks on every stage; the search replaces it.
    const int embedding = static_cast<int>(plan.segments.size()) - 1;
    std::vector<std::vector<Block>> seq(o.pp);
    auto all = [&](BlockKind k, int m, int seg) {
      for (auto& order : seq) order.push_back({k, m, seg});
    };
    for (int m = 0; m < micro_batches; ++m) {
      all(BlockKind::kForward, m, embedding);
      for (int s = 0; s < segments; ++s) seq[s].push_back({BlockKind::kForward, m, s});
      if (o.shard_head) {
        all(BlockKind::kForward, m, segments);
        all(BlockKind::kBackward, m, segments);
      }
      for (int s = segments - 1; s >= 0; --s) seq[s].push_back({BlockKind::kBackward, m, s});
      all(BlockKind::kBackward, m, embedding);
    }
    for (int stage = 0; stage < o.pp; ++stage)
      plan.schedule.push_back({{{"pp", stage}}, seq[stage]});
    Expected<SearchedSchedule> s =
        search_schedule(plan, topo, topo.gpu.hbm_bytes * (1 - o.memory_headroom), o.costs);
    if (!s) return s.error();
    return s->plan;
  }
  // Combined 1F1B runs one forward more before the first backward (see pipeline_orders).
  Expected<std::vector<std::vector<Block>>> orders =
      pipeline_orders(o.schedule, o.pp, o.vpp, micro_batches, recompute_segments,
                      pipeline_runtime_of(o.framework), o.ep_overlap ? 1 : 0);
  if (!orders) return orders.error();
  if (Status s = add_forward_passes(o.schedule, o.recycle, *orders); !s) return s.error();
  if (o.shard_head) {
    if (Status s = add_spanning_blocks(o.schedule, segments, *orders); !s) return s.error();
  }
  for (int stage = 0; stage < o.pp; ++stage) {
    plan.schedule.push_back({{{"pp", stage}}, (*orders)[stage]});
  }
  if (o.schedule == ScheduleKind::kZbH1 || o.schedule == ScheduleKind::kZbH2 ||
      o.schedule == ScheduleKind::kZbV || o.schedule == ScheduleKind::kMerak) {
    // List-scheduled: re-timed with the plan's own compiled costs.
    return generate_schedule(plan, topo, o.schedule, std::nullopt, o.costs);
  }
  if (o.schedule == ScheduleKind::kTessel) {
    Expected<SearchedSchedule> s = search_schedule(plan, topo, std::nullopt, o.costs);
    if (!s) return s.error();
    return s->plan;
  }
  return plan;
}

}  // namespace

Status check_optimizer_offload(double fraction, bool overlap, const std::string& framework,
                               const Topology& topo, bool params) {
  if (params && framework != "deepspeed") {
    return Error(fmt::format(
        "--offload-params is DeepSpeed's offload_param; --framework {} {}", framework,
        framework == "fsdp" ? "offloads its parameters with --optimizer-offload 1 alone"
                            : "has no parameter offloading: use --framework deepspeed"));
  }
  if (params && (fraction != 1 || overlap)) {
    return Error(fmt::format(
        "--offload-params keeps ZeRO-3's parameter shards on the host with all of the optimizer "
        "state: give --optimizer-offload 1{}",
        overlap ? " without --offload-overlap" : ""));
  }
  if (!(fraction >= 0 && fraction <= 1)) {
    return Error(fmt::format(
        "--optimizer-offload {} is the fraction of the optimizer state kept on the host: from 0 "
        "to 1",
        fraction));
  }
  if (overlap && fraction == 0) {
    return Error(
        "--offload-overlap overlaps optimizer offloading's copies; add --optimizer-offload");
  }
  if (fraction == 0) return Status::Ok();
  if (framework == "fsdp" && (fraction != 1 || overlap)) {
    return Error(fmt::format(
        "--optimizer-offload {}{} with --framework fsdp: PyTorch FSDP's CPUOffload moves all "
        "of a GPU's shard, its parameters, gradients and optimizer state, to the host; use "
        "--optimizer-offload 1{}",
        fraction, overlap ? " --offload-overlap" : "",
        overlap ? " without --offload-overlap" : ""));
  }
  if (!topo.has_host) {
    return Error(fmt::format(
        "--optimizer-offload keeps optimizer state in host memory, but topology '{}' describes "
        "no host: add node.host (memory, memory_bandwidth, link_bandwidth; docs/topology.md)",
        topo.name));
  }
  return Status::Ok();
}

Status check_activation_offload(const ModelSpec& model, const MegatronOptions& o,
                                const Topology& topo) {
  if (!o.offload_modules.empty()) {
    const std::string what = "--offload-modules";
    if (o.activation_offload > 0) {
      return Error(what +
                   " offloads chosen operators of every layer; --activation-offload offloads "
                   "whole layers: Megatron-Core runs one or the other, so drop one");
    }
    if (o.framework != "megatron") {
      return Error(fmt::format(
          "{} is Megatron-Core's (--fine-grained-activation-offloading), not --framework {}'s",
          what, o.framework));
    }
    if (o.recycle > 1) return Error(what + " does not offload repeated forwards; drop --recycle");
    if (!topo.has_host) {
      return Error(fmt::format(
          "{} keeps activations in host memory, but topology '{}' describes no host: add "
          "node.host (memory, memory_bandwidth, link_bandwidth; docs/topology.md)",
          what, topo.name));
    }
    // The names are checked where the plan takes their operators (set_framework_conventions).
  }
  const int n = o.activation_offload;
  if (n == 0) return Status::Ok();
  if (n < 0 || n >= model.layers) {
    return Error(fmt::format(
        "--activation-offload {} offloads the activations of the model's first N layers: from 1 "
        "to {} (the last layer's are needed first; Megatron-Core's --cpu-offloading-num-layers)",
        n, model.layers - 1));
  }
  const std::string what = fmt::format("--activation-offload {}", n);
  if (o.pp > 1 || o.vpp > 1) {
    return Error(what +
                 " runs on one pipeline stage (Megatron-Core: \"no support for Pipeline "
                 "parallelism with CPU offloading\"); use --pp 1 without --vpp");
  }
  if (o.recompute != RecomputeMode::kNone || !o.stage_recompute.empty() ||
      !o.recompute_layers.empty() || !o.recompute_modules.empty()) {
    return Error(what +
                 " replaces recomputation (Megatron-Core: \"CPU offloading does not work when "
                 "activation recomputation is enabled\"); drop --recompute and its variants");
  }
  if (o.framework != "megatron") {
    return Error(fmt::format(
        "{} is Megatron-Core's (Transformer Engine's CPU offload), not --framework {}'s", what,
        o.framework));
  }
  if (o.recycle > 1) return Error(what + " does not offload repeated forwards; drop --recycle");
  if (!topo.has_host) {
    return Error(
        fmt::format("{} keeps activations in host memory, but topology '{}' describes no host: add "
                    "node.host (memory, memory_bandwidth, link_bandwidth; docs/topology.md)",
                    what, topo.name));
  }
  return Status::Ok();
}

Expected<Plan> build_megatron_plan(const ModelSpec& model, const Topology& topo,
                                   const MegatronOptions& o) {
  if (Status s = validate_model(model); !s) return s.error();
  if (Status s = check_recompute_modules(model, o.recompute_modules); !s) {
    return Error("--recompute-modules: " + s.error().message());
  }
  Expected<std::vector<int>> usable = usable_gpus(topo, o.avoid_gpus);
  if (!usable) return usable.error();
  const bool avoiding = !o.avoid_gpus.empty();
  const int gpus = static_cast<int>(usable->size());
  for (auto [name, v] : {std::pair{"--tp", o.tp},
                         {"--pp", o.pp},
                         {"--cp", o.cp},
                         {"--ep", o.ep},
                         {"--vpp", o.vpp},
                         {"--micro-batch", o.micro_batch}}) {
    if (v < 1) return Error(fmt::format("{} must be at least 1 (got {})", name, v));
  }
  Expected<int> data_parallel = data_parallel_degree(o, topo, gpus, avoiding);
  if (!data_parallel) return data_parallel.error();
  const int dp = *data_parallel;
  if (Status s = check_expert_options(model, o, dp); !s) return s.error();
  if (Status s = check_shapes(model, o, dp); !s) return s.error();
  if (Status s = check_schedule_options(model, o); !s) return s.error();
  if (Status s = check_optimizer_offload(o.optimizer_offload, o.offload_overlap, o.framework, topo,
                                         o.offload_params);
      !s) {
    return s.error();
  }
  if (Status s = check_activation_offload(model, o, topo); !s) return s.error();
  Expected<std::vector<int>> layers = segment_layers(model, o);
  if (!layers) return layers.error();

  Plan plan;
  plan.model = model;
  // Megatron pads the vocabulary to a multiple of 128 x tp (--make-vocab-size-divisible-by 128)
  // so that every tensor-parallel shard is equal and aligned; other frameworks pad only to what
  // the split needs.
  // A head sharded over the pipeline splits the vocabulary pp ways more.
  const int64_t vocab_split =
      static_cast<int64_t>(o.tp) * (o.shard_head || o.shard_embedding ? o.pp : 1);
  const int64_t pad = o.framework == "megatron" ? 128LL * vocab_split : vocab_split;
  plan.model.vocab = (model.vocab + pad - 1) / pad * pad;
  plan.global_batch = o.global_batch;
  // A replica is ep data-parallel ranks: their micro-batches together are its micro-batch.
  plan.micro_batch = o.micro_batch * o.ep;
  plan.recycle = o.recycle;
  plan.precision = o.precision.value_or(model.precision);
  plan.framework = o.framework;
  plan.topology_gpus = topo.num_gpus();
  plan.topology_name = topo.name;
  plan.schedule_name = std::string(to_string(o.schedule));
  plan.name = plan_name(model, o, dp);
  plan.mesh = megatron_mesh(o, dp);
  // Megatron's rank order tp-cp-ep-dp-pp: tensor parallel fastest, pipeline slowest.
  Expected<Placement> placement =
      placement_from_order(plan.mesh, with_expert_axis(o.placement, o.ep));
  if (!placement) return placement.error();
  plan.placement = *placement;
  if (avoiding) {
    // The factors number the ranks over the usable GPUs, in the order usable_gpus gives.
    const std::vector<int> slot = plan.placement.gpu_of_rank(plan.mesh);
    for (int s : slot) plan.placement.gpus.push_back((*usable)[s]);
    plan.placement.factors.clear();
  }

  add_segments(model, o, *layers, plan);
  add_partition_rules(model, o, plan);
  // The head's operators, multi-token prediction modules included (their rules match them).
  const GraphPart head = model.mtp_layers > 0 ? lower_model(model, 1).head : GraphPart{};
  if (model.mtp_layers > 0) add_mtp_rules(head, o.tp, plan);
  if (Status s = add_recompute_rules(model, o, head, plan); !s) return s.error();
  if (Status s = set_framework_conventions(o, dp, plan); !s) return s.error();
  return add_schedule(std::move(plan), topo, o, dp);
}

}  // namespace nnsim
