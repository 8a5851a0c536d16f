// ZeRO: parameter units and buckets, the tensors ZeRO-3 gathers, shards and keeps whole, gradient
// buckets.
#include "core/compiler.h"

#include <fmt/format.h>

#include "core/host_copy.h"

namespace nnsim::detail {

std::vector<std::pair<int, double>> Compiler::gather_buckets(int segment, int group) const {
  const Segment& s = plan.segments[segment];
  // A tied output projection on the embedding's devices is the embedding's matrix (one
  // parameter, gathered with the embedding).
  const bool tied_here = plan.model.head_uses_embedding() && head_shares_embedding(segment);
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
    const PartInfo& p = info_of(*u.part);
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
  return segment_sum(s, sum);
}

double Compiler::segment_params(int segment, int group) const {
  // A tied output projection on the embedding's own devices is the embedding matrix itself.
  const bool shares_embedding = head_shares_embedding(segment);
  return segment_sum(plan.segments[segment],
                     [&](const PartInfo& p) { return part_params(p, group, shares_embedding); });
}

double Compiler::segment_sum(const Segment& s,
                             const std::function<double(const PartInfo&)>& per_part) const {
  const std::vector<int> count = layer_counts(s);
  double n = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (count[b] > 0) n += count[b] * per_part(blocks[b]);
  }
  if (s.embedding) n += per_part(embed);
  if (s.head) n += per_part(head);
  return n;
}

// Parameter offloading (FSDP's CPUOffload): every ZeRO-3 gather first copies this device's
// shard in from the host, every gradient reduction then copies its shard out (FSDP2's copy-in,
// and its reduce-scatter's copy to the host), on the data-parallel stream with the collective.
// The epilogue's gathers are of the persistent tensors, which stay on the device.
void Compiler::add_param_offload_copies() {
  if (!plan.optimizer.offload_params) return;
  auto shard_degree_of = [&](uint32_t axes) {
    int n = 1;
    for (size_t a = 0; a < mesh.axes.size(); ++a) {
      if (axes & (1u << a)) n *= mesh.axes[a].size;
    }
    return static_cast<double>(n);
  };
  auto add = [&](std::vector<Step>& steps, bool gathers) {
    for (Step& s : steps) {
      if (s.kind != StepKind::kDpLaunch) continue;
      const double shard = shard_degree_of(s.axes);
      if (s.collective == CollectiveKind::kAllGather && gathers) {
        const double elements = s.bytes / compute_weight_bytes(plan) / shard;
        s.host_bytes = elements * plan.optimizer.weight_shard_bytes;
        s.host_seconds = host_copy_seconds(s.host_bytes, false, topo, prog.compute_model);
      } else if (s.collective == CollectiveKind::kReduceScatter) {
        s.host_bytes = s.bytes / shard;
        s.host_seconds = host_copy_seconds(s.host_bytes, true, topo, prog.compute_model);
      }
    }
  };
  for (BlockTemplate& t : prog.templates) add(t.steps, true);
  for (Lane& lane : prog.lanes) {
    add(lane.prologue, true);
    add(lane.epilogue, false);
  }
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

// Each GradGroup's data-parallel axes: dp and the axes every weighted operator of the group
// syncs over.
Status Compiler::set_group_axes() {
  const int dp_axis = mesh.axis_index(kDataParallelAxis);
  // Each GradGroup's buckets sync over dp and the axes every weighted operator of the group
  // syncs over (context parallelism; expert parallelism for the dense weights);
  // operator-specific sync axes (sequence-parallel norms over tp) get their own small
  // all-reduce at the end of the iteration.
  std::array<uint32_t, kNumGradGroups> common;
  common.fill(~0u);
  for (const PartInfo* p : parts()) {
    for (size_t i = 0; i < p->part->ops.size(); ++i) {
      if (!p->part->ops[i].weights.empty()) common[p->grad_group[i]] &= p->sync_axes[i];
    }
  }
  for (int g = 0; g < kNumGradGroups; ++g) {
    group_axes[g] = (1u << dp_axis) | (common[g] == ~0u ? 0u : common[g]);
  }
  if (common[kExpertGrads] == ~0u) group_axes[kExpertGrads] = group_axes[kDenseGrads];
  if (plan.optimizer.zero == 3 && plan.comm.zero3_per_tensor &&
      group_axes[kExpertGrads] != group_axes[kDenseGrads]) {
    return Error(
        "communication.zero3_per_tensor: ZeRO-3 tensor by tensor (DeepSpeed) with experts spread "
        "over a mesh axis (expert parallelism) is not supported, as DeepSpeed's engine does not "
        "run it (\"MoE not supported with Stage 3\"): the experts' and the dense weights' "
        "tensors shard over different groups; gather whole layers (FSDP: "
        "zero3_per_tensor false), use optimizer.zero 0-2, or do not split the experts' 'expert' "
        "dimension");
  }
  return Status::Ok();
}

}  // namespace nnsim::detail
