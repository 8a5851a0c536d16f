// What a device holds: activations kept and transients per operator, and its static memory.
#include "core/compiler.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/optimizer_offload.h"

namespace nnsim::detail {

// Activation bytes a part keeps for its backward pass (one micro-batch). With
// `weight_inputs_only`, only what the weight gradients still need after a split backward's
// input-gradient half: the inputs of operators with weights and the gradients of their outputs
// (dW = x^T dy; Qi et al.'s M_W, what zero-bubble's weight-gradient store keeps), the latter
// made by that half.
double Compiler::kept_bytes(const PartInfo& p, const TensorLayout& in_layout,
                            const std::vector<bool>& recomputed, bool weight_inputs_only) const {
  const std::vector<double>& after = kept_bytes_after(p, in_layout, recomputed, weight_inputs_only);
  return after.empty() ? 0.0 : after.back();
}

const std::vector<double>& Compiler::kept_bytes_after(const PartInfo& p,
                                                      const TensorLayout& in_layout,
                                                      const std::vector<bool>& recomputed,
                                                      bool weight_inputs_only) const {
  for (const KeptMemo& m : kept_memo) {
    if (m.part == &p && m.weight_inputs_only == weight_inputs_only && m.in_layout == in_layout &&
        m.recomputed == recomputed) {
      return m.after;
    }
  }
  const auto& ops = p.part->ops;
  std::vector<TensorRef> kept;
  std::vector<double> after;
  double bytes = 0;
  auto keep = [&](const TensorSpec& t, const TensorLayout& layout) {
    for (const auto& k : kept) {
      if (k == t.ref) return;
    }
    kept.push_back(t.ref);
    bytes += piece_bytes(t, layout, mesh);
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    const OpPartition& part = p.partitions[i];
    after.push_back(bytes);
    if (weight_inputs_only && op.bwd_weight_flops <= 0) continue;
    if (weight_inputs_only) bytes += piece_bytes(op.output, p.out_layouts[i], mesh);
    for (const TensorSpec& t : op.saved) {
      const bool is_input = t.ref.slot == 0 && t.ref.op != static_cast<int>(i);
      if (recomputed[i] && !weight_inputs_only) {
        // A recomputed operator keeps only inputs from outside the recomputed region. (A
        // weight gradient's inputs are held after the input-gradient half all the same: its
        // recomputation brought them back.)
        if (!is_input || (t.ref.op >= 0 && recomputed[t.ref.op])) continue;
      }
      if (weight_inputs_only && !is_input) continue;
      TensorLayout layout;
      if (is_input) {
        const TensorLayout& have = t.ref.op < 0 ? in_layout : p.out_layouts[t.ref.op];
        layout = input_layout(op, part, t.dims);
        // Inputs that arrive by all-gather are kept in their split form, unless the framework
        // saves them gathered (communication.save_gathered_inputs).
        if (!plan.comm.save_gathered_inputs) {
          for (size_t a = 0; a < layout.size(); ++a) {
            if (have[a].kind == AxisLayoutKind::kSplit &&
                layout[a].kind == AxisLayoutKind::kReplicated) {
              layout[a] = have[a];
            }
          }
        }
      } else {
        layout = input_layout(op, part, t.dims);
      }
      keep(t, layout);
    }
    after.back() = bytes;
  }
  kept_memo.push_back({&p, in_layout, recomputed, weight_inputs_only, std::move(after)});
  return kept_memo.back().after;
}

double Compiler::recomputed_bytes(const PartInfo& p, const TensorLayout& in, int layer) const {
  const std::vector<bool> r = recomputed_ops(p, layer);
  return kept_bytes(p, in, std::vector<bool>(r.size(), false), false) - kept_bytes(p, in, r, false);
}

// The largest temporary an operator of the part allocates: its own scratch plus its output and
// the gradient of its output.
double Compiler::op_transient_bytes(const PartInfo& p, size_t i) const {
  const auto& ops = p.part->ops;
  const Op& op = ops[i];
  const double f = p.partitions[i].factor(op.dims, mesh);
  const double out = piece_bytes(op.output, p.out_layouts[i], mesh);
  // An output a later operator works on in place is counted in that operator's transient.
  const bool consumed_in_place = std::any_of(ops.begin(), ops.end(), [&](const Op& o) {
    return o.in_place_input && std::find(o.inputs.begin(), o.inputs.end(),
                                         TensorRef{static_cast<int>(i), 0}) != o.inputs.end();
  });
  return op.transient_bytes / f + (consumed_in_place ? 0 : 2 * out);
}

double Compiler::transient_bytes(const PartInfo& p) const {
  for (const auto& [part, bytes] : transient_memo) {
    if (part == &p) return bytes;
  }
  double worst = 0;
  for (size_t i = 0; i < p.part->ops.size(); ++i) worst = std::max(worst, op_transient_bytes(p, i));
  transient_memo.emplace_back(&p, worst);
  return worst;
}

double Compiler::weight_transient_bytes(const PartInfo& p) const {
  double worst = 0;
  for (size_t i = 0; i < p.part->ops.size(); ++i) {
    if (p.part->ops[i].bwd_weight_flops > 0) worst = std::max(worst, op_transient_bytes(p, i));
  }
  return worst;
}

double Compiler::running_transient_bytes(const PartInfo& p, const TensorLayout& in_layout,
                                         const std::vector<bool>& recomputed,
                                         bool keeps_weight_inputs) const {
  const std::vector<double>& kept = kept_bytes_after(p, in_layout, recomputed, false);
  const std::vector<double>& weight_inputs = kept_bytes_after(p, in_layout, recomputed, true);
  double worst = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    const double later_weight_inputs =
        keeps_weight_inputs ? weight_inputs.back() - weight_inputs[i] : 0.0;
    worst = std::max(worst, kept[i] + later_weight_inputs + op_transient_bytes(p, i) - kept.back());
  }
  return worst;
}

