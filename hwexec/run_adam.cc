// The Adam step of `nnexec run`: fused on a GPU, foreach kernels on a CPU (run_adam.h).
#include "hwexec/run_adam.h"

#include <cmath>

namespace nnsim::hwexec {

void AdamLists::add(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m1,
                    const at::Tensor& m2) {
  weights.push_back(w);
  grads.push_back(g);
  m.push_back(m1);
  v.push_back(m2);
}

void AdamLists::step(double lr, double beta1, double beta2, double eps, double k,
                     int64_t group_elements) const {
  if (weights.empty()) return;
  if (weights.front().is_cuda()) {
    // The step number as the kernel reads it (a float tensor per weight; one shared here).
    const at::Tensor step = at::full({}, k, weights.front().options().dtype(at::kFloat));
    const std::vector<at::Tensor> steps(weights.size(), step);
    at::_fused_adam_(weights, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                     /*weight_decay=*/0.0, eps, /*amsgrad=*/false, /*maximize=*/false);
    return;
  }
  const double v_correction = 1 - std::pow(beta2, k);
  const double step_size = -lr / (1 - std::pow(beta1, k));
  size_t first = 0;
  while (first < weights.size()) {
    // [first, last): tensors up to group_elements together (at least one).
    size_t last = first;
    int64_t elements = 0;
    while (last < weights.size() &&
           (last == first || elements + weights[last].numel() <= group_elements)) {
      elements += weights[last].numel();
      ++last;
    }
    auto group = [&](const std::vector<at::Tensor>& all) {
      return std::vector<at::Tensor>(all.begin() + static_cast<std::ptrdiff_t>(first),
                                     all.begin() + static_cast<std::ptrdiff_t>(last));
    };
    const std::vector<at::Tensor> w = group(weights), g = group(grads), m1 = group(m),
                                  m2 = group(v);
    at::_foreach_mul_(m1, beta1);
    at::_foreach_add_(m1, g, 1 - beta1);
    at::_foreach_mul_(m2, beta2);
    at::_foreach_addcmul_(m2, g, g, 1 - beta2);
    std::vector<at::Tensor> denom = at::_foreach_div(m2, v_correction);
    at::_foreach_sqrt_(denom);
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(w, m1, denom, step_size);
    first = last;
  }
}

}  // namespace nnsim::hwexec
