#include "hwexec/run_model.h"

#include <limits>

#include <fmt/format.h>

#include "core/opgraph.h"
#include "core/program.h"
#include "hwexec/run_precision.h"

namespace nnsim::hwexec {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

void resize_storage(const at::Tensor& t, std::size_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

Model::Model(const ModelSpec& spec, int first, int end, bool embedding, bool head, Split split,
             int tp_index, unsigned long long seed, at::Device device, at::ScalarType dtype,
             Param* embedding_word)
    : device_(device),
      dtype_(dtype),
      spec_(spec),
      first_(first),
      end_(end),
      embedding_(embedding),
      head_(head),
      split_(split),
      t_(tp_index),
      seed_(seed) {
  const int64_t h = spec.hidden, a = spec.heads, k = spec.kv_heads, d = spec.head_dim(),
                f = spec.ffn_hidden, V = spec.vocab, s = spec.seq_len;
  // attn.qkv's columns: per key/value head, its group of a / k query heads, then its key and
  // its value head (Megatron's layout), so a tensor-parallel rank holds whole groups.
  const int64_t g = a / k, kl = k / split.heads, fl = f / split.ffn;
  // mlp.fc1's columns for SwiGLU: the gate's f, then the up projection's f; a rank holds the
  // same slice of each.
  const int64_t branches = spec.gated_mlp() ? 2 : 1;
  const int ta = split.heads > 1 ? t_ : 0, tf = split.ffn > 1 ? t_ : 0;
  auto whole = [](const at::Tensor& x) { return x; };
  positions_ = (split.cp > 1 ? cp_positions(s, split.cp, split.cp_index) : at::arange(s, at::kLong))
                   .to(device);
  // The rank's query heads are the global heads [ta kl g, (ta + 1) kl g) (whole key/value
  // groups): ALiBi's slopes and the attention's dropout masks are those heads'.
  first_head_ = ta * kl * g;
  if (spec.position == PositionKind::kAlibi)
    alibi_ = alibi_slopes_of(a, first_head_, kl * g, device);
  if (embedding_) {
    const int64_t vl = V / split.embed_vocab;
    const int tv = vocab_index(/*head=*/false);
    word_ = add("embed.word.weight", {V, h}, 0.1, 0,
                [=](const at::Tensor& x) { return x.narrow(0, tv * vl, vl); });
    if (spec.position == PositionKind::kLearned) {
      pos_ = add("embed.position.weight", {s, h}, 0.1, 0, whole);
    }
  }
  for (int l = first_; l < end_; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    LayerParams L;
    L.ln1g = add(p + "attn.norm.weight", {h}, 0.1, 1, whole);
    if (spec.bias) L.ln1b = add(p + "attn.norm.bias", {h}, 0.1, 0, whole);
    if (spec.mla()) add_latent_params(p, L, ta * kl * g);
    if (!spec.mla()) {
      L.qkv_w = add(p + "attn.qkv.weight", {h, k * (g + 2) * d}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({h, k, g + 2, d}).narrow(1, ta * kl, kl).reshape({h, kl * (g + 2) * d});
      });
    }
    if (spec.bias && !spec.mla()) {
      L.qkv_b = add(p + "attn.qkv.bias", {k * (g + 2) * d}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({k, g + 2, d}).narrow(0, ta * kl, kl).reshape({kl * (g + 2) * d});
      });
    }
    if (spec.qk_norm) {
      const bool shift = spec.norm == NormKind::kLayerNorm && spec.bias;
      L.qn_g = add(p + "attn.qk_norm.q_weight", {d}, 0.1, 1, whole);
      L.kn_g = add(p + "attn.qk_norm.k_weight", {d}, 0.1, 1, whole);
      if (shift) L.qn_b = add(p + "attn.qk_norm.q_bias", {d}, 0.1, 0, whole);
      if (shift) L.kn_b = add(p + "attn.qk_norm.k_bias", {d}, 0.1, 0, whole);
    }
    // The output projection's rows of the rank's heads (each v_head_dim wide with latents).
    const int64_t dv = spec.mla() ? spec.v_head_dim : d;
    L.proj_w = add(p + "attn.proj.weight", {a * dv, h}, 0.05, 0,
                   [=](const at::Tensor& x) { return x.narrow(0, ta * kl * g * dv, kl * g * dv); });
    if (spec.bias) L.proj_b = add(p + "attn.proj.bias", {h}, 0.05, 0, whole);
    const bool norm_shift = spec.norm == NormKind::kLayerNorm && spec.bias;
    if (spec.post_norms) {
      L.pn1g = add(p + "attn.post_norm.weight", {h}, 0.1, 1, whole);
      if (norm_shift) L.pn1b = add(p + "attn.post_norm.bias", {h}, 0.1, 0, whole);
    }
    L.ln2g = add(p + "mlp.norm.weight", {h}, 0.1, 1, whole);
    if (spec.bias) L.ln2b = add(p + "mlp.norm.bias", {h}, 0.1, 0, whole);
    auto add_mlp_post_norm = [&] {
      if (!spec.post_norms) return;
      L.pn2g = add(p + "mlp.post_norm.weight", {h}, 0.1, 1, whole);
      if (norm_shift) L.pn2b = add(p + "mlp.post_norm.bias", {h}, 0.1, 0, whole);
    };
    if (spec.is_moe_layer(l)) {
      add_moe_params(p, L);
      add_mlp_post_norm();
      layers_.push_back(L);
      recompute_.emplace_back();
      stopped_.emplace_back();
      continue;
    }
    L.fc1_w = add(p + "mlp.fc1.weight", {h, branches * f}, 0.05, 0, [=](const at::Tensor& x) {
      return x.view({h, branches, f}).narrow(2, tf * fl, fl).reshape({h, branches * fl});
    });
    if (spec.bias) {
      L.fc1_b = add(p + "mlp.fc1.bias", {branches * f}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({branches, f}).narrow(1, tf * fl, fl).reshape({branches * fl});
      });
    }
    L.fc2_w = add(p + "mlp.fc2.weight", {f, h}, 0.05, 0,
                  [=](const at::Tensor& x) { return x.narrow(0, tf * fl, fl); });
    if (spec.bias) L.fc2_b = add(p + "mlp.fc2.bias", {h}, 0.05, 0, whole);
    add_mlp_post_norm();
    layers_.push_back(L);
    recompute_.emplace_back();
    stopped_.emplace_back();
  }
  if (head_) {
    hn_g_ = add("head.norm.weight", {h}, 0.1, 1, whole);
    if (spec.bias) hn_b_ = add("head.norm.bias", {h}, 0.1, 0, whole);
    if (!spec.tied_embeddings) {
      const int64_t vl = V / split.head_vocab;
      const int tv = vocab_index(/*head=*/true);
      head_w_ = add("head.proj.weight", {h, V}, 0.1, 0,
                    [=](const at::Tensor& x) { return x.narrow(1, tv * vl, vl); });
    } else if (!embedding_ && embedding_word) {
      word_ = embedding_word;
      shared_word_ = true;
    } else if (!embedding_) {
      // Tied, on another stage than the embedding: a copy of the embedding's matrix (drawn
      // the same, by its name), whose gradient the epilogue sums with the embedding's
      // (Megatron's "tied embedding grad sync").
      const int64_t vl = V / split.embed_vocab;
      const int tv = vocab_index(/*head=*/false);
      word_ = add("embed.word.weight", {V, h}, 0.1, 0,
                  [=](const at::Tensor& x) { return x.narrow(0, tv * vl, vl); });
    }
  }
  cast_weights();
}

