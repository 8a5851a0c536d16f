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
#include "hwexec/run_gradients.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_model.h"
#include "hwexec/run_model_masks.h"
#include "hwexec/run_moe.h"
#include "hwexec/run_pipeline.h"
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

// The device this rank computes on: the CPU, or (--device cuda) GPU `gpu_index`, --gpu or the
// rank's place among the machine's GPUs, selected for this thread.
Expected<at::Device> device_of(const RunOptions& opt, int rank, int& gpu_index) {
  gpu_index = -1;
  if (opt.device == "cpu") return at::Device(at::kCPU);
  if (opt.device != "cuda") {
    return Error(fmt::format("--device: '{}' is neither cpu nor cuda", opt.device));
  }
#ifndef NNSIM_TORCH_HAS_CUDA
  (void)rank;
  return Error(fmt::format(
      "--device cuda: this build's LibTorch ({}) has no CUDA (Debian's libtorch is CPU-only); "
      "configure with -DNNSIM_TORCH_PYTHON=<python with a CUDA torch>",
      TORCH_VERSION));
#else
  const int gpus = at::hasCUDA() ? static_cast<int>(c10::cuda::device_count()) : 0;
  if (gpus == 0) return Error("--device cuda: LibTorch sees no CUDA device");
  gpu_index = opt.gpu >= 0 ? opt.gpu : rank % gpus;
  if (gpu_index >= gpus) {
    return Error(fmt::format("--device cuda: rank {} should drive GPU {} but LibTorch sees {}",
                             rank, gpu_index, gpus));
  }
  ok_or_throw(cuda_set_device(gpu_index));
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(gpu_index));
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu_index));
#endif
}

// A routed expert's gradient group under expert parallelism (dp alone; the rest sums over dp
// and ep).
struct ExpertGroup {
  std::vector<int> ranks;
  std::string axes;
};

// The context's groups of `rank` from its layout: tensor, data (with the axes that also split
// the batch or the sequence), expert and context parallel, and the vocabulary's; records the
// vocabulary shards in the layout's split. Returns the routed experts' gradient group.
ExpertGroup set_groups(RankContext& ctx, const Plan& plan, int rank, RankLayout& L) {
  const Mesh& mesh = plan.mesh;
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
  ExpertGroup experts{ctx.dp_group, ctx.dp_axes};
  if (L.split.ep > 1) {
    ctx.ep_group = mesh.ranks_along(rank, L.ep_axes);
    ctx.ep_axes = axes_name(L.ep_axes);
    for (const std::string& axis : L.ep_axes.size() > 1 ? L.ep_axes : std::vector<std::string>{}) {
      RankContext::AxisGroup g;
      g.ranks = mesh.ranks_along(rank, {axis});
      g.axis = axis;
      g.index = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), rank) - g.ranks.begin());
      ctx.ep_stages.push_back(g);
    }
    const std::vector<std::string> grad_axes = data_parallel_with(mesh, L.batch_axes);
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
  return experts;
}

// One part of the model per segment of the rank, the embedding's first: a tied head in another
// segment on this rank (a V-shaped placement) projects with the embedding part's matrix.
ModelParts build_models(const Plan& plan, const RankLayout& L, const RankContext& ctx,
                        unsigned long long seed, at::Device device, at::ScalarType dtype,
                        bool fp8) {
  ModelParts models;
  std::vector<int> build_order = L.segments;
  std::stable_partition(build_order.begin(), build_order.end(),
                        [&](int sg) { return plan.segments[sg].embedding; });
  Param* embedding_word = nullptr;
  for (int sg : build_order) {
    const Segment& seg = plan.segments[sg];
    models[sg] = std::make_unique<Model>(
        plan.model, seg.first_layer, seg.end_layer, seg.embedding, seg.head, L.split, ctx.tp_index,
        seed, device, dtype,
        plan.model.tied_embeddings && seg.head && !seg.embedding ? embedding_word : nullptr);
    if (seg.embedding) embedding_word = models[sg]->word_matrix();
    models[sg]->set_recompute(plan.recompute, plan.recompute_early_stop);
    models[sg]->set_fp8(fp8);
    models[sg]->set_reduce_input(!seg.embedding && seg.first_layer == 0 &&
                                 seg.end_layer > seg.first_layer && ctx.embed_vocab.pipeline &&
                                 plan.model.position != PositionKind::kLearned &&
                                 !plan.model.dropout);
  }
  return models;
}

