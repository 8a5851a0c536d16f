// Operators under the plan: each part's partitions, layouts and costs, and its forward and backward
// steps.
#include "core/compiler.h"

#include <algorithm>

namespace nnsim::detail {

Status Compiler::resolve_part(const GraphPart& part, PartInfo& info) {
  info.part = &part;
  Expected<std::vector<OpPartition>> parts = resolve_partitions(part, plan);
  if (!parts) return parts.error();
  info.partitions = *parts;
  const GpuSpec& gpu = topo.gpu;
  for (size_t i = 0; i < part.ops.size(); ++i) {
    const Op& op = part.ops[i];
    const OpPartition& p = info.partitions[i];
    const double f = p.factor(op.dims, mesh);
    info.out_layouts.push_back(output_layout(op, p));
    info.fwd_flops.push_back(op.fwd_flops / f);
    info.bwd_input_flops.push_back(op.bwd_input_flops / f);
    info.bwd_weight_flops.push_back(op.bwd_weight_flops / f);
    double fb = op.fwd_bytes / f;
    double bb = op.bwd_bytes / f;
    PieceShape shape;
    // fp8 training runs the transformer blocks' linear layers in fp8; the output projection
    // (and everything that is not a linear layer) stays in bf16 (Transformer Engine modules
    // replace only the blocks' linears; torchao's float8 skips the output layer too).
    const bool fp8 = plan.precision == Precision::kFp8 && part.ops.size() > 0 &&
                     &part != &prog.graph.embedding && &part != &prog.graph.head;
    const Precision precision =
        plan.precision == Precision::kFp8 && !fp8 ? Precision::kBf16 : plan.precision;
    if (op.kind == OpKind::kLinear) {
      shape = linear_piece_shape(op, p, mesh);
      shape.one_kernel = plan.moe_grouped_gemm;
      if (fp8) {
        // Transformer Engine casts the GEMM inputs to fp8 (read 16-bit, write 8-bit): the
        // activation in the forward, the output gradient twice (and the activation's transpose)
        // in the backward.
        fb += 3 * shape.m * shape.k;
        bb += 3 * (2 * shape.m * shape.n + shape.m * shape.k);
      }
    } else if (op.kind == OpKind::kAttention) {
      shape.seq = op.seq;
      shape.head_dim = op.head_dim;
    }
    const ComputeModel& cm = prog.compute_model;
    info.fwd_seconds.push_back(
        op_seconds(op, Pass::kForward, info.fwd_flops.back(), fb, shape, precision, gpu, cm));
    // Weight-gradient kernels move about half of the backward traffic of a matmul.
    const bool has_weight_grad = op.bwd_weight_flops > 0;
    info.bwd_input_seconds.push_back(
        op_seconds(op, Pass::kBackwardInput, info.bwd_input_flops.back(),
                   has_weight_grad ? bb / 2 : bb, shape, precision, gpu, cm));
    info.bwd_weight_seconds.push_back(
        has_weight_grad ? op_seconds(op, Pass::kBackwardWeight, info.bwd_weight_flops.back(),
                                     bb / 2, shape, precision, gpu, cm)
                        : 0.0);
    if (plan.model.windowed()) {
      // Each kind of layer at its own share of the query-key pairs: a fused kernel computes
      // only those; the unfused chain every score either way (op_seconds).
      std::array<PartInfo::WindowCost, 2>& costs = info.window_costs.emplace_back();
      if (op.kind == OpKind::kAttention && op.attended_fraction > 0) {
        for (int k : {0, 1}) {
          Op layer_op = op;
          layer_op.attended_fraction = k == 0 ? 1.0 : window_attended_fraction(plan.model);
          const double scale = layer_op.attended_fraction / op.attended_fraction;
          PartInfo::WindowCost& c = costs[k];
          c.fwd_flops = info.fwd_flops.back() * scale;
          c.bwd_input_flops = info.bwd_input_flops.back() * scale;
          c.fwd_seconds =
              op_seconds(layer_op, Pass::kForward, c.fwd_flops, fb, shape, precision, gpu, cm);
          c.bwd_input_seconds = op_seconds(layer_op, Pass::kBackwardInput, c.bwd_input_flops, bb,
                                           shape, precision, gpu, cm);
        }
      }
    }
    double params = 0;
    uint32_t sync = 0;
    int group = kDenseGrads;
    for (const auto& w : op.weights) {
      params += w.elements / p.factor(w.dims, mesh);
    }
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      if (!p.splits_on(static_cast<int>(a)) || mesh.axes[a].size == 1) continue;
      Dim d = p.dim_on(static_cast<int>(a));
      bool in_weight = false;
      for (const auto& w : op.weights) in_weight = in_weight || w.dims.contains(d);
      if (!op.weights.empty() && !in_weight) sync |= 1u << a;
      if (in_weight && d == Dim::kExpert) group = kExpertGrads;
    }
    info.grad_group.push_back(group);
    info.local_params.push_back(params);
    for (const auto& w : op.weights) {
      info.weight_tensors.push_back(w.elements / p.factor(w.dims, mesh));
    }
    info.sync_axes.push_back(sync);
    double bias_params = 0;
    info.bias_sync_axes.push_back(late_bias_sync(part, info.partitions, i, mesh, &bias_params));
    info.bias_sync_params.push_back(bias_params);
    info.labels.push_back(label(op.name));
  }
  return Status::Ok();
}