void Model::cast_weights() {
  for (Param& p : params_) p.c = dtype_ == at::kFloat ? p.w : p.w.to(dtype_);
}

void Model::set_recompute(const std::vector<RecomputeRule>& rules, bool early_stop) {
  // Rules without layers also recompute the embedding and the head (the program's
  // recomputed_ops of those parts).
  for (const RecomputeRule& rule : rules) {
    if (rule.end_layer >= 0) continue;
    for (const char* op : {"embed.word", "embed.position", "embed.dropout"}) {
      const std::string o = op;
      if (embedding_ && match_pattern(rule.match, op) &&
          (o == "embed.word" || (o == "embed.position" ? pos_ != nullptr : spec_.dropout))) {
        recompute_embed_.insert(op);
      }
    }
    for (const char* op : {"head.norm", "head.proj", "loss"}) {
      if (head_ && match_pattern(rule.match, op)) recompute_head_.insert(op);
    }
  }
  for (int l = first_; l < end_; ++l) {
    std::set<std::string>& r = recompute_[l - first_];
    for (const RecomputeRule& rule : rules) {
      if (l < rule.first_layer || (rule.end_layer >= 0 && l >= rule.end_layer)) continue;
      for (const char* op :
           {"attn.norm",      "attn.qkv",    "attn.qk_norm",   "attn.q_down",    "attn.q_norm",
            "attn.q_up",      "attn.q",      "attn.kv_down",   "attn.kv_norm",   "attn.kv_up",
            "attn.core",      "attn.proj",   "attn.post_norm", "attn.residual",  "mlp.norm",
            "mlp.fc1",        "mlp.act",     "mlp.fc2",        "moe.shared.fc1", "moe.shared.act",
            "moe.shared.fc2", "moe.router",  "moe.dispatch",   "moe.fc1",        "moe.act",
            "moe.fc2",        "moe.combine", "mlp.post_norm",  "mlp.residual"}) {
        if (match_pattern(rule.match, op)) r.insert(op);
      }
    }
  }
  // PyTorch's checkpoint stops its recomputation after the last operator that saves a tensor
  // of its own (the program's replayed_ops): the operators after it keep the graphs of the
  // forward, and the tensors they saved are the recomputation's.
  if (!early_stop) return;
  const OpGraph graph = lower_model(spec_, 1);
  for (int l = first_; l < end_; ++l) {
    const std::set<std::string>& r = recompute_[l - first_];
    if (r.empty()) continue;
    const GraphPart& part = graph.layer_at(l);
    std::vector<bool> recomputed;
    for (const Op& op : part.ops) recomputed.push_back(r.count(op.name) > 0);
    const std::vector<bool> run = replayed_ops(part, recomputed, true);
    for (std::size_t i = 0; i < run.size(); ++i) {
      if (recomputed[i] && !run[i]) stopped_[l - first_].insert(part.ops[i].name);
    }
  }
}

