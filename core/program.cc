#include "core/program.h"

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string_view>

#include <fmt/format.h>

#include "core/schedule_check.h"

namespace nnsim {

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

namespace {

// Bytes of a parameter as the forward reads it, what ZeRO gathers: fp8 training keeps 16-bit
// weights and casts them per GEMM.
double compute_weight_bytes(const Plan& plan) {
  return bytes_per_element(plan.precision == Precision::kFp8 ? Precision::kBf16 : plan.precision);
}

// NCCL's Simple-protocol buffer per channel and peer (NCCL_BUFFSIZE default, 4 MiB) and the
// channels a communicator opens; see docs/cost-model.md.
constexpr double kNcclBufferBytes = 4.0 * 1024 * 1024;
constexpr int kNcclChannels = 8;
// CUDA context, cuBLAS workspaces and allocator slack outside the tensors (assumption,
// docs/cost-model.md; calibrated by hwexec measurements).
constexpr double kRuntimeBytes = 512.0 * 1024 * 1024;
// The loss summed over the replicas each iteration: one fp32 scalar.
constexpr double kLossBytes = 4;

// Tag of a ZeRO-1/2 parameter-gather bucket (disjoint from ZeRO-3's per-unit tags).
int gather_tag(int segment, int group, int bucket) {
  return 1000000 + (segment * 2 + group) * 1000 + bucket;
}

// ZeRO-3's gathers tensor by tensor within a block: this plus the gather's place in the block.
constexpr int kTensorGatherTag = 100000000;

// A collective over the mesh axes `axes` (a bitmask) moving `bytes` per device.
Step collective_step(CollectiveKind kind, uint32_t axes, double bytes, int label) {
  Step s;
  s.kind = StepKind::kCollective;
  s.collective = kind;
  s.axes = axes;
  s.bytes = bytes;
  s.label = label;
  return s;
}

// The collectives that convert a tensor between layouts, one step each.
void append_conversions(const std::vector<Conversion>& conversions, int label,
                        std::vector<Step>& steps) {
  for (const Conversion& c : conversions) {
    steps.push_back(collective_step(c.kind, 1u << c.axis, c.bytes, label));
  }
}

// A graph part (embedding, one layer, head) with everything the plan fixes about it.
struct PartInfo {
  const GraphPart* part = nullptr;
  std::vector<OpPartition> partitions;
  std::vector<TensorLayout> out_layouts;
  std::vector<double> fwd_seconds, bwd_input_seconds, bwd_weight_seconds;
  std::vector<double> fwd_flops, bwd_input_flops, bwd_weight_flops;
  std::vector<double> local_params;    // parameters of each op's piece
  std::vector<double> weight_tensors;  // local size of every weight tensor, in op order
  std::vector<uint32_t> sync_axes;     // axes (besides dp) each op's weight gradients sum over
  std::vector<int> grad_group;         // each op's GradGroup
  // Biases added after a partial sum is reduce-scattered (sequence parallelism's row-parallel
  // biases): the axes their gradients sum over and their local parameters.
  std::vector<uint32_t> bias_sync_axes;
  std::vector<double> bias_sync_params;
  std::vector<int> labels;
};

// The parameters a device holds of part `p`: those of one GradGroup (-1: all), less a tied
// output projection when `skip_tied` (the embedding on the same devices owns that matrix).
double part_params(const PartInfo& p, int group, bool skip_tied) {
  double n = 0;
  for (size_t i = 0; i < p.local_params.size(); ++i) {
    if (skip_tied && p.part->ops[i].tied_to_embedding) continue;
    if (group >= 0 && p.grad_group[i] != group) continue;
    n += p.local_params[i];
  }
  return n;
}

// ZeRO-3 tensor by tensor with prefetch (comm.zero3_prefetch_elements): one gather of a block,
// in the order the block's operators use the tensors.
struct TensorGather {
  size_t unit;  // the segment's parameter unit (Zero3Use::unit)
  const PartInfo* part;
  size_t op;
  bool recompute;  // for the operator's recomputation inside the backward
  double elements;
};

// One operator's use of its tensors: queue entries [first, end) are its own, and when it
// waits for them every entry before `launched` has been launched.
struct TensorUse {
  size_t first, end, launched;
};

// DeepSpeed's prefetch over a block's queue (zero3_launch_through), operator by operator.
std::vector<TensorUse> zero3_tensor_uses(const std::vector<TensorGather>& queue, double prefetch) {
  std::vector<double> elements;
  for (const TensorGather& g : queue) elements.push_back(g.elements);
  std::vector<TensorUse> uses;
  size_t launched = 0;
  for (size_t first = 0; first < queue.size();) {
    const TensorGather& g = queue[first];
    size_t end = first;
    while (end < queue.size() && queue[end].unit == g.unit && queue[end].part == g.part &&
           queue[end].op == g.op && queue[end].recompute == g.recompute) {
      ++end;
    }
    launched = zero3_launch_through(elements, end, launched, prefetch);
    uses.push_back({first, end, launched});
    first = end;
  }
  return uses;
}

// The most elements gathered at once: an operator's tensors and those in flight after them
// (each released once its operator has run).
double zero3_gathered_peak(const std::vector<TensorGather>& queue, double prefetch) {
  double peak = 0;
  for (const TensorUse& u : zero3_tensor_uses(queue, prefetch)) {
    double live = 0;
    for (size_t k = u.first; k < u.launched; ++k) live += queue[k].elements;
    peak = std::max(peak, live);
  }
  return peak;
}

// Weights whose gradients sum over the same mesh axes share gradient buckets and a ZeRO shard
// group. Experts spread over a mesh axis (expert parallelism) are not replicated along it, so
// their gradients sum over fewer devices than the dense weights' (Megatron-Core's expert
// data-parallel group); every other weight is dense.
enum GradGroup : int { kDenseGrads = 0, kExpertGrads = 1, kNumGradGroups = 2 };

// A layer's peak above what it keeps and what its pass keeps or frees, for the last layer
// computed: layers of one block shape, recomputed operators and input layout (the first layer's
// comes from the embedding) share them, and a segment's layers mostly do.
struct LayerMemo {
  const PartInfo* part = nullptr;
  std::vector<bool> recomputed;
  bool first = false;
  double peak = 0, freed = 0;
  bool holds(const PartInfo* p, const std::vector<bool>& r, bool is_first) const {
    return p == part && r == recomputed && is_first == first;
  }
  void set(const PartInfo* p, const std::vector<bool>& r, bool is_first, double layer_peak,
           double layer_freed) {
    part = p;
    recomputed = r;
    first = is_first;
    peak = layer_peak;
    freed = layer_freed;
  }
};

struct Compiler {
  const Plan& plan;
  const Topology& topo;
  Program& prog;
  const Mesh& mesh;
  Network net;
  PartInfo embed, layer, head;
  PartInfo dense_layer;  // a mixed mixture of experts' dense block (graph.dense_layer)
  TensorSpec boundary;   // the hidden-state tensor passed between parts: [b, s, h]
  uint32_t lane_axes = 0;
  // Per GradGroup: dp and the axes every weight of the group syncs over (context parallel;
  // expert parallel for dense weights). An empty expert group has the dense group's axes.
  std::array<uint32_t, kNumGradGroups> group_axes{};
  std::vector<int> segment_order;  // segments in pipeline order
  std::vector<int> next_segment, prev_segment;
  std::vector<std::vector<int>> lanes_of_segment;
  std::vector<int> lane_of_rank;  // replica 0's ranks
  std::map<std::string, int> label_index;

