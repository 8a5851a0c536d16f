// NCCL communicators and CUDA event timing for `nnexec run --device cuda` (hwexec/nccl_comm.h).
// CUDA runtime API and NCCL only: compiled wherever hwexec's CUDA part is (NNSIM_WITH_CUDA),
// also without a CUDA LibTorch.
#include "hwexec/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace nnsim::hwexec {

namespace {

Error cuda_error(const char* what, cudaError_t e) {
  (void)cudaGetLastError();
  return Error(fmt::format("{}: {}: {}", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

Error nccl_error(const std::string& what, ncclResult_t e) {
  return Error(fmt::format("{}: {} (ncclResult {}){}", what, ncclGetErrorString(e),
                           static_cast<int>(e),
                           e == ncclSystemError || e == ncclRemoteError
                               ? "; NCCL_DEBUG=INFO shows the cause (NCCL_SOCKET_IFNAME=lo "
                                 "helps on machines without a usable network interface)"
                               : ""));
}

std::string members(const std::vector<int>& g) {
  std::string s;
  for (std::size_t i = 0; i < g.size(); ++i) s += (i ? "," : "") + std::to_string(g[i]);
  return s;
}

// Every member calls this for the same group at about the same time: the first member makes
// the unique id and sends it to the others through `boot`.
Expected<ncclComm_t> init_comm(Comm& boot, const std::vector<int>& group, int rank) {
  const auto it = std::find(group.begin(), group.end(), rank);
  if (it == group.end()) {
    return Error(fmt::format("rank {} is not in the NCCL group [{}]", rank, members(group)));
  }
  const int position = static_cast<int>(it - group.begin());
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (position == 0) {
    if (ncclResult_t e = ncclGetUniqueId(&id); e != ncclSuccess) {
      return nccl_error("ncclGetUniqueId", e);
    }
    for (std::size_t i = 1; i < group.size(); ++i) {
      if (Status s = boot.send(group[i], &id, sizeof(id)); !s) return s.error();
    }
    // The socket backend writes queued sends only inside its own calls; NCCL's init blocks.
    if (Status s = boot.flush(); !s) return s.error();
  } else {
    if (Status s = boot.recv(group[0], &id, sizeof(id)); !s) return s.error();
  }
  ncclComm_t c = nullptr;
  if (ncclResult_t e = ncclCommInitRank(&c, static_cast<int>(group.size()), id, position);
      e != ncclSuccess) {
    return nccl_error(fmt::format("ncclCommInitRank (group [{}], rank {})", members(group), rank),
                      e);
  }
  return c;
}

}  // namespace

Status cuda_set_device(int device) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return cuda_error(fmt::format("cudaSetDevice({})", device).c_str(), e);
  }
  return {};
}

Status cuda_synchronize() {
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return cuda_error("cudaDeviceSynchronize", e);
  }
  return {};
}

Expected<std::string> cuda_device_name(int device) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    return cuda_error("cudaGetDeviceProperties", e);
  }
  return std::string(prop.name);
}

Expected<double> cuda_used_bytes() {
  size_t free = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free, &total); e != cudaSuccess) {
    return cuda_error("cudaMemGetInfo", e);
  }
  return static_cast<double>(total - free);
}

// ---------------------------------------------------------------- events

CudaEvents::~CudaEvents() {
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

Expected<int> CudaEvents::record(void* stream) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    if (cudaError_t r = cudaEventCreate(&e); r != cudaSuccess) {
      return cuda_error("cudaEventCreate", r);
    }
    events_.push_back(e);
  }
  auto* e = static_cast<cudaEvent_t>(events_[used_]);
  if (cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(stream)); r != cudaSuccess) {
    return cuda_error("cudaEventRecord", r);
  }
  return static_cast<int>(used_++);
}

Expected<double> CudaEvents::elapsed(int start, int stop) const {
  if (start < 0 || stop < 0 || static_cast<std::size_t>(std::max(start, stop)) >= used_) {
    return Error(fmt::format("CUDA events {} and {}: not recorded", start, stop));
  }
  float ms = 0;
  if (cudaError_t e = cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[start]),
                                           static_cast<cudaEvent_t>(events_[stop]));
      e != cudaSuccess) {
    return cuda_error("cudaEventElapsedTime", e);
  }
  return ms * 1e-3;
}

Status CudaEvents::order(void* waiter, void* signaler) {
  Expected<int> i = record(signaler);
  if (!i) return i.error();
  if (cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter),
                                          static_cast<cudaEvent_t>(events_[*i]), 0);
      e != cudaSuccess) {
    return cuda_error("cudaStreamWaitEvent", e);
  }
  return {};
}

// ---------------------------------------------------------------- communicators

