// The unfused attention's batched products (run_attention_products.h).
#include "hwexec/run_attention_products.h"

#include <torch/csrc/autograd/custom_function.h>

namespace nnsim::hwexec {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// out[i] = a[i] c[i] for every i along dimension 0.
void products_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& c, bool fp32_math) {
  for (int64_t i = 0; i < out.size(0); ++i) {
    at::Tensor slice = out.select(0, i);
    if (fp32_math) {
      slice.copy_(at::matmul(a.select(0, i).to(at::kFloat), c.select(0, i).to(at::kFloat)));
    } else {
      at::matmul_out(slice, a.select(0, i), c.select(0, i));
    }
  }
}

class PerSequenceBmm : public torch::autograd::Function<PerSequenceBmm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& c,
                            bool fp32_math) {
    ctx->save_for_backward({a, c});
    ctx->saved_data["fp32_math"] = fp32_math;
    at::Tensor out = at::empty({a.size(0), a.size(1), a.size(2), c.size(3)}, a.options());
    products_into(out, a, c, fp32_math);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &c = saved[1];
    const bool fp32_math = ctx->saved_data["fp32_math"].toBool();
    const at::Tensor& g = grads[0];
    at::Tensor da, dc;
    if (ctx->needs_input_grad(0)) {  // dA = G C^T
      da = at::empty(a.sizes(), g.options());
      products_into(da, g, c.transpose(-2, -1), fp32_math);
    }
    if (ctx->needs_input_grad(1)) {  // dC = A^T G
      dc = at::empty(c.sizes(), g.options());
      products_into(dc, a.transpose(-2, -1), g, fp32_math);
    }
    return {da, dc, at::Tensor()};
  }
};

}  // namespace

at::Tensor per_sequence_bmm(const at::Tensor& a, const at::Tensor& c, bool fp32_math) {
  return PerSequenceBmm::apply(a, c, fp32_math);
}

}  // namespace nnsim::hwexec
