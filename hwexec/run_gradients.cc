#include "hwexec/run_gradients.h"

#include <cstdint>
#include <set>

#include <fmt/format.h>

#include "hwexec/run_adam.h"

namespace nnsim::hwexec {

namespace {

// `flat`'s values written back as each parameter's gradient, in order.
void scatter_gradients(const std::vector<Param*>& params, const at::Tensor& flat) {
  c10::NoGradGuard no_grad;
  int64_t offset = 0;
  for (Param* p : params) {
    const int64_t n = p->w.numel();
    p->w.mutable_grad() = flat.narrow(0, offset, n).view(p->w.sizes()).clone();
    offset += n;
  }
}

ParamCheck check_of(const std::string& name, double elements, const at::Tensor& mine,
                    const at::Tensor& want, double rtol, double atol) {
  ParamCheck c;
  c.name = name;
  c.elements = elements;
  c.max_abs_error = (mine - want).abs().max().item<double>();
  c.ref_max_abs = want.abs().max().item<double>();
  c.ok = c.max_abs_error <= rtol * c.ref_max_abs + atol;
  return c;
}

}  // namespace

void check_gradients_arrived(const std::vector<Param*>& params, int zero, int iteration) {
  for (const Param* p : params) {
    if (zero >= 1 && p->w.grad().defined()) {
      throw RunFailure{
          fmt::format("iteration {}: a gradient of {} arrived after its ZeRO "
                      "reduce-scatter",
                      iteration, p->name)};
    }
  }
  for (const Param* p : params) {
    if (zero == 0 && !p->w.grad().defined()) {
      throw RunFailure{fmt::format("iteration {}: no gradient reached {}", iteration, p->name)};
    }
  }
}

void sum_data_parallel(const Plan& plan, const ModelParts& models, RankContext& ctx,
                       bool expert_parallel, const std::vector<int>& expert_group,
                       const std::string& expert_axes, at::ScalarType reduce_dtype) {
  for (const auto& [sg, model] : models) {
    std::vector<Param*> dense, experts;
    for (Param& p : model->params()) {
      (expert_parallel && p.routed_expert ? experts : dense).push_back(&p);
    }
    for (auto* group : {&dense, &experts}) {
      const bool routed = group == &experts;
      if (group->empty()) continue;
      std::vector<at::Tensor> flat;
      for (Param* p : *group) flat.push_back(grad_or_zeros(*p).reshape({-1}));
      at::Tensor all = at::cat(flat).to(reduce_dtype);
      ctx.all_reduce(all, routed ? expert_group : ctx.dp_group, routed ? expert_axes : ctx.dp_axes,
                     grad_sync_label(plan, sg));
      all = all.to(at::kFloat);  // the 16-bit sums freed before the copies
      scatter_gradients(*group, all);
    }
  }
}

void sum_sequence_parallel(const ModelParts& models, const ZeroShards& shards, RankContext& ctx,
                           at::ScalarType reduce_dtype) {
  std::vector<Param*> sp;
  for (const auto& [sg, model] : models) {
    for (Param* p : model->sequence_parallel_params()) sp.push_back(p);
  }
  if (sp.empty()) return;
  if (shards.level() == 0) {
    std::vector<at::Tensor> flat;
    for (Param* p : sp) flat.push_back(grad_or_zeros(*p).reshape({-1}));
    at::Tensor all = at::cat(flat).to(reduce_dtype);
    ctx.tp_all_reduce(all, "norm grad sync");
    all = all.to(at::kFloat);
    scatter_gradients(sp, all);
    return;
  }
  // With ZeRO the gradients are in the reduced chunks: their slices of those parameters, which
  // sit at the same offsets on every rank of the tensor-parallel group.
  const std::set<const Param*> spset(sp.begin(), sp.end());
  std::vector<at::Tensor> slices;
  for (ZeroUnit* u : shards.units()) {
    for (const ZeroLayout::Piece& k : u->layout.pieces(u->pos)) {
      if (spset.count(u->params[k.tensor])) {
        slices.push_back(u->grad.narrow(0, k.in_chunk, k.length));
      }
    }
  }
  // In the dtype of the gradients' reductions (the program's grad_bytes). A rank whose chunks
  // hold none of them takes part with nothing, as every rank of the program does (its share of
  // the bytes averaged over the shards).
  at::Tensor all = slices.empty() ? at::zeros({0}, ctx.options.dtype(reduce_dtype))
                                  : at::cat(slices).to(reduce_dtype);
  ctx.tp_all_reduce(all, "norm grad sync");
  all = all.to(at::kFloat);
  c10::NoGradGuard no_grad;
  int64_t offset = 0;
  for (at::Tensor& slice : slices) {  // views into the chunks
    slice.copy_(all.narrow(0, offset, slice.numel()));
    offset += slice.numel();
  }
}

void unscale_fp16(const std::vector<Param*>& params, const ZeroShards& shards, double scale,
                  int iteration) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> gs;
  for (ZeroUnit* u : shards.units()) gs.push_back(u->grad);
  for (Param* p : params) {
    if (shards.level() == 0) gs.push_back(p->w.grad());
  }
  for (at::Tensor& g : gs) {
    if (!g.isfinite().all().item<bool>()) {
      throw RunFailure{fmt::format(
          "training.precision: fp16 gradients overflowed in iteration {} at the static loss "
          "scale {} (use bf16)",
          iteration, scale)};
    }
    g.div_(scale);
  }
}

std::vector<ParamCheck> compare_gradients(const std::vector<Param*>& params,
                                          const ZeroShards& shards,
                                          const std::map<std::string, at::Tensor>& reference,
                                          double rtol, double atol, bool inject_fault) {
  std::vector<ParamCheck> checks;
  for (ZeroUnit* u : shards.units()) {
    for (const ZeroLayout::Piece& k : u->layout.pieces(u->pos)) {
      const Param* p = u->params[k.tensor];
      at::Tensor g = u->grad.narrow(0, k.in_chunk, k.length);
      const at::Tensor want =
          p->cut(reference.at(p->name)).reshape({-1}).narrow(0, k.in_tensor, k.length);
      if (inject_fault && checks.empty()) g = g * 1.01;
      checks.push_back(check_of(p->name, static_cast<double>(k.length), g, want, rtol, atol));
    }
  }
  for (Param* p : shards.level() == 0 ? params : std::vector<Param*>{}) {
    at::Tensor mine = grad_or_zeros(*p);
    if (inject_fault && checks.empty()) mine = mine * 1.01;
    checks.push_back(check_of(p->name, static_cast<double>(mine.numel()), mine,
                              p->cut(reference.at(p->name)), rtol, atol));
  }
  return checks;
}

void adam_step(const std::vector<Param*>& params, const ZeroShards& shards, int step) {
  const double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, lr = 1e-4;
  c10::NoGradGuard no_grad;
  AdamLists lists;
  for (ZeroUnit* u : shards.units()) lists.add(u->master, u->grad, u->m, u->v);  // the chunk
  for (Param* p : shards.level() == 0 ? params : std::vector<Param*>{}) {
    if (!p->m.defined()) {
      p->m = at::zeros_like(p->w);
      p->v = at::zeros_like(p->w);
    }
    lists.add(p->w, p->w.grad(), p->m, p->v);
  }
  lists.step(lr, beta1, beta2, eps, step);
  std::vector<at::Tensor> zero_grads;
  for (ZeroUnit* u : shards.units()) zero_grads.push_back(u->grad);
  if (!zero_grads.empty()) at::_foreach_zero_(zero_grads);
}

}  // namespace nnsim::hwexec
