// ZeRO-3's gathers and reductions per block (run_zero3.h).
#include "hwexec/run_zero3.h"

#include <algorithm>

#include "core/opgraph.h"
#include "core/program.h"

namespace nnsim::hwexec {

std::vector<Zero3Block> zero3_blocks(const Plan& plan, const std::vector<Block>& order,
                                     int micro_batches) {
  std::vector<Zero3Block> out(order.size());
  // Segments whose recomputation has blocks of its own (R): the backward does not recompute.
  std::set<int> explicit_recompute, seen_forward;
  for (const Block& b : order) {
    if (b.kind == BlockKind::kRecompute) explicit_recompute.insert(b.segment);
  }
  // The operators of `part` (layer `l`, or -1: the embedding or the head) the plan's rules
  // recompute, as the program's recomputed_ops.
  const OpGraph graph = lower_model(plan.model, 1);
  auto recomputed = [&](const GraphPart& part, int l) {
    std::vector<bool> r(part.ops.size(), false);
    for (std::size_t i = 0; i < r.size(); ++i) {
      for (const RecomputeRule& rule : plan.recompute) {
        if (!match_pattern(rule.match, part.ops[i].name)) continue;
        r[i] =
            r[i] || (l < 0 ? rule.end_layer < 0
                           : l >= rule.first_layer && (rule.end_layer < 0 || l < rule.end_layer));
      }
    }
    return r;
  };
  // The operators whose weights a recomputation of `part` gathers again (none: not recomputed).
  const bool per_tensor = plan.comm.zero3_per_tensor && plan.comm.zero3_prefetch_elements > 0;
  auto gathered_again = [&](const GraphPart& part, int l) {
    const std::vector<bool> r = recomputed(part, l);
    std::set<std::string> ops;
    if (std::find(r.begin(), r.end(), true) == r.end()) return ops;
    const std::vector<bool> runs =
        per_tensor ? replayed_ops(part, r, plan.recompute_early_stop) : std::vector<bool>{};
    for (std::size_t i = 0; i < part.ops.size(); ++i) {
      if (!per_tensor || (runs[i] && !part.ops[i].weights.empty())) ops.insert(part.ops[i].name);
    }
    return ops;
  };
  const bool keep = plan.optimizer.keep_gathered;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const Block& b = order[i];
    Zero3Block& z = out[i];
    const bool first_forward =
        b.kind == BlockKind::kForward && seen_forward.insert(b.segment).second;
    if (b.kind == BlockKind::kRecompute) continue;  // an R block runs on the backward's gathers
    z.gather = !keep || first_forward;
    const bool weights = b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardWeight;
    z.reduce = weights && (!keep || b.micro_batch == micro_batches - 1);
    const bool recomputes_inside =
        b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardInput;
    if (!z.gather || !recomputes_inside || !plan.comm.zero3_regather_for_recompute ||
        explicit_recompute.count(b.segment)) {
      continue;
    }
    const Segment& s = plan.segments[b.segment];
    const int first_unit = s.embedding ? 1 : 0;
    auto add = [&](int unit, std::set<std::string> ops) {
      if (!ops.empty()) z.regather[unit] = std::move(ops);
    };
    for (int l = s.first_layer; l < s.end_layer; ++l) {
      add(first_unit + l - s.first_layer, gathered_again(graph.layer, l));
    }
    // The embedding and the head, recomputed by rules without a layer range: tensor by tensor
    // only (the whole-unit prefetch gathers layers again, not them).
    if (per_tensor && s.embedding) add(0, gathered_again(graph.embedding, -1));
    if (per_tensor && s.head) {
      add(first_unit + s.end_layer - s.first_layer, gathered_again(graph.head, -1));
    }
  }
  return out;
}

}  // namespace nnsim::hwexec
