#include "tools/calibrate_command.h"

#include <cstdio>
#include <optional>
#include <tuple>

#include <fmt/format.h>

#include "core/calibration.h"
#include "core/cost_model.h"
#include "core/plan.h"
#include "core/program.h"
#include "core/topology.h"
#include "core/units.h"
#include "hwexec/compare.h"
#include "hwexec/fit.h"
#include "hwexec/fit_host.h"
#include "hwexec/fit_network.h"
#include "hwexec/run.h"
#include "tools/cli_checks.h"
#include "tools/driver.h"

namespace nnsim::tool {

CLI::App* add_calibrate_command(CLI::App& app, CalibrateArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "fit the cost model to microbenchmarks (nnexec bench) and/or runs (nnexec run) into a "
      "calibration file");
  cmd->add_option("files", a.inputs,
                  "an nnexec bench file (micro.h5) and/or nnexec run files (run.h5)")
      ->required();
  cmd->add_option("--gpu", a.gpu,
                  "catalog GPU to calibrate (default: the microbenchmark file's "
                  "device; required for CPU files and run files)");
  cmd->add_option("-o,--output", a.output, "the calibration file to write")->required();
  cmd->add_option("--topo", a.topo,
                  "topology YAML file or preset name whose nodes are the run files' "
                  "machines: fits the network's efficiency relative to its links, and the "
                  "microbenchmark's host Adam and copies relative to its node.host "
                  "(default GPU: its GPU)");
  cmd->add_option("--nodes", a.nodes, "resize the topology to this many nodes")->check(at_least(1));
  return cmd;
}

