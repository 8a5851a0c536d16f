// Block templates: the steps of a segment's forward, backward or recomputation on a lane, with its
// transfers, gathers, gradient buckets and memory.
#include "core/compiler.h"

#include <algorithm>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "core/schedule_check.h"

namespace nnsim::detail {

namespace {

// Transformer Engine's tensor-parallel overlap: an all-gather runs alongside the GEMM that
// consumes it, a reduce-scatter alongside the GEMM that produces it, chunk by chunk; the pair
// takes the longer of the two (the GEMM slowed by the communication kernels sharing the GPU).
// In a backward the input-gradient GEMM pairs with the all-gather before it and the
// weight-gradient GEMM with the reduce-scatter of the input gradient (TE's bulk overlaps).
void overlap_tp_collectives(std::vector<Step>& steps, uint32_t lane_axes, double interference) {
  std::vector<Step> out;
  out.reserve(steps.size());
  auto overlappable = [&](const Step& c) {
    return c.kind == StepKind::kCollective && c.seconds == 0 && c.group < 0 &&
           (c.axes & ~lane_axes) == 0 &&
           (c.collective == CollectiveKind::kAllGather ||
            c.collective == CollectiveKind::kReduceScatter);
  };
  auto gemm = [](const Step& s) { return s.kind == StepKind::kCompute && s.matmul; };
  auto merge = [&](Step c, const Step& g) {
    c.seconds = g.seconds * (1 + interference);
    c.flops = g.flops;
    c.compute_class = g.compute_class;
    return c;
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (overlappable(s) && s.collective == CollectiveKind::kAllGather && i + 1 < steps.size() &&
        gemm(steps[i + 1])) {
      out.push_back(merge(s, steps[i + 1]));
      ++i;
    } else if (overlappable(s) && s.collective == CollectiveKind::kReduceScatter && !out.empty() &&
               gemm(out.back())) {
      Step g = out.back();
      out.back() = merge(s, g);
    } else {
      out.push_back(s);
    }
  }
  steps = std::move(out);
}

// Merak's sub-pipelined tensor parallelism (comm.tp_sub_batches = k): a block's micro-batch runs
// as k sub-batches along the batch. Between two blocking lane collectives the operators run
// sub-batch after sub-batch, each 1/k of the time (GEMMs of 1/k the rows priced at the same
// efficiency) and of the memory; each collective moves 1/k of its bytes per sub-batch, launched
// when its sub-batch's compute is done and run alongside the compute piece that follows (the next
// sub-batch, or the first sub-batch of the next operators, which needs only the first piece): the
// pair takes the longer of the two, the compute slowed by `interference`. A paired piece's
// compute is counted in the collective's step (its operators lose their own labels there).
// Transfers, data-parallel launches and waits end a stretch: nothing moves across them.
void sub_pipeline_collectives(std::vector<Step>& steps, int k, uint32_t lane_axes,
                              double interference) {
  auto blocking = [&](const Step& s) {
    return s.kind == StepKind::kCollective && s.seconds == 0 && s.group < 0 &&
           (s.axes & ~lane_axes) == 0;
  };
  auto in_stretch = [&](const Step& s) {
    return s.kind == StepKind::kCompute || s.kind == StepKind::kMemory || blocking(s);
  };
  std::vector<Step> out;
  out.reserve(steps.size() * k);
  std::vector<Step> pending;  // collective pieces waiting for the compute piece they overlap
  auto emit_pending = [&]() {
    for (const Step& c : pending) out.push_back(c);
    pending.clear();
  };
  // One sub-batch's piece of a run of compute and memory steps. With a collective pending, the
  // compute of the class that has most of the piece runs beside it; the rest (a recomputation
  // inside a backward, say) runs on its own first, so every second keeps its class.
  auto emit_piece = [&](const std::vector<Step>& run) {
    std::map<ComputeClass, double> by_class;
    for (const Step& s : run) {
      if (s.kind == StepKind::kCompute) by_class[s.compute_class] += s.seconds;
    }
    const bool pair = !pending.empty() && !by_class.empty();
    const ComputeClass main =
        pair ? std::max_element(by_class.begin(), by_class.end(),
                                [](const auto& a, const auto& b) { return a.second < b.second; })
                   ->first
             : ComputeClass::kCompute;
    double seconds = 0, flops = 0;
    for (const Step& s : run) {
      Step piece = s;
      if (s.kind == StepKind::kMemory) {
        piece.bytes /= k;
      } else {
        piece.seconds /= k;
        piece.flops /= k;
        if (pair && s.compute_class == main) {
          seconds += piece.seconds;
          flops += piece.flops;
          continue;
        }
      }
      out.push_back(piece);
    }
    if (pair) {
      Step& c = pending.front();
      c.seconds = seconds * (1 + interference);
      c.flops = flops;
      c.compute_class = main;
    }
    emit_pending();
  };
  for (size_t i = 0; i < steps.size();) {
    if (!in_stretch(steps[i])) {
      out.push_back(steps[i++]);
      continue;
    }
    size_t end = i;
    bool any = false;
    while (end < steps.size() && in_stretch(steps[end])) any = blocking(steps[end++]) || any;
    if (!any) {
      out.insert(out.end(), steps.begin() + i, steps.begin() + end);
      i = end;
      continue;
    }
    // The stretch as runs of compute each followed by its collectives.
    std::vector<std::vector<Step>> runs(1), after(1);
    for (size_t j = i; j < end; ++j) {
      if (blocking(steps[j])) {
        after.back().push_back(steps[j]);
      } else {
        if (!after.back().empty()) {
          runs.emplace_back();
          after.emplace_back();
        }
        runs.back().push_back(steps[j]);
      }
    }
    for (size_t r = 0; r < runs.size(); ++r) {
      for (int piece = 0; piece < k; ++piece) {
        emit_piece(runs[r]);
        for (Step c : after[r]) {
          c.bytes /= k;
          pending.push_back(c);
        }
      }
    }
    emit_pending();
    i = end;
  }
  steps = std::move(out);
}

}  // namespace

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
  const int seg = t.segment;
  const Segment& s = plan.segments[seg];
  const int zero = plan.optimizer.zero;
  const bool tensor_prefetch = zero3_prefetches_tensors(plan);
  const TensorLayout embed_out = input_layout_of(embed);
  const TensorLayout layer_out = input_layout_of(layer);
  // The embedding's output as the next part reads it. A vocabulary split over axes outside the
  // lane (the embedding sharded over pipeline stages) leaves partial sums that only the lanes
  // holding the shards can add: the embedding's segment all-reduces them before handing on.
  TensorLayout embed_boundary = embed_out;
  for (size_t a = 0; a < embed_boundary.size(); ++a) {
    if (!(lane_axes & (1u << a)) && embed_boundary[a].kind == AxisLayoutKind::kPartial) {
      embed_boundary[a] = AxisLayout{};
    }
  }
  auto layer_in = [&](int l) { return l == 0 ? embed_boundary : layer_out; };
  // What the segment hands to the next one.
  const TensorLayout segment_out =
      s.embedding && s.end_layer == s.first_layer && !s.head ? embed_boundary : layer_out;
  // The layout the producer of a part's input needs that input's gradient in.
  const TensorLayout embed_out_grad =
      output_grad_layout(embed.part->ops.back(), embed.partitions.back());
  const TensorLayout layer_out_grad =
      output_grad_layout(layer.part->ops.back(), layer.partitions.back());
  auto layer_in_grad = [&](int l) { return l == 0 ? embed_out_grad : layer_out_grad; };
  // The input gradient a segment hands back to the previous one: the layers' layout, or, from a
  // segment starting at layer 0 without the embedding, the layout the embedding's backward needs
  // (its first layer's backward converts to it: under sequence parallelism without a position
  // table, the whole sequence, which the embedding's other lanes must receive whole too).
  auto handed_back = [&](int segment) {
    const Segment& q = plan.segments[segment];
    return !q.embedding && q.first_layer == 0 && q.end_layer > 0 ? embed_out_grad : layer_out;
  };
  auto steps = &t.steps;
  const int prev = prev_segment[seg];
  const int next = next_segment[seg];
  // Transfers: a lane receives what a neighbouring segment does not compute on it, from that
  // segment's sending lane, and sends to the neighbour's lanes it is the source for.
  const int recv_prev_lane = prev >= 0 ? source_lane(prev, t.lane) : -1;
  const int recv_next_lane = next >= 0 ? source_lane(next, t.lane) : -1;
  std::vector<int> send_next_lanes, send_prev_lanes;
  if (next >= 0) {
    for (int l : lanes_of_segment[next]) {
      if (source_lane(seg, l) == t.lane) send_next_lanes.push_back(l);
    }
  }
  if (prev >= 0) {
    for (int l : lanes_of_segment[prev]) {
      if (source_lane(seg, l) == t.lane) send_prev_lanes.push_back(l);
    }
  }
  const double act_piece = piece_bytes(boundary, s.embedding ? embed_boundary : layer_out, mesh);
  // Pipeline transfers carry the boundary tensor; a tensor replicated over an axis of the lane
  // is sent in 1/size slices and all-gathered on arrival when scatter-gather is on.
  auto transfer_bytes = [&](const TensorLayout& layout, uint32_t* gather_axes) {
    double b = piece_bytes(boundary, layout, mesh);
    *gather_axes = 0;
    if (!plan.comm.pp_scatter_gather) return b;
    for (size_t a = 0; a < layout.size(); ++a) {
      if ((lane_axes & (1u << a)) && layout[a].kind == AxisLayoutKind::kReplicated &&
          mesh.axes[a].size > 1) {
        b /= mesh.axes[a].size;
        *gather_axes |= 1u << a;
      }
    }
    return b;
  };
  // A pipeline transfer's step; `gather` gets the axes whose pieces the receiver all-gathers.
  auto transfer = [&](StepKind kind, int peer, int peer_lane, bool gradient,
                      const TensorLayout& layout, bool recycled, uint32_t* gather) {
    Step x;
    x.kind = kind;
    x.peer_segment = peer;
    x.peer_lane = peer_lane;
    x.gradient = gradient;
    x.recycle = recycled;
    x.blocking = kind == StepKind::kSend && plan.comm.pp_blocking_sends;
    x.bytes = transfer_bytes(layout, gather);
    x.label = label(gradient ? "gradient" : recycled ? "recycled" : "activation");
    steps->push_back(x);
    return x.label;
  };
  auto recv = [&](int peer, int peer_lane, bool gradient, const TensorLayout& layout,
                  bool recycled = false) {
    uint32_t gather = 0;
    const int what =
        transfer(StepKind::kRecv, peer, peer_lane, gradient, layout, recycled, &gather);
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      if (!(gather & (1u << a))) continue;
      steps->push_back(collective_step(CollectiveKind::kAllGather, 1u << a,
                                       piece_bytes(boundary, layout, mesh), what));
    }
  };
  auto send = [&](int peer, int peer_lane, bool gradient, const TensorLayout& layout,
                  bool recycled = false) {
    uint32_t gather = 0;
    transfer(StepKind::kSend, peer, peer_lane, gradient, layout, recycled, &gather);
  };
  auto memory = [&](double bytes) {
    Step m;
    m.kind = StepKind::kMemory;
    m.bytes = bytes;
    steps->push_back(m);
  };
  // ZeRO-3: every parameter unit (embedding, each layer, head) is gathered before it runs; the
  // next unit's gather is launched before waiting for the current one, so it overlaps this
  // unit's compute (FSDP's and DeepSpeed's prefetch of one unit ahead).
  // DeepSpeed gathers and reduces tensor by tensor, FSDP a whole unit at once.
  // A unit's gradients are reduced as `reduce_params` (`reduce_tensors`), which leave out a tied
  // output projection's matrix when the embedding on the same devices owns it (below).
  struct ParamUnit {
    int tag;
    double params;
    const std::vector<double>* tensors;
    double reduce_params;
    const std::vector<double>* reduce_tensors;
    std::array<double, kNumGradGroups> group_params;  // reduce_params by GradGroup
  };
  // The tensors a unit gathers: all of it at once, or tensor by tensor but for the persistent
  // ones (none when all are: a unit of small tensors is never gathered).
  // Whole units (FSDP) gather and reduce each GradGroup's part over its own group: (elements,
  // group). Tensor by tensor (DeepSpeed) there is no expert group (compile_plan refuses it).
  using Piece = std::pair<double, int>;
  auto by_groups = [&](double whole, const ParamUnit& u) {
    std::vector<Piece> out;
    const double experts = u.group_params[kExpertGrads];
    out.emplace_back(whole - experts, kDenseGrads);
    if (experts > 0 && shard_degree(kExpertGrads) > 1) out.emplace_back(experts, kExpertGrads);
    return out;
  };
  auto pieces = [&](const ParamUnit& u) {
    if (!plan.comm.zero3_per_tensor) return by_groups(u.params, u);
    std::vector<Piece> sharded;
    for (double n : *u.tensors) {
      if (n >= plan.comm.zero3_persistence_threshold) sharded.emplace_back(n, kDenseGrads);
    }
    return sharded;
  };
  auto reduce_pieces = [&](const ParamUnit& u) {
    if (!plan.comm.zero3_per_tensor) return by_groups(u.reduce_params, u);
    std::vector<Piece> out;
    for (double n : *u.reduce_tensors) out.emplace_back(n, kDenseGrads);
    return out;
  };
  auto gather = [&](const ParamUnit& u) {
    const auto parts = pieces(u);
    for (size_t k = 0; k < parts.size(); ++k) {
      Step l;
      l.kind = StepKind::kDpLaunch;
      l.collective = CollectiveKind::kAllGather;
      l.axes = group_axes[parts[k].second];
      l.bytes = parts[k].first * compute_weight_bytes(plan);
      l.tag = k + 1 == parts.size() ? u.tag : -1;  // the stream is FIFO: the last one tells
      l.label = label("param gather");
      steps->push_back(l);
    }
  };
  // Whether this block recomputes layer unit `u` inside it (and gathers it for that too).
  auto regather = [&](const ParamUnit& u) {
    if (!plan.comm.zero3_regather_for_recompute || explicit_recompute) return false;
    if (t.kind == BlockKind::kBackwardWeight) return false;
    const int l = u.tag - seg * 10000;
    if (l < s.first_layer || l >= s.end_layer) return false;
    const auto r = recomputed_ops(layer_at(l), l);
    return std::find(r.begin(), r.end(), true) != r.end();
  };
  auto zero3_before = [&](const std::vector<ParamUnit>& order, size_t i) {
    if (zero != 3 || tensor_prefetch) return;
    // Kept gathered: only a segment's first forward gathers.
    if (plan.optimizer.keep_gathered && !(t.kind == BlockKind::kForward && first_forward)) return;
    auto fetch = [&](const ParamUnit& u) {
      // A unit recomputed in this backward is gathered for the recomputation too; the wait on
      // the tagged gather after it covers both (the stream is FIFO).
      if (t.kind != BlockKind::kForward && regather(u)) {
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
    w.label = label("param gather");
    steps->push_back(w);
  };
  auto params_of = [](const PartInfo& p) {
    return std::accumulate(p.local_params.begin(), p.local_params.end(), 0.0);
  };
  auto embed_params = std::accumulate(embed.local_params.begin(), embed.local_params.end(), 0.0);
  auto head_params = std::accumulate(head.local_params.begin(), head.local_params.end(), 0.0);
  // Tied embeddings with the head on the embedding's devices (in its segment, or in another
  // segment on them: a V-shaped placement): the head projects with the embedding's own matrix,
  // one parameter. Its gradient (both uses' sum: autograd accumulates it) is reduced once, with
  // the embedding's unit. ZeRO-3 gathers it for each module that uses it under DeepSpeed
  // (comm.zero3_per_tensor: its hooks fetch a module's parameters at its forward and backward
  // and release them after); under FSDP once per pass with the embedding's unit (the unit
  // holding both) in one segment, and again with the head's unit when the head's segment is
  // another (a block of its own, after the embedding's unit was resharded).
  double head_untied_params = head_params;
  std::vector<double> head_untied_tensors;
  if (plan.model.tied_embeddings && head_shares_embedding(seg)) {
    size_t w = 0;
    for (size_t i = 0; i < head.part->ops.size(); ++i) {
      const bool tied = head.part->ops[i].tied_to_embedding;
      if (tied) head_untied_params -= head.local_params[i];
      for (size_t k = 0; k < head.part->ops[i].weights.size(); ++k, ++w) {
        if (!tied) head_untied_tensors.push_back(head.weight_tensors[w]);
      }
    }
  } else {
    head_untied_tensors = head.weight_tensors;
  }
  const double grad_bytes =
      plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
  // A part's parameters by GradGroup (less the tied projection where the embedding owns it).
  auto by_group = [&](const PartInfo& p, bool untied) {
    return std::array<double, kNumGradGroups>{part_params(p, kDenseGrads, untied),
                                              part_params(p, kExpertGrads, untied)};
  };
  const bool untied_head = plan.model.tied_embeddings && head_shares_embedding(seg);
  std::vector<ParamUnit> units;  // forward order
  if (s.embedding) {
    units.push_back({seg * 10000 + 9999, embed_params, &embed.weight_tensors, embed_params,
                     &embed.weight_tensors, by_group(embed, false)});
  }
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    const PartInfo& p = layer_at(l);
    units.push_back({seg * 10000 + l, params_of(p), &p.weight_tensors, params_of(p),
                     &p.weight_tensors, by_group(p, false)});
  }
  if (s.head) {
    units.push_back({seg * 10000 + 9998,
                     plan.comm.zero3_per_tensor || !s.embedding ? head_params : head_untied_params,
                     &head.weight_tensors, head_untied_params, &head_untied_tensors,
                     by_group(head, untied_head)});
  }
  const std::vector<ParamUnit> backward_units(units.rbegin(), units.rend());
  size_t unit = 0;

  // DeepSpeed's prefetch (comm.zero3_prefetch_elements): the block's gathers in the order its
  // operators use their tensors, each operator waiting for its own (zero3_tensor_queue).
  std::vector<TensorGather> queue;
  if (tensor_prefetch &&
      (!plan.optimizer.keep_gathered || (t.kind == BlockKind::kForward && first_forward))) {
    queue = zero3_tensor_queue(seg, t.kind, explicit_recompute);
  }
  const std::vector<TensorUse> uses = zero3_tensor_uses(queue, plan.comm.zero3_prefetch_elements);
  size_t next_use = 0, launched = 0;
  // The hook lives for this block only.
  struct ClearHook {
    std::function<void(const PartInfo&, size_t, bool)>& hook;
    ~ClearHook() { hook = nullptr; }
  } clear_hook{before_op};
  if (!uses.empty()) {
    before_op = [&](const PartInfo& p, size_t op, bool recompute) {
      if (next_use >= uses.size()) return;
      const TensorUse& u = uses[next_use];
      const TensorGather& g = queue[u.first];
      if (g.part != &p || g.op != op || g.recompute != recompute) return;
      for (; launched < u.launched; ++launched) {
        Step l;
        l.kind = StepKind::kDpLaunch;
        l.collective = CollectiveKind::kAllGather;
        l.axes = group_axes[kDenseGrads];
        l.bytes = queue[launched].elements * compute_weight_bytes(plan);
        l.tag = kTensorGatherTag + static_cast<int>(launched);
        l.label = label("param gather");
        steps->push_back(l);
      }
      Step w;
      w.kind = StepKind::kDpWait;
      w.tag = kTensorGatherTag + static_cast<int>(u.end - 1);
      w.label = label("param gather");
      steps->push_back(w);
      ++next_use;
    };
  }

  // Activation bytes of this segment per micro-batch (forward keeps), and the peak extra.
  // Per part: what the forward keeps, and of it what a split backward's weight half needs.
  double kept = 0, kept_weight_inputs = 0, full_layer = 0, kept_head = 0, kept_layers = 0;
  double head_weight_inputs = 0, layers_weight_inputs = 0;
  if (s.embedding) {
    kept += kept_bytes(embed, embed_out, recomputed_ops(embed, -1), false);
    kept_weight_inputs += kept_bytes(embed, embed_out, recomputed_ops(embed, -1), true);
  }
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    const PartInfo& p = layer_at(l);
    const double layer_kept = kept_bytes(p, layer_in(l), recomputed_ops(p, l), false);
    const double layer_weight_inputs = kept_bytes(p, layer_in(l), recomputed_ops(p, l), true);
    kept_layers += layer_kept;
    kept += layer_kept;
    layers_weight_inputs += layer_weight_inputs;
    kept_weight_inputs += layer_weight_inputs;
    full_layer =
        std::max(full_layer,
                 kept_bytes(p, layer_in(l), std::vector<bool>(p.part->ops.size(), false), false));
  }
  if (s.head) {
    kept_head = kept_bytes(head, layer_out, recomputed_ops(head, -1), false);
    head_weight_inputs = kept_bytes(head, layer_out, recomputed_ops(head, -1), true);
    kept += kept_head;
    kept_weight_inputs += head_weight_inputs;
  }
  if (plan.comm.pp_buffers_per_micro_batch && recv_prev_lane >= 0 && !s.embedding &&
      s.end_layer > s.first_layer) {
    // The first layer saves its input, which is the micro-batch's receive buffer, held with
    // the lane's static memory.
    const int l = s.first_layer;
    const PartInfo& p = layer_at(l);
    const double shared =
        std::min(receive_buffer_bytes(), kept_bytes(p, layer_in(l), recomputed_ops(p, l), false));
    kept -= shared;
    kept_layers -= shared;
  }
  double transient = 0;
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    transient = std::max(transient, transient_bytes(layer_at(l)));
  }
  if (s.head) transient = std::max(transient, transient_bytes(head));
  if (s.embedding) transient = std::max(transient, transient_bytes(embed));

  switch (t.kind) {
    case BlockKind::kForward: {
      // ZeRO-1/2: the first forward of a segment waits, unit by unit, for the bucket of
      // parameters the last optimizer step updated (launched in the prologue).
      std::array<std::vector<std::pair<int, double>>, kNumGradGroups> buckets;
      for (int g = 0; g < kNumGradGroups; ++g) {
        if (first_forward && gathers_before_forward(g)) buckets[g] = gather_buckets(seg, g);
      }
      std::array<size_t, kNumGradGroups> next_bucket{};
      auto wait_gather = [&](size_t u) {
        for (int g = 0; g < kNumGradGroups; ++g) {
          auto& k = next_bucket[g];
          while (k < buckets[g].size() && buckets[g][k].first <= static_cast<int>(u)) {
            Step w;
            w.kind = StepKind::kDpWait;
            w.tag = gather_tag(seg, g, static_cast<int>(k++));
            w.label = label("param gather");
            steps->push_back(w);
          }
        }
      };
      if (recv_prev_lane >= 0) {
        recv(prev, recv_prev_lane, false, s.embedding ? embed_out : layer_out);
      }
      // Repeated forwards: a later pass's first segment reads the last segment's output of the
      // pass before (the final hidden state, [b, s, h]); an earlier pass's last segment sends it.
      const int role = pass_role(seg, t.pass);
      const int last_seg = segment_order.back(), first_seg = segment_order.front();
      if (role & 2) {
        const int from = source_lane(last_seg, t.lane);
        if (from >= 0) recv(last_seg, from, false, layer_out, true);
      }
      if (s.embedding) {
        wait_gather(unit);
        zero3_before(units, unit++);
        emit_forward(embed, embed_out, recomputed_ops(embed, -1), false, ComputeClass::kCompute,
                     t.steps);
        append_conversions(conversions(boundary, embed_out, embed_boundary, mesh),
                           label("embed.partial-sums"), t.steps);
      }
      for (int l = s.first_layer; l < s.end_layer; ++l) {
        wait_gather(unit);
        zero3_before(units, unit++);
        const PartInfo& p = layer_at(l);
        emit_forward(p, layer_in(l), recomputed_ops(p, l), false, ComputeClass::kCompute, t.steps);
      }
      if (s.head) {
        wait_gather(unit);
        zero3_before(units, unit++);
        emit_forward(head, layer_out, recomputed_ops(head, -1), false, ComputeClass::kCompute,
                     t.steps);
      }
      for (int l : send_next_lanes) send(next, l, false, segment_out);
      if (role & 4) {
        for (int l : lanes_of_segment[first_seg]) {
          if (source_lane(seg, l) == t.lane) send(first_seg, l, false, layer_out, true);
        }
      }
      // The parts run one after another: each part's transient sits on what it and the parts
      // before it keep, not on what the whole block keeps.
      {
        double so_far = 0, worst = 0;
        if (s.embedding) {
          so_far += kept - kept_layers - kept_head;
          worst = std::max(worst, so_far + transient_bytes(embed));
        }
        // A layer's forward runs on what the layers before it keep (of one block shape, the
        // last layer's forward runs on the most).
        double later = 0;  // what the layers after l keep
        LayerMemo memo;
        for (int l = s.end_layer - 1; l >= s.first_layer; --l) {
          const PartInfo& p = layer_at(l);
          const std::vector<bool> r = recomputed_ops(p, l);
          if (!memo.holds(&p, r, l == 0)) {
            memo.set(&p, r, l == 0, running_transient_bytes(p, layer_in(l), r),
                     kept_bytes(p, layer_in(l), r, false));
          }
          worst = std::max(worst, so_far + kept_layers - later + memo.peak);
          later += memo.freed;
        }
        so_far += kept_layers;
        if (s.head) worst = std::max(worst, so_far + kept_head + transient_bytes(head));
        t.peak_bytes = worst;
      }
      if (role & 1) break;  // an earlier pass holds its activations only while it runs
      t.kept_bytes = kept + retained_output_bytes(seg);
      memory(t.kept_bytes);
      break;
    }
    case BlockKind::kRecompute: {
      double extra = 0;
      // Recompute rules without layers: the embedding's and the head's operators too.
      auto recompute_part = [&](const PartInfo& p, const TensorLayout& in_layout) {
        const auto r = recomputed_ops(p, -1);
        if (std::find(r.begin(), r.end(), true) == r.end()) return;
        emit_forward(p, in_layout, r, true, ComputeClass::kRecompute, t.steps);
        extra += recomputed_bytes(p, in_layout, -1);
      };
      if (s.embedding) recompute_part(embed, embed_out);
      for (int l = s.first_layer; l < s.end_layer; ++l) {
        const PartInfo& p = layer_at(l);
        emit_forward(p, layer_in(l), recomputed_ops(p, l), true, ComputeClass::kRecompute, t.steps);
        extra += recomputed_bytes(p, layer_in(l), l);
      }
      if (s.head) recompute_part(head, layer_out);
      t.kept_bytes = extra;
      t.peak_bytes = extra + transient;
      memory(extra);
      break;
    }
    case BlockKind::kBackward:
    case BlockKind::kBackwardInput:
    case BlockKind::kBackwardWeight: {
      const bool input_grads = t.kind != BlockKind::kBackwardWeight;
      const bool weight_grads = t.kind != BlockKind::kBackwardInput;
      if (input_grads && recv_next_lane >= 0) {
        recv(next, recv_next_lane, true, handed_back(next));
      }
      std::array<double, kNumGradGroups> pending{};
      // ZeRO-3 reduces unit by unit in the backward whatever overlap_grad_reduce says (the
      // unit's unsharded gradients are freed after; the epilogue reduces ZeRO 0-2 only).
      const bool sync_here = weight_grads && grad_sync &&
                             (plan.comm.overlap_grad_reduce || zero == 3) &&
                             (shard_degree(kDenseGrads) > 1 || shard_degree(kExpertGrads) > 1);
      // DeepSpeed's reduce bucket: elements waiting (comm.zero3_reduce_bucket).
      double waiting = 0;
      int waiting_group = kDenseGrads;
      auto reduce_waiting = [&]() {
        if (waiting <= 0) return;
        Step rs;
        rs.kind = StepKind::kDpLaunch;
        rs.collective = CollectiveKind::kReduceScatter;
        rs.axes = group_axes[waiting_group];
        rs.bytes = waiting * grad_bytes;
        rs.label = label(fmt::format("grad sync {}", s.name));
        steps->push_back(rs);
        waiting = 0;
      };
      auto grads_ready = [&](const ParamUnit& u) {
        if (!sync_here) return;
        if (zero == 3) {
          // Without a bucket each piece is reduced as soon as it waits.
          const bool bucketed = plan.comm.zero3_per_tensor && plan.comm.zero3_reduce_bucket > 0;
          for (const auto& [part, group] : reduce_pieces(u)) {
            if (bucketed && waiting > 0 && waiting + part > plan.comm.zero3_reduce_bucket) {
              reduce_waiting();
            }
            waiting_group = group;
            waiting += part;
            if (!bucketed) reduce_waiting();
          }
        } else {
          for (int g = 0; g < kNumGradGroups; ++g) {
            emit_grad_buckets(u.group_params[g] * grad_bytes, pending[g], t.steps, seg, g);
          }
        }
      };
      // Recompute rules without layers also recompute the embedding's and the head's operators
      // (what they dropped) before their backward.
      auto recompute_part = [&](const PartInfo& p, const TensorLayout& in_layout) {
        const auto r = recomputed_ops(p, -1);
        if (input_grads && !explicit_recompute && std::find(r.begin(), r.end(), true) != r.end()) {
          emit_forward(p, in_layout, r, true, ComputeClass::kRecompute, t.steps);
        }
      };
      if (s.head) {
        zero3_before(backward_units, unit++);
        recompute_part(head, layer_out);
        emit_backward(head, layer_out, layer_out_grad, recomputed_ops(head, -1), input_grads,
                      weight_grads, t.steps);
        grads_ready(backward_units[unit - 1]);
      }
      for (int l = s.end_layer - 1; l >= s.first_layer; --l) {
        zero3_before(backward_units, unit++);
        const PartInfo& p = layer_at(l);
        auto r = recomputed_ops(p, l);
        if (input_grads && !explicit_recompute && std::find(r.begin(), r.end(), true) != r.end()) {
          emit_forward(p, layer_in(l), r, true, ComputeClass::kRecompute, t.steps);
        }
        emit_backward(p, layer_in(l), layer_in_grad(l), r, input_grads, weight_grads, t.steps);
        grads_ready(backward_units[unit - 1]);
      }
      if (s.embedding) {
        zero3_before(backward_units, unit++);
        recompute_part(embed, embed_out);
        emit_backward(embed, embed_out, embed_out_grad, recomputed_ops(embed, -1), input_grads,
                      weight_grads, t.steps);
        grads_ready(backward_units[unit - 1]);
      }
      if (input_grads) {
        for (int l : send_prev_lanes) {
          send(prev, l, true, s.embedding ? embed_out : handed_back(seg));
        }
      }
      reduce_waiting();
      for (int g = 0; g < kNumGradGroups; ++g) {
        if (!sync_here || pending[g] <= 0) continue;
        Step f;
        f.kind = StepKind::kDpLaunch;
        f.collective = zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce;
        f.axes = group_axes[g];
        f.bytes = pending[g];
        f.label = label(fmt::format("grad sync {}", s.name));
        steps->push_back(f);
      }
      // Memory: the backward frees what the forward (and an explicit recompute) kept; a
      // recompute inside the backward holds one layer's activations at a time.
      const bool recompute_inside = input_grads && !explicit_recompute && has_recompute(seg);
      double extra = recompute_inside ? full_layer : 0;
      double freed = 0;
      if (t.kind == BlockKind::kBackward) {
        freed = kept;
        if (explicit_recompute) {
          for (int l = s.first_layer; l < s.end_layer; ++l) {
            freed += recomputed_bytes(layer_at(l), layer_in(l), l);
          }
          // And what the R block recomputed of the embedding and the head.
          if (s.embedding) freed += recomputed_bytes(embed, embed_out, -1);
          if (s.head) freed += recomputed_bytes(head, layer_out, -1);
        }
      } else if (t.kind == BlockKind::kBackwardInput) {
        freed = kept - kept_weight_inputs;
      } else {
        freed = kept_weight_inputs;
      }
      t.kept_bytes = -freed;
      if (t.kind == BlockKind::kBackwardWeight) {
        // The weight half runs only the operators with weights: their transients.
        double worst = 0;
        if (s.embedding) worst = std::max(worst, weight_transient_bytes(embed));
        for (int l = s.first_layer; l < s.end_layer; ++l) {
          worst = std::max(worst, weight_transient_bytes(layer_at(l)));
        }
        if (s.head) worst = std::max(worst, weight_transient_bytes(head));
        t.peak_bytes = worst + act_piece;
      } else {
        t.peak_bytes = extra + transient + act_piece;
      }
      const bool input_half = t.kind == BlockKind::kBackwardInput;
      if ((t.kind == BlockKind::kBackward || input_half) && !explicit_recompute) {
        // The parts' backwards run one after another, each freeing what its forward kept before
        // the next begins (an input half: all but its weight gradients' inputs): the head's
        // (with the loss's transients) ends before the last layer is recomputed, and the
        // layers' before the embedding's.
        double worst = 0, freed_before = 0;
        if (s.head) {
          worst = recomputed_bytes(head, layer_out, -1) + transient_bytes(head);
          freed_before = kept_head - (input_half ? head_weight_inputs : 0.0);
        }
        if (s.end_layer > s.first_layer) {
          // A layer's backward runs with the layers before it still kept (of one block shape,
          // the first backward, the last layer's, runs on the most): a recomputed layer holds
          // all its activations again.
          double freed_later = 0;  // what the backwards of the layers after l freed
          LayerMemo memo;
          for (int l = s.end_layer - 1; l >= s.first_layer; --l) {
            const PartInfo& p = layer_at(l);
            const std::vector<bool> r = recomputed_ops(p, l);
            if (!memo.holds(&p, r, l == 0)) {
              const std::vector<bool> none(p.part->ops.size(), false);
              memo.set(
                  &p, r, l == 0,
                  running_transient_bytes(p, layer_in(l), recompute_inside ? none : r, input_half),
                  kept_bytes(p, layer_in(l), r, false) -
                      (input_half ? kept_bytes(p, layer_in(l), r, true) : 0.0));
            }
            worst = std::max(worst, extra + memo.peak - freed_before - freed_later);
            freed_later += memo.freed;
          }
          freed_before += kept_layers - (input_half ? layers_weight_inputs : 0.0);
        }
        if (s.embedding) {
          worst = std::max(worst, recomputed_bytes(embed, embed_out, -1) + transient_bytes(embed) -
                                      freed_before);
        }
        t.peak_bytes = worst + act_piece;
      }
      memory(-freed);
      break;
    }
  }
  if (plan.comm.tp_overlap) {
    overlap_tp_collectives(t.steps, lane_axes, prog.compute_model.comm_interference);
  }
  if (plan.comm.tp_sub_batches > 1) {
    sub_pipeline_collectives(t.steps, plan.comm.tp_sub_batches, lane_axes,
                             prog.compute_model.comm_interference);
  }
}

}  // namespace nnsim::detail
