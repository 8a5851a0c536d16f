#include "planner/schedules.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/suggest.h"

namespace nnsim {
namespace {

std::vector<Block> gpipe(int stage, int stages, int micro_batches) {
  std::vector<Block> out;
  for (int mb = 0; mb < micro_batches; ++mb) out.push_back({BlockKind::kForward, mb, stage});
  for (int mb = micro_batches - 1; mb >= 0; --mb) {
    out.push_back({BlockKind::kBackward, mb, stage});
  }
  return out;
}

// PipeDream-Flush (Megatron's non-interleaved 1F1B): stage p runs stages-p-1 warm-up forwards,
// then alternates one forward and one backward, then drains the remaining backwards.
std::vector<Block> one_f_one_b(int stage, int stages, int micro_batches) {
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<Block> out;
  for (int mb = 0; mb < warmup; ++mb) out.push_back({BlockKind::kForward, mb, stage});
  for (int i = 0; i < micro_batches - warmup; ++i) {
    out.push_back({BlockKind::kForward, warmup + i, stage});
    out.push_back({BlockKind::kBackward, i, stage});
  }
  for (int mb = micro_batches - warmup; mb < micro_batches; ++mb) {
    out.push_back({BlockKind::kBackward, mb, stage});
  }
  return out;
}

// Megatron's interleaved 1F1B: forwards visit the chunks in groups of `stages` micro-batches;
// warm-up is 2(stages - stage - 1) + (chunks - 1) stages virtual micro-batches.
std::vector<Block> interleaved(int stage, int stages, int chunks, int micro_batches) {
  const int total = micro_batches * chunks;
  auto forward = [&](int k) {
    int chunk = (k / stages) % chunks;
    int mb = (k / (stages * chunks)) * stages + k % stages;
    return Block{BlockKind::kForward, mb, segment_of(chunk, stage, stages)};
  };
  auto backward = [&](int k) {
    int chunk = chunks - 1 - (k / stages) % chunks;
    int mb = (k / (stages * chunks)) * stages + k % stages;
    return Block{BlockKind::kBackward, mb, segment_of(chunk, stage, stages)};
  };
  int warmup = micro_batches == stages
                   ? total
                   : std::min((stages - stage - 1) * 2 + (chunks - 1) * stages, total);
  std::vector<Block> out;
  for (int k = 0; k < warmup; ++k) out.push_back(forward(k));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(forward(warmup + i));
    out.push_back(backward(i));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(backward(k));
  return out;
}

}  // namespace

Expected<std::vector<Block>> pipeline_order(ScheduleKind kind, int stage, int stages, int chunks,
                                            int micro_batches) {
  if (micro_batches < 1) return Error("a schedule needs at least one micro-batch");
  switch (kind) {
    case ScheduleKind::kGpipe:
    case ScheduleKind::kOneFOneB: {
      if (chunks != 1) {
        return Error(
            fmt::format("the {} schedule runs one model chunk per pipeline rank; use "
                        "--schedule interleaved for --vpp {}",
                        to_string(kind), chunks));
      }
      return kind == ScheduleKind::kGpipe ? gpipe(stage, stages, micro_batches)
                                          : one_f_one_b(stage, stages, micro_batches);
    }
    case ScheduleKind::kInterleaved:
      if (micro_batches % stages != 0) {
        return Error(fmt::format(
            "the interleaved schedule needs the micro-batch count ({}) to be a multiple of the "
            "pipeline stages ({}); change the global batch or the micro-batch size",
            micro_batches, stages));
      }
      return interleaved(stage, stages, chunks, micro_batches);
  }
  return Error("unknown schedule");
}

Expected<ScheduleKind> parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::kOneFOneB;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  return Error(fmt::format("unknown schedule '{}'{}", name,
                           suggest(name, {"gpipe", "1f1b", "interleaved"})));
}

std::string_view to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
  }
  return "?";
}

}  // namespace nnsim
