// Replays one training iteration of a compiled plan as a SimGrid discrete-event simulation.
//
// Every simulated lane (devices running one program in lockstep) is a SimGrid actor for its
// compute stream, with a second actor for its data-parallel communication stream; each pipeline
// transfer is a short-lived actor. Collectives are decomposed into flows (core/collective.h)
// that run as one SimGrid parallel task, so that concurrent groups share the links they cross.
//
// SimGrid keeps global state that cannot be reset within a process, so every simulation runs in
// a child process; `simulate` forks, runs it there and reads the result back. Callers may call it
// any number of times, from tests too.
#pragma once

#include <functional>

#include "core/collective.h"
#include "core/error.h"
#include "core/program.h"
#include "core/topology.h"
#include "sim/result.h"

namespace nnsim {

struct SimOptions {
  // kSymmetric simulates one data-parallel replica: its collectives still move every replica's
  // bytes over every replica's links, but other replicas' pipeline transfers are not replayed
  // (docs/simulator.md measures the effect). kFull simulates every replica.
  Fidelity fidelity = Fidelity::kSymmetric;
  bool record_tasks = false;  // keep every task for traces (--trace, --hdf5)
  // Run a collective whose links no other communication of the plan ever crosses in closed form
  // (the time SimGrid gives it alone) instead of as SimGrid activities. Exact; much faster.
  bool fold_exclusive_collectives = true;
  // Run a lane's per-rank collectives (one group per tensor-parallel rank, say) as the first
  // rank's group alone where every rank's groups cross links alike (sim/lane_mirror.h). Exact;
  // much faster where data-parallel rings overlap tensor-parallel collectives.
  bool mirror_lane_ranks = true;
  // Called with the fraction of blocks done, at most every 0.2 s of wall time.
  std::function<void(double)> progress;
};

Expected<SimResult> simulate(const Program& program, const SimOptions& options = {});

// Communication alone on a topology: collectives and transfers that all start at time 0 and
// share the network. Used to check the network model against closed forms and to measure
// collectives the way nccl-tests does.
struct CommRequest {
  enum class Kind { kCollective, kTransfer };
  Kind kind = Kind::kCollective;
  CollectiveKind collective = CollectiveKind::kAllReduce;
  Algorithm algorithm = Algorithm::kRing;
  std::vector<int> gpus;  // the group (kCollective) or {source, destination} (kTransfer)
  double bytes = 0;
};
// Seconds each request took, with NCCL's protocol efficiency and step times from `comm`
// (CommModel::ideal() for the bare network).
Expected<std::vector<double>> simulate_communication(const Topology& topology,
                                                     const CommModel& comm,
                                                     const std::vector<CommRequest>& requests);

}  // namespace nnsim
