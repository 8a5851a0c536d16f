// The GPUs nnsim knows by name. Figures are vendor datasheet peaks (dense, no sparsity), as
// collected in shared/calibration/refs.yaml (gpu_specs). Capacities are the memory the driver
// reports (nvidia-smi "Total", in MiB): the marketing "80GB" of an A100 is 81920 MiB = 80 GiB, the
// "141GB" of an H200 143771 MiB. NVLink figures are per direction: half of the datasheet's
// bidirectional number (A100: 600 GB/s -> 300 GB/s; H100/H200: 900 GB/s -> 450 GB/s).
#include "core/gpu.h"

#include <algorithm>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/suggest.h"

namespace nnsim {
namespace {

constexpr double kT = 1e12;  // TFLOP/s
constexpr double kG = 1e9;   // GB/s
constexpr double kMiB = 1024.0 * 1024.0;

constexpr const char* kA100Source =
    "https://www.nvidia.com/en-us/data-center/a100/ (NVIDIA A100 datasheet)";
constexpr const char* kH100Source =
    "https://www.nvidia.com/en-us/data-center/h100/ (NVIDIA H100 datasheet, SXM column)";

// A100 tensor cores: tf32 156, bf16/fp16 312 TFLOP/s; no fp8 (peak_flops falls back to bf16).
std::map<Precision, double> a100_flops() {
  return {{Precision::kFp32, 19.5 * kT},
          {Precision::kTf32, 156 * kT},
          {Precision::kBf16, 312 * kT},
          {Precision::kFp16, 312 * kT}};
}

// H100 SXM5 and H200 (same GH100 die and clocks): tf32 494.5, bf16/fp16 989, fp8 1979 TFLOP/s.
std::map<Precision, double> h100_sxm_flops() {
  return {{Precision::kFp32, 67 * kT},
          {Precision::kTf32, 494.5 * kT},
          {Precision::kBf16, 989 * kT},
          {Precision::kFp16, 989 * kT},
          {Precision::kFp8, 1979 * kT}};
}

// A catalog entry: its own base.
GpuSpec entry(const std::string& name, std::map<Precision, double> flops, double hbm_bytes,
              double hbm_bandwidth, double nvlink_bandwidth, int sms, const std::string& source) {
  GpuSpec g;
  g.name = name;
  g.dense_flops = std::move(flops);
  g.hbm_bytes = hbm_bytes;
  g.hbm_bandwidth = hbm_bandwidth;
  g.nvlink_bandwidth = nvlink_bandwidth;
  g.sms = sms;
  g.source = source;
  g.base = name;
  return g;
}

std::vector<GpuSpec> build_catalog() {
  std::vector<GpuSpec> c;
  // The optional NVLink bridge between two A100 PCIe cards is not modeled: PCIe-only.
  c.push_back(entry("a100-pcie-80gb", a100_flops(), 81920 * kMiB, 1935 * kG, 0, 108,
                    std::string(kA100Source) + ", A100 80GB PCIe column"));
  c.push_back(entry("a100-sxm4-40gb", a100_flops(), 40960 * kMiB, 1555 * kG, 300 * kG, 108,
                    std::string(kA100Source) + ", A100 40GB SXM column"));
  c.push_back(entry("a100-sxm4-80gb", a100_flops(), 81920 * kMiB, 2039 * kG, 300 * kG, 108,
                    std::string(kA100Source) + ", A100 80GB SXM column"));
  c.push_back(entry("h100-sxm5-80gb", h100_sxm_flops(), 81559 * kMiB, 3350 * kG, 450 * kG, 132,
                    kH100Source));
  c.push_back(
      entry("h100-sxm5-96gb", h100_sxm_flops(), 97871 * kMiB, 3350 * kG, 450 * kG, 132,
            std::string("derived from h100-sxm5-80gb (same compute, NVLink and HBM bandwidth; ") +
                kH100Source + ") with 96 GB of HBM (97871 MiB usable)"));
  // refs.yaml lists bf16, fp8, HBM and NVLink for the H200; fp32, tf32, fp16 and the SM count
  // are those of the H100 SXM5, which the H200 datasheet repeats (same die).
  c.push_back(entry("h200-sxm-141gb", h100_sxm_flops(), 143771 * kMiB, 4800 * kG, 450 * kG, 132,
                    "https://www.nvidia.com/en-us/data-center/h200/ (NVIDIA H200 datasheet, SXM "
                    "column)"));
  std::sort(c.begin(), c.end(), [](const GpuSpec& a, const GpuSpec& b) { return a.name < b.name; });
  return c;
}

}  // namespace

double GpuSpec::peak_flops(Precision p) const {
  // Formats the GPU lacks run at the rate of the next wider one it has: fp8 on an A100 runs as
  // bf16, which is what frameworks do when asked for fp8 on hardware without fp8 tensor cores.
  static constexpr Precision kFp8Chain[] = {Precision::kFp8, Precision::kBf16, Precision::kFp16,
                                            Precision::kTf32, Precision::kFp32};
  static constexpr Precision kBf16Chain[] = {Precision::kBf16, Precision::kFp16, Precision::kTf32,
                                             Precision::kFp32};
  static constexpr Precision kFp16Chain[] = {Precision::kFp16, Precision::kBf16, Precision::kTf32,
                                             Precision::kFp32};
  static constexpr Precision kTf32Chain[] = {Precision::kTf32, Precision::kFp32};
  static constexpr Precision kFp32Chain[] = {Precision::kFp32};
  std::span<const Precision> chain;
  switch (p) {
    case Precision::kFp8:
      chain = kFp8Chain;
      break;
    case Precision::kBf16:
      chain = kBf16Chain;
      break;
    case Precision::kFp16:
      chain = kFp16Chain;
      break;
    case Precision::kTf32:
      chain = kTf32Chain;
      break;
    case Precision::kFp32:
      chain = kFp32Chain;
      break;
  }
  for (Precision q : chain) {
    auto it = dense_flops.find(q);
    if (it != dense_flops.end() && it->second > 0) return it->second;
  }
  return 0;
}

const std::vector<GpuSpec>& gpu_catalog() {
  static const std::vector<GpuSpec> catalog = build_catalog();
  return catalog;
}

Expected<GpuSpec> find_gpu(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& g : gpu_catalog()) {
    if (g.name == name) return g;
    names.push_back(g.name);
  }
  // suggest() lists the catalog itself when nothing is close; otherwise list it here.
  std::string hint = suggest(name, names);
  if (hint.find("did you mean") != std::string::npos) {
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    hint += "; catalog GPUs: " + known;
  }
  return Error("unknown GPU '" + name + "'" + hint +
               " (or describe a hypothetical GPU as a mapping with 'base:')");
}

}  // namespace nnsim
