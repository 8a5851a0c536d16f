#include "planner/list_schedule.h"

#include <algorithm>
#include <deque>
#include <limits>

#include <fmt/format.h>

namespace nnsim {

namespace {

constexpr double kNotYet = std::numeric_limits<double>::infinity();

// Candidate priorities, most urgent first: a backward frees memory and unblocks the devices
// before it (and so does the recomputation it waits for); forwards keep the pipeline full; a
// recomputation is issued early when the device would otherwise wait for its gradient; weight
// gradients fill what is left.
enum Priority { kBackward = 0, kForward = 1, kRecompute = 2, kWeight = 3 };

struct Choice {
  Block block;
  double ready = kNotYet;
  Priority priority = kWeight;
};

// Lower is better: priority, then the older micro-batch, then the deeper segment.
bool better(const Choice& a, const Choice& b) {
  if (a.priority != b.priority) return a.priority < b.priority;
  if (a.block.micro_batch != b.block.micro_batch) return a.block.micro_batch < b.block.micro_batch;
  return a.block.segment > b.block.segment;
}

class ListScheduler {
 public:
  explicit ListScheduler(const ListScheduleProblem& p)
      : p_(p), segments_(static_cast<int>(p.device_of_segment.size())) {}

  Expected<ListSchedule> run();

 private:
  double cost(const std::vector<double>& v, int s, double unit) const {
    return v.empty() ? unit : v[s];
  }
  double& finish(BlockKind k, int s, int mb) {
    const int kind = k == BlockKind::kForward          ? 0
                     : k == BlockKind::kRecompute      ? 2
                     : k == BlockKind::kBackwardWeight ? 3
                                                       : 1;  // B or BI
    return finish_[(kind * segments_ + s) * p_.micro_batches + mb];
  }
  // The best block device `d` can run next and when its inputs are ready.
  Choice next_for(int d);

