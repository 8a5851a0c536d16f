// A plan compiled for a cluster: what every device runs, step by step, with the compute time of
// every step, the collectives and point-to-point transfers between them, and the memory each
// block keeps. The simulator replays it; analytical estimators can walk it too.
//
// Devices that run the same blocks in lockstep (the tensor- and context-parallel ranks of one
// pipeline stage of one replica) share one program: a "lane". Collectives along axes inside a
// lane join only that lane; collectives along other axes (data parallel, or the pipeline axis
// of a segment spanning several stages) or transfers to other segments (pipeline) connect
// lanes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/calibration.h"
#include "core/collective.h"
#include "core/cost_model.h"
#include "core/layout.h"
#include "core/network.h"
#include "core/opgraph.h"
#include "core/optimizer_offload.h"
#include "core/plan.h"
#include "core/topology.h"

namespace nnsim {

// What a stretch of compute was doing, for the breakdown.
enum class ComputeClass : uint8_t { kCompute, kRecompute, kOptimizer };

enum class StepKind : uint8_t {
  kCompute,     // the compute stream is busy for `seconds`
  kCollective,  // a blocking collective on the compute stream (tensor/context parallel)
  kRecv,        // wait for a transfer from another segment
  kSend,        // start a transfer to another segment (blocks the compute stream if `blocking`)
  kDpLaunch,    // queue a collective on the data-parallel stream (gradient or parameter)
  kDpWait,      // wait for queued data-parallel collectives (all, or those with `tag`)
  kMemory,      // allocate (+) or free (-) `bytes`
  // A paired block's expert all-to-all (Plan comm.ep_overlap): queued on the lane's expert
  // communication stream, which runs them one after another while compute goes on, and waited
  // for (by `tag`) before the compute that needs it.
  kCommLaunch,
  kCommWait,
  // Activation offloading (Plan::activation_offload_layers, activation_offload_modules): a copy
  // of `bytes` taking `seconds` queued on the lane's stream to the host (`to_host`) or back,
  // which runs its copies one after another while compute goes on; and a wait for every copy
  // queued on it so far but the last `tag` (-1: every copy).
  kHostCopyLaunch,
  kHostCopyWait,
};

struct Step {
  StepKind kind = StepKind::kCompute;
  ComputeClass compute_class = ComputeClass::kCompute;
  CollectiveKind collective = CollectiveKind::kAllReduce;
  uint32_t axes = 0;      // mesh axes of the collective, as a bitmask over Mesh::axes
  double seconds = 0;     // kCompute; for kCollective with overlap: compute running alongside
  double flops = 0;       // model FLOPs of a kCompute step (for throughput and MFU)
  double bytes = 0;       // collective / transfer / memory bytes (per device)
  int peer_segment = -1;  // kSend / kRecv: the other segment
  int peer_lane = -1;     // kSend: the receiving lane; kRecv: the sending lane
  bool gradient = false;  // kSend / kRecv: a backward transfer
  // kSend / kRecv: repeated forwards' transfer of a pass's output from the last segment to the
  // first segment of the next pass (the receiving block's pass is the sender's plus one).
  bool recycle = false;
  // kSend: the compute stream waits until the transfer has completed (plan.comm's
  // pp_blocking_sends); otherwise it runs on the sender's send stream while compute goes on.
  bool blocking = false;
  bool to_host = false;  // kHostCopyLaunch / kHostCopyWait: the stream to the host, else back
  // kDpLaunch under parameter offloading (OptimizerSpec::offload_params): the copy of this
  // device's shard the data-parallel stream runs with the collective, from the host before a
  // gather, to it after a reduction: `host_bytes` taking `host_seconds` alone.
  double host_seconds = 0;
  double host_bytes = 0;
  int tag = -1;    // kDpLaunch / kDpWait: what to wait for (-1: everything); kHostCopyWait above
  int group = -1;  // kCollective over an explicit group (Program::explicit_groups)
  int label = -1;  // index into Program::labels ("attn.qkv", "grad bucket 3", ...)
  bool matmul = false;  // kCompute of a linear operator (a GEMM)
  // A paired block's step: 0 belongs to the instance's block, 1 to its partner (transfers and
  // joint collectives are keyed by their own block's micro-batch).
  uint8_t member = 0;
};

// The steps of one kind of block (one segment, one block kind, one variant), shared by every
// micro-batch that runs it.
struct BlockTemplate {
  int segment = 0;
  int lane = 0;  // a segment spanning several lanes has templates per lane (transfers differ)
  BlockKind kind = BlockKind::kForward;
  std::vector<Step> steps;
  // Repeated forwards: the pass of the first forward made with this template (passes with the
  // same role, Compiler::pass_role, share it: earlier passes keep nothing).
  int pass = 0;
  double kept_bytes = 0;  // activation bytes the block leaves allocated (negative: frees)
  double peak_bytes = 0;  // extra bytes above the level at the block's start, at its peak
  // A forward and a backward merged into one (comm.ep_overlap, or a pair of the orders):
  // `kind` is the forward's; the steps' `member` says whose each is.
  bool paired = false;
};

struct BlockInstance {
  Block block;
  int template_index = 0;
  // A pair (comm.ep_overlap, or the orders'): the backward block run together with `block` (a
  // forward), in one template.
  bool paired = false;
  Block partner;
};
// "F3@1", or for a pair "F3@1+B1@2".
std::string to_string(const BlockInstance& b);

// Static memory of a device, bytes.
struct StaticMemory {
  double weights = 0;    // ZeRO-3: this device's shards
  double gradients = 0;  // ZeRO-2/3: this device's shards
  double optimizer = 0;
  // ZeRO-3's working set through the iteration: the gathered weights of the unit in use and the
  // one prefetched, and one unit's unsharded gradients (with keep_gathered, every parameter's).
  double gathered = 0;
  double comm_buffers = 0;
  // Pipeline receive buffers held through the iteration (comm.pp_buffers_per_micro_batch).
  double pipeline_buffers = 0;
  double runtime = 0;  // CUDA context and libraries
  double total() const {
    return weights + gradients + optimizer + gathered + comm_buffers + pipeline_buffers + runtime;
  }
};

struct Lane {
  MeshSlice slice;                    // the schedule slice this lane's devices belong to
  std::vector<int> ranks;             // mesh ranks of the lane (one replica), lockstep members
  std::vector<int> gpus;              // their GPUs
  int replica = 0;                    // data-parallel coordinate
  std::vector<Step> prologue;         // before the first block (parameter gathers)
  std::vector<BlockInstance> blocks;  // in schedule order
  std::vector<Step> epilogue;         // gradient sync waits, optimizer step
  StaticMemory memory;
  double parameters = 0;  // parameters held per device (before ZeRO sharding)
  double host_bytes = 0;  // host memory a device's offloaded optimizer shard and activations take
  // Optimizer offloading: the parts of the optimizer step (all 0 without offloading).
  OffloadedStep offloaded_step;
  // Activation offloading: the activation bytes a micro-batch's forwards copy to the host (and
  // its backwards back), per device, over the lane's segments; in host_bytes as the order has
  // them in flight.
  double offloaded_activations = 0;
};

struct Program {
  Plan plan;
  Topology topology;
  OpGraph graph;
  ComputeModel compute_model;
  CommModel comm_model;
  // The router's figures an expert exchange needs (Plan::moe_deepep); empty otherwise.
  ExpertRouting expert_routing;
  Algorithm algorithm = Algorithm::kAuto;
  std::vector<int> gpu_of_rank;
  std::vector<BlockTemplate> templates;
  std::vector<Lane> lanes;  // the lanes of replica 0; other replicas run the same programs
  // The lanes each segment runs on: one, or several for a segment spanning pipeline stages
  // (its collectives along the axes that separate them join those lanes).
  std::vector<std::vector<int>> lanes_of_segment;
  uint32_t lane_axes = 0;  // mesh axes spanned inside a lane
  int replicas = 1;        // data-parallel degree
  std::vector<std::string> labels;
  // Explicit groups (the tied embedding's first/last stage pair): for each, the member ranks of
  // each parallel group, replica 0; other replicas shift by the replica stride.
  std::vector<std::vector<std::vector<int>>> explicit_groups;
  int micro_batches = 0;
  // Activation bytes one device keeps for the backward pass per micro-batch, for each layer
  // (under that layer's partitioning and recompute rules).
  std::vector<double> layer_activation_bytes;
  // Sliding windows: for each layer, the compute seconds a micro-batch's forward, backward and
  // recomputation save through its window, against attending fully (0 for a full layer). Empty
  // for a model without windows.
  std::vector<double> layer_window_seconds;
  double model_flops_per_iteration = 0;  // Megatron-convention FLOPs, whole job
  double tokens_per_iteration = 0;

