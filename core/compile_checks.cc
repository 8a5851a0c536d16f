// The plan against its model and topology: rules that match operators, devices, batch, segments and
// operators split across schedule orders.
#include "core/compiler.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "core/schedule_check.h"

namespace nnsim::detail {

// A partition or recompute rule that matches no operator is a typo (or a rule for another
// model), never a silent no-op.
Status check_rules_match(const Plan& plan, const OpGraph& graph) {
  std::vector<std::string> names;
  for (const GraphPart* part : graph.parts()) {
    for (const Op& op : part->ops) {
      if (std::find(names.begin(), names.end(), op.name) == names.end()) names.push_back(op.name);
    }
  }
  auto unmatched = [&](std::string_view field, size_t index,
                       const std::string& pattern) -> std::optional<Error> {
    for (const std::string& n : names) {
      if (match_pattern(pattern, n)) return std::nullopt;
    }
    return Error(
        fmt::format("{}[{}]: match '{}' matches no operator of the model; its operators are {}",
                    field, index, pattern, fmt::join(names, ", ")));
  };
  for (size_t i = 0; i < plan.partition.size(); ++i) {
    if (auto e = unmatched("partition", i, plan.partition[i].match)) return *e;
  }
  for (size_t i = 0; i < plan.recompute.size(); ++i) {
    if (auto e = unmatched("recompute", i, plan.recompute[i].match)) return *e;
  }
  // Fine-grained offloading chooses operators of the layers only.
  std::vector<std::string> layer_ops;
  for (const GraphPart& part : graph.blocks) {
    for (const Op& op : part.ops) {
      if (std::find(layer_ops.begin(), layer_ops.end(), op.name) == layer_ops.end()) {
        layer_ops.push_back(op.name);
      }
    }
  }
  for (size_t i = 0; i < plan.activation_offload_modules.size(); ++i) {
    const std::string& pattern = plan.activation_offload_modules[i];
    if (std::none_of(layer_ops.begin(), layer_ops.end(),
                     [&](const std::string& n) { return match_pattern(pattern, n); })) {
      return Error(fmt::format(
          "activation_offload_modules[{}]: '{}' matches no operator of the model's layers; "
          "their operators are {}",
          i, pattern, fmt::join(layer_ops, ", ")));
    }
  }
  return Status::Ok();
}

Status Compiler::check_basics() {
  if (Status s = validate_model(plan.model); !s) return s;
  if (mesh.axis_index(kDataParallelAxis) < 0) {
    return Error("the plan's mesh has no 'dp' axis; add [\"dp\", 1] for a single replica");
  }
  if (plan.comm.zero3_prefetch_elements > 0 &&
      (!plan.comm.zero3_per_tensor || !plan.comm.zero3_regather_for_recompute)) {
    return Error(
        "communication.zero3_prefetch_elements needs zero3_per_tensor and "
        "zero3_regather_for_recompute (DeepSpeed's tensor-by-tensor prefetch); set it to 0 "
        "for a whole unit gathered ahead");
  }
  const int ranks = mesh.num_ranks();
  // An explicit list of GPUs may leave some idle (GPUs to avoid); factors cover the cluster.
  const bool subset = !plan.placement.gpus.empty() && ranks <= topo.num_gpus();
  if (ranks != topo.num_gpus() && !subset) {
    return Error(fmt::format(
        "the plan's mesh has {} ranks but topology '{}' has {} GPUs ({} nodes x {}); build the "
        "plan for this topology (nnsim plan --topo ...) or resize the topology with --nodes",
        ranks, topo.name, topo.num_gpus(), topo.nodes, topo.gpus_per_node));
  }
  prog.gpu_of_rank = plan.placement.gpu_of_rank(mesh);
  std::vector<int> owner(topo.num_gpus(), -1);
  for (int r = 0; r < ranks; ++r) {
    int g = prog.gpu_of_rank[r];
    if (g < 0 || g >= topo.num_gpus()) {
      return Error(
          fmt::format("placement puts rank {} on GPU {}, which does not exist "
                      "(GPUs 0-{})",
                      r, g, topo.num_gpus() - 1));
    }
    if (owner[g] >= 0) {
      return Error(
          fmt::format("placement puts ranks {} and {} on the same GPU {}", owner[g], r, g));
    }
    owner[g] = r;
  }
  const int dp = plan.data_parallel();
  if (plan.global_batch % (dp * plan.micro_batch) != 0) {
    return Error(fmt::format(
        "global batch {} is not divisible by data-parallel degree x micro-batch = {} x {} = {}; "
        "change the global batch or the micro-batch",
        plan.global_batch, dp, plan.micro_batch, dp * plan.micro_batch));
  }
  if (plan.recycle < 1) {
    return Error(
        fmt::format("training.recycle is {}; it counts forward passes per micro-batch: at least 1",
                    plan.recycle));
  }
  if (plan.optimizer.offload_fraction > 0 && !topo.has_host) {
    return Error(fmt::format(
        "optimizer.offload_fraction {} keeps optimizer state in host memory, but topology '{}' "
        "describes no host: add node.host (memory, memory_bandwidth, link_bandwidth; "
        "docs/topology.md) or set offload_fraction to 0",
        plan.optimizer.offload_fraction, topo.name));
  }
  return check_activation_offload();
}

namespace {

// What both forms of activation offloading need: a host to keep the activations, and
// Megatron-Core (`flag` runs the form there). Empty when the plan has both.
std::string offload_host_and_framework(const Plan& plan, const Topology& topo,
                                       const std::string& flag) {
  if (!topo.has_host) {
    return fmt::format(
        "offloaded activations live in host memory, but topology '{}' describes no host: add "
        "node.host (memory, memory_bandwidth, link_bandwidth; docs/topology.md)",
        topo.name);
  }
  if (plan.framework != "megatron") {
    return fmt::format(
        "activation offloading is Megatron-Core's ({}), not framework '{}''s; use framework "
        "megatron",
        flag, plan.framework);
  }
  return {};
}

}  // namespace

// Megatron-Core runs Transformer Engine's activation offloading on one pipeline stage without
// recomputation (TransformerConfig refuses the rest), the only form nnsim models.
Status Compiler::check_activation_offload() const {
  if (!plan.activation_offload_modules.empty()) return check_module_offload();
  const int n = plan.activation_offload_layers;
  if (n == 0) return Status::Ok();
  auto refuse = [&](const std::string& why) {
    return Error(fmt::format("activation_offload_layers {}: {}; or set it to 0", n, why));
  };
  if (std::string why = offload_host_and_framework(
          plan, topo, "--cpu-offloading, Transformer Engine's CPU offload");
      !why.empty()) {
    return refuse(why);
  }
  if (plan.segments.size() != 1) {
    return refuse(fmt::format(
        "the plan has {} segments, but Megatron-Core offloads activations on one pipeline stage "
        "only (\"no support for Pipeline parallelism with CPU offloading\"); use one segment "
        "holding every layer",
        plan.segments.size()));
  }
  if (!plan.recompute.empty()) {
    return refuse(
        "Megatron-Core does not offload activations with recomputation (\"CPU offloading does "
        "not work when activation recomputation is enabled\"); remove the recompute rules");
  }
  if (plan.recycle > 1) return refuse("repeated forwards (training.recycle) are not offloaded");
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& b : o.blocks) {
      if (b.kind != BlockKind::kForward && b.kind != BlockKind::kBackward) {
        return refuse(fmt::format(
            "the schedule runs block {}, but offloaded activations come back in a whole "
            "backward (F and B blocks only)",
            to_string(b)));
      }
    }
  }
  return Status::Ok();
}

