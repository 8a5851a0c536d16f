// Multi-head latent attention in a block of `nnexec run` (DeepSeek-V2/V3; docs/opgraph.md,
// "Multi-head latent attention"): the operators the simulator's graph has, split as
// Megatron-Core's MLA splits them. The down-projections and the latents' norms are whole on
// every rank (under sequence parallelism on the rank's sequence slice); the up-projections,
// the core and the output projection hold the rank's heads. The key/value norm carries the
// rotary key part through beside the normalized latent, so it is gathered with the latent for
// the up-projection and its gradient summed with the latent's, as the compiled program has it.
#include <fmt/format.h>

#include "hwexec/run_model.h"

namespace nnsim::hwexec {

void Model::add_latent_params(const std::string& p, LayerParams& L, int64_t head) {
  const ModelSpec& m = spec_;
  const int64_t h = m.hidden, a = m.heads, al = a / split_.heads, dr = m.qk_rope_head_dim,
                dqk = m.qk_nope_head_dim + dr, dkv = m.qk_nope_head_dim + m.v_head_dim,
                rq = m.q_lora_rank, rkv = m.kv_lora_rank;
  const bool shift = m.norm == NormKind::kLayerNorm && m.bias;
  auto whole = [](const at::Tensor& x) { return x; };
  // The columns of the rank's heads, each head `width` wide, of a [in, a width] matrix (or an
  // [a width] bias).
  auto heads_of = [=](int64_t width) {
    return [=](const at::Tensor& x) {
      if (x.dim() == 1) return x.narrow(0, head * width, al * width);
      return x.narrow(1, head * width, al * width);
    };
  };
  int64_t q_in = h;
  if (rq > 0) {
    L.qd_w = add(p + "attn.q_down.weight", {h, rq}, 0.05, 0, whole);
    if (m.bias) L.qd_b = add(p + "attn.q_down.bias", {rq}, 0.05, 0, whole);
    L.qdn_g = add(p + "attn.q_norm.weight", {rq}, 0.1, 1, whole);
    if (shift) L.qdn_b = add(p + "attn.q_norm.bias", {rq}, 0.1, 0, whole);
    q_in = rq;
  }
  const std::string q = rq > 0 ? "attn.q_up" : "attn.q";
  L.q_w = add(p + q + ".weight", {q_in, a * dqk}, 0.05, 0, heads_of(dqk));
  if (m.bias) L.q_b = add(p + q + ".bias", {a * dqk}, 0.05, 0, heads_of(dqk));
  L.kvd_w = add(p + "attn.kv_down.weight", {h, rkv + dr}, 0.05, 0, whole);
  if (m.bias) L.kvd_b = add(p + "attn.kv_down.bias", {rkv + dr}, 0.05, 0, whole);
  L.kvn_g = add(p + "attn.kv_norm.weight", {rkv}, 0.1, 1, whole);
  if (shift) L.kvn_b = add(p + "attn.kv_norm.bias", {rkv}, 0.1, 0, whole);
  L.kvu_w = add(p + "attn.kv_up.weight", {rkv, a * dkv}, 0.05, 0, heads_of(dkv));
  if (m.bias) L.kvu_b = add(p + "attn.kv_up.bias", {a * dkv}, 0.05, 0, heads_of(dkv));
}

void Model::latent_attention_forward(RankContext& c, int l, LayerTape& t, const LayerPass& p) {
  RunStats& st = *c.stats;
  const LayerParams& L = layers_[l];
  const bool sp = split_.seq > 1;
  const int64_t rkv = spec_.kv_lora_rank, dr = spec_.qk_rope_head_dim;
  auto linear = [this](const Param* w, const Param* b) {
    return [this, w, b](const std::vector<at::Tensor>& in) {
      at::Tensor y = block_linear(in[0], W(w));
      return b ? y + W(b) : y;
    };
  };
  const char* q_op = spec_.q_lora_rank > 0 ? "attn.q_up" : "attn.q";
  if (spec_.q_lora_rank > 0) {
    if (p.runs("attn.q_down")) {
      t.qdown = fwd(st, "attn.q_down", p.phase, {leaf(t.n1.out)}, linear(L.qd_w, L.qd_b));
      t.qdown.weights = weights_of({L.qd_w, L.qd_b});
    }
    if (p.runs("attn.q_norm")) {
      t.qnorm =
          fwd(st, "attn.q_norm", p.phase, {leaf(t.qdown.out)},
              [&](const std::vector<at::Tensor>& in) { return norm(in[0], L.qdn_g, L.qdn_b); });
    }
  }
  if (p.runs(q_op)) {
    t.q = fwd(st, q_op, p.phase,
              {column_input(c, (spec_.q_lora_rank > 0 ? t.qnorm : t.n1).out, q_op)},
              linear(L.q_w, L.q_b));
    t.q.weights = weights_of({L.q_w, L.q_b});
    drop_gathered(p, q_op, t.q);
  }
  if (p.runs("attn.kv_down")) {
    t.kvdown = fwd(st, "attn.kv_down", p.phase, {leaf(t.n1.out)}, linear(L.kvd_w, L.kvd_b));
    t.kvdown.weights = weights_of({L.kvd_w, L.kvd_b});
  }
  if (p.runs("attn.kv_norm")) {
    t.kvnorm = fwd(
        st, "attn.kv_norm", p.phase, {leaf(t.kvdown.out)}, [&](const std::vector<at::Tensor>& in) {
          return at::cat(
              {norm(in[0].narrow(-1, 0, rkv), L.kvn_g, L.kvn_b), in[0].narrow(-1, rkv, dr)}, -1);
        });
  }
  if (p.runs("attn.kv_up")) {
    // The latent and the rotary key part (gathered together under sequence parallelism), taken
    // apart: the up-projection keeps the latent only (its gathered copy dropped after the
    // forward, as a column-parallel linear's), the core reads the rotary part.
    const at::Tensor both =
        sp ? gather_seq(c, t.kvnorm.out.detach(), "attn.kv_up") : t.kvnorm.out.detach();
    t.kpe = both.narrow(-1, rkv, dr).contiguous();
    t.kvup = fwd(st, "attn.kv_up", p.phase, {leaf(both.narrow(-1, 0, rkv).contiguous())},
                 linear(L.kvu_w, L.kvu_b));
    t.kvup.weights = weights_of({L.kvu_w, L.kvu_b});
    drop_gathered(p, "attn.kv_up", t.kvup);
    // Without sequence parallelism nothing reads the norm's output again (its backward reads
    // its input), unless a recomputed up-projection does.
    if (!sp && !(p.rc.count("attn.kv_up") && !p.rc.count("attn.kv_norm")) && !p.again) {
      release_output(t.kvnorm, false);
    }
  }
  if (p.runs("attn.core") && split_.cp > 1) {
    t.core = cp_latent_core_forward(c, t.q.out, t.kvup.out, t.kpe, p.phase, t.key, first_ + l);
  } else if (p.runs("attn.core")) {
    t.core =
        fwd(st, "attn.core", p.phase, {leaf(t.q.out), leaf(t.kvup.out), leaf(t.kpe)},
            [&](const std::vector<at::Tensor>& in) { return latent_attention_core(in, t.key, l); });
  }
}

// The queries, keys and values as latent_attention_core forms them, for the ring attention.
Unit Model::cp_latent_core_forward(RankContext& c, const at::Tensor& q, const at::Tensor& kv,
                                   const at::Tensor& kpe, const char* phase, const DropoutKey& key,
                                   int layer) {
  RunStats& st = *c.stats;
  const Mark t0 = st.mark();
  Unit u;
  u.in = {leaf(q), leaf(kv), leaf(kpe)};
  const int64_t dn = spec_.qk_nope_head_dim, dr = spec_.qk_rope_head_dim, dv = spec_.v_head_dim,
                al = spec_.heads / split_.heads;
  const int64_t b = q.size(0), sl = q.size(1);
  const at::Tensor qh = u.in[0].view({b, sl, al, dn + dr});
  const at::Tensor kvh = u.in[1].view({b, sl, al, dn + dv});
  at::Tensor q_rope = qh.narrow(3, dn, dr), k_rope = u.in[2].view({b, sl, 1, dr});
  if (spec_.position == PositionKind::kRope) {
    q_rope = rope(q_rope);
    k_rope = rope(k_rope);
  }
  const at::Tensor queries = at::cat({qh.narrow(3, 0, dn), q_rope}, 3);
  const at::Tensor keys = at::cat({kvh.narrow(3, 0, dn), k_rope.expand({b, sl, al, dr})}, 3);
  cp_attend(c, u, queries, keys, kvh.narrow(3, dn, dv), key, layer);
  st.op("attn.core", phase, t0, st.mark(), /*minus_collectives=*/true);
  return u;
}

// Each head's query is its d_nope + d_rope columns of the query projection; its key the first
// d_nope columns of its key/value up-projection with the rotary key part (shared by the heads)
// after them, its value the up-projection's other d_v columns; the rotary embedding turns the
// queries' and the key's rotary parts.
at::Tensor Model::latent_attention_core(const std::vector<at::Tensor>& in, const DropoutKey& key,
                                        int l) {
  const int64_t dn = spec_.qk_nope_head_dim, dr = spec_.qk_rope_head_dim, dv = spec_.v_head_dim,
                al = spec_.heads / split_.heads;
  const int64_t b = in[0].size(0), s = in[0].size(1);
  const at::Tensor q = in[0].view({b, s, al, dn + dr});
  const at::Tensor kv = in[1].view({b, s, al, dn + dv});
  at::Tensor q_rope = q.narrow(3, dn, dr), k_rope = in[2].view({b, s, 1, dr});
  if (spec_.position == PositionKind::kRope) {
    q_rope = rope(q_rope);
    k_rope = rope(k_rope);
  }
  const at::Tensor queries = at::cat({q.narrow(3, 0, dn), q_rope}, 3);
  const at::Tensor keys = at::cat({kv.narrow(3, 0, dn), k_rope.expand({b, s, al, dr})}, 3);
  return attend(queries, keys, kv.narrow(3, dn, dv), key, l);
}

// The program's order: the core, the key/value latent's operators, the query's.
at::Tensor Model::latent_attention_backward(RankContext& c, LayerTape& t, const at::Tensor& d,
                                            const std::set<std::string>& rc) {
  RunStats& st = *c.stats;
  // The query's, the key/value up-projection's and the rotary key part's gradients.
  std::vector<at::Tensor> dc =
      split_.cp > 1 ? cp_core_backward(c, t.core, d) : bwd(st, "attn.core", t.core, d);
  t.kpe = at::Tensor();
  release_output(t.q, false);
  release_output(t.kvup, false);
  // The key/value latent: the up-projection's input gradient and the core's rotary key part's
  // beside it, summed over tp (reduce-scattered under sequence parallelism).
  at::Tensor dl =
      column_parallel_backward(c, "attn.kv_up", t.kvup, t.kvnorm, dc[1], rc, split_.heads, dc[2]);
  dl = bwd(st, "attn.kv_norm", t.kvnorm, dl)[0];
  release_output(t.kvdown, false);
  const bool kv_down_defers = defers_weights(t.kvdown);
  at::Tensor dx = bwd(st, "attn.kv_down", t.kvdown, dl)[0];
  if (spec_.q_lora_rank > 0) {
    dl = column_parallel_backward(c, "attn.q_up", t.q, t.qnorm, dc[0], rc, split_.heads);
    dl = bwd(st, "attn.q_norm", t.qnorm, dl)[0];
    release_output(t.qdown, false);
    const bool q_down_defers = defers_weights(t.qdown);
    dx = dx + bwd(st, "attn.q_down", t.qdown, dl)[0];
    release_output(t.n1, kv_down_defers || q_down_defers);
    return dx;
  }
  return dx + column_parallel_backward(c, "attn.q", t.q, t.n1, dc[0], rc, split_.heads,
                                       at::Tensor(), kv_down_defers);
}

}  // namespace nnsim::hwexec
