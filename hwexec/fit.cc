#include "hwexec/fit.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "core/comm_model.h"
#include "core/cost_model.h"
#include "core/units.h"

namespace nnsim::hwexec {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool has(const std::string& s, const char* what) {
  return s.find(what) != std::string::npos;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Relative errors |model - measured| / measured: median and max.
std::pair<double, double> error_stats(const std::vector<double>& model,
                                      const std::vector<double>& measured) {
  std::vector<double> e;
  for (size_t i = 0; i < model.size(); ++i) {
    e.push_back(std::abs(model[i] - measured[i]) / measured[i]);
  }
  return {median(e), e.empty() ? 0 : *std::max_element(e.begin(), e.end())};
}

// Relative peak-to-fit check: a measurement above what the datasheet allows means the file is
// not from this GPU.
constexpr double kSlack = 1.02;

}  // namespace

// The simulator's compute model for `gpu` with GEMM efficiency 1 and sustained 1: what a shape's
// time would be at the datasheet peak, with the model's tile and wave quantization and short-k
// factor (the GPU's defaults).
ComputeModel ideal_compute(const GpuSpec& gpu, Precision precision) {
  ComputeModel ideal = ComputeModel::defaults_for(gpu);
  ideal.gemm_efficiency = {{precision, 1.0}};
  ideal.sustained = 1.0;
  ideal.sustained_fp8 = 1.0;
  return ideal;
}

namespace {

// The fit of one precision's GEMM efficiency: the e that minimizes the model's relative time
// errors in squares (docs/hwexec.md): with e_i = ideal_i / t_i the relative error of ideal_i / e
// is e_i / e - 1, and sum (e_i / e - 1)^2 is least at e = sum e_i^2 / sum e_i. At most 1 (a
// calibration file holds efficiencies in (0, 1]). A point above the datasheet peak: an error for a
// GPU's measurement (the file is from another GPU); for a CPU's, which the GPU's shape model does
// not describe (tiny shapes the model quantizes heavily can run faster on a CPU than the model lets
// the GPU run them), kept, and the fit capped at 1 with a note.
Expected<GemmFit> fit_gemm(Precision precision, const std::vector<GemmPoint>& points,
                           const GpuSpec& gpu, std::vector<std::string>& notes) {
  GemmFit f;
  f.precision = precision;
  f.peak = gpu.peak_flops(precision);
  f.samples = static_cast<int>(points.size());
  std::vector<double> ideal_t, measured;
  double best = 0, sum_e = 0, sum_e2 = 0;
  bool best_on_cpu = false;
  for (const GemmPoint& x : points) {
    ideal_t.push_back(x.ideal_seconds);
    measured.push_back(x.seconds);
    const double e = x.ideal_seconds / x.seconds;
    sum_e += e;
    sum_e2 += e * e;
    if (e > best) {
      best = e;
      f.best_flops = x.flops / x.seconds;
      f.best = x.what;
      f.m = x.m;
      f.n = x.n;
      f.k = x.k;
      best_on_cpu = x.cpu;
    }
  }
  f.best_efficiency = best;
  f.efficiency = sum_e > 0 ? sum_e2 / sum_e : 0;
  if (best > kSlack) {
    const std::string what = fmt::format(
        "gemm {}: {} ran at {:.4g} FLOP/s, {:.2f} times what {}'s datasheet peak ({:.4g} FLOP/s) "
        "allows for that shape",
        to_string(precision), f.best, f.best_flops, best, gpu.name, f.peak);
    if (!best_on_cpu) return Error(what + "; is the file from another GPU (--gpu)?");
    notes.push_back(
        what + (f.efficiency > 1
                    ? fmt::format("; the fit ({:.3g}) capped at 1 (measured on a CPU, which {}'s "
                                  "GEMM shape model does not describe)",
                                  f.efficiency, gpu.name)
                    : fmt::format("; kept (measured on a CPU, which {}'s GEMM shape model does "
                                  "not describe)",
                                  gpu.name)));
  }
  f.efficiency = std::min(f.efficiency, 1.0);
  std::vector<double> model;
  for (double t0 : ideal_t) model.push_back(t0 / f.efficiency);
  std::tie(f.median_error, f.max_error) = error_stats(model, measured);
  for (size_t i = 0; i < model.size(); ++i) {
    // Within rounding it is neither.
    if (model[i] > measured[i] * (1 + 1e-9)) ++f.slower;
    if (model[i] < measured[i] * (1 - 1e-9)) ++f.faster;
  }
  return f;
}

// A microbenchmark file's GEMMs as points, per precision.
std::map<Precision, std::vector<GemmPoint>> micro_gemm_points(const MicroResults& micro,
                                                              const GpuSpec& gpu) {
  std::map<Precision, std::vector<GemmPoint>> out;
  for (const GemmSeries& s : micro.gemm) {
    const ComputeModel ideal = ideal_compute(gpu, s.precision);
    for (const GemmSample& x : s.samples) {
      out[s.precision].push_back({fmt::format("{} x {} x {}", x.m, x.n, x.k), x.m, x.n, x.k,
                                  x.flops(), gemm_seconds(x.m, x.n, x.k, s.precision, gpu, ideal),
                                  x.t.seconds, micro.device == "cpu"});
    }
  }
  return out;
}

// Weighted least squares of t = a + b x minimizing the relative residuals (a + b x_i - t_i)/t_i.
// {0, 0} with fewer than two distinct x.
std::pair<double, double> relative_line(const std::vector<double>& x,
                                        const std::vector<double>& t) {
  double s0 = 0, s1 = 0, s2 = 0, st = 0, sxt = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = 1 / (t[i] * t[i]);
    s0 += w;
    s1 += w * x[i];
    s2 += w * x[i] * x[i];
    st += w * t[i];
    sxt += w * x[i] * t[i];
  }
  const double det = s0 * s2 - s1 * s1;
  if (x.size() < 2 || det <= 0) return {0, 0};
  return {(s2 * st - s1 * sxt) / det, (s0 * sxt - s1 * st) / det};
}

// The same line with a >= 0 and b > 0: through the origin when the free line breaks either.
std::pair<double, double> fit_line(const std::vector<double>& x, const std::vector<double>& t) {
  auto [a, b] = relative_line(x, t);
  if (a < 0 || b <= 0) {
    double s2 = 0, sxt = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      s2 += x[i] * x[i] / (t[i] * t[i]);
      sxt += x[i] / t[i];
    }
    a = 0;
    b = sxt / s2;
  }
  return {a, b};
}