// Megatron-Core's fine-grained offloading runs with pipelines and beside recomputation; what
// nnsim does not model of it (split or paired backwards, explicit recomputation blocks,
// repeated forwards) is refused.
Status Compiler::check_module_offload() const {
  auto refuse = [&](const std::string& why) {
    return Error(fmt::format("activation_offload_modules: {}; or remove the field", why));
  };
  if (std::string why =
          offload_host_and_framework(plan, topo, "--fine-grained-activation-offloading");
      !why.empty()) {
    return refuse(why);
  }
  if (plan.recycle > 1) return refuse("repeated forwards (training.recycle) are not offloaded");
  if (plan.comm.ep_overlap) {
    return refuse(
        "a forward paired with a backward (communication.ep_overlap) is not modelled with "
        "offloading; set ep_overlap to false");
  }
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& b : o.blocks) {
      if ((b.kind != BlockKind::kForward && b.kind != BlockKind::kBackward) || b.paired_with_next) {
        return refuse(fmt::format(
            "the schedule runs block {}{}, but nnsim brings offloaded activations back in a "
            "whole backward of its own (unpaired F and B blocks only)",
            to_string(b), b.paired_with_next ? " paired with the next" : ""));
      }
    }
  }
  return Status::Ok();
}

Status Compiler::check_segments() {
  const int L = plan.model.layers;
  if (plan.segments.empty()) return Error("the plan has no segments; add at least one");
  std::vector<int> owner(L, -1);
  int embedding = -1, head_seg = -1;
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const Segment& s = plan.segments[i];
    if (s.end_layer > L) {
      return Error(fmt::format("segment '{}' spans layers [{}, {}) but the model has {} layers",
                               s.name, s.first_layer, s.end_layer, L));
    }
    for (int l = s.first_layer; l < s.end_layer; ++l) {
      if (owner[l] >= 0) {
        return Error(
            fmt::format("layer {} is in segments '{}' and '{}'; every layer belongs "
                        "to exactly one segment",
                        l, plan.segments[owner[l]].name, s.name));
      }
      owner[l] = static_cast<int>(i);
    }
    if (s.embedding) {
      if (embedding >= 0) return Error("two segments hold the embedding; keep one");
      embedding = static_cast<int>(i);
    }
    if (s.head) {
      if (head_seg >= 0) return Error("two segments hold the head; keep one");
      head_seg = static_cast<int>(i);
    }
    for (const auto& [axis, c] : s.devices) {
      if (axis == kDataParallelAxis) {
        return Error(
            fmt::format("segment '{}' fixes the 'dp' coordinate; segments describe "
                        "one replica, remove \"dp\" from its devices",
                        s.name));
      }
    }
  }
  for (int l = 0; l < L; ++l) {
    if (owner[l] < 0) {
      return Error(fmt::format("layer {} is in no segment; extend a segment's layers to it", l));
    }
  }
  if (embedding < 0) return Error("no segment holds the embedding; set \"embedding\": true");
  if (head_seg < 0) return Error("no segment holds the head; set \"head\": true");
  // Pipeline order: the embedding's segment, then by first layer, the head's segment last.
  segment_order.resize(plan.segments.size());
  std::iota(segment_order.begin(), segment_order.end(), 0);
  std::stable_sort(segment_order.begin(), segment_order.end(), [&](int a, int b) {
    const Segment& x = plan.segments[a];
    const Segment& y = plan.segments[b];
    auto rank = [&](const Segment& s, int idx) {
      double pos = s.first_layer;
      if (s.end_layer == s.first_layer) pos = idx == embedding ? -1 : L + 1;
      if (idx == embedding) pos = std::min(pos, -0.5);
      if (idx == head_seg && s.end_layer == s.first_layer) pos = L + 1;
      return pos;
    };
    return rank(x, a) < rank(y, b);
  });
  if (segment_order.front() != embedding) {
    return Error("the embedding's segment must come first in layer order");
  }
  if (segment_order.back() != head_seg) {
    return Error("the head's segment must come last in layer order");
  }
  next_segment.assign(plan.segments.size(), -1);
  prev_segment.assign(plan.segments.size(), -1);
  for (size_t i = 0; i + 1 < segment_order.size(); ++i) {
    const Segment& a = plan.segments[segment_order[i]];
    const Segment& b = plan.segments[segment_order[i + 1]];
    if (a.end_layer != b.first_layer && !(a.end_layer == a.first_layer)) {
      return Error(
          fmt::format("segments '{}' (layers [{}, {})) and '{}' (layers [{}, {})) are "
                      "not consecutive",
                      a.name, a.first_layer, a.end_layer, b.name, b.first_layer, b.end_layer));
    }
    next_segment[segment_order[i]] = segment_order[i + 1];
    prev_segment[segment_order[i + 1]] = segment_order[i];
  }
  return Status::Ok();
}

