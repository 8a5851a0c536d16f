#include "tools/driver.h"

#include <fstream>
#include <utility>

#include <fmt/format.h>

namespace nnsim::tool {

int fail(const std::string& message) {
  std::fprintf(stderr, "nnsim: error: %s\n", message.c_str());
  return 1;
}

Expected<const Calibration*> optional_calibration(const std::string& path, Calibration& storage) {
  if (path.empty()) return static_cast<const Calibration*>(nullptr);
  Expected<Calibration> c = load_calibration(path);
  if (!c) return c.error();
  storage = std::move(*c);
  return static_cast<const Calibration*>(&storage);
}

bool write_file(const std::string& path, const std::string& text, std::string* error) {
  std::ofstream out(path, std::ios::binary);
  if (!out) {
    *error = fmt::format("cannot write '{}' (does its folder exist?)", path);
    return false;
  }
  out << text;
  if (!out.flush()) {
    *error = fmt::format("writing '{}' failed", path);
    return false;
  }
  return true;
}

Expected<Topology> load_topology_sized(const std::string& path, int nodes) {
  Expected<Topology> topo = load_topology(path);
  if (!topo || nodes <= 0) return topo;
  return resize_topology(*topo, nodes);
}

void note_hypothetical_gpu(const GpuSpec& gpu) {
  if (gpu.base.empty() || gpu.base == gpu.name) return;
  std::printf(
      "note: %s is a hypothetical GPU: its peaks, memory and NVLink as the topology gives them, "
      "its GEMM, attention and NCCL efficiencies %s's measured ones (docs/topology.md)\n",
      gpu.name.c_str(), gpu.base.c_str());
}

void note_unvalidated_moe(const ModelSpec& model) {
  if (!model.moe()) return;
  std::printf(
      "note: mixture-of-experts step times are not validated yet: NVIDIA's published H100 runs "
      "of Qwen3-30B-A3B and GPT-OSS 120B took 1.4-3x nnsim's time, of DeepSeek-V3 over 16 nodes "
      "0.4-0.6x (docs/moe.md)\n");
}

void note_unvalidated_hybrid(const ModelSpec& model) {
  if (model.has_layer_kind('G')) {
    std::printf(
        "note: Gated DeltaNet layers are priced by their kernels' FLOPs and traffic, which no "
        "kernel measurement or published training run has checked yet (docs/hybrid.md)\n");
  }
  if (!model.has_layer_kind('M')) return;
  std::printf(
      "note: Mamba-2 layers are priced by their kernels' traffic, which no kernel measurement "
      "has checked yet; on NVIDIA's published Nemotron-H 56B H100 runs nnsim's step is within "
      "2.4 %% without tensor-parallel communication overlap and 22-25 %% short with it, and the "
      "runs do not state which (docs/hybrid.md)\n");
}

}  // namespace nnsim::tool
