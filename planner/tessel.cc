#include "planner/tessel.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <z3++.h>

namespace nnsim {

namespace {

// Blocks in an order where every block comes after those it needs; empty on a cycle.
std::vector<int> topological_order(const TesselProblem& p) {
  const int n = static_cast<int>(p.blocks.size());
  std::vector<int> indegree(n, 0);
  std::vector<std::vector<int>> users(n);
  for (int c = 0; c < n; ++c) {
    for (int b : p.blocks[c].after) {
      ++indegree[c];
      users[b].push_back(c);
    }
  }
  std::vector<int> out;
  for (int b = 0; b < n; ++b) {
    if (indegree[b] == 0) out.push_back(b);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    for (int c : users[out[i]]) {
      if (--indegree[c] == 0) out.push_back(c);
    }
  }
  if (static_cast<int>(out.size()) != n) out.clear();
  return out;
}

double peak_of(const TesselBlock& b) {
  return std::max({b.peak, b.bytes, 0.0});
}

// The plan block that runs `b` for `micro_batch`.
Block block_of(const TesselBlock& b, int micro_batch) {
  return Block{b.kind, micro_batch, b.segment, b.pass};
}

std::string block_name(const TesselBlock& b, int micro_batch) {
  return to_string(block_of(b, micro_batch));
}

Status check_problem(const TesselProblem& p) {
  if (p.devices < 1 || p.micro_batches < 1) {
    return Error("the schedule search needs at least one device and one micro-batch");
  }
  if (p.blocks.empty()) return Error("the schedule search got no blocks to place");
  std::map<std::tuple<BlockKind, int, int>, int> seen;
  std::vector<double> balance(p.devices, 0);
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    const TesselBlock& b = p.blocks[i];
    if (!seen.emplace(std::make_tuple(b.kind, b.segment, b.pass), static_cast<int>(i)).second) {
      return Error(fmt::format("block {} appears twice in one micro-batch", block_name(b, 0)));
    }
    if (b.devices.empty()) return Error(fmt::format("block {} has no device", block_name(b, 0)));
    for (int d : b.devices) {
      if (d < 0 || d >= p.devices) {
        return Error(
            fmt::format("block {} is placed on device {} of {}", block_name(b, 0), d, p.devices));
      }
      balance[d] += b.bytes;
    }
    for (int a : b.after) {
      if (a < 0 || a >= static_cast<int>(p.blocks.size()) || a == static_cast<int>(i)) {
        return Error(
            fmt::format("block {} needs block {}, which does not exist", block_name(b, 0), a));
      }
    }
    if (!b.transfer.empty() && b.transfer.size() != b.after.size()) {
      return Error(fmt::format("block {} has {} transfer times for {} blocks it needs",
                               block_name(b, 0), b.transfer.size(), b.after.size()));
    }
    for (double x : b.transfer) {
      if (!(x >= 0) || !std::isfinite(x)) {
        return Error(
            fmt::format("block {} has a negative or unbounded transfer time", block_name(b, 0)));
      }
    }
    if (b.seconds < 0) return Error(fmt::format("block {} has a negative time", block_name(b, 0)));
  }
  double scale = 1;
  for (const TesselBlock& b : p.blocks) scale = std::max(scale, std::abs(b.bytes));
  for (int d = 0; d < p.devices; ++d) {
    if (std::abs(balance[d]) > 1e-9 * scale) {
      return Error(fmt::format(
          "the blocks of one micro-batch keep {} bytes on device {} that none of them frees",
          balance[d], d));
    }
  }
  if (!p.memory_limit.empty() && static_cast<int>(p.memory_limit.size()) != p.devices) {
    return Error("the memory limit needs one value per device");
  }
  if (topological_order(p).empty()) {
    return Error("the blocks of one micro-batch depend on each other in a cycle");
  }
  return Status::Ok();
}

// The problem in integer units: time in ticks (the busiest device's work is kTicks), bytes in
// millionths of the largest block's.
constexpr int64_t kTicks = 10'000;
// Lags are searched up to this many periods per device (and never above the block count).
constexpr int64_t kMaxLagPerDevice = 2;

struct Discrete {
  std::vector<int64_t> ticks, bytes, peak;
  std::vector<std::vector<int64_t>> transfer;  // per block, per entry of its `after`
  std::vector<int64_t> limit;                  // per device; -1: none
  int64_t lower_bound = 0;                     // busiest device's ticks per micro-batch
  int64_t sequential = 0;                      // every block in sequence
  double seconds_per_tick = 0;
  double busiest_seconds = 0;
  int root = 0;             // a block that needs none
  bool single_root = true;  // every other block needs it, directly or not
};

Discrete discretize(const TesselProblem& p) {
  Discrete d;
  std::vector<double> load(p.devices, 0);
  for (const TesselBlock& b : p.blocks) {
    for (int dev : b.devices) load[dev] += b.seconds;
  }
  const double busiest = *std::max_element(load.begin(), load.end());
  d.busiest_seconds = busiest;
  d.seconds_per_tick = busiest > 0 ? busiest / kTicks : 1.0 / kTicks;
  double byte_unit = 0;
  for (const TesselBlock& b : p.blocks) {
    byte_unit = std::max({byte_unit, std::abs(b.bytes), peak_of(b)});
  }
  byte_unit = byte_unit > 0 ? byte_unit / 1e6 : 1;
  for (const TesselBlock& b : p.blocks) {
    d.ticks.push_back(static_cast<int64_t>(std::ceil(b.seconds / d.seconds_per_tick - 1e-9)));
    d.bytes.push_back(std::llround(b.bytes / byte_unit));
    d.peak.push_back(std::llround(peak_of(b) / byte_unit));
    d.sequential += d.ticks.back();
    d.transfer.emplace_back();
    for (size_t i = 0; i < b.after.size(); ++i) {
      d.transfer.back().push_back(
          static_cast<int64_t>(std::ceil(b.transfer_after(i) / d.seconds_per_tick - 1e-9)));
      // One micro-batch in sequence waits for every transfer.
      d.sequential += d.transfer.back().back();
    }
  }
  std::vector<int64_t> tick_load(p.devices, 0);
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    for (int dev : p.blocks[i].devices) tick_load[dev] += d.ticks[i];
  }
  d.lower_bound = std::max<int64_t>(1, *std::max_element(tick_load.begin(), tick_load.end()));
  d.sequential = std::max(d.sequential, d.lower_bound);
  const std::vector<int> topo = topological_order(p);
  d.root = topo.front();
  for (const TesselBlock& b : p.blocks)
    d.single_root = d.single_root && (&b == &p.blocks[d.root] || !b.after.empty());
  // Rounding each block's bytes to a unit can put a level that exactly meets the limit a few
  // units over it: allow one unit per block and period of lag (a few millionths of a block).
  const int64_t slack = static_cast<int64_t>(p.blocks.size()) * (kMaxLagPerDevice * p.devices + 2);
  for (int dev = 0; dev < p.devices; ++dev) {
    d.limit.push_back(p.memory_limit.empty()
                          ? -1
                          : static_cast<int64_t>(std::floor(p.memory_limit[dev] / byte_unit)) +
                                slack);
  }
  return d;
}

