#include "core/hdf5_io.h"

#include <algorithm>
#include <cstring>

namespace nnsim::h5 {

bool write_attr(hid_t obj, const char* name, double v) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(obj, name, H5T_IEEE_F64LE, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  return a.id >= 0 && H5Awrite(a.id, H5T_NATIVE_DOUBLE, &v) >= 0;
}

bool write_attr(hid_t obj, const char* name, long long v) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(obj, name, H5T_STD_I64LE, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  return a.id >= 0 && H5Awrite(a.id, H5T_NATIVE_LLONG, &v) >= 0;
}

bool write_attr(hid_t obj, const char* name, const std::string& v) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.id, v.size() + 1);
  H5Tset_cset(type.id, H5T_CSET_UTF8);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(obj, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  return a.id >= 0 && H5Awrite(a.id, type.id, v.c_str()) >= 0;
}

bool write_vector(hid_t group, const char* name, const std::vector<double>& v) {
  hsize_t n = v.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle set(
      H5Dcreate2(group, name, H5T_IEEE_F64LE, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
      H5Dclose);
  return set.id >= 0 && (n == 0 || H5Dwrite(set.id, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL,
                                            H5P_DEFAULT, v.data()) >= 0);
}

bool write_strings(hid_t group, const char* name, const std::vector<std::string>& v) {
  std::size_t width = 1;
  for (const std::string& s : v) width = std::max(width, s.size() + 1);
  std::vector<char> buf(width * v.size(), '\0');
  for (std::size_t i = 0; i < v.size(); ++i) std::copy(v[i].begin(), v[i].end(), &buf[i * width]);
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.id, width);
  H5Tset_cset(type.id, H5T_CSET_UTF8);
  hsize_t n = v.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle set(H5Dcreate2(group, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose);
  return set.id >= 0 &&
         (n == 0 || H5Dwrite(set.id, type.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) >= 0);
}

hid_t make_group(hid_t parent, const std::string& name) {
  return H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
}

std::optional<double> read_number(hid_t obj, const char* name) {
  if (H5Aexists(obj, name) <= 0) return std::nullopt;
  Handle a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(a.id), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.id);
  if (cls != H5T_FLOAT && cls != H5T_INTEGER) return std::nullopt;
  double v = 0;
  if (H5Aread(a.id, H5T_NATIVE_DOUBLE, &v) < 0) return std::nullopt;
  return v;
}

std::optional<std::string> read_string(hid_t obj, const char* name) {
  if (H5Aexists(obj, name) <= 0) return std::nullopt;
  Handle a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(a.id), H5Tclose);
  if (H5Tget_class(type.id) != H5T_STRING) return std::nullopt;
  if (H5Tis_variable_str(type.id) > 0) {
    char* p = nullptr;
    Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.id, H5T_VARIABLE);
    if (H5Aread(a.id, mem.id, &p) < 0 || p == nullptr) return std::nullopt;
    std::string s(p);
    H5free_memory(p);
    return s;
  }
  std::string s(H5Tget_size(type.id), '\0');
  if (H5Aread(a.id, type.id, s.data()) < 0) return std::nullopt;
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::optional<std::vector<double>> read_vector(hid_t group, const char* name) {
  if (H5Lexists(group, name, H5P_DEFAULT) <= 0) return std::nullopt;
  Handle set(H5Dopen2(group, name, H5P_DEFAULT), H5Dclose);
  Handle space(H5Dget_space(set.id), H5Sclose);
  hssize_t n = H5Sget_simple_extent_npoints(space.id);
  std::vector<double> v(n > 0 ? n : 0);
  if (n > 0 && H5Dread(set.id, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0) {
    return std::nullopt;
  }
  return v;
}

std::optional<std::vector<std::string>> read_strings(hid_t group, const char* name) {
  if (H5Lexists(group, name, H5P_DEFAULT) <= 0) return std::nullopt;
  Handle set(H5Dopen2(group, name, H5P_DEFAULT), H5Dclose);
  Handle type(H5Dget_type(set.id), H5Tclose);
  if (set.id < 0 || H5Tget_class(type.id) != H5T_STRING) return std::nullopt;
  Handle space(H5Dget_space(set.id), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.id);
  std::vector<std::string> v;
  if (n <= 0) return v;
  if (H5Tis_variable_str(type.id) > 0) {
    std::vector<char*> p(static_cast<size_t>(n), nullptr);
    Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.id, H5T_VARIABLE);
    if (H5Dread(set.id, mem.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data()) < 0) return std::nullopt;
    for (char* s : p) {
      v.emplace_back(s ? s : "");
      if (s) H5free_memory(s);
    }
    return v;
  }
  const size_t width = H5Tget_size(type.id);
  std::vector<char> buf(width * static_cast<size_t>(n), '\0');
  if (H5Dread(set.id, type.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0) return std::nullopt;
  for (hssize_t i = 0; i < n; ++i) {
    const char* s = &buf[static_cast<size_t>(i) * width];
    v.emplace_back(s, strnlen(s, width));
  }
  return v;
}

std::vector<std::string> children(hid_t group) {
  std::vector<std::string> names;
  H5G_info_t info;
  if (H5Gget_info(group, &info) < 0) return names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    ssize_t n =
        H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (n < 0) continue;
    std::string name(static_cast<size_t>(n) + 1, '\0');
    H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                       H5P_DEFAULT);
    name.resize(static_cast<size_t>(n));
    names.push_back(name);
  }
  return names;
}

}  // namespace nnsim::h5
