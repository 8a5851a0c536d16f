// nnexec run: the socket collective backend (TCP), the plan checks, and whole plans (TP, PP, DP and
// all three) run as processes on this CPU whose loss and gradients must equal an unpartitioned
// run's; `--device cuda` refusing with the reason where it cannot run, and the same plans on
// GPUs where it can. Plans come from `nnsim plan` on a tiny model (tests/data/tiny-gpt.yaml).
// Tests that need LibTorch, a CUDA LibTorch or GPUs report Skipped without them.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/model.h"
#include "core/plan.h"
#include "hwexec/comm.h"
#include "hwexec/run.h"
#include "hwexec/run_layout.h"
#include "hwexec/run_model_ops.h"
#include "hwexec/run_spanning.h"
#include "nnexec_info.h"
#include "process.h"
#include "synthetic.h"

namespace nnsim::hwexec {
namespace {

using testing::nnexec_build;
using testing::nnexec_info;
using testing::TempDir;

using testing::contains;
using testing::run;
using testing::RunResult;
using testing::slurp;

const std::string kModel = std::string(NNSIM_TEST_DATA) + "/tiny-gpt.yaml";
// RMSNorm, GQA (2 key/value heads for 4), SwiGLU, rotary positions, no biases.
const std::string kLlama = std::string(NNSIM_TEST_DATA) + "/tiny-llama.yaml";
// tiny-llama with heads of head_dim 24, 96 wide together over a hidden size of 64 (Qwen3's kind).
const std::string kHeadDim = std::string(NNSIM_TEST_DATA) + "/tiny-head-dim.yaml";
// Per-head query and key norms (qk_norm): RMSNorm (tiny-llama's), LayerNorm (tiny-gpt's,
// without biases).
const std::string kQkNorm = std::string(NNSIM_TEST_DATA) + "/tiny-qk-norm.yaml";
const std::string kGptQkNorm = std::string(NNSIM_TEST_DATA) + "/tiny-gpt-qk-norm.yaml";
// A mixture of experts: a dense first block, then blocks of 4 experts (top-2) and a shared one.
const std::string kMoe = std::string(NNSIM_TEST_DATA) + "/tiny-moe.yaml";
const std::string kMoeGrouped = std::string(NNSIM_TEST_DATA) + "/tiny-moe-grouped.yaml";
// tiny-moe with biases (GeLU, LayerNorm, learned positions: tiny-gpt's blocks).
const std::string kMoeBias = std::string(NNSIM_TEST_DATA) + "/tiny-moe-bias.yaml";
// Multi-head latent attention: with the queries' latent, without it (LayerNorm and biases),
// and in a mixture of experts (DeepSeek-V2/V3's blocks).
const std::string kMla = std::string(NNSIM_TEST_DATA) + "/tiny-mla.yaml";
const std::string kMlaNoQLatent = std::string(NNSIM_TEST_DATA) + "/tiny-mla-no-q-latent.yaml";
const std::string kMlaMoe = std::string(NNSIM_TEST_DATA) + "/tiny-mla-moe.yaml";
// A GeGLU MLP (Gemma's).
const std::string kGeglu = std::string(NNSIM_TEST_DATA) + "/tiny-geglu.yaml";
// Gemma 3's block (tiny-gemma: norms after the attention and the MLP, post_norms, with query
// and key norms, GeGLU, tied embeddings and sliding windows), and post_norms' LayerNorms with
// shifts after biased projections, in a mixture of experts with a dense first block.
const std::string kGemma = std::string(NNSIM_TEST_DATA) + "/tiny-gemma.yaml";
const std::string kMoePostNorms = std::string(NNSIM_TEST_DATA) + "/tiny-moe-post-norms.yaml";
const std::string kGemma2 = std::string(NNSIM_TEST_DATA) + "/tiny-gemma2.yaml";  // no qk norms
// Sliding-window attention in every other layer (GPT-OSS's pattern).
const std::string kSlidingWindow = std::string(NNSIM_TEST_DATA) + "/tiny-sliding-window.yaml";
// ReLU MLP (OPT), and squared ReLU with rope and GQA (Nemotron).
const std::string kOpt = std::string(NNSIM_TEST_DATA) + "/tiny-opt.yaml";
const std::string kNemotron = std::string(NNSIM_TEST_DATA) + "/tiny-nemotron.yaml";
// ALiBi over 6 heads (MPT); tiny-gpt with dropout.
const std::string kMpt = std::string(NNSIM_TEST_DATA) + "/tiny-mpt.yaml";
const std::string kDropout = std::string(NNSIM_TEST_DATA) + "/tiny-gpt-dropout.yaml";
// tiny-gpt with tied embeddings: the head projects with the word embedding matrix.
const std::string kTied = std::string(NNSIM_TEST_DATA) + "/tiny-gpt-tied.yaml";
const std::string kTopo = std::string(NNSIM_TEST_DATA) + "/tiny-node2.yaml";
const std::string kTopo1 = std::string(NNSIM_TEST_DATA) + "/tiny-node1.yaml";

// `nnsim plan` for the tiny model on nodes of two ranks.
RunResult make_plan(const TempDir& dir, int tp, int pp, int dp, const std::string& schedule,
                    int global_batch, std::vector<std::string> extra = {},
                    const std::string& model = kModel, const std::string& precision = "fp32",
                    int cp = 1) {
  const int n = tp * pp * dp * cp;
  std::vector<std::string> args = {"plan",
                                   "--model",
                                   model,
                                   "--topo",
                                   n == 1 ? kTopo1 : kTopo,
                                   "--nodes",
                                   std::to_string(n / 2 > 0 ? n / 2 : 1),
                                   "--tp",
                                   std::to_string(tp),
                                   "--pp",
                                   std::to_string(pp),
                                   "--dp",
                                   std::to_string(dp),
                                   "--global-batch",
                                   std::to_string(global_batch),
                                   "--micro-batch",
                                   "1",
                                   "--precision",
                                   precision,
                                   "--schedule",
                                   schedule,
                                   "-o",
                                   "plan.json"};
  if (cp > 1) args.insert(args.end(), {"--cp", std::to_string(cp)});
  args.insert(args.end(), extra.begin(), extra.end());
  return run(dir, NNSIM_BINARY, args);
}

// ---------------------------------------------------------------- the collective backend

// Runs `body(comm)` in `world` forked processes connected over TCP on the loopback interface
// (rank 0 inherits the listening socket, as under `nnexec run --launch`); true when every one
// returns true.
template <class F>
bool in_processes(int world, F body) {
  Expected<Comm::Listener> l = Comm::listen("127.0.0.1", 0);
  if (!l) {
    ADD_FAILURE() << l.error().message();
    return false;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      Comm::Rendezvous at;
      at.host = "127.0.0.1";
      at.port = l->port;
      at.timeout_s = 30;
      if (r == 0) {
        at.listen_fd = l->fd;
      } else {
        ::close(l->fd);
      }
      auto c = Comm::connect(at, r, world, 30);
      bool ok = c.ok() && body(**c) && (*c)->flush().ok() && (*c)->barrier().ok();
      if (!c.ok()) std::fprintf(stderr, "rank %d: %s\n", r, c.error().message().c_str());
      ::_exit(ok ? 0 : 1);
    }
    pids.push_back(pid);
  }
  ::close(l->fd);
  bool ok = true;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

TEST(Comm, CollectivesOverGroupsAndPointToPoint) {
  EXPECT_TRUE(in_processes(4, [](Comm& c) {
    const int r = c.rank();
    // All-reduce over everyone, 10 elements (chunks of uneven size); and max.
    std::vector<float> v(10);
    for (int i = 0; i < 10; ++i) v[i] = static_cast<float>(r * 100 + i);
    if (!c.all_reduce({0, 1, 2, 3}, v.data(), v.size()).ok()) return false;
    for (int i = 0; i < 10; ++i) {
      if (v[i] != 600 + 4 * i) return false;
    }
    float m = static_cast<float>(r);
    if (!c.all_reduce({0, 1, 2, 3}, &m, 1, Comm::Op::kMax).ok() || m != 3) return false;
    // Groups {0, 2} and {1, 3}.
    const std::vector<int> g = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    std::vector<float> in = {float(r), float(r + 10)}, out(4);
    if (!c.all_gather(g, in.data(), 2, out.data()).ok()) return false;
    if (out != std::vector<float>{float(g[0]), float(g[0] + 10), float(g[1]), float(g[1] + 10)}) {
      return false;
    }
    // Reduce-scatter over everyone: member i gets the sum of chunk i (2 floats each).
    std::vector<float> rs(8), chunk(2);
    for (int i = 0; i < 8; ++i) rs[i] = static_cast<float>(i + r);
    if (!c.reduce_scatter({0, 1, 2, 3}, rs.data(), 2, chunk.data()).ok()) return false;
    if (chunk[0] != 4 * (2 * r) + 6 || chunk[1] != 4 * (2 * r + 1) + 6) return false;
    // Point to point, large enough to exceed the sockets' buffers, both ways at once.
    const int peer = r ^ 1;
    std::vector<float> big(1 << 20, float(r)), got(1 << 20);
    if (!c.send(peer, big.data(), big.size() * 4).ok()) return false;
    if (!c.recv(peer, got.data(), got.size() * 4).ok()) return false;
    return got.front() == float(peer) && got.back() == float(peer);
  }));
}

// The bit pattern of a float that bf16 represents exactly, and back.
uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(Comm, Bf16AllReduceSumsAndRoundsToNearestEven) {
  EXPECT_TRUE(in_processes(4, [](Comm& c) {
    const int r = c.rank();
    // Small integers: exact in bf16; 10 elements over 4 ranks (uneven chunks).
    std::vector<uint16_t> v(10);
    for (int i = 0; i < 10; ++i) v[i] = bf16_bits(static_cast<float>(r * 10 + i));
    if (!c.all_reduce_bf16({0, 1, 2, 3}, v.data(), v.size()).ok()) return false;
    for (int i = 0; i < 10; ++i) {
      if (bf16_value(v[i]) != 60 + 4 * i) return false;
    }
    uint16_t m = bf16_bits(static_cast<float>(-r));
    if (!c.all_reduce_bf16({0, 1, 2, 3}, &m, 1, Comm::Op::kMax).ok() || bf16_value(m) != 0) {
      return false;
    }
    // 256 + 1 = 257 lies halfway between bf16's 256 and 258: rounds to the even 256; 258 + 1
    // to 260 (also halfway; 260 is even).
    const std::vector<int> g = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    std::vector<uint16_t> h = {bf16_bits(r < 2 ? 256.0f : 1.0f), bf16_bits(r < 2 ? 258.0f : 1.0f)};
    if (!c.all_reduce_bf16(g, h.data(), h.size()).ok()) return false;
    if (bf16_value(h[0]) != 256 || bf16_value(h[1]) != 260) return false;
    // Reduce-scatter over everyone: member i gets chunk i's sum (2 elements each), rounded the
    // same way; all-gather puts member i's 2 elements at 2 i.
    std::vector<uint16_t> rs(8), mine(2), all(8);
    for (int i = 0; i < 8; ++i) rs[i] = bf16_bits(i == 0 && r == 0 ? 255.0f : float(i + r));
    if (!c.reduce_scatter_bf16({0, 1, 2, 3}, rs.data(), 2, mine.data()).ok()) return false;
    // Chunk 0's first element: 255 + 1 + 2 + 3 = 261 is not a bf16 (258 or 262 are): the ring
    // adds in bf16 steps, so the result is 260 or 262, never 261.
    const float first = bf16_value(mine[0]);
    if (r == 0 ? (first != 260 && first != 262) : first != float(4 * (2 * r) + 6)) return false;
    if (bf16_value(mine[1]) != float(4 * (2 * r + 1) + 6)) return false;
    const std::vector<uint16_t> in = {bf16_bits(float(r)), bf16_bits(float(r + 10))};
    if (!c.all_gather_bf16({0, 1, 2, 3}, in.data(), 2, all.data()).ok()) return false;
    for (int i = 0; i < 4; ++i) {
      const size_t at = 2 * static_cast<size_t>(i);
      if (bf16_value(all[at]) != i || bf16_value(all[at + 1]) != i + 10) return false;
    }
    return true;
  }));
}

// IEEE fp16 (the bit patterns): each ring step adds in fp32 and rounds to fp16, to nearest
// even, overflowing to infinity; subnormals add exactly.
TEST(Comm, Fp16AllReduceSumsRoundsAndOverflows) {
  EXPECT_TRUE(in_processes(2, [](Comm& c) {
    const int r = c.rank();
    const auto f16 = Comm::Float16::kFp16;
    // 2048 + 1 is halfway between fp16's 2048 and 2050: the even 2048; 2050 + 1 goes to 2052;
    // 60000 + 60000 overflows; 2^-24 + 2^-24 = 2^-23.
    std::vector<uint16_t> v = {uint16_t(r == 0 ? 0x6800 : 0x3c00),
                               uint16_t(r == 0 ? 0x6801 : 0x3c00), 0x7b53, 0x0001};
    if (!c.all_reduce_bf16({0, 1}, v.data(), v.size(), Comm::Op::kSum, f16).ok()) return false;
    if (v != std::vector<uint16_t>{0x6800, 0x6802, 0x7c00, 0x0002}) return false;
    // Reduce-scatter: member i gets the sum of chunk i (1 + 1, 2 + 2).
    const std::vector<uint16_t> rs = {0x3c00, 0x4000};
    uint16_t mine = 0;
    if (!c.reduce_scatter_bf16({0, 1}, rs.data(), 1, &mine, f16).ok()) return false;
    return mine == (r == 0 ? 0x4000 : 0x4400);
  }));
}

TEST(Comm, MismatchedMessageSizesFailLoudly) {
  EXPECT_FALSE(in_processes(2, [](Comm& c) {
    std::vector<float> v(c.rank() == 0 ? 4 : 8, 1.0f);
    return c.all_reduce({0, 1}, v.data(), v.size()).ok();
  }));
}

// Channels: point-to-point messages on channel 1 keep their own order, and a receive on one
// channel keeps what arrives first on another (a pipeline transfer queued before an all-reduce
// of the same two ranks, as a segment spanning the pipeline stages has them).
TEST(Comm, ChannelsKeepTheirOwnOrder) {
  EXPECT_TRUE(in_processes(2, [](Comm& c) {
    const int peer = c.rank() ^ 1;
    std::vector<float> v = {float(c.rank() + 1)};
    if (c.rank() == 0) {
      const float a = 7, b = 8;
      if (!c.send(peer, &a, 4, 1).ok() || !c.send(peer, &b, 4, 1).ok()) return false;
      if (!c.all_reduce({0, 1}, v.data(), 1).ok()) return false;
      return v[0] == 3;
    }
    if (!c.all_reduce({0, 1}, v.data(), 1).ok() || v[0] != 3) return false;
    float a = 0, b = 0;
    if (!c.recv(peer, &a, 4, 1).ok() || !c.recv(peer, &b, 4, 1).ok()) return false;
    return a == 7 && b == 8 && !c.recv(peer, &a, 4, Comm::kChannels).ok();
  }));
}

// ---------------------------------------------------------------- plans

struct Case {
  const char* name;
  int tp, pp, dp;
  const char* schedule;
  int global_batch;
  const std::string* model = &kModel;
  const char* precision = "fp32";
  std::vector<std::string> plan_flags = {};  // more `nnsim plan` options
  int cp = 1;                                // context-parallel degree
  // The plan's recompute rules without their layers (so they recompute the embedding and the
  // head too; `nnsim plan` always writes layers).
  bool unranged_recompute = false;
  // Forward passes per micro-batch written into the plan (training.recycle) where `nnsim plan`
  // refuses --recycle (with --shard-head): see with_passes.
  int hand_recycle = 1;
  // The plan's split backwards made whole, as a hand-built order would have them: each BI block
  // a B, its BW dropped (see whole_backwards).
  bool whole_backwards = false;
  // The plan's selective recompute rule (attn.core) made to recompute these operators instead.
  const char* recompute_match = nullptr;
};

// A plan whose BI blocks are B blocks and whose BW blocks are gone: the same order of whole
// backwards (a BI's place is after its micro-batch's gradient arrives, as a B's is).
std::string whole_backwards(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text);
  for (auto& o : j["schedule"]["orders"]) {
    std::string b =
        std::regex_replace(o["blocks"].get<std::string>(), std::regex(R"( ?BW\d+@\d+)"), "");
    b = std::regex_replace(b, std::regex(R"(BI(\d+@\d+))"), "B$1");
    o["blocks"] = std::regex_replace(b, std::regex("^ "), "");
  }
  return j.dump(1);
}

// A plan with `passes` forward passes per micro-batch (docs/plan.md "Repeated forwards"): each
// order runs a micro-batch's forward blocks pass after pass, then its other blocks, micro-batch
// after micro-batch in the order's own sequence.
std::string with_passes(const std::string& text, int passes) {
  nlohmann::json j = nlohmann::json::parse(text);
  j["training"]["recycle"] = passes;
  const std::regex block(R"(([A-Z]+)(\d+)@\d+)");
  for (auto& o : j["schedule"]["orders"]) {
    std::istringstream in(o["blocks"].get<std::string>());
    std::vector<int> seen;
    std::map<int, std::vector<std::string>> forwards, others;
    for (std::string b; in >> b;) {
      std::smatch mt;
      EXPECT_TRUE(std::regex_match(b, mt, block)) << b;
      const int m = std::stoi(mt[2]);
      if (std::find(seen.begin(), seen.end(), m) == seen.end()) seen.push_back(m);
      (mt[1] == "F" ? forwards : others)[m].push_back(b);
    }
    std::string out;
    for (int m : seen) {
      for (int pass = 0; pass < passes; ++pass) {
        for (const std::string& f : forwards[m]) {
          out += (out.empty() ? "" : " ") + f + (pass ? fmt::format("#{}", pass) : "");
        }
      }
      for (const std::string& b : others[m]) out += " " + b;
    }
    o["blocks"] = out;
  }
  return j.dump(1);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

// plan.json with `from` (a regular expression, which must match) replaced by `to`.
void edit_plan(const TempDir& dir, const std::string& from, const std::string& to) {
  const std::string text = slurp(dir.file("plan.json"));
  const std::string edited = std::regex_replace(text, std::regex(from), to);
  ASSERT_NE(edited, text) << from;
  std::ofstream(dir.file("plan.json")) << edited;
}

// A mixture of experts (tiny-moe) in fp32 under `schedule`, tp 1, with `nnsim plan` options.
Case moe_case(const char* name, int pp, int dp, const char* schedule, int global_batch,
              std::vector<std::string> flags) {
  return Case{name, 1, pp, dp, schedule, global_batch, &kMoe, "fp32", std::move(flags)};
}

// A mixture (tiny-moe) in fp32 under 1F1B, two micro-batches a replica, recomputing the
// operators `match` names in every layer.
Case recompute_only(const char* name, int tp, int dp, std::vector<std::string> flags,
                    const char* match) {
  flags.insert(flags.end(), {"--recompute", "selective"});
  Case c{name, tp, 1, dp, "1f1b", 2 * dp, &kMoe, "fp32", std::move(flags)};
  c.recompute_match = match;
  return c;
}

// A 1F1B case with more `nnsim plan` options.
Case with(const char* name, int tp, int pp, int dp, int global_batch,
          std::vector<std::string> flags, const std::string* model = &kModel,
          const char* precision = "fp32") {
  return Case{name, tp, pp, dp, "1f1b", global_batch, model, precision, std::move(flags)};
}

// An interleaved pipeline of two model chunks per stage.
Case interleaved(const char* name, int tp, int pp, int dp, int global_batch,
                 std::vector<std::string> flags = {}, const std::string* model = &kModel) {
  flags.insert(flags.begin(), {"--vpp", "2"});
  return Case{name, tp, pp, dp, "interleaved", global_batch, model, "fp32", std::move(flags)};
}

// Tied embeddings (tiny-gpt-tied) on ZB-V's V-shaped placement of two chunks per stage.
Case vshape(const char* name, int dp, int global_batch, std::vector<std::string> flags,
            const char* precision = "fp32", bool whole = false) {
  flags.insert(flags.begin(), {"--vpp", "2"});
  Case c{name, 1, 2, dp, "zb-v", global_batch, &kTied, precision, std::move(flags)};
  c.whole_backwards = whole;
  return c;
}

class NnexecRun : public ::testing::TestWithParam<Case> {};

TEST_P(NnexecRun, MatchesTheUnpartitionedLossAndGradients) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const Case c = GetParam();
  TempDir dir;
  RunResult p = make_plan(dir, c.tp, c.pp, c.dp, c.schedule, c.global_batch, c.plan_flags, *c.model,
                          c.precision, c.cp);
  ASSERT_EQ(p.status, 0) << p;
  if (c.unranged_recompute) {
    ASSERT_NO_FATAL_FAILURE(
        edit_plan(dir, R"((\{"match": "[^"]*"), "layers": \[\d+, \d+\]\})", "$1}"));
  }
  if (c.recompute_match) {
    ASSERT_NO_FATAL_FAILURE(
        edit_plan(dir, R"("match": "attn.core", "layers")",
                  fmt::format(R"("match": "{}", "layers")", c.recompute_match)));
  }
  if (c.hand_recycle > 1) {
    const std::string edited = with_passes(slurp(dir.file("plan.json")), c.hand_recycle);
    std::ofstream(dir.file("plan.json")) << edited;
  }
  if (c.whole_backwards) {
    const std::string text = slurp(dir.file("plan.json"));
    const std::string edited = whole_backwards(text);
    ASSERT_EQ(edited.find("BW"), std::string::npos) << edited;
    std::ofstream(dir.file("plan.json")) << edited;
  }
  const int n = c.tp * c.pp * c.dp * c.cp;
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--launch", std::to_string(n), "--out", "run.h5",
                     "--iterations", "2", "--warmup", "1", "--check"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "check           passed")) << r;
  EXPECT_TRUE(contains(r.out, "iteration time")) << r;
  Expected<RunResults> file = read_run(dir.file("run.h5"));
  ASSERT_TRUE(file.ok()) << file.error().message();
  EXPECT_EQ(file->dtype, c.precision);
  EXPECT_TRUE(file->check_passed());
  const auto flag = [&](const char* f) {
    return std::find(c.plan_flags.begin(), c.plan_flags.end(), f) != c.plan_flags.end();
  };
  if (c.tp == 1 && c.dp == 1 && c.cp == 1) {
    // Without replicas, the ranks' parameters are the model's as the simulator counts them
    // (the operator graph's shapes: GQA's narrower qkv, SwiGLU's two fc1 branches, no biases,
    // no position table with rope), the plan's (--shard-head and --shard-embedding pad the
    // vocabulary); a segment spanning the pipeline stages holds its unsplit parameters on
    // every stage (the head's norm, the position table).
    Expected<Plan> plan = load_plan(dir.file("plan.json"));
    ASSERT_TRUE(plan.ok()) << plan.error().message();
    const ModelSpec& m = plan->model;
    double copies = 0;
    if (flag("--shard-head")) copies += m.hidden * (m.bias ? 2 : 1);
    if (flag("--shard-embedding") && m.position == PositionKind::kLearned) {
      copies += static_cast<double>(m.seq_len) * m.hidden;
    }
    // A tied head on another stage than the embedding holds a copy of the word matrix
    // (Megatron's, whose gradient joins the embedding's); V-shaped placements put the head on
    // the embedding's rank, which projects with the matrix itself.
    const std::string schedule = c.schedule;
    const bool v_shaped = schedule == "zb-v" || schedule == "dualpipev";
    const double tied_copy =
        m.tied_embeddings && c.pp > 1 && !v_shaped ? static_cast<double>(m.vocab) * m.hidden : 0;
    double held = 0;
    for (const RankResult& k : file->ranks) held += k.parameters;
    EXPECT_EQ(held, static_cast<double>(m.parameters()) + (c.pp - 1) * copies + tied_copy);
  }
  // The worst shard's error relative to its reference: fp32 runs agree to rounding; bf16 runs
  // must show bf16's rounding (they really computed in bf16) and stay within its tolerance.
  double worst = 0;
  for (const RankResult& k : file->ranks) {
    for (const ParamCheck& pc : k.checks) {
      worst = std::max(worst, pc.max_abs_error / std::max(pc.ref_max_abs, 1e-30));
    }
  }
  if (std::string(c.precision) == "bf16") {
    EXPECT_EQ(file->options.rtol, kBf16CheckRtol);
    EXPECT_GT(worst, 1e-3) << "a bf16 run as accurate as fp32";
    EXPECT_LT(worst, kBf16CheckRtol);
  } else if (std::string(c.precision) == "fp8") {
    // fp8's 3- and 2-bit significands: far coarser than bf16's, yet within kFp8CheckRtol.
    EXPECT_EQ(file->options.rtol, kFp8CheckRtol);
    EXPECT_GT(worst, kBf16CheckRtol / 4) << "an fp8 run as accurate as bf16";
    EXPECT_LT(worst, kFp8CheckRtol);
  } else if (std::string(c.precision) == "fp16") {
    // fp16's 11-bit significand: errors well above fp32's, well below bf16's.
    EXPECT_EQ(file->options.rtol, kFp16CheckRtol);
    EXPECT_GT(worst, 1e-4) << "an fp16 run as accurate as fp32";
    EXPECT_LT(worst, kFp16CheckRtol);
  } else {
    EXPECT_LT(worst, 1e-4);
  }
  std::printf("%s: worst relative gradient error %.3g\n", c.name, worst);
  const bool split_backward =
      (std::string(c.schedule).rfind("zb-", 0) == 0 || std::string(c.schedule) == "tessel") &&
      !c.whole_backwards;

  // Every collective and pipeline transfer of the run (per kind, axes and label) is the
  // compiled program's, call for call and byte for byte, and so are the recomputed operators
  // and the split backwards' halves.
  RunResult cmp = run(dir, NNSIM_BINARY,
                      {"compare", "run.h5", "--topo", n == 1 ? kTopo1 : kTopo, "--nodes",
                       std::to_string(n / 2 > 0 ? n / 2 : 1), "--json", "c.json"});
  ASSERT_EQ(cmp.status, 0) << cmp;
  const nlohmann::json j = nlohmann::json::parse(slurp(dir.file("c.json")));
  for (const nlohmann::json& t : j["collectives"]) {
    EXPECT_DOUBLE_EQ(t["measured_calls"].get<double>(), t["simulated_calls"].get<double>())
        << t.dump(1);
    EXPECT_DOUBLE_EQ(t["measured_bytes"].get<double>(), t["simulated_bytes"].get<double>())
        << t.dump(1);
    // Priced by the simulator, pipeline transfers of interleaved, V-shaped and spanning
    // placements too (between the ranks the program moves them).
    EXPECT_FALSE(t["simulated_s"].is_null()) << t.dump(1);
  }
  int halves = 0;
  for (const nlohmann::json& o : j["operators"]) {
    const std::string phase = o["phase"];
    if (phase == "bwd_input" || phase == "bwd_weight") ++halves;
    if (phase != "recompute" && phase != "bwd_input" && phase != "bwd_weight") continue;
    EXPECT_DOUBLE_EQ(o["measured_calls"].get<double>(), o["simulated_calls"].get<double>())
        << o["name"] << "\n"
        << o.dump(1);
  }
  if (n > 1) {
    EXPECT_FALSE(j["collectives"].empty()) << c.name;
  }
  // A zero-bubble schedule's BI and BW blocks are timed as phases of their own.
  if (split_backward) {
    EXPECT_GT(halves, 0) << "no bwd_input or bwd_weight operators";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, NnexecRun,
    ::testing::Values(
        Case{"tp2", 2, 1, 1, "1f1b", 2}, Case{"pp2_1f1b", 1, 2, 1, "1f1b", 4},
        Case{"pp2_gpipe", 1, 2, 1, "gpipe", 4}, Case{"dp2", 1, 1, 2, "1f1b", 4},
        Case{"tp2_pp2_dp2", 2, 2, 2, "1f1b", 8}, Case{"llama_tp2", 2, 1, 1, "1f1b", 2, &kLlama},
        // Latent attention: the heads' up-projections split, the latents' gradients summed
        // over tp (with the rotary key part's); under sequence parallelism the down-projections
        // and latent norms on the rank's slice, the latents gathered for the up-projections.
        // Unsplit on two stages, the ranks hold the simulator's parameter count.
        Case{"mla_pp2", 1, 2, 1, "1f1b", 4, &kMla}, Case{"mla_tp2", 2, 1, 1, "1f1b", 2, &kMla},
        with("mla_tp2_sp_pp2_dp2_zero1", 2, 2, 2, 8, {"--sequence-parallel", "--zero", "1"}, &kMla),
        with("mla_no_q_latent_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kMlaNoQLatent),
        with("mla_recompute_selective_tp2_sp", 2, 1, 1, 2,
             {"--sequence-parallel", "--recompute", "selective"}, &kMla),
        with("mla_recompute_full_zero3_tp2_dp2", 2, 1, 2, 4, {"--recompute", "full", "--zero", "3"},
             &kMla),
        Case{"mla_no_q_latent_zb_h1_tp2_pp2",
             2,
             2,
             1,
             "zb-h1",
             8,
             &kMlaNoQLatent,
             "fp32",
             {"--sequence-parallel"}},
        with("bf16_mla_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kMla, "bf16"),
        with("mla_moe_ep2_tp2_sp", 2, 1, 2, 4, {"--sequence-parallel", "--ep", "2"}, &kMlaMoe),
        // Sliding windows in every other layer, the mask by the layer's global index.
        with("sliding_window_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kSlidingWindow),
        Case{"sliding_window_pp2", 1, 2, 1, "1f1b", 4, &kSlidingWindow},
        // Post-norms take the row-parallel sums (all-reduced, or reduce-scattered under
        // sequence parallelism, labelled with the norm), their scales' gradients summed over tp
        // with the other norms'; unsplit on two stages, the simulator's parameter count.
        with("gemma_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kGemma),
        Case{"gemma_tp2_pp2", 2, 2, 1, "1f1b", 4, &kGemma},
        Case{"gemma_pp2", 1, 2, 1, "1f1b", 4, &kGemma},
        with("bf16_gemma2_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kGemma2, "bf16"),
        Case{"bf16_gemma2_pp2", 1, 2, 1, "1f1b", 4, &kGemma2, "bf16"},
        with("gemma_recompute_full_zero3_tp2_dp2", 2, 1, 2, 4,
             {"--recompute", "full", "--zero", "3"}, &kGemma),
        with("gemma_recompute_selective_tp2_sp", 2, 1, 1, 2,
             {"--sequence-parallel", "--recompute", "selective"}, &kGemma),
        // PyTorch's early stop ends at the MLP's post-norm, the last operator saving a tensor.
        with("gemma_fsdp_recompute_full_early_stop_zero3_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "fsdp", "--recompute", "full"}, &kGemma),
        with("moe_post_norms_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kMoePostNorms),
        with("moe_post_norms_ep2_dp2_recompute_full", 1, 1, 2, 4,
             {"--ep", "2", "--recompute", "full"}, &kMoePostNorms),
        // ... whose early stop ends at the post-norm after the combine, not at the combine.
        with("moe_post_norms_fsdp_recompute_full_early_stop_dp2", 1, 1, 2, 4,
             {"--framework", "fsdp", "--recompute", "full"}, &kMoePostNorms),
        // GeGLU's two branches split alike over tp, as SwiGLU's.
        Case{"geglu_tp2_pp2", 2, 2, 1, "1f1b", 4, &kGeglu},
        Case{"llama_pp2", 1, 2, 1, "1f1b", 4, &kLlama},
        Case{"llama_tp2_pp2", 2, 2, 1, "1f1b", 4, &kLlama},
        Case{"head_dim_tp2_pp2", 2, 2, 1, "1f1b", 4, &kHeadDim},
        // The norms' scales summed over tp (with sequence parallelism's, in one all-reduce).
        Case{"qk_norm_tp2_pp2", 2, 2, 1, "1f1b", 4, &kQkNorm},
        // Recomputed whole, and only the attention (the norms' output kept for it).
        with("qk_norm_recompute_full_tp2", 2, 1, 1, 2, {"--recompute", "full"}, &kQkNorm),
        with("qk_norm_recompute_selective_tp2", 2, 1, 1, 2, {"--recompute", "selective"}, &kQkNorm),
        with("qk_norm_layernorm_tp2_sp_zero1_dp2", 2, 1, 2, 4,
             {"--sequence-parallel", "--zero", "1"}, &kGptQkNorm),
        Case{"bf16_tp2", 2, 1, 1, "1f1b", 2, &kModel, "bf16"},
        Case{"bf16_llama_tp2_pp2", 2, 2, 1, "1f1b", 4, &kLlama, "bf16"},
        // Tied embeddings in one segment: ZeRO-1's gather and reduction count the matrix once.
        with("tied_zero1_dp2", 1, 1, 2, 4, {"--zero", "1"}, &kTied),
        // Tied embeddings on two stages: the head's copy, its gradient summed with the
        // embedding's ("tied embedding grad sync" over the explicit first/last-stage pairs).
        with("tied_tp2_pp2_dp2", 2, 2, 2, 8, {}, &kTied),
        interleaved("tied_zero1_interleaved_pp2_dp2", 1, 2, 2, 8, {"--zero", "1"}, &kTied),
        // Under ZeRO 2-3 the copies' reduced chunks (the matrix chunked alike on both stages),
        // summed once the last micro-batch is reduced.
        with("tied_zero2_pp2_dp2", 1, 2, 2, 8, {"--zero", "2"}, &kTied),
        with("tied_zero3_pp2_dp2", 1, 2, 2, 8, {"--zero", "3"}, &kTied),
        with("bf16_tied_zero2_pp2_dp2", 1, 2, 2, 8, {"--zero", "2"}, &kTied, "bf16"),
        with("tied_zero3_tp2_pp2_dp2", 2, 2, 2, 8, {"--zero", "3"}, &kTied),
        // DeepSpeed's tensor by tensor (the copy a unit of its own) and FSDP's kept gathered
        // (reduced once, in the last micro-batch).
        with("tied_deepspeed_zero3_per_tensor_pp2_dp2", 1, 2, 2, 8,
             {"--zero", "3", "--framework", "deepspeed"}, &kTied),
        with("tied_fsdp_zero3_pp2_dp2", 1, 2, 2, 8, {"--zero", "3", "--framework", "fsdp"}, &kTied),
        with("zero2_tp2_dp2", 2, 1, 2, 4, {"--zero", "2"}),
        // Tied embeddings in one segment: the matrix gathered once per pass with the embedding's
        // unit (FSDP's unit holding both) and reduced once.
        with("tied_zero3_dp2", 1, 1, 2, 4, {"--zero", "3"}, &kTied),
        with("zero3_pp2_dp2", 1, 2, 2, 8, {"--zero", "3"}, &kLlama),
        with("bf16_zero1_dp2", 1, 1, 2, 4, {"--zero", "1"}, &kModel, "bf16"),
        with("bf16_zero3_dp2", 1, 1, 2, 4, {"--zero", "3"}, &kModel, "bf16"),
        with("bf16_llama_zero3_pp2_dp2", 1, 2, 2, 8, {"--zero", "3"}, &kLlama, "bf16"),
        // 16-bit gradients (optimizer.grad_bytes 2): reduce-scattered in bf16.
        with("bf16_zero3_bf16_grads_dp2", 1, 1, 2, 4, {"--zero", "3", "--framework", "other"},
             &kModel, "bf16"),
        with("sp_tp2", 2, 1, 1, 2, {"--sequence-parallel"}),
        with("tp2_sp_pp2", 2, 2, 1, 4, {"--sequence-parallel"}),
        with("llama_sp_tp2", 2, 1, 1, 2, {"--sequence-parallel"}, &kLlama),
        // PyTorch's tensor parallelism (FSDP plans): the gathered input saved, not regathered.
        with("fsdp_llama_sp_tp2_dp2", 2, 1, 2, 4, {"--sequence-parallel", "--framework", "fsdp"},
             &kLlama),
        with("recompute_full_pp2", 1, 2, 1, 4, {"--recompute", "full"}),
        with("recompute_selective_tp2", 2, 1, 1, 2, {"--recompute", "selective"}),
        with("sp_recompute_full_tp2", 2, 1, 1, 2, {"--sequence-parallel", "--recompute", "full"}),
        with("zero3_recompute_full_dp2", 1, 1, 2, 4, {"--zero", "3", "--recompute", "full"}),
        with("sp_zero1_tp2_dp2", 2, 1, 2, 4, {"--sequence-parallel", "--zero", "1"}),
        with("sp_zero3_tp2_dp2", 2, 1, 2, 4, {"--sequence-parallel", "--zero", "3"}),
        // RMSNorm's few weights: one replica's chunks hold none of them, and it still takes part
        // in norm grad sync (with nothing), as every rank of the program does.
        with("llama_sp_zero3_tp2_dp2", 2, 1, 2, 4, {"--sequence-parallel", "--zero", "3"}, &kLlama),
        with("bf16_llama_sp_tp2_pp2", 2, 2, 1, 4, {"--sequence-parallel"}, &kLlama, "bf16"),
        Case{"recompute_full_merak_pp2",
             1,
             2,
             1,
             "merak",
             4,
             &kModel,
             "fp32",
             {"--recompute", "full"}},
        Case{"sp_recompute_selective_merak_tp2_pp2",
             2,
             2,
             1,
             "merak",
             4,
             &kModel,
             "fp32",
             {"--sequence-parallel", "--recompute", "selective"}},
        interleaved("interleaved_pp2", 1, 2, 1, 4),
        interleaved("interleaved_zero3_pp2_dp2", 1, 2, 2, 8, {"--zero", "3"}),
        interleaved("llama_interleaved_tp2_sp_pp2", 2, 2, 1, 4,
                    {"--sequence-parallel", "--recompute", "selective"}, &kLlama),
        // Zero-bubble split backwards (BI, BW blocks).
        Case{"zb_h1_pp2", 1, 2, 1, "zb-h1", 4},
        Case{"zb_v_pp2", 1, 2, 1, "zb-v", 4, &kModel, "fp32", {"--vpp", "2"}},
        // ZB-V with tensor parallelism: the last stage's turn (its two chunks back to back)
        // hands the activation and the gradient over in memory, whole: no scatter-gather.
        Case{"zb_v_tp2_pp2", 2, 2, 1, "zb-v", 4, &kModel, "fp32", {"--vpp", "2"}},
        Case{"tied_zb_v_tp2_pp2", 2, 2, 1, "zb-v", 4, &kTied, "fp32", {"--vpp", "2"}},
        Case{"zb_h1_llama_tp2_sp_pp2",
             2,
             2,
             1,
             "zb-h1",
             4,
             &kLlama,
             "fp32",
             {"--sequence-parallel", "--recompute", "selective"}},
        Case{"zb_h1_zero1_pp2_dp2", 1, 2, 2, "zb-h1", 8, &kModel, "fp32", {"--zero", "1"}},
        Case{"zb_h2_zero2_pp2_dp2", 1, 2, 2, "zb-h2", 8, &kModel, "fp32", {"--zero", "2"}},
        Case{"zb_h1_cp2_pp2", 1, 2, 1, "zb-h1", 4, &kModel, "fp32", {}, 2},
        // ZeRO-3 with split backwards: BI and BW each gather every unit, BW reduce-scatters.
        Case{"zb_h1_zero3_pp2_dp2", 1, 2, 2, "zb-h1", 8, &kModel, "fp32", {"--zero", "3"}},
        Case{"bf16_zb_v_zero3_pp2_dp2",
             1,
             2,
             2,
             "zb-v",
             8,
             &kLlama,
             "bf16",
             {"--zero", "3", "--vpp", "2"}},
        // Tied embeddings on a V-shaped placement (ZB-V): the first stage's head, in a segment
        // of its own, projects with its embedding's matrix (one parameter, no tied sync), whose
        // gradient ZeRO reduces once with the embedding's unit; ZeRO-3 gathers it again for the
        // head's unit (with it under FSDP's whole units, on its own under DeepSpeed's hooks).
        vshape("tied_zb_v_pp2", 1, 4, {}), vshape("tied_zb_v_pp2_dp2", 2, 8, {}),
        vshape("tied_zb_v_zero1_pp2_dp2", 2, 8, {"--zero", "1"}),
        vshape("tied_zb_v_zero2_pp2_dp2", 2, 8, {"--zero", "2"}),
        vshape("tied_zb_v_zero3_pp2_dp2", 2, 8, {"--zero", "3"}),
        vshape("tied_zb_v_deepspeed_zero3_pp2_dp2", 2, 8,
               {"--zero", "3", "--framework", "deepspeed"}),
        // ... every tensor gathered, one tensor ahead: the head's gathers of the tied matrix.
        vshape("tied_zb_v_deepspeed_zero3_prefetch_one_pp2_dp2", 2, 8,
               {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0",
                "--zero3-prefetch-elements", "1"}),
        vshape("tied_zb_v_fsdp_zero3_pp2_dp2", 2, 8, {"--zero", "3", "--framework", "fsdp"}),
        vshape("bf16_tied_zb_v_zero2_pp2_dp2", 2, 8, {"--zero", "2"}, "bf16"),
        // ... and with whole backwards (B blocks), as a hand-built V-shaped order has them.
        vshape("tied_v_whole_backwards_zero3_pp2_dp2", 2, 8, {"--zero", "3"}, "fp32", true),
        vshape("tied_v_whole_backwards_zero1_pp2_dp2", 2, 8, {"--zero", "1"}, "fp32", true),
        // DeepSpeed's ZeRO-3 (comm.zero3_per_tensor): each tensor gathered and reduced on its
        // own (LayerNorm's scale and shift are two); a tied matrix gathered again by the head's
        // hooks, reduced once. Without a persistence threshold: every tensor gathered (these
        // models' are all under DeepSpeed's 1e5 elements).
        with("tied_deepspeed_zero3_per_tensor_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0"},
             &kTied),
        // ... and its second gather of a layer recomputed inside the backward (B, or BI): the
        // whole layer under full recomputation; under selective, none (attention's core, the
        // operator recomputed, holds no weights).
        with("deepspeed_zero3_recompute_full_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "deepspeed", "--recompute", "full",
              "--zero3-persistence-threshold", "0"}),
        // ... gathering ahead only the next tensor (one element's prefetch): each operator's own
        // tensors and one more.
        with("deepspeed_zero3_prefetch_one_recompute_full_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "deepspeed", "--recompute", "full",
              "--zero3-persistence-threshold", "0", "--zero3-prefetch-elements", "1"}),
        Case{"zb_h1_deepspeed_zero3_recompute_selective_pp2_dp2",
             1,
             2,
             2,
             "zb-h1",
             8,
             &kModel,
             "fp32",
             {"--zero", "3", "--framework", "deepspeed", "--recompute", "selective",
              "--zero3-persistence-threshold", "0"}},
        // ... and a tensor's prefetch in BI and BW blocks, whose norms' weights the BW does not
        // read (gathered all the same, as the program's block).
        Case{"zb_h1_deepspeed_zero3_prefetch_one_pp2_dp2",
             1,
             2,
             2,
             "zb-h1",
             8,
             &kModel,
             "fp32",
             {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0",
              "--zero3-prefetch-elements", "1"}},
        // FSDP under a pipeline (optimizer.keep_gathered): each unit gathered in its segment's
        // first forward, its gradients reduce-scattered after the last micro-batch's B or BW.
        with("fsdp_zero3_keep_gathered_pp2_dp2", 1, 2, 2, 8,
             {"--zero", "3", "--framework", "fsdp"}),
        Case{"bf16_fsdp_zb_h2_zero3_keep_gathered_pp2_dp2",
             1,
             2,
             2,
             "zb-h2",
             8,
             &kLlama,
             "bf16",
             {"--zero", "3", "--framework", "fsdp"}},
        // Context parallelism (the sequence over cp: the keys and values all-gathered, the
        // backward's ring recorded as the program's all-gather).
        Case{"cp2", 1, 1, 1, "1f1b", 2, &kModel, "fp32", {}, 2},
        Case{"cp2_tp2", 2, 1, 1, "1f1b", 2, &kModel, "fp32", {}, 2},
        Case{"cp2_dp2", 1, 1, 2, "1f1b", 4, &kModel, "fp32", {}, 2},
        Case{"llama_cp2_tp2", 2, 1, 1, "1f1b", 2, &kLlama, "fp32", {}, 2},
        Case{"cp2_pp2_recompute",
             1,
             2,
             1,
             "1f1b",
             4,
             &kModel,
             "fp32",
             {"--recompute", "selective"},
             2},
        Case{"zero1_cp2_dp2", 1, 1, 2, "1f1b", 4, &kModel, "fp32", {"--zero", "1"}, 2},
        Case{"zero3_cp2", 1, 1, 1, "1f1b", 2, &kModel, "fp32", {"--zero", "3"}, 2},
        Case{"bf16_llama_cp2_tp2", 2, 1, 1, "1f1b", 2, &kLlama, "bf16", {}, 2},
        // Per-head query and key norms under context parallelism: each rank normalizes its
        // tokens' queries and keys before the key and value exchange; the scales' gradients
        // sum over cp (and tp) with the rest.
        Case{"qk_norm_cp2", 1, 1, 1, "1f1b", 2, &kQkNorm, "fp32", {}, 2},
        // Sliding windows (8 of 32 tokens) over the gathered keys at their global positions:
        // across two ranks' chunks of 8, and four's of 4; Gemma's block with tp.
        Case{"sliding_window_cp2", 1, 1, 1, "1f1b", 2, &kSlidingWindow, "fp32", {}, 2},
        Case{"sliding_window_cp4", 1, 1, 1, "1f1b", 2, &kSlidingWindow, "fp32", {}, 4},
        Case{"gemma_cp2_tp2", 2, 1, 1, "1f1b", 2, &kGemma, "fp32", {}, 2},
        // Latent attention: every head's key (its rotary part the shared one's) and value, of
        // their own widths, gathered and passed around the ring; with tp, the query's latent,
        // and in a mixture of experts under sequence parallelism.
        Case{"mla_cp2", 1, 1, 1, "1f1b", 2, &kMla, "fp32", {}, 2},
        Case{"mla_cp2_tp2", 2, 1, 1, "1f1b", 2, &kMla, "fp32", {}, 2},
        Case{"mla_no_q_latent_cp4", 1, 1, 1, "1f1b", 2, &kMlaNoQLatent, "fp32", {}, 4},
        Case{
            "mla_moe_cp2_tp2_sp", 2, 1, 1, "1f1b", 2, &kMlaMoe, "fp32", {"--sequence-parallel"}, 2},
        // Mixtures of experts, every expert on every rank: the router's top-2, the routed
        // copies in expert order, one GEMM an expert, the weighted sum with the shared expert's
        // output; under data, pipeline and context parallelism, DeepSpeed's per-tensor ZeRO-3,
        // recomputation and a zero-bubble pipeline's split backward.
        with("moe_pp2_dp2", 1, 2, 2, 8, {"--zero", "1"}, &kMoe),
        with("moe_deepspeed_zero3_recompute_full_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "deepspeed", "--recompute", "full",
              "--zero3-persistence-threshold", "0", "--zero3-prefetch-elements", "1"},
             &kMoe),
        Case{"moe_cp2", 1, 1, 1, "1f1b", 2, &kMoe, "fp32", {}, 2},
        moe_case("moe_zb_h1_pp2", 2, 1, "zb-h1", 4, {"--recompute", "selective"}),
        // Expert parallelism: each rank half the experts and half of each micro-batch, the
        // routed copies exchanged by all-to-alls (and again for a recomputation), the experts'
        // gradients summed over dp alone (dp4: two replicas of each half), in a zero-bubble
        // pipeline too.
        with("moe_ep2", 1, 1, 2, 4, {"--ep", "2"}, &kMoe),
        with("moe_ep2_dp4", 1, 1, 4, 8, {"--ep", "2"}, &kMoe),
        with("moe_ep2_recompute_full", 1, 1, 2, 4, {"--ep", "2", "--recompute", "full"}, &kMoe),
        moe_case("moe_ep2_zb_h1_pp2_dp2", 2, 2, "zb-h1", 8, {"--ep", "2"}),
        // Paired blocks, a forward beside another micro-batch's backward (DualPipeV's orders,
        // combined 1F1B's), run one after the other; compare counts each half in its phase.
        moe_case("moe_ep2_dualpipev_pp2_dp2", 2, 2, "dualpipev", 8, {"--ep", "2", "--vpp", "2"}),
        with("moe_ep2_ep_overlap", 1, 1, 2, 8, {"--ep", "2", "--ep-overlap"}, &kMoe),
        // PyTorch's early-stopping checkpoint (FSDP plans): the last MLP linear and the
        // residual keep the forward's graphs, the linear's input refilled by the
        // recomputation; compare requires the program's recompute rows exactly (the MoE
        // block's: up to its combine).
        with("fsdp_zero3_recompute_full_early_stop_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "fsdp", "--recompute", "full"}),
        moe_case("moe_fsdp_recompute_full_early_stop_zb_h1_pp2", 2, 1, "zb-h1", 4,
                 {"--framework", "fsdp", "--recompute", "full"}),
        // ... with expert parallelism: the combine's saved input comes back through the
        // recomputation's all-to-all.
        moe_case("moe_ep2_fsdp_recompute_full_early_stop_zb_h1_pp2_dp2", 2, 2, "zb-h1", 8,
                 {"--ep", "2", "--framework", "fsdp", "--recompute", "full"}),
        // Group-limited routing: a token's experts from its best group (of two).
        with("moe_grouped_ep2", 1, 1, 2, 4, {"--ep", "2"}, &kMoeGrouped),
        // Tensor-parallel experts (each rank a half of every expert's width, and of the shared
        // expert's): the experts' and the shared expert's partial sums all-reduced for the
        // combine, their input gradients for the dispatch; under sequence parallelism each
        // rank routes its slice, its copies gathered over tp (reordered expert by expert) and
        // the partial sums reduce-scattered back, the router's gradient summed over tp.
        Case{"moe_tp2", 2, 1, 1, "1f1b", 2, &kMoe},
        with("moe_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kMoe),
        with("moe_tp2_sp_zero1_pp2_dp2", 2, 2, 2, 8, {"--sequence-parallel", "--zero", "1"}, &kMoe),
        with("moe_tp2_sp_recompute_full", 2, 1, 1, 2,
             {"--sequence-parallel", "--recompute", "full"}, &kMoe),
        with("moe_tp2_sp_zero3_dp2", 2, 1, 2, 4, {"--sequence-parallel", "--zero", "3"}, &kMoe),
        Case{"moe_tp2_sp_zb_h1_pp2", 2, 2, 1, "zb-h1", 4, &kMoe, "fp32", {"--sequence-parallel"}},
        Case{"moe_tp2_fsdp_recompute_full_early_stop_zb_h1_pp2",
             2,
             2,
             1,
             "zb-h1",
             4,
             &kMoe,
             "fp32",
             {"--framework", "fsdp", "--recompute", "full"}},
        Case{"moe_tp2_sp_cp2", 2, 1, 1, "1f1b", 2, &kMoe, "fp32", {"--sequence-parallel"}, 2},
        with("moe_grouped_tp2_sp", 2, 1, 1, 2, {"--sequence-parallel"}, &kMoeGrouped),
        Case{"moe_tp2_dualpipev_pp2_dp2", 2, 2, 2, "dualpipev", 8, &kMoe, "fp32", {"--vpp", "2"}},
        // Beside expert parallelism: each tp rank exchanges its copies with its ep peers;
        // under sequence parallelism the copies that arrive are then gathered over tp (their
        // counts differing rank to rank: an all-gather of uneven pieces, recorded with the
        // program's bytes), and the partial sums go back over ep whole, then reduce-scattered
        // over tp, as the program converts ep before tp.
        Case{"moe_tp2_ep2", 2, 1, 2, "1f1b", 4, &kMoe, "fp32", {"--ep", "2"}},
        Case{"moe_tp2_ep2_sp",
             2,
             1,
             2,
             "1f1b",
             4,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel"}},
        Case{"moe_tp2_ep2_sp_recompute_full",
             2,
             1,
             2,
             "1f1b",
             4,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--recompute", "full"}},
        Case{"moe_tp2_ep2_sp_zb_h1_pp2",
             2,
             2,
             2,
             "zb-h1",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel"}},
        Case{"moe_tp2_ep2_sp_zero3_dp4",
             2,
             1,
             4,
             "1f1b",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--zero", "3"}},
        Case{"moe_tp2_ep2_fsdp_recompute_full_early_stop_zb_h1_pp2",
             2,
             2,
             2,
             "zb-h1",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--framework", "fsdp", "--recompute", "full"}},
        Case{"moe_tp2_ep2_sp_dualpipev_pp2",
             2,
             2,
             2,
             "dualpipev",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--vpp", "2", "--sequence-parallel"}},
        // Experts folded over the tensor-parallel ranks too (--etp 1; whole experts, E / (ep tp)
        // a rank): the copies travel by all-to-all over ep, then over tp, and back over ep,
        // then over tp (the program's axis order), each stage ordering what arrives expert by
        // expert, the return each row to its source's place along the axis.
        Case{"moe_tp2_ep2_sp_etp1",
             2,
             1,
             2,
             "1f1b",
             4,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--etp", "1"}},
        Case{"moe_tp2_sp_etp1",
             2,
             1,
             1,
             "1f1b",
             2,
             &kMoe,
             "fp32",
             {"--ep", "1", "--sequence-parallel", "--etp", "1"}},
        Case{"moe_tp2_ep2_sp_etp1_recompute_full",
             2,
             1,
             2,
             "1f1b",
             4,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--etp", "1", "--recompute", "full"}},
        Case{"moe_tp2_ep2_sp_etp1_zb_h1_pp2",
             2,
             2,
             2,
             "zb-h1",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--etp", "1"}},
        Case{"moe_tp2_ep2_sp_etp1_zero3_dp4",
             2,
             1,
             4,
             "1f1b",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--etp", "1", "--zero", "3"}},
        Case{"moe_tp2_ep2_sp_etp1_fsdp_recompute_full_early_stop_zb_h1_pp2",
             2,
             2,
             2,
             "zb-h1",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--sequence-parallel", "--etp", "1", "--framework", "fsdp",
              "--recompute", "full"}},
        Case{"moe_tp2_ep2_sp_etp1_dualpipev_pp2",
             2,
             2,
             2,
             "dualpipev",
             8,
             &kMoe,
             "fp32",
             {"--ep", "2", "--vpp", "2", "--sequence-parallel", "--etp", "1"}},
        // The combine alone recomputed: the conversions into its input (the experts' outputs
        // back over ep, summed over tp, the shared expert's summed) run again, as the program's.
        recompute_only("moe_ep2_recompute_combine", 1, 2, {"--ep", "2"}, "moe.combine"),
        recompute_only("moe_tp2_recompute_combine", 2, 1, {}, "moe.combine"),
        recompute_only("moe_tp2_ep2_sp_recompute_combine", 2, 2,
                       {"--ep", "2", "--sequence-parallel"}, "moe.combine"),
        // ... moe.fc1 alone: its input exchanged again; the dispatch alone: not.
        recompute_only("moe_ep2_recompute_fc1", 1, 2, {"--ep", "2"}, "moe.fc1"),
        recompute_only("moe_tp2_ep2_sp_recompute_dispatch", 2, 2,
                       {"--ep", "2", "--sequence-parallel"}, "moe.dispatch"),
        recompute_only("moe_tp2_ep2_sp_etp1_recompute_moe", 2, 2,
                       {"--ep", "2", "--sequence-parallel", "--etp", "1"}, "moe.*"),
        // ... over four ep ranks, one of which receives no copies of one layer (an empty piece).
        Case{"moe_tp2_ep4_sp",
             2,
             1,
             4,
             "1f1b",
             8,
             &kMoe,
             "fp32",
             {"--ep", "4", "--sequence-parallel"}},
        // ... with biases: the row-parallel experts' added once, to the sums, in the combine.
        Case{"moe_bias_tp2_sp_zb_h1_pp2",
             2,
             2,
             1,
             "zb-h1",
             4,
             &kMoeBias,
             "fp32",
             {"--sequence-parallel"}},
        // ... with ZeRO: the experts' state sharded over their own group (dp), the rest's
        // over dp and ep.
        with("moe_ep2_zero1_dp4", 1, 1, 4, 8, {"--ep", "2", "--zero", "1"}, &kMoe),
        with("moe_ep2_zero3_dp4", 1, 1, 4, 8, {"--ep", "2", "--zero", "3"}, &kMoe),
        with("moe_ep2_zero3_recompute_full_pp2_dp2", 1, 2, 2, 8,
             {"--ep", "2", "--zero", "3", "--recompute", "full"}, &kMoe),
        moe_case("moe_ep2_zero2_zb_h1_pp2_dp4", 2, 4, "zb-h1", 16, {"--ep", "2", "--zero", "2"}),
        Case{"qk_norm_layernorm_cp2_tp2", 2, 1, 1, "1f1b", 2, &kGptQkNorm, "fp32", {}, 2},
        // Sequence parallelism inside context parallelism: each cp rank's tokens cut in tp
        // slices for the norms, residuals and the position add.
        Case{"sp_cp2_tp2", 2, 1, 1, "1f1b", 2, &kModel, "fp32", {"--sequence-parallel"}, 2},
        Case{"llama_sp_cp2_tp2", 2, 1, 1, "1f1b", 2, &kLlama, "fp32", {"--sequence-parallel"}, 2},
        // Repeated forwards (training.recycle): every pass but the last without gradients, the
        // last segment's output recycled into the first segment (a transfer; in memory when
        // one rank holds both).
        with("recycle3_tp2_pp2", 2, 2, 1, 4, {"--recycle", "3"}),
        // The search's orders interleave recycled outputs with gradients (tagged transfers),
        // with zero-bubble split backwards.
        Case{"recycle3_tessel_pp2", 1, 2, 1, "tessel", 4, &kModel, "fp32", {"--recycle", "3"}},
        Case{"recycle2_gpipe_llama_sp_tp2",
             2,
             1,
             1,
             "gpipe",
             2,
             &kLlama,
             "fp32",
             {"--recycle", "2", "--sequence-parallel"}},
        // Recompute rules without layers: the embedding and the head recomputed too.
        Case{"recompute_unranged_sp_tp2_pp2",
             2,
             2,
             1,
             "1f1b",
             4,
             &kModel,
             "fp32",
             {"--sequence-parallel", "--recompute", "full"},
             1,
             true},
        Case{"recompute_unranged_merak_tp2_pp2",
             2,
             2,
             1,
             "merak",
             4,
             &kModel,
             "fp32",
             {"--recompute", "full"},
             1,
             true},
        // ReLU and squared-ReLU MLPs, their fc1 columns split over tp.
        Case{"opt_relu_tp2", 2, 1, 1, "1f1b", 2, &kOpt},
        with("nemotron_squared_relu_sp_tp2", 2, 1, 1, 2, {"--sequence-parallel"}, &kNemotron),
        // ALiBi: each tp rank's heads use their global heads' slopes; each cp rank's tokens
        // their global positions.
        Case{"mpt_alibi_tp2", 2, 1, 1, "1f1b", 2, &kMpt},
        Case{"mpt_alibi_cp2", 1, 1, 1, "1f1b", 2, &kMpt, "fp32", {}, 2},
        // Dropout: the masks of the whole model, sliced by heads, sequence (sp, cp), micro-batch
        // and pipeline stage (global layer index), drawn again by the recomputation.
        with("dropout_sp_recompute_tp2_pp2", 2, 2, 1, 4,
             {"--sequence-parallel", "--recompute", "selective"}, &kDropout),
        Case{"dropout_cp2_tp2", 2, 1, 1, "1f1b", 2, &kDropout, "fp32", {}, 2},
        // ... with repeated forwards (each pass draws masks of its own) and a recompute rule
        // without layers: the embedding's dropout recomputed draws its masks again alike.
        Case{"dropout_recycle2_unranged_recompute_sp_tp2_pp2",
             2,
             2,
             1,
             "1f1b",
             4,
             &kDropout,
             "fp32",
             {"--recycle", "2", "--sequence-parallel", "--recompute", "full"},
             1,
             true},
        // fp16: 16-bit operators with fp32 master weights and a static loss scale; the
        // tensor-parallel collectives, pipeline transfers and 16-bit gradient reduce-scatters
        // carry fp16.
        Case{"fp16_llama_sp_tp2_pp2", 2, 2, 1, "1f1b", 4, &kLlama, "fp16", {"--sequence-parallel"}},
        with("fp16_zero3_fp16_grads_dp2", 1, 1, 2, 4, {"--zero", "3", "--framework", "other"},
             &kModel, "fp16"),
        // fp8: the blocks' linear layers with e4m3 inputs and e5m2 output gradients (per-tensor
        // scales), the rest bf16, every collective bf16 as the program prices it.
        Case{"fp8_tp2", 2, 1, 1, "1f1b", 2, &kModel, "fp8"},
        Case{"fp8_llama_sp_tp2_pp2", 2, 2, 1, "1f1b", 4, &kLlama, "fp8", {"--sequence-parallel"}},
        // The head sharded over the pipeline stages (its segment spans them): head.proj's and
        // the loss's vocabulary over pp and tp, the loss's statistics all-reduced over both,
        // the projection's input gradient over pp then tp; the last stage's output sent to the
        // other stage, kept by its own.
        with("shard_head_tp2_pp2", 2, 2, 1, 4, {"--shard-head"}),
        // ... and the embedding too (Tessel's M shape), with sequence parallelism and split
        // backwards: rotary positions, so the word embeddings' partial sums are all-reduced
        // over pp as embed.partial-sums and reduce-scattered over tp by the first layer's
        // stage, whose input gradient goes whole to the other stage's embedding (a tp slice
        // each, all-gathered on arrival); the head's input gradient all-reduced over pp, then
        // reduce-scattered over tp.
        Case{"shard_embedding_head_tessel_llama_sp_tp2_pp2",
             2,
             2,
             1,
             "tessel",
             4,
             &kLlama,
             "fp32",
             {"--shard-embedding", "--shard-head", "--sequence-parallel"}},
        // ... with context parallelism (attn.core's all-gathers over cp inside the stages; the
        // spanning segments' collectives over pp and tp, each cp rank its share of the
        // sequence) and tp2 without sequence parallelism: the pipeline transfers go as a tp
        // slice of the cp rank's sequence, all-gathered on arrival.
        // Repeated forwards with the head spanning the stages (a plan edited as `nnsim plan`
        // refuses --recycle with --shard-head): the head's earlier passes hand their input to
        // the next pass's first segment on the stage that runs both, and the other stage's
        // head sends nothing (the program's source lane).
        Case{"shard_head_recycle2_tp2_pp2",
             2,
             2,
             1,
             "1f1b",
             4,
             &kModel,
             "fp32",
             {"--shard-head"},
             1,
             false,
             2},
        Case{"shard_embedding_head_tessel_cp2_tp2_pp2",
             2,
             2,
             1,
             "tessel",
             4,
             &kModel,
             "fp32",
             {"--shard-embedding", "--shard-head"},
             2}),
    [](const auto& info) { return std::string(info.param.name); });

// Rank 0's losses over five bf16 training steps of kModel on two data-parallel ranks, planned
// with `args`.
std::vector<double> five_step_losses(const std::vector<std::string>& args) {
  TempDir dir;
  RunResult p = make_plan(dir, 1, 1, 2, "1f1b", 4, args, kModel, "bf16");
  EXPECT_EQ(p.status, 0) << p;
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--launch", "2", "--out", "run.h5",
                     "--iterations", "5", "--warmup", "0"});
  EXPECT_EQ(r.status, 0) << r;
  Expected<RunResults> file = read_run(dir.file("run.h5"));
  EXPECT_TRUE(file.ok()) << (file.ok() ? "" : file.error().message());
  return file.ok() && !file->ranks.empty() ? file->ranks[0].losses : std::vector<double>{};
}

// --check compares the first iteration only; the later ones show that ZeRO-3's bf16 gathers
// reach the operators' copies: trained five steps, bf16 ZeRO-3 follows bf16 ZeRO-1 (both compute
// with bf16 casts of the same fp32 master chunks), while the loss itself moves far more.
TEST(NnexecRunBf16, Zero3TrainsAsZero1) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const std::vector<double> z1 = five_step_losses({"--zero", "1"});
  const std::vector<double> z3 = five_step_losses({"--zero", "3"});
  ASSERT_EQ(z1.size(), 5u);
  ASSERT_EQ(z3.size(), 5u);
  EXPECT_GT(z3.front() - z3.back(), 0.05) << "the loss did not move";
  // ZeRO-1's first forward reads its fp32 norm and embedding weights unrounded (ZeRO-3 reads
  // gathered bf16 values): a small difference, far below what training moves.
  EXPECT_LT(std::abs(z3.back() - z1.back()), 2e-3) << z3.back() << " vs " << z1.back();
}

// DeepSpeed's ZeRO-3 keeps tensors under its persistence threshold (the builder's 1e5 elements:
// all of kModel's biases and norms) whole and gathers their updated chunks after each step:
// trained five steps, it follows ZeRO-1 (0.046 apart without that gather).
TEST(NnexecRunBf16, DeepSpeedZero3PersistentTensorsTrainAsZero1) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const std::vector<double> z1 = five_step_losses({"--zero", "1"});
  const std::vector<double> ds = five_step_losses({"--zero", "3", "--framework", "deepspeed"});
  ASSERT_EQ(z1.size(), 5u);
  ASSERT_EQ(ds.size(), 5u);
  EXPECT_GT(ds.front() - ds.back(), 0.05) << "the loss did not move";
  EXPECT_LT(std::abs(ds.back() - z1.back()), 5e-3) << ds.back() << " vs " << z1.back();
}

TEST(NnexecRunCheck, AWrongGradientFailsLoudly) {
  // The check is not vacuous: --inject-fault scales one gradient shard of the last rank by 1.01
  // before the comparison.
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 2, 1, 1, "1f1b", 2).status, 0);
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "1",
                     "--check", "--inject-fault"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "differs from the unpartitioned run")) << r;
  EXPECT_TRUE(contains(r.err, "check failed")) << r;
  // ZeRO checks each rank's gradient chunk, which the fault reaches too.
  ASSERT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 2, {"--zero", "1"}).status, 0);
  r = run(dir, NNEXEC_BINARY,
          {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "1", "--check",
           "--inject-fault"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "on rank 1 differs from the unpartitioned run")) << r;
}

TEST(NnexecRunRefuses, PlansItCannotRunNameTheField) {
  TempDir dir;
  auto refused = [&](const std::vector<std::string>& expected) {
    RunResult r = run(dir, NNEXEC_BINARY, {"run", "--plan", "plan.json", "--out", "run.h5"});
    EXPECT_EQ(r.status, 1) << r;
    for (const std::string& e : expected) EXPECT_TRUE(contains(r.err, e)) << e << "\n" << r;
    // The error says what runs.
    EXPECT_TRUE(contains(r.err,
                         "data parallelism with ZeRO 0-3, recompute rules, repeated "
                         "forwards"))
        << r;
    EXPECT_FALSE(std::ifstream(dir.file("run.h5")).good());
  };
  // The embedding sharded over the pipeline stages (its segment spans them) under sequence
  // parallelism with rotary positions, its transfers edited to go whole.
  ASSERT_EQ(
      make_plan(dir, 2, 2, 1, "tessel", 4, {"--shard-embedding", "--sequence-parallel"}, kLlama)
          .status,
      0);
  ASSERT_NO_FATAL_FAILURE(
      edit_plan(dir, R"("pp_scatter_gather": true)", R"("pp_scatter_gather": false)"));
  refused(
      {"cannot run this plan: communication.pp_scatter_gather: false with sequence "
       "parallelism, rope positions and the embedding's segment 'embedding' spanning the "
       "pipeline stages is not supported yet"});

  // Expert parallelism runs beside data and pipeline parallelism only, with ZeRO-3 in whole
  // units (a hand-made plan asking DeepSpeed's per-tensor units, which nnsim plan refuses).
  ASSERT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 4, {"--ep", "2", "--zero", "3"}, kMoe).status, 0);
  ASSERT_NO_FATAL_FAILURE(
      edit_plan(dir, R"("zero3_per_tensor": false)", R"("zero3_per_tensor": true)"));
  refused(
      {"cannot run this plan: communication.zero3_per_tensor: DeepSpeed's tensor-by-tensor "
       "ZeRO-3 with expert parallelism is not supported"});
  ASSERT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 4, {"--ep", "2", "--moe-deepep"}, kMoe).status, 0);
  refused({"cannot run this plan: moe_deepep: DeepEP's exchange is simulated only"});
  ASSERT_EQ(make_plan(dir, 2, 1, 2, "1f1b", 4, {"--ep", "2", "--etp", "1"}, kMoe).status, 0);
  refused(
      {"cannot run this plan: partition: experts folded over the tensor-parallel ranks "
       "(--etp 1) need sequence parallelism"});
  // A mixture of experts in bf16 runs (under ZeRO-3 too, which gathers the routers' fp32
  // weights: the router scores in fp32), but is not checked against the fp32 reference:
  // rounding moves tokens to other experts.
  ASSERT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 4, {"--zero", "3"}, kMoe, "bf16").status, 0);
  RunResult checked =
      run(dir, NNEXEC_BINARY, {"run", "--plan", "plan.json", "--out", "run.h5", "--check"});
  EXPECT_EQ(checked.status, 1) << checked;
  EXPECT_TRUE(contains(checked.err,
                       "--check: a mixture of experts in bf16 cannot be checked against the "
                       "unpartitioned fp32 reference"))
      << checked;
  RunResult unchecked = run(dir, NNEXEC_BINARY,
                            {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "1"});
  EXPECT_EQ(unchecked.status, 0) << unchecked;
  // ... and in fp8 (the experts' grouped GEMMs on fp8-quantized operands, MoeGroupedLinear),
  // with expert parallelism.
  ASSERT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 4, {"--ep", "2"}, kMoe, "fp8").status, 0);
  RunResult fp8 = run(dir, NNEXEC_BINARY,
                      {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "1"});
  EXPECT_EQ(fp8.status, 0) << fp8;
  EXPECT_TRUE(contains(fp8.out, "loss")) << fp8;

  ASSERT_EQ(make_plan(dir, 1, 2, 1, "1f1b", 2).status, 0);
  RunResult r =
      run(dir, NNEXEC_BINARY, {"run", "--plan", "plan.json", "--launch", "3", "--out", "run.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "--launch 3 but the plan's mesh has 2 ranks")) << r;
}

// Tied embeddings on a V-shaped placement: ZeRO reduces the one matrix with the embedding's
// unit, so an order computing a head's weight gradient after the embedding's last reduction is
// refused (that gradient would be left out); without ZeRO the sum comes after every block.
TEST(NnexecRunRefuses, AHeadWeightGradientAfterTheTiedMatrixIsReduced) {
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 1, 2, 2, "zb-v", 8, {"--vpp", "2", "--zero", "2"}, kTied).status, 0);
  Expected<Plan> base = load_plan(dir.file("plan.json"));
  ASSERT_TRUE(base.ok()) << base.error().message();
  EXPECT_TRUE(check_runnable(*base).ok()) << check_runnable(*base).error().message();
  Plan p = *base;
  int head = -1, order = -1;
  for (std::size_t i = 0; i < p.segments.size(); ++i) {
    if (p.segments[i].head) head = static_cast<int>(i);
  }
  for (std::size_t o = 0; o < p.schedule.size(); ++o) {
    for (const Block& b : p.schedule[o].blocks) {
      if (b.segment == head) order = static_cast<int>(o);
    }
  }
  ASSERT_GE(order, 0);
  // The head's last BW moved to the end of its order, after the embedding's last BW.
  std::vector<Block>& blocks = p.schedule[order].blocks;
  auto last = std::find_if(blocks.rbegin(), blocks.rend(), [&](const Block& b) {
    return b.segment == head && b.kind == BlockKind::kBackwardWeight;
  });
  ASSERT_NE(last, blocks.rend());
  const Block moved = *last;
  blocks.erase(std::next(last).base());
  blocks.push_back(moved);
  Status s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       fmt::format("schedule.orders[{}].blocks: block '{}' computes weight "
                                   "gradients of the head",
                                   order, to_string(moved))))
      << s.error().message();
  EXPECT_TRUE(contains(s.error().message(), "(ZeRO 2)")) << s.error().message();
  p.optimizer.zero = 0;
  EXPECT_TRUE(check_runnable(p).ok()) << check_runnable(p).error().message();
}

