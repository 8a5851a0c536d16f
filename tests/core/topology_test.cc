#include "core/topology.h"

#include <string>

#include <gtest/gtest.h>

#include "core/gpu.h"

namespace nnsim {
namespace {

// A valid two-node topology; tests change one line of it at a time.
const std::string kBase = R"(name: test
gpu: a100-sxm4-80gb
nodes: 2
node:
  gpus: 8
  intra: {kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us}
  nics:
    count: 8
    bandwidth: 200 Gb/s
    latency: 1 us
    gpus: [[0], [1], [2], [3], [4], [5], [6], [7]]
fabric: {kind: single_switch}
)";

std::string replace(std::string text, const std::string& from, const std::string& to) {
  auto pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  if (pos != std::string::npos) text.replace(pos, from.size(), to);
  return text;
}

// The error message of parsing `yaml` (empty when it parses).
std::string parse_error(const std::string& yaml) {
  auto t = parse_topology(yaml, "test.yaml");
  return t ? "" : t.error().message();
}

TEST(GpuCatalog, HoldsTheDatasheetGpusInNameOrder) {
  std::vector<std::string> names;
  for (const auto& g : gpu_catalog()) names.push_back(g.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"a100-pcie-80gb", "a100-sxm4-40gb", "a100-sxm4-80gb",
                                      "h100-sxm5-80gb", "h100-sxm5-96gb", "h200-sxm-141gb"}));
  for (const auto& g : gpu_catalog()) {
    EXPECT_NE(g.source.find("https://www.nvidia.com/"), std::string::npos) << g.name;
    EXPECT_GT(g.hbm_bytes, 0) << g.name;
    EXPECT_GT(g.hbm_bandwidth, 0) << g.name;
    EXPECT_GT(g.sms, 0) << g.name;
  }
}

