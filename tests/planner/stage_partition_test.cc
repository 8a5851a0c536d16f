// Automatic stage partitioning: the dynamic programme against brute force, stage costs measured
// from compiled plans, and the plans it gives (balanced head, stage-aware recomputation).
#include "planner/stage_partition.h"

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <map>
#include <numeric>

#include <gtest/gtest.h>

#include "core/memory_check.h"
#include "planner/estimator.h"
#include "planner/megatron.h"
#include "planner/search.h"

namespace nnsim {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

StageCosts stage(int in_flight, double other_seconds = 0) {
  StageCosts c;
  c.blocks.resize(1);
  c.blocks[0].seconds = 1.0;
  c.blocks[0].recompute_seconds = 0.3;
  c.blocks[0].static_bytes = 1 * kGiB;
  c.blocks[0].activation_bytes = 0.5 * kGiB;
  c.blocks[0].recomputed_activation_bytes = 0.05 * kGiB;
  c.other_seconds = other_seconds;
  c.in_flight = in_flight;
  c.fixed_bytes = 2 * kGiB;
  return c;
}

// `stage` with a dense block too: cheaper to run, much smaller (no experts), same activations.
StageCosts mixed_stage(int in_flight, double other_seconds = 0) {
  StageCosts c = stage(in_flight, other_seconds);
  c.blocks.push_back(c.blocks[0]);
  c.blocks[1].seconds = 0.6;
  c.blocks[1].recompute_seconds = 0.2;
  c.blocks[1].static_bytes = 0.1 * kGiB;
  return c;
}

using Layers = std::vector<LayerTraits>;

Layers uniform(int layers) {
  return Layers(layers);
}

// One layer per entry, dense where true.
Layers with_dense(const std::vector<bool>& dense) {
  Layers out(dense.size());
  for (size_t l = 0; l < dense.size(); ++l) out[l].block = dense[l] ? 1 : 0;
  return out;
}

const LayerCosts& shape(const StageCosts& c, const LayerTraits& layer) {
  return c.blocks[layer.block];
}

// A stage holding layers [first, first + n) of `layers`, recomputing its first k.
double bytes(const StageCosts& c, const Layers& layers, int first, int n, int k) {
  double b = c.fixed_bytes;
  for (int l = first; l < first + n; ++l) {
    const LayerCosts& x = shape(c, layers[l]);
    b += x.static_bytes +
         c.in_flight * (l < first + k ? x.recomputed_activation_bytes : x.activation_bytes);
  }
  return b;
}

double seconds(const StageCosts& c, const Layers& layers, int first, int n, int k) {
  double t = c.other_seconds;
  for (int l = first; l < first + n; ++l) {
    const LayerCosts& x = shape(c, layers[l]);
    t += x.seconds - layers[l].window_seconds +
         (l < first + k ? x.recompute_seconds - layers[l].recompute_window_seconds : 0);
  }
  return t;
}

double bytes(const StageCosts& c, int n, int k) {
  return bytes(c, uniform(n), 0, n, k);
}

// The best slowest-stage time over every split and every recompute count, by enumeration.
double brute_force(const std::vector<StageCosts>& stages, const Layers& dense, double capacity) {
  const int layers = static_cast<int>(dense.size());
  double best = 1e300;
  std::function<void(size_t, int, double)> walk = [&](size_t s, int first, double slowest) {
    if (slowest >= best) return;
    if (s == stages.size()) {
      if (first == layers) best = std::min(best, slowest);
      return;
    }
    for (int x = 1; first + x <= layers; ++x) {
      for (int k = 0; k <= x; ++k) {
        if (bytes(stages[s], dense, first, x, k) > capacity) continue;
        walk(s + 1, first + x, std::max(slowest, seconds(stages[s], dense, first, x, k)));
        break;  // more recomputation only costs time
      }
    }
  };
  walk(0, 0, 0);
  return best;
}

void expect_valid(const StagePartition& p, const std::vector<StageCosts>& stages,
                  const Layers& dense, double capacity) {
  ASSERT_EQ(p.layers.size(), stages.size());
  EXPECT_EQ(std::accumulate(p.layers.begin(), p.layers.end(), 0), static_cast<int>(dense.size()));
  double slowest = 0;
  int first = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    EXPECT_GE(p.layers[s], 1);
    EXPECT_GE(p.recomputed[s], 0);
    EXPECT_LE(p.recomputed[s], p.layers[s]);
    EXPECT_LE(bytes(stages[s], dense, first, p.layers[s], p.recomputed[s]), capacity)
        << "stage " << s;
    slowest = std::max(slowest, seconds(stages[s], dense, first, p.layers[s], p.recomputed[s]));
    first += p.layers[s];
  }
  EXPECT_NEAR(slowest, p.slowest_stage_seconds, 1e-9);
}

