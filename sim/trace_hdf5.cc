#include <hdf5.h>

#include <cstddef>
#include <memory>

#include <fmt/format.h>

#include "sim/trace.h"

namespace nnsim {
namespace {

// Closes an HDF5 handle when it goes out of scope.
struct Handle {
  hid_t id;
  herr_t (*close)(hid_t);
  ~Handle() {
    if (id >= 0) close(id);
  }
};

// The row layout of /tasks (documented in docs/simulator.md).
struct Row {
  int32_t lane;
  uint8_t stream;
  uint8_t kind;
  double start;
  double end;
  int32_t label;
  int32_t block;
  double bytes;
  double flops;
  double memory;
  uint32_t axes;
};

herr_t write_strings(hid_t file, const char* name, const std::vector<std::string>& values) {
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, H5T_VARIABLE);
  H5Tset_cset(type.id, H5T_CSET_UTF8);
  hsize_t n = values.size();
  Handle space{H5Screate_simple(1, &n, nullptr), H5Sclose};
  Handle set{H5Dcreate2(file, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose};
  std::vector<const char*> ptrs;
  for (const auto& v : values) ptrs.push_back(v.c_str());
  return n == 0 ? 0 : H5Dwrite(set.id, type.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data());
}

void attr_double(hid_t obj, const char* name, double v) {
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(obj, name, H5T_NATIVE_DOUBLE, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  H5Awrite(a.id, H5T_NATIVE_DOUBLE, &v);
}

void attr_string(hid_t obj, const char* name, const std::string& v) {
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, v.size() + 1);
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{H5Acreate2(obj, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  H5Awrite(a.id, type.id, v.c_str());
}

}  // namespace

Status write_hdf5_timeline(const std::string& path, const Program& program, const SimResult& r) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors come back as values, not prints
  Handle file{H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose};
  if (file.id < 0) return Error(fmt::format("cannot create HDF5 file '{}'", path));
  attr_string(file.id, "format", "nnsim-timeline");
  attr_double(file.id, "version", 1);
  attr_double(file.id, "iteration_time_s", r.iteration_time);
  attr_string(file.id, "plan", program.plan.name);
  attr_string(file.id, "topology", program.topology.name);

  Handle type{H5Tcreate(H5T_COMPOUND, sizeof(Row)), H5Tclose};
  H5Tinsert(type.id, "lane", offsetof(Row, lane), H5T_NATIVE_INT32);
  H5Tinsert(type.id, "stream", offsetof(Row, stream), H5T_NATIVE_UINT8);
  H5Tinsert(type.id, "kind", offsetof(Row, kind), H5T_NATIVE_UINT8);
  H5Tinsert(type.id, "start_s", offsetof(Row, start), H5T_NATIVE_DOUBLE);
  H5Tinsert(type.id, "end_s", offsetof(Row, end), H5T_NATIVE_DOUBLE);
  H5Tinsert(type.id, "label", offsetof(Row, label), H5T_NATIVE_INT32);
  H5Tinsert(type.id, "block", offsetof(Row, block), H5T_NATIVE_INT32);
  H5Tinsert(type.id, "bytes", offsetof(Row, bytes), H5T_NATIVE_DOUBLE);
  H5Tinsert(type.id, "flops", offsetof(Row, flops), H5T_NATIVE_DOUBLE);
  H5Tinsert(type.id, "memory_bytes", offsetof(Row, memory), H5T_NATIVE_DOUBLE);
  H5Tinsert(type.id, "axes", offsetof(Row, axes), H5T_NATIVE_UINT32);
  std::vector<Row> rows;
  rows.reserve(r.tasks.size());
  for (const TaskRecord& t : r.tasks) {
    rows.push_back({t.lane, static_cast<uint8_t>(t.stream), static_cast<uint8_t>(t.kind), t.start,
                    t.end, t.label, t.block, t.bytes, t.flops, t.memory, t.axes});
  }
  hsize_t n = rows.size();
  Handle space{H5Screate_simple(1, &n, nullptr), H5Sclose};
  Handle set{H5Dcreate2(file.id, "tasks", type.id, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose};
  if (set.id < 0 ||
      (n > 0 && H5Dwrite(set.id, type.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data()) < 0)) {
    return Error(fmt::format("writing the task table to '{}' failed", path));
  }
  std::vector<std::string> kinds, streams, lanes, blocks;
  for (int k = 0; k <= static_cast<int>(TaskKind::kHostCopyWait); ++k) {
    kinds.emplace_back(to_string(static_cast<TaskKind>(k)));
  }
  for (int s = 0; s <= static_cast<int>(Stream::kReload); ++s) {
    streams.emplace_back(to_string(static_cast<Stream>(s)));
  }
  for (const auto& l : r.lanes) lanes.push_back(l.name);
  if (write_strings(file.id, "labels", r.labels) < 0 ||
      write_strings(file.id, "kinds", kinds) < 0 ||
      write_strings(file.id, "streams", streams) < 0 ||
      write_strings(file.id, "lanes", lanes) < 0 ||
      write_strings(file.id, "axes", r.lane_axes) < 0) {
    return Error(fmt::format("writing the name tables to '{}' failed", path));
  }
  return Status::Ok();
}

}  // namespace nnsim
