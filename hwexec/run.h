// Running a plan on this machine's CPU (`nnexec run`, docs/hwexec.md): one process per mesh rank,
// each building with LibTorch the part of the model its rank owns (Megatron tensor and sequence
// parallelism, the plan's pipeline segments and block orders, interleaved too, data parallelism
// with ZeRO 0-3, recompute rules, repeated forwards), timing every operator and
// collective, and optionally checking its loss and gradients against an unpartitioned run of
// the same model and batch. Results go into an HDF5 run file (format "nnexec-run", version 1).
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim::hwexec {

inline constexpr const char* kRunFormat = "nnexec-run";
inline constexpr int kRunVersion = 1;

class Comm;

struct RunOptions {
  std::string device = "cpu";  // "cpu" (socket collectives) or "cuda" (one GPU a rank, NCCL)
  int iterations = 3;          // measured
  int warmup = 1;              // run before, not recorded
  bool check = false;          // compare the first iteration with an unpartitioned run
  int threads = 1;             // LibTorch intra-op threads per process
  unsigned long long seed = 1234;
  double rtol = 1e-4;  // check: |g - g_ref| <= rtol * max|g_ref| + atol, per parameter
  double atol = 1e-6;
  bool inject_fault = false;  // tests: the last rank perturbs one gradient before the check
  // Sample the bytes of live tensors at the end of every operator span of the last measured
  // iteration (RankResult::memory); off by default, as on a GPU each sample is a host call.
  bool memory_timeline = false;
  // --device cuda: the CUDA device this rank drives (from its local rank); -1: the rank modulo
  // the GPUs visible.
  int gpu = -1;
};

// Time of one operator (the operator graph's name) in one direction, per measured iteration:
// the sum over its calls (every layer, every micro-batch) averaged over the iterations.
struct OpTime {
  std::string name;   // "attn.qkv", ...
  std::string phase;  // "fwd", "recompute" (forward run again before its backward) or "bwd"
  double calls = 0;   // per iteration
  double seconds = 0;
};

// A collective or pipeline transfer, aggregated the same way.
struct CollTime {
  std::string kind;   // all_reduce, all_gather, reduce_scatter, send, recv
  std::string axes;   // mesh axis: "tp", "dp", "pp"
  std::string label;  // what it carries: "attn.proj", "grad", "activation", ...
  double bytes = 0;   // per call, per rank
  double calls = 0;   // per iteration
  double seconds = 0;
};

// The memory at one operator span of the last measured iteration (--memory-timeline): the bytes
// of tensors live at its end, and the most live during it (since the previous span's end).
struct OpMemory {
  std::string name;   // "attn.qkv", "optimizer", ...
  std::string phase;  // as OpTime's
  double live_bytes = 0;
  double peak_bytes = 0;
};

// One parameter shard's first-iteration gradient against its slice of the reference.
struct ParamCheck {
  std::string name;  // "layers.3.attn.qkv.weight"
  double elements = 0;
  double max_abs_error = 0;
  double ref_max_abs = 0;
  bool ok = true;
};

struct RankResult {
  int rank = 0;
  std::string host;              // the machine it ran on (empty: not recorded, older files)
  std::vector<int> coordinates;  // along the mesh axes
  std::vector<double> iteration_seconds;
  std::vector<double> losses;  // whole-job loss per measured iteration (head ranks; else empty)
  std::vector<OpTime> ops;
  std::vector<CollTime> collectives;
  double parameters = 0;       // parameters this rank holds
  double peak_rss_bytes = -1;  // the process's peak resident set (getrusage); -1 = unknown
  // --device cuda: the GPU (CUDA device index); -1 = not on a GPU.
  int gpu = -1;
  // The most bytes of tensors live at once over the measured iterations: LibTorch's CUDA caching
  // allocator on a GPU, nnexec's counting CPU allocator on a CPU (cpu_memory.h); -1 = unknown.
  double peak_allocated_bytes = -1;
  double peak_reserved_bytes = -1;  // the caching allocator's reserve (a GPU only); -1 = none
  std::vector<OpMemory> memory;     // --memory-timeline, in execution order
  // --check
  bool checked = false;
  double check_loss = 0;  // this run's first-iteration loss (head ranks)
  double reference_loss = 0;
  bool has_loss = false;
  std::vector<ParamCheck> checks;
};

struct RunResults {
  std::string device = "cpu";  // what the operators ran on
  std::string dtype = "fp32";  // what they computed in (whatever the plan's precision)
  std::string plan_json;
  std::string plan_name;
  RunOptions options;
  int world = 1;
  std::string torch_version;
  std::string device_name;   // "NVIDIA H200", or the CPU's
  std::string nccl_version;  // --device cuda
  std::vector<std::string> mesh_axes;
  std::vector<RankResult> ranks;
  // Per measured iteration, the slowest rank's time.
  std::vector<double> iteration_seconds() const;
  // --check: every parameter and the loss within tolerance.
  bool check_passed() const;
};

// Whether `nnexec run` can execute `plan` faithfully; the error names the field (and the value)
// it cannot run, e.g. "model.position: 'alibi' ...". No LibTorch needed.
Status check_runnable(const Plan& plan);
// Whether `nnexec run --check` can compare `plan`'s run with the unpartitioned fp32 reference:
// not a mixture of experts in 16 bits, whose rounding moves tokens across the top-k boundary
// (other experts, other gradients) where the fp32 reference does not.
Status check_checkable(const Plan& plan);

// What `nnexec run` computes a plan in: "bf16" when the plan's precision is bf16 (bf16 weights
// and activations, fp32 master weights, gradients and Adam), "fp16" when fp16 (the same in fp16,
// with a static loss scale), "fp8" when fp8 (bf16 with the blocks' linear layers' inputs rounded
// to fp8), else "fp32".
std::string run_dtype(const Plan& plan);

// The --check tolerance for a run computing in `dtype`: fp32, rtol 1e-4 and atol 1e-6; bf16,
// against the fp32 unpartitioned reference, kBf16CheckRtol and kBf16CheckAtol (docs/hwexec.md).
inline constexpr double kBf16CheckRtol = 1.0 / 16;  // 16 units of bf16 rounding (2^-8)
inline constexpr double kBf16CheckAtol = 1e-5;
// fp16, by the same rule: 16 units of fp16 rounding (2^-11). fp16 runs scale the loss by
// kFp16LossScale (static, Megatron's --loss-scale) and unscale the fp32 gradients before the
// optimizer.
inline constexpr double kFp16CheckRtol = 1.0 / 128;
inline constexpr double kFp16CheckAtol = 1e-6;
inline constexpr double kFp16LossScale = 1024;
// fp8 (emulated: the blocks' linear layers with e4m3 inputs and e5m2 output gradients,
// run_precision.h; the rest bf16): see docs/hwexec.md for the rule.
inline constexpr double kFp8CheckRtol = 0.5;
inline constexpr double kFp8CheckAtol = 1e-5;
void set_check_tolerance(const std::string& dtype, RunOptions* options);

// Runs this process's rank (comm.rank()) of the plan. Needs LibTorch.
Expected<RankResult> run_rank(const Plan& plan, const RunOptions& options, Comm& comm);

// A rank's result as text, for rank 0 to collect, and back.
std::string rank_to_text(const RankResult& r);
Expected<RankResult> rank_from_text(const std::string& text);

Status write_run(const std::string& path, const RunResults& r);
// Reads a run file back (hwexec/run_read.cc). Checks the format name and version and that every
// table is complete; errors name the file and the object (`run.h5: /ranks/2/ops: dataset
// 'seconds' is missing`). The per-rank check results come back from /check, so
// check_passed() says what the file's `check_passed` says.
Expected<RunResults> read_run(const std::string& path);
// The `format` attribute of an HDF5 file ("nnexec-run", "nnexec-micro", ...); an error naming the
// file when it is not HDF5 or has none.
Expected<std::string> hdf5_format(const std::string& path);

}  // namespace nnsim::hwexec