// The intercept of t = a + b x with the slope b fixed, least squares on the relative residuals
// (a + b x_i - t_i) / t_i: a = sum((t_i - b x_i) / t_i^2) / sum(1 / t_i^2), at least 0.
double fixed_slope_intercept(const std::vector<double>& x, const std::vector<double>& t, double b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (t[i] - b * x[i]) / (t[i] * t[i]);
    den += 1 / (t[i] * t[i]);
  }
  return den > 0 ? std::max(0.0, num / den) : 0;
}

// A physical bandwidth to fix the memory line's slope at.
struct PhysicalBandwidth {
  double bandwidth = 0;  // bytes/s
  std::string from;
};

// The microbenchmark's streaming bandwidth: the fastest of its kernels at their largest size (the
// sizes past every cache), at most the HBM bandwidth; without one, the datasheet HBM bandwidth.
PhysicalBandwidth physical_bandwidth(const MicroResults* micro, const std::string& micro_path,
                                     const GpuSpec& gpu) {
  PhysicalBandwidth p{gpu.hbm_bandwidth, fmt::format("{}'s datasheet HBM bandwidth", gpu.name)};
  double best = 0;
  std::string what;
  for (const MemorySeries& s : micro ? micro->memory : std::vector<MemorySeries>{}) {
    const MemorySample* largest = nullptr;
    for (const MemorySample& x : s.samples) {
      if (x.t.seconds > 0 && (!largest || x.bytes > largest->bytes)) largest = &x;
    }
    if (largest && largest->bytes / largest->t.seconds > best) {
      best = largest->bytes / largest->t.seconds;
      what = fmt::format("{}'s {} {} at {:.0f} elements", micro_path, s.op, s.dtype,
                         largest->elements);
    }
  }
  if (best > 0 && best <= gpu.hbm_bandwidth) p = {best, what};
  return p;
}

