// Ranks started by someone else (docs/hwexec.md#several-machines-mpirun-srun-torchrun): the
// launchers' variables, the TCP rendezvous and its errors, and `nnexec run` started as one
// process per rank with torchrun-style variables, with Open MPI's, and by a real `mpirun`,
// whose run file must match what `nnexec run --launch` writes for the same plan; and the ranks
// `nnexec run --launch` forks on the CPU.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "hwexec/comm.h"
#include "hwexec/launch.h"
#include "hwexec/run.h"
#include "nnexec_info.h"
#include "process.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::Child;
using testing::contains;
using testing::nnexec_build;
using testing::nnexec_info;
using testing::run;
using testing::RunResult;
using testing::TempDir;
using Env = std::vector<std::pair<std::string, std::string>>;

// The variables a torchrun-style launcher gives rank `rank` of `world`, rendezvous on this host.
Env torchrun_env(int rank, int world, int port) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)}};
}

const std::string kModel = std::string(NNSIM_TEST_DATA) + "/tiny-gpt.yaml";
const std::string kTopo = std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml";

Getenv lookup(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

// A TCP port nobody listens on (just now).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return bound ? ntohs(a.sin_port) : 0;  // 0: the test using it fails to connect, saying so
}

// ---------------------------------------------------------------- the launchers' variables

TEST(LaunchEnv, NoneSetMeansNotLaunched) {
  Expected<std::optional<LaunchEnv>> e = launch_from_env(lookup({{"MASTER_ADDR", "x"}}));
  ASSERT_TRUE(e.ok()) << e.error().message();
  EXPECT_FALSE(e->has_value());
}

TEST(LaunchEnv, EachLauncherAndTheInnerOneFirst) {
  struct Case {
    std::map<std::string, std::string> vars;
    std::string launcher;
    int rank, world, local;
  };
  const std::vector<Case> cases = {
      {{{"OMPI_COMM_WORLD_RANK", "3"},
        {"OMPI_COMM_WORLD_SIZE", "8"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
       "Open MPI",
       3,
       8,
       1},
      {{{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}}, "MPICH/Hydra", 2, 4, 0},
      {{{"RANK", "5"}, {"WORLD_SIZE", "6"}, {"LOCAL_RANK", "1"}}, "torchrun-style", 5, 6, 1},
      {{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}}, "Slurm", 1, 2, -1},
      // `srun torchrun`: Slurm's task is the node; torchrun's variables are the rank's.
      {{{"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_LOCALID", "0"},
        {"RANK", "7"},
        {"WORLD_SIZE", "8"},
        {"LOCAL_RANK", "3"}},
       "torchrun-style",
       7,
       8,
       3},
      // mpirun inside a Slurm allocation.
      {{{"SLURM_PROCID", "0"},
        {"SLURM_NTASKS", "1"},
        {"OMPI_COMM_WORLD_RANK", "2"},
        {"OMPI_COMM_WORLD_SIZE", "4"}},
       "Open MPI",
       2,
       4,
       -1},
  };
  for (const Case& c : cases) {
    Expected<std::optional<LaunchEnv>> e = launch_from_env(lookup(c.vars));
    ASSERT_TRUE(e.ok()) << e.error().message();
    ASSERT_TRUE(e->has_value());
    const LaunchEnv& l = **e;
    EXPECT_EQ(l.launcher, c.launcher);
    EXPECT_EQ(l.rank, c.rank);
    EXPECT_EQ(l.world, c.world);
    EXPECT_EQ(l.local_rank, c.local);
  }
}

std::string launch_error(const std::map<std::string, std::string>& vars) {
  Expected<std::optional<LaunchEnv>> e = launch_from_env(lookup(vars));
  return e.ok() ? "(no error)" : e.error().message();
}

TEST(LaunchEnv, BadVariablesNameTheVariable) {
  EXPECT_EQ(launch_error({{"RANK", "0"}}),
            "RANK is set (0) but WORLD_SIZE is not: torchrun-style sets both (the rank and the "
            "number of ranks); set WORLD_SIZE to the plan's number of ranks");
  EXPECT_EQ(launch_error({{"PMI_RANK", "x"}, {"PMI_SIZE", "4"}}),
            "PMI_RANK='x' is not a rank (a whole number from 0)");
  EXPECT_EQ(launch_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}),
            "SLURM_NTASKS='0' is not a number of ranks (a whole number from 1)");
  EXPECT_EQ(launch_error({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
            "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4 (ranks count from 0)");
  EXPECT_EQ(launch_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}}),
            "LOCAL_RANK='-1' is not a local rank (a whole number from 0)");
}

