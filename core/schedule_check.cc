#include "core/schedule_check.h"

#include <vector>

#include <fmt/format.h>

namespace nnsim {
namespace {

constexpr int kBlockKinds = 5;

}  // namespace

Status check_schedule(const std::vector<OrderView>& orders, int num_segments, int micro_batches,
                      const std::vector<int>& next_segment,
                      const std::vector<int>& lane_of_segment) {
  std::vector<int> prev_segment(num_segments, -1);
  for (int s = 0; s < num_segments; ++s) {
    if (next_segment[s] >= 0) prev_segment[next_segment[s]] = s;
  }
  // Dense tables indexed by (kind, micro-batch, segment): where each block sits in its order
  // (a segment belongs to one order), and whether it has run.
  auto key = [&](BlockKind k, int mb, int seg) {
    return (static_cast<size_t>(k) * micro_batches + mb) * num_segments + seg;
  };
  const size_t table = static_cast<size_t>(kBlockKinds) * micro_batches * num_segments;
  std::vector<int> position(table, -1);
  for (size_t o = 0; o < orders.size(); ++o) {
    const auto& ord = orders[o];
    for (size_t i = 0; i < ord.blocks.size(); ++i) {
      const Block& b = ord.blocks[i];
      if (b.segment >= num_segments) {
        return Error(
            fmt::format("schedule of {}: block {} names segment {}, but the plan has "
                        "{} segments (0-{})",
                        ord.name, to_string(b), b.segment, num_segments, num_segments - 1));
      }
      if (b.micro_batch >= micro_batches) {
        return Error(
            fmt::format("schedule of {}: block {} names micro-batch {}, but an iteration has {} "
                        "micro-batches per replica (0-{}): global_batch / (dp x micro_batch)",
                        ord.name, to_string(b), b.micro_batch, micro_batches, micro_batches - 1));
      }
      if (lane_of_segment[b.segment] != static_cast<int>(o)) {
        return Error(
            fmt::format("schedule of {}: block {} runs segment {}, whose devices are "
                        "not this order's devices",
                        ord.name, to_string(b), b.segment));
      }
      int& at = position[key(b.kind, b.micro_batch, b.segment)];
      if (at >= 0) {
        return Error(fmt::format("schedule of {}: block {} appears twice (positions {} and {})",
                                 ord.name, to_string(b), at, i));
      }
      at = static_cast<int>(i);
    }
  }
  // Completeness and the order of each micro-batch's own blocks on its device.
  auto find = [&](int /*order*/, BlockKind k, int mb, int seg) {
    return position[key(k, mb, seg)];
  };
  for (int s = 0; s < num_segments; ++s) {
    int o = lane_of_segment[s];
    const auto& name = orders[o].name;
    for (int mb = 0; mb < micro_batches; ++mb) {
      int f = find(o, BlockKind::kForward, mb, s);
      int b = find(o, BlockKind::kBackward, mb, s);
      int bi = find(o, BlockKind::kBackwardInput, mb, s);
      int bw = find(o, BlockKind::kBackwardWeight, mb, s);
      int r = find(o, BlockKind::kRecompute, mb, s);
      if (f < 0) {
        return Error(
            fmt::format("schedule of {} never runs the forward F{}@{}; add it", name, mb, s));
      }
      if (b < 0 && (bi < 0 || bw < 0)) {
        return Error(fmt::format(
            "schedule of {} never runs the backward of micro-batch {} through segment {}: add "
            "B{}@{} (or both BI{}@{} and BW{}@{})",
            name, mb, s, mb, s, mb, s, mb, s));
      }
      if (b >= 0 && (bi >= 0 || bw >= 0)) {
        return Error(
            fmt::format("schedule of {} runs both B{}@{} and a split backward (BI/BW) "
                        "of it; keep one",
                        name, mb, s));
      }
      int first_bwd = b >= 0 ? b : bi;
      if (first_bwd < f) {
        return Error(
            fmt::format("schedule of {} runs the backward of micro-batch {} through "
                        "segment {} before its forward F{}@{}",
                        name, mb, s, mb, s));
      }
      if (bw >= 0 && bw < bi) {
        return Error(fmt::format("schedule of {} runs BW{}@{} before BI{}@{}", name, mb, s, mb, s));
      }
      if (r >= 0 && (r < f || r > first_bwd)) {
        return Error(
            fmt::format("schedule of {}: R{}@{} must come after F{}@{} and before the "
                        "backward of that micro-batch",
                        name, mb, s, mb, s));
      }
    }
  }
  for (size_t o = 0; o < orders.size(); ++o) {
    size_t expected = 0;
    for (int s = 0; s < num_segments; ++s) {
      if (lane_of_segment[s] != static_cast<int>(o)) continue;
      for (int mb = 0; mb < micro_batches; ++mb) {
        expected += 1 + (find(static_cast<int>(o), BlockKind::kBackward, mb, s) >= 0 ? 1 : 2) +
                    (find(static_cast<int>(o), BlockKind::kRecompute, mb, s) >= 0 ? 1 : 0);
      }
    }
    if (orders[o].blocks.size() != expected) {
      return Error(fmt::format("schedule of {} has {} blocks; expected {}", orders[o].name,
                               orders[o].blocks.size(), expected));
    }
  }

  // Deadlock: replay every order, a block may run once the blocks it receives data from have
  // run. If no order can make progress before all are done, report what each waits for.
  std::vector<size_t> next(orders.size(), 0);
  std::vector<char> done(table, 0);
  auto is_done = [&](BlockKind k, int mb, int seg) { return done[key(k, mb, seg)] != 0; };
  auto backward_done = [&](int mb, int seg) {
    return is_done(BlockKind::kBackward, mb, seg) || is_done(BlockKind::kBackwardInput, mb, seg);
  };
  // What `b` needs from another order that has not run yet ("" if nothing).
  auto waits_for = [&](const Block& b) -> std::string {
    if (b.kind == BlockKind::kForward) {
      int p = prev_segment[b.segment];
      if (p >= 0 && !is_done(BlockKind::kForward, b.micro_batch, p)) {
        return fmt::format("the activation of F{}@{} from {}", b.micro_batch, p,
                           orders[lane_of_segment[p]].name);
      }
    } else if (b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardInput) {
      int n = next_segment[b.segment];
      if (n >= 0 && !backward_done(b.micro_batch, n)) {
        return fmt::format(
            "the gradient of the backward of micro-batch {} through segment {} "
            "from {}",
            b.micro_batch, n, orders[lane_of_segment[n]].name);
      }
    }
    return "";
  };
  size_t total = 0, finished = 0;
  for (const auto& o : orders) total += o.blocks.size();
  while (finished < total) {
    bool progress = false;
    for (size_t o = 0; o < orders.size(); ++o) {
      while (next[o] < orders[o].blocks.size()) {
        const Block& b = orders[o].blocks[next[o]];
        if (!waits_for(b).empty()) break;
        done[key(b.kind, b.micro_batch, b.segment)] = 1;
        ++next[o];
        ++finished;
        progress = true;
      }
    }
    if (!progress) {
      std::string msg = "the schedule deadlocks:";
      for (size_t o = 0; o < orders.size(); ++o) {
        if (next[o] >= orders[o].blocks.size()) continue;
        const Block& b = orders[o].blocks[next[o]];
        msg += fmt::format("\n  {} waits in {} for {}", orders[o].name, to_string(b), waits_for(b));
      }
      msg += "\nreorder the blocks so that every transfer is produced before it is awaited";
      return Error(msg);
    }
  }
  return Status::Ok();
}

}  // namespace nnsim
