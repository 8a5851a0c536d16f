#include "planner/schedules.h"

#include <algorithm>
#include <deque>
#include <map>

#include <fmt/format.h>

#include "core/suggest.h"
#include "planner/list_schedule.h"

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
std::vector<Block> one_f_one_b(int stage, int stages, int micro_batches, int extra_warmup) {
  const int warmup = std::min(stages - stage - 1 + extra_warmup, micro_batches);
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
// warm-up is 2(stages - stage - 1) + (chunks - 1) stages virtual micro-batches, and every one
// when the micro-batches fill a single group (Megatron's all-warm-up case, which PyTorch's
// ScheduleInterleaved1F1B does not have).
std::vector<Block> interleaved(int stage, int stages, int chunks, int micro_batches,
                               PipelineRuntime runtime, int extra_warmup) {
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
  const bool all_warmup = micro_batches == stages && runtime == PipelineRuntime::kMegatron;
  const int warmup =
      all_warmup ? total
                 : std::min((stages - stage - 1) * 2 + (chunks - 1) * stages + extra_warmup, total);
  std::vector<Block> out;
  for (int k = 0; k < warmup; ++k) out.push_back(forward(k));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(forward(warmup + i));
    out.push_back(backward(i));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(backward(k));
  return out;
}

// DualPipeV (DeepSeek's DualPipe cut in half, deepseek-ai/DualPipe): rank r holds segment r
// (phase 0, on the way down) and segment 2 stages - 1 - r (phase 1, on the way back), as ZB-V
// places them. Its eight steps, with n = stages, M = micro-batches:
//   1. 2(n - r - 1) forwards of phase 0;
//   2. r + 1 times a forward of phase 0 and one of phase 1;
//   3. n - r - 1 times a phase-1 backward split in input and weight gradients, then a forward
//      of phase 1;
//   4. M - 2n + r + 1 times a phase-0 forward paired with a phase-1 backward, then a phase-1
//      forward paired with a phase-0 backward (the last rank runs its first pair apart);
//   5. n - r - 1 times a phase-1 backward, then a phase-1 forward paired with a phase-0 backward;
//   6. r + 1 times a phase-1 and a phase-0 backward, split from the middle on (odd ranks from
//      the phase-1 one);
//   7. n - r - 1 times a held-back weight gradient, then a split phase-0 backward;
//   8. the r + 1 weight gradients left.
// Each phase runs its micro-batches in order; weight gradients run first held, first run.
std::vector<Block> dual_pipe_v(int rank, int stages, int micro_batches) {
  const int segment[2] = {rank, 2 * stages - 1 - rank};
  int forwards[2] = {0, 0}, backwards[2] = {0, 0};
  std::deque<Block> held;  // weight gradients waiting
  std::vector<Block> out;
  auto forward = [&](int phase) {
    out.push_back({BlockKind::kForward, forwards[phase]++, segment[phase]});
  };
  auto backward = [&](int phase, bool split) {
    const int mb = backwards[phase]++;
    if (!split) {
      out.push_back({BlockKind::kBackward, mb, segment[phase]});
      return;
    }
    out.push_back({BlockKind::kBackwardInput, mb, segment[phase]});
    held.push_back({BlockKind::kBackwardWeight, mb, segment[phase]});
  };
  auto weight = [&] {
    out.push_back(held.front());
    held.pop_front();
  };
  auto pair = [&](int forward_phase, int backward_phase) {
    forward(forward_phase);
    out.back().paired_with_next = true;
    backward(backward_phase, false);
  };
  const int n = stages, r = rank;
  for (int i = 0; i < 2 * (n - r - 1); ++i) forward(0);
  for (int i = 0; i < r + 1; ++i) {
    forward(0);
    forward(1);
  }
  for (int i = 0; i < n - r - 1; ++i) {
    backward(1, true);
    weight();
    forward(1);
  }
  for (int i = 0; i < micro_batches - 2 * n + r + 1; ++i) {
    if (i == 0 && r == n - 1) {
      forward(0);
      backward(1, false);
    } else {
      pair(0, 1);
    }
    pair(1, 0);
  }
  for (int i = 0; i < n - r - 1; ++i) {
    backward(1, false);
    pair(1, 0);
  }
  bool split = false;
  for (int i = 0; i < r + 1; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) split = true;
    backward(1, split);
    if (i == (r + 1) / 2 && r % 2 == 0) split = true;
    backward(0, split);
  }
  for (int i = 0; i < n - r - 1; ++i) {
    weight();
    backward(0, true);
  }
  while (!held.empty()) weight();
  return out;
}

}  // namespace

PipelineRuntime pipeline_runtime_of(const std::string& framework) {
  return framework == "fsdp" ? PipelineRuntime::kTorch : PipelineRuntime::kMegatron;
}

bool splits_backward(ScheduleKind kind) {
  return kind == ScheduleKind::kZbH1 || kind == ScheduleKind::kZbH2 || kind == ScheduleKind::kZbV ||
         kind == ScheduleKind::kDualPipeV;
}

