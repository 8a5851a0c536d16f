#include "hwexec/run_pipeline.h"

#include <fmt/format.h>

#include "hwexec/run_model.h"

namespace nnsim::hwexec {

PipelineTransfers::PipelineTransfers(const Plan& plan, int rank, const RankLayout& layout,
                                     RankContext& ctx)
    : plan_(plan), rank_(rank), layout_(layout), ctx_(ctx) {
  const Split& split = layout.split;
  // The rank's sequences of a micro-batch (expert parallelism splits them over the ep ranks),
  // and its share of their tokens.
  const int64_t b = plan.micro_batch / split.batch_ep, s = plan.model.seq_len,
                h = plan.model.hidden;
  shape_ = {b, s / split.seq / split.cp, h};
  const Mesh& mesh = plan.mesh;
  for (int sg : layout.segments) {
    const auto [p, q] = layout.neighbours.at(sg);
    peers_[sg] = {p >= 0 ? peer_in(mesh, rank, plan.segments[p]) : -1,
                  q >= 0 ? peer_in(mesh, rank, plan.segments[q]) : -1};
  }
  spanning_ = any_spanning(plan);
  for (int sg : spanning_ ? layout.segments : std::vector<int>{}) {
    const auto [p, q] = layout.neighbours.at(sg);
    if (p >= 0) {
      ends_in_[{sg, false}] = transfer_ends(plan, rank, p, sg);
      ends_out_[{sg, true}] = transfer_ends(plan, rank, sg, p);
    }
    if (q >= 0) {
      ends_out_[{sg, false}] = transfer_ends(plan, rank, sg, q);
      ends_in_[{sg, true}] = transfer_ends(plan, rank, q, sg);
    }
  }
  whole_embedding_grad_ = spanning_ && split.seq > 1 && ctx.embed_vocab.pipeline &&
                          plan.model.position != PositionKind::kLearned && !plan.model.dropout;
  // Several segments on a rank (interleaved): transfers between two ranks are matched by
  // (direction, segment, micro-batch), not by their order. Repeated forwards tag them too: the
  // recycled outputs and the gradients travel the same way with the same shape, in orders the
  // schedule may interleave differently on the two ranks; and so do spanning segments, whose
  // blocks interleave the two directions alike.
  tagged_ = plan.recycle > 1 || spanning_;
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& blk : o.blocks) tagged_ = tagged_ || blk.segment != o.blocks.front().segment;
  }
  tp_ = static_cast<int64_t>(ctx.tp_group.size());
  numel_ = b * (s / split.cp) * h;  // a cp rank's share of the sequence
  sliced_ = plan.comm.pp_scatter_gather && tp_ > 1 && split.seq == 1 && numel_ % tp_ == 0;
  // Repeated forwards: the first segment's ranks read the last segment's output of the pass
  // before (the `recycled` transfer; in memory when one rank holds both, as in the program).
  for (const auto& [sg, pq] : layout.neighbours) {
    if (pq.first < 0) first_segment_ = sg;
    if (pq.second < 0) last_segment_ = sg;
  }
  if (plan.recycle > 1 && first_segment_ >= 0) {
    recycle_from_ = peer_in(mesh, rank, plan.segments[last_segment_]);
  }
  if (plan.recycle > 1 && last_segment_ >= 0) {
    recycle_to_ = {peer_in(mesh, rank, plan.segments[first_segment_])};
  }
  if (plan.recycle > 1 && spanning_) {
    // A spanning first or last segment: the last segment's first order hands its output to the
    // first segment's ranks that do not hold the last segment (the program's source_lane).
    const TransferEnds e = transfer_ends(plan, rank, last_segment_, first_segment_);
    recycle_from_ = e.local ? rank : e.recv_from;
    recycle_to_ = e.send_to;
    if (e.local) recycle_to_.push_back(rank);
  }
}

std::vector<int> PipelineTransfers::peers() const {
  std::vector<int> all = {recycle_from_};
  for (const auto& [sg, pq] : peers_) {
    all.push_back(pq.first);
    all.push_back(pq.second);
  }
  all.insert(all.end(), recycle_to_.begin(), recycle_to_.end());
  for (const auto* ends : {&ends_in_, &ends_out_}) {
    for (const auto& [k, e] : *ends) {
      all.push_back(e.recv_from);
      all.insert(all.end(), e.send_to.begin(), e.send_to.end());
    }
  }
  std::vector<int> peers;
  for (int peer : all) {
    if (peer >= 0 && peer != rank_) peers.push_back(peer);
  }
  return peers;
}

void PipelineTransfers::start_iteration() {
  handoff_.clear();
  recycled_.clear();
}

