// The SimGrid platform of a topology: a host per GPU and a SimGrid link per network link, routed
// by core/network.h's arithmetic routes (a custom routing zone: no route tables, so it builds in
// a fraction of a second for tens of thousands of GPUs).
#pragma once

#include <vector>

#include <simgrid/s4u/Host.hpp>

#include "core/network.h"

namespace nnsim {

// Must be called once, after the engine is created and before anything runs.
// Hosts are indexed by GPU, then come the network's waypoints (GPU count + Network::Waypoint),
// where the halves of a parallel task's flows meet (sim/collective_runner.h).
std::vector<simgrid::s4u::Host*> build_platform(const Network& net);

}  // namespace nnsim
