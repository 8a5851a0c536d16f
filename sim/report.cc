#include "sim/report.h"

#include <nlohmann/json.hpp>

#include "core/host_copy.h"
#include "core/json_format.h"
#include "core/memory_check.h"

namespace nnsim {

namespace {
using json = nlohmann::ordered_json;

json breakdown_json(const Breakdown& b) {
  json exposed = json::object();
  for (const auto& [group, s] : b.exposed_comm) exposed[group] = s;
  return {{"compute_s", b.compute},
          {"recompute_s", b.recompute},
          {"optimizer_s", b.optimizer},
          {"exposed_comm_s", exposed},
          {"bubble_s", b.bubble}};
}

json memory_json(const LaneReport& l) {
  const StaticMemory& m = l.static_memory;
  return {{"peak_bytes", l.peak_memory},
          {"weights_bytes", m.weights},
          {"gradients_bytes", m.gradients},
          {"gathered_bytes", m.gathered},
          {"optimizer_bytes", m.optimizer},
          {"comm_buffers_bytes", m.comm_buffers},
          {"pipeline_buffers_bytes", m.pipeline_buffers},
          {"runtime_bytes", m.runtime},
          {"peak_activations_bytes", l.peak_activations}};
}

}  // namespace

nlohmann::ordered_json sensitivity_json(const Sensitivity& s) {
  json resources = json::array();
  for (const ResourceSensitivity& x : s.resources) {
    resources.push_back({{"resource", std::string(resource_name(x.resource))},
                         {"iteration_time_s", x.iteration_time},
                         {"change", x.iteration_time / s.baseline - 1}});
  }
  return {{"factor", s.factor}, {"resources", resources}};
}

std::string report_json(const Program& program, const SimResult& r,
                        const std::optional<TrainingTime>& training,
                        const std::optional<Sensitivity>& sensitivity) {
  json j;
  j["format"] = "nnsim-report";
  j["version"] = 1;
  j["plan"] = program.plan.name;
  j["topology"] = program.topology.name;
  j["gpu"] = program.topology.gpu.name;
  j["gpus"] = r.num_gpus;
  j["micro_batches"] = r.micro_batches;
  j["iteration_time_s"] = r.iteration_time;
  j["tokens_per_s"] = r.tokens_per_second;
  j["model_flops_per_s_per_gpu"] = r.model_flops_per_gpu;
  j["peak_flops_per_s_per_gpu"] = r.peak_flops_per_gpu;
  j["mfu"] = r.mfu;
  j["memory_capacity_bytes"] = program.topology.gpu.hbm_bytes;
  const LaneReport& worst = worst_memory_lane(r);
  j["peak_memory_bytes"] = worst.peak_memory;
  if (const NodeHostMemory host = busiest_host_memory(program); host.node >= 0) {
    j["host_memory_capacity_bytes"] = program.topology.host.memory;
    j["host_memory_bytes"] = host.bytes;
  }
  if (training) {
    j["training"] = {{"tokens", training->tokens}, {"tokens_per_step", training->tokens_per_step},
                     {"steps", training->steps},   {"time_s", training->seconds},
                     {"gpus", training->gpus},     {"gpu_hours", training->gpu_hours}};
    if (const std::optional<FailureCost>& f = training->with_failures) {
      j["training"]["with_failures"] = {{"gpu_failures_per_hour", f->model.gpu_failures_per_hour},
                                        {"checkpoint_s", f->model.checkpoint_seconds},
                                        {"restart_s", f->model.restart_seconds},
                                        {"mtbf_s", f->mtbf_seconds},
                                        {"checkpoint_interval_s", f->checkpoint_interval},
                                        {"lost_fraction", f->lost_fraction},
                                        {"failures", f->failures},
                                        {"time_s", f->seconds},
                                        {"gpu_hours", f->gpu_hours}};
    }
  }
  if (sensitivity) j["sensitivity"] = sensitivity_json(*sensitivity);
  j["simulation"] = {{"fidelity", std::string(to_string(r.fidelity))},
                     {"lanes_simulated", r.simulated_lanes},
                     {"replicas_simulated", r.replicas_simulated}};
  json lanes = json::array();
  for (size_t i = 0; i < r.lanes.size(); ++i) {
    const LaneReport& l = r.lanes[i];
    json timeline = json::array();
    for (const auto& p : l.memory_timeline) timeline.push_back({p.time, p.bytes});
    json lane = {{"name", l.name},
                 {"gpus", l.gpus},
                 {"parameters", l.parameters},
                 {"finish_s", l.finish_time},
                 {"breakdown", breakdown_json(l.breakdown)},
                 {"memory", memory_json(l)},
                 {"memory_timeline", timeline}};
    if (program.plan.optimizer.offload_fraction > 0) {
      const OffloadedStep& o = program.lanes[i].offloaded_step;
      lane["optimizer_offload"] = {{"step_s", o.seconds},
                                   {"to_host_s", o.to_host},
                                   {"host_s", o.host},
                                   {"to_device_s", o.to_device},
                                   {"gpu_s", o.gpu}};
    }
    if (program.plan.offloads_activations()) {
      // A micro-batch's copies, one after another on each stream.
      const double bytes = program.lanes[i].offloaded_activations;
      lane["activation_offload"] = {
          {"bytes", bytes},
          {"to_host_s", host_copy_seconds(bytes, true, program.topology, program.compute_model)},
          {"to_device_s",
           host_copy_seconds(bytes, false, program.topology, program.compute_model)}};
    }
    lanes.push_back(lane);
  }
  j["lanes"] = lanes;
  // Every GPU of the job: replicas that were not simulated mirror replica 0.
  json per_gpu = json::array();
  std::vector<int> lane_of_gpu(program.topology.num_gpus(), -1);
  for (size_t l = 0; l < program.lanes.size(); ++l) {
    for (int rank : program.lanes[l].ranks) {
      for (int rep = 0; rep < program.replicas; ++rep) {
        lane_of_gpu[program.gpu_of_rank[program.rank_in_replica(rank, rep)]] = static_cast<int>(l);
      }
    }
  }
  json idle = json::array();  // GPUs of the topology the plan leaves unused
  for (int g = 0; g < program.topology.num_gpus(); ++g) {
    if (lane_of_gpu[g] < 0) {
      idle.push_back(g);
      continue;
    }
    const LaneReport& l = r.lanes[lane_of_gpu[g]];
    per_gpu.push_back({{"gpu", g}, {"lane", lane_of_gpu[g]}, {"peak_memory_bytes", l.peak_memory}});
  }
  j["per_gpu"] = per_gpu;
  if (!idle.empty()) j["idle_gpus"] = idle;
  return format_json(j);
}

}  // namespace nnsim
