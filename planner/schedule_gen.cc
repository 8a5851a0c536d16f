#include "planner/schedule_gen.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "core/program.h"
#include "core/units.h"
#include "planner/estimator.h"
#include "planner/list_schedule.h"

namespace nnsim {

namespace {

bool list_scheduled(ScheduleKind kind) {
  return kind == ScheduleKind::kZbH1 || kind == ScheduleKind::kZbH2 || kind == ScheduleKind::kZbV ||
         kind == ScheduleKind::kMerak;
}

// What one segment's blocks cost, read from a compiled plan (the slowest variant of each).
struct SegmentCosts {
  double forward = 0, backward = 0, backward_input = 0, backward_weight = 0, recompute = 0;
  double kept = 0;            // activation bytes a forward keeps
  double weight_inputs = 0;   // of which a weight-gradient block frees
  double recompute_kept = 0;  // what an explicit recompute block brings back
  double backward_frees = 0;  // what a whole backward frees (an explicit recompute's too)
  // Bytes above the level at the block's start at its peak, per kind.
  double forward_peak = 0, backward_peak = 0, backward_input_peak = 0, backward_weight_peak = 0;
  // Transfer times to neighbouring segments (the slowest of the block's sends to that segment's
  // lanes, at its time alone on the network): the forward's activations, the backward's (or
  // BI's) input gradients, by receiving segment.
  std::map<int, double> forward_sends, backward_sends;
  double forward_send(int to) const { return forward_sends.count(to) ? forward_sends.at(to) : 0; }
  double backward_send(int to) const {
    return backward_sends.count(to) ? backward_sends.at(to) : 0;
  }
};

std::vector<SegmentCosts> segment_costs(const Program& prog) {
  std::vector<SegmentCosts> out(prog.plan.segments.size());
  const std::vector<TemplateTime> times = template_times(prog);
  for (size_t t = 0; t < prog.templates.size(); ++t) {
    const BlockTemplate& tpl = prog.templates[t];
    if (tpl.paired) continue;  // its forward and backward are templates too
    SegmentCosts& c = out[tpl.segment];
    const double s = times[t].layers + times[t].layers_recompute + times[t].other;
    std::map<int, double>* sends = nullptr;
    if (tpl.kind == BlockKind::kForward) sends = &c.forward_sends;
    if (tpl.kind == BlockKind::kBackward || tpl.kind == BlockKind::kBackwardInput) {
      sends = &c.backward_sends;
    }
    for (const auto& [to, seconds] : times[t].sends) {
      if (sends) (*sends)[to] = std::max((*sends)[to], seconds);
    }
    switch (tpl.kind) {
      case BlockKind::kForward:
        c.forward = std::max(c.forward, s);
        c.kept = std::max(c.kept, tpl.kept_bytes);
        c.forward_peak = std::max(c.forward_peak, tpl.peak_bytes);
        break;
      case BlockKind::kBackward:
        c.backward = std::max(c.backward, s);
        c.backward_peak = std::max(c.backward_peak, tpl.peak_bytes);
        c.backward_frees = std::max(c.backward_frees, -tpl.kept_bytes);
        break;
      case BlockKind::kBackwardInput:
        c.backward_input = std::max(c.backward_input, s);
        c.backward_input_peak = std::max(c.backward_input_peak, tpl.peak_bytes);
        break;
      case BlockKind::kBackwardWeight:
        c.backward_weight = std::max(c.backward_weight, s);
        c.backward_weight_peak = std::max(c.backward_weight_peak, tpl.peak_bytes);
        c.weight_inputs = std::max(c.weight_inputs, -tpl.kept_bytes);
        break;
      case BlockKind::kRecompute:
        c.recompute = std::max(c.recompute, s);
        c.recompute_kept = std::max(c.recompute_kept, tpl.kept_bytes);
        break;
    }
  }
  return out;
}

// Whether every device's orders keep its activation bytes within the problem's memory limit.
bool holds_within(const ListScheduleProblem& p, const std::vector<std::vector<Block>>& orders) {
  if (p.memory_limit.empty()) return true;
  for (size_t d = 0; d < orders.size(); ++d) {
    double level = 0;
    for (const Block& b : orders[d]) {
      const double kept = p.forward_bytes[b.segment];
      const double weights = p.weight_input_bytes.empty() ? 0.0 : p.weight_input_bytes[b.segment];
      switch (b.kind) {
        case BlockKind::kForward:
          level += kept;
          if (level > p.memory_limit[d] * (1 + 1e-9)) return false;
          break;
        case BlockKind::kBackward:
          level -= kept;
          break;
        case BlockKind::kBackwardInput:
          level -= kept - weights;
          break;
        case BlockKind::kBackwardWeight:
          level -= weights;
          break;
        case BlockKind::kRecompute:
          break;
      }
    }
  }
  return true;
}

}  // namespace

namespace {

// The plan as the generators need it: one schedule order per pipeline stage, its segments where
// the `kind` schedule puts them, in layer order. Fills each pipeline rank's order index.
Status check_pipeline(const Plan& plan, ScheduleKind kind, int stages, int segments,
                      std::optional<double> memory_limit, std::map<int, int>& order_of_rank) {
  // Order index of each pipeline rank.
  for (int i = 0; i < stages; ++i) {
    const MeshSlice& d = plan.schedule[i].devices;
    auto it = d.find("pp");
    if (it == d.end() || d.size() != 1) {
      return Error(
          fmt::format("schedule order {} is not one pipeline stage ({{\"pp\": r}}); the "
                      "generators schedule pipelines of one order per stage",
                      i));
    }
    order_of_rank[it->second] = i;
  }
  for (int i = 0; i < segments; ++i) {
    const Segment& s = plan.segments[i];
    const int want = rank_of_segment(kind, i, stages);
    auto it = s.devices.find("pp");
    if (it == s.devices.end() || it->second != want) {
      return Error(fmt::format(
          "segment '{}' is not where the {} schedule puts segment {} (pp={}); build the plan "
          "with --schedule {}{}",
          s.name, to_string(kind), i, want, to_string(kind),
          required_chunks(kind) == 2 ? " --vpp 2" : ""));
    }
    if (i + 1 < segments && s.end_layer != plan.segments[i + 1].first_layer) {
      return Error(
          fmt::format("segment '{}' is not followed by the next layers; the generators "
                      "need segments in layer order",
                      s.name));
    }
  }
  if (order_of_rank.size() != static_cast<size_t>(stages)) {
    return Error("two schedule orders name the same pipeline stage");
  }
  if (memory_limit && !list_scheduled(kind)) {
    return Error(
        fmt::format("--memory-limit applies to zb-h1, zb-h2, zb-v and merak; the {} "
                    "schedule's memory follows from its shape",
                    to_string(kind)));
  }
  if (kind == ScheduleKind::kMerak) {
    bool any = false;
    for (const RecomputeRule& r : plan.recompute) {
      any |= r.first_layer < plan.segments[segments - 1].first_layer;
    }
    if (!any) {
      return Error(
          "the merak schedule moves recomputation off the critical path, but the plan "
          "recomputes nothing before its last stage; build it with --recompute selective or full");
    }
  }
  return Status::Ok();
}

// The list-scheduling problem of the plan's pipeline, timed with its compiled costs.
ListScheduleProblem list_problem(ScheduleKind kind, int stages, int micro_batches,
                                 const std::vector<SegmentCosts>& costs,
                                 const std::vector<bool>& recompute_segments) {
  const int segments = static_cast<int>(costs.size());
  ListScheduleProblem p;
  p.devices = stages;
  p.micro_batches = micro_batches;
  p.split_backward = splits_backward(kind);
  for (int i = 0; i < segments; ++i) {
    const SegmentCosts& c = costs[i];
    p.device_of_segment.push_back(rank_of_segment(kind, i, stages));
    p.forward.push_back(c.forward);
    p.backward_input.push_back(p.split_backward ? c.backward_input : c.backward);
    p.backward_weight.push_back(p.split_backward ? c.backward_weight : 0.0);
    p.recompute_time.push_back(c.recompute);
    p.forward_bytes.push_back(c.kept);
    p.weight_input_bytes.push_back(p.split_backward ? c.weight_inputs : 0.0);
  }
  if (kind == ScheduleKind::kZbV) {
    // As in a 2p-stage 1F1B: segment j keeps at most 2p - j micro-batches ahead.
    for (int i = 0; i < segments; ++i) p.segment_lead_limit.push_back(segments - i);
  }
  if (kind == ScheduleKind::kMerak) {
    p.recompute = recompute_segments;
    p.recompute[segments - 1] = false;
  }
  return p;
}

// What the list schedule may hold on each rank: the activations a --memory-limit leaves room
// for, Merak's in-flight micro-batches, or what the hand-built schedules hold (1F1B's peak;
// ZB-H2's 2p - 1 micro-batches).
Status set_memory_limits(ScheduleKind kind, int stages, const Program& prog,
                         const std::vector<SegmentCosts>& costs, std::optional<double> memory_limit,
                         ListScheduleProblem& p) {
  const int segments = static_cast<int>(costs.size());
  // Activation bytes each rank may hold.
  std::vector<double> held(stages, 0);  // a micro-batch's activations per rank (all chunks)
  for (int i = 0; i < segments; ++i) held[p.device_of_segment[i]] += costs[i].kept;
  double one_f_one_b_peak = 0;  // the first stage's p micro-batches
  for (int r = 0; r < stages; ++r) {
    const int in_flight = kind == ScheduleKind::kZbV ? stages : stages - r;
    one_f_one_b_peak = std::max(one_f_one_b_peak, in_flight * held[r]);
  }
  if (kind == ScheduleKind::kZbV) {
    // The V-shaped 1F1B's: segment j keeps 2p - j micro-batches (p + 1/2 stages' worth per
    // rank), or the shallow chunk can fill a rank before anything reaches the turn.
    std::vector<double> v(stages, 0);
    for (int i = 0; i < segments; ++i) v[p.device_of_segment[i]] += (segments - i) * costs[i].kept;
    for (double x : v) one_f_one_b_peak = std::max(one_f_one_b_peak, x);
  }
  if (memory_limit) {
    for (const Lane& lane : prog.lanes) {
      const int rank = lane.slice.count("pp") ? lane.slice.at("pp") : 0;
      if (static_cast<int>(p.memory_limit.size()) <= rank) p.memory_limit.resize(rank + 1, 0);
      // Room for kept activations: the limit less static memory and the largest transient
      // workspace a block of this rank needs on top of them.
      double transient = 0;
      for (const BlockInstance& b : lane.blocks) {
        transient = std::max(transient, prog.templates[b.template_index].peak_bytes);
      }
      const double budget = *memory_limit - lane.memory.total() - transient;
      if (budget <= 0) {
        return Error(fmt::format(
            "--memory-limit {} leaves no room for activations on pipeline stage {}: its "
            "weights, gradients, optimizer state and buffers take {}",
            format_bytes(*memory_limit), rank, format_bytes(lane.memory.total())));
      }
      p.memory_limit[rank] = budget;
    }
  } else if (kind == ScheduleKind::kMerak) {
    for (int r = 0; r < stages; ++r) p.in_flight_limit.push_back(stages - r);
  } else {
    // ZB-H1 and ZB-V: 1F1B's peak on every rank (the later ranks' spare memory holds weight
    // gradients back); ZB-H2: 2p - 1 micro-batches of the first stage.
    const double scale = kind == ScheduleKind::kZbH2 ? (2.0 * stages - 1) / stages : 1.0;
    p.memory_limit.assign(stages, scale * one_f_one_b_peak);
  }
  return Status::Ok();
}

// Variants of the priority rule; the one that finishes first in the plan's own costs wins:
// - warm-up depth: free (as deep as memory allows), or the hand-built schedules' (1F1B's for
//   ZB-H1, 2p - 1 on the first stage for ZB-H2);
// - ZB-H1's weight-gradient delay: stage r runs a weight gradient once r - 1 more input
//   gradients have followed it (the last stage: F B F B F B W F B W ..., Qi et al.), or as
//   late as the other blocks let it;
// - weight gradients wait for a backward about to arrive, or fill the device until it does;
// - ZB-H1 and ZB-H2 also count micro-batches instead of bytes (a pending weight gradient counts
//   as a whole one, as in the papers' schedules), kept only when the bytes fit.
std::vector<ListScheduleProblem> schedule_variants(ScheduleKind kind, int stages,
                                                   const ListScheduleProblem& p) {
  std::vector<ListScheduleProblem> variants = {p};
  if (kind == ScheduleKind::kZbH1 || kind == ScheduleKind::kZbH2) {
    ListScheduleProblem q = p;
    for (int r = 0; r < stages; ++r) {
      q.forward_lead_limit.push_back(kind == ScheduleKind::kZbH2 ? 2 * (stages - r) - 1
                                                                 : stages - r);
    }
    variants.push_back(q);
  }
  if (kind == ScheduleKind::kZbH1) {
    for (size_t i = 0, n = variants.size(); i < n; ++i) {
      ListScheduleProblem q = variants[i];
      for (int r = 0; r < stages; ++r) q.weight_delay_limit.push_back(std::max(0, r - 1));
      variants.push_back(q);
    }
  }
  if (p.split_backward) {
    for (size_t i = 0, n = variants.size(); i < n; ++i) {
      ListScheduleProblem q = variants[i];
      q.weight_waits_for_backward = true;
      variants.push_back(q);
    }
  }
  if ((kind == ScheduleKind::kZbH1 || kind == ScheduleKind::kZbH2) && !p.memory_limit.empty()) {
    for (size_t i = 0, n = variants.size(); i < n; ++i) {
      ListScheduleProblem q = variants[i];
      q.memory_limit.clear();
      q.in_flight_limit.assign(stages, kind == ScheduleKind::kZbH2 ? 2 * stages - 1 : stages);
      variants.push_back(q);
    }
  }
  return variants;
}

}  // namespace

Expected<Plan> generate_schedule(const Plan& in, const Topology& topo, ScheduleKind kind,
                                 std::optional<double> memory_limit,
                                 const CompileOptions& compile) {
  if (kind == ScheduleKind::kTessel) {
    Expected<SearchedSchedule> s = search_schedule(in, topo, memory_limit, compile);
    if (!s) return s.error();
    return s->plan;
  }
  Plan plan = in;
  const int stages = static_cast<int>(plan.schedule.size());
  const int segments = static_cast<int>(plan.segments.size());
  if (stages < 1 || segments % stages != 0) {
    return Error(
        fmt::format("the plan has {} segments over {} schedule orders; a pipeline "
                    "schedule needs the same number of segments on every stage",
                    segments, stages));
  }
  const int chunks = segments / stages;
  std::map<int, int> order_of_rank;
  if (Status s = check_pipeline(plan, kind, stages, segments, memory_limit, order_of_rank); !s) {
    return s.error();
  }
  const int micro_batches = plan.num_micro_batches();
  std::vector<bool> recompute_segments(segments, false);
  for (const RecomputeRule& r : plan.recompute) {
    for (int i = 0; i < segments; ++i) {
      const Segment& s = plan.segments[i];
      const int end = r.end_layer < 0 ? plan.model.layers : r.end_layer;
      if (r.first_layer < s.end_layer && end > s.first_layer) recompute_segments[i] = true;
    }
  }
  auto assign = [&](const std::vector<std::vector<Block>>& orders) {
    for (int r = 0; r < stages; ++r) plan.schedule[order_of_rank[r]].blocks = orders[r];
  };
  // Combined 1F1B runs one warm-up forward more, as the builder writes it (pipeline_orders).
  Expected<std::vector<std::vector<Block>>> provisional =
      pipeline_orders(kind, stages, chunks, micro_batches, recompute_segments,
                      pipeline_runtime_of(plan.framework), plan.comm.ep_overlap ? 1 : 0);
  if (!provisional) return provisional.error();
  if (Status s = add_forward_passes(kind, plan.recycle, *provisional); !s) return s.error();
  assign(*provisional);
  plan.schedule_name = std::string(to_string(kind));
  if (!list_scheduled(kind)) return plan;

  // Time the list schedule with the plan's own costs.
  Expected<Program> prog = compile_plan(plan, topo, compile);
  if (!prog) return prog.error();
  const std::vector<SegmentCosts> costs = segment_costs(*prog);
  ListScheduleProblem p = list_problem(kind, stages, micro_batches, costs, recompute_segments);
  if (Status s = set_memory_limits(kind, stages, *prog, costs, memory_limit, p); !s) {
    return s.error();
  }
  const std::vector<ListScheduleProblem> variants = schedule_variants(kind, stages, p);
  Expected<ListSchedule> ls = list_schedule(variants.front());
  if (!ls) return ls.error();
  for (size_t i = 1; i < variants.size(); ++i) {
    Expected<ListSchedule> other = list_schedule(variants[i]);
    if (other && other->makespan < ls->makespan && holds_within(p, other->orders)) {
      ls = std::move(other);
    }
  }
  assign(ls->orders);
  return plan;
}

}  // namespace nnsim