void Compiler::build_memory(Lane& lane, int lane_index, const std::vector<int>& segments) {
  const int zero = plan.optimizer.zero;
  // ZeRO shards over the gradient-sync group: data parallel, with context parallel when there
  // is one (Megatron's distributed optimizer and FSDP both shard over dp x cp); the experts'
  // state over their own group.
  double params = 0;
  for (int s : segments) params += segment_params(s);
  const double sharded = sharded_params(segments);
  lane.parameters = params;
  const double weight_bytes = compute_weight_bytes(plan);
  StaticMemory m;
  m.weights = params * weight_bytes;
  m.gradients = (zero >= 2 ? sharded : params) * plan.optimizer.grad_bytes;
  const double optimizer_params = zero >= 1 ? sharded : params;
  m.optimizer =
      (1 - plan.optimizer.offload_fraction) * optimizer_params * plan.optimizer.state_bytes;
  lane.host_bytes = offloaded_host_bytes(optimizer_params, plan.optimizer);
  // Offloaded activations stay on the host from a micro-batch's forward to its backward: the
  // most the lane's order has in flight at once.
  double on_host = 0, most_on_host = 0;
  for (int s : segments) {
    auto it = offloaded_activations.find({lane_index, s});
    if (it != offloaded_activations.end()) lane.offloaded_activations += it->second;
  }
  for (const BlockInstance& b : lane.blocks) {
    auto it = offloaded_activations.find({lane_index, b.block.segment});
    if (it == offloaded_activations.end()) continue;
    if (b.block.kind == BlockKind::kForward) on_host += it->second;
    if (b.block.kind == BlockKind::kBackward) on_host -= it->second;
    most_on_host = std::max(most_on_host, on_host);
  }
  lane.host_bytes += most_on_host;
  if (zero >= 3) {
    // Sharded weights plus the gathered copies of the layer in use and the one prefetched.
    double layer_params = 0;  // the largest block's
    for (const PartInfo* p : parts()) {
      if (p == &embed || p == &head) continue;
      layer_params = std::max(layer_params,
                              std::accumulate(p->local_params.begin(), p->local_params.end(), 0.0));
    }
    // Offloaded parameters: the shards, and their gradients', live on the host.
    m.weights = plan.optimizer.offload_params ? 0.0 : sharded * plan.optimizer.weight_shard_bytes;
    if (plan.optimizer.offload_params) m.gradients = 0;
    // Persistent tensors: their whole 16-bit copy on every GPU besides their shard.
    for (int s : segments) m.weights += segment_persistent_params(s) * weight_bytes;
    m.gathered = 2 * layer_params * weight_bytes + layer_params * plan.optimizer.grad_bytes;
    if (zero3_prefetches_tensors(plan)) {
      // Tensor by tensor: the most any block holds gathered, and of gradients one tensor's
      // (autograd's, until the reduce bucket takes it) and the bucket (reduce_bucket_size).
      double peak = 0, largest = 0;
      for (int s : segments) {
        for (BlockKind kind : {BlockKind::kForward, BlockKind::kBackward}) {
          const auto queue = zero3_tensor_queue(s, kind, false);
          peak = std::max(peak, zero3_gathered_peak(queue, plan.comm.zero3_prefetch_elements));
          for (const TensorGather& g : queue) largest = std::max(largest, g.elements);
        }
      }
      const double reduce_bytes =
          plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
      m.gathered = peak * weight_bytes + largest * plan.optimizer.grad_bytes +
                   std::min(plan.comm.zero3_reduce_bucket, params) * reduce_bytes;
    }
    if (plan.optimizer.keep_gathered) {
      // Every parameter gathered, and its unsharded gradient accumulated, for the iteration.
      const double accumulate =
          plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
      m.gathered = params * weight_bytes + params * accumulate;
    }
  }
  // One communicator per parallel group the device is in, plus the pipeline neighbours.
  int communicators = 0;
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    if (mesh.axes[a].size > 1) ++communicators;
  }
  m.comm_buffers = communicators * kNcclChannels * 2 * kNcclBufferBytes;
  if (plan.comm.pp_buffers_per_micro_batch) {
    // A buffer per micro-batch for each transfer the lane receives: activations from the
    // previous segment's lane, gradients from the next one's.
    for (int s : segments) {
      for (int peer : {prev_segment[s], next_segment[s]}) {
        if (peer >= 0 && source_lane(peer, lane_index) >= 0) {
          m.pipeline_buffers += prog.micro_batches * receive_buffer_bytes();
        }
      }
    }
  }
  m.runtime = kRuntimeBytes;
  lane.memory = m;
}

double Compiler::receive_buffer_bytes() const {
  return piece_bytes(boundary, input_layout_of(blocks.front()), mesh);
}

double Compiler::retained_output_bytes(int segment) const {
  if (!plan.comm.pp_buffers_per_micro_batch || plan.segments.size() < 2) return 0;
  if (!plan.segments[segment].head) return receive_buffer_bytes();
  // The model's output: the projection's logits, cast to fp32 for the loss.
  for (size_t i = 0; i < head.part->ops.size(); ++i) {
    const Op& op = head.part->ops[i];
    if (op.name != "head.proj") continue;
    return piece_bytes(op.output, head.out_layouts[i], mesh) * 4 / op.output.bytes_per_element;
  }
  return 0;
}

}  // namespace nnsim::detail
