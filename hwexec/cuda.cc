// The CUDA runtime and NCCL side of hwexec: device probe, event timing and nccl-tests style
// collectives. Runtime API only (libcudart): never the driver library, so binaries start on
// machines without a GPU driver, where every call returns cudaErrorInsufficientDriver.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>

#include <fmt/format.h>

#include "hwexec/backend.h"

namespace nnsim::hwexec::detail {

namespace {

std::string cuda_error(cudaError_t e) {
  return fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
}

Error cuda_failure(const char* what, cudaError_t e) {
  (void)cudaGetLastError();
  return Error(fmt::format("{}: {}", what, cuda_error(e)));
}

Error nccl_failure(const char* what, ncclResult_t e) {
  return Error(fmt::format("{}: {} ({})", what, ncclGetErrorString(e), static_cast<int>(e)));
}

// One communicator, stream and pair of buffers per GPU, released in the destructor.
struct NcclGroup {
  int n = 0;
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
  std::vector<void*> send, recv;
  std::vector<cudaEvent_t> start, stop;
  ~NcclGroup() {
    for (int i = 0; i < n; ++i) {
      cudaSetDevice(i);
      if (i < static_cast<int>(start.size()) && start[i]) cudaEventDestroy(start[i]);
      if (i < static_cast<int>(stop.size()) && stop[i]) cudaEventDestroy(stop[i]);
      if (i < static_cast<int>(send.size()) && send[i]) cudaFree(send[i]);
      if (i < static_cast<int>(recv.size()) && recv[i]) cudaFree(recv[i]);
      if (i < static_cast<int>(streams.size()) && streams[i]) cudaStreamDestroy(streams[i]);
    }
    for (ncclComm_t c : comms) {
      if (c) ncclCommDestroy(c);
    }
  }
};

}  // namespace

CudaProbe cuda_probe() {
  CudaProbe p;
  int n = 0;  // cudaGetDeviceCount leaves it untouched on error
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    p.reason = cuda_error(e);
    return p;
  }
  if (n == 0) {
    p.reason = "no CUDA device visible (CUDA_VISIBLE_DEVICES?)";
    return p;
  }
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, 0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    p.reason = cuda_error(e);
    return p;
  }
  p.usable = true;
  p.devices = n;
  p.name = prop.name;
  return p;
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

CudaTimer::CudaTimer(void* stream) : stream_(stream) {
  cudaEvent_t a = nullptr, b = nullptr;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  start_ = a;
  stop_ = b;
}

CudaTimer::~CudaTimer() {
  if (start_) cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  if (stop_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}

void CudaTimer::start() {
  cudaEventRecord(static_cast<cudaEvent_t>(start_), static_cast<cudaStream_t>(stream_));
}

void CudaTimer::stop() {
  cudaEventRecord(static_cast<cudaEvent_t>(stop_), static_cast<cudaStream_t>(stream_));
}

double CudaTimer::seconds() {
  cudaEventSynchronize(static_cast<cudaEvent_t>(stop_));
  float ms = 0;
  if (cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_),
                           static_cast<cudaEvent_t>(stop_)) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return ms * 1e-3;
}

