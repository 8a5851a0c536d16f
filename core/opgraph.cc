#include "core/opgraph.h"

#include <algorithm>
#include <cmath>

namespace nnsim {

std::string_view to_string(Dim d) {
  switch (d) {
    case Dim::kBatch:
      return "batch";
    case Dim::kSeq:
      return "seq";
    case Dim::kHidden:
      return "hidden";
    case Dim::kHeads:
      return "heads";
    case Dim::kFfn:
      return "ffn";
    case Dim::kVocab:
      return "vocab";
    case Dim::kExpert:
      return "expert";
    case Dim::kLatent:
      return "latent";
  }
  return "?";
}

bool parse_dim(std::string_view name, Dim* out) {
  for (int i = 0; i < kNumDims; ++i) {
    if (to_string(static_cast<Dim>(i)) == name) {
      *out = static_cast<Dim>(i);
      return true;
    }
  }
  return false;
}

std::vector<std::string> dim_names() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumDims; ++i) names.emplace_back(to_string(static_cast<Dim>(i)));
  return names;
}

std::string_view to_string(OpKind k) {
  switch (k) {
    case OpKind::kEmbedding:
      return "embedding";
    case OpKind::kNorm:
      return "norm";
    case OpKind::kLinear:
      return "linear";
    case OpKind::kAttention:
      return "attention";
    case OpKind::kActivation:
      return "activation";
    case OpKind::kDropoutAdd:
      return "dropout_add";
    case OpKind::kAdd:
      return "add";
    case OpKind::kLoss:
      return "loss";
    case OpKind::kPermute:
      return "permute";
    case OpKind::kScan:
      return "scan";
  }
  return "?";
}

double Op::parameters() const {
  if (tied_to_embedding) return 0;
  double n = 0;
  for (const auto& w : weights) n += w.elements;
  return n;
}

// A windowed layer's query at position i sees min(i + 1, w) keys: w s - w (w - 1) / 2 pairs of
// the full s (s + 1) / 2; the other layers see them all. The layers of a part share one
// operator graph, priced at the model's average; the compiler prices each layer's attention
// at its own share (PartInfo::window_costs).
double window_attended_fraction(const ModelSpec& m) {
  if (!m.windowed()) return 1;
  const double s = static_cast<double>(m.seq_len), w = static_cast<double>(m.sliding_window);
  return (w * s - w * (w - 1) / 2) / (s * (s + 1) / 2);
}

double layer_attended_fraction(const ModelSpec& m, int layer) {
  return m.is_windowed_layer(layer) ? window_attended_fraction(m) : 1;
}

double attended_fraction(const ModelSpec& m) {
  if (!m.windowed() || m.layers == 0) return 1;
  double sum = 0;
  for (int l = 0; l < m.layers; ++l) sum += layer_attended_fraction(m, l);
  return sum / m.layers;
}

