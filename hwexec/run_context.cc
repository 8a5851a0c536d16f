#include "hwexec/run_context.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#ifdef NNSIM_TORCH_HAS_CUDA
#include "hwexec/nccl_comm.h"
#endif

namespace nnsim::hwexec {

namespace {

// The 16-bit format of a bf16 or fp16 tensor, for the collectives.
Comm::Float16 float16_of(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ? Comm::Float16::kFp16 : Comm::Float16::kBf16;
}

// The label of a transfer that arrived early (RankContext::transfer_tag's bits).
const char* tag_label(int64_t tag) {
  return (tag & 1) ? "gradient" : (tag & 2) ? "recycled" : "activation";
}

}  // namespace

void RankContext::all_reduce(at::Tensor& t, const std::vector<int>& group, const std::string& axes,
                             const std::string& label, Comm::Op op) {
  if (group.size() <= 1) return;
  t = t.contiguous();
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) {  // 2 bytes on the wire
    const Comm::Float16 f16 = float16_of(t);
    const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
    if (nccl) {
      ok_or_throw(nccl->all_reduce_bf16(group, t.data_ptr(), t.numel(), op, stats->stream, f16));
      stats->coll("all_reduce", axes, label, static_cast<double>(t.nbytes()), a, stats->mark());
      return;
    }
#endif
    ok_or_throw(comm->all_reduce_bf16(group, static_cast<std::uint16_t*>(t.data_ptr()), t.numel(),
                                      op, f16));
    stats->coll("all_reduce", axes, label, static_cast<double>(t.nbytes()), a, stats->mark());
    return;
  }
  if (t.scalar_type() != at::kFloat) {
    throw RunFailure{
        fmt::format("all-reduce of {}: only fp32, bf16 and fp16 tensors are reduced", label)};
  }
  const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    ok_or_throw(nccl->all_reduce(group, t.data_ptr<float>(), t.numel(), op, stats->stream));
    stats->coll("all_reduce", axes, label, t.numel() * 4.0, a, stats->mark());
    return;
  }
#endif
  ok_or_throw(comm->all_reduce(group, t.data_ptr<float>(), t.numel(), op));
  stats->coll("all_reduce", axes, label, t.numel() * 4.0, a, stats->mark());
}

at::Tensor RankContext::exchange_rows(const std::vector<int>& group, const std::string& axes,
                                      const char* kind, const at::Tensor& in,
                                      const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows,
                                      const std::string& label, double bytes) {
  const at::Tensor x = in.contiguous();
  // A row's elements from the shape, not numel / rows: a rank may hold no rows at all.
  int64_t width = 1;
  for (int64_t d = 1; d < x.dim(); ++d) width *= x.size(d);
  const auto row_bytes = static_cast<std::size_t>(width) * x.element_size();
  std::vector<std::size_t> send_bytes, recv_bytes;
  int64_t rows = 0;
  for (std::size_t i = 0; i < group.size(); ++i) {
    send_bytes.push_back(static_cast<std::size_t>(send_rows[i]) * row_bytes);
    recv_bytes.push_back(static_cast<std::size_t>(recv_rows[i]) * row_bytes);
    rows += recv_rows[i];
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, x.options());
  const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    ok_or_throw(nccl->all_to_all(group, x.data_ptr(), send_bytes, out.data_ptr(), recv_bytes,
                                 stats->stream));
    if (kind) stats->coll(kind, axes, label, bytes, a, stats->mark());
    return out;
  }
#endif
  ok_or_throw(comm->all_to_all(group, x.data_ptr(), send_bytes, out.data_ptr(), recv_bytes));
  if (kind) stats->coll(kind, axes, label, bytes, a, stats->mark());
  return out;
}

at::Tensor RankContext::all_to_all_over(const std::vector<int>& group, const std::string& axes,
                                        const at::Tensor& in, const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows,
                                        const std::string& label, double bytes, bool record) {
  return exchange_rows(group, axes, record ? "all_to_all" : nullptr, in, send_rows, recv_rows,
                       label, bytes);
}

