// One rank's groups and collectives in `nnexec run` (docs/hwexec.md), internal to the LibTorch
// executor (run_torch.cc): the tensor-, data-, context- and expert-parallel groups this rank
// belongs to, the collectives over them and the pipeline's point-to-point transfers, each
// recorded in RunStats under the compiled program's kind, axes and label. Groups of one rank
// (the unpartitioned reference) do nothing. On the CPU the socket Comm carries them; with
// `nccl` set (a GPU), NCCL, on the compute stream (sends: on the peer's send stream, after the
// compute stream's work so far).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/plan.h"
#include "hwexec/comm.h"
#include "hwexec/run_spanning.h"
#include "hwexec/run_stats.h"

namespace nnsim::hwexec {

class NcclComms;

struct RankContext {
  Comm* comm = nullptr;
  RunStats* stats = nullptr;
  NcclComms* nccl = nullptr;  // a GPU run's communicators; null on the CPU
  at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
  std::vector<int> tp_group{0}, dp_group{0};
  std::string tp_axes = "tp", pp_axes = "pp";
  // The gradient sums' group is dp's, and cp's with context parallelism (`dp_axes`); the cp
  // ring's group and this rank's neighbours in it.
  std::string dp_axes = kDataParallelAxis;
  std::vector<int> cp_group{0};
  std::string cp_axes = "cp";
  int cp_next = -1, cp_prev = -1;
  int tp_index = 0;
  // Expert parallelism: the ranks that split the experts (and the batch of the rest); with the
  // experts folded over tensor-parallel axes too (--etp 1), one group an axis of them, in mesh
  // order (the routed copies travel axis by axis).
  std::vector<int> ep_group{0};
  std::string ep_axes = "ep";
  struct AxisGroup {
    std::vector<int> ranks;
    std::string axis;
    int index = 0;  // this rank's place
  };
  std::vector<AxisGroup> ep_stages;
  std::vector<at::Tensor> in_flight;  // sent tensors, kept until the iteration's synchronize
  bool has_nccl() const { return nccl != nullptr; }
  // The socket Comm's channel of point-to-point transfers (pipeline, cp ring): apart from the
  // collectives', whose messages may pass between the same two ranks in between (a segment
  // spanning the pipeline stages all-reduces over pp).
  static constexpr int kPointToPoint = 1;

  // In place (fp32, bf16 or fp16; 16-bit values travel as 2 bytes).
  void all_reduce(at::Tensor& t, const std::vector<int>& group, const std::string& axes,
                  const std::string& label, Comm::Op op = Comm::Op::kSum);
  // All-to-all over the expert-parallel group of `in`'s rows (any dtype): send_rows[i] rows to
  // member i, recv_rows[i] rows from it, each member's in group order. Recorded with `bytes`.
  at::Tensor all_to_all(const at::Tensor& in, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows, const std::string& label,
                        double bytes);
  // send_rows[i] of `in`'s rows (any dtype) to member i of `group`, recv_rows[i] from it;
  // recorded as an all-to-all of `bytes` over `axes` (`record` false: metadata, not recorded).
  at::Tensor all_to_all_over(const std::vector<int>& group, const std::string& axes,
                             const at::Tensor& in, const std::vector<int64_t>& send_rows,
                             const std::vector<int64_t>& recv_rows, const std::string& label,
                             double bytes, bool record = true);
  // All-gather of `in`'s rows from members holding different numbers of them (recv_rows[i]
  // from member i, in group order; an all-gather-v, as Megatron-Core's gather of the routed
  // copies over tp), recorded as an all-gather of `bytes`.
  at::Tensor all_gather_rows(const at::Tensor& in, const std::vector<int>& group,
                             const std::string& axes, const std::string& label,
                             const std::vector<int64_t>& recv_rows, double bytes);
  // The routed copies' counts (`per` integers to each member of `group`, in group order): what
  // each member sends this rank. Not recorded (metadata; the program moves the copies only).
  std::vector<int64_t> exchange_counts(const std::vector<int>& group,
                                       const std::vector<int64_t>& send, int64_t per);
  // All-gather (fp32 or bf16): `in` (n elements) from each member of `group`, in group
  // order; bytes recorded as the gathered output (nccl-tests' convention, the program's).
  at::Tensor all_gather(const at::Tensor& in, const std::vector<int>& group,
                        const std::string& axes, const std::string& label);
  // Reduce-scatter (sum; fp32 or bf16) of `in` (group size x n elements): this rank's n-element
  // chunk of the sum; bytes recorded as the input.
  at::Tensor reduce_scatter(const at::Tensor& in, const std::vector<int>& group,
                            const std::string& axes, const std::string& label);

