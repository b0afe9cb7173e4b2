// memoffload._C's checkpoint regions: RegionStore, RegionWriter and
// RegionReader (see python_regions.cc), for memoffload.torch.checkpoint.
#ifndef MEMOFFLOAD_TORCH_PYTHON_REGIONS_H_
#define MEMOFFLOAD_TORCH_PYTHON_REGIONS_H_

#include <torch/extension.h>

namespace memoffload::torch::python {

void BindRegions(pybind11::module_& m);

}  // namespace memoffload::torch::python

#endif  // MEMOFFLOAD_TORCH_PYTHON_REGIONS_H_