// Both passes' solver settings: Z3's deterministic resource limit, and relevancy propagation
// off. On these problems (disjunctions of difference constraints, sums of if-then-else terms)
// relevancy only slows the search: the 8-device sharded-head search took 12.0 s with it, 2.8 s
// without, for the same schedule.
z3::params solver_params(z3::context& ctx, uint64_t rlimit) {
  z3::params params(ctx);
  params.set("rlimit", static_cast<unsigned>(rlimit));
  params.set("relevancy", 0u);
  return params;
}

// The context's resource count so far (Z3's "rlimit count" statistic) after a check.
uint64_t rlimit_count(const z3::solver& solver) {
  const z3::stats stats = solver.statistics();
  uint64_t used = 0;
  for (unsigned i = 0; i < stats.size(); ++i) {
    if (stats.key(i) == "rlimit count") {
      used = stats.is_uint(i) ? stats.uint_value(i) : static_cast<uint64_t>(stats.double_value(i));
    }
  }
  return used;
}

struct Repetend {
  int64_t period = 0;
  std::vector<int64_t> start, lag;
};

// Is there a repetend of period `period` whose lags are at most `max_lag`?
// `budget`: solver work left for the whole search (Z3's resource units); each check may use
// at most `p.solver_rlimit` of it and spends what it used.
std::optional<Repetend> find_repetend(const TesselProblem& p, const Discrete& d, int64_t period,
                                      int64_t max_lag, int& calls, std::string& failure,
                                      uint64_t& budget) {
  if (budget == 0) return std::nullopt;
  ++calls;
  try {
    z3::context ctx;
    z3::solver solver(ctx);
    solver.set(solver_params(ctx, std::min<uint64_t>(p.solver_rlimit, budget)));
    const int n = static_cast<int>(p.blocks.size());
    const z3::expr P = ctx.int_val(period);
    std::vector<z3::expr> s, k;
    for (int b = 0; b < n; ++b) {
      s.push_back(ctx.int_const(fmt::format("s{}", b).c_str()));
      k.push_back(ctx.int_const(fmt::format("k{}", b).c_str()));
      solver.add(s[b] >= 0 && s[b] < P && k[b] >= 0 && k[b] <= ctx.int_val(max_lag));
    }
    auto t = [&](int b) { return ctx.int_val(d.ticks[b]); };
    // The circle can be rotated and all lags shifted: the first block starts period 0 at 0.
    solver.add(s[d.root] == 0);
    if (d.single_root) solver.add(k[d.root] == 0);
    // One block at a time per device, on a circle of length P.
    std::vector<std::vector<int>> on_device(p.devices);
    for (int b = 0; b < n; ++b) {
      for (int dev : p.blocks[b].devices) on_device[dev].push_back(b);
    }
    std::set<std::pair<int, int>> pairs;
    for (const auto& blocks : on_device) {
      for (size_t i = 0; i < blocks.size(); ++i) {
        for (size_t j = i + 1; j < blocks.size(); ++j) {
          const int a = blocks[i], b = blocks[j];
          if (d.ticks[a] == 0 || d.ticks[b] == 0 || !pairs.emplace(a, b).second) continue;
          solver.add((s[a] + t(a) <= s[b] && s[b] + t(b) <= s[a] + P) ||
                     (s[b] + t(b) <= s[a] && s[a] + t(a) <= s[b] + P));
        }
      }
    }
    // Dependencies within a micro-batch, across periods, with the transfer between them.
    for (int c = 0; c < n; ++c) {
      for (size_t i = 0; i < p.blocks[c].after.size(); ++i) {
        const int b = p.blocks[c].after[i];
        solver.add(k[c] * P + s[c] >= k[b] * P + s[b] + t(b) + ctx.int_val(d.transfer[c][i]));
      }
    }
    // Steady-state memory. Block b has ended for j - k_b + floor((tau - e_b) / P) micro-batches
    // by phase tau of period j (e_b = s_b + t_b), so a device holds
    // sum_b bytes_b (floor((tau - e_b) / P) - k_b): the j terms cancel as its blocks free what
    // they keep. The level only changes when a block ends, so the highest it gets while block a
    // runs is its level at s_a plus a's own peak. With s_a, s_b in [0, P) and t_b <= P the floor
    // is 0, -1 or -2: linear conditions, no integer division for the solver.
    for (int dev = 0; dev < p.devices; ++dev) {
      if (d.limit[dev] < 0) continue;
      z3::expr lagged = ctx.int_val(0);  // - sum_b bytes_b k_b
      for (int b : on_device[dev]) {
        if (d.bytes[b] != 0) lagged = lagged - ctx.int_val(d.bytes[b]) * k[b];
      }
      for (int a : on_device[dev]) {
        if (d.peak[a] <= 0) continue;  // the level at its start is bounded at its predecessor's
        z3::expr level = lagged;
        for (int b : on_device[dev]) {
          if (d.bytes[b] == 0) continue;
          const z3::expr bytes = ctx.int_val(d.bytes[b]);
          if (b == a && d.ticks[a] > 0) {
            level = level - bytes;  // not ended yet: floor(-t_a / P) = -1
          } else if (d.ticks[a] > 0 && d.ticks[b] > 0) {
            // Blocks that cannot overlap: b ended before s_a this period or in the last one.
            level = level - z3::ite(s[b] + t(b) <= s[a], ctx.int_val(0), bytes);
          } else {
            const z3::expr since_end = s[a] - s[b] - t(b);
            level =
                level + bytes * z3::ite(since_end >= 0, ctx.int_val(0),
                                        z3::ite(since_end >= -P, ctx.int_val(-1), ctx.int_val(-2)));
          }
        }
        solver.add(level + ctx.int_val(d.peak[a]) <= ctx.int_val(d.limit[dev]));
      }
    }
    const z3::check_result result = solver.check();
    const uint64_t used = rlimit_count(solver);
    budget -= std::min(budget, std::max<uint64_t>(used, 1));
    if (result != z3::sat) return std::nullopt;
    const z3::model m = solver.get_model();
    Repetend r;
    r.period = period;
    for (int b = 0; b < n; ++b) {
      r.start.push_back(m.eval(s[b], true).get_numeral_int64());
      r.lag.push_back(m.eval(k[b], true).get_numeral_int64());
    }
    return r;
  } catch (const z3::exception& e) {
    failure = e.msg();
    return std::nullopt;
  }
}

