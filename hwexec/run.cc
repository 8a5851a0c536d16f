// `nnexec run`'s parts that need no LibTorch: which plans it can run, the per-rank result text
// the launcher collects, and the run file (format "nnexec-run", docs/hwexec.md).
#include "hwexec/run.h"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>

#include "core/hdf5_io.h"
#include "core/opgraph.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_spanning.h"

namespace nnsim::hwexec {

namespace {

// (Latent attention's down-projections and latent norms too: Megatron-Core's MLA runs them on
// the rank's sequence slice; and post_norms' norms, which take the row-parallel sums.)
const std::set<std::string> kSequenceParallelOps = {
    "attn.norm",    "attn.residual",  "mlp.norm",       "mlp.residual",
    "head.norm",    "embed.position", "embed.dropout",  "moe.router",
    "moe.dispatch", "moe.combine",    "attn.q_down",    "attn.q_norm",
    "attn.kv_down", "attn.kv_norm",   "attn.post_norm", "mlp.post_norm"};

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// A refusal naming the plan's field, and what nnexec runs.
Error refuse(const std::string& field, const std::string& why) {
  return Error(fmt::format(
      "{}: {} (nnexec run executes GPT- and Llama-style models: "
      "LayerNorm or RMSNorm (after the attention and the MLP too), multi-head, grouped-query "
      "or latent attention (sliding windows too), GeLU, SwiGLU, GeGLU, "
      "ReLU or squared-ReLU MLP, mixtures of experts (top-k, dropless, a shared expert, "
      "group-limited routing, every expert on every rank, split along its width over the "
      "tensor-parallel ranks (with sequence and context parallelism too), spread over "
      "data-parallel ranks (expert parallelism, with ZeRO 0-3), or both, folded over the "
      "tensor-parallel ranks too), learned, rotary or "
      "ALiBi "
      "positions, dropout with "
      "deterministic masks (recomputed and repeated passes too); Megatron tensor, sequence "
      "and context parallelism (together too), pipelines (interleaved too; the head and the "
      "embedding also sharded over the stages, with context parallelism and repeated "
      "forwards too) with F, B, R and zero-bubble BI/BW blocks, data parallelism with ZeRO "
      "0-3, recompute rules, repeated forwards; tied embeddings (on two pipeline stages, and "
      "in V-shaped placements, too); "
      "ZeRO-3 also as FSDP keeps it gathered under "
      "pipelines and as DeepSpeed gathers per tensor and again for recompute; in fp32, bf16, "
      "fp16 or emulated fp8)",
      field, why));
}

bool is_expert_op(const std::string& name) {
  return name == "moe.fc1" || name == "moe.act" || name == "moe.fc2";
}

// The product of the axes' sizes.
int degree(const Plan& plan, const std::vector<std::string>& axes) {
  int n = 1;
  for (const std::string& a : axes) n *= plan.mesh.axis_size(a);
  return n;
}

// What the model and the optimizer must be, whatever the partition.
Status check_model_runnable(const Plan& plan) {
  const ModelSpec& m = plan.model;
  if (m.mla() && m.qk_norm) {
    return refuse("model.qk_norm",
                  "query and key norms beside multi-head latent attention (whose latents have "
                  "norms of their own) are not supported; drop 'qk_norm'");
  }
  if (m.mtp_layers > 0) {
    return refuse("model.mtp_layers",
                  "multi-token prediction is simulated only (drop 'mtp_layers')");
  }
  // Mixtures of experts run with every expert on every rank, split along their width over the
  // tensor-parallel ranks, spread over ranks that split the batch (expert parallelism, checked
  // below), or both, routed dropless as Megatron-Core's default: each expert takes exactly the
  // tokens routed to it.
  if (m.moe() && m.expert_capacity_factor != 1) {
    return refuse("model.expert_capacity_factor",
                  fmt::format("{} pads the experts' tokens, which nnexec does not: it routes "
                              "dropless, each expert taking the tokens routed to it; set 1",
                              m.expert_capacity_factor));
  }
  // Group-limited routing scores each group by its experts_per_token / router_group_topk best
  // experts (Megatron-Core's, DeepSeek-V3's top-2 of 8 over 4 groups).
  if (m.moe() && m.router_groups > 1 && m.experts_per_token < m.router_group_topk) {
    return refuse("model.router_group_topk",
                  fmt::format("{} groups a token, more than its {} experts: each group is scored "
                              "by its experts_per_token / router_group_topk best experts; use at "
                              "most {}",
                              m.router_group_topk, m.experts_per_token, m.experts_per_token));
  }
  // Paired blocks (`F7@0+B3@7`: DualPipeV, combined 1F1B) run one after the other, the forward
  // first: their inputs are both ready when the pair starts (the schedule check replays a pair
  // as a unit), so the order cannot wait where the pair would not. Their overlap is the
  // simulator's alone.
  if (plan.comm.tp_sub_batches > 1) {
    return refuse("communication.tp_sub_batches",
                  "sub-pipelined tensor parallelism is simulated only; nnexec runs each "
                  "micro-batch whole (remove the field)");
  }
  if (plan.optimizer.offload_fraction > 0) {
    return refuse("optimizer.offload_fraction",
                  "optimizer offloading is simulated only; nnexec keeps the optimizer state on "
                  "the device (remove the field)");
  }
  if (plan.activation_offload_layers > 0) {
    return refuse("activation_offload_layers",
                  "activation offloading is simulated only; nnexec keeps the activations on the "
                  "device (remove the field)");
  }
  if (!plan.activation_offload_modules.empty()) {
    return refuse("activation_offload_modules",
                  "activation offloading is simulated only; nnexec keeps the activations on the "
                  "device (remove the field)");
  }
  if (m.hybrid()) {
    return refuse("model.layer_pattern",
                  "hybrid models (Mamba-2, Gated DeltaNet, attention-only, MLP-only and "
                  "expert-only layers) are simulated only; nnexec runs transformer blocks "
                  "(remove layer_pattern)");
  }
  if (m.attention_output_gate) {
    return refuse("model.attention_output_gate",
                  "gated attention outputs are simulated only; nnexec's attention has no output "
                  "gate (remove the field)");
  }
  if (m.kv_heads < 1 || m.heads % m.kv_heads != 0) {
    return refuse("model.kv_heads", fmt::format("{} key/value heads do not divide {} heads; set "
                                                "kv_heads to a divisor of heads",
                                                m.kv_heads, m.heads));
  }
  if (m.position == PositionKind::kRope && m.head_dim() % 2 != 0) {
    return refuse("model.position",
                  fmt::format("rope needs an even head dimension; hidden {} / heads {} is {}",
                              m.hidden, m.heads, m.head_dim()));
  }
  if (plan.optimizer.zero < 0 || plan.optimizer.zero > 3) {
    return refuse("optimizer.zero",
                  fmt::format("ZeRO stage {} does not exist (0 to 3)", plan.optimizer.zero));
  }
  if (plan.optimizer.kind != "adam") {
    return refuse("optimizer.kind",
                  fmt::format("'{}' is not supported (adam only)", plan.optimizer.kind));
  }
  return {};
}

// Pipeline axes: those the schedule orders fix.
std::set<std::string> pipeline_axes(const Plan& plan) {
  std::set<std::string> pp_axes;
  for (const DeviceOrder& o : plan.schedule) {
    for (const auto& [axis, c] : o.devices) pp_axes.insert(axis);
  }
  return pp_axes;
}

// Expert parallelism as the partition sets it: the routed experts (moe.fc1, moe.act, moe.fc2)
// split over `ep_axes`, which split every other operator's batch (the expert-parallel ranks are
// data-parallel ranks of the rest, as Megatron-Core's), the routed copies exchanged by
// all-to-alls.
struct ExpertSplit {
  std::vector<std::string> ep_axes;
  // The batch's split of every other operator: the expert-parallel axes, or those without the
  // tensor-parallel ones the experts are also folded over (--etp 1).
  std::vector<std::string> batch_axes;
  bool folded = false;  // the experts split over axes the batch is not (--etp 1)
};

// The experts' split, refused where nnexec cannot run it.
Expected<ExpertSplit> expert_split(const Plan& plan, const std::set<std::string>& pp_axes) {
  const ModelSpec& m = plan.model;
  ExpertSplit split;
  std::vector<std::string>& ep_axes = split.ep_axes;
  bool ep_set = false;
  for (const char* op : {"moe.fc1", "moe.act", "moe.fc2"}) {
    const std::vector<std::string> axes = split_axes(plan, op, Dim::kExpert);
    if (ep_set && axes != ep_axes) {
      return refuse("partition", fmt::format("'{}' splits the experts over {} but moe.fc1 over "
                                             "{}; the experts' three operators split alike",
                                             op, join(axes, "+"), join(ep_axes, "+")));
    }
    ep_axes = axes;
    ep_set = true;
  }
  int ep = 1;
  for (const std::string& a : ep_axes) ep *= plan.mesh.axis_size(a);
  split.batch_axes = split_axes(plan, "attn.norm", Dim::kBatch);
  const std::vector<std::string>& batch_axes = split.batch_axes;
  bool& folded = split.folded;
  for (const std::string& a : ep_axes) {
    folded = folded || std::find(batch_axes.begin(), batch_axes.end(), a) == batch_axes.end();
  }
  int batch_ep = 1;
  for (const std::string& a : batch_axes) batch_ep *= plan.mesh.axis_size(a);
  if (!ep_axes.empty()) {
    // Beside the experts' split and the batch's: tensor (and sequence) parallelism over other
    // axes, which the experts may be folded over too; no context parallelism.
    const std::vector<std::string> cp_of_core = split_axes(plan, "attn.core", Dim::kSeq);
    const std::vector<std::string> heads = split_axes(plan, "attn.core", Dim::kHeads);
    for (const PartitionRule& r : plan.partition) {
      for (const DimSplit& s : r.splits) {
        if (s.axes.empty() || s.dim == Dim::kExpert) continue;
        if (s.dim == Dim::kBatch && s.axes == batch_axes) continue;
        bool shares = false;
        for (const std::string& a : s.axes) {
          shares = shares || std::find(batch_axes.begin(), batch_axes.end(), a) != batch_axes.end();
        }
        const bool cp = s.dim == Dim::kSeq && !cp_of_core.empty() &&
                        std::equal(cp_of_core.begin(), cp_of_core.end(), s.axes.begin(),
                                   s.axes.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                        cp_of_core.size(), s.axes.size())));
        if (!shares && !cp) continue;
        return refuse(
            "partition",
            fmt::format("'{}' is split along '{}' over {} beside expert parallelism over {}: "
                        "{} is simulated only (nnexec exchanges the tokens of data-parallel "
                        "ranks, the experts split along their width over tensor-parallel "
                        "ones or folded over them); plan with --cp 1",
                        r.match, to_string(s.dim), join(s.axes, "+"), join(ep_axes, "+"),
                        cp ? "expert parallelism with context parallelism"
                           : "a split over the batch's expert-parallel axes"));
      }
    }
    // Folded over tensor-parallel axes (--etp 1): each rank routes its slice of the sequence
    // (Megatron-Core requires sequence parallelism for a mixture under tensor parallelism).
    for (const std::string& a : ep_axes) {
      if (std::find(batch_axes.begin(), batch_axes.end(), a) != batch_axes.end()) continue;
      if (std::find(heads.begin(), heads.end(), a) == heads.end()) {
        return refuse("partition",
                      fmt::format("the experts are split over '{}', which neither splits the "
                                  "batch nor the attention heads: expert parallelism over the "
                                  "data-parallel ranks, folded over tensor-parallel ones only",
                                  a));
      }
      if (split_axes(plan, "attn.norm", Dim::kSeq).empty()) {
        return refuse("partition",
                      "experts folded over the tensor-parallel ranks (--etp 1) need sequence "
                      "parallelism (each rank routes its slice of the sequence, as "
                      "Megatron-Core requires for a mixture under tensor parallelism); plan "
                      "with --sequence-parallel");
      }
    }
    if (!m.moe()) {
      return refuse("partition", "the experts are split over " + join(ep_axes, "+") +
                                     " but the model has no mixture of experts");
    }
    for (const std::string& a : ep_axes) {
      if (a == kDataParallelAxis || pp_axes.count(a)) {
        return refuse("partition", fmt::format("expert parallelism over '{}', a data- or "
                                               "pipeline-parallel axis, is not supported",
                                               a));
      }
    }
    if (m.experts % ep != 0) {
      return refuse("model.experts",
                    fmt::format("{} experts cannot be split evenly over the {} expert-parallel "
                                "ranks; use an expert-parallel degree dividing {}",
                                m.experts, ep, m.experts));
    }
    if (plan.micro_batch % batch_ep != 0) {
      return refuse("training.micro_batch",
                    fmt::format("{} sequences a micro-batch cannot be split over the {} "
                                "expert-parallel ranks (each takes micro_batch / ep of them)",
                                plan.micro_batch, batch_ep));
    }
    if (plan.moe_deepep) {
      return refuse("moe_deepep",
                    "DeepEP's exchange is simulated only: nnexec exchanges the "
                    "routed copies with all-to-alls; remove the field");
    }
    if (plan.optimizer.zero == 3 && plan.comm.zero3_per_tensor) {
      return refuse("communication.zero3_per_tensor",
                    "DeepSpeed's tensor-by-tensor ZeRO-3 with expert parallelism is not "
                    "supported (its reduce bucket mixes the experts' group with the rest's); "
                    "use whole units (--framework fsdp or megatron)");
    }
  }
  return split;
}

