#include "core/model.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/input.h"
#include "core/suggest.h"

namespace nnsim {
namespace {

namespace fs = std::filesystem;

// One thing wrong with a model, tied to the field the user should change.
struct Problem {
  std::string field;
  std::string message;
};

// Divisors of n just below and just above `near`, for "use 40 or 48" hints.
std::string nearby_divisors(int64_t n, int64_t near) {
  int64_t below = 0, above = 0;
  for (int64_t d = std::min(near, n); d >= 1; --d) {
    if (n % d == 0) {
      below = d;
      break;
    }
  }
  for (int64_t d = std::max<int64_t>(near, 1); d <= n; ++d) {
    if (n % d == 0) {
      above = d;
      break;
    }
  }
  if (below == 0 || below == above) return fmt::format("{}", above);
  if (above == 0) return fmt::format("{}", below);
  return fmt::format("{} or {}", below, above);
}

// Upper bounds far beyond any real model that keep every parameter count within int64
// (layers * layer_parameters() stays below 2^60).
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // hidden, heads, kv_heads, ffn_hidden
constexpr int64_t kMaxMtpLayers = 16;  // multi-token prediction depths (DeepSeek-V3 trains 1)
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxHeadWidths = int64_t{1} << 24;  // heads x their widths (latent attention)
constexpr int64_t kMaxSeqLen = int64_t{1} << 30;

int64_t size_limit(std::string_view field) {
  if (field == "layers") return kMaxLayers;
  if (field == "vocab") return kMaxVocab;
  if (field == "seq_len") return kMaxSeqLen;
  return kMaxWidth;
}

std::string too_large(int64_t value, std::string_view field) {
  return fmt::format("{} is too large (at most {})", value, size_limit(field));
}

// The pieces of `text` between `sep`s (one piece, `text`, when there is none).
std::vector<std::string> split_on(const std::string& text, char sep) {
  std::vector<std::string> pieces(1);
  for (char c : text) {
    if (c == sep) {
      pieces.emplace_back();
    } else {
      pieces.back() += c;
    }
  }
  return pieces;
}

// A Gated DeltaNet mixer's fields; those fields without 'G' layers.
std::optional<Problem> find_gdn_problem(const ModelSpec& m) {
  if (!m.has_layer_kind('G')) {
    if (m.gdn_key_heads != 0 || m.gdn_value_heads != 0) {
      return Problem{m.gdn_key_heads != 0 ? "gdn_key_heads" : "gdn_value_heads",
                     "only 'G' layers (layer_pattern) have it; add them or remove the gdn_ "
                     "fields"};
    }
    return std::nullopt;
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"gdn_key_heads", m.gdn_key_heads},
      {"gdn_value_heads", m.gdn_value_heads},
      {"gdn_key_head_dim", m.gdn_key_head_dim},
      {"gdn_value_head_dim", m.gdn_value_head_dim},
      {"gdn_conv", m.gdn_conv},
      {"gdn_chunk", m.gdn_chunk},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0 || value > kMaxWidth) {
      return Problem{field, fmt::format("must be a positive integer up to {} for 'G' layers, "
                                        "got {}",
                                        kMaxWidth, value)};
    }
  }
  if (m.gdn_value_heads % m.gdn_key_heads != 0) {
    return Problem{"gdn_value_heads",
                   fmt::format("must be a multiple of gdn_key_heads ({}): each query/key head "
                               "serves the same number of value heads, got {}",
                               m.gdn_key_heads, m.gdn_value_heads)};
  }
  if (m.gdn_qk_width() > kMaxHeadWidths || m.gdn_v_width() > kMaxHeadWidths) {
    return Problem{"gdn_value_heads",
                   fmt::format("the mixer's widths (key heads x dim {}, value heads x dim {}) "
                               "are over the {} nnsim handles",
                               m.gdn_qk_width(), m.gdn_v_width(), kMaxHeadWidths)};
  }
  return std::nullopt;
}

