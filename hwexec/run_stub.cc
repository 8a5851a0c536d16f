// run_rank without LibTorch (the build without NNSIM_WITH_TORCH; run_torch.cc otherwise).
#include <limits>

#include "hwexec/run.h"
#include "hwexec/run_model_ops.h"

namespace nnsim::hwexec {

Expected<RankResult> run_rank(const Plan&, const RunOptions&, Comm&) {
  return Error("this nnexec was built without LibTorch (NNSIM_WITH_TORCH); it cannot run plans");
}

double fp8_round(double, bool) {
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace nnsim::hwexec