TEST(LaunchEnv, MasterAddress) {
  LaunchEnv who;
  who.launcher = "Open MPI";
  who.rank = 3;
  who.world = 8;
  who.rank_variable = "OMPI_COMM_WORLD_RANK";
  who.world_variable = "OMPI_COMM_WORLD_SIZE";
  Expected<MasterAddress> m = master_address("node1:29500", lookup({}), who);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->host, "node1");
  EXPECT_EQ(m->port, 29500);
  EXPECT_EQ(m->source, "--master");
  m = master_address("[fe80::1]:7", lookup({}), who);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->host, "fe80::1");
  EXPECT_EQ(m->port, 7);
  // The flag wins over the variables.
  m = master_address("", lookup({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}), who);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->host, "10.0.0.1");
  EXPECT_EQ(m->port, 1234);
  EXPECT_EQ(m->source, "MASTER_ADDR/MASTER_PORT");

  auto error = [&](const std::string& flag, const std::map<std::string, std::string>& vars) {
    Expected<MasterAddress> e = master_address(flag, lookup(vars), who);
    return e.ok() ? "(no error)" : e.error().message();
  };
  EXPECT_EQ(error("", {}),
            "rank 3 of 8 (Open MPI from OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE) needs the "
            "rendezvous address: pass --master HOST:PORT or set MASTER_ADDR and MASTER_PORT "
            "(rank 0's host and a free TCP port on it, the same for every rank)");
  EXPECT_TRUE(contains(error("", {{"MASTER_ADDR", "a"}}),
                       "MASTER_ADDR is set but MASTER_PORT is not: pass --master"));
  EXPECT_TRUE(contains(error("", {{"MASTER_PORT", "1"}}),
                       "MASTER_PORT is set but MASTER_ADDR is not: pass --master"));
  EXPECT_EQ(error("", {{"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}),
            "MASTER_PORT='70000' is not a TCP port (1 to 65535)");
  EXPECT_EQ(error("node1", {}),
            "--master 'node1': no port; expected HOST:PORT (rank 0's host and a free TCP port "
            "on it, e.g. node1:29500)");
  EXPECT_TRUE(contains(error(":80", {}), "--master ':80': no host"));
  EXPECT_TRUE(contains(error("h:0", {}), "--master 'h:0': '0' is not a TCP port"));
}

TEST(LaunchEnv, GpuForLocalRank) {
  LaunchEnv who;
  who.launcher = "torchrun-style";
  who.local_variable = "LOCAL_RANK";
  who.local_rank = 2;
  EXPECT_EQ(*gpu_for_local_rank(who, 4), 2);
  EXPECT_EQ(*gpu_for_local_rank(who, 1), 0);  // one GPU a process (CUDA_VISIBLE_DEVICES)
  Expected<int> g = gpu_for_local_rank(who, 2);
  ASSERT_FALSE(g.ok());
  EXPECT_TRUE(
      contains(g.error().message(), "--device cuda: LOCAL_RANK=2 but this machine shows 2 GPU(s)"))
      << g.error().message();
  who.local_rank = -1;
  g = gpu_for_local_rank(who, 8);
  ASSERT_FALSE(g.ok());
  EXPECT_TRUE(contains(g.error().message(), "torchrun-style sets no local rank (LOCAL_RANK)"))
      << g.error().message();
}

// ---------------------------------------------------------------- the TCP rendezvous

Comm::Rendezvous at(int port, double timeout_s) {
  Comm::Rendezvous r;
  r.host = "127.0.0.1";
  r.port = port;
  r.timeout_s = timeout_s;
  r.source = "MASTER_ADDR/MASTER_PORT";
  return r;
}

TEST(Rendezvous, RanksStartedInAnyOrderConnectAndTalk) {
  // Rank 0 opens the master port itself (no socket handed in), after the others started
  // trying to reach it.
  const int port = free_port();
  const int world = 3;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  std::vector<float> sums(world, 0);
  for (int r = world - 1; r >= 0; --r) {
    threads.emplace_back([&, r] {
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      auto c = Comm::connect(at(port, 10), r, world, 10);
      if (!c) {
        errors[r] = c.error().message();
        return;
      }
      float x = static_cast<float>(r + 1);
      if (Status s = (*c)->all_reduce({0, 1, 2}, &x, 1); !s) {
        errors[r] = s.error().message();
        return;
      }
      sums[r] = x;
      if (Status s = (*c)->barrier(); !s) errors[r] = s.error().message();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], 6.0f) << "rank " << r;
  }
}

// Each rank r sends member j (a group in another order than the ranks') r + j + 1 values
// r * 100 + j, none to one member; each gets every member's piece for it, in group order.
TEST(CommAllToAll, UnevenPiecesReachTheirMembersInGroupOrder) {
  const int port = free_port();
  const int world = 3;
  const std::vector<int> group = {2, 0, 1};
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  std::vector<std::vector<float>> got(world);
  auto count = [](int from, int to) -> std::size_t {
    return from == 1 && to == 2 ? 0 : static_cast<std::size_t>(from + to + 1);
  };
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto c = Comm::connect(at(port, 10), r, world, 10);
      if (!c) {
        errors[r] = c.error().message();
        return;
      }
      std::vector<float> in;
      std::vector<std::size_t> send, recv;
      std::size_t total = 0;
      for (int j : group) {
        for (std::size_t i = 0; i < count(r, j); ++i) in.push_back(static_cast<float>(r * 100 + j));
        send.push_back(count(r, j) * sizeof(float));
        recv.push_back(count(j, r) * sizeof(float));
        total += count(j, r);
      }
      got[r].assign(total, -1);
      if (Status st = (*c)->all_to_all(group, in.data(), send, got[r].data(), recv); !st) {
        errors[r] = st.error().message();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    std::vector<float> want;
    for (int j : group) {
      for (std::size_t i = 0; i < count(j, r); ++i) want.push_back(static_cast<float>(j * 100 + r));
    }
    EXPECT_EQ(got[r], want) << "rank " << r;
  }
}

TEST(Rendezvous, UnreachableMasterNamesTheRankAndTheAddress) {
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  auto c = Comm::connect(at(port, 0.5), 2, 4);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().message(),
            fmt::format("rank 2: could not reach rank 0's rendezvous at 127.0.0.1:{} "
                        "(MASTER_ADDR/MASTER_PORT) within 0.5 s: Connection refused (is rank 0 "
                        "running on that host, and the port open?)",
                        port));
  EXPECT_LT(took, 3.0);
}

TEST(Rendezvous, MissingRanksAreNamed) {
  const int port = free_port();
  std::string error;
  std::thread one([&] {
    auto c = Comm::connect(at(port, 1), 1, 4);
    if (!c) error = c.error().message();
  });
  auto c = Comm::connect(at(port, 1), 0, 4);
  one.join();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().message(),
            fmt::format("rank 0: 2 of 4 ranks reached the rendezvous at port {} "
                        "(MASTER_ADDR/MASTER_PORT) within 1 s; missing rank(s) 2, 3 (were they "
                        "started, with the same MASTER_ADDR/MASTER_PORT and a world of 4?)",
                        port));
  // Rank 1 learns that rank 0 gave up.
  EXPECT_TRUE(contains(error, "rank 1: the rendezvous with rank 0 at 127.0.0.1:")) << error;
}

