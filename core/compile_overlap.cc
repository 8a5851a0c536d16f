// Collectives hidden behind compute inside a block's steps: Transformer Engine's GEMM overlap
// (communication.tp_overlap), Merak's sub-pipelining (communication.tp_sub_batches) and the
// shared expert beside the expert exchanges (communication.moe_shared_expert_overlap).
#include "core/compiler.h"

#include <algorithm>

namespace nnsim::detail {

// Transformer Engine's tensor-parallel overlap: an all-gather runs alongside the GEMM that
// consumes it, a reduce-scatter alongside the GEMM that produces it, chunk by chunk; the pair
// takes the longer of the two (the GEMM slowed by the communication kernels sharing the GPU).
// In a backward the input-gradient GEMM pairs with the all-gather before it and the
// weight-gradient GEMM with the reduce-scatter of the input gradient (TE's bulk overlaps).
void overlap_tp_collectives(std::vector<Step>& steps, uint32_t lane_axes, double interference) {
  std::vector<Step> out;
  out.reserve(steps.size());
  auto overlappable = [&](const Step& c) {
    return c.kind == StepKind::kCollective && c.seconds == 0 && c.group < 0 &&
           (c.axes & ~lane_axes) == 0 &&
           (c.collective == CollectiveKind::kAllGather ||
            c.collective == CollectiveKind::kReduceScatter);
  };
  auto gemm = [](const Step& s) { return s.kind == StepKind::kCompute && s.matmul; };
  auto merge = [&](Step c, const Step& g) {
    c.seconds = g.seconds * (1 + interference);
    c.flops = g.flops;
    c.compute_class = g.compute_class;
    return c;
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (overlappable(s) && s.collective == CollectiveKind::kAllGather && i + 1 < steps.size() &&
        gemm(steps[i + 1])) {
      out.push_back(merge(s, steps[i + 1]));
      ++i;
    } else if (overlappable(s) && s.collective == CollectiveKind::kReduceScatter && !out.empty() &&
               gemm(out.back())) {
      Step g = out.back();
      out.back() = merge(s, g);
    } else {
      out.push_back(s);
    }
  }
  steps = std::move(out);
}

// Merak's sub-pipelined tensor parallelism (comm.tp_sub_batches = k): a block's micro-batch runs
// as k sub-batches along the batch. Between two blocking lane collectives the operators run
// sub-batch after sub-batch, each 1/k of the time (GEMMs of 1/k the rows priced at the same
// efficiency) and of the memory; each collective moves 1/k of its bytes per sub-batch, launched
// when its sub-batch's compute is done and run alongside the compute piece that follows (the next
// sub-batch, or the first sub-batch of the next operators, which needs only the first piece): the
// pair takes the longer of the two, the compute slowed beside it (interference_beside: DeepEP's
// exchange holds its SMs, NCCL's collectives take comm_interference). A paired piece's
// compute is counted in the collective's step (its operators lose their own labels there).
// Transfers, data-parallel launches and waits end a stretch: nothing moves across them.
void sub_pipeline_collectives(std::vector<Step>& steps, int k, uint32_t lane_axes,
                              const ComputeModel& model) {
  auto blocking = [&](const Step& s) {
    return s.kind == StepKind::kCollective && s.seconds == 0 && s.group < 0 &&
           (s.axes & ~lane_axes) == 0;
  };
  auto in_stretch = [&](const Step& s) {
    return s.kind == StepKind::kCompute || s.kind == StepKind::kMemory || blocking(s);
  };
  std::vector<Step> out;
  out.reserve(steps.size() * k);
  std::vector<Step> pending;  // collective pieces waiting for the compute piece they overlap
  auto emit_pending = [&]() {
    for (const Step& c : pending) out.push_back(c);
    pending.clear();
  };
  // One sub-batch's piece of a run of compute and memory steps. With a collective pending, the
  // compute of the class that has most of the piece runs beside it; the rest (a recomputation
  // inside a backward, say) runs on its own first, so every second keeps its class.
  auto emit_piece = [&](const std::vector<Step>& run) {
    std::map<ComputeClass, double> by_class;
    for (const Step& s : run) {
      if (s.kind == StepKind::kCompute) by_class[s.compute_class] += s.seconds;
    }
    const bool pair = !pending.empty() && !by_class.empty();
    const ComputeClass main =
        pair ? std::max_element(by_class.begin(), by_class.end(),
                                [](const auto& a, const auto& b) { return a.second < b.second; })
                   ->first
             : ComputeClass::kCompute;
    double seconds = 0, flops = 0;
    for (const Step& s : run) {
      Step piece = s;
      if (s.kind == StepKind::kMemory) {
        piece.bytes /= k;
      } else {
        piece.seconds /= k;
        piece.flops /= k;
        if (pair && s.compute_class == main) {
          seconds += piece.seconds;
          flops += piece.flops;
          continue;
        }
      }
      out.push_back(piece);
    }
    if (pair) {
      Step& c = pending.front();
      c.seconds = seconds *
                  (1 + interference_beside(model, c.collective == CollectiveKind::kExpertExchange));
      c.flops = flops;
      c.compute_class = main;
    }
    emit_pending();
  };
  for (size_t i = 0; i < steps.size();) {
    if (!in_stretch(steps[i])) {
      out.push_back(steps[i++]);
      continue;
    }
    size_t end = i;
    bool any = false;
    while (end < steps.size() && in_stretch(steps[end])) any = blocking(steps[end++]) || any;
    if (!any) {
      out.insert(out.end(), steps.begin() + i, steps.begin() + end);
      i = end;
      continue;
    }
    // The stretch as runs of compute each followed by its collectives.
    std::vector<std::vector<Step>> runs(1), after(1);
    for (size_t j = i; j < end; ++j) {
      if (blocking(steps[j])) {
        after.back().push_back(steps[j]);
      } else {
        if (!after.back().empty()) {
          runs.emplace_back();
          after.emplace_back();
        }
        runs.back().push_back(steps[j]);
      }
    }
    for (size_t r = 0; r < runs.size(); ++r) {
      for (int piece = 0; piece < k; ++piece) {
        emit_piece(runs[r]);
        for (Step c : after[r]) {
          c.bytes /= k;
          pending.push_back(c);
        }
      }
    }
    emit_pending();
    i = end;
  }
  steps = std::move(out);
}

// Megatron-Core's --moe-shared-expert-overlap: the shared expert runs on a stream of its own
// beside the dispatcher's all-to-alls. Each unbroken run of its compute (moe.shared.*) moves
// into the nearest expert exchange it reaches across compute and memory steps alone: the
// dispatch after it in a forward, the exchange before it in a backward (whose shared expert
// needs only the layer's output gradient). The pair takes the longer of the two, the compute
// slowed beside the exchange (interference_beside); the compute keeps its seconds and class but
// not its labels. Returns how many runs moved.
int overlap_shared_expert(std::vector<Step>& steps, const std::vector<std::string>& labels,
                          const ComputeModel& model, bool backward) {
  auto shared = [&](const Step& s) {
    return s.kind == StepKind::kCompute && s.label >= 0 &&
           labels[s.label].rfind("moe.shared.", 0) == 0;
  };
  auto exchange = [](const Step& s) {
    return s.kind == StepKind::kCollective && s.group < 0 && s.seconds == 0 &&
           (s.collective == CollectiveKind::kAllToAll ||
            s.collective == CollectiveKind::kExpertExchange);
  };
  auto passable = [](const Step& s) {
    return s.kind == StepKind::kCompute || s.kind == StepKind::kMemory;
  };
  std::vector<int> target(steps.size(), -1);  // a shared step's exchange
  std::vector<bool> taken(steps.size(), false);
  int moved = 0;
  for (size_t i = 0; i < steps.size();) {
    if (!shared(steps[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < steps.size() && shared(steps[end])) ++end;
    // A forward (or a recomputation inside a backward) looks ahead to its dispatch; a backward's
    // gradients look back to the exchange before them, within their own layer.
    const bool ahead = !backward || steps[i].compute_class == ComputeClass::kRecompute;
    int found = -1;
    if (ahead) {
      for (size_t j = end; j < steps.size() && found < 0; ++j) {
        if (exchange(steps[j]) && !taken[j]) found = static_cast<int>(j);
        if (!passable(steps[j])) break;
      }
    } else {
      for (size_t j = i; j-- > 0 && found < 0;) {
        if (exchange(steps[j]) && !taken[j]) found = static_cast<int>(j);
        if (!passable(steps[j])) break;
      }
    }
    if (found >= 0) {
      ++moved;
      taken[found] = true;
      for (size_t k = i; k < end; ++k) target[k] = found;
    }
    i = end;
  }
  for (size_t k = 0; k < steps.size(); ++k) {
    if (target[k] < 0) continue;
    Step& x = steps[target[k]];
    x.seconds += steps[k].seconds *
                 (1 + interference_beside(model, x.collective == CollectiveKind::kExpertExchange));
    x.flops += steps[k].flops;
    x.compute_class = steps[k].compute_class;
  }
  std::vector<Step> out;
  out.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    if (target[i] < 0) out.push_back(steps[i]);
  }
  steps = std::move(out);
  return moved;
}

}  // namespace nnsim::detail