// The unrolled orders: every device's blocks by absolute time (m + k_b) P + s_b, ties by
// dependency order then micro-batch, the same on every device a block spans.
std::vector<std::vector<Block>> unroll(const TesselProblem& p, const Repetend& r) {
  const std::vector<int> topo = topological_order(p);
  std::vector<int> rank(p.blocks.size());
  for (size_t i = 0; i < topo.size(); ++i) rank[topo[i]] = static_cast<int>(i);
  std::vector<std::tuple<int64_t, int, int, int>> events;  // time, rank, micro-batch, block
  for (int m = 0; m < p.micro_batches; ++m) {
    for (size_t b = 0; b < p.blocks.size(); ++b) {
      events.emplace_back((m + r.lag[b]) * r.period + r.start[b], rank[b], m, static_cast<int>(b));
    }
  }
  std::sort(events.begin(), events.end());
  std::vector<std::vector<Block>> orders(p.devices);
  for (const auto& [time, order, m, b] : events) {
    for (int dev : p.blocks[b].devices) {
      orders[dev].push_back(block_of(p.blocks[b], m));
    }
  }
  return orders;
}

// Priority of one (block, micro-batch) in the list scheduler: lower runs first when two blocks
// can start at the same time.
using Priority = std::tuple<int64_t, int64_t, int64_t>;

// List scheduling of every micro-batch's blocks: repeatedly, of the blocks whose inputs are
// scheduled and that fit the memory of each of their devices at the end of its order so far,
// the one that can start first (its inputs arrived, all its devices free) is appended to its
// devices' orders; ties go to the lower priority. The orders never exceed the memory limit and
// respect every dependency (a block on several devices is appended to all of them at once, so
// they meet it in the same order). Empty when memory leaves no block able to run.
std::vector<std::vector<Block>> list_orders(const TesselProblem& p,
                                            const std::function<Priority(int, int)>& priority) {
  const int n = static_cast<int>(p.blocks.size());
  const int mb = p.micro_batches;
  std::vector<std::vector<int>> users(n);
  for (int c = 0; c < n; ++c) {
    for (int b : p.blocks[c].after) users[b].push_back(c);
  }
  std::vector<int> waiting(static_cast<size_t>(n) * mb);
  std::vector<double> end(waiting.size(), -1);
  std::vector<Priority> key(waiting.size());
  std::vector<int> ready;
  for (int b = 0; b < n; ++b) {
    for (int m = 0; m < mb; ++m) {
      const int id = b * mb + m;
      waiting[id] = static_cast<int>(p.blocks[b].after.size());
      key[id] = priority(b, m);
      if (waiting[id] == 0) ready.push_back(id);
    }
  }
  std::vector<double> free_at(p.devices, 0), level(p.devices, 0);
  std::vector<std::vector<Block>> orders(p.devices);
  auto fits = [&](const TesselBlock& blk) {
    if (p.memory_limit.empty()) return true;
    for (int dev : blk.devices) {
      const double limit = p.memory_limit[dev];
      if (level[dev] + peak_of(blk) > limit + 1e-9 * std::max(1.0, std::abs(limit))) return false;
    }
    return true;
  };
  for (size_t placed = 0; placed < waiting.size(); ++placed) {
    auto earliest = [&](int id) {
      const int b = id / mb, m = id % mb;
      const TesselBlock& blk = p.blocks[b];
      double start = 0;
      for (int dev : blk.devices) start = std::max(start, free_at[dev]);
      for (size_t i = 0; i < blk.after.size(); ++i) {
        start = std::max(start, end[blk.after[i] * mb + m] + blk.transfer_after(i));
      }
      return start;
    };
    int best = -1;
    double best_start = 0;
    for (int id : ready) {
      if (!fits(p.blocks[id / mb])) continue;
      const double start = earliest(id);
      if (best < 0 || start < best_start || (start == best_start && key[id] < key[best])) {
        best = id;
        best_start = start;
      }
    }
    if (best < 0) return {};
    ready.erase(std::find(ready.begin(), ready.end(), best));
    const int b = best / mb, m = best % mb;
    const TesselBlock& blk = p.blocks[b];
    end[best] = best_start + blk.seconds;
    for (int dev : blk.devices) {
      free_at[dev] = end[best];
      level[dev] += blk.bytes;
      orders[dev].push_back(block_of(blk, m));
    }
    for (int c : users[b]) {
      if (--waiting[c * mb + m] == 0) ready.push_back(c * mb + m);
    }
  }
  return orders;
}

// No schedule of every micro-batch is shorter: on some device, the earliest any of its blocks
// can start (the longest chain of blocks and transfers before it in one micro-batch), plus its
// work for every micro-batch, plus the shortest chain that must follow its last block.
double makespan_lower_bound(const TesselProblem& p) {
  const std::vector<int> topo = topological_order(p);
  const int n = static_cast<int>(p.blocks.size());
  std::vector<double> head(n, 0), tail(n, 0);
  for (int c : topo) {
    for (size_t i = 0; i < p.blocks[c].after.size(); ++i) {
      const int b = p.blocks[c].after[i];
      head[c] = std::max(head[c], head[b] + p.blocks[b].seconds + p.blocks[c].transfer_after(i));
    }
  }
  for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
    const int c = *it;
    for (size_t i = 0; i < p.blocks[c].after.size(); ++i) {
      const int b = p.blocks[c].after[i];
      tail[b] = std::max(tail[b], tail[c] + p.blocks[c].seconds + p.blocks[c].transfer_after(i));
    }
  }
  double bound = 0;
  for (int dev = 0; dev < p.devices; ++dev) {
    double first = std::numeric_limits<double>::infinity(), last = first, work = 0;
    for (int b = 0; b < n; ++b) {
      const std::vector<int>& on = p.blocks[b].devices;
      if (std::find(on.begin(), on.end(), dev) == on.end()) continue;
      first = std::min(first, head[b]);
      last = std::min(last, tail[b]);
      work += p.blocks[b].seconds;
    }
    if (work > 0) bound = std::max(bound, first + p.micro_batches * work + last);
  }
  return bound;
}

