// One rank's part of the model in `nnexec run` (docs/hwexec.md), internal to the LibTorch
// executor (run_torch.cc): the parameters of a segment (the embedding, a run of layers, the head)
// cut to this rank's tensor-, context- and expert-parallel shard, and the forward and backward of
// a micro-batch through them, operator by operator. ATen only (no torch::nn): every operator of
// the operator graph (attn.qkv, attn.core, ...) runs as its own small autograd graph, from
// detached inputs, so that its forward and its backward are timed alone and the collectives
// between operators are explicit, as in Megatron-LM:
//   attn.qkv / mlp.fc1: columns split over tp; their input gradient is all-reduced (f).
//   attn.proj / mlp.fc2: rows split; their output (partial sums) is all-reduced (g), the bias
//     added after it (timed in the residual).
//   embed.word: rows (vocabulary) split, looked up with a mask, output all-reduced.
//   head.proj + loss: columns (vocabulary) split, vocab-parallel cross-entropy (all-reduces of
//     the row maximum, the sum of exponentials and the target logit).
// Sequence parallelism turns the tp all-reduces into all-gathers before the column-parallel
// linears and reduce-scatters after the row-parallel ones; recompute rules re-run operators'
// forwards before the backward (the embedding's and the head's too for rules without layers);
// zero-bubble BI blocks defer the linear layers' weight gradients to BW (run_split_backward.h);
// context parallelism splits every sequence over cp, attn.core exchanging keys and values
// (run_context_parallel.h); mixtures of experts route tokens to grouped expert GEMMs
// (run_moe.h), over the expert-parallel ranks by all-to-all.
// The class's definitions: run_model.cc (construction, the passes, shared helpers),
// run_model_ends.cc (the embedding and the head), run_model_layer.cc (a transformer block) and
// run_model_moe.cc (a mixture-of-experts block's MLP).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/model.h"
#include "core/plan.h"
#include "hwexec/run_context.h"
#include "hwexec/run_context_parallel.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_model_masks.h"
#include "hwexec/run_moe.h"
#include "hwexec/run_split_backward.h"
#include "hwexec/run_stats.h"

