// Compute time of an operator piece on a GPU. Matrix multiplies: the GPU's best measured GEMM
// efficiency, reduced by how well the problem fills the GPU (tile and wave quantization) and by
// short reduction dimensions. Fused attention: the efficiency of the attention kernel library
// on that GPU. Everything else: memory-bound at the achievable HBM bandwidth. Every constant and
// its source is in docs/cost-model.md; a calibration file can replace them.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/gpu.h"
#include "core/opgraph.h"

namespace nnsim {

// Attention kernels: FlashAttention-2 (PyTorch SDPA, flash-attn 2), or the Hopper-generation
// fused kernels (cuDNN fused attention through Transformer Engine, FlashAttention-3).
enum class AttentionLibrary { kFlash2, kFused3 };
std::string_view to_string(AttentionLibrary a);

// A GEMM tile shape the library may pick, and how efficiently a full tile runs relative to the
// largest one (small tiles reuse less data per load).
struct GemmTile {
  double m = 128, n = 256;
  double relative = 1.0;
};

struct ComputeModel {
  // Best achievable GEMM FLOP/s over the dense peak, per precision (mamf-finder).
  std::map<Precision, double> gemm_efficiency = {{Precision::kBf16, 0.8}};
  std::vector<GemmTile> tiles = {
      {256, 128, 1.0}, {128, 256, 1.0}, {128, 128, 0.92}, {64, 128, 0.8}, {64, 64, 0.6}};
  // Reduction dimension at which a GEMM reaches half its efficiency: k / (k + k_half).
  double gemm_k_half = 64;
  int sms = 108;

  AttentionLibrary attention = AttentionLibrary::kFlash2;
  // Fraction of the 16-bit peak fused attention reaches on long sequences with 128-wide heads,
  // forward and backward, counting the FLOPs it executes.
  double attention_fwd_efficiency = 0.6;
  double attention_bwd_efficiency = 0.45;
  // Shorter sequences and narrower heads fill the GPU less: s / (s + seq_half) and
  // min(1, head_dim / 128)^head_dim_exponent.
  double attention_seq_half = 256;
  double attention_head_dim_exponent = 0.3;
  // Fraction of the counted attention FLOPs a causal fused kernel executes.
  double causal_fraction = 0.5;

  // Sustained tensor-core throughput in a training run over the short-benchmark rates above
  // (clock under the power limit), for matmuls and attention.
  double sustained = 1.0;
  // fp8 GEMMs' sustained throughput over bf16's `sustained`: they draw more power at the same
  // clock, so the clock drops further under a training run's power limit.
  double sustained_fp8 = 1.0;

  // Fraction of the HBM bandwidth memory-bound kernels reach.
  double memory_efficiency = 0.8;
  // Traffic of elementwise operators (norms, activations, residuals, loss, embedding) over the
  // operator graph's minimal count: casts, layout copies and unfused steps add to it.
  double elementwise_traffic = 2.0;
  // Fixed cost per kernel (launch and tail), seconds.
  double kernel_overhead = 3e-6;
  // Slowdown of compute while communication kernels run on the same GPU (they take SMs and
  // memory bandwidth): compute takes (1 + comm_interference) as long.
  double comm_interference = 0.1;

  // Optimizer offloading (core/optimizer_offload.h): PCIe's achieved over its raw bandwidth,
  // host to device and device to host (nvbandwidth on an 8x H200 node, refs.yaml
  // nvlink-p2p-h200: 55.43 and 55.06 GB/s over PCIe Gen5 x16's 64 GB/s), and the host's Adam
  // over the host's peak memory bandwidth (no measurement: 1, the bound).
  double host_to_device_efficiency = 55.43 / 64.0;
  double device_to_host_efficiency = 55.06 / 64.0;
  double host_memory_efficiency = 1.0;

  // Defaults for a GPU and attention library (docs/cost-model.md).
  static ComputeModel defaults_for(const GpuSpec& gpu, AttentionLibrary attention);
  static ComputeModel defaults_for(const GpuSpec& gpu);
};

// SMs DeepEP's training (normal) kernels hold while they exchange tokens: DeepSeek-V3's report
// (arXiv:2412.19437, section 3.2.2: 20 SMs suffice to saturate InfiniBand and NVLink) and
// DeepEP's default (Buffer.num_sms = 20).
inline constexpr int kDeepEpSms = 20;

// How much longer compute takes beside communication: beside DeepEP's exchange
// (`expert_exchange`) it runs on the SMs the exchange leaves, kDeepEpSms / (sms - kDeepEpSms)
// longer (0.18 on an H100, 0.23 on an A100); beside NCCL's collectives comm_interference.
double interference_beside(const ComputeModel& m, bool expert_exchange);

enum class Pass { kForward, kBackwardInput, kBackwardWeight };

// Seconds of one GEMM of m x n x k (FLOPs 2mnk) in `precision`; with `groups` > 1, of one
// grouped-GEMM kernel running that many such GEMMs, their tiles filling the waves together.
double gemm_seconds(double m, double n, double k, Precision precision, const GpuSpec& gpu,
                    const ComputeModel& model, double groups = 1);

// Seconds for one piece of `op` that does `flops` matmul FLOPs and moves `bytes` of HBM traffic.
// For a linear operator, `gemm` is the piece's m x n x k; for attention, `heads` and `batch` the
// piece's heads and sequences.
struct PieceShape {
  double m = 0, n = 0, k = 0;    // linear (m: all rows, of every group)
  double groups = 1;             // linear: independent GEMMs sharing m evenly (experts)
  bool one_kernel = false;       // the groups run as one grouped-GEMM kernel, else one by one
  double seq = 0, head_dim = 0;  // attention
};
double op_seconds(const Op& op, Pass pass, double flops, double bytes, const PieceShape& shape,
                  Precision precision, const GpuSpec& gpu, const ComputeModel& model);

// Seconds of the optimizer step over `params` local parameters (memory-bound: reads and writes
// the fp32 state, reads the gradient, writes the 16-bit weight, plus the gradient-norm pass).
double optimizer_seconds(double params, double grad_bytes, double state_bytes, const GpuSpec& gpu,
                         const ComputeModel& model);

}  // namespace nnsim