TEST(Rendezvous, DisagreeingWorldSizesFail) {
  const int port = free_port();
  std::thread one([&] { (void)Comm::connect(at(port, 2), 1, 3); });
  auto c = Comm::connect(at(port, 2), 0, 2);
  one.join();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().message(),
            "rank 0: rank 1 says the world has 3 ranks but rank 0's has 2 (every rank must be "
            "started with the same world size)");
}

TEST(Rendezvous, BusyMasterPortIsNamed) {
  Expected<Comm::Listener> taken = Comm::listen("", 0);
  ASSERT_TRUE(taken.ok()) << taken.error().message();
  std::thread one([&] { (void)Comm::connect(at(taken->port, 0.5), 1, 2); });
  auto c = Comm::connect(at(taken->port, 0.5), 0, 2);
  one.join();
  ::close(taken->fd);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(contains(c.error().message(),
                       fmt::format("rank 0: cannot listen at *:{}: Address already in use "
                                   "(MASTER_ADDR/MASTER_PORT; is another job using port {}? "
                                   "choose another)",
                                   taken->port, taken->port)))
      << c.error().message();
}

// ---------------------------------------------------------------- nnexec run, one rank a process

// `nnsim plan` for the tiny model, tp x pp x dp ranks on nodes of two.
void make_plan(const TempDir& dir, int tp, int pp, int dp, int global_batch) {
  RunResult p = run(dir, NNSIM_BINARY,
                    {"plan",
                     "--model",
                     kModel,
                     "--topo",
                     kTopo,
                     "--nodes",
                     std::to_string(tp * pp * dp / 2),
                     "--tp",
                     std::to_string(tp),
                     "--pp",
                     std::to_string(pp),
                     "--dp",
                     std::to_string(dp),
                     "--global-batch",
                     std::to_string(global_batch),
                     "--micro-batch",
                     "1",
                     "--precision",
                     "fp32",
                     "-o",
                     "plan.json"});
  ASSERT_EQ(p.status, 0) << p;
}

