// A rank's gradients once its blocks of an iteration have run, in `nnexec run`
// (docs/hwexec.md), internal to the LibTorch executor (run_torch.cc): the sums the program's
// epilogue runs (data-parallel without ZeRO, sequence parallelism's partial sums over tp),
// fp16's unscaling, the comparison with the unpartitioned model (--check), and Adam's step.
// ZeRO's reductions and the tied copies' sums are ZeroShards'.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "core/plan.h"
#include "hwexec/run.h"
#include "hwexec/run_context.h"
#include "hwexec/run_model.h"
#include "hwexec/run_zero_shards.h"

namespace nnsim::hwexec {

// Every gradient arrived where it should: without ZeRO on every parameter (each is used by
// every micro-batch, through its bf16 copy in a bf16 run: one without a gradient means the copy
// lost its link to the master), under ZeRO in the chunks and none left on a parameter.
void check_gradients_arrived(const std::vector<Param*>& params, int zero, int iteration);

// Data parallel without ZeRO: one all-reduce of each segment's gradients, flattened, in
// `reduce_dtype` (with expert parallelism the routed experts' apart, over `expert_group`).
void sum_data_parallel(const Plan& plan, const ModelParts& models, RankContext& ctx,
                       bool expert_parallel, const std::vector<int>& expert_group,
                       const std::string& expert_axes, at::ScalarType reduce_dtype);

// Sequence parallelism: the gradients of the parameters applied to sequence slices summed over
// the tensor-parallel group, in one buffer, after the data-parallel sums (the program's
// epilogue: "norm grad sync"); under ZeRO, the chunks' slices of them.
void sum_sequence_parallel(const ModelParts& models, const ZeroShards& shards, RankContext& ctx,
                           at::ScalarType reduce_dtype);

// fp16: the gradients (summed in fp32) divided by the static loss scale; an overflow of the
// fp16 backward fails the run naming training.precision (a static scale does not adapt).
void unscale_fp16(const std::vector<Param*>& params, const ZeroShards& shards, double scale,
                  int iteration);

// The rank's gradients (under ZeRO, its chunk of each unit, per parameter it overlaps: the
// group's chunks together cover every parameter) against the same shard of the unpartitioned
// model's `reference` (by parameter name), within `rtol` and `atol`. `inject_fault` scales the
// first one by 1.01 (to show that a check can fail).
std::vector<ParamCheck> compare_gradients(const std::vector<Param*>& params,
                                          const ZeroShards& shards,
                                          const std::map<std::string, at::Tensor>& reference,
                                          double rtol, double atol, bool inject_fault);

// Adam (lr 1e-4, betas 0.9 and 0.95, eps 1e-8) on the fp32 master weights, step `step` (from 1):
// under ZeRO the rank's chunks, whose gradient sums it then zeroes.
void adam_step(const std::vector<Param*>& params, const ZeroShards& shards, int step);

}  // namespace nnsim::hwexec
