// How `nnexec run` lays out a ZeRO unit's tensors over the data-parallel ranks (docs/hwexec.md,
// ZeRO). The tensors are grouped into parts; each part is flattened, zero-padded to dp times its
// chunk and chunked on its own; rank r owns chunk r of every part, side by side. One part is
// the plain flat layout. A tied word matrix on two pipeline stages is a part of its own, so
// both stages' copies shard alike and their reduced chunks can be summed chunk for chunk
// (Megatron puts the shared embedding in a bucket of its own for the same reason).
// Internal to the LibTorch executor (run_torch.cc).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

namespace nnsim::hwexec {

class ZeroLayout {
 public:
  ZeroLayout() = default;
  // `numels`: the tensors' sizes in order; `part_ends`: one past each part's last tensor,
  // increasing, the last numels.size(); `dp` ranks.
  ZeroLayout(std::vector<int64_t> numels, std::vector<std::size_t> part_ends, int dp);

  // The elements a rank owns (every part's chunk).
  int64_t chunk() const { return chunk_; }
  int64_t numel() const;
  // Where part k sits in a rank's chunk, and its length there.
  int64_t part_offset(std::size_t k) const { return part_offset_[k]; }
  int64_t part_chunk(std::size_t k) const { return part_chunk_[k]; }

  // The tensors (numels() elements each, any shape) as dp x chunk() elements, rank by rank:
  // the input of a reduce-scatter, or every rank's master chunk.
  at::Tensor flatten(const std::vector<at::Tensor>& tensors) const;
  // The tensors' flat values from dp x chunk() elements (an all-gather's output).
  std::vector<at::Tensor> unflatten(const at::Tensor& full) const;

  // A run of one tensor's elements inside rank `pos`'s chunk.
  struct Piece {
    std::size_t tensor;
    int64_t in_chunk, in_tensor, length;
  };
  std::vector<Piece> pieces(int pos) const;

 private:
  std::vector<int64_t> numels_;
  std::vector<std::size_t> part_ends_;
  std::vector<int64_t> part_chunk_, part_offset_;
  int dp_ = 1;
  int64_t chunk_ = 0;
};

}  // namespace nnsim::hwexec
