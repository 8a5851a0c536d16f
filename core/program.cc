#include "core/program.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/compiler.h"
#include "core/schedule_check.h"

namespace nnsim {

std::string to_string(const BlockInstance& b) {
  return b.paired ? to_string(b.block) + "+" + to_string(b.partner) : to_string(b.block);
}

bool Program::has_pairs() const {
  return std::any_of(templates.begin(), templates.end(),
                     [](const BlockTemplate& t) { return t.paired; });
}

std::vector<int> Program::group_of(int rank, uint32_t axes_mask) const {
  const Mesh& mesh = plan.mesh;
  std::vector<int> base = mesh.coordinates(rank);
  std::vector<int> varying;
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    if (axes_mask & (1u << a)) varying.push_back(static_cast<int>(a));
  }
  int count = 1;
  for (int a : varying) count *= mesh.axes[a].size;
  std::vector<int> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) {
    std::vector<int> c = base;
    int rest = i;
    for (int k = static_cast<int>(varying.size()) - 1; k >= 0; --k) {
      int a = varying[k];
      c[a] = rest % mesh.axes[a].size;
      rest /= mesh.axes[a].size;
    }
    out.push_back(mesh.rank_of(c));
  }
  return out;
}

std::string Program::axes_name(uint32_t axes_mask) const {
  std::string s;
  for (size_t a = 0; a < plan.mesh.axes.size(); ++a) {
    if (axes_mask & (1u << a)) s += (s.empty() ? "" : "+") + plan.mesh.axes[a].name;
  }
  return s.empty() ? "local" : s;
}

int Program::rank_in_replica(int rank, int replica) const {
  int dp = plan.mesh.axis_index(kDataParallelAxis);
  if (dp < 0) return rank;
  std::vector<int> c = plan.mesh.coordinates(rank);
  c[dp] = replica;
  return plan.mesh.rank_of(c);
}

bool zero3_prefetches_tensors(const Plan& plan) {
  return plan.optimizer.zero == 3 && plan.comm.zero3_per_tensor &&
         plan.comm.zero3_prefetch_elements > 0;
}

size_t zero3_launch_through(const std::vector<double>& elements, size_t end, size_t launched,
                            double prefetch) {
  launched = std::max(launched, end);
  double ahead = 0;
  for (size_t k = end; k < launched; ++k) ahead += elements[k];
  for (; launched < elements.size() && ahead < prefetch; ++launched) ahead += elements[launched];
  return launched;
}

std::vector<bool> recomputed_ops(const Plan& plan, const GraphPart& part, int layer) {
  std::vector<bool> r(part.ops.size(), false);
  for (size_t i = 0; i < r.size(); ++i) {
    for (const auto& rule : plan.recompute) {
      if (!match_pattern(rule.match, part.ops[i].name)) continue;
      if (layer < 0) {
        if (rule.end_layer < 0) r[i] = true;  // embedding / head: only rules without a range
      } else if (layer >= rule.first_layer && (rule.end_layer < 0 || layer < rule.end_layer)) {
        r[i] = true;
      }
    }
  }
  return r;
}

std::vector<Zero3Use> zero3_uses(const Plan& plan, const OpGraph& graph, int segment,
                                 BlockKind kind, bool explicit_recompute) {
  const Segment& s = plan.segments[segment];
  const bool forward = kind == BlockKind::kForward;
  const bool backward = kind == BlockKind::kBackward || kind == BlockKind::kBackwardInput ||
                        kind == BlockKind::kBackwardWeight;
  std::vector<Zero3Use> units;  // one per unit, op 0
  if (s.embedding) units.push_back({0, &graph.embedding, -1, 0, false});
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    units.push_back({static_cast<int>(units.size()), &graph.layer_at(l), l, 0, false});
  }
  if (s.head) units.push_back({static_cast<int>(units.size()), &graph.head, -1, 0, false});
  if (!forward && !backward) return {};  // an R block runs on the backward's gathers
  if (!forward) std::reverse(units.begin(), units.end());
  std::vector<Zero3Use> uses;
  for (const Zero3Use& unit : units) {
    const GraphPart& part = *unit.part;
    auto use = [&](size_t op, bool recompute) {
      Zero3Use u = unit;
      u.op = op;
      u.recompute = recompute;
      uses.push_back(u);
    };
    const std::vector<bool> r = recomputed_ops(plan, part, unit.layer);
    const bool recomputes = backward && kind != BlockKind::kBackwardWeight && !explicit_recompute &&
                            std::find(r.begin(), r.end(), true) != r.end();
    if (forward || recomputes) {
      const std::vector<bool> replayed = forward ? std::vector<bool>(part.ops.size(), true)
                                                 : replayed_ops(part, r, plan.recompute_early_stop);
      for (size_t op = 0; op < part.ops.size(); ++op) {
        if (replayed[op]) use(op, !forward);
      }
    }
    if (backward) {
      for (size_t op = part.ops.size(); op-- > 0;) use(op, false);
    }
  }
  return uses;
}

