// Synthetic microbenchmark results with known answers: times made from the simulator's own
// formulas with chosen parameters, so a correct fit recovers exactly those parameters.
#pragma once

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/cost_model.h"
#include "core/gpu.h"
#include "hwexec/micro.h"

namespace nnsim::hwexec::testing {

// synthetic_micro's first GEMM shape runs this much slower than the model with the truth's
// efficiency e; the other three run at e. The relative least squares e_fit = sum e_i^2 / sum e_i
// over the four is then gemm_fit_of(e): the three priced e / e_fit - 1 = 6.5 % slow, the slow
// one 1 - e / (1.5 e_fit) = 29 % fast.
constexpr double kSlowShape = 1.5;
inline double gemm_fit_of(double e) {
  const double slow = e / kSlowShape;
  return (3 * e * e + slow * slow) / (3 * e + slow);
}

struct Truth {
  double bf16_efficiency = 0.7;
  double fp8_efficiency = 0.6;
  double memory_efficiency = 0.85;
  double kernel_overhead = 5e-6;
  double alpha = 20e-6;  // all-reduce time of the smallest message
  // all-reduce efficiency for sizes of 1 MiB and up, by size index; all-gather constant
  std::vector<double> all_reduce_efficiency = {0.3, 0.5, 0.7, 0.9, 1.05};
  double all_gather_efficiency = 0.8;
  double attention_fwd_efficiency = 0.55;
  double attention_bwd_efficiency = 0.4;
  double attention_seq_half = 300;
  // The host's side, relative to dgx-h100-superpod's node.host (614.4 GB/s of memory, 64 GB/s a
  // GPU to it): the Adam step's traffic rate and each direction's copy rate a GPU.
  double host_memory_efficiency = 0.3;
  double device_to_host_efficiency = 0.8;
  double host_to_device_efficiency = 0.85;
  int ranks = 8;
  // Smaller groups timed too (nnexec bench's 2, 4, ... GPUs), from the same link: the smallest
  // message's time scales with the latency steps.
  std::vector<int> smaller_groups;
};

inline MicroResults synthetic_micro(const GpuSpec& gpu, const Truth& truth = {}) {
  MicroResults r;
  r.device = "cuda";
  r.device_name = "NVIDIA H100 80GB HBM3";
  r.device_count = truth.ranks;
  r.torch_version = "synthetic";
  r.nccl_version = "2.28.9";
  r.warmup = 1;
  r.repetitions = 1;
  ComputeModel ideal = ComputeModel::defaults_for(gpu);
  ideal.sustained = 1;
  ideal.sustained_fp8 = 1;
  for (auto [p, e] : {std::pair{Precision::kBf16, truth.bf16_efficiency},
                      std::pair{Precision::kFp8, truth.fp8_efficiency}}) {
    ideal.gemm_efficiency = {{p, 1.0}};
    GemmSeries s;
    s.precision = p;
    const std::vector<std::vector<double>> shapes = {
        {1024, 1024, 1024}, {4096, 4096, 4096}, {8192, 5120, 20480}, {300, 700, 96}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto& x = shapes[i];
      double t = gemm_seconds(x[0], x[1], x[2], p, gpu, ideal) / e;
      if (i == 0) t *= kSlowShape;  // one shape slower than the model (gemm_fit_of)
      s.samples.push_back({x[0], x[1], x[2], {t, t}});
    }
    r.gemm.push_back(s);
  }
  const double bw = truth.memory_efficiency * gpu.hbm_bandwidth;
  for (auto [op, traffic] : {std::pair{"add", 6.0}, std::pair{"gelu", 4.0}}) {
    MemorySeries s;
    s.op = op;
    s.dtype = "bf16";
    s.bytes_per_element = traffic;
    for (double n = 1 << 16; n <= (1 << 28); n *= 4) {
      const double t = truth.kernel_overhead + n * traffic / bw;
      s.samples.push_back({n, n * traffic, {t, t}});
    }
    r.memory.push_back(s);
  }
  // Causal bf16 attention priced by op_seconds itself (sustained 1, no kernel overhead).
  ComputeModel attn = ComputeModel::defaults_for(gpu);
  attn.sustained = 1;
  attn.kernel_overhead = 0;
  attn.attention_fwd_efficiency = truth.attention_fwd_efficiency;
  attn.attention_bwd_efficiency = truth.attention_bwd_efficiency;
  attn.attention_seq_half = truth.attention_seq_half;
  Op op;
  op.kind = OpKind::kAttention;
  op.causal = true;
  AttentionSeries as{"bf16", "sdpa", {}};
  for (auto [s, d] :
       {std::pair{512.0, 128.0}, std::pair{1024.0, 128.0}, std::pair{2048.0, 128.0},
        std::pair{4096.0, 128.0}, std::pair{8192.0, 128.0}, std::pair{4096.0, 64.0}}) {
    AttentionSample x{16384 / s, 16, s, d, {}, {}};
    PieceShape shape;
    shape.seq = s;
    shape.head_dim = d;
    const double fwd =
        op_seconds(op, Pass::kForward, x.flops(), 0, shape, Precision::kBf16, gpu, attn);
    const double bwd =
        op_seconds(op, Pass::kBackwardInput, 2 * x.flops(), 0, shape, Precision::kBf16, gpu, attn);
    x.fwd = {fwd, fwd};
    x.bwd = {bwd, bwd};
    as.samples.push_back(x);
  }
  r.attention = {as};
  const double step = truth.alpha / (2 * (truth.ranks - 1));
  std::vector<int> groups = {truth.ranks};
  groups.insert(groups.end(), truth.smaller_groups.begin(), truth.smaller_groups.end());
  for (int n : groups) {
    CollectiveSeries ar{"all_reduce", n, "fp32", {}};
    CollectiveSeries ag{"all_gather", n, "fp32", {}};
    const double alpha = 2 * (n - 1) * step;
    ar.samples.push_back({1024, {alpha, alpha}});
    const double ag_alpha = alpha / 2;  // half the steps
    ag.samples.push_back({1024, {ag_alpha, ag_alpha}});
    double size = 1 << 20;
    for (double e : truth.all_reduce_efficiency) {
      const double t = alpha + 2.0 * (n - 1) / n * size / (gpu.nvlink_bandwidth * e);
      ar.samples.push_back({size, {t, t}});
      const double tg = ag_alpha + 1.0 * (n - 1) / n * size /
                                       (gpu.nvlink_bandwidth * truth.all_gather_efficiency);
      ag.samples.push_back({size, {tg, tg}});
      size *= 4;
    }
    r.collectives.push_back(ar);
    r.collectives.push_back(ag);
  }
  // The largest sizes run at the truth's rates; smaller ones faster (Adam in the CPU's caches)
  // or slower (a copy's fixed cost), which the fit must not take.
  const double adam_rate = truth.host_memory_efficiency * 614.4e9;
  for (double n : {1 << 22, 1 << 24, 1 << 26}) {
    const double t = n * kHostAdamBytesPerElement / adam_rate / (n < (1 << 26) ? 2 : 1);
    r.host_adam.push_back({n, {t, t}});
  }
  for (auto [direction, e] : {std::pair{"to_host", truth.device_to_host_efficiency},
                              std::pair{"to_device", truth.host_to_device_efficiency}}) {
    HostCopySeries c{direction, truth.ranks, {}};
    for (double bytes : {1 << 20, 1 << 28}) {
      const double t = bytes / (e * 64e9) + (bytes < (1 << 28) ? 10e-6 : 0.0);
      c.samples.push_back({bytes, {t, t}});
    }
    r.host_copies.push_back(c);
  }
  return r;
}

// A fresh temporary directory, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "hwexec_test.XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace nnsim::hwexec::testing
