// End-to-end tests of the command-line driver: they run the nnsim binary in a fresh temporary
// directory and look only at what a user sees, its exit status, stdout, stderr and the files it
// writes.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/model.h"
#include "core/topology.h"
#include "core/units.h"

namespace nnsim {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kData = NNSIM_TEST_DATA;
// NNSIM_TEST_DATA is <source>/tests/data.
const fs::path kSourceDir = fs::path(NNSIM_TEST_DATA).parent_path().parent_path();

std::string topology_path(const std::string& name) {
  return (kSourceDir / "topologies" / (name + ".yaml")).string();
}
std::string bad_file(const std::string& name) {
  return (kData / "bad" / name).string();
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct RunResult {
  int status = -1;  // the exit status, or 128 + the signal that ended it
  bool signaled = false;
  std::string out;
  std::string err;
};

std::ostream& operator<<(std::ostream& os, const RunResult& r) {
  return os << "exit status " << r.status << (r.signaled ? " (signal)" : "") << "\n--- stdout ---\n"
            << r.out << "--- stderr ---\n"
            << r.err << "--------------";
}

// A fresh temporary directory (removed afterwards) in which programs run: work/ is their working
// directory, and their stdout and stderr go to files beside it.
class Sandbox {
 public:
  Sandbox() {
    std::string pattern = (fs::temp_directory_path() / "nnsim_test.XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp failed: " << std::strerror(errno);
      return;
    }
    root_ = pattern;
    fs::create_directory(root_ / "work");
  }
  ~Sandbox() {
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  fs::path dir() const { return root_ / "work"; }
  fs::path path(const std::string& name) const { return dir() / name; }
  bool exists(const std::string& name) const { return fs::exists(path(name)); }
  std::string read(const std::string& name) const { return read_text(path(name)); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name), std::ios::binary) << text;
  }
  json read_json(const std::string& name) const { return json::parse(read(name)); }
  void write_json(const std::string& name, const json& j) const { write(name, j.dump(1)); }

  // Runs `program args...` (found on PATH unless it has a slash) without a shell.
  RunResult exec(const std::string& program, const std::vector<std::string>& args) const {
    RunResult r;
    const std::string out_path = (root_ / "stdout").string();
    const std::string err_path = (root_ / "stderr").string();
    const std::string work = dir().string();
    std::vector<std::string> storage;
    storage.push_back(program);
    storage.insert(storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);

    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed: " << std::strerror(errno);
      return r;
    }
    if (pid == 0) {
      int in = ::open("/dev/null", O_RDONLY);
      int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (in < 0 || out < 0 || err < 0 || ::dup2(in, 0) < 0 || ::dup2(out, 1) < 0 ||
          ::dup2(err, 2) < 0 || ::chdir(work.c_str()) != 0) {
        ::_exit(126);
      }
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    int wstatus = 0;
    while (::waitpid(pid, &wstatus, 0) < 0) {
      if (errno != EINTR) {
        ADD_FAILURE() << "waitpid failed: " << std::strerror(errno);
        return r;
      }
    }
    if (WIFEXITED(wstatus)) {
      r.status = WEXITSTATUS(wstatus);
    } else if (WIFSIGNALED(wstatus)) {
      r.signaled = true;
      r.status = 128 + WTERMSIG(wstatus);
    }
    r.out = read_text(out_path);
    r.err = read_text(err_path);
    return r;
  }

  RunResult nnsim(const std::vector<std::string>& args) const { return exec(NNSIM_BINARY, args); }

 private:
  fs::path root_;
};

// The plan of the main job: gpt3-1.3b, tp 2, pp 4 (so dp 4) on the 32 GPUs of dgx-a100x4.
const std::vector<std::string> kPlanArgs = {
    "plan", "--model", "gpt3-1.3b",      "--topo", "dgx-a100x4", "--tp",  "2",
    "--pp", "4",       "--global-batch", "64",     "-o",         "p.json"};

void make_plan(const Sandbox& box, const std::vector<std::string>& args = kPlanArgs) {
  RunResult r = box.nnsim(args);
  ASSERT_EQ(r.status, 0) << r;
  ASSERT_TRUE(contains(r.out, "wrote ")) << r;
}

// A small valid 2-stage plan: gpt3-1.3b tp 8 pp 2 (dp 2), 2 micro-batches per replica.
void make_two_stage_plan(const Sandbox& box, const std::string& output) {
  make_plan(box, {"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "2",
                  "--global-batch", "4", "-o", output});
}

bool looks_like_result(const std::string& out) {
  return contains(out, "iteration time") || contains(out, "throughput") ||
         contains(out, "peak memory") || contains(out, "wrote ");
}

// What every rejected input must give: a non-zero exit (not a crash), no result on stdout, and
// one error on stderr that starts with "nnsim: error:" and carries `needles`.
void expect_error(const RunResult& r, std::initializer_list<std::string> needles) {
  EXPECT_FALSE(r.signaled) << r;
  EXPECT_NE(r.status, 0) << r;
  EXPECT_FALSE(looks_like_result(r.out)) << r;
  EXPECT_EQ(r.err.rfind("nnsim: error:", 0), 0u) << r;
  for (const std::string& n : needles)
    EXPECT_TRUE(contains(r.err, n)) << "want '" << n << "'\n" << r;
}

void expect_matches(const std::string& text, const std::string& pattern) {
  EXPECT_TRUE(std::regex_search(text, std::regex(pattern))) << "want /" << pattern << "/ in\n"
                                                            << text;
}

// The iteration time as printed ("  iteration time   250.43 ms ..."), with half a unit of its
// last printed digit (the precision it was printed to).
struct Printed {
  double seconds = 0;
  double half_ulp = 0;
  std::string text;
};
std::optional<Printed> printed_iteration_time(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"(iteration time\s+([0-9]+)(?:\.([0-9]+))? (s|ms|us|ns)\b)");
  if (!std::regex_search(out, m, re)) return std::nullopt;
  double scale = m[3] == "s" ? 1 : m[3] == "ms" ? 1e-3 : m[3] == "us" ? 1e-6 : 1e-9;
  Printed p;
  std::string number = m[1].str() + (m[2].matched ? "." + m[2].str() : "");
  p.seconds = std::stod(number) * scale;
  p.half_ulp = 0.5 * std::pow(10.0, -static_cast<double>(m[2].length())) * scale;
  p.text = number + " " + m[3].str();
  return p;
}

// ------------------------------------------------------------------------------------------
// 1. The main job.

// `base` with `extra` options and the output file `out`.
std::vector<std::string> plan_args(std::vector<std::string> base,
                                   const std::vector<std::string>& extra, const std::string& out) {
  base.insert(base.end(), extra.begin(), extra.end());
  base.insert(base.end(), {"-o", out});
  return base;
}

// DeepSpeed's ZeRO-3 settings, the persistence threshold and the prefetch bucket: the
// builder's defaults (1e5 and 5e7 elements), values of the user's own, and errors naming the
// fix where they do not apply or are out of range.
TEST(NnsimTool, PlanTakesDeepSpeedsZero3Settings) {
  Sandbox box;
  const std::vector<std::string> base = {"plan",       "--model",        "gpt3-1.3b", "--topo",
                                         "dgx-a100x4", "--tp",           "1",         "--pp",
                                         "1",          "--global-batch", "32",        "--zero",
                                         "3",          "--framework",    "deepspeed"};
  auto with = [&](const std::vector<std::string>& extra, const std::string& out) {
    return plan_args(base, extra, out);
  };
  make_plan(box, with({}, "default.json"));
  const auto comm = box.read_json("default.json")["communication"];
  EXPECT_EQ(comm["zero3_persistence_threshold"], 1e5);
  EXPECT_EQ(comm["zero3_prefetch_elements"], 5e7);
  for (auto [option, value, bad] : {std::tuple{"--zero3-persistence-threshold", 20480.0, "-1"},
                                    std::tuple{"--zero3-prefetch-elements", 2e8, "0"}}) {
    std::string key = std::string(option).substr(2);  // the plan's field: its dashes as _
    std::replace(key.begin(), key.end(), '-', '_');
    make_plan(box, with({option, fmt::format("{}", value)}, "own.json"));
    EXPECT_EQ(box.read_json("own.json")["communication"][key], value) << option;
    std::vector<std::string> fsdp = with({option, fmt::format("{}", value)}, "fsdp.json");
    fsdp[std::find(fsdp.begin(), fsdp.end(), "deepspeed") - fsdp.begin()] = "fsdp";
    expect_error(box.nnsim(fsdp), {"DeepSpeed's ZeRO-3 setting", "--framework deepspeed --zero 3"});
    expect_error(box.nnsim(with({option, bad}, "bad.json")), {option});
  }
}

// Optimizer offloading from the builder to the report: the plan carries it, the report shows
// the host's memory, and values or clusters that cannot take it are refused with the fix.
TEST(NnsimTool, PlanAndSimulateOffloadTheOptimizer) {
  Sandbox box;
  const std::vector<std::string> base = {
      "plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4",     "--tp", "8",
      "--pp", "1",       "--zero",    "1",      "--global-batch", "32"};
  auto with = [&](const std::vector<std::string>& extra, const std::string& out) {
    return plan_args(base, extra, out);
  };
  make_plan(box, with({}, "gpu.json"));
  make_plan(box, with({"--optimizer-offload", "0.5", "--offload-overlap"}, "host.json"));
  const json opt = box.read_json("host.json")["optimizer"];
  EXPECT_EQ(opt["offload_fraction"], 0.5);
  EXPECT_EQ(opt["offload_overlap"], true);
  EXPECT_TRUE(
      contains(box.read_json("host.json")["name"].get<std::string>(), " offload 0.5 overlap"));
  RunResult gpu = box.nnsim({"--topo", "dgx-a100x4", "gpu.json", "--json", "gpu-r.json"});
  RunResult host = box.nnsim({"--topo", "dgx-a100x4", "host.json", "--json", "host-r.json"});
  ASSERT_EQ(gpu.status, 0) << gpu;
  ASSERT_EQ(host.status, 0) << host;
  EXPECT_FALSE(contains(gpu.out, "host memory")) << gpu;
  expect_matches(host.out, R"(host memory +[0-9.]+ GiB of 1\.82 TiB \(node 0: offloaded)");
  const json g = box.read_json("gpu-r.json");
  const json h = box.read_json("host-r.json");
  EXPECT_FALSE(g.contains("host_memory_bytes"));
  EXPECT_EQ(h["host_memory_capacity_bytes"], 2e12);
  EXPECT_GT(h["host_memory_bytes"].get<double>(), 0);
  EXPECT_LT(h["peak_memory_bytes"].get<double>(), g["peak_memory_bytes"].get<double>());
  // The offloaded step part by part: the lane's optimizer time is the step.
  EXPECT_FALSE(g["lanes"][0].contains("optimizer_offload"));
  const json parts = h["lanes"][0]["optimizer_offload"];
  EXPECT_NEAR(parts["step_s"].get<double>(),
              h["lanes"][0]["breakdown"]["optimizer_s"].get<double>(), 1e-12);
  for (const char* part : {"to_host_s", "host_s", "to_device_s", "gpu_s"}) {
    EXPECT_GT(parts[part].get<double>(), 0) << part;
    EXPECT_LT(parts[part].get<double>(), parts["step_s"].get<double>()) << part;
  }
  expect_matches(host.out, R"(optimizer step +[0-9.]+ m?s \(pp=0\): gradients to the host .*, )"
                           R"(overlapped tensor by tensor)");
  EXPECT_GT(h["iteration_time_s"].get<double>(), g["iteration_time_s"].get<double>());

  expect_error(box.nnsim(with({"--optimizer-offload", "2"}, "bad.json")),
               {"--optimizer-offload 2", "from 0 to 1"});
  expect_error(box.nnsim(with({"--offload-overlap"}, "bad.json")), {"add --optimizer-offload"});
  std::vector<std::string> no_host = with({"--optimizer-offload", "1"}, "bad.json");
  no_host[std::find(no_host.begin(), no_host.end(), "dgx-a100x4") - no_host.begin()] = "h200x8";
  no_host[std::find(no_host.begin(), no_host.end(), "32") - no_host.begin()] = "8";
  expect_error(box.nnsim(no_host), {"topology 'h200x8' describes no host", "node.host"});
  // "auto" is the search's; the builder takes a fraction.
  expect_error(box.nnsim(with({"--optimizer-offload", "auto"}, "bad.json")),
               {"--optimizer-offload auto", "the builder takes a fraction"});
  expect_error(box.nnsim(with({"--optimizer-offload", "half"}, "bad.json")),
               {"--optimizer-offload 'half'", "a fraction from 0 to 1 or 'auto'"});
  // FSDP's CPUOffload moves whole shards, ZeRO-3's only.
  auto fsdp_args = [&](const std::string& zero, const std::string& fraction,
                       const std::string& out) {
    std::vector<std::string> args =
        with({"--framework", "fsdp", "--optimizer-offload", fraction}, out);
    args[std::find(args.begin(), args.end(), "--zero") - args.begin() + 1] = zero;
    return args;
  };
  make_plan(box, fsdp_args("3", "1", "fsdp.json"));
  EXPECT_EQ(box.read_json("fsdp.json")["optimizer"]["offload_params"], true);
  RunResult fsdp = box.nnsim({"--topo", "dgx-a100x4", "fsdp.json"});
  ASSERT_EQ(fsdp.status, 0) << fsdp;
  expect_matches(fsdp.out, R"(node 0: offloaded parameters, gradients and optimizer state\))");
  expect_matches(fsdp.out, R"(optimizer step +[0-9.]+ m?s \(pp=0\): the host's update;)");
  expect_error(box.nnsim(fsdp_args("3", "0.5", "bad.json")),
               {"--optimizer-offload 0.5 with --framework fsdp", "use --optimizer-offload 1"});
  expect_error(box.nnsim(fsdp_args("2", "1", "bad.json")), {"ZeRO-2", "use --zero 3"});
  // DeepSpeed's offload_param on request: the same shards on the host.
  std::vector<std::string> ds = fsdp_args("3", "1", "ds.json");
  ds[std::find(ds.begin(), ds.end(), "fsdp") - ds.begin()] = "deepspeed";
  ds.push_back("--offload-params");
  make_plan(box, ds);
  EXPECT_EQ(box.read_json("ds.json")["optimizer"]["offload_params"], true);
  RunResult deepspeed = box.nnsim({"--topo", "dgx-a100x4", "ds.json"});
  ASSERT_EQ(deepspeed.status, 0) << deepspeed;
  expect_matches(deepspeed.out, R"(node 0: offloaded parameters, gradients and optimizer state\))");
  std::vector<std::string> ds_half = ds;
  ds_half[std::find(ds_half.begin(), ds_half.end(), "--optimizer-offload") - ds_half.begin() + 1] =
      "0.5";
  ds_half[std::find(ds_half.begin(), ds_half.end(), "ds.json") - ds_half.begin()] = "bad.json";
  expect_error(box.nnsim(ds_half), {"--offload-params", "give --optimizer-offload 1"});
  expect_error(box.nnsim(with({"--optimizer-offload", "1", "--offload-params"}, "bad.json")),
               {"--offload-params is DeepSpeed's offload_param", "use --framework deepspeed"});
  RunResult search = box.nnsim({"plan", "--model", "llama3-70b", "--topo", "dgx-a100x4", "--nodes",
                                "1", "--global-batch", "16", "--confirm", "1",
                                "--optimizer-offload", "auto", "-o", "auto.json"});
  ASSERT_EQ(search.status, 0) << search;
  expect_matches(search.out, R"(\n +1 +tp\S+ .* offload[0-9.]+ )");
  EXPECT_GT(box.read_json("auto.json")["optimizer"]["offload_fraction"].get<double>(), 0);
  // A host too small for the offloaded state.
  expect_error(
      box.nnsim({"--topo", "dgx-a100x4", "--topo-set", "node.host.memory=1 GB", "host.json"}),
      {"does not fit in host memory", "--optimizer-offload"});
}