std::vector<bool> Compiler::recomputed_ops(const PartInfo& p, int layer_index) const {
  return nnsim::recomputed_ops(plan, *p.part, layer_index);
}

double Compiler::window_seconds_saved(const PartInfo& p, int layer) const {
  if (p.window_costs.empty() || !plan.model.is_windowed_layer(layer)) return 0;
  const std::vector<bool> recomputed = recomputed_ops(p, layer);
  double saved = 0;
  for (size_t i = 0; i < p.part->ops.size(); ++i) {
    const PartInfo::WindowCost* windowed = window_cost(p, i, layer);
    if (!windowed) continue;
    const PartInfo::WindowCost& full = p.window_costs[i][0];
    const double forward = full.fwd_seconds - windowed->fwd_seconds;
    saved +=
        forward * (recomputed[i] ? 2 : 1) + full.bwd_input_seconds - windowed->bwd_input_seconds;
  }
  return saved;
}

bool Compiler::has_recompute(int segment) const {
  const Segment& s = plan.segments[segment];
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    auto r = recomputed_ops(layer_at(l), l);
    if (std::find(r.begin(), r.end(), true) != r.end()) return true;
  }
  return false;
}

void Compiler::append_tensor_conversions(const TensorSpec& t, const TensorLayout& have,
                                         const TensorLayout& want, int label,
                                         std::vector<Step>& steps) const {
  std::vector<Conversion> cs = conversions(t, have, want, mesh);
  // Routed token copies moving between the ranks that split the experts (expert parallelism):
  // DeepEP's exchange when the plan runs it. With the experts split over two axes (--etp 1
  // under tensor parallelism) the exchanges stay all-to-alls.
  auto expert_axes = [](const TensorLayout& l) {
    std::vector<int> out;
    for (size_t a = 0; a < l.size(); ++a) {
      if (l[a].kind == AxisLayoutKind::kSplit && l[a].dim == Dim::kExpert) {
        out.push_back(static_cast<int>(a));
      }
    }
    return out;
  };
  for (Conversion& c : cs) {
    if (!plan.moe_deepep || c.kind != CollectiveKind::kAllToAll) continue;
    for (const TensorLayout* l : {&have, &want}) {
      const std::vector<int> axes = expert_axes(*l);
      if (axes.size() == 1 && axes[0] == c.axis) c.kind = CollectiveKind::kExpertExchange;
    }
  }
  append_conversions(cs, label, steps);
}

