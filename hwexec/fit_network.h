// A run's collectives across machines priced on a topology, for the network's bandwidth
// (`nnsim calibrate run.h5 --topo T.yaml`, docs/hwexec.md "Calibrating from run files"): the run
// file says which machine each rank ran on (`host`), the topology what links join them. The plan
// is compiled for the topology (as `nnsim compare` does), its ranks' placement checked against
// the hosts, and every collective whose group spans machines decomposed by the simulator's own
// collective model (core/collective.h: the algorithm, the ring's channels over the NICs) with
// efficiency 1: its latency steps and the bottleneck bandwidth its bus volume crosses at. The
// fit (hwexec/fit.cc) then relates the measured times to that bandwidth as the NVLink class's
// to the GPU's NVLink bandwidth. No printing.
#pragma once

#include <string>

#include "core/plan.h"
#include "core/topology.h"
#include "hwexec/fit.h"
#include "hwexec/run.h"

namespace nnsim::hwexec {

// Replaces `points.cross_host` (collected by run_points) with series per kind, group size and
// route on `topology`, and sets `points.cross_host_routes` and `points.topology`. `run` is the
// file at `path`, `plan` its plan. Errors (naming the file, the topology and the fix) when the
// topology's GPUs cannot hold the run's ranks, when the run's hosts disagree with the nodes the
// plan's ranks are placed on, or when the plan does not compile for the topology. A run whose
// hosts are not recorded is left as it is (run_points noted it).
Status price_cross_host(const RunResults& run, const Plan& plan, const Topology& topology,
                        const std::string& path, RunPoints& points);

}  // namespace nnsim::hwexec
