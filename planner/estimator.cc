#include "planner/estimator.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include "core/collective.h"
#include "core/memory_check.h"

namespace nnsim {

namespace {

// A template reduced to what matters for timing: fixed delays between synchronization points.
struct Op {
  // kJoin: a collective joining the lanes of a spanning segment (a rendezvous).
  // kCommLaunch / kCommWait: a paired block's expert exchange on its own stream (each lane's
  // exchange at its time alone; the group's lanes run in step, so no rendezvous).
  // kCopyLaunch / kCopyWait: activation offloading's copies, on a stream each way.
  enum Kind {
    kDelay,
    kRecv,
    kSend,
    kDpLaunch,
    kDpWait,
    kJoin,
    kCommLaunch,
    kCommWait,
    kCopyLaunch,
    kCopyWait
  } kind = kDelay;
  double seconds = 0;  // kDelay: busy time; kSend / kDpLaunch / kJoin: communication time
  double compute = 0;  // kDelay: of which compute (the rest is blocking communication)
  int peer = -1;       // kRecv / kSend: the other segment
  int peer_lane = -1;  // kRecv / kSend: the sending / receiving lane
  bool gradient = false;
  bool recycle = false;   // kSend: to the next forward pass (repeated forwards)
  bool blocking = false;  // kSend: the sender waits for it (Step::blocking)
  int tag = -1;           // kDpLaunch / kDpWait
  int lanes = 1;          // kJoin: lanes that meet
  int sequence = 0;       // kJoin: rank among the block's joint collectives
  int member = 0;         // kRecv / kSend / kJoin: whose of a pair (Step::member)
  bool exchange = false;  // kCommLaunch: DeepEP's exchange (CollectiveKind::kExpertExchange)
  bool to_host = false;   // kCopyLaunch / kCopyWait: the stream to the host
  // kDelay: a blocking collective (with any compute it overlaps) as the simulator runs one that
  // shares its links: a stretch of its own, which communication beside it does not slow.
  bool collective = false;
};

class Estimator {
 public:
  explicit Estimator(const Program& p) : prog_(p), net_(p.topology) {}

  Estimate run();
  std::vector<TemplateTime> template_times();

 private:
  void map_segments();
  double collective_seconds(const Lane& lane, const Step& s);
  double transfer_seconds(const Lane& lane, const Step& s);
  const std::vector<Op>& ops(int lane, int template_index, const std::vector<Step>& steps);
  std::vector<Op> reduce(int lane, const std::vector<Step>& steps);

