#include "hwexec/fit_host.h"

#include <fmt/format.h>

#include "core/host_copy.h"

namespace nnsim::hwexec {

bool has_host_series(const MicroResults& micro) {
  return !micro.host_adam.empty() || !micro.host_copies.empty();
}

Expected<HostFit> fit_host(const MicroResults& micro, const std::string& path,
                           const Topology& topology) {
  if (!topology.has_host) {
    return Error(fmt::format(
        "{}: its host's Adam and copies are relative to the topology's host, and {} describes "
        "none: add node.host (memory, memory_bandwidth, link_bandwidth) or leave --topo out",
        path, topology.name));
  }
  HostFit f;
  auto beyond = [&](const char* what, double rate, const char* field, double figure) {
    return Error(fmt::format(
        "{}: the {} ran at {:.4g} bytes/s, above {}'s {} of {:.4g}: the topology does not "
        "describe the machine measured; correct {}",
        path, what, rate, topology.name, field, figure, field));
  };
  if (!micro.host_adam.empty()) {
    // The largest size: out of the CPU's caches, as an offloaded optimizer's state is.
    const HostAdamSample* largest = &micro.host_adam.front();
    for (const HostAdamSample& x : micro.host_adam) {
      if (x.elements > largest->elements) largest = &x;
    }
    f.adam_elements = largest->elements;
    f.adam_bandwidth = largest->elements * kHostAdamBytesPerElement / largest->t.seconds;
    const double figure = topology.host.memory_bandwidth;
    if (f.adam_bandwidth > figure) {
      return beyond("host's Adam", f.adam_bandwidth, "node.host.memory_bandwidth", figure);
    }
    f.memory_efficiency = f.adam_bandwidth / figure;
  }
  f.link_bandwidth = host_link_bandwidth(topology);
  for (const HostCopySeries& s : micro.host_copies) {
    if (s.samples.empty()) continue;
    const HostCopySample* largest = &s.samples.front();
    for (const HostCopySample& x : s.samples) {
      if (x.bytes > largest->bytes) largest = &x;
    }
    const double rate = largest->bytes / largest->t.seconds;
    if (rate > f.link_bandwidth) {
      Error e = beyond(s.direction == "to_host" ? "copies to the host" : "copies from the host",
                       rate, "node.host.link_bandwidth", f.link_bandwidth);
      if (s.gpus >= topology.gpus_per_node) return e;
      return Error(fmt::format(
          "{}, or measure on all {} GPUs of a node (link_bandwidth is a GPU's share while all "
          "copy; {} copied here)",
          e.message(), topology.gpus_per_node, s.gpus));
    }
    const bool to_host = s.direction == "to_host";
    (to_host ? f.to_host_bandwidth : f.to_device_bandwidth) = rate;
    (to_host ? f.to_host_efficiency : f.to_device_efficiency) = rate / f.link_bandwidth;
    f.gpus = s.gpus;
  }
  if (f.gpus > 0 && f.gpus < topology.gpus_per_node) {
    f.notes.push_back(fmt::format(
        "the copies ran on {} GPUs at once, the node of {} has {}: where its GPUs share their way "
        "to the host, each gets less when all copy, and the efficiencies are high",
        f.gpus, topology.name, topology.gpus_per_node));
  }
  return f;
}

}  // namespace nnsim::hwexec
