// The LibTorch side of `nnexec run` (docs/hwexec.md): builds this rank's part of a GPT- or
// Llama-style model (LayerNorm or RMSNorm, multi-head or grouped-query attention, GeLU, SwiGLU,
// ReLU or squared ReLU, learned or rotary positions, with or without biases) and runs the plan's
// blocks, in fp32 or, for bf16 plans, in bf16 with fp32 master weights, gradients and Adam. ATen
// only (no torch::nn): every operator of the operator graph (attn.qkv, attn.core, ...) runs as its
// own small autograd graph, from detached inputs, so that its forward and its backward are timed
// alone and the collectives between operators are explicit, as in Megatron-LM:
//   attn.qkv / mlp.fc1: columns split over tp; their input gradient is all-reduced (f).
//   attn.proj / mlp.fc2: rows split; their output (partial sums) is all-reduced (g), the bias
//     added after it (timed in the residual).
//   embed.word: rows (vocabulary) split, looked up with a mask, output all-reduced.
//   head.proj + loss: columns (vocabulary) split, vocab-parallel cross-entropy (all-reduces of
//     the row maximum, the sum of exponentials and the target logit).
// Sequence parallelism turns the tp all-reduces into all-gathers before the column-parallel
// linears and reduce-scatters after the row-parallel ones; ZeRO reduce-scatters gradients and
// all-gathers parameters over dp; recompute rules re-run operators' forwards before the
// backward (the embedding's and the head's too for rules without layers); repeated forwards
// (training.recycle) run earlier passes without autograd, recycling the last segment's output
// into the first segment's embedding; zero-bubble BI blocks defer the linear layers' weight
// gradients to BW (run_split_backward.h); context parallelism splits every sequence over cp,
// attn.core exchanging keys and values (run_context_parallel.h); the head's and the embedding's
// segments may span the pipeline stages, their vocabulary split over pp too (run_spanning.h).
// Collectives follow the compiled program's order and labels (core/compile_blocks.cc).
// On the CPU (--device cpu) the collectives go over the TCP-socket Comm and spans are timed with
// the steady clock. On a GPU (--device cuda, only in a build whose LibTorch has CUDA) every rank
// owns one GPU, the collectives and pipeline transfers are NCCL calls in the same order
// (hwexec/nccl_comm.h), and every span is a pair of CUDA events, resolved after the iteration's
// synchronize.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <sys/resource.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

#include "core/opgraph.h"
#include "core/program.h"
#include "hwexec/comm.h"
#include "hwexec/cpu_memory.h"
#include "hwexec/run.h"
#include "hwexec/run_adam.h"
#include "hwexec/run_attention_products.h"
#include "hwexec/run_context_parallel.h"
#include "hwexec/run_model_masks.h"
#include "hwexec/run_moe.h"
#include "hwexec/run_precision.h"
#include "hwexec/run_spanning.h"
#include "hwexec/run_split_backward.h"
#include "hwexec/run_zero3.h"
#include "hwexec/run_zero_layout.h"

#ifdef NNSIM_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "hwexec/nccl_comm.h"
#endif

namespace nnsim::hwexec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Internal: thrown inside this file, returned as an Error by run_rank.
struct Failure {
  std::string message;
};

void ok_or_throw(const Status& s) {
  if (!s) throw Failure{s.error().message()};
}

// A point in time: the steady clock's on the CPU, a recorded CUDA event on a GPU. `colls` is how
// many collectives had been recorded before it (an operator's span can exclude them).
struct Mark {
  Clock::time_point t;
  int event = -1;
  std::size_t colls = 0;
};

#ifdef NNSIM_TORCH_HAS_CUDA
using Events = CudaEvents;
#else
// Never constructed without CUDA LibTorch: marks are steady-clock times.
struct Events {
  Expected<int> record(void*) { return Error("no CUDA"); }
  Expected<double> elapsed(int, int) const { return Error("no CUDA"); }
  void reset() {}
};
#endif

// The bytes of tensors live on the rank's device: nnexec's CPU counter (cpu_memory.h) or LibTorch's
// CUDA caching allocator, whose counts are kept on the host as tensors are made and freed.
class MemoryProbe {
 public:
  // A CPU rank counts when LibTorch lets it; a GPU rank (`cuda_device` >= 0) always can.
  explicit MemoryProbe(int cuda_device) : cuda_(cuda_device) {
    counts_ = cuda_ >= 0 || count_cpu_memory();
  }
  bool counts() const { return counts_; }
  // The measured peaks start from what is live now.
  void reset() {
    if (!counts_) return;
    restart();
    peak_ = read().live;
    reserved_peak_ = -1;
  }
  // {live now, the most live since the last reset or sample}; starts the next window.
  std::pair<double, double> sample() {
    if (!counts_) return {-1, -1};
    const Reading r = read();
    restart();
    peak_ = std::max(peak_, r.window_peak);
    return {r.live, r.window_peak};
  }
  // The most live over all windows since reset(); -1 where nothing counts.
  double peak() {
    if (counts_) sample();
    return peak_;
  }
  double reserved_peak() const { return reserved_peak_; }

 private:
  struct Reading {
    double live, window_peak;
  };
  // One read of the counts (on a GPU, one copy of the caching allocator's statistics).
  Reading read() {
#ifdef NNSIM_TORCH_HAS_CUDA
    if (cuda_ >= 0) {
      const auto st =
          c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(cuda_));
      // [0]: the small and large pools together.
      reserved_peak_ = std::max(reserved_peak_, static_cast<double>(st.reserved_bytes[0].peak));
      return {static_cast<double>(st.allocated_bytes[0].current),
              static_cast<double>(st.allocated_bytes[0].peak)};
    }
#endif
    return {cpu_allocated_bytes(), cpu_peak_bytes()};
  }
  void restart() {
#ifdef NNSIM_TORCH_HAS_CUDA
    if (cuda_ >= 0) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(cuda_));
      return;
    }
#endif
    reset_cpu_peak();
  }

  int cuda_ = -1;
  bool counts_ = false;
  double peak_ = -1, reserved_peak_ = -1;
};

// Spans of one iteration, resolved into per-operator and per-collective totals at its end (on a
// GPU, after the synchronize, when the events have completed).
struct Stats {
  bool recording = false;
  Events* events = nullptr;  // null: steady clock
  void* stream = nullptr;    // the compute stream (GPU)
  std::map<std::pair<std::string, std::string>, OpTime> ops;
  std::map<std::tuple<std::string, std::string, std::string, double>, CollTime> colls;

  struct PendingOp {
    std::string name;
    const char* phase;
    Mark a, b;
    bool minus_collectives;
  };
  struct PendingColl {
    const char* kind;
    std::string axes, label;
    double bytes;
    Mark a, b;
  };
  std::vector<PendingOp> pending_ops;
  std::vector<PendingColl> pending_colls;
  // --memory-timeline: the memory at every operator span's end, of the last measured iteration.
  MemoryProbe* memory = nullptr;
  bool memory_timeline = false;
  std::vector<OpMemory> memory_samples;

  // Now, on `on` (a stream; the compute stream when null) on a GPU.
  Mark mark(void* on = nullptr) {
    Mark m;
    m.colls = pending_colls.size();
    if (events == nullptr) {
      m.t = Clock::now();
      return m;
    }
    Expected<int> e = events->record(on ? on : stream);
    if (!e) throw Failure{e.error().message()};
    m.event = *e;
    return m;
  }
  double seconds(const Mark& a, const Mark& b) const {
    if (events == nullptr) return std::chrono::duration<double>(b.t - a.t).count();
    Expected<double> s = events->elapsed(a.event, b.event);
    if (!s) throw Failure{s.error().message()};
    return *s;
  }
  // An operator's span; `minus_collectives`: without the collectives recorded inside it.
  void op(const std::string& name, const char* phase, const Mark& a, const Mark& b,
          bool minus_collectives = false) {
    if (!recording) return;
    pending_ops.push_back({name, phase, a, b, minus_collectives});
    if (memory_timeline && memory->counts()) {
      const auto [live, peak] = memory->sample();
      memory_samples.push_back({name, phase, live, peak});
    }
  }
  void coll(const char* kind, const std::string& axes, const std::string& label, double bytes,
            const Mark& a, const Mark& b) {
    if (recording) pending_colls.push_back({kind, axes, label, bytes, a, b});
  }
  // Adds the iteration's spans to the totals (on a GPU, after a synchronize).
  void resolve() {
    std::vector<double> coll_seconds;
    for (const PendingColl& p : pending_colls) {
      coll_seconds.push_back(seconds(p.a, p.b));
      CollTime& c = colls[{p.kind, p.axes, p.label, p.bytes}];
      c.kind = p.kind;
      c.axes = p.axes;
      c.label = p.label;
      c.bytes = p.bytes;
      c.calls += 1;
      c.seconds += coll_seconds.back();
    }
    for (const PendingOp& p : pending_ops) {
      double s = seconds(p.a, p.b);
      if (p.minus_collectives) {
        for (std::size_t i = p.a.colls; i < p.b.colls; ++i) s -= coll_seconds[i];
      }
      OpTime& o = ops[{p.name, p.phase}];
      o.name = p.name;
      o.phase = p.phase;
      o.calls += 1;
      o.seconds += s;
    }
    pending_ops.clear();
    pending_colls.clear();
    if (events) events->reset();
  }
};

// The 16-bit format of a bf16 or fp16 tensor, for the collectives.
Comm::Float16 float16_of(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ? Comm::Float16::kFp16 : Comm::Float16::kBf16;
}

// Groups and collectives of one rank. Groups of one rank (the unpartitioned reference) do
// nothing. With `nccl` set (a GPU), NCCL carries them, on the compute stream (sends: on the
// peer's send stream, after the compute stream's work so far).
struct Ctx {
  Comm* comm = nullptr;
  Stats* stats = nullptr;
  at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
  std::vector<int> tp_group{0}, dp_group{0};
  std::string tp_axes = "tp", pp_axes = "pp";
  // The gradient sums' group is dp's, and cp's with context parallelism (`dp_axes`); the cp
  // ring's group and this rank's neighbours in it.
  std::string dp_axes = kDataParallelAxis;
  std::vector<int> cp_group{0};
  std::string cp_axes = "cp";
  int cp_next = -1, cp_prev = -1;
  int tp_index = 0;
  // Expert parallelism: the ranks that split the experts (and the batch of the rest).
  std::vector<int> ep_group{0};
  std::string ep_axes = "ep";
#ifdef NNSIM_TORCH_HAS_CUDA
  NcclComms* nccl = nullptr;
#endif
  std::vector<at::Tensor> in_flight;  // sent tensors, kept until the iteration's synchronize
  bool has_nccl() const {
#ifdef NNSIM_TORCH_HAS_CUDA
    return nccl != nullptr;
#else
    return false;
#endif
  }
  // The socket Comm's channel of point-to-point transfers (pipeline, cp ring): apart from the
  // collectives', whose messages may pass between the same two ranks in between (a segment
  // spanning the pipeline stages all-reduces over pp).
  static constexpr int kPointToPoint = 1;

