#include "core/calibration.h"

#include <hdf5.h>

#include <fmt/format.h>

#include "core/hdf5_io.h"
#include "core/suggest.h"

namespace nnsim {

namespace {

// The ComputeModel scalars a calibration may set, with their fields.
struct ComputeField {
  const char* name;
  double ComputeModel::*field;
};
constexpr ComputeField kComputeFields[] = {
    {"sustained", &ComputeModel::sustained},
    {"sustained_fp8", &ComputeModel::sustained_fp8},
    {"gemm_k_half", &ComputeModel::gemm_k_half},
    {"attention_fwd_efficiency", &ComputeModel::attention_fwd_efficiency},
    {"attention_bwd_efficiency", &ComputeModel::attention_bwd_efficiency},
    {"attention_seq_half", &ComputeModel::attention_seq_half},
    {"attention_head_dim_exponent", &ComputeModel::attention_head_dim_exponent},
    {"causal_fraction", &ComputeModel::causal_fraction},
    {"memory_efficiency", &ComputeModel::memory_efficiency},
    {"elementwise_traffic", &ComputeModel::elementwise_traffic},
    {"kernel_overhead", &ComputeModel::kernel_overhead},
    {"comm_interference", &ComputeModel::comm_interference},
    {"host_to_device_efficiency", &ComputeModel::host_to_device_efficiency},
    {"device_to_host_efficiency", &ComputeModel::device_to_host_efficiency},
    {"host_memory_efficiency", &ComputeModel::host_memory_efficiency},
};

constexpr Precision kPrecisions[] = {Precision::kFp32, Precision::kTf32, Precision::kBf16,
                                     Precision::kFp16, Precision::kFp8};

using h5::Handle;
using h5::read_number;
using h5::read_string;
using h5::read_vector;
using h5::write_attr;
using h5::write_vector;

void write_link(hid_t parent, const char* name, const GpuCalibration::Link& l) {
  Handle g(H5Gcreate2(parent, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  std::vector<double> bytes, eff;
  for (const auto& p : l.curve) {
    bytes.push_back(p.bytes);
    eff.push_back(p.efficiency);
  }
  write_vector(g.id, "bytes", bytes);
  write_vector(g.id, "efficiency", eff);
  if (l.max_efficiency) write_attr(g.id, "max_efficiency", *l.max_efficiency);
  if (l.all_reduce_max_efficiency) {
    write_attr(g.id, "all_reduce_max_efficiency", *l.all_reduce_max_efficiency);
  }
  if (l.step_latency) write_attr(g.id, "step_latency_s", *l.step_latency);
}

Expected<std::optional<GpuCalibration::Link>> read_link(hid_t parent, const char* name,
                                                        const std::string& where) {
  if (H5Lexists(parent, name, H5P_DEFAULT) <= 0) return std::optional<GpuCalibration::Link>{};
  Handle g(H5Gopen2(parent, name, H5P_DEFAULT), H5Gclose);
  GpuCalibration::Link l;
  auto bytes = read_vector(g.id, "bytes");
  auto eff = read_vector(g.id, "efficiency");
  if (bytes.has_value() != eff.has_value() || (bytes && bytes->size() != eff->size())) {
    return Error(
        fmt::format("{}/{}: 'bytes' and 'efficiency' must both be present and of the "
                    "same length",
                    where, name));
  }
  if (bytes) {
    for (size_t i = 0; i < bytes->size(); ++i) {
      if ((*eff)[i] <= 0 || (i > 0 && (*bytes)[i] <= (*bytes)[i - 1])) {
        return Error(
            fmt::format("{}/{}: efficiencies must be positive and sizes increasing "
                        "(entry {})",
                        where, name, i));
      }
      l.curve.push_back({(*bytes)[i], (*eff)[i]});
    }
  }
  l.max_efficiency = read_number(g.id, "max_efficiency");
  l.all_reduce_max_efficiency = read_number(g.id, "all_reduce_max_efficiency");
  l.step_latency = read_number(g.id, "step_latency_s");
  return std::optional<GpuCalibration::Link>{l};
}

void apply_link(const GpuCalibration::Link& l, LinkClassModel& m) {
  if (!l.curve.empty()) m.curve = l.curve;
  if (l.max_efficiency) m.max_efficiency = *l.max_efficiency;
  if (l.all_reduce_max_efficiency) m.all_reduce_max_efficiency = *l.all_reduce_max_efficiency;
  if (l.step_latency) m.step_latency = *l.step_latency;
}

GpuCalibration::Link describe_link(const LinkClassModel& m) {
  GpuCalibration::Link l;
  l.curve = m.curve;
  l.max_efficiency = m.max_efficiency;
  l.all_reduce_max_efficiency = m.all_reduce_max_efficiency;
  l.step_latency = m.step_latency;
  return l;
}

}  // namespace

const std::vector<std::string>& compute_parameter_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& f : kComputeFields) v.emplace_back(f.name);
    return v;
  }();
  return names;
}