// The unpartitioned reference of --check: the whole model in fp32 (a bf16 run is checked
// against the full-precision model), the whole batch of iteration 0 as one micro-batch. Its
// gradients by parameter name; its loss in `loss`.
std::map<std::string, at::Tensor> reference_gradients(const Plan& plan, const RunOptions& opt,
                                                      Comm& comm, at::Device device, double& loss) {
  RunStats stats;  // never recording; steady-clock marks
  RankContext ref;
  ref.comm = &comm;
  ref.stats = &stats;
  ref.options = at::TensorOptions().dtype(at::kFloat).device(device);
  ref.tp_group = ref.dp_group = {comm.rank()};
  Model whole(plan.model, 0, plan.model.layers, true, true, Split{}, 0, opt.seed, device,
              at::kFloat);
  const at::Tensor data = batch(plan, opt.seed, 0, device);
  const int64_t s = plan.model.seq_len;
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
  loss = tape.loss.item<double>();
  whole.backward(ref, tape, at::Tensor(), 1.0);
  std::map<std::string, at::Tensor> grads;
  for (Param& p : whole.params()) grads[p.name] = grad_or_zeros(p);
  return grads;
}

#ifdef NNSIM_TORCH_HAS_CUDA
// One NCCL communicator per group and per pipeline direction of the rank: the pipeline
// transfers, the cp ring, recycling and spanning segments' peers, and every collective group.
Expected<std::unique_ptr<NcclComms>> connect_nccl(Comm& comm, int gpu_index, int rank,
                                                  const RankLayout& L, const RankContext& ctx,
                                                  const PipelineTransfers& pipeline,
                                                  const ExpertGroup& experts) {
  std::vector<int> others = pipeline.peers();
  others.insert(others.end(), {ctx.cp_next, ctx.cp_prev});
  std::set<std::pair<int, int>> edge_set;
  for (int peer : others) {
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
    for (const RankContext::AxisGroup& g : ctx.ep_stages) groups.push_back(g.ranks);
    groups.push_back(experts.ranks);
  }
  return NcclComms::create(comm, gpu_index, groups, edges);
}
#endif

// The rank's rows of the batch: its replica's micro-batches, under expert parallelism its
// ep_index-th share of each (b sequences); under context parallelism its tokens' positions.
struct BatchRows {
  int dp_index = 0, M = 0, b = 0;
  int64_t s = 0;
  at::Tensor positions;
  // The loss of a micro-batch is its tokens' mean (under context parallelism, of the rank's
  // share of them): scaled so that the sum over replicas, micro-batches and cp ranks is the
  // global batch's mean.
  double loss_scale = 1;
};

BatchRows rows_of(const Plan& plan, const RankLayout& L, const std::vector<int>& coordinates,
                  at::Device device) {
  BatchRows r;
  const int dp = plan.data_parallel();
  r.dp_index = coordinates[plan.mesh.axis_index(kDataParallelAxis)];
  r.M = plan.num_micro_batches();
  r.b = plan.micro_batch / L.split.batch_ep;
  r.s = plan.model.seq_len;
  r.positions = (L.split.cp > 1 ? cp_positions(r.s, L.split.cp, L.split.cp_index)
                                : at::arange(r.s, at::kLong))
                    .to(device);
  r.loss_scale = 1.0 / (r.M * dp * L.split.cp * L.split.batch_ep);
  return r;
}

// One rank's iterations over what run() set up: the blocks of its order, then the epilogue's
// sums, the --check comparison and the optimizer step.
struct RankIterations {
  const Plan& plan;
  const RunOptions& opt;
  Comm& comm;
  const RankLayout& L;
  RankContext& ctx;
  RunStats& stats;
  PipelineTransfers& pipeline;
  ModelParts& models;
  ZeroShards& shards;
  const std::vector<Param*>& params;
  const ExpertGroup& experts;
  const at::Device device;
  const at::ScalarType reduce_dtype;
  const double fp16_scale;
  const bool has_head;
  std::map<std::string, at::Tensor>& reference;
  RankResult& out;

  const BatchRows rows;

