#include "sim/wait.h"

#include <simgrid/kernel/Timer.hpp>
#include <simgrid/s4u/Engine.hpp>
#include <simgrid/s4u/Semaphore.hpp>

namespace nnsim {

void wait_for(double seconds) {
  if (!(seconds > 0)) return;
  simgrid::s4u::SemaphorePtr done = simgrid::s4u::Semaphore::create(0);
  // The timer's callback runs in SimGrid's kernel, where releasing a semaphore is immediate.
  simgrid::kernel::timer::Timer::set(simgrid::s4u::Engine::get_clock() + seconds,
                                     [done] { done->release(); });
  done->acquire();
}

}  // namespace nnsim