// Each operator's split as the partition's rules give it (every matching rule, in file order).
struct OperatorSplits {
  // Context parallelism: attn.core's sequence split, which every operator must share.
  std::vector<std::string> cp_axes;
  std::set<std::string> cp_split;  // operators split along the sequence over cp_axes
  std::vector<std::string> tp_axes;
  std::map<std::string, std::vector<std::string>> split_of;  // op -> axes of its allowed dim
  std::set<std::string> seq_split;                           // sequence-parallel operators
};

// The operators' splits, refused where a split is not one nnexec runs.
Expected<OperatorSplits> operator_splits(const Plan& plan, const OpGraph& graph,
                                         const std::set<std::string>& pp_axes,
                                         const ExpertSplit& experts) {
  const std::vector<std::string>& ep_axes = experts.ep_axes;
  const std::vector<std::string>& batch_axes = experts.batch_axes;
  // The head's and the embedding's segments may span the pipeline stages (--shard-head,
  // --shard-embedding; run_spanning.h): their vocabulary-parallel operators may then be split
  // along the pipeline axes too.
  bool embedding_spans = false, head_spans = false;
  for (std::size_t si = 0; si < plan.segments.size(); ++si) {
    const bool spans = spans_orders(plan, static_cast<int>(si));
    embedding_spans = embedding_spans || (spans && plan.segments[si].embedding);
    head_spans = head_spans || (spans && plan.segments[si].head);
  }
  OperatorSplits s;
  s.cp_axes = split_axes(plan, "attn.core", Dim::kSeq);
  const std::vector<std::string>& cp_axes = s.cp_axes;
  std::set<std::string>& cp_split = s.cp_split;
  std::vector<std::string>& tp_axes = s.tp_axes;
  bool tp_set = false;
  std::map<std::string, std::vector<std::string>>& split_of = s.split_of;
  std::set<std::string>& seq_split = s.seq_split;
  for (const GraphPart* part : graph.parts()) {
    for (const Op& op : part->ops) {
      std::map<Dim, std::vector<std::string>> splits;
      for (const PartitionRule& r : plan.partition) {
        if (!match_pattern(r.match, op.name)) continue;
        for (const DimSplit& s : r.splits) splits[s.dim] = s.axes;
      }
      Dim allowed = Dim::kBatch;
      bool has_allowed = true;
      if (op.name == "attn.qkv" || op.name == "attn.qk_norm" || op.name == "attn.core" ||
          op.name == "attn.proj" || op.name == "attn.q" || op.name == "attn.q_up" ||
          op.name == "attn.kv_up") {
        allowed = Dim::kHeads;
      } else if (op.name == "mlp.fc1" || op.name == "mlp.act" || op.name == "mlp.fc2" ||
                 op.name == "moe.fc1" || op.name == "moe.act" || op.name == "moe.fc2" ||
                 op.name == "moe.shared.fc1" || op.name == "moe.shared.act" ||
                 op.name == "moe.shared.fc2") {
        // The experts and the shared expert split along their width as the MLP they replace
        // (Megatron-Core's expert tensor parallelism at the tensor-parallel degree).
        allowed = Dim::kFfn;
      } else if (op.name == "embed.word" || op.name == "head.proj" || op.name == "loss") {
        allowed = Dim::kVocab;
      } else {
        has_allowed = false;
      }
      for (auto [dim, axes] : splits) {
        if (axes.empty()) continue;
        // Expert parallelism: the experts' split, and every other operator's batch over the
        // same axes.
        if (!ep_axes.empty() &&
            ((dim == Dim::kExpert && is_expert_op(op.name) && axes == ep_axes) ||
             (dim == Dim::kBatch && !is_expert_op(op.name) && axes == batch_axes))) {
          continue;
        }
        if (dim == Dim::kSeq && !cp_axes.empty() && axes == cp_axes) {
          cp_split.insert(op.name);
          continue;
        }
        if (dim == Dim::kSeq && !cp_axes.empty()) {
          // Megatron's sequence parallelism inside context parallelism: the norms', residuals'
          // and position add's sequence over cp, then over the tensor-parallel axes (each cp
          // rank's tokens cut in tp slices).
          const bool cp_first = axes.size() > cp_axes.size() &&
                                std::equal(cp_axes.begin(), cp_axes.end(), axes.begin());
          if (!cp_first || !kSequenceParallelOps.count(op.name)) {
            return refuse("partition",
                          fmt::format("operator '{}' is split along 'seq' over {} but attn.core "
                                      "over {} (context parallelism splits every operator's "
                                      "sequence over {}; sequence parallelism splits the norms', "
                                      "residuals' and position add's further, over {} then the "
                                      "tensor-parallel axes)",
                                      op.name, join(axes, "+"), join(cp_axes, "+"),
                                      join(cp_axes, "+"), join(cp_axes, "+")));
          }
          cp_split.insert(op.name);
          axes.erase(axes.begin(), axes.begin() + static_cast<std::ptrdiff_t>(cp_axes.size()));
        }
        // Megatron's sequence parallelism: the norms, residuals and position add on sequence
        // shards of the tensor-parallel group.
        const bool sequence_parallel = dim == Dim::kSeq && kSequenceParallelOps.count(op.name);
        if (sequence_parallel) seq_split.insert(op.name);
        if (!sequence_parallel && (!has_allowed || dim != allowed)) {
          // Sequence parallelism splits only the operators above; a sequence split of any
          // other is context parallelism.
          const std::string what = dim == Dim::kSeq ? " (context parallelism)" : "";
          return refuse("partition",
                        fmt::format("operator '{}' is split along '{}' over {}{}, which is not "
                                    "supported yet",
                                    op.name, to_string(dim), join(axes, "+"), what));
        }
        // Along a pipeline axis: only the vocabulary of a segment spanning the stages.
        std::vector<std::string> tensor_axes;
        for (const std::string& a : axes) {
          if (!pp_axes.count(a)) {
            tensor_axes.push_back(a);
            continue;
          }
          const bool spans = op.name == "embed.word"                       ? embedding_spans
                             : op.name == "head.proj" || op.name == "loss" ? head_spans
                                                                           : false;
          if (!spans || dim != Dim::kVocab) {
            return refuse("partition",
                          fmt::format("operator '{}' is split along the pipeline axis '{}', "
                                      "which only the vocabulary of embed.word, head.proj and "
                                      "loss may be, in an embedding's or head's segment "
                                      "spanning the pipeline stages (--shard-embedding, "
                                      "--shard-head: \"devices\": {{}})",
                                      op.name, a));
          }
        }
        if (!sequence_parallel) split_of[op.name] = axes;
        if (tensor_axes.empty()) continue;  // the pipeline axes only
        if (tp_set && tensor_axes != tp_axes) {
          return refuse("partition",
                        fmt::format("operator '{}' is split over {} but others over {}; all "
                                    "tensor-parallel splits must use the same axes",
                                    op.name, join(tensor_axes, "+"), join(tp_axes, "+")));
        }
        tp_axes = tensor_axes;
        tp_set = true;
      }
    }
  }
  return s;
}

