// One hardware resource of a cluster made faster or slower, the rest unchanged: the what-if
// behind a sensitivity study ("what would twice the network bandwidth buy this plan?").
#pragma once

#include <array>
#include <string_view>

#include "core/comm_model.h"
#include "core/topology.h"

namespace nnsim {

enum class Resource {
  kCompute,          // the GPU's dense peak FLOP/s, every precision
  kMemoryBandwidth,  // the GPU's HBM bandwidth
  kIntraNode,        // the links inside a node: NVSwitch ports, NVLink links, PCIe
  kNetwork,          // the NICs, and the fabric uplinks sized from them
  kLatency,          // link, NIC and switch latencies and NCCL's least time a step (divided)
};
inline constexpr std::array<Resource, 5> kResources = {
    Resource::kCompute, Resource::kMemoryBandwidth, Resource::kIntraNode, Resource::kNetwork,
    Resource::kLatency};

// "compute", "hbm", "intra-node", "network", "latency".
std::string_view resource_name(Resource r);
// What the resource's factor multiplies, for reports ("GPU dense FLOP/s, every precision").
std::string_view resource_description(Resource r);

// `topo` with `r`'s peaks or bandwidths times `factor` (> 0), or for kLatency its latencies
// divided by it; capacities and the GPU's identity (whose measured efficiencies the cost model
// applies) are kept, so every cost that runs at the resource's rate scales and nothing else
// moves.
Topology scale_resource(Topology topo, Resource r, double factor);
// The communication model's part of `r`: for kLatency, NCCL's least time a step of a
// collective (LinkClassModel::step_latency) divided by `factor`; the others leave it as is.
CommModel scale_resource(CommModel comm, Resource r, double factor);

}  // namespace nnsim
