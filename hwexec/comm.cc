#include "hwexec/comm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace nnsim::hwexec {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- TCP helpers for the rendezvous. Every socket is non-blocking; waits poll until a deadline.

std::string errno_text(int e) {
  return std::strerror(e);
}

int ms_until(Clock::time_point deadline) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<long long>(ms, 1 << 30));
}

// "10.0.0.2:4242", "[fe80::1]:4242"; IPv4 clients of a dual-stack listener as plain IPv4.
struct Address {
  sockaddr_storage sa{};
  socklen_t len = 0;
};

Address normalized(const sockaddr_storage& sa, socklen_t len) {
  Address a;
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&sa);
  if (sa.ss_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.sa);
    in->sin_family = AF_INET;
    in->sin_port = in6->sin6_port;
    std::memcpy(&in->sin_addr, in6->sin6_addr.s6_addr + 12, 4);
    a.len = sizeof(sockaddr_in);
    return a;
  }
  std::memcpy(&a.sa, &sa, len);
  a.len = len;
  return a;
}

std::string host_of(const Address& a) {
  char host[NI_MAXHOST] = "?";
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&a.sa), a.len, host, sizeof(host), nullptr, 0,
                NI_NUMERICHOST);
  return host;
}

std::string host_port(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                             : fmt::format("{}:{}", host, port);
}

// This end's (or the other end's) address of a connected socket.
Expected<Address> socket_address(int fd, bool peer) {
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  const int r = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len)
                     : ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  if (r < 0) return Error(fmt::format("getsockname: {}", errno_text(errno)));
  return normalized(sa, len);
}

Expected<std::vector<Address>> resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int r =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (r != 0) {
    return Error(fmt::format("cannot resolve host '{}': {}", host, ::gai_strerror(r)));
  }
  std::vector<Address> out;
  for (addrinfo* i = found; i != nullptr; i = i->ai_next) {
    Address a;
    std::memcpy(&a.sa, i->ai_addr, i->ai_addrlen);
    a.len = i->ai_addrlen;
    out.push_back(a);
  }
  ::freeaddrinfo(found);
  // Passive: IPv6 first, so that a dual-stack wildcard socket takes IPv4 clients as well.
  if (passive) {
    std::stable_sort(out.begin(), out.end(), [](const Address& a, const Address& b) {
      return a.sa.ss_family == AF_INET6 && b.sa.ss_family != AF_INET6;
    });
  }
  return out;
}

void tune(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // small ring steps
}

// One non-blocking connect to `a`, waiting at most until `deadline`: the socket, or -1 with
// `*err` set.
int connect_once(const Address& a, Clock::time_point deadline, int* err) {
  const int fd = ::socket(a.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a.sa), a.len) == 0) return fd;
  if (errno != EINPROGRESS) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  const int r = ::poll(&p, 1, ms_until(deadline));
  int so = ETIMEDOUT;
  socklen_t len = sizeof(so);
  if (r > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len);
  if (r > 0 && so == 0) return fd;
  *err = so;
  ::close(fd);
  return -1;
}

