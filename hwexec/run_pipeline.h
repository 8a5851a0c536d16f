// One rank's pipeline transfers in `nnexec run` (docs/hwexec.md), internal to the LibTorch
// executor (run_torch.cc): a segment's input activations and output gradients, to and from the
// ranks of its neighbouring segments, as the compiled program moves them. Tagged where a rank's
// peer may send them in another order than it receives them (interleaved and V-shaped
// placements, repeated forwards, spanning segments: RankContext::send_tagged); sent as the
// rank's 1/tp slice of a tensor replicated over tp and all-gathered on arrival (Megatron's
// scatter-gather, comm.pp_scatter_gather); kept in memory between two segments of one rank;
// repeated forwards' recycled outputs (training.recycle) from the last segment to the first.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/plan.h"
#include "hwexec/run_context.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_spanning.h"

namespace nnsim::hwexec {

class PipelineTransfers {
 public:
  PipelineTransfers(const Plan& plan, int rank, const RankLayout& layout, RankContext& ctx);

  // The ranks this rank sends to or receives from (not itself), for NCCL's communicators.
  std::vector<int> peers() const;
  // Forgets what the last iteration left in memory.
  void start_iteration();

  // The input of segment `sg`'s forward of micro-batch `m` (pass `pass`), from the segment
  // before it: [b, s / sp / cp, h].
  at::Tensor receive_activation(int sg, int m, int pass);
  // Segment `sg`'s output, to the segment after it; freed once sent, as Megatron frees a stage's
  // output (deallocate_pipeline_outputs): only the root of its backward stays.
  void send_activation(int sg, int m, int pass, const at::Tensor& y);
  // The gradient of segment `sg`'s output, from the segment after it.
  at::Tensor receive_gradient(int sg, int m, int pass);
  // The gradient of segment `sg`'s input, to the segment before it.
  void send_gradient(int sg, int m, int pass, const at::Tensor& dx);
  // Repeated forwards: the first segment's input in pass `pass` > 0, the last segment's output
  // of the pass before; and the last segment's output of an earlier pass, to the first
  // segment's ranks (kept where this rank runs the first segment too).
  at::Tensor receive_recycled(int sg, int m, int pass);
  void send_recycled(int m, int pass, const at::Tensor& y);

 private:
  // A transfer to or from `peer`, sliced over tp where the program slices it.
  void send(int peer, const at::Tensor& t, const char* label, int64_t tag);
  at::Tensor recv(int peer, const char* label, int64_t tag);
  // Spanning segments: a transfer into segment `sg` (is a `gradient`) of micro-batch `m`,
  // received or taken from this rank's own neighbouring segment; one out of `sg` into `to`,
  // sent to the ranks that need it and kept where this rank runs `to` too.
  at::Tensor span_recv(int sg, bool gradient, int m, int64_t tag);
  void span_send(int sg, bool gradient, int m, const at::Tensor& t, int to, int64_t tag);

  const Plan& plan_;
  int rank_;
  const RankLayout& layout_;
  RankContext& ctx_;
  std::vector<int64_t> shape_;  // [b, s / sp / cp, h]
  // Per segment of the rank: the ranks its input comes from and its output goes to.
  std::map<int, std::pair<int, int>> peers_;
  // Segments spanning the pipeline stages (--shard-head, --shard-embedding): every transfer
  // between neighbouring segments as the program moves it (run_spanning.h), in memory where
  // this rank holds both; per (segment, is a gradient), into the segment and out of it.
  bool spanning_ = false;
  std::map<std::pair<int, bool>, TransferEnds> ends_in_, ends_out_;
  std::map<std::tuple<bool, int, int>, at::Tensor> handoff_;  // (gradient, segment, micro-batch)
  // Sequence parallelism without a position table or dropout: the first stage hands a spanning
  // embedding the gradient of its whole sequence (its layer 0 gathers it), which the other
  // stages' embeddings receive as a slice and all-gather over tp (the program's scatter-gather).
  bool whole_embedding_grad_ = false;
  // Transfers matched by their tags rather than their order.
  bool tagged_ = false;
  // Megatron's scatter-gather: the rank's slice of `numel_` elements, one of `tp_` (a hand-off
  // between two segments of this rank, ZB-V's turn, stays whole in memory: the program has no
  // transfer, so no slice and no gather either).
  bool sliced_ = false;
  int64_t tp_ = 1, numel_ = 0;
  // Repeated forwards: the first and last segments in pipeline order, where this rank's first
  // segment's recycled input comes from and where its last segment's output goes (itself:
  // kept in `recycled_`, per micro-batch).
  int first_segment_ = -1, last_segment_ = -1;
  int recycle_from_ = -1;
  std::vector<int> recycle_to_;
  std::map<int, at::Tensor> recycled_;
};

}  // namespace nnsim::hwexec
