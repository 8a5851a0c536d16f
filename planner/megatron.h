// The pinned plan builder: a fully specified plan with Megatron-LM semantics from parallel
// degrees. Column-parallel QKV and first MLP matmul, row-parallel output projections,
// vocab-parallel embedding, head and loss; optional sequence parallelism (norms, dropout and
// residuals split along the sequence over tp); context parallelism (everything split along the
// sequence over cp, ring attention); expert parallelism (the experts spread over ep of the
// data-parallel ranks, tokens exchanged by all-to-all); pipeline stages of consecutive layers
// with the embedding on the first and the head on the last; ranks placed tensor-parallel
// innermost.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/schedules.h"

namespace nnsim {

enum class RecomputeMode { kNone, kSelective, kFull };
Expected<RecomputeMode> parse_recompute_mode(const std::string& name);
std::string_view to_string(RecomputeMode m);

struct MegatronOptions {
  int tp = 1;
  int pp = 1;
  int dp = 0;  // 0: whatever the topology's GPU count leaves
  int cp = 1;
  // Expert parallelism (mixture-of-experts models): the experts spread over `ep` ranks, carved
  // out of the data-parallel ones (Megatron-Core's --expert-model-parallel-size), which each
  // keep their own sequences in the dense operators; `dp` counts them all and must be a
  // multiple of `ep`.
  int ep = 1;
  // Expert tensor parallelism: 0 (or tp) splits every expert along its width over tp, as the
  // MLP; 1 keeps experts whole and spreads them over the tensor-parallel ranks too (each holds
  // experts / (ep tp); Megatron-Core's --expert-tensor-parallel-size 1, "parallel folding").
  int expert_tp = 0;
  int vpp = 1;  // model chunks per pipeline rank (interleaved schedule)
  bool sequence_parallel = false;
  int micro_batch = 1;
  int global_batch = 0;
  RecomputeMode recompute = RecomputeMode::kNone;
  int zero = 0;
  ScheduleKind schedule = ScheduleKind::kOneFOneB;
  std::optional<Precision> precision;  // default: the model's
  std::vector<int> stage_layers;       // layers per segment; empty: as even as possible
  // Stage-aware recomputation (Merak; Megatron's --recompute-method block): per segment, how
  // many of its first layers are fully recomputed; the others follow `recompute`. Empty: every
  // layer follows `recompute`.
  std::vector<int> recompute_layers;
  // Recomputation mode per pipeline stage (all chunks of a stage alike); replaces `recompute`.
  std::vector<RecomputeMode> stage_recompute;
  // Operators (name patterns) whose activations every layer drops and recomputes, on top of the
  // mode: a per-module recomputation policy.
  std::vector<std::string> recompute_modules;
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = true;
  std::string algorithm = "auto";
  // Overlap tensor-parallel all-gathers / reduce-scatters with the neighbouring GEMMs
  // (Transformer Engine's --tp-comm-overlap).
  bool tp_comm_overlap = false;
  // Merak's sub-pipelined tensor parallelism: sub-batches per micro-batch (1: off).
  int tp_sub_batches = 1;
  // A mixture of experts' local experts as one grouped-GEMM kernel (--moe-grouped-gemm).
  bool moe_grouped_gemm = false;
  // A mixture of experts' tokens exchanged through DeepEP (--moe-deepep; Plan::moe_deepep).
  bool moe_deepep = false;
  // Megatron-Core's combined 1F1B: a forward and the backward of another micro-batch run
  // together, each one's expert all-to-alls beside the other's compute (--ep-overlap;
  // Plan comm.ep_overlap).
  bool ep_overlap = false;
  // A mixture's shared expert beside the expert all-to-alls (--moe-shared-expert-overlap;
  // Plan comm.moe_shared_expert_overlap).
  bool moe_shared_expert_overlap = false;
  // DeepSpeed ZeRO-3's stage3_param_persistence_threshold (elements); negative: its default
  // (1e5). Only with framework deepspeed and ZeRO-3.
  double zero3_persistence_threshold = -1;
  // DeepSpeed ZeRO-3's stage3_prefetch_bucket_size (elements gathered ahead of the operator
  // that waits); negative: its default (5e7). Only with framework deepspeed and ZeRO-3.
  double zero3_prefetch_elements = -1;
  // Optimizer offloading (Plan optimizer.offload_fraction): the fraction of each device's
  // optimizer shard the host keeps and updates (Megatron-Core's --optimizer-cpu-offload with
  // --optimizer-offload-fraction; DeepSpeed's offload_optimizer), and whether the copies and
  // the host's update overlap tensor by tensor (--overlap-cpu-optimizer-d2h-h2d). Under FSDP
  // (ZeRO-3, fraction 1) it is CPUOffload: the parameter and gradient shards go to the host too.
  double optimizer_offload = 0;
  bool offload_overlap = false;
  // DeepSpeed's offload_param (ZeRO-3 with all of the optimizer state offloaded): the parameter
  // shards live on the host too, as FSDP's CPUOffload keeps them by itself.
  bool offload_params = false;
  // Activation offloading (Plan activation_offload_layers): the activations of the first this
  // many layers are copied to the host and back (Megatron-Core's --cpu-offloading
  // --cpu-offloading-num-layers); one pipeline stage, no recomputation.
  int activation_offload = 0;
  // Fine-grained activation offloading (Plan activation_offload_modules): Megatron-Core's
  // --offload-modules names (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1,
  // moe_act) or operator name patterns; with pipelines and recomputation too.
  std::vector<std::string> offload_modules;
  // Rank placement, outermost axis first (the innermost varies fastest over GPU indices):
  // Megatron's default puts tensor parallelism innermost, pipeline outermost; with expert
  // parallelism "ep" goes just outside "cp" unless the order names it.
  std::vector<std::string> placement = {"pp", "dp", "cp", "tp"};
  // Whose conventions for gradient and optimizer precision: megatron, fsdp (PyTorch FSDP),
  // deepspeed, other (plain data parallelism). See docs/plan.md.
  std::string framework = "megatron";
  // GPUs the plan must not use (faulty or reserved). Ranks then go to the other GPUs, whole
  // nodes without avoided GPUs first, and GPUs that the degrees cannot use stay idle.
  std::vector<int> avoid_gpus;
  // The head (final norm, output projection, loss) as its own segment spanning every pipeline
  // stage, its vocabulary split over pp (and tp): Tessel's sharded head. 1f1b and gpipe only.
  bool shard_head = false;
  // The embedding likewise (its vocabulary split over pp; its partial sums all-reduced over
  // the stages): with the head, Tessel's M shape. Its joint blocks would stall the hand-built
  // schedules' warm-up, so it is scheduled by Tessel's search only (--schedule tessel), within
  // the GPUs' memory less `memory_headroom`.
  bool shard_embedding = false;
  double memory_headroom = 0.1;
  // Repeated forwards (training.recycle): forward passes per micro-batch before its backward
  // (gpipe, 1f1b and tessel; add_forward_passes).
  int recycle = 1;
  // The cost model the list-scheduled and searched schedules time blocks with: the one the plan
  // will be compiled and simulated with.
  CompileOptions costs;
};

Expected<Plan> build_megatron_plan(const ModelSpec& model, const Topology& topo,
                                   const MegatronOptions& options);

// Optimizer offloading's options against the framework and the cluster: a fraction from 0 to 1,
// overlap only with offloading, all of it without overlap under FSDP (whose CPUOffload moves the
// parameter and gradient shards too) or with DeepSpeed's parameter offloading (`params`), and
// a topology that describes its host.
Status check_optimizer_offload(double fraction, bool overlap, const std::string& framework,
                               const Topology& topo, bool params = false);

// Activation offloading's options against the model, the rest of the plan and the cluster, as
// Megatron-Core takes them: fewer layers than the model has, one pipeline stage, no
// recomputation, Megatron's framework and a topology that describes its host.
Status check_activation_offload(const ModelSpec& model, const MegatronOptions& options,
                                const Topology& topo);

// Fine-grained offloading's modules as operator patterns of the model: Megatron-Core's names
// become the operators they wrap (those the model has), anything else must be a pattern that
// matches an operator of a layer.
Expected<std::vector<std::string>> offload_module_patterns(const ModelSpec& model,
                                                           const std::vector<std::string>& modules);

// Megatron-Core's offloadable modules this model's layers have, in the order the search adds
// them: those whose backward is long enough to hide a copy back first (attention, experts,
// projections), the cheap ones Megatron-Core advises recomputing instead (activations, norms)
// last.
std::vector<std::string> offloadable_modules(const ModelSpec& model);

// Every pattern of a per-module recomputation policy (`recompute_modules`) must match an
// operator of the model's blocks; the error names the first that does not and lists them.
Status check_recompute_modules(const ModelSpec& model, const std::vector<std::string>& modules);

// The builder's mesh for degrees `o` with `dp` data-parallel ranks: [dp, pp, cp, tp], and with
// expert parallelism [dp / ep, pp, ep, cp, tp] (the replicas are what ep leaves of dp).
Mesh megatron_mesh(const MegatronOptions& o, int dp);

// A rank order with "ep" where the builder puts it when the order leaves it out: just outside
// "cp" (Megatron-Core's tp-cp-ep-dp-pp). Unchanged without expert parallelism (ep 1).
std::vector<std::string> with_expert_axis(std::vector<std::string> order, int ep);

// Placement factors from a rank order over the mesh axes, outermost first: entries "axis" or
// "axis:size" (a part of a split axis, most significant first; an entry without a size takes
// the rest of its axis). Every axis must be covered.
Expected<Placement> placement_from_order(const Mesh& mesh, const std::vector<std::string>& order);

// The GPUs a plan may use when avoiding `avoid`: GPUs of nodes without avoided GPUs first, then
// the rest, each in index order. Fails on a GPU the topology does not have.
Expected<std::vector<int>> usable_gpus(const Topology& topo, const std::vector<int>& avoid);

// Layers per segment for `segments` segments: as even as possible, with the first and last
// segments (which also hold the embedding and the head) taking the shortfall first.
std::vector<int> split_layers(int layers, int segments);

}  // namespace nnsim
