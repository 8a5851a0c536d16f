#include "core/cost_model.h"

#include <algorithm>
#include <cmath>

namespace nnsim {

std::string_view to_string(AttentionLibrary a) {
  return a == AttentionLibrary::kFused3 ? "fused3" : "flash2";
}

ComputeModel ComputeModel::defaults_for(const GpuSpec& gpu, AttentionLibrary attention) {
  ComputeModel m;
  // Sustained tensor throughput in training relative to the short benchmarks above (clocks
  // under the power limit): calibrated on the validation set (docs/VALIDATION.md).
  m.sustained = gpu.ampere() ? 0.90 : (gpu.hopper() ? 0.81 : 0.9);
  // fp8 GEMMs sustain less again (more power per clock): calibrated on the fp8 runs
  // (docs/VALIDATION.md). Only Hopper has fp8 tensor cores here.
  if (gpu.hopper()) m.sustained_fp8 = 0.91;
  m.sms = gpu.sms > 0 ? gpu.sms : 108;
  m.attention = attention;
  // Maximum achievable matmul FLOP/s over the datasheet peak, measured by mamf-finder
  // (shared/calibration/refs.yaml, gemm_measured): A100 SXM bf16 271.2/312; H100 SXM bf16
  // 794.5/989 (H200 the same); fp8 H100 1402.6/1979, H200 1453.4/1979. fp16 runs as bf16.
  if (gpu.ampere()) {
    m.gemm_efficiency = {{Precision::kBf16, 271.2 / 312},
                         {Precision::kFp16, 271.2 / 312},
                         {Precision::kTf32, 271.2 / 312},
                         {Precision::kFp32, 0.9}};
  } else if (gpu.hopper()) {
    const bool h200 = gpu.lineage().rfind("h200", 0) == 0;
    m.gemm_efficiency = {{Precision::kBf16, 794.5 / 989},
                         {Precision::kFp16, 794.5 / 989},
                         {Precision::kTf32, 794.5 / 989},
                         {Precision::kFp32, 0.9},
                         {Precision::kFp8, (h200 ? 1453.4 : 1402.6) / 1979}};
  }
  // Attention kernels on long sequences, 128-wide heads, causal, executed FLOPs
  // (docs/cost-model.md): FlashAttention-2 reaches about 60 % (forward) and 45 % (backward) of
  // the A100's peak but only about 35 % / 28 % of the H100's in microbenchmarks; the Hopper
  // fused kernels (FlashAttention-3, cuDNN) about 60 % / 45 % of the H100's. FlashAttention-2's
  // values are calibrated on the validation set's training runs, which ran it slower than the
  // microbenchmarks (the H100 pair fitted jointly with `sustained`: docs/VALIDATION.md).
  if (attention == AttentionLibrary::kFused3 && gpu.hopper()) {
    m.attention_fwd_efficiency = 0.60;
    m.attention_bwd_efficiency = 0.45;
  } else if (gpu.hopper()) {
    m.attention_fwd_efficiency = 0.2475;
    m.attention_bwd_efficiency = 0.197;
  } else {
    m.attention_fwd_efficiency = 0.45;
    m.attention_bwd_efficiency = 0.33;
  }
  return m;
}

ComputeModel ComputeModel::defaults_for(const GpuSpec& gpu) {
  return defaults_for(gpu, AttentionLibrary::kFlash2);
}

double interference_beside(const ComputeModel& m, bool expert_exchange) {
  if (!expert_exchange || m.sms <= kDeepEpSms) return m.comm_interference;
  return static_cast<double>(kDeepEpSms) / (m.sms - kDeepEpSms);
}

double gemm_seconds(double m, double n, double k, Precision precision, const GpuSpec& gpu,
                    const ComputeModel& model, double groups) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  double peak = gpu.peak_flops(precision);
  auto it = model.gemm_efficiency.find(precision);
  double best = it != model.gemm_efficiency.end() ? it->second : 0.8;
  if (it == model.gemm_efficiency.end() && precision == Precision::kFp8) {
    // A GPU without fp8 tensor cores runs fp8 GEMMs as bf16.
    auto bf16 = model.gemm_efficiency.find(Precision::kBf16);
    if (bf16 != model.gemm_efficiency.end()) best = bf16->second;
  }
  // The library picks the tile that best fills the GPU: the useful fraction of the last,
  // partial tiles (tile quantization) times the fraction of the last wave of tiles that has
  // work (wave quantization), times the tile's own efficiency.
  double fill = 0;
  for (const GemmTile& t : model.tiles) {
    const double tiles_m = std::ceil(m / t.m), tiles_n = std::ceil(n / t.n);
    const double tile_use = (m * n) / (tiles_m * t.m * tiles_n * t.n);
    const double tiles = tiles_m * tiles_n * groups;
    const double waves = std::ceil(tiles / model.sms);
    const double wave_use = tiles / (waves * model.sms);
    fill = std::max(fill, tile_use * wave_use * t.relative);
  }
  const double k_use = k / (k + model.gemm_k_half);
  const bool fp8_cores = precision == Precision::kFp8 && it != model.gemm_efficiency.end();
  const double sustained = model.sustained * (fp8_cores ? model.sustained_fp8 : 1.0);
  return 2 * m * n * k * groups / (peak * best * sustained * fill * k_use);
}