namespace nnsim {

namespace {

// Schedule orders that hold a segment: those whose devices are in the segment's slice.
std::vector<int> orders_of_segment(const Plan& plan, const Segment& s) {
  std::vector<int> out;
  for (size_t o = 0; o < plan.schedule.size(); ++o) {
    bool inside = true;
    for (const auto& [axis, v] : s.devices) {
      auto it = plan.schedule[o].devices.find(axis);
      inside = inside && it != plan.schedule[o].devices.end() && it->second == v;
    }
    if (inside) out.push_back(static_cast<int>(o));
  }
  return out;
}

// Segments in the order a micro-batch flows through them.
std::vector<int> flow_order(const Plan& plan) {
  std::vector<int> order(plan.segments.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Segment& x = plan.segments[a];
    const Segment& y = plan.segments[b];
    return std::make_tuple(x.first_layer, x.end_layer, x.head) <
           std::make_tuple(y.first_layer, y.end_layer, y.head);
  });
  return order;
}

// The plan's orders with every B as BI then BW (to read the split blocks' costs).
Plan with_split_backward(const Plan& in) {
  Plan plan = in;
  for (DeviceOrder& o : plan.schedule) {
    std::vector<Block> blocks;
    for (const Block& b : o.blocks) {
      if (b.kind == BlockKind::kBackward) {
        blocks.push_back({BlockKind::kBackwardInput, b.micro_batch, b.segment});
        blocks.push_back({BlockKind::kBackwardWeight, b.micro_batch, b.segment});
      } else {
        blocks.push_back(b);
      }
    }
    o.blocks = std::move(blocks);
  }
  return plan;
}

bool has_split_backward(const Plan& plan) {
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& b : o.blocks) {
      if (b.kind == BlockKind::kBackwardInput) return true;
    }
  }
  return false;
}