// Connects to host:port, retrying (the other side may not listen yet) until `deadline`.
Expected<int> connect_until(const std::string& host, int port, Clock::time_point deadline) {
  int err = ETIMEDOUT;
  std::string why;
  for (;;) {
    Expected<std::vector<Address>> addrs = resolve(host, port, false);
    if (addrs) {
      for (const Address& a : *addrs) {
        // At most a few seconds an attempt, so that a refused address is retried.
        const auto attempt = std::min(deadline, Clock::now() + std::chrono::seconds(2));
        const int fd = connect_once(a, attempt, &err);
        if (fd >= 0) {
          tune(fd);
          return fd;
        }
        why = errno_text(err);
      }
    } else {
      why = addrs.error().message();  // DNS may come up late; retried like a refusal
    }
    if (Clock::now() >= deadline) return Error(why);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Moves exactly n bytes over a non-blocking socket before `deadline`. Errors: "timed out",
// "the connection closed", or the system's.
Status move_until(int fd, void* buf, std::size_t n, bool write, Clock::time_point deadline) {
  char* c = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = write ? ::send(fd, c, n, MSG_NOSIGNAL) : ::recv(fd, c, n, 0);
    if (r > 0) {
      c += r;
      n -= static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) return Error("the connection closed");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Error(errno_text(errno));
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int left = ms_until(deadline);
    if (left == 0 || ::poll(&p, 1, left) == 0) return Error("timed out");
  }
  return {};
}

// The rendezvous's messages: a hello to rank 0 {magic, rank, world, listening port}, rank 0's
// table (its length, then one "host port" line a rank), a hello between peers {magic, rank}.
constexpr std::uint32_t kMagic = 0x6e6e7831;  // "nnx1"

Status send_words(int fd, std::vector<std::uint32_t> w, Clock::time_point deadline) {
  for (auto& x : w) x = htonl(x);
  return move_until(fd, w.data(), w.size() * 4, true, deadline);
}

Expected<std::vector<std::uint32_t>> recv_words(int fd, std::size_t n, Clock::time_point deadline) {
  std::vector<std::uint32_t> w(n);
  if (Status s = move_until(fd, w.data(), n * 4, false, deadline); !s) return s.error();
  for (auto& x : w) x = ntohl(x);
  return w;
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

std::uint16_t float_to_fp16(float f) {  // round to nearest even; overflow to infinity
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x47800000u) return sign | 0x7c00u;  // 2^16 and above (infinity too)
  if (a < 0x38800000u) {
    // Below fp16's smallest normal (2^-14): multiples of 2^-24 (the scaling is exact; the
    // default rounding mode rounds to nearest even). 2^-14 itself encodes as 0x0400.
    float m;
    std::memcpy(&m, &a, sizeof(m));
    return sign | static_cast<std::uint16_t>(std::nearbyint(m * 16777216.0f));
  }
  std::uint32_t r = a - 0x38000000u;  // exponent bias 127 -> 15
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return sign | static_cast<std::uint16_t>(r >= 0x7c00u ? 0x7c00u : r);
}

float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  std::uint32_t u;
  if (e == 0) {  // zero or subnormal: m 2^-24
    const float v = std::ldexp(static_cast<float>(m), -24);
    std::memcpy(&u, &v, sizeof(u));
    u |= sign;
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

float to_float(Comm::Float16 f, std::uint16_t x) {
  return f == Comm::Float16::kFp16 ? fp16_to_float(x) : bf16_to_float(x);
}
std::uint16_t from_float(Comm::Float16 f, float x) {
  return f == Comm::Float16::kFp16 ? float_to_fp16(x) : float_to_bf16(x);
}

}  // namespace

Expected<Comm::Listener> Comm::listen(const std::string& host, int port) {
  Expected<std::vector<Address>> addrs = resolve(host, port, true);
  if (!addrs) return addrs.error();
  std::string why = "no address";
  for (const Address& a : *addrs) {
    const int fd = ::socket(a.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = errno_text(errno);
      continue;
    }
    const int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // restarts after TIME_WAIT
    if (a.sa.ss_family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    // The backlog holds every rank's connection before it is accepted (SOMAXCONN caps it).
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&a.sa), a.len) == 0 &&
        ::listen(fd, 4096) == 0) {
      Expected<Address> bound = socket_address(fd, false);
      if (!bound) {
        ::close(fd);
        return bound.error();
      }
      const int p = bound->sa.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound->sa)->sin6_port)
                        : ntohs(reinterpret_cast<const sockaddr_in*>(&bound->sa)->sin_port);
      return Listener{fd, p};
    }
    why = errno_text(errno);
    ::close(fd);
  }
  return Error(
      fmt::format("cannot listen at {}: {}", host_port(host.empty() ? "*" : host, port), why));
}