  Compiler(const Plan& p, const Topology& t, Program& out)
      : plan(p), topo(t), prog(out), mesh(p.mesh), net(t) {}

  int label(const std::string& s) {
    auto [it, inserted] = label_index.emplace(s, static_cast<int>(prog.labels.size()));
    if (inserted) prog.labels.push_back(s);
    return it->second;
  }

  // The block layer `l` runs (graph.layer_at).
  const PartInfo& layer_at(int l) const {
    return &prog.graph.layer_at(l) == &prog.graph.layer ? layer : dense_layer;
  }
  // How many of a segment's layers run `layer` and how many `dense_layer`.
  std::array<int, 2> layer_counts(const Segment& s) const {
    std::array<int, 2> n{};
    for (int l = s.first_layer; l < s.end_layer; ++l) ++n[&layer_at(l) == &layer ? 0 : 1];
    return n;
  }
  // The resolved parts: the embedding, the block(s) and the head.
  std::vector<const PartInfo*> parts() const {
    if (dense_layer.part == nullptr) return {&embed, &layer, &head};
    return {&embed, &layer, &dense_layer, &head};
  }
  Status check_basics();
  Status resolve_part(const GraphPart& part, PartInfo& info);
  Status build_lanes();
  Status check_spanning();
  bool holds(int segment, int lane) const {
    const auto& l = lanes_of_segment[segment];
    return std::find(l.begin(), l.end(), lane) != l.end();
  }
  // The lane that sends segment `from`'s boundary tensor to lane `to`: -1 when `to` holds it
  // (the segment runs there), else the segment's first lane.
  int source_lane(int from, int to) const {
    return holds(from, to) ? -1 : lanes_of_segment[from].front();
  }
  Status check_segments();
  // ZeRO-3 tensor by tensor with prefetch (comm.zero3_prefetch_elements): called before
  // operator `op` of part `p` runs its forward (`recompute`: inside the backward) or its
  // backward, to gather its tensors; set while a block is built.
  std::function<void(const PartInfo& p, size_t op, bool recompute)> before_op;
  // The weight tensors of operator `op` that ZeRO-3 shards (local elements of each): all but
  // those under comm.zero3_persistence_threshold.
  std::vector<double> sharded_tensors(const PartInfo& p, size_t op) const;
  // The gathers of a `kind` block of `segment` tensor by tensor, in the order its operators use
  // them: a forward's in forward order; a backward's unit by unit backwards, a unit recomputed
  // inside it first for the recomputation (forward order), then for the backward (reverse).
  std::vector<TensorGather> zero3_tensor_queue(int segment, BlockKind kind,
                                               bool explicit_recompute) const;
  void emit_forward(const PartInfo& p, const TensorLayout& in_layout,
                    const std::vector<bool>& recomputed, bool only_recomputed, ComputeClass cls,
                    std::vector<Step>& steps);
  void emit_backward(const PartInfo& p, const TensorLayout& in_layout,
                     const TensorLayout& in_grad_layout, const std::vector<bool>& recomputed,
                     bool input_grads, bool weight_grads, std::vector<Step>& steps);
  double kept_bytes(const PartInfo& p, const TensorLayout& in_layout,
                    const std::vector<bool>& recomputed, bool weight_inputs_only) const;
  // The same after each operator: element i is what operators 0..i save.
  std::vector<double> kept_bytes_after(const PartInfo& p, const TensorLayout& in_layout,
                                       const std::vector<bool>& recomputed,
                                       bool weight_inputs_only) const;
  double op_transient_bytes(const PartInfo& p, size_t i) const;
  double transient_bytes(const PartInfo& p) const;
  // The largest transient of the part's operators with weights (a split backward's weight half).
  double weight_transient_bytes(const PartInfo& p) const;
  // The most a part holds above what it keeps while its operators run one after another: in
  // the forward, operator i's transient sits on what operators 0..i have saved so far; in the
  // backward too, as autograd frees what an operator saved once its backward has run.
  // `keeps_weight_inputs`: a split backward's input half, which leaves the weight gradients'
  // inputs for its weight half.
  double running_transient_bytes(const PartInfo& p, const TensorLayout& in_layout,
                                 const std::vector<bool>& recomputed,
                                 bool keeps_weight_inputs = false) const;
  // What recomputing part `p` (layer `layer`, or -1: the embedding's or head's rules) brings
  // back: its activations whole less what the forward kept.
  double recomputed_bytes(const PartInfo& p, const TensorLayout& in, int layer) const;
  std::vector<bool> recomputed_ops(const PartInfo& p, int layer_index) const;
  bool has_recompute(int segment) const;
  int template_for(int segment, int lane, BlockKind kind, bool grad_sync, bool explicit_recompute,
                   bool first_forward, int pass = 0);
  void build_template(BlockTemplate& t, bool grad_sync, bool explicit_recompute,
                      bool first_forward);
  // What a forward's pass changes in its template under repeated forwards: an earlier pass
  // keeps nothing; the first segment receives, the last segment sends, the recycled tensor.
  // Passes with the same role share a template.
  int pass_role(int segment, int pass) const {
    if (plan.recycle <= 1) return 0;
    const bool earlier = pass < plan.recycle - 1;
    const bool recv = pass > 0 && prev_segment[segment] < 0;
    const bool send = earlier && next_segment[segment] < 0;
    return (earlier ? 1 : 0) | (recv ? 2 : 0) | (send ? 4 : 0);
  }
  void emit_grad_buckets(double bytes, double& pending, std::vector<Step>& steps, int segment,
                         int group);
  // Parameters a device holds of the segment: those of one GradGroup, or (-1) all.
  double segment_params(int segment, int group = -1) const;
  // A device's share of the segments' parameters under ZeRO: each GradGroup's divided over its
  // shard group.
  double sharded_params(const std::vector<int>& segments) const {
    double n = 0;
    for (int g = 0; g < kNumGradGroups; ++g) {
      double group = 0;
      for (int s : segments) group += segment_params(s, g);
      n += group / shard_degree(g);
    }
    return n;
  }
  // Parameters of the segment's weight tensors that ZeRO-3 keeps whole on every GPU
  // (comm.zero3_persistence_threshold).
  double segment_persistent_params(int segment) const;
  // Whether the head in `segment` is on the embedding's devices (its segment, or a V-shaped
  // placement's last segment on them): a tied projection there is the embedding's matrix.
  bool head_shares_embedding(int segment) const {
    const auto& emb_lanes = lanes_of_segment[segment_order.front()];
    return plan.segments[segment].head && lanes_of_segment[segment].size() == 1 &&
           emb_lanes.size() == 1 && lanes_of_segment[segment] == emb_lanes;
  }
  // The mesh axes a split operator's internal collective runs over: those splitting `dim`.
  uint32_t internal_comm_axes(const OpPartition& part, Dim dim) const {
    uint32_t axes = 0;
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      if (part.splits_on(static_cast<int>(a)) && part.dim_on(static_cast<int>(a)) == dim) {
        axes |= 1u << a;
      }
    }
    return axes;
  }
  // Devices a GradGroup's optimizer state is sharded over (the size of its bucket group).
  int shard_degree(int group = kDenseGrads) const {
    int n = 1;
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      if (group_axes[group] & (1u << a)) n *= mesh.axes[a].size;
    }
    return n;
  }
  // ZeRO-1/2 parameter buckets of a GradGroup in a segment, in forward order: (index of the
  // first parameter unit, parameters). Units are the embedding, each layer and the head;
  // buckets hold about the data-parallel bucket size of parameters.
  std::vector<std::pair<int, double>> gather_buckets(int segment, int group) const;
  // ZeRO-1/2 with overlap_param_gather: a GradGroup's parameters updated by the last step are
  // gathered during the first forwards (launched in the prologue, awaited unit by unit).
  bool gathers_before_forward(int group) const {
    return (plan.optimizer.zero == 1 || plan.optimizer.zero == 2) &&
           plan.comm.overlap_param_gather && shard_degree(group) > 1;
  }
  void build_memory(Lane& lane, int lane_index, const std::vector<int>& segments);
  // PyTorch's pipelining runtime (comm.pp_buffers_per_micro_batch): the bytes of one receive
  // buffer (a hidden-state piece, or its gradient), and what each forward of `segment` leaves
  // allocated until the step ends (its output; the head's: the fp32 logits).
  double receive_buffer_bytes() const;
  double retained_output_bytes(int segment) const;
  std::map<std::tuple<int, int, int, bool, bool, bool, int>, int> template_cache;
};

