#include "hwexec/run_zero_layout.h"

#include <algorithm>
#include <utility>

namespace nnsim::hwexec {

ZeroLayout::ZeroLayout(std::vector<int64_t> numels, std::vector<std::size_t> part_ends, int dp)
    : numels_(std::move(numels)), part_ends_(std::move(part_ends)), dp_(dp) {
  std::size_t first = 0;
  for (std::size_t end : part_ends_) {
    int64_t n = 0;
    for (std::size_t i = first; i < end; ++i) n += numels_[i];
    part_offset_.push_back(chunk_);
    part_chunk_.push_back((n + dp_ - 1) / dp_);
    chunk_ += part_chunk_.back();
    first = end;
  }
}

int64_t ZeroLayout::numel() const {
  int64_t n = 0;
  for (int64_t k : numels_) n += k;
  return n;
}

at::Tensor ZeroLayout::flatten(const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> parts;
  std::size_t first = 0;
  for (std::size_t k = 0; k < part_ends_.size(); ++k) {
    std::vector<at::Tensor> flat;
    int64_t n = 0;
    for (std::size_t i = first; i < part_ends_[k]; ++i) {
      flat.push_back(tensors[i].reshape({-1}));
      n += numels_[i];
    }
    if (part_chunk_[k] * dp_ > n) {
      flat.push_back(at::zeros({part_chunk_[k] * dp_ - n}, tensors.front().options()));
    }
    parts.push_back(at::cat(flat).view({dp_, part_chunk_[k]}));
    first = part_ends_[k];
  }
  return (parts.size() == 1 ? parts.front() : at::cat(parts, 1)).reshape({-1});
}

std::vector<at::Tensor> ZeroLayout::unflatten(const at::Tensor& full) const {
  const at::Tensor rows = full.view({dp_, chunk_});
  std::vector<at::Tensor> out;
  std::size_t first = 0;
  for (std::size_t k = 0; k < part_ends_.size(); ++k) {
    const at::Tensor part = rows.narrow(1, part_offset_[k], part_chunk_[k]).reshape({-1});
    int64_t offset = 0;
    for (std::size_t i = first; i < part_ends_[k]; ++i) {
      out.push_back(part.narrow(0, offset, numels_[i]));
      offset += numels_[i];
    }
    first = part_ends_[k];
  }
  return out;
}

std::vector<ZeroLayout::Piece> ZeroLayout::pieces(int pos) const {
  std::vector<Piece> out;
  std::size_t first = 0;
  for (std::size_t k = 0; k < part_ends_.size(); ++k) {
    const int64_t lo = pos * part_chunk_[k], hi = lo + part_chunk_[k];
    int64_t offset = 0;
    for (std::size_t i = first; i < part_ends_[k]; ++i) {
      const int64_t a = std::max(lo, offset), e = std::min(hi, offset + numels_[i]);
      if (a < e) out.push_back({i, part_offset_[k] + a - lo, a - offset, e - a});
      offset += numels_[i];
    }
    first = part_ends_[k];
  }
  return out;
}

}  // namespace nnsim::hwexec