  // Block `blk` of iteration `it`: a forward (a pass of it), a backward (whole, or its input or
  // weight half) or a recomputation, with the transfers around it.
  void run_block(const Block& blk, int it, const at::Tensor& data,
                 std::map<std::pair<int, int>, MicroBatchTape>& tapes, at::Tensor& loss_sum) {
    const int m = blk.micro_batch, sg = blk.segment;
    const int64_t row = (static_cast<int64_t>(rows.dp_index) * rows.M + m) * plan.micro_batch +
                        static_cast<int64_t>(L.split.batch_ep_index) * rows.b;
    Model& model = *models.at(sg);
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
        x = pipeline.receive_activation(sg, m, blk.pass);
      } else if (blk.pass > 0) {
        x = pipeline.receive_recycled(sg, m, blk.pass);
      }
      const at::Tensor sequences = data.narrow(0, row, rows.b);
      at::Tensor y =
          model.forward(ctx, sequences.narrow(1, 0, rows.s).index_select(1, rows.positions), x,
                        sequences.narrow(1, 1, rows.s).index_select(1, rows.positions), ftape);
      if (model.has_head() && earlier) {
        pipeline.send_recycled(m, blk.pass, y);
      } else if (model.has_head()) {
        loss_sum.add_(tape.loss, rows.loss_scale);
      } else {
        pipeline.send_activation(sg, m, blk.pass, y);
      }
    } else {
      at::Tensor dy;
      if (!model.has_head()) dy = pipeline.receive_gradient(sg, m, blk.pass);
      const bool input_only = blk.kind == BlockKind::kBackwardInput;
      at::Tensor dx = model.backward(ctx, tape, dy, rows.loss_scale * fp16_scale, input_only);
      if (!model.has_embedding()) pipeline.send_gradient(sg, m, blk.pass, dx);
      if (!input_only) {
        tapes.erase({sg, m});
        shards.after_weight_gradients(sg, m);
      }
    }
    shards.after_block(sg);
  }

  // After the blocks: the gradients' sums, the loss over the replicas, the --check comparison
  // (first iteration) and the optimizer step; the iteration's loss.
  double epilogue(int it, at::Tensor& loss_sum) {
    const int zero = plan.optimizer.zero;
    shards.finish_tied_zero1();
    check_gradients_arrived(params, zero, it);
    if (zero == 0) {
      sum_data_parallel(plan, models, ctx, L.split.ep > 1, experts.ranks, experts.axes,
                        reduce_dtype);
    }
    if (zero != 1) {
      for (int sg : L.segments) shards.tied_sync(sg);
    }
    sum_sequence_parallel(models, shards, ctx, reduce_dtype);
    if (fp16_scale != 1.0) unscale_fp16(params, shards, fp16_scale, it);
    double loss = 0;
    if (has_head) {
      ctx.all_reduce(loss_sum, ctx.dp_group, ctx.dp_axes, "loss");
      loss = loss_sum.item<double>();
    }
    if (it == 0 && opt.check) {
      out.checked = true;
      out.has_loss = has_head;
      out.check_loss = loss;
      out.checks = compare_gradients(params, shards, reference, opt.rtol, opt.atol,
                                     opt.inject_fault && comm.rank() == comm.world() - 1);
      reference.clear();  // checked: their memory is not the plan's
    }
    const Mark o0 = stats.mark();
    adam_step(params, shards, it + 1);
    shards.gather_after_step();
    // bf16: the next iteration's weight copies (with autograd), timed with the step;
    // ZeRO-3's come with each gather.
    if (zero != 3) {
      for (auto& [sg, model] : models) model->cast_weights();
    }
    stats.op("optimizer", "step", o0, stats.mark(), /*minus_collectives=*/true);
    return loss;
  }

  // Iteration `it`: every block of the rank's order, then the epilogue; recorded after the
  // warm-up.
  void run_iteration(int it, MemoryProbe& memory) {
    ok_or_throw(comm.barrier());
    stats.recording = it >= opt.warmup;
    // Memory over the measured iterations only: not the --check reference's forward, nor the
    // first step's allocation of the optimizer's moments.
    if (it == opt.warmup) memory.reset();
    stats.memory_samples.clear();  // the last measured iteration's
    for (Param* p : params) p->w.mutable_grad() = at::Tensor();
    pipeline.start_iteration();
    const auto t0 = RunClock::now();
    const at::Tensor data = batch(plan, opt.seed, it, device);
    std::map<std::pair<int, int>, MicroBatchTape> tapes;  // (segment, micro-batch)
    at::Tensor loss_sum = at::zeros({1}, ctx.options.dtype(at::kFloat));
    for (const Block& blk : L.order->blocks) run_block(blk, it, data, tapes, loss_sum);
    const double loss = epilogue(it, loss_sum);
#ifdef NNSIM_TORCH_HAS_CUDA
    if (device.is_cuda()) ok_or_throw(cuda_synchronize());  // the iteration ends with its GPU work
#endif
    if (stats.recording) {
      out.iteration_seconds.push_back(seconds_since(t0));
      if (has_head) out.losses.push_back(loss);
    }
    stats.resolve();
    ctx.in_flight.clear();
  }
};

