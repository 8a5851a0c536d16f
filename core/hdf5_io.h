// Small helpers over the HDF5 C API shared by the files nnsim writes and reads (calibration,
// microbenchmark and run files): scoped handles, scalar attributes, 1-D datasets of doubles and
// fixed-length UTF-8 strings, and group listings. Failures come back as false or nullopt.
#pragma once

#include <hdf5.h>

#include <optional>
#include <string>
#include <vector>

namespace nnsim::h5 {

// Closes an HDF5 handle when it goes out of scope.
struct Handle {
  hid_t id;
  herr_t (*close)(hid_t);
  Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (id >= 0) close(id);
  }
};

bool write_attr(hid_t obj, const char* name, double v);
bool write_attr(hid_t obj, const char* name, long long v);
bool write_attr(hid_t obj, const char* name, const std::string& v);  // fixed-length UTF-8
bool write_vector(hid_t group, const char* name, const std::vector<double>& v);
bool write_strings(hid_t group, const char* name, const std::vector<std::string>& v);
hid_t make_group(hid_t parent, const std::string& name);  // close with H5Gclose

// A numeric (float or integer) attribute as a double; a string attribute (fixed or variable
// length); a 1-D dataset of numbers.
std::optional<double> read_number(hid_t obj, const char* name);
std::optional<std::string> read_string(hid_t obj, const char* name);
std::optional<std::vector<double>> read_vector(hid_t group, const char* name);
// A 1-D dataset of strings (fixed or variable length).
std::optional<std::vector<std::string>> read_strings(hid_t group, const char* name);
// Names of the links in a group, in name order.
std::vector<std::string> children(hid_t group);

}  // namespace nnsim::h5