  void all_reduce(at::Tensor& t, const std::vector<int>& group, const std::string& axes,
                  const std::string& label, Comm::Op op = Comm::Op::kSum) {
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
      throw Failure{
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
  // All-to-all over the expert-parallel group of `in`'s rows (any dtype): send_rows[i] rows to
  // member i, recv_rows[i] rows from it, each member's in group order. Recorded with `bytes`.
  at::Tensor all_to_all(const at::Tensor& in, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows, const std::string& label,
                        double bytes) {
    const at::Tensor x = in.contiguous();
    const int64_t width = x.numel() / std::max<int64_t>(x.size(0), 1);
    const auto row_bytes = static_cast<std::size_t>(width) * x.element_size();
    std::vector<std::size_t> send_bytes, recv_bytes;
    int64_t rows = 0;
    for (std::size_t i = 0; i < ep_group.size(); ++i) {
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
      ok_or_throw(nccl->all_to_all(ep_group, x.data_ptr(), send_bytes, out.data_ptr(), recv_bytes,
                                   stats->stream));
      stats->coll("all_to_all", ep_axes, label, bytes, a, stats->mark());
      return out;
    }
#endif
    ok_or_throw(comm->all_to_all(ep_group, x.data_ptr(), send_bytes, out.data_ptr(), recv_bytes));
    stats->coll("all_to_all", ep_axes, label, bytes, a, stats->mark());
    return out;
  }
  // The routed copies' counts (`per` integers to each member of the expert-parallel group, in
  // group order): what each member sends this rank. Not recorded (metadata; the program moves
  // the copies only).
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per) {
    const std::size_t g = ep_group.size();
    const std::vector<std::size_t> bytes(g, static_cast<std::size_t>(per) * sizeof(int64_t));
    std::vector<int64_t> got(send.size());
#ifdef NNSIM_TORCH_HAS_CUDA
    if (nccl) {
      const at::Tensor in = at::tensor(send, at::kLong).to(options.device());
      at::Tensor out = at::empty_like(in);
      ok_or_throw(
          nccl->all_to_all(ep_group, in.data_ptr(), bytes, out.data_ptr(), bytes, stats->stream));
      const at::Tensor host = out.cpu();
      std::copy(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel(), got.begin());
      return got;
    }
#endif
    ok_or_throw(comm->all_to_all(ep_group, send.data(), bytes, got.data(), bytes));
    return got;
  }
  // All-gather (fp32 or bf16): `in` (n elements) from each member of `group`, in group
  // order; bytes recorded as the gathered output (nccl-tests' convention, the program's).
  at::Tensor all_gather(const at::Tensor& in, const std::vector<int>& group,
                        const std::string& axes, const std::string& label) {
    if (group.size() <= 1) return in.clone();
    const at::Tensor x = in.contiguous();
    // 16-bit values (bf16 or fp16) move as their bit patterns.
    const bool bf16 = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
    if (!bf16 && x.scalar_type() != at::kFloat) {
      throw Failure{fmt::format("all-gather of {}: only fp32, bf16 and fp16 tensors", label)};
    }
    at::Tensor out = at::empty({static_cast<int64_t>(group.size()) * x.numel()}, x.options());
    const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
    if (nccl) {
      ok_or_throw(bf16 ? nccl->all_gather_bf16(group, x.data_ptr(), x.numel(), out.data_ptr(),
                                               stats->stream)
                       : nccl->all_gather(group, x.data_ptr<float>(), x.numel(),
                                          out.data_ptr<float>(), stats->stream));
      stats->coll("all_gather", axes, label, static_cast<double>(out.nbytes()), a, stats->mark());
      return out;
    }
#endif
    ok_or_throw(
        bf16 ? comm->all_gather_bf16(group, static_cast<const std::uint16_t*>(x.data_ptr()),
                                     x.numel(), static_cast<std::uint16_t*>(out.data_ptr()))
             : comm->all_gather(group, x.data_ptr<float>(), x.numel(), out.data_ptr<float>()));
    stats->coll("all_gather", axes, label, static_cast<double>(out.nbytes()), a, stats->mark());
    return out;
  }
  // Reduce-scatter (sum; fp32 or bf16) of `in` (group size x n elements): this rank's n-element
  // chunk of the sum; bytes recorded as the input.
  at::Tensor reduce_scatter(const at::Tensor& in, const std::vector<int>& group,
                            const std::string& axes, const std::string& label) {
    if (group.size() <= 1) return in.clone();
    const at::Tensor x = in.contiguous();
    const bool bf16 = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
    const Comm::Float16 f16 = float16_of(x);
    if ((!bf16 && x.scalar_type() != at::kFloat) ||
        x.numel() % static_cast<int64_t>(group.size()) != 0) {
      throw Failure{
          fmt::format("reduce-scatter of {}: needs fp32, bf16 or fp16 in equal chunks", label)};
    }
    const int64_t n = x.numel() / static_cast<int64_t>(group.size());
    at::Tensor out = at::empty({n}, x.options());
    const Mark a = stats->mark();
#ifdef NNSIM_TORCH_HAS_CUDA
    if (nccl) {
      ok_or_throw(bf16 ? nccl->reduce_scatter_bf16(group, x.data_ptr(), n, out.data_ptr(),
                                                   stats->stream, f16)
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
  // ZeRO-3: before parameter unit `u` (forward order: the embedding, each layer, the head) runs
  // its forward or its backward, and after its backward. Unset: nothing to do.
  std::function<void(int, bool)> before_unit;
  std::function<void(int)> after_unit_backward;
  void unit_before(int u, bool backward) {
    if (before_unit) before_unit(u, backward);
  }
  void unit_after_backward(int u) {
    if (after_unit_backward) after_unit_backward(u);
  }
  // ZeRO-3 tensor by tensor (DeepSpeed's prefetch, comm.zero3_prefetch_elements): before
  // operator `op` of unit `u` runs its forward (`recompute`: inside the backward) or its
  // backward. Unset: nothing to do.
  std::function<void(int, const std::string&, bool)> before_op;
  void op_before(int u, const std::string& op, bool recompute) {
    if (before_op) before_op(u, op, recompute);
  }
  void tp_all_reduce(at::Tensor& t, const std::string& label, Comm::Op op = Comm::Op::kSum) {
    all_reduce(t, tp_group, tp_axes, label, op);
  }
  // The vocabulary-parallel operators' groups (embed.word's, head.proj's and the loss's): the
  // tensor-parallel group, or with the pipeline axes too where their segment spans the stages
  // (run_spanning.h). Partial sums are reduced axis by axis (`label_of` names each reduction),
  // the loss's statistics over the whole group.
  VocabSplit embed_vocab, head_vocab;
  void vocab_reduce(const VocabSplit& v, at::Tensor& t,
                    const std::function<std::string(const VocabSplit::Axis&)>& label_of) {
    for (const VocabSplit::Axis& a : v.per_axis) all_reduce(t, a.group, a.name, label_of(a));
  }
  void vocab_all_reduce(const VocabSplit& v, at::Tensor& t, const std::string& label,
                        Comm::Op op = Comm::Op::kSum) {
    all_reduce(t, v.group, v.axes, label, op);
  }
  // `record` false: not a transfer of the plan (an interleaved transfer's header).
  void send(int peer, const at::Tensor& t, const std::string& label, bool record = true) {
    at::Tensor c = t.contiguous();
#ifdef NNSIM_TORCH_HAS_CUDA
    if (nccl) {
      Expected<void*> s = nccl->send_stream(peer);
      if (!s) throw Failure{s.error().message()};
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
  at::Tensor recv(int peer, at::IntArrayRef shape, const std::string& label, bool record = true,
                  at::ScalarType dtype = at::kFloat, bool compute_dtype = true) {
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
  // Interleaved pipelines: two ranks exchange the transfers of several segments, and one may
  // send them in another order than the other receives them. Each transfer follows a header
  // holding its tag; a receive keeps the transfers that arrive before the one it waits for.
  std::map<std::pair<int, int64_t>, at::Tensor> early;  // (peer, tag) -> transfer
  // A transfer's tag: bit 0 a gradient, bit 1 a recycled output (repeated forwards), then the
  // segment it goes into, the micro-batch and the receiving forward's pass. A transfer that
  // arrives early is recorded under its own label (from its tag).
  static int64_t transfer_tag(bool gradient, bool recycled, int to, int micro_batch, int pass) {
    return (gradient ? 1 : 0) + (recycled ? 2 : 0) + 4 * (to + 1000 * int64_t{micro_batch}) +
           (int64_t{pass} << 40);
  }
  static const char* tag_label(int64_t tag) {
    return (tag & 1) ? "gradient" : (tag & 2) ? "recycled" : "activation";
  }
  void send_tagged(int peer, const at::Tensor& t, const std::string& label, int64_t tag) {
    if (peer == comm->rank()) {
      // Two segments of one rank next to each other (ZB-V's turn): no transfer.
      early.emplace(std::make_pair(peer, tag), t.clone());
      return;
    }
    send(peer, at::full({1}, tag, options.dtype(at::kLong)), "", /*record=*/false);
    send(peer, t, label);
  }
  at::Tensor recv_tagged(int peer, at::IntArrayRef shape, int64_t tag) {
    if (auto it = early.find({peer, tag}); it != early.end()) {
      at::Tensor t = it->second;
      early.erase(it);
      return t;
    }
    if (peer == comm->rank()) {
      throw Failure{
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
        throw Failure{fmt::format("rank {}: transfer {} from rank {} arrived twice", comm->rank(),
                                  got, peer)};
      }
    }
  }
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Param {
  std::string name;
  at::Tensor w;                                      // this rank's shard, requires grad
  std::function<at::Tensor(const at::Tensor&)> cut;  // full tensor -> this rank's shard
  at::Tensor m, v;                                   // Adam moments
  // What the operators use: w itself in fp32; in bf16, its copy made once per iteration inside
  // autograd, so the weight gradients of every micro-batch reach w's fp32 gradient.
  at::Tensor c;
  // A routed expert's (moe.fc1, moe.fc2): with expert parallelism its gradient sums over dp
  // only, each ep rank holding other experts.
  bool routed_expert = false;
};

// The operator a parameter belongs to: its name without the layer's prefix ("layers.3.") and
// the tensor's own name ("weight", "bias"): "attn.qkv", "embed.word".
std::string operator_of(const std::string& param) {
  std::string name = param;
  if (name.rfind("layers.", 0) == 0) name = name.substr(name.find('.', 7) + 1);
  return name.substr(0, name.rfind('.'));
}

// Tensor-parallel degrees of the three operator groups (1 = replicated on every tp rank).
struct Split {
  int heads = 1, ffn = 1, embed_vocab = 1, head_vocab = 1;
  // Sequence parallelism: `seq` ranks (the tensor-parallel group) each hold a slice of the
  // sequence between the column- and row-parallel linears (Megatron-LM's).
  int seq = 1;
  // The column-parallel linears keep their gathered input for the backward instead of dropping
  // it and gathering it again (communication.save_gathered_inputs: PyTorch's DTensor).
  bool save_gathered = false;
  // Context parallelism: `cp` ranks each hold the tokens at cp_positions(seq_len, cp, cp_index)
  // of every sequence, through every operator.
  int cp = 1, cp_index = 0;
  // Expert parallelism: `ep` ranks each hold experts / ep of the routed experts (the
  // ep_index-th run of them) and micro_batch / ep of each micro-batch's sequences.
  int ep = 1, ep_index = 0;
  // The rank's vocabulary shard of embed.word and head.proj when they are split along the
  // pipeline axes too (run_spanning.h); -1: its place in the tensor-parallel group.
  int embed_vocab_index = -1, head_vocab_index = -1;
};

// Frees or reallocates a tensor's storage in place (FSDP's trick): autograd's saved references
// stay valid, so a sequence-parallel linear's gathered input can be dropped after the forward
// and gathered again into the same storage before the backward. Only ever to 0 bytes and back
// from 0, so there is nothing to copy: the storage's own allocator (the caching allocator on a
// GPU) gives the new block, through StorageImpl's public interface rather than ATen's internal
// per-device resize functions.
void resize_storage(const at::Tensor& t, std::size_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

struct LayerParams {
  Param *ln1g = nullptr, *ln1b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr,
        *proj_b = nullptr, *ln2g = nullptr, *ln2b = nullptr, *fc1_w = nullptr, *fc1_b = nullptr,
        *fc2_w = nullptr, *fc2_b = nullptr;
  // model.qk_norm: the queries' and the keys' scales (and shifts), shared by the heads.
  Param *qn_g = nullptr, *kn_g = nullptr, *qn_b = nullptr, *kn_b = nullptr;
  // A mixture-of-experts block (ModelSpec::is_moe_layer; fc1_w and fc2_w null): the router, the
  // experts' weights stacked ([experts, in, out]) and the shared expert's MLP.
  bool moe = false;
  Param *router_w = nullptr, *efc1_w = nullptr, *efc1_b = nullptr, *efc2_w = nullptr,
        *efc2_b = nullptr, *sfc1_w = nullptr, *sfc1_b = nullptr, *sfc2_w = nullptr,
        *sfc2_b = nullptr;
};

// One operator's forward: its output and the detached inputs whose gradients its backward gives.
struct Unit {
  at::Tensor out;
  std::vector<at::Tensor> in;
  std::vector<at::Tensor> weights;       // a linear layer's master weights (a BI block defers them)
  std::shared_ptr<CpAttentionSaved> cp;  // context-parallel attn.core: its ring backward's state
};

// Expert parallelism: a layer's routed copies between the ep ranks. This rank's copies, in
// global expert order, go to the members holding their experts (send_rows to each, in group
// order); it receives every member's copies for its own experts (recv_rows from each), member
// by member, each member's in expert order, and reorders them expert by expert
// (to_expert_major; to_source_major undoes it) for the grouped GEMMs (local_counts rows each).
struct ExpertExchange {
  std::vector<int64_t> send_rows, recv_rows, local_counts;
  at::Tensor to_expert_major, to_source_major;
};

at::Tensor leaf(const at::Tensor& t) {
  return t.detach().requires_grad_(true);
}

struct LayerTape {
  Unit n1, qkv, qkn, core, proj, res1, n2, fc1, act, fc2, res2;
  // A mixture-of-experts block's operators, and its routing: each token's experts ([tokens,
  // k]), the routed copies in expert order (their token) and each expert's count.
  Unit sfc1, sact, sfc2, router, dispatch, efc1, eact, efc2, combine;
  MoeRouting routing;
  // Expert parallelism: how the routed copies travel (ExpertExchange), the experts' input (every
  // rank's copies for this rank's experts, expert by expert) and their outputs returned to this
  // rank's copies (the combine's input).
  ExpertExchange exchange;
  at::Tensor exchanged, returned;
  DropoutKey key;           // the micro-batch's dropout masks (a recomputation draws them again)
  at::Tensor x;             // the layer's input, kept when the layer recomputes operators
  bool recomputed = false;  // an R block has run the recomputation already
  std::vector<std::pair<const char*, Unit*>> units() {
    return {{"attn.norm", &n1},        {"attn.qkv", &qkv},        {"attn.qk_norm", &qkn},
            {"attn.core", &core},      {"attn.proj", &proj},      {"attn.residual", &res1},
            {"mlp.norm", &n2},         {"mlp.fc1", &fc1},         {"mlp.act", &act},
            {"mlp.fc2", &fc2},         {"moe.shared.fc1", &sfc1}, {"moe.shared.act", &sact},
            {"moe.shared.fc2", &sfc2}, {"moe.router", &router},   {"moe.dispatch", &dispatch},
            {"moe.fc1", &efc1},        {"moe.act", &eact},        {"moe.fc2", &efc2},
            {"moe.combine", &combine}, {"mlp.residual", &res2}};
  }
};

struct MicroBatchTape {
  DropoutKey key;  // which masks model.dropout applies: the iteration and the samples' rows
  Unit word, pos, drop;
  std::vector<LayerTape> layers;
  Unit hnorm, hproj;
  // The loss's saved pieces: exp(logits - max), its sum, and each token's target column with a
  // 1 where this rank's vocabulary shard holds it (Megatron's vocab-parallel cross-entropy
  // keeps the same; no [tokens, vocab] one-hot).
  at::Tensor ez, se, target_index, target_mask;
  at::Tensor loss;  // 0-dimensional, on the device (read after the iteration)
  std::vector<DeferredWeightGrad> deferred;  // a BI block's weight gradients, for its BW
  // Recompute rules without layers: what the embedding's and the head's recomputation reads,
  // and whether an R block has run it.
  at::Tensor tokens, recycled, head_x, targets;
  bool embed_recomputed = false, head_recomputed = false;
};

class Model {
 public:
  // `embedding_word`: for a tied head in a segment of its own on the embedding's ranks (a
  // V-shaped placement), the embedding part's matrix, which the head projects with (one
  // parameter, both uses' gradients accumulated in it; the program's head_shares_embedding).
  Model(const ModelSpec& spec, int first, int end, bool embedding, bool head, Split split,
        int tp_index, unsigned long long seed, at::Device device, at::ScalarType dtype,
        Param* embedding_word = nullptr)
      : device_(device),
        dtype_(dtype),
        spec_(spec),
        first_(first),
        end_(end),
        embedding_(embedding),
        head_(head),
        split_(split),
        t_(tp_index),
        seed_(seed) {
    const int64_t h = spec.hidden, a = spec.heads, k = spec.kv_heads, d = spec.head_dim(),
                  f = spec.ffn_hidden, V = spec.vocab, s = spec.seq_len;
    // attn.qkv's columns: per key/value head, its group of a / k query heads, then its key and
    // its value head (Megatron's layout), so a tensor-parallel rank holds whole groups.
    const int64_t g = a / k, kl = k / split.heads, fl = f / split.ffn;
    // mlp.fc1's columns for SwiGLU: the gate's f, then the up projection's f; a rank holds the
    // same slice of each.
    const int64_t branches = spec.gated_mlp() ? 2 : 1;
    const int ta = split.heads > 1 ? t_ : 0, tf = split.ffn > 1 ? t_ : 0;
    auto whole = [](const at::Tensor& x) { return x; };
    positions_ =
        (split.cp > 1 ? cp_positions(s, split.cp, split.cp_index) : at::arange(s, at::kLong))
            .to(device);
    // The rank's query heads are the global heads [ta kl g, (ta + 1) kl g) (whole key/value
    // groups): ALiBi's slopes and the attention's dropout masks are those heads'.
    first_head_ = ta * kl * g;
    if (spec.position == PositionKind::kAlibi)
      alibi_ = alibi_slopes_of(a, first_head_, kl * g, device);
    if (embedding_) {
      const int64_t vl = V / split.embed_vocab;
      const int tv = vocab_index(/*head=*/false);
      word_ = add("embed.word.weight", {V, h}, 0.1, 0,
                  [=](const at::Tensor& x) { return x.narrow(0, tv * vl, vl); });
      if (spec.position == PositionKind::kLearned) {
        pos_ = add("embed.position.weight", {s, h}, 0.1, 0, whole);
      }
    }
    for (int l = first_; l < end_; ++l) {
      const std::string p = fmt::format("layers.{}.", l);
      LayerParams L;
      L.ln1g = add(p + "attn.norm.weight", {h}, 0.1, 1, whole);
      if (spec.bias) L.ln1b = add(p + "attn.norm.bias", {h}, 0.1, 0, whole);
      L.qkv_w = add(p + "attn.qkv.weight", {h, k * (g + 2) * d}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({h, k, g + 2, d}).narrow(1, ta * kl, kl).reshape({h, kl * (g + 2) * d});
      });
      if (spec.bias) {
        L.qkv_b = add(p + "attn.qkv.bias", {k * (g + 2) * d}, 0.05, 0, [=](const at::Tensor& x) {
          return x.view({k, g + 2, d}).narrow(0, ta * kl, kl).reshape({kl * (g + 2) * d});
        });
      }
      if (spec.qk_norm) {
        const bool shift = spec.norm == NormKind::kLayerNorm && spec.bias;
        L.qn_g = add(p + "attn.qk_norm.q_weight", {d}, 0.1, 1, whole);
        L.kn_g = add(p + "attn.qk_norm.k_weight", {d}, 0.1, 1, whole);
        if (shift) L.qn_b = add(p + "attn.qk_norm.q_bias", {d}, 0.1, 0, whole);
        if (shift) L.kn_b = add(p + "attn.qk_norm.k_bias", {d}, 0.1, 0, whole);
      }
      L.proj_w = add(p + "attn.proj.weight", {a * d, h}, 0.05, 0,
                     [=](const at::Tensor& x) { return x.narrow(0, ta * kl * g * d, kl * g * d); });
      if (spec.bias) L.proj_b = add(p + "attn.proj.bias", {h}, 0.05, 0, whole);
      L.ln2g = add(p + "mlp.norm.weight", {h}, 0.1, 1, whole);
      if (spec.bias) L.ln2b = add(p + "mlp.norm.bias", {h}, 0.1, 0, whole);
      if (spec.is_moe_layer(l)) {
        add_moe_params(p, L);
        layers_.push_back(L);
        recompute_.emplace_back();
        stopped_.emplace_back();
        continue;
      }
      L.fc1_w = add(p + "mlp.fc1.weight", {h, branches * f}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({h, branches, f}).narrow(2, tf * fl, fl).reshape({h, branches * fl});
      });
      if (spec.bias) {
        L.fc1_b = add(p + "mlp.fc1.bias", {branches * f}, 0.05, 0, [=](const at::Tensor& x) {
          return x.view({branches, f}).narrow(1, tf * fl, fl).reshape({branches * fl});
        });
      }
      L.fc2_w = add(p + "mlp.fc2.weight", {f, h}, 0.05, 0,
                    [=](const at::Tensor& x) { return x.narrow(0, tf * fl, fl); });
      if (spec.bias) L.fc2_b = add(p + "mlp.fc2.bias", {h}, 0.05, 0, whole);
      layers_.push_back(L);
      recompute_.emplace_back();
      stopped_.emplace_back();
    }
    if (head_) {
      hn_g_ = add("head.norm.weight", {h}, 0.1, 1, whole);
      if (spec.bias) hn_b_ = add("head.norm.bias", {h}, 0.1, 0, whole);
      if (!spec.tied_embeddings) {
        const int64_t vl = V / split.head_vocab;
        const int tv = vocab_index(/*head=*/true);
        head_w_ = add("head.proj.weight", {h, V}, 0.1, 0,
                      [=](const at::Tensor& x) { return x.narrow(1, tv * vl, vl); });
      } else if (!embedding_ && embedding_word) {
        word_ = embedding_word;
        shared_word_ = true;
      } else if (!embedding_) {
        // Tied, on another stage than the embedding: a copy of the embedding's matrix (drawn
        // the same, by its name), whose gradient the epilogue sums with the embedding's
        // (Megatron's "tied embedding grad sync").
        const int64_t vl = V / split.embed_vocab;
        const int tv = vocab_index(/*head=*/false);
        word_ = add("embed.word.weight", {V, h}, 0.1, 0,
                    [=](const at::Tensor& x) { return x.narrow(0, tv * vl, vl); });
      }
    }
    cast_weights();
  }

  // The operators' copies of the (updated) master weights: bf16 casts, recorded by autograd (as
  // Megatron copies its fp32 master weights to the bf16 model after each optimizer step).
  void cast_weights() {
    for (Param& p : params_) p.c = dtype_ == at::kFloat ? p.w : p.w.to(dtype_);
  }

  std::deque<Param>& params() { return params_; }
  // fp8 training: the blocks' linear layers with fp8 GEMM inputs, the rest in the compute dtype
  // (bf16).
  void set_fp8(bool on) { fp8_ = on; }
  // The segment's first layer (layer 0) reads a spanning embedding's tensor-parallel partial
  // sums and reduces them first (run_spanning.h).
  void set_reduce_input(bool on) { reduce_input_ = on; }
  // The operators the plan's recompute rules name in each layer of this part.
  void set_recompute(const std::vector<RecomputeRule>& rules, bool early_stop = false) {
    // Rules without layers also recompute the embedding and the head (the program's
    // recomputed_ops of those parts).
    for (const RecomputeRule& rule : rules) {
      if (rule.end_layer >= 0) continue;
      for (const char* op : {"embed.word", "embed.position", "embed.dropout"}) {
        const std::string o = op;
        if (embedding_ && match_pattern(rule.match, op) &&
            (o == "embed.word" || (o == "embed.position" ? pos_ != nullptr : spec_.dropout))) {
          recompute_embed_.insert(op);
        }
      }
      for (const char* op : {"head.norm", "head.proj", "loss"}) {
        if (head_ && match_pattern(rule.match, op)) recompute_head_.insert(op);
      }
    }
    for (int l = first_; l < end_; ++l) {
      std::set<std::string>& r = recompute_[l - first_];
      for (const RecomputeRule& rule : rules) {
        if (l < rule.first_layer || (rule.end_layer >= 0 && l >= rule.end_layer)) continue;
        for (const char* op :
             {"attn.norm",      "attn.qkv",      "attn.qk_norm",   "attn.core",
              "attn.proj",      "attn.residual", "mlp.norm",       "mlp.fc1",
              "mlp.act",        "mlp.fc2",       "moe.shared.fc1", "moe.shared.act",
              "moe.shared.fc2", "moe.router",    "moe.dispatch",   "moe.fc1",
              "moe.act",        "moe.fc2",       "moe.combine",    "mlp.residual"}) {
          if (match_pattern(rule.match, op)) r.insert(op);
        }
      }
    }
    // PyTorch's checkpoint stops its recomputation after the last operator that saves a tensor
    // of its own (the program's replayed_ops): the operators after it keep the graphs of the
    // forward, and the tensors they saved are the recomputation's.
    if (!early_stop) return;
    const OpGraph graph = lower_model(spec_, 1);
    for (int l = first_; l < end_; ++l) {
      const std::set<std::string>& r = recompute_[l - first_];
      if (r.empty()) continue;
      const GraphPart& part = graph.layer_at(l);
      std::vector<bool> recomputed;
      for (const Op& op : part.ops) recomputed.push_back(r.count(op.name) > 0);
      const std::vector<bool> run = replayed_ops(part, recomputed, true);
      for (std::size_t i = 0; i < run.size(); ++i) {
        if (recomputed[i] && !run[i]) stopped_[l - first_].insert(part.ops[i].name);
      }
    }
  }
  // Parameter units, forward order: the embedding's, each layer's, the head's (ZeRO-3 gathers
  // and reduces unit by unit, as the compiled program does).
  std::vector<std::vector<Param*>> units() {
    std::vector<std::vector<Param*>> u;
    auto some = [](std::initializer_list<Param*> ps) {
      std::vector<Param*> v;
      for (Param* p : ps) {
        if (p) v.push_back(p);
      }
      return v;
    };
    if (embedding_) u.push_back(some({word_, pos_}));
    for (const LayerParams& L : layers_) {
      // In the order the operators use them (the program's ZeRO-3 units).
      u.push_back(some({L.ln1g,   L.ln1b,   L.qkv_w,  L.qkv_b,  L.qn_g,   L.kn_g,   L.qn_b,
                        L.kn_b,   L.proj_w, L.proj_b, L.ln2g,   L.ln2b,   L.fc1_w,  L.fc1_b,
                        L.fc2_w,  L.fc2_b,  L.sfc1_w, L.sfc1_b, L.sfc2_w, L.sfc2_b, L.router_w,
                        L.efc1_w, L.efc1_b, L.efc2_w, L.efc2_b}));
    }
    if (head_) {
      u.push_back(some({hn_g_, hn_b_, head_w_, embedding_ || shared_word_ ? nullptr : word_}));
    }
    return u;
  }
  // Parameters whose operators read the fp32 weights themselves rather than their copy in the
  // compute dtype: the word embedding's lookup (its rows looked up in fp32, then cast) and the
  // norms computed in fp32 (RMSNorm; LayerNorm on a CPU in fp16).
  std::vector<const Param*> fp32_reads() const {
    std::vector<const Param*> v;
    if (embedding_ && word_) v.push_back(word_);
    // A mixture's router scores in fp32 from the fp32 weights (moe_forward).
    for (const LayerParams& L : layers_) {
      if (L.router_w) v.push_back(L.router_w);
    }
    if (spec_.norm == NormKind::kLayerNorm && !cpu_fp16()) return v;
    auto add = [&](std::initializer_list<const Param*> ps) {
      for (const Param* p : ps) {
        if (p) v.push_back(p);
      }
    };
    for (const LayerParams& L : layers_) {
      add({L.ln1g, L.ln1b, L.qn_g, L.kn_g, L.qn_b, L.kn_b, L.ln2g, L.ln2b});
    }
    add({hn_g_, hn_b_});
    return v;
  }
  // Parameters whose gradients sequence parallelism leaves as partial sums over the
  // tensor-parallel group (applied to a slice of the sequence): the norms', the biases added in
  // the residuals, the position table.
  std::vector<Param*> sequence_parallel_params() {
    std::vector<Param*> v;
    auto add = [&](std::initializer_list<Param*> ps) {
      for (Param* p : ps) {
        if (p) v.push_back(p);
      }
    };
    // The query and key norms' scales, applied to the rank's heads, are partial sums too
    // whenever the heads are split.
    if (split_.heads > 1) {
      for (const LayerParams& L : layers_) add({L.qn_g, L.kn_g, L.qn_b, L.kn_b});
    }
    if (split_.seq <= 1) return v;
    add({pos_});
    for (const LayerParams& L : layers_) add({L.ln1g, L.ln1b, L.proj_b, L.ln2g, L.ln2b, L.fc2_b});
    add({hn_g_, hn_b_});
    return v;
  }
  int head_unit() const { return (embedding_ ? 1 : 0) + static_cast<int>(layers_.size()); }
  bool has_embedding() const { return embedding_; }
  // The word matrix this part uses: the embedding's, or a tied head's copy of it (or, with
  // shares_word(), the embedding part's own).
  Param* word_matrix() const { return word_; }
  bool shares_word() const { return shared_word_; }
  bool has_head() const { return head_; }

  // Forward of a micro-batch through this segment: tokens [b, s] (embedding) or the previous
  // segment's output x [b, s, h]; targets [b, s] for the head. With the embedding, a defined x
  // is the recycled final hidden state of the pass before (repeated forwards), added to the
  // embedding's output as a constant (no gradient flows into earlier passes). Returns the
  // output: the last layer's (the head's input, with the head), and fills the tape.
  at::Tensor forward(Ctx& c, const at::Tensor& tokens, at::Tensor x, const at::Tensor& targets,
                     MicroBatchTape& tape) {
    ctx_ = &c;
    if (embedding_) {
      unit_ = 0;
      c.unit_before(0, false);
      x = embed_forward(c, tokens, x, tape);
    }
    tape.layers.resize(layers_.size());
    const int first_unit = embedding_ ? 1 : 0;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      unit_ = first_unit + static_cast<int>(l);
      c.unit_before(unit_, false);
      tape.layers[l].key = tape.key;
      if (l == 0 && reduce_input_) {
        // The spanning embedding's tensor-parallel partial sums, reduced for attn.norm (the
        // program's conversion of the first layer's input; under sequence parallelism
        // reduce-scattered, or sliced when the vocabulary is split over the pipeline axes
        // only); the layer keeps the sums.
        bool partial = false;
        for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) partial = partial || !a.pipeline;
        if (split_.seq > 1) {
          x = partial ? scatter_seq(c, x, "attn.norm") : my_seq(x);
        } else if (partial) {
          x = x.clone();
          for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
            if (!a.pipeline) c.all_reduce(x, a.group, a.name, "attn.norm");
          }
        }
      }
      x = layer_forward(c, static_cast<int>(l), x, tape.layers[l]);
    }
    if (!head_) return x;
    unit_ = head_unit();
    c.unit_before(head_unit(), false);
    head_forward(c, x, targets, tape);
    return x;
  }

  // Backward: dy is the gradient of the segment's output (layers only) or, for the head, the
  // scale of the loss. Returns the gradient of the segment's input (none for the embedding).
  // `input_only`: a zero-bubble BI block; the linear layers' weight gradients are left in the
  // tape for backward_weights (the BW block).
  at::Tensor backward(Ctx& c, MicroBatchTape& tape, at::Tensor dy, double loss_scale,
                      bool input_only = false) {
    Stats& st = *c.stats;
    ctx_ = &c;
    bwd_phase_ = input_only ? "bwd_input" : "bwd";
    deferred_ = input_only ? &tape.deferred : nullptr;
    if (head_) {
      unit_ = head_unit();
      c.unit_before(head_unit(), true);
      if (!recompute_head_.empty() && !tape.head_recomputed) {
        head_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
      }
      const Mark t0 = st.mark();
      const double n = static_cast<double>(tape.ez.size(0) * tape.ez.size(1));
      // The gradient in the softmax's buffer, as Megatron forms it.
      at::Tensor dlogits = tape.ez.div_(tape.se.unsqueeze(-1));
      dlogits.scatter_add_(-1, tape.target_index, -tape.target_mask.unsqueeze(-1));
      dlogits.mul_(loss_scale / n);
      st.op("loss", bwd_phase_, t0, st.mark());
      tape.ez = tape.se = tape.target_index = tape.target_mask = at::Tensor();
      const int vsplit = spec_.tied_embeddings ? split_.embed_vocab : split_.head_vocab;
      const bool sp = split_.seq > 1;
      if (sp && !recompute_head_.count("head.proj")) {
        regather(c, tape.hnorm.out.detach(), tape.hproj, "head.proj");
      }
      at::Tensor dn = bwd(st, "head.proj", tape.hproj, dlogits.to(dtype_))[0];
      if (sp) {
        // A spanning head's partial sums over the pipeline axes first (the program's order).
        const VocabSplit& v = spec_.tied_embeddings ? c.embed_vocab : c.head_vocab;
        bool tensor_partial = vsplit > 1;
        if (vsplit > 1 && v.pipeline) {
          tensor_partial = false;
          for (const VocabSplit::Axis& a : v.per_axis) {
            if (a.pipeline) c.all_reduce(dn, a.group, a.name, "head.proj");
            tensor_partial = tensor_partial || !a.pipeline;
          }
        }
        dn = tensor_partial ? scatter_seq(c, dn, "head.proj") : my_seq(dn);
      } else if (vsplit > 1) {
        c.vocab_reduce(spec_.tied_embeddings ? c.embed_vocab : c.head_vocab, dn,
                       [](const VocabSplit::Axis&) { return std::string("head.proj"); });
      }
      dy = bwd(st, "head.norm", tape.hnorm, dn)[0];
      tape.head_x = tape.targets = at::Tensor();  // what the head's recomputation read
      c.unit_after_backward(head_unit());
    }
    const int first_unit = embedding_ ? 1 : 0;
    for (std::size_t l = layers_.size(); l-- > 0;) {
      unit_ = first_unit + static_cast<int>(l);
      c.unit_before(unit_, true);
      dy = layer_backward(c, static_cast<int>(l), tape.layers[l], dy);
      c.unit_after_backward(first_unit + static_cast<int>(l));
    }
    if (embedding_) {
      unit_ = 0;
      c.unit_before(0, true);
      if (!recompute_embed_.empty() && !tape.embed_recomputed) {
        embed_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
      }
      if (spec_.dropout) dy = bwd(st, "embed.dropout", tape.drop, dy)[0];
      at::Tensor de = pos_ ? bwd(st, "embed.position", tape.pos, dy)[0] : dy;
      // Under sequence parallelism the sequence slices gathered (unless a spanning embedding's
      // gradient arrived whole: run() gathers it as it arrives, as the program's transfer).
      if (split_.seq > 1 && de.size(1) != positions_.size(0)) {
        de = gather_seq(c, de,
                        pos_            ? "embed.position"
                        : spec_.dropout ? "embed.dropout"
                                        : "attn.residual");
      }
      bwd(st, "embed.word", tape.word, de);
      c.unit_after_backward(0);
      return at::Tensor();
    }
    return dy;
  }

  // A zero-bubble BW block: the weight gradients its BI left, in the BI's (backward) order,
  // unit by unit (ZeRO-3 gathers each unit before and reduces its gradients after, as the
  // program's BW block; those of its operators that BI computed whole included).
  void backward_weights(Ctx& c, MicroBatchTape& tape) {
    Stats& st = *c.stats;
    std::size_t next = 0;
    ctx_ = &c;
    for (int u = head_unit() + (head_ ? 0 : -1); u >= 0; --u) {
      c.unit_before(u, true);
      for (; next < tape.deferred.size() && tape.deferred[next].unit == u; ++next) {
        DeferredWeightGrad& d = tape.deferred[next];
        c.op_before(u, d.op, false);
        const Mark t0 = st.mark();
        weight_gradients(d, /*keep_graph=*/dtype_ != at::kFloat);
        // Each weight gradient's input and output gradient go once it is computed (the
        // zero-bubble implementations' weight-gradient store pops its entries), not at the end.
        d.out = d.dout = at::Tensor();
        st.op(d.op, "bwd_weight", t0, st.mark());
      }
      c.unit_after_backward(u);
    }
    if (next != tape.deferred.size()) {
      throw Failure{
          fmt::format("BW: the weight gradient of {} (unit {}) is out of the units' "
                      "backward order",
                      tape.deferred[next].op, tape.deferred[next].unit)};
    }
    tape.deferred.clear();
  }

  // An explicit R block: the recomputation of every layer ahead of the backward (which then
  // skips it), as the program's recompute template.
  void recompute(Ctx& c, MicroBatchTape& tape) {
    ctx_ = &c;
    if (embedding_ && !recompute_embed_.empty()) {
      embed_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
      tape.embed_recomputed = true;
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (recompute_[l].empty()) continue;
      layer_forward(c, static_cast<int>(l), at::Tensor(), tape.layers[l], /*again=*/true);
      tape.layers[l].recomputed = true;
    }
    if (head_ && !recompute_head_.empty()) {
      head_forward(c, at::Tensor(), at::Tensor(), tape, /*again=*/true);
      tape.head_recomputed = true;
    }
  }

 private:
  // The rank's shard of the vocabulary: embed.word's, or the head's (the embedding's when tied).
  int vocab_index(bool head) const {
    const bool own = head && !spec_.tied_embeddings;
    const int ways = own ? split_.head_vocab : split_.embed_vocab;
    const int index = own ? split_.head_vocab_index : split_.embed_vocab_index;
    return ways <= 1 ? 0 : index >= 0 ? index : t_;
  }

  // A mixture-of-experts block's parameters (prefix `p`, "layers.3."), whole on every rank.
  void add_moe_params(const std::string& p, LayerParams& L) {
    const int64_t h = spec_.hidden, e = spec_.experts, f = spec_.expert_ffn_hidden,
                  fs = spec_.shared_expert_ffn_hidden, branches = spec_.gated_mlp() ? 2 : 1;
    auto whole = [](const at::Tensor& x) { return x; };
    L.moe = true;
    if (fs > 0) {
      L.sfc1_w = add(p + "moe.shared.fc1.weight", {h, branches * fs}, 0.05, 0, whole);
      if (spec_.bias) L.sfc1_b = add(p + "moe.shared.fc1.bias", {branches * fs}, 0.05, 0, whole);
      L.sfc2_w = add(p + "moe.shared.fc2.weight", {fs, h}, 0.05, 0, whole);
      if (spec_.bias) L.sfc2_b = add(p + "moe.shared.fc2.bias", {h}, 0.05, 0, whole);
    }
    L.router_w = add(p + "moe.router.weight", {h, e}, 0.05, 0, whole);
    // Expert parallelism: this rank's run of experts / ep routed experts.
    const int64_t el = e / split_.ep, first = split_.ep_index * el;
    auto mine = [el, first](const at::Tensor& x) { return x.narrow(0, first, el); };
    L.efc1_w = add(p + "moe.fc1.weight", {e, h, branches * f}, 0.05, 0, mine);
    if (spec_.bias) L.efc1_b = add(p + "moe.fc1.bias", {e, branches * f}, 0.05, 0, mine);
    L.efc2_w = add(p + "moe.fc2.weight", {e, f, h}, 0.05, 0, mine);
    if (spec_.bias) L.efc2_b = add(p + "moe.fc2.bias", {e, h}, 0.05, 0, mine);
    for (Param* q : {L.efc1_w, L.efc1_b, L.efc2_w, L.efc2_b}) {
      if (q) q->routed_expert = true;
    }
  }

  Param* add(const std::string& name, const std::vector<int64_t>& shape, double scale,
             double offset, std::function<at::Tensor(const at::Tensor&)> cut) {
    // Drawn on the CPU on every device, so that a GPU run starts from the CPU run's weights.
    at::manual_seed(static_cast<uint64_t>(seed_ ^ fnv1a(name)));
    at::Tensor full = at::randn(shape, at::kFloat) * scale + offset;
    Param p;
    p.name = name;
    p.cut = std::move(cut);
    at::Tensor w = p.cut(full).contiguous();
    p.w = (device_.is_cpu() ? w.clone() : w.to(device_)).requires_grad_(true);
    params_.push_back(std::move(p));
    return &params_.back();
  }

  template <class F>
  Unit fwd(Stats& st, const char* name, std::vector<at::Tensor> in, F&& f) {
    return fwd(st, name, "fwd", std::move(in), std::forward<F>(f));
  }
  template <class F>
  Unit fwd(Stats& st, const char* name, const char* phase, std::vector<at::Tensor> in, F&& f) {
    if (ctx_) ctx_->op_before(unit_, name, std::string_view(phase) == "recompute");
    const Mark t0 = st.mark();
    Unit u;
    u.out = f(in);
    u.in = std::move(in);
    st.op(name, phase, t0, st.mark());
    return u;
  }

  std::vector<at::Tensor> bwd(Stats& st, const char* name, Unit& u, const at::Tensor& dy) {
    if (ctx_) ctx_->op_before(unit_, name, false);
    const Mark t0 = st.mark();
    // A BI block defers the linear layers' weight gradients (the GEMMs the program's BW block
    // holds); every other operator's backward, parameter gradients included, runs whole.
    const bool defer = deferred_ != nullptr && !u.weights.empty();
    if (defer) {
      input_gradients(u.out, dy, u.in);
      deferred_->push_back({name, u.out, dy, u.weights, unit_});
    } else {
      // bf16: the weights' casts are shared by every micro-batch's graphs; keep them.
      u.out.backward(dy, /*retain_graph=*/dtype_ != at::kFloat);
    }
    std::vector<at::Tensor> g;
    for (const at::Tensor& i : u.in) g.push_back(i.grad());
    // A deferred operator's graph, kept for BW, reaches its inputs (autograd's AccumulateGrad
    // holds each leaf), and with them their .grad: handed over here, so that the input
    // gradient goes once the operator before has used it, not when BW ends.
    if (defer) {
      for (const at::Tensor& i : u.in) i.mutable_grad() = at::Tensor();
    }
    st.op(name, bwd_phase_, t0, st.mark());
    u = Unit{};
    return g;
  }
  // A linear layer's master weights (what its deferred weight gradient accumulates into).
  static std::vector<at::Tensor> weights_of(std::initializer_list<const Param*> ps) {
    std::vector<at::Tensor> w;
    for (const Param* p : ps) {
      if (p) w.push_back(p->w);
    }
    return w;
  }

  // A parameter in the compute dtype: the fp32 master weight itself, or this iteration's bf16
  // copy (its gradient arrives in fp32 on the master).
  at::Tensor W(const Param* p) const { return p ? p->c : at::Tensor(); }

  // LayerNorm or RMSNorm (no bias), with fp32 statistics whatever the input's dtype, the output
  // in the input's dtype. LayerNorm is one kernel on the compute dtype and the weights' copies
  // in it, as Megatron's fused LayerNorm (apex's or Transformer Engine's: fp32 statistics
  // inside, 16-bit in and out, the weights in the model's dtype), so a bf16 norm reads and
  // writes bf16 and keeps its bf16 input for the backward; on a CPU in fp16, which has no fp16
  // LayerNorm kernel, in fp32.
  // Over the last dimension: the hidden state, or (qk_norm) a head's width.
  at::Tensor norm(const at::Tensor& x, const Param* g, const Param* b) const {
    const int64_t width = x.size(-1);
    if (spec_.norm == NormKind::kLayerNorm && !cpu_fp16()) {
      return at::layer_norm(x, {width}, W(g), b ? W(b) : at::Tensor(), 1e-5);
    }
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor y;
    if (spec_.norm == NormKind::kLayerNorm) {
      y = at::layer_norm(xf, {width}, g->w, b ? b->w : at::Tensor(), 1e-5);
    } else {
      y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * g->w;
    }
    return y.to(x.scalar_type());
  }

  // fp16 on the CPU: LibTorch 1.13 has no CPU kernels for fp16 matrix products and activations.
  // They run as a GPU's fp16 kernels do: in fp32 on the fp16 values (a GEMM accumulating in
  // fp32), the result rounded to fp16 once.
  bool cpu_fp16() const { return dtype_ == at::kHalf && device_.is_cpu(); }
  at::Tensor mm(const at::Tensor& a, const at::Tensor& b) const {
    if (!cpu_fp16()) return at::matmul(a, b);
    return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(at::kHalf);
  }
  // A transformer block's linear layer (attn.qkv, attn.proj, mlp.fc1, mlp.fc2): with fp8, fp8
  // GEMM inputs (run_precision.h); the head's projection stays in the compute dtype.
  at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w) const {
    return fp8_ ? fp8_linear(x, w) : mm(x, w);
  }
  // The MLP's activation of fc1's output (this rank's columns).
  at::Tensor activation(const at::Tensor& x) const {
    switch (spec_.mlp) {
      case MlpKind::kRelu:
        return at::relu(x);
      case MlpKind::kSquaredRelu:  // Primer's (So et al. 2021): relu(x)^2
        return at::relu(x).square();
      case MlpKind::kSwiglu: {
        // SwiGLU: silu(gate) * up, the halves of this rank's fc1 output.
        const int64_t fl = x.size(-1) / 2;
        return at::silu(x.narrow(-1, 0, fl)) * x.narrow(-1, fl, fl);
      }
      case MlpKind::kGelu:
        break;
    }
    return at::gelu(x);
  }

  // Dropout's multipliers for x [b, sl, h] at a hidden site (the embedding's, a residual's) of
  // `layer` (global; -1: the embedding): the whole model's masks at the rank's sequence
  // positions (context parallelism's share; sequence parallelism's slice of it).
  at::Tensor hidden_dropout(const DropoutKey& key, int layer, DropoutSite site,
                            const at::Tensor& x) const {
    const int64_t sl = x.size(1);
    at::Tensor pos = positions_;
    if (split_.seq > 1) pos = pos.narrow(0, t_ * sl, sl);
    return dropout_multipliers(key, layer, site, x.size(0), spec_.seq_len, spec_.hidden, pos, 0, 0,
                               device_)
        .to(x.scalar_type());
  }

  // Rotary position embedding (rotate-half form, base 10000) of x [b, s, heads, d] at the
  // rank's positions (0 .. s-1; under context parallelism, its share), angles in fp32.
  // The [s, s] causal mask (true where a query must not see a key), made once per length rather
  // than once per layer and micro-batch.
  const at::Tensor& causal_mask(int64_t s) {
    if (!causal_.defined() || causal_.size(0) != s) {
      causal_ = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device_)).triu(1);
    }
    return causal_;
  }
  at::Tensor rope(const at::Tensor& x) const {
    const int64_t s = x.size(1), d = x.size(3);
    const auto f32 = x.options().dtype(at::kFloat);
    const at::Tensor inv = at::pow(10000.0, -at::arange(0, d, 2, f32) / static_cast<double>(d));
    const at::Tensor ang = at::outer(positions_.to(at::kFloat), inv);  // [s, d/2]
    const at::Tensor cos = at::cat({ang.cos(), ang.cos()}, -1).view({s, 1, d}).to(x.dtype());
    const at::Tensor sin = at::cat({ang.sin(), ang.sin()}, -1).view({s, 1, d}).to(x.dtype());
    const at::Tensor rotated = at::cat({-x.narrow(3, d / 2, d / 2), x.narrow(3, 0, d / 2)}, -1);
    return x * cos + rotated * sin;
  }

  // Sequence parallelism: rank t of the tensor-parallel group holds positions [t s/tp, (t+1)
  // s/tp) of every sequence, [b, s/tp, h]. The all-gather before a column-parallel linear:
  at::Tensor gather_seq(Ctx& c, const at::Tensor& x, const std::string& label) {
    const int64_t n = split_.seq, b = x.size(0), sl = x.size(1), h = x.size(2);
    const at::Tensor all = c.all_gather(x.reshape({-1}), c.tp_group, c.tp_axes, label);
    return all.view({n, b, sl, h}).permute({1, 0, 2, 3}).reshape({b, n * sl, h});
  }
  // The reduce-scatter after a row-parallel one (partial sums in, this rank's summed slice out).
  at::Tensor scatter_seq(Ctx& c, const at::Tensor& x, const std::string& label) {
    const int64_t n = split_.seq, b = x.size(0), sl = x.size(1) / n, h = x.size(2);
    const at::Tensor chunks = x.reshape({b, n, sl, h}).permute({1, 0, 2, 3}).reshape({-1});
    return c.reduce_scatter(chunks, c.tp_group, c.tp_axes, label).view({b, sl, h});
  }
  // A replicated tensor's slice (no communication).
  at::Tensor my_seq(const at::Tensor& x) const {
    const int64_t sl = x.size(1) / split_.seq;
    return x.narrow(1, t_ * sl, sl).contiguous();
  }
  // A column-parallel linear's input under sequence parallelism: the gathered sequence, whose
  // storage `dropped` frees after the forward (Megatron keeps only the shard) and `regather`
  // fills again from the shard (the norm's output, kept for its own backward).
  void dropped(const at::Tensor& gathered) {
    if (!split_.save_gathered) resize_storage(gathered, 0);
  }
  void regather(Ctx& c, const at::Tensor& shard, Unit& u, const std::string& label) {
    if (split_.save_gathered) return;
    const at::Tensor full = gather_seq(c, shard, label);
    resize_storage(u.in[0], full.nbytes());
    c10::NoGradGuard no_grad;
    u.in[0].variable_data().copy_(full);
  }

  // The embedding's forward (tokens, and the recycled hidden state of the pass before or
  // undefined); returns what the first layer reads. Recomputed operators (recompute rules
  // without layers) drop their pieces after it, the tokens and the recycled state stay in the
  // tape; `again` (just before the embedding's backward, or in an R block) runs only those, with
  // the collectives that feed them, as phase "recompute".
  at::Tensor embed_forward(Ctx& c, const at::Tensor& tokens, const at::Tensor& recycled,
                           MicroBatchTape& tape, bool again = false) {
    Stats& st = *c.stats;
    const std::set<std::string>& rc = recompute_embed_;
    auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
    const char* phase = again ? "recompute" : "fwd";
    const at::Tensor& toks = again ? tape.tokens : tokens;
    const at::Tensor& rec = again ? tape.recycled : recycled;
    if (runs("embed.word")) {
      const int64_t vl = spec_.vocab / split_.embed_vocab;
      const int64_t start = vocab_index(/*head=*/false) * vl;
      tape.word = fwd(st, "embed.word", phase, {}, [&](const std::vector<at::Tensor>&) {
        // The rows looked up in fp32, then cast: the same values as a lookup in a bf16 copy of
        // the table, without casting the whole table.
        if (split_.embed_vocab == 1) return at::embedding(word_->w, toks).to(dtype_);
        at::Tensor local = toks - start;
        at::Tensor mask = (local >= 0).logical_and(local < vl);
        return (at::embedding(word_->w, local.clamp(0, vl - 1)) * mask.unsqueeze(-1).to(at::kFloat))
            .to(dtype_);
      });
    }
    at::Tensor x;
    // Again: the operator reading the word embeddings (the position table's add, or dropout
    // without one) recomputed, so the conversions feeding it run again.
    if (!again || (pos_ ? runs("embed.position") : spec_.dropout && runs("embed.dropout"))) {
      // The word embeddings' partial sums (vocab-parallel) reduced for the operator that reads
      // them, which the program names the conversion after.
      const char* reader = pos_ ? "embed.position" : spec_.dropout ? "embed.dropout" : "attn.norm";
      at::Tensor e = tape.word.out.detach().clone();
      // A spanning embedding's partial sums over the pipeline axes first, as the program
      // converts one axis at a time (labelled as its partial sums without an operator of its
      // own reading them: no position table, no dropout); then the tensor-parallel ones, but
      // without such an operator those go on to the first layer's segment (reduce_input_).
      const bool own_reader = pos_ || spec_.dropout;
      bool tensor_partial = split_.embed_vocab > 1;
      if (split_.embed_vocab > 1 && c.embed_vocab.pipeline) {
        tensor_partial = false;
        for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
          if (a.pipeline) {
            c.all_reduce(e, a.group, a.name, own_reader ? reader : "embed.partial-sums");
          }
          tensor_partial = tensor_partial || !a.pipeline;
        }
        if (!own_reader) tensor_partial = false;
      }
      if (split_.seq > 1 && (own_reader || !c.embed_vocab.pipeline)) {
        // Sequence parallelism: reduce-scattered to this rank's slice.
        e = tensor_partial ? scatter_seq(c, e, reader) : my_seq(e);
      } else if (tensor_partial) {
        for (const VocabSplit::Axis& a : c.embed_vocab.per_axis) {
          if (!a.pipeline) c.all_reduce(e, a.group, a.name, reader);
        }
      }
      if (rec.defined()) e = e + rec.to(e.scalar_type());
      x = e;  // rotary or ALiBi positions: applied in attn.core
    }
    if (pos_ && runs("embed.position")) {
      const int64_t sl = x.size(1), first = split_.seq > 1 ? t_ * sl : 0;
      tape.pos =
          fwd(st, "embed.position", phase, {leaf(x)}, [&](const std::vector<at::Tensor>& in) {
            // Context parallelism: the rows of this rank's positions (under sequence
            // parallelism, of its slice of them).
            return in[0] + (split_.cp > 1 ? W(pos_).index_select(0, positions_.narrow(0, first, sl))
                                          : W(pos_).narrow(0, first, sl));
          });
      x = tape.pos.out.detach();
      // The word embeddings and their reduced copy are summed and gone, as in Megatron: the
      // lookup's backward reads the token ids, the add's none.
      if (!again && rc.empty()) {
        resize_storage(tape.word.out, 0);
        resize_storage(tape.pos.in[0], 0);
      }
    }
    if (again && pos_ && !runs("embed.position")) x = tape.pos.out.detach();  // kept
    // Dropout recomputed draws its masks again from the tape's key: the same ones.
    if (spec_.dropout && runs("embed.dropout")) {
      tape.drop =
          fwd(st, "embed.dropout", phase, {leaf(x)}, [&](const std::vector<at::Tensor>& in) {
            return in[0] * hidden_dropout(tape.key, -1, DropoutSite::kEmbedding, in[0]);
          });
      x = tape.drop.out.detach();
    }
    if (!again && !rc.empty()) {
      tape.tokens = tokens;
      tape.recycled = recycled;
      if (rc.count("embed.word")) tape.word = Unit{};
      if (rc.count("embed.position")) tape.pos = Unit{};
      if (rc.count("embed.dropout")) tape.drop = Unit{};
    }
    return x;
  }

