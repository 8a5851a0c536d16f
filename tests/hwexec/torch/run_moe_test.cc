// A mixture of experts' routing in nnexec (hwexec/run_moe.h) against a per-token loop: each
// token's k best-scoring experts, its copies ordered by expert, and its output the softmax of
// its k scores weighting those experts' outputs; and the experts' grouped GEMM against one
// product per expert. Compiled only where LibTorch is.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "hwexec/run_moe.h"
#include "hwexec/run_precision.h"

namespace nnsim::hwexec {
namespace {

constexpr int64_t kTokens = 7, kExperts = 4, kTop = 2, kHidden = 3;

// Scores without ties, so that the top-k is unambiguous.
at::Tensor scores() {
  at::manual_seed(5);
  return at::randn({kTokens, kExperts}, at::kFloat);
}

TEST(MoeRouting, EachTokenGoesToItsTopKExpertsInExpertOrder) {
  const at::Tensor s = scores();
  const MoeRouting r = route_tokens(s, kTop);
  std::vector<std::vector<int64_t>> chosen(kTokens);  // by the loop
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<int64_t> e(kExperts);
    std::iota(e.begin(), e.end(), 0);
    std::sort(e.begin(), e.end(),
              [&](int64_t a, int64_t b) { return s[t][a].item<float>() > s[t][b].item<float>(); });
    chosen[t].assign(e.begin(), e.begin() + kTop);
  }
  std::vector<int64_t> counts(kExperts, 0);
  std::vector<std::pair<int64_t, int64_t>> copies;  // (expert, token), expert order, then token
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t e : chosen[t]) {
      ++counts[e];
      copies.emplace_back(e, t);
    }
  }
  std::stable_sort(copies.begin(), copies.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  EXPECT_EQ(r.counts, counts);
  ASSERT_EQ(r.token_of.numel(), kTokens * kTop);
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_EQ(r.token_of[static_cast<int64_t>(i)].item<int64_t>(), copies[i].second) << i;
  }
  // The routed copies are the tokens' rows, in that order.
  const at::Tensor x = at::arange(kTokens * kHidden, at::kFloat).reshape({kTokens, kHidden});
  const at::Tensor routed = dispatch_tokens(x, r);
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_TRUE(at::equal(routed[static_cast<int64_t>(i)], x[copies[i].second])) << i;
  }
}

// Each expert's output here is its expert's index times the token's row, so the combined output
// of token t is sum_j softmax(chosen scores)_j expert_j x_t; the gradients reach the scores.
// Group-limited routing (2 groups of 2 experts, one group a token, top-2): each token's experts
// are the group with the larger sum of its two scores, whatever the scores outside it.
TEST(MoeRouting, GroupLimitedRoutingPicksTheBestGroupsExperts) {
  const at::Tensor s = scores();
  const MoeRouting r = route_tokens(s, kTop, /*groups=*/2, /*group_topk=*/1);
  for (int64_t t = 0; t < kTokens; ++t) {
    const float g0 = s[t][0].item<float>() + s[t][1].item<float>();
    const float g1 = s[t][2].item<float>() + s[t][3].item<float>();
    const int64_t first = g0 >= g1 ? 0 : 2;
    std::vector<int64_t> got = {r.experts_of[t][0].item<int64_t>(),
                                r.experts_of[t][1].item<int64_t>()};
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<int64_t>{first, first + 1})) << "token " << t;
  }
  // Somewhere the best group is not where the best single expert is, so the limit mattered.
  const MoeRouting free = route_tokens(s, kTop);
  EXPECT_FALSE(
      at::equal(std::get<0>(at::sort(free.experts_of, 1)), std::get<0>(at::sort(r.experts_of, 1))));
}

TEST(MoeRouting, CombineWeighsTheExpertsBySoftmaxOfTheirScores) {
  const at::Tensor s = scores().requires_grad_(true);
  const MoeRouting r = route_tokens(s, kTop);
  const at::Tensor x = at::randn({kTokens, kHidden}, at::kFloat);
  at::Tensor expert = at::empty({kTokens * kTop}, at::kLong);  // each copy's expert
  int64_t i = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int64_t n = 0; n < r.counts[e]; ++n) expert[i++] = e;
  }
  const at::Tensor y =
      (dispatch_tokens(x, r) * (expert.to(at::kFloat) + 1).unsqueeze(1)).requires_grad_(true);
  const at::Tensor out = combine_tokens(y, s, r);
  for (int64_t t = 0; t < kTokens; ++t) {
    const at::Tensor top = r.experts_of[t];
    const at::Tensor w = at::softmax(s.detach()[t].index_select(0, top), 0);
    at::Tensor want = at::zeros({kHidden});
    for (int64_t j = 0; j < kTop; ++j) {
      want += w[j] * (top[j].to(at::kFloat) + 1) * x[t];
    }
    EXPECT_TRUE(at::allclose(out[t], want, 1e-5, 1e-6)) << t;
  }
  out.sum().backward();
  ASSERT_TRUE(s.grad().defined());
  // Only the chosen scores get gradients; the others none.
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t e = 0; e < kExperts; ++e) {
      const bool picked = (r.experts_of[t] == e).any().item<bool>();
      if (!picked) {
        EXPECT_EQ(s.grad()[t][e].item<float>(), 0.0f) << t << " " << e;
      }
    }
  }
  EXPECT_GT(s.grad().abs().sum().item<float>(), 0.0f);
}

