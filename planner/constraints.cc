#include "planner/constraints.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/input.h"
#include "core/layout.h"
#include "core/suggest.h"

namespace nnsim {

namespace {

Dim parse_dim_node(const InputNode& n) {
  Dim d;
  std::string s = n.as_string();
  if (!parse_dim(s, &d)) n.fail_unknown(s, dim_names());
  return d;
}

Constraints parse(const InputNode& root) {
  root.check_keys({"memory_cap", "schedules", "max_stages", "max_bubble", "tp_within_node",
                   "ep_within_node", "operators", "stage_layers", "recompute", "recompute_modules",
                   "offload_modules", "stage_nodes", "avoid_gpus", "avoid_nodes"});
  Constraints c;
  c.file = root.file();
  if (auto n = root.get("memory_cap")) {
    c.memory_cap = n->as_quantity(Dimension::kBytes);
    if (*c.memory_cap <= 0) n->fail("must be positive, e.g. 60 GB");
  }
  if (auto n = root.get("schedules")) {
    for (const auto& s : n->items()) {
      Expected<ScheduleKind> k = parse_schedule_kind(s.as_string());
      if (!k) s.fail(k.error().message());
      c.schedules.push_back(*k);
    }
  }
  if (auto n = root.get("max_stages")) {
    c.max_stages = n->as_small_int();
    if (*c.max_stages < 1) n->fail("must be at least 1");
  }
  if (auto n = root.get("max_bubble")) {
    c.max_bubble = n->as_double();
    if (*c.max_bubble < 0 || *c.max_bubble >= 1) n->fail("a fraction of the iteration in [0, 1)");
  }
  c.tp_within_node = root.get_bool("tp_within_node", false);
  c.ep_within_node = root.get_bool("ep_within_node", false);
  if (auto n = root.get("operators")) {
    for (const auto& o : n->items()) {
      o.check_keys({"match", "kind", "layers", "forbid", "allow", "max_degree", "replicate"});
      OperatorConstraint oc;
      oc.line = o.line();
      if (auto m = o.get("match")) oc.match = m->as_string();
      if (auto k = o.get("kind")) {
        const std::string s = k->as_string();
        std::vector<std::string> names;
        for (OpKind kind : kOpKinds) {
          names.emplace_back(to_string(kind));
          if (s == to_string(kind)) oc.kind = kind;
        }
        if (!oc.kind) k->fail_unknown(s, names);
      }
      if (auto l = o.get("layers")) {
        const std::vector<int> range = l->as_small_int_list();
        if (range.size() != 2 || range[0] < 0 || range[1] <= range[0]) {
          l->fail("a layer range [first, end), e.g. [0, 4]");
        }
        oc.layers = std::make_pair(range[0], range[1]);
      }
      if (!o.get("match") && !oc.kind && !oc.layers) {
        o.fail("an operator rule needs match, kind or layers to say which operators it covers");
      }
      if (auto f = o.get("forbid")) {
        for (const auto& d : f->items()) oc.forbid.push_back(parse_dim_node(d));
      }
      if (auto a = o.get("allow")) {
        for (const auto& d : a->items()) oc.allow.push_back(parse_dim_node(d));
      }
      if (auto m = o.get("max_degree")) {
        oc.max_degree = m->as_small_int();
        if (*oc.max_degree < 1) m->fail("must be at least 1");
      }
      oc.replicate = o.get_bool("replicate", false);
      c.operators.push_back(oc);
    }
  }
  if (auto n = root.get("stage_layers")) {
    for (const auto& v : n->items()) {
      const int layers = v.as_small_int();
      if (layers < 1) v.fail("every stage needs at least one layer");
      c.stage_layers.push_back(layers);
    }
  }
  if (auto n = root.get("recompute")) {
    auto mode = [](const InputNode& x) {
      Expected<RecomputeMode> m = parse_recompute_mode(x.as_string());
      if (!m) x.fail(m.error().message());
      return *m;
    };
    if (n->is_sequence()) {
      for (const auto& x : n->items()) c.stage_recompute.push_back(mode(x));
      if (c.stage_recompute.empty()) n->fail("give a mode, or one mode per pipeline stage");
    } else {
      c.recompute = mode(*n);
    }
  }
  if (auto n = root.get("recompute_modules")) {
    for (const auto& x : n->items()) c.recompute_modules.push_back(x.as_string());
  }
  if (auto n = root.get("offload_modules")) {
    for (const auto& x : n->items()) c.offload_modules.push_back(x.as_string());
  }
  if (auto n = root.get("stage_nodes")) {
    for (const auto& e : n->items()) {
      e.check_keys({"stage", "nodes"});
      c.stage_nodes.emplace_back(e["stage"].as_small_int(), e["nodes"].as_small_int_list());
    }
  }
  for (const char* key : {"avoid_gpus", "avoid_nodes"}) {
    if (auto n = root.get(key)) {
      for (int x : n->as_small_int_list()) {
        if (x < 0) n->fail("GPU and node indices start at 0");
        (std::string(key) == "avoid_gpus" ? c.avoid_gpus : c.avoid_nodes).push_back(x);
      }
    }
  }
  return c;
}

}  // namespace

Expected<Constraints> parse_constraints(const std::string& yaml, const std::string& name) {
  return catch_input_errors<Constraints>(name,
                                         [&] { return parse(InputNode::load_string(yaml, name)); });
}

Expected<Constraints> load_constraints(const std::string& path) {
  return catch_input_errors<Constraints>(path, [&] { return parse(InputNode::load_file(path)); });
}

std::string violated_constraint(const Constraints& c, const Plan& plan, const Program& program,
                                double estimated_bubble, double peak_memory) {
  if (c.memory_cap && peak_memory > *c.memory_cap) return "memory_cap";
  if (!c.schedules.empty()) {
    bool ok = false;
    for (ScheduleKind k : c.schedules) ok = ok || plan.schedule_name == to_string(k);
    if (!ok) return "schedules";
  }
  const int pp = plan.mesh.axis_size("pp");
  if (c.max_stages && pp > *c.max_stages) return "max_stages";
  if (c.max_bubble && estimated_bubble > *c.max_bubble) return "max_bubble";
  const Topology& topo = program.topology;
  // Whether every group along mesh axis `axis` (absent: none) has its GPUs in one node.
  auto within_node = [&](const char* axis) {
    const int a = plan.mesh.axis_index(axis);
    if (a < 0) return true;
    for (const Lane& lane : program.lanes) {
      for (int r : lane.ranks) {
        std::vector<int> group = program.group_of(r, 1u << a);
        const int node = topo.node_of(program.gpu_of_rank[group.front()]);
        for (int g : group) {
          if (topo.node_of(program.gpu_of_rank[g]) != node) return false;
        }
      }
    }
    return true;
  };
  if (c.tp_within_node && !within_node("tp")) return "tp_within_node";
  if (c.ep_within_node && !within_node("ep")) return "ep_within_node";
  for (size_t i = 0; i < c.operators.size(); ++i) {
    const OperatorConstraint& oc = c.operators[i];
    const OpGraph& graph = program.graph;
    for (const GraphPart* part : graph.parts()) {
      // Partition rules apply to every block of a shape alike: a layer range selects a block
      // shape's operators when it covers a layer of that shape.
      if (oc.layers) {
        bool covers = false;
        for (int l = oc.layers->first; l < std::min(oc.layers->second, plan.model.layers); ++l) {
          covers = covers || &graph.layer_at(l) == part;
        }
        if (!covers) continue;
      }
      Expected<std::vector<OpPartition>> parts = resolve_partitions(*part, plan);
      if (!parts) continue;
      for (size_t k = 0; k < part->ops.size(); ++k) {
        const Op& op = part->ops[k];
        if (!match_pattern(oc.match, op.name)) continue;
        if (oc.kind && op.kind != *oc.kind) continue;
        const OpPartition& p = (*parts)[k];
        int degree = 1;
        for (size_t a = 0; a < p.axis_dim.size(); ++a) {
          if (!p.splits_on(static_cast<int>(a)) || plan.mesh.axes[a].size == 1) continue;
          const Dim d = p.dim_on(static_cast<int>(a));
          degree *= plan.mesh.axes[a].size;
          const bool forbidden =
              oc.replicate || std::find(oc.forbid.begin(), oc.forbid.end(), d) != oc.forbid.end() ||
              (!oc.allow.empty() &&
               std::find(oc.allow.begin(), oc.allow.end(), d) == oc.allow.end());
          if (forbidden) return fmt::format("operators[{}] ({})", i, oc.match);
        }
        if (oc.max_degree && degree > *oc.max_degree) {
          return fmt::format("operators[{}] ({})", i, oc.match);
        }
      }
    }
  }
  for (const auto& [stage, nodes] : c.stage_nodes) {
    if (stage >= pp) continue;
    for (const Lane& lane : program.lanes) {
      auto it = lane.slice.find("pp");
      if (it == lane.slice.end() || it->second != stage) continue;
      for (int r : lane.ranks) {
        for (int rep = 0; rep < program.replicas; ++rep) {
          const int g = program.gpu_of_rank[program.rank_in_replica(r, rep)];
          if (std::find(nodes.begin(), nodes.end(), topo.node_of(g)) == nodes.end()) {
            return fmt::format("stage_nodes (stage {})", stage);
          }
        }
      }
    }
  }
  return "";
}

}  // namespace nnsim