TEST(GpuCatalog, FiguresAndFallbacks) {
  GpuSpec a100 = *find_gpu("a100-sxm4-80gb");
  EXPECT_DOUBLE_EQ(a100.peak_flops(Precision::kBf16), 312e12);
  EXPECT_DOUBLE_EQ(a100.peak_flops(Precision::kTf32), 156e12);
  EXPECT_DOUBLE_EQ(a100.peak_flops(Precision::kFp32), 19.5e12);
  EXPECT_DOUBLE_EQ(a100.peak_flops(Precision::kFp8), 312e12);   // no fp8: runs as bf16
  EXPECT_DOUBLE_EQ(a100.hbm_bytes, 80.0 * 1024 * 1024 * 1024);  // 81920 MiB
  EXPECT_DOUBLE_EQ(a100.hbm_bandwidth, 2039e9);
  EXPECT_DOUBLE_EQ(a100.nvlink_bandwidth, 300e9);

  GpuSpec h100 = *find_gpu("h100-sxm5-80gb");
  EXPECT_DOUBLE_EQ(h100.peak_flops(Precision::kFp8), 1979e12);
  EXPECT_DOUBLE_EQ(h100.peak_flops(Precision::kBf16), 989e12);
  EXPECT_DOUBLE_EQ(h100.nvlink_bandwidth, 450e9);
  EXPECT_EQ(h100.sms, 132);

  GpuSpec h100_96 = *find_gpu("h100-sxm5-96gb");
  EXPECT_DOUBLE_EQ(h100_96.hbm_bytes, 97871.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(h100_96.hbm_bandwidth, h100.hbm_bandwidth);
  EXPECT_NE(h100_96.source.find("derived"), std::string::npos);

  GpuSpec h200 = *find_gpu("h200-sxm-141gb");
  EXPECT_DOUBLE_EQ(h200.hbm_bytes, 143771.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(h200.hbm_bandwidth, 4800e9);

  GpuSpec pcie = *find_gpu("a100-pcie-80gb");
  EXPECT_DOUBLE_EQ(pcie.nvlink_bandwidth, 0);
  EXPECT_DOUBLE_EQ(pcie.hbm_bandwidth, 1935e9);

  GpuSpec none;
  EXPECT_DOUBLE_EQ(none.peak_flops(Precision::kBf16), 0);
}

TEST(GpuCatalog, UnknownNameSuggestsAndListsTheCatalog) {
  auto g = find_gpu("h100-sxm-80gb");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.error().message().find("did you mean 'h100-sxm5-80gb'"), std::string::npos)
      << g.error().message();
  EXPECT_NE(g.error().message().find("a100-pcie-80gb"), std::string::npos);
}

TEST(Topology, EveryPresetLoadsAndValidates) {
  auto names = topology_preset_names();
  for (const char* expected :
       {"dgx-a100x4", "dgx-h100-superpod", "gb200-nvl72-whatif", "h200x8", "pcie-a100x8"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  for (const auto& name : names) {
    auto t = load_topology(name);
    ASSERT_TRUE(t.ok()) << t.error().message();
    EXPECT_EQ(t->name, name);
    EXPECT_FALSE(t->description.empty()) << name;
    EXPECT_EQ(t->file, topology_preset_path(name));
    EXPECT_TRUE(validate_topology(*t).ok()) << name;
    // Every preset can grow to several nodes.
    auto bigger = resize_topology(*t, 4);
    EXPECT_TRUE(bigger.ok()) << name << ": " << bigger.error().message();
  }
}

TEST(Topology, PresetFigures) {
  Topology a100 = *load_topology("dgx-a100x4");
  EXPECT_EQ(a100.nodes, 4);
  EXPECT_EQ(a100.num_gpus(), 32);
  EXPECT_EQ(a100.gpu.name, "a100-sxm4-80gb");
  EXPECT_EQ(a100.intra.kind, IntraNodeKind::kNvSwitch);
  EXPECT_DOUBLE_EQ(a100.intra.bandwidth, 300e9);
  EXPECT_DOUBLE_EQ(a100.intra.latency, 0.7e-6);
  ASSERT_EQ(a100.nics.size(), 8u);
  EXPECT_DOUBLE_EQ(a100.nics[0].bandwidth, 25e9);
  EXPECT_EQ(a100.nic_of(5), 5);
  EXPECT_EQ(a100.fabric.kind, FabricKind::kSingleSwitch);
  EXPECT_EQ(a100.group_size(), 4);
  // DGX A100's host: 2 TB, two EPYC 7742 (8 x DDR4-3200 each), two GPUs to a PCIe Gen4 uplink.
  ASSERT_TRUE(a100.has_host);
  EXPECT_DOUBLE_EQ(a100.host.memory, 2e12);
  EXPECT_DOUBLE_EQ(a100.host.memory_bandwidth, 409.6e9);
  EXPECT_DOUBLE_EQ(a100.host.link_bandwidth, 16e9);

  Topology pod = *load_topology("dgx-h100-superpod");
  ASSERT_TRUE(pod.has_host);
  EXPECT_DOUBLE_EQ(pod.host.memory_bandwidth, 614.4e9);
  EXPECT_EQ(pod.nodes, 128);
  EXPECT_EQ(pod.fabric.kind, FabricKind::kRailOptimized);
  EXPECT_EQ(pod.group_size(), 32);
  EXPECT_DOUBLE_EQ(pod.nics[7].bandwidth, 50e9);
  EXPECT_DOUBLE_EQ(pod.intra.bandwidth, 450e9);

  Topology pcie = *load_topology("pcie-a100x8");
  EXPECT_EQ(pcie.intra.kind, IntraNodeKind::kPcie);
  EXPECT_TRUE(pcie.intra.has_pcie);
  EXPECT_DOUBLE_EQ(pcie.intra.pcie.gpu_link_bandwidth, 32e9);
  EXPECT_EQ(pcie.intra.pcie.switches.size(), 4u);
  EXPECT_EQ(pcie.nic_of(3), 0);
  EXPECT_EQ(pcie.nic_of(4), 1);
  EXPECT_EQ(pcie.intra.pcie.nic_switch, (std::vector<int>{0, 2}));
}

TEST(Topology, LoadsByPathAndSuggestsPresets) {
  EXPECT_TRUE(load_topology(topology_preset_path("h200x8")).ok());
  auto t = load_topology("dgx-a100x5");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message().find("did you mean 'dgx-a100x4'"), std::string::npos)
      << t.error().message();
  auto missing = load_topology("/nonexistent/cluster.yaml");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message().find("/nonexistent/cluster.yaml"), std::string::npos);
  EXPECT_EQ(topology_preset_path("no-such-preset"), "");
}

TEST(Topology, ResizeKeepsGroups) {
  Topology pod = *load_topology("dgx-h100-superpod");
  auto big = resize_topology(pod, 2048);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->num_gpus(), 16384);
  EXPECT_EQ(big->fabric.nodes_per_group, 32);
  EXPECT_EQ(big->group_size(), 32);
  auto small = resize_topology(pod, 8);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->group_size(), 8);  // fewer nodes than one unit holds
  EXPECT_EQ(small->fabric.nodes_per_group, 32);

  EXPECT_FALSE(resize_topology(pod, 0).ok());

  // A single node without NICs cannot grow.
  std::string lone = R"(gpu: h100-sxm5-80gb
