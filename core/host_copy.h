// A copy between a GPU and its host's memory: the one price that optimizer, parameter and
// activation offloading all pay for crossing PCIe (or NVLink-C2C).
#pragma once

#include "core/cost_model.h"
#include "core/topology.h"

namespace nnsim {

// Bytes/s per direction of a GPU's way to host memory (Network::host_route): its host link
// (node.host.link_bandwidth, a GPU's share while every GPU of the node copies) or, when
// node.pcie describes it and it is slower, the GPU's PCIe link.
double host_link_bandwidth(const Topology& topology);

// Seconds to copy `bytes` between one GPU and its host alone on that way, at the measured
// PCIe efficiency of the direction. In the simulator the copy shares the GPU's PCIe link with
// its NIC's traffic.
double host_copy_seconds(double bytes, bool to_host, const Topology& topology,
                         const ComputeModel& model);

}  // namespace nnsim
