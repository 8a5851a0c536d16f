// A mixture-of-experts block's MLP in a model part (run_model.h): the shared expert, the
// router, the routed copies (over the expert-parallel ranks by all-to-all), the grouped expert
// GEMMs and the combine, forward and backward.
#include "hwexec/run_model.h"

namespace nnsim::hwexec {

namespace {

// The routed copies as received from `members` members (got[i el + l]: member i's copies for
// local expert l; member by member, each member's in expert order), reordered expert by expert:
// the rows from each member, each local expert's count, and the permutation both ways.
void order_by_expert(const std::vector<int64_t>& got, int64_t members, int64_t el,
                     at::Device device, ExpertExchange& x) {
  x.recv_rows.assign(static_cast<std::size_t>(members), 0);
  x.local_counts.assign(static_cast<std::size_t>(el), 0);
  std::vector<int64_t> first(static_cast<std::size_t>(members * el));  // row of (i, l) received
  int64_t row = 0;
  for (int64_t i = 0; i < members; ++i) {
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
    for (int64_t i = 0; i < members; ++i) {
      const auto il = static_cast<std::size_t>(i * el + l);
      for (int64_t r = 0; r < got[il]; ++r) order.push_back(first[il] + r);
    }
  }
  x.to_expert_major = at::tensor(order, at::kLong).to(device);
  x.to_source_major = at::argsort(x.to_expert_major);
}

// The bytes of the rank's own routed copies at `rows`' width and type: what the program moves
// for them, whichever way (and in however many pieces) they travel.
double routed_bytes(const LayerTape& t, const at::Tensor& rows) {
  return static_cast<double>(t.routing.order.numel()) * static_cast<double>(rows.size(1)) *
         static_cast<double>(rows.element_size());
}

}  // namespace

void Model::add_moe_params(const std::string& p, LayerParams& L) {
  const int64_t h = spec_.hidden, e = spec_.experts, f = spec_.expert_ffn_hidden,
                fs = spec_.shared_expert_ffn_hidden, branches = spec_.gated_mlp() ? 2 : 1;
  auto whole = [](const at::Tensor& x) { return x; };
  L.moe = true;
  if (fs > 0) {
    // Split along its width over tp as the MLP: fc1's columns (each SwiGLU branch alike), fc2's
    // rows.
    const int64_t fsl = fs / split_.shared_ffn, ts = split_.shared_ffn > 1 ? t_ : 0;
    L.sfc1_w =
        add(p + "moe.shared.fc1.weight", {h, branches * fs}, 0.05, 0, [=](const at::Tensor& x) {
          return x.view({h, branches, fs}).narrow(2, ts * fsl, fsl).reshape({h, branches * fsl});
        });
    if (spec_.bias) {
      L.sfc1_b = add(p + "moe.shared.fc1.bias", {branches * fs}, 0.05, 0, [=](const at::Tensor& x) {
        return x.view({branches, fs}).narrow(1, ts * fsl, fsl).reshape({branches * fsl});
      });
    }
    L.sfc2_w = add(p + "moe.shared.fc2.weight", {fs, h}, 0.05, 0,
                   [=](const at::Tensor& x) { return x.narrow(0, ts * fsl, fsl); });
    if (spec_.bias) L.sfc2_b = add(p + "moe.shared.fc2.bias", {h}, 0.05, 0, whole);
  }
  L.router_w = add(p + "moe.router.weight", {h, e}, 0.05, 0, whole);
  // Expert parallelism: this rank's run of experts / ep routed experts; tensor parallelism: its
  // slice of each one's width.
  const int64_t el = e / split_.ep, first = split_.ep_index * el;
  const int64_t fl = f / split_.expert_ffn, te = split_.expert_ffn > 1 ? t_ : 0;
  L.efc1_w = add(p + "moe.fc1.weight", {e, h, branches * f}, 0.05, 0, [=](const at::Tensor& x) {
    return x.narrow(0, first, el)
        .reshape({el, h, branches, f})
        .narrow(3, te * fl, fl)
        .reshape({el, h, branches * fl});
  });
  if (spec_.bias) {
    L.efc1_b = add(p + "moe.fc1.bias", {e, branches * f}, 0.05, 0, [=](const at::Tensor& x) {
      return x.narrow(0, first, el)
          .reshape({el, branches, f})
          .narrow(2, te * fl, fl)
          .reshape({el, branches * fl});
    });
  }
  L.efc2_w = add(p + "moe.fc2.weight", {e, f, h}, 0.05, 0, [=](const at::Tensor& x) {
    return x.narrow(0, first, el).narrow(1, te * fl, fl);
  });
  if (spec_.bias) {
    L.efc2_b = add(p + "moe.fc2.bias", {e, h}, 0.05, 0,
                   [=](const at::Tensor& x) { return x.narrow(0, first, el); });
  }
  for (Param* q : {L.efc1_w, L.efc1_b, L.efc2_w, L.efc2_b}) {
    if (q) q->routed_expert = true;
  }
}

at::Tensor Model::expert_linear(const at::Tensor& x, const Param* w, const Param* b,
                                const std::vector<int64_t>& counts) const {
  return grouped_linear(x, W(w), b ? c10::optional<at::Tensor>(W(b)) : c10::nullopt, counts,
                        cpu_fp16(), fp8_);
}

void Model::moe_forward(RunStats& st, const LayerParams& L, LayerTape& t, bool again,
                        const std::set<std::string>& rc, const std::set<std::string>& stopped) {
  RankContext& c = *ctx_;
  auto runs = [&](const char* op) { return !again || rc.count(op) > 0; };
  const char* phase = again ? "recompute" : "fwd";
  const int64_t k = spec_.experts_per_token, e = spec_.experts;
  const at::Tensor xn = t.n2.out;
  const int64_t b = xn.size(0), s = xn.size(1), h = xn.size(2), tokens = b * s;
  const bool ep = split_.ep > 1;
  // Tensor-parallel experts (their width split over tp), and sequence parallelism: the router,
  // the dispatch and the combine on this rank's slice of the sequence.
  const bool etp = split_.expert_ffn > 1, shared_tp = split_.shared_ffn > 1;
  const bool sp = split_.seq > 1;
  // The shared expert's linear layers: fp8 GEMMs in an fp8 plan, as the blocks' others.
  auto linear = [&](const at::Tensor& x, const Param* w, const Param* bias) {
    at::Tensor y = block_linear(x, W(w));
    return bias ? y + W(bias) : y;
  };
  auto act = [&](const at::Tensor& x) {
    return cpu_fp16() ? activation(x.to(at::kFloat)).to(at::kHalf) : activation(x);
  };
  if (L.sfc1_w && runs("moe.shared.fc1")) {
    // Under sequence parallelism its input gathered as mlp.fc1's, dropped after the forward
    // unless recomputed, gathered again for its backward.
    t.sfc1 =
        fwd(st, "moe.shared.fc1", phase, {column_input(c, xn, "moe.shared.fc1")},
            [&](const std::vector<at::Tensor>& in) { return linear(in[0], L.sfc1_w, L.sfc1_b); });
    t.sfc1.weights = weights_of({L.sfc1_w, L.sfc1_b});
    if (sp && !again && !rc.count("moe.shared.fc1")) dropped(t.sfc1.in[0]);
  }
  if (L.sfc1_w && runs("moe.shared.act")) {
    t.sact = fwd(st, "moe.shared.act", phase, {leaf(t.sfc1.out)},
                 [&](const std::vector<at::Tensor>& in) { return act(in[0]); });
  }
  if (L.sfc1_w && runs("moe.shared.fc2")) {
    t.sfc2 = fwd(st, "moe.shared.fc2", phase, {leaf(t.sact.out)},
                 [&](const std::vector<at::Tensor>& in) {
                   // Row-parallel: its bias is added once, to the sum, in the combine.
                   return linear(in[0], L.sfc2_w, shared_tp ? nullptr : L.sfc2_b);
                 });
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
    t.dispatch = fwd(st, "moe.dispatch", phase, {leaf(xn)}, [&](const std::vector<at::Tensor>& in) {
      t.routing = route_tokens(t.router.out.detach().reshape({tokens, e}), k, spec_.router_groups,
                               spec_.router_group_topk);
      return dispatch_tokens(in[0].reshape({tokens, h}), t.routing);
    });
  }
  // Expert parallelism: the copies go to their experts' ranks, folded over tensor-parallel
  // axes too (--etp 1) axis by axis; under sequence parallelism the tensor-parallel experts'
  // copies are gathered over tp. These are the program's conversions into moe.fc1's input
  // (labelled so): run with moe.fc1, recomputed with it, from the dispatch's output, which the
  // exchanges leave unread (its backward reads the indices) unless a recomputed fc1 exchanges
  // again.
  const bool folded = ep && !c.ep_stages.empty();
  const bool gathered = etp && sp;
  if (runs("moe.fc1")) {
    if (ep) {
      if (folded) {
        plan_folded(c, t);
        t.exchanged = folded_to_experts(c, t, t.dispatch.out.detach(), "moe.fc1");
      } else {
        plan_exchange(c, t);
        t.exchanged = to_experts(c, t, t.dispatch.out.detach(), "moe.fc1");
      }
      if (again || !rc.count("moe.fc1")) resize_storage(t.dispatch.out, 0);
    }
    if (gathered) plan_tp_gather(c, t);
  }
  const std::vector<int64_t>& counts = gathered ? t.gather.counts
                                       : folded ? t.folded.local_counts
                                       : ep     ? t.exchange.local_counts
                                                : t.routing.counts;
  if (runs("moe.fc1")) {
    at::Tensor in =
        gathered ? gather_copies(c, t, (ep ? t.exchanged : t.dispatch.out).detach(), "moe.fc1")
        : ep     ? t.exchanged
                 : t.dispatch.out;
    t.efc1 = fwd(st, "moe.fc1", phase, {leaf(in)}, [&](const std::vector<at::Tensor>& in) {
      return expert_linear(in[0], L.efc1_w, L.efc1_b, counts);
    });
    t.efc1.weights = weights_of({L.efc1_w, L.efc1_b});
    if (gathered && !again && !rc.count("moe.fc1")) dropped(t.efc1.in[0]);
  }
  if (runs("moe.act")) {
    t.eact = fwd(st, "moe.act", phase, {leaf(t.efc1.out)},
                 [&](const std::vector<at::Tensor>& in) { return act(in[0]); });
  }
  if (runs("moe.fc2")) {
    t.efc2 = fwd(st, "moe.fc2", phase, {leaf(t.eact.out)}, [&](const std::vector<at::Tensor>& in) {
      // Row-parallel experts: their biases are added once, to the sums, in the combine.
      return expert_linear(in[0], L.efc2_w, etp ? nullptr : L.efc2_b, counts);
    });
    t.efc2.weights = weights_of({L.efc2_w, L.efc2_b});
  }
  // The experts' outputs come back to this rank's copies, in its expert order; tensor-parallel
  // experts' partial sums are summed over tp (under sequence parallelism into this rank's
  // copies). These are the program's conversions into the combine's input (labelled so): run
  // again when the combine is recomputed, and for an early-stopped combine's saved input.
  const bool converts = ep || etp;
  if (converts &&
      (runs("moe.combine") || (again && stopped.count("moe.combine") && rc.count("moe.fc2")))) {
    // The experts' outputs are read once, unless a recomputed combine converts them again.
    const bool release = again || !rc.count("moe.combine");
    const at::Tensor out = t.efc2.out.detach();
    if (gathered) {
      t.returned = return_gathered(c, t, out, "moe.combine", release);
    } else if (ep) {
      t.returned =
          folded ? folded_back(c, t, out, "moe.combine") : from_experts(c, t, out, "moe.combine");
      if (etp) c.tp_all_reduce(t.returned, "moe.combine");
    } else {
      t.returned = out.clone();
      c.tp_all_reduce(t.returned, "moe.combine");
    }
    if (release) resize_storage(t.efc2.out, 0);
  }
  if (L.sfc1_w && shared_tp && runs("moe.combine")) {
    // The shared expert's partial sums, for the combine (after the routed experts', as the
    // program converts the combine's inputs in order).
    if (sp) {
      t.shared_out = scatter_seq(c, t.sfc2.out.detach(), "moe.combine");
    } else {
      t.shared_out = t.sfc2.out.detach().clone();
      c.tp_all_reduce(t.shared_out, "moe.combine");
    }
    // The partial sums go, unless a recomputed combine reduces them again.
    if (again || !rc.count("moe.combine")) resize_storage(t.sfc2.out, 0);
  }
  if (runs("moe.combine")) {
    std::vector<at::Tensor> in = {leaf(ep || etp ? t.returned : t.efc2.out), leaf(t.router.out)};
    if (L.sfc1_w) in.push_back(leaf(shared_tp ? t.shared_out : t.sfc2.out));
    t.combine =
        fwd(st, "moe.combine", phase, std::move(in), [&](const std::vector<at::Tensor>& in) {
          at::Tensor copies = in[0];
          if (etp && L.efc2_b) {  // each copy's expert's bias
            const at::Tensor of_copy = at::repeat_interleave(
                at::arange(e, at::TensorOptions().dtype(at::kLong).device(device_)),
                at::tensor(t.routing.counts, at::kLong).to(device_));
            copies = copies + W(L.efc2_b).index_select(0, of_copy);
          }
          at::Tensor out = combine_tokens(copies, in[1].reshape({tokens, e}), t.routing);
          if (in.size() > 2) out = out + in[2].reshape({tokens, h});
          if (shared_tp && L.sfc2_b) out = out + W(L.sfc2_b);
          return out.reshape({b, s, h});
        });
    // The shared expert's output is only added: the combine's backward does not read it (as
    // a residual's summands). Not when the combine is recomputed, which reads it again (the
    // recomputation itself lets it go).
    const bool reread = rc.count("moe.combine") && !again;
    if (L.sfc1_w && !reread) resize_storage(shared_tp ? t.shared_out : t.sfc2.out, 0);
    // With the experts' biases added the combine saved the biased copies, not the summed ones.
    if (etp && L.efc2_b && !reread) resize_storage(t.returned, 0);
  } else if (again && stopped.count("moe.combine")) {
    // An early stop ends at the combine, which saved the experts' outputs and the scores.
    // (With expert or tensor parallelism, as they came back: the conversion's above.)
    if (rc.count("moe.fc2")) refill(t.combine.in[0], converts ? t.returned : t.efc2.out);
    if (rc.count("moe.router")) refill(t.combine.in[1], t.router.out);
  }
}

void Model::plan_exchange(RankContext& c, LayerTape& t) const {
  const int64_t g = split_.ep, el = spec_.experts / g;
  ExpertExchange& x = t.exchange;
  x.send_rows.assign(static_cast<std::size_t>(g), 0);
  for (int64_t e = 0; e < spec_.experts; ++e) {
    x.send_rows[static_cast<std::size_t>(e / el)] += t.routing.counts[static_cast<std::size_t>(e)];
  }
  // got[i el + l]: member i's copies for this rank's expert l (its counts are in expert order,
  // each member's experts a run of el).
  x.got = c.exchange_counts(c.ep_group, t.routing.counts, el);
  order_by_expert(x.got, g, el, device_, x);
}

void Model::plan_tp_gather(RankContext& c, LayerTape& t) const {
  // Per tp member i: got_i[e el + l], the copies it holds from ep member e for local expert l
  // (held in l-major, then e, order), and sent_i[e], the copies it sent ep member e.
  const auto tp = static_cast<int64_t>(c.tp_group.size());
  const bool ep = split_.ep > 1;
  const int64_t g = split_.ep, el = spec_.experts / g;
  const std::vector<int64_t>& got = ep ? t.exchange.got : t.routing.counts;
  const std::vector<int64_t> sent =
      ep ? t.exchange.send_rows : std::vector<int64_t>{t.routing.order.numel()};
  auto from_all = [&](const std::vector<int64_t>& mine) {
    std::vector<int64_t> send;
    for (int64_t i = 0; i < tp; ++i) send.insert(send.end(), mine.begin(), mine.end());
    return c.exchange_counts(c.tp_group, send, static_cast<int64_t>(mine.size()));
  };
  const std::vector<int64_t> got_all = from_all(got), sent_all = from_all(sent);
  auto got_of = [&](int64_t i, int64_t e, int64_t l) {
    return got_all[static_cast<std::size_t>(i * g * el + e * el + l)];
  };
  auto sent_of = [&](int64_t j, int64_t e) {
    return sent_all[static_cast<std::size_t>(j * g + e)];
  };
  auto cell = [&](int64_t i, int64_t e, int64_t l) {
    return static_cast<std::size_t>((i * g + e) * el + l);
  };
  TpGather& x = t.gather;
  // The gathered rows: member by member, each member's l-major then e; where (i, e, l) starts.
  std::vector<int64_t> start(static_cast<std::size_t>(tp * g * el));
  int64_t row = 0;
  x.member_rows.assign(static_cast<std::size_t>(tp), 0);
  for (int64_t i = 0; i < tp; ++i) {
    for (int64_t l = 0; l < el; ++l) {
      for (int64_t e = 0; e < g; ++e) {
        start[cell(i, e, l)] = row;
        row += got_of(i, e, l);
        x.member_rows[static_cast<std::size_t>(i)] += got_of(i, e, l);
      }
    }
  }
  // Expert-major: l, then i, then e; and where each (i, e, l) lands there.
  std::vector<int64_t> order, landed(start.size());
  order.reserve(static_cast<std::size_t>(row));
  x.counts.assign(static_cast<std::size_t>(el), 0);
  for (int64_t l = 0; l < el; ++l) {
    for (int64_t i = 0; i < tp; ++i) {
      for (int64_t e = 0; e < g; ++e) {
        landed[cell(i, e, l)] = static_cast<int64_t>(order.size());
        for (int64_t r = 0; r < got_of(i, e, l); ++r) order.push_back(start[cell(i, e, l)] + r);
        x.counts[static_cast<std::size_t>(l)] += got_of(i, e, l);
      }
    }
  }
  x.to_expert_major = at::tensor(order, at::kLong).to(device_);
  // Back to the sources: to ep member e, each tp member i's copies from e, expert by expert.
  std::vector<int64_t> back;
  back.reserve(static_cast<std::size_t>(row));
  x.back_send_rows.assign(static_cast<std::size_t>(g), 0);
  for (int64_t e = 0; e < g; ++e) {
    for (int64_t i = 0; i < tp; ++i) {
      for (int64_t l = 0; l < el; ++l) {
        for (int64_t r = 0; r < got_of(i, e, l); ++r) back.push_back(landed[cell(i, e, l)] + r);
        x.back_send_rows[static_cast<std::size_t>(e)] += got_of(i, e, l);
      }
    }
  }
  x.back_send_order = at::tensor(back, at::kLong).to(device_);
  // Received from each ep member e: tp member j's copies' sums from e's experts (sent_j[e]
  // rows), j by j; reordered tp member by tp member, each member's copies in its own order.
  x.back_recv_rows.assign(static_cast<std::size_t>(g), 0);
  std::vector<int64_t> block(static_cast<std::size_t>(g), 0);
  for (int64_t e = 0; e < g; ++e) {
    for (int64_t j = 0; j < tp; ++j) x.back_recv_rows[static_cast<std::size_t>(e)] += sent_of(j, e);
    if (e > 0) {
      block[static_cast<std::size_t>(e)] = block[static_cast<std::size_t>(e - 1)] +
                                           x.back_recv_rows[static_cast<std::size_t>(e - 1)];
    }
  }
  std::vector<int64_t> recv;
  recv.reserve(static_cast<std::size_t>(row));
  for (int64_t j = 0; j < tp; ++j) {
    for (int64_t e = 0; e < g; ++e) {
      int64_t first = block[static_cast<std::size_t>(e)];
      for (int64_t jj = 0; jj < j; ++jj) first += sent_of(jj, e);
      for (int64_t r = 0; r < sent_of(j, e); ++r) recv.push_back(first + r);
    }
  }
  x.back_recv_order = at::tensor(recv, at::kLong).to(device_);
}

at::Tensor Model::gather_copies(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                                const std::string& label) const {
  const int64_t width = rows.size(1);
  if (split_.ep > 1) {
    // The expert-parallel exchange leaves the members different numbers of copies; recorded as
    // the program's all-gather of every member's own routed copies (balanced routing's bytes).
    return c
        .all_gather_rows(rows, c.tp_group, c.tp_axes, label, t.gather.member_rows,
                         nominal_gathered_bytes(c, t, rows))
        .index_select(0, t.gather.to_expert_major);
  }
  return c.all_gather(rows.reshape({-1}), c.tp_group, c.tp_axes, label)
      .view({-1, width})
      .index_select(0, t.gather.to_expert_major);
}

double Model::nominal_gathered_bytes(const RankContext& c, const LayerTape& t,
                                     const at::Tensor& rows) const {
  return static_cast<double>(c.tp_group.size()) * routed_bytes(t, rows);
}

at::Tensor Model::return_gathered(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                                  const std::string& label, bool release) const {
  const TpGather& x = t.gather;
  const int64_t width = rows.size(1);
  const double bytes = nominal_gathered_bytes(c, t, rows);
  at::Tensor back = rows.index_select(0, x.back_send_order);
  // Rows read once go before the exchange's buffers are made.
  if (release) resize_storage(rows, 0);
  if (split_.ep > 1) {
    // The partial sums whole over ep first (the program converts axis by axis, ep before tp).
    back = c.all_to_all(back, x.back_send_rows, x.back_recv_rows, label, bytes);
    back = back.index_select(0, x.back_recv_order);
  }
  return c.reduce_scatter(back.reshape({-1}), c.tp_group, c.tp_axes, label).view({-1, width});
}

void Model::plan_folded(RankContext& c, LayerTape& t) const {
  const std::vector<RankContext::AxisGroup>& stages = c.ep_stages;
  const int64_t experts = spec_.experts, el = experts / split_.ep;
  const std::size_t n_stages = stages.size();
  // The place along stage k's axis of expert x's rank (its flat place x / el in the expert
  // group, whose ranks are in mesh order: the last axis fastest).
  auto owner = [&](int64_t x, std::size_t k) {
    int64_t stride = 1;
    for (std::size_t j = k + 1; j < n_stages; ++j)
      stride *= static_cast<int64_t>(stages[j].ranks.size());
    return (x / el / stride) % static_cast<int64_t>(stages[k].ranks.size());
  };
  FoldedExchange& f = t.folded;
  // Each copy's source: its rank's place along every axis, and its position among its copies.
  const int64_t n = t.routing.order.numel();
  std::vector<int64_t> source;
  source.reserve(static_cast<std::size_t>(n) * (n_stages + 1));
  for (int64_t r = 0; r < n; ++r) {
    for (const RankContext::AxisGroup& g : stages) source.push_back(g.index);
    source.push_back(r);
  }
  at::Tensor meta =
      at::tensor(source, at::kLong).view({n, static_cast<int64_t>(n_stages) + 1}).to(device_);
  std::vector<int64_t> counts = t.routing.counts;  // of the rows held, expert by expert
  for (std::size_t k = 0; k < n_stages; ++k) {
    const RankContext::AxisGroup& g = stages[k];
    const auto members = static_cast<int64_t>(g.ranks.size());
    FoldedExchange::Stage st;
    st.send_rows.assign(static_cast<std::size_t>(members), 0);
    for (int64_t x = 0; x < experts; ++x) {
      st.send_rows[static_cast<std::size_t>(owner(x, k))] += counts[static_cast<std::size_t>(x)];
    }
    std::vector<int64_t> mine;
    for (int64_t m = 0; m < members; ++m) mine.insert(mine.end(), counts.begin(), counts.end());
    const std::vector<int64_t> got = c.exchange_counts(g.ranks, mine, experts);
    // Received member by member, each member's rows of this rank's experts along the axis in
    // expert order; reordered expert by expert.
    st.recv_rows.assign(static_cast<std::size_t>(members), 0);
    std::vector<int64_t> first(static_cast<std::size_t>(members * experts), 0);
    int64_t row = 0;
    for (int64_t m = 0; m < members; ++m) {
      for (int64_t x = 0; x < experts; ++x) {
        if (owner(x, k) != g.index) continue;
        const auto mx = static_cast<std::size_t>(m * experts + x);
        first[mx] = row;
        row += got[mx];
        st.recv_rows[static_cast<std::size_t>(m)] += got[mx];
      }
    }
    std::vector<int64_t> order, next(static_cast<std::size_t>(experts), 0);
    order.reserve(static_cast<std::size_t>(row));
    for (int64_t x = 0; x < experts; ++x) {
      if (owner(x, k) != g.index) continue;
      for (int64_t m = 0; m < members; ++m) {
        const auto mx = static_cast<std::size_t>(m * experts + x);
        for (int64_t r = 0; r < got[mx]; ++r) order.push_back(first[mx] + r);
        next[static_cast<std::size_t>(x)] += got[mx];
      }
    }
    st.order = at::tensor(order, at::kLong).to(device_);
    meta = c.all_to_all_over(g.ranks, g.axis, meta, st.send_rows, st.recv_rows, "", 0,
                             /*record=*/false)
               .index_select(0, st.order);
    counts = next;
    f.to_experts.push_back(std::move(st));
  }
  const int64_t first_expert = split_.ep_index * el;
  f.local_counts.assign(counts.begin() + first_expert, counts.begin() + first_expert + el);
  // Back, axis by axis in the same order: each row to its source's place along the axis.
  for (std::size_t k = 0; k < n_stages; ++k) {
    const RankContext::AxisGroup& g = stages[k];
    FoldedExchange::Stage st;
    const at::Tensor dest = meta.select(1, static_cast<int64_t>(k)).contiguous();
    st.order = std::get<1>(at::sort(dest, /*stable=*/true, 0, false));
    const at::Tensor per = at::bincount(dest.cpu(), {}, static_cast<int64_t>(g.ranks.size()));
    st.send_rows.assign(per.data_ptr<int64_t>(), per.data_ptr<int64_t>() + per.numel());
    st.recv_rows = c.exchange_counts(g.ranks, st.send_rows, 1);
    meta = c.all_to_all_over(g.ranks, g.axis, meta.index_select(0, st.order), st.send_rows,
                             st.recv_rows, "", 0, /*record=*/false);
    f.back.push_back(std::move(st));
  }
  f.final_order = std::get<1>(at::sort(meta.select(1, static_cast<int64_t>(n_stages)).contiguous(),
                                       /*stable=*/true, 0, false));
}

at::Tensor Model::folded_to_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                                    const std::string& label) const {
  const double bytes = routed_bytes(t, rows);
  at::Tensor x = rows;
  for (std::size_t k = 0; k < c.ep_stages.size(); ++k) {
    const FoldedExchange::Stage& st = t.folded.to_experts[k];
    x = c.all_to_all_over(c.ep_stages[k].ranks, c.ep_stages[k].axis, x, st.send_rows, st.recv_rows,
                          label, bytes)
            .index_select(0, st.order);
  }
  return x;
}

