// hwexec's internal boundary between the benchmark driver (bench.cc) and the parts that need
// LibTorch (torch_ops.cc, the only file that includes its headers) or the CUDA runtime and NCCL
// (cuda.cc). When a part is not built, bench.cc does not call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "hwexec/bench.h"
#include "hwexec/micro.h"

namespace nnsim::hwexec::detail {

struct Repeat {
  int warmup = 2;
  int repetitions = 5;
};

// torch_ops.cc
std::string torch_version();
int torch_threads();
void set_torch_threads(int threads);
bool torch_cuda_available();
// Whether LibTorch can multiply matrices of `p` on `device` here (fp8 needs torch >= 2.4 on a
// GPU with fp8 tensor cores); `why` says why not.
bool gemm_supported(const std::string& device, Precision p, std::string* why);
Expected<Timing> time_gemm(const std::string& device, Precision p, std::int64_t m, std::int64_t n,
                           std::int64_t k, const Repeat& r);
// op: "add" (c = a + b), "layernorm" (rows of 4096), "softmax" (rows of 4096), "gelu".
// Returns the timing; *traffic_elements is how many elements it reads and writes per element.
Expected<Timing> time_memory_op(const std::string& device, const std::string& op, Precision dtype,
                                std::int64_t elements, const Repeat& r, double* traffic_elements);
// Causal attention over q, k, v of [b, h, s, d] in `dtype`: `fwd` is the forward alone, `bwd`
// the backward of its output with a fixed upstream gradient (retained graph, so the forward is
// not in it). *kernel says what ran: "sdpa" (at::scaled_dot_product_attention, LibTorch >= 2)
// or "math" (matmul, causal mask, softmax, matmul).
Status time_attention(const std::string& device, Precision dtype, std::int64_t b, std::int64_t h,
                      std::int64_t s, std::int64_t d, const Repeat& r, Timing* fwd, Timing* bwd,
                      std::string* kernel);

// The host's Adam step (AdamLists, LibTorch's CPU kernels on every thread) over `elements`
// fp32 weights with their gradients and moments.
Expected<Timing> time_host_adam(std::int64_t elements, const Repeat& r);
// Every GPU of 0 to `gpus` - 1 copying `bytes` to pinned host memory (`to_host`) or from it,
// all at once; the time until the last copy ends.
Expected<Timing> time_host_copies(int gpus, std::int64_t bytes, bool to_host, const Repeat& r);

// cuda.cc
CudaProbe cuda_probe();
std::string nccl_version();
// Elapsed time between two CUDA events recorded on `stream` (a cudaStream_t).
class CudaTimer {
 public:
  explicit CudaTimer(void* stream);
  ~CudaTimer();
  CudaTimer(const CudaTimer&) = delete;
  CudaTimer& operator=(const CudaTimer&) = delete;
  void start();
  void stop();
  double seconds();  // waits for the stop event

 private:
  void* stream_;
  void* start_ = nullptr;
  void* stop_ = nullptr;
};
// nccl-tests style: one process drives GPUs 0 to `devices` - 1; float32; sum for reductions.
Expected<std::vector<CollectiveSeries>> bench_nccl(int devices, const std::vector<double>& sizes,
                                                   const Repeat& r);

}  // namespace nnsim::hwexec::detail
