// The embedding's and the head's operators of a model part (run_model.h).
#include "hwexec/run_model.h"

#include <fmt/format.h>

namespace nnsim::hwexec {

at::Tensor Model::embed_forward(RankContext& c, const at::Tensor& tokens,
                                const at::Tensor& recycled, MicroBatchTape& tape, bool again) {
  RunStats& st = *c.stats;
  const std::set<std::string>& rc = recompute_embed_;
  auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
  const char* phase = again ? "recompute" : "fwd";
  const at::Tensor& toks = again ? tape.tokens : tokens;
  const at::Tensor& rec = again ? tape.recycled : recycled;
  if (runs("embed.word")) {
    const int64_t vl = spec_.vocab / split_.embed_vocab;
    const int64_t start = vocab_index(/*head=*/false) * vl;
    tape.word = fwd(st, "embed.word", phase, {}, [&](const std::vector<at::Tensor>&) {
      // The rows looked up in fp32, then cast: the same values as a lookup in a bf16 copy of
      // the table, without casting the whole table.
      if (split_.embed_vocab == 1) return at::embedding(word_->w, toks).to(dtype_);
      at::Tensor local = toks - start;
      at::Tensor mask = (local >= 0).logical_and(local < vl);
      return (at::embedding(word_->w, local.clamp(0, vl - 1)) * mask.unsqueeze(-1).to(at::kFloat))
          .to(dtype_);
    });
  }
  at::Tensor x;
  // Again: the operator reading the word embeddings (the position table's add, or dropout
  // without one) recomputed, so the conversions feeding it run again.
  if (!again || (pos_ ? runs("embed.position") : spec_.dropout && runs("embed.dropout"))) {
    // The word embeddings' partial sums (vocab-parallel) reduced for the operator that reads
    // them, which the program names the conversion after.
    const char* reader = pos_ ? "embed.position" : spec_.dropout ? "embed.dropout" : "attn.norm";
    at::Tensor e = tape.word.out.detach().clone();
    // A spanning embedding's partial sums over the pipeline axes first, as the program
    // converts one axis at a time (labelled as its partial sums without an operator of its
    // own reading them: no position table, no dropout); then the tensor-parallel ones, but
    // without such an operator those go on to the first layer's segment (reduce_input_).
    const bool own_reader = pos_ || spec_.dropout;
    bool tensor_partial = split_.embed_vocab > 1;
    if (split_.embed_vocab > 1 && c.embed_vocab.pipeline) {
      tensor_partial = false;
      for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
        if (a.pipeline) {
          c.all_reduce(e, a.group, a.name, own_reader ? reader : "embed.partial-sums");
        }
        tensor_partial = tensor_partial || !a.pipeline;
      }
      if (!own_reader) tensor_partial = false;
    }
    if (split_.seq > 1 && (own_reader || !c.embed_vocab.pipeline)) {
      // Sequence parallelism: reduce-scattered to this rank's slice.
      e = tensor_partial ? scatter_seq(c, e, reader) : my_seq(e);
    } else if (tensor_partial) {
      for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
        if (!a.pipeline) c.all_reduce(e, a.group, a.name, reader);
      }
    }
    if (rec.defined()) e = e + rec.to(e.scalar_type());
    x = e;  // rotary or ALiBi positions: applied in attn.core
  }
  if (pos_ && runs("embed.position")) {
    const int64_t sl = x.size(1), first = split_.seq > 1 ? t_ * sl : 0;
    tape.pos = fwd(st, "embed.position", phase, {leaf(x)}, [&](const std::vector<at::Tensor>& in) {
      // Context parallelism: the rows of this rank's positions (under sequence
      // parallelism, of its slice of them).
      return in[0] + (split_.cp > 1 ? W(pos_).index_select(0, positions_.narrow(0, first, sl))
                                    : W(pos_).narrow(0, first, sl));
    });
    x = tape.pos.out.detach();
    // The word embeddings and their reduced copy are summed and gone, as in Megatron: the
    // lookup's backward reads the token ids, the add's none.
    if (!again && rc.empty()) {
      resize_storage(tape.word.out, 0);
      resize_storage(tape.pos.in[0], 0);
    }
  }
  if (again && pos_ && !runs("embed.position")) x = tape.pos.out.detach();  // kept
  // Dropout recomputed draws its masks again from the tape's key: the same ones.
  if (spec_.dropout && runs("embed.dropout")) {
    tape.drop = fwd(st, "embed.dropout", phase, {leaf(x)}, [&](const std::vector<at::Tensor>& in) {
      return in[0] * hidden_dropout(tape.key, -1, DropoutSite::kEmbedding, in[0]);
    });
    x = tape.drop.out.detach();
  }
  if (!again && !rc.empty()) {
    tape.tokens = tokens;
    tape.recycled = recycled;
    if (rc.count("embed.word")) tape.word = Unit{};
    if (rc.count("embed.position")) tape.pos = Unit{};
    if (rc.count("embed.dropout")) tape.drop = Unit{};
  }
  return x;
}

