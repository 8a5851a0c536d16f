// Microbenchmarks on this machine's CPU or GPUs (`nnexec bench`): a GEMM shape sweep per
// precision, memory-bound operators over sizes (LibTorch tensors), the host's Adam step and the
// GPUs' copies to and from the host (offloading), and NCCL collectives over message sizes on
// the visible GPUs. Results go into a MicroResults (hwexec/micro.h).
#pragma once

#include <functional>
#include <string>

#include "core/error.h"
#include "hwexec/micro.h"

namespace nnsim::hwexec {

struct BenchOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  bool quick = false;          // fewer and smaller sizes, fewer repetitions (tests, CI)
  int threads = 0;             // CPU intra-op threads; 0 keeps LibTorch's default
};

// What this build can run.
struct BuildInfo {
  bool torch = false;       // LibTorch microbenchmarks
  bool torch_cuda = false;  // LibTorch with CUDA tensors
  bool cuda = false;        // CUDA runtime + NCCL
  std::string torch_version;
  std::string nccl_version;
};
BuildInfo build_info();

// Whether CUDA devices can be used here: on a machine without a driver, usable is false and
// `reason` names the CUDA error (e.g. "cudaErrorInsufficientDriver: ...").
struct CudaProbe {
  bool usable = false;
  int devices = 0;
  std::string name;  // device 0
  std::string reason;
};
CudaProbe probe_cuda();

// Runs the microbenchmarks. `progress` (may be empty) receives one line per series.
Expected<MicroResults> run_bench(const BenchOptions& options,
                                 const std::function<void(const std::string&)>& progress = {});

}  // namespace nnsim::hwexec