// Activation offloading from the builder to the report: the plan carries the count, the
// report shows the host's memory, the copies and their exposed wait, and what Megatron-Core
// refuses is refused with the fix.
TEST(NnsimTool, PlanAndSimulateOffloadActivations) {
  Sandbox box;
  const std::vector<std::string> base = {
      "plan", "--model", "llama3-8b", "--topo", "dgx-a100x4",     "--tp", "4",
      "--pp", "1",       "--zero",    "1",      "--global-batch", "8"};
  auto with = [&](const std::vector<std::string>& extra, const std::string& out) {
    return plan_args(base, extra, out);
  };
  make_plan(box, with({}, "gpu.json"));
  make_plan(box, with({"--activation-offload", "8"}, "host.json"));
  EXPECT_EQ(box.read_json("host.json")["activation_offload_layers"], 8);
  EXPECT_FALSE(box.read_json("gpu.json").contains("activation_offload_layers"));
  EXPECT_TRUE(contains(box.read_json("host.json")["name"].get<std::string>(), " act-offload 8"));
  RunResult gpu = box.nnsim({"--topo", "dgx-a100x4", "gpu.json", "--json", "gpu-r.json"});
  RunResult host = box.nnsim(
      {"--topo", "dgx-a100x4", "host.json", "--json", "host-r.json", "--trace", "trace.json"});
  ASSERT_EQ(gpu.status, 0) << gpu;
  ASSERT_EQ(host.status, 0) << host;
  expect_matches(host.out,
                 R"(host memory +[0-9.]+ GiB of 1\.82 TiB \(node 0: offloaded activations\))");
  // The trace has the two copy streams and their copies.
  const std::string trace = read_text(box.path("trace.json"));
  for (const char* part : {R"("args":{"name":"offload"})", R"("args":{"name":"reload"})",
                           R"("cat":"host-copy")", "activation offload", "activation reload"}) {
    EXPECT_TRUE(contains(trace, part)) << part;
  }
  expect_matches(host.out, R"(offloaded acts +8 layers, [0-9.]+ GiB a micro-batch \(pp=0\): )"
                           R"([0-9.]+ m?s to the host, [0-9.]+ m?s back)");
  EXPECT_FALSE(contains(host.out, "optimizer step")) << host;
  EXPECT_TRUE(contains(host.out, "exp.offload")) << host;
  const json g = box.read_json("gpu-r.json");
  const json h = box.read_json("host-r.json");
  EXPECT_LT(h["peak_memory_bytes"].get<double>(), g["peak_memory_bytes"].get<double>());
  EXPECT_GT(h["iteration_time_s"].get<double>(), g["iteration_time_s"].get<double>());
  const json copies = h["lanes"][0]["activation_offload"];
  EXPECT_GT(copies["bytes"].get<double>(), 0);
  EXPECT_GT(copies["to_host_s"].get<double>(), 0);
  EXPECT_GT(copies["to_device_s"].get<double>(), 0);
  EXPECT_GT(h["lanes"][0]["breakdown"]["exposed_comm_s"]["offload"].get<double>(), 0);
  EXPECT_FALSE(g["lanes"][0].contains("activation_offload"));

  expect_error(box.nnsim(with({"--activation-offload", "32"}, "bad.json")),
               {"--activation-offload 32", "from 1 to 31"});
  expect_error(box.nnsim(with({"--activation-offload", "many"}, "bad.json")),
               {"--activation-offload 'many'", "a number of layers or 'auto'"});
  expect_error(box.nnsim(with({"--activation-offload", "auto"}, "bad.json")),
               {"--activation-offload auto", "the builder takes a layer count"});
  expect_error(box.nnsim(with({"--activation-offload", "8", "--recompute", "full"}, "bad.json")),
               {"--activation-offload 8 replaces recomputation", "drop --recompute"});
  std::vector<std::string> staged = with({"--activation-offload", "8"}, "bad.json");
  staged[std::find(staged.begin(), staged.end(), "--pp") - staged.begin() + 1] = "2";
  staged[std::find(staged.begin(), staged.end(), "--tp") - staged.begin() + 1] = "2";
  expect_error(box.nnsim(staged), {"one pipeline stage", "use --pp 1"});
  // On one DGX H100 the best plan offloads (docs/PLANNER.md, "Activation offloading").
  RunResult search = box.nnsim({"plan", "--model", "llama3-8b", "--topo", "dgx-h100-superpod",
                                "--nodes", "1", "--global-batch", "32", "--confirm", "1",
                                "--activation-offload", "auto", "-o", "auto.json"});
  ASSERT_EQ(search.status, 0) << search;
  expect_matches(search.out, R"(\n +1 +tp\S+ pp1 .* act-offload[0-9]+ )");
  EXPECT_GT(box.read_json("auto.json")["activation_offload_layers"].get<int>(), 0);
  expect_error(box.nnsim({"plan", "--model", "llama3-8b", "--topo", "dgx-a100x4", "--nodes", "1",
                          "--global-batch", "32", "--activation-offload", "8", "-o", "x.json"}),
               {"--activation-offload with a layer count is for the builder"});
  // A host too small for the copies.
  expect_error(
      box.nnsim({"--topo", "dgx-a100x4", "--topo-set", "node.host.memory=1 GB", "host.json"}),
      {"does not fit in host memory", "offloaded activations", "--activation-offload"});
}

// Fine-grained activation offloading from the builder to the report: Megatron-Core's module
// names become the plan's operators, two pipeline stages offload, and what nnsim does not
// model is refused with the fix.
TEST(NnsimTool, PlanAndSimulateOffloadModules) {
  Sandbox box;
  const std::vector<std::string> base = {
      "plan", "--model", "llama3-8b", "--topo", "dgx-a100x4",     "--tp", "4",
      "--pp", "2",       "--zero",    "1",      "--global-batch", "8"};
  auto with = [&](const std::vector<std::string>& extra, const std::string& out) {
    return plan_args(base, extra, out);
  };
  make_plan(box, with({}, "gpu.json"));
  make_plan(box, with({"--offload-modules", "core_attn,mlp.fc1"}, "host.json"));
  EXPECT_EQ(box.read_json("host.json")["activation_offload_modules"],
            json::array({"attn.core", "mlp.fc1"}));
  EXPECT_TRUE(contains(box.read_json("host.json")["name"].get<std::string>(),
                       " offload-modules core_attn,mlp.fc1"));
  RunResult gpu = box.nnsim({"--topo", "dgx-a100x4", "gpu.json", "--json", "gpu-r.json"});
  RunResult host = box.nnsim(
      {"--topo", "dgx-a100x4", "host.json", "--json", "host-r.json", "--trace", "trace.json"});
  ASSERT_EQ(gpu.status, 0) << gpu;
  ASSERT_EQ(host.status, 0) << host;
  expect_matches(host.out,
                 R"(offloaded acts +attn\.core,mlp\.fc1 of each layer, [0-9.]+ GiB a micro-batch )"
                 R"(\(pp=0\): [0-9.]+ m?s to the host, [0-9.]+ m?s back)");
  expect_matches(host.out, R"(host memory +[0-9.]+ GiB of [0-9.]+ TiB)");
  EXPECT_TRUE(contains(read_text(box.path("trace.json")), R"("args":{"name":"reload"})"));
  const json g = box.read_json("gpu-r.json");
  const json h = box.read_json("host-r.json");
  EXPECT_LT(h["peak_memory_bytes"].get<double>(), g["peak_memory_bytes"].get<double>());
  EXPECT_GT(h["lanes"][1]["activation_offload"]["bytes"].get<double>(), 0);

  expect_error(box.nnsim(with({"--offload-modules", "expert_fc1"}, "bad.json")),
               {"--offload-modules: 'expert_fc1' is a module this model's layers do not have",
                "moe_act", "attn.core"});
  expect_error(
      box.nnsim(with({"--offload-modules", "core_attn", "--schedule", "zb-h1"}, "bad.json")),
      {"activation_offload_modules", "unpaired F and B blocks only"});
  std::vector<std::string> both = with({"--offload-modules", "core_attn"}, "bad.json");
  both[std::find(both.begin(), both.end(), "--pp") - both.begin() + 1] = "1";
  both.insert(both.end() - 2, {"--activation-offload", "4"});
  expect_error(box.nnsim(both), {"--offload-modules", "--activation-offload", "drop one"});
  // Named modules in the search: every plan offloads them.
  RunResult pinned = box.nnsim({"plan", "--model", "llama3-8b", "--topo", "dgx-a100x4", "--nodes",
                                "1", "--global-batch", "32", "--confirm", "0", "--offload-modules",
                                "core_attn", "-o", "pinned.json"});
  ASSERT_EQ(pinned.status, 0) << pinned;
  expect_matches(pinned.out, R"(\n +1 +tp\S+ .* offload-modules=core_attn)");
  EXPECT_EQ(box.read_json("pinned.json")["activation_offload_modules"], json::array({"attn.core"}));
  expect_error(
      box.nnsim({"plan", "--model", "llama3-8b", "--topo", "dgx-a100x4", "--nodes", "1",
                 "--global-batch", "32", "--offload-modules", "auto,core_attn", "-o", "x.json"}),
      {"--offload-modules: 'auto' is no module", "core_attn"});
  expect_error(box.nnsim(with({"--offload-modules", "auto"}, "bad.json")),
               {"--offload-modules auto lets the search offload", "drop --tp/--pp"});
  // The search offloads modules where plans do not fit (docs/PLANNER.md).
  RunResult search = box.nnsim({"plan", "--model", "llama3-8b", "--topo", "dgx-a100x4", "--nodes",
                                "1", "--global-batch", "32", "--confirm", "0", "--top", "40",
                                "--offload-modules", "auto", "-o", "auto.json"});
  ASSERT_EQ(search.status, 0) << search;
  expect_matches(search.out, R"(\n +[0-9]+ +tp\S+ .* offload-modules=core_attn)");
  expect_error(
      box.nnsim({"--topo", "dgx-a100x4", "--topo-set", "node.host.memory=1 GB", "host.json"}),
      {"does not fit in host memory", "fewer activation_offload_modules (--offload-modules)"});
}

// --loss names the training code's cross-entropy: the plan's model carries it (the preset's own
// is the fused kernel), and a misspelling is an error naming the option and the spellings.
TEST(NnsimTool, PlanTakesTheTrainingCodesCrossEntropy) {
  Sandbox box;
  const std::vector<std::string> base = {"plan",       "--model",        "gpt3-1.3b", "--topo",
                                         "dgx-a100x4", "--tp",           "2",         "--pp",
                                         "1",          "--global-batch", "32"};
  auto with = [&](const std::vector<std::string>& extra, const std::string& out) {
    return plan_args(base, extra, out);
  };
  make_plan(box, with({}, "preset.json"));
  EXPECT_EQ(box.read_json("preset.json")["model"]["loss"], "fused");
  make_plan(box, with({"--loss", "vocab_parallel"}, "megatron.json"));
  EXPECT_EQ(box.read_json("megatron.json")["model"]["loss"], "vocab_parallel");
  expect_error(box.nnsim(with({"--loss", "vocab-parallel"}, "bad.json")),
               {"--loss", "vocab-parallel", "vocab_parallel", "loss_parallel"});
}