// Tessel's second pass: warm-up and cool-down by the solver. The repetend stays fixed: with K
// its largest lag, periods K..M-1 are full and run as unrolled, shifted together by W (an
// integer variable: where period K starts). Every other (block, micro-batch) instance gets its
// own start. Constraints: dependencies with their transfers, one block at a time per device
// (also against the full periods' instances that can border the ends), each block's instances
// in micro-batch order (Tessel's rule; it also keeps the warm-up before period K + 1 and the
// cool-down after period M - 2, so only those periods' fixed instances need checking), and
// the memory limit at the start of every instance whose level the ends can change. The bound
// bisected is the makespan (below the incumbent), or W and the tail after it when the two ends
// are solved apart.
class EndsSearch {
 public:
  EndsSearch(const TesselProblem& p, const Discrete& d, const Repetend& r);

  // The orders of the shortest schedule found below `incumbent` seconds, if any; `calls`
  // counts the solver's checks, `failure` says why the solver stopped, if it failed.
  std::optional<std::vector<std::vector<Block>>> run(double incumbent, int& calls,
                                                     std::string& failure);

 private:
  // Zones: 0 warm-up (free), 1 period K, 2 periods strictly between the borders, 3 the last
  // two periods (fixed), 4 cool-down (free). Without a full period every instance is free (0).
  bool is_free(int id) const { return zone_[id] == 0 || zone_[id] == 4; }
  // The ends a constraint on instance `id` involves: 1 the warm-up, 2 the cool-down.
  int side(int id) const { return zone_[id] == 0 ? 1 : zone_[id] == 4 ? 2 : 0; }
  int64_t natural(int id) const { return (mb_[id] + r_.lag[blk_[id]]) * P_ + r_.start[blk_[id]]; }
  z3::expr ticks(int id) { return ctx_.int_val(d_.ticks[blk_[id]]); }
  int derived(int i, int j) const;
  int known(int i, int j) const;
  void add_constraints();
  z3::expr before(int i, int j);
  std::optional<z3::model> minimize(int sides, const std::vector<z3::expr>& extra,
                                    const std::function<std::vector<z3::expr>(int64_t)>& bounded,
                                    const std::function<int64_t(const z3::model&)>& value,
                                    int64_t lo, int64_t hi, uint64_t budget);
  int64_t eval(const z3::model& model, const z3::expr& e) {
    return model.eval(e, true).get_numeral_int64();
  }
  std::optional<std::vector<int64_t>> solve_apart();
  std::optional<std::vector<int64_t>> solve_together(double incumbent);
  std::vector<std::vector<Block>> orders_from(const std::vector<int64_t>& starts) const;

  const TesselProblem& p_;
  const Discrete& d_;
  const Repetend& r_;
  const int n_;
  const int64_t M_, K_, P_;
  const bool has_fixed_;
  const int total_;
  // Per instance (block b, micro-batch m at b * M + m): its zone, block, micro-batch and, when
  // fixed, its start - W.
  std::vector<int> zone_, blk_, mb_;
  std::vector<int64_t> offset_;
  int free_count_ = 0;
  std::vector<std::vector<bool>> reach_;  // reach_[a][b]: block b depends on a, directly or not
  // Instances whose unrolled starts are this far apart keep the unrolled order (0: none).
  int64_t window_ = 0;
  std::vector<std::vector<int>> on_device_;  // instances the ends can touch, per device
  std::vector<int64_t> middle_bytes_;        // bytes the middle periods leave, per device

  // The solver's model: every instance's start, W, the constraints with the ends they involve,
  // one Boolean per unordered pair the solver decides.
  z3::context ctx_;
  std::vector<std::optional<z3::expr>> start_;
  std::optional<z3::expr> W_;
  std::vector<std::pair<z3::expr, int>> base_;
  std::map<std::pair<int, int>, z3::expr> order_;
  int64_t fixed_end_ = 0;
  uint64_t counted_ = 0;  // the context's resource count so far
  int* calls_ = nullptr;
};

EndsSearch::EndsSearch(const TesselProblem& p, const Discrete& d, const Repetend& r)
    : p_(p),
      d_(d),
      r_(r),
      n_(static_cast<int>(p.blocks.size())),
      M_(p.micro_batches),
      K_(*std::max_element(r.lag.begin(), r.lag.end())),
      P_(r.period),
      has_fixed_(M_ > K_),
      total_(n_ * static_cast<int>(M_)),
      zone_(total_),
      blk_(total_),
      mb_(total_),
      offset_(total_, 0) {
  for (int b = 0; b < n_; ++b) {
    for (int64_t m = 0; m < M_; ++m) {
      const int id = b * static_cast<int>(M_) + static_cast<int>(m);
      blk_[id] = b;
      mb_[id] = static_cast<int>(m);
      const int64_t j = m + r_.lag[b];
      int z = 0;
      if (has_fixed_) {
        z = j < K_ ? 0 : j == K_ ? 1 : j > M_ - 1 ? 4 : j >= M_ - 2 ? 3 : 2;
        offset_[id] = (j - K_) * P_ + r_.start[b];
      }
      zone_[id] = z;
      free_count_ += (z == 0 || z == 4);
    }
  }
  reach_.assign(n_, std::vector<bool>(n_, false));
  for (int b : topological_order(p_)) {
    for (int a : p_.blocks[b].after) {
      reach_[a][b] = true;
      for (int x = 0; x < n_; ++x) reach_[x][b] = reach_[x][b] || reach_[x][a];
    }
  }
}

// Whether instance i runs before j as the rules already fix it: 1 before, 0 after, -1 the
// solver decides.
int EndsSearch::derived(int i, int j) const {
  if (blk_[i] == blk_[j]) return mb_[i] < mb_[j] ? 1 : 0;
  if (mb_[i] == mb_[j] && reach_[blk_[i]][blk_[j]]) return 1;
  if (mb_[i] == mb_[j] && reach_[blk_[j]][blk_[i]]) return 0;
  if (!is_free(i) && !is_free(j)) {
    return std::make_pair(offset_[i], blk_[i]) < std::make_pair(offset_[j], blk_[j]) ? 1 : 0;
  }
  const int zi = zone_[i], zj = zone_[j];
  if (zi == zj) return -1;
  const int lo = std::min(zi, zj), hi = std::max(zi, zj);
  bool ordered = false;
  if (lo == 0) ordered = hi == 2 || hi == 3 || (hi == 4 && M_ - 1 - K_ >= 1);
  if (lo == 1) ordered = hi == 4 && M_ - 1 - K_ >= 2;
  if (lo == 2) ordered = true;
  if (!ordered) return -1;
  return zi < zj ? 1 : 0;
}

