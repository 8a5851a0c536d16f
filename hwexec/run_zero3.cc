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
  // Whether layer `l` recomputes any operator.
  const OpGraph graph = lower_model(plan.model, 1);
  auto recomputes = [&](int l) {
    const std::vector<bool> r = recomputed_ops(plan, graph.layer_at(l), l);
    return std::find(r.begin(), r.end(), true) != r.end();
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
    for (int l = s.first_layer; l < s.end_layer; ++l) {
      if (recomputes(l)) z.regather.insert(first_unit + l - s.first_layer);
    }
  }
  return out;
}

}  // namespace nnsim::hwexec
