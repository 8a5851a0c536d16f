// Zero-bubble split backwards (run_split_backward.h).
#include "hwexec/run_split_backward.h"

namespace nnsim::hwexec {

void input_gradients(const at::Tensor& out, const at::Tensor& dout,
                     const std::vector<at::Tensor>& inputs) {
  out.backward(dout, /*retain_graph=*/true, /*create_graph=*/false, at::TensorList(inputs));
}

void weight_gradients(const DeferredWeightGrad& d, bool keep_graph) {
  d.out.backward(d.dout, keep_graph, /*create_graph=*/false, at::TensorList(d.weights));
}

}  // namespace nnsim::hwexec