Status Compiler::check_block_outputs() const {
  for (size_t b = 1; b < blocks.size(); ++b) {
    if (input_layout_of(blocks[b]) == input_layout_of(blocks.front())) continue;
    const std::string& last = blocks[b].part->ops.back().name;
    const std::string& first = blocks.front().part->ops.back().name;
    return Error(fmt::format(
        "partition: the layers' outputs '{}' and '{}' are split differently; each layer hands "
        "the next the hidden state, so give both the same partition rule (as 'partition: "
        "[{{match: \"*.residual\", ...}}]' does)",
        last, first));
  }
  return Status::Ok();
}

// Operators may be split along an axis that separates schedule orders (the pipeline axis) only
// in a segment spanning every order its groups along that axis reach: their collectives join
// those lanes.
Status Compiler::check_spanning() {
  const int dp_axis = mesh.axis_index(kDataParallelAxis);
  for (size_t s = 0; s < plan.segments.size(); ++s) {
    const Segment& seg = plan.segments[s];
    for (const PartInfo* p : segment_parts(seg)) {
      for (size_t i = 0; i < p->partitions.size(); ++i) {
        const std::string& op = p->part->ops[i].name;
        for (size_t a = 0; a < mesh.axes.size(); ++a) {
          const int ai = static_cast<int>(a);
          if (ai == dp_axis || (lane_axes & (1u << a)) || mesh.axes[a].size == 1 ||
              !p->partitions[i].splits_on(ai)) {
            continue;
          }
          const std::string& axis = mesh.axes[a].name;
          if (lanes_of_segment[s].size() == 1) {
            return Error(fmt::format(
                "operator '{}' of segment '{}' is split along mesh axis '{}', which separates "
                "schedule orders; only a segment spanning those orders may split along it "
                "(leave '{}' out of the segment's devices, or narrow the partition rule)",
                op, seg.name, axis, axis));
          }
          if (p->sync_axes[i] & (1u << a)) {
            return Error(fmt::format(
                "operator '{}' of segment '{}' is split along '{}' on a dimension its weights "
                "do not span; summing weight gradients across schedule orders is not supported",
                op, seg.name, axis));
          }
          for (int l : lanes_of_segment[s]) {
            for (int r : prog.group_of(prog.lanes[l].ranks.front(), 1u << a)) {
              if (!holds(static_cast<int>(s), lane_of_rank[r])) {
                return Error(fmt::format(
                    "operator '{}' of segment '{}' is split along '{}', whose group reaches "
                    "schedule order {}, which the segment does not span",
                    op, seg.name, axis, lane_of_rank[r]));
              }
            }
          }
        }
      }
    }
  }
  const int emb = segment_order.front();
  const int hd = segment_order.back();
  if (plan.model.head_uses_embedding() &&
      (lanes_of_segment[emb].size() > 1 || lanes_of_segment[hd].size() > 1)) {
    return Error(
        "tied embeddings (or multi-token prediction, whose lookup uses the embedding matrix) "
        "with an embedding or head spanning several schedule orders are not supported yet; give "
        "them one order each");
  }
  return Status::Ok();
}

