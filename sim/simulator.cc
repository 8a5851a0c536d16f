#include "sim/simulator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include <fmt/format.h>

#include "sim/simulation.h"

namespace nnsim {
namespace {

// A flat binary encoding of SimResult for the trip from the child process.
class Writer {
 public:
  template <class T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const char* p = reinterpret_cast<const char*>(&v);
    buf_.append(p, sizeof(T));
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    buf_.append(s);
  }
  template <class T>
  void pods(const std::vector<T>& v) {
    pod<uint64_t>(v.size());
    if (!v.empty()) buf_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string& buffer() { return buf_; }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(const std::string& b) : buf_(b) {}
  template <class T>
  T pod() {
    T v;
    std::memcpy(&v, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    auto n = pod<uint64_t>();
    std::string s = buf_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  template <class T>
  std::vector<T> pods() {
    auto n = pod<uint64_t>();
    std::vector<T> v(n);
    if (n > 0) std::memcpy(v.data(), buf_.data() + pos_, n * sizeof(T));  // data() may be null
    pos_ += n * sizeof(T);
    return v;
  }

 private:
  const std::string& buf_;
  size_t pos_ = 0;
};

void encode_breakdown(Writer& w, const Breakdown& b) {
  w.pod(b.compute);
  w.pod(b.recompute);
  w.pod(b.optimizer);
  w.pod(b.bubble);
  w.pod<uint64_t>(b.exposed_comm.size());
  for (const auto& [k, v] : b.exposed_comm) {
    w.str(k);
    w.pod(v);
  }
}

Breakdown decode_breakdown(Reader& r) {
  Breakdown b;
  b.compute = r.pod<double>();
  b.recompute = r.pod<double>();
  b.optimizer = r.pod<double>();
  b.bubble = r.pod<double>();
  auto n = r.pod<uint64_t>();
  for (uint64_t i = 0; i < n; ++i) {
    std::string k = r.str();
    b.exposed_comm[k] = r.pod<double>();
  }
  return b;
}

std::string encode(const SimResult& s) {
  Writer w;
  w.pod(s.iteration_time);
  w.pod(s.tokens_per_second);
  w.pod(s.model_flops_per_gpu);
  w.pod(s.mfu);
  w.pod(s.peak_flops_per_gpu);
  w.pod(s.num_gpus);
  w.pod(s.micro_batches);
  w.pod(s.fidelity);
  w.pod(s.simulated_lanes);
  w.pod(s.replicas_simulated);
  w.pod(s.activities);
  w.pod(s.wall_seconds);
  w.pod<uint64_t>(s.lanes.size());
  for (const auto& l : s.lanes) {
    w.str(l.name);
    w.pods(l.gpus);
    w.pods(l.ranks);
    w.pod(l.finish_time);
    encode_breakdown(w, l.breakdown);
    w.pod(l.static_memory);
    w.pod(l.peak_activations);
    w.pod(l.peak_memory);
    w.pods(l.memory_timeline);
    w.pod(l.parameters);
  }
  w.pod<uint64_t>(s.labels.size());
  for (const auto& x : s.labels) w.str(x);
  w.pod<uint64_t>(s.lane_axes.size());
  for (const auto& x : s.lane_axes) w.str(x);
  w.pods(s.tasks);
  return std::move(w.buffer());
}

SimResult decode(const std::string& buf) {
  Reader r(buf);
  SimResult s;
  s.iteration_time = r.pod<double>();
  s.tokens_per_second = r.pod<double>();
  s.model_flops_per_gpu = r.pod<double>();
  s.mfu = r.pod<double>();
  s.peak_flops_per_gpu = r.pod<double>();
  s.num_gpus = r.pod<int>();
  s.micro_batches = r.pod<int>();
  s.fidelity = r.pod<Fidelity>();
  s.simulated_lanes = r.pod<int>();
  s.replicas_simulated = r.pod<int>();
  s.activities = r.pod<uint64_t>();
  s.wall_seconds = r.pod<double>();
  auto lanes = r.pod<uint64_t>();
  for (uint64_t i = 0; i < lanes; ++i) {
    LaneReport l;
    l.name = r.str();
    l.gpus = r.pods<int>();
    l.ranks = r.pods<int>();
    l.finish_time = r.pod<double>();
    l.breakdown = decode_breakdown(r);
    l.static_memory = r.pod<StaticMemory>();
    l.peak_activations = r.pod<double>();
    l.peak_memory = r.pod<double>();
    l.memory_timeline = r.pods<MemoryPoint>();
    l.parameters = r.pod<double>();
    s.lanes.push_back(std::move(l));
  }
  auto labels = r.pod<uint64_t>();
  for (uint64_t i = 0; i < labels; ++i) s.labels.push_back(r.str());
  auto axes = r.pod<uint64_t>();
  for (uint64_t i = 0; i < axes; ++i) s.lane_axes.push_back(r.str());
  s.tasks = r.pods<TaskRecord>();
  return s;
}

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Frames from the child: a tag byte, then for 'P' a double (progress), for 'R' and 'E' a length
// and a payload (encoded result, error message).
void send_frame(int fd, char tag, const std::string& payload) {
  uint64_t n = payload.size();
  write_all(fd, &tag, 1);
  write_all(fd, &n, sizeof n);
  write_all(fd, payload.data(), payload.size());
}

// Runs `work` in a child process and returns its encoded result (frame 'R') or its error
// (frame 'E'); progress frames ('P') from the child go to `progress`.
using ChildWork = std::function<Expected<std::string>(const std::function<void(double)>&)>;

Expected<std::string> run_isolated(const ChildWork& work,
                                   const std::function<void(double)>& progress) {
  int fds[2];
  if (::pipe(fds) != 0) {
    return Error(fmt::format("cannot create a pipe for the simulation: {}", std::strerror(errno)));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Error(fmt::format("cannot start the simulation process: {}", std::strerror(errno)));
  }
  if (pid == 0) {
    ::close(fds[0]);
    const int fd = fds[1];
    std::function<void(double)> child_progress;
    if (progress) {
      child_progress = [fd](double fraction) {
        char tag = 'P';
        write_all(fd, &tag, 1);
        write_all(fd, &fraction, sizeof fraction);
      };
    }
    Expected<std::string> r = work(child_progress);
    if (r) {
      send_frame(fd, 'R', *r);
    } else {
      send_frame(fd, 'E', r.error().message());
    }
    ::close(fd);
    // Skip SimGrid's and the parent's exit handlers: the parent owns the process's resources.
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string payload;
  char status = 0;
  char tag;
  while (read_all(fds[0], &tag, 1)) {
    if (tag == 'P') {
      double f;
      if (!read_all(fds[0], &f, sizeof f)) break;
      if (progress) progress(f);
      continue;
    }
    uint64_t n;
    if (!read_all(fds[0], &n, sizeof n)) break;
    payload.resize(n);
    if (!read_all(fds[0], payload.data(), n)) break;
    status = tag;
  }
  ::close(fds[0]);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (status == 'R') return payload;
  if (status == 'E') return Error(payload);
  if (WIFSIGNALED(wstatus)) {
    return Error(
        fmt::format("the simulation process was killed by signal {} ({}); this is a "
                    "bug in nnsim: please report it with the plan and topology",
                    WTERMSIG(wstatus), strsignal(WTERMSIG(wstatus))));
  }
  return Error(
      fmt::format("the simulation process exited with status {} without a result; "
                  "this is a bug in nnsim: please report it with the plan and topology",
                  WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1));
}

}  // namespace

Expected<SimResult> simulate(const Program& program, const SimOptions& options) {
  Expected<std::string> out = run_isolated(
      [&](const std::function<void(double)>& progress) -> Expected<std::string> {
        SimOptions child = options;
        child.progress = progress;
        Simulation sim(program, child);
        Expected<SimResult> r = sim.run();
        if (!r) return r.error();
        return encode(*r);
      },
      options.progress);
  if (!out) return out.error();
  return decode(*out);
}

Expected<std::vector<double>> simulate_communication(const Topology& topology,
                                                     const CommModel& comm,
                                                     const std::vector<CommRequest>& requests) {
  Expected<std::string> out = run_isolated(
      [&](const std::function<void(double)>&) -> Expected<std::string> {
        Expected<std::vector<double>> r = run_communication(topology, comm, requests);
        if (!r) return r.error();
        Writer w;
        w.pods(*r);
        return std::move(w.buffer());
      },
      {});
  if (!out) return out.error();
  Reader r(*out);
  return r.pods<double>();
}

}  // namespace nnsim
