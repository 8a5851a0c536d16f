#include "hwexec/run_layout.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace nnsim::hwexec {

namespace {

// Operator `op`'s split along `dim` (the last matching rule's): its axes, how many ways and
// this rank's place along them.
void split_along(const Plan& plan, int rank, const char* op, Dim dim,
                 std::vector<std::string>& axes, int& ways, int& index) {
  axes = split_axes(plan, op, dim);
  for (const std::string& a : axes) ways *= plan.mesh.axis_size(a);
  if (ways > 1) {
    const std::vector<int> g = plan.mesh.ranks_along(rank, axes);
    index = static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
  }
}

}  // namespace

std::vector<std::string> split_axes(const Plan& plan, const std::string& op, Dim dim) {
  std::vector<std::string> axes;
  for (const PartitionRule& r : plan.partition) {
    if (!match_pattern(r.match, op)) continue;
    for (const DimSplit& s : r.splits) {
      if (s.dim == dim) axes = s.axes;
    }
  }
  return axes;
}

bool in_slice(const Mesh& mesh, const MeshSlice& slice, const std::vector<int>& coords) {
  for (const auto& [axis, c] : slice) {
    const int i = mesh.axis_index(axis);
    if (i < 0 || coords[i] != c) return false;
  }
  return true;
}

RankLayout layout_of(const Plan& plan, int rank) {
  RankLayout L;
  const std::vector<int> coords = plan.mesh.coordinates(rank);
  std::set<std::string> pp;
  for (const DeviceOrder& o : plan.schedule) {
    for (const auto& [a, c] : o.devices) pp.insert(a);
    if (in_slice(plan.mesh, o.devices, coords)) L.order = &o;
  }
  L.pp_axes.assign(pp.begin(), pp.end());
  // Context parallelism: attn.core's sequence split (check_runnable: every operator's alike).
  split_along(plan, rank, "attn.core", Dim::kSeq, L.cp_axes, L.split.cp, L.split.cp_index);
  // Expert parallelism: the routed experts' split (check_runnable: the batch of the rest alike).
  split_along(plan, rank, "moe.fc1", Dim::kExpert, L.ep_axes, L.split.ep, L.split.ep_index);
  // ... in the mesh's order (the group's ranks are), and the batch's split of the rest.
  std::vector<std::string> ep_in_mesh_order;
  for (const MeshAxis& a : plan.mesh.axes) {
    if (std::find(L.ep_axes.begin(), L.ep_axes.end(), a.name) != L.ep_axes.end()) {
      ep_in_mesh_order.push_back(a.name);
    }
  }
  L.ep_axes = ep_in_mesh_order;
  split_along(plan, rank, "attn.norm", Dim::kBatch, L.batch_axes, L.split.batch_ep,
              L.split.batch_ep_index);
  auto degree = [&](const char* op) {
    std::vector<std::string> axes;
    for (const PartitionRule& r : plan.partition) {
      if (!match_pattern(r.match, op)) continue;
      for (const DimSplit& s : r.splits) {
        // The tensor-parallel dimension (not the sequence's, nor expert parallelism's batch).
        if (s.dim != Dim::kSeq && s.dim != Dim::kBatch) axes = s.axes;
      }
    }
    int n = 1;
    std::vector<std::string> tensor;  // the pipeline axes (a spanning segment's) left out
    for (const std::string& a : axes) {
      n *= plan.mesh.axis_size(a);
      if (!pp.count(a)) tensor.push_back(a);
    }
    if (!tensor.empty()) L.tp_axes = tensor;
    return n;
  };
  L.split.heads = degree("attn.core");
  L.split.ffn = degree("mlp.fc1");
  L.split.embed_vocab = degree("embed.word");
  L.split.head_vocab = degree("head.proj");
  auto ffn_degree = [&](const char* op) {
    int n = 1;
    for (const PartitionRule& r : plan.partition) {
      if (!match_pattern(r.match, op)) continue;
      for (const DimSplit& s : r.splits) {
        if (s.dim != Dim::kFfn) continue;
        n = 1;
        for (const std::string& a : s.axes) n *= plan.mesh.axis_size(a);
      }
    }
    return n;
  };
  L.split.expert_ffn = ffn_degree("moe.fc1");
  L.split.shared_ffn = ffn_degree("moe.shared.fc1");
  for (const PartitionRule& r : plan.partition) {
    if (!match_pattern(r.match, "attn.norm")) continue;
    for (const DimSplit& sp : r.splits) {
      if (sp.dim != Dim::kSeq || sp.axes == L.cp_axes) continue;
      // Sequence parallelism (with context parallelism: the axes after cp's, over which each cp
      // rank's tokens are cut).
      L.split.seq = 1;
      for (const std::string& a : sp.axes) {
        const bool cp = std::find(L.cp_axes.begin(), L.cp_axes.end(), a) != L.cp_axes.end();
        if (!cp) L.split.seq *= plan.mesh.axis_size(a);
      }
    }
  }
  L.split.save_gathered = plan.comm.save_gathered_inputs;
  if (L.order == nullptr || L.order->blocks.empty()) return L;
  for (const Block& b : L.order->blocks) {
    if (std::find(L.segments.begin(), L.segments.end(), b.segment) == L.segments.end()) {
      L.segments.push_back(b.segment);
    }
  }
  // Pipeline order: embedding first, then by first layer, head last.
  std::vector<int> seq(plan.segments.size());
  for (std::size_t i = 0; i < seq.size(); ++i) seq[i] = static_cast<int>(i);
  auto key = [&](int i) {
    const Segment& s = plan.segments[i];
    return std::make_tuple(s.embedding ? 0 : 1, s.head ? 1 : 0, s.first_layer);
  };
  std::sort(seq.begin(), seq.end(), [&](int a, int b) { return key(a) < key(b); });
  for (std::size_t i = 0; i < seq.size(); ++i) {
    L.neighbours[seq[i]] = {i > 0 ? seq[i - 1] : -1, i + 1 < seq.size() ? seq[i + 1] : -1};
  }
  return L;
}

int peer_in(const Mesh& mesh, int rank, const Segment& seg) {
  std::vector<int> c = mesh.coordinates(rank);
  for (const auto& [axis, v] : seg.devices) c[mesh.axis_index(axis)] = v;
  return mesh.rank_of(c);
}

std::vector<std::string> data_parallel_with(const Mesh& mesh,
                                            const std::vector<std::string>& more) {
  std::vector<std::string> axes;
  for (const MeshAxis& a : mesh.axes) {
    if (a.name == kDataParallelAxis || std::find(more.begin(), more.end(), a.name) != more.end()) {
      axes.push_back(a.name);
    }
  }
  return axes;
}

std::string axes_name(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "+" : "") + v[i];
  return s.empty() ? "none" : s;
}

}  // namespace nnsim::hwexec