// Hybrid models (Mamba-2 layers and layers of attention or an MLP alone), gated attention
// outputs and optimizer and activation offloading are simulated only.
TEST(NnexecRunRefuses, SimulatedOnlyFeaturesNameTheField) {
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 1, 2, 1, "1f1b", 2).status, 0);
  Expected<Plan> base = load_plan(dir.file("plan.json"));
  ASSERT_TRUE(base.ok()) << base.error().message();
  EXPECT_TRUE(check_runnable(*base).ok()) << check_runnable(*base).error().message();
  Plan p = *base;
  p.model.layer_pattern = std::string(static_cast<size_t>(p.model.layers), '-');
  const Status s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(), "model.layer_pattern")) << s.error().message();
  EXPECT_TRUE(contains(s.error().message(), "simulated only")) << s.error().message();
  // Gated attention outputs (Qwen3-Next's) are simulated only too.
  Plan gated = *base;
  gated.model.attention_output_gate = true;
  const Status g = check_runnable(gated);
  ASSERT_FALSE(g.ok());
  EXPECT_TRUE(contains(g.error().message(), "model.attention_output_gate")) << g.error().message();
  // And optimizer offloading: nnexec's optimizer state stays on the device.
  Plan offloading = *base;
  offloading.optimizer.offload_fraction = 0.5;
  const Status o = check_runnable(offloading);
  ASSERT_FALSE(o.ok());
  EXPECT_TRUE(contains(o.error().message(), "optimizer.offload_fraction")) << o.error().message();
  EXPECT_TRUE(contains(o.error().message(), "simulated only")) << o.error().message();
  // And activation offloading: nnexec keeps the activations on the device.
  Plan activations = *base;
  activations.activation_offload_layers = 1;
  const Status a = check_runnable(activations);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(contains(a.error().message(), "activation_offload_layers")) << a.error().message();
  EXPECT_TRUE(contains(a.error().message(), "simulated only")) << a.error().message();
}

