// The host's side of offloading fitted to a microbenchmark file (`nnsim calibrate micro.h5
// --topo T.yaml`, docs/hwexec.md "The host: Adam and copies"): the host's Adam step against the
// node's memory bandwidth (host_memory_efficiency), and the GPUs' copies to and from the host
// against each GPU's way there (device_to_host_efficiency, host_to_device_efficiency). No
// printing.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/topology.h"
#include "hwexec/micro.h"

namespace nnsim::hwexec {

struct HostFit {
  // Adam at its largest size: traffic (kHostAdamBytesPerElement a weight) over time, and that
  // over node.host.memory_bandwidth.
  std::optional<double> memory_efficiency;
  double adam_bandwidth = 0, adam_elements = 0;
  // Each direction at its largest size: bytes a GPU over time, and that over the topology's
  // way to the host (host_link_bandwidth).
  std::optional<double> to_host_efficiency, to_device_efficiency;
  double to_host_bandwidth = 0, to_device_bandwidth = 0;
  double link_bandwidth = 0;  // bytes/s a GPU the copies' efficiencies are relative to
  int gpus = 0;               // GPUs that copied at once
  std::vector<std::string> notes;
};

// Whether `micro` holds anything fit_host fits.
bool has_host_series(const MicroResults& micro);

// Errors (naming `path`, the topology and its field) when the topology describes no host, or
// when a measurement beats the topology's figure (an efficiency above 1: the field is wrong).
Expected<HostFit> fit_host(const MicroResults& micro, const std::string& path,
                           const Topology& topology);

}  // namespace nnsim::hwexec
