// A parallelization plan (plan.json, versioned; schema in docs/plan.md). It states nnScaler's
// three primitives for one data-parallel replica and says how replicas are made:
//
//  - op-trans: `partition` rules say how each operator is split: which of its dimensions is
//    split along which mesh axis. Operators a rule does not split are replicated; splitting a
//    dimension the operator sums over leaves partial sums (value split).
//  - op-assign: `segments` put consecutive layers (plus the embedding and the head) on a slice
//    of the device mesh (e.g. pipeline rank 3, all tensor-parallel ranks).
//  - op-order: `schedule` lists, for each slice of devices that runs the same program, the
//    order of its blocks (forward / backward / backward-input / backward-weight / recompute of
//    one micro-batch through one segment).
//
// Plus recomputation, optimizer sharding (ZeRO 0-3), communication settings and the placement of
// mesh ranks on GPUs. The communication an operator needs follows from the partitioning
// (core/layout.h). Data-parallel replicas and identical layers are described once: the plan's
// size does not grow with the data-parallel degree or the layer count.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model.h"
#include "core/opgraph.h"
#include "core/precision.h"

namespace nnsim {

inline constexpr int kPlanVersion = 1;
inline constexpr const char* kDataParallelAxis = "dp";

// The device mesh: named axes; a rank's coordinates are its row-major index (last axis
// innermost). The axis named "dp" holds the data-parallel replicas.
struct MeshAxis {
  std::string name;
  int size = 1;
};

// Axis sets travel as bit masks (collectives, gradient groups) and layouts hold one entry per
// axis inline (core/layout.h): a plan's mesh has at most this many axes.
inline constexpr int kMaxMeshAxes = 16;

struct Mesh {
  std::vector<MeshAxis> axes;

  int num_ranks() const;
  int axis_index(const std::string& name) const;  // -1 if absent
  int axis_size(const std::string& name) const;   // 1 if absent
  std::vector<int> coordinates(int rank) const;
  int rank_of(const std::vector<int>& coordinates) const;
  // The ranks whose coordinates differ from `rank`'s only along `axes`, in rank order (the
  // group of a collective over those axes).
  std::vector<int> ranks_along(int rank, const std::vector<std::string>& axes) const;
};

// Where mesh ranks sit on the cluster. GPU index = mixed-radix number over `factors`, outermost
// first; an axis may appear in several factors (its coordinate is split, most significant part
// first), which expresses mesh shapes such as "TP 8 as 2 nodes x 4 GPUs". Alternatively, `gpus`
// lists the GPU of every rank explicitly.
struct PlacementFactor {
  std::string axis;
  int size = 1;
};

struct Placement {
  std::vector<PlacementFactor> factors;
  std::vector<int> gpus;  // explicit: gpus[rank]; used when non-empty