// Megatron's tensor parallelism: operators split alike, and degrees that divide the model.
Status check_tensor_parallel(const Plan& plan, const OperatorSplits& s,
                             const ExpertSplit& experts) {
  const ModelSpec& m = plan.model;
  const std::map<std::string, std::vector<std::string>>& split_of = s.split_of;
  const std::vector<std::string>& ep_axes = experts.ep_axes;
  auto same = [&](std::initializer_list<const char*> names) -> Status {
    const auto first =
        split_of.count(*names.begin()) ? split_of.at(*names.begin()) : std::vector<std::string>{};
    for (const char* n : names) {
      const auto a = split_of.count(n) ? split_of.at(n) : std::vector<std::string>{};
      if (a != first) {
        return refuse("partition", fmt::format("operators {} must be split alike (Megatron "
                                               "tensor parallelism); '{}' is not",
                                               join({names.begin(), names.end()}, ", "), n));
      }
    }
    return {};
  };
  if (m.mla()) {
    const char* q = m.q_lora_rank > 0 ? "attn.q_up" : "attn.q";
    if (Status s = same({q, "attn.kv_up", "attn.core", "attn.proj"}); !s) return s;
  } else if (Status s = same({"attn.qkv", "attn.core", "attn.proj"}); !s) {
    return s;
  }
  if (m.qk_norm) {
    if (Status s = same({"attn.qkv", "attn.qk_norm"}); !s) return s;
  }
  if (Status s = same({"mlp.fc1", "mlp.act", "mlp.fc2"}); !s) return s;
  if (m.moe()) {
    if (Status s = same({"moe.fc1", "moe.act", "moe.fc2"}); !s) return s;
    if (m.shared_expert_ffn_hidden > 0) {
      if (Status s = same({"moe.shared.fc1", "moe.shared.act", "moe.shared.fc2"}); !s) return s;
      // Split along their width, the routed experts like the shared one (folded, whole).
      if (split_of.count("moe.fc1")) {
        if (Status s = same({"moe.fc1", "moe.shared.fc1"}); !s) return s;
      }
    }
  }
  if (Status s = same({"head.proj", "loss"}); !s) return s;
  const int tp = degree(plan, s.tp_axes);
  if (m.moe() && split_of.count("moe.fc1")) {
    // The row-parallel experts' biases are added in the combine, to the summed copies: each
    // rank would need every expert's bias, which expert parallelism spreads.
    if (m.bias && !ep_axes.empty()) {
      return refuse("model.bias",
                    "biases in experts split both over expert- and tensor-parallel ranks are not "
                    "supported (each rank adds its copies' experts' biases, and holds only its "
                    "own experts'); use bias: false, --tp 1 or no --ep");
    }
    if (m.expert_ffn_hidden % tp != 0 || m.shared_expert_ffn_hidden % tp != 0) {
      return refuse("partition",
                    fmt::format("tensor-parallel degree {} does not divide the experts' width "
                                "{} and the shared expert's {}",
                                tp, m.expert_ffn_hidden, m.shared_expert_ffn_hidden));
    }
  }
  if (m.heads % tp != 0 || m.ffn_hidden % tp != 0 || m.vocab % tp != 0) {
    return refuse("partition", fmt::format("tensor-parallel degree {} does not divide heads {}, "
                                           "ffn_hidden {} and vocab {}",
                                           tp, m.heads, m.ffn_hidden, m.vocab));
  }
  for (const char* op : {"embed.word", "head.proj"}) {
    int ways = 1;
    for (const std::string& a : split_of.count(op) ? split_of.at(op) : std::vector<std::string>{}) {
      ways *= plan.mesh.axis_size(a);
    }
    if (m.vocab % ways != 0) {
      return refuse("model.vocab", fmt::format("{} is not divisible by the {} shards of {}'s "
                                               "vocabulary; pad it (nnsim plan pads it to 128 "
                                               "tp pp with --shard-head or --shard-embedding)",
                                               m.vocab, ways, op));
    }
  }
  if (split_of.count("attn.qkv") && m.kv_heads % tp != 0) {
    return refuse("model.kv_heads",
                  fmt::format("{} key/value heads cannot be split over a tensor-parallel degree "
                              "of {} (each rank holds whole key/value heads and their query "
                              "groups); use a tensor-parallel degree dividing {}",
                              m.kv_heads, tp, m.kv_heads));
  }
  return {};
}

