// nnexec run's ZeRO layout (hwexec/run_zero_layout.h): parts chunked on their own over the dp
// ranks, element by element. Compiled only where LibTorch is (NNSIM_HAVE_TORCH).
#include <gtest/gtest.h>

#include "hwexec/run_zero_layout.h"

namespace nnsim::hwexec {
namespace {

// Tensors 0..n-1 filled with 100 t + i (tensor t, element i), so every element names itself.
std::vector<at::Tensor> numbered(const std::vector<int64_t>& numels) {
  std::vector<at::Tensor> ts;
  for (std::size_t t = 0; t < numels.size(); ++t) {
    ts.push_back(at::arange(numels[t], at::kFloat) + 100.0 * static_cast<double>(t));
  }
  return ts;
}

TEST(ZeroLayout, OnePartIsThePaddedFlatChunkedInOrder) {
  // 3 + 4 elements over 3 ranks: chunks of 3, two zeros of padding at the end.
  const ZeroLayout l({3, 4}, {2}, 3);
  EXPECT_EQ(l.chunk(), 3);
  const at::Tensor flat = l.flatten(numbered({3, 4}));
  const std::vector<float> want = {0, 1, 2, 100, 101, 102, 103, 0, 0};
  ASSERT_EQ(flat.numel(), 9);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(flat[i].item<float>(), want[i]) << i;
  // Rank 1's chunk holds tensor 1's elements 0-2 at 0-2.
  const auto p = l.pieces(1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].tensor, 1u);
  EXPECT_EQ(p[0].in_chunk, 0);
  EXPECT_EQ(p[0].in_tensor, 0);
  EXPECT_EQ(p[0].length, 3);
}

TEST(ZeroLayout, APartOfItsOwnIsChunkedAloneWhateverSurroundsIt) {
  // Tensor 1 (6 elements, a tied matrix) alone between tensor 0 (2) and tensor 2 (3), 2 ranks:
  // its chunk is elements 3r..3r+2 on rank r whatever the other tensors are, as it would be in
  // a unit of tensor 1 only.
  const ZeroLayout l({2, 6, 3}, {1, 2, 3}, 2);
  EXPECT_EQ(l.part_chunk(1), 3);
  EXPECT_EQ(l.part_offset(1), 1);
  EXPECT_EQ(l.chunk(), 1 + 3 + 2);
  const std::vector<at::Tensor> ts = numbered({2, 6, 3});
  const at::Tensor flat = l.flatten(ts);
  ASSERT_EQ(flat.numel(), 2 * l.chunk());
  for (int r = 0; r < 2; ++r) {
    const at::Tensor mine = flat.narrow(0, r * l.chunk(), l.chunk());
    EXPECT_TRUE(mine.narrow(0, l.part_offset(1), 3).equal(ts[1].narrow(0, 3 * r, 3))) << r;
    // Every piece points at the element it holds.
    int64_t covered = 0;
    for (const ZeroLayout::Piece& p : l.pieces(r)) {
      EXPECT_TRUE(
          mine.narrow(0, p.in_chunk, p.length).equal(ts[p.tensor].narrow(0, p.in_tensor, p.length)))
          << r << " " << p.tensor;
      covered += p.length;
    }
    EXPECT_EQ(covered, r == 0 ? 1 + 3 + 2 : 1 + 3 + 1);  // rank 1's last element is padding
  }
  // An all-gather's output back into the tensors.
  const std::vector<at::Tensor> back = l.unflatten(flat);
  ASSERT_EQ(back.size(), 3u);
  for (std::size_t t = 0; t < 3; ++t) EXPECT_TRUE(back[t].equal(ts[t])) << t;
}

}  // namespace
}  // namespace nnsim::hwexec