TEST(NnsimTool, PlanThenSimulateWritesConsistentReports) {
  Sandbox box;
  make_plan(box);
  json plan = box.read_json("p.json");
  EXPECT_EQ(plan["format"], "nnsim-plan");

  RunResult r = box.nnsim({"--topo", topology_path("dgx-a100x4"), "p.json", "--json", "r.json",
                           "--trace", "t.json", "--hdf5", "t.h5"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "iteration time")) << r;
  EXPECT_TRUE(contains(r.out, "throughput")) << r;
  EXPECT_TRUE(contains(r.out, "peak memory")) << r;
  // Under it, what the fullest GPU holds at its peak.
  for (const char* part : {"activations ", "weights ", "gradients ", "optimizer state ",
                           "NCCL buffers and runtime "}) {
    EXPECT_TRUE(contains(r.out, part)) << part << "\n" << r;
  }
  // Not a terminal: no progress output anywhere.
  EXPECT_FALSE(contains(r.out, "\r")) << r;
  EXPECT_FALSE(contains(r.err, "\r")) << r;
  EXPECT_EQ(r.err, "") << r;

  // The JSON report.
  ASSERT_TRUE(box.exists("r.json"));
  json report = box.read_json("r.json");
  EXPECT_EQ(report["format"], "nnsim-report");
  const double t = report["iteration_time_s"].get<double>();
  EXPECT_GT(t, 0);
  std::optional<Printed> shown = printed_iteration_time(r.out);
  ASSERT_TRUE(shown.has_value()) << r;
  EXPECT_NEAR(shown->seconds, t, shown->half_ulp * (1 + 1e-9)) << shown->text;
  EXPECT_EQ(shown->text, format_seconds(t));

  EXPECT_EQ(report["gpus"], 32);
  ASSERT_TRUE(report["per_gpu"].is_array());
  ASSERT_EQ(report["per_gpu"].size(), 32u);
  std::set<int> gpus;
  for (const auto& g : report["per_gpu"]) gpus.insert(g["gpu"].get<int>());
  EXPECT_EQ(gpus.size(), 32u);
  EXPECT_EQ(*gpus.begin(), 0);
  EXPECT_EQ(*gpus.rbegin(), 31);

  ASSERT_TRUE(report["lanes"].is_array());
  ASSERT_FALSE(report["lanes"].empty());
  for (const auto& lane : report["lanes"]) {
    const json& b = lane["breakdown"];
    double sum = b["compute_s"].get<double>() + b["recompute_s"].get<double>() +
                 b["optimizer_s"].get<double>() + b["bubble_s"].get<double>();
    for (const auto& [group, s] : b["exposed_comm_s"].items()) sum += s.get<double>();
    EXPECT_NEAR(sum, t, 1e-9 * t) << "lane " << lane["name"] << ": " << b.dump();
  }

  // The Chrome trace: complete events on per-lane (pid) and per-stream (tid) tracks.
  ASSERT_TRUE(box.exists("t.json"));
  json trace = box.read_json("t.json");
  ASSERT_TRUE(trace.contains("traceEvents"));
  ASSERT_TRUE(trace["traceEvents"].is_array());
  size_t complete = 0;
  std::set<std::pair<int, int>> tracks, named;
  std::set<int> pids;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name") {
      named.insert({e["pid"].get<int>(), e["tid"].get<int>()});
    }
    if (e.value("ph", "") != "X") continue;
    ++complete;
    ASSERT_TRUE(e.contains("pid") && e["pid"].is_number_integer()) << e.dump();
    ASSERT_TRUE(e.contains("tid") && e["tid"].is_number_integer()) << e.dump();
    ASSERT_TRUE(e.contains("ts") && e.contains("dur")) << e.dump();
    EXPECT_GE(e["dur"].get<double>(), 0) << e.dump();
    tracks.insert({e["pid"].get<int>(), e["tid"].get<int>()});
    pids.insert(e["pid"].get<int>());
  }
  EXPECT_GT(complete, 0u);
  EXPECT_GE(pids.size(), 4u);  // one process per pipeline stage at least
  for (const auto& track : tracks) {
    EXPECT_TRUE(named.count(track))
        << "unnamed track pid " << track.first << " tid " << track.second;
  }
  EXPECT_TRUE(box.exists("t.h5"));
}

// The python3 that has h5py: PATH's first, else the system one (pyenv and virtualenvs often
// shadow the distribution's python3-h5py). Sets *why when there is none.
std::optional<std::string> python_with_h5py(const Sandbox& box, std::string* why) {
  *why = "";
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    RunResult r = box.exec(python, {"-c", "import h5py"});
    if (r.status == 0) return std::string(python);
    *why += std::string(python) + ": " +
            (r.status == 127 ? "not found" : "cannot import h5py (" + r.err + ")") + "; ";
  }
  return std::nullopt;
}

// `calibration export --framework` writes the model a plan of that framework gets: simulating
// with it reproduces the built-in figures exactly; the framework-free export (unfused
// elementwise kernels) does not for a Megatron plan.
TEST(NnsimTool, ExportedFrameworkDefaultsReproduceTheBuiltInModel) {
  Sandbox box;
  make_plan(box);
  for (const char* f : {"megatron", ""}) {
    std::vector<std::string> args = {"calibration", "export",
                                     "--gpu",       "a100-sxm4-80gb",
                                     "-o",          std::string(*f ? f : "plain") + ".h5"};
    if (*f) args.insert(args.end(), {"--framework", f});
    RunResult r = box.nnsim(args);
    ASSERT_EQ(r.status, 0) << r;
  }
  auto simulated = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--topo", "dgx-a100x4", "p.json", "--json", "r.json"};
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = box.nnsim(args);
    EXPECT_EQ(r.status, 0) << r;
    return json::parse(box.read("r.json"))["iteration_time_s"].get<double>();
  };
  const double built_in = simulated({});
  EXPECT_EQ(simulated({"--calib", "megatron.h5"}), built_in);
  EXPECT_GT(simulated({"--calib", "plain.h5"}), built_in);
}

// A mixture of experts from a user's model file: planned with tensor and sequence parallelism,
// simulated, and reported. With one expert per token of the dense MLP's width it runs the
// dense model's matmuls plus routing.
// A small Llama-style model (dense.yaml) and its mixture of 8 experts (moe.yaml).
void write_dense_and_moe(Sandbox& box, int layers, int experts_per_token) {
  const std::string dense = fmt::format(
      "layers: {}\nhidden: 1024\nheads: 16\nkv_heads: 4\nffn_hidden: 4096\nmlp: swiglu\n"
      "vocab: 32000\nseq_len: 2048\nposition: rope\nnorm: rmsnorm\nbias: false\n",
      layers);
  box.write("dense.yaml", dense);
  box.write("moe.yaml",
            dense + fmt::format("experts: 8\nexperts_per_token: {}\n", experts_per_token));
}

TEST(NnsimTool, MixtureOfExpertsPlansAndSimulates) {
  Sandbox box;
  write_dense_and_moe(box, 8, 1);
  auto run = [&](const std::string& model) {
    RunResult p = box.nnsim({"plan", "--model", model + ".yaml", "--topo", "dgx-a100x4", "--nodes",
                             "1", "--tp", "4", "--pp", "1", "--sequence-parallel", "--global-batch",
                             "16", "-o", model + ".json"});
    EXPECT_EQ(p.status, 0) << p;
    RunResult r =
        box.nnsim({"--topo", "dgx-a100x4", "--nodes", "1", model + ".json", "--json", "r.json"});
    EXPECT_EQ(r.status, 0) << r;
    // A mixture's report says its step times are not validated yet (docs/moe.md).
    EXPECT_EQ(contains(r.out, "mixture-of-experts step times are not validated yet"),
              model == "moe")
        << r;
    EXPECT_FALSE(contains(r.out, "hypothetical GPU")) << r;  // an A100 of the catalog
    EXPECT_FALSE(contains(r.out, "Mamba-2")) << r;
    return json::parse(box.read("r.json"));
  };
  const json d = run("dense"), m = run("moe");
  EXPECT_EQ(json::parse(box.read("moe.json"))["model"]["experts"], 8);
  EXPECT_GT(m["iteration_time_s"].get<double>(), d["iteration_time_s"].get<double>());
  EXPECT_LT(m["iteration_time_s"].get<double>(), 1.5 * d["iteration_time_s"].get<double>());
}

// A hybrid preset plans and simulates from the command line; the report says what backs the
// Mamba-2 layers' pricing (docs/hybrid.md), as the search's table does.
TEST(NnsimTool, HybridModelPlansAndSimulates) {
  Sandbox box;
  RunResult p = box.nnsim({"plan", "--model", "nemotron-h-8b", "--topo", "dgx-h100-superpod",
                           "--nodes", "1", "--tp", "2", "--pp", "2", "--sequence-parallel",
                           "--zero", "1", "--global-batch", "16", "-o", "h.json"});
  EXPECT_EQ(p.status, 0) << p;
  RunResult r = box.nnsim({"--topo", "dgx-h100-superpod", "--nodes", "1", "h.json"});
  EXPECT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "Mamba-2 layers are priced by their kernels' traffic")) << r;
  EXPECT_FALSE(contains(r.out, "mixture-of-experts")) << r;
  const json plan = json::parse(box.read("h.json"));
  EXPECT_EQ(plan["model"]["layer_pattern"].get<std::string>().size(), 52u);
  EXPECT_EQ(plan["model"]["mamba_heads"], 128);
}

// A Gated DeltaNet hybrid mixture of experts (Qwen3-Next) from the command line: the plan carries
// the mixer's fields, and the report notes that nothing measured has checked its pricing.
TEST(NnsimTool, GatedDeltaNetModelPlansAndSimulates) {
  Sandbox box;
  RunResult p = box.nnsim({"plan",
                           "--model",
                           "qwen3-next-80b-a3b",
                           "--topo",
                           "dgx-h100-superpod",
                           "--nodes",
                           "4",
                           "--tp",
                           "1",
                           "--cp",
                           "2",
                           "--pp",
                           "4",
                           "--ep",
                           "4",
                           "--zero",
                           "1",
                           "--recompute",
                           "full",
                           "--global-batch",
                           "16",
                           "-o",
                           "q.json"});
  EXPECT_EQ(p.status, 0) << p;
  RunResult r = box.nnsim({"--topo", "dgx-h100-superpod", "--nodes", "4", "q.json"});
  EXPECT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "Gated DeltaNet layers are priced by their kernels")) << r;
  EXPECT_FALSE(contains(r.out, "Mamba-2")) << r;
  const json plan = json::parse(box.read("q.json"));
  EXPECT_EQ(plan["model"]["gdn_value_heads"], 32);
  EXPECT_EQ(plan["model"]["attention_output_gate"], true);
  // Its 80B parameters and their optimizer state do not fit one node's 8 GPUs without sharding.
  RunResult one = box.nnsim({"plan", "--model", "qwen3-next-80b-a3b", "--topo", "dgx-h100-superpod",
                             "--nodes", "1", "--tp", "2", "--pp", "2", "--sequence-parallel",
                             "--global-batch", "4", "-o", "one.json"});
  EXPECT_TRUE(contains(one.err, "does not fit in memory")) << one;
}