TEST(StagePartition, HeadOnTheLastStageGivesItFewerLayers) {
  // 4 stages, 32 layers, the head costs 2.5 layers: uniform 8 each makes the last stage 10.5.
  std::vector<StageCosts> stages = {stage(4), stage(3), stage(2), stage(1, 2.5)};
  Expected<StagePartition> p = partition_stages(stages, uniform(32), 1000 * kGiB);
  ASSERT_TRUE(p.ok()) << p.error().message();
  expect_valid(*p, stages, uniform(32), 1000 * kGiB);
  EXPECT_LT(p->layers[3], 8);
  EXPECT_DOUBLE_EQ(p->slowest_stage_seconds, brute_force(stages, uniform(32), 1000 * kGiB));
  EXPECT_DOUBLE_EQ(p->slowest_stage_seconds, 9.0);  // 9,9,9 + 5 layers and the head (7.5)
  for (int k : p->recomputed) EXPECT_EQ(k, 0);
}

TEST(StagePartition, EarlyStagesRecomputeWhatTheirInFlightMicroBatchesNeed) {
  // Under 1F1B stage s holds p - s micro-batches: with 5 layers each, stage 0 needs
  // 2 + 5 + 6 x 5 x 0.5 = 22 GiB, stage 5 only 9.5 GiB. Capacity 14 GiB.
  std::vector<StageCosts> stages;
  for (int s = 0; s < 6; ++s) stages.push_back(stage(6 - s, s == 5 ? 1.5 : 0));
  const double capacity = 14 * kGiB;
  Expected<StagePartition> p = partition_stages(stages, uniform(30), capacity);
  ASSERT_TRUE(p.ok()) << p.error().message();
  expect_valid(*p, stages, uniform(30), capacity);
  EXPECT_NEAR(p->slowest_stage_seconds, brute_force(stages, uniform(30), capacity), 1e-9);
  EXPECT_GT(p->recomputed.front(), 0);
  EXPECT_EQ(p->recomputed.back(), 0);  // the last stage holds one micro-batch: no recompute
  // Less recomputation than recomputing everything, and faster.
  EXPECT_LT(std::accumulate(p->recomputed.begin(), p->recomputed.end(), 0), 30);
  EXPECT_LT(p->slowest_stage_seconds, 5 * 1.3 + 1.5);
}

TEST(StagePartition, SaysWhenNothingFits) {
  std::vector<StageCosts> stages = {stage(2), stage(1)};
  Expected<StagePartition> p = partition_stages(stages, uniform(16), 8 * kGiB);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("no split of 16 layers over 2 stages fits"), std::string::npos)
      << p.error().message();
  EXPECT_FALSE(partition_stages(stages, uniform(1), 100 * kGiB).ok());  // fewer than stages
}

// The split at each capacity is valid and as fast as the best of every split (brute force).
void expect_best_at(const std::vector<StageCosts>& stages, const Layers& dense,
                    std::initializer_list<double> capacities) {
  for (double capacity : capacities) {
    Expected<StagePartition> p = partition_stages(stages, dense, capacity);
    ASSERT_TRUE(p.ok()) << p.error().message();
    expect_valid(*p, stages, dense, capacity);
    EXPECT_NEAR(p->slowest_stage_seconds, brute_force(stages, dense, capacity), 1e-9)
        << "capacity " << capacity / kGiB << " GiB";
  }
}

// A hybrid model's three layer kinds (Nemotron-H's pattern: Mamba-2, MLP and now and then
// attention), each at its own time, size and activations: the split and the recomputation are
// the best of every split (brute force), recomputing the layers in the order they come.
TEST(StagePartition, HybridLayersCountAtTheirOwnCost) {
  const std::string pattern = "M-M-M*-M-M-M*-M-M-M*-M-";
  Layers layers(pattern.size());
  for (size_t l = 0; l < pattern.size(); ++l) {
    layers[l].block = pattern[l] == 'M' ? 0 : pattern[l] == '-' ? 1 : 2;
  }
  std::vector<StageCosts> stages;
  for (int s = 0; s < 3; ++s) {
    StageCosts c = stage(3 - s, s == 2 ? 1.2 : 0);  // shape 0: the Mamba-2 layer
    LayerCosts mlp = c.blocks[0];
    mlp.seconds = 0.8;
    mlp.recompute_seconds = 0.25;
    mlp.static_bytes = 1.5 * kGiB;
    mlp.activation_bytes = 0.3 * kGiB;
    LayerCosts attention = c.blocks[0];
    attention.seconds = 0.6;
    attention.recompute_seconds = 0.2;
    attention.static_bytes = 0.3 * kGiB;
    attention.activation_bytes = 0.7 * kGiB;
    c.blocks.push_back(mlp);
    c.blocks.push_back(attention);
    stages.push_back(c);
  }
  expect_best_at(stages, layers, {1000 * kGiB, 18 * kGiB, 15 * kGiB, 13 * kGiB});
}

