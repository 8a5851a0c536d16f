// Pipeline schedules as block orders: for each pipeline rank, the order in which it runs the
// forward and backward blocks of every micro-batch through each of its model chunks.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim {

enum class ScheduleKind {
  kGpipe,
  kOneFOneB,
  kInterleaved,
  kZbH1,  // zero bubble, 1F1B's memory (Qi et al. 2024, ZB-H1)
  kZbH2,  // zero bubble, about twice 1F1B's memory on the first stage (ZB-H2)
  kZbV,   // zero bubble on a V-shaped placement of two chunks per rank (ZB-V)
  // DualPipeV (DeepSeek-V3's DualPipe cut in half): ZB-V's placement, each steady-state forward
  // paired with another micro-batch's backward, their expert all-to-alls beside each other.
  kDualPipeV,
  kMerak,  // Merak's shifted critical path: 1F1B with recomputation off the critical path
  // Tessel's repetend search (planner/tessel.h) on the plan's placement, from 1F1B orders (one
  // chunk per rank) or interleaved ones (several), within their memory.
  kTessel,
};

// Whether the schedule splits backward into input- and weight-gradient blocks.
bool splits_backward(ScheduleKind kind);
// Model chunks per pipeline rank the schedule needs (0: any, set by --vpp).
int required_chunks(ScheduleKind kind);

// Segment index of chunk `chunk` on pipeline rank `stage` (Megatron's virtual stages: chunk c of
// rank p holds the (c * stages + p)-th slice of the layers).
inline int segment_of(int chunk, int stage, int stages) {
  return chunk * stages + stage;
}

// The pipeline rank that runs segment `segment`: Megatron's round robin over the ranks, or for
// ZB-V a V (rank r holds segments r and 2 stages - 1 - r).
int rank_of_segment(ScheduleKind kind, int segment, int stages);

// Whose implementation a closed-form schedule follows where they differ: with as many
// micro-batches as stages, Megatron's interleaved schedule runs every forward before the first
// backward, PyTorch's ScheduleInterleaved1F1B keeps its usual warm-up (its 1F1B already matches
// Megatron's order).
enum class PipelineRuntime { kMegatron, kTorch };
// A plan's framework's: fsdp plans pipeline as torchtitan does, with PyTorch's schedules.
PipelineRuntime pipeline_runtime_of(const std::string& framework);

// The block order of every pipeline rank of `stages`, with `chunks` model chunks per rank and
// `micro_batches` micro-batches per iteration. `recompute_segments` marks the segments whose
// recomputation the schedule places as explicit blocks (Merak). `extra_warmup` forwards more
// before the first backward on every rank (1F1B and interleaved; one for combined 1F1B, so that
// each steady-state forward pairs with a backward whose gradient came a pair earlier).
Expected<std::vector<std::vector<Block>>> pipeline_orders(
    ScheduleKind kind, int stages, int chunks, int micro_batches,
    const std::vector<bool>& recompute_segments = {},
    PipelineRuntime runtime = PipelineRuntime::kMegatron, int extra_warmup = 0);

// Adds the blocks of `segment`, a segment spanning every pipeline rank (a head sharded over the
// ranks), to GPipe or 1F1B orders of one chunk per rank: for each micro-batch m, F m and B m of
// it go into every rank's order just before that rank's backward of m (on the last rank that is
// right after its forward of m under 1F1B). Every rank then meets the spanning blocks in the
// order of its backwards, which is the same on every rank, so the joint blocks cannot deadlock.
Status add_spanning_blocks(ScheduleKind kind, int segment, std::vector<std::vector<Block>>& orders);

// Repeated forwards (training.recycle = `passes`, AlphaFold's recycling) in GPipe or 1F1B orders
// of one segment per pipeline rank. GPipe runs pass 0 of every micro-batch, then pass 1, ...,
// then the backwards: pass i + 1 of micro-batch m starts once pass i has left the last stage,
// while the first stage runs the other micro-batches' pass i. 1F1B runs each micro-batch's passes
// back to back where its forward was (the naive order: the first stage waits while each pass
// circles the pipeline; Tessel's search does better). Tessel's provisional order is 1F1B's, or
// with several segments per rank (interleaved) one micro-batch at a time, every pass through the
// segments in ascending order, then its backward. Other schedules, and segments spanning several
// ranks, are refused.
Status add_forward_passes(ScheduleKind kind, int passes, std::vector<std::vector<Block>>& orders);

Expected<ScheduleKind> parse_schedule_kind(const std::string& name);
std::string_view to_string(ScheduleKind kind);

}  // namespace nnsim
