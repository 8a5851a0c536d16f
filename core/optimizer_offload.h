// Optimizer offloading: part of a device's optimizer shard kept in host memory and updated by
// the CPU (Megatron-Core's HybridDeviceOptimizer, DeepSpeed's ZeRO-Offload). What it saves on
// the GPU, what it needs on the host, and how long the step takes (docs/cost-model.md,
// "Optimizer offloading").
#pragma once

#include "core/cost_model.h"
#include "core/plan.h"
#include "core/topology.h"

namespace nnsim {

// The parts of one device's optimizer step with `params` parameters in its optimizer shard,
// the largest of its tensors `largest_tensor` parameters, `offload_fraction` of them on the host.
struct OffloadedStep {
  double gpu = 0;        // the GPU's own part (optimizer_seconds)
  double to_host = 0;    // the offloaded gradients over PCIe
  double host = 0;       // the CPU's update, at the device's share of host memory bandwidth
  double to_device = 0;  // the updated parameters back
  double seconds = 0;    // the whole step
};
OffloadedStep offloaded_optimizer_step(double params, double largest_tensor,
                                       const OptimizerSpec& optimizer, const Topology& topology,
                                       const ComputeModel& model);

// Host memory one device's offloaded shard takes: its state and a pinned copy of its gradients,
// and with offload_params its parameter shard.
double offloaded_host_bytes(double params, const OptimizerSpec& optimizer);

}  // namespace nnsim
