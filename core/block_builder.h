// One block template (Compiler::build_template): the steps of a segment's forward, explicit
// recomputation or backward on one lane. Its parts run in order (embedding, layers, head; the
// reverse in a backward) between the pipeline transfers, with ZeRO's parameter gathers and
// gradient reductions around them and the block's activation memory. Internal to the plan
// compiler (core/compiler.h).
#pragma once

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "core/compiler.h"

namespace nnsim::detail {

class BlockBuilder {
 public:
  BlockBuilder(Compiler& c, BlockTemplate& t, bool grad_sync, bool explicit_recompute,
               bool first_forward);
  ~BlockBuilder();  // uninstalls the compiler's before_op hook
  BlockBuilder(const BlockBuilder&) = delete;
  BlockBuilder& operator=(const BlockBuilder&) = delete;

  // Fills the template's steps, kept and peak bytes.
  void build();

 private:
  // A unit of ZeRO-3's gathers (the embedding, one layer, the head). Its gradients are reduced
  // as `reduce_params` (`reduce_tensors`), which leave out a tied output projection's matrix
  // when the embedding on the same devices owns it.
  struct ParamUnit {
    int tag;
    double params;
    const std::vector<double>* tensors;
    double reduce_params;
    const std::vector<double>* reduce_tensors;
    std::array<double, kNumGradGroups> group_params;  // reduce_params by GradGroup
  };
  // Elements and the GradGroup whose shard group gathers or reduces them.
  using Piece = std::pair<double, int>;
  // Fine-grained offloading: what one operator saves, copied to the host as one group.
  struct ModuleGroup {
    size_t op;
    double bytes;
  };

  // What the segment's forward keeps per micro-batch, by part, and of it what a split
  // backward's weight half needs (`*_weight_inputs`).
  struct Activations {
    double kept = 0, kept_weight_inputs = 0;
    double kept_layers = 0, layers_weight_inputs = 0;
    double kept_head = 0, head_weight_inputs = 0;
    double transient = 0;  // the largest transient of a part
    // Activation offloading: what each of the segment's layers keeps, and of it the offloaded
    // layers' (Plan::activation_offload_layers; empty and 0 without).
    std::vector<double> layer_kept;
    double offloaded = 0;
    // Fine-grained offloading (Plan::activation_offload_modules): per layer of the segment, the
    // chosen operators whose saved tensors go to the host, forward order, and their sum.
    std::vector<std::vector<ModuleGroup>> module_groups;
    std::vector<double> layer_offloaded;
  };

  void forward();
  void recompute();
  void backward();

  // Layouts of the tensors between parts and segments.
  const TensorLayout& layer_in(int l) const { return l == 0 ? embed_boundary_ : layer_out_; }
  const TensorLayout& layer_in_grad(int l) const {
    return l == 0 ? embed_out_grad_ : layer_out_grad_;
  }
  TensorLayout handed_back(int segment) const;

  // Pipeline transfers and memory steps.
  double transfer_bytes(const TensorLayout& layout, uint32_t* gather_axes) const;
  int transfer(StepKind kind, int peer, int peer_lane, bool gradient, const TensorLayout& layout,
               bool recycled, uint32_t* gather);
  void recv(int peer, int peer_lane, bool gradient, const TensorLayout& layout,
            bool recycled = false);
  void send(int peer, int peer_lane, bool gradient, const TensorLayout& layout,
            bool recycled = false);
  void memory(double bytes);

  // ZeRO-3's units and their gathers.
  void collect_units();
  std::vector<Piece> by_groups(double whole, const ParamUnit& u) const;
  std::vector<Piece> pieces(const ParamUnit& u) const;
  std::vector<Piece> reduce_pieces(const ParamUnit& u) const;
  void gather(const ParamUnit& u);
  bool regather(const ParamUnit& u) const;
  // Before unit `i` of `order` runs: its gather (and the next unit's, prefetched) and the wait.
  void zero3_before(const std::vector<ParamUnit>& order, size_t i);
  // DeepSpeed's prefetch (comm.zero3_prefetch_elements): installs the compiler's before_op hook.
  void install_tensor_prefetch();