// A hybrid model's pattern and its mixers; a mixer's fields without its layers.
std::optional<Problem> find_hybrid_problem(const ModelSpec& m) {
  if (auto p = find_gdn_problem(m)) return p;
  if (!m.hybrid()) {
    if (m.mamba_heads != 0) {
      return Problem{"mamba_heads",
                     "only a hybrid model has Mamba-2 layers: give 'layer_pattern' with 'M' "
                     "layers, or remove the mamba_ fields"};
    }
    if (!m.pipeline_layout.empty()) {
      return Problem{"layer_pattern", "pipeline segments need a hybrid model's layer_pattern"};
    }
    return std::nullopt;
  }
  const std::string_view kinds = "MG*-E";
  for (size_t i = 0; i < m.layer_pattern.size(); ++i) {
    if (kinds.find(m.layer_pattern[i]) == std::string_view::npos) {
      return Problem{"layer_pattern",
                     fmt::format("character {} ('{}') is not a layer kind; use 'M' (Mamba-2), "
                                 "'G' (Gated DeltaNet), '*' (attention), '-' (MLP) or 'E' "
                                 "(experts), one per layer",
                                 i + 1, m.layer_pattern[i])};
    }
  }
  if (static_cast<int64_t>(m.layer_pattern.size()) != m.layers) {
    return Problem{"layers", fmt::format("must equal the length of layer_pattern ({}), got {}; "
                                         "omit it to take the pattern's",
                                         m.layer_pattern.size(), m.layers)};
  }
  if (m.has_layer_kind('E') != m.moe()) {
    return Problem{m.moe() ? "experts" : "layer_pattern",
                   m.moe() ? "a hybrid model's experts sit in its 'E' layers, and layer_pattern "
                             "has none; add 'E' layers or remove the expert fields"
                           : "'E' layers need experts: give experts, experts_per_token and "
                             "expert_ffn_hidden"};
  }
  if (m.moe() && (m.first_dense_layers != 0 || m.moe_layer_interval != 1)) {
    return Problem{m.first_dense_layers != 0 ? "first_dense_layers" : "moe_layer_interval",
                   "a hybrid model's layer_pattern says which layers have experts ('E'); remove "
                   "this field"};
  }
  if (m.sliding_window > 0) {
    return Problem{"sliding_window",
                   "sliding windows in a hybrid model's attention layers are not modelled; "
                   "remove sliding_window or layer_pattern"};
  }
  if (!m.pipeline_layout.empty()) {
    int64_t sum = 0;
    for (int n : m.pipeline_layout) sum += n;
    const bool negative = std::any_of(m.pipeline_layout.begin(), m.pipeline_layout.end(),
                                      [](int n) { return n < 0; });
    if (negative || sum != m.layers) {
      return Problem{"layer_pattern",
                     fmt::format("its pipeline segments ('|') hold {} layers; the model has {}",
                                 sum, m.layers)};
    }
  }
  // A multi-token prediction module's block is an attention layer and the model's MLP (its
  // experts in a mixture), split as the pattern's layers of those kinds are (Qwen3-Next's).
  const char mlp_kind = m.moe() ? 'E' : '-';
  if (m.mtp_layers > 0 && (!m.has_layer_kind('*') || !m.has_layer_kind(mlp_kind))) {
    return Problem{"mtp_layers",
                   fmt::format("a hybrid model's multi-token prediction module is an attention "
                               "layer and an {} layer, parallelized as the pattern's are: "
                               "layer_pattern needs '*' and '{}' layers; add them or remove "
                               "mtp_layers",
                               m.moe() ? "expert" : "MLP", mlp_kind)};
  }
  if (!m.has_layer_kind('M')) {
    if (m.mamba_heads != 0) {
      return Problem{"mamba_heads", "layer_pattern has no 'M' layer to use it; remove it"};
    }
    return std::nullopt;
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"mamba_heads", m.mamba_heads}, {"mamba_head_dim", m.mamba_head_dim},
      {"mamba_state", m.mamba_state}, {"mamba_groups", m.mamba_groups},
      {"mamba_conv", m.mamba_conv},   {"mamba_chunk", m.mamba_chunk},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0 || value > kMaxWidth) {
      return Problem{field, fmt::format("must be a positive integer up to {} for 'M' layers, "
                                        "got {}",
                                        kMaxWidth, value)};
    }
  }
  if (m.mamba_heads % m.mamba_groups != 0) {
    return Problem{"mamba_groups",
                   fmt::format("must divide mamba_heads ({}): each group of heads shares its B "
                               "and C; use mamba_groups = {}",
                               m.mamba_heads, nearby_divisors(m.mamba_heads, m.mamba_groups))};
  }
  if (m.mamba_heads * m.mamba_head_dim > kMaxHeadWidths ||
      m.mamba_groups * m.mamba_state > kMaxHeadWidths) {
    return Problem{"mamba_heads",
                   fmt::format("the mixer's widths (heads x head_dim {}, groups x state {}) are "
                               "over the {} nnsim handles",
                               m.mamba_heads * m.mamba_head_dim, m.mamba_groups * m.mamba_state,
                               kMaxHeadWidths)};
  }
  return std::nullopt;
}