// Megatron's sequence parallelism: every norm, residual and the position add split along the
// sequence over the tensor-parallel axes, beside tensor-parallel attention and MLP.
Status check_sequence_parallel(const Plan& plan, const OpGraph& graph, const OperatorSplits& s,
                               const ExpertSplit& experts) {
  if (s.seq_split.empty()) return {};
  const ModelSpec& m = plan.model;
  const std::set<std::string>& seq_split = s.seq_split;
  const std::map<std::string, std::vector<std::string>>& split_of = s.split_of;
  const std::vector<std::string>& cp_axes = s.cp_axes;
  const bool folded = experts.folded;
  const int tp = degree(plan, s.tp_axes);
  for (const GraphPart* part : graph.parts()) {
    for (const Op& op : part->ops) {
      if (kSequenceParallelOps.count(op.name) && !seq_split.count(op.name)) {
        return refuse("partition",
                      fmt::format("operator '{}' is not split along 'seq' but {} is "
                                  "(sequence parallelism splits every norm, residual and the "
                                  "position add alike)",
                                  op.name, *seq_split.begin()));
      }
    }
  }
  if (m.moe() && !split_of.count("moe.fc1") && !folded) {
    return refuse("partition",
                  "sequence parallelism needs the experts split along their width over the "
                  "tensor-parallel ranks (each rank routes its slice of the sequence, whose "
                  "copies are gathered for the experts' column-parallel linears)");
  }
  if (!split_of.count("attn.core") ||
      !(split_of.count("mlp.fc1") || split_of.count("moe.fc1") || folded)) {
    return refuse("partition",
                  "sequence parallelism needs tensor-parallel attention and MLP "
                  "(the sequence is gathered for their column-parallel linears)");
  }
  // With context parallelism each cp rank's tokens are cut in tp slices.
  int cp_ways = 1;
  for (const std::string& a : cp_axes) cp_ways *= plan.mesh.axis_size(a);
  if (m.seq_len % (static_cast<int64_t>(cp_ways) * tp) != 0) {
    return refuse(
        "partition",
        fmt::format("seq_len {} is not divisible by the tensor-parallel degree {}{} "
                    "(sequence parallelism)",
                    m.seq_len, tp,
                    cp_ways > 1 ? fmt::format(" x the context-parallel degree {}", cp_ways)
                                : std::string()));
  }
  return {};
}

