// nnsim presets: the models and topologies nnsim ships (models/, topologies/) and its GPU
// catalog, so a name for --model, --topo or a topology's gpu can be found, and what it describes
// seen, without opening the files.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace nnsim::tool {

struct PresetsArgs {
  std::string kind;  // "models", "topologies", "gpus" or empty (all)
  std::string json;  // also write them here: each model's full description and parameters
};

CLI::App* add_presets_command(CLI::App& app, PresetsArgs& a);
int run_presets(const PresetsArgs& a);

}  // namespace nnsim::tool