namespace nnsim::hwexec {

struct Param {
  std::string name;
  at::Tensor w;                                      // this rank's shard, requires grad
  std::function<at::Tensor(const at::Tensor&)> cut;  // full tensor -> this rank's shard
  at::Tensor m, v;                                   // Adam moments
  // What the operators use: w itself in fp32; in bf16, its copy made once per iteration inside
  // autograd, so the weight gradients of every micro-batch reach w's fp32 gradient.
  at::Tensor c;
  // A routed expert's (moe.fc1, moe.fc2): with expert parallelism its gradient sums over dp
  // only, each ep rank holding other experts.
  bool routed_expert = false;
};

// Frees or reallocates a tensor's storage in place (FSDP's trick): autograd's saved references
// stay valid, so a sequence-parallel linear's gathered input can be dropped after the forward
// and gathered again into the same storage before the backward. Only ever to 0 bytes and back
// from 0, so there is nothing to copy: the storage's own allocator (the caching allocator on a
// GPU) gives the new block, through StorageImpl's public interface rather than ATen's internal
// per-device resize functions.
void resize_storage(const at::Tensor& t, std::size_t bytes);

struct LayerParams {
  Param *ln1g = nullptr, *ln1b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr,
        *proj_b = nullptr, *ln2g = nullptr, *ln2b = nullptr, *fc1_w = nullptr, *fc1_b = nullptr,
        *fc2_w = nullptr, *fc2_b = nullptr;
  // model.qk_norm: the queries' and the keys' scales (and shifts), shared by the heads.
  Param *qn_g = nullptr, *kn_g = nullptr, *qn_b = nullptr, *kn_b = nullptr;
  // model.post_norms: the norms of the attention's output and of the MLP's (Gemma's).
  Param *pn1g = nullptr, *pn1b = nullptr, *pn2g = nullptr, *pn2b = nullptr;
  // Multi-head latent attention (ModelSpec::mla(); qkv_w null): the queries' down-projection,
  // their latent's norm and up-projection (without a query latent, q_w is attn.q from the
  // block's norm), the key/value latent's down-projection (with the rotary key part), norm and
  // up-projection.
  Param *qd_w = nullptr, *qd_b = nullptr, *qdn_g = nullptr, *qdn_b = nullptr, *q_w = nullptr,
        *q_b = nullptr, *kvd_w = nullptr, *kvd_b = nullptr, *kvn_g = nullptr, *kvn_b = nullptr,
        *kvu_w = nullptr, *kvu_b = nullptr;
  // A mixture-of-experts block (ModelSpec::is_moe_layer; fc1_w and fc2_w null): the router, the
  // experts' weights stacked ([experts, in, out]) and the shared expert's MLP.
  bool moe = false;
  Param *router_w = nullptr, *efc1_w = nullptr, *efc1_b = nullptr, *efc2_w = nullptr,
        *efc2_b = nullptr, *sfc1_w = nullptr, *sfc1_b = nullptr, *sfc2_w = nullptr,
        *sfc2_b = nullptr;
};

// One operator's forward: its output and the detached inputs whose gradients its backward gives.
struct Unit {
  at::Tensor out;
  std::vector<at::Tensor> in;
  std::vector<at::Tensor> weights;       // a linear layer's master weights (a BI block defers them)
  std::shared_ptr<CpAttentionSaved> cp;  // context-parallel attn.core: its ring backward's state
};

// Expert parallelism: a layer's routed copies between the ep ranks. This rank's copies, in
// global expert order, go to the members holding their experts (send_rows to each, in group
// order); it receives every member's copies for its own experts (recv_rows from each), member
// by member, each member's in expert order, and reorders them expert by expert
// (to_expert_major; to_source_major undoes it) for the grouped GEMMs (local_counts rows each).
struct ExpertExchange {
  std::vector<int64_t> send_rows, recv_rows, local_counts;
  at::Tensor to_expert_major, to_source_major;
  // got[e el + l]: member e's copies for this rank's local expert l (without expert
  // parallelism: this rank's own copies of every expert).
  std::vector<int64_t> got;
};

// Experts folded over tensor-parallel axes too (--etp 1): the routed copies travel to their
// experts' ranks axis by axis, in mesh order (ep, then tp), each stage an all-to-all over one
// axis whose received rows are ordered expert by expert (`to_experts`); and back to their
// sources in the same axis order (the program's), each stage's rows sorted by their source's
// place along its axis (`back`), the arrived rows finally put in this rank's copy order.
struct FoldedExchange {
  struct Stage {
    std::vector<int64_t> send_rows, recv_rows;
    at::Tensor order;  // to_experts: the received rows' expert-major order; back: the sent rows'
  };
  std::vector<Stage> to_experts, back;
  std::vector<int64_t> local_counts;  // rows of each of this rank's experts
  at::Tensor final_order;
};

// Tensor-parallel experts under sequence parallelism: the copies that reached this rank (its
// own, or those the expert-parallel exchange brought) all-gathered over tp, member by member,
// and ordered expert by expert (to_expert_major, `counts` rows an expert) for the experts' width
// slices; their partial sums go back whole to each copy's expert-parallel source (back_send_order
// over the expert-major rows, back_send_rows to each ep member, back_recv_rows from each), are
// ordered there tp member by tp member (back_recv_order), each member's copies in its own order,
// and reduce-scattered over tp: each rank its own copies' sums.
struct TpGather {
  std::vector<int64_t> counts, member_rows, back_send_rows, back_recv_rows;
  at::Tensor to_expert_major, back_send_order, back_recv_order;
};

struct LayerTape {
  Unit n1, qkv, qkn, core, proj, res1, n2, fc1, act, fc2, res2;
  Unit pn1, pn2;  // model.post_norms: attn.post_norm, mlp.post_norm
  // Latent attention's operators (`q`: attn.q_up, or attn.q without a query latent), and the
  // rotary key part of the key/value latent as the core reads it (the whole sequence).
  Unit qdown, qnorm, q, kvdown, kvnorm, kvup;
  at::Tensor kpe;
  // A mixture-of-experts block's operators, and its routing: each token's experts ([tokens,
  // k]), the routed copies in expert order (their token) and each expert's count.
  Unit sfc1, sact, sfc2, router, dispatch, efc1, eact, efc2, combine;
  MoeRouting routing;
  // Expert parallelism: how the routed copies travel (ExpertExchange), the experts' input (every
  // rank's copies for this rank's experts, expert by expert) and their outputs returned to this
  // rank's copies (the combine's input). Tensor-parallel experts: their outputs summed over tp
  // (`returned`; under sequence parallelism this rank's copies, the copies gathered over tp as
  // `exchange` orders them), and the shared expert's (`shared_out`).
  ExpertExchange exchange;
  TpGather gather;
  FoldedExchange folded;
  at::Tensor exchanged, returned, shared_out;
  DropoutKey key;           // the micro-batch's dropout masks (a recomputation draws them again)
  at::Tensor x;             // the layer's input, kept when the layer recomputes operators
  bool recomputed = false;  // an R block has run the recomputation already
  std::vector<std::pair<const char*, Unit*>> units() {
    return {{"attn.norm", &n1},
            {"attn.qkv", &qkv},
            {"attn.qk_norm", &qkn},
            {"attn.q_down", &qdown},
            {"attn.q_norm", &qnorm},
            {"attn.q_up", &q},
            {"attn.q", &q},
            {"attn.kv_down", &kvdown},
            {"attn.kv_norm", &kvnorm},
            {"attn.kv_up", &kvup},
            {"attn.core", &core},
            {"attn.proj", &proj},
            {"attn.post_norm", &pn1},
            {"attn.residual", &res1},
            {"mlp.norm", &n2},
            {"mlp.fc1", &fc1},
            {"mlp.act", &act},
            {"mlp.fc2", &fc2},
            {"moe.shared.fc1", &sfc1},
            {"moe.shared.act", &sact},
            {"moe.shared.fc2", &sfc2},
            {"moe.router", &router},
            {"moe.dispatch", &dispatch},
            {"moe.fc1", &efc1},
            {"moe.act", &eact},
            {"moe.fc2", &efc2},
            {"moe.combine", &combine},
            {"mlp.post_norm", &pn2},
            {"mlp.residual", &res2}};
  }
};

// One pass of a layer's forward: the first (every operator) or the recomputation (`again`: only
// the recomputed operators, `rc`), with the operators an early stop leaves in their first
// forward's graph (`stopped`).
struct LayerPass {
  bool again = false;
  const char* phase = "fwd";
  std::set<std::string> rc;
  const std::set<std::string>* stopped = nullptr;
  bool runs(const char* op) const { return !again || rc.count(op) > 0; }
};

struct MicroBatchTape {
  DropoutKey key;  // which masks model.dropout applies: the iteration and the samples' rows
  Unit word, pos, drop;
  std::vector<LayerTape> layers;
  Unit hnorm, hproj;
  // The loss's saved pieces: exp(logits - max), its sum, and each token's target column with a
  // 1 where this rank's vocabulary shard holds it (Megatron's vocab-parallel cross-entropy
  // keeps the same; no [tokens, vocab] one-hot).
  at::Tensor ez, se, target_index, target_mask;
  at::Tensor loss;  // 0-dimensional, on the device (read after the iteration)
  std::vector<DeferredWeightGrad> deferred;  // a BI block's weight gradients, for its BW
  // Recompute rules without layers: what the embedding's and the head's recomputation reads,
  // and whether an R block has run it.
  at::Tensor tokens, recycled, head_x, targets;
  bool embed_recomputed = false, head_recomputed = false;
};

// This rank's part of one segment: its parameters (each drawn whole from the seed and its name,
// then cut to this rank's shard) and its passes over a micro-batch's tape.
class Model {
 public:
  // `embedding_word`: for a tied head in a segment of its own on the embedding's ranks (a
  // V-shaped placement), the embedding part's matrix, which the head projects with (one
  // parameter, both uses' gradients accumulated in it; the program's head_shares_embedding).
  Model(const ModelSpec& spec, int first, int end, bool embedding, bool head, Split split,
        int tp_index, unsigned long long seed, at::Device device, at::ScalarType dtype,
        Param* embedding_word = nullptr);

