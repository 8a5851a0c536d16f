// A field of an input file replaced from the command line (what-if studies without copying the
// file): "node.nics.bandwidth=800 Gb/s". InputNode::load_file applies them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace nnsim {

struct FieldOverride {
  std::string text;                // as given
  std::vector<std::string> field;  // {"node", "nics", "bandwidth"}
  std::string value;               // YAML: "800 Gb/s", "{count: 8, bandwidth: 400 Gb/s}"
};
// "FIELD=VALUE", split at the first '='; FIELD is dot-separated keys.
Expected<FieldOverride> parse_field_override(std::string_view text);

// `name` with the overrides recorded ("dgx-a100x4 with node.nics.bandwidth=400Gb/s, ..."), so a
// changed model or cluster does not pass for the file's; `name` itself when there are none or
// one of them sets the field `name`.
std::string name_with_overrides(const std::string& name,
                                const std::vector<FieldOverride>& overrides);

}  // namespace nnsim
