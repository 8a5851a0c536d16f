// fp8 emulation (run_precision.h).
#include "hwexec/run_precision.h"

#include "hwexec/run_model_ops.h"

namespace nnsim::hwexec {

namespace {

struct Format {
  int mantissa;    // stored significand bits
  int min_exp;     // exponent of the smallest normal
  double largest;  // the largest finite value
};

Format format_of(Fp8 f) {
  return f == Fp8::kE4m3 ? Format{3, -6, 448.0} : Format{2, -14, 57344.0};
}

// The straight-through form: q's values, x's gradient.
at::Tensor straight_through(const at::Tensor& x, const at::Tensor& q) {
  return q.detach() + (x - x.detach());
}

}  // namespace

at::Tensor round_to_fp8(const at::Tensor& x, Fp8 format) {
  const Format f = format_of(format);
  const at::Tensor y = x.detach().to(at::kFloat);
  // The spacing of the values around y: 2^(e - mantissa) with e y's binade, no lower than the
  // subnormals' (log2(0) is -inf: clamped too).
  const at::Tensor e = at::floor(at::log2(y.abs())).clamp_min(f.min_exp);
  const at::Tensor spacing = at::exp2(e - f.mantissa);
  // y / spacing and back are exact (powers of two); round() rounds halves to even.
  return (at::round(y / spacing) * spacing).clamp(-f.largest, f.largest).to(x.scalar_type());
}

at::Tensor fp8_quantize(const at::Tensor& x, Fp8 format) {
  const at::Tensor y = x.detach().to(at::kFloat);
  const at::Tensor amax = y.abs().max();
  // The scale: a scalar tensor (no host synchronization); 1 for an all-zero tensor.
  const at::Tensor scale =
      at::where(amax > 0, format_of(format).largest / amax, at::ones_like(amax));
  return round_to_fp8(y * scale, format) / scale;
}

double fp8_round(double x, bool e5m2) {
  return round_to_fp8(at::full({1}, x, at::kFloat), e5m2 ? Fp8::kE5m2 : Fp8::kE4m3).item<double>();
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor xq = straight_through(x, fp8_quantize(x, Fp8::kE4m3));
  const at::Tensor wq = straight_through(w, fp8_quantize(w, Fp8::kE4m3));
  // The hook on the fp32 product: the output's gradient arrives there in fp32 (the 16-bit
  // gradient, cast exactly), and its quantized values stay fp32 for the backward's GEMMs.
  const at::Tensor y = at::matmul(xq, wq);
  if (y.requires_grad()) {
    y.register_hook([](const at::Tensor& g) { return fp8_quantize(g, Fp8::kE5m2); });
  }
  return y.to(x.scalar_type());
}

}  // namespace nnsim::hwexec
