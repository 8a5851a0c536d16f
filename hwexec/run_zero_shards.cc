#include "hwexec/run_zero_shards.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "core/program.h"

namespace nnsim::hwexec {

namespace {

// The operator a parameter belongs to: its name without the layer's prefix ("layers.3.") and
// the tensor's own name ("weight", "bias"): "attn.qkv", "embed.word".
std::string operator_of(const std::string& param) {
  std::string name = param;
  if (name.rfind("layers.", 0) == 0) name = name.substr(name.find('.', 7) + 1);
  return name.substr(0, name.rfind('.'));
}

}  // namespace

at::Tensor grad_or_zeros(const Param& p) {
  return p.w.grad().defined() ? p.w.grad() : at::zeros_like(p.w);
}

std::string grad_sync_label(const Plan& plan, int sg) {
  return plan.optimizer.zero == 3 || plan.comm.overlap_grad_reduce
             ? fmt::format("grad sync {}", plan.segments[sg].name)
             : std::string("grad sync");
}

ZeroShards::ZeroShards(const Plan& plan, int rank, const RankLayout& layout, ModelParts& models,
                       RankContext& ctx, at::ScalarType dtype, at::ScalarType reduce_dtype,
                       std::vector<int> expert_group, std::string expert_axes)
    : plan_(plan),
      rank_(rank),
      layout_(layout),
      models_(models),
      ctx_(ctx),
      dtype_(dtype),
      reduce_dtype_(reduce_dtype),
      expert_group_(std::move(expert_group)),
      expert_axes_(std::move(expert_axes)),
      zero_(plan.optimizer.zero),
      graph_(lower_model(plan.model, 1)) {
  for (const auto& [sg, model] : models_) word_shared_ = word_shared_ || model->shares_word();
  for (int sg : zero_ >= 1 ? layout_.segments : std::vector<int>{}) {
    std::vector<std::vector<Param*>> groups;
    if (zero_ == 3) {
      // DeepSpeed (comm.zero3_per_tensor) gathers and reduces each tensor of a unit on its own.
      for (std::vector<Param*>& g : models_[sg]->units()) {
        ranges_of_[sg].emplace_back(groups.size(), 0);
        if (plan_.comm.zero3_per_tensor) {
          for (Param* p : g) groups.push_back({p});
        } else if (layout_.split.ep > 1) {
          // Expert parallelism: a layer's routed experts gather and reduce over their own
          // group, the rest of it over dp and ep (FSDP's unit per group, as the program's).
          std::vector<Param*> dense, experts;
          for (Param* p : g) (p->routed_expert ? experts : dense).push_back(p);
          for (std::vector<Param*>* part : {&dense, &experts}) {
            if (!part->empty()) groups.push_back(std::move(*part));
          }
        } else {
          groups.push_back(std::move(g));
        }
        ranges_of_[sg].back().second = groups.size();
      }
    } else {
      groups.emplace_back();
      std::vector<Param*> experts;  // expert parallelism: the routed experts' unit
      for (Param& p : models_[sg]->params()) {
        (layout_.split.ep > 1 && p.routed_expert ? experts : groups.back()).push_back(&p);
      }
      if (!experts.empty()) groups.push_back(std::move(experts));
    }
    std::vector<ZeroUnit>& segment_units = units_of_[sg];
    // ZeRO 2-3 sum a tied matrix's two copies chunk by chunk once their gradients are reduced
    // (tied_sync): the matrix is chunked on its own, alike on both stages. Whole ZeRO-3 units
    // on a V-shaped placement chunk it on its own too, for the head's unit to gather it.
    const bool own_part =
        (zero_ >= 2 && tied_copy(sg)) || (zero_ == 3 && !plan_.comm.zero3_per_tensor &&
                                          word_shared_ && models_[sg]->has_embedding());
    const Param* word = own_part ? models_[sg]->word_matrix() : nullptr;
    for (std::vector<Param*>& g : groups) {
      ZeroUnit u;
      u.params = std::move(g);
      const bool routed =
          !u.params.empty() && u.params.front()->routed_expert && layout_.split.ep > 1;
      u.group = routed ? expert_group_ : ctx_.dp_group;
      u.axes = routed ? expert_axes_ : ctx_.dp_axes;
      u.pos = static_cast<int>(std::find(u.group.begin(), u.group.end(), rank_) - u.group.begin());
      std::vector<int64_t> numels;
      std::vector<std::size_t> ends;
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        numels.push_back(u.params[i]->w.numel());
        if (u.params[i] != word) continue;
        if (i > (ends.empty() ? 0 : ends.back())) ends.push_back(i);
        u.tied_part = static_cast<int>(ends.size());
        ends.push_back(i + 1);
      }
      if (ends.empty() || ends.back() < u.params.size()) ends.push_back(u.params.size());
      int64_t elements = 0;
      for (int64_t n : numels) elements += n;
      u.persistent = zero_ == 3 && plan_.comm.zero3_per_tensor &&
                     static_cast<double>(elements) < plan_.comm.zero3_persistence_threshold;
      u.layout = ZeroLayout(std::move(numels), std::move(ends), u.members());
      const int64_t chunk = u.layout.chunk();
      u.master = u.flat([](const Param& p) { return p.w.detach(); })
                     .narrow(0, u.pos * chunk, chunk)
                     .clone();
      u.m = at::zeros_like(u.master);
      u.v = at::zeros_like(u.master);
      u.grad = at::zeros_like(u.master);
      segment_units.push_back(std::move(u));
    }
  }
  for (auto& [sg, us] : units_of_) {
    for (ZeroUnit& u : us) units_.push_back(&u);
  }
  // ZeRO-3: a tied head on the embedding's ranks gathers the embedding's matrix again for its
  // forward and backward (DeepSpeed's hooks fetch it for each module using it; FSDP's head unit
  // of another segment holds it too); reduced once, with the embedding's unit.
  for (int sg : zero_ == 3 && plan_.model.tied_embeddings ? layout_.segments : std::vector<int>{}) {
    Model& model = *models_.at(sg);
    if (!model.has_head() || !(model.has_embedding() || model.shares_word())) continue;
    Param* word = model.word_matrix();
    const ZeroUnit* holder = nullptr;
    for (const ZeroUnit* u : units_) {
      if (std::find(u->params.begin(), u->params.end(), word) != u->params.end()) holder = u;
    }
    if (plan_.comm.zero3_per_tensor) {
      tied_unit_of_[sg] = holder;
    } else if (model.shares_word()) {
      ZeroUnit& head_unit = units_of_.at(sg)[ranges_of_.at(sg).back().first];
      head_unit.gathers_with = holder;
      head_unit.tied_word = word;
    }
  }
  reshard_ = zero_ == 3 && !plan_.optimizer.keep_gathered;
  for (const Block& blk : layout_.order->blocks) {
    reshard_ = reshard_ && blk.kind != BlockKind::kRecompute;
    split_backward_ = split_backward_ || blk.kind == BlockKind::kBackwardWeight;
    if (blk.kind == BlockKind::kRecompute) explicit_recompute_.insert(blk.segment);
    if (blk.kind == BlockKind::kBackward || blk.kind == BlockKind::kBackwardWeight) {
      last_weights_[blk.segment] = blk.micro_batch;
    }
  }
  for (const auto& [sg, model] : models_) {
    for (const Param* p : model->fp32_reads()) fp32_read_.insert(p);
  }
  const bool root_unit = reshard_ && plan_.model.tied_embeddings && !plan_.comm.zero3_per_tensor;
  for (int sg : root_unit ? layout_.segments : std::vector<int>{}) {
    const Model& model = *models_.at(sg);
    if (!model.has_head() || !model.has_embedding()) continue;
    for (const ZeroUnit& u : units_of_.at(sg)) {
      if (std::find(u.params.begin(), u.params.end(), model.word_matrix()) != u.params.end()) {
        pinned_.insert(&u);
      }
    }
  }
  if (zero_ == 3) {
    z3_ = zero3_blocks(plan_, layout_.order->blocks, plan_.num_micro_batches());
  }
  tensor_prefetch_ = zero3_prefetches_tensors(plan_);
  for (int sg : zero_ == 3 ? layout_.segments : std::vector<int>{}) release_segment(sg);
  // The fp32 weights no operator reads: only their gradients are used.
  for (const ZeroUnit* u : reshard_ ? units_ : std::vector<ZeroUnit*>{}) {
    for (Param* p : gather_targets(*u)) {
      if (!gathers_fp32(*p) && p->w.storage().nbytes() > 0) resize_storage(p->w, 0);
    }
  }
}