std::vector<std::vector<Param*>> Model::units() {
  std::vector<std::vector<Param*>> u;
  auto some = [](std::initializer_list<Param*> ps) {
    std::vector<Param*> v;
    for (Param* p : ps) {
      if (p) v.push_back(p);
    }
    return v;
  };
  if (embedding_) u.push_back(some({word_, pos_}));
  for (const LayerParams& L : layers_) {
    // In the order the operators use them (the program's ZeRO-3 units).
    u.push_back(some({L.ln1g,   L.ln1b,   L.qkv_w,  L.qkv_b,  L.qd_w,   L.qd_b,   L.qdn_g,
                      L.qdn_b,  L.q_w,    L.q_b,    L.kvd_w,  L.kvd_b,  L.kvn_g,  L.kvn_b,
                      L.kvu_w,  L.kvu_b,  L.qn_g,   L.kn_g,   L.qn_b,   L.kn_b,   L.proj_w,
                      L.proj_b, L.pn1g,   L.pn1b,   L.ln2g,   L.ln2b,   L.fc1_w,  L.fc1_b,
                      L.fc2_w,  L.fc2_b,  L.sfc1_w, L.sfc1_b, L.sfc2_w, L.sfc2_b, L.router_w,
                      L.efc1_w, L.efc1_b, L.efc2_w, L.efc2_b, L.pn2g,   L.pn2b}));
  }
  if (head_) {
    u.push_back(some({hn_g_, hn_b_, head_w_, embedding_ || shared_word_ ? nullptr : word_}));
  }
  return u;
}