// A partition or recompute rule that matches no operator is a typo (or a rule for another
// model), never a silent no-op.
Status check_rules_match(const Plan& plan, const OpGraph& graph) {
  std::vector<std::string> names;
  for (const GraphPart* part : {&graph.embedding, &graph.layer, &graph.dense_layer, &graph.head}) {
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
  return Status::Ok();
}

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
                     (&part == &prog.graph.layer || &part == &prog.graph.dense_layer);
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

bool Compiler::has_recompute(int segment) const {
  const Segment& s = plan.segments[segment];
  for (int l = s.first_layer; l < s.end_layer; ++l) {
    auto r = recomputed_ops(layer_at(l), l);
    if (std::find(r.begin(), r.end(), true) != r.end()) return true;
  }
  return false;
}

// The layout the part's input arrives in, and the tensor it is.
TensorLayout input_layout_of(const PartInfo& prev) {
  return prev.out_layouts.back();
}

void Compiler::emit_forward(const PartInfo& p, const TensorLayout& in_layout,
                            const std::vector<bool>& recomputed, bool only_recomputed,
                            ComputeClass cls, std::vector<Step>& steps) {
  const auto& ops = p.part->ops;
  std::vector<std::pair<TensorRef, TensorLayout>> converted;
  const std::vector<bool> replayed =
      only_recomputed ? replayed_ops(*p.part, recomputed, plan.recompute_early_stop)
                      : std::vector<bool>{};
  for (size_t i = 0; i < ops.size(); ++i) {
    if (only_recomputed && !replayed[i]) continue;
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
      append_conversions(conversions(t, have, want, mesh), p.labels[i], steps);
    }
    Step s;
    s.kind = StepKind::kCompute;
    s.compute_class = cls;
    s.seconds = p.fwd_seconds[i];
    s.flops = cls == ComputeClass::kRecompute ? 0 : p.fwd_flops[i];
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
                             bool weight_grads, std::vector<Step>& steps) {
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
    s.seconds =
        (input_grads ? p.bwd_input_seconds[i] : 0) + (weight_grads ? p.bwd_weight_seconds[i] : 0);
    s.flops = (input_grads ? p.bwd_input_flops[i] : 0) + (weight_grads ? p.bwd_weight_flops[i] : 0);
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
        s.seconds = p.bwd_input_seconds[i];
        s.flops = p.bwd_input_flops[i];
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
      append_conversions(conversions(t, have, want, mesh), p.labels[i], steps);
    }
  }
}

