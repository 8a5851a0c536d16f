#include "core/activation_offload.h"

#include <algorithm>

namespace nnsim {

std::vector<int> activation_offload_windows(int layers, int offloaded) {
  // Each window is layers / offloaded long; the first layers % offloaded windows are one
  // longer, so the last one ends at the last layer.
  std::vector<int> window(offloaded);
  const int span = layers / offloaded, longer = layers % offloaded;
  for (int i = 0; i < offloaded; ++i) window[i] = span * (i + 1) - 1 + std::min(i + 1, longer);
  return window;
}

}  // namespace nnsim
