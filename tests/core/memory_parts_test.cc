#include <gtest/gtest.h>

#include "core/memory_check.h"

namespace nnsim {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

TEST(MemoryParts, LargestFirstWithoutEmptyParts) {
  StaticMemory m;
  m.weights = 2 * kGiB;
  m.gradients = 2 * kGiB;
  m.optimizer = 12 * kGiB;
  m.comm_buffers = 0.25 * kGiB;
  m.runtime = 0.5 * kGiB;
  EXPECT_EQ(describe_memory_parts(m, 5 * kGiB),
            "optimizer state 12.00 GiB, activations 5.00 GiB, weights 2.00 GiB, gradients 2.00 "
            "GiB, NCCL buffers and runtime 768.00 MiB");
}

TEST(MemoryParts, NoteFollowsTheActivations) {
  StaticMemory m;
  m.weights = 1 * kGiB;
  m.pipeline_buffers = 3 * kGiB;
  m.gathered = 4 * kGiB;
  EXPECT_EQ(describe_memory_parts(m, 0.5 * kGiB, "(2 micro-batches in flight)"),
            "ZeRO-3 gathered weights and gradients 4.00 GiB, pipeline receive buffers 3.00 GiB, "
            "weights 1.00 GiB, activations 512.00 MiB (2 micro-batches in flight)");
}

}  // namespace
}  // namespace nnsim