int required_chunks(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kInterleaved:
    case ScheduleKind::kTessel:
      return 0;
    case ScheduleKind::kZbV:
    case ScheduleKind::kDualPipeV:
      return 2;
    default:
      return 1;
  }
}

int rank_of_segment(ScheduleKind kind, int segment, int stages) {
  if (kind == ScheduleKind::kZbV || kind == ScheduleKind::kDualPipeV) {
    return segment < stages ? segment : 2 * stages - 1 - segment;
  }
  return segment % stages;
}

Expected<std::vector<std::vector<Block>>> pipeline_orders(
    ScheduleKind kind, int stages, int chunks, int micro_batches,
    const std::vector<bool>& recompute_segments, PipelineRuntime runtime, int extra_warmup) {
  if (micro_batches < 1) return Error("a schedule needs at least one micro-batch");
  const int need = required_chunks(kind);
  if (need > 0 && chunks != need) {
    if (need == 2) {
      return Error(
          fmt::format("the {} schedule runs two model chunks per pipeline rank in a V; "
                      "use --vpp 2 (got {})",
                      to_string(kind), chunks));
    }
    return Error(
        fmt::format("the {} schedule runs one model chunk per pipeline rank; use "
                    "--schedule interleaved for --vpp {}",
                    to_string(kind), chunks));
  }
  if (kind == ScheduleKind::kTessel) {
    // The search starts from the orders of the same placement that it must not use more memory
    // than (planner/schedule_gen.h).
    return pipeline_orders(chunks > 1 ? ScheduleKind::kInterleaved : ScheduleKind::kOneFOneB,
                           stages, chunks, micro_batches, recompute_segments, runtime);
  }
  std::vector<std::vector<Block>> out;
  switch (kind) {
    case ScheduleKind::kGpipe:
    case ScheduleKind::kOneFOneB:
      for (int s = 0; s < stages; ++s) {
        out.push_back(kind == ScheduleKind::kGpipe
                          ? gpipe(s, stages, micro_batches)
                          : one_f_one_b(s, stages, micro_batches, extra_warmup));
      }
      return out;
    case ScheduleKind::kInterleaved:
      if (micro_batches % stages != 0) {
        return Error(fmt::format(
            "the interleaved schedule needs the micro-batch count ({}) to be a multiple of the "
            "pipeline stages ({}); change the global batch or the micro-batch size",
            micro_batches, stages));
      }
      for (int s = 0; s < stages; ++s) {
        out.push_back(interleaved(s, stages, chunks, micro_batches, runtime, extra_warmup));
      }
      return out;
    case ScheduleKind::kDualPipeV:
      if (micro_batches < 2 * stages) {
        return Error(fmt::format(
            "the dualpipev schedule needs at least twice as many micro-batches as pipeline "
            "stages (2 x {} = {}; got {}); raise the global batch or lower the micro-batch "
            "size",
            stages, 2 * stages, micro_batches));
      }
      for (int s = 0; s < stages; ++s) out.push_back(dual_pipe_v(s, stages, micro_batches));
      return out;
    default:
      break;
  }
  // The list-scheduled ones (planner/list_schedule.h), with unit block times (the papers'
  // hand-built schedules assume forward = input gradient = weight gradient).
  ListScheduleProblem p;
  p.devices = stages;
  p.micro_batches = micro_batches;
  const int segments = stages * chunks;
  for (int s = 0; s < segments; ++s)
    p.device_of_segment.push_back(rank_of_segment(kind, s, stages));
  p.split_backward = splits_backward(kind);
  for (int d = 0; d < stages; ++d) {
    switch (kind) {
      case ScheduleKind::kMerak:
        p.in_flight_limit.push_back(stages - d);  // 1F1B's
        break;
      case ScheduleKind::kZbH1:
        // 1F1B's peak (the first stage's) on every stage: the later stages use their spare
        // memory to hold weight gradients back for the bubbles.
        p.in_flight_limit.push_back(stages);
        break;
      case ScheduleKind::kZbH2:
        p.in_flight_limit.push_back(2 * stages - 1);
        break;
      case ScheduleKind::kZbV:
        p.in_flight_limit.push_back(2 * stages);  // chunks of half a stage: 1F1B's peak
        break;
      default:
        break;
    }
  }
  if (kind == ScheduleKind::kMerak) {
    // Recomputation as explicit blocks, except on the last stage, which runs each backward
    // right after its forward and keeps its activations.
    p.recompute = recompute_segments;
    p.recompute.resize(segments, false);
    if (segments > 0) p.recompute[segments - 1] = false;
    p.backward_input.assign(segments, 2.0);  // unsplit backward: two forward times
    p.backward_weight.assign(segments, 0.0);
  }
  Expected<ListSchedule> ls = list_schedule(p);
  if (!ls) return ls.error();
  return ls->orders;
}

