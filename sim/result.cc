#include "sim/result.h"

namespace nnsim {

double Breakdown::total_exposed_comm() const {
  double t = 0;
  for (const auto& [group, seconds] : exposed_comm) t += seconds;
  return t;
}

std::string_view to_string(TaskKind k) {
  switch (k) {
    case TaskKind::kCompute:
      return "compute";
    case TaskKind::kRecompute:
      return "recompute";
    case TaskKind::kOptimizer:
      return "optimizer";
    case TaskKind::kCollective:
      return "collective";
    case TaskKind::kRecvWait:
      return "recv-wait";
    case TaskKind::kSendWait:
      return "send-wait";
    case TaskKind::kDpWait:
      return "dp-wait";
    case TaskKind::kTransfer:
      return "transfer";
    case TaskKind::kDpCollective:
      return "dp-collective";
    case TaskKind::kCommWait:
      return "comm-wait";
    case TaskKind::kHostCopy:
      return "host-copy";
    case TaskKind::kHostCopyWait:
      return "host-copy-wait";
  }
  return "?";
}

std::string_view to_string(Stream s) {
  switch (s) {
    case Stream::kCompute:
      return "compute";
    case Stream::kDataParallel:
      return "data-parallel";
    case Stream::kPipelineSend:
      return "pipeline-send";
    case Stream::kExpertComm:
      return "expert-comm";
    case Stream::kOffload:
      return "offload";
    case Stream::kReload:
      return "reload";
  }
  return "?";
}

std::string_view to_string(Fidelity f) {
  return f == Fidelity::kFull ? "full" : "symmetric";
}

const LaneReport& worst_memory_lane(const SimResult& r) {
  const LaneReport* worst = &r.lanes.front();
  for (const auto& l : r.lanes) {
    if (l.peak_memory > worst->peak_memory) worst = &l;
  }
  return *worst;
}

}  // namespace nnsim
