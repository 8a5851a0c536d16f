#include "hwexec/micro.h"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "core/hdf5_io.h"

namespace nnsim::hwexec {

namespace {

using h5::children;
using h5::Handle;
using h5::make_group;
using h5::read_number;
using h5::read_string;
using h5::write_attr;
using h5::write_vector;

// Reads the series datasets of one group: each must exist, be 1-D doubles of one length, and
// hold positive finite values.
class SeriesReader {
 public:
  SeriesReader(hid_t group, std::string where) : group_(group), where_(std::move(where)) {}

  Expected<std::vector<double>> column(const char* name) {
    if (H5Lexists(group_, name, H5P_DEFAULT) <= 0) {
      return Error(fmt::format("{}: dataset '{}' is missing", where_, name));
    }
    Handle set(H5Dopen2(group_, name, H5P_DEFAULT), H5Dclose);
    if (set.id < 0) return Error(fmt::format("{}/{}: not a dataset", where_, name));
    Handle space(H5Dget_space(set.id), H5Sclose);
    if (H5Sget_simple_extent_ndims(space.id) != 1) {
      return Error(fmt::format("{}/{}: must be one-dimensional", where_, name));
    }
    const hssize_t n = H5Sget_simple_extent_npoints(space.id);
    std::vector<double> v(n > 0 ? static_cast<size_t>(n) : 0);
    if (n > 0 && H5Dread(set.id, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0) {
      return Error(fmt::format("{}/{}: cannot be read as numbers", where_, name));
    }
    if (length_ && v.size() != *length_) {
      return Error(fmt::format("{}/{}: has {} entries, the other datasets of the group {}", where_,
                               name, v.size(), *length_));
    }
    length_ = v.size();
    for (size_t i = 0; i < v.size(); ++i) {
      if (!std::isfinite(v[i]) || v[i] <= 0) {
        return Error(
            fmt::format("{}/{}: entry {} is {} (must be positive)", where_, name, i, v[i]));
      }
    }
    return v;
  }

 private:
  hid_t group_;
  std::string where_;
  std::optional<size_t> length_;
};

Status write_timing(hid_t g, const std::vector<Timing>& t) {
  std::vector<double> med, min;
  for (const Timing& x : t) {
    med.push_back(x.seconds);
    min.push_back(x.seconds_min);
  }
  if (!write_vector(g, "seconds", med) || !write_vector(g, "seconds_min", min)) {
    return Error("writing the timings failed");
  }
  return Status::Ok();
}

}  // namespace

double bus_factor(const std::string& kind, int ranks) {
  if (ranks < 1) return 0;
  const double frac = static_cast<double>(ranks - 1) / ranks;
  if (kind == "all_reduce") return 2 * frac;
  if (kind == "all_gather" || kind == "reduce_scatter") return frac;
  return 0;
}

Expected<Precision> parse_precision(const std::string& name) {
  for (Precision p :
       {Precision::kFp32, Precision::kTf32, Precision::kBf16, Precision::kFp16, Precision::kFp8}) {
    if (to_string(p) == name) return p;
  }
  return Error(fmt::format("unknown precision '{}' (fp32, tf32, bf16, fp16 or fp8)", name));
}

Status write_micro(const std::string& path, const MicroResults& r) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("cannot create '{}' (does its folder exist?)", path));
  bool ok = write_attr(file.id, "format", std::string(kMicroFormat)) &&
            write_attr(file.id, "version", static_cast<long long>(kMicroVersion)) &&
            write_attr(file.id, "device", r.device) &&
            write_attr(file.id, "device_name", r.device_name) &&
            write_attr(file.id, "device_count", static_cast<long long>(r.device_count)) &&
            write_attr(file.id, "torch_version", r.torch_version) &&
            write_attr(file.id, "nccl_version", r.nccl_version) &&
            write_attr(file.id, "threads", static_cast<long long>(r.threads)) &&
            write_attr(file.id, "warmup", static_cast<long long>(r.warmup)) &&
            write_attr(file.id, "repetitions", static_cast<long long>(r.repetitions)) &&
            write_attr(file.id, "quick", static_cast<long long>(r.quick ? 1 : 0));
  std::string notes;
  for (const auto& n : r.notes) notes += n + "\n";
  ok = ok && write_attr(file.id, "notes", notes);
  if (!ok) return Error(fmt::format("writing the attributes of '{}' failed", path));