// Expert-parallel plans nnsim plan does not write, edited by hand: each refusal names its field.
TEST(NnexecRunRefuses, ExpertParallelPlansItCannotRunNameTheField) {
  Expected<Plan> base = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 1, 1, 2, "1f1b", 4, {"--ep", "2"}, kMoe).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(base.ok()) << base.error().message();
  EXPECT_TRUE(check_runnable(*base).ok()) << check_runnable(*base).error().message();
  auto expert_rule = [](Plan& q, const char* op) -> DimSplit& {
    for (PartitionRule& r : q.partition) {
      if (r.match != op) continue;
      for (DimSplit& sp : r.splits) {
        if (sp.dim == Dim::kExpert) return sp;
      }
    }
    ADD_FAILURE() << "no expert split of " << op;
    return q.partition.front().splits.front();
  };
  const std::vector<std::pair<std::function<void(Plan&)>, const char*>> refused = {
      {[](Plan& q) { q.model.experts = 3; },
       "model.experts: 3 experts cannot be split evenly over the 2 expert-parallel ranks"},
      {[](Plan& q) { q.micro_batch = 3; },
       "training.micro_batch: 3 sequences a micro-batch cannot be split over the 2 "
       "expert-parallel ranks"},
      {[&](Plan& q) { expert_rule(q, "moe.fc2").axes = {}; },
       "partition: 'moe.fc2' splits the experts over  but moe.fc1 over ep"},
      {[](Plan& q) {
         q.model.experts = 0;
         q.model.experts_per_token = 0;
         q.model.shared_expert_ffn_hidden = 0;
         q.model.first_dense_layers = 0;
       },
       "partition: the experts are split over ep but the model has no mixture of experts"},
      {[](Plan& q) {
         for (PartitionRule& r : q.partition) {
           if (r.match == "*") r.splits.front().axes = {};
         }
       },
       "partition: the experts are split over 'ep', which neither splits the batch nor the "
       "attention heads"},
  };
  for (const auto& [change, message] : refused) {
    Plan p = *base;
    change(p);
    const Status s = check_runnable(p);
    ASSERT_FALSE(s.ok()) << message;
    EXPECT_TRUE(contains(s.error().message(), message)) << s.error().message();
  }
}

