// The Adam step of `nnexec run` (docs/hwexec.md), over every tensor the rank updates at once,
// as the frameworks do: on a GPU LibTorch's fused Adam (one pass over each tensor's weights,
// gradient and moments, as apex's and Transformer Engine's FusedAdam that Megatron uses), on a
// CPU its multi-tensor ("foreach") kernels (LibTorch's CPU has no fused Adam before 2.4). One
// kernel per tensor and formula step would cost more in launches than in arithmetic on a GPU.
// Internal to the LibTorch executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace nnsim::hwexec {

// The tensors of one step: weights (fp32 masters), their gradients and Adam's two moments,
// index for index.
struct AdamLists {
  std::vector<at::Tensor> weights, grads, m, v;

  void add(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m1, const at::Tensor& m2);

  // Adam without weight decay at step k (1-based), bias-corrected:
  //   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
  //   w -= lr / (1 - b1^k) * m / (sqrt(v / (1 - b2^k)) + eps).
  // The foreach path builds the denominators a group of tensors at a time, so the step's extra
  // memory is at most a group's (group_elements), not a copy of every moment.
  void step(double lr, double beta1, double beta2, double eps, double k,
            int64_t group_elements = kGroupElements) const;

  static constexpr int64_t kGroupElements = int64_t{1} << 26;  // 256 MiB of fp32
};

}  // namespace nnsim::hwexec
