#include <fmt/format.h>

#include "sim/trace.h"

namespace nnsim {
namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::string chrome_trace_json(const Program& program, const SimResult& r, bool per_gpu) {
  // Written by hand rather than through a JSON tree: traces reach millions of events.
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& e) {
    if (!first) out += ",\n";
    out += e;
    first = false;
  };
  // Processes (lanes or GPUs) and threads (streams; the expert stream where blocks pair, the
  // copy streams where activations are offloaded).
  const bool expert_stream = program.has_pairs();
  const bool copy_streams = program.plan.offloads_activations();
  std::vector<std::vector<int>> pids(r.lanes.size());
  for (size_t l = 0; l < r.lanes.size(); ++l) {
    const LaneReport& lane = r.lanes[l];
    if (per_gpu) {
      for (int g : lane.gpus) pids[l].push_back(g);
    } else {
      pids[l].push_back(static_cast<int>(l));
    }
    for (size_t i = 0; i < pids[l].size(); ++i) {
      std::string name =
          per_gpu ? fmt::format("GPU {} ({})", lane.gpus[i], lane.name)
                  : fmt::format("GPUs {} ({})",
                                lane.gpus.size() == 1
                                    ? std::to_string(lane.gpus.front())
                                    : fmt::format("{}-{}", lane.gpus.front(), lane.gpus.back()),
                                lane.name);
      emit(fmt::format(R"({{"name":"process_name","ph":"M","pid":{},"args":{{"name":"{}"}}}})",
                       pids[l][i], escape(name)));
      emit(fmt::format(
          R"({{"name":"process_sort_index","ph":"M","pid":{},"args":{{"sort_index":{}}}}})",
          pids[l][i], pids[l][i]));
      for (Stream s : {Stream::kCompute, Stream::kDataParallel, Stream::kPipelineSend,
                       Stream::kExpertComm, Stream::kOffload, Stream::kReload}) {
        if (s == Stream::kExpertComm && !expert_stream) continue;
        if ((s == Stream::kOffload || s == Stream::kReload) && !copy_streams) continue;
        emit(fmt::format(
            R"({{"name":"thread_name","ph":"M","pid":{},"tid":{},"args":{{"name":"{}"}}}})",
            pids[l][i], static_cast<int>(s), to_string(s)));
      }
    }
  }
  for (const TaskRecord& t : r.tasks) {
    std::string label = t.label >= 0 ? r.labels[t.label] : std::string(to_string(t.kind));
    std::string block;
    if (t.block >= 0) block = to_string(program.lanes[t.lane].blocks[t.block]);
    std::string name = block.empty() ? label : block.append(" ").append(label);
    for (int pid : pids[t.lane]) {
      emit(fmt::format(
          R"({{"name":"{}","cat":"{}","ph":"X","pid":{},"tid":{},"ts":{:.3f},"dur":{:.3f},"args":{{"bytes":{},"flops":{},"memory_bytes":{}}}}})",
          escape(name), to_string(t.kind), pid, static_cast<int>(t.stream), t.start * 1e6,
          (t.end - t.start) * 1e6, t.bytes, t.flops, t.memory));
    }
  }
  // Memory counters.
  for (size_t l = 0; l < r.lanes.size(); ++l) {
    for (const MemoryPoint& p : r.lanes[l].memory_timeline) {
      for (int pid : pids[l]) {
        emit(fmt::format(
            R"({{"name":"memory","ph":"C","pid":{},"ts":{:.3f},"args":{{"bytes":{}}}}})", pid,
            p.time * 1e6, p.bytes));
      }
    }
  }
  out += "\n]}\n";
  return out;
}

}  // namespace nnsim