// Expert parallelism from the command line: the builder spreads the experts over --ep of the
// data-parallel ranks, the simulator reports the all-to-alls as the "ep" group's exposed
// communication, each GPU holds fewer weights, and the search tries expert-parallel degrees
// for mixture-of-experts models only. Degrees that do not fit are refused, naming the flag.
TEST(NnsimTool, ExpertParallelismPlansSearchesAndSimulates) {
  Sandbox box;
  write_dense_and_moe(box, 4, 2);
  auto plan = [&](const std::string& model, const std::string& ep, const std::string& out) {
    return box.nnsim({"plan", "--model", model + ".yaml", "--topo", "dgx-a100x4", "--nodes", "1",
                      "--tp", "1", "--pp", "1", "--ep", ep, "--global-batch", "16", "-o", out});
  };
  auto simulate = [&](const std::string& plan_file) {
    RunResult r =
        box.nnsim({"--topo", "dgx-a100x4", "--nodes", "1", plan_file, "--json", "r.json"});
    EXPECT_EQ(r.status, 0) << r;
    return json::parse(box.read("r.json"));
  };
  ASSERT_EQ(plan("moe", "4", "ep4.json").status, 0);
  ASSERT_EQ(plan("moe", "1", "ep1.json").status, 0);
  const json written = json::parse(box.read("ep4.json"));
  const json with_ep = simulate("ep4.json"), without = simulate("ep1.json");
  std::map<std::string, int> axes;
  for (const json& a : written["mesh"]) axes[a[0].get<std::string>()] = a[1].get<int>();
  EXPECT_EQ(axes["ep"], 4);
  EXPECT_EQ(axes["dp"], 2);
  const json& lane = with_ep["lanes"][0];
  EXPECT_GT(lane["breakdown"]["exposed_comm_s"].value("ep", 0.0), 0) << lane["breakdown"];
  EXPECT_LT(lane["memory"]["weights_bytes"].get<double>(),
            without["lanes"][0]["memory"]["weights_bytes"].get<double>() / 2);

  RunResult bad = plan("moe", "3", "bad.json");
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "--ep 3 does not divide the model's 8 experts")) << bad;
  bad = plan("dense", "2", "bad.json");
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "has none (model.experts)")) << bad;
  bad = box.nnsim({"plan", "--model", "moe.yaml", "--topo", "dgx-a100x4", "--nodes", "1", "--tp",
                   "2", "--pp", "1", "--etp", "3", "--global-batch", "16", "-o", "bad.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "--etp 3: the experts split over all the tensor-parallel ranks"))
      << bad;
  // Two plan-file choices of a mixture of experts, each never slower than without it, and
  // refused for a dense model, naming the field: the experts as one grouped-GEMM kernel, and
  // DeepEP's exchange (on one node it sends a token once to each GPU holding its experts).
  ASSERT_EQ(plan("dense", "1", "dense.json").status, 0);
  for (const auto& [field, refusal] :
       {std::pair<std::string, std::string>{"moe_grouped_gemm",
                                            "groups a mixture of experts' GEMMs"},
        {"moe_deepep", "exchanges a mixture of experts' tokens"}}) {
    json with = written;
    with[field] = true;
    box.write(field + ".json", with.dump(1));
    EXPECT_LE(simulate(field + ".json")["iteration_time_s"].get<double>(),
              with_ep["iteration_time_s"].get<double>())
        << field;
    json dense_with = json::parse(box.read("dense.json"));
    dense_with[field] = true;
    box.write("dense-" + field + ".json", dense_with.dump(1));
    bad = box.nnsim({"--topo", "dgx-a100x4", "--nodes", "1", "dense-" + field + ".json"});
    EXPECT_NE(bad.status, 0);
    EXPECT_TRUE(contains(bad.err, fmt::format("field '{}': {}", field, refusal))) << bad;
  }
  bad = box.nnsim({"plan", "--model", "dense.yaml", "--topo", "dgx-a100x4", "--nodes", "1", "--tp",
                   "1", "--pp", "1", "--moe-deepep", "--global-batch", "16", "-o", "bad.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "--moe-deepep exchanges a mixture of experts' tokens")) << bad;
  // Combined 1F1B: the builder refuses it for a dense model, and a dense plan file asking for it
  // fails at compilation naming the field and what it needs.
  bad = box.nnsim({"plan", "--model", "dense.yaml", "--topo", "dgx-a100x4", "--nodes", "1", "--tp",
                   "1", "--pp", "1", "--ep-overlap", "--global-batch", "16", "-o", "bad.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "--ep-overlap hides a mixture of experts'")) << bad;
  bad = box.nnsim({"plan", "--model", "dense.yaml", "--topo", "dgx-a100x4", "--nodes", "1", "--tp",
                   "1", "--pp", "1", "--moe-shared-expert-overlap", "--global-batch", "16", "-o",
                   "bad.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "has no shared expert (model.shared_expert_ffn_hidden)")) << bad;
  json dense_overlap = json::parse(box.read("dense.json"));
  dense_overlap["communication"]["ep_overlap"] = true;
  box.write("dense-overlap.json", dense_overlap.dump(1));
  bad = box.nnsim({"--topo", "dgx-a100x4", "--nodes", "1", "dense-overlap.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "communication.ep_overlap: no forward block")) << bad;
  // A plan file asking for no sub-batch at all names the field.
  json zero = written;
  zero["communication"]["tp_sub_batches"] = 0;
  box.write("zero.json", zero.dump(1));
  bad = box.nnsim({"--topo", "dgx-a100x4", "--nodes", "1", "zero.json"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "field 'communication.tp_sub_batches': must be at least 1")) << bad;

  // The search's candidates: expert-parallel degrees 1, 2, 4 and 8 and folded expert tensor
  // parallelism for the experts, ep 1 only for the dense model.
  auto searched_eps = [&](const std::string& model) {
    RunResult r = box.nnsim({"plan", "--model", model + ".yaml", "--topo", "dgx-a100x4", "--nodes",
                             "1", "--global-batch", "16", "--confirm", "0", "--top", "100000",
                             "--csv", model + ".csv", "-o", model + "-best.json"});
    EXPECT_EQ(r.status, 0) << r;
    // The search's table over a mixture carries the report's note on MoE step times.
    EXPECT_EQ(contains(r.out, "mixture-of-experts step times are not validated yet"),
              model == "moe")
        << r;
    std::set<std::string> eps;
    std::istringstream csv(box.read(model + ".csv"));
    std::string line;
    std::getline(csv, line);
    EXPECT_TRUE(contains(line, ",cp,ep,etp,dp,")) << line;
    while (std::getline(csv, line)) {
      if (contains(line, "\"")) continue;  // a quoted description holds commas
      std::vector<std::string> f;
      std::istringstream row(line);
      for (std::string x; std::getline(row, x, ',');) f.push_back(x);
      if (f.size() > 7) eps.insert(f[6]);
      // Whole experts over the tensor-parallel ranks: tp > 1 with expert tp 1.
      if (f.size() > 7 && f[2] != "1" && f[7] == "1") eps.insert("folded");
    }
    return eps;
  };
  EXPECT_EQ(searched_eps("moe"), (std::set<std::string>{"1", "2", "4", "8", "folded"}));
  EXPECT_EQ(searched_eps("dense"), (std::set<std::string>{"1"}));

  // docs/PLANNER.md's NeMo configuration of Mixtral 8x7B builds from the bundled model file.
  RunResult nemo = box.nnsim({"plan",
                              "--model",
                              (kSourceDir / "examples" / "mixtral-8x7b-seq4096.yaml").string(),
                              "--topo",
                              "dgx-h100-superpod",
                              "--nodes",
                              "8",
                              "--tp",
                              "1",
                              "--pp",
                              "4",
                              "--vpp",
                              "8",
                              "--ep",
                              "8",
                              "--micro-batch",
                              "1",
                              "--global-batch",
                              "256",
                              "--recompute",
                              "none",
                              "--zero",
                              "1",
                              "--schedule",
                              "interleaved",
                              "-o",
                              "nemo.json"});
  ASSERT_EQ(nemo.status, 0) << nemo;
  EXPECT_TRUE(contains(nemo.out, "tp1 pp4 dp16 ep8 vpp8 interleaved")) << nemo;
}

// `nnsim schedule --calib` and `nnsim plan --calib` time the generators' blocks with the file's
// cost model: the schedule's estimate is the calibrated simulation's, not the built-in one's.
TEST(NnsimTool, ScheduleAndPlanTimeTheBlocksWithTheCalibration) {
  Sandbox box;
  std::string why;
  std::optional<std::string> python = python_with_h5py(box, &why);
  if (!python) GTEST_SKIP() << "no python3 with h5py (apt-get install python3-h5py): " << why;
  RunResult r = box.nnsim({"calibration", "export", "--gpu", "a100-sxm4-80gb", "--framework",
                           "megatron", "-o", "c.h5"});
  ASSERT_EQ(r.status, 0) << r;
  // Half the sustained tensor throughput: every GEMM and attention kernel takes twice as long
  // (communication and memory-bound kernels do not).
  box.write("slow.py", R"(import h5py
with h5py.File("c.h5", "r+") as f:
    a = f["a100-sxm4-80gb/compute"].attrs
    a["sustained"] = a["sustained"] / 2
)");
  ASSERT_EQ(box.exec(*python, {"slow.py"}).status, 0);
  r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "4",
                 "--global-batch", "32", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  auto estimate = [](const std::string& out) {
    std::smatch m;
    static const std::regex re(R"(estimated iteration ([0-9.]+) (s|ms))");
    if (!std::regex_search(out, m, re)) return 0.0;
    return std::stod(m[1].str()) * (m[2] == "s" ? 1 : 1e-3);
  };
  RunResult plain =
      box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "-o", "z0.json"});
  ASSERT_EQ(plain.status, 0) << plain;
  RunResult slow = box.nnsim(
      {"schedule", "--plan", "p.json", "--generator", "zb-h1", "--calib", "c.h5", "-o", "z.json"});
  ASSERT_EQ(slow.status, 0) << slow;
  RunResult sim =
      box.nnsim({"--topo", "dgx-a100x4", "z.json", "--calib", "c.h5", "--json", "r.json"});
  ASSERT_EQ(sim.status, 0) << sim;
  const double simulated = json::parse(box.read("r.json"))["iteration_time_s"].get<double>();
  EXPECT_GT(estimate(slow.out), 1.2 * estimate(plain.out)) << plain << slow;
  EXPECT_NEAR(estimate(slow.out), simulated, 0.05 * simulated) << slow;

  r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "4",
                 "--global-batch", "32", "--schedule", "zb-h1", "--calib", "c.h5", "-o", "q.json"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_EQ(json::parse(box.read("q.json"))["schedule"]["name"], "zb-h1");
  expect_error(box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8",
                          "--global-batch", "32", "--calib", "none.h5", "-o", "x.json"}),
               {"none.h5"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "--calib",
                          "none.h5", "-o", "x.json"}),
               {"none.h5"});
}

TEST(NnsimTool, Hdf5TimelineIsReadableWithH5py) {
  Sandbox box;
  std::string why;
  std::optional<std::string> python = python_with_h5py(box, &why);
  if (!python) GTEST_SKIP() << "no python3 with h5py (apt-get install python3-h5py): " << why;

  make_plan(box);
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--hdf5", "t.h5"});
  ASSERT_EQ(r.status, 0) << r;
  ASSERT_TRUE(box.exists("t.h5"));
  box.write("check.py", R"(import sys
import h5py
with h5py.File(sys.argv[1], "r") as f:
    fmt = f.attrs["format"]
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    assert fmt == "nnsim-timeline", fmt
    tasks = f["tasks"]
    assert isinstance(tasks, h5py.Dataset), type(tasks)
    rows = tasks[()]
    assert len(rows) > 0, "no tasks"
    bad = [i for i, row in enumerate(rows) if not row["start_s"] <= row["end_s"]]
    assert not bad, "rows with start_s > end_s: %s" % bad[:10]
    print("ok", len(rows))
)");
  RunResult check = box.exec(*python, {"check.py", "t.h5"});
  EXPECT_EQ(check.status, 0) << check;
  EXPECT_TRUE(contains(check.out, "ok ")) << check;
}

TEST(NnsimTool, TopologyByPresetNameOrPathAndSimulateSubcommandAgree) {
  Sandbox box;
  make_plan(box);
  // A plan built against the topology file is the same plan.
  std::vector<std::string> by_path = kPlanArgs;
  by_path[4] = topology_path("dgx-a100x4");
  by_path.back() = "p2.json";
  make_plan(box, by_path);
  EXPECT_EQ(box.read("p.json"), box.read("p2.json"));

  RunResult a = box.nnsim({"--topo", topology_path("dgx-a100x4"), "p.json", "--json", "a.json"});
  RunResult b = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "b.json"});
  RunResult c = box.nnsim({"simulate", "--topo", "dgx-a100x4", "p.json", "--json", "c.json"});
  ASSERT_EQ(a.status, 0) << a;
  ASSERT_EQ(b.status, 0) << b;
  ASSERT_EQ(c.status, 0) << c;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out, c.out);
  EXPECT_EQ(c.err, "") << c;
  EXPECT_EQ(box.read("a.json"), box.read("b.json"));
  EXPECT_EQ(box.read("a.json"), box.read("c.json"));
}

// ------------------------------------------------------------------------------------------
// 2. Determinism.

TEST(NnsimTool, RunsAreByteIdentical) {
  Sandbox box;
  make_plan(box);
  RunResult a =
      box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "r1.json", "--trace", "t1.json"});
  RunResult b =
      box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "r2.json", "--trace", "t2.json"});
  ASSERT_EQ(a.status, 0) << a;
  ASSERT_EQ(b.status, 0) << b;
  EXPECT_EQ(a.out, b.out);
  std::string r1 = box.read("r1.json"), t1 = box.read("t1.json");
  EXPECT_FALSE(r1.empty());
  EXPECT_FALSE(t1.empty());
  EXPECT_TRUE(r1 == box.read("r2.json")) << "r.json differs between two runs";
  EXPECT_TRUE(t1 == box.read("t2.json")) << "t.json differs between two runs";
}

// ------------------------------------------------------------------------------------------
// 3. --nodes.

TEST(NnsimTool, NodesResizesTheTopologyForPlanAndSimulate) {
  Sandbox box;
  std::vector<std::string> args = kPlanArgs;
  args.insert(args.end(), {"--nodes", "8"});
  make_plan(box, args);
  json plan = box.read_json("p.json");
  EXPECT_TRUE(contains(plan["name"].get<std::string>(), "dp8")) << plan["name"];

  RunResult ok = box.nnsim({"--topo", "dgx-a100x4", "--nodes", "8", "p.json", "--json", "r.json"});
  ASSERT_EQ(ok.status, 0) << ok;
  EXPECT_TRUE(contains(ok.out, "(64 x ")) << ok;
  json report = box.read_json("r.json");
  EXPECT_EQ(report["gpus"], 64);
  EXPECT_EQ(report["per_gpu"].size(), 64u);

  RunResult bad = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "bad.json"});
  expect_error(bad, {"p.json", "64 ranks", "32 GPUs", "--nodes"});
  EXPECT_FALSE(box.exists("bad.json"));
}

TEST(NnsimTool, TrainTokensGivesTheTimeToTrainAtTheSimulatedIteration) {
  Sandbox box;
  make_plan(box);
  RunResult r =
      box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "r.json", "--train-tokens", "300B"});
  ASSERT_EQ(r.status, 0) << r;
  json report = box.read_json("r.json");
  // gpt3-1.3b, 64 sequences of 2,048 tokens a step: 3e11 / 131,072 = 2,288,818.4 steps.
  const json& t = report["training"];
  EXPECT_EQ(t["tokens"].get<double>(), 3e11);
  EXPECT_EQ(t["tokens_per_step"].get<double>(), 131072.0);
  EXPECT_EQ(t["steps"].get<int64_t>(), 2288819);
  EXPECT_DOUBLE_EQ(t["time_s"].get<double>(), 2288819 * report["iteration_time_s"].get<double>());
  EXPECT_EQ(t["gpus"], 32);
  EXPECT_DOUBLE_EQ(t["gpu_hours"].get<double>(), 32 * t["time_s"].get<double>() / 3600);
  EXPECT_TRUE(contains(r.out, "to train         300 B tokens in 2,288,819 steps of 131 k tokens: "))
      << r;
  EXPECT_TRUE(contains(r.out, " days on 32 GPUs, ")) << r;
  // Without the option the report has no training figures.
  ASSERT_EQ(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "plain.json"}).status, 0);
  EXPECT_FALSE(box.read_json("plain.json").contains("training"));

  // The search prints the best plan's, from its simulated time.
  RunResult s = box.nnsim({"plan",
                           "--model",
                           "gpt3-1.3b",
                           "--topo",
                           "dgx-a100x4",
                           "--tp",
                           "2",
                           "--pp",
                           "4",
                           "--micro-batch",
                           "1",
                           "--recompute",
                           "none",
                           "--zero",
                           "1",
                           "--schedule",
                           "1f1b",
                           "--global-batch",
                           "64",
                           "--search",
                           "--jobs",
                           "1",
                           "--confirm",
                           "1",
                           "--csv",
                           "s.csv",
                           "-o",
                           "s.json",
                           "--train-tokens",
                           "1B"});
  ASSERT_EQ(s.status, 0) << s;
  std::istringstream csv(box.read("s.csv"));
  std::string header, best;
  std::getline(csv, header);
  std::getline(csv, best);
  // simulated_s is the CSV's 19th column; 1e9 / 131,072 = 7,629.4 steps.
  std::vector<std::string> cells(1);
  bool quoted = false;
  for (char c : best) {
    if (c == '"')
      quoted = !quoted;
    else if (c == ',' && !quoted)
      cells.emplace_back();
    else
      cells.back() += c;
  }
  ASSERT_GE(cells.size(), 19u) << best;
  const double minutes = 7630 * std::stod(cells[18]) / 60;
  EXPECT_TRUE(contains(
      s.out, fmt::format("the best plan (simulated) trains 1.00 B tokens in 7,630 steps of "
                         "131 k tokens: {:.1f} min on 32 GPUs",
                         minutes)))
      << s;

  // With failures: Llama 3's rate on 32 GPUs, 30 s checkpoints, 600 s restarts.
  RunResult f = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "f.json", "--train-tokens",
                           "300B", "--checkpoint-seconds", "30", "--restart-seconds", "600"});
  ASSERT_EQ(f.status, 0) << f;
  const json w = box.read_json("f.json")["training"]["with_failures"];
  EXPECT_EQ(w["checkpoint_s"], 30.0);
  EXPECT_DOUBLE_EQ(w["mtbf_s"].get<double>(), 3600 / (32 * 419.0 / (54 * 24 * 16384.0)));
  EXPECT_DOUBLE_EQ(w["time_s"].get<double>(),
                   t["time_s"].get<double>() / (1 - w["lost_fraction"].get<double>()));
  EXPECT_TRUE(contains(f.out, "with failures: ")) << f;
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--train-tokens", "1B",
                          "--checkpoint-seconds", "30"}),
               {"give both --checkpoint-seconds and --restart-seconds"});
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--checkpoint-seconds", "30",
                          "--restart-seconds", "60"}),
               {"need --train-tokens"});
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--train-tokens", "3x"}),
               {"--train-tokens", "'3x'", "15T"});
  std::vector<std::string> built(kPlanArgs.begin(), kPlanArgs.end() - 2);  // without -o p.json
  built.insert(built.end(), {"-o", "b.json", "--train-tokens", "1B"});
  expect_error(box.nnsim(built), {"--train-tokens", "--search", "plan.json --train-tokens"});
  EXPECT_FALSE(box.exists("b.json"));
}

