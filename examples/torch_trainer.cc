// A small LibTorch trainer that offloads each layer's input through
// memoffloadd with the explicit API, and recomputes the layer in backward:
//
//   forward:  OffloadGroup(key_i, {x_i}); x_{i+1} = layer_i(x_i) without grad
//   backward: PrefetchGroup(key_{i-1}); x_i = GetGroup(key_i); recompute
//             layer_i with grad; backward through it; ReleaseGroup(key_i)
//
// It trains the same model without offload alongside and checks that losses
// and gradients are bit-identical.
//
//   memoffload-torch-example [--runtime-dir DIR] [--steps N]
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "memoffload/torch/group_offloader.h"

namespace {

struct Net : torch::nn::Module {
  explicit Net(int layers, int width) {
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i), torch::nn::Linear(width, width)));
    }
  }
  std::vector<torch::nn::Linear> blocks;
};

torch::Tensor Block(torch::nn::Linear& layer, const torch::Tensor& x) {
  return torch::gelu(layer->forward(x)) + x;
}

// Plain training step: returns the loss; gradients are left in `net`.
torch::Tensor PlainStep(Net& net, const torch::Tensor& input) {
  torch::Tensor x = input;
  for (auto& b : net.blocks) x = Block(b, x);
  torch::Tensor loss = x.pow(2).mean();
  loss.backward();
  return loss.detach();
}

// Offloaded training step; fails with a message on the first offload error.
torch::Tensor OffloadStep(Net& net, const torch::Tensor& input,
                          memoffload::torch::GroupOffloader& offloader, uint64_t* next_key) {
  const int layers = static_cast<int>(net.blocks.size());
  std::vector<uint64_t> keys(layers);
  torch::Tensor x = input;
  {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < layers; ++i) {
      keys[i] = (*next_key)++;
      memoffload::Status st = offloader.OffloadGroup(keys[i], {x}, 0, /*slot=*/i);
      if (!st.ok()) throw std::runtime_error("OffloadGroup: " + st.ToString());
      x = Block(net.blocks[i], x);
    }
  }
  // Backward starts at the last layer: bring its input back while the loss
  // is computed.
  offloader.PrefetchGroup(keys[layers - 1]);
  torch::Tensor out = x.detach().requires_grad_();
  torch::Tensor loss = out.pow(2).mean();
  loss.backward();
  torch::Tensor grad = out.grad();
  for (int i = layers - 1; i >= 0; --i) {
    if (i > 0) offloader.PrefetchGroup(keys[i - 1]);  // one window ahead
    auto saved = offloader.GetGroup(keys[i]);
    if (!saved.ok()) throw std::runtime_error("GetGroup: " + saved.status().ToString());
    torch::Tensor xi = (*saved)[0].detach().requires_grad_();
    Block(net.blocks[i], xi).backward(grad);
    grad = xi.grad();
    offloader.ReleaseGroup(keys[i]);
  }
  return loss.detach();
}

}  // namespace

int main(int argc, char** argv) {
  std::string runtime_dir;
  int steps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--runtime-dir") == 0 && i + 1 < argc) {
      runtime_dir = argv[++i];
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--runtime-dir DIR] [--steps N]\n", argv[0]);
      return 2;
    }
  }
  memoffload::torch::OffloaderOptions options;
  options.runtime_dir = runtime_dir;
  options.job_id = "torch-example";
  auto offloader = memoffload::torch::GroupOffloader::Create(options);

  torch::manual_seed(0);
  Net plain(6, 256);
  Net offloaded(6, 256);
  {
    torch::NoGradGuard no_grad;
    auto a = plain.parameters();
    auto b = offloaded.parameters();
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  torch::optim::SGD opt_plain(plain.parameters(), 0.01);
  torch::optim::SGD opt_off(offloaded.parameters(), 0.01);
  uint64_t next_key = 1;
  bool identical = true;
  try {
    for (int step = 1; step <= steps; ++step) {
      torch::Tensor input = torch::randn({64, 256});
      opt_plain.zero_grad();
      opt_off.zero_grad();
      torch::Tensor l1 = PlainStep(plain, input);
      torch::Tensor l2 = OffloadStep(offloaded, input, *offloader, &next_key);
      bool same = torch::equal(l1, l2);
      auto pa = plain.parameters();
      auto pb = offloaded.parameters();
      for (size_t i = 0; i < pa.size(); ++i)
        same = same && torch::equal(pa[i].grad(), pb[i].grad());
      identical = identical && same;
      opt_plain.step();
      opt_off.step();
      const memoffload::torch::OffloaderStats s = offloader->stats();
      std::printf(
          "step %d loss %.6f offloaded %llu B prefetched %llu B skipped %llu B blocking_rpcs "
          "%llu gradients %s\n",
          step, l2.item<float>(), static_cast<unsigned long long>(s.offloaded_bytes),
          static_cast<unsigned long long>(s.prefetched_bytes),
          static_cast<unsigned long long>(s.skipped_bytes),
          static_cast<unsigned long long>(s.blocking_rpcs), same ? "identical" : "DIFFERENT");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memoffload-torch-example: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", identical ? "losses and gradients identical to training without offload"
                                : "MISMATCH against training without offload");
  return identical ? 0 : 1;
}
