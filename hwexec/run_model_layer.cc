// A transformer block's operators of a model part (run_model.h): attention and the dense MLP,
// forward (with recomputation) and backward, and context parallelism's attention.
#include "hwexec/run_model.h"

#include <cmath>
#include <limits>

#include "hwexec/run_attention_products.h"
#include "hwexec/run_precision.h"

namespace nnsim::hwexec {

at::Tensor Model::layer_forward(RankContext& c, int l, const at::Tensor& x, LayerTape& t,
                                bool again) {
  LayerPass p;
  p.again = again;
  p.phase = again ? "recompute" : "fwd";
  // The operators recomputed and run again (an early stop leaves the last ones out).
  for (const std::string& op : recompute_[l]) {
    if (!stopped_[l].count(op)) p.rc.insert(op);
  }
  p.stopped = &stopped_[l];
  attention_forward(c, l, again ? t.x : x, t, p);
  mlp_forward(c, l, t, p);
  at::Tensor out = t.res2.out.detach();
  if (!again && !recompute_[l].empty()) keep_checkpoint(x, t, p);
  return out;
}

// A residual add's backward reads neither summand, nor the linear's backward its output: both
// are freed once summed, as one autograd graph over the layer frees them (Megatron keeps the sum
// alone). Not when the add is recomputed, which reads the linear's output (kept for the
// recomputation in the first forward; in the recomputation itself, gone).
void Model::release_summands(const LayerPass& p, const char* op, Unit& add, Unit& linear) {
  if (p.rc.count(op) && !p.again) return;
  resize_storage(add.in[0], 0);
  if (linear.out.defined()) resize_storage(linear.out, 0);
}

// A row-parallel linear's partial sums, summed over its `ways` tensor-parallel ranks: a new
// tensor (the linear's output can go), under sequence parallelism the rank's slice.
at::Tensor Model::row_parallel_sum(RankContext& c, const Unit& linear, int ways,
                                   const char* label) {
  if (split_.seq > 1) return scatter_seq(c, linear.out.detach(), label);
  at::Tensor y = linear.out.detach().clone();
  if (ways > 1) c.tp_all_reduce(y, label);
  return y;
}

// With post_norms: the linear's output, once reduced into the norm's input, goes, unless the
// norm is recomputed (then the recomputation reduces it again). With the bias added first, the
// norm saved the biased sum, not the sums it read: those go too.
void Model::release_summed(const LayerPass& p, const char* norm_op, Unit& norm, Unit& linear,
                           const Param* bias) {
  if (bias) resize_storage(norm.in[0], 0);
  if (p.rc.count(norm_op) && !p.again) return;
  if (linear.out.defined()) resize_storage(linear.out, 0);
}

// Sequence parallelism: a linear's gathered input is dropped unless the linear is recomputed
// (then the recomputation gathers it, just before the backward).
void Model::drop_gathered(const LayerPass& p, const char* op, Unit& u) {
  if (split_.seq > 1 && !p.again && !p.rc.count(op)) dropped(u.in[0]);
}

// attn.norm to attn.residual, from the layer's input `in_x`.
void Model::attention_forward(RankContext& c, int l, const at::Tensor& in_x, LayerTape& t,
                              const LayerPass& p) {
  RunStats& st = *c.stats;
  const LayerParams& L = layers_[l];
  const int64_t d = spec_.head_dim(), g = spec_.heads / spec_.kv_heads,
                kl = spec_.kv_heads / split_.heads;
  if (p.runs("attn.norm")) {
    t.n1 = fwd(st, "attn.norm", p.phase, {leaf(in_x)},
               [&](const std::vector<at::Tensor>& in) { return norm(in[0], L.ln1g, L.ln1b); });
  }
  if (spec_.mla()) latent_attention_forward(c, l, t, p);
  if (!spec_.mla() && p.runs("attn.qkv")) {
    t.qkv = fwd(st, "attn.qkv", p.phase, {column_input(c, t.n1.out, "attn.qkv")},
                [&](const std::vector<at::Tensor>& in) {
                  at::Tensor y = block_linear(in[0], W(L.qkv_w));
                  return L.qkv_b ? y + W(L.qkv_b) : y;
                });
    t.qkv.weights = weights_of({L.qkv_w, L.qkv_b});
    drop_gathered(p, "attn.qkv", t.qkv);
  }
  if (!spec_.mla() && spec_.qk_norm &&
      p.runs("attn.qk_norm")) {  // each head's query and key normalized
    t.qkn =
        fwd(st, "attn.qk_norm", p.phase, {leaf(t.qkv.out)}, [&](const std::vector<at::Tensor>& in) {
          const int64_t b = in[0].size(0), s = in[0].size(1);
          at::Tensor v5 = in[0].view({b, s, kl, g + 2, d});
          at::Tensor q = norm(v5.narrow(3, 0, g), L.qn_g, L.qn_b);
          at::Tensor k = norm(v5.narrow(3, g, 1), L.kn_g, L.kn_b);
          return at::cat({q, k}, 3).reshape({b, s, kl * (g + 1) * d});
        });
  }
  if (spec_.mla()) {  // (its core ran in latent_attention_forward)
  } else if (p.runs("attn.core") && split_.cp > 1) {
    t.core = cp_core_forward(c, t.qkv.out, spec_.qk_norm ? t.qkn.out : at::Tensor(), p.phase, t.key,
                             first_ + l);
  } else if (p.runs("attn.core")) {
    // With qk_norm the queries and keys are the norm's and the values the projection's.
    std::vector<at::Tensor> core_in = {leaf(t.qkv.out)};
    if (spec_.qk_norm) core_in = {leaf(t.qkn.out), leaf(t.qkv.out)};
    t.core = fwd(st, "attn.core", p.phase, core_in,
                 [&](const std::vector<at::Tensor>& in) { return attention_core(in, t.key, l); });
  }
  if (p.runs("attn.proj")) {
    t.proj =
        fwd(st, "attn.proj", p.phase, {leaf(t.core.out)},
            [&](const std::vector<at::Tensor>& in) { return block_linear(in[0], W(L.proj_w)); });
    t.proj.weights = weights_of({L.proj_w});
  }
  // The row-parallel sums feed the residual (the program's conversion for its input), or with
  // post_norms the norm before it, which adds the projection's bias.
  auto summed = [&](const char* label) { return row_parallel_sum(c, t.proj, split_.heads, label); };
  if (spec_.post_norms && p.runs("attn.post_norm")) {
    t.pn1 = fwd(st, "attn.post_norm", p.phase, {leaf(summed("attn.post_norm"))},
                [&](const std::vector<at::Tensor>& in) {
                  return norm(L.proj_b ? in[0] + W(L.proj_b) : in[0], L.pn1g, L.pn1b);
                });
    release_summed(p, "attn.post_norm", t.pn1, t.proj, L.proj_b);
  }
  if (p.runs("attn.residual")) {
    const bool post = spec_.post_norms;
    at::Tensor y = post ? t.pn1.out.detach() : summed("attn.residual");
    t.res1 = fwd(st, "attn.residual", p.phase, {leaf(y), leaf(in_x)},
                 [&](const std::vector<at::Tensor>& in) {
                   at::Tensor z = L.proj_b && !post ? in[0] + W(L.proj_b) : in[0];
                   // Bias, dropout, add (Megatron's fused bias-dropout-add).
                   if (spec_.dropout) {
                     z = z * hidden_dropout(t.key, first_ + l, DropoutSite::kAttnResidual, z);
                   }
                   return z + in[1];
                 });
    release_summands(p, "attn.residual", t.res1, post ? t.pn1 : t.proj);
  }
}

// The attention of this rank's heads over the whole sequence: q, k and v from the QKV output
// (`in.back()`), with qk_norm the queries and keys from the norm (`in[0]`).
at::Tensor Model::attention_core(const std::vector<at::Tensor>& in, const DropoutKey& key, int l) {
  const int64_t d = spec_.head_dim(), g = spec_.heads / spec_.kv_heads,
                kl = spec_.kv_heads / split_.heads, al = kl * g;
  const int64_t b = in.back().size(0), s = in.back().size(1);
  // [b, s, kv heads, group + 2, d]: the group's queries, then its key and value.
  at::Tensor v5 = in.back().view({b, s, kl, g + 2, d});
  at::Tensor q = v5.narrow(3, 0, g).reshape({b, s, al, d});
  at::Tensor k = v5.select(3, g), v = v5.select(3, g + 1);
  if (in.size() > 1) {  // [b, s, kv heads, group + 1, d]: normalized queries, key
    at::Tensor n5 = in[0].view({b, s, kl, g + 1, d});
    q = n5.narrow(3, 0, g).reshape({b, s, al, d});
    k = n5.select(3, g);
  }
  if (spec_.position == PositionKind::kRope) {
    q = rope(q);
    k = rope(k);
  }
  if (g > 1) {  // grouped-query attention: each key/value head serves its g query heads
    k = k.unsqueeze(3).expand({b, s, kl, g, d}).reshape({b, s, al, d});
    v = v.unsqueeze(3).expand({b, s, kl, g, d}).reshape({b, s, al, d});
  }
  return attend(q, k, v, key, l);
}

at::Tensor Model::attend(at::Tensor q, at::Tensor k, at::Tensor v, const DropoutKey& key, int l) {
  const int64_t b = q.size(0), s = q.size(1), al = q.size(2), d = q.size(3), dv = v.size(3);
  q = q.permute({0, 2, 1, 3});
  k = k.permute({0, 2, 1, 3});
  v = v.permute({0, 2, 1, 3});
#if TORCH_VERSION_MAJOR >= 2
  // The model's fused attention (FlashAttention or memory-efficient attention, as
  // LibTorch picks), where it computes what the plan asks for: ALiBi and the
  // probabilities' dropout need the explicit chain below.
  if (spec_.attention == AttentionKernel::kFlash && !alibi_.defined() && !spec_.dropout) {
    // A sliding window's layer: its mask (true where a query may see the key).
    const bool window = spec_.is_windowed_layer(first_ + l) && spec_.sliding_window < s;
    const at::Tensor mask = window ? causal_mask(s, first_ + l).logical_not() : at::Tensor();
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, !window)
        .permute({0, 2, 1, 3})
        .reshape({b, s, al * dv});
  }
#endif
  // Unfused, as Megatron without FlashAttention: the two batched products read q, k
  // and v as views of the QKV output and keep no copies of them
  // (run_attention_products.h); the scale on the scores in place (Megatron folds it
  // into the product), the causal mask in place, the softmax in the compute dtype
  // (LibTorch accumulates a 16-bit softmax in fp32, as Megatron's fused
  // scaled-masked softmax does) and only its output kept for the backward.
  at::Tensor scores = per_sequence_bmm(q, k.transpose(-2, -1), cpu_fp16());
  scores.mul_(1 / std::sqrt(double(d)));
  if (alibi_.defined()) {  // ALiBi: in fp32, at the tokens' positions
    scores = scores.to(at::kFloat) + alibi_bias(alibi_, positions_, positions_);
  }
  scores.masked_fill_(causal_mask(s, first_ + l), -std::numeric_limits<float>::infinity());
  // (LibTorch's CPU softmax has no fp16 kernel: there, in fp32, the same values.)
  at::Tensor p = (cpu_fp16() ? at::softmax(scores, -1, at::kFloat) : at::softmax(scores, -1))
                     .to(q.scalar_type());
  if (spec_.dropout) {  // the probabilities' dropout
    p = p * dropout_multipliers(key, first_ + l, DropoutSite::kAttention, b, spec_.seq_len,
                                spec_.heads, positions_, first_head_, al, device_)
                .to(p.scalar_type());
  }
  return per_sequence_bmm(p, v, cpu_fp16()).permute({0, 2, 1, 3}).reshape({b, s, al * dv});
}

