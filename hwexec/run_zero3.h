// ZeRO-3 for `nnexec run` (docs/hwexec.md): what each block of a rank's order gathers and
// reduces over dp, decided as the compiled program decides it (core/compile_blocks.cc, zero3_before
// and grads_ready), so that the executor's collectives are the program's call for call. No
// LibTorch: the executor (run_torch.cc) applies the decisions to its parameter units.
#pragma once

#include <set>
#include <vector>

#include "core/plan.h"

namespace nnsim::hwexec {

// ZeRO-3 in one block of a segment, unit by unit (a segment's units in forward order: the
// embedding's, each layer's, the head's).
struct Zero3Block {
  // Every unit is all-gathered before it runs (forward, backward, and a zero-bubble BI and BW
  // alike; one unit of prefetch). Off for a kept-gathered plan (optimizer.keep_gathered) except
  // in the segment's first forward of the iteration.
  bool gather = false;
  // Every unit's gradients are reduce-scattered as its backward ends: a B or BW block of every
  // micro-batch, or only of the last one when the parameters are kept gathered (the unsharded
  // gradients accumulate until then). Never a BI (its weight gradients come in the BW).
  bool reduce = false;
  // Units gathered twice: once for their recomputation inside this backward, once for the
  // backward (DeepSpeed's, comm.zero3_regather_for_recompute; never with explicit R blocks).
  // Whole units only: DeepSpeed's tensor-grained prefetch follows the program's queue instead
  // (core/program.h, zero3_uses).
  std::set<int> regather;
};

// The ZeRO-3 decisions for each block of `order` (one rank's), for a plan with
// optimizer.zero == 3; `micro_batches` per replica and iteration.
std::vector<Zero3Block> zero3_blocks(const Plan& plan, const std::vector<Block>& order,
                                     int micro_batches);

}  // namespace nnsim::hwexec
