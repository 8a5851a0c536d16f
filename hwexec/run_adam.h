// The Adam step of `nnexec run` (docs/hwexec.md): LibTorch's multi-tensor ("foreach") kernels
// over every tensor the rank updates, as torch.optim.Adam does by default on a GPU, rather than
// a handful of kernels per tensor (on a GPU, hundreds of small launches cost more than the
// arithmetic). Internal to the LibTorch executor (run_torch.cc).
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
  // The denominators are built a group of tensors at a time, so the step's extra memory is at
  // most a group's (kGroupElements), not a copy of every moment.
  void step(double lr, double beta1, double beta2, double eps, double k) const;

  static constexpr int64_t kGroupElements = int64_t{1} << 26;  // 256 MiB of fp32
};

}  // namespace nnsim::hwexec