bool ZeroShards::tied_copy(int sg) const {
  const Segment& seg = plan_.segments[sg];
  return plan_.model.tied_embeddings && seg.embedding != seg.head && !word_shared_ &&
         models_.at(sg)->word_matrix() != nullptr;
}

std::vector<Param*> ZeroShards::gather_targets(const ZeroUnit& u) {
  std::vector<Param*> targets = u.params;
  if (u.gathers_with) targets.push_back(u.tied_word);
  return targets;
}

bool ZeroShards::gathers_fp32(const Param& p) const {
  return !reshard_ || dtype_ == at::kFloat || fp32_read_.count(&p) > 0;
}

std::vector<at::Tensor> ZeroShards::gathered_storage(const Param& p) const {
  std::vector<at::Tensor> ts;
  if (gathers_fp32(p)) ts.push_back(p.w);
  if (p.c.defined() && !p.c.is_alias_of(p.w)) ts.push_back(p.c);
  return ts;
}

void ZeroShards::release_unit(const ZeroUnit& u) {
  if (!reshard_ || pinned_.count(&u) || u.persistent) return;
  for (Param* p : gather_targets(u)) {
    for (const at::Tensor& t : gathered_storage(*p)) resize_storage(t, 0);
  }
}

void ZeroShards::release_segment(int sg) {
  for (const ZeroUnit& u : units_of_.at(sg)) release_unit(u);
  if (tied_unit_of_.count(sg)) release_unit(*tied_unit_of_.at(sg));
}

