// How `nnexec run` learns that it is one rank of a job started by someone else (mpirun, srun,
// torchrun or a script; docs/hwexec.md#several-machines-mpirun-srun-torchrun): the launchers'
// rank, world size and local rank variables, and the rendezvous address (--master or
// MASTER_ADDR / MASTER_PORT). Reads only what it is given; errors name the variable and the fix.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/error.h"

namespace nnsim::hwexec {

// A variable lookup (std::getenv in nnexec; a map in tests). Returns nullptr when unset.
using Getenv = std::function<const char*(const char*)>;

struct LaunchEnv {
  std::string launcher;  // "Open MPI", "MPICH/Hydra", "torchrun-style", "Slurm"
  int rank = 0;
  int world = 1;
  int local_rank = -1;  // the rank's index on its machine; -1 when the launcher sets none
  std::string rank_variable, world_variable, local_variable;  // "RANK", "WORLD_SIZE", ...
  // "RANK/WORLD_SIZE", for messages.
  std::string variables() const { return rank_variable + "/" + world_variable; }
};

// The rank variables of the first launcher whose rank variable is set, in this order:
// OMPI_COMM_WORLD_RANK (Open MPI's mpirun), PMI_RANK (MPICH / Intel MPI's Hydra), RANK
// (torchrun-style), SLURM_PROCID (srun). An inner launcher's variables come first: Slurm's
// describe the srun task, which under `srun torchrun` or `srun mpirun` is not the rank.
// nullopt when none is set.
Expected<std::optional<LaunchEnv>> launch_from_env(const Getenv& get);

struct MasterAddress {
  std::string host;
  int port = 0;
  std::string source;  // "--master" or "MASTER_ADDR/MASTER_PORT"
};

// "HOST:PORT" or "[IPv6]:PORT"; the error names `what` (e.g. "--master").
Expected<MasterAddress> parse_host_port(const std::string& text, const std::string& what);

// --master HOST:PORT when `flag` is not empty, else MASTER_ADDR and MASTER_PORT; the error
// names both and which one is missing.
Expected<MasterAddress> master_address(const std::string& flag, const Getenv& get,
                                       const LaunchEnv& who);

// The CUDA device a rank drives, from its local rank and the GPUs this process sees: the local
// rank's GPU, or the only one when the launcher gives each process one (CUDA_VISIBLE_DEVICES).
Expected<int> gpu_for_local_rank(const LaunchEnv& who, int devices);

}  // namespace nnsim::hwexec
