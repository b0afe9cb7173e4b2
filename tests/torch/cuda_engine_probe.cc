// cuda_engine_probe: loads the CUDA copy engine the way the torch layer does
// (dlopen of libcuda.so.1) and prints the outcome. Exit 0 with "cuda engine"
// when it loaded, 3 with the status when it is unavailable, 1 otherwise.
// Used by cuda_engine_tests with the simulated driver.
#include <cstdio>

#include "memoffload/torch/copy_engine.h"

int main() {
  auto made = memoffload::torch::MakeCudaCopyEngine();
  if (made.ok()) {
    std::printf("%s engine\n", (*made)->name());
    return 0;
  }
  std::printf("%s\n", made.status().ToString().c_str());
  return made.status().code() == memoffload::StatusCode::kUnavailable ? 3 : 1;
}