// In bf16 plans the gather carries the bf16 weights the operators compute with (Megatron's
// distributed optimizer gathers the 16-bit model parameters; the program's bytes): the fp32
// master values stay in the chunks, and the operators' bf16 copies come out the same. ZeRO-3 in
// bf16 also writes the gathered values into the operators' bf16 copies, which keep their
// autograd link to the fp32 weights (no per-iteration cast: the cast is the chunk's).
void ZeroShards::gather_unit(const ZeroUnit& u) {
  if (u.persistent) return;
  for (Param* p : gather_targets(u)) {
    for (const at::Tensor& t : gathered_storage(*p)) {
      if (t.storage().nbytes() == 0) resize_storage(t, t.numel() * t.element_size());
    }
  }
  const ZeroUnit* with = u.gathers_with;
  const int64_t own = u.layout.chunk();
  const int64_t extra = with ? with->layout.part_chunk(with->tied_part) : 0;
  const at::Tensor send =
      with ? at::cat({u.master,
                      with->master.narrow(0, with->layout.part_offset(with->tied_part), extra)})
           : u.master;
  const at::Tensor full = ctx_.all_gather(dtype_ != at::kFloat ? send.to(dtype_) : send, u.group,
                                          u.axes, "param gather");
  c10::NoGradGuard no_grad;
  const at::Tensor rows = full.view({u.members(), own + extra});
  std::vector<at::Tensor> values =
      u.layout.unflatten(with ? rows.narrow(1, 0, own).reshape({-1}) : full);
  const std::vector<Param*> targets = gather_targets(u);
  if (with) {
    // The matrix's part: every rank's chunk of it, in rank order, then its padding.
    values.push_back(rows.narrow(1, own, extra).reshape({-1}).narrow(0, 0, u.tied_word->w.numel()));
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    Param* p = targets[i];
    const at::Tensor mine = values[i].view(p->w.sizes());
    // Not a version bump: ZeRO-3's backward gather writes weights its saved graphs hold.
    if (gathers_fp32(*p)) p->w.variable_data().copy_(mine);
    if (zero_ == 3 && dtype_ != at::kFloat) p->c.variable_data().copy_(mine);
  }
}