const std::vector<std::string> kRunArgs = {"run", "--plan",   "plan.json", "--iterations",
                                           "1",   "--warmup", "0",         "--check"};

std::vector<std::string> run_args(std::vector<std::string> extra) {
  std::vector<std::string> a = kRunArgs;
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Starts `world` processes of `nnexec run`, each with `env(rank)`; rank 0's result and every
// other rank's.
std::vector<RunResult> run_ranks(const TempDir& dir, int world, const std::function<Env(int)>& env,
                                 const std::vector<std::string>& extra) {
  std::vector<Child> children;
  for (int r = 0; r < world; ++r) {
    children.push_back(
        testing::start(dir, NNEXEC_BINARY, run_args(extra), env(r), fmt::format("-rank{}", r)));
  }
  std::vector<RunResult> results;
  for (const Child& c : children) results.push_back(testing::finish(c));
  return results;
}

// The same job: ranks, their coordinates and parameters, operators and collectives (with
// calls and bytes), checked shards; and, computed in the same order, the same losses.
void expect_same_run(const RunResults& a, const RunResults& b) {
  EXPECT_EQ(a.world, b.world);
  EXPECT_EQ(a.mesh_axes, b.mesh_axes);
  EXPECT_EQ(a.plan_json, b.plan_json);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.dtype, b.dtype);
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (std::size_t i = 0; i < a.ranks.size(); ++i) {
    const RankResult &x = a.ranks[i], &y = b.ranks[i];
    SCOPED_TRACE(fmt::format("rank {}", i));
    EXPECT_EQ(x.rank, static_cast<int>(i));
    EXPECT_EQ(y.rank, static_cast<int>(i));
    EXPECT_EQ(x.coordinates, y.coordinates);
    EXPECT_EQ(x.parameters, y.parameters);
    EXPECT_EQ(x.iteration_seconds.size(), y.iteration_seconds.size());
    EXPECT_EQ(x.losses, y.losses);
    ASSERT_EQ(x.ops.size(), y.ops.size());
    for (std::size_t k = 0; k < x.ops.size(); ++k) {
      EXPECT_EQ(x.ops[k].name + " " + x.ops[k].phase, y.ops[k].name + " " + y.ops[k].phase);
      EXPECT_EQ(x.ops[k].calls, y.ops[k].calls);
    }
    ASSERT_EQ(x.collectives.size(), y.collectives.size());
    for (std::size_t k = 0; k < x.collectives.size(); ++k) {
      const CollTime &p = x.collectives[k], &q = y.collectives[k];
      EXPECT_EQ(p.kind + " " + p.axes + " " + p.label, q.kind + " " + q.axes + " " + q.label);
      EXPECT_EQ(p.bytes, q.bytes);
      EXPECT_EQ(p.calls, q.calls);
    }
    ASSERT_EQ(x.checks.size(), y.checks.size());
    for (std::size_t k = 0; k < x.checks.size(); ++k) {
      EXPECT_EQ(x.checks[k].name, y.checks[k].name);
      EXPECT_EQ(x.checks[k].max_abs_error, y.checks[k].max_abs_error);
    }
  }
}