nodes: 1
node: {gpus: 8, intra: {kind: nvswitch, latency: 1 us}}
)";
  auto one = parse_topology(lone, "lone.yaml");
  ASSERT_TRUE(one.ok()) << one.error().message();
  EXPECT_EQ(one->name, "lone");                   // defaults to the file's stem
  EXPECT_DOUBLE_EQ(one->intra.bandwidth, 450e9);  // defaults to the GPU's NVLink
  auto two = resize_topology(*one, 2);
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.error().message().find("field 'node.nics'"), std::string::npos)
      << two.error().message();
}

TEST(Topology, BaseParses) {
  auto t = parse_topology(kBase, "test.yaml");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->file, "test.yaml");
  EXPECT_EQ(t->nic_of(6), 6);
}

TEST(Topology, MalformedYamlNamesFileAndLine) {
  std::string msg = parse_error("name: x\nnodes: [1, 2\n");
  EXPECT_NE(msg.find("test.yaml:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed YAML"), std::string::npos) << msg;
}

TEST(Topology, UnknownFieldSuggests) {
  std::string msg = parse_error(replace(kBase, "nodes: 2", "nodez: 2"));
  EXPECT_NE(msg.find("test.yaml:3: field 'nodez': unknown field 'nodez' (did you mean 'nodes'?)"),
            std::string::npos)
      << msg;
  msg = parse_error(replace(kBase, "    bandwidth: 200 Gb/s", "    bandwith: 200 Gb/s"));
  EXPECT_NE(msg.find("test.yaml:9: field 'node.nics.bandwith'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'bandwidth'"), std::string::npos) << msg;
}

// YAML's `key:` with nothing after it is null: a forgotten value, not a request for the default.
TEST(Topology, EmptyValueIsAnError) {
  std::string msg = parse_error(replace(kBase, "nodes: 2", "nodes:"));
  EXPECT_NE(msg.find("test.yaml:3: field 'nodes': has no value"), std::string::npos) << msg;
}

TEST(Topology, UnknownGpuName) {
  std::string msg = parse_error(replace(kBase, "gpu: a100-sxm4-80gb", "gpu: a100-sxm4-80g"));
  EXPECT_NE(msg.find("test.yaml:2: field 'gpu': unknown GPU 'a100-sxm4-80g' (did you mean "
                     "'a100-sxm4-80gb'?)"),
            std::string::npos)
      << msg;
}