void ZeroShards::gather_persistent(const std::vector<const ZeroUnit*>& units) {
  std::vector<at::Tensor> chunks;
  int64_t row = 0;
  for (const ZeroUnit* u : units) {
    chunks.push_back(u->master);
    row += u->layout.chunk();
  }
  const at::Tensor send = at::cat(chunks);
  const at::Tensor full = ctx_.all_gather(dtype_ != at::kFloat ? send.to(dtype_) : send,
                                          ctx_.dp_group, ctx_.dp_axes, "param gather");
  c10::NoGradGuard no_grad;
  const at::Tensor rows = full.view({static_cast<int64_t>(ctx_.dp_group.size()), row});
  int64_t offset = 0;
  for (const ZeroUnit* u : units) {
    const int64_t chunk = u->layout.chunk();
    const std::vector<at::Tensor> values =
        u->layout.unflatten(rows.narrow(1, offset, chunk).reshape({-1}));
    offset += chunk;
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      Param* p = u->params[i];
      const at::Tensor mine = values[i].view(p->w.sizes());
      if (gathers_fp32(*p)) p->w.variable_data().copy_(mine);
      if (dtype_ != at::kFloat) p->c.variable_data().copy_(mine);
    }
  }
}

void ZeroShards::reduce_unit(ZeroUnit& u, const std::string& label) {
  for (Param* p : u.params) {
    if (!p->w.grad().defined() && !split_backward_) {
      throw RunFailure{fmt::format("no gradient reached {}", p->name)};
    }
  }
  const at::Tensor mine =
      ctx_.reduce_scatter(u.flat([](const Param& p) { return grad_or_zeros(p); }).to(reduce_dtype_),
                          u.group, u.axes, label);
  c10::NoGradGuard no_grad;
  u.grad.add_(mine);
  for (Param* p : u.params) p->w.mutable_grad() = at::Tensor();
}

void ZeroShards::reduce_waiting() {
  if (waiting_.empty()) return;
  std::vector<at::Tensor> rows;
  for (ZeroUnit* u : waiting_) {
    rows.push_back(u->flat([](const Param& p) { return grad_or_zeros(p); })
                       .to(reduce_dtype_)
                       .view({static_cast<int64_t>(ctx_.dp_group.size()), u->layout.chunk()}));
  }
  const at::Tensor mine = ctx_.reduce_scatter(at::cat(rows, 1).reshape({-1}), ctx_.dp_group,
                                              ctx_.dp_axes, waiting_label_);
  c10::NoGradGuard no_grad;
  int64_t offset = 0;
  for (ZeroUnit* u : waiting_) {
    u->grad.add_(mine.narrow(0, offset, u->layout.chunk()));
    offset += u->layout.chunk();
    for (Param* p : u->params) p->w.mutable_grad() = at::Tensor();
  }
  waiting_.clear();
  waiting_elements_ = 0;
}