Expected<std::unique_ptr<Comm>> Comm::connect(const Rendezvous& at, int rank, int world,
                                              double wait_timeout_s) {
  if (world < 1 || rank < 0 || rank >= world) {
    if (at.listen_fd >= 0) ::close(at.listen_fd);
    return Error(fmt::format("rank {} is outside a world of {}", rank, world));
  }
  std::unique_ptr<Comm> c(new Comm(rank, world));
  c->timeout_s_ = wait_timeout_s;
  c->fds_.assign(world, -1);
  c->out_.resize(world);
  c->early_.assign(world, std::vector<std::deque<std::vector<char>>>(kChannels));
  if (world == 1) {
    if (at.listen_fd >= 0) ::close(at.listen_fd);
    return c;
  }
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<long long>(at.timeout_s * 1000));
  const std::string master = host_port(at.host, at.port);
  // Closes a socket when it goes out of scope unless released.
  struct Fd {
    int fd = -1;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
    int release() { return std::exchange(fd, -1); }
  };

  if (rank == 0) {
    Fd listener;
    if (at.listen_fd >= 0) {
      listener.fd = at.listen_fd;
    } else {
      Expected<Listener> l = listen("", at.port);
      if (!l) {
        return Error(fmt::format("rank 0: {} ({}; is another job using port {}? choose another)",
                                 l.error().message(), at.source, at.port));
      }
      listener.fd = l->fd;
    }
    std::vector<std::string> hosts(world);
    std::vector<int> ports(world, 0);
    int reported = 1;
    while (reported < world) {
      pollfd p{listener.fd, POLLIN, 0};
      const int left = ms_until(deadline);
      if (left == 0 || ::poll(&p, 1, left) <= 0) {
        std::string missing;
        for (int r = 1; r < world; ++r) {
          if (c->fds_[r] < 0) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
        }
        return Error(fmt::format(
            "rank 0: {} of {} ranks reached the rendezvous at port {} ({}) within {} s; missing "
            "rank(s) {} (were they started, with the same {} and a world of {}?)",
            reported, world, at.port, at.source, at.timeout_s, missing, at.source, world));
      }
      Fd fd;
      fd.fd = ::accept4(listener.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd.fd < 0) continue;
      // A connection that says nothing sensible (a port scanner, another program) is dropped.
      Expected<std::vector<std::uint32_t>> hello =
          recv_words(fd.fd, 4, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
      if (!hello || (*hello)[0] != kMagic) continue;
      const int peer = static_cast<int>((*hello)[1]), peer_world = static_cast<int>((*hello)[2]);
      if (peer_world != world) {
        return Error(fmt::format(
            "rank 0: rank {} says the world has {} ranks but rank 0's has {} (every rank must "
            "be started with the same world size)",
            peer, peer_world, world));
      }
      if (peer <= 0 || peer >= world || c->fds_[peer] >= 0) {
        return Error(fmt::format(
            "rank 0: two processes say they are rank {} of {} (each rank must be started "
            "once; is another job using the rendezvous at port {}?)",
            peer, world, at.port));
      }
      Expected<Address> from = socket_address(fd.fd, true);
      if (!from) return from.error();
      hosts[peer] = host_of(*from);
      ports[peer] = static_cast<int>((*hello)[3]);
      tune(fd.fd);
      c->fds_[peer] = fd.release();
      ++reported;
    }
    std::string table;
    for (int r = 0; r < world; ++r) {
      table += fmt::format("{} {}\n", r == 0 ? "-" : hosts[r], ports[r]);
    }
    for (int r = 1; r < world; ++r) {
      Status s = send_words(c->fds_[r], {static_cast<std::uint32_t>(table.size())}, deadline);
      if (s) s = move_until(c->fds_[r], table.data(), table.size(), true, deadline);
      if (!s) {
        return Error(fmt::format("rank 0: sending the address table to rank {} at {}: {}", r,
                                 host_port(hosts[r], ports[r]), s.error().message()));
      }
    }
    return c;
  }

  // Every other rank: connect to rank 0 at the master address; that connection stays theirs.
  Expected<int> fd0 = connect_until(at.host, at.port, deadline);
  if (!fd0) {
    return Error(fmt::format(
        "rank {}: could not reach rank 0's rendezvous at {} ({}) within {} s: {} (is rank 0 "
        "running on that host, and the port open?)",
        rank, master, at.source, at.timeout_s, fd0.error().message()));
  }
  c->fds_[0] = *fd0;
  auto lost_master = [&](const Status& s) {
    return Error(fmt::format(
        "rank {}: the rendezvous with rank 0 at {} ({}) failed: {} (did rank 0 fail? its error "
        "says why)",
        rank, master, at.source, s.error().message()));
  };
  // Listen on the interface that reaches rank 0: the one other ranks can reach too.
  Expected<Address> mine = socket_address(*fd0, false);
  if (!mine) return mine.error();
  Expected<Listener> l = listen(host_of(*mine), 0);
  if (!l) return Error(fmt::format("rank {}: {}", rank, l.error().message()));
  Fd listener;
  listener.fd = l->fd;
  if (Status s =
          send_words(*fd0,
                     {kMagic, static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(world),
                      static_cast<std::uint32_t>(l->port)},
                     deadline);
      !s) {
    return lost_master(s);
  }
  Expected<std::vector<std::uint32_t>> size = recv_words(*fd0, 1, deadline);
  if (!size) return lost_master(size.error());
  std::string table((*size)[0], '\0');
  if (Status s = move_until(*fd0, table.data(), table.size(), false, deadline); !s) {
    return lost_master(s);
  }
  std::vector<std::string> hosts(world);
  std::vector<int> ports(world, 0);
  {
    std::istringstream in(table);
    for (int r = 0; r < world; ++r) in >> hosts[r] >> ports[r];
    if (!in) return Error(fmt::format("rank {}: rank 0 sent a malformed address table", rank));
  }
  for (int peer = 1; peer < rank; ++peer) {
    Expected<int> fd = connect_until(hosts[peer], ports[peer], deadline);
    if (!fd) {
      return Error(fmt::format("rank {}: could not reach rank {} at {} within {} s: {}", rank, peer,
                               host_port(hosts[peer], ports[peer]), at.timeout_s,
                               fd.error().message()));
    }
    c->fds_[peer] = *fd;
    if (Status s = send_words(*fd, {kMagic, static_cast<std::uint32_t>(rank)}, deadline); !s) {
      return Error(fmt::format("rank {}: handshake with rank {} at {}: {}", rank, peer,
                               host_port(hosts[peer], ports[peer]), s.error().message()));
    }
  }
  for (int n = rank + 1; n < world; ++n) {
    pollfd p{listener.fd, POLLIN, 0};
    const int left = ms_until(deadline);
    if (left == 0 || ::poll(&p, 1, left) <= 0) {
      std::string missing;
      for (int r = rank + 1; r < world; ++r) {
        if (c->fds_[r] < 0) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      }
      return Error(fmt::format("rank {}: rank(s) {} did not connect to {} within {} s", rank,
                               missing, host_port(host_of(*mine), l->port), at.timeout_s));
    }
    Fd fd;
    fd.fd = ::accept4(listener.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd.fd < 0) {
      --n;
      continue;
    }
    Expected<std::vector<std::uint32_t>> hello = recv_words(fd.fd, 2, deadline);
    const int peer = hello ? static_cast<int>((*hello)[1]) : -1;
    if (!hello || (*hello)[0] != kMagic || peer <= rank || peer >= world || c->fds_[peer] >= 0) {
      --n;  // not one of ours
      continue;
    }
    tune(fd.fd);
    c->fds_[peer] = fd.release();
  }
  return c;
}