  // The operators' copies of the (updated) master weights: bf16 casts, recorded by autograd (as
  // Megatron copies its fp32 master weights to the bf16 model after each optimizer step).
  void cast_weights();

  std::deque<Param>& params() { return params_; }
  // fp8 training: the blocks' linear layers with fp8 GEMM inputs, the rest in the compute dtype
  // (bf16).
  void set_fp8(bool on) { fp8_ = on; }
  // The segment's first layer (layer 0) reads a spanning embedding's tensor-parallel partial
  // sums and reduces them first (run_spanning.h).
  void set_reduce_input(bool on) { reduce_input_ = on; }
  // The operators the plan's recompute rules name in each layer of this part.
  void set_recompute(const std::vector<RecomputeRule>& rules, bool early_stop = false);
  // Parameter units, forward order: the embedding's, each layer's, the head's (ZeRO-3 gathers
  // and reduces unit by unit, as the compiled program does).
  std::vector<std::vector<Param*>> units();
  // Parameters whose operators read the fp32 weights themselves rather than their copy in the
  // compute dtype: the word embedding's lookup (its rows looked up in fp32, then cast) and the
  // norms computed in fp32 (RMSNorm; LayerNorm on a CPU in fp16).
  std::vector<const Param*> fp32_reads() const;
  // Parameters whose gradients sequence parallelism leaves as partial sums over the
  // tensor-parallel group (applied to a slice of the sequence): the norms', the biases added in
  // the residuals, the position table, a mixture's router.
  std::vector<Param*> sequence_parallel_params();
  int head_unit() const { return (embedding_ ? 1 : 0) + static_cast<int>(layers_.size()); }
  bool has_embedding() const { return embedding_; }
  // The word matrix this part uses: the embedding's, or a tied head's copy of it (or, with
  // shares_word(), the embedding part's own).
  Param* word_matrix() const { return word_; }
  bool shares_word() const { return shared_word_; }
  bool has_head() const { return head_; }

