// Numeric formats of tensors and matrix multiplies.
#pragma once

#include <string>
#include <string_view>

namespace nnsim {

enum class Precision { kFp32, kTf32, kBf16, kFp16, kFp8 };

std::string_view to_string(Precision p);
// Bytes per element of a tensor stored in this format (tf32 is stored as fp32).
double bytes_per_element(Precision p);

}  // namespace nnsim
