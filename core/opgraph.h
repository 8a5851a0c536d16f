// The operator graph a model lowers to: one transformer block described once (the "layer
// template") plus the embedding before the blocks and the head and loss after them.
//
// Every operator is described the way nnScaler annotates operators: by the iteration dimensions
// it loops over (batch, sequence, hidden, heads, ffn, vocab), which of them it sums over, and the
// dimensions each tensor spans. Partitioning an operator means splitting some of its iteration
// dimensions across devices; the size of every tensor piece, the FLOPs of every piece and the
// communication between operators all follow from that (core/layout.h), so no operator needs
// special-case partitioning code.
//
// FLOPs follow the Megatron-LM convention (2 per multiply-add of a matmul, attention scores
// counted in full even when causal); see docs/opgraph.md for every formula.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model.h"

namespace nnsim {

// kExpert: the experts of a mixture-of-experts block (its routed tokens and expert weights).
// kLatent: the compressed width of multi-head latent attention (never split).
enum class Dim : uint8_t { kBatch, kSeq, kHidden, kHeads, kFfn, kVocab, kExpert, kLatent };
inline constexpr int kNumDims = 8;

// A set of dimensions as a bitmask.
class DimSet {
 public:
  constexpr DimSet() = default;
  constexpr DimSet(std::initializer_list<Dim> dims) {
    for (Dim d : dims) bits_ |= bit(d);
  }
  constexpr bool contains(Dim d) const { return (bits_ & bit(d)) != 0; }
  constexpr DimSet with(Dim d) const {
    DimSet s = *this;
    s.bits_ |= bit(d);
    return s;
  }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr bool operator==(const DimSet&) const = default;

 private:
  static constexpr uint8_t bit(Dim d) { return static_cast<uint8_t>(1u << static_cast<int>(d)); }
  uint8_t bits_ = 0;
};

std::string_view to_string(Dim d);
// Parses "batch", "seq", "hidden", "heads", "ffn", "vocab", "expert", "latent".
bool parse_dim(std::string_view name, Dim* out);
std::vector<std::string> dim_names();  // every dimension's spelling, in Dim order

enum class OpKind {
  kEmbedding,   // token lookup (vocab is summed over: a vocab-split lookup yields partial sums)
  kNorm,        // LayerNorm / RMSNorm over hidden
  kLinear,      // matmul with a weight
  kAttention,   // scaled dot-product attention core (scores, softmax, weighted values)
  kActivation,  // GeLU, SwiGLU, squared ReLU, ReLU
  kDropoutAdd,  // [dropout +] residual add
  kAdd,         // elementwise add of a learned position embedding
  kLoss,        // softmax cross-entropy over the vocabulary
  kPermute,     // mixture of experts: tokens to their experts (with the routing) and back
  kScan,        // a recurrent mixer's kernel chain: Mamba-2's convolution, scan and gate; Gated
          // DeltaNet's convolution, gates and chunked delta rule
};
inline constexpr OpKind kOpKinds[] = {
    OpKind::kEmbedding,  OpKind::kNorm, OpKind::kLinear, OpKind::kAttention, OpKind::kActivation,
    OpKind::kDropoutAdd, OpKind::kAdd,  OpKind::kLoss,   OpKind::kPermute,   OpKind::kScan};
std::string_view to_string(OpKind k);

// Which tensor a saved activation is, so that two operators keeping the same tensor (the
// attention output is both the attention core's output and the projection's input) count once.
struct TensorRef {
  int op = -1;   // index of the producing operator in its graph part; -1 = the part's input
  int slot = 0;  // 0 = the operator's output; 1.. = tensors internal to the operator
  bool operator==(const TensorRef&) const = default;
};

// A tensor: its unpartitioned element count and the dimensions it spans (a piece on a device
// holds elements / (product of the split factors of the dims it spans)).
struct TensorSpec {
  TensorRef ref;
  double elements = 0;
  DimSet dims;
  double bytes_per_element = 2;
  double bytes() const { return elements * bytes_per_element; }
};

// Communication an operator does internally when one of its dimensions is split.
struct InternalComm {
  enum class Kind { kAllReduce, kRingExchange };
  Dim dim = Dim::kVocab;
  Kind kind = Kind::kAllReduce;
  DimSet dims;  // dimensions the exchanged buffer spans (its size shrinks with their splits)
  // Bytes per device per call, for the unpartitioned operator; for kRingExchange the bytes each
  // device passes to its ring neighbour per step (there are `ways - 1` steps).
  double fwd_bytes = 0;
  double bwd_bytes = 0;
  int fwd_calls = 0;
  int bwd_calls = 0;
  // True when the exchange overlaps the operator's own compute (ring attention).
  bool overlaps_compute = false;
};

// The matrix multiply of a linear operator, y[m, n] = x[m, k] . w[k, n], unpartitioned: m spans
// the token dimensions (batch, sequence), n and k one dimension each. A device's piece divides
// each by the split factors of its dimensions.
// For experts (an operator spanning kExpert) m counts every routed token of all the experts,
// and the multiply is one GEMM per expert over its share of them.
struct GemmShape {
  double m = 0, n = 0, k = 0;
  Dim n_dim = Dim::kHidden;
  Dim k_dim = Dim::kHidden;
};

struct Op {
  std::string name;  // e.g. "attn.qkv"; matched by plan partition and recompute rules
  OpKind kind = OpKind::kLinear;
  DimSet dims;                    // iteration dimensions
  DimSet reduced;                 // iteration dimensions summed over (absent from the output)
  DimSet unsplittable;            // dimensions the operator cannot be split along
  std::vector<TensorRef> inputs;  // activations consumed
  TensorSpec output;
  std::vector<TensorSpec> weights;
  std::vector<TensorSpec> saved;  // activations kept for the backward pass
  double fwd_flops = 0;           // matmul FLOPs, unpartitioned
  double bwd_input_flops = 0;     // gradient with respect to the inputs
  double bwd_weight_flops = 0;    // gradient with respect to the weights
  double fwd_bytes = 0;           // HBM bytes read + written (memory-bound cost)
  double bwd_bytes = 0;
  double transient_bytes = 0;  // temporaries freed when the operator ends (fwd or bwd)
  // Works in place on its input and counts the input's copies in its own transient: the
  // producer's output and output gradient are not held beside it.
  bool in_place_input = false;
  bool causal = false;  // causal attention that skips the masked half (fused)
  // kAttention: the share of the causal query-key pairs the model attends to, averaged over its
  // layers (sliding windows; 1 without). The counted FLOPs are that share of the full count; a
  // fused kernel computes only them, the unfused chain every score.
  double attended_fraction = 1;
  bool tied_to_embedding = false;  // the head projection sharing the word embedding matrix
  GemmShape gemm;                  // kLinear only
  double head_dim = 0;             // kAttention: per-head width
  double seq = 0;                  // kAttention: sequence length (queries = keys)
  std::vector<InternalComm> internal_comm;
  // Indivisible units along each dimension: a split factor must divide it (heads split by KV
  // group, so it is kv_heads for kHeads).
  int64_t granularity[kNumDims] = {0, 0, 0, 0, 0, 0, 0, 0};

