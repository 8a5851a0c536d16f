#include "sim/platform.h"

#include <simgrid/kernel/routing/NetPoint.hpp>
#include <simgrid/kernel/routing/NetZoneImpl.hpp>
#include <simgrid/s4u/Link.hpp>
#include <simgrid/s4u/NetZone.hpp>

namespace nnsim {
namespace {

namespace sg4 = simgrid::s4u;
using simgrid::kernel::routing::NetPoint;
using simgrid::kernel::routing::Route;

// Routes from Network: host netpoint ids are the GPU indices, then the GPU count plus a
// Network::Waypoint (hosts are created first, in order).
class ClusterZone : public simgrid::kernel::routing::NetZoneImpl {
 public:
  ClusterZone(const Network& net) : NetZoneImpl("cluster"), net_(net) {}
  std::vector<simgrid::kernel::resource::StandardLinkImpl*> links;
  std::vector<double> latency;

 protected:
  void get_local_route(const NetPoint* src, const NetPoint* dst, Route* route,
                       double* lat) override {
    route_.clear();
    const int gpus = net_.topology().num_gpus();
    const int s = static_cast<int>(src->id());
    const int d = static_cast<int>(dst->id());
    if (s < gpus && d < gpus) {
      net_.route(s, d, route_);
    } else if (s < gpus) {
      net_.route_to(s, static_cast<Network::Waypoint>(d - gpus), route_);
    } else {
      net_.route_from(static_cast<Network::Waypoint>(s - gpus), d, route_);
    }
    for (int l : route_) {
      route->link_list_.push_back(links[l]);
      // Half a route reports no latency: its task waits the whole route's before it starts.
      if (lat && s < gpus && d < gpus) *lat += latency[l];
    }
  }

 private:
  const Network& net_;
  std::vector<int> route_;
};

}  // namespace

std::vector<sg4::Host*> build_platform(const Network& net) {
  // The zone is owned by SimGrid's engine once created (it becomes the root zone).
  auto* zone = new ClusterZone(net);
  sg4::NetZone* iface = zone->get_iface();
  const int gpus = net.topology().num_gpus();
  std::vector<sg4::Host*> hosts;
  hosts.reserve(gpus);
  // Host speed is irrelevant: compute is timed by the cost model and replayed as sleeps.
  for (int g = 0; g < gpus; ++g) {
    hosts.push_back(iface->create_host("gpu" + std::to_string(g), 1e12)->seal());
  }
  for (int w = 0; w < Network::kWaypoints; ++w) {
    hosts.push_back(iface->create_host("waypoint" + std::to_string(w), 1e12)->seal());
  }
  const auto& links = net.links();
  zone->links.reserve(links.size());
  zone->latency.reserve(links.size());
  for (const NetLink& l : links) {
    sg4::Link* link = iface->create_link(l.name, l.bandwidth);
    link->set_latency(l.latency);
    link->seal();
    zone->links.push_back(link->get_impl());
    zone->latency.push_back(l.latency);
  }
  iface->seal();
  return hosts;
}

}  // namespace nnsim