// The experts' grouped GEMM against one product per expert under autograd: the same output and
// gradients of its input, weights and biases, an expert without rows included (its gradients
// zero), and only the gradients asked for (a zero-bubble BI asks for the input's alone).
TEST(MoeGroupedLinear, MatchesOneProductPerExpert) {
  at::manual_seed(11);
  const std::vector<int64_t> counts = {3, 0, 4, 2};
  const int64_t rows = 9, in = 5, out = 6;
  const at::Tensor x0 = at::randn({rows, in}), w0 = at::randn({kExperts, in, out}),
                   b0 = at::randn({kExperts, out}), dy = at::randn({rows, out});
  const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                   b = b0.clone().requires_grad_(true);
  const at::Tensor y = grouped_linear(x, w, b, counts, /*fp32_math=*/false);
  y.backward(dy);

  const at::Tensor rx = x0.clone().requires_grad_(true), rw = w0.clone().requires_grad_(true),
                   rb = b0.clone().requires_grad_(true);
  std::vector<at::Tensor> pieces;
  int64_t first = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t n = counts[static_cast<size_t>(e)];
    pieces.push_back(at::mm(rx.narrow(0, first, n), rw[e]) + rb[e]);
    first += n;
  }
  const at::Tensor ry = at::cat(pieces, 0);
  ry.backward(dy);

  EXPECT_TRUE(at::allclose(y, ry, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(x.grad(), rx.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad(), rw.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(b.grad(), rb.grad(), 1e-5, 1e-6));
  EXPECT_EQ(w.grad()[1].abs().sum().item<float>(), 0.0F);
  EXPECT_EQ(b.grad()[1].abs().sum().item<float>(), 0.0F);

  // Only the input's gradient, then only the weights', as a BI and its BW.
  const at::Tensor x2 = x0.clone().requires_grad_(true), w2 = w0.clone().requires_grad_(true);
  const at::Tensor y2 = grouped_linear(x2, w2, c10::nullopt, counts, /*fp32_math=*/false);
  y2.backward(dy, /*retain_graph=*/true, /*create_graph=*/false, at::TensorList({x2}));
  EXPECT_TRUE(at::allclose(x2.grad(), rx.grad(), 1e-5, 1e-6));
  EXPECT_FALSE(w2.grad().defined());
  y2.backward(dy, /*retain_graph=*/false, /*create_graph=*/false, at::TensorList({w2}));
  EXPECT_TRUE(at::allclose(w2.grad(), rw.grad(), 1e-5, 1e-6));
}

// In fp8 each expert's product is fp8_linear's: its rows and weight quantized to e4m3, the
// output's gradient to e5m2 for the backward's products, each expert scaled on its own.
TEST(MoeGroupedLinear, Fp8IsEachExpertsFp8Linear) {
  at::manual_seed(13);
  const std::vector<int64_t> counts = {3, 0, 4, 2};
  const int64_t rows = 9, in = 5, out = 6;
  const at::Tensor x0 = at::randn({rows, in}), w0 = at::randn({kExperts, in, out}),
                   dy = at::randn({rows, out});
  const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  const at::Tensor y = grouped_linear(x, w, c10::nullopt, counts, /*fp32_math=*/false,
                                      /*fp8=*/true);
  y.backward(dy);

  const at::Tensor rx = x0.clone().requires_grad_(true), rw = w0.clone().requires_grad_(true);
  std::vector<at::Tensor> pieces;
  int64_t first = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t n = counts[static_cast<size_t>(e)];
    if (n > 0) pieces.push_back(fp8_linear(rx.narrow(0, first, n), rw[e]));
    first += n;
  }
  at::cat(pieces, 0).backward(dy);

  const at::Tensor plain = grouped_linear(x0, w0, c10::nullopt, counts, false, false);
  EXPECT_FALSE(at::allclose(y.detach(), plain, 1e-3, 1e-4));  // fp8 changed the values
  EXPECT_TRUE(at::allclose(y.detach(), at::cat(pieces, 0).detach(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(x.grad(), rx.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad().narrow(0, 0, 1), rw.grad().narrow(0, 0, 1), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad().narrow(0, 2, 2), rw.grad().narrow(0, 2, 2), 1e-5, 1e-6));
}

}  // namespace
}  // namespace nnsim::hwexec