// DeepSeek's layout: the first 3 of 27 layers dense, cheaper and without experts. The stage
// holding them takes more layers than an even split gives it, and recomputes the layers it must
// in the order they come (dense ones first), as the brute force over every split does.
TEST(StagePartition, DenseBlocksCountAtTheirOwnCost) {
  std::vector<bool> dense(27, false);
  for (int l = 0; l < 3; ++l) dense[l] = true;
  std::vector<StageCosts> stages;
  for (int s = 0; s < 3; ++s) stages.push_back(mixed_stage(3 - s, s == 2 ? 1.0 : 0));
  expect_best_at(stages, with_dense(dense), {1000 * kGiB, 16 * kGiB, 12 * kGiB});
  // Without a memory limit: 9 layers per stage take 3 x 0.6 + 6 = 7.8 s, 9 s and 10 s (the
  // head); 10, 9 and 8 layers take 8.8 s, 9 s and 9 s.
  Expected<StagePartition> p = partition_stages(stages, with_dense(dense), 1000 * kGiB);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->layers, (std::vector<int>{10, 9, 8}));
  EXPECT_DOUBLE_EQ(p->slowest_stage_seconds, 9.0);
  // Dense and expert layers alternating (Llama 4, Qwen2-MoE), recomputation needed.
  std::vector<bool> odd(24, false);
  for (int l = 0; l < 24; l += 2) odd[l] = true;
  std::vector<StageCosts> four;
  for (int s = 0; s < 4; ++s) four.push_back(mixed_stage(4 - s, s == 3 ? 1.5 : 0));
  expect_best_at(four, with_dense(odd), {1000 * kGiB, 10 * kGiB, 8 * kGiB});
}

// Gemma's layout: a full-attention layer every third, the others within a window and cheaper
// (their recomputation too). The split weighs each layer at its own cost, as the brute force
// over every split does.
TEST(StagePartition, WindowedLayersCountAtTheirOwnCost) {
  Layers layers(24);
  for (int l = 0; l < 24; ++l) {
    if ((l + 1) % 3 == 0) continue;
    layers[l].window_seconds = 0.5;
    layers[l].recompute_window_seconds = 0.1;
  }
  std::vector<StageCosts> stages;
  for (int s = 0; s < 4; ++s) stages.push_back(stage(4 - s, s == 3 ? 1.0 : 0));
  expect_best_at(stages, layers, {1000 * kGiB, 14 * kGiB, 11 * kGiB});
  // Without a memory limit: 16 windowed layers at 0.5 s and 8 full ones at 1 s (16 s) and the
  // head (1 s) over 4 stages: 4.25 s at best. The even split's stages take 4, 4, 4 and 5 s.
  Expected<StagePartition> p = partition_stages(stages, layers, 1000 * kGiB);
  ASSERT_TRUE(p.ok());
  EXPECT_LE(p->slowest_stage_seconds, 4.5);
  EXPECT_LT(p->layers.back(), 6);
  const std::vector<double> split = stage_seconds(stages, layers, p->layers);
  EXPECT_DOUBLE_EQ(*std::max_element(split.begin(), split.end()), p->slowest_stage_seconds);
  EXPECT_EQ(stage_seconds(stages, layers, {6, 6, 6, 6}), (std::vector<double>{4, 4, 4, 5}));
}

// The busiest device's time of a split over virtual stages (StageCosts::device).
double busiest_device(const std::vector<StageCosts>& segments, const Layers& layers, int devices,
                      const std::vector<int>& split) {
  std::vector<double> device(devices, 0);
  int first = 0;
  for (size_t k = 0; k < split.size(); ++k) {
    device[segments[k].device] += seconds(segments[k], layers, first, split[k], 0);
    first += split[k];
  }
  return *std::max_element(device.begin(), device.end());
}

// The least busiest-device time over every split (each segment a layer at least, the last
// none at least), by enumeration.
double best_busiest_device(const std::vector<StageCosts>& segments, const Layers& layers,
                           int devices) {
  const int n = static_cast<int>(segments.size());
  const int total = static_cast<int>(layers.size());
  double best = 1e300;
  std::vector<int> split(n, 0);
  std::function<void(int, int)> walk = [&](int k, int left) {
    if (k == n - 1) {
      split[k] = left;
      best = std::min(best, busiest_device(segments, layers, devices, split));
      return;
    }
    for (int x = 1; x <= left - (n - 2 - k); ++x) {
      split[k] = x;
      walk(k + 1, left - x);
    }
  };
  walk(0, total);
  return best;
}

// Two devices, two chunks each, 16 layers, the head (2.5 layers' time) on the last chunk: the
// even split loads the head's device with 10.5 s against 8. Moving layers one at a time evens
// the two out as well as any split does, with sliding windows too.
TEST(StagePartition, VirtualStagesEvenOutTheDevices) {
  std::vector<StageCosts> segments = {stage(1), stage(1), stage(1), stage(1, 2.5)};
  for (int k = 0; k < 4; ++k) segments[k].device = k % 2;
  const std::vector<int> even = {4, 4, 4, 4};
  EXPECT_DOUBLE_EQ(busiest_device(segments, uniform(16), 2, even), 10.5);
  std::vector<int> split = balance_virtual_stages(segments, uniform(16), even);
  EXPECT_EQ(std::accumulate(split.begin(), split.end(), 0), 16);
  EXPECT_DOUBLE_EQ(busiest_device(segments, uniform(16), 2, split), 9.5);
  EXPECT_DOUBLE_EQ(busiest_device(segments, uniform(16), 2, split),
                   best_busiest_device(segments, uniform(16), 2));
  Layers windowed(16);
  for (int l = 0; l < 16; ++l) windowed[l].window_seconds = (l + 1) % 4 == 0 ? 0 : 0.6;
  split = balance_virtual_stages(segments, windowed, even);
  EXPECT_LT(busiest_device(segments, windowed, 2, split),
            busiest_device(segments, windowed, 2, even));
  EXPECT_DOUBLE_EQ(busiest_device(segments, windowed, 2, split),
                   best_busiest_device(segments, windowed, 2));
}