namespace {

constexpr TensorRef kPartInput{-1, 0};

// Shapes shared by the builders below, as doubles (FLOP and byte counts overflow int64 quickly
// for large models only in products, but doubles keep every formula in one type).
struct Shape {
  double b, s, h, a, k, dh, f, v, p;
  double e, top;  // experts and experts per token (0 for a dense model)
  double slots;   // expert slots per token: top x the capacity factor
  // Multi-head latent attention (0 without): the latents' widths, the query/key and the value
  // head widths, and the rotary part of the query/key.
  double q_lora, kv_lora, dqk, dv, rope;
  // Mamba-2 (0 without 'M' layers): heads, head width, state, groups, convolution taps, chunk.
  double mh, mp, mn, mg, mk, mq;
  // Gated DeltaNet (0 without 'G' layers): key and value heads, their widths, convolution taps,
  // chunk.
  double gk, gv, gdk, gdv, gconv, gchunk;
  double gate;  // the attention output gate's channels (0 without)
  int64_t mb, seq, hidden, kv_heads, ffn, vocab, experts, mamba_groups, gdn_key_heads;
  double qkv_width() const { return (a + 2 * k) * dh; }
  // The Q, K, V projection's output: Q, K, V and the output gate's channels.
  double qkv_out_width() const { return qkv_width() + gate; }
};

Shape shape_of(const ModelSpec& m, int64_t micro_batch) {
  Shape x{};
  x.b = static_cast<double>(micro_batch);
  x.s = static_cast<double>(m.seq_len);
  x.h = static_cast<double>(m.hidden);
  x.a = static_cast<double>(m.heads);
  x.k = static_cast<double>(m.kv_heads);
  x.dh = static_cast<double>(m.head_dim());
  x.f = static_cast<double>(m.ffn_hidden);
  x.v = static_cast<double>(m.vocab);
  // Activations are 16-bit in mixed precision (fp8 training keeps bf16 activations too).
  x.p = m.precision == Precision::kFp32 || m.precision == Precision::kTf32 ? 4 : 2;
  x.e = static_cast<double>(m.experts);
  x.top = static_cast<double>(m.experts_per_token);
  x.slots = x.top * m.expert_capacity_factor;
  if (m.mla()) {
    x.q_lora = static_cast<double>(m.q_lora_rank);
    x.kv_lora = static_cast<double>(m.kv_lora_rank);
    x.rope = static_cast<double>(m.qk_rope_head_dim);
    x.dqk = static_cast<double>(m.qk_nope_head_dim + m.qk_rope_head_dim);
    x.dv = static_cast<double>(m.v_head_dim);
  }
  if (m.has_layer_kind('M')) {
    x.mh = static_cast<double>(m.mamba_heads);
    x.mp = static_cast<double>(m.mamba_head_dim);
    x.mn = static_cast<double>(m.mamba_state);
    x.mg = static_cast<double>(m.mamba_groups);
    x.mk = static_cast<double>(m.mamba_conv);
    x.mq = static_cast<double>(m.mamba_chunk);
    x.mamba_groups = m.mamba_groups;
  }
  if (m.has_layer_kind('G')) {
    x.gk = static_cast<double>(m.gdn_key_heads);
    x.gv = static_cast<double>(m.gdn_value_heads);
    x.gdk = static_cast<double>(m.gdn_key_head_dim);
    x.gdv = static_cast<double>(m.gdn_value_head_dim);
    x.gconv = static_cast<double>(m.gdn_conv);
    x.gchunk = static_cast<double>(m.gdn_chunk);
    x.gdn_key_heads = m.gdn_key_heads;
  }
  if (m.attention_output_gate) x.gate = x.a * x.dh;
  x.mb = micro_batch;
  x.seq = m.seq_len;
  x.hidden = m.hidden;
  x.kv_heads = m.kv_heads;
  x.ffn = m.ffn_hidden;
  x.vocab = m.vocab;
  x.experts = m.experts;
  return x;
}

void set_granularity(Op& op, const Shape& x) {
  op.granularity[static_cast<int>(Dim::kBatch)] = x.mb;
  op.granularity[static_cast<int>(Dim::kSeq)] = x.seq;
  op.granularity[static_cast<int>(Dim::kHidden)] = x.hidden;
  op.granularity[static_cast<int>(Dim::kHeads)] = x.kv_heads;  // heads split by KV group
  op.granularity[static_cast<int>(Dim::kFfn)] = x.ffn;
  op.granularity[static_cast<int>(Dim::kVocab)] = x.vocab;
  op.granularity[static_cast<int>(Dim::kExpert)] = x.experts;
}

TensorSpec tensor(TensorRef ref, double elements, DimSet dims, double bytes_per_element) {
  TensorSpec t;
  t.ref = ref;
  t.elements = elements;
  t.dims = dims;
  t.bytes_per_element = bytes_per_element;
  return t;
}

// The op's own output as a tensor reference.
TensorRef out(int op) {
  return TensorRef{op, 0};
}

// A norm over `width` elements of dimension `dim` (the hidden state's, or a latent's). Its
// output carries `carried` more elements a token through unnormalized (the rotary key part
// riding with the key/value latent).
Op norm_op(const std::string& name, int self, TensorRef input, const ModelSpec& m, const Shape& x,
           Dim dim = Dim::kHidden, double width = 0, double carried = 0) {
  if (width == 0) width = x.h;
  Op op;
  op.name = name;
  op.kind = OpKind::kNorm;
  const DimSet bsw{Dim::kBatch, Dim::kSeq, dim};
  op.dims = bsw;
  op.unsplittable = {dim};  // statistics over the width need all of it
  op.inputs = {input};
  const double elements = x.b * x.s * width;
  op.output = tensor(out(self), x.b * x.s * (width + carried), bsw, x.p);
  // Its scale and, for LayerNorm with biases, its shift: two tensors (two parameters in every
  // framework; DeepSpeed's ZeRO-3 gathers each on its own).
  op.weights = {tensor(TensorRef{self, 1}, width, {dim}, x.p)};
  if (m.norm == NormKind::kLayerNorm && m.bias) {
    op.weights.push_back(tensor(TensorRef{self, 2}, width, {dim}, x.p));
  }
  op.saved = {tensor(input, elements, bsw, x.p)};
  op.fwd_bytes = 2 * elements * x.p;  // read x, write y
  op.bwd_bytes = 3 * elements * x.p;  // read x and dy, write dx
  set_granularity(op, x);
  if (dim == Dim::kLatent) {
    op.granularity[static_cast<int>(Dim::kLatent)] = std::llround(width + carried);
  }
  return op;
}

// y[b,s,out] = x[b,s,in] . W[in,out] (+ bias). With `experts` > 0, one such layer per expert,
// each over the tokens routed to it (`tokens` in all, a grouped GEMM): the tokens and the weights
// also span the expert dimension.
Op linear_op(const std::string& name, int self, TensorRef input, Dim in_dim, double in_size,
             Dim out_dim, double out_size, bool bias, const Shape& x, double experts = 0,
             double tokens = 0) {
  if (tokens == 0) tokens = x.b * x.s;
  const double copies = experts > 0 ? experts : 1;
  DimSet token_dims{Dim::kBatch, Dim::kSeq};
  DimSet weight_dims;
  if (experts > 0) {
    token_dims = token_dims.with(Dim::kExpert);
    weight_dims = weight_dims.with(Dim::kExpert);
  }
  Op op;
  op.name = name;
  op.kind = OpKind::kLinear;
  op.dims = token_dims.with(in_dim).with(out_dim);
  op.reduced = {in_dim};
  op.inputs = {input};
  op.output = tensor(out(self), tokens * out_size, token_dims.with(out_dim), x.p);
  op.weights = {tensor(TensorRef{self, 1}, copies * in_size * out_size,
                       weight_dims.with(in_dim).with(out_dim), x.p)};
  if (bias) {
    op.weights.push_back(
        tensor(TensorRef{self, 2}, copies * out_size, weight_dims.with(out_dim), x.p));
  }
  op.saved = {tensor(input, tokens * in_size, token_dims.with(in_dim), x.p)};
  op.fwd_flops = 2 * tokens * in_size * out_size;
  op.gemm = GemmShape{tokens, out_size, in_size, out_dim, in_dim};
  op.bwd_input_flops = op.fwd_flops;
  op.bwd_weight_flops = op.fwd_flops;
  op.fwd_bytes = (tokens * (in_size + out_size) + copies * in_size * out_size) * x.p;
  op.bwd_bytes = 2 * op.fwd_bytes;
  set_granularity(op, x);
  return op;
}

Op dropout_add_op(const std::string& name, int self, std::vector<TensorRef> inputs, bool dropout,
                  const Shape& x) {
  Op op;
  op.name = name;
  op.kind = OpKind::kDropoutAdd;
  op.dims = {Dim::kBatch, Dim::kSeq, Dim::kHidden};
  op.inputs = std::move(inputs);
  const double bsh = x.b * x.s * x.h;
  op.output = tensor(out(self), bsh, {Dim::kBatch, Dim::kSeq, Dim::kHidden}, x.p);
  if (dropout) {
    op.saved = {tensor(TensorRef{self, 1}, bsh, {Dim::kBatch, Dim::kSeq, Dim::kHidden}, 1)};
  }
  const double reads = static_cast<double>(op.inputs.size());
  op.fwd_bytes = (reads + 1) * bsh * x.p + (dropout ? bsh : 0);
  op.bwd_bytes = (reads + 1) * bsh * x.p + (dropout ? bsh : 0);
  set_granularity(op, x);
  return op;
}

// The rest of an attention core once its inputs, output and saved inputs are set: what either
// kernel keeps and moves beyond them and the context-parallel ring. `io`: bytes its kernels read
// and write besides the scores; `kv_bytes`: the K and V a device passes to its ring neighbour.
void finish_attention(Op& op, int self, double io, double kv_bytes, const ModelSpec& m,
                      const Shape& x) {
  // A fused causal kernel skips the masked half of the scores, and the keys outside a sliding
  // window; the unfused chain (batched matmul, masked softmax, batched matmul) computes all of
  // them.
  op.causal = m.attention == AttentionKernel::kFlash;
  op.attended_fraction = attended_fraction(m);
  op.fwd_flops *= op.attended_fraction;
  const DimSet bsn{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  const double scores = x.b * x.a * x.s * x.s;  // spans batch, heads and the query sequence
  if (m.attention == AttentionKernel::kUnfused) {
    op.saved.push_back(tensor(TensorRef{self, 1}, scores, bsn, x.p));  // softmax output
    if (m.dropout) {
      op.saved.push_back(tensor(TensorRef{self, 2}, scores, bsn, 1));    // dropout mask
      op.saved.push_back(tensor(TensorRef{self, 3}, scores, bsn, x.p));  // dropout output
    }
    op.transient_bytes = 2 * scores * x.p;  // raw scores and their gradient
    // Every kernel of the chain passes over the scores. Forward: the matmul writes them, the
    // softmax reads and writes, dropout reads, writes and writes its mask, the matmul with V
    // reads. Backward: the probabilities' gradient written and the probabilities read (for
    // dV), dropout's backward (two reads, the mask, a write), softmax's (three), and the
    // scores' gradient read for dQ and for dK.
    const double fwd_passes = m.dropout ? 6 * x.p + 1 : 4 * x.p;
    const double bwd_passes = m.dropout ? 9 * x.p + 1 : 7 * x.p;
    op.fwd_bytes = io + scores * fwd_passes;
    op.bwd_bytes = 2 * io + scores * bwd_passes;
  } else {
    // FlashAttention keeps its output and the log-sum-exp of each row (fp32).
    op.saved.push_back(op.output);
    op.saved.push_back(tensor(TensorRef{self, 1}, x.b * x.a * x.s, bsn, 4));
    op.fwd_bytes = io;
    op.bwd_bytes = 2 * op.fwd_bytes;
  }
  op.bwd_input_flops = 2 * op.fwd_flops;
  op.seq = x.s;
  // Context parallelism splits the query sequence: each device passes its K and V chunk around a
  // ring (ways - 1 steps), overlapped with attention on the chunk it holds; the backward pass
  // passes K, V and their gradients.
  InternalComm ring;
  ring.dim = Dim::kSeq;
  ring.kind = InternalComm::Kind::kRingExchange;
  ring.dims = bsn;
  ring.fwd_bytes = kv_bytes;
  ring.bwd_bytes = 2 * ring.fwd_bytes;
  ring.fwd_calls = 1;
  ring.bwd_calls = 1;
  ring.overlaps_compute = true;
  op.internal_comm = {ring};
  set_granularity(op, x);
}

// Per-head norms of the queries and keys (Qwen3's, OLMo 2's; Megatron-Core's --qk-layernorm):
// each head's d-wide query and key normalized, with one scale for the queries and one for the
// keys that every head shares. Statistics are per head, so it splits along the heads as the
// projection before it does.
Op qk_norm_op(int self, TensorRef qkv, const ModelSpec& m, const Shape& x) {
  Op op;
  op.name = "attn.qk_norm";
  op.kind = OpKind::kNorm;
  const DimSet bsn{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsn;
  op.inputs = {qkv};
  const double tokens = x.b * x.s;
  const double qk = tokens * (x.a + x.k) * x.dh;
  op.output = tensor(out(self), qk, bsn, x.p);
  op.weights = {tensor(TensorRef{self, 1}, x.dh, {}, x.p),
                tensor(TensorRef{self, 2}, x.dh, {}, x.p)};
  if (m.norm == NormKind::kLayerNorm && m.bias) {
    op.weights.push_back(tensor(TensorRef{self, 3}, x.dh, {}, x.p));
    op.weights.push_back(tensor(TensorRef{self, 4}, x.dh, {}, x.p));
  }
  // Its input is a view of the projection's output, whose storage the attention keeps for V.
  op.saved = {tensor(qkv, tokens * x.qkv_out_width(), bsn, x.p)};
  op.fwd_bytes = 2 * qk * x.p;  // read x, write y
  op.bwd_bytes = 3 * qk * x.p;  // read x and dy, write dx
  set_granularity(op, x);
  return op;
}

// The attention over the projection's Q, K and V, or (`qk_norm` >= 0) over that operator's
// normalized Q and K and the projection's V.
Op attention_op(int self, TensorRef qkv, const ModelSpec& m, const Shape& x, int qk_norm = -1) {
  Op op;
  op.name = "attn.core";
  op.kind = OpKind::kAttention;
  op.dims = {Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.inputs = {qkv};
  const double tokens = x.b * x.s;
  const DimSet bsn{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.output = tensor(out(self), tokens * x.a * x.dh, bsn, x.p);
  // Q, K and V are the projection's output: kept as one tensor (with the output gate's channels,
  // views of the same storage).
  op.saved = {tensor(qkv, tokens * x.qkv_out_width(), bsn, x.p)};
  if (qk_norm >= 0) {
    op.inputs = {out(qk_norm), qkv};
    op.saved.insert(op.saved.begin(), tensor(out(qk_norm), tokens * (x.a + x.k) * x.dh, bsn, x.p));
  }
  // Q.K^T and softmax(.).V: 2 * (2 * b * s * s * a * dh), counted in full (Megatron).
  op.fwd_flops = 4 * x.b * x.s * x.s * x.a * x.dh;
  op.head_dim = x.dh;
  finish_attention(op, self, tokens * (x.qkv_width() + x.a * x.dh) * x.p,
                   tokens * 2 * x.k * x.dh * x.p, m, x);
  return op;
}

// The attention's output gated per channel by the sigmoid of the projection's gate channels
// (Qwen3-Next; Megatron-Core's --attention-output-gate): it keeps both for the backward.
Op attention_gate_op(int self, TensorRef core, TensorRef qkv, const Shape& x) {
  Op op;
  op.name = "attn.gate";
  op.kind = OpKind::kActivation;
  const DimSet bsn{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsn;
  op.inputs = {core, qkv};
  const double elements = x.b * x.s * x.gate;
  op.output = tensor(out(self), elements, bsn, x.p);
  op.saved = {tensor(core, elements, bsn, x.p),
              tensor(qkv, x.b * x.s * x.qkv_out_width(), bsn, x.p)};
  op.fwd_bytes = 3 * elements * x.p;  // read the output and the gate, write
  op.bwd_bytes = 5 * elements * x.p;  // read dy, the output and the gate, write both gradients
  set_granularity(op, x);
  return op;
}

// Multi-head latent attention's core: each head's query (from `q`) and key are dqk wide (the
// rotary part of the key is shared by the heads), its value dv. The rotary parts are
// concatenated onto fresh Q and K tensors (Megatron-Core's MLA), which the kernel keeps with V (a
// view of the key/value up-projection's output, which it keeps alive) for the backward pass.
Op mla_attention_op(int self, TensorRef q, TensorRef kv, const ModelSpec& m, const Shape& x) {
  Op op;
  op.name = "attn.core";
  op.kind = OpKind::kAttention;
  op.dims = {Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.inputs = {q, kv};
  const double tokens = x.b * x.s;
  const DimSet bsn{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  const double qk_width = x.a * x.dqk, v_width = x.a * x.dv;
  const double kv_width = x.a * (x.dqk - x.rope + x.dv);  // the up-projection's output
  op.output = tensor(out(self), tokens * v_width, bsn, x.p);
  op.saved = {tensor(TensorRef{self, 4}, tokens * 2 * qk_width, bsn, x.p),  // Q and K
              tensor(kv, tokens * kv_width, bsn, x.p)};                     // V's storage
  // Q.K^T over dqk and softmax(.).V over dv, counted in full (Megatron-Core's count for MLA).
  op.fwd_flops = 2 * x.b * x.s * x.s * x.a * (x.dqk + x.dv);
  op.head_dim = x.dqk;
  // The concatenation reads the projections and writes Q and K; the kernel reads Q, K, V and
  // writes the output. Context parallelism passes every head's K and V around the ring.
  const double io = tokens * (qk_width + kv_width + 2 * qk_width + 2 * qk_width + 2 * v_width);
  finish_attention(op, self, io * x.p, tokens * (qk_width + v_width) * x.p, m, x);
  // The kernel's backward writes the gradients of the fresh Q and K, which the concatenation's
  // backward then takes apart into the projections' gradients: both held at once.
  op.transient_bytes += tokens * 2 * qk_width * x.p;
  return op;
}

// Multi-head latent attention after the block's norm (operator 0), appended to `ops`: the
// queries (through their latent when q_lora_rank > 0), the key/value latent with the rotary key
// part, its norm and up-projection, the core and the output projection. Returns the output
// projection's index. The rotary key part rides with the key/value latent through its norm
// (unnormalized) and the up-projection's input, which reads only the latent: so it travels with
// the latent wherever that is gathered or its gradient summed, as Megatron-Core moves it beside
// the latent (its own all-gather under sequence parallelism); the core reads it from there.
int add_mla_ops(std::vector<Op>& ops, const ModelSpec& m, const Shape& x) {
  auto next = [&] { return static_cast<int>(ops.size()); };
  auto latent = [&](Op op, double width) {
    op.granularity[static_cast<int>(Dim::kLatent)] = std::llround(width);
    return op;
  };
  const double qk_width = x.a * x.dqk;
  int q = next();
  if (x.q_lora > 0) {
    ops.push_back(latent(
        linear_op("attn.q_down", q, out(0), Dim::kHidden, x.h, Dim::kLatent, x.q_lora, m.bias, x),
        x.q_lora));
    ops.push_back(norm_op("attn.q_norm", q + 1, out(q), m, x, Dim::kLatent, x.q_lora));
    ops.push_back(latent(linear_op("attn.q_up", q + 2, out(q + 1), Dim::kLatent, x.q_lora,
                                   Dim::kHeads, qk_width, m.bias, x),
                         x.q_lora));
    q += 2;
  } else {
    ops.push_back(
        linear_op("attn.q", q, out(0), Dim::kHidden, x.h, Dim::kHeads, qk_width, m.bias, x));
  }
  const int kv = next();
  const double kv_down_width = x.kv_lora + x.rope;
  ops.push_back(latent(linear_op("attn.kv_down", kv, out(0), Dim::kHidden, x.h, Dim::kLatent,
                                 kv_down_width, m.bias, x),
                       kv_down_width));
  ops.push_back(norm_op("attn.kv_norm", kv + 1, out(kv), m, x, Dim::kLatent, x.kv_lora, x.rope));
  ops.push_back(latent(linear_op("attn.kv_up", kv + 2, out(kv + 1), Dim::kLatent, x.kv_lora,
                                 Dim::kHeads, x.a * (x.dqk - x.rope + x.dv), m.bias, x),
                       x.kv_lora));
  const int core = next();
  ops.push_back(mla_attention_op(core, out(q), out(kv + 2), m, x));
  ops.push_back(linear_op("attn.proj", core + 1, out(core), Dim::kHeads, x.a * x.dv, Dim::kHidden,
                          x.h, m.bias, x));
  return core + 1;
}

// The activation of an MLP of width `f` (`name`); for experts (`experts`) over every routed
// token.
Op activation_op(const std::string& name, int self, TensorRef input, const ModelSpec& m,
                 const Shape& x, int64_t width, bool experts = false) {
  Op op;
  op.name = name;
  op.kind = OpKind::kActivation;
  DimSet bsf{Dim::kBatch, Dim::kSeq, Dim::kFfn};
  if (experts) bsf = bsf.with(Dim::kExpert);
  op.dims = bsf;
  op.inputs = {input};
  const double tokens = x.b * x.s * (experts ? x.slots : 1);
  const double f = static_cast<double>(width);
  const double in_width = m.gated_mlp() ? 2 * f : f;
  op.output = tensor(out(self), tokens * f, bsf, x.p);
  op.saved = {tensor(input, tokens * in_width, bsf, x.p)};
  op.fwd_bytes = tokens * (in_width + f) * x.p;
  op.bwd_bytes = tokens * (in_width + f + in_width) * x.p;
  set_granularity(op, x);
  op.granularity[static_cast<int>(Dim::kFfn)] = width;
  return op;
}

// One linear layer of every expert (a grouped GEMM over the routed tokens). The GEMMs run over
// every expert slot (the capacity factor's padding included); the FLOPs count the routed tokens
// only: the model's work, as Megatron counts it.
Op expert_linear_op(const std::string& name, int self, TensorRef input, Dim in_dim, double in_size,
                    Dim out_dim, double out_size, const ModelSpec& m, const Shape& x) {
  Op op = linear_op(name, self, input, in_dim, in_size, out_dim, out_size, m.bias, x, x.e,
                    x.b * x.s * x.slots);
  const double useful = x.top / x.slots;
  op.fwd_flops *= useful;
  op.bwd_input_flops *= useful;
  op.bwd_weight_flops *= useful;
  op.granularity[static_cast<int>(Dim::kFfn)] = m.expert_ffn_hidden;
  return op;
}

// The mixture-of-experts MLP, appended to `ops`: the router's scores, the tokens copied to their
// experts, the experts' MLPs, and each token's expert outputs summed with the router's weights.
// Tokens are assumed spread evenly over the experts (a load-balanced router, dropless).
void add_moe_ops(std::vector<Op>& ops, TensorRef input, const ModelSpec& m, const Shape& x) {
  // The shared expert: an MLP every token goes through, its output added in the combine.
  int shared = -1;
  if (m.shared_expert_ffn_hidden > 0) {
    const int64_t fs = m.shared_expert_ffn_hidden;
    const double width = static_cast<double>(fs);
    const int fc1 = static_cast<int>(ops.size());
    Op up = linear_op("moe.shared.fc1", fc1, input, Dim::kHidden, x.h, Dim::kFfn,
                      m.gated_mlp() ? 2 * width : width, m.bias, x);
    up.granularity[static_cast<int>(Dim::kFfn)] = fs;
    ops.push_back(up);
    ops.push_back(activation_op("moe.shared.act", fc1 + 1, out(fc1), m, x, fs));
    Op down = linear_op("moe.shared.fc2", fc1 + 2, out(fc1 + 1), Dim::kFfn, width, Dim::kHidden,
                        x.h, m.bias, x);
    down.granularity[static_cast<int>(Dim::kFfn)] = fs;
    ops.push_back(down);
    shared = fc1 + 2;
  }
  const int router = static_cast<int>(ops.size());
  // Each expert's rows: its share of the routed copies, times the capacity factor (slots).
  const double tokens = x.b * x.s, routed = tokens * x.slots;
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHidden};
  const DimSet bseh{Dim::kBatch, Dim::kSeq, Dim::kExpert, Dim::kHidden};
  const DimSet bse{Dim::kBatch, Dim::kSeq, Dim::kExpert};
  ops.push_back(
      linear_op("moe.router", router, input, Dim::kHidden, x.h, Dim::kExpert, x.e, false, x));

  // Softmax and top-k over the scores (fp32), then each token copied once per chosen expert.
  // The routing weights are kept for the combine.
  const int dispatch = router + 1;
  Op d;
  d.name = "moe.dispatch";
  d.kind = OpKind::kPermute;
  d.dims = bseh;
  d.inputs = {input, out(router)};
  d.output = tensor(out(dispatch), routed * x.h, bseh, x.p);
  const TensorSpec weights = tensor(TensorRef{dispatch, 1}, tokens * x.e, bse, 4);
  d.saved = {weights};
  d.fwd_bytes = tokens * x.e * (x.p + 4) + 2 * routed * x.h * x.p;
  d.bwd_bytes = tokens * x.e * (4 + 4 + x.p) + 2 * routed * x.h * x.p;
  set_granularity(d, x);
  ops.push_back(d);

  const double f = static_cast<double>(m.expert_ffn_hidden);
  const double fc1_width = m.gated_mlp() ? 2 * f : f;
  const int fc1 = dispatch + 1;
  ops.push_back(expert_linear_op("moe.fc1", fc1, out(dispatch), Dim::kHidden, x.h, Dim::kFfn,
                                 fc1_width, m, x));
  ops.push_back(activation_op("moe.act", fc1 + 1, out(fc1), m, x, m.expert_ffn_hidden, true));
  const int fc2 = fc1 + 2;
  ops.push_back(
      expert_linear_op("moe.fc2", fc2, out(fc1 + 1), Dim::kFfn, f, Dim::kHidden, x.h, m, x));

  // Each token's expert outputs, weighted and summed: the backward needs them (for the routing
  // weights' gradient) and the weights.
  Op c;
  c.name = "moe.combine";
  c.kind = OpKind::kPermute;
  c.dims = bseh;
  c.reduced = {Dim::kExpert};
  c.inputs = {out(fc2)};
  c.output = tensor(out(fc2 + 1), tokens * x.h, bsh, x.p);
  c.saved = {tensor(out(fc2), routed * x.h, bseh, x.p), weights};
  c.fwd_bytes = routed * x.h * x.p + tokens * x.h * x.p;
  if (shared >= 0) {  // the shared expert's output read and added (its gradient is the output's)
    c.inputs.push_back(out(shared));
    c.fwd_bytes += tokens * x.h * x.p;
  }
  c.bwd_bytes = tokens * x.h * x.p + 2 * routed * x.h * x.p;
  // Megatron-Core's unpermute (weighted copies summed by a scatter-add) under autograd: the
  // forward writes the weighted copies, the backward gathers the output's gradient to the
  // routed copies and, beside it, writes their gradient or multiplies it by the expert outputs
  // for the weights' gradient: two routed-size temporaries (nnexec's CPU counts: docs/hwexec.md).
  c.transient_bytes = 2 * routed * x.h * x.p;
  set_granularity(c, x);
  ops.push_back(c);
}

// The token lookup in the word embedding matrix; its input is the part's (the token ids, which
// the compiler gives no layout).
Op word_lookup_op(const std::string& name, int self, const Shape& x) {
  const double bsh = x.b * x.s * x.h;
  Op word;
  word.name = name;
  word.kind = OpKind::kEmbedding;
  word.dims = {Dim::kBatch, Dim::kSeq, Dim::kVocab, Dim::kHidden};
  word.reduced = {Dim::kVocab};  // a vocab shard yields zeros for tokens outside it: partial sums
  word.inputs = {kPartInput};
  word.output = tensor(out(self), bsh, {Dim::kBatch, Dim::kSeq, Dim::kHidden}, x.p);
  word.weights = {tensor(TensorRef{self, 1}, x.v * x.h, {Dim::kVocab, Dim::kHidden}, x.p)};
  word.fwd_bytes = 2 * bsh * x.p;
  word.bwd_bytes = 2 * bsh * x.p;
  set_granularity(word, x);
  return word;
}

GraphPart build_embedding(const ModelSpec& m, const Shape& x) {
  GraphPart part;
  const double bsh = x.b * x.s * x.h;
  const DimSet bsh_dims{Dim::kBatch, Dim::kSeq, Dim::kHidden};
  part.ops.push_back(word_lookup_op("embed.word", 0, x));
  if (m.position == PositionKind::kLearned) {
    Op pos;
    pos.name = "embed.position";
    pos.kind = OpKind::kAdd;
    pos.dims = bsh_dims;
    pos.inputs = {out(0)};
    pos.output = tensor(out(1), bsh, bsh_dims, x.p);
    // The table is indexed by position, but every rank keeps all of it even when the sequence
    // is split (Megatron does), so it spans only hidden: sequence splits replicate it and make
    // its gradient a partial sum.
    pos.weights = {tensor(TensorRef{1, 1}, x.s * x.h, {Dim::kHidden}, x.p)};
    pos.fwd_bytes = 3 * bsh * x.p;
    pos.bwd_bytes = 2 * bsh * x.p;
    set_granularity(pos, x);
    part.ops.push_back(pos);
  }
  if (m.dropout) {
    int self = static_cast<int>(part.ops.size());
    Op drop = dropout_add_op("embed.dropout", self, {out(self - 1)}, true, x);
    part.ops.push_back(drop);
  }
  return part;
}

// Mamba-2's convolution, chunked scan and gate over the input projection's z, x, B, C and dt
// (Megatron-Core's mamba_split_conv1d_scan_combined, one autograd function of a causal
// depthwise convolution and the SSD algorithm's Triton kernels; docs/opgraph.md, "Hybrid models
// and Mamba-2 layers"). It keeps its input and the ungated output for the backward, which
// recomputes the convolution and the chunk states.
Op ssm_scan_op(int self, TensorRef in, const ModelSpec& m, const Shape& x) {
  Op op;
  op.name = "ssm.scan";
  op.kind = OpKind::kScan;
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsh;
  // The recurrence runs along the whole sequence: context parallelism splits its heads instead,
  // with all-to-alls around it (Megatron-Core's MambaContextParallel).
  op.unsplittable = {Dim::kSeq};
  op.inputs = {in};
  const double tokens = x.b * x.s;
  const double d = x.mh * x.mp, gn = x.mg * x.mn, conv = d + 2 * gn;
  const double in_width = static_cast<double>(m.mamba_in_width());
  op.output = tensor(out(self), tokens * d, bsh, x.p);
  op.weights = {tensor(TensorRef{self, 1}, conv * x.mk, {Dim::kHeads}, x.p),  // taps
                tensor(TensorRef{self, 2}, conv, {Dim::kHeads}, x.p),         // conv bias
                tensor(TensorRef{self, 3}, x.mh, {Dim::kHeads}, x.p),         // dt bias
                tensor(TensorRef{self, 4}, x.mh, {Dim::kHeads}, x.p),         // A (its log)
                tensor(TensorRef{self, 5}, x.mh, {Dim::kHeads}, x.p)};        // D
  op.saved = {tensor(in, tokens * in_width, bsh, x.p),
              tensor(TensorRef{self, 6}, tokens * d, bsh, x.p)};  // the ungated output
  // Per token: the convolution's taps; C.B^T within a chunk (per group), the masked scores
  // times x (per head, the causal half of the chunk), the chunk states B^T.x and the states'
  // contribution C.S (per head, state x head width each), the state passing between chunks.
  const double per_token =
      2 * x.mk * conv + 2 * x.mq * gn + x.mq * d + 4 * x.mn * d + 2 * x.mn * d / x.mq;
  op.fwd_flops = tokens * per_token;
  // The backward recomputes the convolution and the chunk states, then takes two gradients of
  // every product.
  op.bwd_input_flops = 3 * op.fwd_flops;
  // 16-bit: the convolution reads its input and writes its output, which the four SSD kernels
  // read (x twice, B three times, C twice) beside z and dt, and the gated and ungated outputs;
  // fp32: dt and its cumulative sums, the chunk states written, passed (read and written) and
  // read, and C.B^T written and read.
  const double per_chunk_state = x.mn * d / x.mq;
  op.fwd_bytes = tokens * (x.p * (2 * conv + 5 * d + 4 * gn + x.mh) +
                           4 * (8 * x.mh + 4 * per_chunk_state + 2 * x.mg * x.mq));
  // The recomputation's traffic again, and each tensor's gradient read or written once.
  op.bwd_bytes = 2 * op.fwd_bytes;
  op.transient_bytes = tokens * (x.p * conv + 4 * (per_chunk_state + x.mg * x.mq + 2 * x.mh));
  set_granularity(op, x);
  return op;
}

// Mamba-2's norm of the gated output, per group of heads (RMSNorm, norm after the gate).
Op gated_norm_op(int self, TensorRef in, const Shape& x) {
  Op op;
  op.name = "ssm.gate_norm";
  op.kind = OpKind::kNorm;
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsh;
  op.inputs = {in};
  const double elements = x.b * x.s * x.mh * x.mp;
  op.output = tensor(out(self), elements, bsh, x.p);
  op.weights = {tensor(TensorRef{self, 1}, x.mh * x.mp, {Dim::kHeads}, x.p)};
  op.saved = {tensor(in, elements, bsh, x.p)};
  op.fwd_bytes = 2 * elements * x.p;
  op.bwd_bytes = 3 * elements * x.p;
  set_granularity(op, x);
  return op;
}

// A Mamba-2 layer ('M', Megatron-Core's MambaLayer): the norm, the input projection (z, x, B, C
// and dt; no bias), the scan, the gated norm, the output projection (no bias) and the residual.
// Its heads split by group of heads (B and C are per group).
GraphPart build_mamba_layer(const ModelSpec& m, const Shape& x) {
  GraphPart part;
  auto& ops = part.ops;
  const double d = x.mh * x.mp;
  ops.push_back(norm_op("ssm.norm", 0, kPartInput, m, x));
  ops.push_back(linear_op("ssm.in_proj", 1, out(0), Dim::kHidden, x.h, Dim::kHeads,
                          static_cast<double>(m.mamba_in_width()), false, x));
  ops.push_back(ssm_scan_op(2, out(1), m, x));
  ops.push_back(gated_norm_op(3, out(2), x));
  ops.push_back(linear_op("ssm.out_proj", 4, out(3), Dim::kHeads, d, Dim::kHidden, x.h, false, x));
  ops.push_back(dropout_add_op("ssm.residual", 5, {out(4), kPartInput}, m.dropout, x));
  for (Op& op : ops) op.granularity[static_cast<int>(Dim::kHeads)] = x.mamba_groups;
  // The scan alone may split a group's heads (context parallelism over more ranks than a
  // tensor-parallel rank has groups: each rank repeats its group's B and C).
  ops[2].granularity[static_cast<int>(Dim::kHeads)] = m.mamba_heads;
  return part;
}

// Gated DeltaNet's convolution, gates and chunked delta rule over the input projection's Q, K,
// V, beta and decay input (Megatron-Core's GatedDeltaNet: causal_conv1d, the L2 norms of Q and K,
// their repetition to the value heads, and flash-linear-attention's chunk_gated_delta_rule
// kernels; docs/opgraph.md, "Gated DeltaNet layers"). The backward recomputes the chunk
// states.
Op gdn_scan_op(int self, TensorRef in, const ModelSpec& m, const Shape& x) {
  Op op;
  op.name = "gdn.scan";
  op.kind = OpKind::kScan;
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsh;
  // The recurrence runs along the whole sequence (context parallelism splits heads instead).
  op.unsplittable = {Dim::kSeq};
  op.inputs = {in};
  const double tokens = x.b * x.s, c = x.gchunk, dk = x.gdk, dv = x.gdv;
  const double qk = x.gk * dk, v = x.gv * dv, conv = 2 * qk + v;
  const double in_width = static_cast<double>(m.gdn_in_width());
  // Q and K repeated to the value heads when those are more (grouped value heads).
  const double repeated = x.gv > x.gk ? 2 * x.gv * dk : 0;
  op.output = tensor(out(self), tokens * v, bsh, x.p);
  op.weights = {tensor(TensorRef{self, 1}, conv * x.gconv, {Dim::kHeads}, x.p),  // taps
                tensor(TensorRef{self, 2}, x.gv, {Dim::kHeads}, x.p),            // dt bias
                tensor(TensorRef{self, 3}, x.gv, {Dim::kHeads}, x.p)};           // decay (A)
  // The convolution's input (the projection's output), its output (V read from it), the
  // normalized and repeated Q and K, the gates g and beta (fp32) and the chunks' inverted
  // triangular matrices (16-bit, chunk wide a value head).
  op.saved = {tensor(in, tokens * in_width, bsh, x.p),
              tensor(TensorRef{self, 4}, tokens * (conv + 2 * qk + repeated), bsh, x.p),
              tensor(TensorRef{self, 5}, tokens * x.gv * 2, bsh, 4),
              tensor(TensorRef{self, 6}, tokens * x.gv * c, bsh, x.p)};
  // Per token and value head: K.K^T within the chunk, its triangular inverse, W and U from it,
  // the chunk states' pass (U - W.S and S += K^T.(...)), and the output (Q.S and the masked
  // Q.K^T times the new values); plus the convolution's taps.
  const double per_head = 6 * c * dk + 4 * c * dv + 6 * dk * dv + 2 * c * c / 3;
  op.fwd_flops = tokens * (x.gv * per_head + 2 * x.gconv * conv);
  // The backward recomputes the chunk states, then takes two gradients of every product.
  op.bwd_input_flops = 3 * op.fwd_flops;
  // 16-bit: the convolution reads and writes its channels, the L2 norms Q and K, the repetition
  // writes the repeated Q and K, the gates read beta's and the decay's inputs; fp32: g and beta
  // written. Then per value head the delta rule's kernels: K (five reads) and Q (one), V and the
  // new values, W, U and the output, the chunk states written and read, the chunks' matrices
  // (fp32 K.K^T written and read, its inverse written and read) and g and beta read (fp32).
  const double per_value_head = x.p * (7 * dk + 6 * dv + 2 * dk * dv / c + 2 * c) + 8 * c + 32;
  op.fwd_bytes =
      tokens * (x.p * (2 * conv + 4 * qk + (repeated > 0 ? 2 * qk + repeated : 0) + 2 * x.gv) +
                8 * x.gv + x.gv * per_value_head);
  // The recomputation's traffic again, and each tensor's gradient read or written once.
  op.bwd_bytes = 2 * op.fwd_bytes;
  // Freed after the forward: K.K^T (fp32), W, U, the chunk states and the new values.
  op.transient_bytes = tokens * x.gv * (4 * c + x.p * (dk + 2 * dv + dk * dv / c));
  set_granularity(op, x);
  return op;
}

// Gated DeltaNet's output norm: each value head's output normalized (RMSNorm, one scale a head's
// width shared by the heads) and gated by silu(z), z from the input projection.
Op gdn_gate_norm_op(int self, TensorRef in, TensorRef proj, const ModelSpec& m, const Shape& x) {
  Op op;
  op.name = "gdn.gate_norm";
  op.kind = OpKind::kNorm;
  const DimSet bsh{Dim::kBatch, Dim::kSeq, Dim::kHeads};
  op.dims = bsh;
  op.inputs = {in, proj};
  const double elements = x.b * x.s * x.gv * x.gdv;
  op.output = tensor(out(self), elements, bsh, x.p);
  op.weights = {tensor(TensorRef{self, 1}, x.gdv, {}, x.p)};
  op.saved = {tensor(in, elements, bsh, x.p),
              tensor(proj, x.b * x.s * static_cast<double>(m.gdn_in_width()), bsh, x.p)};
  op.fwd_bytes = 3 * elements * x.p;  // read the output and z, write
  op.bwd_bytes = 5 * elements * x.p;  // read dy, the output and z, write both gradients
  set_granularity(op, x);
  return op;
}

// A Gated DeltaNet layer ('G', Megatron-Core's GatedDeltaNet): the norm, the input projection
// (Q, K, V, z, beta, the decay's input; no bias), the scan, the gated norm, the output
// projection (no bias) and the residual. Its heads split by query/key head (each with its value
// heads).
GraphPart build_gdn_layer(const ModelSpec& m, const Shape& x) {
  GraphPart part;
  auto& ops = part.ops;
  ops.push_back(norm_op("gdn.norm", 0, kPartInput, m, x));
  ops.push_back(linear_op("gdn.in_proj", 1, out(0), Dim::kHidden, x.h, Dim::kHeads,
                          static_cast<double>(m.gdn_in_width()), false, x));
  ops.push_back(gdn_scan_op(2, out(1), m, x));
  ops.push_back(gdn_gate_norm_op(3, out(2), out(1), m, x));
  ops.push_back(
      linear_op("gdn.out_proj", 4, out(3), Dim::kHeads, x.gv * x.gdv, Dim::kHidden, x.h, false, x));
  ops.push_back(dropout_add_op("gdn.residual", 5, {out(4), kPartInput}, m.dropout, x));
  for (Op& op : ops) op.granularity[static_cast<int>(Dim::kHeads)] = x.gdn_key_heads;
  return part;
}

// With post_norms (Gemma's) a sub-block's output is normalized before the residual adds it:
// appends that norm after operator `output` and returns it; without, returns `output`.
int add_post_norm(std::vector<Op>& ops, const char* name, int output, const ModelSpec& m,
                  const Shape& x) {
  if (!m.post_norms) return output;
  ops.push_back(norm_op(name, output + 1, out(output), m, x));
  return output + 1;
}

// A block's attention half, appended to `ops` (whose next index it takes): the norm, the
// attention operators, [the post-norm] and `attn.residual`, which adds the part's input. Returns
// the residual's index.
int add_attention_half(std::vector<Op>& ops, const ModelSpec& m, const Shape& x) {
  const int norm = static_cast<int>(ops.size());
  ops.push_back(norm_op("attn.norm", norm, kPartInput, m, x));
  int proj = norm + 3;
  if (m.mla()) {
    proj = add_mla_ops(ops, m, x);
  } else {
    ops.push_back(linear_op("attn.qkv", norm + 1, out(norm), Dim::kHidden, x.h, Dim::kHeads,
                            x.qkv_out_width(), m.bias, x));
    int core = norm + 2;
    if (m.qk_norm) ops.push_back(qk_norm_op(core++, out(norm + 1), m, x));
    ops.push_back(attention_op(core, out(norm + 1), m, x, m.qk_norm ? norm + 2 : -1));
    int attn = core;
    if (m.attention_output_gate) {
      ops.push_back(attention_gate_op(++attn, out(core), out(norm + 1), x));
    }
    proj = attn + 1;
    ops.push_back(linear_op("attn.proj", proj, out(attn), Dim::kHeads, x.a * x.dh, Dim::kHidden,
                            x.h, m.bias, x));
  }
  const int attn_out = add_post_norm(ops, "attn.post_norm", proj, m, x);
  const int residual = attn_out + 1;
  ops.push_back(
      dropout_add_op("attn.residual", residual, {out(attn_out), kPartInput}, m.dropout, x));
  return residual;
}

// A block's MLP half (its experts' with `experts`), appended to `ops`: the norm over `input`,
// the MLP, [the post-norm] and `mlp.residual`, which adds `input`.
void add_mlp_half(std::vector<Op>& ops, TensorRef input, bool experts, const ModelSpec& m,
                  const Shape& x) {
  const int norm = static_cast<int>(ops.size());
  ops.push_back(norm_op("mlp.norm", norm, input, m, x));
  int last = 0;
  if (experts) {
    add_moe_ops(ops, out(norm), m, x);
    last = static_cast<int>(ops.size()) - 1;
  } else {
    const int fc1 = norm + 1;
    const double fc1_width = m.gated_mlp() ? 2 * x.f : x.f;
    ops.push_back(
        linear_op("mlp.fc1", fc1, out(norm), Dim::kHidden, x.h, Dim::kFfn, fc1_width, m.bias, x));
    ops.push_back(activation_op("mlp.act", fc1 + 1, out(fc1), m, x, m.ffn_hidden));
    ops.push_back(
        linear_op("mlp.fc2", fc1 + 2, out(fc1 + 1), Dim::kFfn, x.f, Dim::kHidden, x.h, m.bias, x));
    last = fc1 + 2;
  }
  last = add_post_norm(ops, "mlp.post_norm", last, m, x);
  ops.push_back(dropout_add_op("mlp.residual", last + 1, {out(last), input}, m.dropout, x));
}

// A transformer block: attention, then the MLP (experts in a mixture of experts).
GraphPart build_layer(const ModelSpec& m, const Shape& x) {
  GraphPart part;
  const int residual = add_attention_half(part.ops, m, x);
  add_mlp_half(part.ops, out(residual), m.moe(), m, x);
  return part;
}

// A hybrid model's layer of pattern character `kind` (ModelSpec::layer_pattern).
GraphPart build_hybrid_layer(char kind, const ModelSpec& m, const Shape& x) {
  if (kind == 'M') return build_mamba_layer(m, x);
  if (kind == 'G') return build_gdn_layer(m, x);
  GraphPart part;
  if (kind == '*') {
    add_attention_half(part.ops, m, x);
  } else {
    add_mlp_half(part.ops, kPartInput, kind == 'E', m, x);
  }
  return part;
}

// The cross-entropy `name` over the logits of the operator before it (operator `self` - 1).
Op loss_op(const std::string& name, int self, const ModelSpec& m, const Shape& x) {
  Op loss;
  loss.name = name;
  loss.kind = OpKind::kLoss;
  loss.dims = {Dim::kBatch, Dim::kSeq, Dim::kVocab};
  loss.reduced = {Dim::kVocab};
  loss.inputs = {out(self - 1)};
  const double tokens = x.b * x.s;
  const DimSet bsv{Dim::kBatch, Dim::kSeq, Dim::kVocab};
  loss.output = tensor(out(self), tokens, {Dim::kBatch, Dim::kSeq}, 4);
  // Cross-entropy runs in fp32 and keeps the softmax (or log-softmax) for the backward pass.
  const double logits = tokens * x.v;
  loss.saved = {tensor(TensorRef{self, 1}, logits, bsv, 4)};
  // The logits' own block (compute dtype) beside the fp32 buffers; fp32 logits are the buffer.
  const double own_block = x.p < 4 ? x.p : 0;
  // A softmax a kernel per step, as Megatron's default and PyTorch's loss_parallel() run it:
  // the cast (read p, write 4), the row maximum (read 4), the shifted logits (read 4, write 4),
  // exp (read 4, write 4), its row sum (read 4), the division or the log-softmax's result (read
  // 4, write 4).
  const double stepwise_fwd = x.p + 4 + 4 + 8 + 8 + 4 + 8;
  switch (m.loss) {
    case LossKernel::kFlashAttn:
      // flash-attn's kernel computes in fp32 registers: the forward reads the logits (p) and
      // keeps them with each row's log-sum-exp; the backward reads them and writes their
      // gradient (p), its transient beside them.
      loss.saved = {tensor(out(self - 1), logits, bsv, x.p)};
      loss.transient_bytes = logits * x.p;
      loss.fwd_bytes = logits * x.p;
      loss.bwd_bytes = logits * 2 * x.p;
      break;
    case LossKernel::kFused:
    case LossKernel::kVocabParallel:
      // Megatron: the fp32 copy of the logits becomes the softmax in place; the backward pass
      // forms the gradient in that buffer and casts it to the logits' precision. Beside the
      // buffer (saved) the logits in the compute dtype (forward) or their gradient (backward).
      loss.transient_bytes = logits * own_block;
      loss.in_place_input = true;
      if (m.loss == LossKernel::kFused) {
        // One kernel each way: read the logits, write the softmax; read it, write the gradient.
        loss.fwd_bytes = logits * (x.p + 4 + 4);
        loss.bwd_bytes = logits * (4 + x.p);
      } else {
        // Backward: scaling by the output gradient (read 4, write 4), the cast back (read 4,
        // write p).
        loss.fwd_bytes = logits * stepwise_fwd;
        loss.bwd_bytes = logits * (8 + 4 + x.p);
      }
      break;
    case LossKernel::kLossParallel:
      // PyTorch's loss_parallel(): the stepwise log-softmax, whose result is saved. Backward, in
      // one function for the NLL and the log-softmax: zeros (write 4), exp of the saved result
      // (read 4, write 4), their sum (read 8, write 4), times the output gradient (read 4, write
      // 4), and the cast back (read 4, write p). Its peak: the zeros, the exp and the sum beside
      // the saved result, plus the logits' block held as for the unfused loss.
      loss.transient_bytes = logits * (12 + own_block);
      loss.fwd_bytes = logits * stepwise_fwd;
      loss.bwd_bytes = logits * (4 + 8 + 12 + 8 + 4 + x.p);
      break;
    case LossKernel::kUnfused:
      // PyTorch: cast (read p, write 4), log-softmax (read 4 twice, write 4); backward: the
      // log-softmax's gradient (written 4), its backward (read 8, write 4), the cast (read 4,
      // write p). Its peak is in the backward pass: the log-softmax's gradient and the input
      // gradient, both fp32, beside the saved log-softmax. The logits themselves (p bytes, the
      // cast's input) are either still referenced then or freed into the caching allocator's
      // cache, where a block half the size of the fp32 gradients is of no use to them: either
      // way the GPU holds them at that peak (reserved, if not allocated).
      loss.transient_bytes = logits * (8 + own_block);
      loss.fwd_bytes = logits * (x.p + 4 + 8 + 4);
      loss.bwd_bytes = logits * (4 + 12 + 4 + x.p);
      break;
  }
  // A vocab-split loss all-reduces the row maximum, the sum of exponentials and the target
  // logit (three fp32 values per token) across the split.
  InternalComm stats;
  stats.dim = Dim::kVocab;
  stats.kind = InternalComm::Kind::kAllReduce;
  stats.dims = {Dim::kBatch, Dim::kSeq};
  stats.fwd_bytes = tokens * 4;
  stats.fwd_calls = 3;
  loss.internal_comm = {stats};
  set_granularity(loss, x);
  return loss;
}

// Shifts an operator copied into a part at operator `first`: its references to the operators
// before it move by `first`, and those to the part's input go to `input`.
void move_refs(Op& op, int first, TensorRef input) {
  auto move = [&](TensorRef& r) { r = r.op < 0 ? input : TensorRef{r.op + first, r.slot}; };
  for (TensorRef& r : op.inputs) move(r);
  move(op.output.ref);
  for (TensorSpec& t : op.weights) move(t.ref);
  for (TensorSpec& t : op.saved) move(t.ref);
}

// DeepSeek-V3's multi-token prediction module (Megatron-Core's --mtp-num-layers), appended to
// the head's operators: the embedding of the token one further ahead (the embedding's own
// matrix) and the hidden state `hidden` (the model's, or the module before's), each normalized,
// concatenated and projected back to the hidden width, then a block of the model's kind (with
// experts in a mixture), a norm, the head's output projection (the same matrix) and a loss of
// its own. Returns the block's output, which the next module reads.
TensorRef add_mtp_module(std::vector<Op>& ops, TensorRef hidden, const ModelSpec& m,
                         const Shape& x) {
  const int base = static_cast<int>(ops.size());
  Op embed = word_lookup_op("mtp.embed", base, x);
  // Untied, the head's devices hold a copy of the embedding matrix (summed with it as a tied
  // head's is); tied, the head's projection already holds that copy.
  if (m.tied_embeddings) {
    embed.weights.clear();
  } else {
    embed.tied_to_embedding = true;
  }
  ops.push_back(embed);
  ops.push_back(norm_op("mtp.embed.norm", base + 1, out(base), m, x));
  ops.push_back(norm_op("mtp.hidden.norm", base + 2, hidden, m, x));
  // [embedding; hidden], 2h wide: a dimension of its own (latent), not the output's hidden.
  Op proj = linear_op("mtp.proj", base + 3, out(base + 1), Dim::kLatent, 2 * x.h, Dim::kHidden, x.h,
                      false, x);
  proj.inputs.push_back(out(base + 2));
  proj.granularity[static_cast<int>(Dim::kLatent)] = std::llround(2 * x.h);
  ops.push_back(proj);
  const int first = base + 4;
  for (Op op : build_layer(m, x).ops) {
    move_refs(op, first, out(base + 3));
    op.name = "mtp." + op.name;
    ops.push_back(std::move(op));
  }
  const int block_out = static_cast<int>(ops.size()) - 1;
  ops.push_back(norm_op("mtp.head.norm", block_out + 1, out(block_out), m, x));
  Op logits = linear_op("mtp.head.proj", block_out + 2, out(block_out + 1), Dim::kHidden, x.h,
                        Dim::kVocab, x.v, false, x);
  logits.weights.clear();  // the head's projection matrix (a shared output head)
  ops.push_back(logits);
  ops.push_back(loss_op("mtp.loss", block_out + 3, m, x));
  return out(block_out);
}

GraphPart build_head(const ModelSpec& m, const Shape& x) {
  GraphPart part;
  part.ops.push_back(norm_op("head.norm", 0, kPartInput, m, x));
  Op proj = linear_op("head.proj", 1, out(0), Dim::kHidden, x.h, Dim::kVocab, x.v, false, x);
  proj.tied_to_embedding = m.tied_embeddings;
  part.ops.push_back(proj);

  part.ops.push_back(loss_op("loss", 2, m, x));
  TensorRef hidden = kPartInput;
  for (int k = 0; k < m.mtp_layers; ++k) hidden = add_mtp_module(part.ops, hidden, m, x);
  return part;
}

double part_flops(const GraphPart& part, bool backward) {
  double f = 0;
  for (const auto& op : part.ops) {
    f += backward ? op.bwd_input_flops + op.bwd_weight_flops : op.fwd_flops;
  }
  return f;
}

}  // namespace

double OpGraph::forward_flops() const {
  double f = part_flops(embedding, false) + part_flops(head, false);
  for (int l = 0; l < model.layers; ++l) f += part_flops(layer_at(l), false);
  return f;
}

double OpGraph::backward_flops() const {
  double f = part_flops(embedding, true) + part_flops(head, true);
  for (int l = 0; l < model.layers; ++l) f += part_flops(layer_at(l), true);
  return f;
}

OpGraph lower_model(const ModelSpec& model, int64_t micro_batch) {
  Shape x = shape_of(model, micro_batch);
  OpGraph g;
  g.model = model;
  g.micro_batch = micro_batch;
  g.activation_precision = x.p == 4 ? Precision::kFp32 : Precision::kBf16;
  g.embedding = build_embedding(model, x);
  if (model.hybrid()) {
    for (char c : model.layer_kinds()) g.blocks.push_back(build_hybrid_layer(c, model, x));
  } else {
    g.blocks.push_back(build_layer(model, x));
  }
  if (!model.hybrid() && model.mixed_layers()) {
    ModelSpec dense = model;
    dense.experts = 0;
    dense.shared_expert_ffn_hidden = 0;
    g.blocks.push_back(build_layer(dense, shape_of(dense, micro_batch)));
  }
  g.block_of_layer = model.block_shape_of_layers();
  g.head = build_head(model, x);
  return g;
}

double layer_activation_bytes(const OpGraph& graph, const std::vector<std::string>& recomputed) {
  const auto& ops = graph.blocks.front().ops;
  auto is_recomputed = [&](int i) {
    return i >= 0 &&
           std::find(recomputed.begin(), recomputed.end(), ops[i].name) != recomputed.end();
  };
  std::vector<TensorSpec> kept;
  auto keep = [&](const TensorSpec& t) {
    for (const auto& k : kept) {
      if (k.ref == t.ref) return;
    }
    kept.push_back(t);
  };
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    const Op& op = ops[i];
    if (!is_recomputed(i)) {
      for (const auto& t : op.saved) keep(t);
      continue;
    }
    // A recomputed op keeps only the inputs that come from outside the recomputed region: they
    // are the checkpoint it restarts from.
    for (const auto& t : op.saved) {
      if (t.ref.slot == 0 && t.ref.op != i && !is_recomputed(t.ref.op)) keep(t);
    }
  }
  double bytes = 0;
  for (const auto& t : kept) bytes += t.bytes();
  return bytes;
}

}  // namespace nnsim