// As derived, and in large ends two instances whose unrolled starts are `window_` or more apart
// keep the unrolled order (a neighbourhood of the unrolled repetend; the list schedule stays the
// incumbent): too many orders otherwise for the solver to settle within its budget.
int EndsSearch::known(int i, int j) const {
  const int k = derived(i, j);
  if (k >= 0 || window_ == 0 || std::abs(natural(i) - natural(j)) < window_) return k;
  return natural(i) < natural(j) ? 1 : 0;
}

// i ends before j starts: a constant where known, else the pair's Boolean (created on first use
// with the two implications it stands for). Shared by the devices a block spans, so they meet
// their blocks in the same order.
z3::expr EndsSearch::before(int i, int j) {
  const int k = known(i, j);
  if (k >= 0) return ctx_.bool_val(k == 1);
  const std::pair<int, int> key = std::minmax(i, j);
  auto it = order_.find(key);
  if (it == order_.end()) {
    const z3::expr o = ctx_.bool_const(fmt::format("o{}_{}", key.first, key.second).c_str());
    const int sides = side(key.first) | side(key.second);
    base_.emplace_back(z3::implies(o, *start_[key.first] + ticks(key.first) <= *start_[key.second]),
                       sides);
    base_.emplace_back(
        z3::implies(!o, *start_[key.second] + ticks(key.second) <= *start_[key.first]), sides);
    it = order_.emplace(key, o).first;
  }
  return i == key.first ? it->second : !it->second;
}

// The constraints of the ends: starts not negative, each block's instances in micro-batch order,
// dependencies with their transfers, one block at a time per device and the memory limit.
void EndsSearch::add_constraints() {
  for (int id = 0; id < total_; ++id) {
    for (int dev : p_.blocks[blk_[id]].devices) {
      if (zone_[id] == 2) {
        middle_bytes_[dev] += d_.bytes[blk_[id]];
      } else {
        on_device_[dev].push_back(id);
      }
    }
  }
  W_ = ctx_.int_const("W");
  for (int id = 0; id < total_; ++id) {
    if (is_free(id)) {
      start_[id] = ctx_.int_const(fmt::format("x{}_{}", blk_[id], mb_[id]).c_str());
    } else {
      start_[id] = *W_ + ctx_.int_val(offset_[id]);
    }
  }
  base_.emplace_back(*W_ >= 0, 0);
  for (int id = 0; id < total_; ++id) {
    if (is_free(id)) {
      base_.emplace_back(*start_[id] >= 0, side(id));
    } else {
      fixed_end_ = std::max(fixed_end_, offset_[id] + d_.ticks[blk_[id]]);
    }
  }
  // Micro-batch order of each block's instances.
  for (int b = 0; b < n_; ++b) {
    for (int64_t m = 0; m + 1 < M_; ++m) {
      const int i = b * static_cast<int>(M_) + static_cast<int>(m);
      if (is_free(i) || is_free(i + 1)) {
        base_.emplace_back(*start_[i] + ticks(i) <= *start_[i + 1], side(i) | side(i + 1));
      }
    }
  }
  for (int c = 0; c < n_; ++c) {
    for (size_t k = 0; k < p_.blocks[c].after.size(); ++k) {
      const int b = p_.blocks[c].after[k];
      for (int64_t m = 0; m < M_; ++m) {
        const int i = b * static_cast<int>(M_) + static_cast<int>(m);
        const int j = c * static_cast<int>(M_) + static_cast<int>(m);
        if (!is_free(i) && !is_free(j)) continue;
        base_.emplace_back(*start_[j] >= *start_[i] + ticks(i) + ctx_.int_val(d_.transfer[c][k]),
                           side(i) | side(j));
      }
    }
  }
  for (int dev = 0; dev < p_.devices; ++dev) {
    const std::vector<int>& ids = on_device_[dev];
    for (size_t a = 0; a < ids.size(); ++a) {
      for (size_t b = a + 1; b < ids.size(); ++b) {
        const int i = ids[a], j = ids[b];
        if (derived(i, j) >= 0) continue;
        if (known(i, j) < 0) {
          before(i, j);
        } else {
          const int first = known(i, j) == 1 ? i : j, second = first == i ? j : i;
          base_.emplace_back(*start_[first] + ticks(first) <= *start_[second],
                             side(first) | side(second));
        }
      }
    }
    if (d_.limit[dev] < 0) continue;
    for (int i : ids) {
      if (zone_[i] == 2) continue;
      z3::expr level = ctx_.int_val(zone_[i] >= 3 ? middle_bytes_[dev] : 0);
      int sides = zone_[i] == 1 ? 1 : zone_[i] == 3 ? 2 : side(i);
      for (int j : ids) {
        if (j == i || d_.bytes[blk_[j]] == 0) continue;
        if (known(j, i) < 0) sides |= side(i) | side(j);
        level = level + z3::ite(before(j, i), ctx_.int_val(d_.bytes[blk_[j]]), ctx_.int_val(0));
      }
      base_.emplace_back(level + ctx_.int_val(d_.peak[blk_[i]]) <= ctx_.int_val(d_.limit[dev]),
                         sides);
    }
  }
}

// The smallest `value` of a model of the constraints of `sides` (and `extra`) under the bound
// constraints, bisected in [lo, hi] down to the problem's precision; nullopt when none is found
// within `budget` (Z3's resource units).
std::optional<z3::model> EndsSearch::minimize(
    int sides, const std::vector<z3::expr>& extra,
    const std::function<std::vector<z3::expr>(int64_t)>& bounded,
    const std::function<int64_t(const z3::model&)>& value, int64_t lo, int64_t hi,
    uint64_t budget) {
  const int64_t tolerance = std::max<int64_t>(
      1, static_cast<int64_t>(p_.precision * static_cast<double>(d_.lower_bound)));
  std::optional<z3::model> best;
  while (lo <= hi && budget > 0 && (!best || hi - lo >= tolerance)) {
    const int64_t bound = best ? lo + (hi - lo) / 2 : hi;
    z3::solver solver(ctx_);
    solver.set(solver_params(ctx_, std::min<uint64_t>(p_.solver_rlimit, budget)));
    for (const auto& [e, s] : base_) {
      if ((s & ~sides) == 0) solver.add(e);
    }
    for (const z3::expr& e : extra) solver.add(e);
    for (const z3::expr& e : bounded(bound)) solver.add(e);
    ++*calls_;
    const z3::check_result result = solver.check();
    const uint64_t used = rlimit_count(solver);
    // The count is the context's, over every check so far.
    const uint64_t spent = used >= counted_ ? used - counted_ : used;
    counted_ = std::max(counted_, used);
    budget -= std::min(budget, std::max<uint64_t>(spent, 1));
    if (result == z3::sat) {
      best = solver.get_model();
      hi = value(*best) - 1;
    } else if (!best) {
      break;
    } else {
      lo = bound + 1;
    }
  }
  return best;
}

