#include "hwexec/comm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

namespace nnsim::hwexec {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Status set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Error(fmt::format("fcntl: {}", std::strerror(errno)));
  }
  return {};
}

// Blocking full read / write during the handshake (before the sockets become non-blocking):
// `io` is ::read or ::write, repeated until n bytes have moved.
template <typename Byte, typename Io>
bool move_all(Io io, int fd, Byte* c, std::size_t n) {
  while (n > 0) {
    const ssize_t r = io(fd, c, n);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n) {
  return move_all(::read, fd, static_cast<char*>(p), n);
}

bool write_all(int fd, const void* p, std::size_t n) {
  return move_all(::write, fd, static_cast<const char*>(p), n);
}

sockaddr_un address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  return a;
}

// Chunk boundaries of n elements over `parts` members: offsets[i]..offsets[i+1].
std::vector<std::size_t> chunks(std::size_t n, std::size_t parts) {
  std::vector<std::size_t> o(parts + 1);
  for (std::size_t i = 0; i <= parts; ++i) o[i] = n * i / parts;
  return o;
}

int position_in(const std::vector<int>& group, int rank) {
  auto it = std::find(group.begin(), group.end(), rank);
  return it == group.end() ? -1 : static_cast<int>(it - group.begin());
}

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

std::uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

}  // namespace

Expected<std::unique_ptr<Comm>> Comm::connect(const std::string& dir, int rank, int world,
                                              double timeout_s) {
  if (world < 1 || rank < 0 || rank >= world) {
    return Error(fmt::format("rank {} is outside a world of {}", rank, world));
  }
  std::unique_ptr<Comm> c(new Comm(rank, world));
  c->timeout_s_ = timeout_s;
  c->fds_.assign(world, -1);
  c->out_.resize(world);
  if (world == 1) return c;
  const std::string mine = fmt::format("{}/{}.sock", dir, rank);
  if (mine.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return Error(fmt::format("socket path '{}' is too long; use a shorter directory", mine));
  }
  const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (listener < 0) return Error(fmt::format("socket: {}", std::strerror(errno)));
  ::unlink(mine.c_str());
  sockaddr_un a = address(mine);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)) < 0 ||
      ::listen(listener, world) < 0) {
    const std::string why = std::strerror(errno);
    ::close(listener);
    return Error(fmt::format("cannot listen on {}: {}", mine, why));
  }
  c->listen_path_ = mine;
  const auto t0 = Clock::now();
  // Connect to every lower rank (retrying until it listens), then accept every higher one.
  for (int peer = 0; peer < rank; ++peer) {
    const std::string path = fmt::format("{}/{}.sock", dir, peer);
    for (;;) {
      const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un pa = address(path);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&pa), sizeof(pa)) == 0) {
        const int32_t me = rank;
        if (!write_all(fd, &me, sizeof(me))) {
          ::close(fd);
          ::close(listener);
          return Error(fmt::format("rank {}: handshake with rank {} failed", rank, peer));
        }
        c->fds_[peer] = fd;
        break;
      }
      ::close(fd);
      if (since(t0) > timeout_s) {
        ::close(listener);
        return Error(fmt::format("rank {}: rank {} did not start listening on {} within {} s", rank,
                                 peer, path, timeout_s));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  for (int n = rank + 1; n < world; ++n) {
    pollfd p{listener, POLLIN, 0};
    const double left = timeout_s - since(t0);
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left * 1000)) <= 0) {
      ::close(listener);
      return Error(
          fmt::format("rank {}: not every higher rank connected within {} s", rank, timeout_s));
    }
    const int fd = ::accept(listener, nullptr, nullptr);
    int32_t peer = -1;
    if (fd < 0 || !read_all(fd, &peer, sizeof(peer)) || peer <= rank || peer >= world ||
        c->fds_[peer] >= 0) {
      ::close(listener);
      return Error(fmt::format("rank {}: bad handshake from a peer", rank));
    }
    c->fds_[peer] = fd;
  }
  ::close(listener);
  for (int fd : c->fds_) {
    if (fd < 0) continue;
    if (Status s = set_nonblocking(fd); !s) return s.error();
  }
  return c;
}

Comm::~Comm() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
  if (!listen_path_.empty()) ::unlink(listen_path_.c_str());
}

