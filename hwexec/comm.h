// A small CPU collective backend for `nnexec run` (docs/hwexec.md): the processes of one machine
// connected pairwise by Unix-domain stream sockets, with ring all-reduce, all-gather and
// reduce-scatter over any group of ranks and point-to-point send / receive of float buffers.
// Debian's LibTorch has Gloo compiled in but ships no Gloo headers, so c10d's ProcessGroupGloo
// cannot be used from C++ here; this needs nothing but POSIX.
//
// Sends are queued and never block; every blocking call (a receive, a collective, flush) keeps
// writing the queued sends to all peers while it waits, so two ranks that send to each other
// before receiving never deadlock. Each message carries its length; a receive of another length
// is an error (ranks disagreeing about what comes next fail loudly instead of reading garbage).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace nnsim::hwexec {

class Comm {
 public:
  enum class Op { kSum, kMax };

  // Connects rank `rank` of `world` to every other rank through sockets `<dir>/<rank>.sock`.
  // Every rank calls it at about the same time; it fails after `timeout_s` seconds.
  static Expected<std::unique_ptr<Comm>> connect(const std::string& dir, int rank, int world,
                                                 double timeout_s = 120);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }

  // Point to point. send() queues a copy and returns at once.
  Status send(int peer, const void* data, std::size_t bytes);
  Status recv(int peer, void* data, std::size_t bytes);
  // Waits until every queued send has been written.
  Status flush();

  // Collectives over `group` (global ranks, each rank listing the same ranks in the same order;
  // it must contain this rank). Rings in the group's order. A group of one does nothing.
  // all_reduce: n floats in place.
  Status all_reduce(const std::vector<int>& group, float* data, std::size_t n, Op op = Op::kSum);
  // all_reduce_bf16: n bf16 values (their bit patterns) in place, 2 bytes an element on the
  // wire; each ring step combines in fp32 and rounds to bf16 (to nearest even), as NCCL's bf16
  // ring does.
  Status all_reduce_bf16(const std::vector<int>& group, std::uint16_t* data, std::size_t n,
                         Op op = Op::kSum);
  // all_gather: `n` floats from each member into out[position * n ...] (out holds n * size).
  Status all_gather(const std::vector<int>& group, const float* in, std::size_t n, float* out);
  // reduce_scatter: `in` holds n * size floats; member i gets the sum of everyone's chunk i in
  // out (n floats).
  Status reduce_scatter(const std::vector<int>& group, const float* in, std::size_t n, float* out);
  Status barrier();

 private:
  Comm(int rank, int world) : rank_(rank), world_(world) {}
  struct Pending {
    std::vector<char> bytes;
    std::size_t done = 0;
  };
  // Writes queued sends until `until` says stop; waits for input from `reading` (or -1).
  Status progress(int reading, bool block);
  Status ring_reduce_scatter(const std::vector<int>& group, int pos, float* data,
                             const std::vector<std::size_t>& offsets, Op op);
  Status ring_all_gather(const std::vector<int>& group, int pos, float* data,
                         const std::vector<std::size_t>& offsets);

  int rank_ = 0;
  int world_ = 1;
  std::vector<int> fds_;
  std::vector<std::deque<Pending>> out_;
  double timeout_s_ = 120;
  std::string listen_path_;
};

}  // namespace nnsim::hwexec