TEST(Topology, NicServingAMissingGpu) {
  std::string msg = parse_error(replace(kBase, "[[0], [1], [2]", "[[0], [1], [9]"));
  EXPECT_NE(msg.find("test.yaml:11: field 'node.nics.gpus[2]': GPU 9 does not exist (the node "
                     "has 8 GPUs: 0-7)"),
            std::string::npos)
      << msg;
}

TEST(Topology, GpuServedByNoNic) {
  std::string msg = parse_error(replace(kBase, "[[0], [1], [2]", "[[0], [1], [1]"));
  EXPECT_NE(msg.find("field 'node.nics.gpus': GPU 2 is served by no NIC"), std::string::npos)
      << msg;
  msg = parse_error(replace(kBase, "[[0], [1], [2]", "[[0], [1]"));
  EXPECT_NE(msg.find("field 'node.nics.gpus': lists the GPUs of 7 NICs but node.nics.count is 8"),
            std::string::npos)
      << msg;
}

TEST(Topology, ZeroNodes) {
  std::string msg = parse_error(replace(kBase, "nodes: 2", "nodes: 0"));
  EXPECT_NE(msg.find("test.yaml:3: field 'nodes': the cluster needs at least 1 node, got 0"),
            std::string::npos)
      << msg;
}

TEST(Topology, WrongDimensionUnit) {
  std::string msg = parse_error(replace(kBase, "bandwidth: 300 GB/s", "bandwidth: 2 us"));
  EXPECT_NE(msg.find("test.yaml:6: field 'node.intra.bandwidth': unknown unit 'us'"),
            std::string::npos)
      << msg;
}

TEST(Topology, MultiNodeNeedsNics) {
  std::string yaml = R"(gpu: a100-sxm4-80gb
nodes: 2
node:
  gpus: 8
  intra: {kind: nvswitch, latency: 1 us}
)";
  std::string msg = parse_error(yaml);
  EXPECT_NE(msg.find("test.yaml:4: field 'node.nics': a cluster of 2 nodes needs NICs"),
            std::string::npos)
      << msg;
}

TEST(Topology, DefaultNicSpreading) {
  std::string yaml = replace(kBase, "    count: 8\n", "    count: 2\n");
  yaml = replace(yaml, "    gpus: [[0], [1], [2], [3], [4], [5], [6], [7]]\n", "");
  auto t = parse_topology(yaml, "test.yaml");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->nics[0].gpus, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(t->nic_of(3), 0);
  EXPECT_EQ(t->nic_of(4), 1);
}

TEST(Topology, FabricChecks) {
  std::string fat = replace(kBase, "fabric: {kind: single_switch}",
                            "fabric: {kind: fat_tree, nodes_per_group: 2, oversubscription: 0.5, "
                            "switch_latency: 0.13 us}");
  std::string msg = parse_error(fat);
  EXPECT_NE(msg.find("test.yaml:12: field 'fabric.oversubscription': must be at least 1"),
            std::string::npos)
      << msg;
  msg =
      parse_error(replace(fat, "nodes_per_group: 2, oversubscription: 0.5", "nodes_per_group: 0"));
  EXPECT_NE(msg.find("field 'fabric.nodes_per_group': must be at least 1"), std::string::npos)
      << msg;
  msg = parse_error(
      replace(kBase, "{kind: single_switch}", "{kind: single_switch, nodes_per_group: 4}"));
  EXPECT_NE(msg.find("field 'fabric.nodes_per_group': a single switch has no groups"),
            std::string::npos)
      << msg;
  msg = parse_error(replace(kBase, "single_switch", "fat_tre"));
  EXPECT_NE(msg.find("field 'fabric.kind': unknown value 'fat_tre' (did you mean 'fat_tree'?)"),
            std::string::npos)
      << msg;
}