Status add_spanning_blocks(ScheduleKind kind, int segment,
                           std::vector<std::vector<Block>>& orders) {
  if (kind != ScheduleKind::kGpipe && kind != ScheduleKind::kOneFOneB &&
      kind != ScheduleKind::kTessel) {
    return Error(
        fmt::format("a segment spanning every pipeline rank (--shard-head) is placed by the "
                    "gpipe and 1f1b schedules only, not {}; use --schedule 1f1b or gpipe",
                    to_string(kind)));
  }
  for (auto& order : orders) {
    std::vector<Block> out;
    out.reserve(order.size() * 2);
    for (const Block& b : order) {
      if (b.kind == BlockKind::kBackward && b.segment != segment) {
        out.push_back({BlockKind::kForward, b.micro_batch, segment});
        out.push_back({BlockKind::kBackward, b.micro_batch, segment});
      }
      out.push_back(b);
    }
    order = std::move(out);
  }
  return Status::Ok();
}

namespace {

// One micro-batch at a time, every pass through every segment in flow order (ascending
// segment ids, Megatron's virtual stages), then the backward: deadlock-free on any placement
// without spanning segments; Tessel's search replaces it.
std::vector<std::vector<Block>> sequential_passes(const std::vector<std::vector<Block>>& orders,
                                                  const std::map<int, size_t>& order_of_segment,
                                                  int passes) {
  int micro_batches = 0;
  for (const auto& order : orders) {
    for (const Block& b : order) micro_batches = std::max(micro_batches, b.micro_batch + 1);
  }
  std::vector<std::vector<Block>> out(orders.size());
  for (int m = 0; m < micro_batches; ++m) {
    for (int pass = 0; pass < passes; ++pass) {
      for (const auto& [segment, o] : order_of_segment) {
        out[o].push_back({BlockKind::kForward, m, segment, pass});
      }
    }
    for (auto it = order_of_segment.rbegin(); it != order_of_segment.rend(); ++it) {
      out[it->second].push_back({BlockKind::kBackward, m, it->first});
    }
  }
  return out;
}

}  // namespace

Status add_forward_passes(ScheduleKind kind, int passes, std::vector<std::vector<Block>>& orders) {
  if (passes <= 1) return Status::Ok();
  if (kind != ScheduleKind::kGpipe && kind != ScheduleKind::kOneFOneB &&
      kind != ScheduleKind::kTessel) {
    return Error(fmt::format(
        "the {} schedule does not place repeated forwards (training.recycle = {}); use gpipe, "
        "1f1b or tessel",
        to_string(kind), passes));
  }
  std::map<int, size_t> order_of_segment;
  bool one_segment_per_order = true;
  for (size_t o = 0; o < orders.size(); ++o) {
    for (const Block& b : orders[o]) {
      auto it = order_of_segment.emplace(b.segment, o).first;
      if (it->second != o) {
        return Error(fmt::format(
            "repeated forwards (training.recycle = {}): segment {} spans several pipeline "
            "stages, which the hand-built orders do not place with repeated forwards",
            passes, b.segment));
      }
      one_segment_per_order = one_segment_per_order && b.segment == orders[o].front().segment;
    }
  }
  if (!one_segment_per_order) {
    if (kind != ScheduleKind::kTessel) {
      return Error(fmt::format(
          "repeated forwards (training.recycle = {}) are placed by the gpipe and 1f1b schedules "
          "on one segment per pipeline stage; use tessel for several segments per stage",
          passes));
    }
    orders = sequential_passes(orders, order_of_segment, passes);
    return Status::Ok();
  }
  for (auto& order : orders) {
    std::vector<Block> out, rest;
    out.reserve(order.size() + order.size() / 2 * (passes - 1));
    if (kind == ScheduleKind::kGpipe) {
      std::vector<Block> forwards;
      for (const Block& b : order) (b.kind == BlockKind::kForward ? forwards : rest).push_back(b);
      for (int pass = 0; pass < passes; ++pass) {
        for (Block f : forwards) {
          f.pass = pass;
          out.push_back(f);
        }
      }
      out.insert(out.end(), rest.begin(), rest.end());
    } else {
      for (const Block& b : order) {
        for (int pass = 0; pass < (b.kind == BlockKind::kForward ? passes : 1); ++pass) {
          out.push_back(b);
          out.back().pass = pass;
        }
      }
    }
    order = std::move(out);
  }
  return Status::Ok();
}

Expected<ScheduleKind> parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGpipe;
  if (name == "1f1b") return ScheduleKind::kOneFOneB;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  if (name == "zb-h1") return ScheduleKind::kZbH1;
  if (name == "zb-h2") return ScheduleKind::kZbH2;
  if (name == "zb-v") return ScheduleKind::kZbV;
  if (name == "dualpipev") return ScheduleKind::kDualPipeV;
  if (name == "merak") return ScheduleKind::kMerak;
  if (name == "tessel") return ScheduleKind::kTessel;
  return Error(fmt::format("unknown schedule '{}'{}", name,
                           suggest(name, {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v",
                                          "dualpipev", "merak", "tessel"})));
}

std::string_view to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZbH1:
      return "zb-h1";
    case ScheduleKind::kZbH2:
      return "zb-h2";
    case ScheduleKind::kZbV:
      return "zb-v";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
    case ScheduleKind::kMerak:
      return "merak";
    case ScheduleKind::kTessel:
      return "tessel";
  }
  return "?";
}

}  // namespace nnsim