// Rank 0 printed the summary and the check; the others nothing.
void expect_rank0_reports(const std::vector<RunResult>& ranks) {
  ASSERT_FALSE(ranks.empty());
  for (std::size_t r = 0; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].status, 0) << ranks[r];
  EXPECT_TRUE(contains(ranks[0].out, "check           passed")) << ranks[0];
  EXPECT_TRUE(contains(ranks[0].out, fmt::format("on {} processes", ranks.size()))) << ranks[0];
  for (std::size_t r = 1; r < ranks.size(); ++r) EXPECT_EQ(ranks[r].out, "") << ranks[r];
}

// One plan (tp2 pp2: 4 ranks, tensor-parallel all-reduces and pipeline transfers) and what
// `nnexec run --launch 4` makes of it, shared by the tests that start the ranks otherwise.
class NnexecRunRanks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!nnexec_build().torch) return;
    dir_ = new TempDir;
    make_plan(*dir_, 2, 2, 1, 4);
    RunResult r = run(*dir_, NNEXEC_BINARY, run_args({"--launch", "4", "--out", "launch.h5"}));
    ASSERT_EQ(r.status, 0) << r;
    Expected<RunResults> file = read_run(dir_->file("launch.h5"));
    ASSERT_TRUE(file.ok()) << file.error().message();
    reference_ = new RunResults(*file);
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete dir_;
    reference_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
    ASSERT_NE(reference_, nullptr) << "nnexec run --launch 4 failed";
  }
  // `out` (in the shared directory), read back, checked and compared with --launch's.
  static void expect_like_launch(const std::string& out) {
    Expected<RunResults> file = read_run(dir_->file(out));
    ASSERT_TRUE(file.ok()) << file.error().message();
    EXPECT_TRUE(file->check_passed());
    expect_same_run(*file, *reference_);
  }
  static TempDir* dir_;
  static RunResults* reference_;
};

TempDir* NnexecRunRanks::dir_ = nullptr;
RunResults* NnexecRunRanks::reference_ = nullptr;

TEST_F(NnexecRunRanks, TorchrunStyleVariablesMatchLaunch) {
  const int port = free_port();
  std::vector<RunResult> ranks = run_ranks(*dir_, 4,
                                           [&](int r) {
                                             Env env = torchrun_env(r, 4, port);
                                             env.push_back({"LOCAL_RANK", std::to_string(r)});
                                             return env;
                                           },
                                           {"--out", "torchrun.h5"});
  expect_rank0_reports(ranks);
  expect_like_launch("torchrun.h5");
}