  // ZeRO-3: before parameter unit `u` (forward order: the embedding, each layer, the head) runs
  // its forward or its backward, and after its backward. Unset: nothing to do.
  std::function<void(int, bool)> before_unit;
  std::function<void(int)> after_unit_backward;
  void unit_before(int u, bool backward) {
    if (before_unit) before_unit(u, backward);
  }
  void unit_after_backward(int u) {
    if (after_unit_backward) after_unit_backward(u);
  }
  // ZeRO-3 tensor by tensor (DeepSpeed's prefetch, comm.zero3_prefetch_elements): before
  // operator `op` of unit `u` runs its forward (`recompute`: inside the backward) or its
  // backward. Unset: nothing to do.
  std::function<void(int, const std::string&, bool)> before_op;
  void op_before(int u, const std::string& op, bool recompute) {
    if (before_op) before_op(u, op, recompute);
  }
  void tp_all_reduce(at::Tensor& t, const std::string& label, Comm::Op op = Comm::Op::kSum) {
    all_reduce(t, tp_group, tp_axes, label, op);
  }
  // The vocabulary-parallel operators' groups (embed.word's, head.proj's and the loss's): the
  // tensor-parallel group, or with the pipeline axes too where their segment spans the stages
  // (run_spanning.h). Partial sums are reduced axis by axis (`label_of` names each reduction),
  // the loss's statistics over the whole group.
  VocabSplit embed_vocab, head_vocab;
  void vocab_reduce(const VocabSplit& v, at::Tensor& t,
                    const std::function<std::string(const VocabSplit::Axis&)>& label_of) {
    for (const VocabSplit::Axis& a : v.per_axis) all_reduce(t, a.group, a.name, label_of(a));
  }
  void vocab_all_reduce(const VocabSplit& v, at::Tensor& t, const std::string& label,
                        Comm::Op op = Comm::Op::kSum) {
    all_reduce(t, v.group, v.axes, label, op);
  }

  // `record` false: not a transfer of the plan (an interleaved transfer's header).
  void send(int peer, const at::Tensor& t, const std::string& label, bool record = true);
  at::Tensor recv(int peer, at::IntArrayRef shape, const std::string& label, bool record = true,
                  at::ScalarType dtype = at::kFloat, bool compute_dtype = true);
  // Interleaved pipelines: two ranks exchange the transfers of several segments, and one may
  // send them in another order than the other receives them. Each transfer follows a header
  // holding its tag; a receive keeps the transfers that arrive before the one it waits for.
  std::map<std::pair<int, int64_t>, at::Tensor> early;  // (peer, tag) -> transfer
  // A transfer's tag: bit 0 a gradient, bit 1 a recycled output (repeated forwards), then the
  // segment it goes into, the micro-batch and the receiving forward's pass. A transfer that
  // arrives early is recorded under its own label (from its tag).
  static int64_t transfer_tag(bool gradient, bool recycled, int to, int micro_batch, int pass) {
    return (gradient ? 1 : 0) + (recycled ? 2 : 0) + 4 * (to + 1000 * int64_t{micro_batch}) +
           (int64_t{pass} << 40);
  }
  void send_tagged(int peer, const at::Tensor& t, const std::string& label, int64_t tag);
  at::Tensor recv_tagged(int peer, at::IntArrayRef shape, int64_t tag);

 private:
  // send_rows[i] of `in`'s rows to member i of `group`, recv_rows[i] from it (in group order),
  // recorded as a `kind` of `bytes` (null: not recorded).
  at::Tensor exchange_rows(const std::vector<int>& group, const std::string& axes, const char* kind,
                           const at::Tensor& in, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, const std::string& label,
                           double bytes);
};

}  // namespace nnsim::hwexec