// Context parallelism: every operator's sequence split over the same axes, of their own, in two
// chunks a rank.
Status check_context_parallel(const Plan& plan, const OpGraph& graph, const OperatorSplits& s,
                              const std::set<std::string>& pp_axes) {
  if (s.cp_axes.empty()) return {};
  const ModelSpec& m = plan.model;
  const std::vector<std::string>& cp_axes = s.cp_axes;
  const std::vector<std::string>& tp_axes = s.tp_axes;
  const std::set<std::string>& cp_split = s.cp_split;
  const std::string cp = join(cp_axes, "+");
  for (const GraphPart* part : graph.parts()) {
    for (const Op& op : part->ops) {
      if (!cp_split.count(op.name)) {
        return refuse("partition",
                      fmt::format("operator '{}' is not split along 'seq' over {} but attn.core "
                                  "is (context parallelism splits every operator's sequence "
                                  "alike)",
                                  op.name, cp));
      }
    }
  }
  for (const std::string& a : cp_axes) {
    if (pp_axes.count(a) || a == kDataParallelAxis ||
        std::find(tp_axes.begin(), tp_axes.end(), a) != tp_axes.end()) {
      return refuse("partition",
                    fmt::format("context parallelism over '{}', which is also a tensor-, "
                                "pipeline- or data-parallel axis, is not supported",
                                a));
    }
  }
  int ways = 1;
  for (const std::string& a : cp_axes) ways *= plan.mesh.axis_size(a);
  if (ways > 1 && m.seq_len % (2 * static_cast<int64_t>(ways)) != 0) {
    return refuse("model.seq_len",
                  fmt::format("{} is not divisible by 2 x the context-parallel degree {} (each "
                              "cp rank holds two chunks of the sequence: Megatron's "
                              "load-balanced layout)",
                              m.seq_len, ways));
  }
  return {};
}

Status check_expert_batch(const Plan& plan, const OpGraph& graph, const ExpertSplit& experts) {
  if (experts.ep_axes.empty()) return {};
  const std::vector<std::string>& ep_axes = experts.ep_axes;
  const std::vector<std::string>& batch_axes = experts.batch_axes;
  const bool folded = experts.folded;
  // Every operator but the experts' splits its batch over the expert-parallel axes.
  for (const GraphPart* part : graph.parts()) {
    for (const Op& op : part->ops) {
      if (is_expert_op(op.name)) continue;
      const std::vector<std::string> batch = split_axes(plan, op.name, Dim::kBatch);
      if (batch != batch_axes || (batch_axes.empty() && !folded)) {
        return refuse("partition",
                      fmt::format("operator '{}' splits its batch over {} but the experts are "
                                  "split over {} (expert parallelism splits the batch of every "
                                  "other operator over the same axes)",
                                  op.name, join(batch, "+"), join(ep_axes, "+")));
      }
    }
  }
  return {};
}

// Every mesh axis of more than one rank splits something.
Status check_mesh_axes(const Plan& plan, const std::set<std::string>& pp_axes,
                       const OperatorSplits& s, const ExpertSplit& experts) {
  const std::vector<std::string>& ep_axes = experts.ep_axes;
  const std::vector<std::string>& tp_axes = s.tp_axes;
  const std::vector<std::string>& cp_axes = s.cp_axes;
  for (const MeshAxis& a : plan.mesh.axes) {
    if (a.size == 1 || a.name == kDataParallelAxis || pp_axes.count(a.name)) continue;
    if (std::find(ep_axes.begin(), ep_axes.end(), a.name) != ep_axes.end()) continue;
    if (std::find(tp_axes.begin(), tp_axes.end(), a.name) != tp_axes.end()) continue;
    if (std::find(cp_axes.begin(), cp_axes.end(), a.name) != cp_axes.end()) continue;
    return refuse("mesh", fmt::format("axis '{}' has size {} but no operator is split along it",
                                      a.name, a.size));
  }

  return {};
}

