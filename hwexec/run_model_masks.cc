// ALiBi biases and dropout masks (run_model_masks.h).
#include "hwexec/run_model_masks.h"

#include <ATen/CPUGeneratorImpl.h>

#include <vector>

namespace nnsim::hwexec {

at::Tensor alibi_bias(const at::Tensor& slopes, const at::Tensor& q_pos, const at::Tensor& k_pos) {
  const at::Tensor dist = (k_pos.unsqueeze(0) - q_pos.unsqueeze(1)).to(at::kFloat);  // [q, k]
  return slopes.view({-1, 1, 1}) * dist.unsqueeze(0);
}

at::Tensor alibi_slopes_of(int64_t heads, int64_t first, int64_t n, at::Device device) {
  const std::vector<double> all = alibi_slopes(heads);
  std::vector<float> mine(all.begin() + first, all.begin() + first + n);
  return at::tensor(mine, at::kFloat).to(device);
}

at::Tensor dropout_multipliers(const DropoutKey& key, int layer, DropoutSite site, int64_t rows,
                               int64_t seq, int64_t width, const at::Tensor& seq_pos,
                               int64_t first_head, int64_t n_heads, at::Device device) {
  const bool attention = site == DropoutSite::kAttention;
  const at::Tensor pos = seq_pos.to(at::kCPU);
  std::vector<at::Tensor> samples;
  for (int64_t r = 0; r < rows; ++r) {
    // Drawn on the CPU from a generator of its own, so every rank and device draws the same.
    at::Generator gen = at::detail::createCPUGenerator(
        dropout_seed(key.seed, key.iteration, layer, site, key.first_row + r, key.pass));
    const std::vector<int64_t> shape =
        attention ? std::vector<int64_t>{width, seq, seq} : std::vector<int64_t>{seq, width};
    at::Tensor keep = at::empty(shape, at::kFloat).bernoulli_(1.0 - kDropoutProbability, gen);
    if (attention) {
      keep = keep.narrow(0, first_head, n_heads).index_select(1, pos);
    } else {
      keep = keep.index_select(0, pos);
    }
    samples.push_back(keep);
  }
  return (at::stack(samples) * (1.0 / (1.0 - kDropoutProbability))).to(device);
}

}  // namespace nnsim::hwexec