// Tensor-parallel experts (Megatron-Core's expert tensor parallelism at the tensor-parallel
// degree) run; what cannot, refused with the field named.
TEST(NnexecRunRefuses, TensorParallelExpertPlansItCannotRunNameTheField) {
  Expected<Plan> base = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 2, 1, 1, "1f1b", 2, {"--sequence-parallel"}, kMoe).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(base.ok()) << base.error().message();
  EXPECT_TRUE(check_runnable(*base).ok()) << check_runnable(*base).error().message();
  auto unsplit = [](Plan& q, std::initializer_list<const char*> ops) {
    for (const char* op : ops) {
      q.partition.erase(std::remove_if(q.partition.begin(), q.partition.end(),
                                       [&](const PartitionRule& r) { return r.match == op; }),
                        q.partition.end());
    }
  };
  const std::vector<std::pair<std::function<void(Plan&)>, const char*>> refused = {
      {[&](Plan& q) { unsplit(q, {"moe.fc2"}); },
       "partition: operators moe.fc1, moe.act, moe.fc2 must be split alike"},
      {[&](Plan& q) { unsplit(q, {"moe.shared.fc1"}); },
       "partition: operators moe.shared.fc1, moe.shared.act, moe.shared.fc2 must be split "
       "alike"},
      {[&](Plan& q) {
         unsplit(q, {"moe.shared.fc1", "moe.shared.act", "moe.shared.fc2"});
       },
       "partition: operators moe.fc1, moe.shared.fc1 must be split alike"},
      {[&](Plan& q) {
         unsplit(q, {"moe.fc1", "moe.act", "moe.fc2", "moe.shared.fc1", "moe.shared.act",
                     "moe.shared.fc2"});
       },
       "partition: sequence parallelism needs the experts split along their width over the "
       "tensor-parallel ranks"},
      {[](Plan& q) { q.model.expert_ffn_hidden = 47; },
       "partition: tensor-parallel degree 2 does not divide the experts' width 47"},
  };
  for (const auto& [change, message] : refused) {
    Plan p = *base;
    change(p);
    const Status s = check_runnable(p);
    ASSERT_FALSE(s.ok()) << message;
    EXPECT_TRUE(contains(s.error().message(), message)) << s.error().message();
  }
  // Beside expert parallelism: whole experts over the tensor-parallel ranks (--etp 1) without
  // sequence parallelism, context parallelism, and biases (each rank would add experts' biases
  // it does not hold).
  const std::vector<std::tuple<std::vector<std::string>, int, const char*>> refused_plans = {
      {{"--ep", "2", "--etp", "1"},
       1,
       "experts folded over the tensor-parallel ranks (--etp 1) need sequence parallelism"},
      {{"--ep", "2"}, 2, "expert parallelism with context parallelism is simulated only"},
  };
  for (const auto& [flags, cp, message] : refused_plans) {
    TempDir dir;
    ASSERT_EQ(make_plan(dir, 2, 1, 2, "1f1b", 8, flags, kMoe, "fp32", cp).status, 0) << message;
    Expected<Plan> q = load_plan(dir.file("plan.json"));
    ASSERT_TRUE(q.ok()) << q.error().message();
    const Status s = check_runnable(*q);
    ASSERT_FALSE(s.ok()) << message;
    EXPECT_TRUE(contains(s.error().message(), message)) << s.error().message();
  }
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 2, 1, 2, "1f1b", 4, {"--ep", "2"}, kMoeBias).status, 0);
  Expected<Plan> biased = load_plan(dir.file("plan.json"));
  ASSERT_TRUE(biased.ok()) << biased.error().message();
  const Status s = check_runnable(*biased);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "model.bias: biases in experts split both over expert- "
                       "and tensor-parallel ranks"))
      << s.error().message();
}