// One micro-batch's blocks and the activation room of every order, from a compiled plan.
Expected<TesselProblem> tessel_problem(const Program& prog, bool split,
                                       const std::vector<double>& limit) {
  const Plan& plan = prog.plan;
  const std::vector<SegmentCosts> costs = segment_costs(prog);
  TesselProblem p;
  p.devices = static_cast<int>(plan.schedule.size());
  p.micro_batches = plan.num_micro_batches();
  const std::vector<int> flow = flow_order(plan);
  std::vector<int> forward(plan.segments.size()), backward(plan.segments.size());
  int prev = -1;
  for (int s : flow) {
    std::vector<int> devices = orders_of_segment(plan, plan.segments[s]);
    if (devices.empty()) {
      return Error(fmt::format("segment '{}' is on no schedule order", plan.segments[s].name));
    }
    forward[s] = static_cast<int>(p.blocks.size());
    TesselBlock f{BlockKind::kForward,   s, devices, costs[s].forward, costs[s].kept, {},
                  costs[s].forward_peak, {}};
    if (prev >= 0) {
      f.after = {forward[prev]};
      f.transfer = {costs[prev].forward_send(s)};
    }
    p.blocks.push_back(f);
    prev = s;
  }
  // Repeated forwards: every pass's forwards, each later pass after the recycled output's
  // transfer from the last segment to the first (the last segment's only forward send).
  const double recycle_seconds = costs[flow.back()].forward_send(flow.front());
  // Segments whose recomputation the input orders run as its own block (Merak's) keep it.
  std::vector<bool> explicit_recompute(plan.segments.size(), false);
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& b : o.blocks) {
      if (b.kind == BlockKind::kRecompute) explicit_recompute[b.segment] = true;
    }
  }
  int next = -1;
  for (auto it = flow.rbegin(); it != flow.rend(); ++it) {
    const int s = *it;
    const SegmentCosts& c = costs[s];
    const std::vector<int> devices = p.blocks[forward[s]].devices;
    std::vector<int> after = {forward[s]};
    std::vector<double> transfer = {0.0};  // its own forward ran on the same devices
    if (next >= 0) {
      after.push_back(backward[next]);
      transfer.push_back(costs[next].backward_send(s));
    }
    double frees = c.kept;
    if (explicit_recompute[s]) {
      if (split) return Error("explicit recomputation blocks with a split backward");
      after.push_back(static_cast<int>(p.blocks.size()));
      transfer.push_back(0.0);
      p.blocks.push_back({BlockKind::kRecompute,
                          s,
                          devices,
                          c.recompute,
                          c.recompute_kept,
                          {forward[s]},
                          c.recompute_kept,
                          {0.0}});
      frees = c.backward_frees;
    }
    backward[s] = static_cast<int>(p.blocks.size());
    if (split) {
      p.blocks.push_back({BlockKind::kBackwardInput, s, devices, c.backward_input,
                          -(c.kept - c.weight_inputs), after, c.backward_input_peak, transfer});
      p.blocks.push_back({BlockKind::kBackwardWeight,
                          s,
                          devices,
                          c.backward_weight,
                          -c.weight_inputs,
                          {backward[s]},
                          c.backward_weight_peak,
                          {0.0}});
    } else {
      p.blocks.push_back(
          {BlockKind::kBackward, s, devices, c.backward, -frees, after, c.backward_peak, transfer});
    }
    next = s;
  }
  if (plan.recycle > 1) p.blocks = recycled_blocks(p.blocks, plan.recycle, recycle_seconds);
  p.memory_limit = limit;
  return p;
}

}  // namespace

