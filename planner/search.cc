#include "planner/search.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/memory_check.h"
#include "core/suggest.h"
#include "planner/stage_partition.h"

namespace nnsim {

std::string Candidate::describe() const {
  const MegatronOptions& o = options;
  std::string s = fmt::format("tp{} pp{}", o.tp, o.pp);
  if (o.vpp > 1) s += fmt::format(" vpp{}", o.vpp);
  if (o.cp > 1) s += fmt::format(" cp{}", o.cp);
  if (o.ep > 1) s += fmt::format(" ep{}", o.ep);
  if (o.expert_tp == 1 && o.tp > 1) s += " etp1";
  s += fmt::format(" dp{} mb{}", o.dp, o.micro_batch);
  if (o.sequence_parallel) s += " sp";
  std::string recompute(to_string(o.recompute));
  if (!o.stage_recompute.empty()) {
    std::vector<std::string_view> modes;
    for (RecomputeMode m : o.stage_recompute) modes.push_back(to_string(m));
    recompute = fmt::format("recompute={}", fmt::join(modes, ","));
  }
  if (!o.recompute_modules.empty()) {
    recompute += fmt::format("+{}", fmt::join(o.recompute_modules, "+"));
  }
  s += fmt::format(" {} zero{} {}", recompute, o.zero, to_string(o.schedule));
  if (o.tp_sub_batches > 1) s += fmt::format(" sub-batches{}", o.tp_sub_batches);
  if (o.ep_overlap) s += " ep-overlap";
  if (!o.stage_layers.empty()) {
    s += fmt::format(" layers={}", fmt::join(o.stage_layers, ","));
  }
  if (!o.recompute_layers.empty()) {
    s += fmt::format(" recompute-layers={}", fmt::join(o.recompute_layers, ","));
  }
  if (o.optimizer_offload > 0) s += fmt::format(" offload{:g}", o.optimizer_offload);
  if (o.offload_params && o.optimizer_offload > 0) s += " params";
  if (o.activation_offload > 0) s += fmt::format(" act-offload{}", o.activation_offload);
  if (!o.offload_modules.empty()) {
    s += fmt::format(" offload-modules={}", fmt::join(o.offload_modules, ","));
  }
  if (placement != "tp-innermost") s += " " + placement;
  return s;
}

namespace {

// Stage re-partitioning is tried on at most this many pipelines whose cheapest estimate, scaled
// to their best split (Search::balanced_bound_), is within this margin of the best plan.
constexpr size_t kMaxBalanced = 48;
constexpr double kBalanceMargin = 0.05;
// Every other rank placement is tried for the best plans of this many sets of degrees.
constexpr size_t kMaxPlaced = 8;
// The zero-bubble and Merak schedules are tried for this many of the best pipelined plans.
constexpr size_t kMaxRescheduled = 8;
// Sub-pipelined tensor parallelism is tried for this many of the best plans.
constexpr size_t kMaxSubPipelined = 8;
constexpr size_t kMaxEpOverlapped = 8;
// Tessel's search is tried on pipelines of at most this many stages (its solver time grows fast
// with the devices: 0.8 s for 4, 4 s for 8).
constexpr int kMaxTesselStages = 8;

std::vector<int> divisors(int n, int limit) {
  std::vector<int> out;
  for (int d = 1; d <= n && d <= limit; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

template <class T>
std::vector<T> pinned_or(const std::optional<T>& pin, std::vector<T> all) {
  return pin ? std::vector<T>{*pin} : all;
}

// A dominance chain: the same degrees and schedule, with ever cheaper memory and ever higher
// cost (recompute, ZeRO). The first that fits is the one worth having.
struct Chain {
  MegatronOptions base;
  std::string placement;
  std::vector<std::pair<RecomputeMode, int>> levels;
};

struct PlacementChoice {
  std::string name;
  std::vector<std::string> order;
};

// Static memory per GPU (weights, gradients, optimizer state) without activations: a lower
// bound that rules out degrees before compiling anything.
double static_bytes_lower_bound(const ModelSpec& m, int tp, int pp, int dp, int cp, int ep,
                                int zero, bool fsdp, double offload, bool offload_params) {
  // FSDP's CPUOffload and DeepSpeed's offload_param keep every shard on the host: only the
  // gathered working set remains.
  if ((fsdp || offload_params) && offload > 0 && zero == 3) return 0;
  const double per_param = fsdp ? 16.0 : 18.0;
  // Dense weights shard over dp x cp; experts, spread over ep of the dp ranks, over the rest.
  const double experts = static_cast<double>(m.expert_parameters());
  const double dense = static_cast<double>(m.parameters()) - experts;
  double b = 0;
  for (auto [params, shard] : {std::pair{dense / (tp * pp), 1.0 * dp * cp},
                               std::pair{experts / (tp * pp * ep), 1.0 * dp / ep * cp}}) {
    b += params * per_param;
    if (zero >= 1) b -= params * 12 * (1 - 1 / shard);
    if (zero >= 2) b -= params * 4 * (1 - 1 / shard);
    if (zero >= 3) b -= params * 2 * (1 - 1 / shard);
    // The host keeps `offload` of what is left of the optimizer state.
    b -= offload * params * 12 * (zero >= 1 ? 1 / shard : 1);
  }
  return b;
}

// Runs body(0..n-1) on `jobs` threads, calling progress(done, n) after each.
void parallel_for(size_t n, int jobs, const std::function<void(size_t)>& body,
                  const std::function<void(size_t, size_t)>& progress) {
  std::atomic<size_t> next{0}, done{0};
  std::mutex mutex;
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) {
      body(i);
      const size_t d = ++done;
      if (progress) {
        std::lock_guard<std::mutex> lock(mutex);
        progress(d, n);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int j = 1; j < std::max(1, jobs); ++j) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

// Rank orders (outermost first) for the degrees of `o` that place ranks differently from each
// other and from the orders in `done`: every order of the whole axes, and each axis split
// a x b with its a-part outermost (over nodes) and its b-part in Megatron's place (TP 8 as 2
// groups of 4 GPUs on different nodes).
std::vector<std::vector<std::string>> distinct_orders(
    const MegatronOptions& o, const std::vector<std::vector<std::string>>& done) {
  const Mesh mesh = megatron_mesh(o, o.dp);
  auto mapping = [&](const std::vector<std::string>& order) -> std::optional<std::vector<int>> {
    Expected<Placement> p = placement_from_order(mesh, with_expert_axis(order, o.ep));
    if (!p) return std::nullopt;
    return p->gpu_of_rank(mesh);
  };
  std::set<std::vector<int>> seen;
  for (const auto& order : done) {
    if (auto m = mapping(order)) seen.insert(*m);
  }
  std::vector<std::vector<std::string>> candidates;
  std::vector<std::string> axes = {"cp", "dp", "pp", "tp"};
  if (o.ep > 1) axes = {"cp", "dp", "ep", "pp", "tp"};
  do {
    candidates.push_back(axes);
  } while (std::next_permutation(axes.begin(), axes.end()));
  for (const char* axis : {"tp", "cp", "ep", "dp", "pp"}) {
    const int s = mesh.axis_size(axis);
    for (int a = 2; a < s; ++a) {
      if (s % a == 0) {
        candidates.push_back(
            with_expert_axis({fmt::format("{}:{}", axis, a), "pp", "dp", "cp", "tp"}, o.ep));
      }
    }
  }
  std::vector<std::vector<std::string>> out;
  for (const auto& order : candidates) {
    std::optional<std::vector<int>> m = mapping(order);
    if (m && seen.insert(*m).second) out.push_back(order);
  }
  return out;
}

std::string order_name(const MegatronOptions& o, const std::vector<std::string>& order) {
  const Mesh mesh = megatron_mesh(o, o.dp);
  std::vector<std::string> key;
  for (const auto& a : with_expert_axis(order, o.ep)) {
    const int n = mesh.axis_size(a);
    // A split axis's parts are both larger than 1.
    if (n > 1 || a.find(':') != std::string::npos) key.push_back(a);
  }
  return fmt::format("order {}", fmt::join(key, "-"));
}

Expected<Program> compile_options(const ModelSpec& model, const Topology& topo,
                                  const MegatronOptions& options) {
  Expected<Plan> plan = build_megatron_plan(model, topo, options);
  if (!plan) return plan.error();
  return compile_plan(*plan, topo, options.costs);
}

// Merak-style stage partitioning with stage-aware recomputation for one chain's degrees: stage
// costs measured on the uniform split, the split and per-stage recomputation from dynamic
// programming (planner/stage_partition.h), then compiled and checked like any candidate. With
// virtual stages each device recomputes what it needs to fit and the head's segment may give up
// to three layers to the others. When the exact memory check finds a device over, it recomputes
// more and the plan is tried again. Nothing when the result is the uniform plan or nothing fits.
std::optional<Candidate> balance_chain(const ModelSpec& model, const Topology& topo,
                                       const Chain& chain,
                                       std::optional<RecomputeMode> pinned_recompute,
                                       double capacity, const Constraints& cons,
                                       std::atomic<size_t>& evaluated) {
  std::vector<int> zeros;
  for (const auto& level : chain.levels) {
    if (std::find(zeros.begin(), zeros.end(), level.second) == zeros.end()) {
      zeros.push_back(level.second);
    }
  }
  for (int zero : zeros) {
    MegatronOptions plain = chain.base;
    plain.zero = zero;
    plain.recompute = pinned_recompute.value_or(RecomputeMode::kNone);
    Expected<Program> p0 = compile_options(model, topo, plain);
    if (!p0) return std::nullopt;
    std::optional<Program> p1;
    if (!pinned_recompute) {
      MegatronOptions full = plain;
      full.recompute = RecomputeMode::kFull;
      Expected<Program> p = compile_options(model, topo, full);
      if (!p) return std::nullopt;
      p1 = std::move(*p);
    }
    Candidate cand;
    cand.options = plain;
    cand.placement = chain.placement;
    // What recomputing a layer saves; with several block shapes, the least of them.
    double saved_per_layer = 0;
    if (p1) {
      saved_per_layer = p0->layer_activation_bytes.front() - p1->layer_activation_bytes.front();
      for (size_t l = 0; model.block_shapes() > 1 && l < p0->layer_activation_bytes.size(); ++l) {
        saved_per_layer = std::min(saved_per_layer,
                                   p0->layer_activation_bytes[l] - p1->layer_activation_bytes[l]);
      }
    }
    // Compiles the split `layers` (empty: even) with `recomputed` layers a segment, recomputing
    // more where the exact memory check finds a device over.
    auto try_split = [&](std::vector<int> layers,
                         std::vector<int> recomputed) -> std::optional<Candidate> {
      Candidate c = cand;
      c.options.stage_layers = std::move(layers);
      for (int attempt = 0; attempt < 4; ++attempt) {
        const bool any =
            std::any_of(recomputed.begin(), recomputed.end(), [](int k) { return k > 0; });
        c.options.recompute_layers = any ? recomputed : std::vector<int>{};
        const bool uniform =
            c.options.stage_layers.empty() ||
            c.options.stage_layers == split_layers(model.layers, chain.base.pp * chain.base.vpp);
        if (uniform && !any) return std::nullopt;  // already evaluated
        Expected<Plan> plan = build_megatron_plan(model, topo, c.options);
        if (!plan) return std::nullopt;
        Expected<Program> prog = compile_plan(*plan, topo, c.options.costs);
        if (!prog) return std::nullopt;
        ++evaluated;
        c.estimate = estimate_program(*prog);
        if (c.estimate.peak_memory <= capacity) {
          std::string why = violated_constraint(cons, *plan, *prog, c.estimate.bubble_fraction,
                                                c.estimate.peak_memory);
          if (!why.empty()) return std::nullopt;
          c.status = "ok";
          return c;
        }
        // The linear memory model was short: recompute more where the exact check overflows.
        if (pinned_recompute) break;
        Expected<std::vector<int>> more =
            recompute_to_fit(*prog, recomputed, saved_per_layer, capacity);
        if (!more || *more == recomputed) break;
        recomputed = *more;
      }
      return std::nullopt;
    };
    std::vector<int> recomputed(p0->plan.segments.size(), 0);
    if (chain.base.vpp == 1) {
      Expected<std::vector<StageCosts>> costs = measure_stage_costs(*p0, p1 ? *p1 : *p0);
      if (!costs) return std::nullopt;
      Expected<StagePartition> part =
          partition_stages(*costs, layer_traits(*p0, p1 ? *p1 : *p0), capacity);
      if (!part) continue;
      const bool uniform = part->layers == split_layers(model.layers, chain.base.pp);
      if (uniform && std::all_of(part->recomputed.begin(), part->recomputed.end(),
                                 [](int k) { return k == 0; })) {
        return std::nullopt;  // the plan already evaluated
      }
      if (std::optional<Candidate> c = try_split(part->layers, part->recomputed)) return c;
      continue;
    }
    // Virtual stages: each device recomputes what it needs to fit; the splits tried are the
    // even one, the head's segment (the last stage's last chunk) shedding up to three layers
    // to the others (Megatron-Core's --decoder-last-pipeline-num-layers), and the devices'
    // time evened out segment by segment (any split a --pipeline-model-parallel-layout can
    // give); the fastest wins.
    if (!pinned_recompute) {
      Expected<std::vector<int>> fit = recompute_to_fit(*p0, recomputed, saved_per_layer, capacity);
      if (!fit) continue;
      recomputed = *fit;
    }
    const int segments = chain.base.pp * chain.base.vpp;
    const std::vector<int> even = split_layers(model.layers, segments);
    std::vector<std::vector<int>> splits;
    for (int shed = 1; shed <= 3 && even.back() - shed >= 0; ++shed) {
      const int last = even.back() - shed;
      std::vector<int> layers = split_layers(model.layers - last, segments - 1);
      layers.push_back(last);
      splits.push_back(layers);
    }
    // And the segments' layers moved one by one to even out the devices' time.
    if (Expected<std::vector<StageCosts>> times = measure_segment_times(*p0, p1 ? *p1 : *p0)) {
      std::vector<int> layers =
          balance_virtual_stages(*times, layer_traits(*p0, p1 ? *p1 : *p0), even);
      if (std::find(splits.begin(), splits.end(), layers) == splits.end()) {
        splits.push_back(layers);
      }
    }
    std::optional<Candidate> best = try_split({}, recomputed);
    for (const std::vector<int>& layers : splits) {
      std::vector<int> r = recomputed;
      for (size_t i = 0; i < r.size(); ++i) r[i] = std::min(r[i], layers[i]);
      std::optional<Candidate> c = try_split(layers, r);
      if (c && (!best || c->estimate.iteration_time < best->estimate.iteration_time)) best = c;
    }
    if (best) return best;
  }
  return std::nullopt;
}

// The layers each segment of a plan holds.
std::vector<int> layers_per_segment(const Plan& plan) {
  std::vector<int> out;
  for (const Segment& s : plan.segments) out.push_back(s.end_layer - s.first_layer);
  return out;
}

// What a pipeline (one segment a stage) could take with its layers re-partitioned, memory
// aside: its estimate scaled by the slowest stage's time under the best split over that under
// its own (the partitioner's linear model; a pipeline's steady state and its bubble both go
// with the slowest stage). Times only: the memory costs would go unused.
double balanced_bound(const Program& prog, const Estimate& e) {
  Expected<std::vector<StageCosts>> costs = measure_segment_times(prog, prog);
  if (!costs) return e.iteration_time;
  const std::vector<LayerTraits> layers = layer_traits(prog, prog);
  const double unlimited = std::numeric_limits<double>::infinity();
  Expected<StagePartition> best = partition_stages(*costs, layers, unlimited);
  if (!best) return e.iteration_time;
  const std::vector<int> own = layers_per_segment(prog.plan);
  const std::vector<double> now = stage_seconds(*costs, layers, own);
  if (now.size() != own.size()) return e.iteration_time;
  const double slowest = *std::max_element(now.begin(), now.end());
  return slowest > 0 ? e.iteration_time * best->slowest_stage_seconds / slowest : e.iteration_time;
}

// The split of a plan with virtual stages (built with an even one) whose devices' time the
// local search evens out (balance_virtual_stages), or nothing when it is the even split.
std::optional<std::vector<int>> evened_layers(const ModelSpec& model, const Topology& topo,
                                              const MegatronOptions& options) {
  Expected<Plan> plan = build_megatron_plan(model, topo, options);
  if (!plan) return std::nullopt;
  Expected<Program> prog = compile_plan(*plan, topo, options.costs);
  if (!prog) return std::nullopt;
  Expected<std::vector<StageCosts>> times = measure_segment_times(*prog, *prog);
  if (!times) return std::nullopt;
  const std::vector<int> even = layers_per_segment(prog->plan);
  std::vector<int> layers = balance_virtual_stages(*times, layer_traits(*prog, *prog), even);
  if (layers == even) return std::nullopt;
  return layers;
}

// Whether the search runs schedule `sched` with `vpp` chunks a pipeline rank: interleaved with
// several, ZB-V and DualPipeV with two (a V), the rest with one; Tessel with any, but one unless
// --vpp pins it (a solver run per plan).
bool runs_chunks(ScheduleKind sched, int vpp, bool vpp_pinned) {
  const int chunks = required_chunks(sched);
  if (chunks > 0) return vpp == chunks;
  if (sched == ScheduleKind::kInterleaved) return vpp > 1;
  return vpp_pinned || vpp == 1;
}

// Faster estimate first; ties by description, so the order never depends on the input's.
bool faster_estimate(const Candidate& a, const Candidate& b) {
  return a.estimate.iteration_time != b.estimate.iteration_time
             ? a.estimate.iteration_time < b.estimate.iteration_time
             : a.describe() < b.describe();
}

// One search: what its phases share. Each phase adds feasible candidates (and what lost, with
// why) for the next: enumerate the chains of degrees, estimate them, then try variants of the
// best (other stage splits, schedules, sub-pipelining, combined 1F1B, placements), rank and
// confirm.
class Search {
 public:
  Search(const ModelSpec& model, const Topology& topo, const SearchOptions& o,
         std::vector<int> avoid, int usable_gpus, double capacity)
      : model_(model),
        topo_(topo),
        o_(o),
        pin_(o.pins),
        cons_(o.constraints),
        avoid_(std::move(avoid)),
        usable_gpus_(usable_gpus),
        capacity_(capacity),
        fixed_layers_(pin_.stage_layers                ? &*pin_.stage_layers
                      : !cons_.stage_layers.empty()    ? &cons_.stage_layers
                      : !model.pipeline_layout.empty() ? &model.pipeline_layout
                                                       : nullptr) {
    placements_ = {{"tp-innermost", {"pp", "dp", "cp", "tp"}},
                   {"dp-innermost", {"pp", "cp", "tp", "dp"}}};
    if (pin_.placement) placements_ = {{"pinned", *pin_.placement}};
    if (o.module_offload_as_needed) offloadable_ = offloadable_modules(model);
  }

  Expected<SearchResult> run();

 private:
  // One enumerated combination of degrees, before its layouts and levels.
  struct Degrees {
    int tp, pp, cp, dp, micro_batch, vpp;
    bool sp;
  };

  void reject(const std::string& why);
  void enumerate();
  void add_chains(const Degrees& d, const std::vector<int>& eps, ScheduleKind sched);
  void evaluate_chains();
  // Builds and compiles `c`'s plan and estimates it into `c.estimate` (counted as evaluated):
  // its program, or none when the options make no valid plan.
  std::optional<Program> estimate(Candidate& c);
  std::optional<Candidate> fit_by_offloading(const Candidate& cand, const Program& prog);
  std::optional<Candidate> fit_by_offloading_activations(const Candidate& cand,
                                                         const Program& prog);
  std::optional<Candidate> fit_by_offloading_modules(const Candidate& cand);
  // What an offloaded candidate must pass besides the GPUs' memory: the host's memory and the
  // constraints (each failure counted).
  bool offloaded_fits(const Program& prog, const Estimate& estimate);
  void balance_stages();
  void try_schedules();
  void try_schedules_with_stage_recompute();
  void try_sub_pipelining();
  void try_ep_overlap();
  void try_placements();
  void estimate_variants(const std::vector<Candidate>& tries, const char* phase,
                         const std::string& rejected);
  template <class Eligible, class Apply>
  std::vector<Candidate> best_variants(size_t most, const Eligible& eligible, const Apply& apply);
  Status why_nothing_to_try() const;
  Error none_feasible() const;
  Expected<SearchResult> rank_and_confirm();

  const ModelSpec& model_;
  const Topology& topo_;
  const SearchOptions& o_;
  const SearchPins& pin_;
  const Constraints& cons_;
  const std::vector<int> avoid_;
  const int usable_gpus_;
  const double capacity_;
  // Pinned layers per stage (constraints) or per segment (command line, or the model's pattern's
  // '|'); null when free.
  const std::vector<int>* fixed_layers_;
  std::vector<PlacementChoice> placements_;
  std::vector<std::string> offloadable_;  // module offloading's order (offloadable_modules)

  SearchResult result_;
  std::map<std::string, size_t> reasons_;
  std::mutex mutex_;
  std::vector<Chain> chains_;
  std::vector<Candidate> feasible_;
  std::vector<Candidate> lost_;
  std::atomic<size_t> evaluated_{0};
  // Each chain's cheapest level's estimate, fitting or not: what its degrees could reach.
  std::vector<double> first_estimate_;
  std::vector<double> balanced_bound_;  // first_estimate_ with its stages evened out
  // Each chain's feasible plan's estimate (infinite when none fits).
  std::vector<double> chain_best_;
};

void Search::reject(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++reasons_[why];
}

Expected<SearchResult> Search::run() {
  enumerate();
  evaluate_chains();
  if (!fixed_layers_ && !feasible_.empty()) balance_stages();
  if (!pin_.schedule && !feasible_.empty()) try_schedules();
  if (o_.tp_sub_batches > 1 && !feasible_.empty()) try_sub_pipelining();
  if (o_.ep_overlap && !feasible_.empty()) try_ep_overlap();
  if (!pin_.placement && !feasible_.empty()) try_placements();

  result_.evaluated = evaluated_;
  for (const auto& [why, n] : reasons_) result_.rejections.emplace_back(why, n);
  if (chains_.empty() && result_.enumerated == 0) {
    if (Status s = why_nothing_to_try(); !s) return s.error();
  }
  if (feasible_.empty()) return none_feasible();
  return rank_and_confirm();
}

// The degrees (tp, pp, cp, sequence parallelism, micro-batch, virtual stages) and schedules
// that divide the cluster, the model and the batch and obey the constraints.
void Search::enumerate() {
  const int gpus = topo_.num_gpus();
  std::vector<int> tps;
  for (int t : pinned_or(pin_.tp, divisors(gpus, 64))) {
    if (model_.heads % t == 0 && model_.kv_heads % t == 0) tps.push_back(t);
  }
  for (int tp : tps) {
    for (int pp : pinned_or(pin_.pp, divisors(gpus / tp, model_.layers))) {
      if (gpus % (tp * pp) != 0) continue;
      if (cons_.max_stages && pp > *cons_.max_stages) {
        reject("max_stages");
        continue;
      }
      if (!cons_.stage_layers.empty() && static_cast<int>(cons_.stage_layers.size()) != pp) {
        reject("stage_layers");
        continue;
      }
      if (!cons_.stage_recompute.empty() && static_cast<int>(cons_.stage_recompute.size()) != pp) {
        reject("recompute (per stage)");
        continue;
      }
      if (pin_.stage_layers && static_cast<int>(pin_.stage_layers->size()) % pp != 0) continue;
      for (int cp : pinned_or(pin_.cp, std::vector<int>{1, 2, 4, 8})) {
        if (gpus % (tp * pp * cp) != 0) continue;
        const int dp = usable_gpus_ / (tp * pp * cp);
        if (dp < 1) continue;
        if (pin_.dp && *pin_.dp != dp) continue;
        if (cp > 1 && model_.seq_len / cp < 1024) continue;  // too short to split
        // Expert parallelism: the degrees dividing both the experts and the data-parallel ranks.
        std::vector<int> eps;
        const int most_ep = static_cast<int>(std::max<int64_t>(1, model_.experts));
        for (int e : pinned_or(pin_.ep, divisors(dp, most_ep))) {
          if (e == 1 || (model_.moe() && dp % e == 0 && model_.experts % e == 0)) eps.push_back(e);
        }
        for (bool sp : pinned_or(pin_.sequence_parallel, std::vector<bool>{tp > 1})) {
          if (model_.seq_len % (static_cast<int64_t>(cp) * (sp ? tp : 1)) != 0) continue;
          for (int mb : pinned_or(pin_.micro_batch, std::vector<int>{1, 2, 4, 8})) {
            if (o_.global_batch % (dp * mb) != 0) continue;
            const int micro_batches = o_.global_batch / (dp * mb);
            std::vector<int> vpps = {1};
            if (pp > 1) {
              for (int v : {2, 3, 4, 6, 8}) vpps.push_back(v);
            }
            for (int vpp : pinned_or(pin_.vpp, vpps)) {
              if (pp * vpp > model_.layers) continue;
              if (!cons_.stage_layers.empty() && vpp > 1) {
                reject("stage_layers");
                continue;
              }
              if (fixed_layers_ && static_cast<int>(fixed_layers_->size()) != pp * vpp) continue;
              if (vpp > 1 && micro_batches % pp != 0) continue;
              std::vector<ScheduleKind> schedules =
                  vpp > 1
                      ? std::vector<ScheduleKind>{ScheduleKind::kInterleaved}
                      : std::vector<ScheduleKind>{ScheduleKind::kOneFOneB, ScheduleKind::kGpipe};
              if (pin_.schedule) schedules = {*pin_.schedule};
              for (ScheduleKind sched : schedules) {
                if (!runs_chunks(sched, vpp, pin_.vpp.has_value())) continue;
                if (!cons_.schedules.empty() &&
                    std::find(cons_.schedules.begin(), cons_.schedules.end(), sched) ==
                        cons_.schedules.end()) {
                  reject("schedules");
                  continue;
                }
                // GPipe holds every micro-batch's activations and takes as long as 1F1B:
                // evaluated only when 1F1B is not allowed.
                if (sched == ScheduleKind::kGpipe && !pin_.schedule &&
                    (cons_.schedules.empty() ||
                     std::find(cons_.schedules.begin(), cons_.schedules.end(),
                               ScheduleKind::kOneFOneB) != cons_.schedules.end())) {
                  reject("dominated (GPipe: as fast as 1F1B, more memory)");
                  continue;
                }
                add_chains({tp, pp, cp, dp, mb, vpp, sp}, eps, sched);
              }
            }
          }
        }
      }
    }
  }
}

// A chain per rank placement, expert-parallel degree and (folded or not) expert tensor
// parallelism of the degrees `d`: its levels the recomputation and ZeRO stages whose static
// memory could fit.
void Search::add_chains(const Degrees& d, const std::vector<int>& eps, ScheduleKind sched) {
  const bool fsdp = o_.framework == "fsdp";
  struct Layout {
    const PlacementChoice* placement;
    int ep, expert_tp;
  };
  std::vector<Layout> layouts;
  for (const PlacementChoice& pl : placements_) {
    for (int ep : eps) {
      for (int etp : pinned_or(pin_.expert_tp, std::vector<int>{0, 1})) {
        // Folding needs experts to spread over ep x tp; without tensor parallelism or experts it
        // is the default plan again.
        const bool folded = etp == 1 && d.tp > 1 && model_.moe();
        if (etp == 1 && !folded && !pin_.expert_tp) continue;
        if (folded && model_.experts % (static_cast<int64_t>(ep) * d.tp) != 0) continue;
        layouts.push_back({&pl, ep, etp});
      }
    }
  }
  for (const auto& [choice, ep, etp] : layouts) {
    const PlacementChoice& pl = *choice;
    if (pl.name == "dp-innermost" && (d.tp == 1 || d.dp == 1)) continue;
    Chain c;
    c.placement = pl.name;
    MegatronOptions& b = c.base;
    b.tp = d.tp;
    b.pp = d.pp;
    b.cp = d.cp;
    b.ep = ep;
    b.expert_tp = etp;
    b.dp = d.dp;
    b.vpp = d.vpp;
    b.sequence_parallel = d.sp;
    b.micro_batch = d.micro_batch;
    b.global_batch = o_.global_batch;
    b.schedule = sched;
    b.precision = o_.precision;
    b.framework = o_.framework;
    b.avoid_gpus = avoid_;
    b.tp_comm_overlap = o_.tp_comm_overlap;
    b.moe_grouped_gemm = o_.moe_grouped_gemm;
    b.moe_deepep = o_.moe_deepep;
    b.moe_shared_expert_overlap = o_.moe_shared_expert_overlap && ep > 1;
    b.optimizer_offload = o_.optimizer_offload;
    // Under `offload_as_needed` a candidate that fits offloads nothing (fit_by_offloading sets
    // the overlap with the fraction).
    b.offload_overlap = o_.offload_overlap && o_.optimizer_offload > 0;
    b.offload_params = o_.offload_params && o_.optimizer_offload > 0;
    b.costs = o_.compile;
    b.placement = pl.order;
    if (fixed_layers_) b.stage_layers = *fixed_layers_;
    std::vector<RecomputeMode> recs = {RecomputeMode::kNone, RecomputeMode::kSelective,
                                       RecomputeMode::kFull};
    if (pin_.recompute) recs = {*pin_.recompute};
    if (cons_.recompute) recs = {*cons_.recompute};
    // Per-stage modes pinned: the base mode is unused.
    if (!cons_.stage_recompute.empty()) recs = {RecomputeMode::kNone};
    b.stage_recompute = cons_.stage_recompute;
    b.recompute_modules = cons_.recompute_modules;
    b.offload_modules = cons_.offload_modules;
    std::vector<int> zeros =
        d.tp == 1 && d.pp == 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 1};
    if (fsdp) zeros = {3, 2};
    // FSDP offloads through ZeRO-3's shards (CPUOffload), and DeepSpeed's offload_param is
    // ZeRO-3's.
    if ((fsdp || o_.offload_params) && o_.optimizer_offload > 0) zeros = {3};
    // DeepSpeed's tensor-by-tensor ZeRO-3 has no expert group (compile_plan).
    if (ep > 1 && o_.framework == "deepspeed") {
      zeros.erase(std::remove(zeros.begin(), zeros.end(), 3), zeros.end());
    }
    if (pin_.zero) zeros = {*pin_.zero};
    for (RecomputeMode r : recs) {
      for (int z : zeros) {
        if (static_bytes_lower_bound(model_, d.tp, d.pp, d.dp, d.cp, ep, z, fsdp,
                                     o_.offload_as_needed ? 1.0 : o_.optimizer_offload,
                                     o_.offload_params) > capacity_) {
          reject("does not fit in memory");
          continue;
        }
        c.levels.emplace_back(r, z);
      }
    }
    ++result_.enumerated;
    if (!c.levels.empty()) chains_.push_back(c);
  }
}

// Compiles and estimates each chain's levels until one fits.
void Search::evaluate_chains() {
  first_estimate_.assign(chains_.size(), std::numeric_limits<double>::infinity());
  balanced_bound_.assign(chains_.size(), std::numeric_limits<double>::infinity());
  chain_best_.assign(chains_.size(), std::numeric_limits<double>::infinity());
  std::atomic<size_t> next{0}, done{0};
  auto worker = [&] {
    for (size_t i = next++; i < chains_.size(); i = next++) {
      const Chain& chain = chains_[i];
      bool first = true;
      for (const auto& [rec, zero] : chain.levels) {
        Candidate cand;
        cand.options = chain.base;
        cand.options.recompute = rec;
        cand.options.zero = zero;
        cand.placement = chain.placement;
        const std::optional<Program> prog = estimate(cand);
        if (!prog) {
          reject("invalid");
          break;
        }
        if (first) {
          first_estimate_[i] = cand.estimate.iteration_time;
          // The bound is the dynamic programme's, for one chunk a stage; interleaved chunks go
          // by their uniform estimate.
          balanced_bound_[i] = chain.base.pp > 1 && chain.base.vpp == 1
                                   ? balanced_bound(*prog, cand.estimate)
                                   : cand.estimate.iteration_time;
        }
        first = false;
        if (cand.estimate.peak_memory > capacity_) {
          cand.status = fmt::format("does not fit: needs {:.1f} GiB of {:.1f} GiB usable",
                                    cand.estimate.peak_memory / (1 << 30), capacity_ / (1 << 30));
          reject("does not fit in memory");
          std::optional<Candidate> offloaded, activations, modules;
          if (o_.offload_as_needed) offloaded = fit_by_offloading(cand, *prog);
          if (o_.activation_offload_as_needed) {
            activations = fit_by_offloading_activations(cand, *prog);
          }
          if (o_.module_offload_as_needed) modules = fit_by_offloading_modules(cand);
          std::lock_guard<std::mutex> lock(mutex_);
          lost_.push_back(cand);
          for (const auto& fit : {offloaded, activations, modules}) {
            if (!fit) continue;
            chain_best_[i] = std::min(chain_best_[i], fit->estimate.iteration_time);
            feasible_.push_back(*fit);
          }
          continue;
        }
        if (const NodeHostMemory host = busiest_host_memory(*prog);
            host.node >= 0 && host.bytes > topo_.host.memory) {
          cand.status = fmt::format("does not fit in host memory: needs {:.1f} GiB of {:.1f} GiB",
                                    host.bytes / (1 << 30), topo_.host.memory / (1 << 30));
          reject("does not fit in host memory");
          std::lock_guard<std::mutex> lock(mutex_);
          lost_.push_back(cand);
          continue;
        }
        std::string why = violated_constraint(
            cons_, prog->plan, *prog, cand.estimate.bubble_fraction, cand.estimate.peak_memory);
        if (!why.empty()) {
          cand.status = "violates " + why;
          reject(why);
          std::lock_guard<std::mutex> lock(mutex_);
          lost_.push_back(cand);
          if (why == "memory_cap") continue;  // cheaper memory may satisfy it
          break;
        }
        cand.status = "ok";
        chain_best_[i] = std::min(chain_best_[i], cand.estimate.iteration_time);
        std::lock_guard<std::mutex> lock(mutex_);
        feasible_.push_back(cand);
        break;  // the rest of the chain costs more time
      }
      const size_t d = ++done;
      if (o_.progress) {
        std::lock_guard<std::mutex> lock(mutex_);
        o_.progress("estimating", d, chains_.size());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int j = 1; j < std::max(1, o_.jobs); ++j) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

// The candidate with the least fraction of its optimizer state on the host (in hundredths) that
// brings every lane within the GPUs' memory: each lane's excess over its optimizer state, since
// offloading frees that state and nothing else. None when no fraction does, or when the
// offloaded plan breaks the host's memory or a constraint (counted as rejected).
std::optional<Candidate> Search::fit_by_offloading(const Candidate& cand, const Program& prog) {
  double fraction = 0;
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(prog);
  for (size_t l = 0; l < peaks.size(); ++l) {
    const double excess = peaks[l].peak - capacity_;
    if (excess <= 0) continue;
    // FSDP's CPUOffload and DeepSpeed's offload_param free the parameter and gradient shards
    // too.
    const StaticMemory& m = prog.lanes[l].memory;
    const bool shards = cand.options.framework == "fsdp" || o_.offload_params;
    const double state = m.optimizer + (shards ? m.weights + m.gradients : 0.0);
    if (!(state >= excess)) return std::nullopt;
    fraction = std::max(fraction, excess / state);
  }
  fraction = std::min(1.0, std::ceil(fraction * 100) / 100);
  if (fraction <= 0) return std::nullopt;
  // FSDP's CPUOffload and DeepSpeed's offload_param move all of a ZeRO-3 shard, parameters
  // and gradients too.
  if (cand.options.framework == "fsdp" || o_.offload_params) {
    if (cand.options.zero != 3) return std::nullopt;
    fraction = 1;
  }
  Candidate off = cand;
  off.options.optimizer_offload = fraction;
  off.options.offload_overlap = o_.offload_overlap;
  off.options.offload_params = o_.offload_params;
  const std::optional<Program> offloaded = estimate(off);
  if (!offloaded || off.estimate.peak_memory > capacity_) return std::nullopt;
  if (!offloaded_fits(*offloaded, off.estimate)) return std::nullopt;
  off.status = "ok";
  return off;
}

std::optional<Program> Search::estimate(Candidate& c) {
  Expected<Program> prog = compile_options(model_, topo_, c.options);
  if (!prog) return std::nullopt;
  ++evaluated_;
  c.estimate = estimate_program(*prog);
  return std::move(*prog);
}

bool Search::offloaded_fits(const Program& prog, const Estimate& estimate) {
  if (busiest_host_memory(prog).bytes > topo_.host.memory) {
    reject("does not fit in host memory");
    return false;
  }
  const std::string why =
      violated_constraint(cons_, prog.plan, prog, estimate.bubble_fraction, estimate.peak_memory);
  if (!why.empty()) {
    reject(why);
    return false;
  }
  return true;
}

// The candidate offloading the activations of the fewest first layers that brings it within
// the GPUs' memory, as Megatron-Core offloads them (one pipeline stage, no recomputation).
// Each offloaded layer frees about what it keeps, so the search starts from the excess over a
// layer's activations and adds layers until the plan fits. None when no count does, or when the
// offloaded plan breaks the host's memory or a constraint.
std::optional<Candidate> Search::fit_by_offloading_activations(const Candidate& cand,
                                                               const Program& prog) {
  const MegatronOptions& o = cand.options;
  if (o.pp > 1 || o.vpp > 1 || o.recompute != RecomputeMode::kNone || !o.stage_recompute.empty() ||
      !o.recompute_modules.empty() || o.framework != "megatron") {
    return std::nullopt;
  }
  const std::vector<double>& kept = prog.layer_activation_bytes;
  const int layers = static_cast<int>(kept.size());
  const double excess = cand.estimate.peak_memory - capacity_;
  double freed = 0;
  int n = 0;
  while (n + 1 < layers && freed < excess) freed += kept[n++];
  for (; n < layers; ++n) {
    Candidate off = cand;
    off.options.activation_offload = n;
    const std::optional<Program> offloaded = estimate(off);
    if (!offloaded) return std::nullopt;
    if (off.estimate.peak_memory > capacity_) continue;
    if (!offloaded_fits(*offloaded, off.estimate)) return std::nullopt;
    off.status = "ok";
    return off;
  }
  return std::nullopt;
}

// The candidate offloading the fewest modules, in offloadable_modules' order, that brings it
// within the GPUs' memory (Megatron-Core's fine-grained offloading). A module that lowers no
// peak (what it saves is recomputed, or another module copies it) is left out. None when no
// choice fits, or when the offloaded plan breaks the host's memory or a constraint.
std::optional<Candidate> Search::fit_by_offloading_modules(const Candidate& cand) {
  const MegatronOptions& o = cand.options;
  const bool whole_blocks = o.schedule == ScheduleKind::kOneFOneB ||
                            o.schedule == ScheduleKind::kInterleaved ||
                            o.schedule == ScheduleKind::kGpipe;
  if (!whole_blocks || o.ep_overlap || o.framework != "megatron" || o.recycle > 1) {
    return std::nullopt;
  }
  std::vector<std::string> chosen = o.offload_modules;  // the constraints' own
  double peak = cand.estimate.peak_memory;
  for (const std::string& m : offloadable_) {
    if (std::find(chosen.begin(), chosen.end(), m) != chosen.end()) continue;
    Candidate off = cand;
    off.options.offload_modules = chosen;
    off.options.offload_modules.push_back(m);
    const std::optional<Program> offloaded = estimate(off);
    if (!offloaded || off.estimate.peak_memory >= peak) continue;
    chosen = off.options.offload_modules;
    peak = off.estimate.peak_memory;
    if (peak > capacity_) continue;
    if (!offloaded_fits(*offloaded, off.estimate)) return std::nullopt;
    off.status = "ok";
    return off;
  }
  return std::nullopt;
}

// Compiles and estimates variants of feasible plans (other schedules, other placements); those
// that fit and obey the constraints join the feasible ones. `rejected`: the reason counted for
// a variant that breaks a constraint (empty: not counted).
void Search::estimate_variants(const std::vector<Candidate>& tries, const char* phase,
                               const std::string& rejected) {
  std::vector<std::optional<Candidate>> kept(tries.size());
  parallel_for(
      tries.size(), o_.jobs,
      [&](size_t i) {
        Candidate c = tries[i];
        const std::optional<Program> prog = estimate(c);
        if (!prog || c.estimate.peak_memory > capacity_) return;
        if (!violated_constraint(cons_, prog->plan, *prog, c.estimate.bubble_fraction,
                                 c.estimate.peak_memory)
                 .empty()) {
          if (!rejected.empty()) reject(rejected);
          return;
        }
        c.status = "ok";
        kept[i] = c;
      },
      [&](size_t done_count, size_t all) {
        if (o_.progress) o_.progress(phase, done_count, all);
      });
  for (auto& c : kept) {
    if (c) feasible_.push_back(*c);
  }
}

// Re-partitions the stages of the most promising pipelines: those whose cheapest level
// estimates faster than the best plan found (or nearly), fitting or not.
void Search::balance_stages() {
  double best_time = std::numeric_limits<double>::infinity();
  for (const Candidate& c : feasible_) best_time = std::min(best_time, c.estimate.iteration_time);
  std::vector<size_t> promising;
  for (size_t i = 0; i < chains_.size(); ++i) {
    const MegatronOptions& b = chains_[i].base;
    if (b.pp > 1 && balanced_bound_[i] < best_time * (1 + kBalanceMargin)) {
      promising.push_back(i);
    }
  }
  std::sort(promising.begin(), promising.end(), [&](size_t a, size_t b) {
    return balanced_bound_[a] != balanced_bound_[b] ? balanced_bound_[a] < balanced_bound_[b]
                                                    : a < b;
  });
  if (promising.size() > kMaxBalanced) promising.resize(kMaxBalanced);
  std::optional<RecomputeMode> pinned_recompute =
      cons_.recompute ? cons_.recompute : pin_.recompute;
  if (!cons_.stage_recompute.empty()) pinned_recompute = RecomputeMode::kNone;
  std::vector<std::optional<Candidate>> balanced(promising.size());
  parallel_for(
      promising.size(), o_.jobs,
      [&](size_t i) {
        balanced[i] = balance_chain(model_, topo_, chains_[promising[i]], pinned_recompute,
                                    capacity_, cons_, evaluated_);
      },
      [&](size_t done_count, size_t all) {
        if (o_.progress) o_.progress("balancing stages", done_count, all);
      });
  result_.balanced = promising.size();
  for (size_t i = 0; i < balanced.size(); ++i) {
    if (!balanced[i]) continue;
    if (balanced[i]->estimate.iteration_time < chain_best_[promising[i]]) {
      ++result_.balanced_better;
      feasible_.push_back(*balanced[i]);
    }
  }
}

// The list-scheduled pipelines (zero bubble, Merak) for the best pipelined plans: same degrees,
// another schedule (ZB-V with two chunks per stage in a V).
void Search::try_schedules() {
  auto allowed = [&](ScheduleKind k) {
    return cons_.schedules.empty() ||
           std::find(cons_.schedules.begin(), cons_.schedules.end(), k) != cons_.schedules.end();
  };
  std::sort(feasible_.begin(), feasible_.end(), faster_estimate);
  std::vector<Candidate> tries;
  std::set<std::string> seen;
  for (const Candidate& c : feasible_) {
    if (seen.size() >= kMaxRescheduled) break;
    if (c.options.pp < 2 || !c.options.recompute_layers.empty()) continue;
    // The degrees, whatever the virtual stages and schedule.
    Candidate key = c;
    key.options.vpp = 1;
    key.options.schedule = ScheduleKind::kOneFOneB;
    key.options.stage_layers.clear();
    key.placement = "tp-innermost";
    if (!seen.insert(key.describe()).second) continue;
    std::vector<std::pair<ScheduleKind, int>> kinds;
    if (pin_.vpp.value_or(1) == 1) {
      kinds = {{ScheduleKind::kZbH1, 1}, {ScheduleKind::kZbH2, 1}};
      if (c.options.recompute != RecomputeMode::kNone) kinds.emplace_back(ScheduleKind::kMerak, 1);
    }
    if (2 * c.options.pp <= model_.layers && pin_.vpp.value_or(2) == 2) {
      kinds.emplace_back(ScheduleKind::kZbV, 2);
      // DualPipeV pairs blocks to hide expert all-to-alls: only where there are some.
      if (c.options.ep > 1) kinds.emplace_back(ScheduleKind::kDualPipeV, 2);
    }
    // Tessel's search (a solver run per plan) only when the constraints ask for it, on the
    // plan's own stages.
    const bool tessel = c.options.pp <= kMaxTesselStages &&
                        std::find(cons_.schedules.begin(), cons_.schedules.end(),
                                  ScheduleKind::kTessel) != cons_.schedules.end();
    if (tessel) kinds.emplace_back(ScheduleKind::kTessel, c.options.vpp);
    for (const auto& [kind, vpp] : kinds) {
      if (!allowed(kind)) continue;
      Candidate t = c;
      t.options.schedule = kind;
      t.options.vpp = vpp;
      if (kind == ScheduleKind::kDualPipeV) {
        // Its pairs hide the all-to-alls; the builder refuses the other ways of hiding them.
        t.options.ep_overlap = false;
        t.options.moe_shared_expert_overlap = false;
        t.options.tp_sub_batches = 1;
      }
      const bool same_stages = kind == ScheduleKind::kTessel;
      if (!same_stages && (vpp != c.options.vpp || !fixed_layers_)) t.options.stage_layers.clear();
      if (fixed_layers_) t.options.stage_layers = *fixed_layers_;
      if (fixed_layers_ && static_cast<int>(fixed_layers_->size()) != c.options.pp * vpp) continue;
      t.simulated.reset();
      tries.push_back(t);
      // The same chunks a rank as the plan's: its balanced split too (one chunk a stage: the
      // partitioner's), beside the even one.
      if (!same_stages && !fixed_layers_ && vpp == c.options.vpp &&
          !c.options.stage_layers.empty()) {
        t.options.stage_layers = c.options.stage_layers;
        tries.push_back(t);
      }
    }
  }
  // A V's first device runs both the embedding's segment and the head's: the segments' layers
  // evened out over the devices are tried beside the even split.
  std::vector<std::optional<Candidate>> evened(tries.size());
  parallel_for(
      tries.size(), o_.jobs,
      [&](size_t i) {
        const ScheduleKind kind = tries[i].options.schedule;
        const bool v = kind == ScheduleKind::kZbV || kind == ScheduleKind::kDualPipeV;
        if (fixed_layers_ || !v) return;
        if (std::optional<std::vector<int>> layers =
                evened_layers(model_, topo_, tries[i].options)) {
          evened[i] = tries[i];
          evened[i]->options.stage_layers = *layers;
        }
      },
      [&](size_t done_count, size_t all) {
        if (o_.progress) o_.progress("evening out V stages", done_count, all);
      });
  for (const std::optional<Candidate>& c : evened) {
    if (c) tries.push_back(*c);
  }
  result_.schedules_tried = tries.size();
  estimate_variants(tries, "scheduling", "");
  try_schedules_with_stage_recompute();
}

// The zero-bubble, Merak and V schedules with each stage (in a V, each device) recomputing only
// what it needs to fit (balance_chain, which re-partitions the layers too) for the best pipelined
// degree sets whose plans recompute, uniformly or per stage: try_schedules gives them the plan's
// uniform recomputation, or none, while their stages hold unequal numbers of micro-batches in
// flight.
void Search::try_schedules_with_stage_recompute() {
  if (fixed_layers_) return;
  std::optional<RecomputeMode> pinned = cons_.recompute ? cons_.recompute : pin_.recompute;
  if (pinned || !cons_.stage_recompute.empty()) return;  // nothing to choose per stage
  auto allowed = [&](ScheduleKind k) {
    return cons_.schedules.empty() ||
           std::find(cons_.schedules.begin(), cons_.schedules.end(), k) != cons_.schedules.end();
  };
  std::sort(feasible_.begin(), feasible_.end(), faster_estimate);
  std::vector<Chain> chains;
  std::set<std::string> seen;
  for (const Candidate& c : feasible_) {
    if (seen.size() >= kMaxRescheduled) break;
    if (c.options.pp < 2) continue;
    // Degrees whose plan fits without recomputing have their schedules tried as they are
    // (try_schedules).
    if (c.options.recompute == RecomputeMode::kNone && c.options.recompute_layers.empty()) {
      continue;
    }
    Chain chain;
    chain.base = c.options;
    chain.base.stage_layers.clear();
    chain.base.recompute = RecomputeMode::kNone;
    chain.base.recompute_layers.clear();
    chain.placement = c.placement;
    chain.levels = {{RecomputeMode::kNone, c.options.zero}};
    // The degrees, whatever the virtual stages and schedule.
    Candidate key = c;
    key.options = chain.base;
    key.options.vpp = 1;
    key.options.schedule = ScheduleKind::kOneFOneB;
    if (!seen.insert(key.describe()).second) continue;
    std::vector<std::pair<ScheduleKind, int>> kinds;
    if (pin_.vpp.value_or(1) == 1) {
      kinds = {{ScheduleKind::kZbH1, 1}, {ScheduleKind::kZbH2, 1}, {ScheduleKind::kMerak, 1}};
    }
    if (2 * c.options.pp <= model_.layers && pin_.vpp.value_or(2) == 2) {
      kinds.emplace_back(ScheduleKind::kZbV, 2);
      if (c.options.ep > 1) kinds.emplace_back(ScheduleKind::kDualPipeV, 2);
    }
    for (const auto& [kind, vpp] : kinds) {
      if (!allowed(kind)) continue;
      Chain v = chain;
      v.base.schedule = kind;
      v.base.vpp = vpp;
      if (kind == ScheduleKind::kDualPipeV) {
        // Its pairs hide the all-to-alls; the builder refuses the other ways of hiding them.
        v.base.ep_overlap = false;
        v.base.moe_shared_expert_overlap = false;
        v.base.tp_sub_batches = 1;
      }
      chains.push_back(v);
    }
  }
  std::vector<std::optional<Candidate>> fitted(chains.size());
  parallel_for(
      chains.size(), o_.jobs,
      [&](size_t i) {
        fitted[i] =
            balance_chain(model_, topo_, chains[i], std::nullopt, capacity_, cons_, evaluated_);
      },
      [&](size_t done_count, size_t all) {
        if (o_.progress) o_.progress("recomputing stages", done_count, all);
      });
  result_.recompute_schedules_tried = chains.size();
  for (std::optional<Candidate>& c : fitted) {
    if (c) feasible_.push_back(std::move(*c));
  }
}

// Variants of the fastest `most` feasible plans that `eligible` accepts, each as `apply`
// changes it.
template <class Eligible, class Apply>
std::vector<Candidate> Search::best_variants(size_t most, const Eligible& eligible,
                                             const Apply& apply) {
  std::sort(feasible_.begin(), feasible_.end(), faster_estimate);
  std::vector<Candidate> tries;
  for (const Candidate& c : feasible_) {
    if (tries.size() >= most) break;
    if (!eligible(c.options)) continue;
    Candidate t = c;
    apply(t.options);
    t.simulated.reset();
    tries.push_back(t);
  }
  return tries;
}

// Merak's sub-pipelined tensor parallelism for the best plans whose GPUs exchange activations
// inside a layer (tensor or expert parallel) and run sequences enough per micro-batch to split.
void Search::try_sub_pipelining() {
  const int k = o_.tp_sub_batches;
  const std::vector<Candidate> tries = best_variants(
      kMaxSubPipelined,
      [&](const MegatronOptions& x) {
        return (x.tp > 1 || x.ep > 1) && x.micro_batch % k == 0 && x.tp_sub_batches == 1 &&
               !x.ep_overlap;
      },
      [&](MegatronOptions& x) { x.tp_sub_batches = k; });
  result_.sub_pipelined_tried = tries.size();
  estimate_variants(tries, "sub-pipelining", "");
}

// Megatron-Core's combined 1F1B for the best plans with expert parallelism that run without a
// pipeline or with virtual stages (what it requires): pairs hide all-to-alls but make every
// pair wait for both its inputs, so it is a variant to estimate, not a given.
void Search::try_ep_overlap() {
  const std::vector<Candidate> tries = best_variants(
      kMaxEpOverlapped,
      [](const MegatronOptions& x) {
        return x.ep > 1 && !x.ep_overlap && x.tp_sub_batches == 1 &&
               (x.pp == 1 || x.schedule == ScheduleKind::kInterleaved);
      },
      [](MegatronOptions& x) {
        x.ep_overlap = true;
        x.moe_shared_expert_overlap = false;  // Megatron-Core refuses the two together
      });
  result_.ep_overlap_tried = tries.size();
  estimate_variants(tries, "combined 1F1B", "");
}

// Other rank placements for the best plans (nnScaler-M): every order of the mesh axes that
// places ranks differently, priced on the topology by the estimator.
void Search::try_placements() {
  std::sort(feasible_.begin(), feasible_.end(), faster_estimate);
  std::vector<Candidate> tries;
  std::set<std::string> degrees_seen;
  for (const Candidate& c : feasible_) {
    if (degrees_seen.size() >= kMaxPlaced) break;
    Candidate degrees = c;
    degrees.placement = "tp-innermost";
    if (!degrees_seen.insert(degrees.describe()).second) continue;
    // The placements evaluated with the degrees.
    std::vector<std::vector<std::string>> done = {{"pp", "dp", "cp", "tp"}};
    if (c.options.tp > 1 && c.options.dp > 1) done.push_back({"pp", "cp", "tp", "dp"});
    for (const auto& order : distinct_orders(c.options, done)) {
      const std::string name = order_name(c.options, order);
      Candidate t = c;
      t.options.placement = order;
      t.placement = name;
      t.simulated.reset();
      tries.push_back(t);
    }
  }
  result_.placements_tried = tries.size();
  estimate_variants(tries, "placing ranks", "placement constraints");
}

// Nothing even to try: the pinned choices themselves cannot work. The builder says why.
Status Search::why_nothing_to_try() const {
  MegatronOptions b;
  b.global_batch = o_.global_batch;
  b.framework = o_.framework;
  b.costs = o_.compile;
  b.avoid_gpus = avoid_;
  if (pin_.tp) b.tp = *pin_.tp;
  if (pin_.pp) b.pp = *pin_.pp;
  if (pin_.cp) b.cp = *pin_.cp;
  if (pin_.ep) b.ep = *pin_.ep;
  if (pin_.expert_tp) b.expert_tp = *pin_.expert_tp;
  if (pin_.dp) b.dp = *pin_.dp;
  if (pin_.vpp) b.vpp = *pin_.vpp;
  if (pin_.micro_batch) b.micro_batch = *pin_.micro_batch;
  if (pin_.sequence_parallel) b.sequence_parallel = *pin_.sequence_parallel;
  if (pin_.schedule) b.schedule = *pin_.schedule;
  if (pin_.stage_layers) b.stage_layers = *pin_.stage_layers;
  if (b.vpp > 1 && !pin_.schedule) b.schedule = ScheduleKind::kInterleaved;
  Expected<Plan> p = build_megatron_plan(model_, topo_, b);
  if (!p) return p.error();
  return Status::Ok();
}

// No plan feasible: how many candidates each reason removed, most first.
Error Search::none_feasible() const {
  std::string msg = "no plan is feasible";
  if (!cons_.file.empty()) msg += fmt::format(" under the constraints of {}", cons_.file);
  msg += fmt::format(" ({} candidates enumerated):", result_.enumerated);
  std::vector<std::pair<std::string, size_t>> sorted = result_.rejections;
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& [why, n] : sorted) msg += fmt::format("\n  {:>7} removed by {}", n, why);
  msg += "\nrelax the constraints that removed the most, or use more GPUs";
  // Memory was what ruled plans out and the host could take optimizer state.
  const bool memory = std::any_of(sorted.begin(), sorted.end(), [](const auto& r) {
    return r.first == "does not fit in memory";
  });
  if (memory && topo_.has_host && o_.optimizer_offload == 0 && !o_.offload_as_needed) {
    msg += ", or keep optimizer state in host memory (--optimizer-offload auto)";
  }
  if (memory && topo_.has_host && o_.framework == "megatron" && !o_.activation_offload_as_needed) {
    msg += ", or activations on one pipeline stage (--activation-offload auto)";
  }
  if (memory && topo_.has_host && o_.framework == "megatron" && !o_.module_offload_as_needed) {
    msg += ", or chosen modules' activations (--offload-modules auto)";
  }
  return Error(msg);
}

// Ranks the feasible plans by estimate, confirms the best by simulation, and builds the winner.
Expected<SearchResult> Search::rank_and_confirm() {
  // Rank by estimate; deterministic tie-break on the description.
  auto by_time = [](const Candidate& a, const Candidate& b) {
    if (a.time() != b.time()) return a.time() < b.time();
    return a.describe() < b.describe();
  };
  std::sort(feasible_.begin(), feasible_.end(), by_time);
  // The ranking keeps each set of degrees once, at its best placement; the other placements
  // of the winner are reported beside it.
  auto degrees_of = [](const Candidate& c) {
    Candidate d = c;
    d.placement = "tp-innermost";
    return d.describe();
  };
  std::vector<Candidate> all_placed = feasible_;
  {
    std::set<std::string> seen_degrees;
    std::vector<Candidate> unique;
    for (const Candidate& c : feasible_) {
      if (seen_degrees.insert(degrees_of(c)).second) unique.push_back(c);
    }
    feasible_ = unique;
  }

  // Confirm the best by simulation.
  if (o_.simulate && o_.confirm > 0) {
    const size_t n = std::min<size_t>(o_.confirm, feasible_.size());
    // Several at once: each simulation runs in a child process of its own.
    parallel_for(
        n, o_.jobs,
        [&](size_t i) {
          Candidate& c = feasible_[i];
          Expected<Plan> plan = build_megatron_plan(model_, topo_, c.options);
          if (!plan) return;  // estimated already, so not expected; the estimate stands
          Expected<Program> prog = compile_plan(*plan, topo_, c.options.costs);
          if (!prog) return;
          Expected<double> t = o_.simulate(*prog);
          if (t) c.simulated = *t;
        },
        [&](size_t done, size_t total) {
          if (o_.progress) o_.progress("simulating", done, total);
        });
    result_.confirmed = n;
    // How often the estimator orders two confirmed plans differently from the simulator.
    for (size_t a = 0; a < n; ++a) {
      for (size_t b = a + 1; b < n; ++b) {
        if (!feasible_[a].simulated || !feasible_[b].simulated) continue;
        ++result_.rank_pairs;
        const bool est =
            feasible_[a].estimate.iteration_time <= feasible_[b].estimate.iteration_time;
        const bool sim = *feasible_[a].simulated <= *feasible_[b].simulated;
        if (est != sim) ++result_.rank_disagreements;
      }
    }
    std::stable_sort(feasible_.begin(), feasible_.begin() + n, by_time);
  }
  std::set<std::string> seen;
  for (const Candidate& c : all_placed) {
    if (seen.insert(c.placement).second) result_.best_per_placement.push_back(c);
  }
  const std::string winner = degrees_of(feasible_.front());
  for (const Candidate& c : all_placed) {
    if (degrees_of(c) == winner && c.placement != feasible_.front().placement) {
      result_.other_placements_of_best.push_back(c);
    }
  }
  Expected<Plan> best = build_megatron_plan(model_, topo_, feasible_.front().options);
  if (!best) return best.error();
  result_.best = *best;
  if (feasible_.size() > static_cast<size_t>(o_.top)) feasible_.resize(o_.top);
  result_.ranked = feasible_;
  std::sort(lost_.begin(), lost_.end(), by_time);
  if (lost_.size() > static_cast<size_t>(o_.top)) lost_.resize(o_.top);
  result_.rejected = lost_;
  return result_;
}

}  // namespace

Expected<SearchResult> search_plans(const ModelSpec& model, const Topology& topo,
                                    const SearchOptions& o) {
  if (o.global_batch < 1) return Error("--global-batch is required for a search");
  if (o.offload_as_needed && o.optimizer_offload > 0) {
    return Error(
        "the search offloads either the fraction given or as much as each plan needs "
        "(--optimizer-offload auto), not both");
  }
  if (Status st = check_optimizer_offload(o.offload_as_needed ? 1.0 : o.optimizer_offload,
                                          o.offload_overlap, o.framework, topo, o.offload_params);
      !st) {
    return st.error();
  }
  // Either form of activation offloading needs Megatron-Core and a host.
  for (const auto& [on, flag, form] :
       {std::tuple{o.activation_offload_as_needed, "--activation-offload auto",
                   "Transformer Engine's CPU offload"},
        std::tuple{o.module_offload_as_needed, "--offload-modules auto",
                   "--fine-grained-activation-offloading"},
        std::tuple{!o.constraints.offload_modules.empty(), "offload_modules (--offload-modules)",
                   "--fine-grained-activation-offloading"}}) {
    if (!on) continue;
    if (o.framework != "megatron") {
      return Error(
          fmt::format("{}: activation offloading is Megatron-Core's ({}), not --framework {}'s",
                      flag, form, o.framework));
    }
    if (!topo.has_host) {
      return Error(fmt::format(
          "{} keeps activations in host memory, but topology '{}' describes no host: add "
          "node.host (memory, memory_bandwidth, link_bandwidth; docs/topology.md)",
          flag, topo.name));
    }
  }
  if (o.moe_deepep && !model.moe()) {
    return Error(
        fmt::format("--moe-deepep exchanges a mixture of experts' tokens, but model '{}' has none "
                    "(model.experts); drop the flag",
                    model.name));
  }
  if (o.moe_shared_expert_overlap && model.shared_expert_ffn_hidden <= 0) {
    return Error(fmt::format(
        "--moe-shared-expert-overlap runs a shared expert beside the all-to-alls, but model '{}' "
        "has none (model.shared_expert_ffn_hidden); drop the flag",
        model.name));
  }
  if (o.ep_overlap && !model.moe()) {
    return Error(
        fmt::format("--ep-overlap hides a mixture of experts' all-to-alls, but model '{}' has none "
                    "(model.experts); drop the flag",
                    model.name));
  }
  if (o.moe_grouped_gemm && !model.moe()) {
    return Error(fmt::format(
        "--moe-grouped-gemm groups a mixture of experts' GEMMs, but model '{}' has none "
        "(model.experts); drop the flag",
        model.name));
  }
  const Constraints& cons = o.constraints;
  // GPUs to avoid (constraints): degrees still divide the cluster, data parallelism takes what
  // the usable GPUs allow and the rest stay idle.
  std::vector<int> avoid = cons.avoid_gpus;
  for (int node : cons.avoid_nodes) {
    if (node < 0 || node >= topo.nodes) {
      return Error(
          fmt::format("{}: field 'avoid_nodes': node {} does not exist (topology '{}' has "
                      "nodes 0-{})",
                      cons.file, node, topo.name, topo.nodes - 1));
    }
    for (int g = 0; g < topo.gpus_per_node; ++g) avoid.push_back(node * topo.gpus_per_node + g);
  }
  std::sort(avoid.begin(), avoid.end());
  avoid.erase(std::unique(avoid.begin(), avoid.end()), avoid.end());
  Expected<std::vector<int>> usable = usable_gpus(topo, avoid);
  if (!usable)
    return Error(fmt::format("{}: field 'avoid_gpus': {}", cons.file, usable.error().message()));
  const int usable_count = static_cast<int>(usable->size());
  if (Status st = check_recompute_modules(model, cons.recompute_modules); !st) {
    return Error(fmt::format("{}: field 'recompute_modules': {}", cons.file, st.error().message()));
  }
  if (Expected<std::vector<std::string>> m = offload_module_patterns(model, cons.offload_modules);
      !m) {
    return Error(fmt::format("{}: field 'offload_modules': {}", cons.file, m.error().message()));
  }
  // Plans keep headroom for the caching allocator's reserve and fragmentation, which the memory
  // model does not count; a memory_cap constraint replaces it.
  const double capacity = cons.memory_cap ? std::min(*cons.memory_cap, topo.gpu.hbm_bytes)
                                          : topo.gpu.hbm_bytes * (1 - o.memory_headroom);
  Search search(model, topo, o, std::move(avoid), usable_count, capacity);
  return search.run();
}

}  // namespace nnsim
