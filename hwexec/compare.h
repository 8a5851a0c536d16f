// `nnsim compare`: a run file's measured times (nnexec run) against what the simulator predicts
// for the same plan on a topology, per operator, per operator kind, per collective and per
// iteration (docs/hwexec.md, "Comparing a run with the simulator"). The simulated operator times
// are the compiled program's own (core/compile_ops.cc prices every operator with op_seconds), the
// collective times the simulator's collective model alone on the network (decompose_collective,
// isolated_seconds), the iteration time a simulation (sim/simulator.h). Nothing is printed.
#pragma once

#include <string>
#include <vector>

#include "core/calibration.h"
#include "core/plan.h"
#include "core/topology.h"
#include "hwexec/run.h"

namespace nnsim::hwexec {

// The plan `run` (read from `run_path`) executed: the one embedded in it, or, when `given_path` is
// not empty, that file's plan after checking it has the same content (the error names the first
// field that differs).
Expected<Plan> plan_of_run(const RunResults& run, const std::string& run_path,
                           const std::string& given_path);

// Times are seconds per iteration, means over the ranks the row's operator or collective runs
// on; calls are per iteration. error = (simulated - measured) / measured (NaN when nothing was
// measured).
struct OpRow {
  std::string name;   // the operator graph's name ("attn.qkv"), or "optimizer"
  std::string phase;  // "fwd", "recompute", "bwd", "step"
  std::string kind;   // the operator's kind ("linear", "norm", ...), "optimizer"
  int ranks = 0;
  double measured_calls = 0, simulated_calls = 0;
  double measured = 0, simulated = 0;
  double error() const;
};

// Per operator kind: sums over the kind's operators, means over all ranks.
struct KindRow {
  std::string kind;
  double measured = 0, simulated = 0;
  double error() const;
};

// One collective (kind, axes, label), the run's against the compiled program's: calls and bytes
// per iteration on both sides (they must agree where the executor and the compiler agree on what
// is sent), and the simulator's time for the run's calls, each priced alone on the topology over
// the rank's group (send and recv: the transfer between the rank and the peer the program moves
// it to or from, core/transfer_peer.h); for a rank where only the program has the collective,
// the program's own calls priced the same way.
struct CollectiveRow {
  std::string kind, axes, label;
  int ranks = 0;  // ranks where either side has it
  double measured_calls = 0, simulated_calls = 0;
  double measured_bytes = 0, simulated_bytes = 0;  // per iteration, per rank
  double measured = 0, simulated = 0;
  // The run's bytes per call (the program's where the run has none).
  double bytes_per_call() const;
  double error() const;
};

// Communication by kind and axes, the run's against the compiled program's: calls and bytes per
// iteration, means over all ranks. Shows collectives one side has and the other has not.
struct TrafficRow {
  std::string kind, axes;
  double measured_calls = 0, simulated_calls = 0;
  double measured_bytes = 0, simulated_bytes = 0;
  double measured = 0, simulated = 0;
  double error() const;
};

struct Comparison {
  std::string plan_name, topology, gpu;
  std::string calibration;  // the calibration's source, or "built-in cost model"
  std::string device, dtype;
  int ranks = 0;
  std::vector<OpRow> ops;
  std::vector<KindRow> kinds;
  std::vector<CollectiveRow> collectives;
  std::vector<TrafficRow> traffic;
  // Per iteration: the run's slowest rank per measured iteration and their median; the simulated
  // iteration.
  std::vector<double> measured_iterations;
  double measured_iteration = 0, simulated_iteration = 0;
  double iteration_error() const;
  // Operator time per iteration summed over the operators, mean over ranks.
  double measured_compute = 0, simulated_compute = 0;
  double compute_error() const;
  // Peak bytes of tensors on the rank that holds the most: the run's (LibTorch's allocator, or
  // nnexec's CPU counter; -1 when the run did not measure it) against the simulator's lane peak
  // without what LibTorch's allocators do not count: the runtime reserve (CUDA context and
  // libraries) and NCCL's buffers (NaN without a simulation).
  double measured_peak_memory = -1, simulated_peak_memory = 0, simulated_untracked_memory = 0;
  // With --memory-timeline: the operator span during which that rank's peak fell ("" without).
  std::string measured_peak_operator, measured_peak_phase;
  double memory_error() const;
  // Medians of |error| over the rows that have one: every operator, the linear ones (GEMMs),
  // the collectives.
  double median_op_error = 0, median_gemm_error = 0, median_collective_error = 0;
  std::vector<std::string> notes;
};

struct CompareOptions {
  const Calibration* calibration = nullptr;  // applied for the topology's GPU
  std::string calibration_path;              // for the notes
  bool simulate_iteration = true;            // run the simulator for the iteration time
};

Expected<Comparison> compare_run(const RunResults& run, const Plan& plan, const Topology& topology,
                                 const CompareOptions& options = {});

// The comparison as JSON, SI units (seconds, bytes); errors as fractions, null where undefined.
std::string comparison_json(const Comparison& c);

}  // namespace nnsim::hwexec