at::Tensor RankContext::all_to_all(const at::Tensor& in, const std::vector<int64_t>& send_rows,
                                   const std::vector<int64_t>& recv_rows, const std::string& label,
                                   double bytes) {
  return exchange_rows(ep_group, ep_axes, "all_to_all", in, send_rows, recv_rows, label, bytes);
}

at::Tensor RankContext::all_gather_rows(const at::Tensor& in, const std::vector<int>& group,
                                        const std::string& axes, const std::string& label,
                                        const std::vector<int64_t>& recv_rows, double bytes) {
  const auto g = static_cast<int64_t>(group.size());
  const std::vector<int64_t> send_rows(group.size(), in.size(0));
  return exchange_rows(group, axes, "all_gather", in.repeat({g, 1}), send_rows, recv_rows, label,
                       bytes);
}

std::vector<int64_t> RankContext::exchange_counts(const std::vector<int>& group,
                                                  const std::vector<int64_t>& send, int64_t per) {
  const std::size_t g = group.size();
  const std::vector<std::size_t> bytes(g, static_cast<std::size_t>(per) * sizeof(int64_t));
  std::vector<int64_t> got(send.size());
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    const at::Tensor in = at::tensor(send, at::kLong).to(options.device());
    at::Tensor out = at::empty_like(in);
    ok_or_throw(
        nccl->all_to_all(group, in.data_ptr(), bytes, out.data_ptr(), bytes, stats->stream));
    const at::Tensor host = out.cpu();
    std::copy(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel(), got.begin());
    return got;
  }
#endif
  ok_or_throw(comm->all_to_all(group, send.data(), bytes, got.data(), bytes));
  return got;
}

at::Tensor RankContext::all_gather(const at::Tensor& in, const std::vector<int>& group,
                                   const std::string& axes, const std::string& label) {
  if (group.size() <= 1) return in.clone();
  const at::Tensor x = in.contiguous();
  // 16-bit values (bf16 or fp16) move as their bit patterns.
  const bool bf16 = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!bf16 && x.scalar_type() != at::kFloat) {
    throw RunFailure{fmt::format("all-gather of {}: only fp32, bf16 and fp16 tensors", label)};
  }
  at::Tensor out = at::empty({static_cast<int64_t>(group.size()) * x.numel()}, x.options());
  const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    ok_or_throw(
        bf16 ? nccl->all_gather_bf16(group, x.data_ptr(), x.numel(), out.data_ptr(), stats->stream)
             : nccl->all_gather(group, x.data_ptr<float>(), x.numel(), out.data_ptr<float>(),
                                stats->stream));
    stats->coll("all_gather", axes, label, static_cast<double>(out.nbytes()), a, stats->mark());
    return out;
  }
#endif
  ok_or_throw(bf16
                  ? comm->all_gather_bf16(group, static_cast<const std::uint16_t*>(x.data_ptr()),
                                          x.numel(), static_cast<std::uint16_t*>(out.data_ptr()))
                  : comm->all_gather(group, x.data_ptr<float>(), x.numel(), out.data_ptr<float>()));
  stats->coll("all_gather", axes, label, static_cast<double>(out.nbytes()), a, stats->mark());
  return out;
}

at::Tensor RankContext::reduce_scatter(const at::Tensor& in, const std::vector<int>& group,
                                       const std::string& axes, const std::string& label) {
  if (group.size() <= 1) return in.clone();
  const at::Tensor x = in.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const Comm::Float16 f16 = float16_of(x);
  if ((!bf16 && x.scalar_type() != at::kFloat) ||
      x.numel() % static_cast<int64_t>(group.size()) != 0) {
    throw RunFailure{
        fmt::format("reduce-scatter of {}: needs fp32, bf16 or fp16 in equal chunks", label)};
  }
  const int64_t n = x.numel() / static_cast<int64_t>(group.size());
  at::Tensor out = at::empty({n}, x.options());
  const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    ok_or_throw(
        bf16 ? nccl->reduce_scatter_bf16(group, x.data_ptr(), n, out.data_ptr(), stats->stream, f16)
             : nccl->reduce_scatter(group, x.data_ptr<float>(), n, out.data_ptr<float>(),
                                    stats->stream));
    stats->coll("reduce_scatter", axes, label, static_cast<double>(x.nbytes()), a, stats->mark());
    return out;
  }
