// Whether an op may take one of its hand-written CPU paths: not while tracing (untraced), and not
// where its autograd is a C++ torch::autograd::Function or none (plain_autograd, Note [Kernels
// under transforms]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <initializer_list>

// Note [Kernels under transforms]
// -------------------------------
// The CPU kernels of the norms, the conv's per-member loop in training and the attention kernel
// are differentiated by C++ autograd Functions (or, with no gradient wanted, not at all). Two
// things those cannot serve: torch.func's transforms (grad, vjp, vmap, jacrev, hessian), which
// refuse C++ autograd Functions, and forward-mode tangents (torch.autograd.forward_ad,
// torch.func.jvp), for which they have no formula; an op with no autograd at all would even hand
// back no tangent, silently. With either in play the ops run their composites of ATen ops,
// which compute what the members' own modules compute under the same transform (or refuse it as
// they do).

namespace wide::detail {

/// True when none of `ts` is a Python tensor subclass or functional tensor and no Python mode is
/// active: not tracing (fake tensors under torch.compile/export), so a path a traced graph should
/// not record, or one that runs member work on other threads, may run.
inline bool untraced(std::initializer_list<const at::Tensor*> ts) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) return false;
  const c10::DispatchKeySet python({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  for (const at::Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->key_set().has_any(python)) return false;
  }
  return true;
}

/// True when no torch.func transform is active and none of `ts` carries a forward-mode tangent
/// or a functorch wrapper: the kernels with C++ autograd Functions may run.
inline bool plain_autograd(std::initializer_list<const at::Tensor*> ts) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) return false;
  const c10::DispatchKeySet functorch({c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched});
  for (const at::Tensor* t : ts) {
    if (t == nullptr || !t->defined()) continue;
    if (t->key_set().has_any(functorch) || t->_fw_grad(/*level=*/0).defined()) return false;
  }
  return true;
}

}  // namespace wide::detail
