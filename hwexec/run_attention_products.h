// The unfused attention's two batched products for `nnexec run` (docs/hwexec.md, "Memory"),
// internal to the LibTorch executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

namespace nnsim::hwexec {

// a [b, n, r, x] times c [b, n, x, t] into a [b, n, r, t] tensor, under autograd, one index of
// b (a sequence) at a time. Either operand may be a strided view, of the QKV output's rows or a
// transposed one: it is saved for the backward as given, so the backward keeps no copy of q, k
// or v (Megatron's batched products read views of its [s, b, h] layout; a product over b and n
// of this executor's [b, s, h] layout would copy them). The output and both gradients are
// whole-batch tensors, as Megatron's are. `fp32_math`: computed in fp32 and rounded once (fp16
// on a CPU, where LibTorch 1.13 has no fp16 matrix product).
at::Tensor per_sequence_bmm(const at::Tensor& a, const at::Tensor& c, bool fp32_math);

}  // namespace nnsim::hwexec