  // The head's forward from its input x: head.norm, head.proj and the vocab-parallel
  // cross-entropy (mean over the micro-batch's tokens). Recomputed operators as in
  // embed_forward: their pieces dropped, the head's input and the targets kept; `again` runs
  // them before the head's backward.
  void head_forward(Ctx& c, const at::Tensor& x, const at::Tensor& targets, MicroBatchTape& tape,
                    bool again = false) {
    Stats& st = *c.stats;
    const std::set<std::string>& rc = recompute_head_;
    auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
    const char* phase = again ? "recompute" : "fwd";
    const at::Tensor& in_x = again ? tape.head_x : x;
    const at::Tensor& tgt = again ? tape.targets : targets;
    if (runs("head.norm")) {
      tape.hnorm =
          fwd(st, "head.norm", phase, {leaf(in_x)},
              [&](const std::vector<at::Tensor>& in) { return norm(in[0], hn_g_, hn_b_); });
    }
    const bool tied = spec_.tied_embeddings;
    const int vsplit = tied ? split_.embed_vocab : split_.head_vocab;
    const bool sp = split_.seq > 1;
    if (runs("head.proj")) {
      tape.hproj =
          fwd(st, "head.proj", phase,
              {leaf(sp ? gather_seq(c, tape.hnorm.out.detach(), "head.proj") : tape.hnorm.out)},
              [&](const std::vector<at::Tensor>& in) {
                return mm(in[0], tied ? W(word_).t() : W(head_w_));
              });
      tape.hproj.weights = weights_of({tied ? word_ : head_w_});
      // Sequence parallelism: the gathered input is dropped unless the recomputation gathers it.
      if (sp && !again && !rc.count("head.proj")) dropped(tape.hproj.in[0]);
    }
    if (runs("loss")) {
      // Vocab-parallel cross-entropy, mean over the micro-batch's tokens, in fp32 and, as
      // Megatron's, in place on one fp32 copy of the logits (the logits themselves when they are
      // fp32: the projection's backward does not read them): shifted by the row maximum, then
      // exponentiated into the buffer the backward keeps.
      const Mark t0 = st.mark();
      at::Tensor z = tape.hproj.out.detach().to(at::kFloat);
      const int64_t vl = z.size(-1);
      const int64_t start = vocab_index(/*head=*/true) * vl;
      // The vocabulary's group: the embedding's when tied.
      const VocabSplit& vg = tied ? c.embed_vocab : c.head_vocab;
      at::Tensor lmax = std::get<0>(z.max(-1));
      if (vsplit > 1) c.vocab_all_reduce(vg, lmax, "loss", Comm::Op::kMax);
      z.sub_(lmax.unsqueeze(-1));
      at::Tensor local = tgt - start;
      at::Tensor mask = (local >= 0).logical_and(local < vl).to(at::kFloat);
      at::Tensor idx = local.clamp(0, vl - 1).unsqueeze(-1);
      at::Tensor target_logit = z.gather(-1, idx).squeeze(-1) * mask;
      tape.ez = z.exp_();
      tape.se = tape.ez.sum(-1);
      if (vsplit > 1) {
        c.vocab_all_reduce(vg, tape.se, "loss");
        c.vocab_all_reduce(vg, target_logit, "loss");
      }
      if (!again) tape.loss = (tape.se.log() - target_logit).mean();
      tape.target_index = idx;
      tape.target_mask = mask;
      st.op("loss", phase, t0, st.mark(), /*minus_collectives=*/true);
    }
    if (!again && !rc.empty()) {
      tape.head_x = x;
      tape.targets = targets;
      if (rc.count("head.norm")) tape.hnorm = Unit{};
      if (rc.count("head.proj")) tape.hproj = Unit{};
      if (rc.count("loss")) tape.ez = tape.se = tape.target_index = tape.target_mask = at::Tensor();
    }
  }

