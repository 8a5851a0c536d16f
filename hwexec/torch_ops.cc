// The LibTorch side of the microbenchmarks: the only translation unit that includes LibTorch's
// headers (they cost about 1 GB and several seconds to compile). ATen only, no torch::nn.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "hwexec/backend.h"
#include "hwexec/run_adam.h"

#ifdef NNSIM_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace nnsim::hwexec::detail {

namespace {

at::TensorOptions options(const std::string& device, at::ScalarType type) {
  return at::TensorOptions().dtype(type).device(device == "cuda" ? at::kCUDA : at::kCPU);
}

at::ScalarType scalar_type(Precision p) {
  switch (p) {
    case Precision::kBf16:
      return at::kBFloat16;
    case Precision::kFp16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

void synchronize(const std::string& device) {
#ifdef NNSIM_TORCH_HAS_CUDA
  if (device == "cuda") at::cuda::getCurrentCUDAStream().synchronize();
#endif
}

Timing summarize(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return {n % 2 == 1 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]), s.front()};
}

// Warm-up runs, then `repetitions` runs timed one by one: CUDA events on the current stream on
// a GPU, the steady clock on the CPU. The median and the fastest.
template <class F>
Expected<Timing> measure(const std::string& device, const Repeat& r, F&& f) {
  try {
    for (int i = 0; i < r.warmup; ++i) f();
    synchronize(device);
    std::vector<double> samples;
    if (device == "cuda") {
#ifdef NNSIM_TORCH_HAS_CUDA
      CudaTimer timer(at::cuda::getCurrentCUDAStream().stream());
      for (int i = 0; i < r.repetitions; ++i) {
        timer.start();
        f();
        timer.stop();
        samples.push_back(timer.seconds());
      }
#else
      return Error("LibTorch has no CUDA support in this build");
#endif
    } else {
      for (int i = 0; i < r.repetitions; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        f();
        const auto t1 = std::chrono::steady_clock::now();
        samples.push_back(std::chrono::duration<double>(t1 - t0).count());
      }
    }
    if (samples.empty()) return Error("no repetitions");
    for (double& s : samples) s = std::max(s, 1e-9);  // below the clocks' resolution
    return summarize(std::move(samples));
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Error(std::string("LibTorch: ") + e.what());
  }
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define NNSIM_HAVE_SCALED_MM 1
#endif

#if defined(NNSIM_TORCH_HAS_CUDA) && defined(NNSIM_HAVE_SCALED_MM)
// fp8 (e4m3) GEMM through cuBLASLt: a row-major, b column-major, per-tensor scales, bf16 out.
struct Fp8Gemm {
  at::Tensor a, b, scale_a, scale_b;
  Fp8Gemm(std::int64_t m, std::int64_t n, std::int64_t k) {
    auto f32 = options("cuda", at::kFloat);
    a = at::randn({m, k}, f32).to(at::kFloat8_e4m3fn);
    b = at::randn({n, k}, f32).to(at::kFloat8_e4m3fn).t();
    scale_a = at::ones({}, f32);
    scale_b = at::ones({}, f32);
  }
  at::Tensor run() const {
    return at::_scaled_mm(a, b, scale_a, scale_b, std::nullopt, std::nullopt, at::kBFloat16, false);
  }
};
#endif

}  // namespace

std::string torch_version() {
  return TORCH_VERSION;
}

int torch_threads() {
  return at::get_num_threads();
}

void set_torch_threads(int threads) {
  at::set_num_threads(threads);
}

bool torch_cuda_available() {
#ifdef NNSIM_TORCH_HAS_CUDA
  return at::hasCUDA() && at::cuda::device_count() > 0;
#else
  return false;
#endif
}

bool gemm_supported(const std::string& device, Precision p, std::string* why) {
  if (p == Precision::kFp8) {
#if defined(NNSIM_TORCH_HAS_CUDA) && defined(NNSIM_HAVE_SCALED_MM)
    if (device != "cuda") {
      *why = "fp8 GEMMs run on GPUs only";
      return false;
    }
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    if (prop->major * 10 + prop->minor < 89) {
      *why =
          fmt::format("compute capability {}.{} has no fp8 tensor cores", prop->major, prop->minor);
      return false;
    }
    try {
      Fp8Gemm g(16, 16, 16);
      g.run();
      synchronize(device);
      return true;
    } catch (const c10::Error& e) {
      *why = std::string("at::_scaled_mm failed: ") + e.what_without_backtrace();
      return false;
    }
#else
    *why = fmt::format("needs a CUDA LibTorch 2.4 or newer (this is {}{})", TORCH_VERSION,
#ifdef NNSIM_TORCH_HAS_CUDA
                       ""
#else
                       ", without CUDA"
#endif
    );
    return false;
#endif
  }
  if (p == Precision::kTf32 && device != "cuda") {
    *why = "tf32 is a GPU tensor-core format";
    return false;
  }
  try {
    auto o = options(device, scalar_type(p));
    auto c = at::mm(at::ones({16, 16}, o), at::ones({16, 16}, o));
    synchronize(device);
    if (c.sum().item<double>() != 16.0 * 256) {
      *why = "a 16 x 16 matmul of ones gave a wrong sum";
      return false;
    }
    return true;
  } catch (const c10::Error& e) {
    *why = std::string("LibTorch: ") + e.what_without_backtrace();
    return false;
  }
}

Expected<Timing> time_gemm(const std::string& device, Precision p, std::int64_t m, std::int64_t n,
                           std::int64_t k, const Repeat& r) {
  try {
    at::manual_seed(0);
    if (p == Precision::kFp8) {
#if defined(NNSIM_TORCH_HAS_CUDA) && defined(NNSIM_HAVE_SCALED_MM)
      Fp8Gemm g(m, n, k);
      return measure(device, r, [&] { g.run(); });
#else
      return Error("fp8 GEMMs need a CUDA LibTorch 2.4 or newer");
#endif
    }
    auto o = options(device, scalar_type(p));
    at::Tensor a = at::randn({m, k}, o), b = at::randn({k, n}, o), c = at::empty({m, n}, o);
    // fp32 is the full-precision rate; tf32 the same fp32 tensors on tensor cores.
    const bool tf32 = at::globalContext().allowTF32CuBLAS();
    at::globalContext().setAllowTF32CuBLAS(p == Precision::kTf32);
    Expected<Timing> t = measure(device, r, [&] { at::mm_out(c, a, b); });
    at::globalContext().setAllowTF32CuBLAS(tf32);
    return t;
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  }
}

Expected<Timing> time_memory_op(const std::string& device, const std::string& op, Precision dtype,
                                std::int64_t elements, const Repeat& r, double* traffic_elements) {
  try {
    at::manual_seed(0);
    auto o = options(device, scalar_type(dtype));
    const std::int64_t width = elements % 4096 == 0 ? 4096 : elements;
    at::Tensor a = at::randn({elements / width, width}, o);
    at::Tensor out = at::empty_like(a);
    if (op == "add") {
      at::Tensor b = at::randn({elements / width, width}, o);
      *traffic_elements = 3;
      return measure(device, r, [&] { at::add_out(out, a, b); });
    }
    *traffic_elements = 2;
    if (op == "gelu") return measure(device, r, [&] { at::gelu_out(out, a); });
    if (op == "softmax") return measure(device, r, [&] { at::_softmax_out(out, a, 1, false); });
    if (op == "layernorm") {
      at::Tensor w = at::ones({width}, o), b = at::zeros({width}, o);
      if (device == "cuda") {
        // The CUDA kernel keeps its statistics in fp32; the allocating form lets it choose.
        return measure(device, r, [&] { at::layer_norm(a, {width}, w, b, 1e-5); });
      }
      at::Tensor mean = at::empty({0}, o), rstd = at::empty({0}, o);
      return measure(device, r,
                     [&] { at::native_layer_norm_out(out, mean, rstd, a, {width}, w, b, 1e-5); });
    }
    return Error(fmt::format("unknown memory-bound operator '{}'", op));
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  }
}

Status time_attention(const std::string& device, Precision dtype, std::int64_t b, std::int64_t h,
                      std::int64_t s, std::int64_t d, const Repeat& r, Timing* fwd, Timing* bwd,
                      std::string* kernel) {
  try {
    at::manual_seed(0);
    auto o = options(device, scalar_type(dtype));
    at::Tensor q = at::randn({b, h, s, d}, o).requires_grad_(true);
    at::Tensor k = at::randn({b, h, s, d}, o).requires_grad_(true);
    at::Tensor v = at::randn({b, h, s, d}, o).requires_grad_(true);
#if TORCH_VERSION_MAJOR >= 2
    *kernel = "sdpa";
    // FlashAttention (or memory-efficient attention) on a GPU in 16-bit; math on a CPU.
    auto attend = [&] { return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true); };
#else
    *kernel = "math";
    // What SDPA's math fallback does: scaled scores, causal mask, softmax, weighted values.
    const at::Tensor causal = at::ones({s, s}, o.dtype(at::kBool)).triu(1);
    const double scale = 1 / std::sqrt(static_cast<double>(d));
    auto attend = [&] {
      at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
      scores = scores.masked_fill(causal, -std::numeric_limits<double>::infinity());
      return at::matmul(at::softmax(scores, -1), v);
    };
#endif
    // The training forward: it records the graph and saves what the backward needs.
    Expected<Timing> f = measure(device, r, [&] { attend(); });
    if (!f) return f.error();
    // One graph kept for every backward; the gradients accumulate into q, k and v (3 b h s d
    // additions, small next to the s^2 work).
    at::Tensor out = attend();
    const at::Tensor dout = at::randn_like(out);
    Expected<Timing> g = measure(device, r, [&] { out.backward(dout, /*retain_graph=*/true); });
    if (!g) return g.error();
    *fwd = *f;
    *bwd = *g;
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  }
}

