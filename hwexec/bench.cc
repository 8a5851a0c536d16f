#include "hwexec/bench.h"

#include <fstream>

#include <fmt/format.h>

#include "hwexec/backend.h"

namespace nnsim::hwexec {

namespace {

struct Shape {
  std::int64_t m, n, k;
};

[[maybe_unused]] std::vector<Shape> squares(std::initializer_list<std::int64_t> sizes) {
  std::vector<Shape> v;
  for (auto s : sizes) v.push_back({s, s, s});
  return v;
}

// The GEMM sweep: squares, then the shapes of transformer layers (tokens x out x in).
[[maybe_unused]] std::vector<Shape> gemm_shapes(const BenchOptions& o, Precision p) {
  if (o.device == "cpu") {
    const bool slow = p != Precision::kFp32;  // 16-bit matmuls run without BLAS on most CPUs
    if (o.quick) return slow ? squares({64, 128, 256}) : squares({128, 256, 512});
    std::vector<Shape> v = slow ? squares({128, 256, 512, 1024}) : squares({256, 512, 1024, 2048});
    if (!slow) v.insert(v.end(), {{2048, 1024, 4096}, {2048, 4096, 1024}, {4096, 512, 512}});
    return v;
  }
  if (o.quick) return squares({1024, 4096});
  std::vector<Shape> v = squares({512, 1024, 2048, 4096, 8192, 16384});
  // GPT-3 13B-like layer (hidden 5120, tokens 8192): QKV, projection, MLP up and down.
  v.insert(v.end(),
           {{8192, 15360, 5120}, {8192, 5120, 5120}, {8192, 20480, 5120}, {8192, 5120, 20480}});
  return v;
}

[[maybe_unused]] std::vector<std::int64_t> memory_sizes(const BenchOptions& o) {
  if (o.device == "cpu") {
    if (o.quick) return {1 << 14, 1 << 17, 1 << 20};
    return {1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  }
  if (o.quick) return {1 << 20, 1 << 24, 1 << 26};
  return {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28};
}

// Weights of the host's Adam: its traffic leaves the CPU's caches from the second size on.
[[maybe_unused]] std::vector<std::int64_t> host_adam_sizes(const BenchOptions& o) {
  if (o.quick) return {1 << 16, 1 << 18};
  if (o.device == "cpu") return {1 << 20, 1 << 22, 1 << 24};
  return {1 << 22, 1 << 24, 1 << 26};
}

// Bytes a GPU copies to or from the host: a layer's activations are tens to hundreds of MiB.
[[maybe_unused]] std::vector<std::int64_t> host_copy_sizes(const BenchOptions& o) {
  if (o.quick) return {1 << 20, 1 << 24};
  return {1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28};
}

struct AttentionShape {
  std::int64_t b, h, s, d;
};

// Causal attention: sequence lengths at one head width, plus the narrower head at one length
// (the head-width factor). On a GPU the tokens per call stay at 16384, a training micro-batch.
[[maybe_unused]] std::vector<AttentionShape> attention_shapes(const BenchOptions& o) {
  std::vector<AttentionShape> v;
  if (o.device == "cpu") {
    if (o.quick) return {{1, 4, 128, 64}, {1, 4, 256, 64}, {1, 4, 512, 64}};
    for (std::int64_t d : {64, 128}) {
      for (std::int64_t s = 256; s <= 2048; s *= 2) v.push_back({1, 8, s, d});
    }
    return v;
  }
  const std::int64_t tokens = 16384;
  if (o.quick) return {{tokens / 1024, 16, 1024, 128}, {tokens / 4096, 16, 4096, 128}};
  for (std::int64_t s = 512; s <= 16384; s *= 2) v.push_back({tokens / s, 16, s, 128});
  v.push_back({tokens / 4096, 16, 4096, 64});
  return v;
}

// Group sizes the collectives are timed over (the first n GPUs): 2, 4, 8, ... and all of them.
[[maybe_unused]] std::vector<int> group_sizes(int devices) {
  std::vector<int> v;
  for (int n = 2; n < devices; n *= 2) v.push_back(n);
  if (devices >= 2) v.push_back(devices);
  return v;
}

[[maybe_unused]] std::vector<double> collective_sizes(const BenchOptions& o) {
  std::vector<double> v;
  const double top = o.quick ? 64.0 * (1 << 20) : 1024.0 * (1 << 20);
  for (double s = 1024; s <= top; s *= 4) v.push_back(s);
  return v;
}

// The CPU's model name (/proc/cpuinfo), or "cpu".
[[maybe_unused]] std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "cpu";
}

}  // namespace

BuildInfo build_info() {
  BuildInfo b;
#ifdef NNSIM_HAVE_TORCH
  b.torch = true;
  b.torch_version = detail::torch_version();
#endif
#ifdef NNSIM_TORCH_HAS_CUDA
  b.torch_cuda = true;
#endif
#ifdef NNSIM_HAVE_CUDA
  b.cuda = true;
  b.nccl_version = detail::nccl_version();
#endif
  return b;
}

CudaProbe probe_cuda() {
#ifdef NNSIM_HAVE_CUDA
  return detail::cuda_probe();
#else
  CudaProbe p;
  p.reason =
      "this build has no CUDA support (configure with -DNNSIM_WITH_CUDA=ON on a machine "
      "with the CUDA toolkit and NCCL)";
  return p;
#endif
}

Expected<MicroResults> run_bench(const BenchOptions& o,
                                 const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  if (o.device != "cpu" && o.device != "cuda") {
    return Error(fmt::format("--device: '{}' is neither cpu nor cuda", o.device));
  }
  MicroResults r;
  r.device = o.device;
  r.quick = o.quick;
  if (o.device == "cuda") {
    CudaProbe probe = probe_cuda();
    if (!probe.usable) return Error("--device cuda: no usable GPU: " + probe.reason);
    r.device_name = probe.name;
    r.device_count = probe.devices;
  }
#ifndef NNSIM_HAVE_TORCH
  return Error(
      "this nnexec was built without LibTorch, which the microbenchmarks use (install "
      "libtorch-dev, or configure with -DNNSIM_TORCH_PYTHON=python3 for a pip torch, and "
      "-DNNSIM_WITH_TORCH=ON)");
#else
  if (o.device == "cuda" && !detail::torch_cuda_available()) {
    return Error(fmt::format(
        "--device cuda: LibTorch {} here has no CUDA support (Debian's libtorch is CPU-only); "
        "configure with -DNNSIM_TORCH_PYTHON=<python with a CUDA torch>",
        detail::torch_version()));
  }
  if (o.device == "cpu") {
    if (o.threads > 0) detail::set_torch_threads(o.threads);
    r.device_name = cpu_name();
    r.threads = detail::torch_threads();
  }
  r.torch_version = detail::torch_version();
#ifdef NNSIM_HAVE_CUDA
  r.nccl_version = detail::nccl_version();
#endif
  const detail::Repeat rep = o.device == "cpu"
                                 ? (o.quick ? detail::Repeat{1, 3} : detail::Repeat{3, 10})
                                 : (o.quick ? detail::Repeat{3, 10} : detail::Repeat{10, 30});
  r.warmup = rep.warmup;
  r.repetitions = rep.repetitions;

  std::vector<Precision> precisions = {Precision::kFp32, Precision::kBf16};
  if (o.device == "cuda") {
    precisions = {Precision::kFp32, Precision::kTf32, Precision::kBf16, Precision::kFp16,
                  Precision::kFp8};
  }
  for (Precision p : precisions) {
    std::string why;
    if (!detail::gemm_supported(o.device, p, &why)) {
      r.notes.push_back(fmt::format("gemm {}: skipped: {}", to_string(p), why));
      continue;
    }
    GemmSeries s;
    s.precision = p;
    for (const Shape& x : gemm_shapes(o, p)) {
      Expected<Timing> t = detail::time_gemm(o.device, p, x.m, x.n, x.k, rep);
      if (!t) {
        return t.error().with_context(fmt::format("gemm {} {}x{}x{}", to_string(p), x.m, x.n, x.k));
      }
      GemmSample sample{static_cast<double>(x.m), static_cast<double>(x.n),
                        static_cast<double>(x.k), *t};
      s.samples.push_back(sample);
      say(fmt::format("gemm {:>4} {:>6} x {:>6} x {:>6}  {:>10.3f} ms  {:>9.2f} GFLOP/s",
                      to_string(p), x.m, x.n, x.k, t->seconds * 1e3,
                      sample.flops() / t->seconds / 1e9));
    }
    r.gemm.push_back(std::move(s));
  }

  const Precision dtype = o.device == "cpu" ? Precision::kFp32 : Precision::kBf16;
  for (const char* op : {"add", "gelu", "layernorm", "softmax"}) {
    MemorySeries s;
    s.op = op;
    s.dtype = std::string(to_string(dtype));
    for (std::int64_t n : memory_sizes(o)) {
      double traffic = 0;
      Expected<Timing> t = detail::time_memory_op(o.device, op, dtype, n, rep, &traffic);
      if (!t) return t.error().with_context(fmt::format("{} of {} elements", op, n));
      s.bytes_per_element = traffic * bytes_per_element(dtype);
      MemorySample sample{static_cast<double>(n), n * s.bytes_per_element, *t};
      s.samples.push_back(sample);
      say(fmt::format("{:>9} {:>4} {:>10} elements  {:>10.3f} ms  {:>8.2f} GB/s", op, s.dtype, n,
                      t->seconds * 1e3, sample.bytes / t->seconds / 1e9));
    }
    r.memory.push_back(std::move(s));
  }

  {
    AttentionSeries s;
    s.dtype = std::string(to_string(dtype));
    for (const AttentionShape& x : attention_shapes(o)) {
      AttentionSample sample{static_cast<double>(x.b),
                             static_cast<double>(x.h),
                             static_cast<double>(x.s),
                             static_cast<double>(x.d),
                             {},
                             {}};
      Status st = detail::time_attention(o.device, dtype, x.b, x.h, x.s, x.d, rep, &sample.fwd,
                                         &sample.bwd, &s.kernel);
      if (!st) {
        return st.error().with_context(
            fmt::format("attention {} {}x{}x{}x{}", s.dtype, x.b, x.h, x.s, x.d));
      }
      s.samples.push_back(sample);
      // Executed FLOPs: a causal kernel does about half the counted square.
      const double executed = 0.5 * sample.flops();
      say(fmt::format(
          "attention {:>4} {} {}x{}x{:>5}x{:>3}  fwd {:>9.3f} ms {:>8.4g} TFLOP/s  bwd {:>9.3f} ms "
          "{:>8.4g} TFLOP/s (executed)",
          s.dtype, s.kernel, x.b, x.h, x.s, x.d, sample.fwd.seconds * 1e3,
          executed / sample.fwd.seconds / 1e12, sample.bwd.seconds * 1e3,
          2 * executed / sample.bwd.seconds / 1e12));
    }
    r.attention.push_back(std::move(s));
  }

  // The host's side of offloading: its Adam step, and every GPU's copies to and from it.
  for (std::int64_t n : host_adam_sizes(o)) {
    Expected<Timing> t = detail::time_host_adam(n, rep);
    if (!t) return t.error().with_context(fmt::format("host Adam over {} weights", n));
    r.host_adam.push_back({static_cast<double>(n), *t});
    say(fmt::format("host adam {:>10} weights  {:>10.3f} ms  {:>8.2f} GB/s", n, t->seconds * 1e3,
                    n * kHostAdamBytesPerElement / t->seconds / 1e9));
  }
  if (o.device == "cuda") {
    for (bool to_host : {true, false}) {
      HostCopySeries s{to_host ? "to_host" : "to_device", r.device_count, {}};
      for (std::int64_t bytes : host_copy_sizes(o)) {
        Expected<Timing> t = detail::time_host_copies(s.gpus, bytes, to_host, rep);
        if (!t) return t.error().with_context(fmt::format("{} copies of {} B", s.direction, bytes));
        s.samples.push_back({static_cast<double>(bytes), *t});
        say(fmt::format("{:>9} {} GPUs {:>12} B  {:>10.3f} ms  {:>7.2f} GB/s a GPU", s.direction,
                        s.gpus, bytes, t->seconds * 1e3, bytes / t->seconds / 1e9));
      }
      r.host_copies.push_back(std::move(s));
    }
  } else {
    r.notes.emplace_back("host copies: skipped: they need GPUs");
  }

  if (o.device == "cuda") {
#ifdef NNSIM_HAVE_CUDA
    if (r.device_count >= 2) {
      for (int n : group_sizes(r.device_count)) {
        auto series = detail::bench_nccl(n, collective_sizes(o), rep);
        if (!series) {
          return series.error().with_context(fmt::format("NCCL collectives over {} GPUs", n));
        }
        for (const CollectiveSeries& s : *series) {
          for (const CollectiveSample& x : s.samples) {
            say(fmt::format("{:>14} {} GPUs {:>12.0f} B  {:>10.3f} us  busbw {:>7.2f} GB/s", s.kind,
                            s.ranks, x.bytes, x.t.seconds * 1e6,
                            x.bytes / x.t.seconds * bus_factor(s.kind, s.ranks) / 1e9));
          }
          r.collectives.push_back(s);
        }
      }
    } else {
      r.notes.emplace_back("collectives: skipped: one GPU visible (NCCL collectives need two)");
    }
#endif
  } else {
    r.notes.emplace_back("collectives: skipped: NCCL runs on GPUs only");
  }
  return r;
#endif
}

}  // namespace nnsim::hwexec