// The operators a recomputation runs. With early stop, it ends at the last recomputed operator
// that saves a tensor for the backward: that operator runs only when it saves a tensor of its
// own (an input is saved before the operator computes), and the operators after it not at all
// (under PyTorch's checkpoint, a block's last linear and residual add when it has no dropout).
std::vector<bool> replayed_ops(const GraphPart& part, const std::vector<bool>& recomputed,
                               bool early_stop) {
  std::vector<bool> run = recomputed;
  if (!early_stop) return run;
  // One past the last recomputed operator that saves a tensor.
  size_t end = run.size();
  while (end > 0 && !(run[end - 1] && !part.ops[end - 1].saved.empty())) --end;
  for (size_t i = end; i < run.size(); ++i) run[i] = false;
  if (end > 0) {
    const int last = static_cast<int>(end - 1);
    const auto& saved = part.ops[end - 1].saved;
    run[end - 1] = std::any_of(saved.begin(), saved.end(),
                               [&](const TensorSpec& t) { return t.ref.op == last; });
  }
  return run;
}

PieceShape linear_piece_shape(const Op& op, const OpPartition& p, const Mesh& mesh) {
  PieceShape shape;
  shape.m = op.gemm.m / p.factor(DimSet{Dim::kBatch, Dim::kSeq}, mesh);
  // An expert layer: a GEMM per local expert, over the tokens routed to it.
  const bool grouped = op.dims.contains(Dim::kExpert) && op.gemm.n_dim != Dim::kExpert &&
                       op.gemm.k_dim != Dim::kExpert;
  if (grouped) {
    const int split = p.factor(Dim::kExpert, mesh);
    shape.m /= split;
    shape.groups = static_cast<double>(op.granularity[static_cast<int>(Dim::kExpert)]) / split;
  }
  shape.n = op.gemm.n / p.factor(op.gemm.n_dim, mesh);
  shape.k = op.gemm.k / p.factor(op.gemm.k_dim, mesh);
  return shape;
}

ComputeModel default_compute_model(const Plan& plan, const GpuSpec& gpu) {
  // Megatron-Core / NeMo run Transformer Engine's cuDNN fused attention on Hopper; elsewhere
  // FlashAttention-2 (docs/cost-model.md).
  const bool megatron = plan.framework == "megatron";
  const AttentionLibrary attention =
      megatron && !gpu.ampere() ? AttentionLibrary::kFused3 : AttentionLibrary::kFlash2;
  ComputeModel m = ComputeModel::defaults_for(gpu, attention);
  // Megatron fuses its elementwise kernels (bias-GeLU, bias-dropout-add, LayerNorm, the masked
  // softmax): they move the operator graph's minimal traffic.
  if (megatron) m.elementwise_traffic = 1.0;
  return m;
}

