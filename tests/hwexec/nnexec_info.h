// What the nnexec under test can run. The test binary links neither LibTorch nor the CUDA
// runtime (loading LibTorch would cost each of its few hundred test processes 0.7 s): what
// nnexec was built with comes from CMake as definitions, and what this machine's GPUs allow
// from `nnexec info`, run once per test process that asks.
#pragma once

#include <cstdio>
#include <string>

#include "hwexec/bench.h"
#include "process.h"

namespace nnsim::hwexec::testing {

// The parts of nnexec's BuildInfo known when it was configured (no versions).
inline BuildInfo nnexec_build() {
  BuildInfo b;
  b.torch = NNEXEC_HAS_TORCH;
  b.torch_cuda = NNEXEC_HAS_TORCH_CUDA;
  b.cuda = NNEXEC_HAS_CUDA;
  return b;
}

// `nnexec info`, read back: the versions and the GPU probe.
struct NnexecInfo {
  std::string torch_version;  // "1.13.0"; empty without LibTorch
  std::string nccl_version;   // empty without CUDA
  CudaProbe gpus;
  std::string text;  // the whole output, for messages
};

// The text after `label` on its line of `out` ("" when absent).
inline std::string info_line(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return "";
  size_t from = at + label.size();
  while (from < out.size() && out[from] == ' ') ++from;
  return out.substr(from, out.find('\n', from) - from);
}

// `nnexec info`'s output, read.
inline NnexecInfo parse_nnexec_info(const std::string& out) {
  NnexecInfo i;
  i.text = out;
  if (const std::string t = info_line(out, "LibTorch"); t != "not built in") i.torch_version = t;
  const std::string cuda = info_line(out, "CUDA+NCCL");
  if (const size_t at = cuda.find("NCCL "); at != std::string::npos) {
    i.nccl_version = cuda.substr(at + 5);
  }
  // "GPUs       2 x NVIDIA H100 80GB HBM3[ (LibTorch here has no CUDA: ...)]" or
  // "GPUs       none usable: REASON".
  const std::string gpus = info_line(out, "GPUs");
  const std::string none = "none usable: ";
  int devices = 0;
  int name_at = 0;
  if (gpus.rfind(none, 0) == 0) {
    i.gpus.reason = gpus.substr(none.size());
  } else if (std::sscanf(gpus.c_str(), "%d x %n", &devices, &name_at) == 1 && name_at > 0) {
    i.gpus.usable = true;
    i.gpus.devices = devices;
    const std::string name = gpus.substr(static_cast<size_t>(name_at));
    i.gpus.name = name.substr(0, name.find(" (LibTorch"));
  } else {
    i.gpus.reason = "nnexec info's GPU line did not read: '" + gpus + "'";
  }
  return i;
}

// `nnexec info` of the nnexec under test, run once per test process.
inline const NnexecInfo& nnexec_info() {
  static const NnexecInfo info = [] {
    TempDir dir;
    const RunResult r = run(dir, NNEXEC_BINARY, {"info"});
    if (r.status == 0) return parse_nnexec_info(r.out);
    NnexecInfo failed;
    failed.text = r.out + r.err;
    failed.gpus.reason = "nnexec info failed: " + failed.text;
    return failed;
  }();
  return info;
}

}  // namespace nnsim::hwexec::testing
