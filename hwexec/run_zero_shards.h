// ZeRO 1-3 for one rank of `nnexec run` (docs/hwexec.md), internal to the LibTorch executor
// (run_torch.cc): the rank's parameters in units laid out over their gradients' group
// (run_zero_layout.h), this rank's chunk of each (the fp32 master values, Adam's moments and the
// reduce-scattered gradient sum), and when the gradients are reduce-scattered and the parameters
// all-gathered and released: ZeRO-1 and 2 per segment, ZeRO-3 unit by unit (FSDP, Megatron) or
// tensor by tensor with DeepSpeed's prefetch and reduce bucket, as the compiled program decides
// (run_zero3.h, core/program.h). Also the tied word matrix's two copies, whose gradients are
// summed whole or, under ZeRO 2-3, chunk by chunk.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/opgraph.h"
#include "core/plan.h"
#include "hwexec/run_context.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_model.h"
#include "hwexec/run_zero3.h"
#include "hwexec/run_zero_layout.h"

namespace nnsim::hwexec {

// The model parts of one rank, per segment.
using ModelParts = std::map<int, std::unique_ptr<Model>>;

// A parameter's gradient, or zeros where none arrived.
at::Tensor grad_or_zeros(const Param& p);

// The compiled program's label of segment `sg`'s gradient reductions: those in the backward
// blocks (overlapped, and always for ZeRO-3) carry the segment's name.
std::string grad_sync_label(const Plan& plan, int sg);

// A unit of parameters (ZeRO-1/2: all of the segment's, with expert parallelism its routed
// experts' apart; ZeRO-3: the embedding's, each layer's, the head's, or each tensor on its own)
// laid out over its gradients' group; this rank owns one chunk (its place in the group).
struct ZeroUnit {
  std::vector<Param*> params;
  // The group its gradients sum over and its chunks spread over (dp, with cp or ep; a routed
  // expert's: dp alone), its axes' names and this rank's place in it.
  std::vector<int> group;
  std::string axes;
  int pos = 0;
  int members() const { return static_cast<int>(group.size()); }
  ZeroLayout layout;
  int tied_part = -1;  // the layout's part of a tied word matrix copy on two stages (ZeRO 2-3)
  // ZeRO-3 (whole units) on a V-shaped placement: the embedding's unit whose tied_part, the word
  // matrix `tied_word`, this head's unit gathers with its own values in one all-gather (the
  // program's head unit gathers the tied matrix again, and reduces only its own).
  const ZeroUnit* gathers_with = nullptr;
  Param* tied_word = nullptr;
  // ZeRO-3 tensor by tensor: a tensor under comm.zero3_persistence_threshold stays whole on
  // every rank (never gathered nor released); its updated chunks are gathered after the step.
  bool persistent = false;
  at::Tensor master, m, v, grad;

  // `get` of each parameter in the layout's order: dp x chunk elements.
  template <class F>
  at::Tensor flat(F get) const {
    std::vector<at::Tensor> ts;
    for (const Param* p : params) ts.push_back(get(*p));
    return layout.flatten(ts);
  }
};

class ZeroShards {
 public:
  // Every rank of a unit's group starts from the same weights and keeps its chunk. `dtype`: what
  // the operators compute in; `reduce_dtype`: the gradients' reductions'; `expert_group` and
  // `expert_axes`: a routed expert's gradient group under expert parallelism. ZeRO-3 starts
  // with every unit released.
  ZeroShards(const Plan& plan, int rank, const RankLayout& layout, ModelParts& models,
             RankContext& ctx, at::ScalarType dtype, at::ScalarType reduce_dtype,
             std::vector<int> expert_group, std::string expert_axes);
  ZeroShards(const ZeroShards&) = delete;  // its hooks on the context point to it
  ZeroShards& operator=(const ZeroShards&) = delete;

