// run_rank without LibTorch (the build without NNSIM_WITH_TORCH; run_torch.cc otherwise).
#include "hwexec/run.h"

namespace nnsim::hwexec {

Expected<RankResult> run_rank(const Plan&, const RunOptions&, Comm&) {
  return Error("this nnexec was built without LibTorch (NNSIM_WITH_TORCH); it cannot run plans");
}

}  // namespace nnsim::hwexec