  // The experts' linear layer over the routed copies in expert order (`counts` rows each): one
  // GEMM per expert with tokens, as a grouped GEMM (run_moe.h).
  at::Tensor expert_linear(const at::Tensor& x, const Param* w, const Param* b,
                           const std::vector<int64_t>& counts) const {
    return grouped_linear(x, W(w), b ? c10::optional<at::Tensor>(W(b)) : c10::nullopt, counts,
                          cpu_fp16(), fp8_);
  }

  // A mixture-of-experts block's MLP after its norm (t.n2): the shared expert, the router's
  // scores, the routed copies of the tokens in expert order (dispatch), the experts, and each
  // token's expert outputs weighted and summed with the shared expert's (combine); the routing
  // is run_moe.h's.
  void moe_forward(Stats& st, const LayerParams& L, LayerTape& t, bool again,
                   const std::set<std::string>& rc, const std::set<std::string>& stopped) {
    auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
    const char* phase = again ? "recompute" : "fwd";
    const int64_t k = spec_.experts_per_token, e = spec_.experts;
    const at::Tensor xn = t.n2.out;
    const int64_t b = xn.size(0), s = xn.size(1), h = xn.size(2), tokens = b * s;
    // The shared expert's linear layers: fp8 GEMMs in an fp8 plan, as the blocks' others.
    auto linear = [&](const at::Tensor& x, const Param* w, const Param* bias) {
      at::Tensor y = block_linear(x, W(w));
      return bias ? y + W(bias) : y;
    };
    auto act = [&](const at::Tensor& x) {
      return cpu_fp16() ? activation(x.to(at::kFloat)).to(at::kHalf) : activation(x);
    };
    if (L.sfc1_w && runs("moe.shared.fc1")) {
      t.sfc1 = fwd(st, "moe.shared.fc1", phase, {leaf(xn)}, [&](const std::vector<at::Tensor>& in) {
        return linear(in[0], L.sfc1_w, L.sfc1_b);
      });
      t.sfc1.weights = weights_of({L.sfc1_w, L.sfc1_b});
    }
    if (L.sfc1_w && runs("moe.shared.act")) {
      t.sact = fwd(st, "moe.shared.act", phase, {leaf(t.sfc1.out)},
                   [&](const std::vector<at::Tensor>& in) { return act(in[0]); });
    }
    if (L.sfc1_w && runs("moe.shared.fc2")) {
      t.sfc2 =
          fwd(st, "moe.shared.fc2", phase, {leaf(t.sact.out)},
              [&](const std::vector<at::Tensor>& in) { return linear(in[0], L.sfc2_w, L.sfc2_b); });
      t.sfc2.weights = weights_of({L.sfc2_w, L.sfc2_b});
    }
    if (runs("moe.router")) {
      // In fp32 from the fp32 weights (Megatron-Core's --moe-router-dtype fp32, DeepSeek-V3's
      // gating): 16-bit scores would tie and flip top-k choices on rounding alone.
      t.router = fwd(st, "moe.router", phase, {leaf(xn)}, [&](const std::vector<at::Tensor>& in) {
        return at::matmul(in[0].to(at::kFloat), L.router_w->w);
      });
      t.router.weights = weights_of({L.router_w});
    }
    if (runs("moe.dispatch")) {
      t.dispatch =
          fwd(st, "moe.dispatch", phase, {leaf(xn)}, [&](const std::vector<at::Tensor>& in) {
            t.routing = route_tokens(t.router.out.detach().reshape({tokens, e}), k,
                                     spec_.router_groups, spec_.router_group_topk);
            return dispatch_tokens(in[0].reshape({tokens, h}), t.routing);
          });
    }
    // Expert parallelism: the copies go to their experts' ranks (with the dispatch, recomputed
    // with it), and the dispatch's output is not read again (its backward reads the indices).
    const bool ep = split_.ep > 1;
    if (ep && runs("moe.dispatch")) {
      plan_exchange(*ctx_, t);
      // Labelled as the program's: the conversion into moe.fc1's input layout.
      t.exchanged = to_experts(*ctx_, t, t.dispatch.out.detach(), "moe.fc1");
      resize_storage(t.dispatch.out, 0);
    }
    const std::vector<int64_t>& counts = ep ? t.exchange.local_counts : t.routing.counts;
    if (runs("moe.fc1")) {
      t.efc1 = fwd(st, "moe.fc1", phase, {leaf(ep ? t.exchanged : t.dispatch.out)},
                   [&](const std::vector<at::Tensor>& in) {
                     return expert_linear(in[0], L.efc1_w, L.efc1_b, counts);
                   });
      t.efc1.weights = weights_of({L.efc1_w, L.efc1_b});
    }
    if (runs("moe.act")) {
      t.eact = fwd(st, "moe.act", phase, {leaf(t.efc1.out)},
                   [&](const std::vector<at::Tensor>& in) { return act(in[0]); });
    }
    if (runs("moe.fc2")) {
      t.efc2 =
          fwd(st, "moe.fc2", phase, {leaf(t.eact.out)}, [&](const std::vector<at::Tensor>& in) {
            return expert_linear(in[0], L.efc2_w, L.efc2_b, counts);
          });
      t.efc2.weights = weights_of({L.efc2_w, L.efc2_b});
      // ... and their outputs come back to this rank's copies, in its expert order.
      if (ep) {
        t.returned = from_experts(*ctx_, t, t.efc2.out.detach(), "moe.combine");
        resize_storage(t.efc2.out, 0);
      }
    }
    if (runs("moe.combine")) {
      std::vector<at::Tensor> in = {leaf(ep ? t.returned : t.efc2.out), leaf(t.router.out)};
      if (L.sfc1_w) in.push_back(leaf(t.sfc2.out));
      t.combine =
          fwd(st, "moe.combine", phase, std::move(in), [&](const std::vector<at::Tensor>& in) {
            at::Tensor out = combine_tokens(in[0], in[1].reshape({tokens, e}), t.routing);
            if (in.size() > 2) out = out + in[2].reshape({tokens, h});
            return out.reshape({b, s, h});
          });
      // The shared expert's output is only added: the combine's backward does not read it (as
      // a residual's summands). Not when the combine is recomputed, which reads it again.
      if (L.sfc1_w && !rc.count("moe.combine")) resize_storage(t.sfc2.out, 0);
    } else if (again && stopped.count("moe.combine")) {
      // An early stop ends at the combine, which saved the experts' outputs and the scores.
      // (With expert parallelism, as they came back: the recomputed return exchange's.)
      if (rc.count("moe.fc2")) refill(t.combine.in[0], split_.ep > 1 ? t.returned : t.efc2.out);
      if (rc.count("moe.router")) refill(t.combine.in[1], t.router.out);
    }
  }

  // Expert parallelism (ExpertExchange): from the layer's routing, what goes to and comes from
  // each member of the ep group, and the reordering of the received copies expert by expert.
  void plan_exchange(Ctx& c, LayerTape& t) const {
    const int64_t g = split_.ep, el = spec_.experts / g;
    ExpertExchange& x = t.exchange;
    x.send_rows.assign(static_cast<std::size_t>(g), 0);
    for (int64_t e = 0; e < spec_.experts; ++e) {
      x.send_rows[static_cast<std::size_t>(e / el)] +=
          t.routing.counts[static_cast<std::size_t>(e)];
    }
    // got[i el + l]: member i's copies for this rank's expert l (its counts are in expert order,
    // each member's experts a run of el).
    const std::vector<int64_t> got = c.exchange_counts(t.routing.counts, el);
    x.recv_rows.assign(static_cast<std::size_t>(g), 0);
    x.local_counts.assign(static_cast<std::size_t>(el), 0);
    std::vector<int64_t> first(static_cast<std::size_t>(g * el));  // row of (i, l) as received
    int64_t row = 0;
    for (int64_t i = 0; i < g; ++i) {
      for (int64_t l = 0; l < el; ++l) {
        const auto il = static_cast<std::size_t>(i * el + l);
        first[il] = row;
        row += got[il];
        x.recv_rows[static_cast<std::size_t>(i)] += got[il];
        x.local_counts[static_cast<std::size_t>(l)] += got[il];
      }
    }
    std::vector<int64_t> order;
    order.reserve(static_cast<std::size_t>(row));
    for (int64_t l = 0; l < el; ++l) {
      for (int64_t i = 0; i < g; ++i) {
        const auto il = static_cast<std::size_t>(i * el + l);
        for (int64_t r = 0; r < got[il]; ++r) order.push_back(first[il] + r);
      }
    }
    x.to_expert_major = at::tensor(order, at::kLong).to(device_);
    x.to_source_major = at::argsort(x.to_expert_major);
  }
  // This rank's copies (its expert order) to the experts' ranks; every member's copies for this
  // rank's experts, expert by expert. The bytes recorded are this rank's copies (the program's
  // routed tensor), whichever way they go.
  at::Tensor to_experts(Ctx& c, const LayerTape& t, const at::Tensor& rows,
                        const std::string& label) const {
    const ExpertExchange& x = t.exchange;
    const double bytes = static_cast<double>(t.routing.order.numel()) * rows.size(1) *
                         static_cast<double>(rows.element_size());
    return c.all_to_all(rows, x.send_rows, x.recv_rows, label, bytes)
        .index_select(0, x.to_expert_major);
  }
  // The reverse: rows for this rank's experts (expert by expert) back to their members; this
  // rank's copies in its expert order.
  at::Tensor from_experts(Ctx& c, const LayerTape& t, const at::Tensor& rows,
                          const std::string& label) const {
    const ExpertExchange& x = t.exchange;
    const double bytes = static_cast<double>(t.routing.order.numel()) * rows.size(1) *
                         static_cast<double>(rows.element_size());
    return c.all_to_all(rows.index_select(0, x.to_source_major), x.recv_rows, x.send_rows, label,
                        bytes);
  }

  // An operator's output goes once the operator that saved it has run its backward, as
  // autograd frees a saved tensor in Megatron's one graph; here the producer's unit keeps the
  // output as the root of its own backward, which reads only its inputs (ReLU alone reads
  // its result), so the storage is released. Not while a BI block defers the consumer's
  // weight gradient, which reads that input later (asked before the consumer's backward,
  // which clears its unit).
  bool defers_weights(const Unit& consumer) const {
    return deferred_ != nullptr && !consumer.weights.empty();
  }
  static void release_output(Unit& producer, bool consumer_defers) {
    if (!consumer_defers && producer.out.defined()) resize_storage(producer.out, 0);
  }

  // The backward of moe_forward from the gradient of its output (the combine's); returns the
  // gradient of its input (the norm's output). Each producer's output goes after its
  // consumers' backward, as in the dense MLP.
  at::Tensor moe_backward(Stats& st, const LayerParams& L, LayerTape& t, const at::Tensor& dy) {
    const bool relu = spec_.mlp == MlpKind::kRelu;  // its backward reads its output
    const bool ep = split_.ep > 1;
    std::vector<at::Tensor> g = bwd(st, "moe.combine", t.combine, dy);
    release_output(t.efc2, false);
    if (ep) resize_storage(t.returned, 0);
    release_output(t.router, false);
    release_output(t.sfc2, false);
    // Expert parallelism: the copies' gradients go to their experts' ranks, and the experts'
    // input gradients come back (the forward's exchanges reversed).
    if (ep) g[0] = to_experts(*ctx_, t, g[0], "moe.combine");
    const bool fc2_defers = defers_weights(t.efc2);
    at::Tensor d = bwd(st, "moe.fc2", t.efc2, g[0])[0];
    if (!relu) release_output(t.eact, fc2_defers);
    d = bwd(st, "moe.act", t.eact, d)[0];
    release_output(t.efc1, false);
    const bool fc1_defers = defers_weights(t.efc1);
    d = bwd(st, "moe.fc1", t.efc1, d)[0];
    release_output(t.dispatch, fc1_defers);
    if (ep) {
      if (!fc1_defers) resize_storage(t.exchanged, 0);
      d = from_experts(*ctx_, t, d, "moe.fc1");
    }
    at::Tensor dx = bwd(st, "moe.dispatch", t.dispatch, d)[0];
    bool n2_read_later = defers_weights(t.router);
    dx = dx + bwd(st, "moe.router", t.router, g[1])[0];
    if (L.sfc1_w) {
      const bool shared_fc2_defers = defers_weights(t.sfc2);
      d = bwd(st, "moe.shared.fc2", t.sfc2, g[2])[0];
      if (!relu) release_output(t.sact, shared_fc2_defers);
      d = bwd(st, "moe.shared.act", t.sact, d)[0];
      release_output(t.sfc1, false);
      n2_read_later = n2_read_later || defers_weights(t.sfc1);
      dx = dx + bwd(st, "moe.shared.fc1", t.sfc1, d)[0];
    }
    release_output(t.n2, n2_read_later);
    t.routing = MoeRouting{};
    t.exchange = ExpertExchange{};
    t.exchanged = t.returned = at::Tensor();
    return dx;
  }

