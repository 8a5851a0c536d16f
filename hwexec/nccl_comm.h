// The GPU side of `nnexec run --device cuda` that needs only the CUDA runtime and NCCL (no
// LibTorch; docs/hwexec.md): one rank's NCCL communicators, bootstrapped over the TCP-socket
// Comm (the ncclUniqueId of every communicator travels through it; NCCL then connects its ranks
// over TCP), a send stream per pipeline peer, and a pool of CUDA events for timing spans on
// streams. Streams and device pointers are passed as void* so that callers need no CUDA headers.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "hwexec/comm.h"

namespace nnsim::hwexec {

// Selects `device` for this thread (cudaSetDevice).
Status cuda_set_device(int device);
// Waits for all work on the current device (cudaDeviceSynchronize).
Status cuda_synchronize();
// The current device's name, and its used memory (total - free, cudaMemGetInfo).
Expected<std::string> cuda_device_name(int device);
Expected<double> cuda_used_bytes();

// CUDA events recorded on streams, resolved after the work is done. Events are reused across
// reset()s. Not thread-safe; one per rank.
class CudaEvents {
 public:
  CudaEvents() = default;
  ~CudaEvents();
  CudaEvents(const CudaEvents&) = delete;
  CudaEvents& operator=(const CudaEvents&) = delete;

  // Records a new event on `stream`; returns its index (or the CUDA error).
  Expected<int> record(void* stream);
  // Seconds between two recorded events; both must have completed (after a synchronize).
  Expected<double> elapsed(int start, int stop) const;
  // Makes `waiter` wait for the work queued on `signaler` so far.
  Status order(void* waiter, void* signaler);
  // Forget the recorded events (they are reused by the next record()s).
  void reset() { used_ = 0; }

 private:
  std::vector<void*> events_;
  std::size_t used_ = 0;
};

// The NCCL communicators of one rank. Groups (tensor and data parallel) are lists of global
// ranks, in the same order on every member; a pipeline edge is an ordered pair (src, dst) with
// a communicator of its own and, on the sender, a non-blocking stream of its own, so that a
// send never blocks the sender's compute stream or another peer's traffic (like the socket
// backend's queued sends: two ranks that send to each other before receiving never deadlock).
class NcclComms {
 public:
  // Creates every communicator this rank belongs to, in one global order (groups by member
  // list, then edges by (src, dst)), so that ranks never wait on each other in a cycle. `boot`
  // carries the unique ids from each group's first rank (the edge's sender) to the others.
  static Expected<std::unique_ptr<NcclComms>> create(Comm& boot, int device,
                                                     std::vector<std::vector<int>> groups,
                                                     std::vector<std::pair<int, int>> edges);
  ~NcclComms();
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // In-place float32 all-reduce over `group` (one of the groups given to create) on `stream`.
  Status all_reduce(const std::vector<int>& group, float* data, std::size_t n, Comm::Op op,
                    void* stream);
  // The same of n bf16 values (ncclBfloat16; ncclHalf with `format` kFp16).
  Status all_reduce_bf16(const std::vector<int>& group, void* data, std::size_t n, Comm::Op op,
                         void* stream, Comm::Float16 format = Comm::Float16::kBf16);
  // float32 all-gather (n from each member into out, member i's at out + i n) and
  // reduce-scatter (in holds n per member; out gets the sum of everyone's chunk of this rank).
  Status all_gather(const std::vector<int>& group, const float* in, std::size_t n, float* out,
                    void* stream);
  Status reduce_scatter(const std::vector<int>& group, const float* in, std::size_t n, float* out,
                        void* stream);
  // The same of bf16 values (ncclBfloat16).
  Status all_gather_bf16(const std::vector<int>& group, const void* in, std::size_t n, void* out,
                         void* stream);
  Status reduce_scatter_bf16(const std::vector<int>& group, const void* in, std::size_t n,
                             void* out, void* stream, Comm::Float16 format = Comm::Float16::kBf16);
  // The stream that sends to `peer` run on (an edge given to create).
  Expected<void*> send_stream(int peer) const;
  // ncclSend of `bytes` to `peer` on its send stream (the caller orders it after the data's
  // producer with CudaEvents::order); ncclRecv from `peer` on `stream`.
  Status send(int peer, const void* data, std::size_t bytes);
  Status recv(int peer, void* data, std::size_t bytes, void* stream);
  // All-to-all over `group` on `stream` (Comm::all_to_all's layout: member i's piece of `in`,
  // send_bytes[i], and its piece of `out`, recv_bytes[i], one after another in group order):
  // an ncclSend and an ncclRecv per member in one NCCL group.
  Status all_to_all(const std::vector<int>& group, const void* in,
                    const std::vector<std::size_t>& send_bytes, void* out,
                    const std::vector<std::size_t>& recv_bytes, void* stream);

  int rank() const { return rank_; }

 private:
  NcclComms() = default;
  Expected<void*> group_comm(const std::vector<int>& group) const;
  Status all_gather_as(const std::vector<int>& group, const void* in, std::size_t n, void* out,
                       void* stream, int dtype);
  Status reduce_scatter_as(const std::vector<int>& group, const void* in, std::size_t n, void* out,
                           void* stream, int dtype);
  // An in-place all-reduce of n elements of NCCL data type `dtype` (an ncclDataType_t).
  Status all_reduce_as(const std::vector<int>& group, void* data, std::size_t n, Comm::Op op,
                       void* stream, int dtype, const char* what);
  struct Edge {
    void* comm = nullptr;    // ncclComm_t
    void* stream = nullptr;  // cudaStream_t, sender only
  };
  int rank_ = 0;
  std::map<std::vector<int>, void*> groups_;  // ncclComm_t per group
  std::map<std::pair<int, int>, Edge> edges_;
};

}  // namespace nnsim::hwexec
