// A cluster: identical nodes of GPUs, how GPUs inside a node talk (NVSwitch, NVLink mesh or PCIe
// only), the NICs of a node and the GPUs each serves, and the fabric between nodes (one switch,
// a two-level fat tree, or rail-optimized). Described in YAML; see docs/topology.md.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/field_override.h"
#include "core/gpu.h"

namespace nnsim {

enum class IntraNodeKind { kNvSwitch, kNvLinkMesh, kPcie };
enum class FabricKind { kSingleSwitch, kFatTree, kRailOptimized };

// A direct NVLink connection between two GPUs of a node (NVLink mesh nodes).
struct MeshLink {
  int a = 0;
  int b = 0;
  int links = 1;  // parallel NVLink links; bandwidth = links * per-link bandwidth
};

// The PCIe tree of a node: GPUs and NICs hang off PCIe switches that share an uplink to the CPU.
struct PcieSpec {
  double gpu_link_bandwidth = 0;       // bytes/s per direction between a GPU and its PCIe switch
  double switch_uplink_bandwidth = 0;  // bytes/s per direction between a switch and the CPU
  double latency = 0;                  // seconds per hop
  std::vector<std::vector<int>> switches;  // local GPU indices under each PCIe switch
  std::vector<int> nic_switch;             // for each NIC, the PCIe switch it sits on
};

struct IntraNodeSpec {
  IntraNodeKind kind = IntraNodeKind::kNvSwitch;
  // kNvSwitch: bandwidth of each GPU's port into the switch, per direction.
  // kNvLinkMesh: bandwidth of one NVLink link, per direction.
  double bandwidth = 0;
  double latency = 0;          // seconds for one GPU-to-GPU transfer inside the node
  std::vector<MeshLink> mesh;  // kNvLinkMesh only
  bool has_pcie = false;       // true when `pcie` is described (required for kPcie)
  PcieSpec pcie;
};

struct NicSpec {
  double bandwidth = 0;   // bytes/s per direction
  double latency = 0;     // seconds, NIC plus cable to the first switch
  std::vector<int> gpus;  // local GPU indices this NIC serves
};

// The host a node's GPUs offload to (optimizer offloading, docs/topology.md "node.host"): its
// memory, the bandwidth of that memory, and each GPU's share of the PCIe path to it.
struct HostSpec {
  double memory = 0;            // bytes of host memory per node
  double memory_bandwidth = 0;  // bytes/s, the node's peak memory bandwidth (all sockets)
  // bytes/s per direction between one GPU and host memory while every GPU of the node copies
  // (a PCIe switch uplink shared by two GPUs gives each half of it).
  double link_bandwidth = 0;
};

struct FabricSpec {
  FabricKind kind = FabricKind::kSingleSwitch;
  // kFatTree: nodes under one leaf switch. kRailOptimized: nodes in one scalable unit (each rail
  // of a unit has its own leaf switch). Ignored for kSingleSwitch.
  int nodes_per_group = 0;
  double oversubscription = 1.0;  // leaf downlink : uplink bandwidth ratio (>= 1)
  double switch_latency = 0;      // seconds per switch traversed beyond the first
};

struct Topology {
  std::string name;
  std::string description;
  std::string file;  // where it was read from (for messages)
  GpuSpec gpu;
  int nodes = 0;
  int gpus_per_node = 0;
  IntraNodeSpec intra;
  std::vector<NicSpec> nics;  // per node
  bool has_host = false;      // true when node.host is described
  HostSpec host;
  FabricSpec fabric;

  int num_gpus() const { return nodes * gpus_per_node; }
  int node_of(int gpu) const { return gpu / gpus_per_node; }
  int local_index(int gpu) const { return gpu % gpus_per_node; }
  // The NIC serving a local GPU (the first NIC that lists it).
  int nic_of(int local_gpu) const;
  // Nodes in a fat-tree leaf or rail-optimized unit (all nodes for a single switch).
  int group_size() const;
};

// Reads a topology from a YAML file, or a preset name ("dgx-a100x4") from topologies/.
Expected<Topology> load_topology(const std::string& path_or_preset);
// The same with fields replaced ("node.nics.bandwidth=800 Gb/s", "fabric.oversubscription=2",
// "gpu.hbm_bytes=141 GB": a GPU given by name becomes a hypothetical one based on it), for
// what-if studies without copying the file. The name records them ("dgx-h100-superpod with
// node.nics.bandwidth=800 Gb/s") unless one sets it. Errors in a replaced value name `flag`.
Expected<Topology> load_topology(const std::string& path_or_preset,
                                 const std::vector<FieldOverride>& overrides,
                                 const std::string& flag);
Expected<Topology> parse_topology(const std::string& yaml_text, const std::string& display_name);
// Checks internal consistency (every GPU served by a NIC, indices in range, ...).
Status validate_topology(const Topology& topo);
// The same cluster with a different node count (what-if studies); fabric groups are kept.
Expected<Topology> resize_topology(const Topology& topo, int nodes);

// Full path of a preset file, e.g. "<source>/topologies/dgx-a100x4.yaml"; empty if none.
std::string topology_preset_path(const std::string& name);
std::vector<std::string> topology_preset_names();

}  // namespace nnsim