  double parameters() const;
};

// One part of the graph: its operators in forward order; inputs with op == -1 refer to the
// part's input (the previous part's last output).
struct GraphPart {
  std::vector<Op> ops;
  // The part's output is the last operator's output.
};

struct OpGraph {
  ModelSpec model;
  int64_t micro_batch = 1;
  Precision activation_precision = Precision::kBf16;
  GraphPart embedding;  // token (+ position) embedding
  // The transformer blocks, one per block shape (ModelSpec::block_shapes): one for most models;
  // a mixture of experts with dense blocks too has the expert block first, then the dense one.
  std::vector<GraphPart> blocks;
  std::vector<int> block_of_layer;  // per model layer, the index of the block it runs
  GraphPart head;                   // final norm, output projection, loss

  // The embedding, the blocks and the head, in that order.
  std::vector<const GraphPart*> parts() const {
    std::vector<const GraphPart*> out{&embedding};
    for (const GraphPart& b : blocks) out.push_back(&b);
    out.push_back(&head);
    return out;
  }
  // The block layer `l` (from 0) runs, and its index in `blocks`.
  const GraphPart& layer_at(int l) const { return blocks[block_of_layer[l]]; }
  int block_index(int l) const { return block_of_layer[l]; }

  // Model FLOPs of one micro-batch through the whole model (fwd, bwd), unpartitioned.
  double forward_flops() const;
  double backward_flops() const;
};

// Lowers a model for a micro-batch of `micro_batch` sequences of model.seq_len tokens.
OpGraph lower_model(const ModelSpec& model, int64_t micro_batch);

// Sliding windows: the share of a causal attention's query-key pairs a windowed layer attends to
// (1 without windows), layer `layer`'s (1 unless it is a windowed layer), and the average over
// the model's layers (the attention operator's Op::attended_fraction).
double window_attended_fraction(const ModelSpec& m);
double layer_attended_fraction(const ModelSpec& m, int layer);
double attended_fraction(const ModelSpec& m);

// Activation bytes one layer of the first block shape keeps for backward, unpartitioned, with
// the given ops recomputed (by name); full recompute keeps only the layer input.
double layer_activation_bytes(const OpGraph& graph, const std::vector<std::string>& recomputed);

}  // namespace nnsim
