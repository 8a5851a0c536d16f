// Where a compiled program's pipeline transfers go, rank by rank: the pairs of devices the
// simulator moves each send and receive between (sim/simulation.cc, decompose_transfer), for
// tools that meet one rank's transfers without the simulator (nnsim compare's priced rows).
#pragma once

#include "core/program.h"

namespace nnsim {

// The data-parallel replica of `rank` (its dp coordinate; 0 without a dp axis).
int replica_of(const Program& prog, int rank);

// The lane that runs `rank`'s program (its counterpart's in replica 0); -1 when none does.
int lane_of(const Program& prog, int rank);

// The other end of a transfer (a kSend or kRecv step of `rank`'s lane): the peer lane's device
// at `rank`'s place in its own lane (the two lanes' devices pair in order), in `rank`'s
// replica. -1 for other steps, or a rank no lane runs.
int transfer_peer(const Program& prog, int rank, const Step& step);

}  // namespace nnsim