  auto fail = [&](const std::string& what) {
    return Error(fmt::format("writing {} into '{}' failed", what, path));
  };
  Handle gemm(make_group(file.id, "gemm"), H5Gclose);
  for (const GemmSeries& s : r.gemm) {
    const std::string name(to_string(s.precision));
    Handle g(make_group(gemm.id, name), H5Gclose);
    if (g.id < 0) return fail("/gemm/" + name);
    std::vector<double> m, n, k, rate;
    std::vector<Timing> t;
    for (const GemmSample& x : s.samples) {
      m.push_back(x.m);
      n.push_back(x.n);
      k.push_back(x.k);
      t.push_back(x.t);
      rate.push_back(x.flops() / x.t.seconds);
    }
    if (!write_attr(g.id, "precision", name) ||
        !write_attr(g.id, "element_bytes", bytes_per_element(s.precision)) ||
        !write_vector(g.id, "m", m) || !write_vector(g.id, "n", n) || !write_vector(g.id, "k", k) ||
        !write_timing(g.id, t) || !write_vector(g.id, "flop_per_s", rate)) {
      return fail("/gemm/" + name);
    }
  }
  Handle memory(make_group(file.id, "memory"), H5Gclose);
  for (const MemorySeries& s : r.memory) {
    Handle g(make_group(memory.id, s.op), H5Gclose);
    if (g.id < 0) return fail("/memory/" + s.op);
    std::vector<double> elements, bytes, rate;
    std::vector<Timing> t;
    for (const MemorySample& x : s.samples) {
      elements.push_back(x.elements);
      bytes.push_back(x.bytes);
      t.push_back(x.t);
      rate.push_back(x.bytes / x.t.seconds);
    }
    if (!write_attr(g.id, "dtype", s.dtype) ||
        !write_attr(g.id, "bytes_per_element", s.bytes_per_element) ||
        !write_vector(g.id, "elements", elements) || !write_vector(g.id, "bytes", bytes) ||
        !write_timing(g.id, t) || !write_vector(g.id, "bytes_per_s", rate)) {
      return fail("/memory/" + s.op);
    }
  }
  Handle attention(make_group(file.id, "attention"), H5Gclose);
  for (const AttentionSeries& s : r.attention) {
    Handle g(make_group(attention.id, s.dtype), H5Gclose);
    if (g.id < 0) return fail("/attention/" + s.dtype);
    std::vector<double> b, h, seq, d, flops, fwd, fwd_min, bwd, bwd_min, fwd_rate, bwd_rate;
    for (const AttentionSample& x : s.samples) {
      b.push_back(x.batch);
      h.push_back(x.heads);
      seq.push_back(x.seq);
      d.push_back(x.head_dim);
      flops.push_back(x.flops());
      fwd.push_back(x.fwd.seconds);
      fwd_min.push_back(x.fwd.seconds_min);
      bwd.push_back(x.bwd.seconds);
      bwd_min.push_back(x.bwd.seconds_min);
      fwd_rate.push_back(x.flops() / x.fwd.seconds);
      bwd_rate.push_back(2 * x.flops() / x.bwd.seconds);
    }
    if (!write_attr(g.id, "dtype", s.dtype) || !write_attr(g.id, "kernel", s.kernel) ||
        !write_attr(g.id, "causal", 1LL) || !write_vector(g.id, "batch", b) ||
        !write_vector(g.id, "heads", h) || !write_vector(g.id, "seq", seq) ||
        !write_vector(g.id, "head_dim", d) || !write_vector(g.id, "flops", flops) ||
        !write_vector(g.id, "fwd_seconds", fwd) ||
        !write_vector(g.id, "fwd_seconds_min", fwd_min) ||
        !write_vector(g.id, "bwd_seconds", bwd) ||
        !write_vector(g.id, "bwd_seconds_min", bwd_min) ||
        !write_vector(g.id, "fwd_flop_per_s", fwd_rate) ||
        !write_vector(g.id, "bwd_flop_per_s", bwd_rate)) {
      return fail("/attention/" + s.dtype);
    }
  }
  // One group per kind; each row a (group size, message size) measurement, group sizes in the
  // order measured.
  Handle coll(make_group(file.id, "collectives"), H5Gclose);
  std::vector<std::string> kinds;
  for (const CollectiveSeries& s : r.collectives) {
    if (std::find(kinds.begin(), kinds.end(), s.kind) == kinds.end()) kinds.push_back(s.kind);
  }
  for (const std::string& kind : kinds) {
    Handle g(make_group(coll.id, kind), H5Gclose);
    if (g.id < 0) return fail("/collectives/" + kind);
    std::vector<double> ranks, bytes, algbw, busbw;
    std::vector<Timing> t;
    std::string dtype;
    for (const CollectiveSeries& s : r.collectives) {
      if (s.kind != kind) continue;
      dtype = s.dtype;
      const double factor = bus_factor(s.kind, s.ranks);
      for (const CollectiveSample& x : s.samples) {
        ranks.push_back(s.ranks);
        bytes.push_back(x.bytes);
        t.push_back(x.t);
        algbw.push_back(x.bytes / x.t.seconds);
        busbw.push_back(x.bytes / x.t.seconds * factor);
      }
    }
    if (!write_attr(g.id, "dtype", dtype) || !write_vector(g.id, "ranks", ranks) ||
        !write_vector(g.id, "bytes", bytes) || !write_timing(g.id, t) ||
        !write_vector(g.id, "algbw_bytes_per_s", algbw) ||
        !write_vector(g.id, "busbw_bytes_per_s", busbw)) {
      return fail("/collectives/" + kind);
    }
  }
  Handle copies(make_group(file.id, "host_copies"), H5Gclose);
  for (const HostCopySeries& s : r.host_copies) {
    Handle g(make_group(copies.id, s.direction), H5Gclose);
    if (g.id < 0) return fail("/host_copies/" + s.direction);
    std::vector<double> bytes, rate;
    std::vector<Timing> t;
    for (const HostCopySample& x : s.samples) {
      bytes.push_back(x.bytes);
      t.push_back(x.t);
      rate.push_back(x.bytes / x.t.seconds);
    }
    if (!write_attr(g.id, "gpus", static_cast<long long>(s.gpus)) ||
        !write_vector(g.id, "bytes", bytes) || !write_timing(g.id, t) ||
        !write_vector(g.id, "bytes_per_s", rate)) {
      return fail("/host_copies/" + s.direction);
    }
  }
  if (!r.host_adam.empty()) {
    Handle g(make_group(file.id, "host_adam"), H5Gclose);
    std::vector<double> elements, rate;
    std::vector<Timing> t;
    for (const HostAdamSample& x : r.host_adam) {
      elements.push_back(x.elements);
      t.push_back(x.t);
      rate.push_back(x.elements * kHostAdamBytesPerElement / x.t.seconds);
    }
    if (g.id < 0 || !write_attr(g.id, "bytes_per_element", kHostAdamBytesPerElement) ||
        !write_vector(g.id, "elements", elements) || !write_timing(g.id, t) ||
        !write_vector(g.id, "bytes_per_s", rate)) {
      return fail("/host_adam");
    }
  }
  if (H5Fflush(file.id, H5F_SCOPE_GLOBAL) < 0) return fail("the data");
  return Status::Ok();
}