// No constraint involves both ends: the warm-up for the earliest W, then the cool-down for the
// shortest tail after W, each a much smaller problem. Every instance's start, when either end
// improved on the unrolled repetend (W = K P, the natural starts, a solution of each).
std::optional<std::vector<int64_t>> EndsSearch::solve_apart() {
  std::vector<int64_t> starts(total_);
  for (int id = 0; id < total_; ++id) starts[id] = natural(id);
  int64_t w = K_ * P_, tail = fixed_end_;
  std::vector<int64_t> work(p_.devices, 0), cool(p_.devices, 0);
  for (int id = 0; id < total_; ++id) {
    if (zone_[id] == 4) tail = std::max(tail, starts[id] - w + d_.ticks[blk_[id]]);
    for (int dev : p_.blocks[blk_[id]].devices) {
      if (zone_[id] == 0) work[dev] += d_.ticks[blk_[id]];
      if (zone_[id] == 4) cool[dev] += d_.ticks[blk_[id]];
    }
  }
  // The warm-up ends by W + P; the cool-down starts after W + (M - 1 - K) P.
  int64_t w_lo = 0, tail_lo = fixed_end_;
  for (int dev = 0; dev < p_.devices; ++dev) {
    w_lo = std::max(w_lo, work[dev] - P_);
    tail_lo = std::max(tail_lo, (M_ - 1 - K_) * P_ + cool[dev]);
  }
  const z3::expr& W = *W_;
  bool improved = false;
  std::optional<z3::model> warm = minimize(
      1, {}, [&](int64_t bound) { return std::vector<z3::expr>{W <= ctx_.int_val(bound)}; },
      [&](const z3::model& m) { return eval(m, W); }, w_lo, w - 1, p_.ends_rlimit / 2);
  if (warm) {
    improved = true;
    w = eval(*warm, W);
    for (int id = 0; id < total_; ++id) {
      if (zone_[id] == 0) starts[id] = eval(*warm, *start_[id]);
    }
  }
  auto tail_of = [&](const z3::model& m) {
    int64_t z = fixed_end_;
    for (int id = 0; id < total_; ++id) {
      if (zone_[id] == 4) z = std::max(z, eval(m, *start_[id]) + d_.ticks[blk_[id]]);
    }
    return z;
  };
  std::optional<z3::model> cold = minimize(
      2, {W == 0},
      [&](int64_t bound) {
        std::vector<z3::expr> out = {ctx_.int_val(fixed_end_) <= ctx_.int_val(bound)};
        for (int id = 0; id < total_; ++id) {
          if (zone_[id] == 4) out.push_back(*start_[id] + ticks(id) <= ctx_.int_val(bound));
        }
        return out;
      },
      tail_of, tail_lo, tail - 1, p_.ends_rlimit - p_.ends_rlimit / 2);
  for (int id = 0; id < total_; ++id) {
    if (zone_[id] == 4) {
      starts[id] = cold ? eval(*cold, *start_[id]) + w : starts[id] - K_ * P_ + w;
    } else if (!is_free(id)) {
      starts[id] = w + offset_[id];
    }
  }
  if (!improved && !cold) return std::nullopt;
  return starts;
}

// Both ends at once, the makespan bisected strictly below the incumbent, down to the busiest
// device's total work.
std::optional<std::vector<int64_t>> EndsSearch::solve_together(double incumbent) {
  auto makespan_of = [&](const z3::model& model) {
    int64_t z = has_fixed_ ? eval(model, *W_) + fixed_end_ : 0;
    for (int id = 0; id < total_; ++id) {
      if (is_free(id)) z = std::max(z, eval(model, *start_[id]) + d_.ticks[blk_[id]]);
    }
    return z;
  };
  const int64_t hi = static_cast<int64_t>(std::ceil(incumbent / d_.seconds_per_tick - 1e-9)) - 1;
  std::optional<z3::model> model = minimize(
      3, {},
      [&](int64_t bound) {
        std::vector<z3::expr> out;
        if (has_fixed_) out.push_back(*W_ + ctx_.int_val(fixed_end_) <= ctx_.int_val(bound));
        for (int id = 0; id < total_; ++id) {
          if (is_free(id)) out.push_back(*start_[id] + ticks(id) <= ctx_.int_val(bound));
        }
        return out;
      },
      makespan_of, d_.lower_bound * M_, hi, p_.ends_rlimit);
  if (!model) return std::nullopt;
  std::vector<int64_t> starts(total_);
  for (int id = 0; id < total_; ++id) starts[id] = eval(*model, *start_[id]);
  return starts;
}

// Every device runs its instances by start, ties by dependency order then micro-batch, the same
// on every device a block spans.
std::vector<std::vector<Block>> EndsSearch::orders_from(const std::vector<int64_t>& starts) const {
  const std::vector<int> topo = topological_order(p_);
  std::vector<int> rank(n_);
  for (int i = 0; i < n_; ++i) rank[topo[i]] = i;
  std::vector<std::tuple<int64_t, int, int, int>> events;
  for (int id = 0; id < total_; ++id) events.emplace_back(starts[id], rank[blk_[id]], mb_[id], id);
  std::sort(events.begin(), events.end());
  std::vector<std::vector<Block>> orders(p_.devices);
  for (const auto& [time, rk, m, id] : events) {
    for (int dev : p_.blocks[blk_[id]].devices) {
      orders[dev].push_back(block_of(p_.blocks[blk_[id]], m));
    }
  }
  return orders;
}

std::optional<std::vector<std::vector<Block>>> EndsSearch::run(double incumbent, int& calls,
                                                               std::string& failure) {
  if (free_count_ == 0) return std::nullopt;
  // Larger ends are beyond what the solver settles within its budget.
  constexpr int kMaxFree = 400, kFreeInFull = 100;
  constexpr int64_t kWindowPeriods = 2;
  if (free_count_ > kMaxFree) return std::nullopt;
  window_ = free_count_ > kFreeInFull ? kWindowPeriods * P_ : 0;
  calls_ = &calls;
  on_device_.assign(p_.devices, {});
  middle_bytes_.assign(p_.devices, 0);
  start_.assign(total_, std::nullopt);
  try {
    add_constraints();
    bool apart = has_fixed_;
    for (const auto& [e, sides] : base_) apart = apart && sides != 3;
    std::optional<std::vector<int64_t>> starts = apart ? solve_apart() : solve_together(incumbent);
    if (!starts) return std::nullopt;
    return orders_from(*starts);
  } catch (const z3::exception& e) {
    failure = e.msg();
    return std::nullopt;
  }
}

}  // namespace