Program compile(const ModelSpec& model, const Topology& topo, const MegatronOptions& o) {
  Expected<Plan> plan = build_megatron_plan(model, topo, o);
  EXPECT_TRUE(plan.ok()) << plan.error().message();
  Expected<Program> prog = compile_plan(*plan, topo);
  EXPECT_TRUE(prog.ok()) << prog.error().message();
  return *prog;
}

struct Llama8bOnOneNode : ::testing::Test {
  void SetUp() override {
    Expected<ModelSpec> m = load_model("llama3-8b");
    ASSERT_TRUE(m.ok());
    model = *m;
    Expected<Topology> t = load_topology("dgx-h100-superpod");
    ASSERT_TRUE(t.ok());
    Expected<Topology> r = resize_topology(*t, 1);
    ASSERT_TRUE(r.ok());
    topo = *r;
    o.tp = 2;
    o.pp = 4;
    o.sequence_parallel = true;
    o.global_batch = 64;
  }
  // An 8-layer mixture of experts (`name`) at 2,048 tokens over the fixture's 4 stages, with
  // expert parallelism 2 and no tensor parallelism.
  Program compile_small_moe(const std::string& name) {
    Expected<ModelSpec> m = load_model(name);
    EXPECT_TRUE(m.ok());
    m->layers = 8;
    m->seq_len = 2048;
    o.tp = 1;
    o.sequence_parallel = false;
    o.ep = 2;
    return compile(*m, topo, o);
  }
  // A search of global batch 64 with the degrees, the micro-batch, 1F1B and the placement
  // pinned: what is left to it is recomputation, ZeRO and the stages' split.
  static SearchOptions pinned_1f1b(int tp, int pp, int micro_batch) {
    SearchOptions so;
    so.global_batch = 64;
    so.jobs = 2;
    so.confirm = 0;
    so.pins.tp = tp;
    so.pins.pp = pp;
    so.pins.vpp = 1;
    so.pins.micro_batch = micro_batch;
    so.pins.schedule = ScheduleKind::kOneFOneB;
    so.pins.placement = std::vector<std::string>{"pp", "dp", "cp", "tp"};
    return so;
  }
  ModelSpec model;
  Topology topo;
  MegatronOptions o;
};

// DeepSeekMoE's first layer is dense: its costs are measured on the stage that holds it (with an
// expert layer beside it) and lent to the stages that hold none; the linear memory model still
// reproduces every stage's peak.
TEST_F(Llama8bOnOneNode, MixedBlocksArePricedPerShape) {
  o.global_batch = 16;
  Program plain = compile_small_moe("deepseek-moe-16b");  // 4 stages of 2 layers
  Expected<std::vector<StageCosts>> costs = measure_stage_costs(plain, plain);
  ASSERT_TRUE(costs.ok()) << costs.error().message();
  ASSERT_EQ(costs->size(), 4u);
  // The expert block is shape 0, the first (dense) layer's shape 1.
  ASSERT_EQ(plain.graph.block_of_layer, (std::vector<int>{1, 0, 0, 0, 0, 0, 0, 0}));
  const std::vector<bool> dense{true, false, false, false, false, false, false, false};
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(plain);
  for (int s = 0; s < 4; ++s) {
    const StageCosts& c = (*costs)[s];
    // 64 experts over ep 2 against one 10,944-wide MLP; the all-to-alls and the router.
    EXPECT_LT(c.blocks[1].static_bytes, c.blocks[0].static_bytes / 3);
    EXPECT_LT(c.blocks[1].seconds, c.blocks[0].seconds);
    EXPECT_GT(c.blocks[1].seconds, 0.5 * c.blocks[0].seconds);
    EXPECT_NEAR(c.blocks[0].seconds, (*costs)[1].blocks[0].seconds, 0.01 * c.blocks[0].seconds);
    EXPECT_DOUBLE_EQ(c.blocks[1].seconds, (*costs)[0].blocks[1].seconds);
    EXPECT_NEAR(bytes(c, with_dense(dense), 2 * s, 2, 0), peaks[s].peak, 1e-6 * peaks[s].peak);
  }
}

// The busy time of each segment's blocks (forward and backward, the slowest variant of each).
std::vector<double> measured_stage_seconds(const Program& p) {
  const std::vector<TemplateTime> times = template_times(p);
  std::map<std::pair<int, int>, double> worst;
  for (size_t t = 0; t < p.templates.size(); ++t) {
    const TemplateTime& x = times[t];
    double& w = worst[{p.templates[t].segment, static_cast<int>(p.templates[t].kind)}];
    w = std::max(w, x.layers + x.layers_recompute + x.other);
  }
  std::vector<double> out(p.plan.segments.size(), 0);
  for (const auto& [key, seconds] : worst) out[key.first] += seconds;
  return out;
}

