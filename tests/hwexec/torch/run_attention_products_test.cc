// The unfused attention's batched products (hwexec/run_attention_products.h) against LibTorch's
// own matmul, on the strided views the executor gives them. Compiled only where LibTorch is
// (NNSIM_HAVE_TORCH).
#include <gtest/gtest.h>

#include "hwexec/run_attention_products.h"

namespace nnsim::hwexec {
namespace {

// A QKV output [b, s, heads, 3, d] and its q, k, v as [b, heads, s, d] views.
struct Qkv {
  at::Tensor base, q, k, v;
};

Qkv qkv(int64_t b, int64_t s, int64_t heads, int64_t d, at::ScalarType dtype = at::kFloat) {
  Qkv x;
  x.base = at::randn({b, s, heads, 3, d}, at::TensorOptions().dtype(dtype)).requires_grad_(true);
  x.q = x.base.select(3, 0).permute({0, 2, 1, 3});
  x.k = x.base.select(3, 1).permute({0, 2, 1, 3});
  x.v = x.base.select(3, 2).permute({0, 2, 1, 3});
  return x;
}

TEST(PerSequenceBmm, ScoresAndContextMatchMatmulWithTheirGradients) {
  at::manual_seed(7);
  Qkv a = qkv(3, 16, 4, 8);
  at::Tensor base_ref = a.base.detach().clone().requires_grad_(true);
  const at::Tensor q = base_ref.select(3, 0).permute({0, 2, 1, 3});
  const at::Tensor k = base_ref.select(3, 1).permute({0, 2, 1, 3});
  const at::Tensor v = base_ref.select(3, 2).permute({0, 2, 1, 3});

  const at::Tensor p = at::softmax(per_sequence_bmm(a.q, a.k.transpose(-2, -1), false), -1);
  const at::Tensor out = per_sequence_bmm(p, a.v, false);
  const at::Tensor p_ref = at::softmax(at::matmul(q, k.transpose(-2, -1)), -1);
  const at::Tensor out_ref = at::matmul(p_ref, v);
  ASSERT_EQ(out.sizes(), out_ref.sizes());
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_TRUE(at::allclose(out, out_ref, 1e-5, 1e-6));

  const at::Tensor dout = at::randn(out.sizes());
  out.backward(dout);
  out_ref.backward(dout);
  EXPECT_TRUE(at::allclose(a.base.grad(), base_ref.grad(), 1e-5, 1e-6));
}

TEST(PerSequenceBmm, SavesTheViewsNotCopies) {
  // The product saves its operands as given, views sharing the QKV output's storage and
  // version counter, not copies: changing the QKV output in place after the forward makes the
  // backward refuse, as autograd refuses any saved tensor so changed (a copy would not see it).
  at::manual_seed(3);
  Qkv a = qkv(2, 8, 2, 4);
  const at::Tensor scores = per_sequence_bmm(a.q, a.k.transpose(-2, -1), false);
  ASSERT_TRUE(scores.grad_fn());
  const at::Tensor g = at::ones(scores.sizes());
  {
    at::NoGradGuard no_grad;
    a.base.mul_(2);
  }
  EXPECT_THROW(scores.backward(g), c10::Error);
}

TEST(PerSequenceBmm, OnlyTheGradientsAsked) {
  at::manual_seed(5);
  const at::Tensor a = at::randn({2, 3, 4, 5}).requires_grad_(true);
  const at::Tensor c = at::randn({2, 3, 5, 6});  // no gradient
  const at::Tensor out = per_sequence_bmm(a, c, false);
  out.sum().backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_TRUE(at::allclose(a.grad(), at::matmul(at::ones({2, 3, 4, 6}), c.transpose(-2, -1))));
  EXPECT_FALSE(c.grad().defined());
}

TEST(PerSequenceBmm, Fp32MathRoundsOnce) {
  // fp16 on a CPU (LibTorch 1.13 has no fp16 matrix product there): fp32 products of the fp16
  // values, rounded to fp16 once.
  at::manual_seed(11);
  const at::Tensor a = at::randn({2, 2, 4, 8}).to(at::kHalf);
  const at::Tensor c = at::randn({2, 2, 8, 3}).to(at::kHalf);
  const at::Tensor out = per_sequence_bmm(a, c, true);
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  const at::Tensor want = at::matmul(a.to(at::kFloat), c.to(at::kFloat)).to(at::kHalf);
  EXPECT_TRUE(at::equal(out, want));
}

}  // namespace
}  // namespace nnsim::hwexec