Status Comm::progress(int reading, bool block) {
  const auto t0 = Clock::now();
  for (;;) {
    std::vector<pollfd> polls;
    std::vector<int> peers;
    for (int p = 0; p < world_; ++p) {
      short ev = 0;
      if (!out_[p].empty()) ev |= POLLOUT;
      if (p == reading) ev |= POLLIN;
      if (ev != 0) {
        polls.push_back({fds_[p], ev, 0});
        peers.push_back(p);
      }
    }
    if (polls.empty()) return {};  // nothing queued, nothing to read
    const int r = ::poll(polls.data(), polls.size(), block ? 1000 : 0);
    if (r < 0 && errno != EINTR) return Error(fmt::format("poll: {}", std::strerror(errno)));
    bool readable = false;
    for (std::size_t i = 0; r > 0 && i < polls.size(); ++i) {
      const int p = peers[i];
      if (polls[i].revents & (POLLERR | POLLNVAL)) {
        return Error(fmt::format("rank {}: the connection to rank {} failed", rank_, p));
      }
      if (p == reading && (polls[i].revents & (POLLIN | POLLHUP))) readable = true;
      if (polls[i].revents & POLLOUT) {
        while (!out_[p].empty()) {
          Pending& m = out_[p].front();
          const ssize_t w = ::send(fds_[p], m.bytes.data() + m.done, m.bytes.size() - m.done,
                                   MSG_DONTWAIT | MSG_NOSIGNAL);
          if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            return Error(fmt::format("rank {}: sending to rank {}: {} (did it fail?)", rank_, p,
                                     std::strerror(errno)));
          }
          m.done += static_cast<std::size_t>(w);
          if (m.done < m.bytes.size()) break;
          out_[p].pop_front();
        }
      }
    }
    if (readable || !block) return {};
    if (reading < 0) {
      bool all_sent = true;
      for (const auto& q : out_) all_sent = all_sent && q.empty();
      if (all_sent) return {};
    }
    if (since(t0) > timeout_s_) {
      return Error(fmt::format("rank {}: waited {} s for rank {} (is it stuck or dead?)", rank_,
                               timeout_s_, reading >= 0 ? reading : -1));
    }
  }
}

Status Comm::send(int peer, const void* data, std::size_t bytes) {
  if (peer < 0 || peer >= world_ || peer == rank_) {
    return Error(fmt::format("rank {}: cannot send to rank {}", rank_, peer));
  }
  Pending m;
  const uint64_t n = bytes;
  m.bytes.resize(sizeof(n) + bytes);
  std::memcpy(m.bytes.data(), &n, sizeof(n));
  if (bytes > 0) std::memcpy(m.bytes.data() + sizeof(n), data, bytes);
  out_[peer].push_back(std::move(m));
  return progress(-1, false);
}

Status Comm::recv(int peer, void* data, std::size_t bytes) {
  if (peer < 0 || peer >= world_ || peer == rank_) {
    return Error(fmt::format("rank {}: cannot receive from rank {}", rank_, peer));
  }
  uint64_t header = 0;
  auto read_exact = [&](void* p, std::size_t n) -> Status {
    char* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fds_[peer], c, n, MSG_DONTWAIT);
      if (r == 0) {
        return Error(
            fmt::format("rank {}: rank {} closed its connection (did it fail?)", rank_, peer));
      }
      if (r < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return Error(fmt::format("rank {}: receiving from rank {}: {}", rank_, peer,
                                   std::strerror(errno)));
        }
        if (Status s = progress(peer, true); !s) return s;
        continue;
      }
      c += r;
      n -= static_cast<std::size_t>(r);
    }
    return {};
  };
  if (Status s = read_exact(&header, sizeof(header)); !s) return s;
  if (header != bytes) {
    return Error(fmt::format(
        "rank {}: expected a message of {} bytes from rank {} but it sent {} (the ranks disagree "
        "about the order of their communication)",
        rank_, bytes, peer, header));
  }
  return read_exact(data, bytes);
}

Status Comm::flush() {
  return progress(-1, true);
}

Status Comm::ring_reduce_scatter(const std::vector<int>& group, int pos, float* data,
                                 const std::vector<std::size_t>& o, Op op) {
  const int n = static_cast<int>(group.size());
  const int next = group[(pos + 1) % n], prev = group[(pos + n - 1) % n];
  std::vector<float> tmp;
  // After step s, chunk (pos - s - 1) holds the sum of s + 2 members; after n - 1 steps chunk
  // (pos + 1) holds everyone's sum.
  for (int s = 0; s < n - 1; ++s) {
    const int send_chunk = ((pos - s) % n + n) % n;
    const int recv_chunk = ((pos - s - 1) % n + n) % n;
    if (Status st = this->send(next, data + o[send_chunk],
                               (o[send_chunk + 1] - o[send_chunk]) * sizeof(float));
        !st) {
      return st;
    }
    tmp.resize(o[recv_chunk + 1] - o[recv_chunk]);
    if (Status st = recv(prev, tmp.data(), tmp.size() * sizeof(float)); !st) return st;
    float* d = data + o[recv_chunk];
    if (op == Op::kSum) {
      for (std::size_t i = 0; i < tmp.size(); ++i) d[i] += tmp[i];
    } else {
      for (std::size_t i = 0; i < tmp.size(); ++i) d[i] = std::max(d[i], tmp[i]);
    }
  }
  return {};
}

