// Tessel's schedule search (Lin et al., HPCA 2024): for any placement of one micro-batch's
// blocks on devices, including blocks that occupy several devices at once (a sharded embedding
// or head inside a pipeline), find the repeating steady-state pattern (the repetend) with the
// shortest period under a per-device memory limit, with the Z3 solver, then unroll it for any
// number of micro-batches.
//
// A repetend gives every block b a lag k_b (in period j the block runs for micro-batch j - k_b)
// and a start s_b within the period; blocks may wrap around the period's end. Constraints: no
// two blocks overlap on a device (on a circle of length P), a block starts after the blocks it
// needs of the same micro-batch end and their outputs arrive (k_c P + s_c >= k_b P + s_b + t_b +
// x_bc, x_bc the transfer time from b to c), and the activation bytes a device holds in steady
// state, plus each block's own peak, stay under its limit (evaluated exactly at every block's
// start).
// The shortest feasible P is found by bisection between the busiest device's work per
// micro-batch and the whole micro-batch run in sequence; at that P the smallest largest lag
// (the shortest fill and drain) is kept. Unrolled, every device runs its blocks in order of
// their absolute times (m + k_b) P + s_b; executed as soon as inputs have arrived and devices
// are ready this compacts warm-up and cool-down. Those ends still keep the repetend's order, so
// every micro-batch's blocks are also list-scheduled (earliest start first under the memory
// limit, ties by the repetend's order or backward first) and the orders that finish first kept.
// Then Tessel's second Z3 pass: the repetend's full periods fixed (shifted together), the
// warm-up and cool-down instances get their own starts under the same dependency, overlap and
// memory constraints, and the shortest makespan found (bisection) replaces the incumbent only
// when shorter.
#pragma once

#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim {

struct TesselBlock {
  BlockKind kind = BlockKind::kForward;
  int segment = 0;
  std::vector<int> devices;  // the devices it occupies together (several: a sharded block)
  double seconds = 0;
  // Activation bytes it leaves on each of its devices: positive keeps, negative frees. On every
  // device the blocks of one micro-batch sum to zero.
  double bytes = 0;
  std::vector<int> after;  // blocks of the same micro-batch that must end before it starts
  // Bytes above the level at its start it needs while it runs (workspace, and what it keeps);
  // at least `bytes`.
  double peak = 0;
  // Per entry of `after`: seconds from that block's end to this one's earliest start (the
  // transfer of its output from another device: a pipeline send of activations or gradients).
  // Empty: none.
  std::vector<double> transfer;
  double transfer_after(size_t i) const { return i < transfer.size() ? transfer[i] : 0.0; }
  // Repeated forwards: the forward pass it runs (Block::pass); 0 for every other block.
  int pass = 0;
};

struct TesselProblem {
  int devices = 1;
  int micro_batches = 1;
  std::vector<TesselBlock> blocks;  // one micro-batch's
  // Per device: activation bytes it may hold (empty: no limit).
  std::vector<double> memory_limit;
  // Solver work per satisfiability check (Z3's deterministic resource limit, not a wall-clock
  // time: the same inputs give the same schedule).
  // The whole search stops refining once it has spent `search_rlimit` (keeping the best
  // repetend found): at most about 15 s on this project's 2-core machine.
  unsigned solver_rlimit = 4'000'000;
  uint64_t search_rlimit = 8'000'000;
  // The same for the second pass (warm-up and cool-down around the repetend).
  uint64_t ends_rlimit = 1'000'000;
  // Relative precision of the period bisection.
  double precision = 0.01;
};

struct TesselSchedule {
  std::vector<std::vector<Block>> orders;  // per device, every micro-batch's blocks in order
  double period = 0;                       // the repetend's length
  double lower_bound = 0;                  // the busiest device's work per micro-batch
  std::vector<int> lag;                    // per block
  std::vector<double> start;               // per block, within the period
  double makespan = 0;                     // the orders run as soon as possible, transfers included
  std::vector<double> peak_bytes;          // per device, in the orders
  int solver_calls = 0;
  // The orders are the blocks list-scheduled (earliest start first under the memory limit),
  // which filled the warm-up and cool-down better than unrolling the repetend.
  bool ends_list_scheduled = false;
  // The orders' warm-up and cool-down came from the solver's second pass (below), which beat
  // `ends_incumbent`: the better of the unrolled repetend and the list schedules.
  bool ends_searched = false;
  double ends_incumbent = 0;
};

// Repeated forwards (AlphaFold's recycling, Tessel's 3F1B case): one micro-batch's `base` blocks
// with their forward blocks run `passes` times before the backward. Pass i + 1's first blocks
// (forwards that need no other forward) need pass i's last ones (forwards no other forward
// needs), `recycle_seconds` after they end. Only the last pass keeps activations; the earlier
// ones hold theirs while they run (their peak) and free them at once. Each forward's `pass` is
// its pass (0 to passes - 1), the plan's Block::pass, so the orders are a plan's with
// training.recycle = passes. Blocks: the passes' forwards in pass order, then the base's other
// blocks.
std::vector<TesselBlock> recycled_blocks(const std::vector<TesselBlock>& base, int passes,
                                         double recycle_seconds = 0);

// Fails when the blocks' dependencies form a cycle, a block needs a device that does not exist,
// or no repetend fits the memory limit.
Expected<TesselSchedule> tessel_search(const TesselProblem& problem);

// Runs per-device block orders of `problem` (blocks named by kind and segment) as soon as inputs
// have arrived (a needed block's end plus its transfer time) and devices are ready; a block on
// several devices starts when all of them reach it. Returns the makespan, or an error naming the
// device and block that can never start (a deadlock) or a block missing from a device's order.
struct OrdersRun {
  double makespan = 0;
  std::vector<double> peak_bytes;  // per device: the most activation bytes held at once
};
Expected<OrdersRun> run_orders(const TesselProblem& problem,
                               const std::vector<std::vector<Block>>& orders);

}  // namespace nnsim
