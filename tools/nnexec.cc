// nnexec: runs things on this machine's hardware. It parses arguments, calls hwexec and talks
// to the user; the library never prints or exits (docs/hwexec.md).
//
//   nnexec bench --out micro.h5 [--device cpu|cuda] [--quick]
//   nnexec run --plan plan.json --launch N --out run.h5 [--device cpu|cuda] [--iterations K
//              --warmup W --check]
//   mpirun -np N nnexec run --plan plan.json --out run.h5 --master HOST:PORT  (or srun,
//              torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: one rank each)
//   nnexec info
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/plan.h"
#include "hwexec/bench.h"
#include "hwexec/comm.h"
#include "hwexec/launch.h"
#include "hwexec/micro.h"
#include "hwexec/run.h"
#include "tools/cli_checks.h"

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "nnexec: error: %s\n", message.c_str());
  return 1;
}

// This machine's name, recorded per rank: which ranks shared a machine tells the calibration
// fit which collectives stayed inside one (docs/hwexec.md).
std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

int run_info() {
  using namespace nnsim::hwexec;
  const BuildInfo b = build_info();
  std::printf("LibTorch   %s\n", b.torch ? b.torch_version.c_str() : "not built in");
  std::printf("CUDA+NCCL  %s\n",
              b.cuda ? ("built in, NCCL " + b.nccl_version).c_str() : "not built in");
  const CudaProbe p = probe_cuda();
  if (p.usable) {
    std::printf("GPUs       %d x %s%s\n", p.devices, p.name.c_str(),
                b.torch_cuda ? "" : " (LibTorch here has no CUDA: only NCCL can use them)");
  } else {
    std::printf("GPUs       none usable: %s\n", p.reason.c_str());
  }
  return 0;
}

struct RunArgs {
  std::string plan, out, master;
  int launch = 0;
  int worker_rank = -1;  // internal: started by --launch
  int master_fd = -1;    // internal: rank 0's inherited rendezvous socket
  double connect_timeout = 120;
  nnsim::hwexec::RunOptions options;
};

// This process as one rank of a job: who it is, where the ranks meet.
struct Role {
  nnsim::hwexec::LaunchEnv who;
  nnsim::hwexec::MasterAddress master;
  int listen_fd = -1;
};

// Why --device cuda cannot run here, or "" when it can; `ranks_here`: the processes that need
// a GPU each on this machine (0: only check that there is one).
std::string cuda_refusal(int ranks_here) {
  using namespace nnsim::hwexec;
  const BuildInfo b = build_info();
  std::vector<std::string> why;
  const CudaProbe p = probe_cuda();
  if (!b.cuda) {
    why.emplace_back(
        "this nnexec was built without hwexec's CUDA part (NNSIM_WITH_CUDA: the CUDA toolkit "
        "and NCCL)");
  } else if (!p.usable) {
    why.push_back("no usable GPU: " + p.reason);
  } else if (p.devices < ranks_here) {
    why.push_back(
        fmt::format("the plan has {} ranks but this machine has {} GPU(s) (one GPU a "
                    "process; CUDA_VISIBLE_DEVICES?)",
                    ranks_here, p.devices));
  }
  if (!b.torch_cuda) {
    why.push_back(fmt::format(
        "this build's LibTorch ({}) has no CUDA (Debian's libtorch is CPU-only); configure "
        "with -DNNSIM_TORCH_PYTHON=<python with a CUDA torch>",
        b.torch_version));
  }
  std::string m;
  for (std::size_t i = 0; i < why.size(); ++i) m += (i ? "; and " : "") + why[i];
  return m.empty() ? m : "--device cuda: " + m;
}

// The plan, if nnexec can run it (and, with `check`, check it).
nnsim::Expected<nnsim::Plan> runnable_plan(const std::string& path, bool check) {
  using namespace nnsim::hwexec;
  nnsim::Expected<nnsim::Plan> plan = nnsim::load_plan(path);
  if (!plan) return plan;
  if (nnsim::Status s = check_runnable(*plan); !s) {
    return nnsim::Error(fmt::format("{}: cannot run this plan: {}", path, s.error().message()));
  }
  if (nnsim::Status s = check_checkable(*plan); check && !s) {
    return nnsim::Error(fmt::format("{}: --check: {}", path, s.error().message()));
  }
  return plan;
}

