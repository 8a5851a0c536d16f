#include "core/precision.h"

namespace nnsim {

std::string_view to_string(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kTf32:
      return "tf32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
    case Precision::kFp8:
      return "fp8";
  }
  return "?";
}

double bytes_per_element(Precision p) {
  switch (p) {
    case Precision::kFp32:
    case Precision::kTf32:
      return 4;
    case Precision::kBf16:
    case Precision::kFp16:
      return 2;
    case Precision::kFp8:
      return 1;
  }
  return 4;
}

}  // namespace nnsim
