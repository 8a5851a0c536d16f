// The plan compiler's internals (core/program.h's compile_plan), shared by the files that
// make it up: compile_checks.cc (the plan against its model and topology), compile_lanes.cc
// (segments onto devices), compile_ops.cc (operators' partitions, forward and backward steps),
// compile_zero.cc (ZeRO's buckets, gathers and shards), compile_memory.cc (what a device holds),
// compile_blocks.cc with block_builder.h (block templates), compile_overlap.cc (collectives
// hidden behind a block's compute), compile_pairs.cc (a forward and a backward block run as
// one) and compile_steps.cc (a lane's blocks, prologue and epilogue). Not part of the library's
// interface.
#pragma once

#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/program.h"

namespace nnsim::detail {

// Bytes of a parameter as the forward reads it, what ZeRO gathers: fp8 training keeps 16-bit
// weights and casts them per GEMM.
inline double compute_weight_bytes(const Plan& plan) {
  return bytes_per_element(plan.precision == Precision::kFp8 ? Precision::kBf16 : plan.precision);
}

// NCCL's Simple-protocol buffer per channel and peer (NCCL_BUFFSIZE default, 4 MiB) and the
// channels a communicator opens; see docs/cost-model.md.
inline constexpr double kNcclBufferBytes = 4.0 * 1024 * 1024;
inline constexpr int kNcclChannels = 8;

// CUDA context, cuBLAS workspaces and allocator slack outside the tensors (assumption,
// docs/cost-model.md; calibrated by hwexec measurements).
inline constexpr double kRuntimeBytes = 512.0 * 1024 * 1024;

// The loss summed over the replicas each iteration: one fp32 scalar.
inline constexpr double kLossBytes = 4;

// Tag of a ZeRO-1/2 parameter-gather bucket (disjoint from ZeRO-3's per-unit tags).
inline int gather_tag(int segment, int group, int bucket) {
  return 1000000 + (segment * 2 + group) * 1000 + bucket;
}

// ZeRO-3's gathers tensor by tensor within a block: this plus the gather's place in the block.
inline constexpr int kTensorGatherTag = 100000000;

// A collective over the mesh axes `axes` (a bitmask) moving `bytes` per device.
inline Step collective_step(CollectiveKind kind, uint32_t axes, double bytes, int label) {
  Step s;
  s.kind = StepKind::kCollective;
  s.collective = kind;
  s.axes = axes;
  s.bytes = bytes;
  s.label = label;
  return s;
}

// The collectives that convert a tensor between layouts, one step each.
inline void append_conversions(const std::vector<Conversion>& conversions, int label,
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
  // Sliding windows: an attention operator's forward and input-gradient seconds and FLOPs in a
  // layer attending fully ([0]) and in one within its window ([1]); the vectors above hold the
  // model's average, which the embedding's and head's callers (no layer) never need. Empty
  // without windows; per op, zeros for operators other than attention.
  struct WindowCost {
    double fwd_seconds = 0, bwd_input_seconds = 0, fwd_flops = 0, bwd_input_flops = 0;
  };
  std::vector<std::array<WindowCost, 2>> window_costs;
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
inline double part_params(const PartInfo& p, int group, bool skip_tied) {
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
inline std::vector<TensorUse> zero3_tensor_uses(const std::vector<TensorGather>& queue,
                                                double prefetch) {
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
inline double zero3_gathered_peak(const std::vector<TensorGather>& queue, double prefetch) {
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
  double restored = 0;  // what a recomputation inside the backward brings back (set apart)
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
  // Activation offloading: by lane and segment, the bytes of activations a micro-batch's
  // forward copies to the host (its pinned buffers there).
  std::map<std::pair<int, int>, double> offloaded_activations;
  Network net;
  PartInfo embed, head;
  std::vector<PartInfo> blocks;  // graph.blocks'
  TensorSpec boundary;           // the hidden-state tensor passed between parts: [b, s, h]
  uint32_t lane_axes = 0;
  // Per GradGroup: dp and the axes every weight of the group syncs over (context parallel;
  // expert parallel for dense weights). An empty expert group has the dense group's axes.
  std::array<uint32_t, kNumGradGroups> group_axes{};
  std::vector<int> segment_order;  // segments in pipeline order
  std::vector<int> next_segment, prev_segment;
  std::vector<std::vector<int>> lanes_of_segment;
  std::vector<int> lane_of_rank;  // replica 0's ranks
  std::map<std::string, int> label_index;
  // kept_bytes_after's and transient_bytes's results, computed once per argument set: every
  // block template asks them of every layer, and a compile has a few distinct sets.
  struct KeptMemo {
    const PartInfo* part;
    TensorLayout in_layout;
    std::vector<bool> recomputed;
    bool weight_inputs_only;
    std::vector<double> after;
  };
  mutable std::deque<KeptMemo> kept_memo;
  mutable std::vector<std::pair<const PartInfo*, double>> transient_memo;

  Compiler(const Plan& p, const Topology& t, Program& out)
      : plan(p), topo(t), prog(out), mesh(p.mesh), net(t) {}

  int label(const std::string& s) {
    auto [it, inserted] = label_index.emplace(s, static_cast<int>(prog.labels.size()));
    if (inserted) prog.labels.push_back(s);
    return it->second;
  }

  // The block layer `l` runs (graph.layer_at).
  const PartInfo& layer_at(int l) const { return blocks[prog.graph.block_index(l)]; }
  // The resolved part of one of the graph's parts.
  const PartInfo& info_of(const GraphPart& part) const {
    if (&part == &prog.graph.embedding) return embed;
    if (&part == &prog.graph.head) return head;
    return blocks[&part - prog.graph.blocks.data()];
  }
  // How many of a segment's layers run each block.
  std::vector<int> layer_counts(const Segment& s) const {
    std::vector<int> n(blocks.size(), 0);
    for (int l = s.first_layer; l < s.end_layer; ++l) ++n[prog.graph.block_index(l)];
    return n;
  }
  // The resolved parts a segment runs: its embedding, the blocks of its layers, its head.
  std::vector<const PartInfo*> segment_parts(const Segment& s) const {
    std::vector<const PartInfo*> out;
    if (s.embedding) out.push_back(&embed);
    const std::vector<int> count = layer_counts(s);
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (count[b] > 0) out.push_back(&blocks[b]);
    }
    if (s.head) out.push_back(&head);
    return out;
  }
  // The resolved parts: the embedding, the blocks and the head.
  std::vector<const PartInfo*> parts() const {
    std::vector<const PartInfo*> out{&embed};
    for (const PartInfo& b : blocks) out.push_back(&b);
    out.push_back(&head);
    return out;
  }
  Status check_basics();
  Status check_activation_offload() const;
  Status check_module_offload() const;
  // Every block shape leaves the hidden state in the first one's layout (a hybrid model's
  // residuals split alike).
  Status check_block_outputs() const;
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
  // Sub-batches (communication.tp_sub_batches) divide every operator's sequences on a GPU.
  Status check_sub_batches() const;
  // Each GradGroup's axes (group_axes); refuses DeepSpeed's per-tensor ZeRO-3 with experts.
  Status set_group_axes();
  // The schedule's orders, lane by lane (core/schedule_check.h).
  Status check_lane_orders() const;
  // Lane `o`'s blocks, prologue and epilogue (compile_steps.cc).
  void build_lane_steps(int o);
  void add_lane_blocks(int o, Lane& lane);
  void add_prologue_gathers(int o, Lane& lane);
  void add_epilogue(int o, Lane& lane, const std::vector<int>& segs);
  // The tied embedding's gradient sum between its first- and last-stage copies.
  void add_tied_embedding_sync();
  // Parameter offloading: the host copies beside ZeRO-3's gathers and reductions.
  void add_param_offload_copies();
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
  // The collectives converting tensor `t` from layout `have` to `want`, one step each.
  void append_tensor_conversions(const TensorSpec& t, const TensorLayout& have,
                                 const TensorLayout& want, int label,
                                 std::vector<Step>& steps) const;
  // A part's operators as steps; `layer`: the model layer a block part runs as (-1: the
  // embedding's or head's), whose sliding window prices its attention (PartInfo::window_costs).
  void emit_forward(const PartInfo& p, const TensorLayout& in_layout,
                    const std::vector<bool>& recomputed, bool only_recomputed, ComputeClass cls,
                    std::vector<Step>& steps, int layer = -1);
  void emit_backward(const PartInfo& p, const TensorLayout& in_layout,
                     const TensorLayout& in_grad_layout, const std::vector<bool>& recomputed,
                     bool input_grads, bool weight_grads, std::vector<Step>& steps, int layer = -1);
  // The window costs of operator `i` of part `p` in `layer`, or null (no windows, no layer, or
  // not an attention operator).
  const PartInfo::WindowCost* window_cost(const PartInfo& p, size_t i, int layer) const {
    if (layer < 0 || p.window_costs.empty() || p.part->ops[i].kind != OpKind::kAttention) {
      return nullptr;
    }
    return &p.window_costs[i][plan.model.is_windowed_layer(layer) ? 1 : 0];
  }
  // The compute seconds a micro-batch's forward, backward and recomputation of layer `layer`
  // (part `p`) save through its sliding window, against attending fully (0 for a full layer).
  double window_seconds_saved(const PartInfo& p, int layer) const;
  double kept_bytes(const PartInfo& p, const TensorLayout& in_layout,
                    const std::vector<bool>& recomputed, bool weight_inputs_only) const;
  // The same after each operator: element i is what operators 0..i save.
  const std::vector<double>& kept_bytes_after(const PartInfo& p, const TensorLayout& in_layout,
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
  // A per-part figure summed over a segment: its layers' (of each block shape), its embedding's
  // and its head's.
  double segment_sum(const Segment& s,
                     const std::function<double(const PartInfo&)>& per_part) const;
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
  int shared_expert_overlaps = 0;  // runs of shared-expert compute moved beside an exchange
};

// Tensor-parallel collectives of a block's steps hidden behind its compute
// (compile_overlap.cc): paired with the neighbouring GEMMs (Transformer Engine's overlap,
// communication.tp_overlap), or sub-pipelined over `k` sub-batches (Merak,
// communication.tp_sub_batches). Compute beside them is slowed by `interference` (by
// interference_beside, for the sub-pipelined ones).
void overlap_tp_collectives(std::vector<Step>& steps, uint32_t lane_axes, double interference);
void sub_pipeline_collectives(std::vector<Step>& steps, int k, uint32_t lane_axes,
                              const ComputeModel& model);

// Paired blocks (compile_pairs.cc): the orders' pairs ("F3@0+B1@7", DualPipe's overlapped
// forward-backward) and, with communication.ep_overlap, each forward block next to a backward
// block of another micro-batch in a lane's order, both with expert all-to-alls (Megatron-Core's
// combined 1F1B), merged into one block each. With ep_overlap, an error when no pair forms.
Status pair_blocks(Program& prog);

// communication.moe_shared_expert_overlap (compile_overlap.cc): the shared expert's compute
// beside the nearest expert exchange of the block. Returns how many runs of it moved.
int overlap_shared_expert(std::vector<Step>& steps, const std::vector<std::string>& labels,
                          const ComputeModel& model, bool backward);

// A partition or recompute rule that matches no operator is a typo (or a rule for another
// model), never a silent no-op.
Status check_rules_match(const Plan& plan, const OpGraph& graph);

// The layout a part's output leaves for the next part's input.
inline TensorLayout input_layout_of(const PartInfo& prev) {
  return prev.out_layouts.back();
}

}  // namespace nnsim::detail