// Rank 0, with every rank's result: writes the run file and tells the user how it went.
int finish(const RunArgs& a, const nnsim::Plan& plan, const nnsim::hwexec::RunOptions& options,
           std::vector<nnsim::hwexec::RankResult> ranks) {
  using namespace nnsim::hwexec;
  RunResults results;
  results.plan_json = nnsim::plan_to_json(plan);
  results.plan_name = plan.name;
  results.options = options;
  results.world = static_cast<int>(ranks.size());
  results.torch_version = build_info().torch_version;
  results.device = options.device;
  results.dtype = run_dtype(plan);
  results.device_name = options.device == "cuda" ? probe_cuda().name : "cpu";
  if (options.device == "cuda") results.nccl_version = build_info().nccl_version;
  for (const auto& ax : plan.mesh.axes) results.mesh_axes.push_back(ax.name);
  results.ranks = std::move(ranks);
  if (nnsim::Status s = write_run(a.out, results); !s) return fail(s.error().message());

  const int world = results.world;
  std::vector<double> t = results.iteration_seconds();
  std::sort(t.begin(), t.end());
  if (options.device == "cuda") {
    std::printf("%s: %s on %d GPU(s) (%s, %s, LibTorch %s, NCCL %s)\n", a.out.c_str(),
                plan.name.c_str(), world, results.device_name.c_str(), results.dtype.c_str(),
                results.torch_version.c_str(), results.nccl_version.c_str());
  } else {
    std::printf("%s: %s on %d processes (CPU, %s, LibTorch %s, %d thread(s) each)\n", a.out.c_str(),
                plan.name.c_str(), world, results.dtype.c_str(), results.torch_version.c_str(),
                options.threads);
  }
  if (!t.empty()) {
    std::printf("  iteration time  median %.3f ms (min %.3f, max %.3f over %zu iterations)\n",
                t[t.size() / 2] * 1e3, t.front() * 1e3, t.back() * 1e3, t.size());
  }
  for (const RankResult& k : results.ranks) {
    if (!k.losses.empty()) {
      std::printf("  loss            %.6f (last iteration)\n", k.losses.back());
      break;
    }
  }
  double peak = -1;
  for (const RankResult& k : results.ranks) peak = std::max(peak, k.peak_allocated_bytes);
  if (peak >= 0) {
    std::printf("  memory          peak %.3f GiB of tensors (largest rank)\n", peak / (1 << 30));
  }
  if (!options.check) return 0;
  double worst = 0;
  std::string worst_name;
  int shards = 0;
  bool printed_loss = false;
  for (const RankResult& k : results.ranks) {
    for (const ParamCheck& c : k.checks) {
      ++shards;
      const double rel = c.max_abs_error / std::max(c.ref_max_abs, 1e-30);
      if (rel >= worst) {
        worst = rel;
        worst_name = fmt::format("{} on rank {}", c.name, k.rank);
      }
      if (!c.ok) {
        std::fprintf(stderr,
                     "nnexec: check: gradient of %s on rank %d differs from the unpartitioned "
                     "run: max |error| %.3g, max |reference| %.3g\n",
                     c.name.c_str(), k.rank, c.max_abs_error, c.ref_max_abs);
      }
    }
    if (k.has_loss && !printed_loss) {
      printed_loss = true;
      std::printf("  check loss      %.8f, unpartitioned %.8f (rank %d)\n", k.check_loss,
                  k.reference_loss, k.rank);
    }
  }
  if (!results.check_passed()) {
    return fail(
        fmt::format("check failed: the partitioned run's loss or gradients differ from "
                    "the unpartitioned run (see above; rtol {}, atol {})",
                    options.rtol, options.atol));
  }
  std::printf(
      "  check           passed: loss and %d parameter shards match the unpartitioned "
      "run (worst relative error %.2g, %s)\n",
      shards, worst, worst_name.c_str());
  return 0;
}