at::Tensor Model::folded_back(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                              const std::string& label) const {
  const double bytes = routed_bytes(t, rows);
  at::Tensor x = rows;
  for (std::size_t k = 0; k < c.ep_stages.size(); ++k) {
    const FoldedExchange::Stage& st = t.folded.back[k];
    x = c.all_to_all_over(c.ep_stages[k].ranks, c.ep_stages[k].axis, x.index_select(0, st.order),
                          st.send_rows, st.recv_rows, label, bytes);
  }
  return x.index_select(0, t.folded.final_order);
}

at::Tensor Model::to_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                             const std::string& label) const {
  const ExpertExchange& x = t.exchange;
  const double bytes = routed_bytes(t, rows);
  return c.all_to_all(rows, x.send_rows, x.recv_rows, label, bytes)
      .index_select(0, x.to_expert_major);
}

at::Tensor Model::from_experts(RankContext& c, const LayerTape& t, const at::Tensor& rows,
                               const std::string& label) const {
  const ExpertExchange& x = t.exchange;
  const double bytes = routed_bytes(t, rows);
  return c.all_to_all(rows.index_select(0, x.to_source_major), x.recv_rows, x.send_rows, label,
                      bytes);
}

at::Tensor Model::moe_backward(RunStats& st, const LayerParams& L, LayerTape& t,
                               const at::Tensor& dy) {
  RankContext& c = *ctx_;
  const bool relu = spec_.mlp == MlpKind::kRelu;  // its backward reads its output
  const bool ep = split_.ep > 1, etp = split_.expert_ffn > 1, shared_tp = split_.shared_ffn > 1;
  const bool sp = split_.seq > 1, gathered = etp && sp;
  std::vector<at::Tensor> g = bwd(st, "moe.combine", t.combine, dy);
  release_output(t.efc2, false);
  if (ep || etp) resize_storage(t.returned, 0);
  release_output(t.router, false);
  release_output(t.sfc2, false);
  // Expert parallelism: the copies' gradients go to their experts' ranks, and the experts'
  // input gradients come back (the forward's exchanges reversed). Tensor-parallel experts
  // under sequence parallelism: the copies' and the shared expert's output gradients gathered
  // over tp (the program's conversions of the combine's inputs, reversed).
  const bool folded = ep && !c.ep_stages.empty();
  if (ep) {
    g[0] = folded ? folded_to_experts(c, t, g[0], "moe.combine")
                  : to_experts(c, t, g[0], "moe.combine");
  }
  if (gathered) g[0] = gather_copies(c, t, g[0], "moe.combine");
  if (L.sfc1_w && shared_tp && sp) g[2] = gather_seq(c, g[2], "moe.combine");
  const bool fc2_defers = defers_weights(t.efc2);
  at::Tensor d = bwd(st, "moe.fc2", t.efc2, g[0])[0];
  g[0] = at::Tensor();
  if (!relu) release_output(t.eact, fc2_defers);
  d = bwd(st, "moe.act", t.eact, d)[0];
  release_output(t.efc1, false);
  if (gathered && !t.efc1.in.empty()) {
    // The dropped gathered copies, gathered again (a recomputed fc1 has them).
    if (t.efc1.in[0].storage().nbytes() == 0) {
      const at::Tensor full =
          gather_copies(c, t, (ep ? t.exchanged : t.dispatch.out).detach(), "moe.fc1");
      resize_storage(t.efc1.in[0], full.nbytes());
      c10::NoGradGuard no_grad;
      t.efc1.in[0].variable_data().copy_(full);
    }
  }
  const bool fc1_defers = defers_weights(t.efc1);
  d = bwd(st, "moe.fc1", t.efc1, d)[0];
  // The dispatch's output is fc1's input unless the copies moved (exchanged or gathered).
  release_output(t.dispatch, fc1_defers && !ep && !gathered);
  // The exchanged copies: fc1's input, or under sequence parallelism what its gathers read.
  if (ep && (gathered || !fc1_defers)) resize_storage(t.exchanged, 0);
  if (gathered) {
    d = return_gathered(c, t, d, "moe.fc1", /*release=*/true);
  } else if (ep) {
    d = folded ? folded_back(c, t, d, "moe.fc1") : from_experts(c, t, d, "moe.fc1");
    if (etp) c.tp_all_reduce(d, "moe.fc1");
  } else if (etp) {
    c.tp_all_reduce(d, "moe.fc1");
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
    if (sp && !t.sfc1.in.empty() && t.sfc1.in[0].storage().nbytes() == 0) {
      regather(c, t.n2.out.detach(), t.sfc1, "moe.shared.fc1");
    }
    // Under sequence parallelism the shared expert reads its gathered copy of the norm's output.
    n2_read_later = n2_read_later || (!sp && defers_weights(t.sfc1));
    d = bwd(st, "moe.shared.fc1", t.sfc1, d)[0];
    if (sp && shared_tp) {
      d = scatter_seq(c, d, "moe.shared.fc1");
    } else if (shared_tp) {
      c.tp_all_reduce(d, "moe.shared.fc1");
    }
    dx = dx + d;
  }
  release_output(t.n2, n2_read_later);
  t.routing = MoeRouting{};
  t.exchange = ExpertExchange{};
  t.gather = TpGather{};
  t.folded = FoldedExchange{};
  t.exchanged = t.returned = t.shared_out = at::Tensor();
  return dx;
}

}  // namespace nnsim::hwexec
