// nnexec's CPU memory counter (hwexec/cpu_memory.h): the bytes of live LibTorch CPU tensors and
// their peak. Compiled only where LibTorch is (NNSIM_HAVE_TORCH).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hwexec/cpu_memory.h"

namespace nnsim::hwexec {
namespace {

TEST(CpuMemory, CountsTensorsWhileTheyLiveAndTheirPeak) {
  if (!count_cpu_memory()) GTEST_SKIP() << "LibTorch built with CUDA: the GPU's allocator counts";
  const double before = cpu_allocated_bytes();
  reset_cpu_peak();
  {
    at::Tensor a = at::empty({1000}, at::kFloat);  // 4000 bytes
    EXPECT_DOUBLE_EQ(cpu_allocated_bytes() - before, 4000);
    {
      at::Tensor b = at::empty({500}, at::kDouble);  // 4000 more
      EXPECT_DOUBLE_EQ(cpu_allocated_bytes() - before, 8000);
    }
    EXPECT_DOUBLE_EQ(cpu_allocated_bytes() - before, 4000);
    EXPECT_DOUBLE_EQ(cpu_peak_bytes() - before, 8000);
    reset_cpu_peak();
    EXPECT_DOUBLE_EQ(cpu_peak_bytes() - before, 4000);
    at::Tensor view = a.narrow(0, 0, 10);  // a view allocates nothing
    EXPECT_DOUBLE_EQ(cpu_allocated_bytes() - before, 4000);
  }
  EXPECT_DOUBLE_EQ(cpu_allocated_bytes(), before);
}

TEST(CpuMemory, ResizingAStorageCountsItsNewBytes) {
  if (!count_cpu_memory()) GTEST_SKIP() << "LibTorch built with CUDA: the GPU's allocator counts";
  const double before = cpu_allocated_bytes();
  at::Tensor a = at::zeros({256}, at::kFloat);
  a.resize_({1024});  // reallocated through the storage's allocator: 4096 bytes, the old freed
  EXPECT_DOUBLE_EQ(cpu_allocated_bytes() - before, 4096);
  a = at::Tensor();
  EXPECT_DOUBLE_EQ(cpu_allocated_bytes(), before);
}

}  // namespace
}  // namespace nnsim::hwexec