// F, B, R, BI and BW blocks, each micro-batch's once (a spanning segment's in every order).
Status check_blocks(const Plan& plan) {
  const int mb = plan.num_micro_batches();
  if (mb < 1) return refuse("training", "no micro-batches per replica");
  if (plan.recycle < 1) {
    return refuse("training.recycle",
                  fmt::format("{} forward passes per micro-batch; at least 1", plan.recycle));
  }
  if (any_spanning(plan)) {
    if (const std::optional<Refusal> r = check_spanning_runnable(plan)) {
      return refuse(r->field, r->why);
    }
  }
  enum Kind { kF, kB, kR, kBI, kBW };
  for (std::size_t oi = 0; oi < plan.schedule.size(); ++oi) {
    const DeviceOrder& o = plan.schedule[oi];
    std::set<int> segs;
    std::map<std::tuple<int, int, int>, int> count;  // (segment, Kind, micro-batch)
    const std::string field = fmt::format("schedule.orders[{}].blocks", oi);
    auto seen = [&](int sg, Kind k, int mb_) { return count.count({sg, k, mb_}) > 0; };
    for (const Block& b : o.blocks) {
      if (b.segment < 0 || b.segment >= static_cast<int>(plan.segments.size())) {
        return refuse(field, fmt::format("block '{}' names no segment", to_string(b)));
      }
      segs.insert(b.segment);
      const Kind kind = b.kind == BlockKind::kForward         ? kF
                        : b.kind == BlockKind::kBackward      ? kB
                        : b.kind == BlockKind::kRecompute     ? kR
                        : b.kind == BlockKind::kBackwardInput ? kBI
                                                              : kBW;
      const int sg = b.segment, i = b.micro_batch;
      // Repeated forwards: a micro-batch's passes in order, its backward after the last one
      // (whose activations it reads).
      if (kind == kF && b.pass != (count.count({sg, kF, i}) ? count[{sg, kF, i}] : 0)) {
        return refuse(field, fmt::format("block '{}' is not the next forward pass of its "
                                         "micro-batch (training.recycle = {})",
                                         to_string(b), plan.recycle));
      }
      const bool forwarded = count.count({sg, kF, i}) && count[{sg, kF, i}] == plan.recycle;
      if ((kind == kB || kind == kBI || kind == kR) && !forwarded) {
        return refuse(field, fmt::format("block '{}' comes before the last forward pass of its "
                                         "micro-batch",
                                         to_string(b)));
      }
      // An R block recomputes what its forward dropped, for its backward (B or BI).
      if (kind == kR && (!seen(sg, kF, i) || seen(sg, kB, i) || seen(sg, kBI, i))) {
        return refuse(field, fmt::format("block '{}' is not between the forward and the "
                                         "backward of its micro-batch",
                                         to_string(b)));
      }
      // BW computes the weight gradients of what its BI kept.
      if (kind == kBW && !seen(sg, kBI, i)) {
        return refuse(field, fmt::format("block '{}' comes before the BI block of its "
                                         "micro-batch",
                                         to_string(b)));
      }
      if (++count[{sg, kind, i}] > 1 && kind == kR) {
        return refuse(field, fmt::format("block '{}' appears twice", to_string(b)));
      }
    }
    for (int sg : segs) {  // several: an interleaved pipeline
      for (int i = 0; i < mb; ++i) {
        auto n = [&](Kind k) { return count.count({sg, k, i}) ? count[{sg, k, i}] : 0; };
        const char* what = nullptr;
        int times = 0;
        if (n(kF) != plan.recycle) {
          what = plan.recycle > 1 ? "forward passes" : "forward";
          times = n(kF);
        } else if (!(n(kB) == 1 && n(kBI) == 0 && n(kBW) == 0) &&
                   !(n(kB) == 0 && n(kBI) == 1 && n(kBW) == 1)) {
          what = "backward (one B, or one BI and one BW)";
          times = n(kB) + n(kBI) + n(kBW);
        }
        if (what) {
          return refuse(field, fmt::format("the {} of micro-batch {} through segment {} "
                                           "appears {} times ({} expected)",
                                           what, i, sg, times,
                                           n(kF) != plan.recycle && plan.recycle > 1
                                               ? fmt::format("{}", plan.recycle)
                                               : std::string("once")));
        }
      }
    }
  }
  return {};
}

// A tied head's weight gradients all in the embedding's matrix before ZeRO reduces it.
Status check_tied_head_order(const Plan& plan) {
  if (!plan.model.tied_embeddings) return {};
  const int mb = plan.num_micro_batches();
  int emb = -1, head = -1;
  for (std::size_t i = 0; i < plan.segments.size(); ++i) {
    if (plan.segments[i].embedding) emb = static_cast<int>(i);
    if (plan.segments[i].head) head = static_cast<int>(i);
  }
  // The head in another segment on the embedding's devices (a V-shaped or hand-built
  // placement) projects with the embedding's matrix itself: one parameter whose gradient
  // (both uses') ZeRO reduces with the embedding's unit, last after the embedding's last block
  // computing weight gradients (B or BW; FSDP's kept-gathered ZeRO-3: its last micro-batch's).
  // Every weight gradient of the head must be in the matrix by then.
  if (emb != head && plan.optimizer.zero >= 1 &&
      plan.segments[emb].devices == plan.segments[head].devices) {
    const bool kept = plan.optimizer.zero == 3 && plan.optimizer.keep_gathered;
    for (std::size_t oi = 0; oi < plan.schedule.size(); ++oi) {
      const std::vector<Block>& blocks = plan.schedule[oi].blocks;
      int head_last = -1, reduced = -1;
      for (std::size_t k = 0; k < blocks.size(); ++k) {
        const Block& b = blocks[k];
        if (b.kind != BlockKind::kBackward && b.kind != BlockKind::kBackwardWeight) continue;
        if (b.segment == head) head_last = static_cast<int>(k);
        // The embedding's last reduction: after its last such block, or (kept gathered)
        // after its last micro-batch's.
        if (b.segment == emb && (!kept || b.micro_batch == mb - 1)) {
          reduced = static_cast<int>(k);
        }
      }
      if (head_last >= 0 && reduced >= 0 && head_last > reduced) {
        return refuse(
            fmt::format("schedule.orders[{}].blocks", oi),
            fmt::format("block '{}' computes weight gradients of the head, whose tied "
                        "projection is the embedding's matrix, after block '{}' reduced that "
                        "matrix's gradients (ZeRO {}); order every B or BW block of segment "
                        "{} before that block",
                        to_string(blocks[head_last]), to_string(blocks[reduced]),
                        plan.optimizer.zero, head));
      }
    }
  }
  return {};
}

}  // namespace

// ---------------------------------------------------------------- what nnexec run supports

Status check_checkable(const Plan& plan) {
  const std::string dtype = run_dtype(plan);
  if (plan.model.moe() && dtype != "fp32") {
    return Error(fmt::format(
        "a mixture of experts in {} cannot be checked against the unpartitioned fp32 "
        "reference: {} rounding moves some tokens across the router's top-k boundary, to other "
        "experts, where the reference does not; check the plan in fp32 (nnsim plan --precision "
        "fp32), or run it without --check",
        dtype, dtype));
  }
  return Status::Ok();
}

Status check_runnable(const Plan& plan) {
  if (Status s = check_model_runnable(plan); !s) return s;
  const std::set<std::string> pp_axes = pipeline_axes(plan);
  Expected<ExpertSplit> experts = expert_split(plan, pp_axes);
  if (!experts) return experts.error();
  const OpGraph graph = lower_model(plan.model, 1);
  Expected<OperatorSplits> splits = operator_splits(plan, graph, pp_axes, *experts);
  if (!splits) return splits.error();
  if (Status s = check_tensor_parallel(plan, *splits, *experts); !s) return s;
  if (Status s = check_sequence_parallel(plan, graph, *splits, *experts); !s) return s;
  if (Status s = check_context_parallel(plan, graph, *splits, pp_axes); !s) return s;
  if (Status s = check_expert_batch(plan, graph, *experts); !s) return s;
  if (Status s = check_mesh_axes(plan, pp_axes, *splits, *experts); !s) return s;
  if (Status s = check_blocks(plan); !s) return s;
  return check_tied_head_order(plan);
}

