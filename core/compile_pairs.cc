// Paired blocks: Megatron-Core's combined 1F1B (communication.ep_overlap) and DualPipe's
// overlapped forward-backward (pairs written in the orders, "F3@0+B1@7"). A forward block and
// the backward block of another micro-batch next to it in a lane's order become one block whose
// expert all-to-alls run on a communication stream, each beside the other block's compute.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/compiler.h"

namespace nnsim::detail {

namespace {

// An all-to-all that moves a mixture's routed tokens (NCCL's or DeepEP's), blocking and with
// nothing overlapped yet: what the pair may hide.
bool hideable(const Step& s) {
  return s.kind == StepKind::kCollective && s.group < 0 && s.seconds == 0 &&
         (s.collective == CollectiveKind::kAllToAll ||
          s.collective == CollectiveKind::kExpertExchange);
}

bool has_hideable(const BlockTemplate& t) {
  for (const Step& s : t.steps) {
    if (hideable(s)) return true;
  }
  return false;
}

// A blocking collective of the lane or the mesh (not an explicit group's), nothing overlapped.
bool plain_collective(const Step& s) {
  return s.kind == StepKind::kCollective && s.group < 0 && s.seconds == 0;
}

// A block's steps cut at its hideable all-to-alls: run `chunks[k]`, then `exchanges[k]` (the
// last chunk has none after it). An exchange takes the collectives right next to its all-to-all
// with it (the tensor-parallel all-gather after a dispatch, the reduce-scatter before a
// combine), as Megatron-Core's dispatch and combine nodes run them on the communication stream.
struct Cut {
  std::vector<std::vector<Step>> chunks{1};
  std::vector<std::vector<Step>> exchanges;
};

Cut cut(const BlockTemplate& t, uint8_t member) {
  Cut c;
  bool joining = false;  // the last exchange takes the collectives that follow it
  for (Step s : t.steps) {
    s.member = member;
    std::vector<Step>& chunk = c.chunks.back();
    if (hideable(s)) {
      std::vector<Step> exchange;
      while (!chunk.empty() && plain_collective(chunk.back())) {
        exchange.insert(exchange.begin(), chunk.back());
        chunk.pop_back();
      }
      exchange.push_back(s);
      c.exchanges.push_back(std::move(exchange));
      c.chunks.emplace_back();
      joining = true;
    } else if (joining && plain_collective(s)) {
      c.exchanges.back().push_back(s);
    } else {
      joining = false;
      chunk.push_back(s);
    }
  }
  return c;
}

// Megatron-Core's layer-by-layer order: the backward's first chunk (its combine's backward),
// then chunks alternate between the two blocks, each started once its own previous exchange is
// done, each exchange queued as soon as the chunk before it ends. So the forward's attention
// runs beside the backward's combine exchange, the backward's experts beside the forward's
// dispatch, and so on.
BlockTemplate merge(const BlockTemplate& forward, const BlockTemplate& backward) {
  BlockTemplate m;
  m.segment = forward.segment;
  m.lane = forward.lane;
  m.kind = forward.kind;
  m.paired = true;
  m.kept_bytes = forward.kept_bytes + backward.kept_bytes;
  const Cut cuts[2] = {cut(forward, 0), cut(backward, 1)};
  size_t next[2] = {0, 0};    // next chunk of each
  int pending[2] = {-1, -1};  // tag of each one's exchange in flight
  int tags = 0;
  // The forward keeps its activations as the backward frees its own, chunk by chunk (each
  // block's kept bytes spread evenly over its chunks): the pair's level above its start peaks
  // where the forward is furthest ahead. Transient buffers are the running operator's, and the
  // two blocks' operators take turns on the compute stream: the larger block's transient tops
  // that level.
  double level_peak = 0;
  auto level = [&] {
    double x = 0;
    for (int w : {0, 1}) {
      const BlockTemplate& t = w == 0 ? forward : backward;
      x += t.kept_bytes * static_cast<double>(next[w]) / static_cast<double>(cuts[w].chunks.size());
    }
    return x;
  };
  auto run_chunk = [&](int who) {
    const Cut& c = cuts[who];
    if (pending[who] >= 0) {
      // The stream runs in order: the exchange's last collective done, all of it is. The wait
      // is the all-to-all's (its label and group, for the breakdown).
      const std::vector<Step>& exchange = c.exchanges[next[who] - 1];
      Step w = *std::find_if(exchange.begin(), exchange.end(), hideable);
      w.kind = StepKind::kCommWait;
      w.tag = pending[who];
      m.steps.push_back(w);
      pending[who] = -1;
    }
    const std::vector<Step>& chunk = c.chunks[next[who]];
    m.steps.insert(m.steps.end(), chunk.begin(), chunk.end());
    if (next[who] < c.exchanges.size()) {
      for (Step l : c.exchanges[next[who]]) {
        l.kind = StepKind::kCommLaunch;
        l.tag = tags++;
        pending[who] = l.tag;
        m.steps.push_back(l);
      }
    }
    ++next[who];
    level_peak = std::max(level_peak, level());
  };
  int who = 1;  // the backward starts
  while (next[0] < cuts[0].chunks.size() || next[1] < cuts[1].chunks.size()) {
    if (next[who] < cuts[who].chunks.size()) run_chunk(who);
    who = 1 - who;
  }
  m.peak_bytes =
      level_peak + std::max({0.0, forward.peak_bytes - forward.kept_bytes, backward.peak_bytes});
  return m;
}

bool pairable(const Program& prog, const BlockInstance& a, const BlockInstance& b) {
  const Block& x = a.block;
  const Block& y = b.block;
  const bool forward_backward = (x.kind == BlockKind::kForward && y.kind == BlockKind::kBackward) ||
                                (x.kind == BlockKind::kBackward && y.kind == BlockKind::kForward);
  // A backward of the same micro-batch may need the forward's output (the last stage's pair).
  return forward_backward && x.micro_batch != y.micro_batch && x.pass == 0 && y.pass == 0 &&
         has_hideable(prog.templates[a.template_index]) &&
         has_hideable(prog.templates[b.template_index]);
}

// Whether every lane runs through its order when each pair is one unit that needs both
// blocks' inputs before it starts (a pair's template receives no later and sends no earlier
// than that), following the pipeline transfers its blocks receive. Returns, for a lane that
// stops, the position of the pair it stops at (-1 when it runs through).
std::vector<int> stuck_pairs(const Program& prog, const std::vector<std::vector<int>>& units) {
  // What a finished block has sent on: its forward output or its input gradient.
  auto provides = [](const Block& b) {
    const bool gradient = b.kind == BlockKind::kBackward || b.kind == BlockKind::kBackwardInput;
    return std::make_tuple(gradient, b.micro_batch, b.segment);
  };
  // What each template receives: (gradient, sending segment), once for all its blocks.
  std::vector<std::vector<std::pair<bool, int>>> receives(prog.templates.size());
  for (size_t t = 0; t < prog.templates.size(); ++t) {
    for (const Step& s : prog.templates[t].steps) {
      if (s.kind == StepKind::kRecv) receives[t].emplace_back(s.gradient, s.peer_segment);
    }
  }
  std::set<std::tuple<bool, int, int>> done;
  auto ready = [&](const BlockInstance& b) {
    for (const auto& [gradient, from] : receives[b.template_index]) {
      if (!done.count(std::make_tuple(gradient, b.block.micro_batch, from))) return false;
    }
    return true;
  };
  const size_t lanes = prog.lanes.size();
  std::vector<size_t> at(lanes, 0);  // next block of each lane
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t l = 0; l < lanes; ++l) {
      const std::vector<BlockInstance>& blocks = prog.lanes[l].blocks;
      while (at[l] < blocks.size()) {
        const int n = units[l][at[l]];  // blocks in the unit starting here
        bool go = true;
        for (int k = 0; k < n; ++k) go = go && ready(blocks[at[l] + k]);
        if (!go) break;
        for (int k = 0; k < n; ++k) done.insert(provides(blocks[at[l] + k].block));
        at[l] += n;
        progress = true;
      }
    }
  }
  std::vector<int> out(lanes, -1);
  for (size_t l = 0; l < lanes; ++l) {
    if (at[l] < prog.lanes[l].blocks.size() && units[l][at[l]] == 2) {
      out[l] = static_cast<int>(at[l]);
    }
  }
  return out;
}

}  // namespace

