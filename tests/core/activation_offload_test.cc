// Activation offloading's windows and copies (docs/cost-model.md, "Activation offloading"):
// Transformer Engine's spreading of the copies over the layers, and a copy's time.
#include "core/activation_offload.h"
#include "core/host_copy.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/topology.h"

namespace nnsim {
namespace {

TEST(ActivationOffload, WindowsSpreadTheCopiesOverTheLayers) {
  // Megatron-Core's usual count, one fewer than the layers: each layer's copy is waited for
  // after the next layer's forward.
  std::vector<int> every;
  for (int k = 0; k < 31; ++k) every.push_back(k + 1);
  EXPECT_EQ(activation_offload_windows(32, 31), every);
  // An even split: a window of four layers each.
  EXPECT_EQ(activation_offload_windows(32, 8), (std::vector<int>{3, 7, 11, 15, 19, 23, 27, 31}));
  // 10 layers in 3 windows: the first (10 % 3) window is one longer, the rest shift by it.
  EXPECT_EQ(activation_offload_windows(10, 3), (std::vector<int>{3, 6, 9}));
  EXPECT_EQ(activation_offload_windows(10, 4), (std::vector<int>{2, 5, 7, 9}));
  EXPECT_EQ(activation_offload_windows(2, 1), (std::vector<int>{1}));
  // Always: the last window ends at the last layer, and every offloaded layer's window ends
  // after it, so its copy overlaps at least one later layer's forward.
  for (int layers = 2; layers <= 40; ++layers) {
    for (int n = 1; n < layers; ++n) {
      const std::vector<int> w = activation_offload_windows(layers, n);
      ASSERT_EQ(static_cast<int>(w.size()), n);
      EXPECT_EQ(w.back(), layers - 1) << layers << " " << n;
      for (int k = 0; k < n; ++k) {
        EXPECT_GT(w[k], k) << layers << " " << n << " " << k;
        if (k > 0) EXPECT_GT(w[k], w[k - 1]) << layers << " " << n << " " << k;
      }
    }
  }
}

TEST(ActivationOffload, ACopyTakesItsBytesAtTheLinksMeasuredEfficiency) {
  Expected<Topology> t = load_topology("dgx-a100x4");
  ASSERT_TRUE(t.ok()) << t.error().message();
  const ComputeModel m = ComputeModel::defaults_for(t->gpu);
  // 16 GB/s a GPU at nvbandwidth's 55.06 / 64 (to the host) and 55.43 / 64 (back).
  EXPECT_DOUBLE_EQ(host_copy_seconds(1e9, true, *t, m), 1e9 / (16e9 * 55.06 / 64));
  EXPECT_DOUBLE_EQ(host_copy_seconds(1e9, false, *t, m), 1e9 / (16e9 * 55.43 / 64));
  // The calibration's fields apply.
  ComputeModel calibrated = m;
  calibrated.device_to_host_efficiency = 0.5;
  EXPECT_DOUBLE_EQ(host_copy_seconds(1e9, true, *t, calibrated), 1e9 / 8e9);
  // A PCIe link slower than the host link sets the pace, and its latency counts.
  Topology slow = *t;
  slow.intra.pcie.gpu_link_bandwidth = 4e9;
  slow.intra.pcie.latency = 1e-6;
  EXPECT_EQ(host_link_bandwidth(slow), 4e9);
  EXPECT_DOUBLE_EQ(host_copy_seconds(1e9, true, slow, calibrated), 1e-6 + 1e9 / 2e9);
}

}  // namespace
}  // namespace nnsim