  // Forward of a micro-batch through this segment: tokens [b, s] (embedding) or the previous
  // segment's output x [b, s, h]; targets [b, s] for the head. With the embedding, a defined x
  // is the recycled final hidden state of the pass before (repeated forwards), added to the
  // embedding's output as a constant (no gradient flows into earlier passes). Returns the
  // output: the last layer's (the head's input, with the head), and fills the tape.
  at::Tensor forward(RankContext& c, const at::Tensor& tokens, at::Tensor x,
                     const at::Tensor& targets, MicroBatchTape& tape);

  // Backward: dy is the gradient of the segment's output (layers only) or, for the head, the
  // scale of the loss. Returns the gradient of the segment's input (none for the embedding).
  // `input_only`: a zero-bubble BI block; the linear layers' weight gradients are left in the
  // tape for backward_weights (the BW block).
  at::Tensor backward(RankContext& c, MicroBatchTape& tape, at::Tensor dy, double loss_scale,
                      bool input_only = false);

  // A zero-bubble BW block: the weight gradients its BI left, in the BI's (backward) order,
  // unit by unit (ZeRO-3 gathers each unit before and reduces its gradients after, as the
  // program's BW block; those of its operators that BI computed whole included).
  void backward_weights(RankContext& c, MicroBatchTape& tape);

  // An explicit R block: the recomputation of every layer ahead of the backward (which then
  // skips it), as the program's recompute template.
  void recompute(RankContext& c, MicroBatchTape& tape);

 private:
  // A detached copy of `t` whose gradient its operator's backward gives.
  static at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }
  // The rank's shard of the vocabulary: embed.word's, or the head's (the embedding's when tied).
  int vocab_index(bool head) const;

  // A mixture-of-experts block's parameters (prefix `p`, "layers.3."), whole on every rank.
  void add_moe_params(const std::string& p, LayerParams& L);
  // Latent attention's projections and norms (run_model_mla.cc): the down-projections and
  // norms whole on every rank, the up-projections' columns of the rank's heads (from `head`).
  void add_latent_params(const std::string& p, LayerParams& L, int64_t head);

  Param* add(const std::string& name, const std::vector<int64_t>& shape, double scale,
             double offset, std::function<at::Tensor(const at::Tensor&)> cut);

