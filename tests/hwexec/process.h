// Running a program the way a user does (no shell), in a test's own directory, and what came
// back: exit status, stdout, stderr.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
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

// Runs `program args...` (PATH lookup without a slash) in `dir`.
inline RunResult run(const TempDir& dir, const std::string& program,
                     std::vector<std::string> args) {
  RunResult r;
  const std::string out = dir.file("stdout.txt"), err = dir.file("stderr.txt");
  const std::string work = dir.file("");
  args.insert(args.begin(), program);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    if (::chdir(work.c_str()) != 0) ::_exit(126);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

inline bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

}  // namespace nnsim::hwexec::testing