  // A layer's forward. Recomputed operators (`recompute_` of the layer, the plan's rules) drop
  // their pieces after it: what they read from outside the recomputed region stays with the
  // operators that keep it, the layer's input in the tape. `again` (just before the layer's
  // backward) runs only the recomputed operators, with the collectives that feed them, timed
  // as phase "recompute".
  at::Tensor layer_forward(Ctx& c, int l, const at::Tensor& x, LayerTape& t, bool again = false) {
    Stats& st = *c.stats;
    const LayerParams& L = layers_[l];
    // The operators recomputed and run again (an early stop leaves the last ones out).
    std::set<std::string> rc;
    for (const std::string& op : recompute_[l]) {
      if (!stopped_[l].count(op)) rc.insert(op);
    }
    const std::set<std::string>& stopped = stopped_[l];
    auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
    const char* phase = again ? "recompute" : "fwd";
    const at::Tensor& in_x = again ? t.x : x;
    const int64_t d = spec_.head_dim(), g = spec_.heads / spec_.kv_heads,
                  kl = spec_.kv_heads / split_.heads, al = kl * g;
    const bool sp = split_.seq > 1;
    // A residual add's backward reads neither summand, nor the linear's backward its output:
    // both are freed once summed, as one autograd graph over the layer frees them (Megatron
    // keeps the sum alone). Not when the add is recomputed, which reads the linear's output.
    auto release_summands = [&](const char* op, Unit& add, Unit& linear) {
      if (rc.count(op)) return;
      resize_storage(add.in[0], 0);
      if (linear.out.defined()) resize_storage(linear.out, 0);
    };
    // Sequence parallelism: a linear's gathered input is dropped unless the linear is
    // recomputed (then the recomputation gathers it, just before the backward).
    auto drop_gathered = [&](const char* op, Unit& u) {
      if (sp && !again && !rc.count(op)) dropped(u.in[0]);
    };
    if (runs("attn.norm")) {
      t.n1 = fwd(st, "attn.norm", phase, {leaf(in_x)},
                 [&](const std::vector<at::Tensor>& in) { return norm(in[0], L.ln1g, L.ln1b); });
    }
    if (runs("attn.qkv")) {
      t.qkv = fwd(st, "attn.qkv", phase,
                  {leaf(sp ? gather_seq(c, t.n1.out.detach(), "attn.qkv") : t.n1.out)},
                  [&](const std::vector<at::Tensor>& in) {
                    at::Tensor y = block_linear(in[0], W(L.qkv_w));
                    return L.qkv_b ? y + W(L.qkv_b) : y;
                  });
      t.qkv.weights = weights_of({L.qkv_w, L.qkv_b});
      drop_gathered("attn.qkv", t.qkv);
    }
    if (spec_.qk_norm && runs("attn.qk_norm")) {  // each head's query and key normalized
      t.qkn =
          fwd(st, "attn.qk_norm", phase, {leaf(t.qkv.out)}, [&](const std::vector<at::Tensor>& in) {
            const int64_t b = in[0].size(0), s = in[0].size(1);
            at::Tensor v5 = in[0].view({b, s, kl, g + 2, d});
            at::Tensor q = norm(v5.narrow(3, 0, g), L.qn_g, L.qn_b);
            at::Tensor k = norm(v5.narrow(3, g, 1), L.kn_g, L.kn_b);
            return at::cat({q, k}, 3).reshape({b, s, kl * (g + 1) * d});
          });
    }
    if (runs("attn.core") && split_.cp > 1) {
      t.core = cp_core_forward(c, t.qkv.out, spec_.qk_norm ? t.qkn.out : at::Tensor(), phase, t.key,
                               first_ + l);
    } else if (runs("attn.core")) {
      // With qk_norm the queries and keys are the norm's and the values the projection's.
      std::vector<at::Tensor> core_in = {leaf(t.qkv.out)};
      if (spec_.qk_norm) core_in = {leaf(t.qkn.out), leaf(t.qkv.out)};
      t.core = fwd(st, "attn.core", phase, core_in, [&](const std::vector<at::Tensor>& in) {
        const int64_t b = in.back().size(0), s = in.back().size(1);
        // [b, s, kv heads, group + 2, d]: the group's queries, then its key and value.
        at::Tensor v5 = in.back().view({b, s, kl, g + 2, d});
        at::Tensor q = v5.narrow(3, 0, g).reshape({b, s, al, d});
        at::Tensor k = v5.select(3, g), v = v5.select(3, g + 1);
        if (in.size() > 1) {  // [b, s, kv heads, group + 1, d]: normalized queries, key
          at::Tensor n5 = in[0].view({b, s, kl, g + 1, d});
          q = n5.narrow(3, 0, g).reshape({b, s, al, d});
          k = n5.select(3, g);
        }
        if (spec_.position == PositionKind::kRope) {
          q = rope(q);
          k = rope(k);
        }
        if (g > 1) {  // grouped-query attention: each key/value head serves its g query heads
          k = k.unsqueeze(3).expand({b, s, kl, g, d}).reshape({b, s, al, d});
          v = v.unsqueeze(3).expand({b, s, kl, g, d}).reshape({b, s, al, d});
        }
        q = q.permute({0, 2, 1, 3});
        k = k.permute({0, 2, 1, 3});
        v = v.permute({0, 2, 1, 3});
#if TORCH_VERSION_MAJOR >= 2
        // The model's fused attention (FlashAttention or memory-efficient attention, as
        // LibTorch picks), where it computes what the plan asks for: ALiBi and the
        // probabilities' dropout need the explicit chain below.
        if (spec_.attention == AttentionKernel::kFlash && !alibi_.defined() && !spec_.dropout) {
          return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true)
              .permute({0, 2, 1, 3})
              .reshape({b, s, al * d});
        }
#endif
        // Unfused, as Megatron without FlashAttention: the two batched products read q, k
        // and v as views of the QKV output and keep no copies of them
        // (run_attention_products.h); the scale on the scores in place (Megatron folds it
        // into the product), the causal mask in place, the softmax in the compute dtype
        // (LibTorch accumulates a 16-bit softmax in fp32, as Megatron's fused
        // scaled-masked softmax does) and only its output kept for the backward.
        at::Tensor scores = per_sequence_bmm(q, k.transpose(-2, -1), cpu_fp16());
        scores.mul_(1 / std::sqrt(double(d)));
        if (alibi_.defined()) {  // ALiBi: in fp32, at the tokens' positions
          scores = scores.to(at::kFloat) + alibi_bias(alibi_, positions_, positions_);
        }
        scores.masked_fill_(causal_mask(s), -std::numeric_limits<float>::infinity());
        // (LibTorch's CPU softmax has no fp16 kernel: there, in fp32, the same values.)
        at::Tensor p = (cpu_fp16() ? at::softmax(scores, -1, at::kFloat) : at::softmax(scores, -1))
                           .to(q.scalar_type());
        if (spec_.dropout) {  // the probabilities' dropout
          p = p * dropout_multipliers(t.key, first_ + l, DropoutSite::kAttention, b, spec_.seq_len,
                                      spec_.heads, positions_, first_head_, al, device_)
                      .to(p.scalar_type());
        }
        return per_sequence_bmm(p, v, cpu_fp16()).permute({0, 2, 1, 3}).reshape({b, s, al * d});
      });
    }
    if (runs("attn.proj")) {
      t.proj =
          fwd(st, "attn.proj", phase, {leaf(t.core.out)},
              [&](const std::vector<at::Tensor>& in) { return block_linear(in[0], W(L.proj_w)); });
      t.proj.weights = weights_of({L.proj_w});
    }
    // The row-parallel sums feed the residual (the program's conversion for its input).
    if (runs("attn.residual")) {
      at::Tensor y;
      if (sp) {
        y = scatter_seq(c, t.proj.out.detach(), "attn.residual");
      } else {
        y = t.proj.out.detach().clone();
        if (split_.heads > 1) c.tp_all_reduce(y, "attn.residual");
      }
      t.res1 = fwd(st, "attn.residual", phase, {leaf(y), leaf(in_x)},
                   [&](const std::vector<at::Tensor>& in) {
                     at::Tensor z = L.proj_b ? in[0] + W(L.proj_b) : in[0];
                     // Bias, dropout, add (Megatron's fused bias-dropout-add).
                     if (spec_.dropout) {
                       z = z * hidden_dropout(t.key, first_ + l, DropoutSite::kAttnResidual, z);
                     }
                     return z + in[1];
                   });
      release_summands("attn.residual", t.res1, t.proj);
    }
    if (runs("mlp.norm")) {
      t.n2 = fwd(st, "mlp.norm", phase, {leaf(t.res1.out)},
                 [&](const std::vector<at::Tensor>& in) { return norm(in[0], L.ln2g, L.ln2b); });
    }
    if (L.moe) moe_forward(st, L, t, again, rc, stopped);
    if (!L.moe && runs("mlp.fc1")) {
      t.fc1 = fwd(st, "mlp.fc1", phase,
                  {leaf(sp ? gather_seq(c, t.n2.out.detach(), "mlp.fc1") : t.n2.out)},
                  [&](const std::vector<at::Tensor>& in) {
                    at::Tensor z = block_linear(in[0], W(L.fc1_w));
                    return L.fc1_b ? z + W(L.fc1_b) : z;
                  });
      t.fc1.weights = weights_of({L.fc1_w, L.fc1_b});
      drop_gathered("mlp.fc1", t.fc1);
    }
    if (!L.moe && runs("mlp.act")) {
      t.act = fwd(st, "mlp.act", phase, {leaf(t.fc1.out)}, [&](const std::vector<at::Tensor>& in) {
        if (cpu_fp16()) return activation(in[0].to(at::kFloat)).to(at::kHalf);
        return activation(in[0]);
      });
    }
    if (!L.moe && runs("mlp.fc2")) {
      t.fc2 = fwd(st, "mlp.fc2", phase, {leaf(t.act.out)}, [&](const std::vector<at::Tensor>& in) {
        return block_linear(in[0], W(L.fc2_w));
      });
      t.fc2.weights = weights_of({L.fc2_w});
    } else if (!L.moe && again && stopped.count("mlp.fc2") && rc.count("mlp.act")) {
      // What it saved, recomputed (ReLU's backward reads its output too: a copy).
      refill(t.fc2.in[0], t.act.out, spec_.mlp != MlpKind::kRelu);
    }
    if (runs("mlp.residual")) {
      Unit& mlp_out = L.moe ? t.combine : t.fc2;
      at::Tensor y2;
      if (sp) {
        y2 = scatter_seq(c, mlp_out.out.detach(), "mlp.residual");
      } else {
        y2 = mlp_out.out.detach().clone();
        if (split_.ffn > 1 && !L.moe) c.tp_all_reduce(y2, "mlp.residual");
      }
      t.res2 = fwd(st, "mlp.residual", phase, {leaf(y2), leaf(t.res1.out)},
                   [&](const std::vector<at::Tensor>& in) {
                     at::Tensor z = L.fc2_b ? in[0] + W(L.fc2_b) : in[0];
                     if (spec_.dropout) {
                       z = z * hidden_dropout(t.key, first_ + l, DropoutSite::kMlpResidual, z);
                     }
                     return z + in[1];
                   });
      release_summands("mlp.residual", t.res2, mlp_out);
    }
    at::Tensor out = t.res2.out.detach();
    if (!again && !recompute_[l].empty()) {
      t.x = x;  // the checkpoint
      for (const auto& [name, u] : t.units()) {
        if (rc.count(name)) *u = Unit{};
      }
      // An early-stopped operator keeps its graph; what it read from a recomputed operator goes
      // (the recomputation brings back what its backward reads: refill).
      auto drop_input = [&](const char* stopped_op, Unit& u, std::size_t i, const char* producer) {
        if (stopped.count(stopped_op) && rc.count(producer) && u.in.size() > i) {
          resize_storage(u.in[i], 0);
        }
      };
      drop_input("mlp.fc2", t.fc2, 0, "mlp.act");
      drop_input("moe.combine", t.combine, 0, "moe.fc2");
      drop_input("moe.combine", t.combine, 1, "moe.router");
      drop_input("mlp.residual", t.res2, 1, "attn.residual");
    }
    return out;
  }

  // An early-stopped operator's input `leaf` (its storage released after the forward) refilled
  // with `value`, the recomputation's, for its backward. `take`: the value's memory itself
  // moves into the leaf's storage (as PyTorch's checkpoint hands the recomputed tensor to the
  // saved one), leaving `value` empty: for a value nothing else reads afterwards.
  static void refill(const at::Tensor& leaf, const at::Tensor& value, bool take = true) {
    const bool same_layout = value.is_contiguous() && leaf.is_contiguous() &&
                             value.storage_offset() == 0 && leaf.storage_offset() == 0 &&
                             value.sizes() == leaf.sizes() && value.dtype() == leaf.dtype();
    if (take && same_layout) {
      c10::StorageImpl* from = value.storage().unsafeGetStorageImpl();
      c10::StorageImpl* to = leaf.storage().unsafeGetStorageImpl();
      const std::size_t bytes = from->nbytes();
      to->set_data_ptr_noswap(from->set_data_ptr(at::DataPtr(nullptr, from->device())));
      to->set_nbytes(bytes);
      from->set_nbytes(0);
      return;
    }
    resize_storage(leaf, value.nbytes());
    c10::NoGradGuard no_grad;
    leaf.variable_data().copy_(value);
  }

  // Context parallelism: attn.core of this rank's queries over every cp rank's keys and values
  // (run_context_parallel.h). The split into heads and the rotary embedding run under autograd
  // from the detached qkv input, the attention itself by hand: its forward all-gathers the keys
  // and values over cp, its backward passes them around the cp ring with their gradients (the
  // program's overlapped ring: one all-gather of twice the bytes, recorded as one all-gather
  // spanning the whole backward, the attention's backward inside it).
  // With qk_norm the queries and keys are the norm's output `qkn` and the values the projection's.
  Unit cp_core_forward(Ctx& c, const at::Tensor& qkv, const at::Tensor& qkn, const char* phase,
                       const DropoutKey& key, int layer) {
    Stats& st = *c.stats;
    const Mark t0 = st.mark();
    const int64_t d = spec_.head_dim(), g = spec_.heads / spec_.kv_heads,
                  kl = spec_.kv_heads / split_.heads, al = kl * g, b = qkv.size(0),
                  sl = qkv.size(1);
    Unit u;
    u.in = {leaf(qkv)};
    at::Tensor v5 = u.in[0].view({b, sl, kl, g + 2, d});
    at::Tensor q = v5.narrow(3, 0, g).reshape({b, sl, al, d});
    at::Tensor k = v5.select(3, g), v = v5.select(3, g + 1);
    if (qkn.defined()) {  // [b, sl, kv heads, group + 1, d]: normalized queries, key
      u.in.insert(u.in.begin(), leaf(qkn));
      at::Tensor n5 = u.in[0].view({b, sl, kl, g + 1, d});
      q = n5.narrow(3, 0, g).reshape({b, sl, al, d});
      k = n5.select(3, g);
    }
    if (spec_.position == PositionKind::kRope) {
      q = rope(q);
      k = rope(k);
    }
    // [b, heads, sl, d], flattened into one tensor whose backward takes all three gradients.
    u.cp = std::make_shared<CpAttentionSaved>();
    CpAttentionSaved& cs = *u.cp;
    cs.slopes = alibi_;
    if (spec_.dropout) {
      cs.drop = dropout_multipliers(key, layer, DropoutSite::kAttention, b, spec_.seq_len,
                                    spec_.heads, positions_, first_head_, al, device_);
    }
    cs.graph =
        at::cat({q.permute({0, 2, 1, 3}).reshape({-1}), k.permute({0, 2, 1, 3}).reshape({-1}),
                 v.permute({0, 2, 1, 3}).reshape({-1})});
    const at::Tensor flat = cs.graph.detach();
    const int64_t nq = b * al * sl * d, nk = b * kl * sl * d;
    const at::Tensor local =
        at::stack({flat.narrow(0, nq, nk), flat.narrow(0, nq + nk, nk)}).contiguous();
    const at::Tensor all = c.all_gather(local.reshape({-1}), c.cp_group, c.cp_axes, "attn.core")
                               .view({split_.cp, 2, b, kl, sl, d});
    const at::Tensor out = cp_attention_forward(flat.narrow(0, 0, nq).view({b, al, sl, d}), all,
                                                split_.cp_index, spec_.seq_len, &cs);
    u.out = out.to(dtype_).permute({0, 2, 1, 3}).reshape({b, sl, al * d});
    st.op("attn.core", phase, t0, st.mark(), /*minus_collectives=*/true);
    return u;
  }
  // The gradients of the unit's inputs: the projection's output's, and with qk_norm first the
  // normalized queries' and keys'.
  std::vector<at::Tensor> cp_core_backward(Ctx& c, Unit& u, const at::Tensor& dy) {
    Stats& st = *c.stats;
    const Mark t0 = st.mark();
    CpAttentionSaved& cs = *u.cp;
    const int64_t b = dy.size(0), sl = dy.size(1), al = cs.q.size(1), d = cs.q.size(3);
    auto step = [&](const at::Tensor& t) {
      c.send(c.cp_next, t, "", /*record=*/false);
      return c.recv(c.cp_prev, t.sizes(), "", /*record=*/false, t.scalar_type(),
                    /*compute_dtype=*/false);
    };
    const auto [dq, dk, dv] =
        cp_attention_backward(cs, dy.reshape({b, sl, al, d}).permute({0, 2, 1, 3}), step);
    const Mark t1 = st.mark();
    // The program's convention: the ring moves what an all-gather of (k, v, dk, dv) moves.
    st.coll("all_gather", c.cp_axes, "attn.core",
            static_cast<double>(split_.cp) * 2 * static_cast<double>(cs.k.nbytes() + cs.v.nbytes()),
            t0, t1);
    cs.graph.backward(
        at::cat({dq.reshape({-1}), dk.reshape({-1}), dv.reshape({-1})}).to(cs.graph.scalar_type()));
    std::vector<at::Tensor> dx;
    for (const at::Tensor& in : u.in) dx.push_back(in.grad());
    st.op("attn.core", bwd_phase_, t0, st.mark());
    u = Unit{};
    return dx;
  }

  // A column-parallel linear's backward (attn.qkv, mlp.fc1) from the gradient of its output
  // `d`: under sequence parallelism its dropped input gathered again first (a recomputed one has
  // it), then its input's producer `norm` released (unless the linear's deferred weight gradient
  // reads it later), and the input gradient reduce-scattered back to the sequence slices, or
  // summed over the tensor-parallel group (`ways` > 1).
  at::Tensor column_parallel_backward(Ctx& c, const char* op, Unit& linear, Unit& norm,
                                      const at::Tensor& d, const std::set<std::string>& rc,
                                      int ways) {
    const bool sp = split_.seq > 1;
    if (sp && !rc.count(op)) regather(c, norm.out.detach(), linear, op);
    const bool linear_defers = defers_weights(linear);
    at::Tensor dx = bwd(*c.stats, op, linear, d)[0];
    release_output(norm, linear_defers);
    if (sp) return scatter_seq(c, dx, op);
    if (ways > 1) c.tp_all_reduce(dx, op);
    return dx;
  }

  at::Tensor layer_backward(Ctx& c, int l, LayerTape& t, const at::Tensor& dy) {
    Stats& st = *c.stats;
    const std::set<std::string>& rc = recompute_[l];
    if (!rc.empty() && !t.recomputed) layer_forward(c, l, at::Tensor(), t, /*again=*/true);
    // Sequence parallelism (the program's order): the residual's gradient gathered before the
    // row-parallel linear; the column-parallel linear's dropped input gathered again before its
    // backward (a recomputed one has it), and its input gradient (partial sums)
    // reduce-scattered.
    const bool sp = split_.seq > 1;
    auto defers = [&](const Unit& consumer) { return defers_weights(consumer); };
    auto release = [](Unit& producer, bool consumer_defers) {
      release_output(producer, consumer_defers);
    };
    std::vector<at::Tensor> g = bwd(st, "mlp.residual", t.res2, dy);
    at::Tensor d;
    if (layers_[l].moe) {
      d = moe_backward(st, layers_[l], t, g[0]);
    } else {
      const bool fc2_defers = defers(t.fc2);
      d = bwd(st, "mlp.fc2", t.fc2, sp ? gather_seq(c, g[0], "mlp.residual") : g[0])[0];
      if (spec_.mlp != MlpKind::kRelu) release(t.act, fc2_defers);
      d = bwd(st, "mlp.act", t.act, d)[0];
      release(t.fc1, false);
      d = column_parallel_backward(c, "mlp.fc1", t.fc1, t.n2, d, rc, split_.ffn);
    }
    at::Tensor dx1 = bwd(st, "mlp.norm", t.n2, d)[0] + g[1];
    g = bwd(st, "attn.residual", t.res1, dx1);
    dx1 = at::Tensor();
    const bool proj_defers = defers(t.proj);
    d = bwd(st, "attn.proj", t.proj, sp ? gather_seq(c, g[0], "attn.residual") : g[0])[0];
    release(t.core, proj_defers);
    if (spec_.qk_norm) {
      // The values' gradient, and the queries' and keys' through their norms.
      std::vector<at::Tensor> dc =
          split_.cp > 1 ? cp_core_backward(c, t.core, d) : bwd(st, "attn.core", t.core, d);
      release(t.qkn, false);
      d = dc[1] + bwd(st, "attn.qk_norm", t.qkn, dc[0])[0];
      release(t.qkv, false);
    } else if (split_.cp > 1) {
      d = cp_core_backward(c, t.core, d)[0];
    } else {
      d = bwd(st, "attn.core", t.core, d)[0];
      release(t.qkv, false);
    }
    d = column_parallel_backward(c, "attn.qkv", t.qkv, t.n1, d, rc, split_.heads);
    t.x = at::Tensor();
    return bwd(st, "attn.norm", t.n1, d)[0] + g[1];
  }

  at::Device device_;
  at::ScalarType dtype_;  // what the operators compute in; the parameters stay fp32
  ModelSpec spec_;
  int first_, end_;
  bool embedding_, head_;
  Split split_;
  int t_;
  unsigned long long seed_;
  std::deque<Param> params_;
  std::vector<LayerParams> layers_;
  std::vector<std::set<std::string>> recompute_;  // per layer of the segment
  // Per layer: the recomputed operators an early-stopping recomputation does not run again
  // (recompute_early_stop).
  std::vector<std::set<std::string>> stopped_;
  std::set<std::string> recompute_embed_, recompute_head_;
  // The backward being run: its phase ("bwd", or a BI block's "bwd_input") and, in a BI block,
  // where the deferred weight gradients go.
  const char* bwd_phase_ = "bwd";
  std::vector<DeferredWeightGrad>* deferred_ = nullptr;
  int unit_ = -1;       // the parameter unit running (a deferred gradient's unit)
  Ctx* ctx_ = nullptr;  // the context of the pass running: its per-operator hook (Ctx::op_before)
  Param *word_ = nullptr, *pos_ = nullptr, *hn_g_ = nullptr, *hn_b_ = nullptr, *head_w_ = nullptr;
  bool shared_word_ = false;   // word_ is the embedding part's (not in params_)
  at::Tensor positions_;       // the sequence positions of the rank's tokens (long)
  int64_t first_head_ = 0;     // the global index of the rank's first query head
  bool fp8_ = false;           // the blocks' linear layers take fp8 inputs (set_fp8)
  bool reduce_input_ = false;  // set_reduce_input
  at::Tensor alibi_;           // ALiBi: the slopes of the rank's heads (fp32); else undefined
  at::Tensor causal_;          // causal_mask's last mask (true above the diagonal)
};

// The plan as this rank sees it.
struct Layout {
  Split split;
  std::vector<std::string> tp_axes, pp_axes, cp_axes, ep_axes;
  // The segments this rank's order runs (several: an interleaved pipeline), in the order they
  // first appear, and each one's neighbours in pipeline order (-1: none).
  std::vector<int> segments;
  std::map<int, std::pair<int, int>> neighbours;
  const DeviceOrder* order = nullptr;
};

bool in_slice(const Mesh& mesh, const MeshSlice& slice, const std::vector<int>& coords) {
  for (const auto& [axis, c] : slice) {
    const int i = mesh.axis_index(axis);
    if (i < 0 || coords[i] != c) return false;
  }
  return true;
}

int peer_in(const Mesh& mesh, int rank, const Segment& seg) {
  std::vector<int> c = mesh.coordinates(rank);
  for (const auto& [axis, v] : seg.devices) c[mesh.axis_index(axis)] = v;
  return mesh.rank_of(c);
}

// The data-parallel axis and `more` (those also splitting the batch or the sequence), in the
// mesh's order: the axes a gradient sums over.
std::vector<std::string> data_parallel_with(const Mesh& mesh,
                                            const std::vector<std::string>& more) {
  std::vector<std::string> axes;
  for (const MeshAxis& a : mesh.axes) {
    if (a.name == kDataParallelAxis || std::find(more.begin(), more.end(), a.name) != more.end()) {
      axes.push_back(a.name);
    }
  }
  return axes;
}

// Operator `op`'s split along `dim` (the last matching rule's): its axes, how many ways and
// this rank's place along them.
void split_along(const Plan& plan, int rank, const char* op, Dim dim,
                 std::vector<std::string>& axes, int& ways, int& index) {
  for (const PartitionRule& r : plan.partition) {
    if (!match_pattern(r.match, op)) continue;
    for (const DimSplit& sp : r.splits) {
      if (sp.dim == dim) axes = sp.axes;
    }
  }
  for (const std::string& a : axes) ways *= plan.mesh.axis_size(a);
  if (ways > 1) {
    const std::vector<int> g = plan.mesh.ranks_along(rank, axes);
    index = static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
  }
}

