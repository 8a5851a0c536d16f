// Segments spanning pipeline stages for `nnexec run` (docs/hwexec.md, docs/plan.md "Segments
// (op-assign)"): `nnsim plan --shard-head` writes the head as a segment on every pipeline order
// (`"devices": {}`), its head.proj and loss split along the vocabulary over pp (and tp);
// `--shard-embedding` does the same for the embedding's embed.word. Every order of such a segment
// runs its blocks jointly: each rank holds its vocabulary shard, the loss's statistics are
// all-reduced over the vocabulary's whole group, partial sums (the word embeddings', the
// projection's input gradient) axis by axis, and the tensors between segments travel as the
// compiled program moves them (core/compiler.h, source_lane). No LibTorch: the executor
// (run_torch.cc) applies these to its ranks' parts.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/plan.h"

namespace nnsim::hwexec {

// The axes the schedule's orders fix (the pipeline axes).
std::vector<std::string> pipeline_axes_of(const Plan& plan);

// Whether segment `segment` runs on several orders (its slice leaves a pipeline axis unfixed).
bool spans_orders(const Plan& plan, int segment);
// Whether any segment of the plan does.
bool any_spanning(const Plan& plan);

// One rank's part in handing segment `from`'s boundary tensor to segment `to` (the forward's
// output to the next segment, or the backward's input gradient to the previous one), as the
// compiled program does: a rank holding both keeps it (`local`); a rank holding `to` but not
// `from` receives it from `from`'s first order (`recv_from`); a rank of `from`'s first order
// sends it to the ranks of `to`'s orders that do not hold `from` (`send_to`). Ranks are those
// of the same tensor-, context- and data-parallel coordinates.
struct TransferEnds {
  bool local = false;
  int recv_from = -1;
  std::vector<int> send_to;
};
TransferEnds transfer_ends(const Plan& plan, int rank, int from, int to);

// The vocabulary split of `op` (embed.word, head.proj) as rank `rank` holds it.
struct VocabSplit {
  // Partial sums reduced axis by axis (the program converts one mesh axis at a time, in mesh
  // order): each axis of size > 1 the vocabulary is split along, with its group (ranks in
  // order), its name and whether it is a pipeline axis. Without a pipeline axis, one entry:
  // the whole tensor-parallel group (as the executor reduces tensor-parallel partial sums).
  struct Axis {
    std::vector<int> group;
    std::string name;
    bool pipeline = false;
  };
  std::vector<Axis> per_axis;
  // All the axes together (the loss's statistics: the program's internal all-reduces).
  std::vector<int> group;
  std::string axes;
  bool pipeline = false;  // split along a pipeline axis too
  int ways = 1;           // vocabulary shards
  int index = -1;         // this rank's shard; -1: the rank's place in the tensor-parallel group
};
// `tp_group` and `tp_axes`: the executor's tensor-parallel group and its name, for splits
// without a pipeline axis.
VocabSplit vocab_split(const Plan& plan, int rank, const std::string& op,
                       const std::vector<int>& tp_group, const std::string& tp_axes);

// What the executor cannot run yet with a spanning segment: the plan field and why, or nothing.
// For plans with one (any_spanning).
struct Refusal {
  std::string field, why;
};
std::optional<Refusal> check_spanning_runnable(const Plan& plan);

}  // namespace nnsim::hwexec
