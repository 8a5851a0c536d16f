// Context-parallel causal attention (run_context_parallel.h).
#include "hwexec/run_context_parallel.h"

#include <cmath>
#include <limits>

#include "hwexec/run_model_masks.h"

namespace nnsim::hwexec {

namespace {

// Key/value heads [b, kv_heads, n, d] repeated for their groups of query heads [b, heads, n, d]
// (head h of the queries uses key/value head h / group, as run_torch.cc lays attn.qkv out).
at::Tensor expand_heads(const at::Tensor& x, int64_t heads) {
  const int64_t b = x.size(0), kh = x.size(1), n = x.size(2), d = x.size(3), g = heads / kh;
  if (g == 1) return x;
  return x.unsqueeze(2).expand({b, kh, g, n, d}).reshape({b, heads, n, d});
}

// The gradient of expand_heads: each key/value head's group summed.
at::Tensor sum_groups(const at::Tensor& x, int64_t kv_heads) {
  const int64_t b = x.size(0), heads = x.size(1), n = x.size(2), d = x.size(3);
  if (heads == kv_heads) return x;
  return x.view({b, kv_heads, heads / kv_heads, n, d}).sum(2);
}

// True where query position i may not see key position j: j after i, or (window > 0) j a
// window or more behind it. [sl, n].
at::Tensor hidden_keys(const at::Tensor& q_pos, const at::Tensor& k_pos, int64_t window) {
  const at::Tensor behind = q_pos.unsqueeze(1) - k_pos.unsqueeze(0);  // i - j
  at::Tensor hidden = behind < 0;
  if (window > 0) hidden = hidden.logical_or(behind >= window);
  return hidden;
}

}  // namespace

at::Tensor cp_positions(int64_t seq, int ways, int index) {
  const int64_t c = seq / (2 * static_cast<int64_t>(ways));
  return at::cat({at::arange(index * c, (index + 1) * c, at::kLong),
                  at::arange((2 * ways - 1 - index) * c, (2 * ways - index) * c, at::kLong)});
}

at::Tensor cp_attention_forward(const at::Tensor& q, const at::Tensor& k_all,
                                const at::Tensor& v_all, int index, int64_t seq,
                                CpAttentionSaved* s) {
  s->index = index;
  s->seq = seq;
  const int64_t ways = k_all.size(0), b = k_all.size(1), kh = k_all.size(2), sl = k_all.size(3),
                d = k_all.size(4), heads = q.size(1);
  const auto dev = q.device();
  // Every rank's keys and values side by side along the sequence, with their positions.
  auto side_by_side = [&](const at::Tensor& all) {
    return all.permute({1, 2, 0, 3, 4}).reshape({b, kh, ways * sl, all.size(4)});
  };
  const at::Tensor k = expand_heads(side_by_side(k_all).to(at::kFloat), heads);
  const at::Tensor v = expand_heads(side_by_side(v_all).to(at::kFloat), heads);
  std::vector<at::Tensor> pos;
  for (int64_t j = 0; j < ways; ++j) {
    pos.push_back(cp_positions(s->seq, static_cast<int>(ways), static_cast<int>(j)));
  }
  const at::Tensor k_pos = at::cat(pos).to(dev), q_pos = pos[s->index].to(dev);
  const at::Tensor qf = q.to(at::kFloat);
  at::Tensor scores = at::matmul(qf, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  if (s->slopes.defined()) scores = scores + alibi_bias(s->slopes, q_pos, k_pos);
  scores = scores.masked_fill(hidden_keys(q_pos, k_pos, s->window),
                              -std::numeric_limits<float>::infinity());
  s->lse = at::logsumexp(scores, -1);
  at::Tensor p = at::exp(scores - s->lse.unsqueeze(-1));
  if (s->drop.defined()) p = p * s->drop.index_select(-1, k_pos);
  s->out = at::matmul(p, v);
  s->q = qf;
  // Copies: a view would keep every rank's keys and values alive until the backward.
  s->k = k_all.select(0, s->index).clone();
  s->v = v_all.select(0, s->index).clone();
  s->ways = static_cast<int>(ways);
  return s->out;
}

std::array<at::Tensor, 3> cp_attention_backward(const CpAttentionSaved& s, const at::Tensor& dout,
                                                const RingStep& step) {
  const int f = s.ways;
  const int64_t heads = s.q.size(1), kh = s.k.size(1), d = s.q.size(3);
  // What a ring step carries: tensors flattened one after another (keys and values may differ in
  // width), and taken apart again in their shapes.
  auto pass = [&](std::vector<at::Tensor*> ts) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor* t : ts) flat.push_back(t->reshape({-1}));
    const at::Tensor got = step(at::cat(flat).to(s.k.scalar_type())).to(at::kFloat);
    int64_t offset = 0;
    for (at::Tensor* t : ts) {
      *t = got.narrow(0, offset, t->numel()).view(t->sizes());
      offset += t->numel();
    }
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto dev = s.q.device();
  const at::Tensor q_pos = cp_positions(s.seq, f, s.index).to(dev);
  const at::Tensor dO = dout.to(at::kFloat);
  // D_i = sum_d dO_i O_i: softmax's backward term of each query.
  const at::Tensor D = (dO * s.out).sum(-1, /*keepdim=*/true);
  at::Tensor dq = at::zeros_like(s.q);
  // The chunk held: rank j's keys and values and the gradients collected for them so far.
  at::Tensor k = s.k.to(at::kFloat), v = s.v.to(at::kFloat);
  at::Tensor dk = at::zeros_like(k), dv = at::zeros_like(v);
  for (int i = 0; i < f; ++i) {
    const int j = ((s.index - i) % f + f) % f;
    const at::Tensor ke = expand_heads(k, heads), ve = expand_heads(v, heads);
    const at::Tensor k_pos = cp_positions(s.seq, f, j).to(dev);
    // The probabilities of this rank's queries over chunk j (0 where masked).
    at::Tensor logits = at::matmul(s.q, ke.transpose(-2, -1)) * scale;
    if (s.slopes.defined()) logits = logits + alibi_bias(s.slopes, q_pos, k_pos);
    const at::Tensor p = at::exp(logits.masked_fill(hidden_keys(q_pos, k_pos, s.window),
                                                    -std::numeric_limits<float>::infinity()) -
                                 s.lse.unsqueeze(-1));
    // Dropout: the output used the kept probabilities (p m); D = sum dO O is still the sum of
    // p times the kept gradient dP m.
    const at::Tensor m = s.drop.defined() ? s.drop.index_select(-1, k_pos) : at::Tensor();
    dv += sum_groups(at::matmul((m.defined() ? p * m : p).transpose(-2, -1), dO), kh);
    at::Tensor dp = at::matmul(dO, ve.transpose(-2, -1));
    if (m.defined()) dp = dp * m;
    const at::Tensor ds = p * (dp - D);
    dq += at::matmul(ds, ke) * scale;
    dk += sum_groups(at::matmul(ds.transpose(-2, -1), s.q), kh) * scale;
    // Pass the chunk on (in the compute dtype); take the previous rank's (chunk j - 1).
    if (i + 1 < f) pass({&k, &v, &dk, &dv});
  }
  // Every rank has added to the chunk held now (rank index + 1's): its owner is next.
  pass({&dk, &dv});
  return {dq, dk, dv};
}

}  // namespace nnsim::hwexec