Comm::~Comm() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
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

// A message's header: its length, its channel in the top byte.
constexpr int kChannelShift = 56;

Status Comm::send(int peer, const void* data, std::size_t bytes, int channel) {
  if (peer < 0 || peer >= world_ || peer == rank_) {
    return Error(fmt::format("rank {}: cannot send to rank {}", rank_, peer));
  }
  if (channel < 0 || channel >= kChannels || (uint64_t{bytes} >> kChannelShift) != 0) {
    return Error(fmt::format("rank {}: cannot send {} bytes on channel {}", rank_, bytes, channel));
  }
  Pending m;
  const uint64_t n = uint64_t{bytes} | (uint64_t(channel) << kChannelShift);
  m.bytes.resize(sizeof(n) + bytes);
  std::memcpy(m.bytes.data(), &n, sizeof(n));
  if (bytes > 0) std::memcpy(m.bytes.data() + sizeof(n), data, bytes);
  out_[peer].push_back(std::move(m));
  return progress(-1, false);
}

Status Comm::recv(int peer, void* data, std::size_t bytes, int channel) {
  if (peer < 0 || peer >= world_ || peer == rank_) {
    return Error(fmt::format("rank {}: cannot receive from rank {}", rank_, peer));
  }
  if (channel < 0 || channel >= kChannels) {
    return Error(fmt::format("rank {}: cannot receive on channel {}", rank_, channel));
  }
  auto mismatch = [&](uint64_t got) {
    return Error(fmt::format(
        "rank {}: expected a message of {} bytes from rank {} but it sent {} (the ranks disagree "
        "about the order of their communication)",
        rank_, bytes, peer, got));
  };
  if (std::deque<std::vector<char>>& q = early_[peer][channel]; !q.empty()) {
    if (q.front().size() != bytes) return mismatch(q.front().size());
    if (bytes > 0) std::memcpy(data, q.front().data(), bytes);
    q.pop_front();
    return {};
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
  for (;;) {
    if (Status s = read_exact(&header, sizeof(header)); !s) return s;
    const int got_channel = static_cast<int>(header >> kChannelShift);
    const uint64_t n = header & ((uint64_t{1} << kChannelShift) - 1);
    if (got_channel == channel) {
      if (n != bytes) return mismatch(n);
      return read_exact(data, bytes);
    }
    if (got_channel >= kChannels) return mismatch(n);
    // Another channel's message: kept for the receive that wants it.
    std::vector<char> body(n);
    if (Status s = read_exact(body.data(), n); !s) return s;
    early_[peer][got_channel].push_back(std::move(body));
  }
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
                             Op op, Float16 format) {
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
      const float a = to_float(format, d[i]), b = to_float(format, tmp[i]);
      d[i] = from_float(format, op == Op::kSum ? a + b : std::max(a, b));
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

Status Comm::all_gather_bf16(const std::vector<int>& group, const std::uint16_t* in, std::size_t n,
                             std::uint16_t* out) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its all-gather group", rank_));
  const int g = static_cast<int>(group.size());
  std::copy(in, in + n, out + pos * n);
  const int next = group[(pos + 1) % g], prev = group[(pos + g - 1) % g];
  for (int s = 0; s < g - 1; ++s) {  // all_gather's steps on 2-byte elements
    const int send_chunk = ((pos - s) % g + g) % g;
    const int recv_chunk = ((pos - s - 1) % g + g) % g;
    if (Status st = this->send(next, out + send_chunk * n, n * 2); !st) return st;
    if (Status st = recv(prev, out + recv_chunk * n, n * 2); !st) return st;
  }
  return {};
}

Status Comm::reduce_scatter_bf16(const std::vector<int>& group, const std::uint16_t* in,
                                 std::size_t n, std::uint16_t* out, Float16 format) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its reduce-scatter group", rank_));
  const int g = static_cast<int>(group.size());
  if (g == 1) {
    std::copy(in, in + n, out);
    return {};
  }
  // As reduce_scatter: chunk c goes in as ring chunk (c + 1), whose sum the ring leaves at
  // member c.
  std::vector<std::uint16_t> work(n * g), tmp(n);
  for (int c = 0; c < g; ++c)
    std::copy(in + c * n, in + (c + 1) * n, work.begin() + ((c + 1) % g) * n);
  const int next = group[(pos + 1) % g], prev = group[(pos + g - 1) % g];
  for (int s = 0; s < g - 1; ++s) {  // all_reduce_bf16's reduce-scatter steps
    const int send_chunk = ((pos - s) % g + g) % g;
    const int recv_chunk = ((pos - s - 1) % g + g) % g;
    if (Status st = this->send(next, work.data() + send_chunk * n, n * 2); !st) return st;
    if (Status st = recv(prev, tmp.data(), n * 2); !st) return st;
    std::uint16_t* d = work.data() + recv_chunk * n;
    for (std::size_t i = 0; i < n; ++i)
      d[i] = from_float(format, to_float(format, d[i]) + to_float(format, tmp[i]));
  }
  const int mine = (pos + 1) % g;
  std::copy(work.begin() + mine * n, work.begin() + (mine + 1) * n, out);
  return {};
}