std::optional<MemoryFit> fit_memory(const std::vector<TrafficSeries>& series, const GpuSpec& gpu,
                                    const PhysicalBandwidth& physical,
                                    std::vector<std::string>& notes) {
  std::vector<double> bytes, seconds;
  for (const TrafficSeries& s : series) {
    for (const TrafficPoint& x : s.points) {
      bytes.push_back(x.bytes);
      seconds.push_back(x.seconds);
    }
  }
  if (bytes.empty()) {
    notes.emplace_back(
        "memory-bound operators: none measured; memory_efficiency and "
        "kernel_overhead not fitted");
    return std::nullopt;
  }
  if (gpu.hbm_bandwidth <= 0) {
    notes.push_back(
        fmt::format("memory-bound operators: {} has no HBM bandwidth; not fitted", gpu.name));
    return std::nullopt;
  }
  auto [a, b] = fit_line(bytes, seconds);
  MemoryFit f;
  f.samples = static_cast<int>(bytes.size());
  f.free_overhead = a;
  f.free_bandwidth = 1 / b;
  // Above HBM the slope is not a bandwidth (the sizes fit in cache, or the operators' fixed
  // costs differ in ways a line through few sizes takes for a slope): fix it at a physical
  // bandwidth and fit the overhead alone.
  if (f.free_bandwidth > gpu.hbm_bandwidth) {
    b = 1 / physical.bandwidth;
    a = fixed_slope_intercept(bytes, seconds, b);
    f.fixed_bandwidth = true;
    f.bandwidth_from = physical.from;
    notes.push_back(fmt::format(
        "memory-bound operators: the free line's {:.4g} bytes/s (overhead {:.4g} s) is above "
        "{}'s HBM bandwidth ({:.4g} bytes/s); the bandwidth is fixed at {:.4g} bytes/s ({}) and "
        "only the overhead fitted",
        f.free_bandwidth, f.free_overhead, gpu.name, gpu.hbm_bandwidth, physical.bandwidth,
        physical.from));
  }
  f.overhead = a;
  f.bandwidth = 1 / b;
  f.efficiency = f.bandwidth / gpu.hbm_bandwidth;
  for (const TrafficSeries& s : series) {
    if (s.points.empty()) continue;
    std::vector<double> x, t;
    for (const TrafficPoint& p : s.points) {
      x.push_back(p.bytes);
      t.push_back(p.seconds);
    }
    auto [oa, ob] = fit_line(x, t);
    f.per_op.push_back({s.op, 1 / ob, oa});
  }
  std::vector<double> model;
  for (double x : bytes) model.push_back(a + b * x);
  std::tie(f.median_error, f.max_error) = error_stats(model, seconds);
  return f;
}

