// The LibTorch side of `nnexec run` (docs/hwexec.md): runs one rank's blocks of the plan's
// schedule over its parts of the model (run_model.h: a GPT- or Llama-style model, its operators
// each an autograd graph of their own), in fp32 or, for bf16 plans, in bf16 with fp32 master
// weights, gradients and Adam. Around the parts' passes it runs what the program runs between
// them: the pipeline's transfers (tagged where an interleaved, V-shaped or spanning placement
// may reorder them; Megatron's scatter-gather), repeated forwards (training.recycle: earlier
// passes without autograd, the last segment's output recycled into the first segment's
// embedding), the data-parallel gradient sums, ZeRO 1-3 (the optimizer's chunks, the gradients'
// reduce-scatters and the parameters' gathers, unit by unit or tensor by tensor as the program
// decides: run_zero3.h), the epilogue's tied-embedding and sequence-parallel sums, and Adam; and
// with --check, the unpartitioned model's gradients to compare against.
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
#include "hwexec/run_context.h"
#include "hwexec/run_context_parallel.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_model.h"
#include "hwexec/run_model_masks.h"
#include "hwexec/run_moe.h"
#include "hwexec/run_precision.h"
#include "hwexec/run_spanning.h"
#include "hwexec/run_split_backward.h"
#include "hwexec/run_stats.h"
#include "hwexec/run_zero3.h"
#include "hwexec/run_zero_layout.h"
#include "hwexec/run_zero_shards.h"

#ifdef NNSIM_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "hwexec/nccl_comm.h"
#endif

namespace nnsim::hwexec {

namespace {

double seconds_since(RunClock::time_point t0) {
  return std::chrono::duration<double>(RunClock::now() - t0).count();
}

// The batch of iteration `it`: tokens [B, s + 1], the same on every rank (drawn on the CPU).
at::Tensor batch(const Plan& plan, unsigned long long seed, int it, at::Device device) {
  at::manual_seed(seed * 7919 + 104729ull * (it + 1));
  at::Tensor t =
      at::randint(plan.model.vocab, {plan.global_batch, plan.model.seq_len + 1}, at::kLong);
  return device.is_cpu() ? t : t.to(device);
}

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
  RankLayout L = layout_of(plan, rank);
  if (L.order == nullptr) return Error(fmt::format("no schedule order holds rank {}", rank));
  const int tp_size = [&] {
    int n = 1;
    for (const std::string& a : L.tp_axes) n *= mesh.axis_size(a);
    return n;
  }();
  RunStats stats;
  stats.memory = &memory;
  stats.memory_timeline = opt.memory_timeline;
  RankContext ctx;
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
  ctx.tp_axes = axes_name(L.tp_axes);
  ctx.pp_axes = axes_name(L.pp_axes);
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
    ctx.ep_axes = axes_name(L.ep_axes);
    const std::vector<std::string> grad_axes = data_parallel_with(mesh, L.ep_axes);
    ctx.dp_group = mesh.ranks_along(rank, grad_axes);
    ctx.dp_axes = axes_name(grad_axes);
  }
  if (L.split.cp > 1) {
    // Context parallelism: the cp ring, and the gradients summed over dp and cp (the program's
    // gradient buckets when every weighted operator is split along the sequence).
    ctx.cp_group = mesh.ranks_along(rank, L.cp_axes);
    ctx.cp_axes = axes_name(L.cp_axes);
    const int n = static_cast<int>(ctx.cp_group.size()), i = L.split.cp_index;
    ctx.cp_next = ctx.cp_group[(i + 1) % n];
    ctx.cp_prev = ctx.cp_group[(i + n - 1) % n];
    const std::vector<std::string> grad_axes = data_parallel_with(mesh, L.cp_axes);
    ctx.dp_group = mesh.ranks_along(rank, grad_axes);
    ctx.dp_axes = axes_name(grad_axes);
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
  // (direction, segment, micro-batch), not by their order (see RankContext::send_tagged).
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

  // The gradients' reduction carries what the program prices (comm.grad_reduce_bytes, else
  // optimizer.grad_bytes): bf16 at 2 bytes in a bf16 plan, else the fp32 gradients.
  const double reduce_bytes =
      plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
  const at::ScalarType reduce_dtype = dtype != at::kFloat && reduce_bytes == 2 ? dtype : at::kFloat;
  const int zero = plan.optimizer.zero;
  ZeroShards shards(plan, rank, L, models, ctx, dtype, reduce_dtype, expert_grad_group,
                    expert_grad_axes);

  RankResult out;
  out.rank = rank;
  out.coordinates = coords;
  for (const Param* p : params) out.parameters += static_cast<double>(p->w.numel());

  // The unpartitioned reference: the whole model, the whole batch, one micro-batch.
  std::map<std::string, at::Tensor> ref_grads;
  if (opt.check) {
    RunStats ref_stats;  // never recording; steady-clock marks
    RankContext ref;
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
      throw RunFailure{
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
    const auto t0 = RunClock::now();
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
      // The tag of a transfer into segment `to` (RankContext::transfer_tag).
      auto tag = [&](bool gradient, int to) {
        return RankContext::transfer_tag(gradient, false, to, m, blk.pass);
      };
      shards.before_block(static_cast<std::size_t>(&blk - L.order->blocks.data()), sg);
      MicroBatchTape& tape = tapes[{sg, m}];
      tape.key = DropoutKey{opt.seed, it, row, plan.recycle - 1};  // the last pass's masks
      if (blk.kind == BlockKind::kRecompute) {
        model.recompute(ctx, tape);
      } else if (blk.kind == BlockKind::kBackwardWeight) {
        model.backward_weights(ctx, tape);
        tapes.erase({sg, m});
        shards.after_weight_gradients(sg, m);
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
                      RankContext::transfer_tag(false, true, sg, m, blk.pass));
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
                      RankContext::transfer_tag(false, true, first_segment, m, blk.pass + 1));
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
          // reads it (RankContext::in_flight keeps it to the iteration's end).
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
          shards.after_weight_gradients(sg, m);
        }
      }
      shards.after_block(sg);
    }
    shards.finish_tied_zero1();
    if (zero >= 1) {
      for (const Param* pp : params) {
        const Param& p = *pp;
        if (p.w.grad().defined()) {
          throw RunFailure{
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
        throw RunFailure{fmt::format("iteration {}: no gradient reached {}", it, p.name)};
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
                       routed ? expert_grad_axes : ctx.dp_axes, grad_sync_label(plan, sg));
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
      for (int sg : L.segments) shards.tied_sync(sg);
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
      for (ZeroUnit* u : shards.units()) {
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
      for (ZeroUnit* u : shards.units()) gs.push_back(u->grad);
      for (Param* p : params) {
        if (zero == 0) gs.push_back(p->w.grad());
      }
      for (at::Tensor& g : gs) {
        if (!g.isfinite().all().item<bool>()) {
          throw RunFailure{fmt::format(
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
      for (ZeroUnit* zu : shards.units()) {
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
        for (ZeroUnit* u : shards.units())
          lists.add(u->master, u->grad, u->m, u->v);  // ZeRO: the chunk
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
        for (ZeroUnit* u : shards.units()) zero_grads.push_back(u->grad);
        if (!zero_grads.empty()) at::_foreach_zero_(zero_grads);
      }
      shards.gather_after_step();
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
  } catch (const RunFailure& f) {
    return Error(f.message);
  } catch (const c10::Error& e) {
    return Error(std::string("LibTorch: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Error(std::string("LibTorch: ") + e.what());
  }
}

}  // namespace nnsim::hwexec