TEST(Topology, MeshChecks) {
  std::string mesh =
      replace(kBase, "  intra: {kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us}",
              "  intra:\n    kind: nvlink_mesh\n    bandwidth: 25 GB/s\n"
              "    latency: 1 us\n    links: [[0, 1, 4], [1, 8]]");
  std::string msg = parse_error(mesh);
  EXPECT_NE(msg.find("test.yaml:10: field 'node.intra.links[1][1]': GPU 8 does not exist"),
            std::string::npos)
      << msg;
  msg = parse_error(replace(mesh, "[1, 8]", "[1, 0]"));
  EXPECT_NE(msg.find("field 'node.intra.links[1]': GPUs 1 and 0 are already linked by "
                     "node.intra.links[0]"),
            std::string::npos)
      << msg;
  msg = parse_error(replace(mesh, "[1, 8]", "[1, 2]"));
  EXPECT_NE(msg.find("field 'node.intra.links': GPUs 0 and 2 have no NVLink between them"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("describe node.pcie"), std::string::npos) << msg;
}

TEST(Topology, PcieChecks) {
  std::string pcie =
      replace(kBase, "  intra: {kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us}",
              "  intra: {kind: pcie}");
  std::string msg = parse_error(pcie);
  EXPECT_NE(msg.find("test.yaml:5: field 'node.pcie': a PCIe-only node"), std::string::npos) << msg;
  std::string with = replace(pcie, "  intra: {kind: pcie}\n",
                             "  intra: {kind: pcie}\n  pcie: {gpu_link_bandwidth: 32 GB/s, "
                             "switch_uplink_bandwidth: 32 GB/s, latency: 1 us, "
                             "switches: [[0, 1, 2, 3], [4, 5, 6]]}\n");
  msg = parse_error(with);
  EXPECT_NE(msg.find("field 'node.pcie.switches': GPU 7 is under no PCIe switch"),
            std::string::npos)
      << msg;
  with = replace(with, "[4, 5, 6]", "[4, 5, 6, 7]");
  auto t = parse_topology(with, "test.yaml");
  ASSERT_TRUE(t.ok()) << t.error().message();
  // NICs sit by default on the switch of the first GPU they serve.
  EXPECT_EQ(t->intra.pcie.nic_switch, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_DOUBLE_EQ(t->intra.bandwidth, 32e9);
  msg = parse_error(replace(with, "latency: 1 us, ", "latency: 1 us, nic_switch: [0, 5], "));
  EXPECT_NE(msg.find("field 'node.pcie.nic_switch': gives a PCIe switch for 2 NICs but the node "
                     "has 8"),
            std::string::npos)
      << msg;
  msg = parse_error(replace(kBase, "kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us",
                            "kind: pcie, latency: 1 us"));
  EXPECT_NE(msg.find("field 'node.intra.latency': a PCIe-only node takes"), std::string::npos)
      << msg;
}

TEST(Topology, HostChecks) {
  const std::string host =
      "  host: {memory: 1 TB, memory_bandwidth: 400 GB/s, link_bandwidth: 16 GB/s}\nfabric:";
  auto t = parse_topology(replace(kBase, "fabric:", host), "test.yaml");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_TRUE(t->has_host);
  EXPECT_DOUBLE_EQ(t->host.memory, 1e12);
  EXPECT_DOUBLE_EQ(t->host.memory_bandwidth, 400e9);
  EXPECT_DOUBLE_EQ(t->host.link_bandwidth, 16e9);
  EXPECT_FALSE(parse_topology(kBase, "test.yaml")->has_host);

  std::string msg = parse_error(replace(kBase, "fabric:", replace(host, "1 TB", "0 TB")));
  EXPECT_NE(msg.find("test.yaml:12: field 'node.host.memory': must be positive"), std::string::npos)
      << msg;
  msg = parse_error(replace(kBase, "fabric:", replace(host, ", link_bandwidth: 16 GB/s", "")));
  EXPECT_NE(msg.find("link_bandwidth"), std::string::npos) << msg;
  msg = parse_error(replace(kBase, "fabric:", replace(host, "400 GB/s", "400 GB")));
  EXPECT_NE(msg.find("memory_bandwidth"), std::string::npos) << msg;
  msg = parse_error(replace(kBase, "fabric:", replace(host, "memory: 1 TB", "ram: 1 TB")));
  EXPECT_NE(msg.find("ram"), std::string::npos) << msg;
}

TEST(Topology, HypotheticalGpu) {
  std::string yaml = replace(kBase, "gpu: a100-sxm4-80gb",
                             "gpu: {base: h100-sxm5-80gb, name: h100-big, hbm_bytes: 192 GB, "
                             "bf16_flops: 2000 TFLOP/s}");
  auto t = parse_topology(yaml, "test.yaml");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->gpu.name, "h100-big");
  EXPECT_DOUBLE_EQ(t->gpu.hbm_bytes, 192e9);
  EXPECT_DOUBLE_EQ(t->gpu.peak_flops(Precision::kBf16), 2000e12);
  EXPECT_DOUBLE_EQ(t->gpu.peak_flops(Precision::kFp8), 1979e12);
  EXPECT_NE(t->gpu.source.find("hypothetical"), std::string::npos);
  EXPECT_EQ(t->gpu.base, "h100-sxm5-80gb");  // whose measured behaviour it keeps
  EXPECT_TRUE(t->gpu.hopper());

  std::string msg = parse_error(replace(yaml, "hbm_bytes: 192 GB", "hbm_bytes: 192 GB/s"));
  EXPECT_NE(msg.find("field 'gpu.hbm_bytes': unknown unit 'GB/s'"), std::string::npos) << msg;
  msg = parse_error(replace(yaml, "hbm_bytes:", "hbm_byte:"));
  EXPECT_NE(msg.find("did you mean 'hbm_bytes'"), std::string::npos) << msg;
  msg = parse_error(replace(yaml, "hbm_bytes: 192 GB", "hbm_bytes: 0"));
  EXPECT_NE(msg.find("test.yaml:2: field 'gpu.hbm_bytes': the GPU needs a positive memory size"),
            std::string::npos)
      << msg;
}

// The fields of `texts` replaced in the preset dgx-a100x4 ("--topo-set" is the flag errors name).
Expected<Topology> preset_with(std::initializer_list<const char*> texts) {
  std::vector<FieldOverride> overrides;
  for (const char* text : texts) {
    Expected<FieldOverride> o = parse_field_override(text);
    EXPECT_TRUE(o.ok()) << text;
    if (o) overrides.push_back(*o);
  }
  return load_topology("dgx-a100x4", overrides, "--topo-set");
}

TEST(Topology, FieldsReplacedFromTheCommandLine) {
  Expected<Topology> t = preset_with({"node.nics.bandwidth=400 Gb/s", "fabric.kind=fat_tree",
                                      "fabric.nodes_per_group=2", "fabric.oversubscription=2",
                                      "fabric.switch_latency=0.13 us"});
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_DOUBLE_EQ(t->nics.front().bandwidth, 50e9);
  EXPECT_EQ(t->nics.size(), 8u);  // the rest of the NICs' map stands
  EXPECT_EQ(t->fabric.kind, FabricKind::kFatTree);
  EXPECT_EQ(t->fabric.nodes_per_group, 2);
  EXPECT_DOUBLE_EQ(t->fabric.oversubscription, 2.0);
  EXPECT_EQ(t->name,
            "dgx-a100x4 with node.nics.bandwidth=400 Gb/s, fabric.kind=fat_tree, "
            "fabric.nodes_per_group=2, fabric.oversubscription=2, fabric.switch_latency=0.13 us");
  // A whole map as YAML; a name given is kept.
  t = preset_with({"node.nics={count: 4, bandwidth: 100 Gb/s, latency: 2 us}", "name=half"});
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->nics.size(), 4u);
  EXPECT_DOUBLE_EQ(t->nics.front().latency, 2e-6);
  EXPECT_EQ(t->name, "half");
  // A GPU given by name becomes a hypothetical one based on it.
  t = preset_with({"gpu.hbm_bytes=40 GB"});
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_DOUBLE_EQ(t->gpu.hbm_bytes, 40e9);
  EXPECT_EQ(t->gpu.name, "a100-sxm4-80gb-custom");
  EXPECT_EQ(t->gpu.base, "a100-sxm4-80gb");
  // Without overrides, the file as it is.
  EXPECT_EQ(preset_with({})->name, "dgx-a100x4");
}