// The attention efficiencies and seq_half. With x = 1/s, each pass's
// y = t * peak16 * head_factor / executed = (1 + seq_half x) / e: a line in x, fitted to the
// forwards by relative least squares; the backward's e with that seq_half.
Expected<std::optional<AttentionFit>> fit_attention(const MicroResults& micro, const GpuSpec& gpu,
                                                    std::vector<std::string>& notes) {
  if (micro.attention.empty() || micro.attention.front().samples.empty()) {
    notes.emplace_back("attention: none measured; attention_* not fitted");
    return std::optional<AttentionFit>{};
  }
  const AttentionSeries& series = micro.attention.front();
  for (size_t i = 1; i < micro.attention.size(); ++i) {
    notes.push_back(fmt::format("attention {} ({}): not used; fitted to {} ({})",
                                micro.attention[i].dtype, micro.attention[i].kernel, series.dtype,
                                series.kernel));
  }
  const ComputeModel model = ComputeModel::defaults_for(gpu);
  AttentionFit f;
  f.dtype = series.dtype;
  f.kernel = series.kernel;
  f.peak = gpu.peak_flops(Precision::kBf16);  // attention runs in 16-bit
  f.samples = static_cast<int>(series.samples.size());
  if (f.peak <= 0) {
    notes.push_back(fmt::format("attention: {} has no bf16 peak; not fitted", gpu.name));
    return std::optional<AttentionFit>{};
  }
  // y per sample and pass: the inverse efficiency it ran at, head width factor included.
  std::vector<double> x, yf, yb;
  std::vector<double> lengths;
  for (const AttentionSample& a : series.samples) {
    const double head =
        std::pow(std::min(1.0, a.head_dim / 128), model.attention_head_dim_exponent);
    const double executed = model.causal_fraction * a.flops();
    x.push_back(1 / a.seq);
    yf.push_back(a.fwd.seconds * f.peak * head / executed);
    yb.push_back(a.bwd.seconds * f.peak * head / (2 * executed));
    if (std::find(lengths.begin(), lengths.end(), a.seq) == lengths.end()) {
      lengths.push_back(a.seq);
    }
  }
  // Relative least squares through the origin: min sum ((c g_i - y_i) / y_i)^2.
  auto scale = [](const std::vector<double>& g, const std::vector<double>& y) {
    double num = 0, den = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      num += g[i] / y[i];
      den += g[i] * g[i] / (y[i] * y[i]);
    }
    return num / den;
  };
  auto growth = [&](double seq_half) {
    std::vector<double> g;
    for (double xi : x) g.push_back(1 + seq_half * xi);
    return g;
  };
  double a = 0, b = 0;  // y = a + b x
  if (lengths.size() >= 2) {
    std::tie(a, b) = relative_line(x, yf);
    if (a <= 0) {
      // Falls faster with the length than s / (s + seq_half) can: no asymptote to fit.
      f.seq_half = model.attention_seq_half;
      a = scale(growth(f.seq_half), yf);
      notes.push_back(fmt::format(
          "attention: the forward's time per FLOP falls faster with the sequence length than "
          "the model's s / (s + seq_half); kept the built-in attention_seq_half {:.4g}",
          f.seq_half));
    } else if (b < 0) {
      // Shorter sequences no slower: no fill-up term, a flat line.
      notes.push_back(
          fmt::format("attention: the forward's time per FLOP does not fall with the sequence "
                      "length (seq_half {:.4g}); attention_seq_half set to 0",
                      b / a));
      a = scale(growth(0), yf);
      f.seq_half = 0;
      f.seq_half_fitted = true;
    } else {
      f.seq_half = b / a;
      f.seq_half_fitted = true;
    }
  } else {
    f.seq_half = model.attention_seq_half;
    a = scale(growth(f.seq_half), yf);
    notes.push_back(fmt::format(
        "attention: one sequence length ({}) cannot separate the efficiency from "
        "attention_seq_half; kept the built-in {:.4g} and fitted the efficiencies with it",
        series.samples.front().seq, f.seq_half));
  }
  f.fwd_efficiency = 1 / a;
  f.bwd_efficiency = 1 / scale(growth(f.seq_half), yb);
  // A GPU sample that ran faster than the 16-bit peak allows (1/y > 1) means another GPU. The
  // fitted e is an extrapolation to long sequences: above 1 it is capped, with a note.
  if (micro.device != "cpu") {
    for (size_t i = 0; i < x.size(); ++i) {
      for (auto [name, y] : {std::pair{"forward", yf[i]}, std::pair{"backward", yb[i]}}) {
        if (1 / y <= kSlack) continue;
        const AttentionSample& a = series.samples[i];
        return Error(fmt::format(
            "attention {} {}x{}x{}x{} ran at {:.2f} times what {}'s 16-bit peak ({:.4g} FLOP/s) "
            "allows; is the file from another GPU (--gpu)?",
            name, a.batch, a.heads, a.seq, a.head_dim, 1 / y, gpu.name, f.peak));
      }
    }
  }
  for (auto [name, e] :
       {std::pair{"forward", &f.fwd_efficiency}, std::pair{"backward", &f.bwd_efficiency}}) {
    if (*e <= 1) continue;
    notes.push_back(fmt::format(
        "attention {}: the fitted long-sequence efficiency {:.4g} is above 1; capped at 1{}", name,
        *e, micro.device == "cpu" ? " (measured on a CPU)" : ""));
  }
  f.fwd_efficiency = std::min(f.fwd_efficiency, 1.0);
  f.bwd_efficiency = std::min(f.bwd_efficiency, 1.0);
  // Model times against the measured ones, forwards and backwards.
  std::vector<double> model_t, measured;
  for (size_t i = 0; i < x.size(); ++i) {
    const double g = 1 + f.seq_half * x[i];
    const AttentionSample& s = series.samples[i];
    model_t.push_back(s.fwd.seconds / yf[i] * g / f.fwd_efficiency);
    measured.push_back(s.fwd.seconds);
    model_t.push_back(s.bwd.seconds / yb[i] * g / f.bwd_efficiency);
    measured.push_back(s.bwd.seconds);
  }
  std::tie(f.median_error, f.max_error) = error_stats(model_t, measured);
  return std::optional<AttentionFit>{f};
}