  const ListScheduleProblem& p_;
  const int segments_;
  std::vector<std::vector<int>> segments_of_;  // per device, its segments in pipeline order
  std::vector<double> finish_;
  std::vector<int> next_f_, next_b_, next_r_;
  std::vector<std::deque<int>> weights_;  // per segment: micro-batches awaiting BW
  std::vector<double> free_at_;
  std::vector<int> in_flight_;
  std::vector<int> lead_;      // per device: forwards issued minus B / BI issued
  std::vector<double> bytes_;  // per device, when limited by memory
};

Choice ListScheduler::next_for(int d) {
  const bool split = p_.split_backward;
  Choice best;
  Choice first_backward;  // the backward ready soonest (already timed)
  auto consider = [&](const Choice& c) {
    if (c.ready == kNotYet) return;
    if (c.priority == kBackward &&
        (first_backward.ready == kNotYet || c.ready < first_backward.ready)) {
      first_backward = c;
    }
    // Among what is ready when the device is free, the best priority; otherwise whatever is
    // ready first.
    const double t = free_at_[d];
    const bool c_now = c.ready <= t, best_now = best.ready <= t;
    if (best.ready == kNotYet || (c_now && !best_now) ||
        (c_now == best_now &&
         (c_now ? better(c, best)
                : (c.ready < best.ready || (c.ready == best.ready && better(c, best)))))) {
      best = c;
    }
  };
  const int limit = p_.in_flight_limit.empty() ? 0 : p_.in_flight_limit[d];
  const bool by_bytes = !p_.memory_limit.empty();
  for (int s : segments_of_[d]) {
    const bool rec = !p_.recompute.empty() && p_.recompute[s];
    // Backward of the oldest micro-batch without one.
    if (int mb = next_b_[s]; mb < p_.micro_batches) {
      double ready = s + 1 == segments_ ? finish(BlockKind::kForward, s, mb)
                                        : finish(BlockKind::kBackwardInput, s + 1, mb);
      if (rec) {
        const double r = finish(BlockKind::kRecompute, s, mb);
        if (r == kNotYet) {
          // Recompute it first, while its gradient is still on the way.
          const double f = finish(BlockKind::kForward, s, mb);
          if (next_r_[s] == mb && f != kNotYet) {
            const bool gradient_here = ready <= free_at_[d];
            consider({{BlockKind::kRecompute, mb, s}, f, gradient_here ? kBackward : kRecompute});
          }
          ready = kNotYet;
        } else {
          ready = std::max(ready, r);
        }
      }
      consider(
          {{split ? BlockKind::kBackwardInput : BlockKind::kBackward, mb, s}, ready, kBackward});
    }
    // Forward of the next micro-batch, if the device may hold another.
    const bool room = by_bytes ? bytes_[d] + p_.forward_bytes[s] <= p_.memory_limit[d] ||
                                     in_flight_[d] == 0  // always one, or nothing could run
                               : limit <= 0 || in_flight_[d] < limit;
    const int lead = p_.forward_lead_limit.empty() ? 0 : p_.forward_lead_limit[d];
    const bool segment_room = p_.segment_lead_limit.empty() || p_.segment_lead_limit[s] <= 0 ||
                              next_f_[s] - next_b_[s] < p_.segment_lead_limit[s];
    if (int mb = next_f_[s];
        mb < p_.micro_batches && room && segment_room && (lead <= 0 || lead_[d] < lead)) {
      const double ready = s == 0 ? 0.0 : finish(BlockKind::kForward, s - 1, mb);
      consider({{BlockKind::kForward, mb, s}, ready, kForward});
    }
    // Weight gradients, oldest first.
    if (split && !weights_[s].empty()) {
      const int mb = weights_[s].front();
      const int delay = p_.weight_delay_limit.empty() ? -1 : p_.weight_delay_limit[d];
      const bool overdue = delay >= 0 && static_cast<int>(weights_[s].size()) > delay;
      consider({{BlockKind::kBackwardWeight, mb, s},
                finish(BlockKind::kBackwardInput, s, mb),
                overdue ? kBackward : kWeight});
    }
  }
  // A weight gradient that would still run when a backward arrives waits for it instead: the
  // backward is on the critical path of the stages before, the weight gradient on nobody's.
  if (p_.weight_waits_for_backward && best.priority == kWeight && first_backward.ready != kNotYet &&
      first_backward.ready <
          std::max(free_at_[d], best.ready) + cost(p_.backward_weight, best.block.segment, 1)) {
    return first_backward;
  }
  return best;
}

Expected<ListSchedule> ListScheduler::run() {
  const int D = p_.devices, M = p_.micro_batches;
  if (D < 1 || M < 1 || segments_ < 1) return Error("list schedule: nothing to schedule");
  for (int d : p_.device_of_segment) {
    if (d < 0 || d >= D) return Error(fmt::format("list schedule: no device {}", d));
  }
  segments_of_.assign(D, {});
  for (int s = 0; s < segments_; ++s) segments_of_[p_.device_of_segment[s]].push_back(s);
  finish_.assign(static_cast<size_t>(4) * segments_ * M, kNotYet);
  next_f_.assign(segments_, 0);
  next_b_.assign(segments_, 0);
  next_r_.assign(segments_, 0);
  weights_.assign(segments_, {});
  free_at_.assign(D, 0);
  in_flight_.assign(D, 0);
  lead_.assign(D, 0);
  bytes_.assign(D, 0);
  if (!p_.memory_limit.empty() && (static_cast<int>(p_.memory_limit.size()) != D ||
                                   static_cast<int>(p_.forward_bytes.size()) != segments_ ||
                                   static_cast<int>(p_.weight_input_bytes.size()) != segments_)) {
    return Error("list schedule: memory limits need one per device and bytes per segment");
  }
  auto bytes = [&](const std::vector<double>& v, int s) { return v.empty() ? 0.0 : v[s]; };
  std::vector<std::vector<Block>> order(D);
  int remaining = 0;
  for (int s = 0; s < segments_; ++s) {
    const bool rec = !p_.recompute.empty() && p_.recompute[s];
    remaining += M * (2 + (p_.split_backward ? 1 : 0) + (rec ? 1 : 0));
  }
  // A device's best next block depends only on its own state and on the blocks of its segments
  // and their neighbours, so it is recomputed only when one of those has run.
  std::vector<Choice> next(D);
  std::vector<bool> stale(D, true);
  while (remaining > 0) {
    int device = -1;
    Choice pick;
    double start = kNotYet;
    for (int d = 0; d < D; ++d) {
      if (stale[d]) {
        next[d] = next_for(d);
        stale[d] = false;
      }
      const Choice& c = next[d];
      if (c.ready == kNotYet) continue;
      const double s = std::max(free_at_[d], c.ready);
      if (s < start) {
        start = s;
        pick = c;
        device = d;
      }
    }
    if (device < 0) {
      std::string stuck;
      for (int d = 0; d < D; ++d) {
        stuck += fmt::format("{}device {} holds {}", stuck.empty() ? "" : "; ", d, in_flight_[d]);
      }
      return Error(fmt::format(
          "the schedule cannot proceed: no device can run a block within its in-flight limit "
          "({}); raise the memory limit",
          stuck));
    }
    const Block& b = pick.block;
    const int s = b.segment;
    double duration = 0;
    switch (b.kind) {
      case BlockKind::kForward:
        duration = cost(p_.forward, s, 1);
        ++next_f_[s];
        ++in_flight_[device];
        ++lead_[device];
        bytes_[device] += bytes(p_.forward_bytes, s);
        break;
      case BlockKind::kBackward:
        duration = cost(p_.backward_input, s, 1) + cost(p_.backward_weight, s, 1);
        ++next_b_[s];
        --in_flight_[device];
        --lead_[device];
        bytes_[device] -= bytes(p_.forward_bytes, s);
        break;
      case BlockKind::kBackwardInput:
        duration = cost(p_.backward_input, s, 1);
        ++next_b_[s];
        weights_[s].push_back(b.micro_batch);
        --lead_[device];
        bytes_[device] -= bytes(p_.forward_bytes, s) - bytes(p_.weight_input_bytes, s);
        break;
      case BlockKind::kBackwardWeight:
        duration = cost(p_.backward_weight, s, 1);
        weights_[s].pop_front();
        --in_flight_[device];
        bytes_[device] -= bytes(p_.weight_input_bytes, s);
        break;
      case BlockKind::kRecompute:
        duration = cost(p_.recompute_time, s, 1);
        ++next_r_[s];
        break;
    }
    free_at_[device] = start + duration;
    finish(b.kind, s, b.micro_batch) = free_at_[device];
    stale[device] = true;
    if (s > 0) stale[p_.device_of_segment[s - 1]] = true;
    if (s + 1 < segments_) stale[p_.device_of_segment[s + 1]] = true;
    order[device].push_back(b);
    --remaining;
  }
  ListSchedule out;
  out.orders = std::move(order);
  for (double t : free_at_) out.makespan = std::max(out.makespan, t);
  return out;
}

}  // namespace

Expected<ListSchedule> list_schedule(const ListScheduleProblem& problem) {
  return ListScheduler(problem).run();
}

}  // namespace nnsim