void Compiler::emit_forward(const PartInfo& p, const TensorLayout& in_layout,
                            const std::vector<bool>& recomputed, bool only_recomputed,
                            ComputeClass cls, std::vector<Step>& steps, int layer) {
  const auto& ops = p.part->ops;
  std::vector<std::pair<TensorRef, TensorLayout>> converted;
  const std::vector<bool> replayed =
      only_recomputed ? replayed_ops(*p.part, recomputed, plan.recompute_early_stop)
                      : std::vector<bool>{};
  for (size_t i = 0; i < ops.size(); ++i) {
    if (only_recomputed && !replayed[i]) {
      // An early stop's last operator does not run again, but the inputs it saved are the
      // recomputation's: those that reach it through a collective (an expert exchange's
      // all-to-all) are exchanged again; gathered ones it keeps split (kept_bytes).
      if (recomputed[i]) {
        const Op& op = ops[i];
        for (const TensorSpec& t : op.saved) {
          const bool is_input = t.ref.slot == 0 && t.ref.op != static_cast<int>(i);
          if (!is_input || t.ref.op < 0 || !replayed[t.ref.op]) continue;
          const TensorLayout& have = p.out_layouts[t.ref.op];
          TensorLayout want = input_layout(op, p.partitions[i], t.dims);
          for (size_t a = 0; a < want.size(); ++a) {
            if (!plan.comm.save_gathered_inputs && have[a].kind == AxisLayoutKind::kSplit &&
                want[a].kind == AxisLayoutKind::kReplicated) {
              want[a] = have[a];
            }
          }
          append_tensor_conversions(ops[t.ref.op].output, have, want, p.labels[i], steps);
        }
      }
      continue;
    }
    if (before_op) before_op(p, i, only_recomputed);
    const Op& op = ops[i];
    const OpPartition& part = p.partitions[i];
    for (const TensorRef& r : op.inputs) {
      if (op.kind == OpKind::kEmbedding && r.op < 0) continue;  // token ids: every rank has them
      const TensorSpec& t = r.op < 0 ? boundary : ops[r.op].output;
      const TensorLayout& have = r.op < 0 ? in_layout : p.out_layouts[r.op];
      // Partial sums arriving from the previous part (a vocabulary-parallel embedding's output
      // with rotary positions) are reduced once, and the reduced tensor is what the part keeps
      // as its input (Megatron reduces inside the embedding): a recomputation starts from it.
      const bool partial = std::any_of(have.begin(), have.end(), [](const AxisLayout& a) {
        return a.kind == AxisLayoutKind::kPartial;
      });
      if (only_recomputed && r.op < 0 && partial) continue;
      TensorLayout want = input_layout(op, part, t.dims);
      bool seen = false;
      for (const auto& [ref, lay] : converted) seen = seen || (ref == r && lay == want);
      if (seen) continue;
      converted.emplace_back(r, want);
      append_tensor_conversions(t, have, want, p.labels[i], steps);
    }
    Step s;
    s.kind = StepKind::kCompute;
    s.compute_class = cls;
    const PartInfo::WindowCost* window = window_cost(p, i, layer);
    s.seconds = window ? window->fwd_seconds : p.fwd_seconds[i];
    s.flops = cls == ComputeClass::kRecompute ? 0 : (window ? window->fwd_flops : p.fwd_flops[i]);
    s.label = p.labels[i];
    s.matmul = op.kind == OpKind::kLinear;
    // Internal communication of a split operator.
    bool overlapped = false;
    for (const auto& ic : op.internal_comm) {
      int f = part.factor(ic.dim, mesh);
      if (f <= 1) continue;
      const uint32_t axes = internal_comm_axes(part, ic.dim);
      const double piece = ic.fwd_bytes / part.factor(ic.dims, mesh);
      if (ic.kind == InternalComm::Kind::kRingExchange) {
        // Passing every chunk around the ring moves what an all-gather of the chunks moves.
        Step c = collective_step(CollectiveKind::kAllGather, axes, piece * f, p.labels[i]);
        c.seconds = s.seconds;  // overlapped with the operator's compute
        c.compute_class = cls;
        c.flops = s.flops;
        steps.push_back(c);
        overlapped = true;
      } else {
        for (int k = 0; k < ic.fwd_calls; ++k) {
          steps.push_back(collective_step(CollectiveKind::kAllReduce, axes, piece, p.labels[i]));
        }
      }
    }
    if (!overlapped) steps.push_back(s);
  }
}