std::optional<Problem> find_problem(const ModelSpec& m) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"layers", m.layers},     {"hidden", m.hidden},         {"heads", m.heads},
      {"kv_heads", m.kv_heads}, {"ffn_hidden", m.ffn_hidden}, {"vocab", m.vocab},
      {"seq_len", m.seq_len},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0) {
      return Problem{field, fmt::format("must be a positive integer, got {}", value)};
    }
    if (value > size_limit(field)) return Problem{field, too_large(value, field)};
  }
  if (auto p = find_hybrid_problem(m)) return p;
  if (m.attention_output_gate && !m.has_layer_kind('T') && !m.has_layer_kind('*')) {
    return Problem{"attention_output_gate",
                   "layer_pattern has no attention layer ('*') to gate; remove it"};
  }
  if (m.moe()) {
    if (m.experts < 2 || m.experts > kMaxWidth) {
      return Problem{"experts", fmt::format("must be between 2 and {} for a mixture of experts "
                                            "(omit it for a dense model), got {}",
                                            kMaxWidth, m.experts)};
    }
    if (m.experts_per_token < 1 || m.experts_per_token > m.experts) {
      return Problem{"experts_per_token", fmt::format("must be between 1 and experts ({}), got {}",
                                                      m.experts, m.experts_per_token)};
    }
    if (m.expert_ffn_hidden <= 0 || m.expert_ffn_hidden > kMaxWidth) {
      return Problem{"expert_ffn_hidden", fmt::format("must be a positive integer up to {}, got {}",
                                                      kMaxWidth, m.expert_ffn_hidden)};
    }
    if (m.shared_expert_ffn_hidden < 0 || m.shared_expert_ffn_hidden > kMaxWidth) {
      return Problem{"shared_expert_ffn_hidden",
                     fmt::format("must be a positive integer up to {} (or absent: no shared "
                                 "expert), got {}",
                                 kMaxWidth, m.shared_expert_ffn_hidden)};
    }
    // Below 1 a router drops tokens; above experts / experts_per_token every expert would get
    // every token.
    const double most = static_cast<double>(m.experts) / static_cast<double>(m.experts_per_token);
    if (!(m.expert_capacity_factor >= 1 && m.expert_capacity_factor <= most)) {
      return Problem{"expert_capacity_factor",
                     fmt::format("must be between 1 (balanced) and experts / experts_per_token "
                                 "({:g}), got {:g}; dropping tokens (below 1) is not modelled",
                                 most, m.expert_capacity_factor)};
    }
  }
  if (m.moe() && (m.router_groups < 1 || m.experts % m.router_groups != 0)) {
    return Problem{"router_groups",
                   fmt::format("must divide experts ({}) into equal groups, got {}", m.experts,
                               m.router_groups)};
  }
  if (m.moe() && (m.router_group_topk < 1 || m.router_group_topk > m.router_groups ||
                  m.router_group_topk * (m.experts / m.router_groups) < m.experts_per_token)) {
    return Problem{"router_group_topk",
                   fmt::format("must be between 1 and router_groups ({}) with room for "
                               "experts_per_token ({}) in its groups, got {}",
                               m.router_groups, m.experts_per_token, m.router_group_topk)};
  }
  if (m.moe() && (m.moe_layer_interval < 1 || m.moe_layer_interval > m.layers)) {
    return Problem{"moe_layer_interval",
                   fmt::format("must be between 1 (every block has experts) and layers ({}), "
                               "got {}",
                               m.layers, m.moe_layer_interval)};
  }
  if (m.moe() && (m.first_dense_layers < 0 || m.first_dense_layers >= m.layers)) {
    return Problem{"first_dense_layers",
                   fmt::format("must be between 0 and layers - 1 ({}) so that a block has "
                               "experts, got {}; a model without expert blocks has no 'experts'",
                               m.layers - 1, m.first_dense_layers)};
  }
  if (m.mla()) {
    const std::pair<const char*, int64_t> widths[] = {
        {"kv_lora_rank", m.kv_lora_rank},
        {"qk_nope_head_dim", m.qk_nope_head_dim},
        {"qk_rope_head_dim", m.qk_rope_head_dim},
        {"v_head_dim", m.v_head_dim},
    };
    for (const auto& [field, value] : widths) {
      if (value <= 0 || value > kMaxWidth) {
        return Problem{field, fmt::format("must be a positive integer up to {} for multi-head "
                                          "latent attention, got {}",
                                          kMaxWidth, value)};
      }
    }
    // Every head's query, key and value widths together stay within a bound that keeps the
    // up-projections' parameter counts (and layers times them) within int64.
    const int64_t per_token = m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim);
    if (per_token > kMaxHeadWidths) {
      return Problem{"v_head_dim",
                     fmt::format("heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) is "
                                 "{}, over the {} nnsim handles; use narrower heads or fewer",
                                 per_token, kMaxHeadWidths)};
    }
    if (m.q_lora_rank < 0 || m.q_lora_rank > kMaxWidth) {
      return Problem{"q_lora_rank", fmt::format("must be between 0 (queries straight from the "
                                                "hidden state) and {}, got {}",
                                                kMaxWidth, m.q_lora_rank)};
    }
    if (m.kv_heads != m.heads) {
      return Problem{"kv_heads", fmt::format("multi-head latent attention gives every head its "
                                             "own key and value: kv_heads must equal heads "
                                             "({}) or be omitted, got {}",
                                             m.heads, m.kv_heads)};
    }
    if (m.qk_norm) {
      return Problem{"qk_norm",
                     "multi-head latent attention normalizes its latents, not per-head queries "
                     "and keys; remove qk_norm"};
    }
    if (m.attention_output_gate) {
      return Problem{"attention_output_gate",
                     "an output gate on multi-head latent attention is not modelled; remove "
                     "attention_output_gate"};
    }
    if (m.head_width > 0) {
      return Problem{"head_dim",
                     "multi-head latent attention's heads are qk_nope_head_dim + "
                     "qk_rope_head_dim (queries, keys) and v_head_dim (values) wide; remove "
                     "head_dim"};
    }
    return std::nullopt;  // heads need not divide hidden: their widths are given
  }
  if (m.head_width != 0) {
    // Heads of their own width need not divide hidden.
    if (m.head_width < 0 || m.head_width > kMaxWidth) {
      return Problem{"head_dim", fmt::format("must be a positive integer up to {} (or absent: "
                                             "hidden / heads), got {}",
                                             kMaxWidth, m.head_width)};
    }
    if (m.heads * m.head_width > kMaxHeadWidths) {
      return Problem{"head_dim",
                     fmt::format("heads x head_dim is {}, over the {} nnsim handles; use "
                                 "narrower heads or fewer",
                                 m.heads * m.head_width, kMaxHeadWidths)};
    }
  } else if (m.hidden % m.heads != 0) {
    return Problem{"heads",
                   fmt::format("heads ({}) must divide hidden ({}) so that every head has the "
                               "same width; use heads = {}, change hidden, or give head_dim",
                               m.heads, m.hidden, nearby_divisors(m.hidden, m.heads))};
  }
  if (m.kv_heads > m.heads || m.heads % m.kv_heads != 0) {
    return Problem{
        "kv_heads",
        fmt::format("kv_heads ({}) must divide heads ({}): each key/value head serves "
                    "the same number of query heads; use kv_heads = {} (or omit it for "
                    "plain multi-head attention)",
                    m.kv_heads, m.heads, nearby_divisors(m.heads, std::min(m.kv_heads, m.heads)))};
  }
  return std::nullopt;
}

