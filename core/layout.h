// How partitioned operators lay their tensors out over the device mesh, and the communication
// that follows (nnScaler's R/V/D rules). Along each mesh axis a tensor is replicated (R), split
// along one of its dimensions (S), or a partial sum (P: the "value split"). An operator's
// partition fixes the layout of its output and the layout it needs for each input; where a
// producer's layout differs from what the consumer needs, a collective converts it:
//
//   have -> want   forward           backward (on the gradient, want -> have)
//   P -> R         all-reduce        nothing
//   P -> S(d)      reduce-scatter    all-gather
//   S(d) -> R      all-gather        reduce-scatter
//   S(d) -> S(e)   all-to-all        all-to-all
//   R -> S(d)      nothing (slice)   all-gather of the gradient pieces ... (see below)
//
// The backward column is derived, not tabulated: the gradient of an input an operator reads
// replicated while being split along that axis is a partial sum, and a producer whose output is
// a partial sum needs the full gradient. docs/plan.md walks through Megatron's tensor and
// sequence parallelism as an example.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/opgraph.h"
#include "core/plan.h"

namespace nnsim {

// How one operator is split: for each mesh axis, the dimension split along it (or none).
struct OpPartition {
  static constexpr int8_t kNone = -1;
  std::vector<int8_t> axis_dim;  // indexed like Mesh::axes

  bool splits_on(int axis) const { return axis_dim[axis] != kNone; }
  Dim dim_on(int axis) const { return static_cast<Dim>(axis_dim[axis]); }
  // Product of the sizes of the axes splitting `d`.
  int factor(Dim d, const Mesh& mesh) const;
  // Product of the split factors of the dimensions in `dims`.
  int factor(DimSet dims, const Mesh& mesh) const;
};

enum class AxisLayoutKind : uint8_t { kReplicated, kSplit, kPartial };

struct AxisLayout {
  AxisLayoutKind kind = AxisLayoutKind::kReplicated;
  Dim dim = Dim::kBatch;  // for kSplit
  bool operator==(const AxisLayout&) const = default;
};

// A tensor's layout: one entry per mesh axis, stored inline (a mesh has at most kMaxMeshAxes):
// the compiler makes layouts by the million in a plan search, and a heap block each took a
// quarter of its time (docs/PERFORMANCE.md).
class TensorLayout {
 public:
  TensorLayout() = default;
  explicit TensorLayout(std::size_t axes) : size_(static_cast<uint8_t>(axes)) {
    assert(axes <= axes_.size());
  }
  TensorLayout(std::initializer_list<AxisLayout> axes) {
    for (const AxisLayout& a : axes) push_back(a);
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  AxisLayout& operator[](std::size_t a) { return axes_[a]; }
  const AxisLayout& operator[](std::size_t a) const { return axes_[a]; }
  AxisLayout* begin() { return axes_.data(); }
  AxisLayout* end() { return axes_.data() + size_; }
  const AxisLayout* begin() const { return axes_.data(); }
  const AxisLayout* end() const { return axes_.data() + size_; }
  void push_back(const AxisLayout& x) {
    assert(size_ < axes_.size());
    axes_[size_++] = x;
  }
  bool operator==(const TensorLayout& o) const {
    return std::equal(begin(), end(), o.begin(), o.end());
  }

 private:
  std::array<AxisLayout, kMaxMeshAxes> axes_{};
  uint8_t size_ = 0;
};

// kExpertExchange: a mixture of experts' routed tokens exchanged through DeepEP's kernels
// (Plan::moe_deepep), an all-to-all that crosses nodes once per token and node
// (core/collective.h).
enum class CollectiveKind { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kExpertExchange };
std::string_view to_string(CollectiveKind k);

// A collective along one mesh axis. `bytes` follows nccl-tests: the all-reduce buffer, the
// all-gather output, the reduce-scatter input, the all-to-all buffer, per device.
struct Conversion {
  int axis = 0;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  double bytes = 0;
};

TensorLayout output_layout(const Op& op, const OpPartition& part);
// The layout `op` needs for an input tensor spanning `dims`.
TensorLayout input_layout(const Op& op, const OpPartition& part, DimSet dims);
// The layout of the gradient `op` produces for that input.
TensorLayout input_grad_layout(const Op& op, const OpPartition& part, DimSet dims);
// The layout a producer needs for the gradient of its output.
TensorLayout output_grad_layout(const Op& op, const OpPartition& part);

// Bytes of the piece of `t` one device holds under `layout`.
double piece_bytes(const TensorSpec& t, const TensorLayout& layout, const Mesh& mesh);

// Collectives turning `have` into `want` for tensor `t`, axis by axis (mesh order).
std::vector<Conversion> conversions(const TensorSpec& t, TensorLayout have,
                                    const TensorLayout& want, const Mesh& mesh);

// Resolves the plan's partition rules for every operator of a graph part. Fails when a rule
// splits a dimension the operator does not have or cannot be split along, when a factor does not
// divide the dimension, or when one axis would split two dimensions of one operator.
Expected<std::vector<OpPartition>> resolve_partitions(const GraphPart& part, const Plan& plan);

// An operator split along a dimension it sums over (a row-parallel linear) leaves a partial sum;
// a weight that does not span that dimension (the bias) is added once the sum is reduced. Where
// the reduced output is split along a dimension the bias does not span (sequence parallelism's
// reduce-scatter), each rank adds it to its slice only, so its gradient is a partial sum over that
// axis (Megatron all-reduces these biases' gradients over tp with the norms'). Returns those axes
// of operator `i` of `part` (the first operator reading its output decides the layout it is
// reduced into) and adds the bias's local parameters to `*params`.
uint32_t late_bias_sync(const GraphPart& part, const std::vector<OpPartition>& parts, size_t i,
                        const Mesh& mesh, double* params);

}  // namespace nnsim
