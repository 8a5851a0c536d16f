// Compute time of an operator piece on a GPU: a roofline with efficiencies. Every constant and
// its source is in docs/cost-model.md; a calibration file may replace them (issue: calibrated
// cost model).
#pragma once

#include "core/gpu.h"
#include "core/opgraph.h"

namespace nnsim {

struct ComputeModel {
  // Fraction of the dense peak a large GEMM reaches (maximum achievable matmul FLOP/s).
  double matmul_efficiency = 0.8;
  // Fraction of the dense peak fused attention reaches, forward and backward.
  double attention_fwd_efficiency = 0.6;
  double attention_bwd_efficiency = 0.5;
  // Fraction of the HBM bandwidth memory-bound kernels reach.
  double memory_efficiency = 0.8;
  // Fixed cost per kernel (launch and tail), seconds.
  double kernel_overhead = 2e-6;
  // Fraction of the counted attention FLOPs a causal fused kernel executes (it skips the masked
  // half of the score matrix).
  double causal_fraction = 0.5;

  // Defaults for a GPU from the calibration references (docs/cost-model.md).
  static ComputeModel defaults_for(const GpuSpec& gpu);
};

enum class Pass { kForward, kBackwardInput, kBackwardWeight };

// Seconds for one piece of `op` that does `flops` matmul FLOPs and moves `bytes` of HBM traffic.
double op_seconds(const Op& op, Pass pass, double flops, double bytes, Precision precision,
                  const GpuSpec& gpu, const ComputeModel& model);

// Seconds of the optimizer step over `params` local parameters (memory-bound: reads and writes
// the fp32 state, reads the gradient, writes the 16-bit weight).
double optimizer_seconds(double params, double grad_bytes, double state_bytes, const GpuSpec& gpu,
                         const ComputeModel& model);

}  // namespace nnsim