// Signs are checked by find_problem, after all fields are read; the upper bound is checked here
// too so that `layers` cannot wrap when narrowed to int.
int64_t read_size(const InputNode& parent, std::string_view field) {
  InputNode node = parent[field];
  int64_t v = node.as_int();
  if (v > size_limit(field)) node.fail(too_large(v, field));
  return v;
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// Preset names contain dots ("gpt3-1.3b"), so only a directory or a YAML/JSON extension marks
// a string as a path.
bool looks_like_path(const std::string& s) {
  std::string ext = fs::path(s).extension().string();
  return s.find('/') != std::string::npos || ext == ".yaml" || ext == ".yml" || ext == ".json";
}

std::string models_dir() {
  return std::string(NNSIM_SOURCE_DIR) + "/models";
}

}  // namespace

int ModelSpec::moe_layers() const {
  int n = 0;
  for (int l = 0; l < layers; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelSpec::attention_parameters() const {
  const int64_t h = hidden;
  auto norm_of = [&](int64_t width) {
    return width + (norm == NormKind::kLayerNorm && bias ? width : 0);
  };
  auto linear = [&](int64_t in, int64_t out) { return in * out + (bias ? out : 0); };
  if (!mla()) {
    const int64_t d = head_dim();
    // Q, K, V and, with an output gate, the gate (one channel per query channel).
    const int64_t qkv_out = (heads + 2 * kv_heads + (attention_output_gate ? heads : 0)) * d;
    // The norm, the fused Q, K, V projection, the query and key norms and the output projection.
    return norm_of(h) + linear(h, qkv_out) + (qk_norm ? 2 * norm_of(d) : 0) + linear(heads * d, h) +
           (post_norms ? norm_of(h) : 0);
  }
  const int64_t qk = qk_nope_head_dim + qk_rope_head_dim;
  int64_t p = norm_of(h);
  p += q_lora_rank > 0
           ? linear(h, q_lora_rank) + norm_of(q_lora_rank) + linear(q_lora_rank, heads * qk)
           : linear(h, heads * qk);
  p += linear(h, kv_lora_rank + qk_rope_head_dim) + norm_of(kv_lora_rank);
  p += linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim));
  p += linear(heads * v_head_dim, h);
  if (post_norms) p += norm_of(h);
  return p;
}

