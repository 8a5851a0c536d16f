// Reading a run file (format "nnexec-run", version 1, docs/hwexec.md) back into RunResults, for
// `nnsim compare` and `nnsim calibrate`. Errors name the file and the object.
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "core/hdf5_io.h"
#include "hwexec/run.h"

namespace nnsim::hwexec {

namespace {

using h5::Handle;

// The datasets of one table (a group of equally long one-dimensional datasets).
class TableReader {
 public:
  TableReader(hid_t group, std::string where) : group_(group), where_(std::move(where)) {}

  // Numbers that must be finite and >= 0.
  Expected<std::vector<double>> numbers(const char* name) {
    if (Status s = exists(name); !s) return s.error();
    std::optional<std::vector<double>> v = h5::read_vector(group_, name);
    if (!v) return Error(fmt::format("{}/{}: cannot be read as numbers", where_, name));
    if (Status s = same_length(name, v->size()); !s) return s.error();
    for (size_t i = 0; i < v->size(); ++i) {
      if (!std::isfinite((*v)[i]) || (*v)[i] < 0) {
        return Error(
            fmt::format("{}/{}: entry {} is {} (must be a number >= 0)", where_, name, i, (*v)[i]));
      }
    }
    return *v;
  }

  Expected<std::vector<std::string>> strings(const char* name) {
    if (Status s = exists(name); !s) return s.error();
    std::optional<std::vector<std::string>> v = h5::read_strings(group_, name);
    if (!v) return Error(fmt::format("{}/{}: cannot be read as strings", where_, name));
    if (Status s = same_length(name, v->size()); !s) return s.error();
    return *v;
  }

 private:
  Status exists(const char* name) const {
    if (H5Lexists(group_, name, H5P_DEFAULT) <= 0) {
      return Error(fmt::format("{}: dataset '{}' is missing", where_, name));
    }
    return {};
  }
  Status same_length(const char* name, size_t n) {
    if (length_ && n != *length_) {
      return Error(fmt::format("{}/{}: has {} entries, the other datasets of the group {}", where_,
                               name, n, *length_));
    }
    length_ = n;
    return {};
  }