Layout layout_of(const Plan& plan, int rank) {
  Layout L;
  const std::vector<int> coords = plan.mesh.coordinates(rank);
  std::set<std::string> pp;
  for (const DeviceOrder& o : plan.schedule) {
    for (const auto& [a, c] : o.devices) pp.insert(a);
    if (in_slice(plan.mesh, o.devices, coords)) L.order = &o;
  }
  L.pp_axes.assign(pp.begin(), pp.end());
  // Context parallelism: attn.core's sequence split (check_runnable: every operator's alike).
  split_along(plan, rank, "attn.core", Dim::kSeq, L.cp_axes, L.split.cp, L.split.cp_index);
  // Expert parallelism: the routed experts' split (check_runnable: the batch of the rest alike).
  split_along(plan, rank, "moe.fc1", Dim::kExpert, L.ep_axes, L.split.ep, L.split.ep_index);
  auto degree = [&](const char* op) {
    std::vector<std::string> axes;
    for (const PartitionRule& r : plan.partition) {
      if (!match_pattern(r.match, op)) continue;
      for (const DimSplit& s : r.splits) {
        // The tensor-parallel dimension (not the sequence's, nor expert parallelism's batch).
        if (s.dim != Dim::kSeq && s.dim != Dim::kBatch) axes = s.axes;
      }
    }
    int n = 1;
    std::vector<std::string> tensor;  // the pipeline axes (a spanning segment's) left out
    for (const std::string& a : axes) {
      n *= plan.mesh.axis_size(a);
      if (!pp.count(a)) tensor.push_back(a);
    }
    if (!tensor.empty()) L.tp_axes = tensor;
    return n;
  };
  L.split.heads = degree("attn.qkv");
  L.split.ffn = degree("mlp.fc1");
  L.split.embed_vocab = degree("embed.word");
  L.split.head_vocab = degree("head.proj");
  for (const PartitionRule& r : plan.partition) {
    if (!match_pattern(r.match, "attn.norm")) continue;
    for (const DimSplit& sp : r.splits) {
      if (sp.dim != Dim::kSeq || sp.axes == L.cp_axes) continue;
      // Sequence parallelism (with context parallelism: the axes after cp's, over which each cp
      // rank's tokens are cut).
      L.split.seq = 1;
      for (const std::string& a : sp.axes) {
        const bool cp = std::find(L.cp_axes.begin(), L.cp_axes.end(), a) != L.cp_axes.end();
        if (!cp) L.split.seq *= plan.mesh.axis_size(a);
      }
    }
  }
  L.split.save_gathered = plan.comm.save_gathered_inputs;
  if (L.order == nullptr || L.order->blocks.empty()) return L;
  for (const Block& b : L.order->blocks) {
    if (std::find(L.segments.begin(), L.segments.end(), b.segment) == L.segments.end()) {
      L.segments.push_back(b.segment);
    }
  }
  // Pipeline order: embedding first, then by first layer, head last.
  std::vector<int> seq(plan.segments.size());
  for (std::size_t i = 0; i < seq.size(); ++i) seq[i] = static_cast<int>(i);
  auto key = [&](int i) {
    const Segment& s = plan.segments[i];
    return std::make_tuple(s.embedding ? 0 : 1, s.head ? 1 : 0, s.first_layer);
  };
  std::sort(seq.begin(), seq.end(), [&](int a, int b) { return key(a) < key(b); });
  for (std::size_t i = 0; i < seq.size(); ++i) {
    L.neighbours[seq[i]] = {i > 0 ? seq[i - 1] : -1, i + 1 < seq.size() ? seq[i + 1] : -1};
  }
  return L;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "+" : "") + v[i];
  return s.empty() ? "none" : s;
}

// The batch of iteration `it`: tokens [B, s + 1], the same on every rank (drawn on the CPU).
at::Tensor batch(const Plan& plan, unsigned long long seed, int it, at::Device device) {
  at::manual_seed(seed * 7919 + 104729ull * (it + 1));
  at::Tensor t =
      at::randint(plan.model.vocab, {plan.global_batch, plan.model.seq_len + 1}, at::kLong);
  return device.is_cpu() ? t : t.to(device);
}

at::Tensor grad_or_zeros(const Param& p) {
  return p.w.grad().defined() ? p.w.grad() : at::zeros_like(p.w);
}

// ZeRO (optimizer.zero >= 1): a unit of parameters (ZeRO-1/2: all of the segment's, with expert
// parallelism its routed experts' apart; ZeRO-3: the embedding's, each layer's, the head's)
// laid out over its gradients' group (run_zero_layout.h); this rank owns one chunk (its place
// in the group): the fp32 master values, Adam's moments and the reduce-scattered gradient sum.
struct ZeroUnit {
  std::vector<Param*> params;
  // The group its gradients sum over and its chunks spread over (dp, with cp or ep; a routed
  // expert's: dp alone), its axes' names and this rank's place in it.
  std::vector<int> group;
  std::string axes;
  int pos = 0;
  int members() const { return static_cast<int>(group.size()); }
  ZeroLayout layout;
  int tied_part = -1;  // the layout's part of a tied word matrix copy on two stages (ZeRO 2-3)
  // ZeRO-3 (whole units) on a V-shaped placement: the embedding's unit whose tied_part, the word
  // matrix `tied_word`, this head's unit gathers with its own values in one all-gather (the
  // program's head unit gathers the tied matrix again, and reduces only its own).
  const ZeroUnit* gathers_with = nullptr;
  Param* tied_word = nullptr;
  // ZeRO-3 tensor by tensor: a tensor under comm.zero3_persistence_threshold stays whole on
  // every rank (never gathered nor released); its updated chunks are gathered after the step.
  bool persistent = false;
  at::Tensor master, m, v, grad;

  // `get` of each parameter in the layout's order: dp x chunk elements.
  template <class F>
  at::Tensor flat(F get) const {
    std::vector<at::Tensor> ts;
    for (const Param* p : params) ts.push_back(get(*p));
    return layout.flatten(ts);
  }
};

Expected<RankResult> run(const Plan& plan, const RunOptions& opt, Comm& comm) {
  if (Status s = check_runnable(plan); !s) return s.error();
  if (comm.world() != plan.mesh.num_ranks()) {
    return Error(fmt::format("the plan's mesh has {} ranks but {} processes run it",
                             plan.mesh.num_ranks(), comm.world()));
  }
  at::set_num_threads(std::max(1, opt.threads));
  const int rank = comm.rank();
  const Mesh& mesh = plan.mesh;
  const bool gpu = opt.device == "cuda";
  if (!gpu && opt.device != "cpu") {
    return Error(fmt::format("--device: '{}' is neither cpu nor cuda", opt.device));
  }
#ifndef NNSIM_TORCH_HAS_CUDA
  if (gpu) {
    return Error(fmt::format(
        "--device cuda: this build's LibTorch ({}) has no CUDA (Debian's libtorch is CPU-only); "
        "configure with -DNNSIM_TORCH_PYTHON=<python with a CUDA torch>",
        TORCH_VERSION));
  }
  const at::Device device(at::kCPU);
#else
  int gpu_index = -1;
  if (gpu) {
    const int gpus = at::hasCUDA() ? static_cast<int>(c10::cuda::device_count()) : 0;
    if (gpus == 0) return Error("--device cuda: LibTorch sees no CUDA device");
    gpu_index = opt.gpu >= 0 ? opt.gpu : rank % gpus;
    if (gpu_index >= gpus) {
      return Error(fmt::format("--device cuda: rank {} should drive GPU {} but LibTorch sees {}",
                               rank, gpu_index, gpus));
    }
    ok_or_throw(cuda_set_device(gpu_index));
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(gpu_index));
  }
  const at::Device device =
      gpu ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu_index)) : at::Device(at::kCPU);
#endif
#ifdef NNSIM_TORCH_HAS_CUDA
  MemoryProbe memory(gpu ? gpu_index : -1);
#else
  MemoryProbe memory(-1);
#endif
  Layout L = layout_of(plan, rank);
  if (L.order == nullptr) return Error(fmt::format("no schedule order holds rank {}", rank));
  const int tp_size = [&] {
    int n = 1;
    for (const std::string& a : L.tp_axes) n *= mesh.axis_size(a);
    return n;
  }();
  Stats stats;
  stats.memory = &memory;
  stats.memory_timeline = opt.memory_timeline;
  Ctx ctx;
  ctx.comm = &comm;
  ctx.stats = &stats;
  const std::string run_type = run_dtype(plan);
  const at::ScalarType dtype = run_type == "bf16" || run_type == "fp8" ? at::kBFloat16
                               : run_type == "fp16"                    ? at::kHalf
                                                                       : at::kFloat;
  // fp16: a static loss scale (Megatron's --loss-scale), so that small gradients stay above
  // fp16's smallest values; the fp32 gradients are unscaled before the optimizer (and --check).
  const double fp16_scale = dtype == at::kHalf ? kFp16LossScale : 1.0;
  ctx.options = at::TensorOptions().dtype(dtype).device(device);
  ctx.tp_axes = join(L.tp_axes);
  ctx.pp_axes = join(L.pp_axes);
  ctx.tp_group = L.tp_axes.empty() ? std::vector<int>{rank} : mesh.ranks_along(rank, L.tp_axes);
  ctx.dp_group = mesh.ranks_along(rank, {kDataParallelAxis});
  ctx.tp_index = static_cast<int>(std::find(ctx.tp_group.begin(), ctx.tp_group.end(), rank) -
                                  ctx.tp_group.begin());
  ctx.embed_vocab = vocab_split(plan, rank, "embed.word", ctx.tp_group, ctx.tp_axes);
  ctx.head_vocab = vocab_split(plan, rank, "head.proj", ctx.tp_group, ctx.tp_axes);
  L.split.embed_vocab_index = ctx.embed_vocab.index;
  L.split.head_vocab_index = ctx.head_vocab.index;
  // Expert parallelism: the tokens' exchange group; the gradients of everything but the routed
  // experts sum over dp and ep (the batch's split), the experts' over dp alone.
  std::vector<int> expert_grad_group = ctx.dp_group;
  std::string expert_grad_axes = ctx.dp_axes;
  if (L.split.ep > 1) {
    ctx.ep_group = mesh.ranks_along(rank, L.ep_axes);
    ctx.ep_axes = join(L.ep_axes);
    const std::vector<std::string> grad_axes = data_parallel_with(mesh, L.ep_axes);
    ctx.dp_group = mesh.ranks_along(rank, grad_axes);
    ctx.dp_axes = join(grad_axes);
  }
  if (L.split.cp > 1) {
    // Context parallelism: the cp ring, and the gradients summed over dp and cp (the program's
    // gradient buckets when every weighted operator is split along the sequence).
    ctx.cp_group = mesh.ranks_along(rank, L.cp_axes);
    ctx.cp_axes = join(L.cp_axes);
    const int n = static_cast<int>(ctx.cp_group.size()), i = L.split.cp_index;
    ctx.cp_next = ctx.cp_group[(i + 1) % n];
    ctx.cp_prev = ctx.cp_group[(i + n - 1) % n];
    const std::vector<std::string> grad_axes = data_parallel_with(mesh, L.cp_axes);
    ctx.dp_group = mesh.ranks_along(rank, grad_axes);
    ctx.dp_axes = join(grad_axes);
  }
  (void)tp_size;
  const std::vector<int> coords = mesh.coordinates(rank);
  const int dp = plan.data_parallel();
  const int dp_index = coords[mesh.axis_index(kDataParallelAxis)];
  const int M = plan.num_micro_batches();
  // The rank's sequences of a micro-batch (expert parallelism splits them over the ep ranks).
  const int b = plan.micro_batch / L.split.ep;
  const int64_t s = plan.model.seq_len, h = plan.model.hidden;
  // The loss of a micro-batch is its tokens' mean (under context parallelism, of the rank's
  // share of them): scaled so that the sum over replicas, micro-batches and cp ranks is the
  // global batch's mean.
  const double loss_scale = 1.0 / (M * dp * L.split.cp * L.split.ep);
  // The sequence positions of the rank's tokens (all of them without context parallelism).
  const at::Tensor positions =
      (L.split.cp > 1 ? cp_positions(s, L.split.cp, L.split.cp_index) : at::arange(s, at::kLong))
          .to(device);

  // Per segment of the rank: the ranks its input comes from and its output goes to.
  std::map<int, std::pair<int, int>> peers;
  for (int sg : L.segments) {
    const auto [p, q] = L.neighbours.at(sg);
    peers[sg] = {p >= 0 ? peer_in(mesh, rank, plan.segments[p]) : -1,
                 q >= 0 ? peer_in(mesh, rank, plan.segments[q]) : -1};
  }
  // Segments spanning the pipeline stages (--shard-head, --shard-embedding): every transfer
  // between neighbouring segments as the program moves it (run_spanning.h), in memory where
  // this rank holds both; per (segment, is a gradient), into the segment and out of it.
  const bool spanning = any_spanning(plan);
  std::map<std::pair<int, bool>, TransferEnds> ends_in, ends_out;
  for (int sg : spanning ? L.segments : std::vector<int>{}) {
    const auto [p, q] = L.neighbours.at(sg);
    if (p >= 0) {
      ends_in[{sg, false}] = transfer_ends(plan, rank, p, sg);
      ends_out[{sg, true}] = transfer_ends(plan, rank, sg, p);
    }
    if (q >= 0) {
      ends_out[{sg, false}] = transfer_ends(plan, rank, sg, q);
      ends_in[{sg, true}] = transfer_ends(plan, rank, q, sg);
    }
  }
  // Several segments on a rank (interleaved): transfers between two ranks are matched by
  // (direction, segment, micro-batch), not by their order (see Ctx::send_tagged).
  // Repeated forwards tag them too: the recycled outputs and the gradients travel the same way
  // with the same shape, in orders the schedule may interleave differently on the two ranks;
  // and so do spanning segments, whose blocks interleave the two directions alike.
  bool tagged = plan.recycle > 1 || spanning;
  for (const DeviceOrder& o : plan.schedule) {
    for (const Block& blk : o.blocks) tagged = tagged || blk.segment != o.blocks.front().segment;
  }
  // Repeated forwards: the first segment's ranks read the last segment's output of the pass
  // before (the `recycled` transfer; in memory when one rank holds both, as in the program).
  int first_segment = -1, last_segment = -1;
  for (const auto& [sg, pq] : L.neighbours) {
    if (pq.first < 0) first_segment = sg;
    if (pq.second < 0) last_segment = sg;
  }
  int recycle_from = plan.recycle > 1 && first_segment >= 0
                         ? peer_in(mesh, rank, plan.segments[last_segment])
                         : -1;
  std::vector<int> recycle_to;  // where this rank's last-segment output goes (itself: kept)
  if (plan.recycle > 1 && last_segment >= 0) {
    recycle_to = {peer_in(mesh, rank, plan.segments[first_segment])};
  }
  if (plan.recycle > 1 && spanning) {
    // A spanning first or last segment: the last segment's first order hands its output to the
    // first segment's ranks that do not hold the last segment (the program's source_lane).
    const TransferEnds e = transfer_ends(plan, rank, last_segment, first_segment);
    recycle_from = e.local ? rank : e.recv_from;
    recycle_to = e.send_to;
    if (e.local) recycle_to.push_back(rank);
  }
#ifdef NNSIM_TORCH_HAS_CUDA
  // One NCCL communicator per tensor- and data-parallel group and per pipeline direction; the
  // compute stream is a non-blocking one of LibTorch's pool (NCCL kernels waiting for a peer
  // must not serialize with the legacy default stream).
  std::unique_ptr<NcclComms> nccl;
  CudaEvents events;
  if (gpu) {
    std::set<std::pair<int, int>> edge_set;
    for (const auto& [sg, pq] : peers) {
      for (int peer : {pq.first, pq.second}) {
        if (peer < 0 || peer == rank) continue;
        edge_set.insert({rank, peer});
        edge_set.insert({peer, rank});
      }
    }
    std::vector<int> others = {ctx.cp_next, ctx.cp_prev, recycle_from};
    others.insert(others.end(), recycle_to.begin(), recycle_to.end());
    for (const auto* ends : {&ends_in, &ends_out}) {  // spanning segments' transfers
      for (const auto& [k, e] : *ends) {
        others.push_back(e.recv_from);
        others.insert(others.end(), e.send_to.begin(), e.send_to.end());
      }
    }
    for (int peer : others) {  // cp ring, recycling, spanning segments
      if (peer < 0 || peer == rank) continue;
      edge_set.insert({rank, peer});
      edge_set.insert({peer, rank});
    }
    const std::vector<std::pair<int, int>> edges(edge_set.begin(), edge_set.end());
    std::vector<std::vector<int>> groups = {ctx.tp_group, ctx.dp_group};
    for (const VocabSplit* v : {&ctx.embed_vocab, &ctx.head_vocab}) {  // NcclComms dedupes
      groups.push_back(v->group);
      for (const VocabSplit::Axis& a : v->per_axis) groups.push_back(a.group);
    }
    if (L.split.cp > 1) groups.push_back(ctx.cp_group);  // the keys' and values' all-gather
    if (L.split.ep > 1) {  // the tokens' all-to-alls, the experts' gradient sums
      groups.push_back(ctx.ep_group);
      groups.push_back(expert_grad_group);
    }
    auto made = NcclComms::create(comm, gpu_index, groups, edges);
    if (!made) return made.error();
    nccl = std::move(*made);
    ctx.nccl = nccl.get();
    c10::cuda::CUDAStream compute = c10::cuda::getStreamFromPool(false, device.index());
    c10::cuda::setCurrentCUDAStream(compute);
    stats.events = &events;
    stats.stream = compute.stream();
  }