void ZeroShards::reduce_or_wait(ZeroUnit& u, const std::string& label) {
  const double bucket = plan_.comm.zero3_reduce_bucket;
  if (!plan_.comm.zero3_per_tensor || bucket <= 0) return reduce_unit(u, label);
  for (Param* p : u.params) {
    if (!p->w.grad().defined() && !split_backward_) {
      throw RunFailure{fmt::format("no gradient reached {}", p->name)};
    }
  }
  double elements = 0;
  for (const Param* p : u.params) elements += static_cast<double>(p->w.numel());
  if (!waiting_.empty() && waiting_elements_ + elements > bucket) reduce_waiting();
  waiting_.push_back(&u);
  waiting_elements_ += elements;
  waiting_label_ = label;
}

std::string ZeroShards::op_of(int sg, int unit, const Param& p) const {
  const std::string op = operator_of(p.name);
  const Model& model = *models_.at(sg);
  return model.has_head() && unit == model.head_unit() && op == "embed.word" ? "head.proj" : op;
}

void ZeroShards::gather_through(std::size_t end) {
  for (; gathered_ < end; ++gathered_) gather_unit(*queue_[gathered_].zu);
}

void ZeroShards::release_through(std::size_t end) {
  for (; released_ < end; ++released_) {
    const ZeroUnit* zu = queue_[released_].zu;
    bool ahead = false;
    for (std::size_t k = end; k < gathered_; ++k) ahead = ahead || queue_[k].zu == zu;
    if (!ahead) release_unit(*zu);
  }
}

// As the program does (run_zero3.h): the first unit's gather, then each unit's gather launched
// before the previous unit runs (one unit of prefetch), twice for a unit recomputed inside the
// backward when DeepSpeed regathers; gradients reduced as each unit's backward ends.
void ZeroShards::before_block(std::size_t i, int sg) {
  if (zero_ != 3) return;
  const Zero3Block* zb = &z3_.at(i);
  queue_.clear();
  queue_elements_.clear();
  gathered_ = released_ = 0;
  ctx_.before_op = nullptr;
  if (tensor_prefetch_ && zb->gather) {
    const int n = static_cast<int>(ranges_of_.at(sg).size());
    const BlockKind kind = layout_.order->blocks[i].kind;
    for (const Zero3Use& u : zero3_uses(plan_, graph_, sg, kind, explicit_recompute_.count(sg))) {
      const std::string& op = u.part->ops[u.op].name;
      each(sg, u.unit, [&](const ZeroUnit& zu) {
        if (!zu.persistent && op_of(sg, u.unit, *zu.params.front()) == op) {
          queue_.push_back({u.unit, op, u.recompute, &zu});
        }
      });
      // The head's projection with the embedding's matrix (its hooks fetch it again).
      if (op == "head.proj" && u.unit == n - 1 && tied_unit_of_.count(sg)) {
        queue_.push_back({u.unit, op, u.recompute, tied_unit_of_.at(sg)});
      }
    }
    for (const TensorGather& g : queue_) {
      queue_elements_.push_back(static_cast<double>(g.zu->params.front()->w.numel()));
    }
    ctx_.before_op = [this](int unit, const std::string& op, bool recompute) {
      auto is = [&](const TensorGather& g) {
        return g.unit == unit && g.op == op && g.recompute == recompute;
      };
      std::size_t first = released_;
      while (first < queue_.size() && !is(queue_[first])) ++first;
      if (first == queue_.size()) return;  // no weights of its own to gather
      std::size_t end = first;
      while (end < queue_.size() && is(queue_[end])) ++end;
      // What the operators before it used (gathered now if none of them ran: the program's
      // calls), released; then its own tensors and those after them.
      gather_through(first);
      release_through(first);
      gather_through(zero3_launch_through(queue_elements_, end, gathered_,
                                          plan_.comm.zero3_prefetch_elements));
    };
  }
  ctx_.before_unit = [this, sg, zb](int u, bool backward) {
    if (!zb->gather || tensor_prefetch_) return;
    const int n = static_cast<int>(ranges_of_.at(sg).size());
    const int pos = backward ? n - 1 - u : u;
    auto fetch = [&](int q) {
      const int unit = backward ? n - 1 - q : q;
      const int times = zb->regather.count(unit) ? 2 : 1;
      for (int t = 0; t < times; ++t) {
        each(sg, unit, [this](const ZeroUnit& zu) { gather_unit(zu); });
        if (unit == n - 1 && tied_unit_of_.count(sg)) gather_unit(*tied_unit_of_.at(sg));
      }
    };
    if (pos == 0) fetch(0);
    if (pos + 1 < n) fetch(pos + 1);
    if (pos == 0) return;
    // The unit before this one is done.
    const int done = backward ? n - pos : pos - 1;
    each(sg, done, [this](const ZeroUnit& zu) { release_unit(zu); });
    if (done == n - 1 && tied_unit_of_.count(sg)) release_unit(*tied_unit_of_.at(sg));
  };
  ctx_.after_unit_backward = [this, sg, zb](int u) {
    if (!zb->reduce) return;
    each(sg, u, [&](ZeroUnit& zu) { reduce_or_wait(zu, grad_sync_label(plan_, sg)); });
  };
}