// `--sensitivity F`: the plan simulated again with each resource F times as fast, in the report
// and its JSON; the main figures are the plain run's.
TEST(NnsimTool, SensitivityRerunsThePlanWithEachResourceScaled) {
  Sandbox box;
  make_plan(box);
  ASSERT_EQ(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "plain.json"}).status, 0);
  RunResult r =
      box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "s.json", "--sensitivity", "2"});
  ASSERT_EQ(r.status, 0) << r;
  const json plain = box.read_json("plain.json");
  const json report = box.read_json("s.json");
  EXPECT_FALSE(plain.contains("sensitivity"));
  EXPECT_EQ(report["iteration_time_s"], plain["iteration_time_s"]);
  const json& s = report["sensitivity"];
  EXPECT_EQ(s["factor"], 2.0);
  ASSERT_EQ(s["resources"].size(), 5u);
  const double base = report["iteration_time_s"].get<double>();
  std::vector<std::string> names;
  for (const json& x : s["resources"]) {
    names.push_back(x["resource"].get<std::string>());
    const double t = x["iteration_time_s"].get<double>();
    EXPECT_LT(t, base) << x;  // faster hardware never slows this plan
    EXPECT_DOUBLE_EQ(x["change"].get<double>(), t / base - 1) << x;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"compute", "hbm", "intra-node", "network", "latency"}));
  EXPECT_TRUE(contains(r.out, "sensitivity: the plan simulated again with one resource 2x as fast"))
      << r;
  EXPECT_TRUE(contains(r.out, "GPU dense FLOP/s, every precision")) << r;
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--sensitivity", "0"}),
               {"--sensitivity", "must be more than 0"});
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--sensitivity", "fast"}),
               {"--sensitivity", "expected a number, got 'fast'"});
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--sensitivity", "500"}),
               {"--sensitivity", "the factor must be from 0.01 to 100"});

  // The search's best plan, against its confirming simulation; the builder has none.
  RunResult searched =
      box.nnsim({"plan",      "--model", "gpt3-1.3b",      "--topo", "dgx-a100x4", "--tp",   "2",
                 "--pp",      "4",       "--global-batch", "64",     "--search",   "--jobs", "1",
                 "--confirm", "1",       "--sensitivity",  "2",      "-o",         "s.json"});
  ASSERT_EQ(searched.status, 0) << searched;
  EXPECT_TRUE(contains(searched.out, "the best plan simulated: ")) << searched;
  EXPECT_TRUE(contains(searched.out, "sensitivity: the plan simulated again")) << searched;
  RunResult again = box.nnsim({"--topo", "dgx-a100x4", "s.json", "--sensitivity", "2"});
  ASSERT_EQ(again.status, 0) << again;
  // The same plan, the same four simulations: the same table.
  const std::string table = "sensitivity: the plan simulated again";
  EXPECT_EQ(searched.out.substr(searched.out.find(table),
                                searched.out.find("wrote s.json") - searched.out.find(table)),
            again.out.substr(again.out.find(table)))
      << searched << again;
  std::vector<std::string> built(kPlanArgs.begin(), kPlanArgs.end() - 2);  // without -o p.json
  built.insert(built.end(), {"-o", "b.json", "--sensitivity", "2"});
  expect_error(box.nnsim(built), {"--sensitivity needs a simulated plan", "--search"});
  EXPECT_FALSE(box.exists("b.json"));
}

// `nnsim topology` shows the cluster a what-if makes, and writes it to replay.
TEST(NnsimTool, TopologyShowsAndWritesTheClusterAsRead) {
  Sandbox box;
  RunResult r = box.nnsim({"topology", "--topo", "dgx-h100-superpod", "--nodes", "16", "--topo-set",
                           "node.nics.bandwidth=800Gb/s", "--topo-set", "gpu.hbm_bytes=141GB", "-o",
                           "what.yaml"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "16 nodes x 8 GPUs = 128 GPUs")) << r;
  EXPECT_TRUE(contains(r.out, "8 a node, 100 GB/s each per direction (800 GB/s a node)")) << r;
  EXPECT_TRUE(contains(r.out, "131.32 GiB of memory")) << r;
  EXPECT_TRUE(contains(r.out, "hypothetical: h100-sxm5-80gb's measured efficiencies")) << r;
  // The PCIe link each GPU's NIC traffic and host copies share.
  EXPECT_TRUE(contains(r.out,
                       "PCIe       64.0 GB/s per GPU link (to its NIC and the host), 8 "
                       "switches"))
      << r;
  // The written file reads back as the same cluster.
  RunResult back = box.nnsim({"topology", "--topo", "what.yaml"});
  ASSERT_EQ(back.status, 0) << back;
  EXPECT_EQ(back.out + "wrote what.yaml\n", r.out);
  expect_error(box.nnsim({"topology", "--topo", "dgx-h100-superpod", "--topo-set", "fabric=3"}),
               {"--topo-set fabric=3", "field 'fabric'"});
}

TEST(NnsimTool, TopoSetReplacesTopologyFieldsForPlanAndSimulate) {
  Sandbox box;
  make_plan(box);
  RunResult base = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "base.json"});
  ASSERT_EQ(base.status, 0) << base;
  // Half the NICs' bandwidth: the same plan's data-parallel and pipeline traffic slows.
  RunResult slow = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "slow.json", "--topo-set",
                              "node.nics.bandwidth=100Gb/s"});
  ASSERT_EQ(slow.status, 0) << slow;
  EXPECT_TRUE(contains(slow.out, "on dgx-a100x4 with node.nics.bandwidth=100Gb/s (32 x")) << slow;
  const json b = box.read_json("base.json");
  const json s = box.read_json("slow.json");
  EXPECT_GT(s["iteration_time_s"].get<double>(), b["iteration_time_s"].get<double>());
  EXPECT_EQ(s["topology"], "dgx-a100x4 with node.nics.bandwidth=100Gb/s");
  // A GPU with less memory: the plan no longer fits, and the message says by how much.
  RunResult small =
      box.nnsim({"--topo", "dgx-a100x4", "p.json", "--topo-set", "gpu.hbm_bytes=4GB"});
  expect_error(small, {"does not fit", "a100-sxm4-80gb-custom"});
  // The plan command reads them too (the builder checks the plan fits the changed cluster). A
  // node of 4 GPUs needs a PCIe tree of 4: the preset's lists GPUs 4-7.
  std::vector<std::string> args(kPlanArgs.begin(), kPlanArgs.end() - 2);
  args.insert(args.end(), {"-o", "q.json", "--topo-set", "node.gpus=4", "--topo-set",
                           "node.nics={count: 4, bandwidth: 200 Gb/s, latency: 1 us}"});
  expect_error(box.nnsim(args), {"node.pcie.switches[2][0]", "GPU 4 does not exist"});
  args.insert(args.end(), {"--topo-set", "node.pcie.switches=[[0, 1], [2, 3]]"});
  RunResult plan = box.nnsim(args);
  ASSERT_EQ(plan.status, 0) << plan;
  EXPECT_TRUE(contains(box.read_json("q.json")["name"].get<std::string>(), "dp2")) << plan;

  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--topo-set", "node.nics.bandwith=1"}),
               {"--topo-set node.nics.bandwith=1", "did you mean 'bandwidth'"});
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "p.json", "--topo-set", "nodes"}),
               {"--topo-set", "expected FIELD=VALUE"});
}

// The plan search at each point, as `nnsim plan` runs it: the same best plan and step.
TEST(NnsimTool, SweepSearchesEachPointAsPlanDoes) {
  Sandbox box;
  const std::vector<std::string> pins = {"--model", "gpt3-1.3b", "--topo",    "dgx-a100x4",
                                         "--tp",    "2",         "--pp",      "4",
                                         "--jobs",  "1",         "--confirm", "1"};
  std::vector<std::string> sweep = {"sweep",
                                    "--nodes",
                                    "1,2",
                                    "--global-batch",
                                    "64",
                                    "--vary",
                                    "node.nics.bandwidth=25Gb/s,200Gb/s",
                                    "--train-tokens",
                                    "1B",
                                    "--json",
                                    "s.json",
                                    "--csv",
                                    "s.csv",
                                    "--plans",
                                    "plans"};
  sweep.insert(sweep.end(), pins.begin(), pins.end());
  RunResult r = box.nnsim(sweep);
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "gpt3-1.3b on dgx-a100x4: 4 points, each searched")) << r;
  const json j = box.read_json("s.json");
  EXPECT_EQ(j["format"], "nnsim-sweep");
  ASSERT_EQ(j["points"].size(), 4u);
  const json& slow = j["points"][1];  // 2 nodes, 25 Gb/s
  const json& fast = j["points"][3];  // 2 nodes, 200 Gb/s
  for (const json* p : {&slow, &fast}) {
    EXPECT_EQ((*p)["status"], "ok") << *p;
    EXPECT_EQ((*p)["gpus"], 16);
    // The pace-setting lane's breakdown adds up to the step.
    const json& lane = (*p)["pace_lane"];
    double parts = lane["compute_s"].get<double>() + lane["recompute_s"].get<double>() +
                   lane["optimizer_s"].get<double>() + lane["bubble_s"].get<double>();
    for (const auto& [group, seconds] : lane["exposed_comm_s"].items()) {
      parts += seconds.get<double>();
    }
    EXPECT_NEAR(parts, (*p)["iteration_time_s"].get<double>(), 1e-9) << lane;
    EXPECT_DOUBLE_EQ((*p)["tokens_per_s"].get<double>(),
                     64.0 * 2048 / (*p)["iteration_time_s"].get<double>());
    EXPECT_EQ((*p)["training"]["steps"], 7630);  // 1e9 / 131,072 tokens, rounded up
  }
  EXPECT_EQ(slow["set"], "node.nics.bandwidth=25Gb/s");
  // The table names each best plan in the search's words, micro-batch included.
  const std::string choices = fast["choices"].get<std::string>();
  EXPECT_EQ(choices.rfind("tp2 pp4 ", 0), 0u) << choices;
  EXPECT_TRUE(contains(choices, " mb")) << choices;
  EXPECT_TRUE(contains(r.out, "  " + choices + "\n")) << r;
  EXPECT_GT(slow["iteration_time_s"].get<double>(), fast["iteration_time_s"].get<double>());
  // Per GPU against the same value's first point (1 node).
  EXPECT_DOUBLE_EQ(fast["per_gpu_vs_group_first"].get<double>(),
                   fast["tokens_per_s_per_gpu"].get<double>() /
                       j["points"][2]["tokens_per_s_per_gpu"].get<double>());
  EXPECT_TRUE(contains(box.read("s.csv"), "\"node.nics.bandwidth=25Gb/s\",\"\",\"ok\""))
      << box.read("s.csv");

  // The plan command at the fast point finds the same plan and step.
  std::vector<std::string> plan = {"plan",  "--nodes",  "2",          "--global-batch",
                                   "64",    "--search", "--topo-set", "node.nics.bandwidth=200Gb/s",
                                   "--csv", "p.csv",    "-o",         "p.json"};
  plan.insert(plan.end(), pins.begin(), pins.end());
  RunResult p = box.nnsim(plan);
  ASSERT_EQ(p.status, 0) << p;
  EXPECT_EQ(box.read_json("p.json")["name"], fast["plan"]);
  EXPECT_EQ(box.read_json("plans/nodes2-gb64-t2.json"), box.read_json("p.json"));
  // A written plan simulates on its point's cluster at the sweep's step.
  RunResult sim =
      box.nnsim({"--topo", "dgx-a100x4", "--nodes", "2", "--topo-set",
                 "node.nics.bandwidth=200Gb/s", "plans/nodes2-gb64-t2.json", "--json", "r.json"});
  ASSERT_EQ(sim.status, 0) << sim;
  EXPECT_DOUBLE_EQ(box.read_json("r.json")["iteration_time_s"].get<double>(),
                   fast["iteration_time_s"].get<double>());
}