Expected<SearchedSchedule> search_schedule(const Plan& in, const Topology& topo,
                                           std::optional<double> memory_limit,
                                           const CompileOptions& compile) {
  Expected<Program> input = compile_plan(in, topo, compile);
  if (!input) return input.error();
  // Activation room per order: what the limit leaves beside static memory (each block's own
  // workspace is in its peak); without a limit, what the current orders hold at most.
  std::vector<double> room;
  for (size_t o = 0; memory_limit && o < input->lanes.size(); ++o) {
    const Lane& lane = input->lanes[o];
    const double budget = *memory_limit - lane.memory.total();
    if (budget < 0) {
      return Error(fmt::format(
          "--memory-limit {} leaves no room for activations on schedule order {}: its weights, "
          "gradients, optimizer state and buffers take {}",
          format_bytes(*memory_limit), o, format_bytes(lane.memory.total())));
    }
    room.push_back(budget);
  }
  auto attempt = [&](bool split) -> Expected<SearchedSchedule> {
    std::optional<Program> rewritten;
    const Program* prog = &*input;
    if (split && !has_split_backward(in)) {
      Expected<Program> c = compile_plan(with_split_backward(in), topo, compile);
      if (!c) return c.error();
      rewritten = std::move(*c);
      prog = &*rewritten;
    }
    Expected<TesselProblem> problem = tessel_problem(*prog, split, room);
    if (!problem) return problem.error();
    std::vector<std::vector<Block>> current;
    for (const DeviceOrder& o : prog->plan.schedule) current.push_back(o.blocks);
    Expected<OrdersRun> before = run_orders(*problem, current);
    if (!before) return before.error();
    if (!memory_limit) problem->memory_limit = before->peak_bytes;
    Expected<TesselSchedule> found = tessel_search(*problem);
    if (!found) return found.error();
    SearchedSchedule s;
    s.plan = in;
    for (size_t o = 0; o < s.plan.schedule.size(); ++o)
      s.plan.schedule[o].blocks = found->orders[o];
    s.plan.schedule_name = "tessel";
    s.tessel = std::move(*found);
    s.problem = *problem;
    s.split_backward = split;
    s.input_makespan = before->makespan;
    // The input stands when it is faster and fits the limit.
    bool input_fits = true;
    for (size_t o = 0; o < room.size(); ++o) {
      input_fits = input_fits && before->peak_bytes[o] <= room[o] * (1 + 1e-9);
    }
    if (input_fits && s.tessel.makespan > before->makespan * (1 + 1e-9)) {
      s.plan = in;
      s.kept_input = true;
    }
    return s;
  };
  // The split backward first: it has the more freedom, so when its repetend has no bubble
  // (the busiest device's work per micro-batch) the whole backward cannot do better.
  bool recompute_blocks = false;
  for (const DeviceOrder& o : in.schedule) {
    for (const Block& b : o.blocks) recompute_blocks |= b.kind == BlockKind::kRecompute;
  }
  if (recompute_blocks) return attempt(false);  // Merak's blocks go with a whole backward
  Expected<SearchedSchedule> split = attempt(true);
  if (has_split_backward(in)) return split;
  if (split && split->tessel.period <= split->tessel.lower_bound * 1.01) return split;
  Expected<SearchedSchedule> whole = attempt(false);
  if (!whole) return split ? std::move(split) : std::move(whole);
  auto effective = [](const SearchedSchedule& x) {
    return x.kept_input ? x.input_makespan : x.tessel.makespan;
  };
  if (split && effective(*split) < effective(*whole)) return split;
  return whole;
}

}  // namespace nnsim