TEST_F(NnexecRunRanks, OpenMpiVariablesAndMasterFlag) {
  const int port = free_port();
  std::vector<RunResult> ranks =
      run_ranks(*dir_, 4,
                [&](int r) {
                  return Env{{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                             {"OMPI_COMM_WORLD_SIZE", "4"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)}};
                },
                {"--out", "ompi.h5", "--master", fmt::format("localhost:{}", port)});
  expect_rank0_reports(ranks);
  expect_like_launch("ompi.h5");
}

// mpirun on PATH (scripts/setup installs Debian's openmpi-bin), or nullopt.
std::optional<std::string> find_mpirun() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (std::size_t start = 0; start <= dirs.size();) {
    std::size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string candidate = dirs.substr(start, end - start) + "/mpirun";
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return std::nullopt;
}

TEST_F(NnexecRunRanks, UnderMpirun) {
  const std::optional<std::string> mpirun = find_mpirun();
  if (!mpirun) GTEST_SKIP() << "no mpirun on PATH (scripts/setup installs openmpi-bin)";
  const int port = free_port();
  // Open MPI refuses root without --allow-run-as-root, and more ranks than cores without
  // --oversubscribe.
  std::vector<std::string> args = {"--oversubscribe", "-np", "4"};
  if (::getuid() == 0) args.insert(args.begin(), "--allow-run-as-root");
  args.emplace_back(NNEXEC_BINARY);
  for (const std::string& a :
       run_args({"--out", "mpi.h5", "--master", fmt::format("127.0.0.1:{}", port)})) {
    args.emplace_back(a);
  }
  RunResult r = run(*dir_, *mpirun, args);
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "check           passed")) << r;
  EXPECT_TRUE(contains(r.out, "on 4 processes")) << r;
  expect_like_launch("mpi.h5");
}

// ---------------------------------------------------------------- nnexec run: bad launches

TEST(NnexecRunRanksRefuse, WorldSizeOtherThanThePlans) {
  TempDir dir;
  make_plan(dir, 2, 2, 1, 4);
  RunResult r = run(dir, NNEXEC_BINARY, run_args({"--out", "run.h5"}), torchrun_env(1, 2, 29500));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_EQ(r.err,
            "nnexec: rank 1: error: WORLD_SIZE=2 (torchrun-style) but the plan's mesh has 4 "
            "ranks: start 4 processes (mpirun -np 4, srun -n 4, or WORLD_SIZE=4 over all "
            "machines), or all on this machine with `nnexec run --launch 4`\n");
}

TEST(NnexecRunRanksRefuse, MissingMasterAddress) {
  TempDir dir;
  make_plan(dir, 2, 1, 1, 2);
  RunResult r = run(dir, NNEXEC_BINARY, run_args({"--out", "run.h5"}),
                    {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_EQ(r.err,
            "nnexec: rank 0: error: rank 0 of 2 (Open MPI from "
            "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE) needs the rendezvous address: pass "
            "--master HOST:PORT or set MASTER_ADDR and MASTER_PORT (rank 0's host and a free TCP "
            "port on it, the same for every rank)\n");
  // --master without a launcher's variables.
  r = run(dir, NNEXEC_BINARY, run_args({"--out", "run.h5", "--master", "127.0.0.1:29500"}));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err,
                       "--master is for ranks started by a launcher, but none of "
                       "OMPI_COMM_WORLD_RANK, PMI_RANK, RANK or SLURM_PROCID is set"))
      << r;
}

