// Hand-edited plans (a field deleted, a number or a string changed, a list entry repeated, a
// block order cut or shuffled) are read, compiled, memory-checked and estimated without a crash,
// a hang or an escaping exception: each stage either accepts the plan or returns an error that
// says what is wrong. The mutations are drawn from a fixed seed, so a failure reproduces.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/memory_check.h"
#include "core/model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"
#include "planner/estimator.h"
#include "planner/megatron.h"

namespace nnsim {
namespace {

using nlohmann::json;

// Every node of `j` by its path (object keys and array indices), the root excluded.
void collect(json& j, std::vector<json*>& parents, std::vector<json>& keys) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      parents.push_back(&j);
      keys.emplace_back(it.key());
      collect(it.value(), parents, keys);
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) {
      parents.push_back(&j);
      keys.emplace_back(i);
      collect(j[i], parents, keys);
    }
  }
}

// One random edit of one node of `plan`.
void mutate(json& plan, std::mt19937& rng) {
  std::vector<json*> parents;
  std::vector<json> keys;
  collect(plan, parents, keys);
  const size_t pick = std::uniform_int_distribution<size_t>(0, parents.size() - 1)(rng);
  json& parent = *parents[pick];
  json& node = keys[pick].is_string() ? parent[keys[pick].get<std::string>()]
                                      : parent[keys[pick].get<size_t>()];
  const std::vector<json> values = {0,
                                    -1,
                                    1,
                                    2,
                                    3,
                                    7,
                                    1e30,
                                    -0.5,
                                    2.5,
                                    1e-300,
                                    2147483648LL,
                                    "",
                                    "x",
                                    nullptr,
                                    json::array(),
                                    json::object(),
                                    true,
                                    65537};
  const int how = std::uniform_int_distribution<int>(0, 9)(rng);
  if (how == 0) {  // delete
    if (keys[pick].is_string()) {
      parent.erase(keys[pick].get<std::string>());
    } else {
      parent.erase(keys[pick].get<size_t>());
    }
  } else if (how <= 3 && node.is_number()) {  // scale or shift a number
    const double x = node.get<double>();
    const double choices[] = {2 * x, x + 1, x - 1, 0, -x, 1000 * x};
    node = choices[std::uniform_int_distribution<int>(0, 5)(rng)];
    if (node.get<double>() == static_cast<int64_t>(node.get<double>())) {
      node = static_cast<int64_t>(node.get<double>());
    }
  } else if (how <= 5 && node.is_string() &&
             node.get<std::string>().find(' ') != std::string::npos) {
    // A block order: its blocks shuffled, or the last ones dropped.
    std::vector<std::string> tokens;
    std::string s = node.get<std::string>();
    for (size_t at = 0, next; at < s.size(); at = next + 1) {
      next = s.find(' ', at);
      if (next == std::string::npos) next = s.size();
      tokens.push_back(s.substr(at, next - at));
    }
    if (how == 4) {
      std::shuffle(tokens.begin(), tokens.end(), rng);
    } else {
      tokens.resize(tokens.size() - std::min<size_t>(tokens.size() - 1, 2));
    }
    std::string joined;
    for (const std::string& t : tokens) joined += (joined.empty() ? "" : " ") + t;
    node = joined;
  } else if (how == 6 && node.is_array() && !node.empty()) {  // repeat an entry
    node.push_back(node.front());
  } else {
    node = values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
  }
}

struct Outcome {
  int read = 0, compiled = 0, fit = 0, refused = 0;
};

// Reads, compiles, checks and estimates `text`; every refusal must say why.
void run_stages(const std::string& text, const Topology& topo, Outcome& out) {
  Expected<Plan> plan = parse_plan(text, "mutated.json");
  if (!plan) {
    ++out.refused;
    EXPECT_FALSE(plan.error().message().empty());
    return;
  }
  ++out.read;
  Expected<Program> prog = compile_plan(*plan, topo);
  if (!prog) {
    ++out.refused;
    EXPECT_FALSE(prog.error().message().empty());
    return;
  }
  ++out.compiled;
  if (Status s = check_memory_fits(*prog); !s) {
    EXPECT_FALSE(s.error().message().empty());
    return;
  }
  ++out.fit;
  const Estimate e = estimate_program(*prog);
  EXPECT_GT(e.iteration_time, 0) << text;
}

