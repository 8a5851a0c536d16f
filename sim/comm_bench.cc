// Communication alone on a topology (sim/simulator.h: simulate_communication). Runs inside the
// child process.
#include <fmt/format.h>
#include <xbt/log.h>

#include <simgrid/s4u.hpp>

#include "sim/collective_runner.h"
#include "sim/platform.h"
#include "sim/simulation.h"

namespace nnsim {

namespace sg4 = simgrid::s4u;

Expected<std::vector<double>> run_communication(const Topology& topology, const CommModel& comm,
                                                const std::vector<CommRequest>& requests) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const CommRequest& r = requests[i];
    if (r.kind == CommRequest::Kind::kTransfer && r.gpus.size() != 2) {
      return Error(fmt::format("request {}: a transfer names a source and a destination GPU", i));
    }
    for (int g : r.gpus) {
      if (g < 0 || g >= topology.num_gpus()) {
        return Error(fmt::format("request {}: GPU {} does not exist (GPUs 0-{})", i, g,
                                 topology.num_gpus() - 1));
      }
    }
  }
  configure_engine_once();
  int argc = 1;
  char arg0[] = "nnsim";
  char* argv[] = {arg0, nullptr};
  sg4::Engine engine(&argc, argv);
  apply_engine_config();
  Network net(topology);
  std::vector<sg4::Host*> hosts = build_platform(net);
  std::vector<double> seconds(requests.size(), 0);
  std::vector<std::unique_ptr<CollectiveRunner>> runners;
  for (size_t i = 0; i < requests.size(); ++i) {
    const CommRequest& r = requests[i];
    runners.push_back(std::make_unique<CollectiveRunner>(net, hosts, r.algorithm, comm));
    CollectiveRunner* runner = runners.back().get();
    PreparedComm comm = r.kind == CommRequest::Kind::kTransfer
                            ? runner->prepare_transfer({r.gpus[0]}, {r.gpus[1]}, r.bytes)
                            : runner->prepare({r.gpus}, r.collective, r.bytes);
    sg4::Actor::create(fmt::format("request{}", i), hosts[r.gpus.front()],
                       [runner, comm, i, &seconds] {
                         runner->run(comm);
                         seconds[i] = sg4::Engine::get_clock();
                       });
  }
  engine.run();
  return seconds;
}

}  // namespace nnsim
