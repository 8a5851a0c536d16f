// Running a program the way a user does (no shell), in a test's own directory, and what came
// back: exit status, stdout, stderr.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "synthetic.h"

namespace nnsim::hwexec::testing {

struct RunResult {
  int status = -1;
  std::string out, err;
};

inline std::ostream& operator<<(std::ostream& os, const RunResult& r) {
  return os << "exit status " << r.status << "\n--- stdout ---\n"
            << r.out << "--- stderr ---\n"
            << r.err << "--------------";
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The launcher variables nnexec reads (hwexec/launch.h). Every child starts without them, so
// that a test run from inside mpirun, srun or torchrun is not taken for one rank of a job.
inline const char* const kLaunchVariables[] = {"OMPI_COMM_WORLD_RANK",
                                               "OMPI_COMM_WORLD_SIZE",
                                               "OMPI_COMM_WORLD_LOCAL_RANK",
                                               "PMI_RANK",
                                               "PMI_SIZE",
                                               "MPI_LOCALRANKID",
                                               "RANK",
                                               "WORLD_SIZE",
                                               "LOCAL_RANK",
                                               "SLURM_PROCID",
                                               "SLURM_NTASKS",
                                               "SLURM_LOCALID",
                                               "MASTER_ADDR",
                                               "MASTER_PORT"};

// A started program: its process and where its output goes.
struct Child {
  pid_t pid = -1;
  std::string out, err;
};

// Starts `program args...` (PATH lookup without a slash) in `dir` with `env` ({name, value})
// set on top of this environment (less kLaunchVariables); `tag` names its output files.
inline Child start(const TempDir& dir, const std::string& program, std::vector<std::string> args,
                   const std::vector<std::pair<std::string, std::string>>& env = {},
                   const std::string& tag = "") {
  Child c;
  c.out = dir.file("stdout" + tag + ".txt");
  c.err = dir.file("stderr" + tag + ".txt");
  const std::string work = dir.file("");
  args.insert(args.begin(), program);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  c.pid = ::fork();
  if (c.pid == 0) {
    int o = ::open(c.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = ::open(c.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    for (const char* v : kLaunchVariables) ::unsetenv(v);
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
    if (::chdir(work.c_str()) != 0) ::_exit(126);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  return c;
}

// Waits for a started program; what it did.
inline RunResult finish(const Child& c) {
  RunResult r;
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(c.out);
  r.err = slurp(c.err);
  return r;
}

// Runs `program args...` (PATH lookup without a slash) in `dir`.
inline RunResult run(const TempDir& dir, const std::string& program, std::vector<std::string> args,
                     const std::vector<std::pair<std::string, std::string>>& env = {}) {
  return finish(start(dir, program, std::move(args), env));
}

inline bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

}  // namespace nnsim::hwexec::testing
