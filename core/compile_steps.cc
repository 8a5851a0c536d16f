// A lane's steps around its blocks: the blocks in the order's sequence, the prologue (ZeRO-1/2's
// gathers of the parameters the last step updated) and the epilogue (gradient sums, the
// optimizer step, the gathers after it), and the tied embedding's gradient sum between the first
// and last stages.
#include "core/compiler.h"

#include <algorithm>
#include <set>

namespace nnsim::detail {

namespace {

// A collective launched on the data-parallel stream (gradient sums, parameter gathers).
Step dp_launch(CollectiveKind kind, uint32_t axes, double bytes, int label) {
  Step l = collective_step(kind, axes, bytes, label);
  l.kind = StepKind::kDpLaunch;
  return l;
}

// The compute stream waiting for what the data-parallel stream launched.
Step dp_wait(int label) {
  Step w;
  w.kind = StepKind::kDpWait;
  w.label = label;
  return w;
}

}  // namespace

void Compiler::build_lane_steps(int o) {
  Lane& lane = prog.lanes[o];
  std::vector<int> segs;
  for (size_t s = 0; s < plan.segments.size(); ++s) {
    if (holds(static_cast<int>(s), o)) segs.push_back(static_cast<int>(s));
  }
  add_lane_blocks(o, lane);
  add_prologue_gathers(o, lane);
  add_epilogue(o, lane, segs);
}

// The order's blocks, each with its template.
void Compiler::add_lane_blocks(int o, Lane& lane) {
  const int zero = plan.optimizer.zero;
  std::set<int> explicit_recompute;
  std::set<int> seen_forward;
  for (const Block& b : plan.schedule[o].blocks) {
    if (b.kind == BlockKind::kRecompute) explicit_recompute.insert(b.segment);
  }
  for (const Block& b : plan.schedule[o].blocks) {
    const bool last = b.micro_batch == prog.micro_batches - 1;
    const bool sync = (zero >= 2 && !plan.optimizer.keep_gathered) || last;
    const bool first_fwd = b.kind == BlockKind::kForward && seen_forward.insert(b.segment).second;
    const bool sync_block = b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardWeight;
    int t = template_for(b.segment, o, b.kind, sync_block && sync,
                         explicit_recompute.count(b.segment) > 0, first_fwd, b.pass);
    BlockInstance instance;
    instance.block = b;
    instance.template_index = t;
    lane.blocks.push_back(instance);
  }
}

// Prologue: ZeRO-1/2 gather the parameters updated by the last step, overlapped with the
// first forwards, in the order the forwards use them (the groups' buckets interleaved by
// their first unit).
void Compiler::add_prologue_gathers(int o, Lane& lane) {
  for (const Block& b : plan.schedule[o].blocks) {
    if (b.kind != BlockKind::kForward || b.micro_batch != 0 || b.pass != 0) continue;
    struct Launch {
      int first_unit, group, bucket;
      double params;
    };
    std::vector<Launch> launches;
    for (int g = 0; g < kNumGradGroups; ++g) {
      if (!gathers_before_forward(g)) continue;
      const auto buckets = gather_buckets(b.segment, g);
      for (size_t k = 0; k < buckets.size(); ++k) {
        launches.push_back({buckets[k].first, g, static_cast<int>(k), buckets[k].second});
      }
    }
    std::stable_sort(launches.begin(), launches.end(),
                     [](const Launch& x, const Launch& y) { return x.first_unit < y.first_unit; });
    for (const Launch& x : launches) {
      Step l = dp_launch(CollectiveKind::kAllGather, group_axes[x.group],
                         x.params * compute_weight_bytes(plan), label("param gather"));
      l.tag = gather_tag(b.segment, x.group, x.bucket);
      lane.prologue.push_back(l);
    }
  }
}

// Epilogue: the gradient sums the backward did not overlap, the loss's sum, operator-specific
// sums, the memory timeline, the optimizer step and the gathers after it.
void Compiler::add_epilogue(int o, Lane& lane, const std::vector<int>& segs) {
  const Topology& topology = topo;
  const int zero = plan.optimizer.zero;
  const double grad_bytes =
      plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
  if (!plan.comm.overlap_grad_reduce && zero < 3) {
    for (int s : segs) {
      for (int g = 0; g < kNumGradGroups; ++g) {
        const double params = segment_params(s, g);
        if (params <= 0 || shard_degree(g) == 1) continue;
        lane.epilogue.push_back(
            dp_launch(zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce,
                      group_axes[g], params * grad_bytes, label("grad sync")));
      }
    }
  }
  // The head's ranks sum the micro-batches' losses over the replicas (and the context-parallel
  // ranks, which each hold part of every sequence) to report the global batch's loss: one fp32
  // scalar, latency-bound (Megatron averages it the same way). On the data-parallel stream,
  // after the gradients, so it shares their links instead of contending.
  bool holds_head = false;
  for (int s : segs) holds_head = holds_head || plan.segments[s].head;
  if (holds_head && !lane.ranks.empty() &&
      prog.group_of(lane.ranks[0], group_axes[kDenseGrads]).size() > 1) {
    lane.epilogue.push_back(
        dp_launch(CollectiveKind::kAllReduce, group_axes[kDenseGrads], kLossBytes, label("loss")));
  }
  lane.epilogue.push_back(dp_wait(label("grad sync wait")));
  // Operator-specific gradient sums (sequence-parallel norm weights over tp).
  std::map<std::pair<uint32_t, int>, double> extra_sync;  // (axes, GradGroup) -> bytes
  for (int s : segs) {
    const Segment& seg = plan.segments[s];
    auto add = [&](const PartInfo& p, int times) {
      for (size_t i = 0; i < p.part->ops.size(); ++i) {
        const int g = p.grad_group[i];
        uint32_t rest = p.sync_axes[i] & ~group_axes[g];
        if (rest && p.local_params[i] > 0) {
          extra_sync[{rest, g}] += times * p.local_params[i] * grad_bytes;
        }
        // Biases summed over axes the whole operator's weights are not.
        const uint32_t bias = p.bias_sync_axes[i] & ~group_axes[g] & ~rest;
        if (bias && p.bias_sync_params[i] > 0) {
          extra_sync[{bias, g}] += times * p.bias_sync_params[i] * grad_bytes;
        }
      }
    };
    const std::vector<int> count = layer_counts(seg);
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (count[b] > 0) add(blocks[b], count[b]);
    }
    if (seg.embedding) add(embed, 1);
    if (seg.head) add(head, 1);
  }
  for (const auto& [key, bytes] : extra_sync) {
    // With ZeRO each rank needs the sum only for the shard its optimizer updates (the same
    // offsets on every rank of the group), which is what it sums.
    const auto [axes, g] = key;
    lane.epilogue.push_back(collective_step(CollectiveKind::kAllReduce, axes,
                                            zero >= 1 ? bytes / shard_degree(g) : bytes,
                                            label("norm grad sync")));
  }
  build_memory(lane, o, segs);
  const double local_params = zero >= 1 ? sharded_params(segs) : lane.parameters;
  Step opt;
  opt.kind = StepKind::kCompute;
  opt.compute_class = ComputeClass::kOptimizer;
  if (plan.optimizer.offload_fraction > 0) {
    // The CPU updates its fraction tensor by tensor; a tensor's piece is at most the shard.
    double largest_tensor = 0;
    for (int s : segs) {
      for (const PartInfo* p : segment_parts(plan.segments[s])) {
        for (double t : p->weight_tensors) largest_tensor = std::max(largest_tensor, t);
      }
    }
    lane.offloaded_step = offloaded_optimizer_step(local_params, largest_tensor, plan.optimizer,
                                                   topology, prog.compute_model);
    opt.seconds = lane.offloaded_step.seconds;
  } else {
    opt.seconds = optimizer_seconds(local_params, plan.optimizer.grad_bytes,
                                    plan.optimizer.state_bytes, topology.gpu, prog.compute_model);
  }
  opt.label = label("optimizer step");
  lane.epilogue.push_back(opt);
  // Updated parameters gathered after the step, one all-gather per entry of `params` (and
  // its GradGroup), awaited before the iteration ends.
  auto gather_after_step = [&](const std::vector<std::pair<double, int>>& params) {
    if (params.empty()) return;
    for (const auto& [p, g] : params) {
      lane.epilogue.push_back(dp_launch(CollectiveKind::kAllGather, group_axes[g],
                                        p * compute_weight_bytes(plan), label("param gather")));
    }
    lane.epilogue.push_back(dp_wait(label("param gather wait")));
  };
  if ((zero == 1 || zero == 2) && !plan.comm.overlap_param_gather) {
    std::vector<std::pair<double, int>> per_segment;
    for (int s : segs) {
      for (int g = 0; g < kNumGradGroups; ++g) {
        const double params = segment_params(s, g);
        if (params > 0 && shard_degree(g) > 1) per_segment.emplace_back(params, g);
      }
    }
    gather_after_step(per_segment);
  }
  // ZeRO-3's persistent tensors: their updated chunks in one all-gather (DeepSpeed's), before
  // the next iteration's forward reads them.
  double persistent = 0;
  for (int s : segs) persistent += segment_persistent_params(s);
  if (zero == 3 && persistent > 0 && shard_degree() > 1) {
    gather_after_step({{persistent, kDenseGrads}});
  }
  // The outputs the forwards kept (PyTorch's pipelining) are released when the next step
  // begins, after the optimizer's.
  double retained = 0;
  for (int s : segs) retained += prog.micro_batches * retained_output_bytes(s);
  if (retained > 0) {
    Step m;
    m.kind = StepKind::kMemory;
    m.bytes = -retained;
    lane.epilogue.push_back(m);
  }
}