Expected<std::vector<CollectiveSeries>> bench_nccl(int devices, const std::vector<double>& sizes,
                                                   const Repeat& r) {
  NcclGroup g;
  g.n = devices;
  g.comms.assign(devices, nullptr);
  std::vector<int> ids(devices);
  for (int i = 0; i < devices; ++i) ids[i] = i;
  if (ncclResult_t e = ncclCommInitAll(g.comms.data(), devices, ids.data()); e != ncclSuccess) {
    g.comms.clear();
    return nccl_failure("ncclCommInitAll", e);
  }
  const double largest = *std::max_element(sizes.begin(), sizes.end());
  g.streams.assign(devices, nullptr);
  g.send.assign(devices, nullptr);
  g.recv.assign(devices, nullptr);
  g.start.assign(devices, nullptr);
  g.stop.assign(devices, nullptr);
  for (int i = 0; i < devices; ++i) {
    if (auto e = cudaSetDevice(i); e != cudaSuccess) return cuda_failure("cudaSetDevice", e);
    if (auto e = cudaStreamCreateWithFlags(&g.streams[i], cudaStreamNonBlocking);
        e != cudaSuccess) {
      return cuda_failure("cudaStreamCreate", e);
    }
    // The all-gather's output and the reduce-scatter's input are `bytes`; the other side is
    // `bytes` / n; one buffer of the largest size on each side covers every case.
    if (auto e = cudaMalloc(&g.send[i], static_cast<size_t>(largest)); e != cudaSuccess) {
      return cuda_failure("cudaMalloc", e);
    }
    if (auto e = cudaMalloc(&g.recv[i], static_cast<size_t>(largest)); e != cudaSuccess) {
      return cuda_failure("cudaMalloc", e);
    }
    cudaMemset(g.send[i], 0, static_cast<size_t>(largest));
    cudaEventCreate(&g.start[i]);
    cudaEventCreate(&g.stop[i]);
  }

  std::vector<CollectiveSeries> out;
  for (const char* kind : {"all_reduce", "all_gather", "reduce_scatter"}) {
    CollectiveSeries s;
    s.kind = kind;
    s.ranks = devices;
    s.dtype = "fp32";
    for (double bytes : sizes) {
      // Whole float32 elements, divisible by the rank count (nccl-tests does the same).
      const size_t count = static_cast<size_t>(bytes / 4) / devices * devices;
      if (count == 0) continue;
      auto launch = [&]() -> ncclResult_t {
        ncclResult_t e = ncclGroupStart();
        for (int i = 0; i < devices && e == ncclSuccess; ++i) {
          if (s.kind == "all_reduce") {
            e = ncclAllReduce(g.send[i], g.recv[i], count, ncclFloat, ncclSum, g.comms[i],
                              g.streams[i]);
          } else if (s.kind == "all_gather") {
            e = ncclAllGather(g.send[i], g.recv[i], count / devices, ncclFloat, g.comms[i],
                              g.streams[i]);
          } else {
            e = ncclReduceScatter(g.send[i], g.recv[i], count / devices, ncclFloat, ncclSum,
                                  g.comms[i], g.streams[i]);
          }
        }
        ncclResult_t end = ncclGroupEnd();
        return e != ncclSuccess ? e : end;
      };
      for (int w = 0; w < r.warmup; ++w) {
        if (auto e = launch(); e != ncclSuccess) return nccl_failure(kind, e);
      }
      std::vector<double> times;
      for (int rep = 0; rep < r.repetitions; ++rep) {
        for (int i = 0; i < devices; ++i) {
          cudaSetDevice(i);
          cudaEventRecord(g.start[i], g.streams[i]);
        }
        if (auto e = launch(); e != ncclSuccess) return nccl_failure(kind, e);
        double slowest = 0;
        for (int i = 0; i < devices; ++i) {
          cudaSetDevice(i);
          cudaEventRecord(g.stop[i], g.streams[i]);
        }
        for (int i = 0; i < devices; ++i) {
          cudaSetDevice(i);
          if (auto e = cudaEventSynchronize(g.stop[i]); e != cudaSuccess) {
            return cuda_failure("cudaEventSynchronize", e);
          }
          float ms = 0;
          cudaEventElapsedTime(&ms, g.start[i], g.stop[i]);
          slowest = std::max(slowest, ms * 1e-3);
        }
        times.push_back(std::max(slowest, 1e-9));
      }
      std::sort(times.begin(), times.end());
      const size_t n = times.size();
      const double med = n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
      s.samples.push_back({static_cast<double>(count) * 4, {med, times.front()}});
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace nnsim::hwexec::detail
