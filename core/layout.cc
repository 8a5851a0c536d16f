#include "core/layout.h"

#include <array>
#include <string>

#include <fmt/format.h>

namespace nnsim {

int OpPartition::factor(Dim d, const Mesh& mesh) const {
  int f = 1;
  for (size_t a = 0; a < axis_dim.size(); ++a) {
    if (axis_dim[a] == static_cast<int8_t>(d)) f *= mesh.axes[a].size;
  }
  return f;
}

int OpPartition::factor(DimSet dims, const Mesh& mesh) const {
  int f = 1;
  for (size_t a = 0; a < axis_dim.size(); ++a) {
    if (axis_dim[a] != kNone && dims.contains(static_cast<Dim>(axis_dim[a]))) {
      f *= mesh.axes[a].size;
    }
  }
  return f;
}

std::string_view to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce:
      return "all-reduce";
    case CollectiveKind::kAllGather:
      return "all-gather";
    case CollectiveKind::kReduceScatter:
      return "reduce-scatter";
    case CollectiveKind::kAllToAll:
      return "all-to-all";
    case CollectiveKind::kExpertExchange:
      return "expert exchange";
  }
  return "?";
}

TensorLayout output_layout(const Op& op, const OpPartition& part) {
  TensorLayout l(part.axis_dim.size());
  for (size_t a = 0; a < l.size(); ++a) {
    if (!part.splits_on(static_cast<int>(a))) continue;
    Dim d = part.dim_on(static_cast<int>(a));
    if (op.reduced.contains(d)) {
      l[a].kind = AxisLayoutKind::kPartial;
    } else if (op.output.dims.contains(d)) {
      l[a] = {AxisLayoutKind::kSplit, d};
    }
  }
  return l;
}

TensorLayout input_layout(const Op& op, const OpPartition& part, DimSet dims) {
  TensorLayout l(part.axis_dim.size());
  for (size_t a = 0; a < l.size(); ++a) {
    if (!part.splits_on(static_cast<int>(a))) continue;
    Dim d = part.dim_on(static_cast<int>(a));
    if (dims.contains(d)) l[a] = {AxisLayoutKind::kSplit, d};
  }
  return l;
}

TensorLayout input_grad_layout(const Op& op, const OpPartition& part, DimSet dims) {
  TensorLayout l = input_layout(op, part, dims);
  for (size_t a = 0; a < l.size(); ++a) {
    // Each piece of a split operator that reads the whole input contributes part of its gradient.
    if (part.splits_on(static_cast<int>(a)) && l[a].kind == AxisLayoutKind::kReplicated) {
      l[a].kind = AxisLayoutKind::kPartial;
    }
  }
  return l;
}

TensorLayout output_grad_layout(const Op& op, const OpPartition& part) {
  TensorLayout l = output_layout(op, part);
  // Every partial-sum piece's gradient is the gradient of the sum: the whole of it.
  for (auto& x : l) {
    if (x.kind == AxisLayoutKind::kPartial) x.kind = AxisLayoutKind::kReplicated;
  }
  return l;
}

double piece_bytes(const TensorSpec& t, const TensorLayout& layout, const Mesh& mesh) {
  double b = t.bytes();
  for (size_t a = 0; a < layout.size(); ++a) {
    if (layout[a].kind == AxisLayoutKind::kSplit && t.dims.contains(layout[a].dim)) {
      b /= mesh.axes[a].size;
    }
  }
  return b;
}

std::vector<Conversion> conversions(const TensorSpec& t, TensorLayout have,
                                    const TensorLayout& want, const Mesh& mesh) {
  std::vector<Conversion> out;
  for (size_t a = 0; a < have.size(); ++a) {
    const AxisLayout h = have[a];
    const AxisLayout w = want[a];
    if (h == w || mesh.axes[a].size == 1) continue;
    Conversion c;
    c.axis = static_cast<int>(a);
    if (w.kind == AxisLayoutKind::kReplicated) {
      if (h.kind == AxisLayoutKind::kPartial) {
        c.kind = CollectiveKind::kAllReduce;
        c.bytes = piece_bytes(t, have, mesh);
      } else {  // split -> replicated
        c.kind = CollectiveKind::kAllGather;
        have[a] = w;
        c.bytes = piece_bytes(t, have, mesh);
      }
    } else if (w.kind == AxisLayoutKind::kSplit) {
      if (h.kind == AxisLayoutKind::kReplicated) {
        have[a] = w;  // a local slice
        continue;
      }
      if (h.kind == AxisLayoutKind::kPartial) {
        c.kind = CollectiveKind::kReduceScatter;
        c.bytes = piece_bytes(t, have, mesh);
      } else {
        c.kind = CollectiveKind::kAllToAll;
        c.bytes = piece_bytes(t, have, mesh);
      }
    } else {
      continue;  // nothing ever needs a partial sum as input
    }
    have[a] = w;
    out.push_back(c);
  }
  return out;
}