void ZeroShards::after_block(int sg) {
  if (zero_ != 3) return;
  gather_through(queue_.size());  // tensors no operator of this block asked for
  reduce_waiting();
  release_segment(sg);
}

void ZeroShards::after_weight_gradients(int sg, int m) {
  if (zero_ == 2 || (zero_ == 1 && m == last_weights_.at(sg) && !tied_copy(sg))) {
    for (ZeroUnit& u : units_of_.at(sg)) reduce_unit(u, grad_sync_label(plan_, sg));
  }
}

void ZeroShards::finish_tied_zero1() {
  for (int sg : layout_.segments) {
    if (zero_ != 1 || !tied_copy(sg)) continue;
    tied_sync(sg);
    for (ZeroUnit& u : units_of_.at(sg)) reduce_unit(u, grad_sync_label(plan_, sg));
  }
}

void ZeroShards::tied_sync(int sg) {
  if (!tied_copy(sg)) return;
  const Segment& seg = plan_.segments[sg];
  int other = -1;
  for (std::size_t j = 0; j < plan_.segments.size(); ++j) {
    if (seg.embedding ? plan_.segments[j].head : plan_.segments[j].embedding) {
      other = static_cast<int>(j);
    }
  }
  const int partner = peer_in(plan_.mesh, rank_, plan_.segments[other]);
  const std::vector<int> pair = {std::min(rank_, partner), std::max(rank_, partner)};
  if (zero_ >= 2) {
    for (ZeroUnit& u : units_of_.at(sg)) {
      if (u.tied_part < 0) continue;
      at::Tensor mine =
          u.grad.narrow(0, u.layout.part_offset(u.tied_part), u.layout.part_chunk(u.tied_part));
      at::Tensor g = mine.to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
      ctx_.all_reduce(g, pair, "explicit", "tied embedding grad sync");
      c10::NoGradGuard no_grad;
      mine.copy_(g);
    }
    return;
  }
  Param& w = *models_.at(sg)->word_matrix();
  at::Tensor g = grad_or_zeros(w).to(reduce_dtype_);
  ctx_.all_reduce(g, pair, "explicit", "tied embedding grad sync");
  c10::NoGradGuard no_grad;
  w.w.mutable_grad() = g.to(at::kFloat).view(w.w.sizes()).clone();
}

void ZeroShards::gather_after_step() {
  if (zero_ == 1 || zero_ == 2) {
    for (ZeroUnit* u : units_) gather_unit(*u);
  }
  std::vector<const ZeroUnit*> persistent;
  for (const ZeroUnit* u : units_) {
    if (u->persistent) persistent.push_back(u);
  }
  if (!persistent.empty()) gather_persistent(persistent);
}

}  // namespace nnsim::hwexec