// One rank: connects to the others, runs its part, and sends its result to rank 0 (ranks may
// be on other machines), which writes the run file.
int run_as_rank(const RunArgs& a, const Role& role) {
  using namespace nnsim::hwexec;
  const int rank = role.who.rank;
  // `ps` and `top` show which process is which rank (the command line stays the launcher's).
  ::prctl(PR_SET_NAME, fmt::format("nnexec r{}", rank).c_str());
  auto fail_rank = [&](std::string m) {
    // The library's errors name the rank too; say it once.
    const std::string self = fmt::format("rank {}: ", rank);
    if (m.rfind(self, 0) == 0) m.erase(0, self.size());
    std::fprintf(stderr, "nnexec: rank %d: error: %s\n", rank, m.c_str());
    return 1;
  };
  nnsim::Expected<nnsim::Plan> plan = runnable_plan(a.plan, a.options.check);
  if (!plan) return fail_rank(plan.error().message());
  const int ranks = plan->mesh.num_ranks();
  if (role.who.world != ranks) {
    return fail_rank(fmt::format(
        "{}={} ({}) but the plan's mesh has {} ranks: start {} processes (mpirun -np {}, srun "
        "-n {}, or WORLD_SIZE={} over all machines), or all on this machine with `nnexec run "
        "--launch {}`",
        role.who.world_variable, role.who.world, role.who.launcher, ranks, ranks, ranks, ranks,
        ranks, ranks));
  }
  if (!build_info().torch) {
    return fail_rank(
        "this nnexec was built without LibTorch (NNSIM_WITH_TORCH); it cannot run plans");
  }
  RunOptions options = a.options;
  set_check_tolerance(run_dtype(*plan), &options);
  if (options.device == "cuda") {
    if (std::string why = cuda_refusal(0); !why.empty()) return fail_rank(why);
    nnsim::Expected<int> gpu = gpu_for_local_rank(role.who, probe_cuda().devices);
    if (!gpu) return fail_rank(gpu.error().message());
    options.gpu = *gpu;
  }
  Comm::Rendezvous at;
  at.host = role.master.host;
  at.port = role.master.port;
  at.source = role.master.source;
  at.listen_fd = role.listen_fd;
  at.timeout_s = a.connect_timeout;
  auto comm = Comm::connect(at, rank, role.who.world);
  if (!comm) return fail_rank(comm.error().message());
  nnsim::Expected<RankResult> r = run_rank(*plan, options, **comm);
  if (!r) return fail_rank(r.error().message());
  r->host = host_name();
  Comm& c = **comm;
  if (rank != 0) {
    const std::string text = rank_to_text(*r);
    const std::uint64_t n = text.size();
    nnsim::Status s = c.send(0, &n, sizeof(n));
    if (s) s = c.send(0, text.data(), text.size());
    if (s) s = c.flush();
    if (!s) return fail_rank("sending the result to rank 0: " + s.error().message());
    return 0;
  }
  std::vector<RankResult> results = {*r};
  for (int peer = 1; peer < role.who.world; ++peer) {
    std::uint64_t n = 0;
    nnsim::Status s = c.recv(peer, &n, sizeof(n));
    std::string text(s ? n : 0, '\0');
    if (s) s = c.recv(peer, text.data(), text.size());
    if (!s) return fail_rank(s.error().message());
    nnsim::Expected<RankResult> k = rank_from_text(text);
    if (!k) return fail_rank(fmt::format("the result of rank {}: {}", peer, k.error().message()));
    results.push_back(*k);
  }
  return finish(a, *plan, options, std::move(results));
}

// Rank `rank` of `world` started by `nnexec run --launch` on this machine.
Role launched_role(int rank, int world) {
  Role role;
  role.who.launcher = "nnexec run --launch";
  role.who.rank = rank;
  role.who.world = world;
  role.who.local_rank = rank;
  role.who.rank_variable = "--worker-rank";
  role.who.world_variable = "--launch";
  role.who.local_variable = "--worker-rank";
  role.master.source = "--master";
  return role;
}