// A model field swept: each point's model has it set, as `--model-set` sets it on plan.
TEST(NnsimTool, SweepVariesAModelFieldAsModelSetDoes) {
  Sandbox box;
  const std::vector<std::string> pins = {
      "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--nodes",   "1", "--tp",           "2",
      "--pp",    "4",         "--jobs", "1",          "--confirm", "1", "--global-batch", "64"};
  std::vector<std::string> sweep = {"sweep", "--vary-model", "seq_len=1024,4096", "--json",
                                    "s.json"};
  sweep.insert(sweep.end(), pins.begin(), pins.end());
  RunResult r = box.nnsim(sweep);
  ASSERT_EQ(r.status, 0) << r;
  const json j = box.read_json("s.json");
  ASSERT_EQ(j["points"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const json& p = j["points"][i];
    const int seq = i == 0 ? 1024 : 4096;
    EXPECT_EQ(p["model_set"], fmt::format("seq_len={}", seq));
    EXPECT_DOUBLE_EQ(p["tokens_per_s"].get<double>(),
                     64.0 * seq / p["iteration_time_s"].get<double>());
    EXPECT_TRUE(contains(p["plan"].get<std::string>(), fmt::format("with seq_len={}", seq)))
        << p["plan"];
  }
  // Four times the tokens a sequence take longer than four times as long: attention grows with
  // the square of the sequence.
  EXPECT_GT(j["points"][1]["iteration_time_s"].get<double>(),
            4 * j["points"][0]["iteration_time_s"].get<double>());

  std::vector<std::string> plan = {"plan",         "--search", "--model-set",
                                   "seq_len=4096", "-o",       "p.json"};
  plan.insert(plan.end(), pins.begin(), pins.end());
  RunResult p = box.nnsim(plan);
  ASSERT_EQ(p.status, 0) << p;
  const json built = box.read_json("p.json");
  EXPECT_EQ(built["name"], j["points"][1]["plan"]);
  EXPECT_EQ(built["model"]["seq_len"], 4096);
  EXPECT_EQ(built["model"]["name"], "gpt3-1.3b with seq_len=4096");

  // The same tokens a step at each length: 131,072 tokens are 128 sequences of 1,024 and 32 of
  // 4,096.
  std::vector<std::string> tokens = {
      "sweep",  "--vary-model", "seq_len=1024,4096", "--global-batch-tokens", "131072",
      "--json", "t.json"};
  tokens.insert(tokens.end(), pins.begin(), pins.end() - 2);  // without --global-batch 64
  RunResult t = box.nnsim(tokens);
  ASSERT_EQ(t.status, 0) << t;
  const json tj = box.read_json("t.json");
  ASSERT_EQ(tj["points"].size(), 2u);
  EXPECT_EQ(tj["points"][0]["global_batch"], 128);
  EXPECT_EQ(tj["points"][1]["global_batch"], 32);
}

// Fields of a CSV line, commas inside double quotes kept.
size_t csv_fields(const std::string& line) {
  size_t fields = 1;
  bool quoted = false;
  for (char c : line) {
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) ++fields;
  }
  return fields;
}

// `--sensitivity F` on a sweep: each best plan again with each resource scaled, a column each;
// a point without a plan keeps the CSV's shape.
TEST(NnsimTool, SweepSensitivityGivesEachBestPlansResourceChanges) {
  Sandbox box;
  RunResult r = box.nnsim({"sweep",
                           "--model",
                           "gpt3-1.3b",
                           "--topo",
                           "dgx-a100x4",
                           "--nodes",
                           "1",
                           "--global-batch",
                           "64",
                           "--tp",
                           "2",
                           "--pp",
                           "4",
                           "--jobs",
                           "1",
                           "--confirm",
                           "1",
                           "--vary",
                           "gpu.hbm_bytes=1GB,80GB",
                           "--sensitivity",
                           "2",
                           "--json",
                           "s.json",
                           "--csv",
                           "s.csv"});
  ASSERT_EQ(r.status, 0) << r;
  const json j = box.read_json("s.json");
  ASSERT_EQ(j["points"].size(), 2u);
  EXPECT_NE(j["points"][0]["status"], "ok");  // nothing fits in 1 GB
  EXPECT_FALSE(j["points"][0].contains("sensitivity"));
  const json& p = j["points"][1];
  ASSERT_EQ(p["status"], "ok") << p;
  const json& s = p["sensitivity"];
  EXPECT_EQ(s["factor"], 2.0);
  ASSERT_EQ(s["resources"].size(), 5u);
  const double step = p["iteration_time_s"].get<double>();
  for (const json& x : s["resources"]) {
    EXPECT_DOUBLE_EQ(x["change"].get<double>(), x["iteration_time_s"].get<double>() / step - 1);
    if (x["resource"] == "network") {
      EXPECT_EQ(x["change"].get<double>(), 0.0) << "one node: nothing crosses a NIC";
    } else {
      EXPECT_LT(x["change"].get<double>(), 0.0) << x;
    }
  }
  EXPECT_TRUE(contains(r.out, "intra-node network latency  best plan")) << r;
  EXPECT_TRUE(contains(r.out, "the plan unchanged")) << r;
  // Every CSV row has the header's columns, the infeasible point's too.
  const std::string csv = box.read("s.csv");
  std::vector<std::string> lines;
  for (size_t from = 0, end; (end = csv.find('\n', from)) != std::string::npos; from = end + 1) {
    lines.push_back(csv.substr(from, end - from));
  }
  ASSERT_EQ(lines.size(), 3u) << csv;
  EXPECT_TRUE(contains(
      lines[0], ",compute_change,hbm_change,intra_node_change,network_change,latency_change"));
  for (const std::string& line : lines) EXPECT_EQ(csv_fields(line), csv_fields(lines[0])) << line;

  expect_error(box.nnsim({"sweep", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--global-batch",
                          "64", "--sensitivity", "1000"}),
               {"--sensitivity", "the factor must be from 0.01 to 100"});
}

TEST(NnsimToolErrors, SweepRefusesBadPointsBeforeSearching) {
  Sandbox box;
  const std::vector<std::string> base = {"sweep",      "--model",        "gpt3-1.3b", "--topo",
                                         "dgx-a100x4", "--global-batch", "64",        "--tp",
                                         "2",          "--pp",           "4"};
  auto with = [&](std::initializer_list<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more);
    return box.nnsim(args);
  };
  expect_error(with({"--vary", "node.nics.bandwidth"}), {"--vary", "expected FIELD=V1,V2"});
  expect_error(with({"--vary", "node.nics.bandwith=1,2"}),
               {"--vary node.nics.bandwith=1", "did you mean 'bandwidth'"});
  expect_error(with({"--vary", "node.nics.bandwidth=1Gb/s,,2Gb/s"}), {"an empty value"});
  expect_error(with({"--recycle", "2"}), {"--recycle is for the builder"});
  expect_error(with({"--vary-model", "seq_len=1024,lots"}),
               {"--vary-model seq_len=lots", "field 'seq_len'"});
  expect_error(with({"--vary-model", "seq_len"}), {"--vary-model", "e.g. seq_len=8192,32768"});
  expect_error(with({"--global-batch-tokens", "4M"}), {"excludes"});
  std::vector<std::string> by_tokens(base.begin(), base.end());
  by_tokens.erase(by_tokens.begin() + 5, by_tokens.begin() + 7);  // --global-batch 64
  by_tokens.insert(by_tokens.end(), {"--global-batch-tokens", "100000"});
  expect_error(box.nnsim(by_tokens),
               {"--global-batch-tokens 100000", "48.83 sequences of 2048 tokens",
                "whole number of sequences"});
  expect_error(with({"--model-set", "hiden=1024"}),
               {"--model-set hiden=1024: field 'hiden'", "did you mean 'hidden'"});
  expect_error(with({"--train-tokens", "lots"}), {"--train-tokens", "'lots'"});
  // Nothing fits anywhere: the rows say why, and the exit status says it failed.
  RunResult none = box.nnsim({"sweep", "--model", "gpt3-175b", "--topo", "dgx-a100x4", "--nodes",
                              "1", "--global-batch", "64", "--jobs", "1"});
  EXPECT_NE(none.status, 0) << none;
  EXPECT_TRUE(contains(none.out, "no plan is feasible")) << none;
  EXPECT_TRUE(contains(none.err, "no point of the sweep has a feasible plan")) << none;
}

// ------------------------------------------------------------------------------------------
// 4. Bad inputs. Topologies.

TEST(NnsimToolErrors, TopologyYamlWithATab) {
  Sandbox box;
  make_plan(box);
  RunResult r = box.nnsim({"--topo", bad_file("topo-tab.yaml"), "p.json"});
  expect_error(r, {"topo-tab.yaml:7", "YAML"});
}

TEST(NnsimToolErrors, TopologyYamlWithAnUnbalancedBracket) {
  Sandbox box;
  make_plan(box);
  RunResult r = box.nnsim({"--topo", bad_file("topo-bracket.yaml"), "p.json"});
  expect_error(r, {"topo-bracket.yaml:", "YAML"});
  expect_matches(r.err, R"(topo-bracket\.yaml:[0-9]+)");
}

TEST(NnsimToolErrors, TopologyWithAnUnknownField) {
  Sandbox box;
  make_plan(box);
  RunResult r = box.nnsim({"--topo", bad_file("topo-typo.yaml"), "p.json"});
  expect_error(r, {"topo-typo.yaml:8", "bandwith", "did you mean 'bandwidth'"});
}

TEST(NnsimToolErrors, UnknownTopologyPreset) {
  Sandbox box;
  make_plan(box);
  RunResult near = box.nnsim({"--topo", "dgx-a100x44", "p.json"});
  expect_error(near, {"dgx-a100x44", "did you mean 'dgx-a100x4'"});
  RunResult far = box.nnsim({"--topo", "nonsense", "p.json"});
  expect_error(far, {"nonsense", "dgx-a100x4", "h200x8"});
  // Also when building a plan.
  RunResult plan = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x44",
                              "--global-batch", "64", "-o", "x.json"});
  expect_error(plan, {"dgx-a100x44", "did you mean 'dgx-a100x4'"});
  EXPECT_FALSE(box.exists("x.json"));
}

TEST(NnsimToolErrors, MissingFiles) {
  Sandbox box;
  make_plan(box);
  RunResult topo = box.nnsim({"--topo", "/nonexistent/dir/topology.yaml", "p.json"});
  expect_error(topo, {"/nonexistent/dir/topology.yaml"});
  RunResult plan = box.nnsim({"--topo", "dgx-a100x4", "no-such-plan.json"});
  expect_error(plan, {"no-such-plan.json"});
  RunResult out = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4",
                             "--global-batch", "64", "-o", "/nonexistent/dir/p.json"});
  expect_error(out, {"/nonexistent/dir/p.json"});
}

// Models.

TEST(NnsimToolErrors, UnknownModelPreset) {
  Sandbox box;
  RunResult near = box.nnsim({"plan", "--model", "gpt3-1.3bb", "--topo", "dgx-a100x4",
                              "--global-batch", "64", "-o", "x.json"});
  expect_error(near, {"gpt3-1.3bb", "did you mean 'gpt3-1.3b'"});
  RunResult far = box.nnsim({"plan", "--model", "nonsense", "--topo", "dgx-a100x4",
                             "--global-batch", "64", "-o", "x.json"});
  // The first dozen presets and how many there are (the rest are in the models folder it names).
  expect_error(far, {"nonsense", "a preset in", "deepseek-v3", "gpt3-1.3b", "in all)"});
  EXPECT_FALSE(box.exists("x.json"));
}

TEST(NnsimToolErrors, ModelWhoseHeadsDoNotDivideHidden) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", bad_file("model-heads.yaml"), "--topo", "dgx-a100x4",
                           "--global-batch", "64", "-o", "x.json"});
  expect_error(r, {"model-heads.yaml:6", "'heads'", "12", "2048"});
  EXPECT_FALSE(box.exists("x.json"));
}

// Plans.

TEST(NnsimToolErrors, MalformedPlanJson) {
  Sandbox box;
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", bad_file("plan-missing-comma.json")});
  expect_error(r, {"plan-missing-comma.json:4:", "JSON"});
  expect_matches(r.err, R"(plan-missing-comma\.json:4:[0-9]+:)");
}

// Writes the main job's plan edited by `edit` to `name` and simulates it.
template <typename Edit>
RunResult simulate_edited_plan(const Sandbox& box, const std::string& name, Edit edit) {
  json plan = box.read_json("p.json");
  edit(plan);
  box.write_json(name, plan);
  return box.nnsim({"--topo", "dgx-a100x4", name, "--json", "r.json"});
}

TEST(NnsimToolErrors, PlanWithAWrongFieldValue) {
  Sandbox box;
  make_plan(box);
  RunResult r = simulate_edited_plan(box, "bad-value.json",
                                     [](json& p) { p["training"]["micro_batch"] = "x"; });
  expect_error(r, {"bad-value.json:", "training.micro_batch", "'x'"});
  expect_matches(r.err, R"(bad-value\.json:[0-9]+)");
  EXPECT_FALSE(box.exists("r.json"));
}

TEST(NnsimToolErrors, PlanWithAnUnknownField) {
  Sandbox box;
  make_plan(box);
  RunResult r =
      simulate_edited_plan(box, "bad-field.json", [](json& p) { p["training"]["micro_bach"] = 1; });
  expect_error(r, {"bad-field.json:", "micro_bach", "did you mean 'micro_batch'"});
  expect_matches(r.err, R"(bad-field\.json:[0-9]+)");
}

TEST(NnsimToolErrors, PlanWithAnUnsupportedVersion) {
  Sandbox box;
  make_plan(box);
  RunResult r = simulate_edited_plan(box, "bad-version.json", [](json& p) { p["version"] = 99; });
  expect_error(r, {"bad-version.json:", "version", "99", "nnsim plan"});
}

TEST(NnsimToolErrors, PlanWithABadBlockString) {
  Sandbox box;
  make_plan(box);
  RunResult r = simulate_edited_plan(box, "bad-block.json", [](json& p) {
    std::string& blocks = p["schedule"]["orders"][0]["blocks"].get_ref<std::string&>();
    blocks.replace(blocks.find("F1@0"), 4, "X1@0");
  });
  expect_error(r, {"bad-block.json:", "schedule.orders[0].blocks", "X1@0"});
}

TEST(NnsimToolErrors, PlanWhoseMeshDoesNotMatchTheTopology) {
  Sandbox box;
  make_plan(box, {"plan", "--model", "gpt3-1.3b", "--topo", "h200x8", "--tp", "2", "--pp", "2",
                  "--global-batch", "64", "-o", "h200.json"});
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", "h200.json", "--json", "r.json"});
  expect_error(r, {"h200.json", "8 ranks", "32 GPUs", "--nodes"});
  EXPECT_FALSE(box.exists("r.json"));
}

// `nnsim plan` arguments.

// Counts given on the command line are checked, not taken as "not given" (--nodes 0 and
// --dp -1 used to fall back to the topology's size).
TEST(NnsimToolErrors, CountsBelowOne) {
  Sandbox box;
  RunResult nodes = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--nodes",
                               "0", "--global-batch", "64", "-o", "x.json"});
  expect_error(nodes, {"--nodes: must be at least 1, got 0"});
  RunResult dp = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--dp", "-1",
                            "--global-batch", "64", "-o", "x.json"});
  expect_error(dp, {"--dp: must be at least 1, got -1"});
  EXPECT_FALSE(box.exists("x.json"));
}

