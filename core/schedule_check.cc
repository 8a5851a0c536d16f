#include "core/schedule_check.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

namespace nnsim {
namespace {

constexpr int kBlockKinds = 5;

// The checks' shared state: the orders, the pipeline's segment order, and the dense tables of
// where every block sits in its orders and, while replaying, which blocks have run.
struct OrderChecker {
  const std::vector<OrderView>& orders;
  const int num_segments, micro_batches;
  const std::vector<int>& next_segment;
  const std::vector<std::vector<int>>& lanes_of_segment;
  const int passes;
  std::vector<int> prev_segment;
  // With repeated forwards, pass i + 1 of the first segment reads pass i's output of the last.
  int last_segment = -1;
  // Blocks are told apart by kind and, for the forwards before the last pass, by pass: the last
  // pass's forward has the kind's own index (the one its backward reads), pass i < passes - 1
  // index kBlockKinds + i.
  int kinds = 0;
  // Where each segment's orders start in `position`'s slots.
  std::vector<size_t> base;
  // By (segment, its order, kind, micro-batch): where the block sits in that order (-1: absent).
  std::vector<int> position;
  // By (kind, micro-batch, segment), while replaying: whether the block has run (a block of a
  // spanning segment runs once, jointly).
  std::vector<char> done;
  // While replaying: each order's next block.
  std::vector<size_t> next;

  OrderChecker(const std::vector<OrderView>& o, int segments, int mbs,
               const std::vector<int>& next_seg, const std::vector<std::vector<int>>& lanes,
               int forward_passes)
      : orders(o),
        num_segments(segments),
        micro_batches(mbs),
        next_segment(next_seg),
        lanes_of_segment(lanes),
        passes(forward_passes),
        prev_segment(segments, -1),
        kinds(kBlockKinds + forward_passes - 1),
        base(segments + 1, 0) {
    for (int s = 0; s < num_segments; ++s) {
      if (next_segment[s] >= 0) prev_segment[next_segment[s]] = s;
      if (next_segment[s] < 0) last_segment = s;
    }
    for (int s = 0; s < num_segments; ++s) base[s + 1] = base[s] + lanes_of_segment[s].size();
    position.assign(base.back() * kinds * micro_batches, -1);
    done.assign(static_cast<size_t>(kinds) * micro_batches * num_segments, 0);
    next.assign(orders.size(), 0);
  }

  // Where order o sits among the orders of segment s (-1: not one of them).
  int slot_of(int s, int o) const {
    const auto& l = lanes_of_segment[s];
    auto it = std::find(l.begin(), l.end(), o);
    return it == l.end() ? -1 : static_cast<int>(it - l.begin());
  }
  int kind_of(const Block& b) const {
    return b.kind == BlockKind::kForward && b.pass < passes - 1 ? kBlockKinds + b.pass
                                                                : static_cast<int>(b.kind);
  }
  int forward_kind(int pass) const {
    return pass == passes - 1 ? static_cast<int>(BlockKind::kForward) : kBlockKinds + pass;
  }
  size_t key(int k, int mb, int seg) const {
    return (static_cast<size_t>(k) * micro_batches + mb) * num_segments + seg;
  }
  size_t pkey(int k, int mb, int seg, int slot) const {
    return ((base[seg] + slot) * kinds + static_cast<size_t>(k)) * micro_batches + mb;
  }
  size_t pkey_kind(BlockKind k, int mb, int seg, int slot) const {
    return pkey(static_cast<int>(k), mb, seg, slot);
  }
  bool is_done(BlockKind k, int mb, int seg) const {
    return done[key(static_cast<int>(k), mb, seg)] != 0;
  }
  bool backward_done(int mb, int seg) const {
    return is_done(BlockKind::kBackward, mb, seg) || is_done(BlockKind::kBackwardInput, mb, seg);
  }
  std::string order_names(int seg) const {
    std::string s;
    for (int o : lanes_of_segment[seg]) s += (s.empty() ? "" : ", ") + orders[o].name;
    return s;
  }

