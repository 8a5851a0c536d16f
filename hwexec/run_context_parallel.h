// Context parallelism for `nnexec run` (docs/hwexec.md): causal attention over a sequence split
// across the ranks of the cp group, as the compiled program models it (core/opgraph.cc,
// attention_op): the forward gathers every rank's keys and values (the program's ring, priced as
// an all-gather), the backward passes each rank's keys and values around the ring with the
// gradients they collect, which end at the rank that owns them. Internal to the LibTorch
// executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <vector>

namespace nnsim::hwexec {

// The positions of cp rank `index`'s tokens in a sequence of `seq`, in the order the rank holds
// them: Megatron-LM's load-balanced layout, the sequence cut in 2 `ways` chunks of which rank i
// holds chunks i and 2 ways - 1 - i, so every rank has the same share of causal attention's work
// (the simulator prices each rank's attention as 1/ways of the whole). seq must be divisible by
// 2 ways. Long, on the CPU.
at::Tensor cp_positions(int64_t seq, int ways, int index);

// What the forward keeps for the ring backward.
struct CpAttentionSaved {
  at::Tensor q;     // this rank's queries [b, heads, sl, dk], fp32
  at::Tensor k, v;  // this rank's keys and values [b, kv_heads, sl, dk or dv], the compute dtype
  at::Tensor out;   // [b, heads, sl, dv], fp32
  at::Tensor lse;   // [b, heads, sl]: each query's log-sum-exp over all keys, fp32
  int ways = 1, index = 0;
  int64_t seq = 0;  // the whole sequence
  // Set before the forward: a sliding-window layer's window (a query sees the `window` keys up
  // to its own position); 0: the whole causal prefix.
  int64_t window = 0;
  at::Tensor graph;  // the queries, keys and values flattened, with their autograd graph
  // Set before the forward, or undefined: ALiBi's slopes of the rank's heads [heads] (fp32), and
  // dropout's multipliers of the attention probabilities [b, heads, sl, seq] (fp32; the rank's
  // queries against every key, in sequence order; run_model_masks.h).
  at::Tensor slopes, drop;
};

// Forward: the queries q [b, heads, sl, dk] of cp rank `index` (of a sequence of `seq`) against
// every rank's keys `k_all` [ways, b, kv_heads, sl, dk] and values `v_all` [ways, b, kv_heads,
// sl, dv] (all-gathered, rank order), under the causal mask of the tokens' positions
// (cp_positions), within saved->window of each query when set. Each key/value head serves
// heads / kv_heads query heads. Computes in fp32; returns the output [b, heads, sl, dv] in fp32
// and fills `saved` (q, out, lse, and this rank's k and v). With saved->slopes, ALiBi's bias is
// added to the scores at the tokens' global positions; with saved->drop, the probabilities are
// multiplied by it.
at::Tensor cp_attention_forward(const at::Tensor& q, const at::Tensor& k_all,
                                const at::Tensor& v_all, int index, int64_t seq,
                                CpAttentionSaved* saved);

// One step of the ring: sends `t` to the next rank of the cp group and returns what the
// previous one sent (the same shape and dtype).
using RingStep = std::function<at::Tensor(const at::Tensor&)>;

// Backward: the gradients of this rank's q, k and v (fp32) from the output's gradient `dout`
// [b, heads, sl, dv]. Each rank's keys and values travel around the ring with the gradients
// every rank adds to them (ways - 1 steps carrying keys, values and their gradients), and a last
// step returns the completed gradients to their owner: `ways` calls of `step`.
std::array<at::Tensor, 3> cp_attention_backward(const CpAttentionSaved& s, const at::Tensor& dout,
                                                const RingStep& step);

}  // namespace nnsim::hwexec
