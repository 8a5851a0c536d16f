// nnsim presets: the models and topologies nnsim ships (models/, topologies/), so a name for
// --model or --topo can be found, and what it describes seen, without opening the files.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct PresetsArgs {
  std::string kind;  // "models", "topologies" or empty (both)
  std::string json;  // also write them here: each model's full description and parameters
};

CLI::App* add_presets_command(CLI::App& app, PresetsArgs& a);
int run_presets(const PresetsArgs& a);

}  // namespace nnsim::tool