int ModelSpec::windowed_layers() const {
  int n = 0;
  for (int l = 0; l < layers; ++l) n += is_windowed_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelSpec::dense_layer_parameters() const {
  const int64_t h = hidden;
  // The norm before the MLP and, with post_norms, the one after it.
  const int64_t mlp_norm =
      (h + (norm == NormKind::kLayerNorm && bias ? h : 0)) * (post_norms ? 2 : 1);
  return attention_parameters() + mlp_norm + mlp_parameters(ffn_hidden);
}

int64_t ModelSpec::layer_parameters() const {
  if (!moe()) return dense_layer_parameters();
  int64_t p = dense_layer_parameters() - mlp_parameters(ffn_hidden);
  p += hidden * experts + experts * mlp_parameters(expert_ffn_hidden);  // router, experts
  if (shared_expert_ffn_hidden > 0) p += mlp_parameters(shared_expert_ffn_hidden);
  return p;
}

int64_t ModelSpec::mlp_parameters(int64_t f) const {
  const int64_t h = hidden;
  return gated_mlp() ? 3 * h * f + (bias ? 2 * f + h : 0)  // gate and up (h->f), down (f->h)
                     : 2 * h * f + (bias ? f + h : 0);     // up (h->f), down (f->h)
}

int64_t ModelSpec::expert_parameters() const {
  return moe() ? moe_layers() * experts * mlp_parameters(expert_ffn_hidden) : 0;
}

int64_t ModelSpec::embedding_parameters() const {
  return vocab * hidden + (position == PositionKind::kLearned ? seq_len * hidden : 0);
}

int64_t ModelSpec::head_parameters() const {
  const int64_t final_norm = hidden + (norm == NormKind::kLayerNorm && bias ? hidden : 0);
  return final_norm + (tied_embeddings ? 0 : vocab * hidden) + mtp_layers * mtp_parameters();
}

int64_t ModelSpec::mtp_parameters() const {
  const int64_t norm_params = hidden + (norm == NormKind::kLayerNorm && bias ? hidden : 0);
  // The embedding's and the hidden state's norms, the 2h -> h projection, a block (with experts
  // in a mixture) and the output head's norm; the embedding and the projection are shared.
  return 3 * norm_params + 2 * hidden * hidden + layer_parameters();
}

std::string ModelSpec::layer_kinds() const {
  std::string kinds;
  for (char c : layer_pattern) {
    if (kinds.find(c) == std::string::npos) kinds += c;
  }
  return kinds;
}

int ModelSpec::block_shapes() const {
  if (!hybrid()) return mixed_layers() ? 2 : 1;
  return static_cast<int>(layer_kinds().size());
}

int ModelSpec::block_shape(int layer) const {
  if (!hybrid()) return mixed_layers() && !is_moe_layer(layer) ? 1 : 0;
  return static_cast<int>(layer_kinds().find(layer_pattern[layer]));
}

std::vector<int> ModelSpec::block_shape_of_layers() const {
  std::vector<int> out(std::max(0, layers), 0);
  const std::string kinds = layer_kinds();
  for (int l = 0; l < layers; ++l) {
    out[l] = hybrid() ? static_cast<int>(kinds.find(layer_pattern[l])) : block_shape(l);
  }
  return out;
}

int64_t ModelSpec::mamba_layer_parameters() const {
  const int64_t h = hidden, d = mamba_inner(), c = mamba_conv_width();
  const int64_t norm_params = h + (norm == NormKind::kLayerNorm && bias ? h : 0);
  // The norm, the input projection, the convolution's taps and bias, each head's dt bias, decay
  // (A) and skip (D), the gated norm's scale and the output projection.
  return norm_params + h * mamba_in_width() + c * mamba_conv + c + 3 * mamba_heads + d + d * h;
}

int64_t ModelSpec::gdn_layer_parameters() const {
  const int64_t h = hidden;
  const int64_t norm_params = h + (norm == NormKind::kLayerNorm && bias ? h : 0);
  // The norm, the input projection, the convolution's taps (no bias: Megatron-Core's and
  // Qwen3-Next's), each value head's dt bias and decay (A), the gated norm's scale (one value
  // head's width, shared by the heads) and the output projection.
  return norm_params + h * gdn_in_width() + gdn_conv_width() * gdn_conv + 2 * gdn_value_heads +
         gdn_value_head_dim + gdn_v_width() * h;
}

int64_t ModelSpec::parameters() const {
  if (hybrid()) {
    const int64_t norm_params = hidden + (norm == NormKind::kLayerNorm && bias ? hidden : 0);
    // An 'E' layer's router, experts and shared expert.
    const int64_t shared =
        shared_expert_ffn_hidden > 0 ? mlp_parameters(shared_expert_ffn_hidden) : 0;
    const int64_t experts_mlp =
        hidden * experts + experts * mlp_parameters(expert_ffn_hidden) + shared;
    int64_t p = embedding_parameters() + head_parameters();
    for (char c : layer_pattern) {
      p += c == 'M'   ? mamba_layer_parameters()
           : c == 'G' ? gdn_layer_parameters()
           : c == '*' ? attention_parameters()
           : c == '-' ? norm_params + mlp_parameters(ffn_hidden)
                      : norm_params + experts_mlp;
    }
    return p;
  }
  const int64_t moe_blocks = moe() ? moe_layers() : layers;
  return moe_blocks * layer_parameters() + (layers - moe_blocks) * dense_layer_parameters() +
         embedding_parameters() + head_parameters();
}

Status validate_model(const ModelSpec& model) {
  if (auto p = find_problem(model)) {
    return Error(fmt::format("model '{}': field '{}': {}", model.name, p->field, p->message));
  }
  return Status::Ok();
}

ModelSpec parse_model_node(const InputNode& node, const std::string& default_name) {
  node.check_keys({"name",
                   "family",
                   "layers",
                   "hidden",
                   "heads",
                   "kv_heads",
                   "head_dim",
                   "qk_norm",
                   "post_norms",
                   "mtp_layers",
                   "ffn_hidden",
                   "mlp",
                   "vocab",
                   "seq_len",
                   "tied_embeddings",
                   "position",
                   "norm",
                   "bias",
                   "dropout",
                   "attention",
                   "loss",
                   "precision",
                   "experts",
                   "experts_per_token",
                   "expert_ffn_hidden",
                   "expert_capacity_factor",
                   "shared_expert_ffn_hidden",
                   "first_dense_layers",
                   "moe_layer_interval",
                   "router_groups",
                   "router_group_topk",
                   "q_lora_rank",
                   "kv_lora_rank",
                   "qk_nope_head_dim",
                   "qk_rope_head_dim",
                   "v_head_dim",
                   "sliding_window",
                   "full_attention_interval",
                   "layer_pattern",
                   "mamba_heads",
                   "mamba_head_dim",
                   "mamba_state",
                   "mamba_groups",
                   "mamba_conv",
                   "mamba_chunk",
                   "gdn_key_heads",
                   "gdn_value_heads",
                   "gdn_key_head_dim",
                   "gdn_value_head_dim",
                   "gdn_conv",
                   "gdn_chunk",
                   "attention_output_gate"});
  ModelSpec m;
  m.name = node.get_string("name", default_name);
  m.family = node.get_string("family", "");
  // Megatron-LM's full notation: "<main>/<mtp>/<mtp>...", the main part's '|' between pipeline
  // segments.
  m.layer_pattern = node.get_string("layer_pattern", "");
  if (node.has("layer_pattern") && m.layer_pattern.find_first_of("[]") != std::string::npos) {
    node["layer_pattern"].fail(
        "layer groups ('[...]') are not read; write the group's layers one after another");
  }
  const std::vector<std::string> parts = split_on(m.layer_pattern, '/');
  m.layer_pattern = parts.front();
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].empty() || parts[i] != parts[1]) {
      node["layer_pattern"].fail(
          fmt::format("its prediction-module parts (after '/') must all be the same and not "
                      "empty, got '{}'",
                      parts[i]));
    }
  }
  const int mtp_from_pattern = static_cast<int>(parts.size()) - 1;
  const std::string mtp_pattern = mtp_from_pattern > 0 ? parts[1] : "";
  if (const std::vector<std::string> segments = split_on(m.layer_pattern, '|');
      segments.size() > 1) {
    m.layer_pattern.clear();
    for (const std::string& segment : segments) {
      m.pipeline_layout.push_back(static_cast<int>(segment.size()));
      m.layer_pattern += segment;
    }
  }
  if (node.has("layer_pattern") && m.layer_pattern.empty()) {
    node["layer_pattern"].fail(
        "must name one kind a layer ('M', 'G', '*', '-', 'E'), or be absent (transformer "
        "blocks)");
  }
  const bool layers_from_pattern = m.hybrid() && !node.has("layers");
  m.layers =
      layers_from_pattern
          ? static_cast<int>(std::min<size_t>(m.layer_pattern.size(), size_limit("layers") + 1))
          : static_cast<int>(read_size(node, "layers"));
  m.hidden = read_size(node, "hidden");
  m.heads = read_size(node, "heads");
  m.kv_heads = node.has("kv_heads") ? read_size(node, "kv_heads") : m.heads;
  if (node.has("head_dim")) {
    m.head_width = read_size(node, "head_dim");
    if (m.head_width <= 0) {
      node["head_dim"].fail(fmt::format(
          "must be a positive integer (or absent: hidden / heads), got {}", m.head_width));
    }
  }
  m.ffn_hidden = read_size(node, "ffn_hidden");
  m.vocab = read_size(node, "vocab");
  m.seq_len = read_size(node, "seq_len");
  m.mlp = node["mlp"].as_enum<MlpKind>({{"gelu", MlpKind::kGelu},
                                        {"swiglu", MlpKind::kSwiglu},
                                        {"geglu", MlpKind::kGeglu},
                                        {"squared_relu", MlpKind::kSquaredRelu},
                                        {"relu", MlpKind::kRelu}});
  m.tied_embeddings = node.get_bool("tied_embeddings", false);
  if (auto n = node.get("position")) {
    m.position = n->as_enum<PositionKind>({{"learned", PositionKind::kLearned},
                                           {"rope", PositionKind::kRope},
                                           {"alibi", PositionKind::kAlibi},
                                           {"none", PositionKind::kNone}});
  }
  if (auto n = node.get("norm")) {
    m.norm = n->as_enum<NormKind>(
        {{"layernorm", NormKind::kLayerNorm}, {"rmsnorm", NormKind::kRmsNorm}});
  }
  m.bias = node.get_bool("bias", true);
  m.qk_norm = node.get_bool("qk_norm", false);
  m.post_norms = node.get_bool("post_norms", false);
  if (node.has("mtp_layers")) {
    InputNode n = node["mtp_layers"];
    const int64_t v = n.as_int();
    if (v < 0 || v > kMaxMtpLayers) {
      n.fail(fmt::format("must be between 0 (no multi-token prediction) and {}, got {}",
                         kMaxMtpLayers, v));
    }
    m.mtp_layers = static_cast<int>(v);
    if (mtp_from_pattern > 0 && m.mtp_layers != mtp_from_pattern) {
      n.fail(fmt::format("layer_pattern gives {} prediction modules ('/'); remove one of the two",
                         mtp_from_pattern));
    }
  } else if (mtp_from_pattern > 0) {
    if (mtp_from_pattern > kMaxMtpLayers) {
      node["layer_pattern"].fail(fmt::format("at most {} prediction modules ('/'), got {}",
                                             kMaxMtpLayers, mtp_from_pattern));
    }
    m.mtp_layers = mtp_from_pattern;
  }
  m.dropout = node.get_bool("dropout", false);
  if (auto n = node.get("attention")) {
    m.attention = n->as_enum<AttentionKernel>(
        {{"flash", AttentionKernel::kFlash}, {"unfused", AttentionKernel::kUnfused}});
  }
  if (auto n = node.get("loss")) {
    const std::string name = n->as_string();
    Expected<LossKernel> loss = parse_loss_kernel(name);
    if (!loss) n->fail_unknown(name, loss_kernel_names());
    m.loss = *loss;
  }
  if (auto n = node.get("precision")) {
    m.precision = n->as_enum<Precision>({{"fp32", Precision::kFp32},
                                         {"tf32", Precision::kTf32},
                                         {"bf16", Precision::kBf16},
                                         {"fp16", Precision::kFp16},
                                         {"fp8", Precision::kFp8}});
  }
  if (node.has("experts")) {
    m.experts = read_size(node, "experts");
    m.experts_per_token = read_size(node, "experts_per_token");  // required with experts
    m.expert_ffn_hidden =
        node.has("expert_ffn_hidden") ? read_size(node, "expert_ffn_hidden") : m.ffn_hidden;
    if (auto c = node.get("expert_capacity_factor")) m.expert_capacity_factor = c->as_double();
    if (node.has("shared_expert_ffn_hidden")) {
      m.shared_expert_ffn_hidden = read_size(node, "shared_expert_ffn_hidden");
    }
    // A count of layers: range-checked here so that it cannot wrap when narrowed to int.
    auto read_layer_count = [&](const char* field) {
      InputNode n = node[field];
      const int64_t v = n.as_int();
      if (v < 0 || v > m.layers) {
        n.fail(fmt::format("must be between 0 and layers ({}), got {}", m.layers, v));
      }
      return static_cast<int>(v);
    };
    if (node.has("first_dense_layers"))
      m.first_dense_layers = read_layer_count("first_dense_layers");
    if (node.has("moe_layer_interval"))
      m.moe_layer_interval = read_layer_count("moe_layer_interval");
    if (node.has("router_groups")) {
      m.router_groups = read_size(node, "router_groups");
      // Required with router_groups.
      m.router_group_topk = read_size(node, "router_group_topk");
    } else if (node.has("router_group_topk")) {
      node["router_group_topk"].fail("group-limited routing needs 'router_groups' too");
    }
  } else {
    for (const char* f : {"experts_per_token", "expert_ffn_hidden", "expert_capacity_factor",
                          "shared_expert_ffn_hidden", "first_dense_layers", "moe_layer_interval",
                          "router_groups", "router_group_topk"}) {
      if (node.has(f)) node[f].fail("only a mixture of experts has it; give 'experts' too");
    }
  }
  if (node.has("kv_lora_rank")) {
    m.kv_lora_rank = read_size(node, "kv_lora_rank");
    // Required with kv_lora_rank.
    m.qk_nope_head_dim = read_size(node, "qk_nope_head_dim");
    m.qk_rope_head_dim = read_size(node, "qk_rope_head_dim");
    m.v_head_dim = read_size(node, "v_head_dim");
    if (node.has("q_lora_rank")) m.q_lora_rank = read_size(node, "q_lora_rank");
  } else {
    for (const char* f : {"q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
      if (node.has(f)) {
        node[f].fail("only multi-head latent attention has it; give 'kv_lora_rank' too");
      }
    }
  }
  if (node.has("sliding_window")) {
    InputNode n = node["sliding_window"];
    m.sliding_window = n.as_int();
    if (m.sliding_window <= 0) {
      n.fail(
          fmt::format("must be a positive number of tokens (or absent: every layer attends "
                      "to the whole causal prefix), got {}",
                      m.sliding_window));
    }
    if (node.has("full_attention_interval")) {
      InputNode f = node["full_attention_interval"];
      const int64_t v = f.as_int();
      if (v < 0 || v > m.layers) {
        f.fail(
            fmt::format("must be between 0 (every layer attends within the window) and "
                        "layers ({}), got {}",
                        m.layers, v));
      }
      m.full_attention_interval = static_cast<int>(v);
    }
  } else if (node.has("full_attention_interval")) {
    node["full_attention_interval"].fail(
        "says which layers attend beyond a sliding window; give 'sliding_window' too");
  }
  for (auto [field, value] :
       {std::pair{"mamba_heads", &m.mamba_heads}, std::pair{"mamba_head_dim", &m.mamba_head_dim},
        std::pair{"mamba_state", &m.mamba_state}, std::pair{"mamba_groups", &m.mamba_groups},
        std::pair{"mamba_conv", &m.mamba_conv}, std::pair{"mamba_chunk", &m.mamba_chunk}}) {
    if (node.has(field)) *value = node[field].as_int();
  }
  if (!m.has_layer_kind('M')) {
    for (const char* f :
         {"mamba_head_dim", "mamba_state", "mamba_groups", "mamba_conv", "mamba_chunk"}) {
      if (node.has(f)) node[f].fail("only 'M' layers (layer_pattern) have it; remove it");
    }
  }
  for (auto [field, value] :
       {std::pair{"gdn_key_heads", &m.gdn_key_heads},
        std::pair{"gdn_value_heads", &m.gdn_value_heads},
        std::pair{"gdn_key_head_dim", &m.gdn_key_head_dim},
        std::pair{"gdn_value_head_dim", &m.gdn_value_head_dim}, std::pair{"gdn_conv", &m.gdn_conv},
        std::pair{"gdn_chunk", &m.gdn_chunk}}) {
    if (node.has(field)) *value = node[field].as_int();
  }
  if (!m.has_layer_kind('G')) {
    for (const char* f : {"gdn_key_heads", "gdn_value_heads", "gdn_key_head_dim",
                          "gdn_value_head_dim", "gdn_conv", "gdn_chunk"}) {
      if (node.has(f)) node[f].fail("only 'G' layers (layer_pattern) have it; remove it");
    }
  }
  m.attention_output_gate = node.get_bool("attention_output_gate", false);
  // nnsim's prediction module is an attention layer and the model's MLP (or experts).
  if (const std::string module = m.moe() ? "*E" : "*-";
      mtp_from_pattern > 0 && mtp_pattern != module) {
    node["layer_pattern"].fail(
        fmt::format("a prediction module of pattern '{}' is not modelled; nnsim's is an attention "
                    "layer and the model's {} ('{}')",
                    mtp_pattern, m.moe() ? "experts" : "MLP", module));
  }
  if (auto p = find_problem(m)) {
    // Point at the offending field; kv_heads may be absent (defaulted), then at the mapping.
    if (node.has(p->field)) node[p->field].fail(p->message);
    node.fail(fmt::format("field '{}': {}", p->field, p->message));
  }
  return m;
}

