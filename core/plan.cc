#include "core/plan.h"

#include <algorithm>

#include <charconv>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/input.h"
#include "core/json_format.h"
#include "core/suggest.h"

namespace nnsim {

int Mesh::num_ranks() const {
  int n = 1;
  for (const auto& a : axes) n *= a.size;
  return n;
}

int Mesh::axis_index(const std::string& name) const {
  for (size_t i = 0; i < axes.size(); ++i) {
    if (axes[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

int Mesh::axis_size(const std::string& name) const {
  int i = axis_index(name);
  return i < 0 ? 1 : axes[i].size;
}

std::vector<int> Mesh::coordinates(int rank) const {
  std::vector<int> c(axes.size());
  for (int i = static_cast<int>(axes.size()) - 1; i >= 0; --i) {
    c[i] = rank % axes[i].size;
    rank /= axes[i].size;
  }
  return c;
}

int Mesh::rank_of(const std::vector<int>& coordinates) const {
  int r = 0;
  for (size_t i = 0; i < axes.size(); ++i) r = r * axes[i].size + coordinates[i];
  return r;
}

std::vector<int> Mesh::ranks_along(int rank, const std::vector<std::string>& along) const {
  const std::vector<int> mine = coordinates(rank);
  std::vector<int> group;
  for (int r = 0; r < num_ranks(); ++r) {
    const std::vector<int> c = coordinates(r);
    bool same = true;
    for (size_t i = 0; i < c.size() && same; ++i) {
      const bool free = std::find(along.begin(), along.end(), axes[i].name) != along.end();
      same = free || c[i] == mine[i];
    }
    if (same) group.push_back(r);
  }
  return group;
}

std::vector<int> Placement::gpu_of_rank(const Mesh& mesh) const {
  const int n = mesh.num_ranks();
  if (!gpus.empty()) return gpus;
  std::vector<int> out(n);
  for (int r = 0; r < n; ++r) {
    std::vector<int> coord = mesh.coordinates(r);
    // Remaining (not yet consumed) size of each axis: factors of one axis take its coordinate
    // most significant part first.
    std::vector<int> remaining(mesh.axes.size());
    for (size_t i = 0; i < mesh.axes.size(); ++i) remaining[i] = mesh.axes[i].size;
    int gpu = 0;
    for (const auto& f : factors) {
      int ai = mesh.axis_index(f.axis);
      remaining[ai] /= f.size;
      int digit = (coord[ai] / remaining[ai]) % f.size;
      gpu = gpu * f.size + digit;
    }
    out[r] = gpu;
  }
  return out;
}

int Plan::num_micro_batches() const {
  int denom = micro_batch * data_parallel();
  return denom > 0 ? global_batch / denom : 0;
}

std::string_view to_string(BlockKind k) {
  switch (k) {
    case BlockKind::kForward:
      return "F";
    case BlockKind::kBackward:
      return "B";
    case BlockKind::kBackwardInput:
      return "BI";
    case BlockKind::kBackwardWeight:
      return "BW";
    case BlockKind::kRecompute:
      return "R";
  }
  return "?";
}

std::string to_string(const Block& b) {
  if (b.pass != 0)
    return fmt::format("{}{}@{}#{}", to_string(b.kind), b.micro_batch, b.segment, b.pass);
  return fmt::format("{}{}@{}", to_string(b.kind), b.micro_batch, b.segment);
}

Expected<Block> parse_block(const std::string& text) {
  auto bad = [&] {
    return Error(fmt::format(
        "'{}' is not a block (expected KIND<micro-batch>@<segment> with KIND one of F, B, BI, "
        "BW, R, e.g. 'F3@1', or a forward's pass F<micro-batch>@<segment>#<pass>, e.g. "
        "'F3@1#2')",
        text));
  };
  size_t i = 0;
  while (i < text.size() && std::isalpha(static_cast<unsigned char>(text[i]))) ++i;
  std::string kind = text.substr(0, i);
  Block b;
  if (kind == "F") {
    b.kind = BlockKind::kForward;
  } else if (kind == "B") {
    b.kind = BlockKind::kBackward;
  } else if (kind == "BI") {
    b.kind = BlockKind::kBackwardInput;
  } else if (kind == "BW") {
    b.kind = BlockKind::kBackwardWeight;
  } else if (kind == "R") {
    b.kind = BlockKind::kRecompute;
  } else {
    return bad();
  }
  size_t at = text.find('@', i);
  if (at == std::string::npos) return bad();
  const char* begin = text.data();
  const size_t hash = text.find('#', at);
  const size_t seg_end = hash == std::string::npos ? text.size() : hash;
  auto r1 = std::from_chars(begin + i, begin + at, b.micro_batch);
  auto r2 = std::from_chars(begin + at + 1, begin + seg_end, b.segment);
  if (r1.ec != std::errc() || r1.ptr != begin + at || r2.ec != std::errc() ||
      r2.ptr != begin + seg_end || b.micro_batch < 0 || b.segment < 0) {
    return bad();
  }
  if (hash != std::string::npos) {
    auto r3 = std::from_chars(begin + hash + 1, begin + text.size(), b.pass);
    if (r3.ec != std::errc() || r3.ptr != begin + text.size() || b.pass < 0) return bad();
    if (b.kind != BlockKind::kForward) {
      return Error(fmt::format(
          "'{}': only forward blocks have a pass (repeated forwards, training.recycle); the "
          "backward and recompute blocks read the last pass: write '{}{}@{}'",
          text, kind, b.micro_batch, b.segment));
    }
  }
  return b;
}

bool match_pattern(const std::string& pattern, const std::string& name) {
  // Iterative glob with '*' only.
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

namespace {

using json = nlohmann::ordered_json;

Precision parse_precision(const InputNode& n) {
  return n.as_enum<Precision>({{"fp32", Precision::kFp32},
                               {"tf32", Precision::kTf32},
                               {"bf16", Precision::kBf16},
                               {"fp16", Precision::kFp16},
                               {"fp8", Precision::kFp8}});
}

MeshSlice parse_slice(const InputNode& n, const Mesh& mesh) {
  MeshSlice slice;
  for (const auto& [axis, value] : n.entries()) {
    int ai = mesh.axis_index(axis);
    if (ai < 0) {
      std::vector<std::string> names;
      for (const auto& a : mesh.axes) names.push_back(a.name);
      value.fail(fmt::format("no mesh axis '{}'{}", axis, suggest(axis, names)));
    }
    int64_t c = value.as_int();
    if (c < 0 || c >= mesh.axes[ai].size) {
      value.fail(fmt::format("coordinate {} is outside axis '{}' (size {}: 0-{})", c, axis,
                             mesh.axes[ai].size, mesh.axes[ai].size - 1));
    }
    slice[axis] = static_cast<int>(c);
  }
  return slice;
}

Mesh parse_mesh(const InputNode& n) {
  Mesh mesh;
  std::set<std::string> seen;
  for (const auto& item : n.items()) {
    auto pair = item.items();
    if (pair.size() != 2) item.fail("expected [\"axis\", size], e.g. [\"tp\", 8]");
    MeshAxis a{pair[0].as_string(), pair[1].as_small_int()};
    if (a.size < 1) pair[1].fail("an axis size must be at least 1");
    if (!seen.insert(a.name).second) pair[0].fail("axis '" + a.name + "' appears twice");
    if (static_cast<int>(mesh.axes.size()) == kMaxMeshAxes) {
      item.fail(fmt::format("a mesh has at most {} axes; merge axes that split the same way",
                            kMaxMeshAxes));
    }
    mesh.axes.push_back(a);
  }
  if (mesh.axes.empty()) n.fail("the mesh needs at least one axis");
  return mesh;
}

Placement parse_placement(const InputNode& n, const Mesh& mesh) {
  n.check_keys({"factors", "gpus"});
  Placement p;
  if (auto g = n.get("gpus")) {
    for (const auto& item : g->items()) p.gpus.push_back(item.as_small_int());
    if (static_cast<int>(p.gpus.size()) != mesh.num_ranks()) {
      g->fail(
          fmt::format("lists {} GPUs but the mesh has {} ranks", p.gpus.size(), mesh.num_ranks()));
    }
    return p;
  }
  auto factors = n["factors"];
  std::map<std::string, int> product;
  for (const auto& item : factors.items()) {
    auto pair = item.items();
    if (pair.size() != 2) item.fail("expected [\"axis\", size], e.g. [\"tp\", 8]");
    PlacementFactor f{pair[0].as_string(), pair[1].as_small_int()};
    if (mesh.axis_index(f.axis) < 0) pair[0].fail("no mesh axis '" + f.axis + "'");
    if (f.size < 1) pair[1].fail("a factor must be at least 1");
    product[f.axis] = (product.count(f.axis) ? product[f.axis] : 1) * f.size;
    p.factors.push_back(f);
  }
  for (const auto& a : mesh.axes) {
    int got = product.count(a.name) ? product[a.name] : 1;
    if (got != a.size) {
      factors.fail(fmt::format("the factors of axis '{}' multiply to {}, but the axis has size {}",
                               a.name, got, a.size));
    }
  }
  return p;
}

// Bytes per element of a gradient, weight shard or optimizer state, within [min, max]. `usual`
// says which values frameworks use.
double read_element_bytes(const InputNode& parent, std::string_view key, double fallback,
                          double min, double max, std::string_view usual) {
  if (!parent.has(key)) return fallback;
  const InputNode node = parent[key];
  const double v = node.as_double();
  if (v < min || v > max) {
    node.fail(
        fmt::format("{} bytes per element is out of range ({} to {}; {})", v, min, max, usual));
  }
  return v;
}

// Smaller gradient buckets only multiply collectives (and the simulation's work).
constexpr double kMinBucketBytes = 1024.0 * 1024.0;

std::pair<int, int> parse_range(const InputNode& n) {
  const std::vector<int> v = n.as_small_int_list();
  if (v.size() != 2 || v[0] < 0 || v[1] < v[0]) {
    n.fail("expected [first, end) as two integers with first <= end, e.g. [0, 12]");
  }
  return {v[0], v[1]};
}

// training: the batch, the precision, the framework and repeated forwards.
void parse_training(const InputNode& training, Plan& plan) {
  training.check_keys({"global_batch", "micro_batch", "precision", "framework", "recycle"});
  plan.global_batch = training["global_batch"].as_small_int();
  plan.micro_batch = training["micro_batch"].as_small_int();
  if (plan.global_batch < 1) training["global_batch"].fail("must be at least 1");
  if (plan.micro_batch < 1) training["micro_batch"].fail("must be at least 1");
  if (training.has("recycle")) {
    plan.recycle = training["recycle"].as_small_int();
    if (plan.recycle < 1) {
      training["recycle"].fail(fmt::format(
          "must be at least 1 (forward passes per micro-batch; 1 = no repeated forwards), not {}",
          plan.recycle));
    }
  }
  plan.precision =
      training.has("precision") ? parse_precision(training["precision"]) : plan.model.precision;
  plan.framework = training.get_string("framework", "megatron");
  if (plan.framework != "megatron" && plan.framework != "fsdp" && plan.framework != "deepspeed" &&
      plan.framework != "other") {
    training["framework"].fail_unknown(plan.framework, {"megatron", "fsdp", "deepspeed", "other"});
  }
}

// segments (op-assign): consecutive layers, the embedding or head, the devices that hold them.
void parse_segments(const InputNode& segments, Plan& plan) {
  for (const auto& s : segments.items()) {
    s.check_keys({"name", "layers", "embedding", "head", "devices"});
    Segment seg;
    seg.name = s.get_string("name", fmt::format("s{}", plan.segments.size()));
    std::tie(seg.first_layer, seg.end_layer) = parse_range(s["layers"]);
    seg.embedding = s.get_bool("embedding", false);
    seg.head = s.get_bool("head", false);
    seg.devices = parse_slice(s["devices"], plan.mesh);
    plan.segments.push_back(seg);
  }
}

// partition (op-trans): which dimensions of the operators a name matches split over which axes.
void parse_partition(const InputNode& parts, Plan& plan) {
  for (const auto& r : parts.items()) {
    r.check_keys({"match", "split"});
    PartitionRule rule;
    rule.match = r["match"].as_string();
    for (const auto& [dim_name, axes] : r["split"].entries()) {
      DimSplit split;
      if (!parse_dim(dim_name, &split.dim)) {
        axes.fail(
            fmt::format("unknown dimension '{}'{}", dim_name, suggest(dim_name, dim_names())));
      }
      for (const auto& a : axes.items()) {
        std::string axis = a.as_string();
        if (plan.mesh.axis_index(axis) < 0) a.fail("no mesh axis '" + axis + "'");
        if (axis == kDataParallelAxis) {
          a.fail("the data-parallel axis 'dp' splits the batch implicitly; remove it here");
        }
        split.axes.push_back(axis);
      }
      rule.splits.push_back(split);
    }
    plan.partition.push_back(rule);
  }
}

// recompute: the operators whose activations are dropped and recomputed, in which layers.
void parse_recompute(const InputNode& rec, Plan& plan) {
  for (const auto& r : rec.items()) {
    r.check_keys({"match", "layers"});
    RecomputeRule rule;
    rule.match = r["match"].as_string();
    if (r.has("layers")) {
      std::tie(rule.first_layer, rule.end_layer) = parse_range(r["layers"]);
      if (rule.first_layer == rule.end_layer || rule.end_layer > plan.model.layers) {
        r["layers"].fail(fmt::format("[{}, {}) is not a range of the model's layers [0, {})",
                                     rule.first_layer, rule.end_layer, plan.model.layers));
      }
    }
    plan.recompute.push_back(rule);
  }
}

// optimizer: Adam's bytes per parameter and the ZeRO stage.
void parse_optimizer(const InputNode& opt, Plan& plan) {
  opt.check_keys({"kind", "zero", "grad_bytes", "state_bytes", "weight_shard_bytes",
                  "keep_gathered", "offload_fraction", "offload_overlap", "offload_param_bytes",
                  "offload_params"});
  plan.optimizer.kind = opt.get_string("kind", "adam");
  if (plan.optimizer.kind != "adam") opt["kind"].fail_unknown(plan.optimizer.kind, {"adam"});
  plan.optimizer.zero = opt.get_small_int("zero", 0);
  if (plan.optimizer.zero < 0 || plan.optimizer.zero > 3) {
    opt["zero"].fail("expected a ZeRO stage 0, 1, 2 or 3");
  }
  plan.optimizer.grad_bytes = read_element_bytes(opt, "grad_bytes", plan.optimizer.grad_bytes, 1, 8,
                                                 "2 for 16-bit gradients, 4 for fp32");
  plan.optimizer.state_bytes =
      read_element_bytes(opt, "state_bytes", plan.optimizer.state_bytes, 0, 64,
                         "12 for an fp32 master copy and Adam's two moments, 8 without the copy");
  plan.optimizer.weight_shard_bytes =
      read_element_bytes(opt, "weight_shard_bytes", plan.optimizer.weight_shard_bytes, 1, 8,
                         "2 for 16-bit shards, 4 for fp32 ones");
  plan.optimizer.keep_gathered = opt.get_bool("keep_gathered", false);
  if (plan.optimizer.keep_gathered && plan.optimizer.zero != 3) {
    opt["keep_gathered"].fail(
        "keeps ZeRO-3's gathered parameters; it needs \"zero\": 3 (or remove it)");
  }
  plan.optimizer.offload_fraction = opt.get_double("offload_fraction", 0);
  if (!(plan.optimizer.offload_fraction >= 0 && plan.optimizer.offload_fraction <= 1)) {
    opt["offload_fraction"].fail(
        "must be from 0 (the optimizer on the GPU) to 1 (all of it on the host)");
  }
  plan.optimizer.offload_overlap = opt.get_bool("offload_overlap", false);
  plan.optimizer.offload_param_bytes =
      read_element_bytes(opt, "offload_param_bytes", plan.optimizer.offload_param_bytes, 1, 8,
                         "4 for an fp32 parameter copy, 2 for a 16-bit one");
  if (plan.optimizer.offload_fraction == 0) {
    for (const char* key : {"offload_overlap", "offload_param_bytes"}) {
      if (opt.has(key)) {
        opt[key].fail("applies to optimizer offloading; set \"offload_fraction\" (or remove it)");
      }
    }
  }
  plan.optimizer.offload_params = opt.get_bool("offload_params", false);
  if (plan.optimizer.offload_params &&
      (plan.optimizer.zero != 3 || plan.optimizer.offload_fraction != 1)) {
    opt["offload_params"].fail(
        "keeps ZeRO-3's parameter shards on the host beside the whole optimizer state: it needs "
        "\"zero\": 3 and \"offload_fraction\": 1 (or remove it)");
  }
  if (plan.optimizer.offload_params && plan.optimizer.offload_overlap) {
    opt["offload_overlap"].fail(
        "overlaps the optimizer's own copies, which parameter offloading does not make (its "
        "copies run beside the gathers and reductions); remove it");
  }
}

// communication: buckets, overlaps, algorithms and the frameworks' ZeRO-3 and pipeline habits.
void parse_communication(const InputNode& c, Plan& plan) {
  c.check_keys({"dp_bucket_bytes", "overlap_grad_reduce", "overlap_param_gather",
                "pp_scatter_gather", "algorithm", "grad_reduce_bytes", "tp_overlap",
                "zero3_per_tensor", "zero3_regather_for_recompute", "zero3_persistence_threshold",
                "zero3_reduce_bucket", "zero3_prefetch_elements", "save_gathered_inputs",
                "pp_buffers_per_micro_batch", "tp_sub_batches", "pp_blocking_sends", "ep_overlap",
                "moe_shared_expert_overlap"});
  plan.comm.dp_bucket_bytes =
      c.get_quantity("dp_bucket_bytes", Dimension::kBytes, plan.comm.dp_bucket_bytes);
  if (plan.comm.dp_bucket_bytes < kMinBucketBytes) {
    c["dp_bucket_bytes"].fail(fmt::format(
        "a gradient bucket of {} is below the 1 MiB minimum (PyTorch DDP's first bucket, the "
        "smallest frameworks use; Megatron's hold 40M parameters)",
        format_bytes(plan.comm.dp_bucket_bytes)));
  }
  plan.comm.overlap_grad_reduce = c.get_bool("overlap_grad_reduce", true);
  plan.comm.overlap_param_gather = c.get_bool("overlap_param_gather", true);
  plan.comm.pp_scatter_gather = c.get_bool("pp_scatter_gather", true);
  plan.comm.algorithm = c.get_string("algorithm", "auto");
  plan.comm.grad_reduce_bytes =
      read_element_bytes(c, "grad_reduce_bytes", 0, 0, 8,
                         "0 reduces in the gradients' own dtype, 2 in 16 bits, 4 in fp32");
  plan.comm.tp_overlap = c.get_bool("tp_overlap", false);
  if (auto n = c.get("tp_sub_batches")) {
    plan.comm.tp_sub_batches = n->as_small_int();
    if (plan.comm.tp_sub_batches < 1) n->fail("must be at least 1 (1: no sub-pipelining)");
    if (plan.comm.tp_sub_batches > 1 && plan.comm.tp_overlap) {
      n->fail(
          "sub-pipelines the collectives that \"tp_overlap\" pairs with GEMMs; use one of "
          "the two");
    }
  }
  plan.comm.zero3_per_tensor = c.get_bool("zero3_per_tensor", false);
  plan.comm.zero3_regather_for_recompute = c.get_bool("zero3_regather_for_recompute", false);
  plan.comm.zero3_persistence_threshold = c.get_double("zero3_persistence_threshold", 0);
  if (plan.comm.zero3_persistence_threshold < 0) {
    c["zero3_persistence_threshold"].fail(
        "give a number of elements, 0 or more (0: every tensor is sharded)");
  }
  plan.comm.zero3_reduce_bucket = c.get_double("zero3_reduce_bucket", 0);
  if (plan.comm.zero3_reduce_bucket < 0) {
    c["zero3_reduce_bucket"].fail(
        "give a number of elements, 0 or more (0: each tensor reduced on its own)");
  }
  plan.comm.zero3_prefetch_elements = c.get_double("zero3_prefetch_elements", 0);
  if (plan.comm.zero3_prefetch_elements < 0) {
    c["zero3_prefetch_elements"].fail(
        "give a number of elements, 0 or more (0: a whole unit gathered ahead)");
  }
  if (plan.comm.zero3_prefetch_elements > 0 &&
      (!plan.comm.zero3_per_tensor || !plan.comm.zero3_regather_for_recompute)) {
    c["zero3_prefetch_elements"].fail(
        "prefetches ZeRO-3's gathers tensor by tensor, as DeepSpeed does; it needs "
        "\"zero3_per_tensor\": true and \"zero3_regather_for_recompute\": true (or remove it)");
  }
  plan.comm.save_gathered_inputs = c.get_bool("save_gathered_inputs", false);
  plan.comm.pp_buffers_per_micro_batch = c.get_bool("pp_buffers_per_micro_batch", false);
  plan.comm.pp_blocking_sends = c.get_bool("pp_blocking_sends", false);
  plan.comm.ep_overlap = c.get_bool("ep_overlap", false);
  plan.comm.moe_shared_expert_overlap = c.get_bool("moe_shared_expert_overlap", false);
  if (plan.comm.moe_shared_expert_overlap && plan.comm.ep_overlap) {
    c["moe_shared_expert_overlap"].fail(
        "runs the shared expert beside the all-to-alls, which \"ep_overlap\" already hides "
        "behind another micro-batch (Megatron-Core refuses the two together); use one");
  }
  if (plan.comm.ep_overlap && plan.comm.tp_sub_batches > 1) {
    c["ep_overlap"].fail(
        "overlaps the expert all-to-alls across micro-batches, which \"tp_sub_batches\" "
        "already sub-pipelines within one; use one of the two");
  }
  if (plan.comm.algorithm != "auto" && plan.comm.algorithm != "ring" &&
      plan.comm.algorithm != "tree") {
    c["algorithm"].fail_unknown(plan.comm.algorithm, {"auto", "ring", "tree"});
  }
}

// schedule (op-order): each order's devices and blocks ("F3@0", pairs "F3@0+B1@7").
void parse_schedule(const InputNode& sched, Plan& plan) {
  sched.check_keys({"name", "orders"});
  plan.schedule_name = sched.get_string("name", "");
  for (const auto& o : sched["orders"].items()) {
    o.check_keys({"devices", "blocks"});
    DeviceOrder order;
    order.devices = parse_slice(o["devices"], plan.mesh);
    std::string text = o["blocks"].as_string();
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = text.find(' ', pos);
      if (end == std::string::npos) end = text.size();
      if (end > pos) {
        // "F3@0+B1@7": two blocks run as one pair.
        const std::string token = text.substr(pos, end - pos);
        const size_t plus = token.find('+');
        if (plus != std::string::npos && token.find('+', plus + 1) != std::string::npos) {
          o["blocks"].fail(fmt::format(
              "'{}' pairs more than two blocks; a pair is a forward and a backward, e.g. "
              "'F3@0+B1@7'",
              token));
        }
        for (const std::string& part :
             plus == std::string::npos
                 ? std::vector<std::string>{token}
                 : std::vector<std::string>{token.substr(0, plus), token.substr(plus + 1)}) {
          Expected<Block> b = parse_block(part);
          if (!b) o["blocks"].fail(b.error().message());
          order.blocks.push_back(*b);
        }
        if (plus != std::string::npos) {
          if (plan.comm.moe_shared_expert_overlap) {
            o["blocks"].fail(fmt::format(
                "pair '{}' hides its expert all-to-alls behind the other block, which "
                "communication.moe_shared_expert_overlap already hides behind the shared "
                "expert; use one of the two",
                token));
          }
          order.blocks[order.blocks.size() - 2].paired_with_next = true;
        }
      }
      pos = end + 1;
    }
    plan.schedule.push_back(order);
  }
}

Plan parse_plan_node(const InputNode& root) {
  root.check_keys({"format", "version", "name", "topology", "model", "training", "mesh",
                   "placement", "segments", "partition", "recompute", "recompute_early_stop",
                   "activation_offload_layers", "activation_offload_modules", "moe_grouped_gemm",
                   "moe_deepep", "optimizer", "communication", "schedule"});
  if (root["format"].as_string() != "nnsim-plan") {
    root["format"].fail("expected \"nnsim-plan\" (is this a plan file?)");
  }
  Plan plan;
  plan.version = root["version"].as_small_int();
  if (plan.version != kPlanVersion) {
    root["version"].fail(fmt::format(
        "plan version {} is not supported by this nnsim (it reads version {}); rebuild the plan "
        "with `nnsim plan`",
        plan.version, kPlanVersion));
  }
  plan.name = root.get_string("name", "");
  if (auto t = root.get("topology")) {
    t->check_keys({"name", "gpus"});
    plan.topology_name = t->get_string("name", "");
    plan.topology_gpus = t->get_small_int("gpus", 0);
    if (t->has("gpus") && plan.topology_gpus < 1) (*t)["gpus"].fail("must be at least 1");
  }
  plan.model = parse_model_node(root["model"]);

  parse_training(root["training"], plan);
  plan.mesh = parse_mesh(root["mesh"]);
  plan.placement = parse_placement(root["placement"], plan.mesh);
  parse_segments(root["segments"], plan);
  if (auto parts = root.get("partition")) parse_partition(*parts, plan);
  if (auto rec = root.get("recompute")) parse_recompute(*rec, plan);
  plan.recompute_early_stop = root.get_bool("recompute_early_stop", false);
  plan.activation_offload_layers = root.get_small_int("activation_offload_layers", 0);
  if (plan.activation_offload_layers < 0 || plan.activation_offload_layers >= plan.model.layers) {
    root["activation_offload_layers"].fail(fmt::format(
        "offloads the activations of the model's first N layers: from 0 to {} (the model has {} "
        "layers, and the last one's are needed first in the backward: Megatron-Core's "
        "--cpu-offloading-num-layers takes fewer than num_layers)",
        plan.model.layers - 1, plan.model.layers));
  }
  if (auto mods = root.get("activation_offload_modules")) {
    for (const auto& m : mods->items()) plan.activation_offload_modules.push_back(m.as_string());
    if (plan.activation_offload_layers > 0 && !plan.activation_offload_modules.empty()) {
      (*mods).fail(
          "offloads chosen operators' activations in every layer, but activation_offload_layers "
          "offloads whole layers too; Megatron-Core runs one or the other: remove one of them");
    }
  }
  plan.moe_grouped_gemm = root.get_bool("moe_grouped_gemm", false);
  if (plan.moe_grouped_gemm && !plan.model.moe()) {
    root["moe_grouped_gemm"].fail(
        "groups a mixture of experts' GEMMs, but the model has no experts (model.experts); "
        "remove it");
  }
  plan.moe_deepep = root.get_bool("moe_deepep", false);
  if (plan.moe_deepep && !plan.model.moe()) {
    root["moe_deepep"].fail(
        "exchanges a mixture of experts' tokens, but the model has no experts (model.experts); "
        "remove it");
  }
  if (auto opt = root.get("optimizer")) parse_optimizer(*opt, plan);
  if (auto c = root.get("communication")) parse_communication(*c, plan);
  parse_schedule(root["schedule"], plan);
  return plan;
}

json slice_json(const MeshSlice& s) {
  json j = json::object();
  for (const auto& [axis, c] : s) j[axis] = c;
  return j;
}

}  // namespace

Expected<Plan> parse_plan(const std::string& json_text, const std::string& display_name) {
  return catch_input_errors<Plan>(display_name, [&] {
    return parse_plan_node(InputNode::load_string(json_text, display_name));
  });
}

Expected<Plan> load_plan(const std::string& path) {
  return catch_input_errors<Plan>(path,
                                  [&] { return parse_plan_node(InputNode::load_file(path)); });
}

std::string plan_to_json(const Plan& plan) {
  json j;
  j["format"] = "nnsim-plan";
  j["version"] = plan.version;
  j["name"] = plan.name;
  if (plan.topology_gpus > 0) {
    j["topology"] = {{"name", plan.topology_name}, {"gpus", plan.topology_gpus}};
  }
  j["model"] = json::parse(model_to_json(plan.model));
  j["training"] = {{"global_batch", plan.global_batch},
                   {"micro_batch", plan.micro_batch},
                   {"precision", std::string(to_string(plan.precision))},
                   {"framework", plan.framework},
                   {"recycle", plan.recycle}};
  json mesh = json::array();
  for (const auto& a : plan.mesh.axes) mesh.push_back(json::array({a.name, a.size}));
  j["mesh"] = mesh;
  json placement = json::object();
  if (!plan.placement.gpus.empty()) {
    placement["gpus"] = plan.placement.gpus;
  } else {
    json factors = json::array();
    for (const auto& f : plan.placement.factors) factors.push_back(json::array({f.axis, f.size}));
    placement["factors"] = factors;
  }
  j["placement"] = placement;
  json segments = json::array();
  for (const auto& s : plan.segments) {
    segments.push_back({{"name", s.name},
                        {"layers", json::array({s.first_layer, s.end_layer})},
                        {"embedding", s.embedding},
                        {"head", s.head},
                        {"devices", slice_json(s.devices)}});
  }
  j["segments"] = segments;
  json partition = json::array();
  for (const auto& r : plan.partition) {
    json split = json::object();
    for (const auto& s : r.splits) split[std::string(to_string(s.dim))] = s.axes;
    partition.push_back({{"match", r.match}, {"split", split}});
  }
  j["partition"] = partition;
  json recompute = json::array();
  for (const auto& r : plan.recompute) {
    json rule = {{"match", r.match}};
    if (r.end_layer >= 0) rule["layers"] = json::array({r.first_layer, r.end_layer});
    recompute.push_back(rule);
  }
  j["recompute"] = recompute;
  j["recompute_early_stop"] = plan.recompute_early_stop;
  if (plan.activation_offload_layers > 0) {
    j["activation_offload_layers"] = plan.activation_offload_layers;
  }
  if (!plan.activation_offload_modules.empty()) {
    j["activation_offload_modules"] = plan.activation_offload_modules;
  }
  if (plan.moe_grouped_gemm) j["moe_grouped_gemm"] = true;
  if (plan.moe_deepep) j["moe_deepep"] = true;
  j["optimizer"] = {{"kind", plan.optimizer.kind},
                    {"zero", plan.optimizer.zero},
                    {"grad_bytes", plan.optimizer.grad_bytes},
                    {"state_bytes", plan.optimizer.state_bytes},
                    {"weight_shard_bytes", plan.optimizer.weight_shard_bytes},
                    {"keep_gathered", plan.optimizer.keep_gathered}};
  if (plan.optimizer.offload_fraction > 0) {
    j["optimizer"]["offload_fraction"] = plan.optimizer.offload_fraction;
    j["optimizer"]["offload_overlap"] = plan.optimizer.offload_overlap;
    j["optimizer"]["offload_param_bytes"] = plan.optimizer.offload_param_bytes;
    if (plan.optimizer.offload_params) j["optimizer"]["offload_params"] = true;
  }
  j["communication"] = {{"dp_bucket_bytes", plan.comm.dp_bucket_bytes},
                        {"overlap_grad_reduce", plan.comm.overlap_grad_reduce},
                        {"overlap_param_gather", plan.comm.overlap_param_gather},
                        {"pp_scatter_gather", plan.comm.pp_scatter_gather},
                        {"algorithm", plan.comm.algorithm},
                        {"grad_reduce_bytes", plan.comm.grad_reduce_bytes},
                        {"tp_overlap", plan.comm.tp_overlap},
                        {"zero3_per_tensor", plan.comm.zero3_per_tensor},
                        {"zero3_regather_for_recompute", plan.comm.zero3_regather_for_recompute},
                        {"zero3_persistence_threshold", plan.comm.zero3_persistence_threshold},
                        {"zero3_reduce_bucket", plan.comm.zero3_reduce_bucket},
                        {"zero3_prefetch_elements", plan.comm.zero3_prefetch_elements},
                        {"save_gathered_inputs", plan.comm.save_gathered_inputs},
                        {"pp_buffers_per_micro_batch", plan.comm.pp_buffers_per_micro_batch},
                        {"pp_blocking_sends", plan.comm.pp_blocking_sends}};
  if (plan.comm.tp_sub_batches > 1) j["communication"]["tp_sub_batches"] = plan.comm.tp_sub_batches;
  if (plan.comm.ep_overlap) j["communication"]["ep_overlap"] = true;
  if (plan.comm.moe_shared_expert_overlap) {
    j["communication"]["moe_shared_expert_overlap"] = true;
  }
  json orders = json::array();
  for (const auto& o : plan.schedule) {
    std::string blocks;
    for (size_t i = 0; i < o.blocks.size(); ++i) {
      if (!blocks.empty()) blocks += i > 0 && o.blocks[i - 1].paired_with_next ? '+' : ' ';
      blocks += to_string(o.blocks[i]);
    }
    orders.push_back({{"devices", slice_json(o.devices)}, {"blocks", blocks}});
  }
  j["schedule"] = {{"name", plan.schedule_name}, {"orders", orders}};
  return format_json(j);
}

}  // namespace nnsim