// mlp.norm to mlp.residual: the dense MLP or a mixture of experts.
void Model::mlp_forward(RankContext& c, int l, LayerTape& t, const LayerPass& p) {
  RunStats& st = *c.stats;
  const LayerParams& L = layers_[l];
  if (p.runs("mlp.norm")) {
    t.n2 = fwd(st, "mlp.norm", p.phase, {leaf(t.res1.out)},
               [&](const std::vector<at::Tensor>& in) { return norm(in[0], L.ln2g, L.ln2b); });
  }
  if (L.moe) moe_forward(st, L, t, p.again, p.rc, *p.stopped);
  if (!L.moe && p.runs("mlp.fc1")) {
    t.fc1 = fwd(st, "mlp.fc1", p.phase, {column_input(c, t.n2.out, "mlp.fc1")},
                [&](const std::vector<at::Tensor>& in) {
                  at::Tensor z = block_linear(in[0], W(L.fc1_w));
                  return L.fc1_b ? z + W(L.fc1_b) : z;
                });
    t.fc1.weights = weights_of({L.fc1_w, L.fc1_b});
    drop_gathered(p, "mlp.fc1", t.fc1);
  }
  if (!L.moe && p.runs("mlp.act")) {
    t.act = fwd(st, "mlp.act", p.phase, {leaf(t.fc1.out)}, [&](const std::vector<at::Tensor>& in) {
      if (cpu_fp16()) return activation(in[0].to(at::kFloat)).to(at::kHalf);
      return activation(in[0]);
    });
  }
  if (!L.moe && p.runs("mlp.fc2")) {
    t.fc2 = fwd(st, "mlp.fc2", p.phase, {leaf(t.act.out)},
                [&](const std::vector<at::Tensor>& in) { return block_linear(in[0], W(L.fc2_w)); });
    t.fc2.weights = weights_of({L.fc2_w});
  } else if (!L.moe && p.again && p.stopped->count("mlp.fc2") && p.rc.count("mlp.act")) {
    // What it saved, recomputed (ReLU's backward reads its output too: a copy).
    refill(t.fc2.in[0], t.act.out, spec_.mlp != MlpKind::kRelu);
  }
  // The MLP's output as the residual (or with post_norms the norm before it) reads it: the
  // row-parallel sums reduced (a mixture's combine sums its experts' outputs itself, on the
  // rank's slice), the fc2 bias added by the reader.
  Unit& mlp_out = L.moe ? t.combine : t.fc2;
  auto summed = [&](const char* label) {
    if (L.moe) return mlp_out.out.detach().clone();
    return row_parallel_sum(c, mlp_out, split_.ffn, label);
  };
  if (spec_.post_norms && p.runs("mlp.post_norm")) {
    t.pn2 = fwd(st, "mlp.post_norm", p.phase, {leaf(summed("mlp.post_norm"))},
                [&](const std::vector<at::Tensor>& in) {
                  return norm(L.fc2_b ? in[0] + W(L.fc2_b) : in[0], L.pn2g, L.pn2b);
                });
    release_summed(p, "mlp.post_norm", t.pn2, mlp_out, L.fc2_b);
  }
  if (p.runs("mlp.residual")) {
    const bool post = spec_.post_norms;
    at::Tensor y2 = post ? t.pn2.out.detach() : summed("mlp.residual");
    t.res2 = fwd(st, "mlp.residual", p.phase, {leaf(y2), leaf(t.res1.out)},
                 [&](const std::vector<at::Tensor>& in) {
                   at::Tensor z = L.fc2_b && !post ? in[0] + W(L.fc2_b) : in[0];
                   if (spec_.dropout) {
                     z = z * hidden_dropout(t.key, first_ + l, DropoutSite::kMlpResidual, z);
                   }
                   return z + in[1];
                 });
    release_summands(p, "mlp.residual", t.res2, post ? t.pn2 : mlp_out);
  }
}