std::string model_to_json(const ModelSpec& m) {
  nlohmann::ordered_json j;
  j["name"] = m.name;
  j["family"] = m.family;
  j["layers"] = m.layers;
  j["hidden"] = m.hidden;
  j["heads"] = m.heads;
  j["kv_heads"] = m.kv_heads;
  if (m.head_width > 0) j["head_dim"] = m.head_width;
  if (m.qk_norm) j["qk_norm"] = true;
  if (m.post_norms) j["post_norms"] = true;
  if (m.attention_output_gate) j["attention_output_gate"] = true;
  if (m.mtp_layers > 0) j["mtp_layers"] = m.mtp_layers;
  j["ffn_hidden"] = m.ffn_hidden;
  j["mlp"] = to_string(m.mlp);
  j["vocab"] = m.vocab;
  j["seq_len"] = m.seq_len;
  j["tied_embeddings"] = m.tied_embeddings;
  j["position"] = to_string(m.position);
  j["norm"] = to_string(m.norm);
  j["bias"] = m.bias;
  j["dropout"] = m.dropout;
  j["attention"] = to_string(m.attention);
  j["loss"] = to_string(m.loss);
  j["precision"] = to_string(m.precision);
  if (m.moe()) {
    j["experts"] = m.experts;
    j["experts_per_token"] = m.experts_per_token;
    j["expert_ffn_hidden"] = m.expert_ffn_hidden;
    if (m.expert_capacity_factor != 1) j["expert_capacity_factor"] = m.expert_capacity_factor;
    if (m.shared_expert_ffn_hidden > 0) j["shared_expert_ffn_hidden"] = m.shared_expert_ffn_hidden;
    if (m.first_dense_layers > 0) j["first_dense_layers"] = m.first_dense_layers;
    if (m.moe_layer_interval != 1) j["moe_layer_interval"] = m.moe_layer_interval;
    if (m.router_groups != 1) {
      j["router_groups"] = m.router_groups;
      j["router_group_topk"] = m.router_group_topk;
    }
  }
  if (m.sliding_window > 0) {
    j["sliding_window"] = m.sliding_window;
    j["full_attention_interval"] = m.full_attention_interval;
  }
  if (m.hybrid()) {
    std::string pattern = m.layer_pattern;
    if (!m.pipeline_layout.empty()) {  // the segments' boundaries written back as '|'
      pattern.clear();
      size_t at = 0;
      for (size_t i = 0; i < m.pipeline_layout.size(); ++i) {
        if (i > 0) pattern += '|';
        pattern += m.layer_pattern.substr(at, m.pipeline_layout[i]);
        at += m.pipeline_layout[i];
      }
    }
    j["layer_pattern"] = pattern;
    if (m.has_layer_kind('M')) {
      j["mamba_heads"] = m.mamba_heads;
      j["mamba_head_dim"] = m.mamba_head_dim;
      j["mamba_state"] = m.mamba_state;
      j["mamba_groups"] = m.mamba_groups;
      j["mamba_conv"] = m.mamba_conv;
      j["mamba_chunk"] = m.mamba_chunk;
    }
    if (m.has_layer_kind('G')) {
      j["gdn_key_heads"] = m.gdn_key_heads;
      j["gdn_value_heads"] = m.gdn_value_heads;
      j["gdn_key_head_dim"] = m.gdn_key_head_dim;
      j["gdn_value_head_dim"] = m.gdn_value_head_dim;
      j["gdn_conv"] = m.gdn_conv;
      j["gdn_chunk"] = m.gdn_chunk;
    }
  }
  if (m.mla()) {
    if (m.q_lora_rank > 0) j["q_lora_rank"] = m.q_lora_rank;
    j["kv_lora_rank"] = m.kv_lora_rank;
    j["qk_nope_head_dim"] = m.qk_nope_head_dim;
    j["qk_rope_head_dim"] = m.qk_rope_head_dim;
    j["v_head_dim"] = m.v_head_dim;
  }
  return j.dump();
}

