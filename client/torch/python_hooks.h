// memoffload._C's saved-tensor hooks: PackHook, UnpackHook, SavedEntry and
// PackCounters (see python_hooks.cc).
#ifndef MEMOFFLOAD_TORCH_PYTHON_HOOKS_H_
#define MEMOFFLOAD_TORCH_PYTHON_HOOKS_H_

#include <torch/extension.h>

namespace memoffload::torch::python {

void BindSavedTensorHooks(pybind11::module_& m);

}  // namespace memoffload::torch::python

#endif  // MEMOFFLOAD_TORCH_PYTHON_HOOKS_H_