void Compiler::emit_backward(const PartInfo& p, const TensorLayout& in_layout,
                             const TensorLayout& in_grad_layout,
                             const std::vector<bool>& recomputed, bool input_grads,
                             bool weight_grads, std::vector<Step>& steps, int layer) {
  const auto& ops = p.part->ops;
  std::vector<std::pair<TensorRef, TensorLayout>> converted;
  for (int i = static_cast<int>(ops.size()) - 1; i >= 0; --i) {
    if (before_op) before_op(p, static_cast<size_t>(i), false);
    const Op& op = ops[i];
    const OpPartition& part = p.partitions[i];
    if (input_grads && !plan.comm.save_gathered_inputs) {
      // Inputs kept split instead of gathered (Megatron's sequence parallelism keeps the
      // sequence-split norm output) are gathered again before the backward matmuls.
      for (const TensorRef& r : op.inputs) {
        const TensorSpec& t = r.op < 0 ? boundary : ops[r.op].output;
        const TensorLayout& have = r.op < 0 ? in_layout : p.out_layouts[r.op];
        TensorLayout want = input_layout(op, part, t.dims);
        bool saved = false;
        for (const auto& sv : op.saved) saved = saved || sv.ref == r;
        if (!saved || recomputed[i]) continue;
        for (const Conversion& c : conversions(t, have, want, mesh)) {
          if (c.kind != CollectiveKind::kAllGather) continue;
          steps.push_back(collective_step(c.kind, 1u << c.axis, c.bytes, p.labels[i]));
        }
      }
    }
    Step s;
    s.kind = StepKind::kCompute;
    // (Attention has no weight gradient: a window changes only the input-gradient half.)
    const PartInfo::WindowCost* window = window_cost(p, static_cast<size_t>(i), layer);
    const double input_seconds = window ? window->bwd_input_seconds : p.bwd_input_seconds[i];
    const double input_flops = window ? window->bwd_input_flops : p.bwd_input_flops[i];
    s.seconds = (input_grads ? input_seconds : 0) + (weight_grads ? p.bwd_weight_seconds[i] : 0);
    s.flops = (input_grads ? input_flops : 0) + (weight_grads ? p.bwd_weight_flops[i] : 0);
    s.label = p.labels[i];
    s.matmul = op.kind == OpKind::kLinear;
    bool overlapped = false;
    if (input_grads) {
      for (const auto& ic : op.internal_comm) {
        int f = part.factor(ic.dim, mesh);
        if (f <= 1 || ic.bwd_calls == 0) continue;
        const double piece = ic.bwd_bytes / part.factor(ic.dims, mesh);
        Step c = collective_step(CollectiveKind::kAllGather, internal_comm_axes(part, ic.dim),
                                 piece * f, p.labels[i]);
        if (ic.overlaps_compute) {
          c.seconds = s.seconds;
          c.flops = s.flops;
          overlapped = true;
        }
        steps.push_back(c);
      }
    }
    if (!overlapped && s.seconds > 0) {
      if (plan.comm.tp_overlap && s.matmul && input_grads && weight_grads) {
        // Transformer Engine's bulk overlap runs the input-gradient GEMM alongside the
        // all-gather before it and the weight-gradient GEMM alongside the reduce-scatter after
        // it (overlap_tp_collectives): the two GEMMs are separate steps.
        Step wgrad = s;
        s.seconds = input_seconds;
        s.flops = input_flops;
        wgrad.seconds = p.bwd_weight_seconds[i];
        wgrad.flops = p.bwd_weight_flops[i];
        if (s.seconds > 0) steps.push_back(s);
        if (wgrad.seconds > 0) steps.push_back(wgrad);
      } else {
        steps.push_back(s);
      }
    }
    if (!input_grads) continue;
    // Gradients of the inputs, converted to the layout their producers need.
    for (const TensorRef& r : op.inputs) {
      const TensorSpec& t = r.op < 0 ? boundary : ops[r.op].output;
      if (op.kind == OpKind::kEmbedding && r.op < 0) continue;  // token ids: no gradient
      TensorLayout have = input_grad_layout(op, part, t.dims);
      TensorLayout want =
          r.op < 0 ? in_grad_layout : output_grad_layout(ops[r.op], p.partitions[r.op]);
      bool seen = false;
      for (const auto& [ref, lay] : converted) seen = seen || (ref == r && lay == have);
      if (seen) continue;
      converted.emplace_back(r, have);
      append_tensor_conversions(t, have, want, p.labels[i], steps);
    }
  }
}

}  // namespace nnsim::detail