std::vector<const Param*> Model::fp32_reads() const {
  std::vector<const Param*> v;
  if (embedding_ && word_) v.push_back(word_);
  // A mixture's router scores in fp32 from the fp32 weights (moe_forward).
  for (const LayerParams& L : layers_) {
    if (L.router_w) v.push_back(L.router_w);
  }
  if (spec_.norm == NormKind::kLayerNorm && !cpu_fp16()) return v;
  auto add = [&](std::initializer_list<const Param*> ps) {
    for (const Param* p : ps) {
      if (p) v.push_back(p);
    }
  };
  for (const LayerParams& L : layers_) {
    add({L.ln1g, L.ln1b, L.qn_g, L.kn_g, L.qn_b, L.kn_b, L.qdn_g, L.qdn_b, L.kvn_g, L.kvn_b, L.pn1g,
         L.pn1b, L.ln2g, L.ln2b, L.pn2g, L.pn2b});
  }
  add({hn_g_, hn_b_});
  return v;
}

std::vector<Param*> Model::sequence_parallel_params() {
  std::vector<Param*> v;
  auto add = [&](std::initializer_list<Param*> ps) {
    for (Param* p : ps) {
      if (p) v.push_back(p);
    }
  };
  // The query and key norms' scales, applied to the rank's heads, are partial sums too
  // whenever the heads are split.
  if (split_.heads > 1) {
    for (const LayerParams& L : layers_) add({L.qn_g, L.kn_g, L.qn_b, L.kn_b});
  }
  if (split_.seq <= 1) return v;
  add({pos_});
  // A mixture's router scores the rank's slice of the sequence, and its combine adds the
  // row-parallel experts' biases to the rank's copies.
  for (const LayerParams& L : layers_) add({L.router_w});
  if (split_.expert_ffn > 1) {
    for (const LayerParams& L : layers_) add({L.efc2_b, L.sfc2_b});
  }
  for (const LayerParams& L : layers_) {
    add({L.ln1g, L.ln1b, L.proj_b, L.pn1g, L.pn1b, L.ln2g, L.ln2b, L.fc2_b, L.pn2g, L.pn2b});
  }
  // Latent attention's down-projections and latent norms, applied to the rank's slice.
  for (const LayerParams& L : layers_) {
    add({L.qd_w, L.qd_b, L.qdn_g, L.qdn_b, L.kvd_w, L.kvd_b, L.kvn_g, L.kvn_b});
  }
  add({hn_g_, hn_b_});
  return v;
}

at::Tensor Model::forward(RankContext& c, const at::Tensor& tokens, at::Tensor x,
                          const at::Tensor& targets, MicroBatchTape& tape) {
  ctx_ = &c;
  if (embedding_) {
    unit_ = 0;
    c.unit_before(0, false);
    x = embed_forward(c, tokens, x, tape);
  }
  tape.layers.resize(layers_.size());
  const int first_unit = embedding_ ? 1 : 0;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    unit_ = first_unit + static_cast<int>(l);
    c.unit_before(unit_, false);
    tape.layers[l].key = tape.key;
    if (l == 0 && reduce_input_) {
      // The spanning embedding's tensor-parallel partial sums, reduced for attn.norm (the
      // program's conversion of the first layer's input; under sequence parallelism
      // reduce-scattered, or sliced when the vocabulary is split over the pipeline axes
      // only); the layer keeps the sums.
      bool partial = false;
      for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) partial = partial || !a.pipeline;
      if (split_.seq > 1) {
        x = partial ? scatter_seq(c, x, "attn.norm") : my_seq(x);
      } else if (partial) {
        x = x.clone();
        for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
          if (!a.pipeline) c.all_reduce(x, a.group, a.name, "attn.norm");
        }
      }
    }
    x = layer_forward(c, static_cast<int>(l), x, tape.layers[l]);
  }
  if (!head_) return x;
  unit_ = head_unit();
  c.unit_before(head_unit(), false);
  head_forward(c, x, targets, tape);
  return x;
}