#endif
  // One part of the model per segment, the embedding's first: a tied head in another segment
  // on this rank (a V-shaped placement) projects with the embedding part's matrix.
  std::map<int, std::unique_ptr<Model>> models;
  std::vector<Param*> params;  // all of the rank's, segment by segment
  bool has_head = false;
  std::vector<int> build_order = L.segments;
  std::stable_partition(build_order.begin(), build_order.end(),
                        [&](int sg) { return plan.segments[sg].embedding; });
  Param* embedding_word = nullptr;
  for (int sg : build_order) {
    const Segment& seg = plan.segments[sg];
    models[sg] = std::make_unique<Model>(
        plan.model, seg.first_layer, seg.end_layer, seg.embedding, seg.head, L.split, ctx.tp_index,
        opt.seed, device, dtype,
        plan.model.tied_embeddings && seg.head && !seg.embedding ? embedding_word : nullptr);
    if (seg.embedding) embedding_word = models[sg]->word_matrix();
    models[sg]->set_recompute(plan.recompute, plan.recompute_early_stop);
    models[sg]->set_fp8(run_type == "fp8");
    models[sg]->set_reduce_input(!seg.embedding && seg.first_layer == 0 &&
                                 seg.end_layer > seg.first_layer && ctx.embed_vocab.pipeline &&
                                 plan.model.position != PositionKind::kLearned &&
                                 !plan.model.dropout);
    has_head = has_head || seg.head;
  }
  for (int sg : L.segments) {
    for (Param& p : models[sg]->params()) params.push_back(&p);
  }

  // ZeRO: every rank of the dp group starts from the same weights; each keeps its chunk.
  const int zero = plan.optimizer.zero;
  const int dpn = static_cast<int>(ctx.dp_group.size());
  std::map<int, std::vector<ZeroUnit>> zunits_of;  // per segment
  // ZeRO-3: parameter unit u of a segment is its ZeroUnits [first, end) (one, or one a tensor).
  std::map<int, std::vector<std::pair<std::size_t, std::size_t>>> zranges_of;
  // DeepSpeed's ZeRO-3: per segment holding a tied head on the embedding's ranks, the word
  // matrix's ZeroUnit (the embedding's), which the head's hooks gather again.
  std::map<int, const ZeroUnit*> ztied_of;
  // A tied head in a segment of its own on this rank's embedding's ranks (V-shaped): one matrix.
  bool word_shared = false;
  for (const auto& [sg, model] : models) word_shared = word_shared || model->shares_word();
  // A segment holding one of two copies of a tied word matrix (the embedding's, or the head's on
  // another stage).
  auto tied_copy = [&](int sg) {
    const Segment& seg = plan.segments[sg];
    return plan.model.tied_embeddings && seg.embedding != seg.head && !word_shared &&
           models.at(sg)->word_matrix() != nullptr;
  };
  for (int sg : zero >= 1 ? L.segments : std::vector<int>{}) {
    std::vector<std::vector<Param*>> groups;
    if (zero == 3) {
      // DeepSpeed (comm.zero3_per_tensor) gathers and reduces each tensor of a unit on its own.
      for (std::vector<Param*>& g : models[sg]->units()) {
        zranges_of[sg].emplace_back(groups.size(), 0);
        if (plan.comm.zero3_per_tensor) {
          for (Param* p : g) groups.push_back({p});
        } else if (L.split.ep > 1) {
          // Expert parallelism: a layer's routed experts gather and reduce over their own
          // group, the rest of it over dp and ep (FSDP's unit per group, as the program's).
          std::vector<Param*> dense, experts;
          for (Param* p : g) (p->routed_expert ? experts : dense).push_back(p);
          for (std::vector<Param*>* part : {&dense, &experts}) {
            if (!part->empty()) groups.push_back(std::move(*part));
          }
        } else {
          groups.push_back(std::move(g));
        }
        zranges_of[sg].back().second = groups.size();
      }
    } else {
      groups.emplace_back();
      std::vector<Param*> experts;  // expert parallelism: the routed experts' unit
      for (Param& p : models[sg]->params()) {
        (L.split.ep > 1 && p.routed_expert ? experts : groups.back()).push_back(&p);
      }
      if (!experts.empty()) groups.push_back(std::move(experts));
    }
    std::vector<ZeroUnit>& zunits = zunits_of[sg];
    // ZeRO 2-3 sum a tied matrix's two copies chunk by chunk once their gradients are reduced
    // (tied_sync): the matrix is chunked on its own, alike on both stages. Whole ZeRO-3 units
    // on a V-shaped placement chunk it on its own too, for the head's unit to gather it.
    const bool own_part =
        (zero >= 2 && tied_copy(sg)) ||
        (zero == 3 && !plan.comm.zero3_per_tensor && word_shared && models[sg]->has_embedding());
    const Param* word = own_part ? models[sg]->word_matrix() : nullptr;
    for (std::vector<Param*>& g : groups) {
      ZeroUnit u;
      u.params = std::move(g);
      const bool routed = !u.params.empty() && u.params.front()->routed_expert && L.split.ep > 1;
      u.group = routed ? expert_grad_group : ctx.dp_group;
      u.axes = routed ? expert_grad_axes : ctx.dp_axes;
      u.pos = static_cast<int>(std::find(u.group.begin(), u.group.end(), rank) - u.group.begin());
      std::vector<int64_t> numels;
      std::vector<std::size_t> ends;
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        numels.push_back(u.params[i]->w.numel());
        if (u.params[i] != word) continue;
        if (i > (ends.empty() ? 0 : ends.back())) ends.push_back(i);
        u.tied_part = static_cast<int>(ends.size());
        ends.push_back(i + 1);
      }
      if (ends.empty() || ends.back() < u.params.size()) ends.push_back(u.params.size());
      int64_t elements = 0;
      for (int64_t n : numels) elements += n;
      u.persistent = zero == 3 && plan.comm.zero3_per_tensor &&
                     static_cast<double>(elements) < plan.comm.zero3_persistence_threshold;
      u.layout = ZeroLayout(std::move(numels), std::move(ends), u.members());
      const int64_t chunk = u.layout.chunk();
      u.master = u.flat([](const Param& p) { return p.w.detach(); })
                     .narrow(0, u.pos * chunk, chunk)
                     .clone();
      u.m = at::zeros_like(u.master);
      u.v = at::zeros_like(u.master);
      u.grad = at::zeros_like(u.master);
      zunits.push_back(std::move(u));
    }
  }
  std::vector<ZeroUnit*> zunits;  // all of them
  for (auto& [sg, us] : zunits_of) {
    for (ZeroUnit& u : us) zunits.push_back(&u);
  }
  // ZeRO-3: a tied head on the embedding's ranks gathers the embedding's matrix again for its
  // forward and backward (DeepSpeed's hooks fetch it for each module using it; FSDP's head unit
  // of another segment holds it too); reduced once, with the embedding's unit.
  for (int sg : zero == 3 && plan.model.tied_embeddings ? L.segments : std::vector<int>{}) {
    Model& model = *models.at(sg);
    if (!model.has_head() || !(model.has_embedding() || model.shares_word())) continue;
    Param* word = model.word_matrix();
    const ZeroUnit* holder = nullptr;
    for (const ZeroUnit* u : zunits) {
      if (std::find(u->params.begin(), u->params.end(), word) != u->params.end()) holder = u;
    }
    if (plan.comm.zero3_per_tensor) {
      ztied_of[sg] = holder;
    } else if (model.shares_word()) {
      ZeroUnit& head_unit = zunits_of.at(sg)[zranges_of.at(sg).back().first];
      head_unit.gathers_with = holder;
      head_unit.tied_word = word;
    }
  }
  // The compiled program's labels: gradients reduced in the backward blocks (overlapped, and
  // always for ZeRO-3) carry the segment's name.
  auto grad_sync_label = [&](int sg) {
    return zero == 3 || plan.comm.overlap_grad_reduce
               ? fmt::format("grad sync {}", plan.segments[sg].name)
               : std::string("grad sync");
  };
  // ZeRO-3 frees a unit's gathered weights once the unit has run (FSDP's reshard, DeepSpeed's
  // release) and allocates them again for its next gather: a rank holds the unit in use and the
  // one prefetched, as the simulator counts (docs/cost-model.md, "Memory"). Not when the plan
  // keeps them gathered, nor with explicit recompute blocks, which run on the backward's gathers.
  bool reshard = zero == 3 && !plan.optimizer.keep_gathered;
  for (const Block& blk : L.order->blocks) {
    reshard = reshard && blk.kind != BlockKind::kRecompute;
  }
  // The tensors a unit's gather writes: its parameters, and a V-shaped head's tied matrix.
  auto gather_targets = [](const ZeroUnit& u) {
    std::vector<Param*> targets = u.params;
    if (u.gathers_with) targets.push_back(u.tied_word);
    return targets;
  };
  // A parameter's gathered values: the weights, and their bf16 copy when it has its own storage.
  // In a 16-bit plan the operators read the gathered copy in the compute dtype; the fp32
  // weights of a resharded unit are gathered only where an operator reads them (fp32_reads).
  std::set<const Param*> fp32_read;
  for (const auto& [sg, model] : models) {
    for (const Param* p : model->fp32_reads()) fp32_read.insert(p);
  }
  auto gathers_fp32 = [&](const Param& p) {
    return !reshard || dtype == at::kFloat || fp32_read.count(&p) > 0;
  };
  auto gathered_storage = [&](const Param& p) {
    std::vector<at::Tensor> ts;
    if (gathers_fp32(p)) ts.push_back(p.w);
    if (p.c.defined() && !p.c.is_alias_of(p.w)) ts.push_back(p.c);
    return ts;
  };
  // FSDP's root unit: a tied head in the embedding's segment reads the embedding unit's matrix,
  // which stays gathered (DeepSpeed's hooks gather it again instead).
  std::set<const ZeroUnit*> pinned;
  const bool root_unit = reshard && plan.model.tied_embeddings && !plan.comm.zero3_per_tensor;
  for (int sg : root_unit ? L.segments : std::vector<int>{}) {
    const Model& model = *models.at(sg);
    if (!model.has_head() || !model.has_embedding()) continue;
    for (const ZeroUnit& u : zunits_of.at(sg)) {
      if (std::find(u.params.begin(), u.params.end(), model.word_matrix()) != u.params.end()) {
        pinned.insert(&u);
      }
    }
  }
  auto release_unit = [&](const ZeroUnit& u) {
    if (!reshard || pinned.count(&u) || u.persistent) return;
    for (Param* p : gather_targets(u)) {
      for (const at::Tensor& t : gathered_storage(*p)) resize_storage(t, 0);
    }
  };
  // The master chunks all-gathered into the parameters the operators use.
  // In bf16 plans the gather carries the bf16 weights the operators compute with (Megatron's
  // distributed optimizer gathers the 16-bit model parameters; the program's bytes): the fp32
  // master values stay in the chunks, and the operators' bf16 copies come out the same.
  // ZeRO-3 in bf16 also writes the gathered values into the operators' bf16 copies, which keep
  // their autograd link to the fp32 weights (no per-iteration cast: the cast is the chunk's).
  auto gather_unit = [&](const ZeroUnit& u) {
    if (u.persistent) return;
    for (Param* p : gather_targets(u)) {
      for (const at::Tensor& t : gathered_storage(*p)) {
        if (t.storage().nbytes() == 0) resize_storage(t, t.numel() * t.element_size());
      }
    }
    const ZeroUnit* with = u.gathers_with;
    const int64_t own = u.layout.chunk();
    const int64_t extra = with ? with->layout.part_chunk(with->tied_part) : 0;
    const at::Tensor send =
        with ? at::cat({u.master,
                        with->master.narrow(0, with->layout.part_offset(with->tied_part), extra)})
             : u.master;
    const at::Tensor full = ctx.all_gather(dtype != at::kFloat ? send.to(dtype) : send, u.group,
                                           u.axes, "param gather");
    c10::NoGradGuard no_grad;
    const at::Tensor rows = full.view({u.members(), own + extra});
    std::vector<at::Tensor> values =
        u.layout.unflatten(with ? rows.narrow(1, 0, own).reshape({-1}) : full);
    const std::vector<Param*> targets = gather_targets(u);
    if (with) {
      // The matrix's part: every rank's chunk of it, in rank order, then its padding.
      values.push_back(
          rows.narrow(1, own, extra).reshape({-1}).narrow(0, 0, u.tied_word->w.numel()));
    }
    for (std::size_t i = 0; i < targets.size(); ++i) {
      Param* p = targets[i];
      const at::Tensor mine = values[i].view(p->w.sizes());
      // Not a version bump: ZeRO-3's backward gather writes weights its saved graphs hold.
      if (gathers_fp32(*p)) p->w.variable_data().copy_(mine);
      if (zero == 3 && dtype != at::kFloat) p->c.variable_data().copy_(mine);
    }
  };
  // ZeRO-3's persistent tensors after the step: every unit's updated chunk in one all-gather,
  // written into its whole weights (and their compute-dtype copies).
  auto gather_persistent = [&](const std::vector<const ZeroUnit*>& units) {
    std::vector<at::Tensor> chunks;
    int64_t row = 0;
    for (const ZeroUnit* u : units) {
      chunks.push_back(u->master);
      row += u->layout.chunk();
    }
    const at::Tensor send = at::cat(chunks);
    const at::Tensor full = ctx.all_gather(dtype != at::kFloat ? send.to(dtype) : send,
                                           ctx.dp_group, ctx.dp_axes, "param gather");
    c10::NoGradGuard no_grad;
    const at::Tensor rows = full.view({dpn, row});
    int64_t offset = 0;
    for (const ZeroUnit* u : units) {
      const int64_t chunk = u->layout.chunk();
      const std::vector<at::Tensor> values =
          u->layout.unflatten(rows.narrow(1, offset, chunk).reshape({-1}));
      offset += chunk;
      for (std::size_t i = 0; i < u->params.size(); ++i) {
        Param* p = u->params[i];
        const at::Tensor mine = values[i].view(p->w.sizes());
        if (gathers_fp32(*p)) p->w.variable_data().copy_(mine);
        if (dtype != at::kFloat) p->c.variable_data().copy_(mine);
      }
    }
  };
  // The unit's gradients so far reduce-scattered over dp into its chunk, then dropped.
  // With split backwards, ZeRO-2's reduce after a BW may find no new gradient of a parameter
  // whose gradient BI computes (a norm's, when no BI ran since the last reduce): zeros.
  bool split_backward = false;
  for (const Block& blk : L.order->blocks) {
    split_backward = split_backward || blk.kind == BlockKind::kBackwardWeight;
  }
  // The gradients' reduction carries what the program prices (comm.grad_reduce_bytes, else
  // optimizer.grad_bytes): bf16 at 2 bytes in a bf16 plan, else the fp32 gradients.
  const double reduce_bytes =
      plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
  const at::ScalarType reduce_dtype = dtype != at::kFloat && reduce_bytes == 2 ? dtype : at::kFloat;
  auto reduce_unit = [&](ZeroUnit& u, const std::string& label) {
    for (Param* p : u.params) {
      if (!p->w.grad().defined() && !split_backward) {
        throw Failure{fmt::format("no gradient reached {}", p->name)};
      }
    }
    const at::Tensor mine =
        ctx.reduce_scatter(u.flat([](const Param& p) { return grad_or_zeros(p); }).to(reduce_dtype),
                           u.group, u.axes, label);
    c10::NoGradGuard no_grad;
    u.grad.add_(mine);
    for (Param* p : u.params) p->w.mutable_grad() = at::Tensor();
  };
  // DeepSpeed's reduce bucket (comm.zero3_reduce_bucket): per-tensor units' gradients wait and
  // are reduce-scattered together, every rank's chunks of them side by side in its share, when
  // the next unit would overflow the bucket and when the backward block ends.
  std::vector<ZeroUnit*> waiting;
  double waiting_elements = 0;
  std::string waiting_label;
  auto reduce_waiting = [&] {
    if (waiting.empty()) return;
    std::vector<at::Tensor> rows;
    for (ZeroUnit* u : waiting) {
      rows.push_back(u->flat([](const Param& p) { return grad_or_zeros(p); })
                         .to(reduce_dtype)
                         .view({dpn, u->layout.chunk()}));
    }
    const at::Tensor mine = ctx.reduce_scatter(at::cat(rows, 1).reshape({-1}), ctx.dp_group,
                                               ctx.dp_axes, waiting_label);
    c10::NoGradGuard no_grad;
    int64_t offset = 0;
    for (ZeroUnit* u : waiting) {
      u->grad.add_(mine.narrow(0, offset, u->layout.chunk()));
      offset += u->layout.chunk();
      for (Param* p : u->params) p->w.mutable_grad() = at::Tensor();
    }
    waiting.clear();
    waiting_elements = 0;
  };
  auto reduce_or_wait = [&](ZeroUnit& u, const std::string& label) {
    const double bucket = plan.comm.zero3_reduce_bucket;
    if (!plan.comm.zero3_per_tensor || bucket <= 0) return reduce_unit(u, label);
    for (Param* p : u.params) {
      if (!p->w.grad().defined() && !split_backward) {
        throw Failure{fmt::format("no gradient reached {}", p->name)};
      }
    }
    double elements = 0;
    for (const Param* p : u.params) elements += static_cast<double>(p->w.numel());
    if (!waiting.empty() && waiting_elements + elements > bucket) reduce_waiting();
    waiting.push_back(&u);
    waiting_elements += elements;
    waiting_label = label;
  };
  // ZeRO-3, for block `i` of the order (segment `sg`), as the program does (run_zero3.h): the
  // first unit's gather, then each unit's gather launched before the previous unit runs (one
  // unit of prefetch), twice for a unit recomputed inside the backward when DeepSpeed regathers;
  // gradients reduced as each unit's backward ends.
  const std::vector<Zero3Block> z3 =
      zero == 3 ? zero3_blocks(plan, L.order->blocks, M) : std::vector<Zero3Block>{};
  // The operator of unit `unit` of segment `sg` a parameter belongs to (a head's copy of a tied
  // word matrix: the head's projection).
  auto op_of = [&](int sg, int unit, const Param& p) {
    const std::string op = operator_of(p.name);
    const Model& model = *models.at(sg);
    return model.has_head() && unit == model.head_unit() && op == "embed.word" ? "head.proj" : op;
  };
  // DeepSpeed's tensor-grained prefetch (comm.zero3_prefetch_elements), in the program's order
  // (core/program.h, zero3_uses and zero3_launch_through): a block's gathers in the order its
  // operators use the tensors; before an operator runs, its own and the next ones until that
  // many elements are gathered ahead of it; a tensor released once its operator has run (and no
  // gather ahead holds it). Whole units otherwise (before_unit).
  const bool tensor_prefetch = zero3_prefetches_tensors(plan);
  const OpGraph graph = lower_model(plan.model, 1);
  std::set<int> explicit_recompute;  // segments with R blocks: the backward does not recompute
  for (const Block& blk : L.order->blocks) {
    if (blk.kind == BlockKind::kRecompute) explicit_recompute.insert(blk.segment);
  }
  struct TensorGather {
    int unit;
    std::string op;
    bool recompute;
    const ZeroUnit* zu;
  };
  std::vector<TensorGather> tqueue;
  std::vector<double> telements;  // tqueue's tensors' elements (this rank's, before ZeRO)
  std::size_t t_gathered = 0;     // entries [0, t_gathered) gathered
  std::size_t t_released = 0;     // entries [0, t_released) released (or still needed ahead)
  auto t_gather_through = [&](std::size_t end) {
    for (; t_gathered < end; ++t_gathered) gather_unit(*tqueue[t_gathered].zu);
  };
  // Releases entries [t_released, end) but those gathered ahead again.
  auto t_release_through = [&](std::size_t end) {
    for (; t_released < end; ++t_released) {
      const ZeroUnit* zu = tqueue[t_released].zu;
      bool ahead = false;
      for (std::size_t k = end; k < t_gathered; ++k) ahead = ahead || tqueue[k].zu == zu;
      if (!ahead) release_unit(*zu);
    }
  };
  auto zero3_for = [&](std::size_t i, int sg) {
    if (zero != 3) return;
    const Zero3Block* zb = &z3.at(i);
    auto each = [&, sg](int u, auto f) {
      const auto [first, end] = zranges_of.at(sg).at(u);
      for (std::size_t k = first; k < end; ++k) f(zunits_of.at(sg)[k]);
    };
    tqueue.clear();
    telements.clear();
    t_gathered = t_released = 0;
    ctx.before_op = nullptr;
    if (tensor_prefetch && zb->gather) {
      const int n = static_cast<int>(zranges_of.at(sg).size());
      const BlockKind kind = L.order->blocks[i].kind;
      for (const Zero3Use& u : zero3_uses(plan, graph, sg, kind, explicit_recompute.count(sg))) {
        const std::string& op = u.part->ops[u.op].name;
        each(u.unit, [&](const ZeroUnit& zu) {
          if (!zu.persistent && op_of(sg, u.unit, *zu.params.front()) == op) {
            tqueue.push_back({u.unit, op, u.recompute, &zu});
          }
        });
        // The head's projection with the embedding's matrix (its hooks fetch it again).
        if (op == "head.proj" && u.unit == n - 1 && ztied_of.count(sg)) {
          tqueue.push_back({u.unit, op, u.recompute, ztied_of.at(sg)});
        }
      }
      for (const TensorGather& g : tqueue) {
        telements.push_back(static_cast<double>(g.zu->params.front()->w.numel()));
      }
      ctx.before_op = [&](int unit, const std::string& op, bool recompute) {
        std::size_t first = t_released;
        while (first < tqueue.size() && !(tqueue[first].unit == unit && tqueue[first].op == op &&
                                          tqueue[first].recompute == recompute)) {
          ++first;
        }
        if (first == tqueue.size()) return;  // no weights of its own to gather
        std::size_t end = first;
        while (end < tqueue.size() && tqueue[end].unit == unit && tqueue[end].op == op &&
               tqueue[end].recompute == recompute) {
          ++end;
        }
        // What the operators before it used (gathered now if none of them ran: the program's
        // calls), released; then its own tensors and those after them.
        t_gather_through(first);
        t_release_through(first);
        t_gather_through(
            zero3_launch_through(telements, end, t_gathered, plan.comm.zero3_prefetch_elements));
      };
    }
    ctx.before_unit = [&, sg, zb, each](int u, bool backward) {
      if (!zb->gather || tensor_prefetch) return;
      const int n = static_cast<int>(zranges_of.at(sg).size());
      const int pos = backward ? n - 1 - u : u;
      auto fetch = [&](int q) {
        const int unit = backward ? n - 1 - q : q;
        const int times = zb->regather.count(unit) ? 2 : 1;
        for (int t = 0; t < times; ++t) {
          each(unit, gather_unit);
          if (unit == n - 1 && ztied_of.count(sg)) gather_unit(*ztied_of.at(sg));
        }
      };
      if (pos == 0) fetch(0);
      if (pos + 1 < n) fetch(pos + 1);
      if (pos == 0) return;
      // The unit before this one is done.
      const int done = backward ? n - pos : pos - 1;
      each(done, release_unit);
      if (done == n - 1 && ztied_of.count(sg)) release_unit(*ztied_of.at(sg));
    };
    ctx.after_unit_backward = [&, sg, zb, each](int u) {
      if (!zb->reduce) return;
      each(u, [&](ZeroUnit& zu) { reduce_or_wait(zu, grad_sync_label(sg)); });
    };
  };

  // Between blocks no unit stays gathered.
  auto release_segment = [&](int sg) {
    for (const ZeroUnit& u : zunits_of.at(sg)) release_unit(u);
    if (ztied_of.count(sg)) release_unit(*ztied_of.at(sg));
  };
  for (int sg : zero == 3 ? L.segments : std::vector<int>{}) release_segment(sg);
  // The fp32 weights no operator reads: only their gradients are used.
  for (const ZeroUnit* u : reshard ? zunits : std::vector<ZeroUnit*>{}) {
    for (Param* p : gather_targets(*u)) {
      if (!gathers_fp32(*p) && p->w.storage().nbytes() > 0) resize_storage(p->w, 0);
    }
  }

  RankResult out;
  out.rank = rank;
  out.coordinates = coords;
  for (const Param* p : params) out.parameters += static_cast<double>(p->w.numel());

  // The unpartitioned reference: the whole model, the whole batch, one micro-batch.
  std::map<std::string, at::Tensor> ref_grads;
  if (opt.check) {
    Stats ref_stats;  // never recording; steady-clock marks
    Ctx ref;
    ref.comm = &comm;
    ref.stats = &ref_stats;
    ref.options = at::TensorOptions().dtype(at::kFloat).device(device);
    ref.tp_group = ref.dp_group = {rank};
    // Always fp32: a bf16 run is checked against the full-precision model.
    Model whole(plan.model, 0, plan.model.layers, true, true, Split{}, 0, opt.seed, device,
                at::kFloat);
    const at::Tensor data = batch(plan, opt.seed, 0, device);
    // Repeated forwards: the earlier passes without autograd, each feeding its final hidden
    // state to the next; the last one is differentiated.
    MicroBatchTape tape;
    tape.key = DropoutKey{opt.seed, 0, 0, plan.recycle - 1};  // iteration 0, every row
    at::Tensor recycled;
    for (int pass = 0; pass + 1 < plan.recycle; ++pass) {
      c10::NoGradGuard no_grad;
      MicroBatchTape scratch;
      scratch.key = DropoutKey{opt.seed, 0, 0, pass};
      recycled = whole.forward(ref, data.narrow(1, 0, s), recycled, data.narrow(1, 1, s), scratch);
    }
    whole.forward(ref, data.narrow(1, 0, s), recycled, data.narrow(1, 1, s), tape);
    out.reference_loss = tape.loss.item<double>();
    whole.backward(ref, tape, at::Tensor(), 1.0);
    for (Param& p : whole.params()) ref_grads[p.name] = grad_or_zeros(p);
  }

  // ZeRO-2 reduces a segment's gradients after every block that computes weight gradients (B,
  // or a split backward's BW), ZeRO-1 after the segment's last such block (the program's grad
  // sync blocks, per segment); ZeRO-3 unit by unit inside the backward.
  std::map<int, int> last_weights;  // segment -> the micro-batch of its last B or BW
  for (const Block& blk : L.order->blocks) {
    if (blk.kind == BlockKind::kBackward || blk.kind == BlockKind::kBackwardWeight) {
      last_weights[blk.segment] = blk.micro_batch;
    }
  }
  // Tied embeddings on two stages: the embedding's matrix and the head's copy hold the
  // gradients of their own uses, summed between the first and the last stage (the ranks of the
  // same other coordinates), so both copies take the same step (the program's epilogue: "tied
  // embedding grad sync"). Without ZeRO the whole gradients, after the data-parallel sums; under
  // ZeRO-1 the whole gradients before the reduce-scatter at the iteration's end (the summing
  // partner reaches its own end only after this stage's later blocks, which must not wait for
  // it); under ZeRO 2-3, whose reduce-scatters leave only this rank's chunk, the matrix's chunk
  // (chunked alike on both stages) once every micro-batch is reduced, as Megatron sums its
  // shared embedding's bucket after the data-parallel reduce-scatter.
  auto tied_sync = [&](int sg) {
    if (!tied_copy(sg)) return;
    const Segment& seg = plan.segments[sg];
    int other = -1;
    for (std::size_t j = 0; j < plan.segments.size(); ++j) {
      if (seg.embedding ? plan.segments[j].head : plan.segments[j].embedding) {
        other = static_cast<int>(j);
      }
    }
    const int partner = peer_in(plan.mesh, rank, plan.segments[other]);
    const std::vector<int> pair = {std::min(rank, partner), std::max(rank, partner)};
    if (zero >= 2) {
      for (ZeroUnit& u : zunits_of.at(sg)) {
        if (u.tied_part < 0) continue;
        at::Tensor mine =
            u.grad.narrow(0, u.layout.part_offset(u.tied_part), u.layout.part_chunk(u.tied_part));
        at::Tensor g = mine.to(reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
        ctx.all_reduce(g, pair, "explicit", "tied embedding grad sync");
        c10::NoGradGuard no_grad;
        mine.copy_(g);
      }
      return;
    }
    Param& w = *models.at(sg)->word_matrix();
    at::Tensor g = grad_or_zeros(w).to(reduce_dtype);
    ctx.all_reduce(g, pair, "explicit", "tied embedding grad sync");
    c10::NoGradGuard no_grad;
    w.w.mutable_grad() = g.to(at::kFloat).view(w.w.sizes()).clone();
  };
  auto reduce_after = [&](int sg, int m) {
    if (zero == 2 || (zero == 1 && m == last_weights.at(sg) && !tied_copy(sg))) {
      for (ZeroUnit& u : zunits_of.at(sg)) reduce_unit(u, grad_sync_label(sg));
    }
  };

  // Pipeline transfers of a tensor replicated over tp go as this rank's 1/tp slice, all-gathered
  // on arrival (Megatron's scatter-gather; the program's comm.pp_scatter_gather).
  const int64_t tpn = static_cast<int64_t>(ctx.tp_group.size());
  const int64_t transfer_numel = b * (s / L.split.cp) * h;  // a cp rank's share of the sequence
  const bool sliced_transfers =
      plan.comm.pp_scatter_gather && tpn > 1 && L.split.seq == 1 && transfer_numel % tpn == 0;
  // A hand-off between two segments of this rank (ZB-V's turn) stays whole in memory: the
  // program has no transfer, so no slice and no gather either.
  auto pp_send = [&](int peer, const at::Tensor& t, const char* label, int64_t tag) {
    const at::Tensor x = sliced_transfers && peer != rank
                             ? t.reshape({-1}).chunk(tpn)[ctx.tp_index].contiguous()
                             : t;
    if (tagged) {
      ctx.send_tagged(peer, x, label, tag);
    } else {
      ctx.send(peer, x, label);
    }
  };
  auto pp_recv = [&](int peer, const std::vector<int64_t>& shape, const char* label, int64_t tag) {
    const bool sliced = sliced_transfers && peer != rank;
    std::vector<int64_t> piece = shape;
    if (sliced) piece = {transfer_numel / tpn};
    at::Tensor x = tagged ? ctx.recv_tagged(peer, piece, tag) : ctx.recv(peer, piece, label);
    if (!sliced) return x;
    return ctx.all_gather(x, ctx.tp_group, ctx.tp_axes, label).view(shape);
  };
  // Spanning segments: a transfer into segment `sg` (is a `gradient`) of micro-batch `m`, received
  // or taken from this rank's own neighbouring segment; one out of `sg` into `to`, sent to the
  // ranks that need it and kept where this rank runs `to` too.
  std::map<std::tuple<bool, int, int>, at::Tensor> handoff;  // (gradient, segment, micro-batch)
  // Sequence parallelism without a position table or dropout: the first stage hands a spanning
  // embedding the gradient of its whole sequence (its layer 0 gathers it), which the other
  // stages' embeddings receive as a slice and all-gather over tp (the program's scatter-gather).
  const bool whole_embedding_grad = spanning && L.split.seq > 1 && ctx.embed_vocab.pipeline &&
                                    plan.model.position != PositionKind::kLearned &&
                                    !plan.model.dropout;
  auto span_recv = [&](int sg, bool gradient, int m, const std::vector<int64_t>& shape,
                       int64_t tg) {
    const TransferEnds& e = ends_in.at({sg, gradient});
    const Segment& into = plan.segments[sg];
    if (!e.local && gradient && whole_embedding_grad && into.embedding &&
        into.end_layer == into.first_layer) {
      const at::Tensor slice = pp_recv(e.recv_from, shape, "gradient", tg);
      const int64_t n = L.split.seq;
      return ctx.all_gather(slice.reshape({-1}), ctx.tp_group, ctx.tp_axes, "gradient")
          .view({n, shape[0], shape[1], shape[2]})
          .permute({1, 0, 2, 3})
          .reshape({shape[0], n * shape[1], shape[2]});
    }
    if (!e.local) return pp_recv(e.recv_from, shape, gradient ? "gradient" : "activation", tg);
    const auto it = handoff.find({gradient, sg, m});
    if (it == handoff.end()) {
      throw Failure{
          fmt::format("rank {}: the {} of micro-batch {} into segment '{}' is not ready "
                      "(the block producing it comes later in the order)",
                      rank, gradient ? "gradient" : "activation", m, plan.segments[sg].name)};
    }
    at::Tensor t = it->second;
    handoff.erase(it);
    return t;
  };
  auto span_send = [&](int sg, bool gradient, int m, const at::Tensor& t, int to, int64_t tg) {
    const TransferEnds& e = ends_out.at({sg, gradient});
    if (e.local) handoff[{gradient, to, m}] = t;
    for (int peer : e.send_to) pp_send(peer, t, gradient ? "gradient" : "activation", tg);
  };
  const double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, lr = 1e-4;
  for (int it = 0; it < opt.warmup + opt.iterations; ++it) {
    ok_or_throw(comm.barrier());
    stats.recording = it >= opt.warmup;
    // Memory over the measured iterations only: not the --check reference's forward, nor the
    // first step's allocation of the optimizer's moments.
    if (it == opt.warmup) memory.reset();
    stats.memory_samples.clear();  // the last measured iteration's
    for (Param* p : params) p->w.mutable_grad() = at::Tensor();
    handoff.clear();
    const auto t0 = Clock::now();
    const at::Tensor data = batch(plan, opt.seed, it, device);
    std::map<std::pair<int, int>, MicroBatchTape> tapes;  // (segment, micro-batch)
    std::map<int, at::Tensor> recycled;  // micro-batch -> its last pass's output, on this rank
    at::Tensor loss_sum = at::zeros({1}, ctx.options.dtype(at::kFloat));
    for (const Block& blk : L.order->blocks) {
      const int m = blk.micro_batch, sg = blk.segment;
      const int64_t row = (static_cast<int64_t>(dp_index) * M + m) * plan.micro_batch +
                          static_cast<int64_t>(L.split.ep_index) * b;
      Model& model = *models.at(sg);
      const auto [prev, next] = peers.at(sg);
      const std::vector<int64_t> shape = {b, s / L.split.seq / L.split.cp, h};
      // The tag of a transfer into segment `to` (Ctx::transfer_tag).
      auto tag = [&](bool gradient, int to) {
        return Ctx::transfer_tag(gradient, false, to, m, blk.pass);
      };
      zero3_for(static_cast<std::size_t>(&blk - L.order->blocks.data()), sg);
      MicroBatchTape& tape = tapes[{sg, m}];
      tape.key = DropoutKey{opt.seed, it, row, plan.recycle - 1};  // the last pass's masks
      if (blk.kind == BlockKind::kRecompute) {
        model.recompute(ctx, tape);
      } else if (blk.kind == BlockKind::kBackwardWeight) {
        model.backward_weights(ctx, tape);
        tapes.erase({sg, m});
        reduce_after(sg, m);
      } else if (blk.kind == BlockKind::kForward) {
        // Repeated forwards: a pass before the last keeps nothing and has no gradient.
        const bool earlier = blk.pass + 1 < plan.recycle;
        std::optional<c10::NoGradGuard> no_grad;
        if (earlier) no_grad.emplace();
        MicroBatchTape scratch;
        scratch.key = DropoutKey{opt.seed, it, row, blk.pass};  // the pass's own masks
        MicroBatchTape& ftape = earlier ? scratch : tape;
        at::Tensor x;
        if (!model.has_embedding()) {
          x = spanning ? span_recv(sg, false, m, shape, tag(false, sg))
                       : pp_recv(prev, shape, "activation", tag(false, sg));
        } else if (blk.pass > 0 && recycle_from == rank) {
          x = recycled.at(m);
          recycled.erase(m);
        } else if (blk.pass > 0) {
          x = pp_recv(recycle_from, shape, "recycled",
                      Ctx::transfer_tag(false, true, sg, m, blk.pass));
        }
        const at::Tensor rows = data.narrow(0, row, b);
        at::Tensor y = model.forward(ctx, rows.narrow(1, 0, s).index_select(1, positions), x,
                                     rows.narrow(1, 1, s).index_select(1, positions), ftape);
        if (model.has_head() && earlier) {
          for (int peer : recycle_to) {
            if (peer == rank) {
              recycled[m] = y;
            } else {
              // Into the next pass's forward of the first segment.
              pp_send(peer, y, "recycled",
                      Ctx::transfer_tag(false, true, first_segment, m, blk.pass + 1));
            }
          }
        } else if (model.has_head()) {
          loss_sum.add_(tape.loss, loss_scale);
        } else if (spanning) {
          const int to = L.neighbours.at(sg).second;
          span_send(sg, false, m, y, to, tag(false, to));
        } else {
          pp_send(next, y, "activation", tagged ? tag(false, L.neighbours.at(sg).second) : 0);
          // Megatron frees a stage's output once sent (deallocate_pipeline_outputs): only the
          // root of its backward stays. The socket backend has copied it; an NCCL send still
          // reads it (Ctx::in_flight keeps it to the iteration's end).
          if (!ctx.has_nccl()) resize_storage(y, 0);
        }
      } else {
        at::Tensor dy;
        if (!model.has_head()) {
          dy = spanning ? span_recv(sg, true, m, shape, tag(true, sg))
                        : pp_recv(next, shape, "gradient", tag(true, sg));
        }
        const bool input_only = blk.kind == BlockKind::kBackwardInput;
        at::Tensor dx = model.backward(ctx, tape, dy, loss_scale * fp16_scale, input_only);
        if (!model.has_embedding() && spanning) {
          const int to = L.neighbours.at(sg).first;
          span_send(sg, true, m, dx, to, tag(true, to));
        } else if (!model.has_embedding()) {
          pp_send(prev, dx, "gradient", tagged ? tag(true, L.neighbours.at(sg).first) : 0);
        }
        if (!input_only) {
          tapes.erase({sg, m});
          reduce_after(sg, m);
        }
      }
      if (zero == 3) {
        t_gather_through(tqueue.size());  // tensors no operator of this block asked for
        reduce_waiting();
        release_segment(sg);
      }
    }
    for (int sg : L.segments) {
      if (zero != 1 || !tied_copy(sg)) continue;
      tied_sync(sg);
      for (ZeroUnit& u : zunits_of.at(sg)) reduce_unit(u, grad_sync_label(sg));
    }
    if (zero >= 1) {
      for (const Param* pp : params) {
        const Param& p = *pp;
        if (p.w.grad().defined()) {
          throw Failure{
              fmt::format("iteration {}: a gradient of {} arrived after its ZeRO "
                          "reduce-scatter",
                          it, p.name)};
        }
      }
    }
    for (const Param* pp : params) {
      const Param& p = *pp;
      if (zero >= 1) break;
      // Every parameter of the rank's part is used by every micro-batch (through its bf16 copy
      // in a bf16 run): one without a gradient means the copy lost its link to the master.
      if (!p.w.grad().defined()) {
        throw Failure{fmt::format("iteration {}: no gradient reached {}", it, p.name)};
      }
    }
    // Data parallel without ZeRO: one all-reduce of each segment's gradients, flattened (with
    // expert parallelism, the routed experts' apart, over their own group).
    for (const auto& [sg, model] : models) {
      if (zero != 0) break;
      std::vector<Param*> dense, experts;
      for (Param& p : model->params()) {
        (L.split.ep > 1 && p.routed_expert ? experts : dense).push_back(&p);
      }
      for (auto* group : {&dense, &experts}) {
        const bool routed = group == &experts;
        if (group->empty()) continue;
        std::vector<at::Tensor> flat;
        for (Param* p : *group) flat.push_back(grad_or_zeros(*p).reshape({-1}));
        at::Tensor all = at::cat(flat).to(reduce_dtype);
        ctx.all_reduce(all, routed ? expert_grad_group : ctx.dp_group,
                       routed ? expert_grad_axes : ctx.dp_axes, grad_sync_label(sg));
        all = all.to(at::kFloat);
        c10::NoGradGuard no_grad;
        int64_t offset = 0;
        for (Param* p : *group) {
          const int64_t n = p->w.numel();
          p->w.mutable_grad() = all.narrow(0, offset, n).view(p->w.sizes()).clone();
          offset += n;
        }
      }
    }
    if (zero != 1) {
      for (int sg : L.segments) tied_sync(sg);
    }
    // Sequence parallelism: the gradients of the parameters applied to sequence slices summed
    // over the tensor-parallel group, in one buffer, after the data-parallel sums (the program's
    // epilogue: "norm grad sync").
    std::vector<Param*> sp;
    for (const auto& [sg, model] : models) {
      for (Param* p : model->sequence_parallel_params()) sp.push_back(p);
    }
    if (!sp.empty() && zero >= 1) {
      // With ZeRO the gradients are in the reduced chunks: their slices of those parameters,
      // which sit at the same offsets on every rank of the tensor-parallel group.
      const std::set<const Param*> spset(sp.begin(), sp.end());
      std::vector<at::Tensor> slices;
      for (ZeroUnit* u : zunits) {
        for (const ZeroLayout::Piece& k : u->layout.pieces(u->pos)) {
          if (spset.count(u->params[k.tensor])) {
            slices.push_back(u->grad.narrow(0, k.in_chunk, k.length));
          }
        }
      }
      {
        // In the dtype of the gradients' reductions (the program's grad_bytes). A rank whose
        // chunks hold none of them takes part with nothing, as every rank of the program does
        // (its share of the bytes averaged over the shards).
        at::Tensor all = slices.empty() ? at::zeros({0}, ctx.options.dtype(reduce_dtype))
                                        : at::cat(slices).to(reduce_dtype);
        ctx.tp_all_reduce(all, "norm grad sync");
        all = all.to(at::kFloat);
        c10::NoGradGuard no_grad;
        int64_t offset = 0;
        for (at::Tensor& slice : slices) {  // views into the chunks
          slice.copy_(all.narrow(0, offset, slice.numel()));
          offset += slice.numel();
        }
      }
    } else if (!sp.empty()) {
      std::vector<at::Tensor> flat;
      for (Param* p : sp) flat.push_back(grad_or_zeros(*p).reshape({-1}));
      at::Tensor all = at::cat(flat).to(reduce_dtype);
      ctx.tp_all_reduce(all, "norm grad sync");
      all = all.to(at::kFloat);
      c10::NoGradGuard no_grad;
      int64_t offset = 0;
      for (Param* p : sp) {
        const int64_t n = p->w.numel();
        p->w.mutable_grad() = all.narrow(0, offset, n).view(p->w.sizes()).clone();
        offset += n;
      }
    }
    if (fp16_scale != 1.0) {
      // The gradients (summed in fp32) unscaled; an overflow of the fp16 backward fails the run
      // (a static scale does not adapt).
      c10::NoGradGuard no_grad;
      std::vector<at::Tensor> gs;
      for (ZeroUnit* u : zunits) gs.push_back(u->grad);
      for (Param* p : params) {
        if (zero == 0) gs.push_back(p->w.grad());
      }
      for (at::Tensor& g : gs) {
        if (!g.isfinite().all().item<bool>()) {
          throw Failure{fmt::format(
              "training.precision: fp16 gradients overflowed in iteration {} at the static loss "
              "scale {} (use bf16)",
              it, fp16_scale)};
        }
        g.div_(fp16_scale);
      }
    }
    double loss = 0;
    if (has_head) {
      ctx.all_reduce(loss_sum, ctx.dp_group, ctx.dp_axes, "loss");
      loss = loss_sum.item<double>();
    }
    if (it == 0 && opt.check) {
      out.checked = true;
      out.has_loss = has_head;
      out.check_loss = loss;
      // ZeRO: the rank's chunk of each unit against the same chunk of the reference, per
      // parameter it overlaps (the dp group's chunks together cover every parameter).
      for (ZeroUnit* zu : zunits) {
        ZeroUnit& u = *zu;
        for (const ZeroLayout::Piece& k : u.layout.pieces(u.pos)) {
          const Param* p = u.params[k.tensor];
          at::Tensor g = u.grad.narrow(0, k.in_chunk, k.length);
          const at::Tensor w =
              p->cut(ref_grads.at(p->name)).reshape({-1}).narrow(0, k.in_tensor, k.length);
          if (opt.inject_fault && rank == comm.world() - 1 && out.checks.empty()) g = g * 1.01;
          ParamCheck c;
          c.name = p->name;
          c.elements = static_cast<double>(k.length);
          c.max_abs_error = (g - w).abs().max().item<double>();
          c.ref_max_abs = w.abs().max().item<double>();
          c.ok = c.max_abs_error <= opt.rtol * c.ref_max_abs + opt.atol;
          out.checks.push_back(c);
        }
      }
      for (Param* pp : params) {
        Param& p = *pp;
        if (zero >= 1) break;
        at::Tensor mine = grad_or_zeros(p);
        if (opt.inject_fault && rank == comm.world() - 1 && out.checks.empty()) mine = mine * 1.01;
        const at::Tensor want = p.cut(ref_grads.at(p.name));
        ParamCheck c;
        c.name = p.name;
        c.elements = static_cast<double>(mine.numel());
        c.max_abs_error = (mine - want).abs().max().item<double>();
        c.ref_max_abs = want.abs().max().item<double>();
        c.ok = c.max_abs_error <= opt.rtol * c.ref_max_abs + opt.atol;
        out.checks.push_back(c);
      }
      ref_grads.clear();  // checked: their memory is not the plan's
    }
    // Adam.
    {
      const Mark o0 = stats.mark();
      {
        c10::NoGradGuard no_grad;
        const double k = it + 1;
        AdamLists lists;
        for (ZeroUnit* u : zunits) lists.add(u->master, u->grad, u->m, u->v);  // ZeRO: the chunk
        for (Param* p : params) {
          if (zero >= 1) break;
          if (!p->m.defined()) {
            p->m = at::zeros_like(p->w);
            p->v = at::zeros_like(p->w);
          }
          lists.add(p->w, p->w.grad(), p->m, p->v);
        }
        lists.step(lr, beta1, beta2, eps, k);
        std::vector<at::Tensor> zero_grads;
        for (ZeroUnit* u : zunits) zero_grads.push_back(u->grad);
        if (!zero_grads.empty()) at::_foreach_zero_(zero_grads);
      }
      // ZeRO-1/2: the updated chunks gathered into whole weights (the program launches this
      // gather after the step and waits for it before each unit's first forward); ZeRO-3
      // gathers unit by unit in the next iteration's blocks.
      if (zero == 1 || zero == 2) {
        for (ZeroUnit* u : zunits) gather_unit(*u);
      }
      // ZeRO-3: the persistent tensors' updated chunks, all in one all-gather (DeepSpeed's
      // after the step, as the program's epilogue).
      std::vector<const ZeroUnit*> persistent;
      for (const ZeroUnit* u : zunits) {
        if (u->persistent) persistent.push_back(u);
      }
      if (!persistent.empty()) gather_persistent(persistent);
      // bf16: the next iteration's weight copies (with autograd), timed with the step; ZeRO-3's
      // come with each gather.
      if (zero != 3) {
        for (auto& [sg, model] : models) model->cast_weights();
      }
      stats.op("optimizer", "step", o0, stats.mark(), /*minus_collectives=*/true);
    }
#ifdef NNSIM_TORCH_HAS_CUDA
    if (gpu) ok_or_throw(cuda_synchronize());  // the iteration ends when its GPU work does
#endif
    if (stats.recording) {
      out.iteration_seconds.push_back(seconds_since(t0));
      if (has_head) out.losses.push_back(loss);
    }
    stats.resolve();
    ctx.in_flight.clear();
  }
  ok_or_throw(comm.flush());
  ok_or_throw(comm.barrier());
  const double n = std::max(1, opt.iterations);
  for (auto& [k, o] : stats.ops) {
    o.calls /= n;
    o.seconds /= n;
    out.ops.push_back(o);
  }
  for (auto& [k, c] : stats.colls) {
    c.calls /= n;
    c.seconds /= n;
    out.collectives.push_back(c);
  }
  rusage u{};
  if (::getrusage(RUSAGE_SELF, &u) == 0) out.peak_rss_bytes = u.ru_maxrss * 1024.0;
  out.peak_allocated_bytes = memory.peak();
  out.peak_reserved_bytes = memory.reserved_peak();
  out.memory = std::move(stats.memory_samples);
#ifdef NNSIM_TORCH_HAS_CUDA
  if (gpu) out.gpu = gpu_index;
#endif
  return out;
}

}  // namespace

Expected<RankResult> run_rank(const Plan& plan, const RunOptions& options, Comm& comm) {
  try {
    return run(plan, options, comm);
  } catch (const Failure& f) {
    return Error(f.message);
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Error(std::string("LibTorch: ") + e.what());
  }
}

}  // namespace nnsim::hwexec
