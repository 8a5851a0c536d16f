#include "core/comm_model.h"

#include <algorithm>
#include <cmath>

namespace nnsim {

double LinkClassModel::efficiency(double bytes, bool all_reduce) const {
  const double cap = all_reduce ? all_reduce_max_efficiency : max_efficiency;
  if (curve.empty()) return cap;
  double e = curve.back().efficiency;
  if (bytes <= curve.front().bytes) {
    e = curve.front().efficiency;
  } else if (bytes < curve.back().bytes) {
    for (size_t i = 1; i < curve.size(); ++i) {
      if (bytes <= curve[i].bytes) {
        const auto& a = curve[i - 1];
        const auto& b = curve[i];
        const double f = std::log(bytes / a.bytes) / std::log(b.bytes / a.bytes);
        e = a.efficiency + f * (b.efficiency - a.efficiency);
        break;
      }
    }
  }
  return std::min(e, cap);
}

namespace {

struct Measured {
  double bytes;
  double time_us;
};

// Efficiency curve of an n-GPU ring all-reduce measured on links of `link_bandwidth`, from
// sizes of 1 MiB up (below, the time is all latency and the efficiency undefined).
LinkClassModel from_all_reduce(const std::vector<Measured>& table, int n, double link_bandwidth) {
  LinkClassModel m;
  const double alpha_us = table.front().time_us;
  m.step_latency = alpha_us * 1e-6 / (2.0 * (n - 1));
  for (const Measured& p : table) {
    if (p.bytes < 1024.0 * 1024) continue;
    const double volume = 2.0 * (n - 1) / n * p.bytes;
    const double e = volume / (link_bandwidth * (p.time_us - alpha_us) * 1e-6);
    m.curve.push_back({p.bytes, e});
  }
  return m;
}

// nccl-tests all_reduce_perf, 8 x A100 SXM (NVLink 3, 300 GB/s per direction), float32 sum,
// out of place (refs.yaml: nccl-allreduce-dgx-a100-8gpu).
const std::vector<Measured> kA100AllReduce = {
    {32768, 43.83},      {1048576, 101.9},    {2097152, 101.4},    {4194304, 101.5},
    {8388608, 133.5},    {16777216, 276.6},   {33554432, 424.0},   {67108864, 684.6},
    {134217728, 1327.6}, {268435456, 2420.6}, {536870912, 4218.4}, {1073741824, 8203.9},
    {2147483648, 16240}, {4294967296, 32136}, {8589934592, 64074}, {17179869184, 127997}};

// nccl-tests all_reduce_perf, 8 x H100 SXM (NVLink 4, 450 GB/s per direction), float32 sum,
// out of place; NCCL uses NVLink SHARP for large all-reduces (refs.yaml:
// nccl-allreduce-dgx-h100-8gpu).
const std::vector<Measured> kH100AllReduce = {
    {16, 13.0},           {1048576, 27.37},    {2097152, 42.21},    {4194304, 54.19},
    {8388608, 83.04},     {16777216, 123.8},   {33554432, 199.3},   {67108864, 324.7},
    {134217728, 586.4},   {268435456, 1112.5}, {536870912, 2151.0}, {1073741824, 4029.4},
    {2147483648, 7939.1}, {4294967296, 15749}, {8589934592, 31307}, {17179869184, 62648}};

}  // namespace

CommModel CommModel::defaults_for(const GpuSpec& gpu) {
  CommModel m;
  if (gpu.hopper()) {
    m.nvlink = from_all_reduce(kH100AllReduce, 8, 450e9);
    // Without NVLink SHARP (all-gather, reduce-scatter, point-to-point) a ring reaches about
    // 365 GB/s of bus bandwidth on 450 GB/s links (refs.yaml: nccl-allreduce-h200-8gpu-nvls-
    // vs-ring, ring_only_busbw_gbps); the all-reduce keeps its measured (NVLS) curve.
    m.nvlink.max_efficiency = 365.6 / 450;
    m.nvlink.all_reduce_max_efficiency = 482.26 / 450;
  } else {
    m.nvlink = from_all_reduce(kA100AllReduce, 8, 300e9);
    m.nvlink.max_efficiency = 1;
    m.nvlink.all_reduce_max_efficiency = 1;
  }
  // Between nodes: the same message-size curve (NCCL's protocols and chunking are the same),
  // reaching at most 90 % of the NICs' line rate, at least 6 us per step (assumptions,
  // docs/cost-model.md; calibrated from measurements when given).
  m.network = m.nvlink;
  const double top =
      std::max_element(m.network.curve.begin(), m.network.curve.end(),
                       [](const auto& a, const auto& b) { return a.efficiency < b.efficiency; })
          ->efficiency;
  for (auto& p : m.network.curve) p.efficiency = p.efficiency / top * 0.9;
  m.network.max_efficiency = 0.9;
  m.network.all_reduce_max_efficiency = 0.9;
  m.network.step_latency = 6e-6;
  return m;
}

CommModel CommModel::ideal() {
  CommModel m;
  m.nvlink.curve.clear();
  m.network.curve.clear();
  return m;
}

}  // namespace nnsim
