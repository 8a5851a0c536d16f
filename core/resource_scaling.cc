#include "core/resource_scaling.h"

namespace nnsim {

std::string_view resource_name(Resource r) {
  switch (r) {
    case Resource::kCompute:
      return "compute";
    case Resource::kMemoryBandwidth:
      return "hbm";
    case Resource::kIntraNode:
      return "intra-node";
    case Resource::kNetwork:
      return "network";
    case Resource::kLatency:
      return "latency";
  }
  return "";
}

std::string_view resource_description(Resource r) {
  switch (r) {
    case Resource::kCompute:
      return "GPU dense FLOP/s, every precision";
    case Resource::kMemoryBandwidth:
      return "GPU memory (HBM) bandwidth";
    case Resource::kIntraNode:
      return "links inside a node (NVLink, NVSwitch, PCIe)";
    case Resource::kNetwork:
      return "NICs and the fabric behind them";
    case Resource::kLatency:
      return "link, NIC and switch latencies and NCCL's time a step (divided)";
  }
  return "";
}

Topology scale_resource(Topology topo, Resource r, double factor) {
  switch (r) {
    case Resource::kCompute:
      for (auto& [precision, flops] : topo.gpu.dense_flops) flops *= factor;
      break;
    case Resource::kMemoryBandwidth:
      topo.gpu.hbm_bandwidth *= factor;
      break;
    case Resource::kIntraNode:
      topo.intra.bandwidth *= factor;
      topo.intra.pcie.gpu_link_bandwidth *= factor;
      topo.intra.pcie.switch_uplink_bandwidth *= factor;
      topo.gpu.nvlink_bandwidth *= factor;
      break;
    case Resource::kNetwork:
      // The fabric's uplinks are sized from the NICs (core/network.h), so they follow.
      for (NicSpec& nic : topo.nics) nic.bandwidth *= factor;
      break;
    case Resource::kLatency:
      topo.intra.latency /= factor;
      topo.intra.pcie.latency /= factor;
      for (NicSpec& nic : topo.nics) nic.latency /= factor;
      topo.fabric.switch_latency /= factor;
      break;
  }
  return topo;
}

CommModel scale_resource(CommModel comm, Resource r, double factor) {
  if (r == Resource::kLatency) {
    comm.nvlink.step_latency /= factor;
    comm.network.step_latency /= factor;
  }
  return comm;
}

}  // namespace nnsim
