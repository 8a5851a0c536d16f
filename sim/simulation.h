// The actors of one simulated iteration, and the state they share. Internal to sim/: use
// sim/simulator.h. Runs inside the process that owns the SimGrid engine.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <simgrid/s4u.hpp>

#include "core/network.h"
#include "core/program.h"
#include "sim/collective_runner.h"
#include "sim/lane_mirror.h"
#include "sim/result.h"
#include "sim/simulator.h"

namespace nnsim {

// SimGrid settings every simulation uses: call configure_engine_once before creating the engine
// and apply_engine_config right after.
void configure_engine_once();
void apply_engine_config();

// Runs simulate_communication's requests in this process (which must not have run SimGrid).
Expected<std::vector<double>> run_communication(const Topology& topology, const CommModel& comm,
                                                const std::vector<CommRequest>& requests);

class Simulation {
 public:
  Simulation(const Program& program, const SimOptions& options);
  // Creates the engine, the platform and the actors, runs, and collects the result.
  Expected<SimResult> run();

 private:
  // Identifies one joint collective the same way on every participant.
  using RendezvousKey = std::tuple<int, int, int, int, int>;

  // A communication stream the compute stream feeds: collectives queued and run one after
  // another by the stream's actor, counted as launched and completed (the compute stream waits
  // on `progress` for a count), with each tag's last launch.
  template <typename Item>
  struct CommStream {
    std::deque<Item> queue;
    simgrid::s4u::SemaphorePtr pending;
    simgrid::s4u::MutexPtr mutex;
    simgrid::s4u::ConditionVariablePtr progress;
    int launched = 0;
    int completed = 0;
    std::map<int, int> tag_seq;  // tag -> sequence number of its last launch
    void open() {
      pending = simgrid::s4u::Semaphore::create(0);
      mutex = simgrid::s4u::Mutex::create();
      progress = simgrid::s4u::ConditionVariable::create();
    }
    bool busy() const { return completed < launched; }
    // Blocks the stream's actor until an item is queued, and takes it.
    Item next() {
      pending->acquire();
      Item item = queue.front();
      queue.pop_front();
      return item;
    }
    // Blocks the calling actor until the first `target` launches have completed.
    void wait_until(int target) {
      std::unique_lock<simgrid::s4u::Mutex> lock(*mutex);
      while (completed < target) progress->wait(lock);
    }
    void complete_one() {
      std::unique_lock<simgrid::s4u::Mutex> lock(*mutex);
      ++completed;
      progress->notify_all();
    }
  };

  // One simulated lane in one replica.
  struct Instance {
    int lane = 0;
    int replica = 0;
    std::vector<int> ranks;
    std::vector<int> gpus;
    // Data-parallel stream: a FIFO of collectives.
    struct DpItem {
      const Step* step = nullptr;
    };
    CommStream<DpItem> dp;
    std::map<int, uint32_t> dp_seq_axes;  // sequence number -> axes (for the breakdown)
    int dp_sequence_for_rendezvous = 0;
    int explicit_sequence = 0;
    int joint_sequence = 0;
    // The block being run (a pair's two: Step::member), and how many collectives joining
    // other lanes each has run so far (the key under which the lanes of a spanning segment, or
    // of an expert-parallel group, meet).
    struct BlockContext {
      int segment = -1;
      int kind = -1;
      int micro_batch = -1;
      int pass = 0;
      int cross_sequence = 0;
    };
    BlockContext running[2];
    // Expert communication stream of a paired block (StepKind::kCommLaunch): a FIFO of
    // collectives, each under the rendezvous key its launch computed.
    struct CommItem {
      const Step* step = nullptr;
      RendezvousKey key;
      int block = -1;
    };
    CommStream<CommItem> ep;  // its tags count within the running block
    // Activation offloading's copies (StepKind::kHostCopyLaunch), a stream each way: [1] to
    // the host, [0] back.
    struct CopyItem {
      const Step* step = nullptr;
      int block = -1;
      // A copy back starts once the copies to the host launched before it have finished: what
      // it brings back must have arrived there.
      int after_to_host = 0;
    };
    CommStream<CopyItem> host_copy[2];
    int exchanges_in_flight = 0;  // of them, DeepEP's (CollectiveKind::kExpertExchange)
    // Accounting.
    Breakdown breakdown;
    double finish = 0;
    double memory_level = 0;
    double peak_memory = 0;
    std::vector<MemoryPoint> timeline;
    // A step's communication as it runs, and whole: every group of a per-rank collective, which
    // may run as its first group alone (lane_mirror.h).
    std::unordered_map<const Step*, const PreparedComm*> prepared;
    std::unordered_map<const Step*, const PreparedComm*> whole;
    // Copies to or from the host memory (activation offloading's launches, parameter
    // offloading's data-parallel launches), each over the lane's GPUs.
    std::unordered_map<const Step*, const PreparedComm*> host_copies;
    // Pipeline sends, one FIFO stream per direction (activations, gradients).
    struct SendItem {
      const PreparedComm* comm = nullptr;
      simgrid::s4u::SemaphorePtr arrived;
      const Step* step = nullptr;
      int block = -1;
      double posted = 0;
      simgrid::s4u::SemaphorePtr done;  // a blocking send's: released when it has completed
    };
    std::deque<SendItem> send_queue[2];
    simgrid::s4u::SemaphorePtr send_pending[2];
  };

  // A pipeline transfer, keyed by (from segment, to segment, gradient, micro-batch, replica,
  // receiving lane, the receiving block's forward pass).
  struct Transfer {
    simgrid::s4u::SemaphorePtr arrived;
    double posted = -1;
  };
  using TransferKey = std::tuple<int, int, bool, int, int, int, int>;