// Where a link's collectives come from and what their efficiencies are relative to.
struct LinkSource {
  std::string what;            // "micro.h5", "run files (inside one machine)"
  double bandwidth = 0;        // bytes/s per direction; 0: fit the step latency alone
  double min_curve_bytes = 0;  // smaller messages only set the latency
  size_t min_sizes = 1;        // series with fewer message sizes are not used
};

// Link parameters from collective series of one link class (docs/hwexec.md): all latency at a
// series' smallest size (the step latency is its time over the collective's latency steps), and
// the efficiency curve over the larger sizes, relative to the source's bandwidth. A series whose
// sizes give no curve point still gives the step latency.
// With `routes` (one per series: across machines on a topology), each series' own latency steps
// and bandwidth replace the ring's steps and the source's bandwidth.
std::optional<LinkFit> fit_link_series(const std::vector<CollectiveSeries>& series,
                                       const LinkSource& src, std::vector<std::string>& notes,
                                       const std::vector<CollectiveRoute>* routes = nullptr) {
  LinkFit f;
  f.link_bandwidth = src.bandwidth;
  std::optional<double> all_reduce_cap, ring_cap, step_latency;
  std::vector<EfficiencyPoint> all_reduce_curve, ring_curve;
  for (size_t si = 0; si < series.size(); ++si) {
    const CollectiveSeries& s = series[si];
    const CollectiveRoute* route = routes ? &(*routes)[si] : nullptr;
    const double bandwidth = route ? route->bandwidth : src.bandwidth;
    const std::string name =
        fmt::format("collectives {} over {} ranks ({})", s.kind, s.ranks, src.what);
    if (s.ranks < 2 || s.samples.size() < src.min_sizes) {
      notes.push_back(fmt::format("{}: {} size(s); not fitted", name, s.samples.size()));
      continue;
    }
    if (f.ranks != 0 && f.ranks != s.ranks) {
      notes.push_back(fmt::format("{}: the others have {} ranks; not fitted", name, f.ranks));
      continue;
    }
    std::vector<CollectiveSample> samples = s.samples;
    std::sort(samples.begin(), samples.end(),
              [](const auto& x, const auto& y) { return x.bytes < y.bytes; });
    const bool all_reduce = s.kind == "all_reduce";
    const int steps = route ? route->steps : all_reduce ? 2 * (s.ranks - 1) : s.ranks - 1;
    // All latency at the smallest size (as for the built-in curves, core/comm_model.cc).
    const double alpha = samples.front().t.seconds;
    if (alpha <= 0 || steps <= 0) {
      notes.push_back(fmt::format("{}: no time measured; not fitted", name));
      continue;
    }
    std::vector<EfficiencyPoint> curve;
    for (const CollectiveSample& x : samples) {
      if (bandwidth <= 0 || x.bytes < src.min_curve_bytes || x.t.seconds <= alpha) continue;
      const double volume = bus_factor(s.kind, s.ranks) * x.bytes;
      curve.push_back({x.bytes, volume / (bandwidth * (x.t.seconds - alpha))});
    }
    if (curve.empty()) {
      std::string why;
      if (samples.size() == 1) {
        why = "one message size";
      } else if (bandwidth <= 0) {
        why = "no bandwidth to relate an efficiency to";
      } else if (src.min_curve_bytes > 0) {
        why = fmt::format("no size of {} or more above the smallest size's time",
                          format_bytes(src.min_curve_bytes));
      } else {
        why = "no size above the smallest size's time";
      }
      notes.push_back(fmt::format("{}: {}; the step latency only", name, why));
    }
    f.ranks = s.ranks;
    f.from.push_back(route ? fmt::format("{} ({} over {}/s at efficiency 1)", s.kind,
                                         route->algorithm, format_bytes(route->bandwidth))
                           : s.kind);
    double top = 0;
    for (const auto& p : curve) top = std::max(top, p.efficiency);
    if (all_reduce) {
      step_latency = alpha / steps;
      if (!curve.empty()) {
        all_reduce_curve = curve;
        all_reduce_cap = top;
      }
    } else {
      if (!step_latency) step_latency = alpha / steps;
      if (!curve.empty()) {
        ring_cap = std::max(ring_cap.value_or(0.0), top);
        if (ring_curve.empty()) ring_curve = curve;
      }
    }
  }
  if (f.from.empty()) return std::nullopt;
  // The curve is the all-reduce's (all-gather's or reduce-scatter's without one); the
  // ring-only collectives are capped at their own best, the all-reduce at its own.
  f.link.curve = all_reduce_curve.empty() ? ring_curve : all_reduce_curve;
  f.link.step_latency = step_latency;
  if (all_reduce_cap) f.link.all_reduce_max_efficiency = *all_reduce_cap;
  if (ring_cap || all_reduce_cap) f.link.max_efficiency = ring_cap ? *ring_cap : *all_reduce_cap;
  if (!all_reduce_cap && ring_cap) f.link.all_reduce_max_efficiency = *ring_cap;
  return f;
}