Expected<ModelSpec> parse_model(const std::string& yaml_text, const std::string& display_name) {
  return catch_input_errors<ModelSpec>(display_name, [&] {
    return parse_model_node(InputNode::load_string(yaml_text, display_name),
                            fs::path(display_name).stem().string());
  });
}

Expected<ModelSpec> load_model(const std::string& path_or_preset) {
  return load_model(path_or_preset, {}, "");
}

Expected<ModelSpec> load_model(const std::string& path_or_preset,
                               const std::vector<FieldOverride>& overrides,
                               const std::string& flag) {
  std::string path = path_or_preset;
  // An existing file wins over a preset of the same name.
  if (!is_file(path) && !path.empty() && path.find('/') == std::string::npos) {
    std::string preset = model_preset_path(path);
    if (is_file(preset)) {
      path = preset;
    } else if (!looks_like_path(path)) {
      return Error(fmt::format("model '{}' is neither a file nor a preset in {}{}", path,
                               models_dir(), suggest(path, model_preset_names())));
    }
  }
  Expected<ModelSpec> m = catch_input_errors<ModelSpec>(path, [&] {
    return parse_model_node(InputNode::load_file(path, overrides, flag),
                            fs::path(path).stem().string());
  });
  if (m) m->name = name_with_overrides(m->name, overrides);
  return m;
}

