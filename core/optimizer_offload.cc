#include "core/optimizer_offload.h"

#include <algorithm>

#include "core/host_copy.h"

namespace nnsim {

OffloadedStep offloaded_optimizer_step(double params, double largest_tensor,
                                       const OptimizerSpec& optimizer, const Topology& topology,
                                       const ComputeModel& model) {
  OffloadedStep s;
  const double f = optimizer.offload_fraction;
  s.gpu = optimizer_seconds((1 - f) * params, optimizer.grad_bytes, optimizer.state_bytes,
                            topology.gpu, model);
  const double host_params = f * params;
  if (host_params <= 0) {
    s.seconds = s.gpu;
    return s;
  }
  // Host memory traffic per parameter: the copied-in gradient written and read, Adam's state
  // read and written, and the updated parameter read by the copy back, or, with the parameters
  // living on the host (their copies run beside the gathers and reductions), read and written
  // in place. Every GPU of the node updates its shard at once, so each gets its share of the
  // bandwidth.
  const double parameter_traffic =
      optimizer.offload_params ? 2 * optimizer.weight_shard_bytes : optimizer.offload_param_bytes;
  const double traffic = 2 * optimizer.grad_bytes + 2 * optimizer.state_bytes + parameter_traffic;
  if (!optimizer.offload_params) {
    s.to_host = host_copy_seconds(host_params * optimizer.grad_bytes, true, topology, model);
    s.to_device =
        host_copy_seconds(host_params * optimizer.offload_param_bytes, false, topology, model);
  }
  s.host = host_params * traffic /
           (topology.host.memory_bandwidth * model.host_memory_efficiency / topology.gpus_per_node);
  if (optimizer.offload_overlap) {
    // Tensor by tensor: the copies and the update pipeline, so the slowest of them (or the
    // GPU's own part) sets the pace and the largest tensor passes through the other two.
    const double one = std::min(largest_tensor, host_params) / host_params;
    s.seconds = std::max({s.to_host, s.host, s.to_device, s.gpu}) +
                one * (s.to_host + s.host + s.to_device);
  } else {
    // The gradients copy, then the CPU updates while the GPU does its part, then the copy back.
    s.seconds = s.to_host + std::max(s.host, s.gpu) + s.to_device;
  }
  return s;
}

double offloaded_host_bytes(double params, const OptimizerSpec& optimizer) {
  const double per_param = optimizer.state_bytes + optimizer.grad_bytes +
                           (optimizer.offload_params ? optimizer.weight_shard_bytes : 0.0);
  return optimizer.offload_fraction * params * per_param;
}

}  // namespace nnsim