TEST(NnexecRunRefuses, ModelsItCannotRunNameTheField) {
  Expected<Plan> base = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 2, 1, 1, "1f1b", 2, {}, kLlama).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(base.ok()) << base.error().message();
  EXPECT_TRUE(check_runnable(*base).ok()) << check_runnable(*base).error().message();
  Plan p = *base;
  p.recycle = 3;  // repeated forwards: the orders must name every pass
  Status s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "schedule.orders[0].blocks: block 'B0@0' comes before the last forward "
                       "pass of its micro-batch"))
      << s.error().message();
  p.schedule[0].blocks.insert(p.schedule[0].blocks.begin(), Block{BlockKind::kForward, 0, 0, 2});
  s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "schedule.orders[0].blocks: block 'F0@0#2' is not the next forward pass "
                       "of its micro-batch (training.recycle = 3)"))
      << s.error().message();
  p = *base;
  p.model.position = PositionKind::kAlibi;
  p.model.dropout = true;
  EXPECT_TRUE(check_runnable(p).ok()) << check_runnable(p).error().message();
  p.recompute = {{"*", 0, -1}};  // no layers: the embedding's dropout recomputed
  EXPECT_TRUE(check_runnable(p).ok()) << check_runnable(p).error().message();
  for (MlpKind k :
       {MlpKind::kGelu, MlpKind::kSwiglu, MlpKind::kRelu, MlpKind::kSquaredRelu, MlpKind::kGeglu}) {
    p = *base;
    p.model.mlp = k;  // every MLP of the operator graph runs
    EXPECT_TRUE(check_runnable(p).ok())
        << to_string(k) << ": " << check_runnable(p).error().message();
  }
  p = *base;
  p.model.post_norms = true;  // Gemma's norms after the attention and the MLP
  EXPECT_TRUE(check_runnable(p).ok()) << check_runnable(p).error().message();
  // What only the simulator has is refused by its field. A mixture of experts runs, but not
  // every kind (`experts` makes the model one).
  auto experts = [](Plan& q) {
    q.model.experts = 4;
    q.model.experts_per_token = 2;
    q.model.expert_ffn_hidden = q.model.ffn_hidden;
  };
  p = *base;
  experts(p);
  EXPECT_TRUE(check_runnable(p).ok()) << check_runnable(p).error().message();
  const std::vector<std::pair<std::function<void(Plan&)>, const char*>> simulated_only = {
      {[&](Plan& q) {
         experts(q);
         q.model.expert_capacity_factor = 1.5;
       },
       "model.expert_capacity_factor: 1.5 pads the experts' tokens, which nnexec does not"},
      {[&](Plan& q) {
         experts(q);
         q.model.router_groups = 2;
         q.model.router_group_topk = 2;
         q.model.experts_per_token = 1;
       },
       "model.router_group_topk: 2 groups a token, more than its 1 experts"},
      {[](Plan& q) { q.model.mtp_layers = 1; },
       "model.mtp_layers: multi-token prediction is simulated"},
      {[](Plan& q) {
         q.model.kv_lora_rank = 16;
         q.model.qk_nope_head_dim = 16;
         q.model.qk_rope_head_dim = 8;
         q.model.v_head_dim = 16;
         q.model.qk_norm = true;
       },
       "model.qk_norm: query and key norms beside multi-head latent attention"},
      {[](Plan& q) { q.comm.tp_sub_batches = 2; }, "communication.tp_sub_batches: sub-pipelined"},
  };
  for (const auto& [change, message] : simulated_only) {
    p = *base;
    change(p);
    s = check_runnable(p);
    ASSERT_FALSE(s.ok()) << message;
    EXPECT_TRUE(contains(s.error().message(), message)) << s.error().message();
  }
  p = *base;
  p.model.kv_heads = 1;  // MQA: runs unsplit, but one key/value head cannot be split over tp 2
  s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "model.kv_heads: 1 key/value heads cannot be split over a tensor-parallel "
                       "degree of 2"))
      << s.error().message();
  p = *base;
  p.model.kv_heads = 3;
  s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(), "model.kv_heads: 3 key/value heads do not divide 4"))
      << s.error().message();
  p = *base;
  // A split backward's BW needs its BI first, and a B is not split.
  p.schedule[0].blocks.insert(p.schedule[0].blocks.begin(),
                              Block{BlockKind::kBackwardWeight, 0, 0});
  s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "schedule.orders[0].blocks: block 'BW0@0' comes "
                       "before the BI block of its micro-batch"))
      << s.error().message();
  p = *base;
  for (Block& b : p.schedule[0].blocks) {
    if (b.kind == BlockKind::kBackward && b.micro_batch == 0) b.kind = BlockKind::kBackwardInput;
  }
  s = check_runnable(p);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.error().message(),
                       "schedule.orders[0].blocks: the backward (one B, or one BI and one BW) "
                       "of micro-batch 0 through segment 0 appears 1 times"))
      << s.error().message();
  // Sequence parallelism inside context parallelism cuts each cp rank's tokens over tp: the
  // norms' sequence split over cp, then tp; the other order is refused.
  Expected<Plan> spcp = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 2, 1, 1, "1f1b", 2, {"--sequence-parallel"}, kModel, "fp32", 2).status,
              0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(spcp.ok()) << spcp.error().message();
  EXPECT_TRUE(check_runnable(*spcp).ok()) << check_runnable(*spcp).error().message();
  for (PartitionRule& r : spcp->partition) {
    for (DimSplit& d : r.splits) {
      if (d.axes == std::vector<std::string>{"cp", "tp"}) d.axes = {"tp", "cp"};
    }
  }
  s = check_runnable(*spcp);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(
      contains(s.error().message(), "is split along 'seq' over tp+cp but attn.core over cp"))
      << s.error().message();
  // MQA without tensor parallelism runs.
  Expected<Plan> one = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 1, 2, 1, "1f1b", 2, {}, kLlama).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(one.ok()) << one.error().message();
  one->model.kv_heads = 1;
  EXPECT_TRUE(check_runnable(*one).ok()) << check_runnable(*one).error().message();
}