// nnsim calibrate: fits the cost model to an `nnexec bench` file and/or `nnexec run` files
// (docs/hwexec.md).
int run_calibrate(const CalibrateArgs& a) {
  std::optional<hwexec::MicroResults> micro;
  std::string micro_path;
  std::vector<std::pair<std::string, hwexec::RunResults>> runs;
  for (const std::string& path : a.inputs) {
    Expected<std::string> format = hwexec::hdf5_format(path);
    if (!format) {
      return fail(
          fmt::format("{}; give an nnexec bench file (nnexec bench --out) or nnexec run "
                      "files (nnexec run --out)",
                      format.error().message()));
    }
    if (*format == hwexec::kRunFormat) {
      Expected<hwexec::RunResults> run = hwexec::read_run(path);
      if (!run) return fail(run.error().message());
      runs.emplace_back(path, std::move(*run));
    } else {
      if (micro) {
        return fail(
            fmt::format("{} and {} are both microbenchmark files; give one", micro_path, path));
      }
      Expected<hwexec::MicroResults> m = hwexec::read_micro(path);
      if (!m) return fail(m.error().message());
      micro = std::move(*m);
      micro_path = path;
    }
  }
  std::optional<Topology> topo;
  if (!a.topo.empty()) {
    Expected<Topology> t = load_topology_sized(a.topo, a.nodes);
    if (!t) return fail("--topo: " + t.error().message());
    if (runs.empty() && !(micro && hwexec::has_host_series(*micro))) {
      return fail(fmt::format(
          "--topo {}: it serves run files (nnexec run), whose collectives across machines fit "
          "the network, and a microbenchmark file's host Adam and copies (nnexec bench, "
          "version 4); {} has neither: give one, or leave --topo out",
          a.topo, micro_path.empty() ? "the input" : micro_path));
    }
    if (!a.gpu.empty() && a.gpu != t->gpu.name) {
      return fail(
          fmt::format("--gpu {} and --topo {} (GPU {}) differ: nnsim compare and simulate read the "
                      "calibration of the topology's GPU; leave --gpu out or give the same GPU",
                      a.gpu, a.topo, t->gpu.name));
    }
    topo = std::move(*t);
  } else if (a.nodes > 0) {
    return fail("--nodes resizes the topology: give --topo too");
  }
  // The GPU: --gpu, else the topology's, else the one the CUDA microbenchmark file names. CPU
  // files need one of the first two.
  std::string gpu_name = a.gpu.empty() && topo ? topo->gpu.name : a.gpu;
  if (gpu_name.empty()) {
    if (micro && micro->device == "cpu") {
      return fail(fmt::format(
          "{} was measured on a CPU ('{}'), which has no catalog entry: name the catalog GPU "
          "whose parameters it should set with --gpu (its efficiencies are then relative to that "
          "GPU's datasheet peaks; docs/hwexec.md)",
          micro_path, micro->device_name));
    }
    for (const auto& [path, run] : runs) {
      if (run.device == "cpu") {
        return fail(fmt::format(
            "{} was run on a CPU, which has no catalog entry: name the catalog GPU whose "
            "parameters it should set with --gpu (the topology's GPU, for nnsim compare; "
            "docs/hwexec.md)",
            path));
      }
    }
    if (!micro) {
      return fail(fmt::format("{} does not name its GPU model: give --gpu", runs.front().first));
    }
    Expected<std::string> matched = hwexec::match_catalog_gpu(micro->device_name);
    if (!matched) return fail(fmt::format("{}: {}", micro_path, matched.error().message()));
    gpu_name = *matched;
  }
  Expected<GpuSpec> gpu = find_gpu(gpu_name);
  if (!gpu) return fail("--gpu: " + gpu.error().message());

  std::vector<hwexec::RunPoints> points;
  std::string source = "nnsim calibrate";
  if (micro) {
    source += fmt::format(" {} (nnexec bench on {} '{}', LibTorch {})", micro_path, micro->device,
                          micro->device_name, micro->torch_version);
  }
  bool cpu = micro && micro->device == "cpu";
  for (const auto& [path, run] : runs) {
    Expected<Plan> plan = hwexec::plan_of_run(run, path, "");
    if (!plan) return fail(plan.error().message());
    Expected<hwexec::RunPoints> p = hwexec::run_points(run, *plan, *gpu, path);
    if (!p) return fail(p.error().message());
    if (topo) {
      if (Status s = hwexec::price_cross_host(run, *plan, *topo, path, *p); !s) {
        return fail(s.error().message());
      }
    }
    points.push_back(std::move(*p));
    source += fmt::format(" {} (nnexec run of '{}' on {}, {} ranks, LibTorch {})", path,
                          run.plan_name, run.device, run.world, run.torch_version);
    cpu = cpu || run.device == "cpu";
  }
  if (cpu) source += fmt::format("; relative to {}'s datasheet", gpu->name);
  if (topo) source += fmt::format("; network relative to {}'s links", topo->name);
  const std::string inputs = fmt::format("{}", fmt::join(a.inputs, " "));
  Expected<hwexec::Fit> fit =
      hwexec::fit_all(micro ? &*micro : nullptr, micro_path, points, *gpu, source);
  if (!fit) return fail(fmt::format("{}: {}", inputs, fit.error().message()));
  // The host's side of offloading: relative to the topology's host.
  std::optional<hwexec::HostFit> host;
  if (micro && hwexec::has_host_series(*micro)) {
    if (topo) {
      Expected<hwexec::HostFit> h = hwexec::fit_host(*micro, micro_path, *topo);
      if (!h) return fail(h.error().message());
      host = std::move(*h);
      auto& compute = fit->calibration.compute;
      for (const auto& [name, value] :
           {std::pair{"host_memory_efficiency", host->memory_efficiency},
            std::pair{"device_to_host_efficiency", host->to_host_efficiency},
            std::pair{"host_to_device_efficiency", host->to_device_efficiency}}) {
        if (value) compute[name] = *value;
      }
      fit->calibration.source += fmt::format("; the host relative to {}'s node.host", topo->name);
    } else {
      fit->notes.push_back(fmt::format(
          "{}: its host Adam and copies are not fitted without a topology whose node.host "
          "describes the machine (--topo)",
          micro_path));
    }
  }
  Calibration c;
  c.gpus[gpu->name] = fit->calibration;
  if (Status s = save_calibration(a.output, c); !s) return fail(s.error().message());

  std::printf("%s -> %s (%s)\n", inputs.c_str(), a.output.c_str(), gpu->name.c_str());
  if (cpu) {
    std::printf("  note: measured on a CPU; efficiencies are relative to %s's datasheet\n",
                gpu->name.c_str());
  }
  for (const hwexec::GemmFit& g : fit->gemm) {
    const std::string at = g.m > 0 ? fmt::format("{:.0f}x{:.0f}x{:.0f}", g.m, g.n, g.k) : g.best;
    std::printf(
        "  gemm_efficiency_%-4s %.4g  (relative least squares over %d GEMMs: median error %.1f%%, "
        "max %.1f%%, %d slower and %d faster than measured; best %.4g FLOP/s, e %.4g, at %s of "
        "%.4g peak)\n",
        std::string(to_string(g.precision)).c_str(), g.efficiency, g.samples, 100 * g.median_error,
        100 * g.max_error, g.slower, g.faster, g.best_flops, g.best_efficiency, at.c_str(), g.peak);
  }
  if (fit->memory) {
    const hwexec::MemoryFit& m = *fit->memory;
    if (m.fixed_bandwidth) {
      std::printf(
          "  memory_efficiency    %.4g  (%.4g bytes/s of %.4g, fixed: %s; the free line over %s "
          "gave %.4g, above HBM)\n",
          m.efficiency, m.bandwidth, gpu->hbm_bandwidth, m.bandwidth_from.c_str(), m.from.c_str(),
          m.free_bandwidth);
    } else {
      std::printf("  memory_efficiency    %.4g  (%.4g bytes/s of %.4g; from %s)\n", m.efficiency,
                  m.bandwidth, gpu->hbm_bandwidth, m.from.c_str());
    }
    std::printf("  kernel_overhead      %.4g s  (%s over %d kernels: median %.1f%%, max %.1f%%)\n",
                m.overhead, m.fixed_bandwidth ? "fitted with the bandwidth fixed" : "line fit",
                m.samples, 100 * m.median_error, 100 * m.max_error);
    for (const auto& op : m.per_op) {
      std::printf("    %-16s alone: %.4g bytes/s, %.4g s per kernel\n", op.op.c_str(), op.bandwidth,
                  op.overhead);
    }
  }
  if (fit->attention) {
    const hwexec::AttentionFit& at = *fit->attention;
    std::printf("  attention_fwd_efficiency %.4g  (%s %s, %d shapes, of %.4g 16-bit peak)\n",
                at.fwd_efficiency, at.dtype.c_str(), at.kernel.c_str(), at.samples, at.peak);
    std::printf("  attention_bwd_efficiency %.4g\n", at.bwd_efficiency);
    std::printf(
        "  attention_seq_half   %.4g%s  (model error over %d forwards and backwards: "
        "median %.1f%%, max %.1f%%)\n",
        at.seq_half, at.seq_half_fitted ? "" : " (built-in, kept)", 2 * at.samples,
        100 * at.median_error, 100 * at.max_error);
  }
  for (const auto& [name, link] :
       {std::pair{"nvlink", &fit->nvlink}, std::pair{"network", &fit->network}}) {
    if (!*link) continue;
    const hwexec::LinkFit& l = **link;
    std::string what =
        fmt::format("step latency {}", format_seconds(l.link.step_latency.value_or(0)));
    if (l.link.max_efficiency)
      what += fmt::format(", max efficiency {:.3g}", *l.link.max_efficiency);
    if (l.link.all_reduce_max_efficiency) {
      what += fmt::format(", all-reduce {:.3g}", *l.link.all_reduce_max_efficiency);
    }
    if (!l.link.curve.empty()) what += fmt::format(", {} curve points", l.link.curve.size());
    std::printf("  %-20s %s  (%d GPUs, %s)\n", name, what.c_str(), l.ranks,
                fmt::format("{}", fmt::join(l.from, ", ")).c_str());
    for (const hwexec::LinkFit::GroupCheck& c : l.checks) {
      std::printf("    %s over %d GPUs: model error median %.1f%%, max %.1f%% (%d sizes)\n",
                  c.kind.c_str(), c.ranks, 100 * c.median_error, 100 * c.max_error, c.samples);
    }
  }
  if (host) {
    if (host->memory_efficiency) {
      std::printf("  host_memory_efficiency %.4g  (Adam over %.0f weights at %s of %s's %s)\n",
                  *host->memory_efficiency, host->adam_elements,
                  format_rate(host->adam_bandwidth).c_str(), topo->name.c_str(),
                  format_rate(topo->host.memory_bandwidth).c_str());
    }
    for (const auto& [name, eff, rate] :
         {std::tuple{"device_to_host_efficiency", host->to_host_efficiency,
                     host->to_host_bandwidth},
          std::tuple{"host_to_device_efficiency", host->to_device_efficiency,
                     host->to_device_bandwidth}}) {
      if (!eff) continue;
      std::printf("  %s %.4g  (%s a GPU, %d at once, of %s a GPU)\n", name, *eff,
                  format_rate(rate).c_str(), host->gpus, format_rate(host->link_bandwidth).c_str());
    }
    for (const std::string& n : host->notes) std::printf("  note: %s\n", n.c_str());
  }
  for (const std::string& n : fit->notes) std::printf("  note: %s\n", n.c_str());
  return 0;
}

