// A decoder-only transformer, described by its shape (YAML; see docs/model.md). The operator
// graph it lowers to is in core/opgraph.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/field_override.h"
#include "core/precision.h"

namespace nnsim {

// kSwiglu and kGeglu are gated: silu or GeLU (tanh form) of a gate branch times an up branch.
enum class MlpKind { kGelu, kSwiglu, kSquaredRelu, kRelu, kGeglu };
enum class PositionKind { kLearned, kRope, kAlibi, kNone };
enum class NormKind { kLayerNorm, kRmsNorm };
// kFlash: fused attention that keeps only Q, K, V, the output and the softmax statistics.
// kUnfused: the scores, softmax output and dropout mask are materialized and kept.
enum class AttentionKernel { kFlash, kUnfused };
// The cross-entropy over the vocabulary, all on fp32 logits.
// kFused: one fused kernel each way (Megatron-Core's --cross-entropy-loss-fusion): the fp32 copy
//   of the logits becomes the saved softmax, and the backward pass forms the gradient in it.
// kVocabParallel: Megatron's default vocab-parallel cross-entropy: the same buffers, but each
//   step (cast, max, subtract, exp, sum, divide; multiply, cast back) a kernel of its own.
// kUnfused: PyTorch's F.cross_entropy(logits.float()): the log-softmax output is saved, and the
//   backward pass materializes the log-softmax's gradient and the input gradient beside it.
// kLossParallel: the same call under PyTorch's loss_parallel() on vocabulary-sharded logits
//   (DTensor, torchtitan's tensor parallelism): a decomposed log-softmax, and a backward that
//   forms zeros, exp(log-softmax), their sum and the product with the output gradient.
// kFlashAttn: flash-attn's cross-entropy kernel (llm-foundry): reads the logits in their own
//   dtype, keeps them and each row's log-sum-exp for the backward, which writes the gradient from
//   them; no fp32 copy.
enum class LossKernel { kFused, kVocabParallel, kUnfused, kLossParallel, kFlashAttn };

struct ModelSpec {
  std::string name;
  std::string family;  // informational: gpt, llama, mpt, nemotron, ...
  int layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;    // == heads for multi-head attention; fewer for GQA/MQA
  int64_t ffn_hidden = 0;  // per branch for gated MLPs
  int64_t vocab = 0;
  int64_t seq_len = 0;
  MlpKind mlp = MlpKind::kGelu;
  bool tied_embeddings = false;
  PositionKind position = PositionKind::kLearned;
  NormKind norm = NormKind::kLayerNorm;
  bool bias = true;      // linear layers and norms carry bias vectors
  bool dropout = false;  // dropout layers after attention, MLP and embedding (masks kept)
  AttentionKernel attention = AttentionKernel::kFlash;
  LossKernel loss = LossKernel::kFused;
  Precision precision = Precision::kBf16;  // default compute precision of the matmuls
  // Mixture of experts (0: a dense model): every block's MLP becomes `experts` MLPs of
  // `expert_ffn_hidden` (per branch), of which a router picks `experts_per_token` for each token.
  int64_t experts = 0;
  int64_t experts_per_token = 0;
  int64_t expert_ffn_hidden = 0;
  // Expert slots per routed token copy: each expert computes (and its tokens travel) as if it
  // received this many times its even share of the routed tokens. Megatron's
  // --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity; for a dropless router
  // that loads experts unevenly, the busiest expert's load over the mean. 1: balanced, dropless.
  double expert_capacity_factor = 1;
  // A shared expert every token also goes through (DeepSeekMoE, Qwen-MoE): one MLP of this
  // inner width (several shared experts are one wider MLP); 0: none.
  int64_t shared_expert_ffn_hidden = 0;
  // Which blocks have experts: layer l (from 0) does when l >= first_dense_layers and
  // (l - first_dense_layers) % moe_layer_interval == 0 (DeepSeek's first_k_dense_replace,
  // Megatron-Core's --moe-layer-freq). The others are dense blocks with an MLP of ffn_hidden.
  int first_dense_layers = 0;
  int moe_layer_interval = 1;
  // Group-limited routing (DeepSeek-V3's node-limited routing; Megatron-Core's
  // --moe-router-num-groups and --moe-router-group-topk): the experts split into
  // router_groups equal groups and a token's experts come from at most router_group_topk of
  // them. 1 and 1: no limit.
  int64_t router_groups = 1;
  int64_t router_group_topk = 1;
  // Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank > 0): keys and values come up
  // from a shared latent of kv_lora_rank (its down-projection also yields the rotary key part,
  // qk_rope_head_dim wide, one for all heads), queries from a latent of q_lora_rank (0: straight
  // from the hidden state). Each head's query and key are qk_nope_head_dim + qk_rope_head_dim
  // wide, its value and output v_head_dim.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // Each attention head's width when it is not hidden / heads (Qwen3's, Gemma's; Megatron's
  // --kv-channels, the YAML's head_dim): the Q, K and V projections are (heads + 2 kv_heads) x
  // this wide and the output projection reads heads x this. 0: hidden / heads.
  int64_t head_width = 0;
  // Per-head norms of the queries and keys (Qwen3, OLMo 2; Megatron-Core's --qk-layernorm), of
  // the model's `norm` kind, one scale for the queries and one for the keys.
  bool qk_norm = false;
  // A norm of the model's `norm` kind on the attention's and on the MLP's output, before each
  // is added to the residual stream (Gemma 2 and 3's post_attention_layernorm and
  // post_feedforward_layernorm, beside the usual norms before them).
  bool post_norms = false;
  // DeepSeek-V3's multi-token prediction (Megatron-Core's --mtp-num-layers): modules after the
  // head, each predicting one token further ahead from the previous one's hidden state and the
  // token's embedding, through a block of the model's kind, the shared output head and a loss
  // of its own. 0: none.
  int mtp_layers = 0;
  // Sliding-window attention (Mistral's, GPT-OSS's, Gemma's): a layer's query attends to the
  // sliding_window keys up to its own position (0: every layer attends to the whole causal
  // prefix). With full_attention_interval n >= 1 every n-th layer (l + 1 divisible by n)
  // attends fully and the others within the window (GPT-OSS: 2; Gemma 3: 6); 0: every layer
  // within the window.
  int64_t sliding_window = 0;
  int full_attention_interval = 0;
  // A sigmoid gate on the attention's output, per channel, projected from the hidden state beside
  // the queries (Qwen3-Next's gated attention; Megatron-Core's --attention-output-gate).
  bool attention_output_gate = false;
  // Hybrid models (Megatron-LM's --hybrid-override-pattern): one character per layer, each its
  // own pre-norm and residual: 'M' a Mamba-2 mixer, 'G' a Gated DeltaNet mixer, '*'
  // self-attention alone, '-' an MLP of ffn_hidden alone, 'E' a mixture of experts' MLP alone.
  // Empty: every layer is a transformer block (attention and an MLP or experts).
  std::string layer_pattern;
  // Layers per pipeline segment where the pattern as written splits them ('|' in Megatron-LM's
  // notation: its flexible virtual pipeline stages); empty: the plan splits them. The
  // pattern's '/' parts (multi-token prediction modules) set mtp_layers.
  std::vector<int> pipeline_layout;
  // The Mamba-2 mixer (Dao and Gu 2024; 'M' layers): mamba_heads heads of mamba_head_dim
  // channels (the inner width d = heads x head_dim), a state of mamba_state per head, B and C
  // shared by mamba_groups groups of heads, a causal depthwise convolution of mamba_conv taps
  // and the chunked scan's chunks of mamba_chunk tokens.
  int64_t mamba_heads = 0;
  int64_t mamba_head_dim = 64;
  int64_t mamba_state = 128;
  int64_t mamba_groups = 8;
  int64_t mamba_conv = 4;
  int64_t mamba_chunk = 128;
  // The Gated DeltaNet mixer (Yang, Kautz and Hatamizadeh 2025; 'G' layers, Qwen3-Next's linear
  // attention): gdn_key_heads query/key heads of gdn_key_head_dim channels, gdn_value_heads value
  // heads of gdn_value_head_dim (a multiple of the key heads, which each serve value_heads /
  // key_heads of them), a causal depthwise convolution of gdn_conv taps over Q, K and V, and the
  // chunked delta rule's chunks of gdn_chunk tokens.
  int64_t gdn_key_heads = 0;
  int64_t gdn_value_heads = 0;
  int64_t gdn_key_head_dim = 128;
  int64_t gdn_value_head_dim = 128;
  int64_t gdn_conv = 4;
  int64_t gdn_chunk = 64;
  bool hybrid() const { return !layer_pattern.empty(); }
  // The pattern character of layer l ('T' for a transformer block of a model without pattern).
  char layer_kind(int layer) const { return hybrid() ? layer_pattern[layer] : 'T'; }
  bool has_layer_kind(char kind) const {
    return hybrid() ? layer_pattern.find(kind) != std::string::npos : kind == 'T';
  }
  int64_t mamba_inner() const { return mamba_heads * mamba_head_dim; }
  // The Mamba-2 input projection's width: z and x (inner each), B and C (groups x state each)
  // and one dt per head.
  int64_t mamba_in_width() const {
    return 2 * mamba_inner() + 2 * mamba_groups * mamba_state + mamba_heads;
  }
  // The channels the convolution runs over: x, B and C.
  int64_t mamba_conv_width() const { return mamba_inner() + 2 * mamba_groups * mamba_state; }
  int64_t mamba_layer_parameters() const;
  int64_t gdn_qk_width() const { return gdn_key_heads * gdn_key_head_dim; }     // Q's (and K's)
  int64_t gdn_v_width() const { return gdn_value_heads * gdn_value_head_dim; }  // V's (and z's)
  // The Gated DeltaNet input projection's width: Q, K, V, the output gate z, and beta and the
  // decay's input (one each per value head).
  int64_t gdn_in_width() const {
    return 2 * gdn_qk_width() + 2 * gdn_v_width() + 2 * gdn_value_heads;
  }
  // The channels its convolution runs over: Q, K and V.
  int64_t gdn_conv_width() const { return 2 * gdn_qk_width() + gdn_v_width(); }
  int64_t gdn_layer_parameters() const;
  bool windowed() const { return sliding_window > 0 && sliding_window < seq_len; }
  bool is_windowed_layer(int layer) const {
    return sliding_window > 0 &&
           (full_attention_interval == 0 || (layer + 1) % full_attention_interval != 0);
  }
  int windowed_layers() const;  // how many layers attend within the window
  // Whether the head's devices use the embedding's matrix: a tied output projection, or the
  // multi-token prediction modules' embedding lookup. Where the head is not on the embedding's
  // devices they hold a copy, whose gradient is summed with the embedding's.
  bool head_uses_embedding() const { return tied_embeddings || mtp_layers > 0; }

