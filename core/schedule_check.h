// Checks a plan's schedule before anything runs it: every device runs every block it must, in an
// order that respects each micro-batch's own dependencies, and the devices together cannot
// deadlock (a device waiting for data another device only produces after waiting for it).
#pragma once

#include <vector>

#include "core/error.h"
#include "core/plan.h"

namespace nnsim {

// One schedule order, as the checker sees it: the order's blocks and the segments its devices
// hold.
struct OrderView {
  std::string name;  // for messages: "pp=1 (GPUs 8-15)"
  std::vector<Block> blocks;
};

// `next_segment[s]` is the segment after s in the pipeline (-1 for the last) and `lane_of_segment`
// the order that runs it. Segments on the same order exchange data without waiting. `passes`:
// forward passes per micro-batch (repeated forwards, Plan::recycle): every segment runs each
// pass's forward once, in pass order, and pass i + 1's first segment needs pass i's last.
Status check_schedule(const std::vector<OrderView>& orders, int num_segments, int micro_batches,
                      const std::vector<int>& next_segment, const std::vector<int>& lane_of_segment,
                      int passes = 1);

// The same with the orders of every segment: a segment spanning several orders (pipeline
// stages) has each of its blocks in every one of them, and such a block is a joint event that
// starts only once every order it spans has reached it.
Status check_schedule(const std::vector<OrderView>& orders, int num_segments, int micro_batches,
                      const std::vector<int>& next_segment,
                      const std::vector<std::vector<int>>& lanes_of_segment, int passes = 1);

}  // namespace nnsim
