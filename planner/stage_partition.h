// Automatic stage partitioning with stage-aware recomputation (Merak, DAPPLE): how many layers
// each pipeline stage holds and how many of them it recomputes, so that the slowest stage is as
// fast as possible while every stage fits in memory.
//
// The costs come from a compiled plan with the uniform split (measured, not assumed): per stage,
// the time of a layer's forward and backward, the extra time of recomputing one, the time of
// what is not a layer (the embedding on the first stage, the head and loss on the last), and
// the memory at the stage's peak broken into static bytes per layer, activation bytes per layer
// per in-flight micro-batch, and the rest. A model of several block shapes
// (ModelSpec::block_shapes: a mixture of experts with dense blocks too) has these per layer
// for each shape; with sliding
// windows they are a layer's attending fully, and each windowed layer takes off what its window
// saves. A stage's time and memory are linear in its layers; dynamic programming over (stage,
// layers placed) finds the split.
#pragma once

#include <vector>

#include "core/error.h"
#include "core/program.h"

namespace nnsim {

// One layer of one block shape on one stage: per micro-batch (times) and at the stage's memory
// peak (bytes).
struct LayerCosts {
  double seconds = 0;                      // forward + backward, not recomputed
  double recompute_seconds = 0;            // extra when fully recomputed
  double static_bytes = 0;                 // weights, gradients, optimizer state
  double activation_bytes = 0;             // kept per micro-batch, not recomputed
  double recomputed_activation_bytes = 0;  // kept per micro-batch, recomputed
};

// What sets one layer apart from the others (LayerCosts are a block shape's, attending fully).
struct LayerTraits {
  int block = 0;                        // its block shape (ModelSpec::block_shape)
  double window_seconds = 0;            // what its sliding window saves, forward + backward
  double recompute_window_seconds = 0;  // the same of its recomputation, when fully recomputed
};

// One pipeline stage's costs, per micro-batch (times) and at its memory peak (bytes).
struct StageCosts {
  std::vector<LayerCosts> blocks;  // per block shape (ModelSpec::block_shape)
  double other_seconds = 0;        // the stage's operators that are not layers
  int in_flight = 1;               // micro-batches whose activations are alive at the peak
  double fixed_bytes = 0;          // the rest of the peak (embedding, head, buffers, runtime)
  int device = 0;                  // the pipeline device (lane) that runs it
};

struct StagePartition {
  std::vector<int> layers;      // per stage
  std::vector<int> recomputed;  // per stage: its first layers fully recomputed
  double slowest_stage_seconds = 0;
};

// Stage costs of a compiled plan with one segment per stage (no virtual stages). `plain` is the
// plan without recomputation (or with the mode the user pinned), `recomputed` the same plan with
// every layer fully recomputed; pass the same program twice to forbid extra recomputation. A
// block shape that a stage does not hold gets the mean of the stages that do.
Expected<std::vector<StageCosts>> measure_stage_costs(const Program& plain,
                                                      const Program& recomputed);

// The times of measure_stage_costs (LayerCosts' seconds and recompute_seconds, StageCosts'
// other_seconds; the memory fields zero) per segment, several a device allowed (virtual
// stages).
Expected<std::vector<StageCosts>> measure_segment_times(const Program& plain,
                                                        const Program& recomputed);

// Each layer's traits, from the same two programs as measure_stage_costs.
std::vector<LayerTraits> layer_traits(const Program& plain, const Program& recomputed);

// The split of the layers (one entry each) over the stages (at least one layer each) that
// minimizes the slowest stage's time per micro-batch, recomputing in each stage only the layers
// it needs to fit in `capacity` bytes. Ties go to less recomputation, then to later stages
// holding more layers. Fails when no split fits.
Expected<StagePartition> partition_stages(const std::vector<StageCosts>& stages,
                                          const std::vector<LayerTraits>& layers, double capacity);

// The time per micro-batch of each stage holding the next `layers[s]` layers, none recomputed.
std::vector<double> stage_seconds(const std::vector<StageCosts>& stages,
                                  const std::vector<LayerTraits>& traits,
                                  const std::vector<int>& layers);

// Virtual stages (a device running several segments: interleaved, or in a V): from the split
// `layers`, takes a layer from one segment and gives one to another (the boundaries between
// them shift by one), the move that helps most first, while that makes the busiest device's
// time per micro-batch (the sum of its segments', StageCosts::device) and then the slowest
// segment's smaller: a local search, not always the best split. Every segment keeps a layer but
// the last (the head's), which may hold none. Memory aside: the caller checks the compiled
// plan. `segments` from measure_segment_times.
std::vector<int> balance_virtual_stages(const std::vector<StageCosts>& segments,
                                        const std::vector<LayerTraits>& traits,
                                        std::vector<int> layers);

// Stage-aware recomputation for a given split, also with virtual stages (a device holding
// several segments): from `recomputed` (per segment), every device of `program` whose exact
// memory peak is over `capacity` recomputes more of each of its segments' layers, enough to
// cover the excess at `saved_per_layer` bytes per recomputed layer per in-flight block.
// Returns the counts (unchanged when every device fits), or an error naming the device that
// cannot fit even recomputing every layer.
Expected<std::vector<int>> recompute_to_fit(const Program& program, std::vector<int> recomputed,
                                            double saved_per_layer, double capacity);

}  // namespace nnsim
