// The plan as one rank of `nnexec run` sees it (docs/hwexec.md): how its operators are split
// (tensor, sequence, context and expert parallelism), along which mesh axes, which segments its
// schedule order runs and their neighbours in pipeline order. No LibTorch: plain plan geometry,
// read by the executor (run_torch.cc) and its model parts (run_model.h).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/plan.h"

namespace nnsim::hwexec {

// How this rank's operators are split: the tensor-parallel degrees of the head groups, the MLP
// and the two vocabulary matrices (1: whole on every tp rank), and the sequence, context and
// expert splits.
struct Split {
  int heads = 1, ffn = 1, embed_vocab = 1, head_vocab = 1;
  // A mixture of experts' routed experts and shared expert, split along their width like the
  // MLP (Megatron-Core's expert tensor parallelism at the tensor-parallel degree).
  int expert_ffn = 1, shared_ffn = 1;
  // Sequence parallelism: `seq` ranks (the tensor-parallel group) each hold a slice of the
  // sequence between the column- and row-parallel linears (Megatron-LM's).
  int seq = 1;
  // The column-parallel linears keep their gathered input for the backward instead of dropping
  // it and gathering it again (communication.save_gathered_inputs: PyTorch's DTensor).
  bool save_gathered = false;
  // Context parallelism: `cp` ranks each hold the tokens at cp_positions(seq_len, cp, cp_index)
  // of every sequence, through every operator.
  int cp = 1, cp_index = 0;
  // Expert parallelism: `ep` ranks each hold experts / ep of the routed experts (the
  // ep_index-th run of them), and `batch_ep` of them (the axes also splitting the batch: all of
  // them, or without tensor-parallel axes when the experts are folded over those too, --etp 1)
  // micro_batch / batch_ep of each micro-batch's sequences (the batch_ep_index-th share).
  int ep = 1, ep_index = 0, batch_ep = 1, batch_ep_index = 0;
  // The rank's vocabulary shard of embed.word and head.proj when they are split along the
  // pipeline axes too (run_spanning.h); -1: its place in the tensor-parallel group.
  int embed_vocab_index = -1, head_vocab_index = -1;
};

// The plan as this rank sees it.
struct RankLayout {
  Split split;
  // ep_axes: the routed experts' split (in mesh order); batch_axes: the batch's.
  std::vector<std::string> tp_axes, pp_axes, cp_axes, ep_axes, batch_axes;
  // The segments this rank's order runs (several: an interleaved pipeline), in the order they
  // first appear, and each one's neighbours in pipeline order (-1: none).
  std::vector<int> segments;
  std::map<int, std::pair<int, int>> neighbours;
  const DeviceOrder* order = nullptr;
};

RankLayout layout_of(const Plan& plan, int rank);

// The axes of operator `op`'s split along `dim` (the last matching rule's; none: unsplit).
std::vector<std::string> split_axes(const Plan& plan, const std::string& op, Dim dim);

// Whether the rank at `coords` lies in `slice` (a segment's or an order's devices).
bool in_slice(const Mesh& mesh, const MeshSlice& slice, const std::vector<int>& coords);

// The rank of `rank`'s coordinates with `seg`'s device coordinates (its pipeline stage): the
// rank running `seg` beside it.
int peer_in(const Mesh& mesh, int rank, const Segment& seg);

// The data-parallel axis and `more` (those also splitting the batch or the sequence), in the
// mesh's order: the axes a gradient sums over.
std::vector<std::string> data_parallel_with(const Mesh& mesh, const std::vector<std::string>& more);

// Axes as the run file names a group: joined with '+' ("dp+cp"), "none" for no axes.
std::string axes_name(const std::vector<std::string>& axes);

}  // namespace nnsim::hwexec