// Activation bytes a part keeps for its backward pass (one micro-batch). With
// `weight_inputs_only`, only what the weight gradients still need after a split backward's
// input-gradient half (the inputs of operators with weights).
double Compiler::kept_bytes(const PartInfo& p, const TensorLayout& in_layout,
                            const std::vector<bool>& recomputed, bool weight_inputs_only) const {
  const std::vector<double> after = kept_bytes_after(p, in_layout, recomputed, weight_inputs_only);
  return after.empty() ? 0.0 : after.back();
}

std::vector<double> Compiler::kept_bytes_after(const PartInfo& p, const TensorLayout& in_layout,
                                               const std::vector<bool>& recomputed,
                                               bool weight_inputs_only) const {
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
    for (const TensorSpec& t : op.saved) {
      const bool is_input = t.ref.slot == 0 && t.ref.op != static_cast<int>(i);
      if (recomputed[i]) {
        // A recomputed operator keeps only inputs from outside the recomputed region.
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
  return after;
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
  double worst = 0;
  for (size_t i = 0; i < p.part->ops.size(); ++i) worst = std::max(worst, op_transient_bytes(p, i));
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
  const std::vector<double> kept = kept_bytes_after(p, in_layout, recomputed, false);
  const std::vector<double> weight_inputs = kept_bytes_after(p, in_layout, recomputed, true);
  double worst = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    const double later_weight_inputs =
        keeps_weight_inputs ? weight_inputs.back() - weight_inputs[i] : 0.0;
    worst = std::max(worst, kept[i] + later_weight_inputs + op_transient_bytes(p, i) - kept.back());
  }
  return worst;
}

std::vector<std::pair<int, double>> Compiler::gather_buckets(int segment, int group) const {
  const Segment& s = plan.segments[segment];
  // A tied output projection on the embedding's devices is the embedding's matrix (one
  // parameter, gathered with the embedding).
  const bool tied_here = plan.model.tied_embeddings && head_shares_embedding(segment);
  auto sum = [&](const PartInfo& p) { return part_params(p, group, tied_here); };
  std::vector<double> units;
  if (s.embedding) units.push_back(sum(embed));
  for (int l = s.first_layer; l < s.end_layer; ++l) units.push_back(sum(layer_at(l)));
  if (s.head) units.push_back(sum(head));
  const double bucket = plan.comm.dp_bucket_bytes / plan.optimizer.grad_bytes;
  std::vector<std::pair<int, double>> out;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u] <= 0) continue;
    if (out.empty() || out.back().second >= bucket) out.emplace_back(static_cast<int>(u), 0.0);
    out.back().second += units[u];
  }
  return out;
}