// Sliding windows with a full layer every third (32 layers: 2, 5, ..., 29): stages 1 and 2 hold
// three full layers, stages 0 and 3 two. Every stage's costs are a full layer's, and each
// windowed layer takes off what its window saves, which reproduces every stage's time.
TEST_F(Llama8bOnOneNode, WindowedLayersArePricedApartFromFullOnes) {
  model.sliding_window = 1024;
  model.full_attention_interval = 3;
  Program plain = compile(model, topo, o);
  Expected<std::vector<StageCosts>> costs = measure_stage_costs(plain, plain);
  ASSERT_TRUE(costs.ok()) << costs.error().message();
  const Layers layers = layer_traits(plain, plain);
  ASSERT_EQ(layers.size(), 32u);
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(layers[l].window_seconds > 0, model.is_windowed_layer(l)) << "layer " << l;
    EXPECT_EQ(layers[l].recompute_window_seconds, 0);
  }
  const double full = costs->front().blocks[0].seconds;
  EXPECT_GT(layers[0].window_seconds, 0.05 * full);
  const std::vector<double> measured = measured_stage_seconds(plain);
  for (int s = 0; s < 4; ++s) {
    EXPECT_NEAR((*costs)[s].blocks[0].seconds, full, 0.01 * full) << "stage " << s;
    EXPECT_NEAR(seconds((*costs)[s], layers, 8 * s, 8, 0), measured[s], 1e-6 * measured[s])
        << "stage " << s;
  }
}

// Nemotron-H 8B's layers (Mamba-2, MLP, attention) over 4 stages of 13: each kind is priced on
// its own, and the linear model reproduces every stage's measured time and memory peak.
TEST_F(Llama8bOnOneNode, HybridLayersArePricedPerKind) {
  Expected<ModelSpec> m = load_model("nemotron-h-8b");
  ASSERT_TRUE(m.ok()) << m.error().message();
  o.global_batch = 16;
  Program plain = compile(*m, topo, o);
  Expected<std::vector<StageCosts>> costs = measure_stage_costs(plain, plain);
  ASSERT_TRUE(costs.ok()) << costs.error().message();
  const Layers layers = layer_traits(plain, plain);
  ASSERT_EQ(layers.size(), 52u);
  EXPECT_EQ(layers[7].block, 2);  // the first attention layer
  const std::vector<double> measured = measured_stage_seconds(plain);
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(plain);
  for (int s = 0; s < 4; ++s) {
    const StageCosts& c = (*costs)[s];
    ASSERT_EQ(c.blocks.size(), 3u);
    // The kinds differ: no shape's cost is another's.
    EXPECT_GT(std::abs(c.blocks[0].seconds / c.blocks[1].seconds - 1), 0.05) << "stage " << s;
    EXPECT_GT(std::abs(c.blocks[0].seconds / c.blocks[2].seconds - 1), 0.05) << "stage " << s;
    EXPECT_GT(std::abs(c.blocks[1].seconds / c.blocks[2].seconds - 1), 0.05) << "stage " << s;
    // The MLP layer holds the most weights (2 x 4096 x 21504 against the mixer's 4096 x 26,752
    // and 8,192 x 4096, the attention's 4096 x 6,144 and 4096 x 4096).
    EXPECT_GT(c.blocks[1].static_bytes, c.blocks[0].static_bytes);
    EXPECT_GT(c.blocks[0].static_bytes, 2 * c.blocks[2].static_bytes);
    EXPECT_NEAR(seconds(c, layers, 13 * s, 13, 0), measured[s], 1e-6 * measured[s])
        << "stage " << s;
    EXPECT_NEAR(bytes(c, layers, 13 * s, 13, 0), peaks[s].peak, 1e-6 * peaks[s].peak)
        << "stage " << s;
  }
}

// Expert parallelism holds 1/ep of a layer's experts on a GPU: a middle stage's static memory
// is its layers' and nothing else.
TEST_F(Llama8bOnOneNode, StaticBytesPerLayerFollowExpertParallelism) {
  o.global_batch = 16;
  Program plain = compile_small_moe("mixtral-8x7b");  // 4 stages of 2 layers, dp 2
  Expected<std::vector<StageCosts>> costs = measure_stage_costs(plain, plain);
  ASSERT_TRUE(costs.ok()) << costs.error().message();
  const Lane& middle = plain.lanes[1];
  const double static_bytes = middle.memory.weights + middle.memory.gradients +
                              middle.memory.optimizer + middle.memory.gathered;
  EXPECT_NEAR(2 * (*costs)[1].blocks[0].static_bytes, static_bytes, 1e-9 * static_bytes);
}

TEST_F(Llama8bOnOneNode, MeasuredCostsSeparateLayersFromTheHead) {
  Program plain = compile(model, topo, o);
  MegatronOptions full = o;
  full.recompute = RecomputeMode::kFull;
  Program recomputed = compile(model, topo, full);
  Expected<std::vector<StageCosts>> costs = measure_stage_costs(plain, recomputed);
  ASSERT_TRUE(costs.ok()) << costs.error().message();
  ASSERT_EQ(costs->size(), 4u);
  const StageCosts& first = costs->front();
  const StageCosts& last = costs->back();
  for (const StageCosts& c : *costs) {
    // Identical layers cost the same on every stage.
    EXPECT_NEAR(c.blocks[0].seconds, first.blocks[0].seconds, 0.01 * first.blocks[0].seconds);
    EXPECT_GT(c.blocks[0].recompute_seconds, 0);
    // A forward, not a forward and backward.
    EXPECT_LT(c.blocks[0].recompute_seconds, c.blocks[0].seconds);
    EXPECT_LT(c.blocks[0].recomputed_activation_bytes, c.blocks[0].activation_bytes / 10);
    EXPECT_EQ(c.blocks.size(), 1u);  // one block shape
  }
  // Llama 3's 128K vocabulary: the head and loss cost more than a layer; the embedding little.
  EXPECT_GT(last.other_seconds, first.blocks[0].seconds);
  EXPECT_LT(first.other_seconds, 0.1 * first.blocks[0].seconds);
  // 1F1B: stage s holds p - s micro-batches at its peak.
  for (int s = 0; s < 4; ++s) EXPECT_EQ((*costs)[s].in_flight, 4 - s);
  // The linear memory model reproduces each stage's measured peak with the uniform split.
  const std::vector<LaneMemoryPeak> peaks = lane_memory_peaks(plain);
  for (int s = 0; s < 4; ++s) {
    const StageCosts& c = (*costs)[s];
    EXPECT_NEAR(bytes(c, 8, 0), peaks[s].peak, 1e-6 * peaks[s].peak);
  }
}