at::Tensor Model::backward(RankContext& c, MicroBatchTape& tape, at::Tensor dy, double loss_scale,
                           bool input_only) {
  RunStats& st = *c.stats;
  ctx_ = &c;
  bwd_phase_ = input_only ? "bwd_input" : "bwd";
  deferred_ = input_only ? &tape.deferred : nullptr;
  if (head_) {
    unit_ = head_unit();
    c.unit_before(head_unit(), true);
    if (!recompute_head_.empty() && !tape.head_recomputed) {
      head_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
    }
    const Mark t0 = st.mark();
    const double n = static_cast<double>(tape.ez.size(0) * tape.ez.size(1));
    // The gradient in the softmax's buffer, as Megatron forms it.
    at::Tensor dlogits = tape.ez.div_(tape.se.unsqueeze(-1));
    dlogits.scatter_add_(-1, tape.target_index, -tape.target_mask.unsqueeze(-1));
    dlogits.mul_(loss_scale / n);
    st.op("loss", bwd_phase_, t0, st.mark());
    tape.ez = tape.se = tape.target_index = tape.target_mask = at::Tensor();
    const int vsplit = spec_.tied_embeddings ? split_.embed_vocab : split_.head_vocab;
    const bool sp = split_.seq > 1;
    if (sp && !recompute_head_.count("head.proj")) {
      regather(c, tape.hnorm.out.detach(), tape.hproj, "head.proj");
    }
    at::Tensor dn = bwd(st, "head.proj", tape.hproj, dlogits.to(dtype_))[0];
    if (sp) {
      // A spanning head's partial sums over the pipeline axes first (the program's order).
      const VocabSplit& v = spec_.tied_embeddings ? c.embed_vocab : c.head_vocab;
      bool tensor_partial = vsplit > 1;
      if (vsplit > 1 && v.pipeline) {
        tensor_partial = false;
        for (const VocabSplit::Axis& a : v.per_axis) {
          if (a.pipeline) c.all_reduce(dn, a.group, a.name, "head.proj");
          tensor_partial = tensor_partial || !a.pipeline;
        }
      }
      dn = tensor_partial ? scatter_seq(c, dn, "head.proj") : my_seq(dn);
    } else if (vsplit > 1) {
      c.vocab_reduce(spec_.tied_embeddings ? c.embed_vocab : c.head_vocab, dn,
                     [](const VocabSplit::Axis&) { return std::string("head.proj"); });
    }
    dy = bwd(st, "head.norm", tape.hnorm, dn)[0];
    tape.head_x = tape.targets = at::Tensor();  // what the head's recomputation read
    c.unit_after_backward(head_unit());
  }
  const int first_unit = embedding_ ? 1 : 0;
  for (std::size_t l = layers_.size(); l-- > 0;) {
    unit_ = first_unit + static_cast<int>(l);
    c.unit_before(unit_, true);
    dy = layer_backward(c, static_cast<int>(l), tape.layers[l], dy);
    c.unit_after_backward(first_unit + static_cast<int>(l));
  }
  if (embedding_) {
    unit_ = 0;
    c.unit_before(0, true);
    if (!recompute_embed_.empty() && !tape.embed_recomputed) {
      embed_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
    }
    if (spec_.dropout) dy = bwd(st, "embed.dropout", tape.drop, dy)[0];
    at::Tensor de = pos_ ? bwd(st, "embed.position", tape.pos, dy)[0] : dy;
    // Under sequence parallelism the sequence slices gathered (unless a spanning embedding's
    // gradient arrived whole: run() gathers it as it arrives, as the program's transfer).
    if (split_.seq > 1 && de.size(1) != positions_.size(0)) {
      de = gather_seq(c, de,
                      pos_            ? "embed.position"
                      : spec_.dropout ? "embed.dropout"
                                      : "attn.residual");
    }
    bwd(st, "embed.word", tape.word, de);
    c.unit_after_backward(0);
    return at::Tensor();
  }
  return dy;
}