std::vector<double> Compiler::sharded_tensors(const PartInfo& p, size_t op) const {
  size_t w = 0;  // weight_tensors runs over the operators' weights in order
  for (size_t i = 0; i < op; ++i) w += p.part->ops[i].weights.size();
  std::vector<double> out;
  for (size_t k = 0; k < p.part->ops[op].weights.size(); ++k) {
    const double n = p.weight_tensors[w + k];
    if (n >= plan.comm.zero3_persistence_threshold) out.push_back(n);
  }
  return out;
}

std::vector<TensorGather> Compiler::zero3_tensor_queue(int segment, BlockKind kind,
                                                       bool explicit_recompute) const {
  std::vector<TensorGather> queue;
  for (const Zero3Use& u : zero3_uses(plan, prog.graph, segment, kind, explicit_recompute)) {
    const PartInfo& p = u.part == &prog.graph.embedding ? embed
                        : u.part == &prog.graph.head    ? head
                        : u.part == &prog.graph.layer   ? layer
                                                        : dense_layer;
    for (double n : sharded_tensors(p, u.op)) {
      queue.push_back({static_cast<size_t>(u.unit), &p, u.op, u.recompute, n});
    }
  }
  return queue;
}

double Compiler::segment_persistent_params(int segment) const {
  if (!plan.comm.zero3_per_tensor) return 0;
  const Segment& s = plan.segments[segment];
  // A tied output projection on the embedding's devices is the embedding's matrix (counted once).
  const bool shares_embedding = head_shares_embedding(segment);
  auto sum = [&](const PartInfo& p) {
    double n = 0;
    size_t w = 0;  // weight_tensors runs over the operators' weights in order
    for (const Op& op : p.part->ops) {
      for (size_t k = 0; k < op.weights.size(); ++k, ++w) {
        if (shares_embedding && op.tied_to_embedding) continue;
        if (p.weight_tensors[w] < plan.comm.zero3_persistence_threshold) n += p.weight_tensors[w];
      }
    }
    return n;
  };
  const std::array<int, 2> count = layer_counts(s);
  double n = count[0] * sum(layer);
  if (count[1] > 0) n += count[1] * sum(dense_layer);
  if (s.embedding) n += sum(embed);
  if (s.head) n += sum(head);
  return n;
}