void apply_calibration(const Calibration& c, const std::string& gpu, ComputeModel& compute,
                       CommModel& comm) {
  auto it = c.gpus.find(gpu);
  if (it == c.gpus.end()) return;
  const GpuCalibration& g = it->second;
  for (const auto& f : kComputeFields) {
    auto v = g.compute.find(f.name);
    if (v != g.compute.end()) compute.*(f.field) = v->second;
  }
  for (const auto& [p, e] : g.gemm_efficiency) compute.gemm_efficiency[p] = e;
  if (g.nvlink) apply_link(*g.nvlink, comm.nvlink);
  if (g.network) apply_link(*g.network, comm.network);
}

void apply_calibration(const Calibration& c, const GpuSpec& gpu, ComputeModel& compute,
                       CommModel& comm) {
  apply_calibration(c, c.gpus.count(gpu.name) > 0 ? gpu.name : gpu.lineage(), compute, comm);
}

GpuCalibration describe_models(const ComputeModel& compute, const CommModel& comm,
                               const std::string& source) {
  GpuCalibration g;
  g.source = source;
  for (const auto& f : kComputeFields) g.compute[f.name] = compute.*(f.field);
  g.gemm_efficiency = compute.gemm_efficiency;
  g.nvlink = describe_link(comm.nvlink);
  g.network = describe_link(comm.network);
  return g;
}

Status save_calibration(const std::string& path, const Calibration& c) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("cannot create calibration file '{}'", path));
  write_attr(file.id, "format", std::string("nnsim-calibration"));
  write_attr(file.id, "version", 1.0);
  for (const auto& [gpu, g] : c.gpus) {
    Handle group(H5Gcreate2(file.id, gpu.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    if (group.id < 0) return Error(fmt::format("writing '{}' into '{}' failed", gpu, path));
    write_attr(group.id, "source", g.source);
    Handle compute(H5Gcreate2(group.id, "compute", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                   H5Gclose);
    for (const auto& [name, v] : g.compute) write_attr(compute.id, name.c_str(), v);
    for (const auto& [p, e] : g.gemm_efficiency) {
      write_attr(compute.id, fmt::format("gemm_efficiency_{}", to_string(p)).c_str(), e);
    }
    Handle comm(H5Gcreate2(group.id, "comm", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    if (g.nvlink) write_link(comm.id, "nvlink", *g.nvlink);
    if (g.network) write_link(comm.id, "network", *g.network);
  }
  return Status::Ok();
}

Expected<Calibration> load_calibration(const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    return Error(
        fmt::format("{}: not an HDF5 file (or it does not exist); write one with "
                    "`nnsim calibration export`",
                    path));
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("{}: cannot open", path));
  auto format = read_string(file.id, "format");
  if (!format || *format != "nnsim-calibration") {
    return Error(fmt::format("{}: attribute 'format' of / must be \"nnsim-calibration\"", path));
  }
  auto version = read_number(file.id, "version");
  if (!version || *version != 1) {
    return Error(fmt::format("{}: calibration version {} is not supported (expected 1)", path,
                             version ? *version : 0));
  }
  std::vector<std::string> known;
  for (const auto& g : gpu_catalog()) known.push_back(g.name);
  Calibration c;
  H5G_info_t info;
  H5Gget_info(file.id, &info);
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    char name[256];
    if (H5Lget_name_by_idx(file.id, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name,
                           H5P_DEFAULT) < 0) {
      continue;
    }
    const std::string gpu = name;
    const std::string where = fmt::format("{}: /{}", path, gpu);
    if (!find_gpu(gpu)) {
      return Error(
          fmt::format("{}: no GPU '{}' in the catalog{}", where, gpu, suggest(gpu, known)));
    }
    Handle group(H5Gopen2(file.id, name, H5P_DEFAULT), H5Gclose);
    GpuCalibration g;
    g.source = read_string(group.id, "source").value_or("");
    if (H5Lexists(group.id, "compute", H5P_DEFAULT) > 0) {
      Handle compute(H5Gopen2(group.id, "compute", H5P_DEFAULT), H5Gclose);
      for (const auto& f : kComputeFields) {
        if (auto v = read_number(compute.id, f.name)) {
          if (*v < 0) {
            return Error(fmt::format("{}/compute: '{}' is negative ({})", where, f.name, *v));
          }
          g.compute[f.name] = *v;
        }
      }
      for (Precision p : kPrecisions) {
        if (auto v =
                read_number(compute.id, fmt::format("gemm_efficiency_{}", to_string(p)).c_str())) {
          if (*v <= 0 || *v > 1) {
            return Error(fmt::format("{}/compute: gemm_efficiency_{} must be in (0, 1]", where,
                                     to_string(p)));
          }
          g.gemm_efficiency[p] = *v;
        }
      }
    }
    if (H5Lexists(group.id, "comm", H5P_DEFAULT) > 0) {
      Handle comm(H5Gopen2(group.id, "comm", H5P_DEFAULT), H5Gclose);
      auto nv = read_link(comm.id, "nvlink", where + "/comm");
      if (!nv) return nv.error();
      g.nvlink = *nv;
      auto net = read_link(comm.id, "network", where + "/comm");
      if (!net) return net.error();
      g.network = *net;
    }
    c.gpus[gpu] = g;
  }
  return c;
}

}  // namespace nnsim
