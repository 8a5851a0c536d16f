// nnsim validate: simulate published runs and compare with what they measured.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct ValidateArgs {
  std::string set;
  std::string json;
  std::string calib;
  std::vector<std::string> only;
  std::string plans_dir;
  int jobs = 0;
};

CLI::App* add_validate_command(CLI::App& app, ValidateArgs& a);
int run_validate(const ValidateArgs& a);

}  // namespace nnsim::tool