TEST(NnexecRunOneRank, NeedsNoMasterAndCudaSaysWhyNot) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  RunResult p = run(dir, NNSIM_BINARY,
                    {"plan",
                     "--model",
                     kModel,
                     "--topo",
                     std::string(NNSIM_TEST_DATA) + "/tiny-node1.yaml",
                     "--nodes",
                     "1",
                     "--tp",
                     "1",
                     "--pp",
                     "1",
                     "--dp",
                     "1",
                     "--global-batch",
                     "2",
                     "--micro-batch",
                     "1",
                     "--precision",
                     "fp32",
                     "-o",
                     "plan.json"});
  ASSERT_EQ(p.status, 0) << p;
  const Env one = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}};
  RunResult r = run(dir, NNEXEC_BINARY, run_args({"--out", "one.h5"}), one);
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "on 1 processes")) << r;
  Expected<RunResults> file = read_run(dir.file("one.h5"));
  ASSERT_TRUE(file.ok()) << file.error().message();
  EXPECT_TRUE(file->check_passed());
  // --device cuda where it cannot run: the same reasons as under --launch, from the rank.
  const CudaProbe probe = nnexec_info().gpus;
  if (nnexec_build().torch_cuda && probe.usable) GTEST_SKIP() << "this machine can run cuda";
  r = run(dir, NNEXEC_BINARY, run_args({"--out", "gpu.h5", "--device", "cuda"}), one);
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "nnexec: rank 0: error: --device cuda: ")) << r;
  EXPECT_FALSE(std::ifstream(dir.file("gpu.h5")).good());
}

TEST(NnexecRunRanksRefuse, UnreachableMaster) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  make_plan(dir, 2, 1, 1, 2);
  const int port = free_port();
  RunResult r = run(dir, NNEXEC_BINARY, run_args({"--out", "run.h5", "--connect-timeout", "0.5"}),
                    torchrun_env(1, 2, port));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_EQ(r.err, fmt::format("nnexec: rank 1: error: could not reach rank 0's "
                               "rendezvous at 127.0.0.1:{} (MASTER_ADDR/MASTER_PORT) within 0.5 "
                               "s: Connection refused (is rank 0 running on that host, and the "
                               "port open?)\n",
                               port));
  EXPECT_FALSE(std::ifstream(dir.file("run.h5")).good());
}

TEST(NnexecRunRanksRefuse, ARankThatNeverComesIsNamed) {
  // Rank 1 of 2 never comes: rank 0 says which rank is missing.
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  make_plan(dir, 2, 1, 1, 2);
  const int port = free_port();
  RunResult r = run(dir, NNEXEC_BINARY, run_args({"--out", "run.h5", "--connect-timeout", "0.5"}),
                    torchrun_env(0, 2, port));
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, fmt::format("nnexec: rank 0: error: 1 of 2 ranks reached "
                                          "the rendezvous at port {} (MASTER_ADDR/MASTER_PORT) "
                                          "within 0.5 s; missing rank(s) 1",
                                          port)))
      << r;
}

// ---------------------------------------------------------------- nnexec run --launch on the CPU

// The direct children of process `parent`, in pid order (/proc/PID/stat's fourth field).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = testing::slurp(e.path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == parent) {
      out.push_back(static_cast<pid_t>(std::stoi(name)));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Whether `pid` has signal `sig` pending (sent to the process; /proc/PID/status, ShdPnd).
bool pending(pid_t pid, int sig) {
  const std::string status = testing::slurp(fmt::format("/proc/{}/status", pid));
  const size_t at = status.find("ShdPnd:");
  if (at == std::string::npos) return false;
  return (std::stoull(status.substr(at + 7), nullptr, 16) >> (sig - 1)) & 1;
}