// After a first forward that recomputes operators: the layer's input kept as the checkpoint, the
// recomputed operators' pieces dropped.
void Model::keep_checkpoint(const at::Tensor& x, LayerTape& t, const LayerPass& p) {
  t.x = x;  // the checkpoint
  for (const auto& [name, u] : t.units()) {
    if (p.rc.count(name)) *u = Unit{};
  }
  // A mixture's copies converted for a recomputed operator (moe.fc1's exchanged input, the
  // combine's returned and summed inputs): converted again by the recomputation.
  if (p.rc.count("moe.fc1")) t.exchanged = at::Tensor();
  if (p.rc.count("attn.kv_up")) t.kpe = at::Tensor();  // latent attention's, gathered again
  if (p.rc.count("moe.combine")) t.returned = t.shared_out = at::Tensor();
  // An early-stopped operator keeps its graph; what it read from a recomputed operator goes
  // (the recomputation brings back what its backward reads: refill).
  auto drop_input = [&](const char* stopped_op, Unit& u, std::size_t i, const char* producer) {
    if (p.stopped->count(stopped_op) && p.rc.count(producer) && u.in.size() > i) {
      resize_storage(u.in[i], 0);
    }
  };
  drop_input("mlp.fc2", t.fc2, 0, "mlp.act");
  drop_input("moe.combine", t.combine, 0, "moe.fc2");
  drop_input("moe.combine", t.combine, 1, "moe.router");
  drop_input("mlp.residual", t.res2, 1, "attn.residual");
}

