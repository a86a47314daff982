// wide::*_step: fused per-member optimizer steps on stacked [N, ...] parameters.
//
// Member k of every tensor is slice [k]. Each hyperparameter is a real tensor with one value per
// member ([N]) or one shared value ([] or [1]). Every call updates the parameter and its state
// for all N members, exactly as torch.optim's single-tensor path would update each member alone
// (see Note [Fused per-member optimizer kernels] in cpu/kernels_impl.h). These functions call
// through the dispatcher: the hand-written CPU kernel on CPU (float, double), the ATen composite
// (the *_composite functions below) on every other device and dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace wide {

/// SGD: d = grad (+ wd * param); buf = momentum * buf + (1 - dampening) * d (buf = d when
/// init_buffer); d = nesterov ? d + momentum * buf : buf (members with momentum 0 skip the
/// buffer); param -= lr * d.
void sgd_step(const at::Tensor& param, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& lr,
              const at::Tensor& weight_decay, const at::Tensor& momentum,
              const at::Tensor& dampening, bool nesterov = false, bool maximize = false,
              bool init_buffer = false);

/// Adam / AdamW (decoupled_weight_decay) with optional AMSGrad; step [N] is incremented first
/// and the bias corrections are per member.
void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const at::Tensor& step, const at::Tensor& lr, const at::Tensor& beta1,
               const at::Tensor& beta2, const at::Tensor& eps, const at::Tensor& weight_decay,
               bool decoupled_weight_decay = false, bool amsgrad = false, bool maximize = false);

/// RMSprop (optionally centered, with momentum for members whose momentum > 0).
void rmsprop_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg,
                  const std::optional<at::Tensor>& grad_avg,
                  const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& step,
                  const at::Tensor& lr, const at::Tensor& alpha, const at::Tensor& eps,
                  const at::Tensor& weight_decay, const at::Tensor& momentum,
                  bool centered = false, bool maximize = false);

/// Adagrad: clr = lr / (1 + (step - 1) * lr_decay) per member.
void adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum,
                  const at::Tensor& step, const at::Tensor& lr, const at::Tensor& lr_decay,
                  const at::Tensor& weight_decay, const at::Tensor& eps, bool maximize = false);

namespace optim {

/// The same steps built from ATen ops: the CompositeExplicitAutograd kernels (every device and
/// dtype without a hand-written kernel), and the reference the CPU kernels are tested against.
void sgd_step_composite(const at::Tensor& param, const at::Tensor& grad,
                        const std::optional<at::Tensor>& momentum_buffer, const at::Tensor& lr,
                        const at::Tensor& weight_decay, const at::Tensor& momentum,
                        const at::Tensor& dampening, bool nesterov, bool maximize,
                        bool init_buffer);
void adam_step_composite(const at::Tensor& param, const at::Tensor& grad,
                         const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                         const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& step,
                         const at::Tensor& lr, const at::Tensor& beta1, const at::Tensor& beta2,
                         const at::Tensor& eps, const at::Tensor& weight_decay,
                         bool decoupled_weight_decay, bool amsgrad, bool maximize);
void rmsprop_step_composite(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& square_avg, const std::optional<at::Tensor>& grad_avg,
                            const std::optional<at::Tensor>& momentum_buffer,
                            const at::Tensor& step, const at::Tensor& lr, const at::Tensor& alpha,
                            const at::Tensor& eps, const at::Tensor& weight_decay,
                            const at::Tensor& momentum, bool centered, bool maximize);
void adagrad_step_composite(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& state_sum, const at::Tensor& step,
                            const at::Tensor& lr, const at::Tensor& lr_decay,
                            const at::Tensor& weight_decay, const at::Tensor& eps, bool maximize);

}  // namespace optim
}  // namespace wide