std::string run_dtype(const Plan& plan) {
  // tf32 is an fp32 run whose GEMMs may round (the executor keeps fp32).
  if (plan.precision == Precision::kTf32) return "fp32";
  return std::string(to_string(plan.precision));
}

void set_check_tolerance(const std::string& dtype, RunOptions* options) {
  if (dtype == "bf16") {
    options->rtol = kBf16CheckRtol;
    options->atol = kBf16CheckAtol;
  } else if (dtype == "fp16") {
    options->rtol = kFp16CheckRtol;
    options->atol = kFp16CheckAtol;
  } else if (dtype == "fp8") {
    options->rtol = kFp8CheckRtol;
    options->atol = kFp8CheckAtol;
  } else {
    options->rtol = 1e-4;
    options->atol = 1e-6;
  }
}

// ---------------------------------------------------------------- per-rank result text

std::vector<double> RunResults::iteration_seconds() const {
  std::vector<double> t;
  for (const RankResult& r : ranks) {
    if (t.size() < r.iteration_seconds.size()) t.resize(r.iteration_seconds.size(), 0);
    for (std::size_t i = 0; i < r.iteration_seconds.size(); ++i) {
      t[i] = std::max(t[i], r.iteration_seconds[i]);
    }
  }
  return t;
}

bool RunResults::check_passed() const {
  if (!options.check) return false;
  for (const RankResult& r : ranks) {
    if (!r.checked) return false;
    for (const ParamCheck& c : r.checks) {
      if (!c.ok) return false;
    }
    if (r.has_loss && std::abs(r.check_loss - r.reference_loss) >
                          options.rtol * std::abs(r.reference_loss) + options.atol) {
      return false;
    }
  }
  return true;
}

std::string rank_to_text(const RankResult& r) {
  std::string s = fmt::format("rank {}\nhost {}\ncoordinates", r.rank, r.host);
  for (int c : r.coordinates) s += fmt::format(" {}", c);
  s += "\niterations";
  for (double x : r.iteration_seconds) s += fmt::format(" {:.17g}", x);
  s += "\nlosses";
  for (double x : r.losses) s += fmt::format(" {:.17g}", x);
  s +=
      fmt::format("\ngpu {} {:.17g} {:.17g}", r.gpu, r.peak_allocated_bytes, r.peak_reserved_bytes);
  s += fmt::format("\nparameters {:.17g}\npeak_rss {:.17g}\ncheck {} {} {:.17g} {:.17g}\n",
                   r.parameters, r.peak_rss_bytes, r.checked ? 1 : 0, r.has_loss ? 1 : 0,
                   r.check_loss, r.reference_loss);
  for (const OpTime& o : r.ops) {
    s += fmt::format("op {} {} {:.17g} {:.17g}\n", o.name, o.phase, o.calls, o.seconds);
  }
  for (const CollTime& c : r.collectives) {
    // The label last: it may hold spaces ("param gather", as the compiled program names it).
    s += fmt::format("coll {} {} {:.17g} {:.17g} {:.17g} {}\n", c.kind, c.axes, c.bytes, c.calls,
                     c.seconds, c.label);
  }
  for (const OpMemory& m : r.memory) {
    s += fmt::format("mem {} {} {:.17g} {:.17g}\n", m.name, m.phase, m.live_bytes, m.peak_bytes);
  }
  for (const ParamCheck& c : r.checks) {
    s += fmt::format("param {} {:.17g} {:.17g} {:.17g} {}\n", c.name, c.elements, c.max_abs_error,
                     c.ref_max_abs, c.ok ? 1 : 0);
  }
  return s;
}

Expected<RankResult> rank_from_text(const std::string& text) {
  RankResult r;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::istringstream l(line);
    std::string key;
    l >> key;
    auto numbers = [&l] {
      std::vector<double> v;
      double x;
      while (l >> x) v.push_back(x);
      return v;
    };
    if (key == "rank") {
      l >> r.rank;
    } else if (key == "host") {
      l >> std::ws;
      std::getline(l, r.host);
    } else if (key == "coordinates") {
      for (double x : numbers()) r.coordinates.push_back(static_cast<int>(x));
    } else if (key == "iterations") {
      r.iteration_seconds = numbers();
    } else if (key == "losses") {
      r.losses = numbers();
    } else if (key == "parameters") {
      l >> r.parameters;
    } else if (key == "gpu") {
      l >> r.gpu >> r.peak_allocated_bytes >> r.peak_reserved_bytes;
    } else if (key == "peak_rss") {
      l >> r.peak_rss_bytes;
    } else if (key == "check") {
      int c = 0, h = 0;
      l >> c >> h >> r.check_loss >> r.reference_loss;
      r.checked = c != 0;
      r.has_loss = h != 0;
    } else if (key == "op") {
      OpTime o;
      l >> o.name >> o.phase >> o.calls >> o.seconds;
      r.ops.push_back(o);
    } else if (key == "coll") {
      CollTime c;
      l >> c.kind >> c.axes >> c.bytes >> c.calls >> c.seconds >> std::ws;
      std::getline(l, c.label);
      r.collectives.push_back(c);
    } else if (key == "mem") {
      OpMemory m;
      l >> m.name >> m.phase >> m.live_bytes >> m.peak_bytes;
      r.memory.push_back(m);
    } else if (key == "param") {
      ParamCheck c;
      int ok = 0;
      l >> c.name >> c.elements >> c.max_abs_error >> c.ref_max_abs >> ok;
      c.ok = ok != 0;
      r.checks.push_back(c);
    } else if (!key.empty()) {
      return Error(fmt::format("rank result line {}: unknown key '{}'", n, key));
    }
    if (l.fail() && !l.eof()) return Error(fmt::format("rank result line {}: malformed", n));
  }
  return r;
}

// ---------------------------------------------------------------- the run file

namespace {

using h5::Handle;

// A table of the run file: a group of equally long datasets, string columns then number ones.
class Table {
 public:
  void add(std::vector<std::string> texts, const std::vector<double>& numbers) {
    texts_.resize(std::max(texts_.size(), texts.size()));
    numbers_.resize(std::max(numbers_.size(), numbers.size()));
    for (std::size_t i = 0; i < texts.size(); ++i) texts_[i].push_back(std::move(texts[i]));
    for (std::size_t i = 0; i < numbers.size(); ++i) numbers_[i].push_back(numbers[i]);
  }
  bool write(hid_t parent, const char* group, const std::vector<const char*>& text_names,
             const std::vector<const char*>& number_names) {
    texts_.resize(text_names.size());
    numbers_.resize(number_names.size());
    Handle g(h5::make_group(parent, group), H5Gclose);
    bool ok = g.id >= 0;
    for (std::size_t i = 0; i < text_names.size(); ++i) {
      ok = ok && h5::write_strings(g.id, text_names[i], texts_[i]);
    }
    for (std::size_t i = 0; i < number_names.size(); ++i) {
      ok = ok && h5::write_vector(g.id, number_names[i], numbers_[i]);
    }
    return ok;
  }