  int64_t head_dim() const { return head_width > 0 ? head_width : hidden / heads; }
  bool mla() const { return kv_lora_rank > 0; }
  // Parameters of a block's attention (its norm included).
  int64_t attention_parameters() const;
  bool gated_mlp() const { return mlp == MlpKind::kSwiglu || mlp == MlpKind::kGeglu; }
  bool moe() const { return experts > 0; }
  bool is_moe_layer(int layer) const {
    if (hybrid()) return layer_pattern[layer] == 'E';
    return moe() && layer >= first_dense_layers &&
           (layer - first_dense_layers) % moe_layer_interval == 0;
  }
  int moe_layers() const;  // how many blocks have experts
  // A mixture of experts with dense blocks too (two block shapes).
  bool mixed_layers() const { return moe() && moe_layers() < layers; }
  // Layers of one block shape run the same operators (sliding windows aside, which price the
  // attention only). Shapes are numbered from 0: the expert block (or a model's only block),
  // then a mixed model's dense block; in a hybrid model, the pattern's characters in the order
  // they first appear.
  int block_shapes() const;
  int block_shape(int layer) const;
  std::vector<int> block_shape_of_layers() const;  // block_shape of every layer, in one pass
  // A hybrid model's pattern characters, each once, in the order they first appear.
  std::string layer_kinds() const;
  // Parameters of one transformer block (an expert block in a mixture of experts), of a dense
  // block of a mixed model, of the embedding(s) and in total.
  int64_t layer_parameters() const;
  int64_t dense_layer_parameters() const;
  int64_t embedding_parameters() const;  // word (+ learned position) embedding
  // Output projection (0 when tied) + final norm + the multi-token prediction modules.
  int64_t head_parameters() const;
  int64_t mtp_parameters() const;  // one multi-token prediction module's own
  int64_t parameters() const;
  // Parameters of every layer's experts (0 for a dense model), and of one MLP of width `ffn`.
  int64_t expert_parameters() const;
  int64_t mlp_parameters(int64_t ffn) const;
};

// Reads a model from a YAML file, or a preset name ("gpt3-175b") from models/.
Expected<ModelSpec> load_model(const std::string& path_or_preset);
// The same with fields replaced ("seq_len=32768", "layers=40"), for what-if studies without
// copying the file; the name records them ("llama3-8b with seq_len=32768") unless one sets it.
// Errors in a replaced value name `flag` ("--model-set seq_len=x: field 'seq_len': ...").
Expected<ModelSpec> load_model(const std::string& path_or_preset,
                               const std::vector<FieldOverride>& overrides,
                               const std::string& flag);
Expected<ModelSpec> parse_model(const std::string& yaml_text, const std::string& display_name);
Status validate_model(const ModelSpec& model);

class InputNode;
// Reads and validates a model mapping inside a larger file (a plan, a validation case); throws
// InputError naming the file, line and field. `default_name` is used when the mapping has no
// `name`.
ModelSpec parse_model_node(const InputNode& node, const std::string& default_name = "");
// Every field, defaults included, as a JSON object that parse_model reads back unchanged.
std::string model_to_json(const ModelSpec& model);

std::string model_preset_path(const std::string& name);
std::vector<std::string> model_preset_names();

std::string_view to_string(MlpKind k);
std::string_view to_string(PositionKind k);
std::string_view to_string(NormKind k);
std::string_view to_string(AttentionKernel k);
std::string_view to_string(LossKernel k);
// "fused", "vocab_parallel", "unfused", "loss_parallel" or "flash_attn"; an error names the
// spellings (with a suggestion for a typo).
Expected<LossKernel> parse_loss_kernel(const std::string& name);
std::vector<std::string> loss_kernel_names();  // every kernel's spelling

}  // namespace nnsim
