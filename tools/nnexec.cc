// nnexec: runs things on this machine's hardware. It parses arguments, calls hwexec and talks
// to the user; the library never prints or exits (docs/hwexec.md).
//
//   nnexec bench --out micro.h5 [--device cpu|cuda] [--quick]
//   nnexec run --plan plan.json --launch N --out run.h5 [--device cpu|cuda] [--iterations K
//              --warmup W --check]
//   nnexec info
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/plan.h"
#include "hwexec/bench.h"
#include "hwexec/comm.h"
#include "hwexec/micro.h"
#include "hwexec/run.h"

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "nnexec: error: %s\n", message.c_str());
  return 1;
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
  std::string plan, out, rendezvous;
  int launch = 0;
  int worker_rank = -1;
  nnsim::hwexec::RunOptions options;
};

// One rank, started by the launcher: connects to the others, runs, and leaves its result in
// <rendezvous>/rank-<r>.txt.
int run_worker(const RunArgs& a) {
  using namespace nnsim::hwexec;
  auto fail_rank = [&](const std::string& m) {
    std::fprintf(stderr, "nnexec: rank %d: error: %s\n", a.worker_rank, m.c_str());
    return 1;
  };
  nnsim::Expected<nnsim::Plan> plan = nnsim::load_plan(a.plan);
  if (!plan) return fail_rank(plan.error().message());
  auto comm = Comm::connect(a.rendezvous, a.worker_rank, a.launch);
  if (!comm) return fail_rank(comm.error().message());
  RunOptions options = a.options;
  set_check_tolerance(run_dtype(*plan), &options);
  nnsim::Expected<RankResult> r = run_rank(*plan, options, **comm);
  if (!r) return fail_rank(r.error().message());
  const std::string path = fmt::format("{}/rank-{}.txt", a.rendezvous, a.worker_rank);
  {
    std::ofstream f(path + ".tmp");
    f << rank_to_text(*r);
    if (!f) return fail_rank("cannot write " + path);
  }
  std::filesystem::rename(path + ".tmp", path);
  return 0;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Starts one process per rank (this executable again, with --worker-rank), waits for all, and
// writes the run file.
int run_launcher(RunArgs a) {
  using namespace nnsim::hwexec;
  nnsim::Expected<nnsim::Plan> plan = nnsim::load_plan(a.plan);
  if (!plan) return fail(plan.error().message());
  if (nnsim::Status s = check_runnable(*plan); !s) {
    return fail(fmt::format("{}: cannot run this plan: {}", a.plan, s.error().message()));
  }
  set_check_tolerance(run_dtype(*plan), &a.options);
  const int ranks = plan->mesh.num_ranks();
  if (a.launch == 0) a.launch = ranks;
  if (a.launch != ranks) {
    return fail(fmt::format("--launch {} but the plan's mesh has {} ranks; launch {}", a.launch,
                            ranks, ranks));
  }
  if (!build_info().torch) {
    return fail("this nnexec was built without LibTorch (NNSIM_WITH_TORCH); it cannot run plans");
  }
  std::string device_name = "cpu";
  if (a.options.device == "cuda") {
    // Everything that stops a GPU run, in one message.
    const BuildInfo b = build_info();
    std::vector<std::string> why;
    const CudaProbe p = probe_cuda();
    if (!b.cuda) {
      why.push_back(
          "this nnexec was built without hwexec's CUDA part (NNSIM_WITH_CUDA: the CUDA toolkit "
          "and NCCL)");
    } else if (!p.usable) {
      why.push_back("no usable GPU: " + p.reason);
    } else if (p.devices < ranks) {
      why.push_back(
          fmt::format("the plan has {} ranks but this machine has {} GPU(s) (one GPU a "
                      "process; CUDA_VISIBLE_DEVICES?)",
                      ranks, p.devices));
    }
    if (!b.torch_cuda) {
      why.push_back(fmt::format(
          "this build's LibTorch ({}) has no CUDA (Debian's libtorch is CPU-only); configure "
          "with -DNNSIM_TORCH_PYTHON=<python with a CUDA torch>",
          b.torch_version));
    }
    if (!why.empty()) {
      std::string m = "--device cuda: ";
      for (std::size_t i = 0; i < why.size(); ++i) m += (i ? "; and " : "") + why[i];
      return fail(m);
    }
    device_name = p.name;
    // All ranks are on this machine: NCCL's bootstrap can always use the loopback interface.
    ::setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
  }
  char dir_template[] = "/tmp/nnexec-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) return fail("cannot create a rendezvous directory");
  const std::string dir = dir_template;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return fail("cannot find this executable (/proc/self/exe)");
  self[n] = '\0';
  std::map<pid_t, int> children;
  for (int r = 0; r < a.launch; ++r) {
    std::vector<std::string> args = {self,
                                     "run",
                                     "--plan",
                                     a.plan,
                                     "--launch",
                                     std::to_string(a.launch),
                                     "--worker-rank",
                                     std::to_string(r),
                                     "--rendezvous",
                                     dir,
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
    if (a.options.check) args.push_back("--check");
    if (a.options.inject_fault) args.push_back("--inject-fault");
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) return fail("fork failed");
    if (pid == 0) {
      ::execv(self, argv.data());
      ::_exit(127);
    }
    children[pid] = r;
  }
  std::string failure;
  while (!children.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    auto it = children.find(pid);
    if (it == children.end()) continue;
    const int r = it->second;
    children.erase(it);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failure.empty()) {
      failure = WIFEXITED(status)
                    ? fmt::format("rank {} failed (exit status {})", r, WEXITSTATUS(status))
                    : fmt::format("rank {} was killed by signal {}", r, WTERMSIG(status));
      for (const auto& [other, _] : children) ::kill(other, SIGTERM);  // ours only
    }
  }
  RunResults results;
  results.plan_json = nnsim::plan_to_json(*plan);
  results.plan_name = plan->name;
  results.options = a.options;
  results.world = a.launch;
  results.torch_version = build_info().torch_version;
  results.device = a.options.device;
  results.dtype = run_dtype(*plan);
  results.device_name = device_name;
  if (a.options.device == "cuda") results.nccl_version = build_info().nccl_version;
  for (const auto& ax : plan->mesh.axes) results.mesh_axes.push_back(ax.name);
  for (int r = 0; failure.empty() && r < a.launch; ++r) {
    auto k = rank_from_text(slurp(fmt::format("{}/rank-{}.txt", dir, r)));
    if (!k)
      failure = fmt::format("rank {}: {}", r, k.error().message());
    else
      results.ranks.push_back(*k);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (!failure.empty()) return fail(failure);
  if (nnsim::Status s = write_run(a.out, results); !s) return fail(s.error().message());

  std::vector<double> t = results.iteration_seconds();
  std::sort(t.begin(), t.end());
  if (a.options.device == "cuda") {
    std::printf("%s: %s on %d GPU(s) (%s, %s, LibTorch %s, NCCL %s)\n", a.out.c_str(),
                plan->name.c_str(), a.launch, device_name.c_str(), results.dtype.c_str(),
                results.torch_version.c_str(), results.nccl_version.c_str());
  } else {
    std::printf("%s: %s on %d processes (CPU, %s, LibTorch %s, %d thread(s) each)\n", a.out.c_str(),
                plan->name.c_str(), a.launch, results.dtype.c_str(), results.torch_version.c_str(),
                a.options.threads);
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
  if (peak >= 0)
    std::printf("  GPU memory      peak %.3f GiB allocated (largest rank)\n", peak / (1 << 30));
  if (!a.options.check) return 0;
  double worst = 0;
  std::string worst_name;
  int shards = 0;
  bool ok = true, printed_loss = false;
  for (const RankResult& k : results.ranks) {
    for (const ParamCheck& c : k.checks) {
      ++shards;
      const double rel = c.max_abs_error / std::max(c.ref_max_abs, 1e-30);
      if (rel >= worst) {
        worst = rel;
        worst_name = fmt::format("{} on rank {}", c.name, k.rank);
      }
      if (!c.ok) {
        ok = false;
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
                    a.options.rtol, a.options.atol));
  }
  std::printf(
      "  check           passed: loss and %d parameter shards match the unpartitioned "
      "run (worst relative error %.2g, %s)\n",
      shards, worst, worst_name.c_str());
  (void)ok;
  return 0;
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
      "run a plan on this machine's CPU or GPUs, one process per mesh rank, into an HDF5 run file");
  run_cmd->add_option("--plan", run.plan, "plan.json (nnsim plan)")->required();
  run_cmd
      ->add_option("--device", run.options.device,
                   "cpu (socket collectives) or cuda (one GPU a rank, NCCL); default cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  run_cmd->add_option("--launch", run.launch,
                      "processes to start, one per mesh rank (default: the plan's ranks)");
  run_cmd->add_option("-o,--out", run.out, "the HDF5 run file to write (format nnexec-run)");
  run_cmd->add_option("--iterations", run.options.iterations, "measured iterations (default 3)")
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--warmup", run.options.warmup, "warm-up iterations (default 1)")
      ->check(CLI::NonNegativeNumber);
  run_cmd->add_flag("--check", run.options.check,
                    "compare the first iteration's loss and gradients with an unpartitioned run");
  run_cmd->add_option("--threads", run.options.threads, "LibTorch threads per process (default 1)")
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--seed", run.options.seed, "weights and data seed (default 1234)");
  run_cmd->add_flag("--inject-fault", run.options.inject_fault)->group("");  // tests
  run_cmd->add_option("--worker-rank", run.worker_rank)->group("");          // internal
  run_cmd->add_option("--rendezvous", run.rendezvous)->group("");            // internal

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "nnexec: error: %s\nRun with --help for more information.\n", e.what());
    return 2;
  }
  if (info_cmd->parsed()) return run_info();
  if (run_cmd->parsed()) {
    if (run.worker_rank >= 0) return run_worker(run);
    if (run.out.empty()) return fail("run: --out is required");
    return run_launcher(run);
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
  for (const CollectiveSeries& s : r->collectives) {
    double best = 0;
    for (const CollectiveSample& x : s.samples) {
      best = std::max(best, x.bytes / x.t.seconds * bus_factor(s.kind, s.ranks));
    }
    std::printf("  %-14s %d GPUs, best bus bandwidth %8.2f GB/s\n", s.kind.c_str(), s.ranks,
                best / 1e9);
  }
  for (const std::string& n : r->notes) std::printf("  note: %s\n", n.c_str());
  return 0;
}
