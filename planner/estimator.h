// The planner's fast estimator: replays a compiled program's blocks without SimGrid. Every
// block takes the sum of its steps (compute from the cost model, collectives and transfers at
// their time alone on the network); a block starts when its lane is free and its input has
// arrived. Data-parallel collectives run on their own stream behind the compute. No contention
// between communications: the simulator confirms the best candidates with it.
#pragma once

#include <utility>
#include <vector>

#include "core/program.h"

namespace nnsim {

struct Estimate {
  double iteration_time = 0;
  double compute = 0;          // busiest lane's compute + recompute + optimizer
  double exposed_comm = 0;     // its exposed communication
  double bubble = 0;           // its idle time
  double bubble_fraction = 0;  // worst lane's idle time over the iteration
  double peak_memory = 0;      // worst lane, bytes
  double mfu = 0;
};

Estimate estimate_program(const Program& program);

// Busy time of a block template on its lane's compute stream (compute, and blocking collectives
// at their time alone on the network), split into the steps of transformer-layer operators and
// the rest (embedding, head, loss). Recompute steps are counted apart. The stage partitioner
// reads per-layer costs from it.
struct TemplateTime {
  double layers = 0;            // forward / backward of the layers' operators
  double layers_recompute = 0;  // recomputing the layers' dropped activations
  // Of the two above, per block shape (OpGraph::blocks) when the model has several: the
  // operators only that shape has; the rest are in every shape. Empty with one shape.
  std::vector<double> block_only;
  double other = 0;  // everything else on the compute stream
  // Point-to-point transfers the block starts to neighbouring segments' lanes (pipeline sends
  // of activations or gradients, at the block's end), each at its time alone on the network:
  // (receiving segment, seconds). They do not occupy the compute stream.
  std::vector<std::pair<int, double>> sends;
};
std::vector<TemplateTime> template_times(const Program& program);

}  // namespace nnsim