  // Activation offloading: after layer `i` (of the segment) ran its forward, the copies to the
  // host its end starts and waits for; before layer `i`'s backward, those back.
  void offload_after_forward(int i);
  void reload_before_backward(int i);
  void host_copy(int group, bool to_host);
  void host_copy_wait(bool to_host);
  // Both forms' steps: a copy of `bytes` on the lane's stream to the host (or back), and a wait
  // for every copy queued on it but the last `still_running` (-1: every one).
  Step copy_step(double bytes, bool to_host) const;
  Step copy_wait_step(bool to_host, int still_running) const;

  // Fine-grained offloading (core/compile_module_offload.cc): the groups of layer `l`; after
  // layer `i`'s forward (its steps from `start`), each group's copy to the host and the wait
  // for the layer before's; in layer `i`'s backward, each group's reload one group ahead.
  std::vector<ModuleGroup> module_groups(const PartInfo& p, int l,
                                         const std::vector<bool>& recomputed) const;
  void offload_modules_forward(int i, size_t start);
  void reload_first_module();
  void reload_modules_backward(int i, size_t start);
  double module_forward_peak() const;
  double module_backward_peak(bool recompute_inside) const;

  Activations activations() const;
  // The forward's peak above the block's start: each part's transient on what it and the parts
  // before it keep.
  double forward_peak() const;
  // The backward's peak: its parts free their activations one after another.
  double backward_peak(bool input_half, bool recompute_inside) const;
  // The same with activation offloading (no recomputation, whole backwards): an offloaded
  // layer's activations stay until its window's last forward has run, and come back at its
  // window's first backward.
  double offload_forward_peak() const;
  double offload_backward_peak() const;

  Compiler& c_;
  const Plan& plan_;
  BlockTemplate& t_;
  std::vector<Step>* steps_;
  const bool grad_sync_, explicit_recompute_, first_forward_;
  const int seg_;
  const Segment& s_;
  const int zero_;
  const bool tensor_prefetch_;

  TensorLayout embed_out_, layer_out_;
  // The embedding's output as the next part reads it. A vocabulary split over axes outside the
  // lane (the embedding sharded over pipeline stages) leaves partial sums that only the lanes
  // holding the shards can add: the embedding's segment all-reduces them before handing on.
  TensorLayout embed_boundary_;
  TensorLayout segment_out_;  // what the segment hands to the next one
  // The layout the producer of a part's input needs that input's gradient in.
  TensorLayout embed_out_grad_, layer_out_grad_;

  // Transfers: a lane receives what a neighbouring segment does not compute on it, from that
  // segment's sending lane, and sends to the neighbour's lanes it is the source for.
  int prev_ = -1, next_ = -1;
  int recv_prev_lane_ = -1, recv_next_lane_ = -1;
  std::vector<int> send_next_lanes_, send_prev_lanes_;
  double act_piece_ = 0;  // a device's piece of the hidden state the segment receives

  std::vector<ParamUnit> units_;           // forward order
  std::vector<ParamUnit> backward_units_;  // backward order
  size_t next_unit_ = 0;
  std::vector<double> head_untied_tensors_;
  double grad_bytes_ = 0;  // bytes per element of gradient reductions

  // DeepSpeed's prefetch: the block's gathers in the order its operators use them.
  std::vector<TensorGather> queue_;
  std::vector<TensorUse> uses_;
  size_t next_use_ = 0, launched_ = 0;

  Activations act_;
  // Activation offloading: each offloaded layer's window end (activation_offload_windows), and
  // how many layers' copies the forward has waited for (the backward: not yet reloaded).
  std::vector<int> offload_window_;
  int offload_count_ = 0;
  // Fine-grained offloading: on, the groups' bytes in backward order, and the next to reload.
  const bool module_offload_;
  std::vector<double> reload_order_;
  size_t reloaded_ = 0;
};

}  // namespace nnsim::detail
