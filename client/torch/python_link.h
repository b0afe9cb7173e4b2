// memoffload._C's link between nodes: LinkListener and link_exchange (see
// python_link.cc), for memoffload.torch.checkpoint.nodes.
#ifndef MEMOFFLOAD_TORCH_PYTHON_LINK_H_
#define MEMOFFLOAD_TORCH_PYTHON_LINK_H_

#include <torch/extension.h>

namespace memoffload::torch::python {

void BindLink(pybind11::module_& m);

}  // namespace memoffload::torch::python

#endif  // MEMOFFLOAD_TORCH_PYTHON_LINK_H_