// The plan as each rank sees it: its operators' splits and axes, its segments and their
// neighbours in pipeline order, and the peers a transfer goes to.
TEST(NnexecRunLayout, SplitsSegmentsAndNeighboursAsThePlanPlacesThem) {
  Expected<Plan> plan = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 2, 2, 1, "1f1b", 4, {"--sequence-parallel"}).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  // Mesh dp1 pp2 cp1 tp2: rank = 2 pp + tp.
  const RankLayout L = layout_of(*plan, 3);
  EXPECT_EQ(L.split.heads, 2);
  EXPECT_EQ(L.split.ffn, 2);
  EXPECT_EQ(L.split.seq, 2);
  EXPECT_EQ(L.split.embed_vocab, 2);
  EXPECT_EQ(L.split.head_vocab, 2);
  EXPECT_EQ(L.split.cp, 1);
  EXPECT_EQ(L.split.ep, 1);
  EXPECT_EQ(L.tp_axes, std::vector<std::string>{"tp"});
  EXPECT_EQ(L.pp_axes, std::vector<std::string>{"pp"});
  ASSERT_NE(L.order, nullptr);
  ASSERT_EQ(L.segments.size(), 1u);
  const int sg = L.segments[0];
  EXPECT_TRUE(plan->segments[sg].head);
  const auto [prev, next] = L.neighbours.at(sg);
  EXPECT_EQ(next, -1);
  ASSERT_GE(prev, 0);
  EXPECT_TRUE(plan->segments[prev].embedding);
  // The first stage's rank beside rank 3: the same tensor-parallel place on pp 0.
  EXPECT_EQ(peer_in(plan->mesh, 3, plan->segments[prev]), 1);
  EXPECT_EQ(layout_of(*plan, 0).neighbours.at(prev).second, sg);

  // Expert parallelism: the routed experts split over ep, the batch of the rest too; gradients
  // of the rest sum over dp and ep.
  Expected<Plan> moe = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 1, 1, 4, "1f1b", 8, {"--ep", "2"}, kMoe).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(moe.ok()) << moe.error().message();
  const RankLayout E = layout_of(*moe, 1);
  EXPECT_EQ(E.split.ep, 2);
  EXPECT_EQ(E.split.ep_index, 1);
  EXPECT_EQ(E.split.heads, 1);
  ASSERT_EQ(E.ep_axes.size(), 1u);
  const std::vector<std::string> grads = data_parallel_with(moe->mesh, E.ep_axes);
  EXPECT_EQ(grads.size(), 2u);
  EXPECT_NE(std::find(grads.begin(), grads.end(), kDataParallelAxis), grads.end());
  EXPECT_NE(std::find(grads.begin(), grads.end(), E.ep_axes[0]), grads.end());
  EXPECT_EQ(axes_name({"dp", "cp"}), "dp+cp");
  EXPECT_EQ(axes_name({}), "none");
}