// The measured iterations' operators and collectives per iteration, and the memory figures.
void record_results(RunStats& stats, MemoryProbe& memory, const RunOptions& opt, at::Device device,
                    int gpu_index, RankResult& out) {
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
  if (device.is_cuda()) out.gpu = gpu_index;
}

Expected<RankResult> run(const Plan& plan, const RunOptions& opt, Comm& comm) {
  if (Status s = check_runnable(plan); !s) return s.error();
  if (comm.world() != plan.mesh.num_ranks()) {
    return Error(fmt::format("the plan's mesh has {} ranks but {} processes run it",
                             plan.mesh.num_ranks(), comm.world()));
  }
  at::set_num_threads(std::max(1, opt.threads));
  const int rank = comm.rank();
  int gpu_index = -1;
  const Expected<at::Device> on = device_of(opt, rank, gpu_index);
  if (!on) return on.error();
  const at::Device device = *on;
  MemoryProbe memory(gpu_index);
  RankLayout L = layout_of(plan, rank);
  if (L.order == nullptr) return Error(fmt::format("no schedule order holds rank {}", rank));
  RunStats stats;
  stats.memory = &memory;
  stats.memory_timeline = opt.memory_timeline;
  const std::string run_type = run_dtype(plan);
  const at::ScalarType dtype = run_type == "bf16" || run_type == "fp8" ? at::kBFloat16
                               : run_type == "fp16"                    ? at::kHalf
                                                                       : at::kFloat;
  // fp16: a static loss scale (Megatron's --loss-scale), so that small gradients stay above
  // fp16's smallest values; the fp32 gradients are unscaled before the optimizer (and --check).
  const double fp16_scale = dtype == at::kHalf ? kFp16LossScale : 1.0;
  // The gradients' reduction carries what the program prices (comm.grad_reduce_bytes, else
  // optimizer.grad_bytes): bf16 at 2 bytes in a bf16 plan, else the fp32 gradients.
  const double reduce_bytes =
      plan.comm.grad_reduce_bytes > 0 ? plan.comm.grad_reduce_bytes : plan.optimizer.grad_bytes;
  const at::ScalarType reduce_dtype = dtype != at::kFloat && reduce_bytes == 2 ? dtype : at::kFloat;
  RankContext ctx;
  ctx.comm = &comm;
  ctx.stats = &stats;
  ctx.options = at::TensorOptions().dtype(dtype).device(device);
  const ExpertGroup experts = set_groups(ctx, plan, rank, L);
  PipelineTransfers pipeline(plan, rank, L, ctx);
#ifdef NNSIM_TORCH_HAS_CUDA
  // The compute stream is a non-blocking one of LibTorch's pool (NCCL kernels waiting for a
  // peer must not serialize with the legacy default stream).
  std::unique_ptr<NcclComms> nccl;
  CudaEvents events;
  if (device.is_cuda()) {
    auto made = connect_nccl(comm, gpu_index, rank, L, ctx, pipeline, experts);
    if (!made) return made.error();
    nccl = std::move(*made);
    ctx.nccl = nccl.get();
    c10::cuda::CUDAStream compute = c10::cuda::getStreamFromPool(false, device.index());
    c10::cuda::setCurrentCUDAStream(compute);
    stats.events = &events;
    stats.stream = compute.stream();
  }
#endif
  ModelParts models = build_models(plan, L, ctx, opt.seed, device, dtype, run_type == "fp8");
  std::vector<Param*> params;  // all of the rank's, segment by segment
  bool has_head = false;
  for (int sg : L.segments) {
    for (Param& p : models[sg]->params()) params.push_back(&p);
    has_head = has_head || plan.segments[sg].head;
  }
  ZeroShards shards(plan, rank, L, models, ctx, dtype, reduce_dtype, experts.ranks, experts.axes);

  RankResult out;
  out.rank = rank;
  out.coordinates = plan.mesh.coordinates(rank);
  for (const Param* p : params) out.parameters += static_cast<double>(p->w.numel());
  std::map<std::string, at::Tensor> reference;
  if (opt.check) reference = reference_gradients(plan, opt, comm, device, out.reference_loss);

  RankIterations iterations{plan,         opt,
                            comm,         L,
                            ctx,          stats,
                            pipeline,     models,
                            shards,       params,
                            experts,      device,
                            reduce_dtype, fp16_scale,
                            has_head,     reference,
                            out,          rows_of(plan, L, out.coordinates, device)};
  for (int it = 0; it < opt.warmup + opt.iterations; ++it) iterations.run_iteration(it, memory);
  ok_or_throw(comm.flush());
  ok_or_throw(comm.barrier());
  record_results(stats, memory, opt, device, gpu_index, out);
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