  template <class F>
  Unit fwd(RunStats& st, const char* name, std::vector<at::Tensor> in, F&& f) {
    return fwd(st, name, "fwd", std::move(in), std::forward<F>(f));
  }
  template <class F>
  Unit fwd(RunStats& st, const char* name, const char* phase, std::vector<at::Tensor> in, F&& f) {
    if (ctx_) ctx_->op_before(unit_, name, std::string_view(phase) == "recompute");
    const Mark t0 = st.mark();
    Unit u;
    u.out = f(in);
    u.in = std::move(in);
    st.op(name, phase, t0, st.mark());
    return u;
  }

  std::vector<at::Tensor> bwd(RunStats& st, const char* name, Unit& u, const at::Tensor& dy);
  // A linear layer's master weights (what its deferred weight gradient accumulates into).
  static std::vector<at::Tensor> weights_of(std::initializer_list<const Param*> ps);

  // A parameter in the compute dtype: the fp32 master weight itself, or this iteration's bf16
  // copy (its gradient arrives in fp32 on the master).
  at::Tensor W(const Param* p) const { return p ? p->c : at::Tensor(); }

  // LayerNorm or RMSNorm (no bias), with fp32 statistics whatever the input's dtype, the output
  // in the input's dtype. LayerNorm is one kernel on the compute dtype and the weights' copies
  // in it, as Megatron's fused LayerNorm (apex's or Transformer Engine's: fp32 statistics
  // inside, 16-bit in and out, the weights in the model's dtype), so a bf16 norm reads and
  // writes bf16 and keeps its bf16 input for the backward; on a CPU in fp16, which has no fp16
  // LayerNorm kernel, in fp32.
  // Over the last dimension: the hidden state, or (qk_norm) a head's width.
  at::Tensor norm(const at::Tensor& x, const Param* g, const Param* b) const;