namespace {

// What an operator's granularity along `d` counts, for messages.
std::string head_units(const Op& op, Dim d) {
  if (d != Dim::kHeads) return "elements";
  if (op.name.rfind("gdn.", 0) == 0) {
    return "Gated DeltaNet key heads (gdn_key_heads must be divisible by the split)";
  }
  if (op.kind == OpKind::kScan) return "Mamba-2 heads (mamba_heads must be divisible by the split)";
  if (op.name.rfind("ssm.", 0) == 0) {
    return "Mamba-2 head groups (mamba_groups must be divisible by the split)";
  }
  return "key/value head groups (kv_heads must be divisible by the split)";
}

}  // namespace

Expected<std::vector<OpPartition>> resolve_partitions(const GraphPart& part, const Plan& plan) {
  const Mesh& mesh = plan.mesh;
  std::vector<OpPartition> out;
  for (const Op& op : part.ops) {
    OpPartition p;
    p.axis_dim.assign(mesh.axes.size(), OpPartition::kNone);
    // Every matching rule applies in file order; a later rule replaces the axes of a dimension
    // an earlier one split ("seq": [] un-splits it). The rule that split each dimension last.
    std::array<const PartitionRule*, kNumDims> split_by{};
    for (const auto& rule : plan.partition) {
      if (!match_pattern(rule.match, op.name)) continue;
      for (const auto& split : rule.splits) {
        for (auto& d : p.axis_dim) {
          if (d == static_cast<int8_t>(split.dim)) d = OpPartition::kNone;
        }
        split_by[static_cast<int>(split.dim)] = split.axes.empty() ? nullptr : &rule;
        if (split.axes.empty()) continue;
        if (!op.dims.contains(split.dim)) {
          return Error(fmt::format(
              "partition rule '{}' splits dimension '{}' of operator '{}', which has no such "
              "dimension; narrow the rule's match",
              rule.match, to_string(split.dim), op.name));
        }
        for (const auto& axis : split.axes) {
          int ai = mesh.axis_index(axis);
          if (p.axis_dim[ai] != OpPartition::kNone) {
            return Error(fmt::format(
                "operator '{}' would be split along mesh axis '{}' twice ('{}' and '{}'); an axis "
                "splits one dimension of an operator",
                op.name, axis, to_string(p.dim_on(ai)), to_string(split.dim)));
          }
          p.axis_dim[ai] = static_cast<int8_t>(split.dim);
        }
      }
    }
    for (int d = 0; d < kNumDims; ++d) {
      const Dim dim = static_cast<Dim>(d);
      // Checked once every rule has applied: a later rule may take back an earlier split.
      if (split_by[d] != nullptr && op.unsplittable.contains(dim)) {
        return Error(fmt::format(
            "partition rule '{}' splits dimension '{}' of operator '{}' ({}), which cannot be "
            "split; narrow the rule's match",
            split_by[d]->match, to_string(dim), op.name, to_string(op.kind)));
      }
      int f = p.factor(dim, mesh);
      int64_t g = op.granularity[d];
      if (f > 1 && g % f != 0) {
        return Error(
            fmt::format("operator '{}' splits '{}' {} ways, which does not divide its {} "
                        "{}",
                        op.name, to_string(dim), f, g, head_units(op, dim)));
      }
    }
    out.push_back(p);
  }
  return out;
}

uint32_t late_bias_sync(const GraphPart& part, const std::vector<OpPartition>& parts, size_t i,
                        const Mesh& mesh, double* params) {
  const Op& op = part.ops[i];
  const TensorLayout out = output_layout(op, parts[i]);
  // The first operator reading the output decides the layout it is reduced into.
  int consumer = -1;
  for (size_t j = i + 1; j < part.ops.size() && consumer < 0; ++j) {
    for (const TensorRef& r : part.ops[j].inputs) {
      if (r.op == static_cast<int>(i) && r.slot == 0) consumer = static_cast<int>(j);
    }
  }
  if (consumer < 0) return 0;
  const TensorLayout want = input_layout(part.ops[consumer], parts[consumer], op.output.dims);
  uint32_t axes = 0;
  double local = 0;
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    if (out[a].kind != AxisLayoutKind::kPartial || want[a].kind != AxisLayoutKind::kSplit ||
        mesh.axes[a].size == 1) {
      continue;
    }
    const Dim summed = parts[i].dim_on(static_cast<int>(a));
    double n = 0;
    for (const auto& w : op.weights) {
      if (!w.dims.contains(summed) && !w.dims.contains(want[a].dim)) {
        n += w.elements / parts[i].factor(w.dims, mesh);
      }
    }
    if (n > 0) {
      axes |= 1u << a;
      local = n;
    }
  }
  *params += local;
  return axes;
}

}  // namespace nnsim
