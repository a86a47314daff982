// Serve N fused members from C++: load the AOTInductor package written by export_model.py, run
// one request batch through all N members at once, print each member's predictions and the
// ensemble's, and check every member against the original Python module's output.
//
//   python examples/cpp/export_model.py build/examples/model
//   build/examples/serve build/examples/model
//
// Links only LibTorch and WideCompiler::wide (whose library registers the wide ops the package
// calls). Exit status 1 if a member differs from its Python reference.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::string classes(const torch::Tensor& labels) {  // a 1-D integer tensor as "[3, 1, 4]"
  std::string out = "[";
  for (int64_t j = 0; j < labels.numel(); ++j) {
    out += (j ? ", " : "") + std::to_string(labels[j].item<int64_t>());
  }
  return out + "]";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: serve MODEL_DIR   (written by examples/cpp/export_model.py)\n";
    return 2;
  }
  const std::string dir = argv[1];
  torch::NoGradGuard no_grad;
  torch::inductor::AOTIModelPackageLoader loader(dir + "/wide_convnet.pt2");

  std::ifstream file(dir + "/reference.pt", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  auto reference = torch::pickle_load(bytes).toGenericDict();
  torch::Tensor batch = reference.at("input").toTensor();        // [B, 3, H, W]: one request
  torch::Tensor expected = reference.at("expected").toTensor();  // [N, B, 10]: each member alone
  const int64_t n = expected.size(0);

  // The package takes N-first inputs [N, B, ...]: every member gets the same request here.
  torch::Tensor input = batch.unsqueeze(0).expand({n, -1, -1, -1, -1}).contiguous();
  torch::Tensor logits = loader.run({input}).at(0);               // [N, B, 10]

  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    const double err = (logits[i] - expected[i]).abs().max().item<double>();
    ok = ok && torch::allclose(logits[i], expected[i], 1e-4, 1e-5);
    std::printf("member %lld: predictions %s  max |C++ - Python| = %.2e\n", static_cast<long long>(i),
                classes(logits[i].argmax(-1)).c_str(), err);
  }
  torch::Tensor ensemble = logits.softmax(-1).mean(0).argmax(-1);
  std::printf("ensemble of %lld: predictions %s\n", static_cast<long long>(n),
              classes(ensemble).c_str());
  std::printf(ok ? "every member matches its Python module\n"
                 : "MISMATCH: a member differs from its Python module\n");
  return ok ? 0 : 1;
}