// Sub-batches (Merak's sub-pipelined tensor parallelism) split the sequences each GPU runs
// through every operator: each operator's share must divide.
Status Compiler::check_sub_batches() const {
  const int k = plan.comm.tp_sub_batches;
  if (k <= 1) return Status::Ok();
  for (const PartInfo* p : parts()) {
    for (size_t i = 0; i < p->part->ops.size(); ++i) {
      const Op& op = p->part->ops[i];
      const int64_t local = op.granularity[static_cast<int>(Dim::kBatch)] /
                            p->partitions[i].factor(Dim::kBatch, plan.mesh);
      if (local % k != 0) {
        return Error(fmt::format(
            "communication.tp_sub_batches: {} sub-batches do not divide the {} sequence{} "
            "operator '{}' runs per micro-batch on a GPU; use a micro-batch whose share per "
            "GPU is a multiple of {}",
            k, local, local == 1 ? "" : "s", op.name, k));
      }
    }
  }
  return Status::Ok();
}

// Every lane's order runs each micro-batch's blocks once, in an order that cannot deadlock.
Status Compiler::check_lane_orders() const {
  std::vector<OrderView> views;
  for (size_t o = 0; o < prog.lanes.size(); ++o) {
    const Lane& lane = prog.lanes[o];
    std::string name;
    for (const auto& [axis, v] : lane.slice)
      name += fmt::format("{}{}={}", name.empty() ? "" : ",", axis, v);
    if (name.empty()) name = "all devices";
    auto [lo, hi] = std::minmax_element(lane.gpus.begin(), lane.gpus.end());
    views.push_back({lane.gpus.size() == 1 ? fmt::format("{} (GPU {})", name, *lo)
                                           : fmt::format("{} (GPUs {}-{})", name, *lo, *hi),
                     plan.schedule[o].blocks});
  }
  return check_schedule(views, static_cast<int>(plan.segments.size()), prog.micro_batches,
                        next_segment, lanes_of_segment, plan.recycle);
}

}  // namespace nnsim::detail