Status pair_blocks(Program& prog) {
  // Pairs come from the orders ("F3@0+B1@7", DualPipe's) and, with ep_overlap, from every
  // forward next to a backward of another micro-batch.
  const bool automatic = prog.plan.comm.ep_overlap;
  const std::string what =
      automatic ? "communication.ep_overlap" : "schedule.orders: the pairs (F+B)";
  if (prog.plan.comm.tp_sub_batches > 1) {
    return Error(fmt::format(
        "{}: overlaps the expert all-to-alls across micro-batches, which \"tp_sub_batches\" "
        "already sub-pipelines within one; use one of the two",
        what));
  }
  if (prog.plan.recycle > 1) {
    return Error(fmt::format(
        "{}: pairs a forward with a backward block, which repeated forwards (recycle > 1) do "
        "not run one after the other; remove one of the two",
        what));
  }
  // units[l][i]: 2 where blocks i and i + 1 pair, 1 where block i runs alone, 0 for a pair's
  // second block.
  std::vector<std::vector<int>> units;
  for (const Lane& lane : prog.lanes) {
    for (const BlockInstance& b : lane.blocks) {
      if (automatic && prog.lanes_of_segment[b.block.segment].size() > 1) {
        return Error(fmt::format(
            "communication.ep_overlap: segment '{}' spans several pipeline stages, whose "
            "blocks meet for their collectives and cannot pair; do not split the head or the "
            "embedding over the pipeline (--shard-head, --shard-embedding), or remove "
            "ep_overlap",
            prog.plan.segments[b.block.segment].name));
      }
    }
    std::vector<int> u(lane.blocks.size(), 1);
    for (size_t i = 0; i + 1 < lane.blocks.size(); ++i) {
      const bool given = lane.blocks[i].block.paired_with_next;
      if (given || (automatic && !lane.blocks[i + 1].block.paired_with_next &&
                    pairable(prog, lane.blocks[i], lane.blocks[i + 1]))) {
        u[i] = 2;
        u[++i] = 0;
      }
    }
    units.push_back(std::move(u));
  }
  // A pair can close a cycle through the pipeline that the blocks in sequence did not: plain
  // 1F1B's last stage pairs a backward with the next forward, whose input comes from the
  // previous stage's pair, which waits for that backward's gradient. Split such pairs, a
  // backward-first one before a forward-first one, until every lane runs through. The orders'
  // own pairs stay: the schedule check replayed them as units.
  while (true) {
    const std::vector<int> stuck = stuck_pairs(prog, units);
    int split = -1;  // lane
    for (size_t l = 0; l < stuck.size(); ++l) {
      if (stuck[l] < 0 || prog.lanes[l].blocks[stuck[l]].block.paired_with_next) continue;
      const bool backward_first = prog.lanes[l].blocks[stuck[l]].block.kind != BlockKind::kForward;
      if (split < 0 || backward_first) split = static_cast<int>(l);
      if (backward_first) break;
    }
    if (split < 0) break;  // runs through (the schedule check caught any other deadlock)
    units[split][stuck[split]] = 1;
    units[split][stuck[split] + 1] = 1;
  }
  std::map<std::pair<int, int>, int> merged;  // (forward, backward template) -> pair's template
  int pairs = 0;
  for (size_t l = 0; l < prog.lanes.size(); ++l) {
    Lane& lane = prog.lanes[l];
    std::vector<BlockInstance> out;
    for (size_t i = 0; i < lane.blocks.size(); ++i) {
      if (units[l][i] != 2) {
        out.push_back(lane.blocks[i]);
        continue;
      }
      const bool forward_first = lane.blocks[i].block.kind == BlockKind::kForward;
      const BlockInstance& f = lane.blocks[forward_first ? i : i + 1];
      const BlockInstance& b = lane.blocks[forward_first ? i + 1 : i];
      auto [it, fresh] = merged.try_emplace({f.template_index, b.template_index},
                                            static_cast<int>(prog.templates.size()));
      if (fresh) {
        prog.templates.push_back(
            merge(prog.templates[f.template_index], prog.templates[b.template_index]));
      }
      BlockInstance pair;
      pair.block = f.block;
      pair.block.paired_with_next = false;
      pair.template_index = it->second;
      pair.paired = true;
      pair.partner = b.block;
      pair.partner.paired_with_next = false;
      out.push_back(pair);
      ++pairs;
      ++i;
    }
    lane.blocks = std::move(out);
  }
  if (automatic && pairs == 0) {
    return Error(
        "communication.ep_overlap: no forward block sits next to a backward block of another "
        "micro-batch with expert all-to-alls in both, so nothing can overlap; it needs a "
        "mixture of experts whose experts are split over a mesh axis (expert parallelism), "
        "more than one micro-batch per replica and, with pipeline stages, an interleaved "
        "schedule (Megatron-Core's combined 1F1B requires virtual stages)");
  }
  return Status::Ok();
}

}  // namespace nnsim::detail