std::string model_preset_path(const std::string& name) {
  return models_dir() + "/" + name + ".yaml";
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(models_dir(), ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".yaml") names.push_back(p.stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string_view to_string(MlpKind k) {
  switch (k) {
    case MlpKind::kGelu:
      return "gelu";
    case MlpKind::kSwiglu:
      return "swiglu";
    case MlpKind::kSquaredRelu:
      return "squared_relu";
    case MlpKind::kRelu:
      return "relu";
    case MlpKind::kGeglu:
      return "geglu";
  }
  return "?";
}

std::string_view to_string(PositionKind k) {
  switch (k) {
    case PositionKind::kLearned:
      return "learned";
    case PositionKind::kRope:
      return "rope";
    case PositionKind::kAlibi:
      return "alibi";
    case PositionKind::kNone:
      return "none";
  }
  return "?";
}

std::string_view to_string(NormKind k) {
  switch (k) {
    case NormKind::kLayerNorm:
      return "layernorm";
    case NormKind::kRmsNorm:
      return "rmsnorm";
  }
  return "?";
}

std::string_view to_string(AttentionKernel k) {
  switch (k) {
    case AttentionKernel::kFlash:
      return "flash";
    case AttentionKernel::kUnfused:
      return "unfused";
  }
  return "?";
}

namespace {
constexpr LossKernel kLossKernels[] = {LossKernel::kFused, LossKernel::kVocabParallel,
                                       LossKernel::kUnfused, LossKernel::kLossParallel,
                                       LossKernel::kFlashAttn};
}  // namespace

std::vector<std::string> loss_kernel_names() {
  std::vector<std::string> names;
  for (LossKernel k : kLossKernels) names.emplace_back(to_string(k));
  return names;
}

Expected<LossKernel> parse_loss_kernel(const std::string& name) {
  for (LossKernel k : kLossKernels) {
    if (to_string(k) == name) return k;
  }
  const std::vector<std::string> names = loss_kernel_names();
  return Error(fmt::format("unknown cross-entropy kernel '{}'{} (one of {})", name,
                           suggest(name, names), fmt::join(names, ", ")));
}

std::string_view to_string(LossKernel k) {
  switch (k) {
    case LossKernel::kFused:
      return "fused";
    case LossKernel::kVocabParallel:
      return "vocab_parallel";
    case LossKernel::kUnfused:
      return "unfused";
    case LossKernel::kLossParallel:
      return "loss_parallel";
    case LossKernel::kFlashAttn:
      return "flash_attn";
  }
  return "?";
}

}  // namespace nnsim
