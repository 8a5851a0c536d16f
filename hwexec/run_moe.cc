// A mixture of experts' routing (run_moe.h).
#include "hwexec/run_moe.h"

#include <limits>
#include <tuple>

#include <torch/csrc/autograd/custom_function.h>

#include "hwexec/run_precision.h"

namespace nnsim::hwexec {

MoeRouting route_tokens(const at::Tensor& scores, int64_t k, int64_t groups, int64_t group_topk) {
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  MoeRouting r;
  at::Tensor candidates = scores.detach();
  if (groups > 1) {
    const at::Tensor by_group = candidates.reshape({tokens, groups, experts / groups});
    const at::Tensor group_score =
        std::get<0>(at::topk(by_group, k / group_topk, 2)).sum(2);  // [tokens, groups]
    const at::Tensor best = std::get<1>(at::topk(group_score, group_topk, 1));
    const at::Tensor chosen =
        at::zeros({tokens, groups}, candidates.options().dtype(at::kBool)).scatter(1, best, true);
    const at::Tensor allowed = chosen.unsqueeze(2).expand_as(by_group).reshape({tokens, experts});
    candidates =
        candidates.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  }
  r.experts_of = std::get<1>(at::topk(candidates, k, 1));
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

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// How a product's operands are taken: as they are, in fp32 (fp16 on a CPU), or quantized to
// fp8 (`a` and `c` in the formats given) with the product in fp32.
struct Math {
  bool fp32 = false;
  bool fp8 = false;
};

// out = a c, into `out` (a view of a larger tensor).
void product_into(at::Tensor out, const at::Tensor& a, const at::Tensor& c, Math math,
                  Fp8 a_format = Fp8::kE4m3, Fp8 c_format = Fp8::kE4m3) {
  if (math.fp8) {
    out.copy_(at::mm(fp8_quantize(a, a_format), fp8_quantize(c, c_format)));
  } else if (math.fp32) {
    out.copy_(at::mm(a.to(at::kFloat), c.to(at::kFloat)));
  } else {
    at::mm_out(out, a, c);
  }
}

class GroupedLinear : public torch::autograd::Function<GroupedLinear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const c10::optional<at::Tensor>& b, const std::vector<int64_t>& counts,
                            bool fp32_math, bool fp8) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["fp32_math"] = fp32_math;
    ctx->saved_data["fp8"] = fp8;
    const Math math{fp32_math, fp8};
    ctx->saved_data["bias"] = b.has_value() && b->defined();
    at::Tensor out = at::empty({x.size(0), w.size(2)}, x.options());
    int64_t first = 0;
    for (std::size_t e = 0; e < counts.size(); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      at::Tensor rows = out.narrow(0, first, n);
      product_into(rows, x.narrow(0, first, n), w[static_cast<int64_t>(e)], math);
      if (b.has_value() && b->defined()) rows.add_((*b)[static_cast<int64_t>(e)]);
      first += n;
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const Math math{ctx->saved_data["fp32_math"].toBool(), ctx->saved_data["fp8"].toBool()};
    const bool bias = ctx->saved_data["bias"].toBool();
    const at::Tensor& g = grads[0];
    at::Tensor dx, dw, db;
    // An expert without tokens gets a zero gradient, as from a product over no rows.
    if (ctx->needs_input_grad(0)) dx = at::empty(x.sizes(), g.options());
    if (ctx->needs_input_grad(1)) dw = at::zeros(w.sizes(), g.options());
    if (bias && ctx->needs_input_grad(2)) db = at::zeros({w.size(0), w.size(2)}, g.options());
    int64_t first = 0;
    for (std::size_t e = 0; e < counts.size(); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      const auto i = static_cast<int64_t>(e);
      const at::Tensor ge = g.narrow(0, first, n);
      // fp8: the output's gradient in e5m2, the forward's operands in e4m3.
      if (dx.defined()) {
        product_into(dx.narrow(0, first, n), ge, w[i].t(), math, Fp8::kE5m2, Fp8::kE4m3);
      }
      if (dw.defined()) {
        product_into(dw[i], x.narrow(0, first, n).t(), ge, math, Fp8::kE4m3, Fp8::kE5m2);
      }
      if (db.defined()) db[i].copy_(ge.sum(0));
      first += n;
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& b, const std::vector<int64_t>& counts,
                          bool fp32_math, bool fp8) {
  return GroupedLinear::apply(x, w, b, counts, fp32_math, fp8);
}

}  // namespace nnsim::hwexec