TEST_F(Llama8bOnOneNode, BalancedStagesBeatTheUniformSplit) {
  const double uniform = estimate_program(compile(model, topo, o)).iteration_time;
  SearchOptions so = pinned_1f1b(2, 4, 1);
  so.pins.sequence_parallel = true;
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GE(r->balanced_better, 1u);
  const Candidate& best = r->ranked.front();
  ASSERT_EQ(best.options.stage_layers.size(), 4u);
  EXPECT_LT(best.options.stage_layers.back(), 8);  // the head's stage holds fewer layers
  EXPECT_LT(best.estimate.iteration_time, 0.95 * uniform);
}

// A multi-token prediction module is the last stage's: a block and another pass through the
// output head on top of the head, which the search answers with fewer layers there.
TEST_F(Llama8bOnOneNode, MultiTokenPredictionWeighsOnTheLastStage) {
  ModelSpec mtp = model;
  mtp.mtp_layers = 1;
  Program plain = compile(model, topo, o);
  Program with = compile(mtp, topo, o);
  Expected<std::vector<StageCosts>> before = measure_stage_costs(plain, plain);
  Expected<std::vector<StageCosts>> after = measure_stage_costs(with, with);
  ASSERT_TRUE(before.ok() && after.ok());
  const double layer = before->back().blocks[0].seconds;
  EXPECT_GT(after->back().other_seconds - before->back().other_seconds, 1.5 * layer);
  EXPECT_NEAR(after->front().other_seconds, before->front().other_seconds, 1e-3 * layer);
  EXPECT_NEAR(after->back().blocks[0].seconds, layer, 0.01 * layer);
  SearchOptions so = pinned_1f1b(2, 4, 1);
  so.pins.sequence_parallel = true;
  Expected<SearchResult> without_module = search_plans(model, topo, so);
  Expected<SearchResult> with_module = search_plans(mtp, topo, so);
  ASSERT_TRUE(without_module.ok() && with_module.ok());
  const std::vector<int>& a = without_module->ranked.front().options.stage_layers;
  const std::vector<int>& b = with_module->ranked.front().options.stage_layers;
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_LT(b.back(), a.back());
}

// A 512K-token vocabulary makes the head's stage so slow that a pipeline's even split estimates
// more than 5 % behind the best plan without a pipeline. The search re-partitions the pipelines
// whose estimate, scaled to their best split on the partitioner's linear model, comes close, and
// the balanced pipeline wins.
TEST_F(Llama8bOnOneNode, APipelineBehindOnlyForItsSplitIsBalanced) {
  model.vocab = 524288;
  SearchOptions so = pinned_1f1b(1, 2, 1);
  so.pins.pp.reset();
  so.pins.micro_batch.reset();
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Candidate& best = r->ranked.front();
  ASSERT_GT(best.options.pp, 1) << best.describe();
  ASSERT_EQ(best.options.stage_layers.size(), static_cast<size_t>(best.options.pp));
  EXPECT_LT(best.options.stage_layers.back(), best.options.stage_layers.front());
  MegatronOptions even = best.options;
  even.stage_layers.clear();
  even.recompute_layers.clear();
  EXPECT_GT(estimate_program(compile(model, topo, even)).iteration_time,
            1.05 * best.estimate.iteration_time);
}

// Interleaved stages keep the even split but for the head's segment (the last stage's last
// chunk), which gives layers to the others when that is faster: Llama 3's 128K-vocabulary head
// costs more than a layer.
TEST_F(Llama8bOnOneNode, InterleavedHeadSegmentShedsLayers) {
  SearchOptions so = pinned_1f1b(2, 4, 1);
  so.pins.sequence_parallel = true;
  so.pins.vpp = 2;
  so.pins.schedule = ScheduleKind::kInterleaved;
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Candidate& best = r->ranked.front();
  ASSERT_EQ(best.options.stage_layers.size(), 8u);
  EXPECT_LT(best.options.stage_layers.back(), split_layers(model.layers, 8).back());
  EXPECT_EQ(std::accumulate(best.options.stage_layers.begin(), best.options.stage_layers.end(), 0),
            model.layers);
  MegatronOptions even = best.options;
  even.stage_layers.clear();
  even.recompute_layers.clear();
  EXPECT_LT(best.estimate.iteration_time,
            estimate_program(compile(model, topo, even)).iteration_time);
}

