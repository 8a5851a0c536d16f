#include "core/cost_model.h"

#include <algorithm>

namespace nnsim {

ComputeModel ComputeModel::defaults_for(const GpuSpec& gpu) {
  ComputeModel m;
  // Maximum achievable matmul FLOP/s over peak, measured by mamf-finder (calibration refs.yaml,
  // gemm_measured/mamf-bf16): A100 SXM 271.2/312, H100 SXM 794.5/989 (H200 the same).
  if (gpu.name.rfind("a100", 0) == 0) {
    m.matmul_efficiency = 271.2 / 312.0;
  } else if (gpu.name.rfind("h100", 0) == 0 || gpu.name.rfind("h200", 0) == 0) {
    m.matmul_efficiency = 794.5 / 989.0;
  }
  return m;
}

double op_seconds(const Op& op, Pass pass, double flops, double bytes, Precision precision,
                  const GpuSpec& gpu, const ComputeModel& model) {
  if (flops <= 0 && bytes <= 0) return 0;
  double peak = gpu.peak_flops(precision);
  double efficiency = model.matmul_efficiency;
  double executed = flops;
  if (op.kind == OpKind::kAttention) {
    efficiency =
        pass == Pass::kForward ? model.attention_fwd_efficiency : model.attention_bwd_efficiency;
    // Attention runs in 16-bit even in fp8 training.
    peak = gpu.peak_flops(precision == Precision::kFp8 ? Precision::kBf16 : precision);
    if (op.causal) executed *= model.causal_fraction;
  }
  double compute = peak > 0 && executed > 0 ? executed / (peak * efficiency) : 0;
  double memory = bytes > 0 ? bytes / (gpu.hbm_bandwidth * model.memory_efficiency) : 0;
  return std::max(compute, memory) + model.kernel_overhead;
}

double optimizer_seconds(double params, double grad_bytes, double state_bytes, const GpuSpec& gpu,
                         const ComputeModel& model) {
  if (params <= 0) return 0;
  // Read and write the state (master weights, two moments), read the gradient, write the 16-bit
  // weight copy.
  double bytes = params * (2 * state_bytes + grad_bytes + 2);
  return bytes / (gpu.hbm_bandwidth * model.memory_efficiency) + model.kernel_overhead;
}

}  // namespace nnsim
