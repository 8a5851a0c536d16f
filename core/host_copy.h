// A copy between a GPU and its host's memory: the one price that optimizer, parameter and
// activation offloading all pay for crossing PCIe (or NVLink-C2C).
#pragma once

#include "core/cost_model.h"
#include "core/topology.h"

namespace nnsim {

// Seconds to copy `bytes` between one GPU and its host while every GPU of the node copies
// (node.host.link_bandwidth is a GPU's share), at the measured PCIe efficiency of the
// direction.
double host_copy_seconds(double bytes, bool to_host, const Topology& topology,
                         const ComputeModel& model);

}  // namespace nnsim