#endif
  ok_or_throw(bf16 ? comm->reduce_scatter_bf16(group,
                                               static_cast<const std::uint16_t*>(x.data_ptr()), n,
                                               static_cast<std::uint16_t*>(out.data_ptr()), f16)
                   : comm->reduce_scatter(group, x.data_ptr<float>(), n, out.data_ptr<float>()));
  stats->coll("reduce_scatter", axes, label, static_cast<double>(x.nbytes()), a, stats->mark());
  return out;
}

void RankContext::send(int peer, const at::Tensor& t, const std::string& label, bool record) {
  at::Tensor c = t.contiguous();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    Expected<void*> s = nccl->send_stream(peer);
    if (!s) throw RunFailure{s.error().message()};
    ok_or_throw(stats->events->order(*s, stats->stream));
    const Mark a = stats->mark(*s);
    ok_or_throw(nccl->send(peer, c.data_ptr(), c.nbytes()));
    if (record) {
      stats->coll("send", pp_axes, label, static_cast<double>(c.nbytes()), a, stats->mark(*s));
    }
    in_flight.push_back(c);
    return;
  }
#endif
  const Mark a = stats->mark();
  ok_or_throw(comm->send(peer, c.data_ptr(), c.nbytes(), kPointToPoint));
  if (record) {
    stats->coll("send", pp_axes, label, static_cast<double>(c.nbytes()), a, stats->mark());
  }
}

at::Tensor RankContext::recv(int peer, at::IntArrayRef shape, const std::string& label, bool record,
                             at::ScalarType dtype, bool compute_dtype) {
  at::Tensor t = at::empty(shape, compute_dtype ? options : options.dtype(dtype));
  const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
  if (nccl) {
    ok_or_throw(nccl->recv(peer, t.data_ptr(), t.nbytes(), stats->stream));
    if (record) {
      stats->coll("recv", pp_axes, label, static_cast<double>(t.nbytes()), a, stats->mark());
    }
    return t;
  }
#endif
  ok_or_throw(comm->recv(peer, t.data_ptr(), t.nbytes(), kPointToPoint));
  if (record) {
    stats->coll("recv", pp_axes, label, static_cast<double>(t.nbytes()), a, stats->mark());
  }
  return t;
}

void RankContext::send_tagged(int peer, const at::Tensor& t, const std::string& label,
                              int64_t tag) {
  if (peer == comm->rank()) {
    // Two segments of one rank next to each other (ZB-V's turn): no transfer.
    early.emplace(std::make_pair(peer, tag), t.clone());
    return;
  }
  send(peer, at::full({1}, tag, options.dtype(at::kLong)), "", /*record=*/false);
  send(peer, t, label);
}

at::Tensor RankContext::recv_tagged(int peer, at::IntArrayRef shape, int64_t tag) {
  if (auto it = early.find({peer, tag}); it != early.end()) {
    at::Tensor t = it->second;
    early.erase(it);
    return t;
  }
  if (peer == comm->rank()) {
    throw RunFailure{
        fmt::format("rank {}: transfer {} from its own segment is not ready (its "
                    "block comes later in the order)",
                    peer, tag)};
  }
  for (;;) {
    const int64_t got =
        recv(peer, {1}, "", /*record=*/false, at::kLong, /*compute_dtype=*/false).item<int64_t>();
    at::Tensor t = recv(peer, shape, tag_label(got));
    if (got == tag) return t;
    if (!early.emplace(std::make_pair(peer, got), t).second) {
      throw RunFailure{
          fmt::format("rank {}: transfer {} from rank {} arrived twice", comm->rank(), got, peer)};
    }
  }
}

}  // namespace nnsim::hwexec
