// nnexec: runs things on this machine's hardware. It parses arguments, calls hwexec and talks
// to the user; the library never prints or exits (docs/hwexec.md).
//
//   nnexec bench --out micro.h5 [--device cpu|cuda] [--quick]
//   nnexec info
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "hwexec/bench.h"
#include "hwexec/micro.h"

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

}  // namespace

int main(int argc, char** argv) {
  using namespace nnsim::hwexec;
  CLI::App app{"nnexec: run microbenchmarks on real CPUs and GPUs (docs/hwexec.md)"};
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