Expected<Program> compile_plan(const Plan& plan, const Topology& topology,
                               const CompileOptions& options) {
  using namespace detail;  // the compiler's internals (core/compiler.h)
  Program prog;
  prog.plan = plan;
  prog.topology = topology;
  prog.compute_model = options.use_default_compute_model ? default_compute_model(plan, topology.gpu)
                                                         : options.compute_model;
  prog.comm_model =
      options.use_default_comm_model ? CommModel::defaults_for(topology.gpu) : options.comm_model;
  if (options.calibration) {
    apply_calibration(*options.calibration, topology.gpu, prog.compute_model, prog.comm_model);
  }
  if (plan.moe_deepep) {
    const ModelSpec& m = plan.model;
    prog.expert_routing = {static_cast<double>(m.experts), static_cast<double>(m.experts_per_token),
                           m.expert_capacity_factor, static_cast<double>(m.router_groups),
                           static_cast<double>(m.router_group_topk)};
  }
  prog.algorithm = plan.comm.algorithm == "ring"   ? Algorithm::kRing
                   : plan.comm.algorithm == "tree" ? Algorithm::kTree
                                                   : Algorithm::kAuto;
  Compiler c(prog.plan, prog.topology, prog);
  if (Status s = c.check_basics(); !s) return s.error();
  ModelSpec model = plan.model;
  model.precision = plan.precision;
  prog.graph = lower_model(model, plan.micro_batch);
  if (Status s = check_rules_match(plan, prog.graph); !s) return s.error();
  if (Status s = c.resolve_part(prog.graph.embedding, c.embed); !s) return s.error();
  c.blocks.resize(prog.graph.blocks.size());  // sized once: memos point into it
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    if (Status s = c.resolve_part(prog.graph.blocks[b], c.blocks[b]); !s) return s.error();
  }
  // Blocks hand each other the hidden state, which every shape leaves in one layout.
  if (Status s = c.check_block_outputs(); !s) return s.error();
  if (Status s = c.resolve_part(prog.graph.head, c.head); !s) return s.error();
  if (Status s = c.check_sub_batches(); !s) return s.error();
  c.boundary = prog.graph.blocks.front().ops.back().output;
  c.boundary.ref = TensorRef{-1, 0};
  if (Status s = c.check_segments(); !s) return s.error();
  if (Status s = c.build_lanes(); !s) return s.error();
  if (Status s = c.check_spanning(); !s) return s.error();
  prog.lanes_of_segment = c.lanes_of_segment;
  prog.lane_axes = c.lane_axes;
  prog.replicas = plan.data_parallel();
  prog.micro_batches = plan.num_micro_batches();
  if (Status s = c.set_group_axes(); !s) return s.error();
  if (Status s = c.check_lane_orders(); !s) return s.error();
  for (size_t o = 0; o < prog.lanes.size(); ++o) c.build_lane_steps(static_cast<int>(o));
  if (!plan.activation_offload_modules.empty() && c.offloaded_activations.empty()) {
    return Error(fmt::format(
        "activation_offload_modules [{}]: the operators they match save nothing for the "
        "backward in any layer that offloads (their activations are recomputed, or only the "
        "last layer of one stage has them); choose operators whose activations the forward "
        "keeps, or remove the field",
        fmt::join(plan.activation_offload_modules, ", ")));
  }

  if (plan.comm.moe_shared_expert_overlap && c.shared_expert_overlaps == 0) {
    return Error(
        "communication.moe_shared_expert_overlap: no shared expert sits next to an expert "
        "all-to-all, so nothing can overlap; it needs a mixture of experts with a shared expert "
        "(model.shared_expert_ffn_hidden) whose experts are split over a mesh axis (expert "
        "parallelism); remove the field otherwise");
  }
  bool ordered_pairs = false;
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& b : o.blocks) ordered_pairs = ordered_pairs || b.paired_with_next;
  }
  if (plan.comm.ep_overlap || ordered_pairs) {
    if (Status s = detail::pair_blocks(prog); !s) return s.error();
  }
  c.add_tied_embedding_sync();
  c.add_param_offload_copies();

  for (int l = 0; l < plan.model.layers; ++l) {
    const TensorLayout in = l == 0 ? input_layout_of(c.embed) : input_layout_of(c.layer_at(l - 1));
    const PartInfo& p = c.layer_at(l);
    prog.layer_activation_bytes.push_back(c.kept_bytes(p, in, c.recomputed_ops(p, l), false));
    if (plan.model.windowed()) prog.layer_window_seconds.push_back(c.window_seconds_saved(p, l));
  }

  // Throughput bookkeeping. Every forward pass of repeated forwards is the model's work.
  const OpGraph& g = prog.graph;
  prog.model_flops_per_iteration =
      (g.forward_flops() * plan.recycle + g.backward_flops()) * prog.micro_batches * prog.replicas;
  prog.tokens_per_iteration = static_cast<double>(plan.global_batch) * plan.model.seq_len;
  return prog;
}

}  // namespace nnsim