  Status place_blocks();
  Status check_micro_batches() const;
  Status check_counts() const;
  std::string waits_for(const Block& b) const;
  Status replay();
};

// Every block names a segment, micro-batch and pass that exist, on an order of its segment,
// once; a pair is a forward and a whole backward of another micro-batch.
Status OrderChecker::place_blocks() {
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
      if (b.pass < 0 || b.pass >= passes || (b.pass != 0 && b.kind != BlockKind::kForward)) {
        return Error(fmt::format(
            "schedule of {}: block {} names forward pass {}, but training.recycle is {} "
            "(passes 0-{}; only forward blocks have a pass)",
            ord.name, to_string(b), b.pass, passes, passes - 1));
      }
      const int slot = slot_of(b.segment, static_cast<int>(o));
      if (slot < 0) {
        return Error(
            fmt::format("schedule of {}: block {} runs segment {}, whose devices are "
                        "not this order's devices",
                        ord.name, to_string(b), b.segment));
      }
      int& at = position[pkey(kind_of(b), b.micro_batch, b.segment, slot)];
      if (at >= 0) {
        return Error(fmt::format("schedule of {}: block {} appears twice (positions {} and {})",
                                 ord.name, to_string(b), at, i));
      }
      at = static_cast<int>(i);
      if (!b.paired_with_next) continue;
      // A pair runs as one block: a forward beside the backward of another micro-batch.
      const std::string pair = i + 1 < ord.blocks.size()
                                   ? to_string(b) + "+" + to_string(ord.blocks[i + 1])
                                   : to_string(b) + "+";
      if (i + 1 >= ord.blocks.size() || ord.blocks[i + 1].paired_with_next) {
        return Error(fmt::format("schedule of {}: pair {} needs exactly one block after the '+'",
                                 ord.name, pair));
      }
      const Block& c = ord.blocks[i + 1];
      const bool forward_backward =
          (b.kind == BlockKind::kForward && c.kind == BlockKind::kBackward) ||
          (b.kind == BlockKind::kBackward && c.kind == BlockKind::kForward);
      if (!forward_backward || b.micro_batch == c.micro_batch || passes > 1) {
        return Error(fmt::format(
            "schedule of {}: pair {} must be a forward (F) and a whole backward (B) of another "
            "micro-batch{}; write the two blocks apart",
            ord.name, pair, passes > 1 ? ", without repeated forwards (training.recycle)" : ""));
      }
      if (lanes_of_segment[b.segment].size() > 1 || lanes_of_segment[c.segment].size() > 1) {
        return Error(fmt::format(
            "schedule of {}: pair {} runs a segment spanning several orders, whose blocks meet "
            "for their collectives and cannot pair; write the two blocks apart",
            ord.name, pair));
      }
    }
  }
  return Status::Ok();
}

// Completeness and the order of each micro-batch's own blocks on every order of its segment.
Status OrderChecker::check_micro_batches() const {
  for (int s = 0; s < num_segments; ++s) {
    const bool spanning = lanes_of_segment[s].size() > 1;
    const std::string note =
        spanning ? fmt::format(" (segment {} spans {} orders; each runs all its blocks)", s,
                               lanes_of_segment[s].size())
                 : "";
    for (size_t slot = 0; slot < lanes_of_segment[s].size(); ++slot) {
      const auto& name = orders[lanes_of_segment[s][slot]].name;
      auto find = [&](BlockKind k, int mb) {
        return position[pkey_kind(k, mb, s, static_cast<int>(slot))];
      };
      for (int mb = 0; mb < micro_batches; ++mb) {
        int f = find(BlockKind::kForward, mb);
        int b = find(BlockKind::kBackward, mb);
        int bi = find(BlockKind::kBackwardInput, mb);
        int bw = find(BlockKind::kBackwardWeight, mb);
        int r = find(BlockKind::kRecompute, mb);
        // Every pass's forward, in pass order; the last one's is `f`.
        for (int pass = 0; pass < passes; ++pass) {
          const Block fb{BlockKind::kForward, mb, s, pass};
          const int at = position[pkey(forward_kind(pass), mb, s, static_cast<int>(slot))];
          if (at < 0) {
            return Error(fmt::format(
                "schedule of {} never runs the forward {}{}; add it{}", name, to_string(fb),
                passes > 1 ? fmt::format(" (pass {} of training.recycle = {})", pass, passes)
                           : std::string(),
                note));
          }
          if (pass > 0 &&
              at < position[pkey(forward_kind(pass - 1), mb, s, static_cast<int>(slot))]) {
            return Error(fmt::format(
                "schedule of {} runs {} before {}; a pass reads the one before it", name,
                to_string(fb), to_string(Block{BlockKind::kForward, mb, s, pass - 1})));
          }
        }
        if (b < 0 && (bi < 0 || bw < 0)) {
          return Error(fmt::format(
              "schedule of {} never runs the backward of micro-batch {} through segment {}: add "
              "B{}@{} (or both BI{}@{} and BW{}@{}){}",
              name, mb, s, mb, s, mb, s, mb, s, note));
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
          return Error(
              fmt::format("schedule of {} runs BW{}@{} before BI{}@{}", name, mb, s, mb, s));
        }
        if (r >= 0 && (r < f || r > first_bwd)) {
          return Error(
              fmt::format("schedule of {}: R{}@{} must come after F{}@{} and before the "
                          "backward of that micro-batch",
                          name, mb, s, mb, s));
        }
      }
    }
  }
  return Status::Ok();
}

// Each order holds exactly the blocks its segments need.
Status OrderChecker::check_counts() const {
  for (size_t o = 0; o < orders.size(); ++o) {
    size_t expected = 0;
    for (int s = 0; s < num_segments; ++s) {
      const int slot = slot_of(s, static_cast<int>(o));
      if (slot < 0) continue;
      for (int mb = 0; mb < micro_batches; ++mb) {
        expected += passes + (position[pkey_kind(BlockKind::kBackward, mb, s, slot)] >= 0 ? 1 : 2) +
                    (position[pkey_kind(BlockKind::kRecompute, mb, s, slot)] >= 0 ? 1 : 0);
      }
    }
    if (orders[o].blocks.size() != expected) {
      return Error(fmt::format("schedule of {} has {} blocks; expected {}", orders[o].name,
                               orders[o].blocks.size(), expected));
    }
  }
  return Status::Ok();
}