  // Several instances meeting for one collective; the last to arrive runs it.
  struct Rendezvous {
    int arrived = 0;
    simgrid::s4u::SemaphorePtr release;
    std::shared_ptr<double> start;  // when the last participant arrived
  };

  void compute_actor(Instance& inst);
  void dp_stream_actor(Instance& inst);
  void comm_stream_actor(Instance& inst);
  void host_copy_actor(Instance& inst, bool to_host);
  // Parameter offloading's copy beside a data-parallel collective (Step::host_seconds).
  void host_copy_on_dp_stream(Instance& inst, const Step& step);
  void send_stream_actor(Instance& inst, int direction);
  // Prepares every communication of every instance and finds the collectives whose links no
  // other communication crosses (those run in closed form on the compute stream) and the lanes
  // whose per-rank collectives may run their first rank's group alone (lane_mirror.h).
  void analyze_links();
  // Runs the per-rank collectives of every lane that may as their first rank's group alone.
  using PerRankStep = std::pair<const Step*, PerRankCollective>;
  void mirror_lanes(const std::vector<std::vector<PerRankStep>>& per_rank,
                    const std::set<std::pair<const PreparedComm*, LinkUse>>& crossings);
  bool foldable(const Instance& inst, const Step& step) const;
  const PreparedComm& prepared_transfer(Instance& inst, const Step& step);
  // Runs one of the lane's copies to or from the host: in closed form (`seconds`) when nothing
  // else crosses its links, else in SimGrid beside what does (its GPU's NIC traffic).
  void run_host_copy(Instance& inst, const Step& step, double seconds);
  void host_copy_wait(Instance& inst, const Step& step, int block);
  void run_steps(Instance& inst, const std::vector<Step>& steps, int block);
  void flush_compute(Instance& inst, int block);
  void run_collective(Instance& inst, const Step& step, int block);
  void recv(Instance& inst, const Step& step, int block);
  void send(Instance& inst, const Step& step, int block);
  void dp_wait(Instance& inst, const Step& step, int block);
  void comm_wait(Instance& inst, const Step& step, int block);
  // Runs one collective of a communication stream: in closed form when nothing else crosses its
  // links, else with the instances it joins. Returns when it started.
  double run_on_stream(Instance& inst, const Step& step, const RendezvousKey& key);
  // The key under which the participants of a joint collective meet: counted per lane, or for
  // collectives joining other lanes per block (the step's member of a pair).
  RendezvousKey rendezvous_key(Instance& inst, const Step& step);
  const PreparedComm& prepared_collective(const Instance& inst, const Step& step) const;
  // The GPU groups a collective step of `inst` runs over (one per lane rank unless its axes
  // join them, or the step's explicit groups).
  std::vector<std::vector<int>> collective_groups(const Instance& inst, const Step& step) const;
  const PreparedComm& prepared_comm(int kind, double bytes, std::vector<std::vector<int>> groups);
  // Runs a collective that several instances join (data parallel in full fidelity, explicit
  // groups); returns when it is done for this instance.
  // Returns when the collective started (the last participant's arrival).
  double joint_collective(Instance& inst, const PreparedComm& comm, const RendezvousKey& key,
                          int participants, double overlap);
  // Instances that run `step` together: the lanes its group reaches (a spanning segment's
  // collective along the pipeline axis), the replicas in full fidelity, or an explicit pair.
  int participants(const Instance& inst, const Step& step) const;
  void record(const Instance& inst, Stream stream, TaskKind kind, double start, double end,
              int label, int block, double bytes, double flops, uint32_t axes);
  void block_done();
  std::string exposed_key(uint32_t axes) const;

  const Program& prog_;
  SimOptions options_;
  std::unique_ptr<Network> net_;
  std::vector<simgrid::s4u::Host*> hosts_;
  std::unique_ptr<CollectiveRunner> runner_;
  std::vector<std::unique_ptr<Instance>> instances_;
  std::map<TransferKey, Transfer> transfers_;
  std::map<RendezvousKey, Rendezvous> rendezvous_;
  // Prepared communication by (collective kind, -1 for a transfer, -2 for a copy from the host
  // or -3 to it; bytes; groups).
  std::map<std::tuple<int, double, std::vector<std::vector<int>>>, PreparedComm> prepared_cache_;
  std::vector<int> lane_of_rank_;  // replica 0's ranks
  uint32_t cross_axes_ = 0;        // axes that separate lanes, besides dp
  mutable std::map<std::pair<int, uint32_t>, int> lanes_reached_;  // (lane, axes) -> lanes
  // Pending merged compute of the instance being run (actors never interleave within a step).
  struct PendingCompute {
    double seconds = 0;
    double compute_seconds = 0;  // of which compute (communication slows it down)
    double start = 0;
    struct Part {
      const Step* step;
      double offset;
      double seconds;
      bool collective;  // a folded collective (its compute part, if overlapped, is step->seconds)
    };
    std::vector<Part> parts;
  };
  std::unordered_map<const Instance*, PendingCompute> pending_;
  std::vector<TaskRecord> tasks_;
  // Link analysis: for each link, which communication uses it (an id per distinct set of GPUs)
  // and whether a second one does too.
  std::vector<int> link_user_;
  std::vector<bool> link_shared_;
  std::map<std::vector<int>, int> user_ids_;
  bool fold_ = true;
  uint64_t activities_ = 0;
  size_t blocks_total_ = 0;
  size_t blocks_done_ = 0;
  double last_progress_wall_ = 0;
};

}  // namespace nnsim