 private:
  std::vector<std::vector<std::string>> texts_;
  std::vector<std::vector<double>> numbers_;
};

}  // namespace

Status write_run(const std::string& path, const RunResults& r) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as values, not prints
  Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("{}: cannot create the file", path));
  bool ok = true;
  const hid_t f = file.id;
  ok &= h5::write_attr(f, "format", std::string(kRunFormat));
  ok &= h5::write_attr(f, "version", static_cast<long long>(kRunVersion));
  const bool gpu = r.device == "cuda";
  ok &= h5::write_attr(f, "device", r.device);
  ok &= h5::write_attr(f, "device_name", r.device_name);
  ok &= h5::write_attr(f, "backend", std::string(gpu ? "nccl" : "tcp-sockets"));
  ok &= h5::write_attr(f, "nccl_version", r.nccl_version);
  ok &= h5::write_attr(f, "timing", std::string(gpu ? "cuda-events" : "steady-clock"));
  ok &= h5::write_attr(f, "dtype", r.dtype);
  ok &= h5::write_attr(f, "torch_version", r.torch_version);
  ok &= h5::write_attr(f, "plan_name", r.plan_name);
  ok &= h5::write_strings(f, "plan", {r.plan_json});
  ok &= h5::write_attr(f, "mesh_axes", join(r.mesh_axes, ","));
  ok &= h5::write_attr(f, "ranks", static_cast<long long>(r.world));
  ok &= h5::write_attr(f, "iterations", static_cast<long long>(r.options.iterations));
  ok &= h5::write_attr(f, "warmup", static_cast<long long>(r.options.warmup));
  ok &= h5::write_attr(f, "threads", static_cast<long long>(r.options.threads));
  ok &= h5::write_attr(f, "seed", static_cast<long long>(r.options.seed));
  ok &= h5::write_attr(f, "checked", r.options.check ? 1LL : 0LL);
  ok &= h5::write_attr(f, "check_passed", r.check_passed() ? 1LL : 0LL);
  ok &= h5::write_vector(f, "iteration_seconds", r.iteration_seconds());
  std::vector<double> loss;
  for (const RankResult& k : r.ranks) {
    if (!k.losses.empty()) {
      loss = k.losses;
      break;
    }
  }
  ok &= h5::write_vector(f, "loss", loss);
  Handle ranks(h5::make_group(f, "ranks"), H5Gclose);
  ok &= ranks.id >= 0;
  for (const RankResult& k : r.ranks) {
    Handle g(h5::make_group(ranks.id, std::to_string(k.rank)), H5Gclose);
    if (g.id < 0) return Error(fmt::format("{}: cannot create /ranks/{}", path, k.rank));
    for (std::size_t a = 0; a < k.coordinates.size() && a < r.mesh_axes.size(); ++a) {
      ok &= h5::write_attr(g.id, r.mesh_axes[a].c_str(), static_cast<long long>(k.coordinates[a]));
    }
    if (!k.host.empty()) ok &= h5::write_attr(g.id, "host", k.host);
    ok &= h5::write_attr(g.id, "parameters", k.parameters);
    ok &= h5::write_attr(g.id, "peak_rss_bytes", k.peak_rss_bytes);
    if (k.gpu >= 0) ok &= h5::write_attr(g.id, "gpu", static_cast<long long>(k.gpu));
    if (k.peak_allocated_bytes >= 0) {
      ok &= h5::write_attr(g.id, "peak_allocated_bytes", k.peak_allocated_bytes);
    }
    if (k.peak_reserved_bytes >= 0) {
      ok &= h5::write_attr(g.id, "peak_reserved_bytes", k.peak_reserved_bytes);
    }
    ok &= h5::write_vector(g.id, "iteration_seconds", k.iteration_seconds);
    ok &= h5::write_vector(g.id, "loss", k.losses);
    Table ops, cs, mem;
    for (const OpTime& o : k.ops) {
      ops.add({o.name, o.phase}, {o.calls, o.seconds});
    }
    for (const CollTime& c : k.collectives) {
      cs.add({c.kind, c.axes, c.label}, {c.bytes, c.calls, c.seconds});
    }
    for (const OpMemory& m : k.memory) {
      mem.add({m.name, m.phase}, {m.live_bytes, m.peak_bytes});
    }
    ok &= ops.write(g.id, "ops", {"name", "phase"}, {"calls", "seconds"});
    ok &= cs.write(g.id, "collectives", {"kind", "axes", "label"}, {"bytes", "calls", "seconds"});
    if (!k.memory.empty()) {
      ok &= mem.write(g.id, "memory", {"name", "phase"}, {"live_bytes", "peak_bytes"});
    }
  }
  if (r.options.check) {
    Handle c(h5::make_group(f, "check"), H5Gclose);
    std::vector<double> rank, elements, err, ref, pass;
    std::vector<std::string> name;
    double l = 0, lref = 0;
    for (const RankResult& k : r.ranks) {
      if (k.has_loss) {
        l = k.check_loss;
        lref = k.reference_loss;
      }
      for (const ParamCheck& p : k.checks) {
        rank.push_back(k.rank);
        name.push_back(p.name);
        elements.push_back(p.elements);
        err.push_back(p.max_abs_error);
        ref.push_back(p.ref_max_abs);
        pass.push_back(p.ok ? 1 : 0);
      }
    }
    ok &= h5::write_attr(c.id, "passed", r.check_passed() ? 1LL : 0LL);
    ok &= h5::write_attr(c.id, "loss", l) && h5::write_attr(c.id, "reference_loss", lref);
    ok &= h5::write_attr(c.id, "rtol", r.options.rtol) &&
          h5::write_attr(c.id, "atol", r.options.atol);
    ok &= h5::write_vector(c.id, "rank", rank) && h5::write_strings(c.id, "name", name) &&
          h5::write_vector(c.id, "elements", elements) &&
          h5::write_vector(c.id, "max_abs_error", err) &&
          h5::write_vector(c.id, "ref_max_abs", ref) && h5::write_vector(c.id, "ok", pass);
  }
  if (!ok) return Error(fmt::format("{}: writing the run file failed", path));
  return {};
}

}  // namespace nnsim::hwexec