// The command line of rank `rank` started as this executable again (--device cuda).
std::vector<std::string> worker_args(const RunArgs& a, const char* self, int rank, int port,
                                     int listen_fd) {
  std::vector<std::string> args = {self,
                                   "run",
                                   "--plan",
                                   a.plan,
                                   "--launch",
                                   std::to_string(a.launch),
                                   "--worker-rank",
                                   std::to_string(rank),
                                   "--master",
                                   fmt::format("127.0.0.1:{}", port),
                                   "--connect-timeout",
                                   fmt::format("{}", a.connect_timeout),
                                   "--iterations",
                                   std::to_string(a.options.iterations),
                                   "--warmup",
                                   std::to_string(a.options.warmup),
                                   "--threads",
                                   std::to_string(a.options.threads),
                                   "--seed",
                                   std::to_string(a.options.seed),
                                   "--device",
                                   a.options.device};
  if (rank == 0) {
    args.insert(args.end(), {"--out", a.out, "--master-fd", std::to_string(listen_fd)});
  }
  if (a.options.check) args.emplace_back("--check");
  if (a.options.inject_fault) args.emplace_back("--inject-fault");
  if (a.options.memory_timeline) args.emplace_back("--memory-timeline");
  return args;
}

// Starts one process per rank on this machine (forked; on GPUs this executable again, with
// --worker-rank), connected over TCP on the loopback interface, and waits for all; rank 0 writes
// the file.
int run_launcher(RunArgs a) {
  using namespace nnsim::hwexec;
  nnsim::Expected<nnsim::Plan> plan = runnable_plan(a.plan, a.options.check);
  if (!plan) return fail(plan.error().message());
  const int ranks = plan->mesh.num_ranks();
  if (a.launch == 0) a.launch = ranks;
  if (a.launch != ranks) {
    return fail(fmt::format("--launch {} but the plan's mesh has {} ranks; launch {}", a.launch,
                            ranks, ranks));
  }
  if (!build_info().torch) {
    return fail("this nnexec was built without LibTorch (NNSIM_WITH_TORCH); it cannot run plans");
  }
  if (a.options.device == "cuda") {
    if (std::string why = cuda_refusal(ranks); !why.empty()) return fail(why);
    // All ranks are on this machine: NCCL's bootstrap can always use the loopback interface.
    ::setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
  }
  // Rank 0 inherits the listening socket, so no other process can take its port meanwhile.
  nnsim::Expected<Comm::Listener> listener = Comm::listen("127.0.0.1", 0);
  if (!listener) return fail(listener.error().message());
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return fail("cannot find this executable (/proc/self/exe)");
  self[n] = '\0';
  std::map<pid_t, int> children;
  // On the CPU a rank is this process forked: it skips loading LibTorch again (about half a
  // second a rank). CUDA cannot be used in a process forked after CUDA was touched
  // (cuda_refusal probed it), so for --device cuda each rank is this executable again.
  const bool exec_ranks = a.options.device == "cuda";
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < a.launch; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) return fail("fork failed");
    if (pid == 0) {
      if (exec_ranks) {
        if (r == 0) ::fcntl(listener->fd, F_SETFD, 0);  // keep it open across exec
        std::vector<std::string> args = worker_args(a, self, r, listener->port, listener->fd);
        std::vector<char*> argv;
        for (auto& s : args) argv.push_back(s.data());
        argv.push_back(nullptr);
        ::execv(self, argv.data());
        ::_exit(127);
      }
      Role role = launched_role(r, a.launch);
      role.master.host = "127.0.0.1";
      role.master.port = listener->port;
      if (r == 0) {
        role.listen_fd = listener->fd;
      } else {
        ::close(listener->fd);
      }
      RunArgs mine = a;
      mine.worker_rank = r;
      if (r != 0) mine.out.clear();
      const int status = run_as_rank(mine, role);
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(status);
    }
    children[pid] = r;
  }
  ::close(listener->fd);
  // A rank that fails says why itself (exit status 1); the first failure stops the others.
  std::string failure;
  bool failed = false;
  while (!children.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    auto it = children.find(pid);
    if (it == children.end()) continue;
    const int r = it->second;
    children.erase(it);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !failed) {
      failed = true;
      if (!WIFEXITED(status)) {
        failure = fmt::format("rank {} was killed by signal {}", r, WTERMSIG(status));
      } else if (WEXITSTATUS(status) != 1) {
        failure = fmt::format("rank {} failed (exit status {})", r, WEXITSTATUS(status));
      }
      for (const auto& [other, _] : children) ::kill(other, SIGTERM);  // ours only
    }
  }
  if (!failure.empty()) return fail(failure);
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace nnsim::hwexec;
  CLI::App app{"nnexec: run microbenchmarks and plans on real CPUs and GPUs (docs/hwexec.md)"};
  app.set_version_flag("--version", "nnexec 0.1.0");
  app.require_subcommand(1);

  BenchOptions bench;
  std::string out;
  bool verbose = false;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "GEMM, memory-bound operator and NCCL collective microbenchmarks into an HDF5 file");
  bench_cmd->add_option("-o,--out", out, "the HDF5 file to write (format nnexec-micro)")
      ->required();
  bench_cmd->add_option("--device", bench.device, "cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  bench_cmd->add_flag("--quick", bench.quick, "fewer, smaller sizes and repetitions (tests)");
  bench_cmd->add_option("--threads", bench.threads, "CPU threads (default: LibTorch's)");
  bench_cmd->add_flag("-v,--verbose", verbose, "print every measurement");
  CLI::App* info_cmd = app.add_subcommand("info", "what this build and machine can run");

  RunArgs run;
  CLI::App* run_cmd = app.add_subcommand(
      "run",
      "run a plan on CPUs or GPUs, one process per mesh rank (started here with --launch, or by "
      "mpirun, srun or torchrun-style variables), into an HDF5 run file");
  run_cmd->add_option("--plan", run.plan, "plan.json (nnsim plan)")->required();
  run_cmd
      ->add_option("--device", run.options.device,
                   "cpu (socket collectives) or cuda (one GPU a rank, NCCL); default cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  run_cmd->add_option("--launch", run.launch,
                      "processes to start on this machine, one per mesh rank (default: the "
                      "plan's ranks, unless a launcher's variables make this process one rank)");
  run_cmd->add_option("-o,--out", run.out, "the HDF5 run file to write (format nnexec-run)");
  run_cmd->add_option("--iterations", run.options.iterations, "measured iterations (default 3)")
      ->check(nnsim::at_least(1));
  run_cmd->add_option("--warmup", run.options.warmup, "warm-up iterations (default 1)")
      ->check(nnsim::at_least(0));
  run_cmd->add_flag("--check", run.options.check,
                    "compare the first iteration's loss and gradients with an unpartitioned run");
  run_cmd->add_option("--threads", run.options.threads, "LibTorch threads per process (default 1)")
      ->check(nnsim::at_least(1));
  run_cmd->add_option("--seed", run.options.seed, "weights and data seed (default 1234)");
  run_cmd->add_option("--master", run.master,
                      "HOST:PORT where the ranks meet (rank 0's host, a free port) when a "
                      "launcher (mpirun, srun, torchrun) starts them; default MASTER_ADDR and "
                      "MASTER_PORT");
  run_cmd
      ->add_option("--connect-timeout", run.connect_timeout,
                   "seconds to wait for the other ranks at the start (default 120)")
      ->check(nnsim::at_least(0, /*strict=*/true));
  run_cmd->add_flag("--memory-timeline", run.options.memory_timeline,
                    "record the bytes of live tensors at every operator of the last measured "
                    "iteration (/ranks/<r>/memory)");
  run_cmd->add_flag("--inject-fault", run.options.inject_fault)->group("");  // tests
  run_cmd->add_option("--worker-rank", run.worker_rank)->group("");          // internal
  run_cmd->add_option("--master-fd", run.master_fd)->group("");              // internal

  if (std::optional<int> done = nnsim::parse_command_line(app, argc, argv, "nnexec")) return *done;
  if (info_cmd->parsed()) return run_info();
  if (run_cmd->parsed()) {
    if (run.out.empty() && run.worker_rank < 0) return fail("run: --out is required");
    if (run.worker_rank >= 0) {  // started by --launch
      Role role = launched_role(run.worker_rank, run.launch);
      role.listen_fd = run.master_fd;
      nnsim::Expected<MasterAddress> m = parse_host_port(run.master, "--master");
      if (!m) return fail(m.error().message());
      role.master = *m;
      return run_as_rank(run, role);
    }
    if (run.launch > 0) return run_launcher(run);
    const Getenv get = [](const char* name) -> const char* { return std::getenv(name); };
    nnsim::Expected<std::optional<LaunchEnv>> env = launch_from_env(get);
    if (!env) return fail(env.error().message());
    if (!*env) {
      if (!run.master.empty()) {
        return fail(
            "--master is for ranks started by a launcher, but none of OMPI_COMM_WORLD_RANK, "
            "PMI_RANK, RANK or SLURM_PROCID is set; start nnexec with mpirun, srun or torchrun "
            "(or set RANK, WORLD_SIZE and LOCAL_RANK), or use --launch N on one machine");
      }
      return run_launcher(run);
    }
    Role role;
    role.who = **env;
    nnsim::Expected<MasterAddress> m = master_address(run.master, get, role.who);
    if (!m && role.who.world == 1) m = MasterAddress{};  // alone: nobody to meet
    if (!m) {
      std::fprintf(stderr, "nnexec: rank %d: error: %s\n", role.who.rank,
                   m.error().message().c_str());
      return 1;
    }
    role.master = *m;
    return run_as_rank(run, role);
  }

  auto progress = [&](const std::string& line) {
    if (verbose) std::fprintf(stderr, "%s\n", line.c_str());
  };
  nnsim::Expected<MicroResults> r = run_bench(bench, progress);
  if (!r) return fail(r.error().message());
  if (nnsim::Status s = write_micro(out, *r); !s) return fail(s.error().message());

  std::printf("%s: %s (%s), LibTorch %s%s\n", out.c_str(), r->device_name.c_str(),
              r->device.c_str(), r->torch_version.c_str(),
              r->device == "cpu" ? fmt::format(", {} thread(s)", r->threads).c_str() : "");
  for (const GemmSeries& s : r->gemm) {
    double best = 0;
    for (const GemmSample& x : s.samples) best = std::max(best, x.flops() / x.t.seconds);
    std::printf("  gemm %-5s best %10.2f GFLOP/s over %zu shapes\n",
                std::string(nnsim::to_string(s.precision)).c_str(), best / 1e9, s.samples.size());
  }
  for (const MemorySeries& s : r->memory) {
    double best = 0;
    for (const MemorySample& x : s.samples) best = std::max(best, x.bytes / x.t.seconds);
    std::printf("  %-10s %-4s best %8.2f GB/s over %zu sizes\n", s.op.c_str(), s.dtype.c_str(),
                best / 1e9, s.samples.size());
  }
  for (const AttentionSeries& s : r->attention) {
    double fwd = 0, bwd = 0;  // executed: half the counted FLOPs for a causal kernel
    for (const AttentionSample& x : s.samples) {
      fwd = std::max(fwd, 0.5 * x.flops() / x.fwd.seconds);
      bwd = std::max(bwd, x.flops() / x.bwd.seconds);
    }
    std::printf("  attention  %-4s %s best fwd %8.2f GFLOP/s, bwd %8.2f GFLOP/s over %zu shapes\n",
                s.dtype.c_str(), s.kernel.c_str(), fwd / 1e9, bwd / 1e9, s.samples.size());
  }
  for (const CollectiveSeries& s : r->collectives) {
    double best = 0;
    for (const CollectiveSample& x : s.samples) {
      best = std::max(best, x.bytes / x.t.seconds * bus_factor(s.kind, s.ranks));
    }
    std::printf("  %-14s %d GPUs, best bus bandwidth %8.2f GB/s\n", s.kind.c_str(), s.ranks,
                best / 1e9);
  }
  if (!r->host_adam.empty()) {
    // The largest size: out of the CPU's caches, as an offloaded optimizer's state is.
    const HostAdamSample& x = r->host_adam.back();
    std::printf("  host adam  %.0f weights: %.3f ms, %.2f GB/s of traffic\n", x.elements,
                x.t.seconds * 1e3, x.elements * kHostAdamBytesPerElement / x.t.seconds / 1e9);
  }
  for (const HostCopySeries& s : r->host_copies) {
    double best = 0;
    for (const HostCopySample& x : s.samples) best = std::max(best, x.bytes / x.t.seconds);
    std::printf("  %-9s %d GPUs at once, best %8.2f GB/s a GPU\n", s.direction.c_str(), s.gpus,
                best / 1e9);
  }
  for (const std::string& n : r->notes) std::printf("  note: %s\n", n.c_str());
  return 0;
}
