// ALiBi biases and deterministic dropout masks for `nnexec run` (docs/hwexec.md), as slices of
// the whole model's: a rank holding some heads, some sequence positions or some samples of a
// step applies exactly the values the unpartitioned model applies to them. Internal to the
// LibTorch executor (run_torch.cc, run_context_parallel.cc).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "hwexec/run_model_ops.h"

namespace nnsim::hwexec {

// ALiBi's bias [heads, q, k] (fp32) of heads with `slopes` [heads] (fp32) for queries at
// positions q_pos [q] and keys at k_pos [k] (long, the sequence positions): slope * (k - i),
// which the causal mask leaves non-positive.
at::Tensor alibi_bias(const at::Tensor& slopes, const at::Tensor& q_pos, const at::Tensor& k_pos);

// The slopes of the global heads [first, first + n) of a model with `heads` heads, fp32 on
// `device`.
at::Tensor alibi_slopes_of(int64_t heads, int64_t first, int64_t n, at::Device device);

// What identifies a micro-batch's masks: the iteration and the global-batch rows it holds.
struct DropoutKey {
  unsigned long long seed = 0;
  int iteration = 0;
  int64_t first_row = 0;  // the micro-batch's first sample in the global batch
  int pass = 0;           // the forward pass (repeated forwards)
};

// Dropout's multipliers (0, or 1 / (1 - kDropoutProbability) for the kept elements), fp32 on
// `device`, for `rows` samples from key.first_row, at `site` of `layer`.
//  Hidden sites (embedding, residuals): the whole [seq, hidden] mask of each sample, its
//  sequence positions `seq_pos` (long) taken: [rows, seq_pos, hidden].
//  The attention: the whole [heads, seq, seq] mask of each sample, the global heads
//  [first_head, first_head + n_heads) and the query positions `seq_pos` taken, every key kept
//  in sequence order: [rows, n_heads, seq_pos, seq].
at::Tensor dropout_multipliers(const DropoutKey& key, int layer, DropoutSite site, int64_t rows,
                               int64_t seq, int64_t width, const at::Tensor& seq_pos,
                               int64_t first_head, int64_t n_heads, at::Device device);

}  // namespace nnsim::hwexec