TEST(NnsimToolErrors, PlanDegreesThatDoNotDivide) {
  Sandbox box;
  // tp 3 does not divide the 32 GPUs...
  RunResult gpus = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "3",
                              "--global-batch", "64", "-o", "x.json"});
  expect_error(gpus, {"3", "32 GPUs"});
  // ... nor, on 3 nodes (24 GPUs), the 16 heads of gpt3-1.3b.
  RunResult heads = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--nodes",
                               "3", "--tp", "3", "--global-batch", "48", "-o", "x.json"});
  expect_error(heads, {"--tp 3", "16", "heads"});
  EXPECT_FALSE(box.exists("x.json"));
}

TEST(NnsimToolErrors, PlanGlobalBatchNotDivisible) {
  Sandbox box;
  RunResult r =
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "2", "--pp", "4",
                 "--micro-batch", "3", "--global-batch", "64", "-o", "x.json"});
  expect_error(r, {"global batch 64", "4 x 3 = 12", "multiple of 12"});
  EXPECT_FALSE(box.exists("x.json"));
}

TEST(NnsimToolErrors, PlanUnknownRecomputeScheduleAndStrayVpp) {
  Sandbox box;
  std::vector<std::string> base = {"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4",
                                   "--tp", "2",       "--pp",      "4",      "--global-batch",
                                   "64",   "-o",      "x.json"};
  auto with = [&base](std::initializer_list<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra);
    return args;
  };
  expect_error(box.nnsim(with({"--recompute", "ful"})),
               {"--recompute", "'ful'", "did you mean 'full'"});
  expect_error(box.nnsim(with({"--schedule", "zigzag"})),
               {"--schedule", "'zigzag'", "1f1b", "interleaved"});
  expect_error(box.nnsim(with({"--vpp", "2"})), {"--vpp", "interleaved"});
  EXPECT_FALSE(box.exists("x.json"));
}

// Simulation.

TEST(NnsimToolErrors, DeadlockingSchedule) {
  Sandbox box;
  make_two_stage_plan(box, "p2.json");
  json plan = box.read_json("p2.json");
  json& orders = plan["schedule"]["orders"];
  ASSERT_EQ(orders.size(), 2u) << orders.dump();
  ASSERT_EQ(orders[0]["devices"]["pp"], 0);
  ASSERT_EQ(orders[1]["devices"]["pp"], 1);
  // Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation, which
  // stage 1 waits for first.
  orders[0]["blocks"] = "F0@0 B0@0 F1@0 B1@0";
  orders[1]["blocks"] = "F1@1 B1@1 F0@1 B0@1";
  box.write_json("deadlock.json", plan);
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", "deadlock.json", "--json", "r.json"});
  expect_error(r, {"deadlock.json", "deadlock", "pp=0", "pp=1", "GPUs 0-7", "GPUs 16-23"});
  EXPECT_FALSE(box.exists("r.json"));
}

TEST(NnsimToolErrors, PlanThatDoesNotFitInMemory) {
  Sandbox box;
  // 70B parameters over 8-way tensor parallelism without sharding: ~206 GiB per GPU.
  make_plan(box, {"plan", "--model", "llama3-70b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "1",
                  "--global-batch", "8", "-o", "l70.json"});
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", "l70.json", "--json", "r.json"});
  expect_error(r, {"does not fit", "GPU 0", "80.00 GiB", "optimizer state", "activations",
                   "--recompute", "--zero"});
  expect_matches(r.err, R"([0-9.]+ [KMGT]iB over)");
  EXPECT_FALSE(box.exists("r.json"));

  // --allow-oom: the report still comes, and so does the error and a non-zero exit.
  RunResult anyway =
      box.nnsim({"--topo", "dgx-a100x4", "l70.json", "--allow-oom", "--json", "r.json"});
  EXPECT_NE(anyway.status, 0) << anyway;
  EXPECT_FALSE(anyway.signaled) << anyway;
  EXPECT_TRUE(contains(anyway.out, "iteration time")) << anyway;
  EXPECT_TRUE(contains(anyway.out, "peak memory")) << anyway;
  EXPECT_EQ(anyway.err.rfind("nnsim: error:", 0), 0u) << anyway;
  EXPECT_TRUE(contains(anyway.err, "does not fit")) << anyway;
  EXPECT_FALSE(contains(anyway.out + anyway.err, "\r")) << anyway;
  ASSERT_TRUE(box.exists("r.json"));
  EXPECT_EQ(box.read_json("r.json")["format"], "nnsim-report");
}

TEST(NnsimToolErrors, Gpt3_175bUnshardedDoesNotFit) {
  Sandbox box;
  make_plan(box, {"plan", "--model", "gpt3-175b", "--topo", "dgx-a100x4", "--tp", "1", "--pp", "1",
                  "--global-batch", "64", "-o", "big.json"});
  RunResult r = box.nnsim({"--topo", "dgx-a100x4", "big.json"});
  expect_error(r, {"does not fit", "GPU 0", "TiB over", "optimizer state"});
}

// The command line itself.

TEST(NnsimToolErrors, NoArgumentsPrintsHelp) {
  Sandbox box;
  RunResult r = box.nnsim({});
  EXPECT_NE(r.status, 0) << r;
  EXPECT_FALSE(r.signaled) << r;
  EXPECT_FALSE(looks_like_result(r.out)) << r;
  std::string all = r.out + r.err;
  EXPECT_TRUE(contains(all, "Usage:")) << r;
  EXPECT_TRUE(contains(all, "--topo")) << r;
  EXPECT_TRUE(contains(all, "plan")) << r;
  EXPECT_TRUE(contains(r.err, "nnsim: error:")) << r;
}

TEST(NnsimToolErrors, MissingRequiredOptionFails) {
  Sandbox box;
  make_plan(box);
  RunResult r = box.nnsim({"simulate", "p.json"});
  EXPECT_NE(r.status, 0) << r;
  EXPECT_FALSE(r.signaled) << r;
  EXPECT_FALSE(looks_like_result(r.out)) << r;
  EXPECT_TRUE(contains(r.err, "--topo")) << r;
}

TEST(NnsimToolErrors, UsageErrorsUseTheErrorPrefix) {
  // Errors found by the command-line parser read like every other error.
  Sandbox box;
  make_plan(box);
  expect_error(box.nnsim({"simulate", "p.json"}), {"--topo"});
  expect_error(box.nnsim({"--bogus"}), {"--bogus"});
}

// ------------------------------------------------------------------------------------------
// 5. --version.

TEST(NnsimTool, SearchWritesTheBestPlanAndTheRankedTable) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--global-batch",
                           "64", "--confirm", "2", "-o", "best.json", "--csv", "ranked.csv"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "rank")) << r;
  EXPECT_TRUE(contains(r.out, "confirmed by simulation")) << r;
  EXPECT_FALSE(contains(r.out + r.err, "\r")) << r;
  std::string csv = box.read("ranked.csv");
  EXPECT_EQ(csv.rfind("rank,plan,tp,pp", 0), 0u) << csv;
  EXPECT_GT(std::count(csv.begin(), csv.end(), '\n'), 2) << csv;
  RunResult sim = box.nnsim({"--topo", "dgx-a100x4", "best.json"});
  EXPECT_EQ(sim.status, 0) << sim;

  box.write("c.yaml", "memory_cap: 1 GB\n");
  RunResult none = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4",
                              "--global-batch", "64", "--constraints", "c.yaml", "-o", "x.json"});
  expect_error(none, {"no plan is feasible under the constraints of c.yaml",
                      "removed by does not fit in memory"});
}

TEST(NnsimTool, PerStageLayersAndRecomputeOnTheCommandLine) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "2",
                           "--pp", "4", "--global-batch", "64", "--stage-layers", "5,7,7,5",
                           "--recompute-layers", "2,1,0,0", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  json plan = json::parse(box.read("p.json"));
  EXPECT_EQ(plan["segments"][1]["layers"], json::array({5, 12})) << plan["segments"];
  EXPECT_EQ(plan["recompute"].size(), 2u) << plan["recompute"];
  RunResult sim = box.nnsim({"--topo", "dgx-a100x4", "p.json"});
  EXPECT_EQ(sim.status, 0) << sim;
  // The search chooses per-stage recomputation itself.
  expect_error(box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--global-batch",
                          "64", "--recompute-layers", "1,1", "-o", "x.json"}),
               {"--recompute-layers", "the search chooses"});
  expect_error(
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "2", "--pp", "4",
                 "--global-batch", "64", "--recompute-layers", "9,0,0,0", "-o", "x.json"}),
      {"segment 0 (stage0) has 6 layers; it cannot recompute 9"});
}

// Megatron-Core's --recompute-modules: the builder and the search keep the operators'
// recomputation in every layer, and a name that matches no operator is refused with the nearest.
TEST(NnsimTool, RecomputeModulesOnTheCommandLine) {
  Sandbox box;
  const std::vector<std::string> base = {"plan",       "--model", "gpt3-1.3b", "--topo",
                                         "dgx-a100x4", "--pp",    "2",         "--global-batch",
                                         "64",         "-o",      "p.json"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return box.nnsim(args);
  };
  RunResult built = with({"--tp", "2", "--recompute-modules", "mlp.act,attn.core"});
  ASSERT_EQ(built.status, 0) << built;
  json plan = json::parse(box.read("p.json"));
  EXPECT_EQ(plan["recompute"], json::parse(R"([{"match": "mlp.act", "layers": [0, 24]},
                                               {"match": "attn.core", "layers": [0, 24]}])"))
      << plan["recompute"];
  RunResult searched = with({"--search", "--confirm", "0", "--recompute-modules", "mlp.act"});
  ASSERT_EQ(searched.status, 0) << searched;
  EXPECT_NE(searched.out.find("recompute-modules mlp.act"), std::string::npos) << searched;
  plan = json::parse(box.read("p.json"));
  bool kept = false;
  for (const auto& rule : plan["recompute"]) kept |= rule["match"] == "mlp.act";
  EXPECT_TRUE(kept) << plan["recompute"];
  for (const char* search : {"--search", "--sequence-parallel"}) {
    expect_error(with({"--tp", "2", search, "--recompute-modules", "mlp.acts"}),
                 {"--recompute-modules: 'mlp.acts' matches no operator of a layer",
                  "did you mean 'mlp.act'?"});
  }
}

// A what-if GPU's report says whose measured efficiencies it runs at (docs/topology.md): the
// simulation's and the search's.
TEST(NnsimTool, AHypotheticalGpusReportNamesItsBase) {
  Sandbox box;
  const std::string note =
      "note: gb200-whatif is a hypothetical GPU: its peaks, memory and NVLink as the topology "
      "gives them, its GEMM, attention and NCCL efficiencies h200-sxm-141gb's measured ones";
  RunResult r =
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "gb200-nvl72-whatif", "--nodes", "1",
                 "--tp", "8", "--pp", "1", "--global-batch", "72", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  RunResult sim = box.nnsim({"--topo", "gb200-nvl72-whatif", "--nodes", "1", "p.json"});
  ASSERT_EQ(sim.status, 0) << sim;
  EXPECT_TRUE(contains(sim.out, note)) << sim;
  RunResult search =
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "gb200-nvl72-whatif", "--nodes", "1",
                 "--tp", "8", "--global-batch", "72", "--search", "-o", "s.json"});
  ASSERT_EQ(search.status, 0) << search;
  EXPECT_TRUE(contains(search.out, note)) << search;
}

TEST(NnsimTool, AvoidedGpusAreIdleInTheReport) {
  Sandbox box;
  RunResult r =
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "1",
                 "--global-batch", "48", "--avoid-gpus", "3", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  RunResult sim = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "r.json"});
  ASSERT_EQ(sim.status, 0) << sim;
  EXPECT_TRUE(contains(sim.out, "(24 x a100-sxm4-80gb; 8 GPUs idle)")) << sim;
  json report = json::parse(box.read("r.json"));
  EXPECT_EQ(report["gpus"], 24);
  EXPECT_EQ(report["idle_gpus"], json::array({0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(report["per_gpu"].size(), 24u);
  EXPECT_EQ(report["per_gpu"][0]["gpu"], 8);
  expect_error(
      box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8", "--pp", "1",
                 "--global-batch", "48", "--avoid-gpus", "40", "-o", "x.json"}),
      {"GPU 40 to avoid does not exist"});
}

TEST(NnsimTool, ScheduleRewritesTheBlockOrders) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8",
                           "--pp", "4", "--global-batch", "32", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  RunResult s = box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "-o", "z.json"});
  ASSERT_EQ(s.status, 0) << s;
  EXPECT_TRUE(contains(s.out, "zb-h1 schedule, 4 schedule orders, 32 micro-batches")) << s;
  json plan = json::parse(box.read("z.json"));
  EXPECT_EQ(plan["schedule"]["name"], "zb-h1");
  const std::string blocks = plan["schedule"]["orders"][0]["blocks"];
  EXPECT_TRUE(contains(blocks, "BI0@0") && contains(blocks, "BW0@0")) << blocks;
  RunResult sim = box.nnsim({"--topo", "dgx-a100x4", "z.json"});
  EXPECT_EQ(sim.status, 0) << sim;

  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h3", "-o", "x.json"}),
               {"--generator", "unknown schedule 'zb-h3'", "did you mean"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-v", "-o", "x.json"}),
               {"p.json", "zb-v", "--vpp 2"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "merak", "-o", "x.json"}),
               {"recomputes nothing", "--recompute selective or full"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "--memory-limit",
                          "lots", "-o", "x.json"}),
               {"--memory-limit 'lots'", "e.g. 60GB"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "--memory-limit",
                          "1GB", "-o", "x.json"}),
               {"leaves no room for activations on pipeline stage 0"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "1f1b", "--memory-limit",
                          "60GB", "-o", "x.json"}),
               {"--memory-limit applies to zb-h1, zb-h2, zb-v and merak"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "-o", "x.json"}),
               {"give either --generator NAME or --search"});
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "1f1b", "--search", "-o",
                          "x.json"}),
               {"give either --generator NAME or --search"});
}