Status Comm::all_to_all(const std::vector<int>& group, const void* in,
                        const std::vector<std::size_t>& send_bytes, void* out,
                        const std::vector<std::size_t>& recv_bytes) {
  const int pos = position_in(group, rank_);
  if (pos < 0) return Error(fmt::format("rank {} is not in its all-to-all group", rank_));
  const std::size_t g = group.size();
  if (send_bytes.size() != g || recv_bytes.size() != g) {
    return Error(fmt::format("all-to-all over {} ranks with {} send and {} receive sizes", g,
                             send_bytes.size(), recv_bytes.size()));
  }
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  std::vector<std::size_t> send_at(g, 0), recv_at(g, 0);
  for (std::size_t i = 1; i < g; ++i) {
    send_at[i] = send_at[i - 1] + send_bytes[i - 1];
    recv_at[i] = recv_at[i - 1] + recv_bytes[i - 1];
  }
  const auto me = static_cast<std::size_t>(pos);
  if (send_bytes[me] != recv_bytes[me]) {
    return Error(fmt::format("all-to-all: rank {} sends itself {} bytes but expects {}", rank_,
                             send_bytes[me], recv_bytes[me]));
  }
  std::copy(src + send_at[me], src + send_at[me] + send_bytes[me], dst + recv_at[me]);
  // Sends are queued, so sending to every member before receiving cannot deadlock.
  for (std::size_t i = 0; i < g; ++i) {
    if (i == me) continue;
    if (Status st = send(group[i], src + send_at[i], send_bytes[i]); !st) return st;
  }
  for (std::size_t i = 0; i < g; ++i) {
    if (i == me) continue;
    if (Status st = recv(group[i], dst + recv_at[i], recv_bytes[i]); !st) return st;
  }
  return {};
}

Status Comm::barrier() {
  std::vector<int> all(world_);
  for (int i = 0; i < world_; ++i) all[i] = i;
  float x = 0;
  return all_reduce(all, &x, 1);
}

}  // namespace nnsim::hwexec
