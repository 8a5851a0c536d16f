// Fitting the simulator's cost-model parameters to microbenchmark results and run files
// (`nnsim calibrate`). The formulas, what each parameter means and how the sources combine are in
// docs/hwexec.md. Independent of LibTorch and CUDA: it runs wherever nnsim does.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/calibration.h"
#include "core/gpu.h"
#include "core/plan.h"
#include "hwexec/micro.h"
#include "hwexec/run.h"

namespace nnsim::hwexec {

// The catalog GPU a CUDA device name stands for ("NVIDIA H200" -> "h200-sxm-141gb"), or an
// error that lists the catalog.
Expected<std::string> match_catalog_gpu(const std::string& device_name);

// The simulator's compute model for `gpu` with GEMM efficiency 1 (for `precision`) and
// sustained 1: a shape's time at the datasheet peak, with the model's tile and wave quantization
// and short-k factor.
ComputeModel ideal_compute(const GpuSpec& gpu, Precision precision);

// A GEMM-bound measurement: the simulator's time for it at gemm efficiency 1 and sustained 1
// (the shape's tile and wave quantization and short-k factor at the datasheet peak), and the
// measured time.
struct GemmPoint {
  std::string what;            // "512 x 512 x 512", "attn.qkv bwd, rank 0 (run.h5)"
  double m = 0, n = 0, k = 0;  // a microbenchmark's shape (0 for a run's operator)
  double flops = 0;
  double ideal_seconds = 0;
  double seconds = 0;
  bool cpu = false;  // measured on a CPU
};

// A memory-bound kernel: the bytes the simulator charges it and its time.
struct TrafficPoint {
  double bytes = 0;
  double seconds = 0;
};
struct TrafficSeries {
  std::string op;  // "add" (micro.h5), "attn.norm fwd" (a run)
  std::vector<TrafficPoint> points;
};

// How the simulator runs a collective series on a topology's links (hwexec/fit_network.h): its
// latency steps and the bandwidth its bus volume (bus_factor x bytes) crosses the bottleneck
// link at, with efficiency 1.
struct CollectiveRoute {
  int steps = 0;
  double bandwidth = 0;   // bytes/s
  std::string algorithm;  // "ring", "tree"
};

// What a run file offers the fit, already in the simulator's terms (see docs/hwexec.md).
struct RunPoints {
  std::string path;
  Precision precision = Precision::kFp32;  // what its operators computed in
  std::vector<GemmPoint> gemm;             // linear operators
  std::vector<TrafficSeries> memory;       // norms, activations, residual and position adds
  double elementwise_traffic = 0;          // the traffic factor `memory`'s bytes include
  // All-reduces, all-gathers and reduce-scatters, one series per kind and group size, each
  // sample a message size with its time per call (mean and fastest over the ranks that ran it),
  // split by whether the group's ranks shared one machine. Empty when the file does not say
  // where each rank ran (files written before nnexec recorded hosts).
  std::vector<CollectiveSeries> same_host, cross_host;
  bool hosts_known = false;
  // With a topology (nnsim calibrate --topo, hwexec/fit_network.h): each cross_host series'
  // route on it, in the same order; empty without one (only the step latency is then fitted).
  std::vector<CollectiveRoute> cross_host_routes;
  std::string topology;  // the topology's name the routes are on
  std::vector<std::string> notes;
};

// The points of a run file `run` (read from `path`) of `plan` against `gpu`. Linear operators:
// the forward is one GEMM of the piece's m x n x k, the backward the input-gradient (m x k x n)
// and weight-gradient (k x n x m) GEMMs; memory-bound operators: the graph's traffic of the
// piece times the GPU's built-in elementwise_traffic, per kernel the simulator prices.
Expected<RunPoints> run_points(const RunResults& run, const Plan& plan, const GpuSpec& gpu,
                               const std::string& path);

struct GemmFit {
  Precision precision = Precision::kFp32;
  double peak = 0;  // the GPU's dense peak for it, FLOP/s
  // The fitted gemm_efficiency: the relative least-squares e = sum e_i^2 / sum e_i over all
  // points (docs/hwexec.md), at most 1.
  double efficiency = 0;
  // The best point, for the summary: its e_i, rate, name and shape (micro.h5 GEMMs; 0 for run
  // operators).
  double best_efficiency = 0;
  double best_flops = 0;  // FLOP/s
  std::string best;
  double m = 0, n = 0, k = 0;
  // Over all shapes: the model's relative time error |t_model - t| / t with the fitted value,
  // and how many points the model prices slower and faster than measured.
  double median_error = 0, max_error = 0;
  int slower = 0, faster = 0;
  int samples = 0;
};

struct MemoryFit {
  // The same line fitted to each operator alone: how far apart they are.
  struct PerOp {
    std::string op;
    double bandwidth = 0, overhead = 0;
  };
  std::vector<PerOp> per_op;
  double bandwidth = 0;   // achieved bytes/s (1 / slope)
  double overhead = 0;    // seconds per kernel (intercept)
  double efficiency = 0;  // bandwidth / the GPU's HBM bandwidth
  double median_error = 0, max_error = 0;
  int samples = 0;
  std::string from;  // the files it was fitted to
  // The free line (slope and intercept both fitted). When its bandwidth is above the GPU's HBM
  // bandwidth, the slope is fixed at a physical bandwidth (bandwidth_from says which) and only
  // the overhead is fitted.
  double free_bandwidth = 0, free_overhead = 0;
  bool fixed_bandwidth = false;
  std::string bandwidth_from;
};

// Causal attention (docs/hwexec.md): the simulator's time with sustained 1 is
// t = executed / (peak16 * e * s / (s + seq_half) * min(1, d / 128)^exponent), executed =
// causal_fraction x the counted FLOPs; e per pass, seq_half shared.
struct AttentionFit {
  std::string dtype, kernel;  // the series fitted
  double peak = 0;            // the GPU's 16-bit peak, FLOP/s
  double fwd_efficiency = 0, bwd_efficiency = 0;
  double seq_half = 0;
  bool seq_half_fitted = false;  // false: fewer than 2 lengths, the built-in value kept
  // The model's relative time error over forwards and backwards with the fitted values.
  double median_error = 0, max_error = 0;
  int samples = 0;
};

struct LinkFit {
  int ranks = 0;
  double link_bandwidth = 0;      // bytes/s per direction the efficiencies are relative to
  GpuCalibration::Link link;      // curve, caps and step latency
  std::vector<std::string> from;  // collectives used
  // Every group size a microbenchmark measured (the fitted largest one too), against the fitted
  // model: the relative time error of steps x step_latency + volume / (B x efficiency). One
  // curve serves every kind, so a kind whose own curve differs shows here as well.
  struct GroupCheck {
    std::string kind;
    int ranks = 0;
    int samples = 0;
    double median_error = 0, max_error = 0;
  };
  std::vector<GroupCheck> checks;
};

struct Fit {
  std::string gpu;  // catalog name
  std::vector<GemmFit> gemm;
  std::optional<MemoryFit> memory;
  std::optional<AttentionFit> attention;
  std::optional<LinkFit> nvlink;
  // Across machines (runs only): the step latency, and with a topology (--topo) the
  // efficiency curve relative to each route's bottleneck bandwidth on it.
  std::optional<LinkFit> network;
  std::vector<std::string> notes;  // what could not be fitted and why
  GpuCalibration calibration;      // only the fitted values; the rest keep the built-ins
};

// Fits `micro` against the datasheet figures of `gpu`. `source` goes into the calibration
// entry. Errors when nothing can be fitted or a measurement beats the datasheet peak (wrong GPU).
Expected<Fit> fit_micro(const MicroResults& micro, const GpuSpec& gpu, const std::string& source);

// Fits a microbenchmark file (optional: `micro` may be null, `micro_path` names it) and run files
// together (docs/hwexec.md, "Calibrating from run files"): each precision's GEMM efficiency is
// the relative least squares sum e_i^2 / sum e_i over the GEMMs of both, and sustained is 1 when
// a run gave GEMMs (their times hold the run's clock); the memory line is fitted to the runs'
// memory-bound operators when they have any (the traffic the simulator charges, in the framework
// that ran them), else to micro.h5's kernels, its bandwidth fixed at micro.h5's streaming
// bandwidth (else the datasheet HBM) when the free line is above HBM; attention comes from
// micro.h5 only; the NVLink link from
// micro.h5's collectives, else from the runs' collectives inside one machine; the network's step
// latency from the runs' collectives across machines, and its efficiency too when every run
// was priced on a topology (price_cross_host, hwexec/fit_network.h).
Expected<Fit> fit_all(const MicroResults* micro, const std::string& micro_path,
                      const std::vector<RunPoints>& runs, const GpuSpec& gpu,
                      const std::string& source);

}  // namespace nnsim::hwexec