double Compiler::segment_params(int segment, int group) const {
  const Segment& s = plan.segments[segment];
  // A tied output projection on the embedding's own devices is the embedding matrix itself.
  const bool shares_embedding = head_shares_embedding(segment);
  auto sum = [&](const PartInfo& p) { return part_params(p, group, shares_embedding); };
  const std::array<int, 2> count = layer_counts(s);
  double n = count[0] * sum(layer);
  if (count[1] > 0) n += count[1] * sum(dense_layer);
  if (s.embedding) n += sum(embed);
  if (s.head) n += sum(head);
  return n;
}

void Compiler::emit_grad_buckets(double bytes, double& pending, std::vector<Step>& steps,
                                 int segment, int group) {
  if (shard_degree(group) == 1) return;  // nothing to sum with
  pending += bytes;
  const double bucket = plan.comm.dp_bucket_bytes;
  while (bucket > 0 && pending >= bucket) {
    Step s;
    s.kind = StepKind::kDpLaunch;
    s.collective =
        plan.optimizer.zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce;
    s.axes = group_axes[group];
    s.bytes = bucket;
    s.label = label(fmt::format("grad sync {}", plan.segments[segment].name));
    steps.push_back(s);
    pending -= bucket;
  }
}

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

bool slice_contains(const MeshSlice& slice, const Mesh& mesh, const std::vector<int>& coord) {
  for (const auto& [axis, c] : slice) {
    if (coord[mesh.axis_index(axis)] != c) return false;
  }
  return true;
}