  int level() const { return zero_; }
  // Every unit (none without ZeRO), segment by segment.
  const std::vector<ZeroUnit*>& units() const { return units_; }

  // Before block `i` of the rank's order (of segment `sg`) runs: ZeRO-3's gathers and
  // reductions, as hooks on the context (whole units: before_unit, after_unit_backward; tensor
  // by tensor: before_op).
  void before_block(std::size_t i, int sg);
  // After it: ZeRO-3's gathers no operator asked for, the waiting reduce bucket, and the
  // segment's units released (between blocks none stays gathered).
  void after_block(int sg);
  // After a block computing segment `sg`'s weight gradients (B, or a split backward's BW) of
  // micro-batch `m`: ZeRO-2 reduces them, ZeRO-1 after the segment's last such block (the
  // program's grad sync blocks); ZeRO-3 has, unit by unit, inside the backward.
  void after_weight_gradients(int sg, int m);
  // The iteration's end, once every block has run: ZeRO-1's segments holding a tied copy sum
  // its whole gradients, then reduce (their partner reaches its end only after this stage's
  // later blocks, which must not wait for it).
  void finish_tied_zero1();
  // Tied embeddings on two stages: the embedding's matrix and the head's copy hold the
  // gradients of their own uses, summed between the first and the last stage (the ranks of the
  // same other coordinates), so both copies take the same step (the program's epilogue: "tied
  // embedding grad sync"). Without ZeRO the whole gradients, after the data-parallel sums; under
  // ZeRO 2-3, whose reduce-scatters leave only this rank's chunk, the matrix's chunk (chunked
  // alike on both stages) once every micro-batch is reduced, as Megatron sums its shared
  // embedding's bucket after the data-parallel reduce-scatter. ZeRO-1: finish_tied_zero1.
  void tied_sync(int sg);
  // After the optimizer's step on the chunks: ZeRO-1/2's updated chunks gathered into whole
  // weights (the program launches this gather after the step and waits for it before each
  // unit's first forward); ZeRO-3's persistent tensors' in one all-gather (DeepSpeed's, as the
  // program's epilogue). ZeRO-3 gathers the rest unit by unit in the next iteration's blocks.
  void gather_after_step();

 private:
  // A segment holding one of two copies of a tied word matrix (the embedding's, or the head's
  // on another stage).
  bool tied_copy(int sg) const;
  // The tensors a unit's gather writes: its parameters, and a V-shaped head's tied matrix.
  static std::vector<Param*> gather_targets(const ZeroUnit& u);
  // A parameter's gathered values: the weights, and their bf16 copy when it has its own
  // storage. In a 16-bit plan the operators read the gathered copy in the compute dtype; the
  // fp32 weights of a resharded unit are gathered only where an operator reads them
  // (Model::fp32_reads).
  bool gathers_fp32(const Param& p) const;
  std::vector<at::Tensor> gathered_storage(const Param& p) const;
  // ZeRO-3 frees a unit's gathered weights once the unit has run (FSDP's reshard, DeepSpeed's
  // release) and allocates them again for its next gather.
  void release_unit(const ZeroUnit& u);
  void release_segment(int sg);
  // The master chunks all-gathered into the parameters the operators use.
  void gather_unit(const ZeroUnit& u);
  // ZeRO-3's persistent tensors after the step: every unit's updated chunk in one all-gather,
  // written into its whole weights (and their compute-dtype copies).
  void gather_persistent(const std::vector<const ZeroUnit*>& units);
  // The unit's gradients so far reduce-scattered into its chunk, then dropped.
  void reduce_unit(ZeroUnit& u, const std::string& label);
  // DeepSpeed's reduce bucket (comm.zero3_reduce_bucket): per-tensor units' gradients wait and
  // are reduce-scattered together, every rank's chunks of them side by side in its share, when
  // the next unit would overflow the bucket and when the backward block ends.
  void reduce_waiting();
  void reduce_or_wait(ZeroUnit& u, const std::string& label);
  // The operator of unit `unit` of segment `sg` a parameter belongs to (a head's copy of a tied
  // word matrix: the head's projection).
  std::string op_of(int sg, int unit, const Param& p) const;
  // Each ZeroUnit of parameter unit `u` of segment `sg`.
  template <class F>
  void each(int sg, int u, F f) {
    const auto [first, end] = ranges_of_.at(sg).at(u);
    for (std::size_t k = first; k < end; ++k) f(units_of_.at(sg)[k]);
  }
  // DeepSpeed's tensor-grained prefetch: the queue's entries gathered up to `end`, and released
  // up to `end` but those gathered ahead again.
  void gather_through(std::size_t end);
  void release_through(std::size_t end);

