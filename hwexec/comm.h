// A small CPU collective backend for `nnexec run` (docs/hwexec.md): the ranks of a job, on one
// machine or several, connected pairwise by TCP sockets, with ring all-reduce, all-gather and
// reduce-scatter over any group of ranks and point-to-point send / receive of float buffers.
// Debian's LibTorch has Gloo compiled in but ships no Gloo headers, so c10d's ProcessGroupGloo
// cannot be used from C++ here; this needs nothing but POSIX sockets (no MPI library).
//
// Rendezvous: rank 0 listens at the master address (MASTER_ADDR:MASTER_PORT); every other rank
// connects to it, opens a listening socket of its own and reports its port; rank 0 answers with
// every rank's address; then each rank connects to the lower ranks and accepts the higher ones
// (connections complete in the listeners' backlogs, so the order cannot deadlock). Rank 0's
// connection to each rank is the one made to the master address.
//
// Sends are queued and never block; every blocking call (a receive, a collective, flush) keeps
// writing the queued sends to all peers while it waits, so two ranks that send to each other
// before receiving never deadlock. Each message carries its length; a receive of another length
// is an error (ranks disagreeing about what comes next fail loudly instead of reading garbage).
// Each message also carries its channel: the collectives use channel 0, and point-to-point
// messages may use others (the executor's pipeline transfers), which keep their own order
// between two ranks: a receive on one channel keeps the messages of others that arrive first.
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
  // A 16-bit float format: bf16 (8 exponent bits) or IEEE fp16 (5 exponent bits).
  enum class Float16 { kBf16, kFp16 };

  // Where the ranks meet.
  struct Rendezvous {
    std::string host;  // rank 0's host name or address (MASTER_ADDR)
    int port = 0;      // MASTER_PORT
    // Rank 0 only: a socket already listening at `port` (from listen()), which connect() takes
    // over; -1: rank 0 opens it. A launcher that starts rank 0 itself passes one, so no other
    // process can take the port between choosing it and rank 0 listening.
    int listen_fd = -1;
    // Connecting: how long a rank keeps trying to reach the master or a peer, and how long
    // rank 0 waits for every rank to report.
    double timeout_s = 120;
    // In error messages, where the address came from ("MASTER_ADDR/MASTER_PORT", "--master").
    std::string source = "the master address";
  };

  // Connects rank `rank` of `world` to every other rank (see the top of this file). Every rank
  // calls it at about the same time. Errors name the rank and the address it could not reach.
  // Once connected, a wait for a peer fails after `wait_timeout_s`.
  static Expected<std::unique_ptr<Comm>> connect(const Rendezvous& at, int rank, int world,
                                                 double wait_timeout_s = 120);

  // A TCP socket listening on `host` (an address; "" for every interface) at `port` (0: a free
  // one the system picks); returns the socket and its port. For launchers (see listen_fd).
  struct Listener {
    int fd = -1;
    int port = 0;
  };
  static Expected<Listener> listen(const std::string& host, int port);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }

  // Point to point, on `channel` (0 to kChannels - 1). send() queues a copy and returns at once.
  static constexpr int kChannels = 4;
  Status send(int peer, const void* data, std::size_t bytes, int channel = 0);
  Status recv(int peer, void* data, std::size_t bytes, int channel = 0);
  // Waits until every queued send has been written.
  Status flush();

  // Collectives over `group` (global ranks, each rank listing the same ranks in the same order;
  // it must contain this rank). Rings in the group's order. A group of one does nothing.
  // all_reduce: n floats in place.
  Status all_reduce(const std::vector<int>& group, float* data, std::size_t n, Op op = Op::kSum);
  // all_reduce_bf16: n bf16 values (their bit patterns) in place, 2 bytes an element on the
  // wire; each ring step combines in fp32 and rounds to bf16 (to nearest even), as NCCL's bf16
  // ring does.
  // `format` kFp16: the same of IEEE fp16 values (rounded to nearest even, overflowing to
  // infinity), as NCCL's half ring.
  Status all_reduce_bf16(const std::vector<int>& group, std::uint16_t* data, std::size_t n,
                         Op op = Op::kSum, Float16 format = Float16::kBf16);
  // all_gather: `n` floats from each member into out[position * n ...] (out holds n * size).
  Status all_gather(const std::vector<int>& group, const float* in, std::size_t n, float* out);
  // reduce_scatter: `in` holds n * size floats; member i gets the sum of everyone's chunk i in
  // out (n floats).
  Status reduce_scatter(const std::vector<int>& group, const float* in, std::size_t n, float* out);
  // The same of bf16 values (bit patterns), 2 bytes an element on the wire; the reduce-scatter's
  // ring steps combine in fp32 and round to bf16 (to nearest even), as all_reduce_bf16's (fp16
  // with `format` kFp16; the all-gather moves any 2-byte values).
  Status all_gather_bf16(const std::vector<int>& group, const std::uint16_t* in, std::size_t n,
                         std::uint16_t* out);
  Status reduce_scatter_bf16(const std::vector<int>& group, const std::uint16_t* in, std::size_t n,
                             std::uint16_t* out, Float16 format = Float16::kBf16);
  // all_to_all: member i of `group` gets send_bytes[i] bytes from `in` (the members' pieces one
  // after another, in group order) and this rank gets recv_bytes[j] bytes from member j into
  // `out` (likewise), any data type; this rank's own piece is copied. The sizes must agree
  // between each pair (a receive of another length fails).
  Status all_to_all(const std::vector<int>& group, const void* in,
                    const std::vector<std::size_t>& send_bytes, void* out,
                    const std::vector<std::size_t>& recv_bytes);
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
  // Per peer and channel: messages that arrived while a receive waited on another channel.
  std::vector<std::vector<std::deque<std::vector<char>>>> early_;
  double timeout_s_ = 120;
};

}  // namespace nnsim::hwexec
