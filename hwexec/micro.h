// Microbenchmark results (`nnexec bench`) and their HDF5 file: format "nnexec-micro", version 3,
// layout in docs/hwexec.md. Times are seconds, sizes bytes, rates FLOP/s or bytes/s.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/precision.h"

namespace nnsim::hwexec {

inline constexpr const char* kMicroFormat = "nnexec-micro";
inline constexpr int kMicroVersion = 4;
// Older files are still read: version 1 (before the attention series) has no attention; versions
// 1 and 2 hold one group size per collective (an attribute, not a column); versions 1 to 3 have
// no host copies and no host Adam.
inline constexpr int kMicroOldestVersion = 1;

// One timed configuration: the median and the fastest of `repetitions` runs after warm-up.
struct Timing {
  double seconds = 0;      // median
  double seconds_min = 0;  // fastest
};

// C = A B with A m x k and B k x n (2 m n k FLOPs).
struct GemmSample {
  double m = 0, n = 0, k = 0;
  Timing t;
  double flops() const { return 2 * m * n * k; }
};

struct GemmSeries {
  Precision precision = Precision::kFp32;
  std::vector<GemmSample> samples;
};

// A memory-bound operator over `elements` elements; it reads and writes `bytes` in all
// (its minimal traffic: every input read once, the output written once).
struct MemorySample {
  double elements = 0;
  double bytes = 0;
  Timing t;
};

struct MemorySeries {
  std::string op;                // "add", "layernorm", "softmax", "gelu", ...
  std::string dtype;             // element type, e.g. "fp32", "bf16"
  double bytes_per_element = 0;  // traffic per element (3 element sizes for a + b -> c)
  std::vector<MemorySample> samples;
};

// Causal attention over q, k, v of [batch, heads, seq, head_dim]: the forward alone, and the
// backward of the forward's output with a fixed upstream gradient.
struct AttentionSample {
  double batch = 0, heads = 0, seq = 0, head_dim = 0;
  Timing fwd, bwd;
  // Forward FLOPs as the simulator counts them (QK^T and PV over the full s x s square); the
  // backward counts twice that. A causal kernel executes about half (causal_fraction).
  double flops() const { return 4 * batch * seq * seq * heads * head_dim; }
};

struct AttentionSeries {
  std::string dtype;   // "fp32", "bf16"
  std::string kernel;  // "sdpa" (at::scaled_dot_product_attention) or "math" (matmul, mask,
                       // softmax, matmul)
  std::vector<AttentionSample> samples;
};

// A collective over `ranks` GPUs, `bytes` in nccl-tests' convention (the all-reduce buffer, the
// all-gather output, the reduce-scatter input, per GPU).
struct CollectiveSample {
  double bytes = 0;
  Timing t;
};

struct CollectiveSeries {
  std::string kind;  // "all_reduce", "all_gather", "reduce_scatter"
  int ranks = 0;
  std::string dtype;
  std::vector<CollectiveSample> samples;
};

// Every visible GPU copying `bytes` between its memory and pinned host memory at once (each on
// its own stream): the way offloading copies while all of a node's GPUs do.
struct HostCopySample {
  double bytes = 0;  // per GPU
  Timing t;          // until every GPU's copy has ended
};

struct HostCopySeries {
  std::string direction;  // "to_host" or "to_device"
  int gpus = 0;           // GPUs copying at once
  std::vector<HostCopySample> samples;
};

// The host's Adam step over `elements` fp32 weights (LibTorch's CPU Adam, every thread): the
// optimizer offloading's update. Its minimal traffic is kHostAdamBytesPerElement a weight: the
// weight, the gradient and both moments read, the weight and the moments written.
inline constexpr double kHostAdamBytesPerElement = 28;
struct HostAdamSample {
  double elements = 0;
  Timing t;
};

// nccl-tests' bus bandwidth factor: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n;
// also the fraction of `bytes` the busiest link of a ring carries. 0 for an unknown kind.
double bus_factor(const std::string& kind, int ranks);

struct MicroResults {
  std::string device = "cpu";  // "cpu" or "cuda"
  std::string device_name;     // e.g. "NVIDIA H200", or the CPU model
  int device_count = 1;        // GPUs visible (1 on a CPU)
  std::string torch_version;
  std::string nccl_version;  // empty without NCCL
  int threads = 1;           // intra-op threads (CPU)
  int warmup = 0;
  int repetitions = 0;
  bool quick = false;
  std::vector<GemmSeries> gemm;
  std::vector<MemorySeries> memory;
  std::vector<AttentionSeries> attention;
  std::vector<CollectiveSeries> collectives;
  std::vector<HostCopySeries> host_copies;  // since version 4, on a GPU only
  std::vector<HostAdamSample> host_adam;    // since version 4
  std::vector<std::string> notes;           // what was skipped and why
};

Status write_micro(const std::string& path, const MicroResults& r);
// Checks the format name and version (1 to 4), and that every series is complete and positive;
// errors name the file and the object.
Expected<MicroResults> read_micro(const std::string& path);

// "fp32" -> kFp32, ...
Expected<Precision> parse_precision(const std::string& name);

}  // namespace nnsim::hwexec