  const Plan& plan_;
  int rank_;
  const RankLayout& layout_;
  ModelParts& models_;
  RankContext& ctx_;
  at::ScalarType dtype_, reduce_dtype_;
  std::vector<int> expert_group_;
  std::string expert_axes_;
  int zero_;
  std::map<int, std::vector<ZeroUnit>> units_of_;  // per segment
  std::vector<ZeroUnit*> units_;                   // all of them
  // ZeRO-3: parameter unit u of a segment is its ZeroUnits [first, end) (one, or one a tensor).
  std::map<int, std::vector<std::pair<std::size_t, std::size_t>>> ranges_of_;
  // DeepSpeed's ZeRO-3: per segment holding a tied head on the embedding's ranks, the word
  // matrix's ZeroUnit (the embedding's), which the head's hooks gather again.
  std::map<int, const ZeroUnit*> tied_unit_of_;
  // A tied head in a segment of its own on this rank's embedding's ranks (V-shaped): one matrix.
  bool word_shared_ = false;
  // ZeRO-3 releases gathered units (a rank holds the unit in use and the one prefetched, as the
  // simulator counts: docs/cost-model.md, "Memory"); not when the plan keeps them gathered, nor
  // with explicit recompute blocks, which run on the backward's gathers.
  bool reshard_ = false;
  std::set<const Param*> fp32_read_;
  // FSDP's root unit: a tied head in the embedding's segment reads the embedding unit's matrix,
  // which stays gathered (DeepSpeed's hooks gather it again instead).
  std::set<const ZeroUnit*> pinned_;
  // With split backwards, ZeRO-2's reduce after a BW may find no new gradient of a parameter
  // whose gradient BI computes (a norm's, when no BI ran since the last reduce): zeros.
  bool split_backward_ = false;
  std::vector<ZeroUnit*> waiting_;  // the reduce bucket
  double waiting_elements_ = 0;
  std::string waiting_label_;
  // ZeRO-3, per block of the order (run_zero3.h).
  std::vector<Zero3Block> z3_;
  std::map<int, int> last_weights_;  // segment -> the micro-batch of its last B or BW
  // DeepSpeed's tensor-grained prefetch (comm.zero3_prefetch_elements), in the program's order
  // (core/program.h, zero3_uses and zero3_launch_through): a block's gathers in the order its
  // operators use the tensors; before an operator runs, its own and the next ones until that
  // many elements are gathered ahead of it; a tensor released once its operator has run (and
  // no gather ahead holds it). Whole units otherwise (before_unit).
  bool tensor_prefetch_ = false;
  OpGraph graph_;
  std::set<int> explicit_recompute_;  // segments with R blocks: the backward does not recompute
  struct TensorGather {
    int unit;
    std::string op;
    bool recompute;
    const ZeroUnit* zu;
  };
  std::vector<TensorGather> queue_;
  std::vector<double> queue_elements_;  // the queue's tensors' elements (this rank's, whole)
  std::size_t gathered_ = 0;            // entries [0, gathered_) gathered
  std::size_t released_ = 0;            // entries [0, released_) released (or needed ahead)
};

}  // namespace nnsim::hwexec
