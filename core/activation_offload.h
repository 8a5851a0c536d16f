// Activation offloading as Transformer Engine runs it under Megatron-Core's --cpu-offloading:
// which layer's forward waits for each offloaded layer's copy to the host and which layer's
// backward starts copying it back (docs/cost-model.md, "Activation offloading"); a copy's time
// is host_copy_seconds (core/host_copy.h).
#pragma once

#include <vector>

namespace nnsim {

// For each of the first `offloaded` of `layers` layers (0-based within the stage), the layer
// that ends its window: the forward waits for the offloaded layer's copy to the host after
// that layer's forward, and the backward starts copying it back before that layer's backward.
// The windows spread the copies evenly over the stage (Transformer Engine's layer_window_map);
// the last one ends at the last layer. Requires 0 < offloaded < layers.
std::vector<int> activation_offload_windows(int layers, int offloaded);

}  // namespace nnsim