Expected<OrdersRun> run_orders(const TesselProblem& p,
                               const std::vector<std::vector<Block>>& orders) {
  if (Status s = check_problem(p); !s) return s.error();
  if (static_cast<int>(orders.size()) != p.devices) {
    return Error(fmt::format("{} orders for {} devices", orders.size(), p.devices));
  }
  std::map<std::tuple<BlockKind, int, int>, int> index;
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    index[{p.blocks[i].kind, p.blocks[i].segment, p.blocks[i].pass}] = static_cast<int>(i);
  }
  const int n = static_cast<int>(p.blocks.size());
  // Which positions of which orders each (block, micro-batch) holds.
  std::vector<std::vector<int>> position(orders.size());
  std::vector<int> seen(static_cast<size_t>(n) * p.micro_batches, 0);
  for (size_t dev = 0; dev < orders.size(); ++dev) {
    for (const Block& b : orders[dev]) {
      auto it = index.find({b.kind, b.segment, b.pass});
      const bool on_device =
          it != index.end() && std::count(p.blocks[it->second].devices.begin(),
                                          p.blocks[it->second].devices.end(), dev) > 0;
      if (!on_device || b.micro_batch < 0 || b.micro_batch >= p.micro_batches) {
        return Error(
            fmt::format("device {} runs {}, which is not one of its blocks", dev, to_string(b)));
      }
      if (++seen[static_cast<size_t>(it->second) * p.micro_batches + b.micro_batch] >
          static_cast<int>(p.blocks[it->second].devices.size())) {
        return Error(fmt::format("device {} runs {} twice", dev, to_string(b)));
      }
      position[dev].push_back(it->second * p.micro_batches + b.micro_batch);
    }
  }
  for (int b = 0; b < n; ++b) {
    for (int m = 0; m < p.micro_batches; ++m) {
      if (seen[static_cast<size_t>(b) * p.micro_batches + m] !=
          static_cast<int>(p.blocks[b].devices.size())) {
        for (int dev : p.blocks[b].devices) {
          if (std::find(orders[dev].begin(), orders[dev].end(), block_of(p.blocks[b], m)) ==
              orders[dev].end()) {
            return Error(fmt::format("device {} never runs {}", dev, block_name(p.blocks[b], m)));
          }
        }
      }
    }
  }
  std::vector<size_t> next(orders.size(), 0);
  std::vector<double> free_at(orders.size(), 0);
  std::vector<double> end(static_cast<size_t>(n) * p.micro_batches, -1);
  size_t remaining = 0;
  for (const auto& o : orders) remaining += o.size();
  OrdersRun run;
  run.peak_bytes.assign(orders.size(), 0);
  std::vector<double> level(orders.size(), 0);
  while (remaining > 0) {
    bool progress = false;
    for (size_t dev = 0; dev < orders.size(); ++dev) {
      if (next[dev] >= orders[dev].size()) continue;
      const int id = position[dev][next[dev]];
      const int b = id / p.micro_batches, m = id % p.micro_batches;
      const TesselBlock& blk = p.blocks[b];
      // Every device of the block is at it, and its inputs are done.
      bool ready = true;
      double start = 0;
      for (int other : blk.devices) {
        ready = ready && next[other] < orders[other].size() && position[other][next[other]] == id;
        start = std::max(start, free_at[other]);
      }
      for (size_t i = 0; i < blk.after.size(); ++i) {
        const double e = end[static_cast<size_t>(blk.after[i]) * p.micro_batches + m];
        ready = ready && e >= 0;
        start = std::max(start, e + blk.transfer_after(i));
      }
      if (!ready) continue;
      const double finish = start + blk.seconds;
      end[id] = finish;
      run.makespan = std::max(run.makespan, finish);
      for (int other : blk.devices) {
        free_at[other] = finish;
        run.peak_bytes[other] = std::max(run.peak_bytes[other], level[other] + peak_of(blk));
        level[other] += blk.bytes;
        ++next[other];
        --remaining;
      }
      progress = true;
    }
    if (!progress) {
      for (size_t dev = 0; dev < orders.size(); ++dev) {
        if (next[dev] < orders[dev].size()) {
          return Error(fmt::format("the orders deadlock: device {} waits forever at {}", dev,
                                   to_string(orders[dev][next[dev]])));
        }
      }
    }
  }
  return run;
}

std::vector<TesselBlock> recycled_blocks(const std::vector<TesselBlock>& base, int passes,
                                         double recycle_seconds) {
  const int n = static_cast<int>(base.size());
  std::vector<int> forwards, others;
  for (int b = 0; b < n; ++b) {
    (base[b].kind == BlockKind::kForward ? forwards : others).push_back(b);
  }
  // Forwards that need no forward (a pass's first) and that no forward needs (its last).
  std::vector<bool> first(n, true), last(n, true);
  for (int b : forwards) {
    for (int a : base[b].after) {
      if (base[a].kind == BlockKind::kForward) {
        first[b] = false;
        last[a] = false;
      }
    }
  }
  passes = std::max(passes, 1);
  const int f = static_cast<int>(forwards.size());
  std::vector<int> index(n, -1);  // base block -> its block in the output (last pass)
  for (int i = 0; i < f; ++i) index[forwards[i]] = (passes - 1) * f + i;
  for (size_t i = 0; i < others.size(); ++i) index[others[i]] = passes * f + static_cast<int>(i);
  std::vector<TesselBlock> out;
  for (int pass = 0; pass < passes; ++pass) {
    for (int i = 0; i < f; ++i) {
      TesselBlock blk = base[forwards[i]];
      const int shift = pass * f - (passes - 1) * f;  // from the last pass's indices to this one's
      blk.transfer.resize(blk.after.size(), 0.0);
      for (int& a : blk.after) a = index[a] + (base[a].kind == BlockKind::kForward ? shift : 0);
      if (pass > 0 && first[forwards[i]]) {
        for (int j = 0; j < f; ++j) {
          if (!last[forwards[j]]) continue;
          blk.after.push_back((pass - 1) * f + j);
          blk.transfer.push_back(recycle_seconds);
        }
      }
      blk.pass = pass;
      if (pass < passes - 1) {
        blk.peak = std::max({blk.peak, blk.bytes, 0.0});
        blk.bytes = 0;
      }
      out.push_back(std::move(blk));
    }
  }
  for (int b : others) {
    TesselBlock blk = base[b];
    for (int& a : blk.after) a = index[a];
    out.push_back(std::move(blk));
  }
  for (TesselBlock& blk : out) {
    bool any = false;
    for (double x : blk.transfer) any = any || x != 0;
    if (!any) blk.transfer.clear();
  }
  return out;
}