CLI::App* add_calibration_command(CLI::App& app, ExportArgs& a) {
  CLI::App* calib_cmd = app.add_subcommand("calibration", "calibration files");
  CLI::App* cmd =
      calib_cmd->add_subcommand("export", "write the built-in cost model as a calibration file");
  cmd->add_option("--gpu", a.gpus, "catalog GPU (repeatable)")->required();
  cmd->add_option("--attention", a.attention, "attention kernels: flash2 or fused3")
      ->check(CLI::IsMember({"flash2", "fused3"}));
  cmd->add_option("--framework", a.framework,
                  "the model a plan of this framework gets (its attention library and "
                  "elementwise fusion): megatron, fsdp, deepspeed or other")
      ->check(CLI::IsMember({"megatron", "fsdp", "deepspeed", "other"}))
      ->excludes("--attention");
  cmd->add_option("-o,--output", a.output, "the HDF5 file to write")->required();
  calib_cmd->require_subcommand(1);
  return cmd;
}

int run_calibration_export(const ExportArgs& a) {
  Calibration c;
  for (const auto& name : a.gpus) {
    Expected<GpuSpec> gpu = find_gpu(name);
    if (!gpu) return fail("--gpu: " + gpu.error().message());
    const AttentionLibrary lib =
        a.attention == "fused3" ? AttentionLibrary::kFused3 : AttentionLibrary::kFlash2;
    ComputeModel compute = ComputeModel::defaults_for(*gpu, lib);
    if (!a.framework.empty()) {
      Plan plan;
      plan.framework = a.framework;
      compute = default_compute_model(plan, *gpu);
    }
    c.gpus[name] = describe_models(compute, CommModel::defaults_for(*gpu),
                                   "nnsim built-in defaults (docs/cost-model.md)");
  }
  if (Status s = save_calibration(a.output, c); !s) return fail(s.error().message());
  std::printf("wrote %s\n", a.output.c_str());
  return 0;
}

}  // namespace nnsim::tool