  hid_t group_;
  std::string where_;
  std::optional<size_t> length_;
};

// The group's id (close with H5Gclose), or an error naming it.
Expected<hid_t> open_group(hid_t parent, const std::string& name, const std::string& where) {
  if (H5Lexists(parent, name.c_str(), H5P_DEFAULT) <= 0) {
    return Error(fmt::format("{}: group '{}' is missing", where, name));
  }
  hid_t g = H5Gopen2(parent, name.c_str(), H5P_DEFAULT);
  if (g < 0) return Error(fmt::format("{}/{}: not a group", where, name));
  return g;
}

Expected<RankResult> read_rank(hid_t ranks, const std::string& name, const std::string& where,
                               const std::vector<std::string>& axes) {
  const std::string at = fmt::format("{}/{}", where, name);
  RankResult r;
  char* end = nullptr;
  r.rank = static_cast<int>(std::strtol(name.c_str(), &end, 10));
  if (name.empty() || *end != '\0' || r.rank < 0) {
    return Error(fmt::format("{}: '{}' is not a rank number", where, name));
  }
  Expected<hid_t> g_id = open_group(ranks, name, where);
  if (!g_id) return g_id.error();
  Handle g(*g_id, H5Gclose);
  for (const std::string& a : axes) {
    std::optional<double> c = h5::read_number(g.id, a.c_str());
    if (!c) {
      return Error(
          fmt::format("{}: attribute '{}' (the rank's coordinate along mesh axis '{}') is "
                      "missing",
                      at, a, a));
    }
    r.coordinates.push_back(static_cast<int>(*c));
  }
  r.host = h5::read_string(g.id, "host").value_or("");
  r.parameters = h5::read_number(g.id, "parameters").value_or(0);
  r.peak_rss_bytes = h5::read_number(g.id, "peak_rss_bytes").value_or(-1);
  r.gpu = static_cast<int>(h5::read_number(g.id, "gpu").value_or(-1));
  r.peak_allocated_bytes = h5::read_number(g.id, "peak_allocated_bytes").value_or(-1);
  r.peak_reserved_bytes = h5::read_number(g.id, "peak_reserved_bytes").value_or(-1);
  TableReader own(g.id, at);
  auto it = own.numbers("iteration_seconds");
  if (!it) return it.error();
  r.iteration_seconds = *it;
  TableReader own_loss(g.id, at);
  auto loss = own_loss.numbers("loss");
  if (!loss) return loss.error();
  r.losses = *loss;

  Expected<hid_t> ops_id = open_group(g.id, "ops", at);
  if (!ops_id) return ops_id.error();
  Handle ops(*ops_id, H5Gclose);
  TableReader o(ops.id, at + "/ops");
  auto op_name = o.strings("name");
  if (!op_name) return op_name.error();
  auto phase = o.strings("phase");
  if (!phase) return phase.error();
  auto calls = o.numbers("calls");
  if (!calls) return calls.error();
  auto seconds = o.numbers("seconds");
  if (!seconds) return seconds.error();
  for (size_t i = 0; i < op_name->size(); ++i) {
    r.ops.push_back({(*op_name)[i], (*phase)[i], (*calls)[i], (*seconds)[i]});
  }

  Expected<hid_t> cs_id = open_group(g.id, "collectives", at);
  if (!cs_id) return cs_id.error();
  Handle cs(*cs_id, H5Gclose);
  TableReader c(cs.id, at + "/collectives");
  auto kind = c.strings("kind");
  if (!kind) return kind.error();
  auto cax = c.strings("axes");
  if (!cax) return cax.error();
  auto label = c.strings("label");
  if (!label) return label.error();
  auto bytes = c.numbers("bytes");
  if (!bytes) return bytes.error();
  auto ccalls = c.numbers("calls");
  if (!ccalls) return ccalls.error();
  auto cseconds = c.numbers("seconds");
  if (!cseconds) return cseconds.error();
  for (size_t i = 0; i < kind->size(); ++i) {
    r.collectives.push_back(
        {(*kind)[i], (*cax)[i], (*label)[i], (*bytes)[i], (*ccalls)[i], (*cseconds)[i]});
  }

  // /memory: only with --memory-timeline.
  if (H5Lexists(g.id, "memory", H5P_DEFAULT) > 0) {
    Expected<hid_t> mem_id = open_group(g.id, "memory", at);
    if (!mem_id) return mem_id.error();
    Handle mem(*mem_id, H5Gclose);
    TableReader m(mem.id, at + "/memory");
    auto m_name = m.strings("name");
    if (!m_name) return m_name.error();
    auto m_phase = m.strings("phase");
    if (!m_phase) return m_phase.error();
    auto live = m.numbers("live_bytes");
    if (!live) return live.error();
    auto peak = m.numbers("peak_bytes");
    if (!peak) return peak.error();
    for (size_t i = 0; i < m_name->size(); ++i) {
      r.memory.push_back({(*m_name)[i], (*m_phase)[i], (*live)[i], (*peak)[i]});
    }
  }
  return r;
}

// /check: per parameter shard, back onto the ranks; the loss onto the head's ranks.
Status read_check(hid_t file, const std::string& path, RunResults& out) {
  const std::string where = path + ": /check";
  Expected<hid_t> g_id = open_group(file, "check", path + ": /");
  if (!g_id) return g_id.error();
  Handle g(*g_id, H5Gclose);
  for (const char* a : {"passed", "loss", "reference_loss", "rtol", "atol"}) {
    if (!h5::read_number(g.id, a)) {
      return Error(fmt::format("{}: attribute '{}' is missing", where, a));
    }
  }
  out.options.rtol = *h5::read_number(g.id, "rtol");
  out.options.atol = *h5::read_number(g.id, "atol");
  const double loss = *h5::read_number(g.id, "loss");
  const double reference = *h5::read_number(g.id, "reference_loss");
  TableReader t(g.id, where);
  auto rank = t.numbers("rank");
  if (!rank) return rank.error();
  auto name = t.strings("name");
  if (!name) return name.error();
  auto elements = t.numbers("elements");
  if (!elements) return elements.error();
  auto err = t.numbers("max_abs_error");
  if (!err) return err.error();
  auto ref = t.numbers("ref_max_abs");
  if (!ref) return ref.error();
  auto ok = t.numbers("ok");
  if (!ok) return ok.error();
  std::map<int, RankResult*> by_rank;
  for (RankResult& r : out.ranks) {
    r.checked = true;
    r.has_loss = !r.losses.empty();
    if (r.has_loss) {
      r.check_loss = loss;
      r.reference_loss = reference;
    }
    by_rank[r.rank] = &r;
  }
  for (size_t i = 0; i < rank->size(); ++i) {
    auto it = by_rank.find(static_cast<int>((*rank)[i]));
    if (it == by_rank.end()) {
      return Error(fmt::format("{}/rank: entry {} names rank {}, which /ranks does not have", where,
                               i, (*rank)[i]));
    }
    it->second->checks.push_back({(*name)[i], (*elements)[i], (*err)[i], (*ref)[i], (*ok)[i] != 0});
  }
  return {};
}

}  // namespace

Expected<std::string> hdf5_format(const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    return Error(fmt::format("{}: not an HDF5 file (or it does not exist)", path));
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("{}: cannot open", path));
  auto format = h5::read_string(file.id, "format");
  if (!format) return Error(fmt::format("{}: attribute 'format' of / is missing", path));
  return *format;
}