Expected<TesselSchedule> tessel_search(const TesselProblem& p) {
  if (Status s = check_problem(p); !s) return s.error();
  const Discrete d = discretize(p);
  const int n = static_cast<int>(p.blocks.size());
  // Lags beyond one per block never help: the sequential repetend has none.
  const int64_t lag_bound = std::min<int64_t>(n, kMaxLagPerDevice * p.devices + 4);
  TesselSchedule out;
  std::string failure;
  uint64_t budget = p.search_rlimit;
  auto find = [&](int64_t period, int64_t max_lag) {
    return find_repetend(p, d, period, max_lag, out.solver_calls, failure, budget);
  };
  // Shortest period: the busiest device's work if it can be had, else by bisection up to the
  // whole micro-batch in sequence.
  // (Tried first with the lags a pipeline of this many devices needs, which is much quicker
  // to search, then with all.)
  const int64_t few_lags = std::min<int64_t>(lag_bound, p.devices + 2);
  std::optional<Repetend> best = find(d.lower_bound, few_lags);
  if (!best && few_lags < lag_bound) best = find(d.lower_bound, lag_bound);
  if (!best) {
    int64_t lo = d.lower_bound + 1, hi = d.sequential;
    const int64_t tolerance = std::max<int64_t>(
        1, static_cast<int64_t>(p.precision * static_cast<double>(d.lower_bound)));
    while (hi - lo > tolerance) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (auto r = find(mid, lag_bound)) {
        best = r;
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    if (!best) {
      budget = std::max<uint64_t>(budget, p.solver_rlimit);  // the answer of last resort
      best = find(hi, lag_bound);
    }
  }
  if (!failure.empty()) return Error("the Z3 solver failed: " + failure);
  if (!best) {
    return Error(
        "no repeating schedule fits the memory limit, not even one micro-batch at a time; "
        "raise --memory-limit or recompute more");
  }
  // At that period, smaller largest lags (shorter warm-up and cool-down): every repetend found
  // on the way is unrolled, and the one whose unrolled orders finish first is kept.
  std::optional<Repetend> chosen;
  std::optional<OrdersRun> chosen_run;
  std::vector<std::vector<Block>> chosen_orders;
  auto consider = [&](const Repetend& r) -> Status {
    std::vector<std::vector<Block>> orders = unroll(p, r);
    Expected<OrdersRun> run = run_orders(p, orders);
    if (!run) return run.error();
    if (!chosen_run || run->makespan < chosen_run->makespan) {
      chosen = r;
      chosen_run = *run;
      chosen_orders = std::move(orders);
    }
    return Status::Ok();
  };
  if (Status s = consider(*best); !s) return s.error();
  int64_t lag_lo = 0, lag_hi = *std::max_element(best->lag.begin(), best->lag.end());
  while (lag_lo < lag_hi) {
    const int64_t mid = lag_lo + (lag_hi - lag_lo) / 2;
    if (auto r = find(best->period, mid)) {
      if (Status s = consider(*r); !s) return s.error();
      lag_hi = mid;
    } else {
      lag_lo = mid + 1;
    }
  }
  // Warm-up and cool-down: the unrolled orders keep the repetend's order from the first block
  // to the last, so the fill and drain wait on it. List scheduling every micro-batch's blocks
  // (earliest start first, within the memory limit) fills them instead; two tie-breaks: the
  // repetend's own order ((m + k_b) P + s_b), and backward first (input gradients, then
  // forwards, then weight gradients, earliest micro-batch first: 1F1B's and ZB-H1's rule).
  // The orders that finish first are kept (the unrolled ones on a tie).
  const std::vector<int> topo = topological_order(p);
  std::vector<int64_t> rank(n);
  for (int i = 0; i < n; ++i) rank[topo[i]] = i;
  const Repetend& r = *chosen;
  auto by_repetend = [&](int b, int m) {
    return Priority{(m + r.lag[b]) * r.period + r.start[b], rank[b], m};
  };
  auto backward_first = [&](int b, int m) {
    const BlockKind k = p.blocks[b].kind;
    const int64_t cls = k == BlockKind::kForward ? 1 : k == BlockKind::kBackwardWeight ? 2 : 0;
    return Priority{cls, m, rank[b]};
  };
  for (const std::function<Priority(int, int)>& rule :
       {std::function<Priority(int, int)>(by_repetend),
        std::function<Priority(int, int)>(backward_first)}) {
    std::vector<std::vector<Block>> orders = list_orders(p, rule);
    if (orders.empty()) continue;
    Expected<OrdersRun> run = run_orders(p, orders);
    if (!run) return run.error();
    if (run->makespan < chosen_run->makespan) {
      chosen_run = *run;
      chosen_orders = std::move(orders);
      out.ends_list_scheduled = true;
    }
  }
  // Tessel's second pass: the ends searched around the fixed repetend, kept only when shorter
  // and within the memory limit (the solver's bytes are rounded).
  out.ends_incumbent = chosen_run->makespan;
  const bool optimal = chosen_run->makespan <= makespan_lower_bound(p) * (1 + 1e-9);
  if (auto orders =
          optimal ? std::nullopt
                  : EndsSearch(p, d, r).run(chosen_run->makespan, out.solver_calls, failure)) {
    Expected<OrdersRun> run = run_orders(p, *orders);
    if (!run) return run.error();
    bool fits = true;
    for (int dev = 0; dev < p.devices && !p.memory_limit.empty(); ++dev) {
      const double limit = p.memory_limit[dev];
      fits = fits && run->peak_bytes[dev] <= limit + 1e-9 * std::max(1.0, std::abs(limit));
    }
    if (fits && run->makespan < chosen_run->makespan) {
      chosen_run = *run;
      chosen_orders = std::move(*orders);
      out.ends_searched = true;
      out.ends_list_scheduled = false;
    }
  }
  if (!failure.empty()) return Error("the Z3 solver failed: " + failure);
  out.period = static_cast<double>(chosen->period) * d.seconds_per_tick;
  out.lower_bound = d.busiest_seconds;
  out.lag.assign(chosen->lag.begin(), chosen->lag.end());
  for (int64_t s : chosen->start) out.start.push_back(static_cast<double>(s) * d.seconds_per_tick);
  out.orders = std::move(chosen_orders);
  out.makespan = chosen_run->makespan;
  out.peak_bytes = chosen_run->peak_bytes;
  return out;
}

}  // namespace nnsim
