// Version counters of the tensors the fused optimizer steps write.
//
// Note [Optimizer steps bump version counters]
// --------------------------------------------
// The steps (wide::sgd_step, adam_step, rmsprop_step, adagrad_step) write their parameter and
// state tensors from CPU kernels that autograd never sees. An in-place ATen op bumps the version
// counter of what it writes in its ADInplaceOrView kernel; these ops get the same, one boxed
// kernel for all four: it runs the step below ADInplaceOrView and then bumps every argument the
// schema marks as written (Tensor(a!)). Without it a parameter stepped between a forward and its
// backward gives silently wrong gradients instead of autograd's "modified by an inplace
// operation" error, and caches keyed on versions (the eval graph's folded conv weights,
// Note [The fold cache] in python/wide_compiler/fx/fold.py) would go stale. Inference tensors
// have no version counter and skip this key, as for ATen's own in-place ops.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <vector>

namespace wide {
namespace {

void step_then_bump_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    const c10::IValue& v = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && v.isTensor()) written.push_back(v.toTensor());
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  for (const at::Tensor& t : written) {
    if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace
}  // namespace wide

TORCH_LIBRARY_IMPL(wide, ADInplaceOrView, m) {
  for (const char* name : {"sgd_step", "adam_step", "rmsprop_step", "adagrad_step"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&wide::step_then_bump_versions>());
  }
}