Status Comm::ring_all_gather(const std::vector<int>& group, int pos, float* data,
                             const std::vector<std::size_t>& o) {
  const int n = static_cast<int>(group.size());
  const int next = group[(pos + 1) % n], prev = group[(pos + n - 1) % n];
  // Member pos starts owning chunk (pos + 1) (the reduce-scatter's result).
  for (int s = 0; s < n - 1; ++s) {
    const int send_chunk = ((pos + 1 - s) % n + n) % n;
    const int recv_chunk = ((pos - s) % n + n) % n;
    if (Status st = this->send(next, data + o[send_chunk],
                               (o[send_chunk + 1] - o[send_chunk]) * sizeof(float));
        !st) {
      return st;
    }
    if (Status st =
            recv(prev, data + o[recv_chunk], (o[recv_chunk + 1] - o[recv_chunk]) * sizeof(float));
        !st) {
      return st;
    }
  }
  return {};
}

Status Comm::all_reduce(const std::vector<int>& group, float* data, std::size_t n, Op op) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its all-reduce group", rank_));
  if (group.size() == 1) return {};
  const auto o = chunks(n, group.size());
  if (Status s = ring_reduce_scatter(group, pos, data, o, op); !s) return s;
  return ring_all_gather(group, pos, data, o);
}

Status Comm::all_reduce_bf16(const std::vector<int>& group, std::uint16_t* data, std::size_t n,
                             Op op) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its all-reduce group", rank_));
  const int g = static_cast<int>(group.size());
  if (g == 1) return {};
  const auto o = chunks(n, group.size());
  const int next = group[(pos + 1) % g], prev = group[(pos + g - 1) % g];
  auto bytes = [&](int chunk) { return (o[chunk + 1] - o[chunk]) * sizeof(std::uint16_t); };
  // The float ring's steps (ring_reduce_scatter, ring_all_gather) on 2-byte elements.
  std::vector<std::uint16_t> tmp;
  for (int s = 0; s < g - 1; ++s) {
    const int send_chunk = ((pos - s) % g + g) % g;
    const int recv_chunk = ((pos - s - 1) % g + g) % g;
    if (Status st = this->send(next, data + o[send_chunk], bytes(send_chunk)); !st) return st;
    tmp.resize(o[recv_chunk + 1] - o[recv_chunk]);
    if (Status st = recv(prev, tmp.data(), bytes(recv_chunk)); !st) return st;
    std::uint16_t* d = data + o[recv_chunk];
    for (std::size_t i = 0; i < tmp.size(); ++i) {
      const float a = bf16_to_float(d[i]), b = bf16_to_float(tmp[i]);
      d[i] = float_to_bf16(op == Op::kSum ? a + b : std::max(a, b));
    }
  }
  for (int s = 0; s < g - 1; ++s) {
    const int send_chunk = ((pos + 1 - s) % g + g) % g;
    const int recv_chunk = ((pos - s) % g + g) % g;
    if (Status st = this->send(next, data + o[send_chunk], bytes(send_chunk)); !st) return st;
    if (Status st = recv(prev, data + o[recv_chunk], bytes(recv_chunk)); !st) return st;
  }
  return {};
}

Status Comm::all_gather(const std::vector<int>& group, const float* in, std::size_t n, float* out) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its all-gather group", rank_));
  const int g = static_cast<int>(group.size());
  std::copy(in, in + n, out + pos * n);
  if (g == 1) return {};
  // ring_all_gather starts from chunk pos + 1; shift by one so that member pos owns chunk pos.
  const int next = group[(pos + 1) % g], prev = group[(pos + g - 1) % g];
  for (int s = 0; s < g - 1; ++s) {
    const int send_chunk = ((pos - s) % g + g) % g;
    const int recv_chunk = ((pos - s - 1) % g + g) % g;
    if (Status st = this->send(next, out + send_chunk * n, n * sizeof(float)); !st) return st;
    if (Status st = recv(prev, out + recv_chunk * n, n * sizeof(float)); !st) return st;
  }
  return {};
}

Status Comm::reduce_scatter(const std::vector<int>& group, const float* in, std::size_t n,
                            float* out) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its reduce-scatter group", rank_));
  const int g = static_cast<int>(group.size());
  std::vector<float> work(in, in + n * g);
  if (g > 1) {
    // The ring leaves everyone's sum of ring chunk (pos + 1) at member pos: chunk c goes in as
    // ring chunk (c + 1).
    std::vector<float> rotated(n * g);
    for (int c = 0; c < g; ++c) {
      std::copy(work.begin() + c * n, work.begin() + (c + 1) * n,
                rotated.begin() + ((c + 1) % g) * n);
    }
    std::vector<std::size_t> o(g + 1);
    for (int i = 0; i <= g; ++i) o[i] = static_cast<std::size_t>(i) * n;
    if (Status s = ring_reduce_scatter(group, pos, rotated.data(), o, Op::kSum); !s) return s;
    const int mine = (pos + 1) % g;
    std::copy(rotated.begin() + mine * n, rotated.begin() + (mine + 1) * n, out);
    return {};
  }
  std::copy(work.begin(), work.end(), out);
  return {};
}

Status Comm::barrier() {
  std::vector<int> all(world_);
  for (int i = 0; i < world_; ++i) all[i] = i;
  float x = 0;
  return all_reduce(all, &x, 1);
}

}  // namespace nnsim::hwexec
