#include "core/program.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include <fmt/format.h>

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
  const AttentionLibrary attention = megatron && gpu.name.rfind("a100", 0) != 0
                                         ? AttentionLibrary::kFused3
                                         : AttentionLibrary::kFlash2;
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
    apply_calibration(*options.calibration, topology.gpu.name, prog.compute_model, prog.comm_model);
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
  if (Status s = c.resolve_part(prog.graph.layer, c.layer); !s) return s.error();
  if (!prog.graph.dense_layer.ops.empty()) {
    if (Status s = c.resolve_part(prog.graph.dense_layer, c.dense_layer); !s) return s.error();
    // Blocks hand each other the hidden state: both shapes end in `mlp.residual`, whose
    // partition rules apply to both, so they leave it in one layout.
  }
  if (Status s = c.resolve_part(prog.graph.head, c.head); !s) return s.error();
  if (const int k = plan.comm.tp_sub_batches; k > 1) {
    // Sub-batches split the sequences each GPU runs through every operator.
    for (const PartInfo* p : c.parts()) {
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
  }
  c.boundary = prog.graph.layer.ops.back().output;
  c.boundary.ref = TensorRef{-1, 0};
  if (Status s = c.check_segments(); !s) return s.error();
  if (Status s = c.build_lanes(); !s) return s.error();
  if (Status s = c.check_spanning(); !s) return s.error();
  prog.lanes_of_segment = c.lanes_of_segment;
  prog.lane_axes = c.lane_axes;

  const Mesh& mesh = prog.plan.mesh;
  const int dp_axis = mesh.axis_index(kDataParallelAxis);
  prog.replicas = plan.data_parallel();
  prog.micro_batches = plan.num_micro_batches();
  // Each GradGroup's buckets sync over dp and the axes every weighted operator of the group
  // syncs over (context parallelism; expert parallelism for the dense weights);
  // operator-specific sync axes (sequence-parallel norms over tp) get their own small
  // all-reduce at the end of the iteration.
  std::array<uint32_t, kNumGradGroups> common;
  common.fill(~0u);
  for (const PartInfo* p : c.parts()) {
    for (size_t i = 0; i < p->part->ops.size(); ++i) {
      if (!p->part->ops[i].weights.empty()) common[p->grad_group[i]] &= p->sync_axes[i];
    }
  }
  for (int g = 0; g < kNumGradGroups; ++g) {
    c.group_axes[g] = (1u << dp_axis) | (common[g] == ~0u ? 0u : common[g]);
  }
  if (common[kExpertGrads] == ~0u) c.group_axes[kExpertGrads] = c.group_axes[kDenseGrads];
  if (plan.optimizer.zero == 3 && plan.comm.zero3_per_tensor &&
      c.group_axes[kExpertGrads] != c.group_axes[kDenseGrads]) {
    return Error(
        "communication.zero3_per_tensor: ZeRO-3 tensor by tensor (DeepSpeed) with experts spread "
        "over a mesh axis (expert parallelism) is not supported, as DeepSpeed's engine does not "
        "run it (\"MoE not supported with Stage 3\"): the experts' and the dense weights' "
        "tensors shard over different groups; gather whole layers (FSDP: "
        "zero3_per_tensor false), use optimizer.zero 0-2, or do not split the experts' 'expert' "
        "dimension");
  }

  // Schedule checks.
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
  if (Status s = check_schedule(views, static_cast<int>(plan.segments.size()), prog.micro_batches,
                                c.next_segment, c.lanes_of_segment, plan.recycle);
      !s) {
    return s.error();
  }

  // Blocks, prologue and epilogue of every lane.
  const int zero = plan.optimizer.zero;
  for (size_t o = 0; o < prog.lanes.size(); ++o) {
    Lane& lane = prog.lanes[o];
    std::vector<int> segs;
    for (size_t s = 0; s < plan.segments.size(); ++s) {
      if (c.holds(static_cast<int>(s), static_cast<int>(o))) segs.push_back(static_cast<int>(s));
    }
    std::set<int> explicit_recompute;
    std::set<int> seen_forward;
    for (const Block& b : plan.schedule[o].blocks) {
      if (b.kind == BlockKind::kRecompute) explicit_recompute.insert(b.segment);
    }
    for (const Block& b : plan.schedule[o].blocks) {
      const bool last = b.micro_batch == prog.micro_batches - 1;
      const bool sync = (zero >= 2 && !plan.optimizer.keep_gathered) || last;
      const bool first_fwd = b.kind == BlockKind::kForward && seen_forward.insert(b.segment).second;
      const bool sync_block =
          b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardWeight;
      int t = c.template_for(b.segment, static_cast<int>(o), b.kind, sync_block && sync,
                             explicit_recompute.count(b.segment) > 0, first_fwd, b.pass);
      BlockInstance instance;
      instance.block = b;
      instance.template_index = t;
      lane.blocks.push_back(instance);
    }
    // Prologue: ZeRO-1/2 gather the parameters updated by the last step, overlapped with the
    // first forwards, in the order the forwards use them (the groups' buckets interleaved by
    // their first unit).
    for (const Block& b : plan.schedule[o].blocks) {
      if (b.kind != BlockKind::kForward || b.micro_batch != 0 || b.pass != 0) continue;
      struct Launch {
        int first_unit, group, bucket;
        double params;
      };
      std::vector<Launch> launches;
      for (int g = 0; g < kNumGradGroups; ++g) {
        if (!c.gathers_before_forward(g)) continue;
        const auto buckets = c.gather_buckets(b.segment, g);
        for (size_t k = 0; k < buckets.size(); ++k) {
          launches.push_back({buckets[k].first, g, static_cast<int>(k), buckets[k].second});
        }
      }
      std::stable_sort(launches.begin(), launches.end(), [](const Launch& x, const Launch& y) {
        return x.first_unit < y.first_unit;
      });
      for (const Launch& x : launches) {
        Step l;
        l.kind = StepKind::kDpLaunch;
        l.collective = CollectiveKind::kAllGather;
        l.axes = c.group_axes[x.group];
        l.bytes = x.params * compute_weight_bytes(plan);
        l.tag = gather_tag(b.segment, x.group, x.bucket);
        l.label = c.label("param gather");
        lane.prologue.push_back(l);
      }
    }
    // Epilogue.
    const double grad_bytes =
        plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
    if (!plan.comm.overlap_grad_reduce && zero < 3) {
      for (int s : segs) {
        for (int g = 0; g < kNumGradGroups; ++g) {
          const double params = c.segment_params(s, g);
          if (params <= 0 || c.shard_degree(g) == 1) continue;
          Step l;
          l.kind = StepKind::kDpLaunch;
          l.collective = zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce;
          l.axes = c.group_axes[g];
          l.bytes = params * grad_bytes;
          l.label = c.label("grad sync");
          lane.epilogue.push_back(l);
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
        prog.group_of(lane.ranks[0], c.group_axes[kDenseGrads]).size() > 1) {
      Step l;
      l.kind = StepKind::kDpLaunch;
      l.collective = CollectiveKind::kAllReduce;
      l.axes = c.group_axes[kDenseGrads];
      l.bytes = kLossBytes;
      l.label = c.label("loss");
      lane.epilogue.push_back(l);
    }
    Step wait;
    wait.kind = StepKind::kDpWait;
    wait.label = c.label("grad sync wait");
    lane.epilogue.push_back(wait);
    // Operator-specific gradient sums (sequence-parallel norm weights over tp).
    std::map<std::pair<uint32_t, int>, double> extra_sync;  // (axes, GradGroup) -> bytes
    for (int s : segs) {
      const Segment& seg = plan.segments[s];
      auto add = [&](const PartInfo& p, int times) {
        for (size_t i = 0; i < p.part->ops.size(); ++i) {
          const int g = p.grad_group[i];
          uint32_t rest = p.sync_axes[i] & ~c.group_axes[g];
          if (rest && p.local_params[i] > 0) {
            extra_sync[{rest, g}] += times * p.local_params[i] * grad_bytes;
          }
          // Biases summed over axes the whole operator's weights are not.
          const uint32_t bias = p.bias_sync_axes[i] & ~c.group_axes[g] & ~rest;
          if (bias && p.bias_sync_params[i] > 0) {
            extra_sync[{bias, g}] += times * p.bias_sync_params[i] * grad_bytes;
          }
        }
      };
      const std::array<int, 2> count = c.layer_counts(seg);
      add(c.layer, count[0]);
      if (count[1] > 0) add(c.dense_layer, count[1]);
      if (seg.embedding) add(c.embed, 1);
      if (seg.head) add(c.head, 1);
    }
    for (const auto& [key, bytes] : extra_sync) {
      // With ZeRO each rank needs the sum only for the shard its optimizer updates (the same
      // offsets on every rank of the group), which is what it sums.
      const auto [axes, g] = key;
      lane.epilogue.push_back(collective_step(CollectiveKind::kAllReduce, axes,
                                              zero >= 1 ? bytes / c.shard_degree(g) : bytes,
                                              c.label("norm grad sync")));
    }
    c.build_memory(lane, static_cast<int>(o), segs);
    const double local_params = zero >= 1 ? c.sharded_params(segs) : lane.parameters;
    Step opt;
    opt.kind = StepKind::kCompute;
    opt.compute_class = ComputeClass::kOptimizer;
    opt.seconds = optimizer_seconds(local_params, plan.optimizer.grad_bytes,
                                    plan.optimizer.state_bytes, topology.gpu, prog.compute_model);
    opt.label = c.label("optimizer step");
    lane.epilogue.push_back(opt);
    // Updated parameters gathered after the step, one all-gather per entry of `params` (and
    // its GradGroup), awaited before the iteration ends.
    auto gather_after_step = [&](const std::vector<std::pair<double, int>>& params) {
      if (params.empty()) return;
      for (const auto& [p, g] : params) {
        Step l;
        l.kind = StepKind::kDpLaunch;
        l.collective = CollectiveKind::kAllGather;
        l.axes = c.group_axes[g];
        l.bytes = p * compute_weight_bytes(plan);
        l.label = c.label("param gather");
        lane.epilogue.push_back(l);
      }
      Step w;
      w.kind = StepKind::kDpWait;
      w.label = c.label("param gather wait");
      lane.epilogue.push_back(w);
    };
    if ((zero == 1 || zero == 2) && !plan.comm.overlap_param_gather) {
      std::vector<std::pair<double, int>> per_segment;
      for (int s : segs) {
        for (int g = 0; g < kNumGradGroups; ++g) {
          const double params = c.segment_params(s, g);
          if (params > 0 && c.shard_degree(g) > 1) per_segment.emplace_back(params, g);
        }
      }
      gather_after_step(per_segment);
    }
    // ZeRO-3's persistent tensors: their updated chunks in one all-gather (DeepSpeed's), before
    // the next iteration's forward reads them.
    double persistent = 0;
    for (int s : segs) persistent += c.segment_persistent_params(s);
    if (zero == 3 && persistent > 0 && c.shard_degree() > 1) {
      gather_after_step({{persistent, kDenseGrads}});
    }
    // The outputs the forwards kept (PyTorch's pipelining) are released when the next step
    // begins, after the optimizer's.
    double retained = 0;
    for (int s : segs) retained += prog.micro_batches * c.retained_output_bytes(s);
    if (retained > 0) {
      Step m;
      m.kind = StepKind::kMemory;
      m.bytes = -retained;
      lane.epilogue.push_back(m);
    }
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

  // Tied embedding (or multi-token prediction's lookup): the first and last pipeline stage hold
  // copies whose gradients are summed.
  const int emb_seg = c.segment_order.front();
  const int head_seg = c.segment_order.back();
  const int emb_lane = c.lanes_of_segment[emb_seg].front();
  const int head_lane = c.lanes_of_segment[head_seg].front();
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
    for (size_t i = 0; i < c.embed.part->ops.size(); ++i) {
      if (c.embed.part->ops[i].name == "embed.word") tied_params += c.embed.local_params[i];
    }
    // ZeRO 2-3 keep only each rank's reduced chunk of the gradients (reduce-scattered every
    // micro-batch): the two stages' chunks of the matrix, chunked alike, are what is summed
    // (Megatron sums its shared embedding's own bucket after the data-parallel reduce-scatter).
    // Without ZeRO and under ZeRO-1 the whole gradients are.
    const double bytes =
        tied_params * plan.optimizer.grad_bytes / (zero >= 2 ? c.shard_degree() : 1.0);
    for (int l : {emb_lane, head_lane}) {
      Step s = collective_step(CollectiveKind::kAllReduce, 0, bytes,
                               c.label("tied embedding grad sync"));
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

  for (int l = 0; l < plan.model.layers; ++l) {
    const TensorLayout in = l == 0 ? input_layout_of(c.embed) : input_layout_of(c.layer);
    const PartInfo& p = c.layer_at(l);
    prog.layer_activation_bytes.push_back(c.kept_bytes(p, in, c.recomputed_ops(p, l), false));
  }

  // Throughput bookkeeping. Every forward pass of repeated forwards is the model's work.
  const OpGraph& g = prog.graph;
  prog.model_flops_per_iteration =
      (g.forward_flops() * plan.recycle + g.backward_flops()) * prog.micro_batches * prog.replicas;
  prog.tokens_per_iteration = static_cast<double>(plan.global_batch) * plan.model.seq_len;
  return prog;
}

}  // namespace nnsim