Expected<std::unique_ptr<NcclComms>> NcclComms::create(Comm& boot, int device,
                                                       std::vector<std::vector<int>> groups,
                                                       std::vector<std::pair<int, int>> edges) {
  std::unique_ptr<NcclComms> c(new NcclComms());
  c->rank_ = boot.rank();
  if (Status s = cuda_set_device(device); !s) return s.error();
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  std::sort(edges.begin(), edges.end());
  edges.erase(std::unique(edges.begin(), edges.end()), edges.end());
  for (const std::vector<int>& g : groups) {
    if (g.size() <= 1) continue;
    Expected<ncclComm_t> comm = init_comm(boot, g, c->rank_);
    if (!comm) return comm.error();
    c->groups_[g] = *comm;
  }
  for (const auto& [src, dst] : edges) {
    if (src == dst || (src != c->rank_ && dst != c->rank_)) {
      return Error(fmt::format("pipeline edge {} -> {} does not connect rank {} to another rank",
                               src, dst, c->rank_));
    }
    Expected<ncclComm_t> comm = init_comm(boot, {src, dst}, c->rank_);
    if (!comm) return comm.error();
    Edge& e = c->edges_[{src, dst}];
    e.comm = *comm;
    if (src == c->rank_) {
      cudaStream_t s = nullptr;
      if (cudaError_t r = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); r != cudaSuccess) {
        return cuda_error("cudaStreamCreateWithFlags", r);
      }
      e.stream = s;
    }
  }
  return c;
}

NcclComms::~NcclComms() {
  for (auto& [g, comm] : groups_) ncclCommDestroy(static_cast<ncclComm_t>(comm));
  for (auto& [k, e] : edges_) {
    if (e.stream) cudaStreamSynchronize(static_cast<cudaStream_t>(e.stream));
    ncclCommDestroy(static_cast<ncclComm_t>(e.comm));
    if (e.stream) cudaStreamDestroy(static_cast<cudaStream_t>(e.stream));
  }
}

Status NcclComms::all_reduce_as(const std::vector<int>& group, void* data, std::size_t n,
                                Comm::Op op, void* stream, int dtype, const char* what) {
  if (group.size() <= 1) return {};
  const auto it = groups_.find(group);
  if (it == groups_.end()) {
    return Error(
        fmt::format("rank {}: no NCCL communicator for group [{}]", rank_, members(group)));
  }
  if (ncclResult_t e =
          ncclAllReduce(data, data, n, static_cast<ncclDataType_t>(dtype),
                        op == Comm::Op::kMax ? ncclMax : ncclSum,
                        static_cast<ncclComm_t>(it->second), static_cast<cudaStream_t>(stream));
      e != ncclSuccess) {
    return nccl_error(fmt::format("{} (group [{}])", what, members(group)), e);
  }
  return {};
}

Status NcclComms::all_reduce(const std::vector<int>& group, float* data, std::size_t n, Comm::Op op,
                             void* stream) {
  return all_reduce_as(group, data, n, op, stream, ncclFloat, "ncclAllReduce");
}

Status NcclComms::all_reduce_bf16(const std::vector<int>& group, void* data, std::size_t n,
                                  Comm::Op op, void* stream, Comm::Float16 format) {
  return format == Comm::Float16::kFp16
             ? all_reduce_as(group, data, n, op, stream, ncclHalf, "ncclAllReduce fp16")
             : all_reduce_as(group, data, n, op, stream, ncclBfloat16, "ncclAllReduce bf16");
}

Expected<void*> NcclComms::group_comm(const std::vector<int>& group) const {
  const auto it = groups_.find(group);
  if (it == groups_.end()) {
    return Error(
        fmt::format("rank {}: no NCCL communicator for group [{}]", rank_, members(group)));
  }
  return it->second;
}

Status NcclComms::all_gather_as(const std::vector<int>& group, const void* in, std::size_t n,
                                void* out, void* stream, int dtype) {
  if (group.size() <= 1) return {};
  Expected<void*> c = group_comm(group);
  if (!c) return c.error();
  if (ncclResult_t e =
          ncclAllGather(in, out, n, static_cast<ncclDataType_t>(dtype), static_cast<ncclComm_t>(*c),
                        static_cast<cudaStream_t>(stream));
      e != ncclSuccess) {
    return nccl_error(fmt::format("ncclAllGather (group [{}])", members(group)), e);
  }
  return {};
}

Status NcclComms::reduce_scatter_as(const std::vector<int>& group, const void* in, std::size_t n,
                                    void* out, void* stream, int dtype) {
  if (group.size() <= 1) return {};
  Expected<void*> c = group_comm(group);
  if (!c) return c.error();
  if (ncclResult_t e =
          ncclReduceScatter(in, out, n, static_cast<ncclDataType_t>(dtype), ncclSum,
                            static_cast<ncclComm_t>(*c), static_cast<cudaStream_t>(stream));
      e != ncclSuccess) {
    return nccl_error(fmt::format("ncclReduceScatter (group [{}])", members(group)), e);
  }
  return {};
}