  // GPU index of every rank.
  std::vector<int> gpu_of_rank(const Mesh& mesh) const;
};

// Split `dim` of the matched operators along the product of `axes`.
struct DimSplit {
  Dim dim = Dim::kBatch;
  std::vector<std::string> axes;
};

struct PartitionRule {
  std::string match;  // operator name pattern: "attn.qkv", "mlp.*", "*"
  std::vector<DimSplit> splits;
};

// A fixed coordinate per named mesh axis; axes not named are spanned. {"pp": 3} = every device
// whose pipeline coordinate is 3 (all tensor-parallel ranks of it, in every replica).
using MeshSlice = std::map<std::string, int>;

// Consecutive layers [first_layer, end_layer) on one mesh slice, optionally with the embedding
// before them and the head (final norm, output projection, loss) after them.
struct Segment {
  std::string name;
  int first_layer = 0;
  int end_layer = 0;
  bool embedding = false;
  bool head = false;
  MeshSlice devices;
};

enum class BlockKind {
  kForward,         // F
  kBackward,        // B: input and weight gradients
  kBackwardInput,   // BI: input gradients only (zero-bubble split)
  kBackwardWeight,  // BW: weight gradients only
  kRecompute,       // R: recompute a micro-batch's dropped activations ahead of its backward
};
std::string_view to_string(BlockKind k);  // "F", "B", "BI", "BW", "R"

struct Block {
  BlockKind kind = BlockKind::kForward;
  int micro_batch = 0;
  int segment = 0;
  // Forward blocks of a plan with repeated forwards (Plan::recycle > 1): which pass, 0 to
  // recycle - 1; the last keeps the activations its backward reads. 0 for every other block.
  int pass = 0;
  // Runs as one block with the next block of its order, a forward beside the backward of
  // another micro-batch, each one's expert all-to-alls beside the other's compute (DualPipe's
  // overlapped forward-backward; written "F3@0+B1@7").
  bool paired_with_next = false;
  bool operator==(const Block&) const = default;
};
// "F3@1": forward of micro-batch 3 through segment 1; "F3@1#2": its pass 2 (repeated forwards).
// The pair marker is the order's (DeviceOrder), not the block's text.
std::string to_string(const Block& b);
Expected<Block> parse_block(const std::string& text);

// The block order of every device in a slice.
struct DeviceOrder {
  MeshSlice devices;
  std::vector<Block> blocks;
};

// Operators whose activations are dropped after the forward pass and recomputed before their
// backward, in layers [first_layer, end_layer) (end_layer -1 = through the last layer).
struct RecomputeRule {
  std::string match;
  int first_layer = 0;
  int end_layer = -1;
};

struct OptimizerSpec {
  std::string kind = "adam";
  int zero = 0;  // 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (over "dp")
  // Bytes per parameter of the gradient buffer (2 = bf16/fp16, 4 = fp32 accumulation) and of
  // the optimizer state (fp32 master copy + two Adam moments = 12).
  double grad_bytes = 2;
  double state_bytes = 12;
  // ZeRO-3: bytes per parameter of the stored weight shard (2: a 16-bit shard, DeepSpeed;
  // 4: an fp32 shard that is also the master copy, PyTorch FSDP, whose state_bytes is then 8).
  double weight_shard_bytes = 2;
  // ZeRO-3: keep each parameter gathered from the first forward that needs it to the last
  // micro-batch's backward, with its unsharded gradient accumulated there (at the
  // communication's grad_reduce_bytes, else grad_bytes) and reduce-scattered once: one gather
  // and one reduce-scatter per iteration instead of per micro-batch, as PyTorch FSDP2 runs
  // under pipeline schedules.
  bool keep_gathered = false;
  // Optimizer offloading (Megatron-Core's --optimizer-cpu-offload, DeepSpeed's
  // offload_optimizer): the fraction of this device's optimizer shard whose state lives in
  // host memory and which the CPU updates. Its gradients cross PCIe to the host and its
  // updated parameters (offload_param_bytes each: 4 for Megatron's fp32 copy, 2 for
  // DeepSpeed's 16-bit one) come back. With offload_overlap the copies and the CPU's update run
  // tensor by tensor, concurrently (--overlap-cpu-optimizer-d2h-h2d); without, one after another.
  double offload_fraction = 0;
  bool offload_overlap = false;
  double offload_param_bytes = 4;
  // Parameter offloading (PyTorch FSDP's CPUOffload, DeepSpeed's offload_param): with ZeRO-3
  // and all of the optimizer offloaded, the device's parameter and gradient shards live on the
  // host too. Each parameter gather first copies its shard to the device, each gradient
  // reduction copies its shard back, both on the data-parallel stream, and the host's update
  // needs no copies of its own.
  bool offload_params = false;
};

struct CommSettings {
  // Data-parallel gradient reduction: bucket size (bytes of gradients) and whether buckets are
  // reduced during the backward pass (else after it).
  double dp_bucket_bytes = 40e6 * 4;
  bool overlap_grad_reduce = true;
  // ZeRO-1/2 parameter all-gather after the optimizer step overlapped with the next forward;
  // ZeRO-3 prefetches the next layers' parameters.
  bool overlap_param_gather = true;
  // Pipeline: send 1/t of a tensor replicated over `t` ranks and all-gather it on arrival.
  bool pp_scatter_gather = true;
  std::string algorithm = "auto";  // collective algorithm: auto, ring or tree
  // Tensor-parallel all-gathers and reduce-scatters overlapped with the GEMM next to them
  // (Transformer Engine's userbuffer overlap), instead of blocking before or after it.
  bool tp_overlap = false;
  // Merak's sub-pipelined tensor parallelism: each micro-batch runs through a block as this many
  // sub-batches along the batch, so that one sub-batch's blocking lane collectives (tensor,
  // context or expert parallel) run while the next computes; 1: off.
  int tp_sub_batches = 1;
  // ZeRO-3: gather parameters and reduce gradients tensor by tensor (DeepSpeed) rather than a
  // whole unit (layer) at once (FSDP).
  bool zero3_per_tensor = false;
  // ZeRO-3: a unit recomputed inside the backward pass is gathered twice there, for its
  // recomputation and again for its backward (DeepSpeed: the recomputed forward's hooks fetch
  // and release the parameters before the backward's hooks fetch them again).
  bool zero3_regather_for_recompute = false;
  // ZeRO-3 under DeepSpeed: a weight tensor of fewer elements than this stays whole on every
  // GPU and is never gathered (stage3_param_persistence_threshold: biases and norm scales);
  // 0: every tensor is sharded.
  double zero3_persistence_threshold = 0;
  // ZeRO-3 tensor by tensor: gradients wait in a bucket of up to this many elements and are
  // reduce-scattered together when the next tensor would overflow it and at the end of the
  // backward block (DeepSpeed's reduce_bucket_size); 0: each tensor on its own.
  double zero3_reduce_bucket = 0;
  // ZeRO-3 tensor by tensor: each operator waits for its own tensors' gathers, and the gathers
  // of the tensors after them are launched until at least this many elements are in flight
  // (DeepSpeed's stage3_prefetch_bucket_size); the gathered working set is those tensors, each
  // released after its operator. 0: a whole unit (layer) is gathered ahead (FSDP's prefetch).
  double zero3_prefetch_elements = 0;
  // Sequence parallelism: an input that arrives by all-gather (a norm's output, gathered for the
  // column-parallel linears) is saved for the backward as gathered, which then does not gather
  // it again (PyTorch's DTensor tensor parallelism, as torchtitan runs it); false: saved split
  // and gathered again in the backward (Megatron).
  bool save_gathered_inputs = false;
  // Bytes per element of gradient reduce-scatters / all-reduces (0: the gradient buffer's,
  // grad_bytes; frameworks may reduce in another precision than they accumulate).
  double grad_reduce_bytes = 0;
  // Pipeline memory as PyTorch's pipelining runtime (torch.distributed.pipelining) holds it: a
  // receive buffer per micro-batch for the activations (stages after the first) and for their
  // gradients (stages before the last), allocated once and held, and every micro-batch's stage
  // output (the last stage's: the model's fp32 logits) kept until the step ends; false:
  // Megatron's, which receives into a fresh tensor per transfer and frees an output once sent.
  bool pp_buffers_per_micro_batch = false;
  // Pipeline sends that hold the sender's compute stream until the transfer has completed
  // (Megatron-Core's non-interleaved schedules: batched p2p whose requests are waited on before
  // the next block); false: a send runs on its own stream while the sender computes on.
  bool pp_blocking_sends = false;
  // Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): a forward block and the
  // backward block of another micro-batch next to it in a device's order run as one, each one's
  // expert-parallel all-to-alls on a communication stream beside the other's compute.
  bool ep_overlap = false;
  // Megatron-Core's --moe-shared-expert-overlap: a mixture's shared expert computes on a stream
  // of its own beside the expert all-to-all next to it (not with ep_overlap, as Megatron-Core
  // refuses the two together).
  bool moe_shared_expert_overlap = false;
};

struct Plan {
  int version = kPlanVersion;
  std::string name;
  ModelSpec model;
  int global_batch = 0;  // sequences per optimizer step, whole job
  int micro_batch = 1;   // sequences per micro-batch per replica
  // Repeated forwards (AlphaFold's recycling): every micro-batch's forward runs `recycle` times
  // before its backward, pass i + 1 reading pass i's output; only the last pass keeps
  // activations for the backward, the earlier ones hold theirs only while they run.
  int recycle = 1;
  Precision precision = Precision::kBf16;
  // The training framework whose kernels and conventions the plan runs with: megatron, fsdp,
  // deepspeed or other (it picks kernel efficiencies; docs/cost-model.md).
  std::string framework = "megatron";
  Mesh mesh;
  Placement placement;
  std::vector<Segment> segments;
  std::vector<PartitionRule> partition;
  std::vector<RecomputeRule> recompute;
  // A recomputation stops once it has recomputed every tensor the backward needs, skipping the
  // operators after the last one that saves a tensor (PyTorch's non-reentrant checkpoint, whose
  // early stop is on by default); false: the whole recomputed region runs again (Megatron's and
  // DeepSpeed's checkpointing).
  bool recompute_early_stop = false;
  // Activation offloading (Megatron-Core's --cpu-offloading --cpu-offloading-num-layers N,
  // Transformer Engine's CPU offload): the activations the first N layers save for the backward
  // are copied to host memory during the forward, each layer's copy waited on by a later
  // layer's forward, and copied back during the backward ahead of their use (docs/cost-model.md,
  // "Activation offloading"). 0: none.
  int activation_offload_layers = 0;
  // Fine-grained activation offloading (Megatron-Core's --fine-grained-activation-offloading
  // --offload-modules): in every layer, what the operators matching these patterns save for
  // the backward is copied to the host after their forward and back one group ahead of their
  // backward, with pipelines too (docs/cost-model.md, "Fine-grained activation offloading").
  // Empty: none. Not with activation_offload_layers.
  std::vector<std::string> activation_offload_modules;
  // A mixture of experts' local experts run as one grouped-GEMM kernel (Megatron-Core's
  // --moe-grouped-gemm), else one GEMM after another.
  bool moe_grouped_gemm = false;
  // A mixture of experts' tokens exchanged through DeepEP's kernels (Megatron-Core's
  // --moe-token-dispatcher-type flex --moe-enable-deepep): over the expert-parallel axis, an
  // expert exchange (core/collective.h) instead of NCCL's all-to-all.
  bool moe_deepep = false;
  std::vector<DeviceOrder> schedule;
  OptimizerSpec optimizer;
  CommSettings comm;
  std::string schedule_name;  // informational ("1f1b"), as written by the builder
  int topology_gpus = 0;      // GPU count the plan was built for (0 = unchecked)
  std::string topology_name;  // informational

  int data_parallel() const { return mesh.axis_size(kDataParallelAxis); }
  int num_micro_batches() const;  // per replica, per iteration
  // Either form of activation offloading: copies of activations to the host and back.
  bool offloads_activations() const {
    return activation_offload_layers > 0 || !activation_offload_modules.empty();
  }
};

// plan.json <-> Plan. Reading checks the structure and the names (file, line and field in every
// message); semantic checks against a topology are in core/program.h.
Expected<Plan> load_plan(const std::string& path);
Expected<Plan> parse_plan(const std::string& json_text, const std::string& display_name);
std::string plan_to_json(const Plan& plan);

// Name matching used by partition and recompute rules: '*' matches any run of characters.
bool match_pattern(const std::string& pattern, const std::string& name);

}  // namespace nnsim