  // fp16 on the CPU: LibTorch 1.13 has no CPU kernels for fp16 matrix products and activations.
  // They run as a GPU's fp16 kernels do: in fp32 on the fp16 values (a GEMM accumulating in
  // fp32), the result rounded to fp16 once.
  bool cpu_fp16() const { return dtype_ == at::kHalf && device_.is_cpu(); }
  at::Tensor mm(const at::Tensor& a, const at::Tensor& b) const;
  // A transformer block's linear layer (attn.qkv, attn.proj, mlp.fc1, mlp.fc2): with fp8, fp8
  // GEMM inputs (run_precision.h); the head's projection stays in the compute dtype.
  at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w) const;
  // The MLP's activation of fc1's output (this rank's columns).
  at::Tensor activation(const at::Tensor& x) const;

  // Dropout's multipliers for x [b, sl, h] at a hidden site (the embedding's, a residual's) of
  // `layer` (global; -1: the embedding): the whole model's masks at the rank's sequence
  // positions (context parallelism's share; sequence parallelism's slice of it).
  at::Tensor hidden_dropout(const DropoutKey& key, int layer, DropoutSite site,
                            const at::Tensor& x) const;

  // The [s, s] causal mask (true where a query must not see a key), made once per length rather
  // than once per layer and micro-batch.
  // A layer within a sliding window (model.sliding_window) also masks the keys a window or more
  // behind its query: its own mask, made once.
  const at::Tensor& causal_mask(int64_t s, int layer = -1);
  // Rotary position embedding (rotate-half form, base 10000) of x [b, s, heads, d] at the
  // rank's positions (0 .. s-1; under context parallelism, its share), angles in fp32.
  at::Tensor rope(const at::Tensor& x) const;

  // Sequence parallelism: rank t of the tensor-parallel group holds positions [t s/tp, (t+1)
  // s/tp) of every sequence, [b, s/tp, h]. The all-gather before a column-parallel linear:
  at::Tensor gather_seq(RankContext& c, const at::Tensor& x, const std::string& label);
  // The reduce-scatter after a row-parallel one (partial sums in, this rank's summed slice out).
  at::Tensor scatter_seq(RankContext& c, const at::Tensor& x, const std::string& label);
  // A replicated tensor's slice (no communication).
  at::Tensor my_seq(const at::Tensor& x) const;
  // A column-parallel linear's input, as a leaf for its backward: its producer's output `x`, under
  // sequence parallelism gathered over tp first (labelled with the linear `op`).
  at::Tensor column_input(RankContext& c, const at::Tensor& x, const char* op);
  // A column-parallel linear's input under sequence parallelism: the gathered sequence, whose
  // storage `dropped` frees after the forward (Megatron keeps only the shard) and `regather`
  // fills again from the shard (the norm's output, kept for its own backward).
  void dropped(const at::Tensor& gathered);
  // (A linear reading the first columns of what is gathered, latent attention's key/value
  // up-projection, gets those.)
  void regather(RankContext& c, const at::Tensor& shard, Unit& u, const std::string& label);

  // The embedding's forward (tokens, and the recycled hidden state of the pass before or
  // undefined); returns what the first layer reads. Recomputed operators (recompute rules
  // without layers) drop their pieces after it, the tokens and the recycled state stay in the
  // tape; `again` (just before the embedding's backward, or in an R block) runs only those, with
  // the collectives that feed them, as phase "recompute".
  at::Tensor embed_forward(RankContext& c, const at::Tensor& tokens, const at::Tensor& recycled,
                           MicroBatchTape& tape, bool again = false);

  // The head's forward from its input x: head.norm, head.proj and the vocab-parallel
  // cross-entropy (mean over the micro-batch's tokens). Recomputed operators as in
  // embed_forward: their pieces dropped, the head's input and the targets kept; `again` runs
  // them before the head's backward.
  void head_forward(RankContext& c, const at::Tensor& x, const at::Tensor& targets,
                    MicroBatchTape& tape, bool again = false);

  // The experts' linear layer over the routed copies in expert order (`counts` rows each): one
  // GEMM per expert with tokens, as a grouped GEMM (run_moe.h).
  at::Tensor expert_linear(const at::Tensor& x, const Param* w, const Param* b,
                           const std::vector<int64_t>& counts) const;

  // A mixture-of-experts block's MLP after its norm (t.n2): the shared expert, the router's
  // scores, the routed copies of the tokens in expert order (dispatch), the experts, and each
  // token's expert outputs weighted and summed with the shared expert's (combine); the routing
  // is run_moe.h's.
  void moe_forward(RunStats& st, const LayerParams& L, LayerTape& t, bool again,
                   const std::set<std::string>& rc, const std::set<std::string>& stopped);

  // Expert parallelism (ExpertExchange): from the layer's routing, what goes to and comes from
  // each member of the ep group, and the reordering of the received copies expert by expert.
  void plan_exchange(RankContext& c, LayerTape& t) const;
  // This rank's copies (its expert order) to the experts' ranks; every member's copies for this
  // rank's experts, expert by expert. The bytes recorded are this rank's copies (the program's
  // routed tensor), whichever way they go.
  at::Tensor to_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                        const std::string& label) const;
  // The reverse: rows for this rank's experts (expert by expert) back to their members; this
  // rank's copies in its expert order.
  at::Tensor from_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                          const std::string& label) const;
  // Tensor-parallel experts under sequence parallelism: each tp rank routes its sequence slice;
  // the copies that reach a rank (after the expert-parallel exchange, if any) are all-gathered
  // over tp for the experts (each rank a slice of every expert's width), ordered expert by
  // expert (`plan_tp_gather`, from every member's counts; `gather_copies`); the experts'
  // partial sums go back to their sources, over ep first and then reduce-scattered over tp, as
  // the program converts axis by axis in mesh order (`return_gathered`; `release`: `rows` are
  // not read again, their memory goes first).
  void plan_tp_gather(RankContext& c, LayerTape& t) const;
  at::Tensor gather_copies(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                           const std::string& label) const;
  at::Tensor return_gathered(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                             const std::string& label, bool release) const;
  // Folded experts (FoldedExchange): the stages' plan, from every member's counts and the
  // copies' sources (exchanged as metadata, unrecorded); the copies to their experts, and the
  // experts' rows back to their sources, recorded as the program's all-to-alls, one an axis,
  // each with the bytes of the rank's own routed copies.
  void plan_folded(RankContext& c, LayerTape& t) const;
  at::Tensor folded_to_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                               const std::string& label) const;
  at::Tensor folded_back(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                         const std::string& label) const;
  // What the program moves for the gathered copies: every tp member's own routed copies.
  double nominal_gathered_bytes(const RankContext& c, const LayerTape& t,
                                const at::Tensor& rows) const;

  // An operator's output goes once the operator that saved it has run its backward, as
  // autograd frees a saved tensor in Megatron's one graph; here the producer's unit keeps the
  // output as the root of its own backward, which reads only its inputs (ReLU alone reads
  // its result), so the storage is released. Not while a BI block defers the consumer's
  // weight gradient, which reads that input later (asked before the consumer's backward,
  // which clears its unit).
  bool defers_weights(const Unit& consumer) const;
  static void release_output(Unit& producer, bool consumer_defers);

  // The backward of moe_forward from the gradient of its output (the combine's); returns the
  // gradient of its input (the norm's output). Each producer's output goes after its
  // consumers' backward, as in the dense MLP.
  at::Tensor moe_backward(RunStats& st, const LayerParams& L, LayerTape& t, const at::Tensor& dy);

  // A layer's forward. Recomputed operators (`recompute_` of the layer, the plan's rules) drop
  // their pieces after it: what they read from outside the recomputed region stays with the
  // operators that keep it, the layer's input in the tape. `again` (just before the layer's
  // backward) runs only the recomputed operators, with the collectives that feed them, timed
  // as phase "recompute".
  at::Tensor layer_forward(RankContext& c, int l, const at::Tensor& x, LayerTape& t,
                           bool again = false);
  // The layer forward's parts (run_model_layer.cc).
  void attention_forward(RankContext& c, int l, const at::Tensor& in_x, LayerTape& t,
                         const LayerPass& p);
  at::Tensor attention_core(const std::vector<at::Tensor>& in, const DropoutKey& key, int l);
  // The attention of q [b, s, heads, d] over k (the same shape) and v [b, s, heads, dv], after
  // the rotary embedding and the grouped queries' expansion: [b, s, heads dv].
  at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, const DropoutKey& key, int l);
  // Latent attention (run_model_mla.cc): from the block's norm (t.n1) to attn.core's output,
  // the core's inputs being the query projection's output, the key/value up-projection's and
  // the rotary key part; and the backward from the core's output gradient to the norm's output
  // gradient.
  void latent_attention_forward(RankContext& c, int l, LayerTape& t, const LayerPass& p);
  at::Tensor latent_attention_core(const std::vector<at::Tensor>& in, const DropoutKey& key, int l);
  at::Tensor latent_attention_backward(RankContext& c, LayerTape& t, const at::Tensor& d,
                                       const std::set<std::string>& rc);
  void mlp_forward(RankContext& c, int l, LayerTape& t, const LayerPass& p);
  void keep_checkpoint(const at::Tensor& x, LayerTape& t, const LayerPass& p);
  void release_summands(const LayerPass& p, const char* op, Unit& add, Unit& linear);
  at::Tensor row_parallel_sum(RankContext& c, const Unit& linear, int ways, const char* label);
  void release_summed(const LayerPass& p, const char* norm_op, Unit& norm, Unit& linear,
                      const Param* bias);
  void drop_gathered(const LayerPass& p, const char* op, Unit& u);

  // An early-stopped operator's input `leaf` (its storage released after the forward) refilled
  // with `value`, the recomputation's, for its backward. `take`: the value's memory itself
  // moves into the leaf's storage (as PyTorch's checkpoint hands the recomputed tensor to the
  // saved one), leaving `value` empty: for a value nothing else reads afterwards.
  static void refill(const at::Tensor& leaf, const at::Tensor& value, bool take = true);

  // Context parallelism: attn.core of this rank's queries over every cp rank's keys and values
  // (run_context_parallel.h). The split into heads and the rotary embedding run under autograd
  // from the detached qkv input, the attention itself by hand: its forward all-gathers the keys
  // and values over cp, its backward passes them around the cp ring with their gradients (the
  // program's overlapped ring: one all-gather of twice the bytes, recorded as one all-gather
  // spanning the whole backward, the attention's backward inside it).
  // With qk_norm the queries and keys are the norm's output `qkn` and the values the projection's.
  Unit cp_core_forward(RankContext& c, const at::Tensor& qkv, const at::Tensor& qkn,
                       const char* phase, const DropoutKey& key, int layer);
  // Latent attention's (run_model_mla.cc): the query projection's output, the key/value
  // up-projection's and the rotary key part, as latent_attention_core takes them apart.
  Unit cp_latent_core_forward(RankContext& c, const at::Tensor& q, const at::Tensor& kv,
                              const at::Tensor& kpe, const char* phase, const DropoutKey& key,
                              int layer);
  // Their shared part: from q [b, sl, heads, dk], k [b, sl, kv heads, dk] and v [b, sl, kv
  // heads, dv], computed under autograd from u.in, the attention's output and ring state in u.
  void cp_attend(RankContext& c, Unit& u, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const DropoutKey& key, int layer);
  // The gradients of the unit's inputs: the projection's output's, and with qk_norm first the
  // normalized queries' and keys'.
  std::vector<at::Tensor> cp_core_backward(RankContext& c, Unit& u, const at::Tensor& dy);

  // A column-parallel linear's backward (attn.qkv, mlp.fc1) from the gradient of its output
  // `d`: under sequence parallelism its dropped input gathered again first (a recomputed one has
  // it), then its input's producer `norm` released (unless the linear's deferred weight gradient
  // reads it later), and the input gradient reduce-scattered back to the sequence slices, or
  // summed over the tensor-parallel group (`ways` > 1).
  // `tail_grad`: the gradient of columns of the norm's output after those the linear reads
  // (latent attention's rotary key part, which the core reads), appended before the sum;
  // `norm_read_later`: the norm's
  // output is read by another operator's backward still (latent attention's down-projection).
  at::Tensor column_parallel_backward(RankContext& c, const char* op, Unit& linear, Unit& norm,
                                      const at::Tensor& d, const std::set<std::string>& rc,
                                      int ways, const at::Tensor& tail_grad = at::Tensor(),
                                      bool norm_read_later = false);

  at::Tensor layer_backward(RankContext& c, int l, LayerTape& t, const at::Tensor& dy);

  at::Device device_;
  at::ScalarType dtype_;  // what the operators compute in; the parameters stay fp32
  ModelSpec spec_;
  int first_, end_;
  bool embedding_, head_;
  Split split_;
  int t_;
  unsigned long long seed_;
  std::deque<Param> params_;
  std::vector<LayerParams> layers_;
  std::vector<std::set<std::string>> recompute_;  // per layer of the segment
  // Per layer: the recomputed operators an early-stopping recomputation does not run again
  // (recompute_early_stop).
  std::vector<std::set<std::string>> stopped_;
  std::set<std::string> recompute_embed_, recompute_head_;
  // The backward being run: its phase ("bwd", or a BI block's "bwd_input") and, in a BI block,
  // where the deferred weight gradients go.
  const char* bwd_phase_ = "bwd";
  std::vector<DeferredWeightGrad>* deferred_ = nullptr;
  int unit_ = -1;  // the parameter unit running (a deferred gradient's unit)
  // The context of the pass running: its per-operator hook (RankContext::op_before).
  RankContext* ctx_ = nullptr;
  Param *word_ = nullptr, *pos_ = nullptr, *hn_g_ = nullptr, *hn_b_ = nullptr, *head_w_ = nullptr;
  bool shared_word_ = false;   // word_ is the embedding part's (not in params_)
  at::Tensor positions_;       // the sequence positions of the rank's tokens (long)
  int64_t first_head_ = 0;     // the global index of the rank's first query head
  bool fp8_ = false;           // the blocks' linear layers take fp8 inputs (set_fp8)
  bool reduce_input_ = false;  // set_reduce_input
  at::Tensor alibi_;           // ALiBi: the slopes of the rank's heads (fp32); else undefined
  at::Tensor causal_;          // causal_mask's last mask (true above the diagonal)
  at::Tensor windowed_;        // ... and its last sliding-window mask
};

}  // namespace nnsim::hwexec