TEST(NnsimTool, ScheduleSearchOnAShardedHead) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", "llama2-7b", "--topo", "dgx-a100x4", "--tp", "8",
                           "--pp", "4", "--global-batch", "16", "--shard-head", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  RunResult s = box.nnsim({"schedule", "--plan", "p.json", "--search", "-o", "t.json"});
  ASSERT_EQ(s.status, 0) << s;
  EXPECT_TRUE(contains(s.out, "tessel schedule, 4 schedule orders, 16 micro-batches")) << s;
  EXPECT_TRUE(contains(s.out, "repetend of")) << s;
  json plan = json::parse(box.read("t.json"));
  EXPECT_EQ(plan["schedule"]["name"], "tessel");
  RunResult sim = box.nnsim({"--topo", "dgx-a100x4", "t.json"});
  EXPECT_EQ(sim.status, 0) << sim;
  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--search", "--memory-limit", "1GB", "-o",
                          "x.json"}),
               {"leaves no room for activations on schedule order 0"});
}

// Repeated forwards: `nnsim plan --recycle 3` writes 1F1B with each micro-batch's three passes
// back to back; `nnsim schedule --search` (and --generator tessel) rewrites them into orders
// that pass the schedule check and simulate faster, within the same memory.
TEST(NnsimTool, ScheduleSearchPlacesRepeatedForwards) {
  Sandbox box;
  RunResult r = box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8",
                           "--pp", "4", "--global-batch", "8", "--recycle", "3", "-o", "p.json"});
  ASSERT_EQ(r.status, 0) << r;
  json plan = box.read_json("p.json");
  EXPECT_EQ(plan["training"]["recycle"], 3);
  const std::string naive = plan["schedule"]["orders"][0]["blocks"];
  EXPECT_TRUE(contains(naive, "F0@0 F0@0#1 F0@0#2 F1@0 F1@0#1 F1@0#2")) << naive;
  RunResult s = box.nnsim({"schedule", "--plan", "p.json", "--search", "-o", "t.json"});
  ASSERT_EQ(s.status, 0) << s;
  EXPECT_TRUE(contains(s.out, "tessel schedule, 4 schedule orders, 8 micro-batches")) << s;
  EXPECT_FALSE(contains(s.out, "kept them")) << s;
  json searched = box.read_json("t.json");
  EXPECT_EQ(searched["training"]["recycle"], 3);
  const std::string blocks = searched["schedule"]["orders"][0]["blocks"];
  EXPECT_TRUE(contains(blocks, "F7@0#2")) << blocks;
  RunResult g =
      box.nnsim({"schedule", "--plan", "p.json", "--generator", "tessel", "-o", "g.json"});
  ASSERT_EQ(g.status, 0) << g;
  EXPECT_EQ(box.read("g.json"), box.read("t.json"));
  RunResult a = box.nnsim({"--topo", "dgx-a100x4", "p.json", "--json", "a.json"});
  ASSERT_EQ(a.status, 0) << a;
  RunResult b = box.nnsim({"--topo", "dgx-a100x4", "t.json", "--json", "b.json"});
  ASSERT_EQ(b.status, 0) << b;
  const double before = box.read_json("a.json")["iteration_time_s"];
  const double after = box.read_json("b.json")["iteration_time_s"];
  EXPECT_LT(after, 0.9 * before) << before << " s -> " << after << " s";

  expect_error(box.nnsim({"schedule", "--plan", "p.json", "--generator", "zb-h1", "-o", "x.json"}),
               {"the zb-h1 schedule does not place repeated forwards (training.recycle = 3)"});
  expect_error(box.nnsim({"plan", "--model", "gpt3-1.3b", "--topo", "dgx-a100x4", "--tp", "8",
                          "--pp", "4", "--global-batch", "8", "--recycle", "0", "-o", "x.json"}),
               {"--recycle must be at least 1"});
  // A pass outside training.recycle, written by hand.
  std::string text = box.read("p.json");
  text.replace(text.find("F0@0#2"), 6, "F0@0#3");
  box.write("bad.json", text);
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "bad.json"}),
               {"block F0@0#3 names forward pass 3, but training.recycle is 3 (passes 0-2"});
  text = box.read("p.json");
  const std::string three = "\"recycle\": 3";
  text.replace(text.find(three), three.size(), "\"recycle\": -1");
  box.write("neg.json", text);
  expect_error(box.nnsim({"--topo", "dgx-a100x4", "neg.json"}),
               {"field 'training.recycle'", "must be at least 1"});
}

// Two small cases of the validation schema, for the driver's `validate` options.
std::string two_case_set() {
  std::string one = R"(- id: ID
  source: a test
  model: {family: gpt, layers: 2, hidden: 512, heads: 8, kv_heads: 8, ffn_hidden: 2048,
          mlp: gelu, vocab: 32000, seq_len: 512, tied_embeddings: true, position: learned}
  cluster: {gpu: a100-sxm4-80gb, nodes: 1, gpus_per_node: 8, nic_gbps: 200, nics_per_node: 8}
  parallel: {tp: 2, pp: 1, dp: 4, cp: 1, ep: 1, vp: 1, micro_batch: 1, global_batch: 8,
             recompute: none, sequence_parallel: false, zero: 1, precision: bf16,
             framework: megatron}
  measured: {iteration_time_s: 0.05}
)";
  std::string set = "schema: nnsim-validation/1\ncases:\n";
  for (const char* id : {"first", "second", "third"}) {
    std::string c = one;
    c.replace(c.find("ID"), 2, id);
    set += c;
  }
  return set;
}

TEST(NnsimTool, ValidateOnlyTakesCommaOrSpaceSeparatedIds) {
  Sandbox box;
  box.write("set.yaml", two_case_set());
  auto ids_in = [&](const std::string& json_name) {
    const json report = box.read_json(json_name);
    std::set<std::string> ids;
    for (const auto& c : report["cases"]) ids.insert(c["id"].get<std::string>());
    return ids;
  };
  const std::set<std::string> want = {"first", "third"};
  RunResult r = box.nnsim(
      {"validate", "set.yaml", "--only", "first,third", "--jobs", "1", "--json", "comma.json"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_EQ(ids_in("comma.json"), want);
  r = box.nnsim(
      {"validate", "set.yaml", "--only", "first", "third", "--jobs", "1", "--json", "space.json"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_EQ(ids_in("space.json"), want);
  expect_error(box.nnsim({"validate", "set.yaml", "--only", "first,fourth"}),
               {"--only: no case 'fourth'", "known: first, second, third"});
  // A pattern picks every case it matches, in the set's order; one matching none is an error.
  r = box.nnsim({"validate", "set.yaml", "--only", "*ir*", "--jobs", "1", "--json", "glob.json"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_EQ(ids_in("glob.json"), want);
  expect_error(box.nnsim({"validate", "set.yaml", "--only", "x*"}), {"--only: no case 'x*'"});
}

// Where a case measured its peak memory, its line shows the signed memory error next to the
// iteration time's, the same number as the JSON's memory_error_pct.
TEST(NnsimTool, ValidatePrintsEachCasesMemoryError) {
  Sandbox box;
  std::string set = two_case_set();
  const std::string measured = "measured: {iteration_time_s: 0.05}";
  set.replace(set.find(measured), measured.size(),
              "measured: {iteration_time_s: 0.05, peak_memory_gib: 2}");
  box.write("set.yaml", set);
  RunResult r = box.nnsim({"validate", "set.yaml", "--jobs", "1", "--json", "v.json"});
  ASSERT_EQ(r.status, 0) << r;
  const json report = box.read_json("v.json");
  ASSERT_TRUE(report["cases"][0]["memory_error_pct"].is_number()) << report.dump();
  EXPECT_FALSE(report["cases"][1].contains("memory_error_pct")) << report.dump();
  const std::string shown =
      fmt::format("{:+.1f}%", report["cases"][0]["memory_error_pct"].get<double>());
  EXPECT_TRUE(contains(r.out, "mem err")) << r;
  const size_t first = r.out.find("\nfirst ");
  ASSERT_NE(first, std::string::npos) << r;
  const std::string line = r.out.substr(first + 1, r.out.find('\n', first + 1) - first - 1);
  EXPECT_TRUE(contains(line, "2.0 GiB")) << line;
  EXPECT_TRUE(contains(line, shown)) << line << " (want " << shown << ")";
}

TEST(NnsimTool, ValidateWritePlansCreatesItsFolder) {
  Sandbox box;
  box.write("set.yaml", two_case_set());
  RunResult r = box.nnsim(
      {"validate", "set.yaml", "--only", "second", "--jobs", "1", "--write-plans", "plans/dev"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(box.exists("plans/dev/second.json"));
  EXPECT_TRUE(contains(box.read("plans/dev/second.json"), "\"nnsim-plan\"")) << r;
  EXPECT_TRUE(box.exists("plans/dev/second.topology.yaml"));
  box.write("plans/file", "not a folder");
  expect_error(
      box.nnsim({"validate", "set.yaml", "--only", "second", "--write-plans", "plans/file/sub"}),
      {"--write-plans: cannot create the folder 'plans/file/sub'"});
}

// The plan and the cluster --write-plans leaves replay the case: nnsim simulate on them predicts
// what nnsim validate did, on a cluster no preset describes (40 GB A100s, two 100 Gb/s NICs).
TEST(NnsimTool, ValidateWritePlansReplaysWithSimulate) {
  Sandbox box;
  std::string set = two_case_set();
  auto edit = [&set](const std::string& from, const std::string& to) {
    set.replace(set.find(from), from.size(), to);
  };
  edit("a100-sxm4-80gb, nodes: 1, gpus_per_node: 8, nic_gbps: 200, nics_per_node: 8",
       "a100-sxm4-40gb, nodes: 2, gpus_per_node: 8, nic_gbps: 100, nics_per_node: 2");
  edit("dp: 4", "dp: 8");
  edit("global_batch: 8", "global_batch: 16");
  box.write("set.yaml", set);
  RunResult r = box.nnsim({"validate", "set.yaml", "--only", "first", "--jobs", "1",
                           "--write-plans", "out", "--json", "v.json"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "wrote the plan and cluster of 1 case to out")) << r;
  const std::string cluster = box.read("out/first.topology.yaml");
  EXPECT_TRUE(contains(cluster, "gpu: a100-sxm4-40gb")) << cluster;
  EXPECT_TRUE(contains(cluster, "count: 2")) << cluster;
  RunResult s = box.nnsim(
      {"simulate", "--topo", "out/first.topology.yaml", "out/first.json", "--json", "s.json"});
  ASSERT_EQ(s.status, 0) << s;
  EXPECT_EQ(box.read_json("s.json")["iteration_time_s"].get<double>(),
            box.read_json("v.json")["cases"][0]["predicted_iteration_time_s"].get<double>());
}

// `nnsim presets` lists every model and topology preset with what it is; a kind narrows it, and
// an unknown kind is refused with the choices.
TEST(NnsimTool, PresetsListsEveryModelAndTopology) {
  Sandbox box;
  RunResult r = box.nnsim({"presets"});
  EXPECT_EQ(r.status, 0) << r;
  for (const std::string& name : model_preset_names()) {
    EXPECT_TRUE(contains(r.out, "  " + name + " ")) << name << "\n" << r;
  }
  for (const std::string& name : topology_preset_names()) {
    EXPECT_TRUE(contains(r.out, "  " + name + " ")) << name << "\n" << r;
  }
  // A hybrid's layer kinds counted, with its parameters (docs/model.md's counts).
  std::istringstream lines(r.out);
  std::string line, qwen_next;
  while (std::getline(lines, line)) {
    if (line.rfind("  qwen3-next-80b-a3b ", 0) == 0) qwen_next = line;
  }
  EXPECT_TRUE(contains(qwen_next, "81.32 B")) << qwen_next;
  EXPECT_TRUE(contains(qwen_next, "36 Gated DeltaNet, 12 attention, 48 experts")) << qwen_next;
  EXPECT_TRUE(contains(qwen_next, "512 experts, top 10 + shared")) << qwen_next;
  EXPECT_TRUE(contains(r.out, "dgx-a100x4             4 x 8 a100")) << r;

  RunResult models = box.nnsim({"presets", "models"});
  EXPECT_EQ(models.status, 0) << models;
  EXPECT_TRUE(contains(models.out, "gpt3-175b")) << models;
  EXPECT_FALSE(contains(models.out, "dgx-a100x4")) << models;
  RunResult bad = box.nnsim({"presets", "racks"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.err, "models")) << bad;
  // The GPU catalog, the names a topology's gpu takes (--topo-set gpu=NAME).
  RunResult gpus = box.nnsim({"presets", "gpus"});
  EXPECT_EQ(gpus.status, 0) << gpus;
  for (const GpuSpec& g : gpu_catalog()) {
    EXPECT_TRUE(contains(gpus.out, "  " + g.name + " ")) << g.name << "\n" << gpus;
  }
  EXPECT_TRUE(contains(gpus.out, "h200-sxm-141gb      989 TFLOP/s 1.98 PFLOP/s 140.40 GiB"))
      << gpus;
  EXPECT_FALSE(contains(gpus.out, "gpt3-175b")) << gpus;

  // As JSON: each model's description as a plan records it (which reads back) and its count.
  RunResult j = box.nnsim({"presets", "--json", "presets.json"});
  EXPECT_EQ(j.status, 0) << j;
  const json presets = json::parse(box.read("presets.json"));
  ASSERT_EQ(presets["models"].size(), model_preset_names().size());
  ASSERT_EQ(presets["topologies"].size(), topology_preset_names().size());
  for (const json& m : presets["models"]) {
    Expected<ModelSpec> back = parse_model(m["model"].dump(), "m.json");
    ASSERT_TRUE(back.ok()) << back.error().message();
    EXPECT_EQ(back->parameters(), m["parameters"].get<int64_t>()) << m["name"];
  }
  EXPECT_EQ(presets["topologies"][0]["gpus_per_node"], 8);
  ASSERT_EQ(presets["gpus"].size(), gpu_catalog().size());
  EXPECT_EQ(presets["gpus"][0]["name"], gpu_catalog().front().name);
  EXPECT_EQ(presets["gpus"][0]["hbm_bytes"].get<double>(), gpu_catalog().front().hbm_bytes);
  RunResult unwritable = box.nnsim({"presets", "--json", "no-such-dir/p.json"});
  EXPECT_NE(unwritable.status, 0);
  EXPECT_TRUE(contains(unwritable.err, "no-such-dir/p.json")) << unwritable;
}

TEST(NnsimTool, Version) {
  Sandbox box;
  RunResult r = box.nnsim({"--version"});
  EXPECT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out + r.err, "nnsim")) << r;
}

}  // namespace
}  // namespace nnsim