Expected<MicroResults> read_micro(const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    return Error(fmt::format(
        "{}: not an HDF5 file (or it does not exist); write one with `nnexec bench --out {}`", path,
        path));
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("{}: cannot open", path));
  auto format = read_string(file.id, "format");
  if (!format || *format != kMicroFormat) {
    return Error(fmt::format("{}: attribute 'format' of / is {} (must be \"{}\")", path,
                             format ? "\"" + *format + "\"" : std::string("missing"),
                             kMicroFormat));
  }
  auto version = read_number(file.id, "version");
  if (!version || *version < kMicroOldestVersion || *version > kMicroVersion) {
    return Error(fmt::format(
        "{}: attribute 'version' of / is {} (this nnsim reads versions {} to {})", path,
        version ? fmt::format("{}", *version) : "missing", kMicroOldestVersion, kMicroVersion));
  }
  MicroResults r;
  auto device = read_string(file.id, "device");
  if (!device || (*device != "cpu" && *device != "cuda")) {
    return Error(fmt::format("{}: attribute 'device' of / must be \"cpu\" or \"cuda\"", path));
  }
  r.device = *device;
  r.device_name = read_string(file.id, "device_name").value_or("");
  r.device_count = static_cast<int>(read_number(file.id, "device_count").value_or(1));
  r.torch_version = read_string(file.id, "torch_version").value_or("");
  r.nccl_version = read_string(file.id, "nccl_version").value_or("");
  r.threads = static_cast<int>(read_number(file.id, "threads").value_or(1));
  r.warmup = static_cast<int>(read_number(file.id, "warmup").value_or(0));
  r.repetitions = static_cast<int>(read_number(file.id, "repetitions").value_or(0));
  r.quick = read_number(file.id, "quick").value_or(0) != 0;

  auto timings = [](SeriesReader& in) -> Expected<std::vector<Timing>> {
    auto med = in.column("seconds");
    if (!med) return med.error();
    auto min = in.column("seconds_min");
    if (!min) return min.error();
    std::vector<Timing> t;
    for (size_t i = 0; i < med->size(); ++i) t.push_back({(*med)[i], (*min)[i]});
    return t;
  };

  if (H5Lexists(file.id, "gemm", H5P_DEFAULT) > 0) {
    Handle gemm(H5Gopen2(file.id, "gemm", H5P_DEFAULT), H5Gclose);
    for (const std::string& name : children(gemm.id)) {
      const std::string where = fmt::format("{}: /gemm/{}", path, name);
      Expected<Precision> p = parse_precision(name);
      if (!p) return p.error().with_context(where);
      Handle g(H5Gopen2(gemm.id, name.c_str(), H5P_DEFAULT), H5Gclose);
      SeriesReader in(g.id, where);
      auto m = in.column("m");
      if (!m) return m.error();
      auto n = in.column("n");
      if (!n) return n.error();
      auto k = in.column("k");
      if (!k) return k.error();
      auto t = timings(in);
      if (!t) return t.error();
      GemmSeries s;
      s.precision = *p;
      for (size_t i = 0; i < m->size(); ++i)
        s.samples.push_back({(*m)[i], (*n)[i], (*k)[i], (*t)[i]});
      r.gemm.push_back(std::move(s));
    }
  }
  if (H5Lexists(file.id, "memory", H5P_DEFAULT) > 0) {
    Handle memory(H5Gopen2(file.id, "memory", H5P_DEFAULT), H5Gclose);
    for (const std::string& name : children(memory.id)) {
      const std::string where = fmt::format("{}: /memory/{}", path, name);
      Handle g(H5Gopen2(memory.id, name.c_str(), H5P_DEFAULT), H5Gclose);
      SeriesReader in(g.id, where);
      auto elements = in.column("elements");
      if (!elements) return elements.error();
      auto bytes = in.column("bytes");
      if (!bytes) return bytes.error();
      auto t = timings(in);
      if (!t) return t.error();
      MemorySeries s;
      s.op = name;
      s.dtype = read_string(g.id, "dtype").value_or("");
      s.bytes_per_element = read_number(g.id, "bytes_per_element").value_or(0);
      for (size_t i = 0; i < elements->size(); ++i) {
        s.samples.push_back({(*elements)[i], (*bytes)[i], (*t)[i]});
      }
      r.memory.push_back(std::move(s));
    }
  }
  // Version 1 files have no attention group.
  if (*version >= 2 && H5Lexists(file.id, "attention", H5P_DEFAULT) > 0) {
    Handle attention(H5Gopen2(file.id, "attention", H5P_DEFAULT), H5Gclose);
    for (const std::string& name : children(attention.id)) {
      const std::string where = fmt::format("{}: /attention/{}", path, name);
      Handle g(H5Gopen2(attention.id, name.c_str(), H5P_DEFAULT), H5Gclose);
      SeriesReader in(g.id, where);
      std::vector<std::vector<double>> c;
      for (const char* column : {"batch", "heads", "seq", "head_dim", "fwd_seconds",
                                 "fwd_seconds_min", "bwd_seconds", "bwd_seconds_min"}) {
        auto v = in.column(column);
        if (!v) return v.error();
        c.push_back(std::move(*v));
      }
      AttentionSeries s;
      s.dtype = name;
      s.kernel = read_string(g.id, "kernel").value_or("");
      if (s.kernel != "sdpa" && s.kernel != "math") {
        return Error(fmt::format("{}: attribute 'kernel' must be \"sdpa\" or \"math\"", where));
      }
      for (size_t i = 0; i < c[0].size(); ++i) {
        s.samples.push_back(
            {c[0][i], c[1][i], c[2][i], c[3][i], {c[4][i], c[5][i]}, {c[6][i], c[7][i]}});
      }
      r.attention.push_back(std::move(s));
    }
  }
  if (H5Lexists(file.id, "collectives", H5P_DEFAULT) > 0) {
    Handle coll(H5Gopen2(file.id, "collectives", H5P_DEFAULT), H5Gclose);
    for (const std::string& name : children(coll.id)) {
      const std::string where = fmt::format("{}: /collectives/{}", path, name);
      if (bus_factor(name, 2) == 0) {
        return Error(fmt::format(
            "{}: unknown collective (all_reduce, all_gather or reduce_scatter)", where));
      }
      Handle g(H5Gopen2(coll.id, name.c_str(), H5P_DEFAULT), H5Gclose);
      SeriesReader in(g.id, where);
      auto bytes = in.column("bytes");
      if (!bytes) return bytes.error();
      auto t = timings(in);
      if (!t) return t.error();
      // The group size of each row: a column since version 3, one attribute before.
      std::vector<double> ranks;
      if (*version >= 3) {
        auto column = in.column("ranks");
        if (!column) return column.error();
        ranks = *column;
      } else {
        auto attr = read_number(g.id, "ranks");
        if (!attr) return Error(fmt::format("{}: attribute 'ranks' is missing", where));
        ranks.assign(bytes->size(), *attr);
      }
      const std::string dtype = read_string(g.id, "dtype").value_or("");
      const size_t first = r.collectives.size();
      for (size_t i = 0; i < bytes->size(); ++i) {
        if (ranks[i] < 1 || ranks[i] != std::floor(ranks[i])) {
          return Error(fmt::format("{}: ranks[{}] is {}, not a whole number of 1 or more", where, i,
                                   ranks[i]));
        }
        const int n = static_cast<int>(ranks[i]);
        auto it = std::find_if(r.collectives.begin() + first, r.collectives.end(),
                               [n](const CollectiveSeries& s) { return s.ranks == n; });
        if (it == r.collectives.end()) {
          r.collectives.push_back({name, n, dtype, {}});
          it = r.collectives.end() - 1;
        }
        it->samples.push_back({(*bytes)[i], (*t)[i]});
      }
    }
  }
  // Version 4 added the host's copies and Adam.
  if (*version >= 4 && H5Lexists(file.id, "host_copies", H5P_DEFAULT) > 0) {
    Handle copies(H5Gopen2(file.id, "host_copies", H5P_DEFAULT), H5Gclose);
    for (const std::string& name : children(copies.id)) {
      const std::string where = fmt::format("{}: /host_copies/{}", path, name);
      if (name != "to_host" && name != "to_device") {
        return Error(fmt::format("{}: unknown direction (to_host or to_device)", where));
      }
      Handle g(H5Gopen2(copies.id, name.c_str(), H5P_DEFAULT), H5Gclose);
      SeriesReader in(g.id, where);
      auto bytes = in.column("bytes");
      if (!bytes) return bytes.error();
      auto t = timings(in);
      if (!t) return t.error();
      auto gpus = read_number(g.id, "gpus");
      if (!gpus || *gpus < 1 || *gpus != std::floor(*gpus)) {
        return Error(
            fmt::format("{}: attribute 'gpus' must be a whole number of 1 or more", where));
      }
      HostCopySeries s{name, static_cast<int>(*gpus), {}};
      for (size_t i = 0; i < bytes->size(); ++i) s.samples.push_back({(*bytes)[i], (*t)[i]});
      r.host_copies.push_back(std::move(s));
    }
  }
  if (*version >= 4 && H5Lexists(file.id, "host_adam", H5P_DEFAULT) > 0) {
    Handle g(H5Gopen2(file.id, "host_adam", H5P_DEFAULT), H5Gclose);
    SeriesReader in(g.id, fmt::format("{}: /host_adam", path));
    auto elements = in.column("elements");
    if (!elements) return elements.error();
    auto t = timings(in);
    if (!t) return t.error();
    for (size_t i = 0; i < elements->size(); ++i) r.host_adam.push_back({(*elements)[i], (*t)[i]});
  }
  if (auto notes = read_string(file.id, "notes")) {
    size_t start = 0;
    while (start < notes->size()) {
      size_t end = notes->find('\n', start);
      if (end == std::string::npos) end = notes->size();
      if (end > start) r.notes.push_back(notes->substr(start, end - start));
      start = end + 1;
    }
  }
  return r;
}

}  // namespace nnsim::hwexec