Unit Model::cp_core_forward(RankContext& c, const at::Tensor& qkv, const at::Tensor& qkn,
                            const char* phase, const DropoutKey& key, int layer) {
  RunStats& st = *c.stats;
  const Mark t0 = st.mark();
  const int64_t d = spec_.head_dim(), g = spec_.heads / spec_.kv_heads,
                kl = spec_.kv_heads / split_.heads, al = kl * g, b = qkv.size(0), sl = qkv.size(1);
  Unit u;
  u.in = {leaf(qkv)};
  at::Tensor v5 = u.in[0].view({b, sl, kl, g + 2, d});
  at::Tensor q = v5.narrow(3, 0, g).reshape({b, sl, al, d});
  at::Tensor k = v5.select(3, g), v = v5.select(3, g + 1);
  if (qkn.defined()) {  // [b, sl, kv heads, group + 1, d]: normalized queries, key
    u.in.insert(u.in.begin(), leaf(qkn));
    at::Tensor n5 = u.in[0].view({b, sl, kl, g + 1, d});
    q = n5.narrow(3, 0, g).reshape({b, sl, al, d});
    k = n5.select(3, g);
  }
  if (spec_.position == PositionKind::kRope) {
    q = rope(q);
    k = rope(k);
  }
  cp_attend(c, u, q, k, v, key, layer);
  st.op("attn.core", phase, t0, st.mark(), /*minus_collectives=*/true);
  return u;
}