// Polls `done` every 20 ms for up to `seconds`; whether it came true.
bool within(double seconds, const std::function<bool()>& done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// On the CPU, `nnexec run --launch` forks its ranks (GPU ranks execute nnexec again with
// --worker-rank): they are the launcher's own children, with its command line. A rank that dies
// stops the run: the launcher names it, ends the others itself (SIGTERM) and exits non-zero.
// Rank 0 is stopped while rank 1 is killed, so that it cannot notice the dead peer and fail
// first; the launcher's SIGTERM is seen pending before rank 0 continues.
TEST(NnexecRunLaunch, RanksAreForkedAndADeadRankStopsTheRun) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  make_plan(dir, 1, 2, 1, 4);
  const std::vector<std::string> args = {"run",    "--plan",   "plan.json", "--launch",
                                         "2",      "--out",    "run.h5",    "--iterations",
                                         "100000", "--warmup", "0"};
  const Child launcher = testing::start(dir, NNEXEC_BINARY, args);
  std::vector<pid_t> ranks;
  int status = 0;
  bool exited = false;
  // Whatever fails below, nothing of this run outlives the test.
  struct Cleanup {
    const Child& launcher;
    std::vector<pid_t>& ranks;
    bool& exited;
    ~Cleanup() {
      if (exited) return;
      for (pid_t p : ranks) ::kill(p, SIGKILL);
      ::kill(launcher.pid, SIGKILL);
      ::waitpid(launcher.pid, nullptr, 0);
    }
  } cleanup{launcher, ranks, exited};

  ASSERT_TRUE(within(60,
                     [&] {
                       ranks = children_of(launcher.pid);
                       return ranks.size() >= 2;
                     }))
      << "the launcher started " << ranks.size() << " ranks";
  ASSERT_EQ(ranks.size(), 2u);
  // Well past the moment an executed rank would have replaced its command line.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const std::string cmdline = testing::slurp(fmt::format("/proc/{}/cmdline", launcher.pid));
  EXPECT_TRUE(contains(cmdline, "--launch")) << cmdline;
  for (pid_t p : ranks) {
    const std::string mine = testing::slurp(fmt::format("/proc/{}/cmdline", p));
    EXPECT_EQ(mine, cmdline) << "rank pid " << p << " is not the launcher forked";
    EXPECT_FALSE(contains(mine, "--worker-rank")) << mine;
  }

  // Each rank names itself (its comm, as ps shows it): pids alone do not say which is which,
  // since they wrap around (at 32,768 on many machines).
  std::map<std::string, pid_t> by_name;
  EXPECT_TRUE(within(60, [&] {
    by_name.clear();
    for (pid_t p : ranks) {
      by_name[testing::slurp(fmt::format("/proc/{}/comm", p))] = p;
    }
    return by_name.count("nnexec r0\n") && by_name.count("nnexec r1\n");
  })) << "the ranks do not call themselves 'nnexec r0' and 'nnexec r1'";
  ASSERT_EQ(by_name.count("nnexec r0\n") + by_name.count("nnexec r1\n"), 2u);
  ranks = {by_name["nnexec r0\n"], by_name["nnexec r1\n"]};
  ASSERT_EQ(::kill(ranks[0], SIGSTOP), 0);
  ASSERT_EQ(::kill(ranks[1], SIGKILL), 0);
  EXPECT_TRUE(within(30, [&] { return pending(ranks[0], SIGTERM); }))
      << "the launcher did not end rank 0 after rank 1 died";
  ::kill(ranks[0], SIGCONT);
  exited = within(30, [&] { return ::waitpid(launcher.pid, &status, WNOHANG) == launcher.pid; });
  ASSERT_TRUE(exited) << "the launcher did not exit after its rank 1 died";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << "status " << status;
  const std::string err = testing::slurp(launcher.err);
  EXPECT_TRUE(contains(err, "nnexec: error: rank 1 was killed by signal 9")) << err;
  EXPECT_FALSE(contains(err, "rank 0: error")) << err;  // ended by the launcher, not by itself
  // Both ranks reaped by the launcher; no run file.
  for (pid_t p : ranks) EXPECT_FALSE(std::filesystem::exists(fmt::format("/proc/{}", p))) << p;
  EXPECT_FALSE(std::filesystem::exists(dir.file("run.h5")));
}

}  // namespace
}  // namespace nnsim::hwexec
