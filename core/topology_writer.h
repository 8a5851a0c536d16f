// A topology written back as the YAML load_topology reads (docs/topology.md), every figure in
// base units (bytes/s, seconds, bytes, FLOP/s): what `nnsim validate --write-plans` leaves next
// to each case's plan, so that `nnsim simulate` replays the case on the very cluster it built.
#pragma once

#include <string>

#include "core/error.h"
#include "core/topology.h"

namespace nnsim {

// Reading the text back gives the same cluster. An error when the format cannot say it: NICs of
// one node with different bandwidths or latencies, or a GPU whose precisions no catalog GPU has.
Expected<std::string> topology_to_yaml(const Topology& topo);

}  // namespace nnsim