void Model::cp_attend(RankContext& c, Unit& u, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const DropoutKey& key, int layer) {
  const int64_t b = q.size(0), sl = q.size(1), al = q.size(2), dk = q.size(3), kl = k.size(2),
                dv = v.size(3);
  u.cp = std::make_shared<CpAttentionSaved>();
  CpAttentionSaved& cs = *u.cp;
  cs.slopes = alibi_;
  if (spec_.is_windowed_layer(layer)) cs.window = spec_.sliding_window;
  if (spec_.dropout) {
    cs.drop = dropout_multipliers(key, layer, DropoutSite::kAttention, b, spec_.seq_len,
                                  spec_.heads, positions_, first_head_, al, device_);
  }
  // [b, heads, sl, d], flattened into one tensor whose backward takes all three gradients.
  cs.graph = at::cat({q.permute({0, 2, 1, 3}).reshape({-1}), k.permute({0, 2, 1, 3}).reshape({-1}),
                      v.permute({0, 2, 1, 3}).reshape({-1})});
  const at::Tensor flat = cs.graph.detach();
  const int64_t nq = b * al * sl * dk, nk = b * kl * sl * dk, nv = b * kl * sl * dv;
  // Every rank's keys and values, gathered as one buffer: [cp, keys then values].
  const at::Tensor all =
      c.all_gather(flat.narrow(0, nq, nk + nv).contiguous(), c.cp_group, c.cp_axes, "attn.core")
          .view({split_.cp, nk + nv});
  const at::Tensor k_all = all.narrow(1, 0, nk).reshape({split_.cp, b, kl, sl, dk});
  const at::Tensor v_all = all.narrow(1, nk, nv).reshape({split_.cp, b, kl, sl, dv});
  const at::Tensor out = cp_attention_forward(flat.narrow(0, 0, nq).view({b, al, sl, dk}), k_all,
                                              v_all, split_.cp_index, spec_.seq_len, &cs);
  u.out = out.to(dtype_).permute({0, 2, 1, 3}).reshape({b, sl, al * dv});
}

std::vector<at::Tensor> Model::cp_core_backward(RankContext& c, Unit& u, const at::Tensor& dy) {
  RunStats& st = *c.stats;
  const Mark t0 = st.mark();
  CpAttentionSaved& cs = *u.cp;
  const int64_t b = dy.size(0), sl = dy.size(1), al = cs.q.size(1), width = cs.v.size(3);
  auto step = [&](const at::Tensor& t) {
    c.send(c.cp_next, t, "", /*record=*/false);
    return c.recv(c.cp_prev, t.sizes(), "", /*record=*/false, t.scalar_type(),
                  /*compute_dtype=*/false);
  };
  const auto [dq, dk, dv] =
      cp_attention_backward(cs, dy.reshape({b, sl, al, width}).permute({0, 2, 1, 3}), step);
  const Mark t1 = st.mark();
  // The program's convention: the ring moves what an all-gather of (k, v, dk, dv) moves.
  st.coll("all_gather", c.cp_axes, "attn.core",
          static_cast<double>(split_.cp) * 2 * static_cast<double>(cs.k.nbytes() + cs.v.nbytes()),
          t0, t1);
  cs.graph.backward(
      at::cat({dq.reshape({-1}), dk.reshape({-1}), dv.reshape({-1})}).to(cs.graph.scalar_type()));
  std::vector<at::Tensor> dx;
  for (const at::Tensor& in : u.in) dx.push_back(in.grad());
  st.op("attn.core", bwd_phase_, t0, st.mark());
  u = Unit{};
  return dx;
}

