// Model features of `nnexec run` that need no LibTorch (docs/hwexec.md): ALiBi's per-head slopes
// and the keys of deterministic dropout, whose masks (hwexec/run_model_masks.h) are drawn over
// the whole logical tensor so that every partitioning of the model applies the same ones.
#pragma once

#include <cstdint>
#include <vector>

namespace nnsim::hwexec {

// ALiBi's slopes (Press et al. 2022, "Train short, test long"), one per attention head in head
// order: for a power of two n heads, 2^(-8 i / n) for i = 1..n; otherwise those of the largest
// power of two m below n, followed by every other slope of 2m heads (the odd i: 1, 3, ...), as
// the paper's reference code. Head h's bias on the score of query position i for key position
// j is slopes[h] * (j - i). Empty for heads < 1.
std::vector<double> alibi_slopes(int64_t heads);

// Dropout's probability (model.dropout: true; the model has no field for it): 0.1, GPT-2's and
// Megatron-LM's default hidden and attention dropout.
inline constexpr double kDropoutProbability = 0.1;

// Where dropout applies (the operator graph's sites, core/opgraph.cc): after the embedding
// (embed.dropout), on the attention probabilities (attn.core), and on the outputs of the
// attention and MLP blocks before their residual adds (attn.residual, mlp.residual).
enum class DropoutSite { kEmbedding = 0, kAttention = 1, kAttnResidual = 2, kMlpResidual = 3 };

// The seed of one sample's mask at one site: a hash of the run's seed, the iteration, the
// layer (the model's global index; -1 for the embedding), the site, the sample's row in the
// global batch and the forward pass (repeated forwards, training.recycle: each pass draws masks
// of its own; pass 0's seed does not depend on it). Any partitioning of a step (micro-batches,
// replicas, pipeline stages, ranks holding slices of the heads or the sequence) draws the same
// whole mask from it and slices it; a recomputation draws it again.
std::uint64_t dropout_seed(unsigned long long run_seed, int iteration, int layer, DropoutSite site,
                           int64_t row, int pass = 0);

// x rounded to fp8 as `nnexec run`'s fp8 emulation rounds (run_precision.h: to nearest even,
// saturating): e4m3, or e5m2 when `e5m2`. Needs LibTorch (NaN in a build without).
double fp8_round(double x, bool e5m2);

}  // namespace nnsim::hwexec