TEST(Topology, ReplacedFieldsThatDoNotReadNameTheFlag) {
  auto error = [](std::initializer_list<const char*> texts) {
    Expected<Topology> t = preset_with(texts);
    return t ? std::string() : t.error().message();
  };
  EXPECT_EQ(error({"node.nics.bandwith=400 Gb/s"}),
            "--topo-set node.nics.bandwith=400 Gb/s: field 'node.nics.bandwith': unknown field "
            "'bandwith' (did you mean 'bandwidth'?)");
  EXPECT_EQ(
      error({"node.nics.bandwidth=fast"})
          .rfind("--topo-set node.nics.bandwidth=fast: field 'node.nics.bandwidth': 'fast' is not "
                 "a number",
                 0),
      0u);
  EXPECT_NE(error({"node.nics={count: 8"}).find("--topo-set node.nics={count: 8: malformed YAML"),
            std::string::npos);
  EXPECT_NE(error({"name.first=x"}).find("field 'name' of "), std::string::npos);
  EXPECT_NE(error({"name.first=x"}).find("holds a value, not fields"), std::string::npos);
  // Set twice, the error names the override whose value stands.
  EXPECT_EQ(error({"node.nics.bandwidth=400 Gb/s", "node.nics.bandwidth=fast"})
                .rfind("--topo-set node.nics.bandwidth=fast: field 'node.nics.bandwidth'", 0),
            0u);
  // Other fields' errors still cite the file's line.
  EXPECT_NE(error({"node.gpus=16"}).find("dgx-a100x4.yaml:"), std::string::npos);

  for (const char* bad : {"nodes", "=4", "node..gpus=4", "node.gpus=", "node.gpu s=4"}) {
    EXPECT_FALSE(parse_field_override(bad).ok()) << bad;
  }
  EXPECT_NE(parse_field_override("nodes").error().message().find("expected FIELD=VALUE"),
            std::string::npos);
  Expected<FieldOverride> ok = parse_field_override("a.b_2=x=y");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->field, (std::vector<std::string>{"a", "b_2"}));
  EXPECT_EQ(ok->value, "x=y");
}