void PipelineTransfers::send(int peer, const at::Tensor& t, const char* label, int64_t tag) {
  const at::Tensor x =
      sliced_ && peer != rank_ ? t.reshape({-1}).chunk(tp_)[ctx_.tp_index].contiguous() : t;
  if (tagged_) {
    ctx_.send_tagged(peer, x, label, tag);
  } else {
    ctx_.send(peer, x, label);
  }
}

at::Tensor PipelineTransfers::recv(int peer, const char* label, int64_t tag) {
  const bool sliced = sliced_ && peer != rank_;
  std::vector<int64_t> piece = shape_;
  if (sliced) piece = {numel_ / tp_};
  at::Tensor x = tagged_ ? ctx_.recv_tagged(peer, piece, tag) : ctx_.recv(peer, piece, label);
  if (!sliced) return x;
  return ctx_.all_gather(x, ctx_.tp_group, ctx_.tp_axes, label).view(shape_);
}

at::Tensor PipelineTransfers::span_recv(int sg, bool gradient, int m, int64_t tag) {
  const TransferEnds& e = ends_in_.at({sg, gradient});
  const Segment& into = plan_.segments[sg];
  if (!e.local && gradient && whole_embedding_grad_ && into.embedding &&
      into.end_layer == into.first_layer) {
    const at::Tensor slice = recv(e.recv_from, "gradient", tag);
    const int64_t n = layout_.split.seq;
    return ctx_.all_gather(slice.reshape({-1}), ctx_.tp_group, ctx_.tp_axes, "gradient")
        .view({n, shape_[0], shape_[1], shape_[2]})
        .permute({1, 0, 2, 3})
        .reshape({shape_[0], n * shape_[1], shape_[2]});
  }
  if (!e.local) return recv(e.recv_from, gradient ? "gradient" : "activation", tag);
  const auto it = handoff_.find({gradient, sg, m});
  if (it == handoff_.end()) {
    throw RunFailure{
        fmt::format("rank {}: the {} of micro-batch {} into segment '{}' is not ready "
                    "(the block producing it comes later in the order)",
                    rank_, gradient ? "gradient" : "activation", m, plan_.segments[sg].name)};
  }
  at::Tensor t = it->second;
  handoff_.erase(it);
  return t;
}

void PipelineTransfers::span_send(int sg, bool gradient, int m, const at::Tensor& t, int to,
                                  int64_t tag) {
  const TransferEnds& e = ends_out_.at({sg, gradient});
  if (e.local) handoff_[{gradient, to, m}] = t;
  for (int peer : e.send_to) send(peer, t, gradient ? "gradient" : "activation", tag);
}

at::Tensor PipelineTransfers::receive_activation(int sg, int m, int pass) {
  const int64_t tag = RankContext::transfer_tag(false, false, sg, m, pass);
  if (spanning_) return span_recv(sg, false, m, tag);
  return recv(peers_.at(sg).first, "activation", tag);
}

void PipelineTransfers::send_activation(int sg, int m, int pass, const at::Tensor& y) {
  const int to = layout_.neighbours.at(sg).second;
  const int64_t tag = RankContext::transfer_tag(false, false, to, m, pass);
  if (spanning_) return span_send(sg, false, m, y, to, tag);
  send(peers_.at(sg).second, y, "activation", tagged_ ? tag : 0);
  // The socket backend has copied it; an NCCL send still reads it (RankContext::in_flight keeps
  // it to the iteration's end).
  if (!ctx_.has_nccl()) resize_storage(y, 0);
}

at::Tensor PipelineTransfers::receive_gradient(int sg, int m, int pass) {
  const int64_t tag = RankContext::transfer_tag(true, false, sg, m, pass);
  if (spanning_) return span_recv(sg, true, m, tag);
  return recv(peers_.at(sg).second, "gradient", tag);
}

void PipelineTransfers::send_gradient(int sg, int m, int pass, const at::Tensor& dx) {
  const int to = layout_.neighbours.at(sg).first;
  const int64_t tag = RankContext::transfer_tag(true, false, to, m, pass);
  if (spanning_) return span_send(sg, true, m, dx, to, tag);
  send(peers_.at(sg).first, dx, "gradient", tagged_ ? tag : 0);
}

at::Tensor PipelineTransfers::receive_recycled(int sg, int m, int pass) {
  if (recycle_from_ == rank_) {
    at::Tensor x = recycled_.at(m);
    recycled_.erase(m);
    return x;
  }
  return recv(recycle_from_, "recycled", RankContext::transfer_tag(false, true, sg, m, pass));
}

void PipelineTransfers::send_recycled(int m, int pass, const at::Tensor& y) {
  for (int peer : recycle_to_) {
    if (peer == rank_) {
      recycled_[m] = y;
    } else {
      // Into the next pass's forward of the first segment.
      send(peer, y, "recycled",
           RankContext::transfer_tag(false, true, first_segment_, m, pass + 1));
    }
  }
}

}  // namespace nnsim::hwexec