// What `b` needs that has not run yet ("" if nothing).
std::string OrderChecker::waits_for(const Block& b) const {
  if (b.kind == BlockKind::kForward) {
    int p = prev_segment[b.segment];
    if (p >= 0 && !done[key(forward_kind(b.pass), b.micro_batch, p)]) {
      return fmt::format("the activation of {} from {}",
                         to_string(Block{BlockKind::kForward, b.micro_batch, p, b.pass}),
                         order_names(p));
    }
    if (p < 0 && b.pass > 0 && !done[key(forward_kind(b.pass - 1), b.micro_batch, last_segment)]) {
      return fmt::format(
          "the recycled output of {} from {}",
          to_string(Block{BlockKind::kForward, b.micro_batch, last_segment, b.pass - 1}),
          order_names(last_segment));
    }
  } else if (b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardInput) {
    int n = next_segment[b.segment];
    if (n >= 0 && !backward_done(b.micro_batch, n)) {
      return fmt::format(
          "the gradient of the backward of micro-batch {} through segment {} "
          "from {}",
          b.micro_batch, n, order_names(n));
    }
  }
  if (lanes_of_segment[b.segment].size() > 1) {
    std::string absent;
    for (int o : lanes_of_segment[b.segment]) {
      if (next[o] < orders[o].blocks.size() && orders[o].blocks[next[o]] == b) continue;
      absent += fmt::format("{}{} ({})", absent.empty() ? "" : ", ", orders[o].name,
                            next[o] < orders[o].blocks.size()
                                ? fmt::format("waiting in {}", to_string(orders[o].blocks[next[o]]))
                                : std::string("finished"));
    }
    if (!absent.empty()) {
      return fmt::format("the other devices of the joint block {}: {}", to_string(b), absent);
    }
  }
  return "";
}

// Deadlock: replay every order, a block may run once the blocks it receives data from have run;
// a block of a spanning segment runs once every order it spans has reached it. If no order can
// make progress before all are done, report what each waits for.
Status OrderChecker::replay() {
  size_t total = 0, finished = 0;
  for (const auto& o : orders) total += o.blocks.size();
  while (finished < total) {
    bool progress = false;
    for (size_t o = 0; o < orders.size(); ++o) {
      while (next[o] < orders[o].blocks.size()) {
        const Block b = orders[o].blocks[next[o]];
        if (!waits_for(b).empty()) break;
        if (b.paired_with_next) {
          // A pair starts once both blocks' inputs are there (neither segment spans orders).
          const Block c = orders[o].blocks[next[o] + 1];
          if (!waits_for(c).empty()) break;
          done[key(kind_of(b), b.micro_batch, b.segment)] = 1;
          done[key(kind_of(c), c.micro_batch, c.segment)] = 1;
          next[o] += 2;
          finished += 2;
          progress = true;
          continue;
        }
        done[key(kind_of(b), b.micro_batch, b.segment)] = 1;
        for (int x : lanes_of_segment[b.segment]) {
          ++next[x];
          ++finished;
        }
        progress = true;
      }
    }
    if (!progress) {
      std::string msg = "the schedule deadlocks:";
      for (size_t o = 0; o < orders.size(); ++o) {
        if (next[o] >= orders[o].blocks.size()) continue;
        const Block& b = orders[o].blocks[next[o]];
        std::string why = waits_for(b);
        std::string at = to_string(b);
        if (b.paired_with_next) {
          const Block& c = orders[o].blocks[next[o] + 1];
          at += "+" + to_string(c);
          if (why.empty()) why = waits_for(c);
        }
        msg += fmt::format("\n  {} waits in {} for {}", orders[o].name, at, why);
      }
      msg += "\nreorder the blocks so that every transfer is produced before it is awaited";
      if (base.back() > static_cast<size_t>(num_segments)) {
        msg += " and the orders a segment spans run its blocks in the same order";
      }
      return Error(msg);
    }
  }
  return Status::Ok();
}

}  // namespace

Status check_schedule(const std::vector<OrderView>& orders, int num_segments, int micro_batches,
                      const std::vector<int>& next_segment, const std::vector<int>& lane_of_segment,
                      int passes) {
  std::vector<std::vector<int>> lanes;
  for (int l : lane_of_segment) lanes.push_back({l});
  return check_schedule(orders, num_segments, micro_batches, next_segment, lanes, passes);
}

Status check_schedule(const std::vector<OrderView>& orders, int num_segments, int micro_batches,
                      const std::vector<int>& next_segment,
                      const std::vector<std::vector<int>>& lanes_of_segment, int passes) {
  if (passes < 1) return Error(fmt::format("{} forward passes per micro-batch", passes));
  OrderChecker c(orders, num_segments, micro_batches, next_segment, lanes_of_segment, passes);
  if (Status s = c.place_blocks(); !s) return s;
  if (Status s = c.check_micro_batches(); !s) return s;
  if (Status s = c.check_counts(); !s) return s;
  return c.replay();
}

}  // namespace nnsim
