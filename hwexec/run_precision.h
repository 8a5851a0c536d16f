// fp8 training as `nnexec run` emulates it (docs/hwexec.md): Transformer Engine's recipe for the
// transformer blocks' linear layers, with per-tensor scaling, e4m3 for the forward's GEMM inputs
// (activations and weights) and e5m2 for the backward's output gradients. Every other operator
// computes in bf16. The GEMMs run in bf16 on values rounded to fp8: the numerics of an fp8 GEMM
// (fp8 inputs, fp32 accumulation, a 16-bit output), not its speed. Internal to the LibTorch
// executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

namespace nnsim::hwexec {

// The two fp8 formats (OCP's): e4m3 ("fn": no infinities, largest 448) and e5m2 (largest
// 57344).
enum class Fp8 { kE4m3, kE5m2 };

// x rounded to the fp8 format (to nearest even, subnormals kept, saturating at the largest
// finite value), in x's dtype: what a cast to the format and back gives. No scaling.
at::Tensor round_to_fp8(const at::Tensor& x, Fp8 format);

// Per-tensor scaling (Transformer Engine's current scaling): x scaled so that its largest
// magnitude is the format's largest value, rounded, and scaled back, in fp32 (the values an fp8
// GEMM multiplies, its scales applied). Zeros stay.
at::Tensor fp8_quantize(const at::Tensor& x, Fp8 format);

// A linear layer's product x . w with fp8 GEMM inputs: x and w quantized to e4m3 (their
// gradients pass straight through the rounding, as Transformer Engine's GEMMs take the
// quantized tensors' gradients for the originals'), and the output's gradient quantized to e5m2
// before the backward GEMMs use it. The product in fp32 (an fp8 GEMM accumulates in fp32),
// returned in x's dtype (bf16).
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w);

}  // namespace nnsim::hwexec