void Model::backward_weights(RankContext& c, MicroBatchTape& tape) {
  RunStats& st = *c.stats;
  std::size_t next = 0;
  ctx_ = &c;
  for (int u = head_unit() + (head_ ? 0 : -1); u >= 0; --u) {
    c.unit_before(u, true);
    for (; next < tape.deferred.size() && tape.deferred[next].unit == u; ++next) {
      DeferredWeightGrad& d = tape.deferred[next];
      c.op_before(u, d.op, false);
      const Mark t0 = st.mark();
      weight_gradients(d, /*keep_graph=*/dtype_ != at::kFloat);
      // Each weight gradient's input and output gradient go once it is computed (the
      // zero-bubble implementations' weight-gradient store pops its entries), not at the end.
      d.out = d.dout = at::Tensor();
      st.op(d.op, "bwd_weight", t0, st.mark());
    }
    c.unit_after_backward(u);
  }
  if (next != tape.deferred.size()) {
    throw RunFailure{
        fmt::format("BW: the weight gradient of {} (unit {}) is out of the units' "
                    "backward order",
                    tape.deferred[next].op, tape.deferred[next].unit)};
  }
  tape.deferred.clear();
}

void Model::recompute(RankContext& c, MicroBatchTape& tape) {
  ctx_ = &c;
  if (embedding_ && !recompute_embed_.empty()) {
    embed_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
    tape.embed_recomputed = true;
  }
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (recompute_[l].empty()) continue;
    layer_forward(c, static_cast<int>(l), at::Tensor(), tape.layers[l], /*again=*/true);
    tape.layers[l].recomputed = true;
  }
  if (head_ && !recompute_head_.empty()) {
    head_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
    tape.head_recomputed = true;
  }
}

int Model::vocab_index(bool head) const {
  const bool own = head && !spec_.tied_embeddings;
  const int ways = own ? split_.head_vocab : split_.embed_vocab;
  const int index = own ? split_.head_vocab_index : split_.embed_vocab_index;
  return ways <= 1 ? 0 : index >= 0 ? index : t_;
}

Param* Model::add(const std::string& name, const std::vector<int64_t>& shape, double scale,
                  double offset, std::function<at::Tensor(const at::Tensor&)> cut) {
  // Drawn on the CPU on every device, so that a GPU run starts from the CPU run's weights.
  at::manual_seed(static_cast<uint64_t>(seed_ ^ fnv1a(name)));
  at::Tensor full = at::randn(shape, at::kFloat) * scale + offset;
  Param p;
  p.name = name;
  p.cut = std::move(cut);
  at::Tensor w = p.cut(full).contiguous();
  p.w = (device_.is_cpu() ? w.clone() : w.to(device_)).requires_grad_(true);
  params_.push_back(std::move(p));
  return &params_.back();
}

std::vector<at::Tensor> Model::bwd(RunStats& st, const char* name, Unit& u, const at::Tensor& dy) {
  if (ctx_) ctx_->op_before(unit_, name, false);
  const Mark t0 = st.mark();
  // A BI block defers the linear layers' weight gradients (the GEMMs the program's BW block
  // holds); every other operator's backward, parameter gradients included, runs whole.
  const bool defer = deferred_ != nullptr && !u.weights.empty();
  if (defer) {
    input_gradients(u.out, dy, u.in);
    deferred_->push_back({name, u.out, dy, u.weights, unit_});
  } else {
    // bf16: the weights' casts are shared by every micro-batch's graphs; keep them.
    u.out.backward(dy, /*retain_graph=*/dtype_ != at::kFloat);
  }
  std::vector<at::Tensor> g;
  for (const at::Tensor& i : u.in) g.push_back(i.grad());
  // A deferred operator's graph, kept for BW, reaches its inputs (autograd's AccumulateGrad
  // holds each leaf), and with them their .grad: handed over here, so that the input
  // gradient goes once the operator before has used it, not when BW ends.
  if (defer) {
    for (const at::Tensor& i : u.in) i.mutable_grad() = at::Tensor();
  }
  st.op(name, bwd_phase_, t0, st.mark());
  u = Unit{};
  return g;
}