// DeepSeekMoE with 16 layers, the first dense: its stage (dense block, cheap embedding) takes a
// layer more than the even split gives it, the head's stage fewer, and the plan is faster.
TEST_F(Llama8bOnOneNode, BalancedStagesWithADenseFirstLayer) {
  Expected<ModelSpec> m = load_model("deepseek-moe-16b");
  ASSERT_TRUE(m.ok());
  m->layers = 16;
  m->seq_len = 2048;
  SearchOptions so = pinned_1f1b(1, 4, 1);
  so.pins.ep = 2;
  Expected<SearchResult> r = search_plans(*m, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  EXPECT_GE(r->balanced_better, 1u);
  const Candidate& best = r->ranked.front();
  ASSERT_EQ(best.options.stage_layers.size(), 4u);
  EXPECT_GT(best.options.stage_layers.front(), 4);
  EXPECT_LT(best.options.stage_layers.back(), 4);
  MegatronOptions even = best.options;
  even.stage_layers.clear();
  even.recompute_layers.clear();
  EXPECT_LT(best.estimate.iteration_time,
            0.97 * estimate_program(compile(*m, topo, even)).iteration_time);
}

// Interleaved, DeepSeekMoE's dense first layer makes the first chunk cheaper: the chunks'
// layers moved one by one give it more than the others, which neither the even split nor the
// head's shedding does, and the plan is faster.
TEST_F(Llama8bOnOneNode, InterleavedChunksEvenOutADenseFirstLayer) {
  Expected<ModelSpec> m = load_model("deepseek-moe-16b");  // 28 layers, the first dense
  ASSERT_TRUE(m.ok());
  Expected<Topology> t = load_topology("dgx-h100-superpod");
  ASSERT_TRUE(t.ok());
  Expected<Topology> four = resize_topology(*t, 4);
  ASSERT_TRUE(four.ok());
  topo = *four;
  SearchOptions so = pinned_1f1b(1, 4, 4);
  so.global_batch = 256;
  so.pins.cp = 2;
  so.pins.vpp = 2;
  so.pins.schedule = ScheduleKind::kInterleaved;
  Expected<SearchResult> r = search_plans(*m, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Candidate& best = r->ranked.front();
  ASSERT_EQ(best.options.stage_layers.size(), 8u) << best.describe();
  EXPECT_GT(best.options.stage_layers.front(), best.options.stage_layers[1]) << best.describe();
  MegatronOptions even = best.options;
  even.stage_layers.clear();
  even.recompute_layers.clear();
  EXPECT_LT(best.estimate.iteration_time, estimate_program(compile(*m, topo, even)).iteration_time);
}

// A V (ZB-V, DualPipeV) puts the embedding's segment and the head's on the first device. Pinned,
// the search runs it with its two chunks a rank (it found no plan before), and the local search
// gives that device fewer layers than the even split, which it beats.
TEST_F(Llama8bOnOneNode, APinnedVScheduleIsSearchedAndItsFirstDeviceEvenedOut) {
  for (ScheduleKind kind : {ScheduleKind::kZbV, ScheduleKind::kDualPipeV}) {
    SearchOptions so = pinned_1f1b(2, 4, 1);
    so.pins.sequence_parallel = true;
    so.pins.vpp.reset();
    so.pins.schedule = kind;
    Expected<SearchResult> r = search_plans(model, topo, so);
    ASSERT_TRUE(r.ok()) << r.error().message();
    const Candidate& best = r->ranked.front();
    EXPECT_EQ(best.options.schedule, kind);
    EXPECT_EQ(best.options.vpp, 2);
    ASSERT_EQ(best.options.stage_layers.size(), 8u) << best.describe();
    const std::vector<int>& l = best.options.stage_layers;
    EXPECT_LT(l.front() + l.back(), 8) << best.describe();  // device 0: segments 0 and 7
    MegatronOptions even = best.options;
    even.stage_layers.clear();
    even.recompute_layers.clear();
    EXPECT_LT(best.estimate.iteration_time,
              0.95 * estimate_program(compile(model, topo, even)).iteration_time);
  }
}

// Among the ranked plans of schedule `kind` and micro-batch 1: the fastest with a split of its
// own beats the fastest evenly split one by 5 %.
void expect_split_beats_even(const SearchResult& r, ScheduleKind kind) {
  const Candidate* even = nullptr;
  const Candidate* split = nullptr;
  for (const Candidate& c : r.ranked) {
    if (c.options.schedule != kind || c.options.micro_batch != 1) continue;
    const Candidate*& slot = c.options.stage_layers.empty() ? even : split;
    if (!slot) slot = &c;
  }
  ASSERT_TRUE(even && split) << to_string(kind);
  EXPECT_LT(split->estimate.iteration_time, 0.95 * even->estimate.iteration_time)
      << split->describe();
}

// Unpinned, the search tries ZB-V for its best pipelines both evenly split and evened out, and
// the one-chunk zero-bubble schedules with the balanced 1F1B plan's split as well as evenly.
TEST_F(Llama8bOnOneNode, SearchedZeroBubbleSchedulesAreBalancedToo) {
  SearchOptions so = pinned_1f1b(2, 4, 1);
  so.pins.sequence_parallel = true;
  so.pins.schedule.reset();
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  expect_split_beats_even(*r, ScheduleKind::kZbH1);
  so.pins.vpp.reset();
  r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  expect_split_beats_even(*r, ScheduleKind::kZbV);
}

TEST_F(Llama8bOnOneNode, StageAwareRecomputeFitsWhereNoRecomputeDoesNot) {
  // tp1 pp8 micro-batch 4: without recomputation stage 0 does not fit in 80 GB; recomputing
  // every layer fits but costs a third more.
  SearchOptions so = pinned_1f1b(1, 8, 4);
  so.pins.zero = 0;
  Expected<SearchResult> r = search_plans(model, topo, so);
  ASSERT_TRUE(r.ok()) << r.error().message();
  const Candidate& best = r->ranked.front();
  ASSERT_EQ(best.options.recompute_layers.size(), 8u);
  EXPECT_GT(best.options.recompute_layers.front(), 0);
  EXPECT_EQ(best.options.recompute_layers.back(), 0);
  // It fits (exact memory check), and beats uniform full recomputation.
  Program p = compile(model, topo, best.options);
  EXPECT_LE(estimate_program(p).peak_memory, 0.9 * topo.gpu.hbm_bytes);
  MegatronOptions full = best.options;
  full.stage_layers.clear();
  full.recompute_layers.clear();
  full.recompute = RecomputeMode::kFull;
  EXPECT_LT(best.estimate.iteration_time,
            0.9 * estimate_program(compile(model, topo, full)).iteration_time);
}

TEST(StagePartition, RecomputeToFitCoversEachDevicesExcess) {
  // Interleaved GPT-3 13B: 4 stages x 2 chunks; capacity set between the plan with no
  // recomputation and the plan recomputing everything.
  Expected<ModelSpec> m = load_model("gpt3-13b");
  Expected<Topology> t = load_topology("dgx-a100x4");
  ASSERT_TRUE(m.ok() && t.ok());
  MegatronOptions o;
  o.tp = 8;
  o.pp = 4;
  o.vpp = 2;
  o.schedule = ScheduleKind::kInterleaved;
  o.global_batch = 64;
  o.micro_batch = 4;
  Program plain = compile(*m, *t, o);
  o.recompute = RecomputeMode::kFull;
  Program full = compile(*m, *t, o);
  double plain_peak = 0, full_peak = 0;
  for (const auto& p : lane_memory_peaks(plain)) plain_peak = std::max(plain_peak, p.peak);
  for (const auto& p : lane_memory_peaks(full)) full_peak = std::max(full_peak, p.peak);
  ASSERT_LT(full_peak, plain_peak);
  const double capacity = 0.5 * (plain_peak + full_peak);
  const double saved = plain.layer_activation_bytes[0] - full.layer_activation_bytes[0];
  Expected<std::vector<int>> k = recompute_to_fit(plain, std::vector<int>(8, 0), saved, capacity);
  ASSERT_TRUE(k.ok()) << k.error().message();
  // Every device's chunks recompute the same count; the first stage (most in flight) the most.
  for (int s = 0; s < 4; ++s) EXPECT_EQ((*k)[s], (*k)[s + 4]);
  EXPECT_GT((*k)[0], 0);
  EXPECT_GE((*k)[0], (*k)[3]);
  MegatronOptions fitted = o;
  fitted.recompute = RecomputeMode::kNone;
  fitted.recompute_layers = *k;
  for (const auto& p : lane_memory_peaks(compile(*m, *t, fitted))) EXPECT_LE(p.peak, capacity);
  // Below the fully recomputed peak nothing fits, and the error says which GPU.
  Expected<std::vector<int>> none =
      recompute_to_fit(full, std::vector<int>(8, 5), saved, 0.9 * full_peak);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message().find("even recomputing every layer"), std::string::npos);
}

TEST(MegatronRecomputeLayers, RulesCoverEachSegmentsFirstLayers) {
  Expected<ModelSpec> m = load_model("gpt3-1.3b");
  Expected<Topology> t = load_topology("dgx-a100x4");
  MegatronOptions o;
  o.pp = 4;
  o.global_batch = 32;
  o.stage_layers = {5, 7, 6, 6};
  o.recompute_layers = {3, 1, 0, 6};
  o.recompute = RecomputeMode::kSelective;
  Expected<Plan> p = build_megatron_plan(*m, *t, o);
  ASSERT_TRUE(p.ok()) << p.error().message();
  // Full recomputation of layers 0-2, 5, 18-23; selective for the rest.
  std::vector<std::tuple<std::string, int, int>> rules;
  for (const auto& r : p->recompute) rules.emplace_back(r.match, r.first_layer, r.end_layer);
  std::vector<std::tuple<std::string, int, int>> want = {
      {"*", 0, 3},         {"*", 5, 6},          {"*", 18, 24},
      {"attn.core", 3, 5}, {"attn.core", 6, 12}, {"attn.core", 12, 18}};
  EXPECT_EQ(rules, want);
  o.recompute_layers = {3, 8, 0, 0};
  Expected<Plan> bad = build_megatron_plan(*m, *t, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("segment 1 (stage1) has 7 layers; it cannot recompute 8"),
            std::string::npos)
      << bad.error().message();
}

}  // namespace
}  // namespace nnsim
