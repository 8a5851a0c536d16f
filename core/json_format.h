// JSON written for people to read: objects one key per line, short arrays and small objects of
// plain values on one line ("mesh": [["dp", 8], ["pp", 4]], "devices": {"pp": 0}).
// Deterministic: the same value always gives the same text.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace nnsim {

std::string format_json(const nlohmann::ordered_json& value);

}  // namespace nnsim
