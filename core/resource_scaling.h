// One hardware resource of a cluster made faster or slower, the rest unchanged: the what-if
// behind a sensitivity study ("what would twice the network bandwidth buy this plan?").
#pragma once

#include <array>
#include <string_view>

#include "core/topology.h"

namespace nnsim {

enum class Resource {
  kCompute,          // the GPU's dense peak FLOP/s, every precision
  kMemoryBandwidth,  // the GPU's HBM bandwidth
  kIntraNode,        // the links inside a node: NVSwitch ports, NVLink links, PCIe
  kNetwork,          // the NICs, and the fabric uplinks sized from them
};
inline constexpr std::array<Resource, 4> kResources = {
    Resource::kCompute, Resource::kMemoryBandwidth, Resource::kIntraNode, Resource::kNetwork};

std::string_view resource_name(Resource r);  // "compute", "hbm", "intra-node", "network"
// What the resource's factor multiplies, for reports ("GPU dense FLOP/s, every precision").
std::string_view resource_description(Resource r);

// `topo` with `r`'s peaks or bandwidths times `factor` (> 0); latencies, capacities and the
// GPU's identity (whose measured efficiencies the cost model applies) are kept, so every cost
// that runs at the resource's rate scales and nothing else moves.
Topology scale_resource(Topology topo, Resource r, double factor);

}  // namespace nnsim