std::optional<LinkFit> fit_link(const MicroResults& micro, const GpuSpec& gpu,
                                std::vector<std::string>& notes) {
  if (micro.collectives.empty()) {
    notes.emplace_back(
        "collectives: none measured (NCCL needs 2 or more GPUs); link parameters "
        "not fitted");
    return std::nullopt;
  }
  if (gpu.nvlink_bandwidth <= 0) {
    notes.push_back(fmt::format(
        "collectives: {} has no NVLink; a PCIe bandwidth depends on the machine and is not in "
        "the catalog, so link parameters are not fitted",
        gpu.name));
    return std::nullopt;
  }
  // The largest group (the whole node, what the simulator's NVLink class stands for) is
  // fitted; every group checks the fitted model.
  int largest = 0;
  for (const CollectiveSeries& s : micro.collectives) largest = std::max(largest, s.ranks);
  std::vector<CollectiveSeries> fitted;
  for (const CollectiveSeries& s : micro.collectives) {
    if (s.ranks == largest) fitted.push_back(s);
  }
  std::optional<LinkFit> f =
      fit_link_series(fitted, {"micro.h5", gpu.nvlink_bandwidth, 1024.0 * 1024, 2}, notes);
  if (!f) return f;
  // The fitted link as the simulator applies it (a calibration holding only that link).
  Calibration as_file;
  as_file.gpus[gpu.name].nvlink = f->link;
  ComputeModel compute = ComputeModel::defaults_for(gpu);
  CommModel comm = CommModel::defaults_for(gpu);
  apply_calibration(as_file, gpu.name, compute, comm);
  const LinkClassModel& model = comm.nvlink;
  for (const CollectiveSeries& s : micro.collectives) {
    if (s.ranks < 2 || s.samples.empty()) continue;
    const bool all_reduce = s.kind == "all_reduce";
    const int steps = all_reduce ? 2 * (s.ranks - 1) : s.ranks - 1;
    std::vector<double> model_t, measured;
    for (const CollectiveSample& x : s.samples) {
      const double volume = bus_factor(s.kind, s.ranks) * x.bytes;
      model_t.push_back(steps * model.step_latency +
                        volume / (gpu.nvlink_bandwidth * model.efficiency(x.bytes, all_reduce)));
      measured.push_back(x.t.seconds);
    }
    LinkFit::GroupCheck c{s.kind, s.ranks, static_cast<int>(s.samples.size()), 0, 0};
    std::tie(c.median_error, c.max_error) = error_stats(model_t, measured);
    f->checks.push_back(c);
  }
  return f;
}

}  // namespace

Expected<std::string> match_catalog_gpu(const std::string& device_name) {
  const std::string d = lower(device_name);
  std::string name;
  if (has(d, "h200")) {
    name = "h200-sxm-141gb";
  } else if (has(d, "h100") && !has(d, "pcie") && !has(d, "nvl")) {
    name = has(d, "96") ? "h100-sxm5-96gb" : "h100-sxm5-80gb";
  } else if (has(d, "a100")) {
    name =
        has(d, "pcie") ? "a100-pcie-80gb" : (has(d, "40gb") ? "a100-sxm4-40gb" : "a100-sxm4-80gb");
  }
  if (!name.empty() && find_gpu(name)) return name;
  std::string known;
  for (const GpuSpec& g : gpu_catalog()) known += (known.empty() ? "" : ", ") + g.name;
  return Error(fmt::format("device '{}' is not a catalog GPU ({}); name one with --gpu",
                           device_name, known));
}

