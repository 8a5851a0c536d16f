// Block templates: the steps of a segment's forward, backward or recomputation on a lane, with its
// transfers, gathers, gradient buckets and memory. What the three kinds share (layouts,
// transfers, ZeRO-3 units, activation bytes) is in block_builder.cc.
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/block_builder.h"
#include "core/compiler.h"

namespace nnsim::detail {

int Compiler::template_for(int segment, int lane, BlockKind kind, bool grad_sync,
                           bool explicit_recompute, bool first_forward, int pass) {
  const int role = pass_role(segment, pass);
  auto k = std::make_tuple(segment, lane, static_cast<int>(kind), grad_sync, explicit_recompute,
                           first_forward, role);
  auto it = template_cache.find(k);
  if (it != template_cache.end()) return it->second;
  BlockTemplate t;
  t.segment = segment;
  t.lane = lane;
  t.kind = kind;
  t.pass = pass;
  build_template(t, grad_sync, explicit_recompute, first_forward);
  prog.templates.push_back(std::move(t));
  int index = static_cast<int>(prog.templates.size()) - 1;
  template_cache.emplace(k, index);
  return index;
}

void Compiler::build_template(BlockTemplate& t, bool grad_sync, bool explicit_recompute,
                              bool first_forward) {
  BlockBuilder(*this, t, grad_sync, explicit_recompute, first_forward).build();
  if (plan.comm.tp_overlap) {
    overlap_tp_collectives(t.steps, lane_axes, prog.compute_model.comm_interference);
  }
  if (plan.comm.tp_sub_batches > 1) {
    sub_pipeline_collectives(t.steps, plan.comm.tp_sub_batches, lane_axes, prog.compute_model);
  }
  if (plan.comm.moe_shared_expert_overlap) {
    shared_expert_overlaps += overlap_shared_expert(t.steps, prog.labels, prog.compute_model,
                                                    t.kind != BlockKind::kForward);
  }
}

void BlockBuilder::build() {
  switch (t_.kind) {
    case BlockKind::kForward:
      forward();
      break;
    case BlockKind::kRecompute:
      recompute();
      break;
    case BlockKind::kBackward:
    case BlockKind::kBackwardInput:
    case BlockKind::kBackwardWeight:
      backward();
      break;
  }
}

void BlockBuilder::forward() {
  const PartInfo& embed = c_.embed;
  const PartInfo& head = c_.head;
  // ZeRO-1/2: the first forward of a segment waits, unit by unit, for the bucket of parameters
  // the last optimizer step updated (launched in the prologue).
  std::array<std::vector<std::pair<int, double>>, kNumGradGroups> buckets;
  for (int g = 0; g < kNumGradGroups; ++g) {
    if (first_forward_ && c_.gathers_before_forward(g)) buckets[g] = c_.gather_buckets(seg_, g);
  }
  std::array<size_t, kNumGradGroups> next_bucket{};
  auto wait_gather = [&](size_t u) {
    for (int g = 0; g < kNumGradGroups; ++g) {
      auto& k = next_bucket[g];
      while (k < buckets[g].size() && buckets[g][k].first <= static_cast<int>(u)) {
        Step w;
        w.kind = StepKind::kDpWait;
        w.tag = gather_tag(seg_, g, static_cast<int>(k++));
        w.label = c_.label("param gather");
        steps_->push_back(w);
      }
    }
  };
  if (recv_prev_lane_ >= 0) {
    recv(prev_, recv_prev_lane_, false, s_.embedding ? embed_out_ : layer_out_);
  }
  // Repeated forwards: a later pass's first segment reads the last segment's output of the
  // pass before (the final hidden state, [b, s, h]); an earlier pass's last segment sends it.
  const int role = c_.pass_role(seg_, t_.pass);
  const int last_seg = c_.segment_order.back(), first_seg = c_.segment_order.front();
  if (role & 2) {
    const int from = c_.source_lane(last_seg, t_.lane);
    if (from >= 0) recv(last_seg, from, false, layer_out_, true);
  }
  // A part's forward, once its parameters are gathered.
  auto forward_part = [&](const PartInfo& p, int layer, const TensorLayout& in_layout) {
    wait_gather(next_unit_);
    zero3_before(units_, next_unit_++);
    c_.emit_forward(p, in_layout, c_.recomputed_ops(p, layer), false, ComputeClass::kCompute,
                    t_.steps, layer);
  };
  if (s_.embedding) {
    forward_part(embed, -1, embed_out_);
    append_conversions(conversions(c_.boundary, embed_out_, embed_boundary_, c_.mesh),
                       c_.label("embed.partial-sums"), t_.steps);
  }
  for (int l = s_.first_layer; l < s_.end_layer; ++l) {
    const size_t start = steps_->size();
    forward_part(c_.layer_at(l), l, layer_in(l));
    offload_after_forward(l - s_.first_layer);
    offload_modules_forward(l - s_.first_layer, start);
  }
  if (s_.head) forward_part(head, -1, layer_out_);
  for (int l : send_next_lanes_) send(next_, l, false, segment_out_);
  if (role & 4) {
    for (int l : c_.lanes_of_segment[first_seg]) {
      if (c_.source_lane(seg_, l) == t_.lane) send(first_seg, l, false, layer_out_, true);
    }
  }
  t_.peak_bytes = module_offload_           ? module_forward_peak()
                  : offload_window_.empty() ? forward_peak()
                                            : offload_forward_peak();
  if (role & 1) return;  // an earlier pass holds its activations only while it runs
  t_.kept_bytes = act_.kept - act_.offloaded + c_.retained_output_bytes(seg_);
  if (act_.offloaded > 0) c_.offloaded_activations[{t_.lane, seg_}] = act_.offloaded;
  memory(t_.kept_bytes);
}

void BlockBuilder::recompute() {
  double extra = 0;
  // Recompute rules without layers: the embedding's and the head's operators too.
  auto recompute_part = [&](const PartInfo& p, const TensorLayout& in_layout) {
    const auto r = c_.recomputed_ops(p, -1);
    if (std::find(r.begin(), r.end(), true) == r.end()) return;
    c_.emit_forward(p, in_layout, r, true, ComputeClass::kRecompute, t_.steps);
    extra += c_.recomputed_bytes(p, in_layout, -1);
  };
  if (s_.embedding) recompute_part(c_.embed, embed_out_);
  for (int l = s_.first_layer; l < s_.end_layer; ++l) {
    const PartInfo& p = c_.layer_at(l);
    c_.emit_forward(p, layer_in(l), c_.recomputed_ops(p, l), true, ComputeClass::kRecompute,
                    t_.steps, l);
    extra += c_.recomputed_bytes(p, layer_in(l), l);
  }
  if (s_.head) recompute_part(c_.head, layer_out_);
  t_.kept_bytes = extra;
  t_.peak_bytes = extra + act_.transient;
  memory(extra);
}

void BlockBuilder::backward() {
  const PartInfo& embed = c_.embed;
  const PartInfo& head = c_.head;
  const BlockKind kind = t_.kind;
  const bool input_grads = kind != BlockKind::kBackwardWeight;
  const bool weight_grads = kind != BlockKind::kBackwardInput;
  if (input_grads && recv_next_lane_ >= 0) {
    recv(next_, recv_next_lane_, true, handed_back(next_));
  }
  std::array<double, kNumGradGroups> pending{};
  // ZeRO-3 reduces unit by unit in the backward whatever overlap_grad_reduce says (the unit's
  // unsharded gradients are freed after; the epilogue reduces ZeRO 0-2 only).
  const bool sync_here = weight_grads && grad_sync_ &&
                         (plan_.comm.overlap_grad_reduce || zero_ == 3) &&
                         (c_.shard_degree(kDenseGrads) > 1 || c_.shard_degree(kExpertGrads) > 1);
  // DeepSpeed's reduce bucket: elements waiting (comm.zero3_reduce_bucket).
  double waiting = 0;
  int waiting_group = kDenseGrads;
  auto reduce_waiting = [&]() {
    if (waiting <= 0) return;
    Step rs;
    rs.kind = StepKind::kDpLaunch;
    rs.collective = CollectiveKind::kReduceScatter;
    rs.axes = c_.group_axes[waiting_group];
    rs.bytes = waiting * grad_bytes_;
    rs.label = c_.label(fmt::format("grad sync {}", s_.name));
    steps_->push_back(rs);
    waiting = 0;
  };
  auto grads_ready = [&](const ParamUnit& u) {
    if (!sync_here) return;
    if (zero_ == 3) {
      // Without a bucket each piece is reduced as soon as it waits.
      const bool bucketed = plan_.comm.zero3_per_tensor && plan_.comm.zero3_reduce_bucket > 0;
      for (const auto& [part, group] : reduce_pieces(u)) {
        if (bucketed && waiting > 0 && waiting + part > plan_.comm.zero3_reduce_bucket) {
          reduce_waiting();
        }
        waiting_group = group;
        waiting += part;
        if (!bucketed) reduce_waiting();
      }
    } else {
      for (int g = 0; g < kNumGradGroups; ++g) {
        c_.emit_grad_buckets(u.group_params[g] * grad_bytes_, pending[g], t_.steps, seg_, g);
      }
    }
  };
  // Where the last part's own backward steps start (after its recomputation).
  size_t backward_start = 0;
  // A part's backward, after its recomputation inside the backward (rules without layers drop
  // the embedding's and the head's operators too).
  auto backward_part = [&](const PartInfo& p, int layer, const TensorLayout& in_layout,
                           const TensorLayout& in_grad_layout) {
    zero3_before(backward_units_, next_unit_++);
    const std::vector<bool> r = c_.recomputed_ops(p, layer);
    if (input_grads && !explicit_recompute_ && std::find(r.begin(), r.end(), true) != r.end()) {
      c_.emit_forward(p, in_layout, r, true, ComputeClass::kRecompute, t_.steps, layer);
    }
    backward_start = steps_->size();
    c_.emit_backward(p, in_layout, in_grad_layout, r, input_grads, weight_grads, t_.steps, layer);
    grads_ready(backward_units_[next_unit_ - 1]);
  };
  if (s_.head) backward_part(head, -1, layer_out_, layer_out_grad_);
  offload_count_ = static_cast<int>(offload_window_.size());
  reload_first_module();
  for (int l = s_.end_layer - 1; l >= s_.first_layer; --l) {
    reload_before_backward(l - s_.first_layer);
    backward_part(c_.layer_at(l), l, layer_in(l), layer_in_grad(l));
    reload_modules_backward(l - s_.first_layer, backward_start);
  }
  if (s_.embedding) backward_part(embed, -1, embed_out_, embed_out_grad_);
  if (input_grads) {
    for (int l : send_prev_lanes_) {
      send(prev_, l, true, s_.embedding ? embed_out_ : handed_back(seg_));
    }
  }
  reduce_waiting();
  for (int g = 0; g < kNumGradGroups; ++g) {
    if (!sync_here || pending[g] <= 0) continue;
    Step f;
    f.kind = StepKind::kDpLaunch;
    f.collective = zero_ >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce;
    f.axes = c_.group_axes[g];
    f.bytes = pending[g];
    f.label = c_.label(fmt::format("grad sync {}", s_.name));
    steps_->push_back(f);
  }
  // Memory: the backward frees what the forward (and an explicit recompute) kept; a recompute
  // inside the backward brings back one layer's recomputed activations at a time
  // (backward_peak).
  const bool recompute_inside = input_grads && !explicit_recompute_ && c_.has_recompute(seg_);
  double freed = 0;
  if (kind == BlockKind::kBackward) {
    freed = act_.kept - act_.offloaded;  // the offloaded come back and go within the block
    if (explicit_recompute_) {
      for (int l = s_.first_layer; l < s_.end_layer; ++l) {
        freed += c_.recomputed_bytes(c_.layer_at(l), layer_in(l), l);
      }
      // And what the R block recomputed of the embedding and the head.
      if (s_.embedding) freed += c_.recomputed_bytes(embed, embed_out_, -1);
      if (s_.head) freed += c_.recomputed_bytes(head, layer_out_, -1);
    }
  } else if (kind == BlockKind::kBackwardInput) {
    freed = act_.kept - act_.kept_weight_inputs;
  } else {
    freed = act_.kept_weight_inputs;
  }
  t_.kept_bytes = -freed;
  if (kind == BlockKind::kBackwardWeight) {
    // The weight half runs only the operators with weights: their transients.
    double worst = 0;
    if (s_.embedding) worst = std::max(worst, c_.weight_transient_bytes(embed));
    for (int l = s_.first_layer; l < s_.end_layer; ++l) {
      worst = std::max(worst, c_.weight_transient_bytes(c_.layer_at(l)));
    }
    if (s_.head) worst = std::max(worst, c_.weight_transient_bytes(head));
    t_.peak_bytes = worst + act_piece_;
  } else if (explicit_recompute_) {
    t_.peak_bytes = act_.transient + act_piece_;
  } else if (module_offload_) {
    t_.peak_bytes = module_backward_peak(recompute_inside);
  } else if (!offload_window_.empty()) {
    t_.peak_bytes = offload_backward_peak();
  } else {
    t_.peak_bytes = backward_peak(kind == BlockKind::kBackwardInput, recompute_inside);
  }
  memory(-freed);
}

}  // namespace nnsim::detail