at::Tensor Model::column_parallel_backward(RankContext& c, const char* op, Unit& linear, Unit& norm,
                                           const at::Tensor& d, const std::set<std::string>& rc,
                                           int ways, const at::Tensor& tail_grad,
                                           bool norm_read_later) {
  const bool sp = split_.seq > 1;
  if (sp && !rc.count(op)) regather(c, norm.out.detach(), linear, op);
  const bool linear_defers = defers_weights(linear);
  at::Tensor dx = bwd(*c.stats, op, linear, d)[0];
  if (tail_grad.defined()) dx = at::cat({dx, tail_grad}, -1);
  release_output(norm, linear_defers || norm_read_later);
  if (sp) return scatter_seq(c, dx, op);
  if (ways > 1) c.tp_all_reduce(dx, op);
  return dx;
}

at::Tensor Model::layer_backward(RankContext& c, int l, LayerTape& t, const at::Tensor& dy) {
  RunStats& st = *c.stats;
  const std::set<std::string>& rc = recompute_[l];
  if (!rc.empty() && !t.recomputed) layer_forward(c, l, at::Tensor(), t, /*again=*/true);
  // Sequence parallelism (the program's order): the residual's gradient gathered before the
  // row-parallel linear; the column-parallel linear's dropped input gathered again before its
  // backward (a recomputed one has it), and its input gradient (partial sums)
  // reduce-scattered.
  const bool sp = split_.seq > 1;
  auto defers = [&](const Unit& consumer) { return defers_weights(consumer); };
  auto release = [](Unit& producer, bool consumer_defers) {
    release_output(producer, consumer_defers);
  };
  // With post_norms the residual's summand is the norm's output: its gradient goes through
  // the norm first, and under sequence parallelism is gathered under the norm's label (the
  // program's conversion into the norm's input).
  const bool post = spec_.post_norms;
  std::vector<at::Tensor> g = bwd(st, "mlp.residual", t.res2, dy);
  at::Tensor d = post ? bwd(st, "mlp.post_norm", t.pn2, g[0])[0] : g[0];
  if (layers_[l].moe) {
    d = moe_backward(st, layers_[l], t, d);
  } else {
    const bool fc2_defers = defers(t.fc2);
    const char* mlp_label = post ? "mlp.post_norm" : "mlp.residual";
    d = bwd(st, "mlp.fc2", t.fc2, sp ? gather_seq(c, d, mlp_label) : d)[0];
    if (spec_.mlp != MlpKind::kRelu) release(t.act, fc2_defers);
    d = bwd(st, "mlp.act", t.act, d)[0];
    release(t.fc1, false);
    d = column_parallel_backward(c, "mlp.fc1", t.fc1, t.n2, d, rc, split_.ffn);
  }
  at::Tensor dx1 = bwd(st, "mlp.norm", t.n2, d)[0] + g[1];
  g = bwd(st, "attn.residual", t.res1, dx1);
  dx1 = at::Tensor();
  d = post ? bwd(st, "attn.post_norm", t.pn1, g[0])[0] : g[0];
  const bool proj_defers = defers(t.proj);
  const char* attn_label = post ? "attn.post_norm" : "attn.residual";
  d = bwd(st, "attn.proj", t.proj, sp ? gather_seq(c, d, attn_label) : d)[0];
  release(t.core, proj_defers);
  if (spec_.mla()) {
    d = latent_attention_backward(c, t, d, rc);
    t.x = at::Tensor();
    return bwd(st, "attn.norm", t.n1, d)[0] + g[1];
  }
  if (spec_.qk_norm) {
    // The values' gradient, and the queries' and keys' through their norms.
    std::vector<at::Tensor> dc =
        split_.cp > 1 ? cp_core_backward(c, t.core, d) : bwd(st, "attn.core", t.core, d);
    release(t.qkn, false);
    d = dc[1] + bwd(st, "attn.qk_norm", t.qkn, dc[0])[0];
    release(t.qkv, false);
  } else if (split_.cp > 1) {
    d = cp_core_backward(c, t.core, d)[0];
  } else {
    d = bwd(st, "attn.core", t.core, d)[0];
    release(t.qkv, false);
  }
  d = column_parallel_backward(c, "attn.qkv", t.qkv, t.n1, d, rc, split_.heads);
  t.x = at::Tensor();
  return bwd(st, "attn.norm", t.n1, d)[0] + g[1];
}

}  // namespace nnsim::hwexec