Expected<Fit> fit_micro(const MicroResults& micro, const GpuSpec& gpu, const std::string& source) {
  return fit_all(&micro, "", {}, gpu, source);
}

Expected<Fit> fit_all(const MicroResults* micro, const std::string& micro_path,
                      const std::vector<RunPoints>& runs, const GpuSpec& gpu,
                      const std::string& source) {
  Fit f;
  f.gpu = gpu.name;
  // Memory-bound: the runs' operators when there are any, else the microbenchmark's kernels.
  std::vector<TrafficSeries> memory;
  std::string memory_from;
  for (const RunPoints& r : runs) {
    bool any = false;
    for (const TrafficSeries& s : r.memory) {
      memory.push_back(s);
      any = any || !s.points.empty();
    }
    if (any) memory_from += (memory_from.empty() ? "" : ", ") + r.path;
  }
  if (memory_from.empty()) {
    memory.clear();
    if (micro) {
      for (const MemorySeries& s : micro->memory) {
        TrafficSeries t{s.op, {}};
        for (const MemorySample& x : s.samples) t.points.push_back({x.bytes, x.t.seconds});
        memory.push_back(t);
      }
      memory_from = micro_path;
    }
  }
  f.memory = fit_memory(memory, gpu, physical_bandwidth(micro, micro_path, gpu), f.notes);
  if (f.memory) f.memory->from = memory_from;
  if (f.memory && memory_from != micro_path && micro && !micro->memory.empty()) {
    f.notes.push_back(
        f.memory->fixed_bandwidth
            ? fmt::format("memory-bound operators: the overhead fitted to the run files' "
                          "operators; {}'s kernels set the bandwidth only",
                          micro_path)
            : fmt::format("memory-bound operators: fitted to the run files' operators; {}'s "
                          "kernels are not used",
                          micro_path));
  }
  // GEMMs: every source's points of a precision together.
  std::map<Precision, std::vector<GemmPoint>> gemm;
  if (micro) gemm = micro_gemm_points(*micro, gpu);
  for (const RunPoints& r : runs) {
    for (const GemmPoint& p : r.gemm) gemm[r.precision].push_back(p);
    for (const std::string& n : r.notes) f.notes.push_back(n);
  }
  for (const auto& [precision, points] : gemm) {
    if (points.empty()) continue;
    if (gpu.peak_flops(precision) <= 0) {
      f.notes.push_back(fmt::format("gemm {}: {} has no peak for it; not fitted",
                                    to_string(precision), gpu.name));
      continue;
    }
    Expected<GemmFit> g = fit_gemm(precision, points, gpu, f.notes);
    if (!g) return g.error();
    f.gemm.push_back(*g);
  }
  if (micro) {
    Expected<std::optional<AttentionFit>> attention = fit_attention(*micro, gpu, f.notes);
    if (!attention) return attention.error();
    f.attention = *attention;
    f.nvlink = fit_link(*micro, gpu, f.notes);
  } else {
    f.notes.emplace_back(
        "attention: attention_* come from a microbenchmark file (nnexec bench) only");
  }
  // The runs' collectives: inside one machine for NVLink when micro.h5 gave none; across
  // machines for the network's step latency (its bandwidth is the topology's, not the GPU's).
  std::vector<CollectiveSeries> same_host, cross_host;
  bool hosts_known = false;
  for (const RunPoints& r : runs) {
    hosts_known = hosts_known || r.hosts_known;
    same_host.insert(same_host.end(), r.same_host.begin(), r.same_host.end());
    cross_host.insert(cross_host.end(), r.cross_host.begin(), r.cross_host.end());
  }
  if (!runs.empty() && !hosts_known) {
    f.notes.emplace_back(
        "collectives: the run files do not say which machine each rank ran on (written before "
        "nnexec recorded it); their collectives are not fitted");
  }
  if (!f.nvlink && !same_host.empty()) {
    if (gpu.nvlink_bandwidth > 0) {
      f.nvlink = fit_link_series(
          same_host, {"run files, inside one machine", gpu.nvlink_bandwidth, 0, 1}, f.notes);
    } else {
      f.notes.push_back(fmt::format(
          "collectives inside one machine: {} has no NVLink in the catalog; not fitted", gpu.name));
    }
  }
  // Across machines with a topology: each series relative to its route's bottleneck bandwidth
  // (every run file must then have been priced on one, fit_network.h); without, the latency.
  std::vector<CollectiveRoute> routes;
  std::string topology;
  for (const RunPoints& r : runs) {
    if (r.cross_host_routes.size() == r.cross_host.size() && !r.topology.empty()) {
      routes.insert(routes.end(), r.cross_host_routes.begin(), r.cross_host_routes.end());
      topology = r.topology;
    }
  }
  for (const RunPoints& r : runs) {
    if (cross_host.empty() && !r.topology.empty()) topology = r.topology;
  }
  if (cross_host.empty() && !topology.empty()) {
    f.notes.push_back(fmt::format(
        "network: no collective of the run files spans machines (on {}); not fitted", topology));
  }
  const bool priced = !cross_host.empty() && routes.size() == cross_host.size();
  std::optional<LinkFit> network;
  if (!cross_host.empty()) {
    network = fit_link_series(cross_host,
                              {priced ? fmt::format("run files, across machines on {}", topology)
                                      : std::string("run files, across machines"),
                               0, 0, 1},
                              f.notes, priced ? &routes : nullptr);
    if (!priced) {
      f.notes.emplace_back(
          "network: the step latency only; an efficiency is relative to the route's bandwidth "
          "on a topology, which a run file does not name: give the topology the run's "
          "machines stand for (--topo T.yaml [--nodes N]) to fit it");
    }
  }
  if (f.gemm.empty() && !f.memory && !f.attention && !f.nvlink && !network) {
    return Error("nothing to fit: no GEMM, memory-bound, attention or collective measurements");
  }
  f.calibration.source = source;
  for (const GemmFit& g : f.gemm) f.calibration.gemm_efficiency[g.precision] = g.efficiency;
  // A run's GEMM times are a training run's own, with whatever clock it held: the efficiency
  // fitted to them at sustained 1 is what the run sustained, so the simulator must not apply
  // the built-in clock drop on top (docs/hwexec.md).
  bool run_gemms = false;
  for (const RunPoints& r : runs) {
    for (const GemmFit& g : f.gemm)
      run_gemms = run_gemms || (g.precision == r.precision && !r.gemm.empty());
  }
  if (run_gemms) {
    f.calibration.compute["sustained"] = 1.0;
    f.calibration.compute["sustained_fp8"] = 1.0;
    const ComputeModel builtin = ComputeModel::defaults_for(gpu);
    f.notes.push_back(fmt::format(
        "sustained and sustained_fp8: 1 (built-in {:.3g} and {:.3g}): the GEMM efficiencies are "
        "fitted to the run files' times, which hold the clock the runs ran at",
        builtin.sustained, builtin.sustained_fp8));
  }
  if (f.memory) {
    f.calibration.compute["memory_efficiency"] = f.memory->efficiency;
    f.calibration.compute["kernel_overhead"] = f.memory->overhead;
    // Fitted to nnexec's unfused kernels: the bandwidth holds with their traffic factor, which
    // goes into the file with it (it replaces a fused framework's 1.0).
    if (memory_from != micro_path && !runs.empty()) {
      f.calibration.compute["elementwise_traffic"] = runs.front().elementwise_traffic;
    }
  }
  if (f.attention) {
    f.calibration.compute["attention_fwd_efficiency"] = f.attention->fwd_efficiency;
    f.calibration.compute["attention_bwd_efficiency"] = f.attention->bwd_efficiency;
    if (f.attention->seq_half_fitted) {
      f.calibration.compute["attention_seq_half"] = f.attention->seq_half;
    }
  }
  if (f.nvlink) f.calibration.nvlink = f.nvlink->link;
  if (network) {
    f.network = network;
    f.calibration.network = network->link;
  }
  return f;
}

}  // namespace nnsim::hwexec