void Compiler::add_tied_embedding_sync() {
  const int zero = plan.optimizer.zero;
  // Tied embedding (or multi-token prediction's lookup): the first and last pipeline stage hold
  // copies whose gradients are summed.
  const int emb_seg = segment_order.front();
  const int head_seg = segment_order.back();
  const int emb_lane = lanes_of_segment[emb_seg].front();
  const int head_lane = lanes_of_segment[head_seg].front();
  if (plan.model.head_uses_embedding() && emb_lane != head_lane) {
    const Lane& a = prog.lanes[emb_lane];
    const Lane& b = prog.lanes[head_lane];
    std::vector<std::vector<int>> groups;
    for (size_t i = 0; i < a.ranks.size() && i < b.ranks.size(); ++i) {
      groups.push_back({a.ranks[i], b.ranks[i]});
    }
    prog.explicit_groups.push_back(groups);
    const int gid = static_cast<int>(prog.explicit_groups.size()) - 1;
    // Only the word matrix is tied (a learned position table stays the embedding's own).
    double tied_params = 0;
    for (size_t i = 0; i < embed.part->ops.size(); ++i) {
      if (embed.part->ops[i].name == "embed.word") tied_params += embed.local_params[i];
    }
    // ZeRO 2-3 keep only each rank's reduced chunk of the gradients (reduce-scattered every
    // micro-batch): the two stages' chunks of the matrix, chunked alike, are what is summed
    // (Megatron sums its shared embedding's own bucket after the data-parallel reduce-scatter).
    // Without ZeRO and under ZeRO-1 the whole gradients are.
    const double bytes =
        tied_params * plan.optimizer.grad_bytes / (zero >= 2 ? shard_degree() : 1.0);
    for (int l : {emb_lane, head_lane}) {
      Step s =
          collective_step(CollectiveKind::kAllReduce, 0, bytes, label("tied embedding grad sync"));
      s.group = gid;
      auto& ep = prog.lanes[l].epilogue;
      // After the data-parallel wait, just before the optimizer step (ZeRO-1/2's parameter
      // gathers, when not overlapped with the next forwards, follow the step).
      const auto step = std::find_if(ep.begin(), ep.end(), [](const Step& x) {
        return x.kind == StepKind::kCompute && x.compute_class == ComputeClass::kOptimizer;
      });
      ep.insert(step, s);
    }
  }
}

}  // namespace nnsim::detail
