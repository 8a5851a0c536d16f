// Letting simulated time pass on an actor. SimGrid's own sleep is an action of the host model:
// under the ptask model every start and end of one re-solves the bandwidth sharing of every
// flow in flight, although a sleep takes no bandwidth. Compute is timed by the cost model and
// needs no resource, so it waits on a kernel timer instead, which SimGrid only fires.
#pragma once

namespace nnsim {

// Blocks the calling actor for `seconds` of simulated time (nothing when not positive).
void wait_for(double seconds);

}  // namespace nnsim