// Segments spanning the pipeline stages (--shard-head, --shard-embedding): what runs, where the
// tensors between segments go (as the compiled program's source_lane), and what is refused.
TEST(NnexecRunSpanning, TransfersAndVocabularyShardsAsTheProgram) {
  Expected<Plan> plan = [] {
    TempDir dir;
    EXPECT_EQ(make_plan(dir, 2, 2, 1, "1f1b", 4, {"--shard-head"}).status, 0);
    return load_plan(dir.file("plan.json"));
  }();
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_TRUE(check_runnable(*plan).ok()) << check_runnable(*plan).error().message();
  ASSERT_TRUE(any_spanning(*plan));
  // Mesh dp1 pp2 cp1 tp2: rank = 2 pp + tp. Segments: stage0 (pp 0), stage1 (pp 1), head (all).
  EXPECT_FALSE(spans_orders(*plan, 1));
  EXPECT_TRUE(spans_orders(*plan, 2));
  // Forward: stage1's output goes from pp 1 to the head's other order, kept on its own.
  TransferEnds e = transfer_ends(*plan, 3, 1, 2);
  EXPECT_TRUE(e.local);
  EXPECT_EQ(e.send_to, std::vector<int>{1});
  e = transfer_ends(*plan, 1, 1, 2);
  EXPECT_FALSE(e.local);
  EXPECT_EQ(e.recv_from, 3);
  EXPECT_TRUE(e.send_to.empty());
  // Backward: the head's input gradient stays on pp 1, and pp 0 sends none.
  e = transfer_ends(*plan, 3, 2, 1);
  EXPECT_TRUE(e.local);
  EXPECT_TRUE(e.send_to.empty());
  e = transfer_ends(*plan, 0, 2, 1);
  EXPECT_FALSE(e.local);
  EXPECT_EQ(e.recv_from, -1);
  EXPECT_TRUE(e.send_to.empty());
  // Between two stages: the ordinary pipeline transfer.
  e = transfer_ends(*plan, 0, 0, 1);
  EXPECT_EQ(e.send_to, std::vector<int>{2});
  EXPECT_EQ(transfer_ends(*plan, 2, 0, 1).recv_from, 0);
  // head.proj's vocabulary over pp then tp: shard 2 pp + tp of 4; partial sums reduced over pp,
  // then over tp; the loss's statistics over all four ranks.
  const VocabSplit v = vocab_split(*plan, 1, "head.proj", {0, 1}, "tp");
  EXPECT_EQ(v.ways, 4);
  EXPECT_EQ(v.index, 1);
  EXPECT_EQ(vocab_split(*plan, 2, "head.proj", {2, 3}, "tp").index, 2);
  ASSERT_EQ(v.per_axis.size(), 2u);
  EXPECT_EQ(v.per_axis[0].name, "pp");
  EXPECT_EQ(v.per_axis[0].group, (std::vector<int>{1, 3}));
  EXPECT_TRUE(v.per_axis[0].pipeline);
  EXPECT_EQ(v.per_axis[1].name, "tp");
  EXPECT_EQ(v.per_axis[1].group, (std::vector<int>{0, 1}));
  EXPECT_EQ(v.group, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(v.axes, "pp+tp");
  // embed.word (in stage0) over tp only: the tensor-parallel group, as before.
  const VocabSplit w = vocab_split(*plan, 1, "embed.word", {0, 1}, "tp");
  EXPECT_EQ(w.index, -1);
  EXPECT_EQ(w.axes, "tp");

  auto refusal = [](const Plan& p) {
    const Status s = check_runnable(p);
    return s.ok() ? std::string("runs") : s.error().message();
  };
  Plan p = *plan;
  p.segments[1].end_layer = 3;  // the head's segment with a layer
  p.segments[2].first_layer = 3;
  EXPECT_TRUE(contains(refusal(p),
                       "segments[2].devices: segment 'head' spans several pipeline stages with "
                       "layers [3, 4), which is not supported yet"))
      << refusal(p);
  p = *plan;
  p.partition.push_back({"mlp.fc1", {{Dim::kFfn, {"pp", "tp"}}}});
  EXPECT_TRUE(contains(refusal(p),
                       "partition: operator 'mlp.fc1' is split along the pipeline axis 'pp', "
                       "which only the vocabulary of embed.word, head.proj and loss may be"))
      << refusal(p);
  // Sequence parallelism with a spanning embedding that has no operator reading its partial
  // sums (rotary positions), without scatter-gather transfers: the embedding made a segment of
  // its own on every stage.
  {
    TempDir dir;
    ASSERT_EQ(make_plan(dir, 2, 2, 1, "1f1b", 4, {"--shard-head", "--sequence-parallel"}).status,
              0);
    Expected<Plan> sp = load_plan(dir.file("plan.json"));
    ASSERT_TRUE(sp.ok()) << sp.error().message();
    EXPECT_TRUE(check_runnable(*sp).ok()) << check_runnable(*sp).error().message();
    p = *sp;
  }
  p.model.position = PositionKind::kRope;
  p.segments[0].embedding = false;
  p.segments.push_back({"embedding", 0, 0, true, false, {}});
  p.partition.push_back({"embed.word", {{Dim::kVocab, {"pp", "tp"}}}});
  p.comm.pp_scatter_gather = false;
  EXPECT_TRUE(contains(refusal(p),
                       "communication.pp_scatter_gather: false with sequence parallelism, rope "
                       "positions and the embedding's segment 'embedding' spanning the pipeline "
                       "stages is not supported yet"))
      << refusal(p);
  p = *plan;
  p.model.vocab = 130;  // divisible by tp 2, not by the head's 4 shards
  EXPECT_TRUE(contains(refusal(p),
                       "model.vocab: 130 is not divisible by the 4 shards of "
                       "head.proj's vocabulary"))
      << refusal(p);
}

// Press et al.'s slopes: 2^(-8 i / n) for a power of two n heads; otherwise the largest power of
// two m's, then every other one of 2m's.
TEST(NnexecRunAlibi, SlopesArePressEtAls) {
  const std::vector<double> eight = alibi_slopes(8);
  ASSERT_EQ(eight.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(eight[i], std::exp2(-(i + 1))) << i;
  const std::vector<double> six = alibi_slopes(6);  // 4's (2^-2, 2^-4, 2^-6, 2^-8), 8's 1st, 3rd
  const std::vector<double> want = {0.25, 1.0 / 16, 1.0 / 64, 1.0 / 256, 0.5, 0.125};
  ASSERT_EQ(six.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(six[i], want[i]) << i;
  EXPECT_TRUE(alibi_slopes(0).empty());
}

// The first iteration's loss of `model` on one rank, two sequences.
double one_rank_first_loss(const std::string& model) {
  TempDir dir;
  EXPECT_EQ(make_plan(dir, 1, 1, 1, "1f1b", 2, {}, model).status, 0);
  RunResult r =
      run(dir, NNEXEC_BINARY,
          {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "1", "--warmup", "0"});
  EXPECT_EQ(r.status, 0) << r;
  Expected<RunResults> file = read_run(dir.file("run.h5"));
  EXPECT_TRUE(file.ok()) << (file.ok() ? "" : file.error().message());
  return file.ok() && !file->ranks.empty() && !file->ranks[0].losses.empty()
             ? file->ranks[0].losses[0]
             : 0.0;
}

// Sliding windows really mask (the check alone compares the executor with itself): the fused
// kernel's path (LibTorch's scaled_dot_product_attention with the window's mask) and the
// unfused chain (the scores masked in place) give the same loss, and another than the same
// model whose window spans the sequence.
TEST(NnexecRunSlidingWindow, FusedAndUnfusedMaskAlikeAndChangeTheLoss) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const std::string text = slurp(kSlidingWindow);
  auto first_loss = [&](const std::string& from, const std::string& to) {
    TempDir models;
    const std::string edited = std::regex_replace(text, std::regex(from), to);
    EXPECT_TRUE(from == to || edited != text) << from;
    std::ofstream(models.file("model.yaml")) << edited;
    return one_rank_first_loss(models.file("model.yaml"));
  };
  const double unfused = first_loss("attention: unfused", "attention: unfused");
  const double fused = first_loss("attention: unfused", "attention: flash");
  const double unwindowed = first_loss("sliding_window: 8", "sliding_window: 32");
  EXPECT_NEAR(fused, unfused, 1e-6 * std::abs(unfused));
  EXPECT_GT(std::abs(unfused - unwindowed), 1e-3) << unfused << " vs " << unwindowed;
}

// Dropout really applies (the check alone would pass with none): the model with dropout has
// another loss than the same model without, and the masks are a function of the seed, the
// iteration, the layer, the site, the sample and the forward pass only (dropout_seed).
TEST(NnexecRunDropout, MasksChangeTheLoss) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  const double with = one_rank_first_loss(kDropout), without = one_rank_first_loss(kModel);
  EXPECT_GT(std::abs(with - without), 1e-4) << with << " vs " << without;
  EXPECT_NE(dropout_seed(1, 0, 0, DropoutSite::kAttention, 0),
            dropout_seed(1, 0, 0, DropoutSite::kAttention, 1));
  EXPECT_NE(dropout_seed(1, 0, 0, DropoutSite::kAttention, 0),
            dropout_seed(1, 1, 0, DropoutSite::kAttention, 0));
  EXPECT_NE(dropout_seed(1, 0, 0, DropoutSite::kAttention, 0),
            dropout_seed(1, 0, 1, DropoutSite::kAttention, 0));
  EXPECT_NE(dropout_seed(1, 0, 0, DropoutSite::kAttention, 0),
            dropout_seed(1, 0, 0, DropoutSite::kMlpResidual, 0));
  // Repeated forwards: each pass its own masks.
  EXPECT_NE(dropout_seed(1, 0, 0, DropoutSite::kAttention, 0, 0),
            dropout_seed(1, 0, 0, DropoutSite::kAttention, 0, 1));
}

std::optional<std::string> python_with_h5py(const TempDir& dir) {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    if (run(dir, python, {"-c", "import h5py"}).status == 0) return std::string(python);
  }
  return std::nullopt;
}

