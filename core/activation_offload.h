// Activation offloading as Transformer Engine runs it under Megatron-Core's --cpu-offloading:
// which layer's forward waits for each offloaded layer's copy to the host and which layer's
// backward starts copying it back, and how long a copy takes (docs/cost-model.md, "Activation
// offloading").
#pragma once

#include <vector>

#include "core/cost_model.h"
#include "core/topology.h"

namespace nnsim {

// For each of the first `offloaded` of `layers` layers (0-based within the stage), the layer
// that ends its window: the forward waits for the offloaded layer's copy to the host after
// that layer's forward, and the backward starts copying it back before that layer's backward.
// The windows spread the copies evenly over the stage (Transformer Engine's layer_window_map);
// the last one ends at the last layer. Requires 0 < offloaded < layers.
std::vector<int> activation_offload_windows(int layers, int offloaded);

// Seconds to copy `bytes` between one GPU and its host while every GPU of the node copies
// (node.host.link_bandwidth is a GPU's share), at the measured PCIe efficiency of the
// direction.
double host_copy_seconds(double bytes, bool to_host, const Topology& topology,
                         const ComputeModel& model);

}  // namespace nnsim