Expected<Timing> time_host_adam(std::int64_t elements, const Repeat& r) {
  try {
    at::manual_seed(0);
    auto o = options("cpu", at::kFloat);
    AdamLists lists;
    lists.add(at::randn({elements}, o), at::randn({elements}, o), at::zeros({elements}, o),
              at::zeros({elements}, o));
    double k = 0;
    return measure("cpu", r, [&] { lists.step(1e-4, 0.9, 0.95, 1e-8, ++k); });
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  }
}

Expected<Timing> time_host_copies(int gpus, std::int64_t bytes, bool to_host, const Repeat& r) {
#ifdef NNSIM_TORCH_HAS_CUDA
  try {
    // Each GPU its pinned host buffer and its device buffer; every copy issued on its GPU's
    // current stream without waiting, then all waited for: the slowest sets the time.
    std::vector<at::Tensor> host, device;
    for (int d = 0; d < gpus; ++d) {
      host.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
      device.push_back(
          at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, d)));
    }
    auto copy_all = [&] {
      for (int d = 0; d < gpus; ++d) {
        if (to_host) {
          host[d].copy_(device[d], /*non_blocking=*/true);
        } else {
          device[d].copy_(host[d], /*non_blocking=*/true);
        }
      }
      for (int d = 0; d < gpus; ++d) at::cuda::getCurrentCUDAStream(d).synchronize();
    };
    for (int i = 0; i < r.warmup; ++i) copy_all();
    std::vector<double> samples;
    for (int i = 0; i < r.repetitions; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      copy_all();
      const auto t1 = std::chrono::steady_clock::now();
      samples.push_back(std::max(std::chrono::duration<double>(t1 - t0).count(), 1e-9));
    }
    return summarize(std::move(samples));
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  }
#else
  (void)gpus, (void)bytes, (void)to_host, (void)r;
  return Error("LibTorch has no CUDA support in this build");
#endif
}

}  // namespace nnsim::hwexec::detail