Expected<RunResults> read_run(const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    return Error(fmt::format(
        "{}: not an HDF5 file (or it does not exist); write one with `nnexec run --plan plan.json "
        "--out {}`",
        path, path));
  }
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (file.id < 0) return Error(fmt::format("{}: cannot open", path));
  const hid_t f = file.id;
  auto format = h5::read_string(f, "format");
  if (!format || *format != kRunFormat) {
    return Error(
        fmt::format("{}: attribute 'format' of / is {} (must be \"{}\": a file written by "
                    "`nnexec run`)",
                    path, format ? "\"" + *format + "\"" : std::string("missing"), kRunFormat));
  }
  auto version = h5::read_number(f, "version");
  if (!version || *version != kRunVersion) {
    return Error(fmt::format("{}: attribute 'version' of / is {} (this nnsim reads version {})",
                             path, version ? fmt::format("{}", *version) : "missing", kRunVersion));
  }
  RunResults r;
  for (auto [attr, field] : {std::pair{"device", &r.device},
                             {"dtype", &r.dtype},
                             {"plan_name", &r.plan_name},
                             {"torch_version", &r.torch_version}}) {
    auto v = h5::read_string(f, attr);
    if (!v) return Error(fmt::format("{}: attribute '{}' of / is missing", path, attr));
    *field = *v;
  }
  // The plan: a one-string dataset (an attribute in files of other writers).
  if (auto plan = h5::read_strings(f, "plan"); plan && plan->size() == 1) {
    r.plan_json = plan->front();
  } else if (auto attr = h5::read_string(f, "plan")) {
    r.plan_json = *attr;
  } else {
    return Error(fmt::format("{}: /plan (the plan's JSON, one string) is missing", path));
  }
  auto axes = h5::read_string(f, "mesh_axes");
  if (!axes) return Error(fmt::format("{}: attribute 'mesh_axes' of / is missing", path));
  for (size_t start = 0; !axes->empty() && start <= axes->size();) {
    size_t comma = axes->find(',', start);
    if (comma == std::string::npos) comma = axes->size();
    r.mesh_axes.push_back(axes->substr(start, comma - start));
    start = comma + 1;
  }
  for (auto [attr, field] : {std::pair{"ranks", &r.world},
                             {"iterations", &r.options.iterations},
                             {"warmup", &r.options.warmup},
                             {"threads", &r.options.threads}}) {
    auto v = h5::read_number(f, attr);
    if (!v) return Error(fmt::format("{}: attribute '{}' of / is missing", path, attr));
    *field = static_cast<int>(*v);
  }
  r.options.seed = static_cast<unsigned long long>(h5::read_number(f, "seed").value_or(0));
  r.options.check = h5::read_number(f, "checked").value_or(0) != 0;

  Expected<hid_t> ranks_id = open_group(f, "ranks", path + ": /");
  if (!ranks_id) return ranks_id.error();
  Handle ranks(*ranks_id, H5Gclose);
  for (const std::string& name : h5::children(ranks.id)) {
    Expected<RankResult> k = read_rank(ranks.id, name, path + ": /ranks", r.mesh_axes);
    if (!k) return k.error();
    r.ranks.push_back(std::move(*k));
  }
  std::sort(r.ranks.begin(), r.ranks.end(),
            [](const RankResult& a, const RankResult& b) { return a.rank < b.rank; });
  if (static_cast<int>(r.ranks.size()) != r.world) {
    return Error(fmt::format("{}: /ranks has {} ranks, attribute 'ranks' of / says {}", path,
                             r.ranks.size(), r.world));
  }
  for (int i = 0; i < r.world; ++i) {
    if (r.ranks[i].rank != i) {
      return Error(fmt::format("{}: /ranks/{} is missing (ranks are 0-{})", path, i, r.world - 1));
    }
  }
  if (r.options.check) {
    if (Status s = read_check(f, path, r); !s) return s.error();
  }
  return r;
}

}  // namespace nnsim::hwexec