  const Program& prog_;
  Network net_;
  LinkLoadScratch scratch_;
  std::map<std::tuple<int, int>, std::vector<Op>> ops_;  // (lane, template)
  std::map<std::tuple<int, uint32_t, int, int, double>, double> collective_cache_;
  std::vector<int> lane_of_segment_;
  uint32_t cross_axes_ = 0;
};

double Estimator::collective_seconds(const Lane& lane, const Step& s) {
  auto key = std::make_tuple(s.group >= 0 ? -1 - s.group : 0, s.axes,
                             static_cast<int>(s.collective), lane.ranks.front(), s.bytes);
  auto it = collective_cache_.find(key);
  if (it != collective_cache_.end()) return it->second;
  std::vector<int> ranks = s.group >= 0 ? prog_.explicit_groups[s.group].front()
                                        : prog_.group_of(lane.ranks.front(), s.axes);
  std::vector<int> gpus;
  for (int r : ranks) gpus.push_back(prog_.gpu_of_rank[r]);
  CollectiveFlows c = decompose_collective(s.collective, gpus, s.bytes, prog_.algorithm, net_,
                                           prog_.comm_model, prog_.expert_routing);
  double t = isolated_seconds(c, net_, scratch_);
  collective_cache_.emplace(key, t);
  return t;
}

double Estimator::transfer_seconds(const Lane& lane, const Step& s) {
  const Lane& peer = prog_.lanes[s.peer_lane >= 0 ? s.peer_lane : lane_of_segment_[s.peer_segment]];
  CollectiveFlows c =
      decompose_transfer({lane.gpus.front()}, {peer.gpus.front()}, s.bytes, net_, prog_.comm_model);
  return isolated_seconds(c, net_, scratch_);
}

std::vector<Op> Estimator::reduce(int lane_index, const std::vector<Step>& steps) {
  const Lane& lane = prog_.lanes[lane_index];
  std::vector<Op> out;
  int joins[2] = {0, 0};
  auto delay = [&](double seconds, double compute) {
    if (out.empty() || out.back().kind != Op::kDelay || out.back().collective) out.push_back(Op{});
    out.back().seconds += seconds;
    out.back().compute += compute;
  };
  for (const Step& s : steps) {
    switch (s.kind) {
      case StepKind::kCompute:
        delay(s.seconds, s.seconds);
        break;
      case StepKind::kCollective: {
        const double comm = collective_seconds(lane, s);
        if (s.group < 0 && (s.axes & cross_axes_)) {
          Op o;
          o.kind = Op::kJoin;
          o.seconds = std::max(comm, s.seconds);
          o.compute = s.seconds;
          std::set<int> lanes;
          for (int r : prog_.group_of(lane.ranks.front(), s.axes)) {
            for (size_t l = 0; l < prog_.lanes.size(); ++l) {
              const auto& rk = prog_.lanes[l].ranks;
              if (std::find(rk.begin(), rk.end(), r) != rk.end()) lanes.insert(static_cast<int>(l));
            }
          }
          o.lanes = static_cast<int>(lanes.size());
          o.member = s.member;
          o.sequence = joins[s.member]++;
          out.push_back(o);
          break;
        }
        Op o;
        o.seconds = std::max(comm, s.seconds);
        o.compute = s.seconds;
        o.collective = true;
        out.push_back(o);
        break;
      }
      case StepKind::kRecv: {
        Op o;
        o.kind = Op::kRecv;
        o.member = s.member;
        o.peer = s.peer_segment;
        o.peer_lane = s.peer_lane;
        o.gradient = s.gradient;
        out.push_back(o);
        break;
      }
      case StepKind::kSend: {
        Op o;
        o.kind = Op::kSend;
        o.member = s.member;
        o.peer = s.peer_segment;
        o.peer_lane = s.peer_lane;
        o.gradient = s.gradient;
        o.recycle = s.recycle;
        o.blocking = s.blocking;
        o.seconds = transfer_seconds(lane, s);
        out.push_back(o);
        break;
      }
      case StepKind::kDpLaunch:
      case StepKind::kCommLaunch: {
        Op o;
        o.kind = s.kind == StepKind::kDpLaunch ? Op::kDpLaunch : Op::kCommLaunch;
        o.seconds = collective_seconds(lane, s) + s.host_seconds;
        o.exchange = s.collective == CollectiveKind::kExpertExchange;
        o.tag = s.tag;
        out.push_back(o);
        break;
      }
      case StepKind::kDpWait:
      case StepKind::kCommWait: {
        Op o;
        o.kind = s.kind == StepKind::kDpWait ? Op::kDpWait : Op::kCommWait;
        o.tag = s.tag;
        out.push_back(o);
        break;
      }
      case StepKind::kHostCopyLaunch:
      case StepKind::kHostCopyWait: {
        Op o;
        o.kind = s.kind == StepKind::kHostCopyLaunch ? Op::kCopyLaunch : Op::kCopyWait;
        o.seconds = s.seconds;
        o.to_host = s.to_host;
        o.tag = s.tag;
        out.push_back(o);
        break;
      }
      case StepKind::kMemory:
        break;
    }
  }
  return out;
}

const std::vector<Op>& Estimator::ops(int lane, int template_index,
                                      const std::vector<Step>& steps) {
  auto key = std::make_tuple(lane, template_index);
  auto it = ops_.find(key);
  if (it != ops_.end()) return it->second;
  return ops_.emplace(key, reduce(lane, steps)).first->second;
}

void Estimator::map_segments() {
  lane_of_segment_.assign(prog_.plan.segments.size(), 0);
  for (size_t l = prog_.lanes.size(); l-- > 0;) {
    for (const auto& b : prog_.lanes[l].blocks) lane_of_segment_[b.block.segment] = l;
  }
  const int dp_axis = prog_.plan.mesh.axis_index(kDataParallelAxis);
  cross_axes_ = 0;
  for (size_t a = 0; a < prog_.plan.mesh.axes.size(); ++a) {
    if (static_cast<int>(a) != dp_axis && !(prog_.lane_axes & (1u << a)) &&
        prog_.plan.mesh.axes[a].size > 1) {
      cross_axes_ |= 1u << a;
    }
  }
}

std::vector<TemplateTime> Estimator::template_times() {
  map_segments();
  auto labels_of = [&](const GraphPart& part) {
    std::set<int> out;
    for (const auto& op : part.ops) {
      for (size_t i = 0; i < prog_.labels.size(); ++i) {
        if (prog_.labels[i] == op.name) out.insert(static_cast<int>(i));
      }
    }
    return out;
  };
  const size_t shapes = prog_.graph.blocks.size();
  std::set<int> layer_labels;
  std::map<int, int> only_shape;  // label -> the one shape that has it (-1: several)
  for (size_t b = 0; b < shapes; ++b) {
    for (int label : labels_of(prog_.graph.blocks[b])) {
      layer_labels.insert(label);
      const auto [it, inserted] = only_shape.emplace(label, static_cast<int>(b));
      if (!inserted) it->second = -1;
    }
  }
  std::vector<TemplateTime> out(prog_.templates.size());
  for (size_t t = 0; t < prog_.templates.size(); ++t) {
    if (shapes > 1) out[t].block_only.assign(shapes, 0);
    const BlockTemplate& tpl = prog_.templates[t];
    const Lane& lane = prog_.lanes[tpl.lane];
    for (const Step& s : tpl.steps) {
      if (s.kind == StepKind::kSend) {
        out[t].sends.emplace_back(s.peer_segment, transfer_seconds(lane, s));
        continue;
      }
      double busy = 0;
      if (s.kind == StepKind::kCompute) busy = s.seconds;
      if (s.kind == StepKind::kCollective) busy = std::max(collective_seconds(lane, s), s.seconds);
      if (s.kind == StepKind::kCommLaunch) busy = collective_seconds(lane, s);
      if (busy == 0) continue;
      if (!layer_labels.count(s.label)) {
        out[t].other += busy;
        continue;
      }
      if (s.compute_class == ComputeClass::kRecompute) {
        out[t].layers_recompute += busy;
      } else {
        out[t].layers += busy;
      }
      if (shapes > 1 && only_shape[s.label] >= 0) out[t].block_only[only_shape[s.label]] += busy;
    }
  }
  return out;
}

Estimate Estimator::run() {
  const size_t lanes = prog_.lanes.size();
  map_segments();
  struct LaneState {
    double time = 0;
    double compute = 0;
    double dp_free = 0;                // when the data-parallel stream is next free
    double dp_last = 0;                // when the last launched item ends
    std::map<int, double> tag_done;    // tag -> when its last launch ends
    double comm_free = 0;              // when the expert communication stream is next free
    double exchange_free = 0;          // when its last DeepEP exchange ends
    std::map<int, double> comm_done;   // a pair's exchange tag -> when it ends
    std::vector<double> copy_done[2];  // when each copy ([1]: to the host) ends, in order
    size_t block = 0;                  // next block (lanes' prologue is block "-1")
    size_t op = 0;                     // next op within it
    int phase = 0;                     // 0 prologue, 1 blocks, 2 epilogue, 3 done
  };
  std::vector<LaneState> st(lanes);
  // Arrival time of transfers by (from, to, gradient, micro-batch, receiving lane, receiving
  // block's forward pass).
  std::map<std::tuple<int, int, bool, int, int, int>, double> arrival;
  // Joint collectives of spanning segments by (segment, kind and forward pass, micro-batch,
  // sequence): the lanes that have arrived and the latest arrival.
  struct Join {
    std::set<int> arrived;
    double last = 0;
  };
  std::map<std::tuple<int, int, int, int>, Join> joins;

  auto current_ops = [&](size_t l) -> const std::vector<Op>* {
    const Lane& lane = prog_.lanes[l];
    LaneState& s = st[l];
    if (s.phase == 0) return &ops(static_cast<int>(l), -1, lane.prologue);
    if (s.phase == 1) {
      const BlockInstance& b = lane.blocks[s.block];
      return &ops(static_cast<int>(l), b.template_index, prog_.templates[b.template_index].steps);
    }
    return &ops(static_cast<int>(l), -2, lane.epilogue);
  };
  auto advance_phase = [&](LaneState& s, const Lane& lane) {
    s.op = 0;
    if (s.phase == 0) {
      s.phase = lane.blocks.empty() ? 2 : 1;
    } else if (s.phase == 1) {
      if (++s.block >= lane.blocks.size()) s.phase = 2;
    } else {
      s.phase = 3;
    }
  };

  size_t done = 0;
  bool progress = true;
  while (done < lanes && progress) {
    progress = false;
    for (size_t l = 0; l < lanes; ++l) {
      LaneState& s = st[l];
      const Lane& lane = prog_.lanes[l];
      while (s.phase < 3) {
        const std::vector<Op>& list = *current_ops(l);
        // The block (a pair's two, by Op::member) the ops belong to.
        Block own[2];
        own[0].segment = -1;
        if (s.phase == 1) {
          own[0] = lane.blocks[s.block].block;
          own[1] = lane.blocks[s.block].partner;
        }
        bool blocked = false;
        const size_t op_before = s.op;
        for (; s.op < list.size(); ++s.op) {
          const Op& o = list[s.op];
          const Block& b = own[o.member];
          const int segment = b.segment;
          const int mb = b.micro_batch;
          const int pass = b.pass;
          const int kind = s.phase == 1 ? static_cast<int>(b.kind) + 8 * pass : -1;
          if (o.kind == Op::kDelay) {
            // Compute shares the GPU with communication still running: the data-parallel stream,
            // a pair's exchanges (as in the simulator, decided at the start of the stretch).
            const double interference =
                o.collective               ? 0
                : s.exchange_free > s.time ? interference_beside(prog_.compute_model, true)
                : s.dp_last > s.time || s.comm_free > s.time ? prog_.compute_model.comm_interference
                                                             : 0;
            const double slowdown = o.compute * interference;
            s.time += o.seconds + slowdown;
            s.compute += o.compute + slowdown;
          } else if (o.kind == Op::kRecv) {
            auto it = arrival.find({o.peer, segment, o.gradient, mb, static_cast<int>(l), pass});
            if (it == arrival.end()) {
              blocked = true;
              break;
            }
            s.time = std::max(s.time, it->second);
          } else if (o.kind == Op::kSend) {
            const double end = s.time + o.seconds;
            arrival[{segment, o.peer, o.gradient, mb, o.peer_lane, pass + (o.recycle ? 1 : 0)}] =
                end;
            if (o.blocking) s.time = end;
          } else if (o.kind == Op::kJoin) {
            // Starts when the last lane arrives (the simulator's rendezvous).
            Join& j = joins[{segment, kind, mb, o.sequence}];
            if (j.arrived.insert(static_cast<int>(l)).second) j.last = std::max(j.last, s.time);
            if (static_cast<int>(j.arrived.size()) < o.lanes) {
              blocked = true;
              break;
            }
            s.time = j.last + o.seconds;
            s.compute += o.compute;
          } else if (o.kind == Op::kCommLaunch) {
            s.comm_free = std::max(s.comm_free, s.time) + o.seconds;
            s.comm_done[o.tag] = s.comm_free;
            if (o.exchange) s.exchange_free = s.comm_free;
          } else if (o.kind == Op::kCommWait) {
            s.time = std::max(s.time, s.comm_done.at(o.tag));
          } else if (o.kind == Op::kCopyLaunch) {
            std::vector<double>& done = s.copy_done[o.to_host ? 1 : 0];
            double start = std::max(done.empty() ? 0.0 : done.back(), s.time);
            // A copy back waits for the copies to the host before it (the simulator's rule).
            const std::vector<double>& out = s.copy_done[1];
            if (!o.to_host && !out.empty()) start = std::max(start, out.back());
            done.push_back(start + o.seconds);
          } else if (o.kind == Op::kCopyWait) {
            // Every copy but the last `tag` (-1: every one).
            const std::vector<double>& done = s.copy_done[o.to_host ? 1 : 0];
            const size_t still = o.tag > 0 ? static_cast<size_t>(o.tag) : 0;
            if (done.size() > still) s.time = std::max(s.time, done[done.size() - 1 - still]);
          } else if (o.kind == Op::kDpLaunch) {
            s.dp_free = std::max(s.dp_free, s.time) + o.seconds;
            s.dp_last = s.dp_free;
            if (o.tag >= 0) s.tag_done[o.tag] = s.dp_free;
          } else {
            double until = s.dp_last;
            if (o.tag >= 0) {
              auto it = s.tag_done.find(o.tag);
              until = it == s.tag_done.end() ? s.time : it->second;
            }
            s.time = std::max(s.time, until);
          }
        }
        if (blocked) {
          progress = progress || s.op != op_before;  // passing a rendezvous frees others
          break;
        }
        advance_phase(s, lane);
        progress = true;
        if (s.phase == 3) ++done;
      }
    }
  }

  Estimate e;
  size_t busiest = 0;
  for (size_t l = 0; l < lanes; ++l) {
    e.iteration_time = std::max(e.iteration_time, st[l].time);
    if (st[l].compute > st[busiest].compute) busiest = l;
  }
  e.compute = st[busiest].compute;
  for (size_t l = 0; l < lanes; ++l) {
    // Idle = not computing and not blocked on communication we can attribute: approximate the
    // bubble by the time a lane is neither computing nor was it the last to finish.
    const double idle = e.iteration_time - st[l].compute;
    e.bubble_fraction = std::max(e.bubble_fraction, idle / e.iteration_time);
  }
  e.exposed_comm = std::max(0.0, st[busiest].time - st[busiest].compute);
  e.bubble = e.iteration_time - st[busiest].time;
  for (const auto& p : lane_memory_peaks(prog_)) e.peak_memory = std::max(e.peak_memory, p.peak);
  const double peak = prog_.topology.gpu.peak_flops(prog_.plan.precision);
  if (e.iteration_time > 0 && peak > 0) {
    e.mfu = prog_.model_flops_per_iteration / e.iteration_time /
            static_cast<double>(prog_.gpu_of_rank.size()) / peak;
  }
  return e;
}

}  // namespace

Estimate estimate_program(const Program& program) {
  return Estimator(program).run();
}

std::vector<TemplateTime> template_times(const Program& program) {
  return Estimator(program).template_times();
}

}  // namespace nnsim