Status Compiler::build_lanes() {
  const int dp_axis = mesh.axis_index(kDataParallelAxis);
  const int ranks = mesh.num_ranks();
  // Lanes: the schedule's slices within replica 0.
  lane_of_rank.assign(ranks, -1);
  for (size_t o = 0; o < plan.schedule.size(); ++o) {
    Lane lane;
    lane.slice = plan.schedule[o].devices;
    for (int r = 0; r < ranks; ++r) {
      auto c = mesh.coordinates(r);
      if (c[dp_axis] != 0 || !slice_contains(lane.slice, mesh, c)) continue;
      if (lane_of_rank[r] >= 0) {
        return Error(
            fmt::format("rank {} is in two schedule orders ({} and {}); give every "
                        "device exactly one order",
                        r, lane_of_rank[r], o));
      }
      lane_of_rank[r] = static_cast<int>(o);
      lane.ranks.push_back(r);
      lane.gpus.push_back(prog.gpu_of_rank[r]);
    }
    if (lane.ranks.empty()) {
      return Error(fmt::format("schedule order {} matches no device", o));
    }
    prog.lanes.push_back(std::move(lane));
  }
  for (int r = 0; r < ranks; ++r) {
    if (mesh.coordinates(r)[dp_axis] == 0 && lane_of_rank[r] < 0) {
      return Error(
          fmt::format("rank {} (coordinates {}) is in no schedule order; every device "
                      "needs one",
                      r, fmt::join(mesh.coordinates(r), ",")));
    }
  }
  // Axes a lane spans: the axes no schedule slice fixes (besides dp).
  lane_axes = 0;
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    if (static_cast<int>(a) == dp_axis) continue;
    bool fixed = false;
    for (const auto& o : plan.schedule) fixed = fixed || o.devices.count(mesh.axes[a].name) > 0;
    if (!fixed) lane_axes |= 1u << a;
  }
  // Each segment runs on the lanes whose devices are its devices: one, or several when its
  // slice leaves an axis the orders fix unfixed (a block spanning pipeline stages).
  lanes_of_segment.assign(plan.segments.size(), {});
  for (size_t s = 0; s < plan.segments.size(); ++s) {
    for (size_t o = 0; o < prog.lanes.size(); ++o) {
      auto c = mesh.coordinates(prog.lanes[o].ranks.front());
      if (!slice_contains(plan.segments[s].devices, mesh, c)) continue;
      // Every lane rank must be in the segment and vice versa (within replica 0).
      for (int r : prog.lanes[o].ranks) {
        if (!slice_contains(plan.segments[s].devices, mesh, mesh.coordinates(r))) {
          return Error(
              fmt::format("segment '{}' covers part of schedule order {} only; a "
                          "segment's devices must be whole orders",
                          plan.segments[s].name, o));
        }
      }
      lanes_of_segment[s].push_back(static_cast<int>(o));
    }
    if (lanes_of_segment[s].empty()) {
      return Error(
          fmt::format("segment '{}' is on no device of any schedule order", plan.segments[s].name));
    }
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
    std::vector<const PartInfo*> parts;
    if (seg.embedding) parts.push_back(&embed);
    const std::array<int, 2> count = layer_counts(seg);
    if (count[0] > 0) parts.push_back(&layer);
    if (count[1] > 0) parts.push_back(&dense_layer);
    if (seg.head) parts.push_back(&head);
    for (const PartInfo* p : parts) {
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
  if (plan.model.tied_embeddings &&
      (lanes_of_segment[emb].size() > 1 || lanes_of_segment[hd].size() > 1)) {
    return Error(
        "tied embeddings with an embedding or head spanning several schedule orders are not "
        "supported yet; give them one order each");
  }
  return Status::Ok();
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
  m.optimizer = (zero >= 1 ? sharded : params) * plan.optimizer.state_bytes;
  if (zero >= 3) {
    // Sharded weights plus the gathered copies of the layer in use and the one prefetched.
    double layer_params = 0;  // the largest block's
    for (const PartInfo* p : parts()) {
      if (p == &embed || p == &head) continue;
      layer_params = std::max(layer_params,
                              std::accumulate(p->local_params.begin(), p->local_params.end(), 0.0));
    }
    m.weights = sharded * plan.optimizer.weight_shard_bytes;
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
  return piece_bytes(boundary, input_layout_of(layer), mesh);
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

}  // namespace

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
        "over a mesh axis (expert parallelism) is not supported: the experts' and the dense "
        "weights' tensors shard over different groups; gather whole layers (FSDP: "
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
      lane.blocks.push_back({b, t});
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

  // Tied embedding: the first and last pipeline stage hold copies whose gradients are summed.
  const int emb_seg = c.segment_order.front();
  const int head_seg = c.segment_order.back();
  const int emb_lane = c.lanes_of_segment[emb_seg].front();
  const int head_lane = c.lanes_of_segment[head_seg].front();
  if (plan.model.tied_embeddings && emb_lane != head_lane) {
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
