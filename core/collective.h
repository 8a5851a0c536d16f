// Collectives decomposed the way NCCL runs them, into concurrent flows between GPUs:
//
//  - ring: members ordered node by node; one ring per channel, channel c entering each node at
//    local member c and leaving it at member c-1, so that every NIC of the group carries one
//    channel out and one in (NCCL's multi-ring layout). An all-reduce moves 2(n-1)/n of the
//    buffer over every ring edge, an all-gather or reduce-scatter (n-1)/n.
//  - tree (all-reduce only): a chain through the members of each node and two binary trees over
//    the nodes, each carrying half the buffer (NCCL's double binary tree); reduce up, broadcast
//    down, pipelined.
//  - all-to-all: every member sends 1/n of its buffer to every other member.
//  - expert exchange (DeepEP's dispatch and combine; DeepSeek-V3 report, section 3.2.2): a
//    token crosses to another node once, to the GPU of the same local index there, whatever
//    number of its experts that node holds, and is forwarded over NVLink to the GPUs holding
//    them; within its own node it goes once to each GPU holding one of its experts. The two
//    legs run together. Volumes are expectations under the router's uniform choice
//    (expert_hit_probability).
//
// The flows of a pipelined algorithm progress together at the rate of their bottleneck link
// (what SimGrid's parallel tasks do), so a collective alone on the network takes
//   max over links (bytes crossing the link / its bandwidth) + steps x route latency,
// which `isolated_seconds` computes; the simulator runs the same flows with contention.
#pragma once

#include <string>
#include <vector>

#include "core/comm_model.h"
#include "core/layout.h"
#include "core/network.h"

namespace nnsim {

enum class Algorithm { kAuto, kRing, kTree };

// What an expert exchange needs of the model's router (ModelSpec's experts, experts_per_token,
// expert_capacity_factor, router_groups and router_group_topk).
struct ExpertRouting {
  double experts = 0;
  double per_token = 0;
  double capacity_factor = 1;
  double groups = 1;
  double group_topk = 1;
};

// The probability that a token picks at least one of `held` experts that sit together (a GPU's
// or a node's: whole router groups, or part of one), when its router picks group_topk of the
// groups and then per_token experts among theirs, all equally likely.
double expert_hit_probability(const ExpertRouting& r, double held);

struct Flow {
  int src = 0;  // GPU indices
  int dst = 0;
  double bytes = 0;
};

struct CollectiveFlows {
  std::string algorithm;    // "ring", "tree", "all-to-all", "p2p"
  std::vector<Flow> flows;  // bytes already divided by NCCL's efficiency at this size
  int steps = 1;            // sequential latency steps (2(n-1) for a ring all-reduce)
  double step_latency = 0;  // least time per step (CommModel), wire latency included
};

// Decomposes a collective over `gpus` (group order) moving `bytes` (nccl-tests convention, see
// core/layout.h). kAuto picks the algorithm with the smaller isolated time, as NCCL's tuner
// does. One member gives no flows.
// NCCL's protocol efficiency and per-step time come from `comm` (CommModel::ideal() for the
// bare network).
// An expert exchange's `bytes` is the all-to-all's: each device's routed token copies,
// padding included; without `routing` (no experts) it runs as that all-to-all.
CollectiveFlows decompose_collective(CollectiveKind kind, const std::vector<int>& gpus,
                                     double bytes, Algorithm algorithm, const Network& net,
                                     const CommModel& comm, const ExpertRouting& routing = {});
// Point-to-point transfers src_gpus[i] -> dst_gpus[i] of `bytes` each, at once.
CollectiveFlows decompose_transfer(const std::vector<int>& src_gpus,
                                   const std::vector<int>& dst_gpus, double bytes,
                                   const Network& net, const CommModel& comm);
// Time per latency step: the larger of the route latency and the model's step latency.
double step_seconds(const CollectiveFlows& c, double route_latency);

// Seconds the flows take alone on the network (see above). Scratch vectors are reused between
// calls through `scratch` to avoid allocation on hot paths.
struct LinkLoadScratch {
  std::vector<double> load;
  std::vector<int> touched;
  std::vector<int> route;
};
double isolated_seconds(const CollectiveFlows& c, const Network& net, LinkLoadScratch& scratch);
// Largest route latency among the flows.
double max_route_latency(const CollectiveFlows& c, const Network& net, LinkLoadScratch& scratch);

}  // namespace nnsim