TEST(MutatedPlans, AreRefusedWithAReasonOrRunNeverACrash) {
  Expected<Topology> base = load_topology(std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml");
  ASSERT_TRUE(base.ok()) << base.error().message();
  Expected<Topology> topo = resize_topology(*base, 4);
  ASSERT_TRUE(topo.ok()) << topo.error().message();
  struct Source {
    const char* model;
    MegatronOptions options;
  };
  std::vector<Source> sources;
  auto add = [&](const char* model, auto&& set) {
    Source s{model, {}};
    s.options.global_batch = 16;
    set(s.options);
    sources.push_back(s);
  };
  add("tiny-gpt.yaml", [](MegatronOptions& o) {
    o.tp = 2;
    o.pp = 2;
    o.vpp = 2;
    o.schedule = ScheduleKind::kInterleaved;
    o.sequence_parallel = true;
    o.recompute = RecomputeMode::kSelective;
    o.zero = 1;
  });
  add("tiny-llama.yaml", [](MegatronOptions& o) {
    o.pp = 2;
    o.vpp = 2;
    o.schedule = ScheduleKind::kZbV;
  });
  add("tiny-gpt.yaml", [](MegatronOptions& o) {
    o.zero = 3;
    o.framework = "deepspeed";
    o.recompute = RecomputeMode::kFull;
  });
  add("tiny-moe.yaml", [](MegatronOptions& o) {
    o.tp = 2;
    o.ep = 2;
    o.sequence_parallel = true;
    o.zero = 1;
  });
  add("tiny-gpt.yaml", [](MegatronOptions& o) {
    o.tp = 2;
    o.cp = 2;
    o.pp = 2;
    o.framework = "fsdp";
    o.zero = 3;
  });
  // (Added after the five above, so that their edits stay the ones they were.)
  add("tiny-mla-moe.yaml", [](MegatronOptions& o) {
    o.tp = 2;
    o.ep = 2;
    o.sequence_parallel = true;
    o.recompute = RecomputeMode::kSelective;
  });
  add("tiny-sliding-window.yaml", [](MegatronOptions& o) {
    o.pp = 2;
    o.schedule = ScheduleKind::kZbH1;
  });
  add("tiny-gemma.yaml", [](MegatronOptions& o) {
    o.tp = 2;
    o.pp = 2;
    o.sequence_parallel = true;
    o.zero = 1;
  });
  std::mt19937 rng(20261206);
  Outcome out;
  constexpr int kPerSource = 240;
  for (const Source& s : sources) {
    Expected<ModelSpec> model = load_model(std::string(NNSIM_TEST_DATA) + "/" + s.model);
    ASSERT_TRUE(model.ok()) << model.error().message();
    Expected<Plan> plan = build_megatron_plan(*model, *topo, s.options);
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    const json original = json::parse(plan_to_json(*plan));
    for (int i = 0; i < kPerSource; ++i) {
      json edited = original;
      const int edits = std::uniform_int_distribution<int>(1, 3)(rng);
      for (int k = 0; k < edits; ++k) mutate(edited, rng);
      const std::string text = edited.dump(1);
      SCOPED_TRACE(fmt::format("{} mutation {}", s.model, i));
      EXPECT_NO_THROW(run_stages(text, *topo, out));
    }
  }
  // The edits reach every stage: some plans are refused, some still compile and run.
  EXPECT_GT(out.refused, 0);
  EXPECT_GT(out.compiled, 0);
  EXPECT_GT(out.fit, 0);
  RecordProperty("read", out.read);
  RecordProperty("compiled", out.compiled);
  RecordProperty("fit", out.fit);
  RecordProperty("refused", out.refused);
}

}  // namespace
}  // namespace nnsim