double op_seconds(const Op& op, Pass pass, double flops, double bytes, const PieceShape& shape,
                  Precision precision, const GpuSpec& gpu, const ComputeModel& model) {
  if (flops <= 0 && bytes <= 0) return 0;
  double compute = 0;
  if (op.kind == OpKind::kLinear && flops > 0) {
    // The backward pass is two GEMMs: input gradient (m x k x n) and weight gradient
    // (k x n x m). Grouped GEMMs (experts) are priced one group after another, or as one
    // grouped-GEMM kernel.
    const double g = std::max(1.0, shape.groups), m = shape.m / g;
    const double times = shape.one_kernel ? 1 : g, in_kernel = shape.one_kernel ? g : 1;
    switch (pass) {
      case Pass::kForward:
        compute = times * gemm_seconds(m, shape.n, shape.k, precision, gpu, model, in_kernel);
        break;
      case Pass::kBackwardInput:
        compute = times * gemm_seconds(m, shape.k, shape.n, precision, gpu, model, in_kernel);
        break;
      case Pass::kBackwardWeight:
        compute = times * gemm_seconds(shape.k, shape.n, m, precision, gpu, model, in_kernel);
        break;
    }
  } else if (op.kind == OpKind::kAttention && flops > 0) {
    // Attention runs in 16-bit even in fp8 training.
    const Precision p = precision == Precision::kFp8 ? Precision::kBf16 : precision;
    double efficiency =
        pass == Pass::kForward ? model.attention_fwd_efficiency : model.attention_bwd_efficiency;
    efficiency *= shape.seq / (shape.seq + model.attention_seq_half);
    efficiency *= std::pow(std::min(1.0, shape.head_dim / 128), model.attention_head_dim_exponent);
    // The unfused chain computes the scores a sliding window leaves out too.
    const double executed =
        op.causal ? flops * model.causal_fraction : flops / op.attended_fraction;
    compute = executed / (gpu.peak_flops(p) * efficiency * model.sustained);
  } else if (flops > 0) {
    // Mamba-2's scan and Gated DeltaNet's delta rule run their small matrix products in 16-bit
    // even in fp8 training.
    const Precision p =
        op.kind == OpKind::kScan && precision == Precision::kFp8 ? Precision::kBf16 : precision;
    auto it = model.gemm_efficiency.find(p);
    compute = flops / (gpu.peak_flops(p) * (it != model.gemm_efficiency.end() ? it->second : 0.8));
  }
  // Elementwise operators move more than the operator graph's minimal traffic (casts, layout
  // copies, unfused steps): elementwise_traffic times it.
  const bool elementwise = op.kind != OpKind::kLinear && op.kind != OpKind::kAttention;
  const double traffic = elementwise ? bytes * model.elementwise_traffic : bytes;
  const double memory = traffic > 0 ? traffic / (gpu.hbm_bandwidth * model.memory_efficiency) : 0;
  return std::max(compute, memory) + model.kernel_overhead;
}

double optimizer_seconds(double params, double grad_bytes, double state_bytes, const GpuSpec& gpu,
                         const ComputeModel& model) {
  if (params <= 0) return 0;
  // Gradient norm (read the gradients), then Adam: read and write the state (master weights,
  // two moments), read the gradient, write the 16-bit weight copy.
  double bytes = params * (2 * state_bytes + 2 * grad_bytes + 2);
  return bytes / (gpu.hbm_bandwidth * model.memory_efficiency) + 2 * model.kernel_overhead;
}

}  // namespace nnsim
