// Automatic stage partitioning with stage-aware recomputation (Merak, DAPPLE): how many layers
// each pipeline stage holds and how many of them it recomputes, so that the slowest stage is as
// fast as possible while every stage fits in memory.
//
// The costs come from a compiled plan with the uniform split (measured, not assumed): per stage,
// the time of a layer's forward and backward, the extra time of recomputing one, the time of
// what is not a layer (the embedding on the first stage, the head and loss on the last), and
// the memory at the stage's peak broken into static bytes per layer, activation bytes per layer
// per in-flight micro-batch, and the rest. Layers are identical, so a stage's time and memory
// are linear in its layer count; dynamic programming over (stage, layers placed) finds the split.
#pragma once

#include <vector>

#include "core/error.h"
#include "core/program.h"

namespace nnsim {

// One pipeline stage's costs, per micro-batch (times) and at its memory peak (bytes).
struct StageCosts {
  double layer_seconds = 0;                    // forward + backward of one layer, not recomputed
  double recompute_seconds = 0;                // extra for one fully recomputed layer
  double other_seconds = 0;                    // the stage's operators that are not layers
  double static_per_layer = 0;                 // weights, gradients, optimizer state of one layer
  double activation_per_layer = 0;             // kept per micro-batch, not recomputed
  double activation_per_recomputed_layer = 0;  // kept per micro-batch, recomputed
  int in_flight = 1;       // micro-batches whose activations are alive at the peak
  double fixed_bytes = 0;  // the rest of the peak (embedding, head, buffers, runtime)
};

struct StagePartition {
  std::vector<int> layers;      // per stage
  std::vector<int> recomputed;  // per stage: its first layers fully recomputed
  double slowest_stage_seconds = 0;
};

// Stage costs of a compiled plan with one segment per stage (no virtual stages). `plain` is the
// plan without recomputation (or with the mode the user pinned), `recomputed` the same plan with
// every layer fully recomputed; pass the same program twice to forbid extra recomputation.
Expected<std::vector<StageCosts>> measure_stage_costs(const Program& plain,
                                                      const Program& recomputed);

// The split of `layers` layers over the stages (at least one layer each) that minimizes the
// slowest stage's time per micro-batch, recomputing in each stage only the layers it needs to
// fit in `capacity` bytes. Ties go to less recomputation, then to later stages holding more
// layers. Fails when no split fits.
Expected<StagePartition> partition_stages(const std::vector<StageCosts>& stages, int layers,
                                          double capacity);

// Stage-aware recomputation for a given split, also with virtual stages (a device holding
// several segments): from `recomputed` (per segment), every device of `program` whose exact
// memory peak is over `capacity` recomputes more of each of its segments' layers, enough to
// cover the excess at `saved_per_layer` bytes per recomputed layer per in-flight block.
// Returns the counts (unchanged when every device fits), or an error naming the device that
// cannot fit even recomputing every layer.
Expected<std::vector<int>> recompute_to_fit(const Program& program, std::vector<int> recomputed,
                                            double saved_per_layer, double capacity);

}  // namespace nnsim