  // Ranks that share every coordinate of `rank` outside the axes in `axes_mask` (the group of
  // `rank` along those axes), in mesh order.
  std::vector<int> group_of(int rank, uint32_t axes_mask) const;
  std::string axes_name(uint32_t axes_mask) const;  // "tp", "dp+cp", ...
  // The rank holding the same position as `rank` in data-parallel replica `replica`.
  int rank_in_replica(int rank, int replica) const;
  // Whether some block is a pair (comm.ep_overlap or the orders' pairs): its expert all-to-alls
  // run on a stream of their own.
  bool has_pairs() const;
};

// The compute model a plan runs with on `gpu` by default: the GPU's constants with the plan's
// framework's kernels (its attention library; Megatron's fused elementwise kernels).
ComputeModel default_compute_model(const Plan& plan, const GpuSpec& gpu);

struct CompileOptions {
  ComputeModel compute_model;
  bool use_default_compute_model = true;  // default_compute_model(plan, topology GPU)
  CommModel comm_model;
  bool use_default_comm_model = true;  // CommModel::defaults_for(topology GPU)
  // Applied on top of the default models when set (its entry for the topology's GPU).
  const Calibration* calibration = nullptr;
};

// The m x n x k of a linear operator's piece on one device under its partition: the GEMM the
// compiler prices with op_seconds (the backward's two GEMMs transpose it).
PieceShape linear_piece_shape(const Op& op, const OpPartition& p, const Mesh& mesh);

// The operators of `part` the plan's recompute rules recompute: in layer `layer`, or with
// `layer` -1 in the embedding or the head (only rules without a layer range reach those).
std::vector<bool> recomputed_ops(const Plan& plan, const GraphPart& part, int layer);

// One operator's use of its weights in a block, in the order ZeRO-3 tensor by tensor gathers
// them (DeepSpeed's prefetch queue, comm.zero3_prefetch_elements).
struct Zero3Use {
  int unit = 0;  // the segment's parameter unit: its embedding, each layer, its head, in order
  const GraphPart* part = nullptr;  // the graph's embedding, layer or head
  int layer = -1;                   // the model's layer (the layer part), else -1
  size_t op = 0;                    // index into part->ops
  bool recompute = false;           // for its recomputation inside the backward
};

// Whether ZeRO-3 gathers tensor by tensor with DeepSpeed's prefetch (zero3_prefetch_elements).
bool zero3_prefetches_tensors(const Plan& plan);

// DeepSpeed's prefetch window: the tensors `elements` in the order they are used; an operator
// whose own are [first, end) and which finds [0, launched) gathered or in flight launches its
// own, then those after them until at least `prefetch` elements are in flight after its own.
// Returns the new end of what is launched.
size_t zero3_launch_through(const std::vector<double>& elements, size_t end, size_t launched,
                            double prefetch);

// The uses of a `kind` block of `segment`: a forward's every operator in forward order; a
// backward's (B, BI, BW) unit by unit backwards, each operator in reverse order, preceded in a
// B or BI block (without explicit R blocks) by the operators its recomputation replays, in
// forward order. An R block's: none (it runs on the backward's gathers). Which of them hold
// weights is the caller's to say.
std::vector<Zero3Use> zero3_uses(const Plan& plan, const OpGraph& graph, int segment,
                                 BlockKind kind, bool explicit_recompute);

// The operators of `part` a recomputation runs, given those the plan's rules recompute
// (`recomputed`): all of them, or with `early_stop` (Plan::recompute_early_stop) up to the last
// one that saves a tensor for the backward.
std::vector<bool> replayed_ops(const GraphPart& part, const std::vector<bool>& recomputed,
                               bool early_stop);

// Checks the plan against the model and topology and compiles it. Errors say what is wrong and
// how to fix it (degrees that do not divide, a schedule that misses a block, ...).
Expected<Program> compile_plan(const Plan& plan, const Topology& topology,
                               const CompileOptions& options = {});

}  // namespace nnsim