std::vector<at::Tensor> Model::weights_of(std::initializer_list<const Param*> ps) {
  std::vector<at::Tensor> w;
  for (const Param* p : ps) {
    if (p) w.push_back(p->w);
  }
  return w;
}

at::Tensor Model::norm(const at::Tensor& x, const Param* g, const Param* b) const {
  const int64_t width = x.size(-1);
  if (spec_.norm == NormKind::kLayerNorm && !cpu_fp16()) {
    return at::layer_norm(x, {width}, W(g), b ? W(b) : at::Tensor(), 1e-5);
  }
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y;
  if (spec_.norm == NormKind::kLayerNorm) {
    y = at::layer_norm(xf, {width}, g->w, b ? b->w : at::Tensor(), 1e-5);
  } else {
    y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * g->w;
  }
  return y.to(x.scalar_type());
}

at::Tensor Model::mm(const at::Tensor& a, const at::Tensor& b) const {
  if (!cpu_fp16()) return at::matmul(a, b);
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(at::kHalf);
}

at::Tensor Model::block_linear(const at::Tensor& x, const at::Tensor& w) const {
  return fp8_ ? fp8_linear(x, w) : mm(x, w);
}

at::Tensor Model::activation(const at::Tensor& x) const {
  switch (spec_.mlp) {
    case MlpKind::kRelu:
      return at::relu(x);
    case MlpKind::kSquaredRelu:  // Primer's (So et al. 2021): relu(x)^2
      return at::relu(x).square();
    case MlpKind::kSwiglu: {
      // SwiGLU: silu(gate) * up, the halves of this rank's fc1 output.
      const int64_t fl = x.size(-1) / 2;
      return at::silu(x.narrow(-1, 0, fl)) * x.narrow(-1, fl, fl);
    }
    case MlpKind::kGeglu: {
      // GeGLU (Shazeer 2020; Gemma's, T5 v1.1's): gelu(gate) * up, GeLU in its tanh form.
      const int64_t fl = x.size(-1) / 2;
      return at::gelu(x.narrow(-1, 0, fl), "tanh") * x.narrow(-1, fl, fl);
    }
    case MlpKind::kGelu:
      break;
  }
  return at::gelu(x);
}

at::Tensor Model::hidden_dropout(const DropoutKey& key, int layer, DropoutSite site,
                                 const at::Tensor& x) const {
  const int64_t sl = x.size(1);
  at::Tensor pos = positions_;
  if (split_.seq > 1) pos = pos.narrow(0, t_ * sl, sl);
  return dropout_multipliers(key, layer, site, x.size(0), spec_.seq_len, spec_.hidden, pos, 0, 0,
                             device_)
      .to(x.scalar_type());
}

const at::Tensor& Model::causal_mask(int64_t s, int layer) {
  if (!causal_.defined() || causal_.size(0) != s) {
    causal_ = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device_)).triu(1);
  }
  if (layer < 0 || !spec_.is_windowed_layer(layer) || spec_.sliding_window >= s) return causal_;
  if (!windowed_.defined() || windowed_.size(0) != s) {
    const at::Tensor ones = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device_));
    windowed_ = ones.triu(1).logical_or(ones.tril(-spec_.sliding_window));
  }
  return windowed_;
}