TEST(NnexecRunFile, ReadableWithH5py) {
  if (!nnexec_build().torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 2, 2, 1, "1f1b", 4).status, 0);
  RunResult r =
      run(dir, NNEXEC_BINARY,
          {"run", "--plan", "plan.json", "--out", "run.h5", "--iterations", "3", "--check"});
  ASSERT_EQ(r.status, 0) << r;
  std::optional<std::string> python = python_with_h5py(dir);
  if (!python) GTEST_SKIP() << "no python3 with h5py (apt-get install python3-h5py)";
  std::ofstream(dir.file("check.py")) << R"(import sys
import h5py
def s(x):
    return x.decode() if isinstance(x, bytes) else x
with h5py.File(sys.argv[1], "r") as f:
    assert s(f.attrs["format"]) == "nnexec-run", f.attrs["format"]
    assert int(f.attrs["version"]) == 1
    assert int(f.attrs["ranks"]) == 4
    assert s(f.attrs["mesh_axes"]) == "dp,pp,cp,tp"
    t = f["iteration_seconds"][()]
    assert len(t) == 3 and (t > 0).all(), t
    assert len(f["loss"][()]) == 3
    assert sorted(f["ranks"].keys()) == ["0", "1", "2", "3"]
    r3 = f["ranks/3"]
    assert int(r3.attrs["pp"]) == 1 and int(r3.attrs["tp"]) == 1
    names = set(r3["ops/name"][()].astype(str))
    for op in ["attn.qkv", "attn.core", "attn.proj", "mlp.fc1", "mlp.act", "mlp.fc2",
               "attn.norm", "head.proj", "loss", "optimizer"]:
        assert op in names, (op, names)
    assert (r3["ops/seconds"][()] > 0).all()
    kinds = set(zip(r3["collectives/kind"][()].astype(str), r3["collectives/label"][()].astype(str)))
    assert ("all_reduce", "attn.residual") in kinds and ("recv", "activation") in kinds, kinds
    assert int(f["check"].attrs["passed"]) == 1
    assert (f["check/ok"][()] == 1).all()
    print("ok %.2f ms" % (1e3 * t.min()))
)";
  RunResult check = run(dir, *python, {"check.py", "run.h5"});
  EXPECT_EQ(check.status, 0) << check;
  EXPECT_TRUE(contains(check.out, "ok ")) << check;
}

}  // namespace
}  // namespace nnsim::hwexec

namespace nnsim::hwexec {
namespace {

// ---------------------------------------------------------------- --device cuda

TEST(NnexecRunCuda, RefusesWithTheReasonWhereItCannotRun) {
  const BuildInfo b = nnexec_build();
  const CudaProbe p = nnexec_info().gpus;
  if (!b.torch) GTEST_SKIP() << "built without LibTorch (NNSIM_WITH_TORCH)";
  if (b.cuda && p.usable && b.torch_cuda) GTEST_SKIP() << "this machine can run --device cuda";
  TempDir dir;
  ASSERT_EQ(make_plan(dir, 1, 1, 1, "1f1b", 2).status, 0);
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--device", "cuda", "--out", "run.h5"});
  EXPECT_EQ(r.status, 1) << r;
  EXPECT_TRUE(contains(r.err, "nnexec: error: --device cuda: ")) << r;
  if (!b.cuda) {
    EXPECT_TRUE(contains(r.err, "built without hwexec's CUDA part (NNSIM_WITH_CUDA")) << r;
  } else if (!p.usable) {
    // No driver (CI): cudaErrorInsufficientDriver; a driver without devices: cudaErrorNoDevice.
    const std::string name = p.reason.substr(0, p.reason.find(':'));
    EXPECT_EQ(name.rfind("cudaError", 0), 0u) << p.reason;
    EXPECT_TRUE(contains(r.err, "no usable GPU: " + name)) << r;
  }
  if (!b.torch_cuda) {
    EXPECT_TRUE(
        contains(r.err, "this build's LibTorch (" + nnexec_info().torch_version + ") has no CUDA"))
        << r;
  }
  EXPECT_FALSE(std::ifstream(dir.file("run.h5")).good());
}

// Needs a CUDA LibTorch and `ranks` GPUs; skipped otherwise.
std::optional<std::string> gpu_unavailable(int ranks) {
  const BuildInfo b = nnexec_build();
  if (!b.torch_cuda) return std::string("this build's LibTorch has no CUDA");
  const CudaProbe p = nnexec_info().gpus;
  if (!p.usable) return "no usable GPU: " + p.reason;
  if (p.devices < ranks) return fmt::format("needs {} GPUs, {} visible", ranks, p.devices);
  return std::nullopt;
}

class NnexecRunGpu : public ::testing::TestWithParam<Case> {};

TEST_P(NnexecRunGpu, MatchesTheUnpartitionedLossAndGradients) {
  const Case c = GetParam();
  const int n = c.tp * c.pp * c.dp * c.cp;
  if (auto why = gpu_unavailable(n)) GTEST_SKIP() << *why;
  TempDir dir;
  ASSERT_EQ(make_plan(dir, c.tp, c.pp, c.dp, c.schedule, c.global_batch, c.plan_flags, *c.model,
                      c.precision, c.cp)
                .status,
            0);
  RunResult r = run(dir, NNEXEC_BINARY,
                    {"run", "--plan", "plan.json", "--device", "cuda", "--out", "run.h5",
                     "--iterations", "2", "--warmup", "1", "--check"});
  ASSERT_EQ(r.status, 0) << r;
  EXPECT_TRUE(contains(r.out, "GPU(s)")) << r;
  EXPECT_TRUE(contains(r.out, "check           passed")) << r;
  EXPECT_TRUE(contains(r.out, "memory          peak")) << r;
  std::optional<std::string> python = python_with_h5py(dir);
  if (!python) GTEST_SKIP() << "no python3 with h5py";
  std::ofstream(dir.file("check.py")) << R"(import sys
import h5py
def s(x):
    return x.decode() if isinstance(x, bytes) else x
with h5py.File(sys.argv[1], "r") as f:
    assert s(f.attrs["device"]) == "cuda" and s(f.attrs["backend"]) == "nccl", dict(f.attrs)
    assert s(f.attrs["timing"]) == "cuda-events"
    for r in f["ranks"].values():
        assert int(r.attrs["gpu"]) >= 0 and r.attrs["peak_allocated_bytes"] > 0, dict(r.attrs)
        assert (r["ops/seconds"][()] > 0).all()
        if len(r["collectives/kind"]):
            assert (r["collectives/seconds"][()] > 0).all()
    print("ok")
)";
  RunResult check = run(dir, *python, {"check.py", "run.h5"});
  EXPECT_EQ(check.status, 0) << check;
}

INSTANTIATE_TEST_SUITE_P(
    Plans, NnexecRunGpu,
    ::testing::Values(
        Case{"one_gpu", 1, 1, 1, "1f1b", 2}, Case{"tp2", 2, 1, 1, "1f1b", 2},
        Case{"pp2_1f1b", 1, 2, 1, "1f1b", 4}, Case{"dp2", 1, 1, 2, "1f1b", 4},
        Case{"tp2_pp2_dp2", 2, 2, 2, "1f1b", 8}, Case{"llama_tp2", 2, 1, 1, "1f1b", 2, &kLlama},
        Case{"bf16_llama_tp2", 2, 1, 1, "1f1b", 2, &kLlama, "bf16"},
        with("zero1_dp2", 1, 1, 2, 4, {"--zero", "1"}),
        with("zero3_dp2", 1, 1, 2, 4, {"--zero", "3"}),
        // DeepSpeed's tensor-grained prefetch over NCCL, every tensor gathered.
        with("deepspeed_zero3_prefetch_one_dp2", 1, 1, 2, 4,
             {"--zero", "3", "--framework", "deepspeed", "--zero3-persistence-threshold", "0",
              "--zero3-prefetch-elements", "1"}),
        with("sp_recompute_full_tp2", 2, 1, 1, 2, {"--sequence-parallel", "--recompute", "full"}),
        with("tp2_sp_pp2", 2, 2, 1, 4, {"--sequence-parallel"}),
        // NCCL point-to-point inside a stage's order and the cp ring.
        Case{"zb_h1_pp2", 1, 2, 1, "zb-h1", 4},
        Case{"cp2", 1, 1, 1, "1f1b", 2, &kModel, "fp32", {}, 2},
        // A mixture of experts, its routed copies through NCCL's grouped sends and receives
        // (not yet run on a GPU).
        with("moe_ep2", 1, 1, 2, 4, {"--ep", "2"}, &kMoe)),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace nnsim::hwexec