void Model::head_forward(RankContext& c, const at::Tensor& x, const at::Tensor& targets,
                         MicroBatchTape& tape, bool again) {
  RunStats& st = *c.stats;
  const std::set<std::string>& rc = recompute_head_;
  auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
  const char* phase = again ? "recompute" : "fwd";
  const at::Tensor& in_x = again ? tape.head_x : x;
  const at::Tensor& tgt = again ? tape.targets : targets;
  if (runs("head.norm")) {
    tape.hnorm = fwd(st, "head.norm", phase, {leaf(in_x)},
                     [&](const std::vector<at::Tensor>& in) { return norm(in[0], hn_g_, hn_b_); });
  }
  const bool tied = spec_.tied_embeddings;
  const int vsplit = tied ? split_.embed_vocab : split_.head_vocab;
  const bool sp = split_.seq > 1;
  if (runs("head.proj")) {
    tape.hproj = fwd(st, "head.proj", phase, {column_input(c, tape.hnorm.out, "head.proj")},
                     [&](const std::vector<at::Tensor>& in) {
                       return mm(in[0], tied ? W(word_).t() : W(head_w_));
                     });
    tape.hproj.weights = weights_of({tied ? word_ : head_w_});
    // Sequence parallelism: the gathered input is dropped unless the recomputation gathers it.
    if (sp && !again && !rc.count("head.proj")) dropped(tape.hproj.in[0]);
  }
  if (runs("loss")) {
    // Vocab-parallel cross-entropy, mean over the micro-batch's tokens, in fp32 and, as
    // Megatron's, in place on one fp32 copy of the logits (the logits themselves when they are
    // fp32: the projection's backward does not read them): shifted by the row maximum, then
    // exponentiated into the buffer the backward keeps.
    const Mark t0 = st.mark();
    at::Tensor z = tape.hproj.out.detach().to(at::kFloat);
    const int64_t vl = z.size(-1);
    const int64_t start = vocab_index(/*head=*/true) * vl;
    // The vocabulary's group: the embedding's when tied.
    const VocabSplit& vg = tied ? c.embed_vocab : c.head_vocab;
    at::Tensor lmax = std::get<0>(z.max(-1));
    if (vsplit > 1) c.vocab_all_reduce(vg, lmax, "loss", Comm::Op::kMax);
    z.sub_(lmax.unsqueeze(-1));
    at::Tensor local = tgt - start;
    at::Tensor mask = (local >= 0).logical_and(local < vl).to(at::kFloat);
    at::Tensor idx = local.clamp(0, vl - 1).unsqueeze(-1);
    at::Tensor target_logit = z.gather(-1, idx).squeeze(-1) * mask;
    tape.ez = z.exp_();
    tape.se = tape.ez.sum(-1);
    if (vsplit > 1) {
      c.vocab_all_reduce(vg, tape.se, "loss");
      c.vocab_all_reduce(vg, target_logit, "loss");
    }
    if (!again) tape.loss = (tape.se.log() - target_logit).mean();
    tape.target_index = idx;
    tape.target_mask = mask;
    st.op("loss", phase, t0, st.mark(), /*minus_collectives=*/true);
  }
  if (!again && !rc.empty()) {
    tape.head_x = x;
    tape.targets = targets;
    if (rc.count("head.norm")) tape.hnorm = Unit{};
    if (rc.count("head.proj")) tape.hproj = Unit{};
    if (rc.count("loss")) tape.ez = tape.se = tape.target_index = tape.target_mask = at::Tensor();
  }
}

}  // namespace nnsim::hwexec