at::Tensor Model::rope(const at::Tensor& x) const {
  const int64_t s = x.size(1), d = x.size(3);
  const auto f32 = x.options().dtype(at::kFloat);
  const at::Tensor inv = at::pow(10000.0, -at::arange(0, d, 2, f32) / static_cast<double>(d));
  const at::Tensor ang = at::outer(positions_.to(at::kFloat), inv);  // [s, d/2]
  const at::Tensor cos = at::cat({ang.cos(), ang.cos()}, -1).view({s, 1, d}).to(x.dtype());
  const at::Tensor sin = at::cat({ang.sin(), ang.sin()}, -1).view({s, 1, d}).to(x.dtype());
  const at::Tensor rotated = at::cat({-x.narrow(3, d / 2, d / 2), x.narrow(3, 0, d / 2)}, -1);
  return x * cos + rotated * sin;
}

at::Tensor Model::gather_seq(RankContext& c, const at::Tensor& x, const std::string& label) {
  const int64_t n = split_.seq, b = x.size(0), sl = x.size(1), h = x.size(2);
  const at::Tensor all = c.all_gather(x.reshape({-1}), c.tp_group, c.tp_axes, label);
  return all.view({n, b, sl, h}).permute({1, 0, 2, 3}).reshape({b, n * sl, h});
}

at::Tensor Model::scatter_seq(RankContext& c, const at::Tensor& x, const std::string& label) {
  const int64_t n = split_.seq, b = x.size(0), sl = x.size(1) / n, h = x.size(2);
  const at::Tensor chunks = x.reshape({b, n, sl, h}).permute({1, 0, 2, 3}).reshape({-1});
  return c.reduce_scatter(chunks, c.tp_group, c.tp_axes, label).view({b, sl, h});
}

at::Tensor Model::column_input(RankContext& c, const at::Tensor& x, const char* op) {
  return leaf(split_.seq > 1 ? gather_seq(c, x.detach(), op) : x);
}

at::Tensor Model::my_seq(const at::Tensor& x) const {
  const int64_t sl = x.size(1) / split_.seq;
  return x.narrow(1, t_ * sl, sl).contiguous();
}

void Model::dropped(const at::Tensor& gathered) {
  if (!split_.save_gathered) resize_storage(gathered, 0);
}

void Model::regather(RankContext& c, const at::Tensor& shard, Unit& u, const std::string& label) {
  if (split_.save_gathered) return;
  at::Tensor full = gather_seq(c, shard, label);
  if (full.size(-1) > u.in[0].size(-1)) full = full.narrow(-1, 0, u.in[0].size(-1));
  resize_storage(u.in[0], static_cast<std::size_t>(u.in[0].numel()) * u.in[0].element_size());
  c10::NoGradGuard no_grad;
  u.in[0].variable_data().copy_(full);
}

bool Model::defers_weights(const Unit& consumer) const {
  return deferred_ != nullptr && !consumer.weights.empty();
}

void Model::release_output(Unit& producer, bool consumer_defers) {
  if (!consumer_defers && producer.out.defined()) resize_storage(producer.out, 0);
}

void Model::refill(const at::Tensor& leaf, const at::Tensor& value, bool take) {
  const bool same_layout = value.is_contiguous() && leaf.is_contiguous() &&
                           value.storage_offset() == 0 && leaf.storage_offset() == 0 &&
                           value.sizes() == leaf.sizes() && value.dtype() == leaf.dtype();
  if (take && same_layout) {
    c10::StorageImpl* from = value.storage().unsafeGetStorageImpl();
    c10::StorageImpl* to = leaf.storage().unsafeGetStorageImpl();
    const std::size_t bytes = from->nbytes();
    to->set_data_ptr_noswap(from->set_data_ptr(at::DataPtr(nullptr, from->device())));
    to->set_nbytes(bytes);
    from->set_nbytes(0);
    return;
  }
  resize_storage(leaf, value.nbytes());
  c10::NoGradGuard no_grad;
  leaf.variable_data().copy_(value);
}

}  // namespace nnsim::hwexec
