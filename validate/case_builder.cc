#include "validate/case_builder.h"

#include <fmt/format.h>

namespace nnsim {

Expected<Topology> case_topology(const ValidationCase& c) {
  const bool a100 = c.cluster.gpu.rfind("a100", 0) == 0;
  Expected<Topology> base = load_topology(a100 ? "dgx-a100x4" : "dgx-h100-superpod");
  if (!base) return base.error();
  Topology t = *base;
  Expected<GpuSpec> gpu = find_gpu(c.cluster.gpu);
  if (!gpu) return gpu.error().with_context(fmt::format("case {}: cluster.gpu", c.id));
  t.name = c.id + "-cluster";
  t.description = fmt::format(
      "case {}: {} nodes of {} {}, NVSwitch, {} x {:g} Gb/s NICs a node, on the fabric of preset "
      "{}",
      c.id, c.cluster.nodes, c.cluster.gpus_per_node, c.cluster.gpu, c.cluster.nics_per_node,
      c.cluster.nic_bandwidth * 8 / 1e9, a100 ? "dgx-a100x4" : "dgx-h100-superpod");
  t.gpu = *gpu;
  t.intra.bandwidth = gpu->nvlink_bandwidth;
  t.gpus_per_node = c.cluster.gpus_per_node;
  // NICs: the case's count and speed, GPUs spread evenly over them. No case states its PCIe
  // tree, and none offloads (the only traffic PCIe would slow beside the NICs'), so the
  // preset's tree, laid out for its own NICs, is left out.
  t.intra.has_pcie = false;
  t.intra.pcie = {};
  const int nics = c.cluster.nics_per_node;
  t.nics.assign(nics, t.nics.front());
  for (int n = 0; n < nics; ++n) {
    t.nics[n].bandwidth = c.cluster.nic_bandwidth;
    t.nics[n].gpus.clear();
  }
  for (int g = 0; g < t.gpus_per_node; ++g) {
    t.nics[static_cast<size_t>(g) * nics / t.gpus_per_node].gpus.push_back(g);
  }
  Expected<Topology> sized = resize_topology(t, c.cluster.nodes);
  if (!sized) return sized.error().with_context(fmt::format("case {}", c.id));
  return sized;
}

Expected<MegatronOptions> case_options(const ValidationCase& c) {
  const ValidationParallel& p = c.parallel;
  MegatronOptions o;
  o.tp = p.tp;
  o.pp = p.pp;
  o.dp = p.dp;
  o.cp = p.cp;
  o.vpp = p.vp;
  o.sequence_parallel = p.sequence_parallel;
  o.micro_batch = p.micro_batch;
  o.global_batch = p.global_batch;
  Expected<RecomputeMode> rec = parse_recompute_mode(p.recompute);
  if (!rec) return rec.error();
  o.recompute = *rec;
  o.zero = p.zero;
  o.precision = p.precision;
  o.schedule = p.vp > 1 ? ScheduleKind::kInterleaved : ScheduleKind::kOneFOneB;
  o.framework = p.framework;
  // Megatron-Core / NeMo on Hopper run Transformer Engine with tensor-parallel communication
  // overlapped with the GEMMs (the NeMo recipes enable it); earlier Megatron did not.
  o.tp_comm_overlap = p.framework == "megatron" && c.cluster.gpu.rfind("a100", 0) != 0;
  return o;
}

Expected<Plan> case_plan(const ValidationCase& c, const Topology& topology) {
  Expected<MegatronOptions> o = case_options(c);
  if (!o) return o.error().with_context(fmt::format("case {}", c.id));
  // The loss is the training code's: PyTorch FSDP loops call F.cross_entropy on the fp32 logits
  // (torchtitan; under loss_parallel() on the vocabulary-sharded logits with tensor
  // parallelism), except llm-foundry, whose MPT models use flash-attn's cross-entropy kernel;
  // Megatron runs its vocab-parallel cross-entropy step by step (--cross-entropy-loss-fusion is
  // off by default).
  ModelSpec model = c.model;
  if (o->framework == "megatron") {
    model.loss = LossKernel::kVocabParallel;
  } else if (o->framework == "fsdp" && model.family == "mpt") {
    model.loss = LossKernel::kFlashAttn;
  } else if (o->framework == "fsdp") {
    model.loss = o->tp > 1 ? LossKernel::kLossParallel : LossKernel::kUnfused;
  }
  // fp16 Megatron and DeepSpeed runs are the GPT-3-era configuration (2021-22, before
  // FlashAttention reached Megatron): the fused scale-mask-softmax materializes the scores, and
  // dropout follows the embedding, the attention scores and both sub-blocks.
  const bool gpt3_era = (o->framework == "megatron" || o->framework == "deepspeed") &&
                        o->precision.value_or(c.model.precision) == Precision::kFp16;
  if (gpt3_era) {
    model.attention = AttentionKernel::kUnfused;
    model.dropout = true;
  }
  // Megatron-style ALiBi ran through the unfused softmax: Megatron-DeepSpeed (BLOOM) adds the
  // ALiBi bias to the materialized scores, and FlashAttention gained ALiBi only in v2.4
  // (December 2023); Megatron-LM itself has no ALiBi.
  if (o->framework == "megatron" && model.position == PositionKind::kAlibi) {
    model.attention = AttentionKernel::kUnfused;
  }
  Expected<Plan> plan = build_megatron_plan(model, topology, *o);
  if (!plan) return plan.error().with_context(fmt::format("case {}", c.id));
  return plan;
}

}  // namespace nnsim
