// A mixture of experts' routing for `nnexec run` (docs/hwexec.md), internal to the LibTorch
// executor (run_torch.cc): which experts each token goes to, its routed copies ordered by
// expert, and their outputs weighted and summed back per token. As Megatron-Core's default
// router (--moe-router-topk without pre-softmax, dropless): each token's k highest scores pick
// its experts, and the softmax over those k scores weights their outputs.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace nnsim::hwexec {

struct MoeRouting {
  at::Tensor experts_of;        // [tokens, k]: each token's experts
  at::Tensor order;             // [tokens k]: the routed copies (token t's j-th: t k + j) in
                                // expert order, a token's copies in token order within each
  at::Tensor token_of;          // [tokens k]: the token of each copy in that order
  std::vector<int64_t> counts;  // per expert: how many copies it takes
};

// Routes `scores` [tokens, experts] (the router's output) to each token's top `k`. Group-limited
// (`groups` > 1: DeepSeek-V3's node-limited routing, Megatron-Core's --moe-router-num-groups
// and --moe-router-group-topk): the experts in `groups` equal runs, each scored by the sum of
// its k / group_topk best scores; a token's experts come from its `group_topk` best groups.
MoeRouting route_tokens(const at::Tensor& scores, int64_t k, int64_t groups = 1,
                        int64_t group_topk = 1);

// The routed copies of `x` [tokens, h] in expert order: [tokens k, h] (differentiable in x).
at::Tensor dispatch_tokens(const at::Tensor& x, const MoeRouting& r);

// The experts' outputs `y` [tokens k, h] (in expert order) weighted by the softmax of each
// token's k chosen `scores` [tokens, experts] (in fp32) and summed per token: [tokens, h], in
// y's dtype. Differentiable in y and in the scores.
at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& scores, const MoeRouting& r);

// The experts' linear layer over routed copies `x` [rows, in] in expert order (`counts[e]` rows
// for expert e): rows of expert e times w[e] ([experts, in, out]) plus b[e] ([experts, out],
// optional), under autograd. As a grouped GEMM (Megatron-Core's GroupedMLP, TEGroupedMLP): one
// product per expert with tokens, each written into its rows of one output, and the backward's
// input gradient and weight gradients written the same way, so that neither direction holds
// per-expert pieces beside the whole (a loop of products joined by cat holds both, as
// SequentialMLP's). `fp32_math`: computed in fp32 and rounded once (fp16 on a CPU). `fp8`:
// each product's operands quantized as fp8_linear's (run_precision.h; per expert, as
// Transformer Engine's grouped linear scales each GEMM's): the rows and the weight to e4m3 in
// the forward, the output's gradient to e5m2 for the backward's two products.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& b, const std::vector<int64_t>& counts,
                          bool fp32_math, bool fp8 = false);

}  // namespace nnsim::hwexec