// The what-if preset's GPU is hypothetical: Blackwell's peaks over the H200's measured behaviour,
// in 72-GPU NVLink domains.
TEST(Topology, TheGb200WhatIfKeepsTheH200sMeasuredBehaviour) {
  auto t = load_topology("gb200-nvl72-whatif");
  ASSERT_TRUE(t.ok()) << t.error().message();
  EXPECT_EQ(t->gpu.base, "h200-sxm-141gb");
  EXPECT_TRUE(t->gpu.hopper());
  EXPECT_DOUBLE_EQ(t->gpu.peak_flops(Precision::kBf16), 2500e12);
  EXPECT_DOUBLE_EQ(t->gpu.peak_flops(Precision::kFp8), 5000e12);
  EXPECT_EQ(t->gpus_per_node, 72);
  EXPECT_DOUBLE_EQ(t->intra.bandwidth, 900e9);
  EXPECT_NE(t->gpu.source.find("hypothetical"), std::string::npos);
}

TEST(Topology, ValidateNamesTheField) {
  Topology t = *parse_topology(kBase, "test.yaml");
  t.nics[3].gpus = {12};
  Status s = validate_topology(t);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().message(),
            "test.yaml: field 'node.nics.gpus[3]': GPU 12 does not exist (the node has 8 GPUs: "
            "0-7)");
}

}  // namespace
}  // namespace nnsim