Status NcclComms::all_gather(const std::vector<int>& group, const float* in, std::size_t n,
                             float* out, void* stream) {
  return all_gather_as(group, in, n, out, stream, ncclFloat);
}

Status NcclComms::reduce_scatter(const std::vector<int>& group, const float* in, std::size_t n,
                                 float* out, void* stream) {
  return reduce_scatter_as(group, in, n, out, stream, ncclFloat);
}

Status NcclComms::all_gather_bf16(const std::vector<int>& group, const void* in, std::size_t n,
                                  void* out, void* stream) {
  return all_gather_as(group, in, n, out, stream, ncclBfloat16);
}

Status NcclComms::reduce_scatter_bf16(const std::vector<int>& group, const void* in, std::size_t n,
                                      void* out, void* stream, Comm::Float16 format) {
  return reduce_scatter_as(group, in, n, out, stream,
                           format == Comm::Float16::kFp16 ? ncclHalf : ncclBfloat16);
}

Expected<void*> NcclComms::send_stream(int peer) const {
  const auto it = edges_.find({rank_, peer});
  if (it == edges_.end()) {
    return Error(fmt::format("rank {}: no NCCL pipeline edge to rank {}", rank_, peer));
  }
  return it->second.stream;
}

Status NcclComms::all_to_all(const std::vector<int>& group, const void* in,
                             const std::vector<std::size_t>& send_bytes, void* out,
                             const std::vector<std::size_t>& recv_bytes, void* stream) {
  if (send_bytes.size() != group.size() || recv_bytes.size() != group.size()) {
    return Error(fmt::format("all-to-all over {} ranks with {} send and {} receive sizes",
                             group.size(), send_bytes.size(), recv_bytes.size()));
  }
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  if (group.size() <= 1) {
    if (cudaError_t e =
            cudaMemcpyAsync(dst, src, send_bytes.empty() ? 0 : send_bytes[0],
                            cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
        e != cudaSuccess) {
      return Error(fmt::format("cudaMemcpyAsync: {}", cudaGetErrorString(e)));
    }
    return {};
  }
  Expected<void*> c = group_comm(group);
  if (!c) return c.error();
  const auto comm = static_cast<ncclComm_t>(*c);
  const auto s = static_cast<cudaStream_t>(stream);
  if (ncclResult_t e = ncclGroupStart(); e != ncclSuccess) return nccl_error("ncclGroupStart", e);
  ncclResult_t first = ncclSuccess;
  std::size_t sent = 0, received = 0;
  for (std::size_t i = 0; i < group.size(); ++i) {
    const int peer = static_cast<int>(i);  // the member's rank in the group's communicator
    const ncclResult_t a = ncclSend(src + sent, send_bytes[i], ncclUint8, peer, comm, s);
    const ncclResult_t b = ncclRecv(dst + received, recv_bytes[i], ncclUint8, peer, comm, s);
    if (first == ncclSuccess) first = a != ncclSuccess ? a : b;
    sent += send_bytes[i];
    received += recv_bytes[i];
  }
  const ncclResult_t end = ncclGroupEnd();
  if (first != ncclSuccess || end != ncclSuccess) {
    return nccl_error(fmt::format("ncclSend/ncclRecv all-to-all (group [{}])", members(group)),
                      first != ncclSuccess ? first : end);
  }
  return {};
}

Status NcclComms::send(int peer, const void* data, std::size_t bytes) {
  const auto it = edges_.find({rank_, peer});
  if (it == edges_.end()) {
    return Error(fmt::format("rank {}: no NCCL pipeline edge to rank {}", rank_, peer));
  }
  // In the edge's communicator the sender is rank 0 and the receiver rank 1.
  if (ncclResult_t e = ncclSend(data, bytes, ncclUint8, 1, static_cast<ncclComm_t>(it->second.comm),
                                static_cast<cudaStream_t>(it->second.stream));
      e != ncclSuccess) {
    return nccl_error(fmt::format("ncclSend {} -> {}", rank_, peer), e);
  }
  return {};
}

Status NcclComms::recv(int peer, void* data, std::size_t bytes, void* stream) {
  const auto it = edges_.find({peer, rank_});
  if (it == edges_.end()) {
    return Error(fmt::format("rank {}: no NCCL pipeline edge from rank {}", rank_, peer));
  }
  if (ncclResult_t e = ncclRecv(data, bytes, ncclUint8, 0, static_cast<ncclComm_t>(it->second.comm),
                                static_cast<cudaStream_t>(stream));
      e != ncclSuccess) {
    return nccl_error(fmt::format("ncclRecv {} <- {}", rank_, peer), e);
  }
  return {};
}

}  // namespace nnsim::hwexec
