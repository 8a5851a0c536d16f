// nnexec run's Adam step (hwexec/run_adam.h) against the formula, element by element. Compiled
// only where LibTorch is (NNSIM_HAVE_TORCH); the CPU takes the foreach path, a GPU build's
// NnexecRunGpu cases the fused one.
#include <gtest/gtest.h>

#include <cmath>

#include "hwexec/run_adam.h"

namespace nnsim::hwexec {
namespace {

TEST(RunAdam, StepsAsTheFormulaSaysOverGroupsOfTensors) {
  const double lr = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8;
  // Groups of at most 10 elements: the first two tensors share one, the third (over the size)
  // is one alone, the last another.
  const int64_t group = 10;
  const std::vector<int64_t> sizes = {3, 5, 23, 4};
  AdamLists lists;
  std::vector<at::Tensor> w0, m0, v0;
  at::manual_seed(1);
  for (int64_t n : sizes) {
    at::Tensor w = at::randn({n}), g = at::randn({n}), m = at::randn({n}) * 0.1,
               v = at::rand({n}) * 0.1;
    w0.push_back(w.clone());
    m0.push_back(m.clone());
    v0.push_back(v.clone());
    lists.add(w, g, m, v);
  }
  const double k = 3;
  lists.step(lr, b1, b2, eps, k, group);
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (int64_t i : {int64_t{0}, sizes[t] / 2, sizes[t] - 1}) {
      const double g = lists.grads[t][i].item<double>();
      const double m = b1 * m0[t][i].item<double>() + (1 - b1) * g;
      const double v = b2 * v0[t][i].item<double>() + (1 - b2) * g * g;
      const double w = w0[t][i].item<double>() - lr / (1 - std::pow(b1, k)) * m /
                                                     (std::sqrt(v / (1 - std::pow(b2, k))) + eps);
      EXPECT_NEAR(lists.m[t][i].item<double>(), m, 1e-6) << "tensor " << t << " element " << i;
      EXPECT_NEAR(lists.v[t][i].item<double>(), v, 1e-6) << "tensor " << t << " element " << i;
      EXPECT_NEAR(lists.weights[t][i].item<double>(), w, 1e-6)
          << "tensor " << t << " element " << i;
      EXPECT_GT(std::abs(lists.weights[t][i].item<double>() - w0[t][i].item<double>()), 1e-3)
          << "the weight did not move";
    }
  }
}

TEST(RunAdam, NoTensorsIsNoStep) {
  const AdamLists empty;
  empty.step(1e-3, 0.9, 0.95, 1e-8, 1);
  EXPECT_TRUE(empty.weights.empty());
}

}  // namespace
}  // namespace nnsim::hwexec
