// What every block of a segment on a lane shares: the layouts between its parts, its pipeline
// transfers, ZeRO-3's units and gathers, and its activation bytes. The blocks themselves are
// in compile_blocks.cc.
#include "core/block_builder.h"

#include <algorithm>
#include <numeric>

#include "core/activation_offload.h"
#include "core/host_copy.h"

namespace nnsim::detail {

BlockBuilder::BlockBuilder(Compiler& c, BlockTemplate& t, bool grad_sync, bool explicit_recompute,
                           bool first_forward)
    : c_(c),
      plan_(c.plan),
      t_(t),
      steps_(&t.steps),
      grad_sync_(grad_sync),
      explicit_recompute_(explicit_recompute),
      first_forward_(first_forward),
      seg_(t.segment),
      s_(c.plan.segments[t.segment]),
      zero_(c.plan.optimizer.zero),
      tensor_prefetch_(zero3_prefetches_tensors(c.plan)),
      module_offload_(!c.plan.activation_offload_modules.empty()) {
  embed_out_ = input_layout_of(c.embed);
  layer_out_ = input_layout_of(c.blocks.front());  // every block leaves one layout
  embed_boundary_ = embed_out_;
  for (size_t a = 0; a < embed_boundary_.size(); ++a) {
    if (!(c.lane_axes & (1u << a)) && embed_boundary_[a].kind == AxisLayoutKind::kPartial) {
      embed_boundary_[a] = AxisLayout{};
    }
  }
  segment_out_ =
      s_.embedding && s_.end_layer == s_.first_layer && !s_.head ? embed_boundary_ : layer_out_;
  embed_out_grad_ = output_grad_layout(c.embed.part->ops.back(), c.embed.partitions.back());
  layer_out_grad_ =
      output_grad_layout(c.blocks.front().part->ops.back(), c.blocks.front().partitions.back());

  prev_ = c.prev_segment[seg_];
  next_ = c.next_segment[seg_];
  recv_prev_lane_ = prev_ >= 0 ? c.source_lane(prev_, t.lane) : -1;
  recv_next_lane_ = next_ >= 0 ? c.source_lane(next_, t.lane) : -1;
  if (next_ >= 0) {
    for (int l : c.lanes_of_segment[next_]) {
      if (c.source_lane(seg_, l) == t.lane) send_next_lanes_.push_back(l);
    }
  }
  if (prev_ >= 0) {
    for (int l : c.lanes_of_segment[prev_]) {
      if (c.source_lane(seg_, l) == t.lane) send_prev_lanes_.push_back(l);
    }
  }
  act_piece_ = piece_bytes(c.boundary, s_.embedding ? embed_boundary_ : layer_out_, c.mesh);
  grad_bytes_ =
      plan_.comm.grad_reduce_bytes > 0 ? plan_.comm.grad_reduce_bytes : plan_.optimizer.grad_bytes;

  collect_units();
  install_tensor_prefetch();
  if (plan_.activation_offload_layers > 0) {
    offload_window_ =
        activation_offload_windows(s_.end_layer - s_.first_layer, plan_.activation_offload_layers);
  }
  act_ = activations();
  for (auto layer = act_.module_groups.rbegin(); layer != act_.module_groups.rend(); ++layer) {
    for (auto g = layer->rbegin(); g != layer->rend(); ++g) reload_order_.push_back(g->bytes);
  }
}

BlockBuilder::~BlockBuilder() {
  c_.before_op = nullptr;  // the hook lives for this block only
}

// The input gradient a segment hands back to the previous one: the layers' layout, or, from a
// segment starting at layer 0 without the embedding, the layout the embedding's backward needs
// (its first layer's backward converts to it: under sequence parallelism without a position
// table, the whole sequence, which the embedding's other lanes must receive whole too).
TensorLayout BlockBuilder::handed_back(int segment) const {
  const Segment& q = plan_.segments[segment];
  return !q.embedding && q.first_layer == 0 && q.end_layer > 0 ? embed_out_grad_ : layer_out_;
}

// Pipeline transfers carry the boundary tensor; a tensor replicated over an axis of the lane
// is sent in 1/size slices and all-gathered on arrival when scatter-gather is on.
double BlockBuilder::transfer_bytes(const TensorLayout& layout, uint32_t* gather_axes) const {
  double b = piece_bytes(c_.boundary, layout, c_.mesh);
  *gather_axes = 0;
  if (!plan_.comm.pp_scatter_gather) return b;
  for (size_t a = 0; a < layout.size(); ++a) {
    if ((c_.lane_axes & (1u << a)) && layout[a].kind == AxisLayoutKind::kReplicated &&
        c_.mesh.axes[a].size > 1) {
      b /= c_.mesh.axes[a].size;
      *gather_axes |= 1u << a;
    }
  }
  return b;
}

// A pipeline transfer's step; `gather` gets the axes whose pieces the receiver all-gathers.
int BlockBuilder::transfer(StepKind kind, int peer, int peer_lane, bool gradient,
                           const TensorLayout& layout, bool recycled, uint32_t* gather) {
  Step x;
  x.kind = kind;
  x.peer_segment = peer;
  x.peer_lane = peer_lane;
  x.gradient = gradient;
  x.recycle = recycled;
  x.blocking = kind == StepKind::kSend && plan_.comm.pp_blocking_sends;
  x.bytes = transfer_bytes(layout, gather);
  x.label = c_.label(gradient ? "gradient" : recycled ? "recycled" : "activation");
  steps_->push_back(x);
  return x.label;
}

void BlockBuilder::recv(int peer, int peer_lane, bool gradient, const TensorLayout& layout,
                        bool recycled) {
  uint32_t gather = 0;
  const int what = transfer(StepKind::kRecv, peer, peer_lane, gradient, layout, recycled, &gather);
  for (size_t a = 0; a < c_.mesh.axes.size(); ++a) {
    if (!(gather & (1u << a))) continue;
    steps_->push_back(collective_step(CollectiveKind::kAllGather, 1u << a,
                                      piece_bytes(c_.boundary, layout, c_.mesh), what));
  }
}

void BlockBuilder::send(int peer, int peer_lane, bool gradient, const TensorLayout& layout,
                        bool recycled) {
  uint32_t gather = 0;
  transfer(StepKind::kSend, peer, peer_lane, gradient, layout, recycled, &gather);
}

void BlockBuilder::memory(double bytes) {
  Step m;
  m.kind = StepKind::kMemory;
  m.bytes = bytes;
  steps_->push_back(m);
}

// ZeRO-3: every parameter unit (embedding, each layer, head) is gathered before it runs; the
// next unit's gather is launched before waiting for the current one, so it overlaps this
// unit's compute (FSDP's and DeepSpeed's prefetch of one unit ahead).
// DeepSpeed gathers and reduces tensor by tensor, FSDP a whole unit at once.
void BlockBuilder::collect_units() {
  const PartInfo& embed = c_.embed;
  const PartInfo& head = c_.head;
  auto params_of = [](const PartInfo& p) {
    return std::accumulate(p.local_params.begin(), p.local_params.end(), 0.0);
  };
  const double embed_params = params_of(embed);
  const double head_params = params_of(head);
  // Tied embeddings with the head on the embedding's devices (in its segment, or in another
  // segment on them: a V-shaped placement): the head projects with the embedding's own matrix,
  // one parameter. Its gradient (both uses' sum: autograd accumulates it) is reduced once, with
  // the embedding's unit. ZeRO-3 gathers it for each module that uses it under DeepSpeed
  // (comm.zero3_per_tensor: its hooks fetch a module's parameters at its forward and backward
  // and release them after); under FSDP once per pass with the embedding's unit (the unit
  // holding both) in one segment, and again with the head's unit when the head's segment is
  // another (a block of its own, after the embedding's unit was resharded).
  const bool untied_head = plan_.model.head_uses_embedding() && c_.head_shares_embedding(seg_);
  double head_untied_params = head_params;
  if (untied_head) {
    size_t w = 0;
    for (size_t i = 0; i < head.part->ops.size(); ++i) {
      const bool tied = head.part->ops[i].tied_to_embedding;
      if (tied) head_untied_params -= head.local_params[i];
      for (size_t k = 0; k < head.part->ops[i].weights.size(); ++k, ++w) {
        if (!tied) head_untied_tensors_.push_back(head.weight_tensors[w]);
      }
    }
  } else {
    head_untied_tensors_ = head.weight_tensors;
  }
  // A part's parameters by GradGroup (less the tied projection where the embedding owns it).
  auto by_group = [&](const PartInfo& p, bool untied) {
    return std::array<double, kNumGradGroups>{part_params(p, kDenseGrads, untied),
                                              part_params(p, kExpertGrads, untied)};
  };
  if (s_.embedding) {
    units_.push_back({seg_ * 10000 + 9999, embed_params, &embed.weight_tensors, embed_params,
                      &embed.weight_tensors, by_group(embed, false)});
  }
  for (int l = s_.first_layer; l < s_.end_layer; ++l) {
    const PartInfo& p = c_.layer_at(l);
    units_.push_back({seg_ * 10000 + l, params_of(p), &p.weight_tensors, params_of(p),
                      &p.weight_tensors, by_group(p, false)});
  }
  if (s_.head) {
    units_.push_back(
        {seg_ * 10000 + 9998,
         plan_.comm.zero3_per_tensor || !s_.embedding ? head_params : head_untied_params,
         &head.weight_tensors, head_untied_params, &head_untied_tensors_,
         by_group(head, untied_head)});
  }
  backward_units_.assign(units_.rbegin(), units_.rend());
}

// Whole units (FSDP) gather and reduce each GradGroup's part over its own group. Tensor by
// tensor (DeepSpeed) there is no expert group (compile_plan refuses it).
std::vector<BlockBuilder::Piece> BlockBuilder::by_groups(double whole, const ParamUnit& u) const {
  std::vector<Piece> out;
  const double experts = u.group_params[kExpertGrads];
  out.emplace_back(whole - experts, kDenseGrads);
  if (experts > 0 && c_.shard_degree(kExpertGrads) > 1) out.emplace_back(experts, kExpertGrads);
  return out;
}

// The tensors a unit gathers: all of it at once, or tensor by tensor but for the persistent
// ones (none when all are: a unit of small tensors is never gathered).
std::vector<BlockBuilder::Piece> BlockBuilder::pieces(const ParamUnit& u) const {
  if (!plan_.comm.zero3_per_tensor) return by_groups(u.params, u);
  std::vector<Piece> sharded;
  for (double n : *u.tensors) {
    if (n >= plan_.comm.zero3_persistence_threshold) sharded.emplace_back(n, kDenseGrads);
  }
  return sharded;
}

std::vector<BlockBuilder::Piece> BlockBuilder::reduce_pieces(const ParamUnit& u) const {
  if (!plan_.comm.zero3_per_tensor) return by_groups(u.reduce_params, u);
  std::vector<Piece> out;
  for (double n : *u.reduce_tensors) out.emplace_back(n, kDenseGrads);
  return out;
}

void BlockBuilder::gather(const ParamUnit& u) {
  const auto parts = pieces(u);
  for (size_t k = 0; k < parts.size(); ++k) {
    Step l;
    l.kind = StepKind::kDpLaunch;
    l.collective = CollectiveKind::kAllGather;
    l.axes = c_.group_axes[parts[k].second];
    l.bytes = parts[k].first * compute_weight_bytes(plan_);
    l.tag = k + 1 == parts.size() ? u.tag : -1;  // the stream is FIFO: the last one tells
    l.label = c_.label("param gather");
    steps_->push_back(l);
  }
}

// Whether this block recomputes layer unit `u` inside it (and gathers it for that too).
bool BlockBuilder::regather(const ParamUnit& u) const {
  if (!plan_.comm.zero3_regather_for_recompute || explicit_recompute_) return false;
  if (t_.kind == BlockKind::kBackwardWeight) return false;
  const int l = u.tag - seg_ * 10000;
  if (l < s_.first_layer || l >= s_.end_layer) return false;
  const auto r = c_.recomputed_ops(c_.layer_at(l), l);
  return std::find(r.begin(), r.end(), true) != r.end();
}

void BlockBuilder::zero3_before(const std::vector<ParamUnit>& order, size_t i) {
  if (zero_ != 3 || tensor_prefetch_) return;
  // Kept gathered: only a segment's first forward gathers.
  if (plan_.optimizer.keep_gathered && !(t_.kind == BlockKind::kForward && first_forward_)) {
    return;
  }
  auto fetch = [&](const ParamUnit& u) {
    // A unit recomputed in this backward is gathered for the recomputation too; the wait on
    // the tagged gather after it covers both (the stream is FIFO).
    if (t_.kind != BlockKind::kForward && regather(u)) {
      ParamUnit untagged = u;
      untagged.tag = -1;
      gather(untagged);
    }
    gather(u);
  };
  if (i == 0) fetch(order[0]);
  if (i + 1 < order.size()) fetch(order[i + 1]);
  if (pieces(order[i]).empty()) return;
  Step w;
  w.kind = StepKind::kDpWait;
  w.tag = order[i].tag;
  w.label = c_.label("param gather");
  steps_->push_back(w);
}

// DeepSpeed's prefetch (comm.zero3_prefetch_elements): the block's gathers in the order its
// operators use their tensors, each operator waiting for its own (zero3_tensor_queue).
void BlockBuilder::install_tensor_prefetch() {
  if (tensor_prefetch_ &&
      (!plan_.optimizer.keep_gathered || (t_.kind == BlockKind::kForward && first_forward_))) {
    queue_ = c_.zero3_tensor_queue(seg_, t_.kind, explicit_recompute_);
  }
  uses_ = zero3_tensor_uses(queue_, plan_.comm.zero3_prefetch_elements);
  if (uses_.empty()) return;
  c_.before_op = [this](const PartInfo& p, size_t op, bool recompute) {
    if (next_use_ >= uses_.size()) return;
    const TensorUse& u = uses_[next_use_];
    const TensorGather& g = queue_[u.first];
    if (g.part != &p || g.op != op || g.recompute != recompute) return;
    for (; launched_ < u.launched; ++launched_) {
      Step l;
      l.kind = StepKind::kDpLaunch;
      l.collective = CollectiveKind::kAllGather;
      l.axes = c_.group_axes[kDenseGrads];
      l.bytes = queue_[launched_].elements * compute_weight_bytes(plan_);
      l.tag = kTensorGatherTag + static_cast<int>(launched_);
      l.label = c_.label("param gather");
      steps_->push_back(l);
    }
    Step w;
    w.kind = StepKind::kDpWait;
    w.tag = kTensorGatherTag + static_cast<int>(u.end - 1);
    w.label = c_.label("param gather");
    steps_->push_back(w);
    ++next_use_;
  };
}

// Transformer Engine's offload handler: the first layer's end starts copying its activations;
// a window's last layer waits for the copy under way, frees that layer's activations and
// starts the next offloaded layer's copy.
void BlockBuilder::offload_after_forward(int i) {
  const int offloaded = static_cast<int>(offload_window_.size());
  if (offloaded == 0) return;
  if (i == 0) host_copy(0, true);
  if (offload_count_ < offloaded && offload_window_[offload_count_] == i) {
    host_copy_wait(true);
    if (offload_count_ + 1 < offloaded) host_copy(offload_count_ + 1, true);
    ++offload_count_;
  }
}

// Backwards: a window's last layer (the first to run its backward) waits for the copies back
// under way and starts its offloaded layer's; the first layer waits for the last of them.
void BlockBuilder::reload_before_backward(int i) {
  if (offload_window_.empty()) return;
  if (offload_count_ >= 1 && offload_window_[offload_count_ - 1] == i) {
    host_copy_wait(false);
    host_copy(offload_count_ - 1, false);
    --offload_count_;
  }
  if (i == 0) host_copy_wait(false);
}

void BlockBuilder::host_copy(int group, bool to_host) {
  steps_->push_back(copy_step(act_.layer_kept[group], to_host));
}

void BlockBuilder::host_copy_wait(bool to_host) {
  steps_->push_back(copy_wait_step(to_host, -1));
}

Step BlockBuilder::copy_step(double bytes, bool to_host) const {
  Step x;
  x.kind = StepKind::kHostCopyLaunch;
  x.to_host = to_host;
  x.bytes = bytes;
  x.seconds = host_copy_seconds(bytes, to_host, c_.topo, c_.prog.compute_model);
  x.label = c_.label(to_host ? "activation offload" : "activation reload");
  return x;
}

Step BlockBuilder::copy_wait_step(bool to_host, int still_running) const {
  Step w;
  w.kind = StepKind::kHostCopyWait;
  w.to_host = to_host;
  w.tag = still_running;
  w.label = c_.label(to_host ? "activation offload" : "activation reload");
  return w;
}

BlockBuilder::Activations BlockBuilder::activations() const {
  const PartInfo& embed = c_.embed;
  const PartInfo& head = c_.head;
  Activations a;
  if (s_.embedding) {
    a.kept += c_.kept_bytes(embed, embed_out_, c_.recomputed_ops(embed, -1), false);
    a.kept_weight_inputs += c_.kept_bytes(embed, embed_out_, c_.recomputed_ops(embed, -1), true);
  }
  for (int l = s_.first_layer; l < s_.end_layer; ++l) {
    const PartInfo& p = c_.layer_at(l);
    const std::vector<bool> r = c_.recomputed_ops(p, l);
    const double layer_kept = c_.kept_bytes(p, layer_in(l), r, false);
    const double layer_weight_inputs = c_.kept_bytes(p, layer_in(l), r, true);
    a.kept_layers += layer_kept;
    a.kept += layer_kept;
    if (!offload_window_.empty()) {
      a.layer_kept.push_back(layer_kept);
      if (l - s_.first_layer < plan_.activation_offload_layers) a.offloaded += layer_kept;
    }
    if (module_offload_) {
      a.layer_kept.push_back(layer_kept);
      a.module_groups.push_back(module_groups(p, l, r));
    }
    a.layers_weight_inputs += layer_weight_inputs;
    a.kept_weight_inputs += layer_weight_inputs;
  }
  if (s_.head) {
    a.kept_head = c_.kept_bytes(head, layer_out_, c_.recomputed_ops(head, -1), false);
    a.head_weight_inputs = c_.kept_bytes(head, layer_out_, c_.recomputed_ops(head, -1), true);
    a.kept += a.kept_head;
    a.kept_weight_inputs += a.head_weight_inputs;
  }
  if (plan_.comm.pp_buffers_per_micro_batch && recv_prev_lane_ >= 0 && !s_.embedding &&
      s_.end_layer > s_.first_layer) {
    // The first layer saves its input, which is the micro-batch's receive buffer, held with
    // the lane's static memory.
    const int l = s_.first_layer;
    const PartInfo& p = c_.layer_at(l);
    const double shared = std::min(c_.receive_buffer_bytes(),
                                   c_.kept_bytes(p, layer_in(l), c_.recomputed_ops(p, l), false));
    a.kept -= shared;
    a.kept_layers -= shared;
    if (module_offload_) {
      // The buffer stays on the GPU: what the first groups save of it is not offloaded.
      a.layer_kept.front() -= shared;
      double left = shared;
      for (ModuleGroup& g : a.module_groups.front()) {
        const double from_buffer = std::min(left, g.bytes);
        g.bytes -= from_buffer;
        left -= from_buffer;
      }
    }
  }
  for (const auto& layer : a.module_groups) {
    double sum = 0;
    for (const ModuleGroup& g : layer) sum += g.bytes;
    a.layer_offloaded.push_back(sum);
    a.offloaded += sum;
  }
  for (int l = s_.first_layer; l < s_.end_layer; ++l) {
    a.transient = std::max(a.transient, c_.transient_bytes(c_.layer_at(l)));
  }
  if (s_.head) a.transient = std::max(a.transient, c_.transient_bytes(head));
  if (s_.embedding) a.transient = std::max(a.transient, c_.transient_bytes(embed));
  return a;
}

double BlockBuilder::forward_peak() const {
  double so_far = 0, worst = 0;
  if (s_.embedding) {
    so_far += act_.kept - act_.kept_layers - act_.kept_head;
    worst = std::max(worst, so_far + c_.transient_bytes(c_.embed));
  }
  // A layer's forward runs on what the layers before it keep (of one block shape, the last
  // layer's forward runs on the most).
  double later = 0;  // what the layers after l keep
  LayerMemo memo;
  for (int l = s_.end_layer - 1; l >= s_.first_layer; --l) {
    const PartInfo& p = c_.layer_at(l);
    const std::vector<bool> r = c_.recomputed_ops(p, l);
    if (!memo.holds(&p, r, l == 0)) {
      memo.set(&p, r, l == 0, c_.running_transient_bytes(p, layer_in(l), r),
               c_.kept_bytes(p, layer_in(l), r, false));
    }
    worst = std::max(worst, so_far + act_.kept_layers - later + memo.peak);
    later += memo.freed;
  }
  so_far += act_.kept_layers;
  if (s_.head) worst = std::max(worst, so_far + act_.kept_head + c_.transient_bytes(c_.head));
  return worst;
}

double BlockBuilder::offload_forward_peak() const {
  double so_far = act_.kept - act_.kept_layers - act_.kept_head;  // the embedding's
  double worst = s_.embedding ? so_far + c_.transient_bytes(c_.embed) : 0.0;
  const int offloaded = plan_.activation_offload_layers;
  double resident = 0;  // what the layers before i still hold
  int released = 0;     // offloaded layers whose copy a forward has waited for
  for (int i = 0; i < s_.end_layer - s_.first_layer; ++i) {
    const int l = s_.first_layer + i;
    const PartInfo& p = c_.layer_at(l);
    const double peak = c_.running_transient_bytes(p, layer_in(l), c_.recomputed_ops(p, l));
    worst = std::max(worst, so_far + resident + act_.layer_kept[i] + peak);
    resident += act_.layer_kept[i];
    if (released < offloaded && offload_window_[released] == i) {
      resident -= act_.layer_kept[released++];
    }
  }
  so_far += resident;
  if (s_.head) worst = std::max(worst, so_far + act_.kept_head + c_.transient_bytes(c_.head));
  return worst;
}

double BlockBuilder::offload_backward_peak() const {
  const int offloaded = plan_.activation_offload_layers;
  double worst = 0, freed_before = 0;
  if (s_.head) {
    worst = c_.transient_bytes(c_.head);
    freed_before = act_.kept_head;
  }
  double freed_later = 0;  // what the backwards of the resident layers after i freed
  double reloaded = 0;     // offloaded layers copied back and not yet run
  int next = offloaded - 1;
  for (int i = s_.end_layer - s_.first_layer - 1; i >= 0; --i) {
    const int l = s_.first_layer + i;
    if (next >= 0 && offload_window_[next] == i) reloaded += act_.layer_kept[next--];
    const PartInfo& p = c_.layer_at(l);
    const double peak = c_.running_transient_bytes(p, layer_in(l), c_.recomputed_ops(p, l), false);
    worst = std::max(worst, peak + reloaded - freed_before - freed_later);
    if (i < offloaded) {
      reloaded -= act_.layer_kept[i];
    } else {
      freed_later += act_.layer_kept[i];
    }
  }
  freed_before += freed_later;
  if (s_.embedding) worst = std::max(worst, c_.transient_bytes(c_.embed) - freed_before);
  return worst + act_piece_;
}

// The parts' backwards run one after another, each freeing what its forward kept before the
// next begins (an input half: all but its weight gradients' inputs): the head's (with the
// loss's transients) ends before the last layer is recomputed, and the layers' before the
// embedding's.
double BlockBuilder::backward_peak(bool input_half, bool recompute_inside) const {
  const PartInfo& embed = c_.embed;
  const PartInfo& head = c_.head;
  double worst = 0, freed_before = 0;
  if (s_.head) {
    worst = c_.recomputed_bytes(head, layer_out_, -1) + c_.transient_bytes(head);
    freed_before = act_.kept_head - (input_half ? act_.head_weight_inputs : 0.0);
  }
  if (s_.end_layer > s_.first_layer) {
    // A layer's backward runs with the layers before it still kept (of one block shape, the
    // first backward, the last layer's, runs on the most): a layer recomputed inside the
    // backward holds again what its recomputation brings back, beside what it kept.
    double freed_later = 0;  // what the backwards of the layers after l freed
    LayerMemo memo;
    for (int l = s_.end_layer - 1; l >= s_.first_layer; --l) {
      const PartInfo& p = c_.layer_at(l);
      const std::vector<bool> r = c_.recomputed_ops(p, l);
      if (!memo.holds(&p, r, l == 0)) {
        const std::vector<bool> none(p.part->ops.size(), false);
        memo.set(
            &p, r, l == 0,
            c_.running_transient_bytes(p, layer_in(l), recompute_inside ? none : r, input_half),
            c_.kept_bytes(p, layer_in(l), r, false) -
                (input_half ? c_.kept_bytes(p, layer_in(l), r, true) : 0.0));
        memo.restored = recompute_inside ? c_.recomputed_bytes(p, layer_in(l), l) : 0.0;
      }
      worst = std::max(worst, memo.restored + memo.peak - freed_before - freed_later);
      freed_later += memo.freed;
    }
    freed_before += act_.kept_layers - (input_half ? act_.layers_weight_inputs : 0.0);
  }
  if (s_.embedding) {
    worst = std::max(worst, c_.recomputed_bytes(embed, embed_out_, -1) + c_.transient_bytes(embed) -
                                freed_before);
  }
  return worst + act_piece_;
}

}  // namespace nnsim::detail
