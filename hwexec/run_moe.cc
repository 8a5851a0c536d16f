// A mixture of experts' routing (run_moe.h).
#include "hwexec/run_moe.h"

#include <tuple>

namespace nnsim::hwexec {

MoeRouting route_tokens(const at::Tensor& scores, int64_t k) {
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  MoeRouting r;
  r.experts_of = std::get<1>(at::topk(scores.detach(), k, 1));
  const at::Tensor flat = r.experts_of.reshape({tokens * k});
  r.order = std::get<1>(at::sort(flat, /*stable=*/true, 0, /*descending=*/false));
  r.token_of = at::div(r.order, k, "floor");
  const at::Tensor counts = at::bincount(flat, {}, experts).cpu();
  r.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + experts);
  return r;
}

at::Tensor dispatch_tokens(const at::Tensor& x, const MoeRouting& r) {
  return x.index_select(0, r.token_of);
}

at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& scores, const MoeRouting& r) {
  const int64_t tokens = scores.size(0);
  const at::Tensor chosen = scores.to(at::kFloat).gather(1, r.experts_of);
  const at::Tensor weight = at::softmax(chosen, 1).reshape({-1}).index_select(0, r.order);
  const at::Tensor weighted = (y.to(at::kFloat) * weight.unsqueeze(1)).to(y.scalar_type());
  // A scatter-add, whose backward keeps only the indices (index_add's keeps its source, the
  // weighted copies), as Megatron-Core's unpermute sums them.
  const at::Tensor index = r.token_of.unsqueeze(1).expand({-1, y.size(1)});
  return at::zeros({tokens, y.size(1)}, weighted.options()).scatter_add(0, index, weighted);
}

}  // namespace nnsim::hwexec
