// Fine-grained activation offloading (Plan::activation_offload_modules), as Megatron-Core's
// --fine-grained-activation-offloading runs it: each chosen operator's saved tensors are one
// group, copied to the host on the lane's copy stream once the operator's forward has run, and
// copied back one group ahead of the backward that needs them (docs/cost-model.md,
// "Fine-grained activation offloading").
#include <algorithm>
#include <utility>
#include <vector>

#include "core/block_builder.h"

namespace nnsim::detail {

// A chunk whose backward runs right after its forward (the pipeline's last segment) keeps its
// last layer's groups on the GPU, as Megatron-Core does: they would come back at once.
std::vector<BlockBuilder::ModuleGroup> BlockBuilder::module_groups(
    const PartInfo& p, int l, const std::vector<bool>& recomputed) const {
  std::vector<ModuleGroup> groups;
  if (l == s_.end_layer - 1 && seg_ == c_.segment_order.back()) return groups;
  const std::vector<double>& saved = c_.kept_bytes_after(p, layer_in(l), recomputed, false);
  const auto& ops = p.part->ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    const bool chosen = std::any_of(
        plan_.activation_offload_modules.begin(), plan_.activation_offload_modules.end(),
        [&](const std::string& m) { return match_pattern(m, ops[i].name); });
    // A recomputed operator's tensors are dropped, and what its recomputation starts from stays
    // with the checkpoint.
    const double bytes = saved[i] - (i > 0 ? saved[i - 1] : 0.0);
    if (chosen && !recomputed[i] && bytes > 0) groups.push_back({i, bytes});
  }
  return groups;
}

// A group's copy starts after its operator's steps and the collectives that follow them (a
// sequence-parallel reduce-scatter stays next to its GEMM). The layer's end waits for the copies
// the layer before started: at most one layer's groups are on their way, which is what the
// memory peaks count (Megatron-Core does not wait; where its copies would fall behind, nnsim
// charges the time instead of holding the memory longer).
void BlockBuilder::offload_modules_forward(int i, size_t start) {
  if (!module_offload_ || reload_order_.empty()) return;
  const PartInfo& p = c_.layer_at(s_.first_layer + i);
  std::vector<Step>& steps = *steps_;
  const auto& groups = act_.module_groups[i];
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) {
    size_t at = steps.size();
    for (size_t k = steps.size(); k > start; --k) {
      if (steps[k - 1].label == p.labels[g->op]) {
        at = k;
        break;
      }
    }
    while (at < steps.size() && steps[at].kind == StepKind::kCollective) ++at;
    steps.insert(steps.begin() + static_cast<std::ptrdiff_t>(at), copy_step(g->bytes, true));
  }
  steps.push_back(copy_wait_step(true, static_cast<int>(groups.size())));
}

void BlockBuilder::reload_first_module() {
  reloaded_ = 0;
  if (module_offload_ && !reload_order_.empty()) {
    steps_->push_back(copy_step(reload_order_.front(), false));
  }
}

// Before a group's operator runs its backward: the next group's reload starts, and the backward
// waits for its own group's (Megatron-Core's group start in the backward).
void BlockBuilder::reload_modules_backward(int i, size_t start) {
  if (!module_offload_) return;
  const PartInfo& p = c_.layer_at(s_.first_layer + i);
  std::vector<Step>& steps = *steps_;
  const auto& groups = act_.module_groups[i];
  std::vector<std::pair<size_t, std::vector<Step>>> inserts;
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) {
    size_t at = steps.size();
    for (size_t k = start; k < steps.size(); ++k) {
      if (steps[k].label == p.labels[g->op]) {
        at = k;
        break;
      }
    }
    const size_t next = ++reloaded_;
    std::vector<Step> here;
    if (next < reload_order_.size()) here.push_back(copy_step(reload_order_[next], false));
    here.push_back(copy_wait_step(false, next < reload_order_.size() ? 1 : 0));
    inserts.emplace_back(at, std::move(here));
  }
  // Backward order is ascending positions: insert from the last so earlier ones stay put.
  for (auto it = inserts.rbegin(); it != inserts.rend(); ++it) {
    steps.insert(steps.begin() + static_cast<std::ptrdiff_t>(it->first), it->second.begin(),
                 it->second.end());
  }
}

// A layer's forward runs on what the layers before it keep on the GPU, the layer before's
// groups still on their way to the host, and its own.
double BlockBuilder::module_forward_peak() const {
  double so_far = act_.kept - act_.kept_layers - act_.kept_head;  // the embedding's
  double worst = s_.embedding ? so_far + c_.transient_bytes(c_.embed) : 0.0;
  double resident = 0, in_flight = 0;
  for (int i = 0; i < s_.end_layer - s_.first_layer; ++i) {
    const int l = s_.first_layer + i;
    const PartInfo& p = c_.layer_at(l);
    const double peak = c_.running_transient_bytes(p, layer_in(l), c_.recomputed_ops(p, l));
    worst = std::max(worst, so_far + resident + in_flight + act_.layer_kept[i] + peak);
    resident += act_.layer_kept[i] - act_.layer_offloaded[i];
    in_flight = act_.layer_offloaded[i];
  }
  so_far += resident;
  if (s_.head) {
    worst = std::max(worst, so_far + in_flight + act_.kept_head + c_.transient_bytes(c_.head));
  }
  return worst;
}

// A layer's backward runs with its groups back and the next layer's first group reloading (an
// upper bound: the whole layer before's), on what the layers before it keep, recomputed ones
// holding again what their recomputation brings back.
double BlockBuilder::module_backward_peak(bool recompute_inside) const {
  double worst = 0, freed_before = 0;
  if (s_.head) {
    worst = c_.recomputed_bytes(c_.head, layer_out_, -1) + c_.transient_bytes(c_.head);
    freed_before = act_.kept_head;
  }
  double freed_later = 0;  // what the backwards of the layers after i freed
  for (int i = s_.end_layer - s_.first_layer - 1; i >= 0; --i) {
    const int l = s_.first_layer + i;
    const PartInfo& p = c_.layer_at(l);
    const std::vector<bool> r = c_.recomputed_ops(p, l);
    const std::vector<bool> none(p.part->ops.size(), false);
    const double peak =
        c_.running_transient_bytes(p, layer_in(l), recompute_inside ? none : r, false);
    const double restored = recompute_inside ? c_.recomputed_bytes(p, layer_in(l), l) : 0.0;
    const double reloaded = act_.layer_offloaded[i] + (i > 0 ? act_.layer_offloaded[i - 1] : 0.0);
    worst = std::max(worst, restored + peak + reloaded - freed_before - freed_later);
    freed_later += act_.layer_kept[i] - act_.layer_offloaded[i];
  }
  freed_before += freed_later;
  if (s_.embedding) {
    worst = std::max(worst, c_.recomputed_bytes(c_.embed, embed_out_, -1) +
                                c_.transient_bytes(c_.embed) - freed_before);
  }
  return worst + act_piece_;
}

}  // namespace nnsim::detail
