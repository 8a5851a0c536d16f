// Command-line checks shared by the drivers, with messages a user can act on ("--nodes: must be
// at least 1, got 0") where CLI11's own range checks print the whole double range.
#pragma once

#include <charconv>
#include <cstdio>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

namespace nnsim {

// A number no smaller than `min` (`strict`: larger than `min`).
inline CLI::Validator at_least(double min, bool strict = false) {
  return CLI::Validator(
      [min, strict](std::string& text) -> std::string {
        double v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec != std::errc() || end != text.data() + text.size()) {
          return fmt::format("expected a number, got '{}'", text);
        }
        if (v < min || (strict && v == min)) {
          return fmt::format("must be {} {}, got {}", strict ? "more than" : "at least", min, text);
        }
        return "";
      },
      fmt::format("NUMBER{}{}", strict ? ">" : ">=", min));
}

// Parses the command line. Help and version requests print and return 0; a parse error prints
// "<tool>: error: ..." and returns 2; nullopt when the command should run.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             const char* tool) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: error: %s\nRun with --help for more information.\n", tool, e.what());
    return 2;
  }
  return std::nullopt;
}

}  // namespace nnsim
