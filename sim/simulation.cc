#include "sim/simulation.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>

#include <fmt/format.h>
#include <xbt/log.h>

#include "sim/platform.h"
#include "sim/wait.h"

namespace nnsim {

namespace sg4 = simgrid::s4u;

namespace {

double wall_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Simulation::Simulation(const Program& program, const SimOptions& options)
    : prog_(program), options_(options) {}

std::string Simulation::exposed_key(uint32_t axes) const {
  return prog_.axes_name(axes);
}

void Simulation::record(const Instance& inst, Stream stream, TaskKind kind, double start,
                        double end, int label, int block, double bytes, double flops,
                        uint32_t axes) {
  if (!options_.record_tasks || inst.replica != 0) return;
  TaskRecord r;
  r.lane = inst.lane;
  r.stream = stream;
  r.kind = kind;
  r.start = start;
  r.end = end;
  r.label = label;
  r.block = block;
  r.bytes = bytes;
  r.flops = flops;
  r.memory = inst.memory_level;
  r.axes = axes;
  tasks_.push_back(r);
}

void Simulation::block_done() {
  ++blocks_done_;
  if (!options_.progress) return;
  double now = wall_now();
  if (now - last_progress_wall_ >= 0.2 || blocks_done_ == blocks_total_) {
    last_progress_wall_ = now;
    options_.progress(static_cast<double>(blocks_done_) / static_cast<double>(blocks_total_));
  }
}

// Consecutive compute steps (and folded collectives) run as one wait; the breakdown and the
// records keep every step.
void Simulation::flush_compute(Instance& inst, int block) {
  PendingCompute& p = pending_[&inst];
  if (p.parts.empty()) return;
  if (p.seconds > 0) {
    // Collectives running on this GPU meanwhile (the data-parallel stream, a pair's expert
    // exchanges) take SMs and memory bandwidth from the compute, DeepEP's exchange SMs of its
    // own (interference_beside); a pipeline send's few channels are not counted.
    const bool comm_busy = inst.dp.busy() || inst.ep.busy();
    const double interference =
        !comm_busy ? 0 : interference_beside(prog_.compute_model, inst.exchanges_in_flight > 0);
    const double slowdown = p.compute_seconds * interference;
    inst.breakdown.compute += slowdown;
    wait_for(p.seconds + slowdown);
    ++activities_;
  }
  if (options_.record_tasks && inst.replica == 0) {
    for (const auto& part : p.parts) {
      const Step& step = *part.step;
      TaskKind kind = step.compute_class == ComputeClass::kRecompute   ? TaskKind::kRecompute
                      : step.compute_class == ComputeClass::kOptimizer ? TaskKind::kOptimizer
                                                                       : TaskKind::kCompute;
      const double start = p.start + part.offset;
      if (!part.collective) {
        record(inst, Stream::kCompute, kind, start, start + part.seconds, step.label, block, 0,
               step.flops, 0);
        continue;
      }
      if (step.seconds > 0) {
        record(inst, Stream::kCompute, kind, start, start + step.seconds, step.label, block, 0,
               step.flops, 0);
      }
      record(inst, Stream::kCompute, TaskKind::kCollective, start, start + part.seconds, step.label,
             block, step.bytes, 0, step.axes);
    }
  }
  p.parts.clear();
  p.seconds = 0;
  p.compute_seconds = 0;
}

void Simulation::analyze_links() {
  link_user_.assign(net_->links().size(), -1);
  link_shared_.assign(net_->links().size(), false);
  // A user is one stream's communication over one set of GPUs: a stream runs its collectives
  // one after another, so they never contend with each other; different streams may overlap.
  auto use = [&](const PreparedComm& c, int stream) {
    std::vector<int> key = c.gpus;
    key.insert(key.begin(), stream);
    int id = user_ids_.emplace(key, static_cast<int>(user_ids_.size())).first->second;
    for (int l : c.links) {
      if (link_user_[l] < 0) {
        link_user_[l] = id;
      } else if (link_user_[l] != id) {
        link_shared_[l] = true;
      }
    }
  };
  // Each lane's per-rank collectives, and what crosses their links (lane_mirror.h).
  std::vector<std::vector<PerRankStep>> per_rank(instances_.size());
  std::map<const PreparedComm*, int> comm_ids;
  auto comm_id = [&](const PreparedComm& c) {
    return comm_ids.emplace(&c, static_cast<int>(comm_ids.size())).first->second;
  };
  std::set<std::pair<const PreparedComm*, LinkUse>> crossings;  // (communication, its use)
  for (size_t i = 0; i < instances_.size(); ++i) {
    Instance& inst = *instances_[i];
    const int index = static_cast<int>(i);
    const Lane& lane = prog_.lanes[inst.lane];
    auto visit = [&](const std::vector<Step>& steps) {
      for (const Step& step : steps) {
        if (step.kind == StepKind::kSend) {
          const PreparedComm& c = prepared_transfer(inst, step);
          use(c, step.gradient ? -4 : -3);
          crossings.insert({&c, {index, comm_id(c)}});
          continue;
        }
        // A host copy, on a copy stream of its own or beside a data-parallel collective.
        const bool offload = step.kind == StepKind::kHostCopyLaunch;
        if (offload || (step.kind == StepKind::kDpLaunch && step.host_bytes > 0)) {
          const bool to_host =
              offload ? step.to_host : step.collective != CollectiveKind::kAllGather;
          const double bytes = offload ? step.bytes : step.host_bytes;
          const PreparedComm& c = prepared_comm(to_host ? -3 : -2, bytes, {inst.gpus});
          inst.host_copies[&step] = &c;
          use(c, offload ? (to_host ? -6 : -7) : -8);
          crossings.insert({&c, {index, comm_id(c)}});
          if (offload) continue;
        }
        if (step.kind != StepKind::kCollective && step.kind != StepKind::kDpLaunch &&
            step.kind != StepKind::kCommLaunch) {
          continue;
        }
        std::vector<std::vector<int>> groups = collective_groups(inst, step);
        const bool one_per_rank = options_.mirror_lane_ranks && step.group < 0 &&
                                  groups.size() > 1 && groups.size() == inst.ranks.size() &&
                                  participants(inst, step) == 1;
        std::vector<std::vector<int>> copy =
            one_per_rank ? groups : std::vector<std::vector<int>>{};
        const PreparedComm& whole =
            prepared_comm(static_cast<int>(step.collective), step.bytes, std::move(groups));
        inst.whole[&step] = &whole;
        inst.prepared[&step] = &whole;
        use(whole, step.kind == StepKind::kCollective ? -1
                   : step.kind == StepKind::kDpLaunch ? -2
                                                      : -5);
        if (!one_per_rank) {
          crossings.insert({&whole, {index, comm_id(whole)}});
          continue;
        }
        PerRankCollective c{comm_id(whole), {}};
        for (std::vector<int>& g : copy) {
          const PreparedComm& alone =
              prepared_comm(static_cast<int>(step.collective), step.bytes, {std::move(g)});
          crossings.insert({&alone, {index, c.comm, static_cast<int>(c.groups.size())}});
          c.groups.push_back(&alone);
        }
        per_rank[i].emplace_back(&step, std::move(c));
      }
    };
    visit(lane.prologue);
    visit(lane.epilogue);
    std::set<int> templates;
    for (const auto& b : lane.blocks) templates.insert(b.template_index);
    for (int t : templates) visit(prog_.templates[t].steps);
  }
  mirror_lanes(per_rank, crossings);
}

void Simulation::mirror_lanes(const std::vector<std::vector<PerRankStep>>& per_rank,
                              const std::set<std::pair<const PreparedComm*, LinkUse>>& crossings) {
  // Only the per-rank groups' links matter to the mirror check.
  std::vector<bool> relevant(net_->links().size(), false);
  for (const auto& collectives : per_rank) {
    for (const auto& [step, c] : collectives) {
      for (const PreparedComm* g : c.groups) {
        for (int l : g->links) relevant[l] = true;
      }
    }
  }
  if (std::find(relevant.begin(), relevant.end(), true) == relevant.end()) return;
  LinkUses uses(net_->links().size());
  for (const auto& [comm, u] : crossings) uses.add(*comm, u, relevant);
  uses.sort_all();
  std::vector<std::vector<PerRankCollective>> collectives(instances_.size());
  for (size_t i = 0; i < instances_.size(); ++i) {
    for (const auto& [step, c] : per_rank[i]) collectives[i].push_back(c);
  }
  const std::vector<bool> mirror = lanes_mirroring_first_rank(collectives, *net_, uses);
  for (size_t i = 0; i < instances_.size(); ++i) {
    if (!mirror[i]) continue;
    for (const auto& [step, c] : per_rank[i]) instances_[i]->prepared[step] = c.groups.front();
  }
}

bool Simulation::foldable(const Instance& inst, const Step& step) const {
  if (!fold_ || participants(inst, step) > 1) return false;
  const PreparedComm& c = *inst.whole.at(&step);
  for (int l : c.links) {
    if (link_shared_[l]) return false;
  }
  return true;
}

int Simulation::participants(const Instance& inst, const Step& step) const {
  if (step.group >= 0) return 2;
  if (step.axes & cross_axes_) {
    auto [it, fresh] = lanes_reached_.try_emplace({inst.lane, step.axes}, 0);
    if (fresh) {
      std::set<int> lanes;
      for (int r : prog_.group_of(prog_.lanes[inst.lane].ranks.front(), step.axes)) {
        lanes.insert(lane_of_rank_[prog_.rank_in_replica(r, 0)]);
      }
      it->second = static_cast<int>(lanes.size());
    }
    return it->second;
  }
  // Collectives along axes outside the lane join the instances of other replicas when those are
  // simulated too.
  const int dp_axis = prog_.plan.mesh.axis_index(kDataParallelAxis);
  if (options_.fidelity == Fidelity::kFull && (step.axes & (1u << dp_axis))) {
    return prog_.replicas;
  }
  return 1;
}

const PreparedComm& Simulation::prepared_collective(const Instance& inst, const Step& step) const {
  return *inst.prepared.at(&step);  // analyze_links prepared every step
}

std::vector<std::vector<int>> Simulation::collective_groups(const Instance& inst,
                                                            const Step& step) const {
  std::vector<std::vector<int>> groups;
  if (step.group >= 0) {
    for (const auto& ranks : prog_.explicit_groups[step.group]) {
      std::vector<int> g;
      for (int r : ranks) g.push_back(prog_.gpu_of_rank[prog_.rank_in_replica(r, inst.replica)]);
      groups.push_back(g);
    }
    return groups;
  }
  // One group per lane rank, in the lane's order, unless the axes join them.
  std::set<std::vector<int>> seen;
  for (int r : inst.ranks) {
    std::vector<int> ranks = prog_.group_of(r, step.axes);
    if (!seen.insert(ranks).second) continue;
    std::vector<int> g;
    for (int x : ranks) g.push_back(prog_.gpu_of_rank[x]);
    groups.push_back(g);
  }
  return groups;
}

const PreparedComm& Simulation::prepared_comm(int kind, double bytes,
                                              std::vector<std::vector<int>> groups) {
  // Identical communication (same groups, kind and size) is prepared once for all steps and
  // instances that run it.
  auto key = std::make_tuple(kind, bytes, std::move(groups));
  auto shared = prepared_cache_.find(key);
  if (shared == prepared_cache_.end()) {
    const bool to_host = kind == -3;
    PreparedComm c =
        kind >= 0
            ? runner_->prepare(std::get<2>(key), static_cast<CollectiveKind>(kind), bytes)
            : runner_->prepare_host_copy(std::get<2>(key).front(), bytes, to_host,
                                         to_host ? prog_.compute_model.device_to_host_efficiency
                                                 : prog_.compute_model.host_to_device_efficiency);
    shared = prepared_cache_.emplace(std::move(key), std::move(c)).first;
  }
  return shared->second;
}

double Simulation::joint_collective(Instance& inst, const PreparedComm& comm,
                                    const RendezvousKey& key, int n, double overlap) {
  if (n <= 1) {
    const double start = sg4::Engine::get_clock();
    activities_ += runner_->run(comm, overlap);
    return start;
  }
  Rendezvous& rv = rendezvous_[key];
  if (!rv.release) {
    rv.release = sg4::Semaphore::create(0);
    rv.start = std::make_shared<double>(0);
  }
  if (++rv.arrived < n) {
    sg4::SemaphorePtr release = rv.release;
    std::shared_ptr<double> start = rv.start;
    release->acquire();
    return *start;
  }
  // The last to arrive starts it: until then the others were waiting on their peers.
  sg4::SemaphorePtr release = rv.release;
  std::shared_ptr<double> start = rv.start;
  rendezvous_.erase(key);
  *start = sg4::Engine::get_clock();
  activities_ += runner_->run(comm, overlap);
  for (int i = 1; i < n; ++i) release->release();
  return *start;
}

Simulation::RendezvousKey Simulation::rendezvous_key(Instance& inst, const Step& step) {
  // Instances joining one collective meet under the same key: each counts its joint
  // collectives in program order, which is the same on every participant. The lanes of a
  // spanning segment, or of an expert-parallel group, meet by block and by the collective's
  // rank among the block's joint ones (their templates differ only in transfers).
  if (step.group >= 0) return {-1 - step.group, inst.replica, inst.explicit_sequence++, 0, 0};
  if (step.axes & cross_axes_) {
    Instance::BlockContext& b = inst.running[step.member];
    return {-(1 << 24) - b.segment, b.kind * (1 << 20) + b.micro_batch, b.cross_sequence++,
            inst.replica, 1 + b.pass};
  }
  return {inst.lane, 2 << 20, inst.joint_sequence++, 0, 0};
}

void Simulation::run_collective(Instance& inst, const Step& step, int block) {
  const PreparedComm& comm = prepared_collective(inst, step);
  if (foldable(inst, step)) {
    // Nothing else ever crosses its links: its time alone is its time, so it joins the
    // compute stream's pending wait.
    PendingCompute& p = pending_[&inst];
    if (p.parts.empty()) p.start = sg4::Engine::get_clock();
    const double seconds = comm.alone_with_overlap(step.seconds);
    p.parts.push_back({&step, p.seconds, seconds, true});
    p.seconds += seconds;
    p.compute_seconds += step.seconds;  // the operator's compute overlapped with it
    if (step.seconds > 0) {
      (step.compute_class == ComputeClass::kRecompute ? inst.breakdown.recompute
                                                      : inst.breakdown.compute) += step.seconds;
    }
    const double exposed = seconds - step.seconds;
    if (exposed > 0) inst.breakdown.exposed_comm[exposed_key(step.axes)] += exposed;
    return;
  }
  flush_compute(inst, block);
  const int n = participants(inst, step);
  const RendezvousKey key = rendezvous_key(inst, step);
  // Time spent waiting for the other participants to arrive is not communication.
  const double t0 = joint_collective(inst, comm, key, n, step.seconds);
  const double t1 = sg4::Engine::get_clock();
  const std::string group = step.group >= 0 ? "pp" : exposed_key(step.axes);
  double exposed = t1 - t0 - step.seconds;
  if (step.seconds > 0) {
    // Communication overlapped with this operator's compute: the compute counts as compute.
    (step.compute_class == ComputeClass::kRecompute ? inst.breakdown.recompute
                                                    : inst.breakdown.compute) += step.seconds;
    record(
        inst, Stream::kCompute,
        step.compute_class == ComputeClass::kRecompute ? TaskKind::kRecompute : TaskKind::kCompute,
        t0, t0 + step.seconds, step.label, block, 0, step.flops, 0);
  }
  if (exposed > 0) inst.breakdown.exposed_comm[group] += exposed;
  record(inst, Stream::kCompute, TaskKind::kCollective, t0, t1, step.label, block, step.bytes, 0,
         step.axes);
}

const PreparedComm& Simulation::prepared_transfer(Instance& inst, const Step& step) {
  auto it = inst.prepared.find(&step);
  if (it != inst.prepared.end()) return *it->second;
  const Instance& peer =
      *instances_[static_cast<size_t>(inst.replica) * prog_.lanes.size() + step.peer_lane];
  auto key = std::make_tuple(-1, step.bytes, std::vector<std::vector<int>>{inst.gpus, peer.gpus});
  auto shared = prepared_cache_.find(key);
  if (shared == prepared_cache_.end()) {
    PreparedComm c = runner_->prepare_transfer(inst.gpus, peer.gpus, step.bytes);
    shared = prepared_cache_.emplace(std::move(key), std::move(c)).first;
  }
  return *inst.prepared.emplace(&step, &shared->second).first->second;
}

void Simulation::send(Instance& inst, const Step& step, int block) {
  flush_compute(inst, block);
  const Instance::BlockContext& b = inst.running[step.member];
  // A recycled output goes to the next pass's forward.
  TransferKey key{b.segment,
                  step.peer_segment,
                  step.gradient,
                  b.micro_batch,
                  inst.replica,
                  step.peer_lane,
                  b.pass + (step.recycle ? 1 : 0)};
  Transfer& t = transfers_[key];
  if (!t.arrived) t.arrived = sg4::Semaphore::create(0);
  const double now = sg4::Engine::get_clock();
  t.posted = now;
  // The transfer runs on the sender's send stream for its direction, after the sends before it.
  const int direction = step.gradient ? 1 : 0;
  sg4::SemaphorePtr done = step.blocking ? sg4::Semaphore::create(0) : nullptr;
  inst.send_queue[direction].push_back(
      {&prepared_transfer(inst, step), t.arrived, &step, block, now, done});
  inst.send_pending[direction]->release();
  if (!done) return;
  // Megatron waits on its batched p2p requests before the next block: the transfer's time is
  // the sender's too.
  done->acquire();
  const double t1 = sg4::Engine::get_clock();
  if (t1 > now) {
    inst.breakdown.exposed_comm["pp"] += t1 - now;
    record(inst, Stream::kCompute, TaskKind::kSendWait, now, t1, step.label, block, step.bytes, 0,
           0);
  }
}

void Simulation::send_stream_actor(Instance& inst, int direction) {
  sg4::Actor::self()->daemonize();
  while (true) {
    inst.send_pending[direction]->acquire();
    Instance::SendItem item = inst.send_queue[direction].front();
    inst.send_queue[direction].pop_front();
    const double t0 = sg4::Engine::get_clock();
    activities_ += runner_->run(*item.comm);
    record(inst, Stream::kPipelineSend, TaskKind::kTransfer, t0, sg4::Engine::get_clock(),
           item.step->label, item.block, item.step->bytes, 0, 0);
    item.arrived->release();
    if (item.done) item.done->release();
  }
}

void Simulation::recv(Instance& inst, const Step& step, int block) {
  flush_compute(inst, block);
  const Instance::BlockContext& b = inst.running[step.member];
  TransferKey key{step.peer_segment, b.segment, step.gradient, b.micro_batch,
                  inst.replica,      inst.lane, b.pass};
  Transfer& t = transfers_[key];
  if (!t.arrived) t.arrived = sg4::Semaphore::create(0);
  sg4::SemaphorePtr arrived = t.arrived;
  const double t0 = sg4::Engine::get_clock();
  arrived->acquire();
  const double t1 = sg4::Engine::get_clock();
  const double posted = transfers_[key].posted;
  transfers_.erase(key);
  // Waiting for the producer to finish is bubble; waiting for the bytes is exposed transfer.
  const double ready = std::max(t0, std::min(posted, t1));
  inst.breakdown.bubble += ready - t0;
  if (t1 > ready) inst.breakdown.exposed_comm["pp"] += t1 - ready;
  if (t1 > t0) {
    record(inst, Stream::kCompute, TaskKind::kRecvWait, t0, t1, step.label, block, step.bytes, 0,
           0);
  }
}

void Simulation::dp_wait(Instance& inst, const Step& step, int block) {
  flush_compute(inst, block);
  int target = inst.dp.launched;
  if (step.tag >= 0) {
    auto it = inst.dp.tag_seq.find(step.tag);
    target = it == inst.dp.tag_seq.end() ? 0 : it->second;
  }
  const double t0 = sg4::Engine::get_clock();
  inst.dp.wait_until(target);
  const double t1 = sg4::Engine::get_clock();
  if (t1 > t0) {
    uint32_t axes = inst.dp_seq_axes.count(target) ? inst.dp_seq_axes[target] : 0;
    inst.breakdown.exposed_comm[exposed_key(axes)] += t1 - t0;
    record(inst, Stream::kCompute, TaskKind::kDpWait, t0, t1, step.label, block, 0, 0, axes);
  }
}

void Simulation::comm_wait(Instance& inst, const Step& step, int block) {
  flush_compute(inst, block);
  const int target = inst.ep.tag_seq.at(step.tag);
  const double t0 = sg4::Engine::get_clock();
  inst.ep.wait_until(target);
  const double t1 = sg4::Engine::get_clock();
  if (t1 > t0) {
    inst.breakdown.exposed_comm[exposed_key(step.axes)] += t1 - t0;
    record(inst, Stream::kCompute, TaskKind::kCommWait, t0, t1, step.label, block, step.bytes, 0,
           step.axes);
  }
}

// The compute stream waits for every copy queued on the stream so far (Transformer Engine's
// wait_stream), or all but the last `tag` (fine-grained offloading's groups still on their
// way); the wait is exposed offloading, counted with the exposed communication.
void Simulation::host_copy_wait(Instance& inst, const Step& step, int block) {
  flush_compute(inst, block);
  auto& stream = inst.host_copy[step.to_host ? 1 : 0];
  const double t0 = sg4::Engine::get_clock();
  stream.wait_until(step.tag >= 0 ? stream.launched - step.tag : stream.launched);
  const double t1 = sg4::Engine::get_clock();
  if (t1 > t0) {
    inst.breakdown.exposed_comm["offload"] += t1 - t0;
    record(inst, Stream::kCompute, TaskKind::kHostCopyWait, t0, t1, step.label, block, 0, 0, 0);
  }
}

void Simulation::run_steps(Instance& inst, const std::vector<Step>& steps, int block) {
  PendingCompute& p = pending_[&inst];
  for (const Step& step : steps) {
    switch (step.kind) {
      case StepKind::kCompute: {
        if (p.parts.empty()) p.start = sg4::Engine::get_clock();
        p.parts.push_back({&step, p.seconds, step.seconds, false});
        p.seconds += step.seconds;
        p.compute_seconds += step.seconds;
        switch (step.compute_class) {
          case ComputeClass::kCompute:
            inst.breakdown.compute += step.seconds;
            break;
          case ComputeClass::kRecompute:
            inst.breakdown.recompute += step.seconds;
            break;
          case ComputeClass::kOptimizer:
            inst.breakdown.optimizer += step.seconds;
            break;
        }
        break;
      }
      case StepKind::kCollective:
        run_collective(inst, step, block);
        break;
      case StepKind::kRecv:
        recv(inst, step, block);
        break;
      case StepKind::kSend:
        send(inst, step, block);
        break;
      case StepKind::kCommLaunch: {
        flush_compute(inst, block);  // its tokens exist once the compute before it ran
        const int seq = ++inst.ep.launched;
        inst.ep.tag_seq[step.tag] = seq;
        if (step.collective == CollectiveKind::kExpertExchange) ++inst.exchanges_in_flight;
        inst.ep.queue.push_back({&step, rendezvous_key(inst, step), block});
        inst.ep.pending->release();
        break;
      }
      case StepKind::kCommWait:
        comm_wait(inst, step, block);
        break;
      case StepKind::kHostCopyLaunch: {
        flush_compute(inst, block);  // the activations exist once the compute before them ran
        auto& stream = inst.host_copy[step.to_host ? 1 : 0];
        ++stream.launched;
        stream.queue.push_back({&step, block, step.to_host ? 0 : inst.host_copy[1].launched});
        stream.pending->release();
        break;
      }
      case StepKind::kHostCopyWait:
        host_copy_wait(inst, step, block);
        break;
      case StepKind::kDpLaunch: {
        flush_compute(inst, block);  // the gradients exist once the compute before them ran
        const int seq = ++inst.dp.launched;
        if (step.tag >= 0) inst.dp.tag_seq[step.tag] = seq;
        inst.dp_seq_axes[seq] = step.axes;
        inst.dp.queue.push_back({&step});
        inst.dp.pending->release();
        break;
      }
      case StepKind::kDpWait:
        dp_wait(inst, step, block);
        break;
      case StepKind::kMemory: {
        flush_compute(inst, block);
        inst.memory_level += step.bytes;
        inst.timeline.push_back({sg4::Engine::get_clock(), inst.memory_level});
        break;
      }
    }
  }
  flush_compute(inst, block);
}

void Simulation::compute_actor(Instance& inst) {
  const Lane& lane = prog_.lanes[inst.lane];
  inst.memory_level = lane.memory.total();
  inst.peak_memory = inst.memory_level;
  inst.timeline.push_back({0, inst.memory_level});
  run_steps(inst, lane.prologue, -1);
  for (size_t b = 0; b < lane.blocks.size(); ++b) {
    const BlockInstance& bi = lane.blocks[b];
    const BlockTemplate& t = prog_.templates[bi.template_index];
    // The block's peak happens while it runs, above the level at its start.
    inst.peak_memory = std::max(inst.peak_memory, inst.memory_level + t.peak_bytes);
    inst.timeline.push_back({sg4::Engine::get_clock(), inst.memory_level + t.peak_bytes});
    auto context = [](const Block& x) {
      return Instance::BlockContext{x.segment, static_cast<int>(x.kind), x.micro_batch, x.pass, 0};
    };
    inst.running[0] = context(bi.block);
    if (bi.paired) inst.running[1] = context(bi.partner);
    inst.ep.tag_seq.clear();
    run_steps(inst, t.steps, static_cast<int>(b));
    if (inst.replica == 0) block_done();
  }
  run_steps(inst, lane.epilogue, -1);
  inst.finish = sg4::Engine::get_clock();
}

double Simulation::run_on_stream(Instance& inst, const Step& step, const RendezvousKey& key) {
  const PreparedComm& comm = prepared_collective(inst, step);
  if (!foldable(inst, step)) return joint_collective(inst, comm, key, participants(inst, step), 0);
  const double t0 = sg4::Engine::get_clock();
  wait_for(comm.alone_seconds);  // nothing else crosses its links
  ++activities_;
  return t0;
}

void Simulation::dp_stream_actor(Instance& inst) {
  sg4::Actor::self()->daemonize();
  while (true) {
    const Step& step = *inst.dp.next().step;
    const RendezvousKey key{inst.lane, 1 << 20, inst.dp_sequence_for_rendezvous++, 0, 0};
    // Parameter offloading: a gather's shard comes from the host first, a reduction's goes
    // there after.
    const bool copy_in = step.host_seconds > 0 && step.collective == CollectiveKind::kAllGather;
    const bool copy_out = step.host_seconds > 0 && !copy_in;
    if (copy_in) host_copy_on_dp_stream(inst, step);
    const double t0 = run_on_stream(inst, step, key);
    record(inst, Stream::kDataParallel, TaskKind::kDpCollective, t0, sg4::Engine::get_clock(),
           step.label, -1, step.bytes, 0, step.axes);
    if (copy_out) host_copy_on_dp_stream(inst, step);
    inst.dp.complete_one();
  }
}

void Simulation::run_host_copy(Instance& inst, const Step& step, double seconds) {
  const PreparedComm& c = *inst.host_copies.at(&step);
  bool alone = fold_;
  for (int l : c.links) alone = alone && !link_shared_[l];
  if (!alone) {
    activities_ += runner_->run(c);
    return;
  }
  wait_for(seconds);  // nothing else crosses its links
  ++activities_;
}

void Simulation::host_copy_on_dp_stream(Instance& inst, const Step& step) {
  const double t0 = sg4::Engine::get_clock();
  run_host_copy(inst, step, step.host_seconds);
  record(inst, Stream::kDataParallel, TaskKind::kHostCopy, t0, sg4::Engine::get_clock(), step.label,
         -1, 0, 0, 0);
}

void Simulation::comm_stream_actor(Instance& inst) {
  sg4::Actor::self()->daemonize();
  while (true) {
    const Instance::CommItem item = inst.ep.next();
    const Step& step = *item.step;
    const double t0 = run_on_stream(inst, step, item.key);
    record(inst, Stream::kExpertComm, TaskKind::kCollective, t0, sg4::Engine::get_clock(),
           step.label, item.block, step.bytes, 0, step.axes);
    if (step.collective == CollectiveKind::kExpertExchange) --inst.exchanges_in_flight;
    inst.ep.complete_one();
  }
}

// Copies over the GPU's way to the host (Network::host_route): its host link is already its
// share of the way while all of the node's GPUs copy, and its PCIe link may carry its NIC's
// traffic too.
void Simulation::host_copy_actor(Instance& inst, bool to_host) {
  sg4::Actor::self()->daemonize();
  auto& stream = inst.host_copy[to_host ? 1 : 0];
  while (true) {
    const Instance::CopyItem item = stream.next();
    if (!to_host) inst.host_copy[1].wait_until(item.after_to_host);
    const double t0 = sg4::Engine::get_clock();
    run_host_copy(inst, *item.step, item.step->seconds);
    record(inst, to_host ? Stream::kOffload : Stream::kReload, TaskKind::kHostCopy, t0,
           sg4::Engine::get_clock(), item.step->label, item.block, item.step->bytes, 0, 0);
    stream.complete_one();
  }
}

void configure_engine_once() {
  // SimGrid is quiet: everything nnsim reports goes through the result.
  xbt_log_control_set("root.thresh:critical");
}

void apply_engine_config() {
  // Parallel tasks need the L07 model; its bandwidth sharing is fair (no RTT weighting) and
  // the TCP window bound is disabled (GPU fabrics have no TCP). See docs/simulator.md.
  sg4::Engine::set_config("host/model:ptask_L07");
  sg4::Engine::set_config("network/TCP-gamma:0");
  sg4::Engine::set_config("contexts/stack-size:256");
}

Expected<SimResult> Simulation::run() {
  const double wall0 = wall_now();
  configure_engine_once();
  int argc = 1;
  char arg0[] = "nnsim";
  char* argv[] = {arg0, nullptr};
  sg4::Engine engine(&argc, argv);
  apply_engine_config();

  const bool host_copies = prog_.plan.offloads_activations() || prog_.plan.optimizer.offload_params;
  net_ = std::make_unique<Network>(prog_.topology, host_copies);
  hosts_ = build_platform(*net_);
  runner_ = std::make_unique<CollectiveRunner>(*net_, hosts_, prog_.algorithm, prog_.comm_model,
                                               prog_.expert_routing);

  lane_of_rank_.assign(prog_.plan.mesh.num_ranks(), -1);
  for (size_t l = 0; l < prog_.lanes.size(); ++l) {
    for (int r : prog_.lanes[l].ranks) lane_of_rank_[r] = static_cast<int>(l);
  }
  const int dp_axis = prog_.plan.mesh.axis_index(kDataParallelAxis);
  cross_axes_ = 0;
  for (size_t a = 0; a < prog_.plan.mesh.axes.size(); ++a) {
    if (static_cast<int>(a) != dp_axis && !(prog_.lane_axes & (1u << a)) &&
        prog_.plan.mesh.axes[a].size > 1) {
      cross_axes_ |= 1u << a;
    }
  }
  const int replicas = options_.fidelity == Fidelity::kFull ? prog_.replicas : 1;
  for (int r = 0; r < replicas; ++r) {
    for (size_t l = 0; l < prog_.lanes.size(); ++l) {
      auto inst = std::make_unique<Instance>();
      inst->lane = static_cast<int>(l);
      inst->replica = r;
      for (int rank : prog_.lanes[l].ranks) {
        int x = prog_.rank_in_replica(rank, r);
        inst->ranks.push_back(x);
        inst->gpus.push_back(prog_.gpu_of_rank[x]);
      }
      inst->dp.open();
      inst->ep.open();
      for (auto& stream : inst->host_copy) stream.open();
      inst->send_pending[0] = sg4::Semaphore::create(0);
      inst->send_pending[1] = sg4::Semaphore::create(0);
      instances_.push_back(std::move(inst));
    }
  }
  for (const auto& l : prog_.lanes) blocks_total_ += l.blocks.size();
  fold_ = options_.fold_exclusive_collectives;
  analyze_links();
  for (auto& inst : instances_) {
    Instance* p = inst.get();
    sg4::Host* host = hosts_[p->gpus.front()];
    sg4::Actor::create(fmt::format("lane{}.r{}", p->lane, p->replica), host,
                       [this, p] { compute_actor(*p); });
    sg4::Actor::create(fmt::format("dp{}.r{}", p->lane, p->replica), host,
                       [this, p] { dp_stream_actor(*p); });
    if (prog_.has_pairs()) {
      sg4::Actor::create(fmt::format("ep{}.r{}", p->lane, p->replica), host,
                         [this, p] { comm_stream_actor(*p); });
    }
    if (prog_.plan.offloads_activations()) {
      for (bool to_host : {false, true}) {
        sg4::Actor::create(
            fmt::format("{}{}.r{}", to_host ? "offload" : "reload", p->lane, p->replica), host,
            [this, p, to_host] { host_copy_actor(*p, to_host); });
      }
    }
    for (int d = 0; d < 2; ++d) {
      sg4::Actor::create(fmt::format("send{}.{}.r{}", d, p->lane, p->replica), host,
                         [this, p, d] { send_stream_actor(*p, d); });
    }
  }
  engine.run();

  SimResult res;
  res.fidelity = options_.fidelity;
  res.num_gpus = static_cast<int>(prog_.gpu_of_rank.size());  // GPUs the plan uses
  res.micro_batches = prog_.micro_batches;
  res.simulated_lanes = static_cast<int>(instances_.size());
  res.replicas_simulated = replicas;
  res.labels = prog_.labels;
  for (const auto& a : prog_.plan.mesh.axes) res.lane_axes.push_back(a.name);
  double iteration = 0;
  for (const auto& inst : instances_) iteration = std::max(iteration, inst->finish);
  for (const auto& inst : instances_) {
    if (inst->finish <= 0 && !prog_.lanes[inst->lane].blocks.empty()) {
      return Error(
          fmt::format("the simulation stopped before lane {} finished its blocks "
                      "(a deadlock the schedule check did not catch)",
                      inst->lane));
    }
  }
  for (size_t l = 0; l < prog_.lanes.size(); ++l) {
    const Instance& inst = *instances_[l];
    const Lane& lane = prog_.lanes[l];
    LaneReport rep;
    for (const auto& [axis, v] : lane.slice) {
      rep.name += fmt::format("{}{}={}", rep.name.empty() ? "" : ",", axis, v);
    }
    if (rep.name.empty()) rep.name = "all";
    rep.gpus = lane.gpus;
    rep.ranks = lane.ranks;
    rep.finish_time = inst.finish;
    rep.breakdown = inst.breakdown;
    // Whatever is not compute or exposed communication is waiting on others: bubble.
    double busy = rep.breakdown.compute + rep.breakdown.recompute + rep.breakdown.optimizer +
                  rep.breakdown.total_exposed_comm();
    rep.breakdown.bubble = iteration - busy;
    if (rep.breakdown.bubble < 1e-12 * iteration) rep.breakdown.bubble = 0;  // rounding residue
    rep.static_memory = lane.memory;
    rep.peak_memory = inst.peak_memory;
    rep.peak_activations = inst.peak_memory - lane.memory.total();
    rep.memory_timeline = inst.timeline;
    rep.memory_timeline.push_back({iteration, inst.memory_level});
    rep.parameters = lane.parameters;
    res.lanes.push_back(std::move(rep));
  }
  res.iteration_time = iteration;
  res.tokens_per_second = iteration > 0 ? prog_.tokens_per_iteration / iteration : 0;
  res.model_flops_per_gpu =
      iteration > 0 ? prog_.model_flops_per_iteration / iteration / res.num_gpus : 0;
  res.peak_flops_per_gpu = prog_.topology.gpu.peak_flops(prog_.plan.precision);
  res.mfu = res.peak_flops_per_gpu > 0 ? res.model_flops_per_gpu / res.peak_flops_per_gpu : 0;
  res.tasks = std::move(tasks_);
  res.activities = activities_;
  res.wall_seconds = wall_now() - wall0;
  return res;
}

}  // namespace nnsim
