// Zero-bubble split backwards for `nnexec run` (docs/hwexec.md): a BI block computes every
// operator's input gradient and, for the linear layers, keeps what their weight gradients need;
// the BW block computes those later. Internal to the LibTorch executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace nnsim::hwexec {

// A linear layer's weight gradient left for the BW block: its output (whose graph BI kept), the
// output's gradient, the master weights (leaves) the gradient accumulates into, and its unit.
struct DeferredWeightGrad {
  std::string op;
  at::Tensor out, dout;
  std::vector<at::Tensor> weights;
  int unit = -1;  // the parameter unit the operator belongs to (ZeRO-3 gathers it for BW)
};

// BI: the gradients of `inputs` (the operator's detached inputs) only; autograd computes no
// weight gradient (MmBackward skips the edges not asked for) and the graph stays for BW. The
// gradients accumulate into the inputs' .grad.
void input_gradients(const at::Tensor& out, const at::Tensor& dout,
                     const std::vector<at::Tensor>& inputs);

// BW: the deferred weight gradients, accumulated into the weights' .grad. `keep_graph`: the
// graph is shared with other micro-batches (bf16 weight copies) and must outlive this call.
void weight_gradients(const DeferredWeightGrad& d, bool keep_graph);

}  // namespace nnsim::hwexec
