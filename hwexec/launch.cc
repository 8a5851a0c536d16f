#include "hwexec/launch.h"

#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>

namespace nnsim::hwexec {

namespace {

struct Launcher {
  const char* name;
  const char* rank;
  const char* world;
  const char* local;
};

constexpr Launcher kLaunchers[] = {
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"torchrun-style", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

// A whole number >= `min`, or nullopt.
std::optional<long> whole(const char* text, long min) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < min || v > (1L << 30)) return std::nullopt;
  return v;
}

}  // namespace

Expected<std::optional<LaunchEnv>> launch_from_env(const Getenv& get) {
  for (const Launcher& l : kLaunchers) {
    const char* rank = get(l.rank);
    if (rank == nullptr) continue;
    LaunchEnv e;
    e.launcher = l.name;
    e.rank_variable = l.rank;
    e.world_variable = l.world;
    e.local_variable = l.local;
    const char* world = get(l.world);
    if (world == nullptr) {
      return Error(
          fmt::format("{} is set ({}) but {} is not: {} sets both (the rank and the "
                      "number of ranks); set {} to the plan's number of ranks",
                      l.rank, rank, l.world, l.name, l.world));
    }
    const std::optional<long> r = whole(rank, 0), w = whole(world, 1);
    if (!r)
      return Error(fmt::format("{}='{}' is not a rank (a whole number from 0)", l.rank, rank));
    if (!w) {
      return Error(
          fmt::format("{}='{}' is not a number of ranks (a whole number from 1)", l.world, world));
    }
    if (*r >= *w) {
      return Error(
          fmt::format("{}={} is not below {}={} (ranks count from 0)", l.rank, *r, l.world, *w));
    }
    e.rank = static_cast<int>(*r);
    e.world = static_cast<int>(*w);
    if (const char* local = get(l.local)) {
      const std::optional<long> lr = whole(local, 0);
      if (!lr) {
        return Error(
            fmt::format("{}='{}' is not a local rank (a whole number from 0)", l.local, local));
      }
      e.local_rank = static_cast<int>(*lr);
    }
    return std::optional<LaunchEnv>(e);
  }
  return std::optional<LaunchEnv>();
}

Expected<MasterAddress> parse_host_port(const std::string& text, const std::string& what) {
  const auto bad = [&](const std::string& why) {
    return Error(fmt::format(
        "{} '{}': {}; expected HOST:PORT (rank 0's host and a free TCP port on it, e.g. "
        "node1:29500)",
        what, text, why));
  };
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return bad("an IPv6 address needs the form [ADDRESS]:PORT");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) return bad("no host");
  const std::optional<long> p = whole(port.c_str(), 1);
  if (!p || *p > 65535) return bad(fmt::format("'{}' is not a TCP port (1 to 65535)", port));
  return MasterAddress{host, static_cast<int>(*p), what};
}

Expected<MasterAddress> master_address(const std::string& flag, const Getenv& get,
                                       const LaunchEnv& who) {
  if (!flag.empty()) return parse_host_port(flag, "--master");
  const char* addr = get("MASTER_ADDR");
  const char* port = get("MASTER_PORT");
  const std::string fix =
      "pass --master HOST:PORT or set MASTER_ADDR and MASTER_PORT (rank 0's host and a free TCP "
      "port on it, the same for every rank)";
  if ((addr == nullptr || *addr == '\0') && port == nullptr) {
    return Error(fmt::format("rank {} of {} ({} from {}) needs the rendezvous address: {}",
                             who.rank, who.world, who.launcher, who.variables(), fix));
  }
  if (addr == nullptr || *addr == '\0') {
    return Error(fmt::format("MASTER_PORT is set but MASTER_ADDR is not: {}", fix));
  }
  if (port == nullptr) {
    return Error(fmt::format("MASTER_ADDR is set but MASTER_PORT is not: {}", fix));
  }
  const std::optional<long> p = whole(port, 1);
  if (!p || *p > 65535) {
    return Error(fmt::format("MASTER_PORT='{}' is not a TCP port (1 to 65535)", port));
  }
  return MasterAddress{addr, static_cast<int>(*p), "MASTER_ADDR/MASTER_PORT"};
}

Expected<int> gpu_for_local_rank(const LaunchEnv& who, int devices) {
  if (devices == 1) return 0;
  if (who.local_rank < 0) {
    return Error(fmt::format(
        "--device cuda: {} sets no local rank ({}), which picks this rank's GPU among the {} "
        "this process sees; set {} (the rank's index on its machine), or give each rank one "
        "GPU with CUDA_VISIBLE_DEVICES",
        who.launcher, who.local_variable, devices, who.local_variable));
  }
  if (who.local_rank >= devices) {
    return Error(fmt::format(
        "--device cuda: {}={} but this machine shows {} GPU(s): start at most one rank a GPU on "
        "each machine (or give each rank one GPU with CUDA_VISIBLE_DEVICES)",
        who.local_variable, who.local_rank, devices));
  }
  return who.local_rank;
}

}  // namespace nnsim::hwexec
