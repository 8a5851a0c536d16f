// Pipeline schedules as block orders: for each pipeline rank, the order in which it runs the
// forward and backward blocks of every micro-batch through each of its model chunks.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim {

enum class ScheduleKind { kGpipe, kOneFOneB, kInterleaved };

// Segment index of chunk `chunk` on pipeline rank `stage` (Megatron's virtual stages: chunk c of
// rank p holds the (c * stages + p)-th slice of the layers).
inline int segment_of(int chunk, int stage, int stages) {
  return chunk * stages + stage;
}

// The block order of pipeline rank `stage` of `stages`, with `chunks` model chunks per rank
// (1 unless interleaved) and `micro_batches` micro-batches per iteration.
Expected<std::vector<Block>> pipeline_order(ScheduleKind kind, int stage, int stages, int chunks,
                                            int micro_batches);

Expected<ScheduleKind> parse_schedule_kind(const std::string& name);
std::string_view to_string(ScheduleKind kind);

}  // namespace nnsim
