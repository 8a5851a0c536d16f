#include "core/topology.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/input.h"
#include "core/suggest.h"

namespace nnsim {
namespace {

namespace fs = std::filesystem;

// The largest cluster nnsim accepts; keeps every GPU index and link index inside an int.
constexpr int64_t kMaxGpus = int64_t{1} << 24;
// The largest node (an NVLink domain of a few hundred GPUs is the biggest built so far); bounds
// the per-node tables, which grow with the square of the GPU count for an NVLink mesh.
constexpr int kMaxGpusPerNode = 4096;

std::string gpu_range(int n) {
  if (n <= 0) return "no GPUs";
  return n == 1 ? "1 GPU: 0" : fmt::format("{} GPUs: 0-{}", n, n - 1);
}

std::string no_such_gpu(int64_t gpu, int gpus_per_node) {
  return fmt::format("GPU {} does not exist (the node has {})", gpu, gpu_range(gpus_per_node));
}

// A consistency problem: the field it is about, as InputNode spells paths ("node.nics.gpus[2]"),
// and what is wrong. The validator works on a Topology, so that a file and a resized or
// programmatically built topology are checked by the same code; the parser then maps the field
// back to the line of the file.
struct Problem {
  std::string field;
  std::string message;
};

std::optional<Problem> check_gpu(const GpuSpec& gpu) {
  if (!(gpu.peak_flops(Precision::kBf16) > 0)) {
    return Problem{"gpu.bf16_flops", "the GPU needs a positive bf16 peak (e.g. '989 TFLOP/s')"};
  }
  if (!(gpu.hbm_bytes > 0)) {
    return Problem{"gpu.hbm_bytes", "the GPU needs a positive memory size (e.g. '80 GB')"};
  }
  if (!(gpu.hbm_bandwidth > 0)) {
    return Problem{"gpu.hbm_bandwidth",
                   "the GPU needs a positive memory bandwidth (e.g. '3350 GB/s')"};
  }
  if (!(gpu.nvlink_bandwidth >= 0)) {
    return Problem{"gpu.nvlink_bandwidth", "must be 0 (no NVLink) or positive"};
  }
  return std::nullopt;
}

std::optional<Problem> check_mesh(const Topology& t) {
  const int g = t.gpus_per_node;
  const auto& mesh = t.intra.mesh;
  if (mesh.empty()) {
    return Problem{"node.intra.links",
                   "an NVLink mesh needs at least one link, e.g. links: [[0, 1, 2]] (GPU 0 to "
                   "GPU 1 over 2 NVLinks); use kind: pcie for a node without NVLink"};
  }
  std::vector<int> seen(static_cast<size_t>(g) * g, -1);
  for (size_t i = 0; i < mesh.size(); ++i) {
    const MeshLink& m = mesh[i];
    std::string field = fmt::format("node.intra.links[{}]", i);
    if (m.a < 0 || m.a >= g) return Problem{field + "[0]", no_such_gpu(m.a, g)};
    if (m.b < 0 || m.b >= g) return Problem{field + "[1]", no_such_gpu(m.b, g)};
    if (m.a == m.b) return Problem{field, fmt::format("links GPU {} to itself", m.a)};
    if (m.links < 1) {
      return Problem{field + "[2]",
                     fmt::format("the number of NVLinks must be at least 1, got {}", m.links)};
    }
    int& prev = seen[static_cast<size_t>(m.a) * g + m.b];
    if (prev >= 0) {
      return Problem{field, fmt::format("GPUs {} and {} are already linked by "
                                        "node.intra.links[{}]; give one entry per pair with the "
                                        "total number of NVLinks",
                                        m.a, m.b, prev)};
    }
    prev = static_cast<int>(i);
    seen[static_cast<size_t>(m.b) * g + m.a] = static_cast<int>(i);
  }
  if (!t.intra.has_pcie) {
    for (int a = 0; a < g; ++a) {
      for (int b = a + 1; b < g; ++b) {
        if (seen[static_cast<size_t>(a) * g + b] < 0) {
          return Problem{"node.intra.links",
                         fmt::format("GPUs {} and {} have no NVLink between them, so they talk "
                                     "over PCIe: describe node.pcie, or link them",
                                     a, b)};
        }
      }
    }
  }
  return std::nullopt;
}

std::optional<Problem> check_pcie(const Topology& t) {
  const PcieSpec& p = t.intra.pcie;
  const int g = t.gpus_per_node;
  if (!(p.gpu_link_bandwidth > 0)) {
    return Problem{"node.pcie.gpu_link_bandwidth", "must be positive (e.g. '32 GB/s')"};
  }
  if (!(p.switch_uplink_bandwidth > 0)) {
    return Problem{"node.pcie.switch_uplink_bandwidth", "must be positive (e.g. '32 GB/s')"};
  }
  if (!(p.latency >= 0)) return Problem{"node.pcie.latency", "must not be negative"};
  if (p.switches.empty()) {
    return Problem{"node.pcie.switches",
                   "list the GPUs under each PCIe switch, e.g. switches: [[0, 1], [2, 3]]"};
  }
  std::vector<int> switch_of(g, -1);
  for (size_t s = 0; s < p.switches.size(); ++s) {
    for (size_t j = 0; j < p.switches[s].size(); ++j) {
      int gpu = p.switches[s][j];
      std::string field = fmt::format("node.pcie.switches[{}][{}]", s, j);
      if (gpu < 0 || gpu >= g) return Problem{field, no_such_gpu(gpu, g)};
      if (switch_of[gpu] >= 0) {
        return Problem{field, fmt::format("GPU {} is already under PCIe switch {}; a GPU sits "
                                          "under exactly one switch",
                                          gpu, switch_of[gpu])};
      }
      switch_of[gpu] = static_cast<int>(s);
    }
  }
  for (int gpu = 0; gpu < g; ++gpu) {
    if (switch_of[gpu] < 0) {
      return Problem{
          "node.pcie.switches",
          fmt::format("GPU {} is under no PCIe switch: add it to one of the lists", gpu)};
    }
  }
  if (p.nic_switch.size() != t.nics.size()) {
    return Problem{"node.pcie.nic_switch",
                   fmt::format("gives a PCIe switch for {} NICs but the node has {}: list one "
                               "switch index per NIC",
                               p.nic_switch.size(), t.nics.size())};
  }
  for (size_t i = 0; i < p.nic_switch.size(); ++i) {
    int s = p.nic_switch[i];
    if (s < 0 || s >= static_cast<int>(p.switches.size())) {
      return Problem{fmt::format("node.pcie.nic_switch[{}]", i),
                     fmt::format("PCIe switch {} does not exist (node.pcie.switches describes "
                                 "{}: 0-{})",
                                 s, p.switches.size(), p.switches.size() - 1)};
    }
  }
  return std::nullopt;
}

std::optional<Problem> check_nics(const Topology& t) {
  const int g = t.gpus_per_node;
  if (t.nics.empty()) {
    if (t.nodes > 1) {
      return Problem{"node.nics",
                     fmt::format("a cluster of {} nodes needs NICs between them: describe "
                                 "node.nics (count, bandwidth, latency)",
                                 t.nodes)};
    }
    return std::nullopt;
  }
  std::vector<bool> served(g, false);
  for (size_t i = 0; i < t.nics.size(); ++i) {
    const NicSpec& nic = t.nics[i];
    if (!(nic.bandwidth > 0)) {
      return Problem{"node.nics.bandwidth", "must be positive (e.g. '400 Gb/s')"};
    }
    if (!(nic.latency >= 0)) return Problem{"node.nics.latency", "must not be negative"};
    std::string field = fmt::format("node.nics.gpus[{}]", i);
    for (size_t j = 0; j < nic.gpus.size(); ++j) {
      int gpu = nic.gpus[j];
      if (gpu < 0 || gpu >= g) return Problem{field, no_such_gpu(gpu, g)};
      if (std::find(nic.gpus.begin(), nic.gpus.begin() + j, gpu) != nic.gpus.begin() + j) {
        return Problem{field, fmt::format("GPU {} is listed twice", gpu)};
      }
      served[gpu] = true;
    }
  }
  for (int gpu = 0; gpu < g; ++gpu) {
    if (!served[gpu]) {
      return Problem{"node.nics.gpus",
                     fmt::format("GPU {} is served by no NIC: add it to a NIC's list (when "
                                 "several NICs list a GPU, the first one carries its traffic)",
                                 gpu)};
    }
  }
  return std::nullopt;
}

std::optional<Problem> check_fabric(const FabricSpec& f) {
  if (f.kind == FabricKind::kSingleSwitch) return std::nullopt;
  if (f.nodes_per_group < 1) {
    return Problem{"fabric.nodes_per_group",
                   fmt::format("must be at least 1, got {} (nodes under one leaf switch, or in "
                               "one scalable unit)",
                               f.nodes_per_group)};
  }
  if (!(f.oversubscription >= 1)) {
    return Problem{"fabric.oversubscription",
                   fmt::format("must be at least 1, got {} (1 = full bisection bandwidth, 2 = "
                               "leaves have half as much uplink as downlink bandwidth)",
                               f.oversubscription)};
  }
  if (!(f.switch_latency >= 0)) return Problem{"fabric.switch_latency", "must not be negative"};
  return std::nullopt;
}

std::optional<Problem> find_problem_in_sizes(const Topology& t) {
  if (t.nodes < 1) {
    return Problem{"nodes", fmt::format("the cluster needs at least 1 node, got {}", t.nodes)};
  }
  if (t.gpus_per_node < 1) {
    return Problem{"node.gpus",
                   fmt::format("a node needs at least 1 GPU, got {}", t.gpus_per_node)};
  }
  if (t.gpus_per_node > kMaxGpusPerNode) {
    return Problem{"node.gpus", fmt::format("{} GPUs in a node is more than the {} nnsim supports",
                                            t.gpus_per_node, kMaxGpusPerNode)};
  }
  if (static_cast<int64_t>(t.nodes) * t.gpus_per_node > kMaxGpus) {
    return Problem{"nodes", fmt::format("{} nodes of {} GPUs is more than the {} GPUs nnsim "
                                        "supports",
                                        t.nodes, t.gpus_per_node, kMaxGpus)};
  }
  return std::nullopt;
}

std::optional<Problem> check_host(const HostSpec& h) {
  if (!(h.memory > 0)) return Problem{"node.host.memory", "must be positive (e.g. '2 TB')"};
  if (!(h.memory_bandwidth > 0)) {
    return Problem{"node.host.memory_bandwidth", "must be positive (e.g. '409.6 GB/s')"};
  }
  if (!(h.link_bandwidth > 0)) {
    return Problem{"node.host.link_bandwidth", "must be positive (e.g. '16 GB/s')"};
  }
  return std::nullopt;
}

std::optional<Problem> find_problem(const Topology& t) {
  if (auto p = find_problem_in_sizes(t)) return p;
  if (auto p = check_gpu(t.gpu)) return p;
  const IntraNodeSpec& in = t.intra;
  if (in.kind != IntraNodeKind::kPcie) {
    if (!(in.bandwidth > 0)) return Problem{"node.intra.bandwidth", "must be positive"};
    if (!(in.latency >= 0)) return Problem{"node.intra.latency", "must not be negative"};
  }
  if (in.kind == IntraNodeKind::kNvLinkMesh) {
    if (auto p = check_mesh(t)) return p;
  }
  if (in.kind == IntraNodeKind::kPcie && !in.has_pcie) {
    return Problem{"node.pcie",
                   "a PCIe-only node (node.intra.kind: pcie) needs node.pcie: gpu_link_bandwidth, "
                   "switch_uplink_bandwidth, latency and switches"};
  }
  if (auto p = check_nics(t)) return p;
  if (in.has_pcie) {
    if (auto p = check_pcie(t)) return p;
  }
  if (t.has_host) {
    if (auto p = check_host(t.host)) return p;
  }
  return check_fabric(t.fabric);
}

// ---- Parsing ------------------------------------------------------------------------------

// Throws an InputError for `p` at the line of its field (or of the closest enclosing field the
// file has, when the problem is about a field that was left out).
[[noreturn]] void report(const InputNode& root, const Problem& p) {
  InputNode at = root;
  bool exact = true;
  std::string_view rest = p.field;
  while (exact && !rest.empty()) {
    size_t end = rest.find_first_of(".[");
    std::string_view key = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end);
    if (!key.empty()) {
      if (!at.has(key)) {
        exact = false;
        break;
      }
      at = at[key];
    }
    while (!rest.empty() && rest.front() == '[') {
      size_t close = rest.find(']');
      size_t index = std::stoul(std::string(rest.substr(1, close - 1)));
      rest.remove_prefix(close + 1);
      if (!at.is_sequence()) {
        exact = false;
        break;
      }
      std::vector<InputNode> items = at.items();
      if (index >= items.size()) {
        exact = false;
        break;
      }
      at = items[index];
    }
    if (!rest.empty() && rest.front() == '.') rest.remove_prefix(1);
  }
  if (exact) at.fail(p.message);
  std::string where = at.line() > 0 ? fmt::format("{}:{}", at.file(), at.line()) : at.file();
  throw InputError(fmt::format("{}: field '{}': {}", where, p.field, p.message));
}

GpuSpec parse_gpu(const InputNode& n) {
  if (n.is_scalar()) {
    Expected<GpuSpec> gpu = find_gpu(n.as_string());
    if (!gpu) n.fail(gpu.error().message());
    return *gpu;
  }
  n.check_keys({"base", "name", "fp32_flops", "tf32_flops", "bf16_flops", "fp16_flops", "fp8_flops",
                "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "sms"});
  InputNode base = n["base"];
  Expected<GpuSpec> found = find_gpu(base.as_string());
  if (!found) base.fail(found.error().message());
  GpuSpec gpu = *found;
  std::string changed;
  auto note = [&](std::string_view key) {
    changed += (changed.empty() ? "" : ", ") + std::string(key);
  };
  struct FlopsKey {
    std::string_view key;
    Precision precision;
  };
  static constexpr FlopsKey kFlopsKeys[] = {{"fp32_flops", Precision::kFp32},
                                            {"tf32_flops", Precision::kTf32},
                                            {"bf16_flops", Precision::kBf16},
                                            {"fp16_flops", Precision::kFp16},
                                            {"fp8_flops", Precision::kFp8}};
  for (const auto& [key, precision] : kFlopsKeys) {
    if (auto v = n.get(key)) {
      gpu.dense_flops[precision] = v->as_quantity(Dimension::kFlopsPerSecond);
      note(key);
    }
  }
  if (auto v = n.get("hbm_bytes")) {
    gpu.hbm_bytes = v->as_quantity(Dimension::kBytes);
    note("hbm_bytes");
  }
  if (auto v = n.get("hbm_bandwidth")) {
    gpu.hbm_bandwidth = v->as_quantity(Dimension::kBytesPerSecond);
    note("hbm_bandwidth");
  }
  if (auto v = n.get("nvlink_bandwidth")) {
    gpu.nvlink_bandwidth = v->as_quantity(Dimension::kBytesPerSecond);
    note("nvlink_bandwidth");
  }
  if (auto v = n.get("sms")) {
    gpu.sms = v->as_small_int();
    if (gpu.sms < 1) v->fail("must be at least 1");
    note("sms");
  }
  gpu.name = n.get_string("name", gpu.name + "-custom");
  gpu.source = fmt::format("hypothetical GPU described in {}: {} with {} changed", n.file(),
                           found->name, changed.empty() ? "nothing" : changed);
  return gpu;
}

void parse_pcie(const InputNode& n, PcieSpec& p) {
  n.check_keys(
      {"gpu_link_bandwidth", "switch_uplink_bandwidth", "latency", "switches", "nic_switch"});
  p.gpu_link_bandwidth = n["gpu_link_bandwidth"].as_quantity(Dimension::kBytesPerSecond);
  p.switch_uplink_bandwidth = n["switch_uplink_bandwidth"].as_quantity(Dimension::kBytesPerSecond);
  p.latency = n["latency"].as_quantity(Dimension::kSeconds);
  for (const InputNode& sw : n["switches"].items()) {
    std::vector<int> gpus;
    for (const InputNode& gpu : sw.items()) gpus.push_back(gpu.as_small_int());
    p.switches.push_back(std::move(gpus));
  }
  if (auto ns = n.get("nic_switch")) {
    for (const InputNode& s : ns->items()) p.nic_switch.push_back(s.as_small_int());
  }
}

void parse_host(const InputNode& n, HostSpec& h) {
  n.check_keys({"memory", "memory_bandwidth", "link_bandwidth"});
  h.memory = n["memory"].as_quantity(Dimension::kBytes);
  h.memory_bandwidth = n["memory_bandwidth"].as_quantity(Dimension::kBytesPerSecond);
  h.link_bandwidth = n["link_bandwidth"].as_quantity(Dimension::kBytesPerSecond);
}

void parse_nics(const InputNode& n, Topology& t) {
  n.check_keys({"count", "bandwidth", "latency", "gpus"});
  InputNode count_node = n["count"];
  int count = count_node.as_small_int();
  if (count < 1) {
    count_node.fail(
        fmt::format("a node needs at least 1 NIC, got {} (leave node.nics out for a "
                    "single node without NICs)",
                    count));
  }
  NicSpec proto;
  proto.bandwidth = n["bandwidth"].as_quantity(Dimension::kBytesPerSecond);
  proto.latency = n["latency"].as_quantity(Dimension::kSeconds);
  t.nics.assign(count, proto);
  if (auto gpus = n.get("gpus")) {
    std::vector<InputNode> lists = gpus->items();
    if (static_cast<int>(lists.size()) != count) {
      gpus->fail(
          fmt::format("lists the GPUs of {} NICs but node.nics.count is {}: give one "
                      "list per NIC",
                      lists.size(), count));
    }
    for (int i = 0; i < count; ++i) {
      // A bare number is shorthand for a one-GPU list.
      if (lists[i].is_scalar()) {
        t.nics[i].gpus.push_back(lists[i].as_small_int());
      } else {
        for (const InputNode& gpu : lists[i].items()) t.nics[i].gpus.push_back(gpu.as_small_int());
      }
    }
  } else {
    // Spread GPUs evenly: GPU j uses NIC floor(j * count / gpus), so with 8 GPUs and 2 NICs
    // NIC 0 serves GPUs 0-3 and NIC 1 serves GPUs 4-7.
    for (int j = 0; j < t.gpus_per_node; ++j) {
      int nic = static_cast<int>(static_cast<int64_t>(j) * count / t.gpus_per_node);
      t.nics[nic].gpus.push_back(j);
    }
  }
}

void parse_intra(const InputNode& n, Topology& t) {
  n.check_keys({"kind", "bandwidth", "latency", "links"});
  IntraNodeSpec& in = t.intra;
  in.kind = n["kind"].as_enum<IntraNodeKind>({{"nvswitch", IntraNodeKind::kNvSwitch},
                                              {"nvlink_mesh", IntraNodeKind::kNvLinkMesh},
                                              {"pcie", IntraNodeKind::kPcie}});
  if (in.kind == IntraNodeKind::kPcie) {
    for (std::string_view key : {"bandwidth", "latency", "links"}) {
      if (auto v = n.get(key)) {
        v->fail(
            "a PCIe-only node takes its bandwidths and latency from node.pcie: remove this "
            "field");
      }
    }
    return;
  }
  if (in.kind == IntraNodeKind::kNvSwitch) {
    if (auto v = n.get("links")) {
      v->fail(
          "'links' describes an NVLink mesh (kind: nvlink_mesh); an NVSwitch node needs "
          "only bandwidth and latency");
    }
    // The GPU's NVLink figure is the usual port bandwidth into the NVSwitch fabric.
    if (auto v = n.get("bandwidth")) {
      in.bandwidth = v->as_quantity(Dimension::kBytesPerSecond);
    } else if (t.gpu.nvlink_bandwidth > 0) {
      in.bandwidth = t.gpu.nvlink_bandwidth;
    } else {
      n.fail(
          fmt::format("missing field 'bandwidth' (each GPU's port bandwidth into the NVSwitch, "
                      "per direction): GPU {} has no NVLink figure to default to",
                      t.gpu.name));
    }
  } else {
    in.bandwidth = n["bandwidth"].as_quantity(Dimension::kBytesPerSecond);
    for (const InputNode& item : n["links"].items()) {
      std::vector<InputNode> v = item.is_sequence() ? item.items() : std::vector<InputNode>{};
      if (v.size() != 2 && v.size() != 3) {
        item.fail(
            "expected [a, b] or [a, b, links] (two GPU indices and the number of NVLinks "
            "between them)");
      }
      in.mesh.push_back(
          {v[0].as_small_int(), v[1].as_small_int(), v.size() == 3 ? v[2].as_small_int() : 1});
    }
  }
  in.latency = n["latency"].as_quantity(Dimension::kSeconds);
}

void parse_fabric(const InputNode& n, FabricSpec& f) {
  n.check_keys({"kind", "nodes_per_group", "oversubscription", "switch_latency"});
  f.kind = n["kind"].as_enum<FabricKind>({{"single_switch", FabricKind::kSingleSwitch},
                                          {"fat_tree", FabricKind::kFatTree},
                                          {"rail_optimized", FabricKind::kRailOptimized}});
  if (f.kind == FabricKind::kSingleSwitch) {
    for (std::string_view key : {"nodes_per_group", "oversubscription", "switch_latency"}) {
      if (auto v = n.get(key)) {
        v->fail(
            "a single switch has no groups or uplinks (its latency is part of "
            "node.nics.latency): remove this field");
      }
    }
    return;
  }
  f.nodes_per_group = n["nodes_per_group"].as_small_int();
  f.oversubscription = n.get_double("oversubscription", 1.0);
  f.switch_latency = n["switch_latency"].as_quantity(Dimension::kSeconds);
}

Topology parse_root(const InputNode& root) {
  root.check_keys({"name", "description", "gpu", "nodes", "node", "fabric"});
  Topology t;
  t.file = root.file();
  t.name = root.get_string("name", fs::path(root.file()).stem().string());
  t.description = root.get_string("description", "");
  t.gpu = parse_gpu(root["gpu"]);
  t.nodes = root["nodes"].as_small_int();
  InputNode node = root["node"];
  node.check_keys({"gpus", "intra", "pcie", "nics", "host"});
  t.gpus_per_node = node["gpus"].as_small_int();
  // Checked before the NIC and PCIe lists, which are indexed by GPU.
  if (auto p = find_problem_in_sizes(t)) report(root, *p);
  if (auto p = node.get("pcie")) {
    t.intra.has_pcie = true;
    parse_pcie(*p, t.intra.pcie);
  }
  parse_intra(node["intra"], t);
  if (auto nics = node.get("nics")) parse_nics(*nics, t);
  if (auto h = node.get("host")) {
    t.has_host = true;
    parse_host(*h, t.host);
  }
  if (t.intra.has_pcie) {
    PcieSpec& p = t.intra.pcie;
    if (t.intra.kind == IntraNodeKind::kPcie) {
      // Consumers that read `intra` alone see the same-switch GPU-to-GPU path.
      t.intra.bandwidth = p.gpu_link_bandwidth;
      t.intra.latency = 2 * p.latency;
    }
    if (!node["pcie"].has("nic_switch")) {
      // A NIC sits on the switch of the first GPU it serves (where GPUDirect RDMA is fast).
      for (const NicSpec& nic : t.nics) {
        int s = nic.gpus.empty() ? 0 : -1;  // a NIC serving no GPU carries no traffic
        for (size_t i = 0; s < 0 && i < p.switches.size(); ++i) {
          const auto& sw = p.switches[i];
          if (std::find(sw.begin(), sw.end(), nic.gpus[0]) != sw.end()) s = static_cast<int>(i);
        }
        if (s < 0) break;  // the validator reports the missing nic_switch
        p.nic_switch.push_back(s);
      }
    }
  }
  if (auto f = root.get("fabric")) parse_fabric(*f, t.fabric);
  if (auto p = find_problem(t)) report(root, *p);
  return t;
}

std::string presets_dir() {
  return std::string(NNSIM_SOURCE_DIR) + "/topologies";
}

}  // namespace

int Topology::nic_of(int local_gpu) const {
  for (size_t i = 0; i < nics.size(); ++i) {
    const auto& g = nics[i].gpus;
    if (std::find(g.begin(), g.end(), local_gpu) != g.end()) return static_cast<int>(i);
  }
  return -1;
}

int Topology::group_size() const {
  if (fabric.kind == FabricKind::kSingleSwitch || fabric.nodes_per_group < 1) return nodes;
  return std::min(nodes, fabric.nodes_per_group);
}

Expected<Topology> parse_topology(const std::string& yaml_text, const std::string& display_name) {
  return catch_input_errors<Topology>(
      display_name, [&] { return parse_root(InputNode::load_string(yaml_text, display_name)); });
}

Expected<Topology> load_topology(const std::string& path_or_preset) {
  return load_topology(path_or_preset, {}, "");
}

Expected<Topology> load_topology(const std::string& path_or_preset,
                                 const std::vector<FieldOverride>& overrides,
                                 const std::string& flag) {
  std::error_code ec;
  std::string path = path_or_preset;
  bool looks_like_path = path.find('/') != std::string::npos || path.ends_with(".yaml") ||
                         path.ends_with(".yml") || path.ends_with(".json");
  if (!fs::is_regular_file(path, ec) && !looks_like_path) {
    path = topology_preset_path(path_or_preset);
    if (path.empty()) {
      return Error(
          fmt::format("unknown topology '{}': no such file and no preset of that "
                      "name{}",
                      path_or_preset, suggest(path_or_preset, topology_preset_names())));
    }
  }
  Expected<Topology> t = catch_input_errors<Topology>(
      path, [&] { return parse_root(InputNode::load_file(path, overrides, flag, "gpu", "base")); });
  if (t) t->name = name_with_overrides(t->name, overrides);
  return t;
}

Status validate_topology(const Topology& topo) {
  auto p = find_problem(topo);
  if (!p) return Status::Ok();
  std::string what = topo.file.empty() ? fmt::format("topology '{}'", topo.name) : topo.file;
  return Error(fmt::format("{}: field '{}': {}", what, p->field, p->message));
}

Expected<Topology> resize_topology(const Topology& topo, int nodes) {
  if (nodes < 1) {
    return Error(
        fmt::format("cannot resize topology '{}' to {} nodes: a cluster needs at least "
                    "1 node",
                    topo.name, nodes));
  }
  Topology t = topo;
  t.nodes = nodes;
  Status s = validate_topology(t);
  if (!s) {
    return s.error().with_context(
        fmt::format("cannot resize topology '{}' to {} nodes", topo.name, nodes));
  }
  return t;
}

std::string topology_preset_path(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos) return "";
  std::error_code ec;
  std::string path = presets_dir() + "/" + name + ".yaml";
  return fs::is_regular_file(path, ec) ? path : "";
}

std::vector<std::string> topology_preset_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(presets_dir(), ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".yaml") names.push_back(it->path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace nnsim
