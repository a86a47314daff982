// Bodies of the fused per-member optimizer kernels. Included ONLY by kernels_{default,avx2,
// avx512}.cpp, each compiled with CPU_CAPABILITY=<ISA> (and the matching -m flags), so that
// at::vec::Vectorized is the real SIMD type of that instruction set and every definition lands in
// the namespace wide::optim::cpu::<ISA> (no ODR clash between the three copies).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "wide/ops/cpu/isa_kernel.h"
#include "wide/optim/cpu/kernels.h"

// Note [Fused per-member optimizer kernels]
// -----------------------------------------
// A wide parameter is [N, ...]: member k owns the contiguous block [k*m, (k+1)*m). One kernel
// call updates the parameter and all its optimizer state for all N members in ONE pass over
// memory (torch.optim's single-tensor path makes 5-8 passes, each a separate ATen op).
//  * Threading: at::parallel_for over the N*m elements (not over members, so one huge member or
//    many tiny ones both split evenly); each chunk walks the member blocks it overlaps and loads
//    that member's coefficients once.
//  * Coefficients (bias corrections, step sizes, 1 - beta...) are computed per member on the
//    host in double, exactly as torch.optim computes its Python floats, and cast to the dtype
//    per member, as ATen casts a Scalar argument.
//  * Per element the kernel performs the same floating-point operations in the same order as the
//    ATen kernels torch.optim's single-tensor path calls (vectorised paths): `add(x, alpha=a)` is
//    fmadd(x, a, self); `lerp` with a scalar weight w is fmadd(w, end - start, start) when
//    |w| < 0.5 else fmadd(w - 1, end - start, end); `addcmul` is fmadd(value * t1, t2, self)
//    (ATen is built with floating-point contraction); `addcdiv` is self + (value * t1) / t2.
//    SGD therefore matches torch.optim bit for bit in fp32 (AVX2/AVX512). The others differ by
//    an ulp here and there: ATen's fp32 sqrt (MKL VML) is not correctly rounded, ours is the
//    IEEE sqrt instruction. Measured: <= 1e-6 relative after 20 steps (tests/python/test_optim.py).
//    The DEFAULT build's fmadd is an unfused multiply-add, so it differs by a few ulps more.
//  * The tail of each member block (< one vector) runs the same vector code on a partial load.

WIDE_ISA_KERNEL_BEGIN

namespace wide::optim::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Memory-bound: a thread must get enough work to pay for waking it (on a busy machine, a
// parallel region can wait a whole scheduler slice for its second thread).
constexpr int64_t kGrainSize = int64_t{1} << 18;

// f(member, offset, length) over the member blocks of [0, n*m), in parallel chunks.
template <typename F>
void for_each_member_block(int64_t n, int64_t m, const F& f) {
  if (n == 0 || m == 0) return;
  at::parallel_for(0, n * m, kGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t member = i / m;
      const int64_t stop = std::min(end, (member + 1) * m);
      f(member, i, stop - i);
      i = stop;
    }
  });
}

// body(j, count) over [0, len) in vectors; the last one may be partial (count < size()).
template <typename T, typename Body>
inline void vector_loop(int64_t len, const Body& body) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  int64_t j = 0;
  for (; j + kWidth <= len; j += kWidth) body(j, kWidth);
  if (j < len) body(j, len - j);
}

// ATen's vectorised lerp with a scalar weight.
template <typename T>
inline Vectorized<T> lerp(const Vectorized<T>& start, const Vectorized<T>& end, T weight) {
  if (std::abs(weight) < T(0.5)) return at::vec::fmadd(Vectorized<T>(weight), end - start, start);
  return at::vec::fmadd(Vectorized<T>(weight - T(1)), end - start, end);
}

// update(param, grad, j, count) on every vector of one member block, with the parameter and the
// gradient (negated when maximize) loaded at element j. Each kernel runs it per member block
// (for_each_member_block) after making that member's vector constants once.
template <typename T, typename Update>
inline void for_each_vector(const T* param, const T* grad, int64_t len, bool maximize,
                            const Update& update) {
  using Vec = Vectorized<T>;
  vector_loop<T>(len, [&](int64_t j, int64_t cnt) {
    Vec g = Vec::loadu(grad + j, cnt);
    if (maximize) g = g.neg();
    update(Vec::loadu(param + j, cnt), g, j, cnt);
  });
}

// state: momentum_buffer.
template <typename T>
void step_impl(T* param, const T* grad, T* const* state, int64_t n, int64_t m, const SgdCoef* coef,
               SgdFlags flags) {
  using Vec = Vectorized<T>;
  T* const buf = state[0];
  for_each_member_block(n, m, [&](int64_t k, int64_t off, int64_t len) {
    const SgdCoef& c = coef[k];
    const bool decay = c.weight_decay != 0;
    const bool momentum = c.momentum != 0 && buf != nullptr;
    const Vec wd(static_cast<T>(c.weight_decay)), mom(static_cast<T>(c.momentum)),
        one_minus_damp(static_cast<T>(c.one_minus_dampening)), neg_lr(static_cast<T>(c.neg_lr));
    T* p = param + off;
    T* b_ptr = buf != nullptr ? buf + off : nullptr;
    for_each_vector(p, grad + off, len, flags.maximize, [&](Vec pv, Vec g, int64_t j, int64_t cnt) {
      if (decay) g = at::vec::fmadd(pv, wd, g);                 // grad.add(param, alpha=wd)
      if (momentum) {
        Vec b = flags.init_buffer ? g                             // buf = grad.clone()
                                  : at::vec::fmadd(g, one_minus_damp, Vec::loadu(b_ptr + j, cnt) * mom);
        b.store(b_ptr + j, cnt);
        g = flags.nesterov ? at::vec::fmadd(b, mom, g) : b;     // grad.add(buf, alpha=momentum)
      }
      at::vec::fmadd(g, neg_lr, pv).store(p + j, cnt);          // param.add_(grad, alpha=-lr)
    });
  });
}

// state: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad).
template <typename T>
void step_impl(T* param, const T* grad, T* const* state, int64_t n, int64_t m, const AdamCoef* coef,
               AdamFlags flags) {
  using Vec = Vectorized<T>;
  T *const exp_avg = state[0], *const exp_avg_sq = state[1], *const max_exp_avg_sq = state[2];
  for_each_member_block(n, m, [&](int64_t k, int64_t off, int64_t len) {
    const AdamCoef& c = coef[k];
    const bool decay = c.weight_decay != 0;
    const T w1 = static_cast<T>(c.one_minus_beta1);
    const Vec wd(static_cast<T>(c.weight_decay)), decay_factor(static_cast<T>(c.decay)),
        beta2(static_cast<T>(c.beta2)), one_minus_beta2(static_cast<T>(c.one_minus_beta2)),
        bc2_sqrt(static_cast<T>(c.bias_correction2_sqrt)), eps(static_cast<T>(c.eps)),
        neg_step(static_cast<T>(c.neg_step_size));
    T* p = param + off;
    T* m_ptr = exp_avg + off;
    T* v_ptr = exp_avg_sq + off;
    T* vmax_ptr = flags.amsgrad ? max_exp_avg_sq + off : nullptr;
    for_each_vector(p, grad + off, len, flags.maximize, [&](Vec pv, Vec g, int64_t j, int64_t cnt) {
      if (decay) {
        if (flags.decoupled) {
          pv = pv * decay_factor;                               // param.mul_(1 - lr * wd)
        } else {
          g = at::vec::fmadd(pv, wd, g);                        // grad.add(param, alpha=wd)
        }
      }
      const Vec mv = lerp(Vec::loadu(m_ptr + j, cnt), g, w1);   // exp_avg.lerp_(grad, 1 - beta1)
      Vec vv = Vec::loadu(v_ptr + j, cnt) * beta2;              // exp_avg_sq.mul_(beta2)
      vv = at::vec::fmadd(one_minus_beta2 * g, g, vv);          //   .addcmul_(grad, grad, 1 - beta2)
      Vec v_hat = vv;
      if (flags.amsgrad) {
        v_hat = at::vec::maximum(Vec::loadu(vmax_ptr + j, cnt), vv);
        v_hat.store(vmax_ptr + j, cnt);
      }
      const Vec denom = v_hat.sqrt() / bc2_sqrt + eps;          // (v.sqrt() / bc2_sqrt).add_(eps)
      (pv + neg_step * mv / denom).store(p + j, cnt);           // param.addcdiv_(m, denom, -step_size)
      mv.store(m_ptr + j, cnt);
      vv.store(v_ptr + j, cnt);
    });
  });
}

// state: square_avg, grad_avg (centered), momentum_buffer.
template <typename T>
void step_impl(T* param, const T* grad, T* const* state, int64_t n, int64_t m,
               const RmspropCoef* coef, RmspropFlags flags) {
  using Vec = Vectorized<T>;
  T *const square_avg = state[0], *const grad_avg = state[1], *const buf = state[2];
  for_each_member_block(n, m, [&](int64_t k, int64_t off, int64_t len) {
    const RmspropCoef& c = coef[k];
    const bool decay = c.weight_decay != 0;
    const bool momentum = flags.has_momentum_buffer && c.momentum > 0;
    const T one_minus_alpha_s = static_cast<T>(c.one_minus_alpha);
    const Vec wd(static_cast<T>(c.weight_decay)), alpha(static_cast<T>(c.alpha)),
        one_minus_alpha(one_minus_alpha_s), eps(static_cast<T>(c.eps)),
        mom(static_cast<T>(c.momentum)), neg_lr(static_cast<T>(c.neg_lr)), one(T(1)), minus_one(T(-1));
    T* p = param + off;
    T* sq_ptr = square_avg + off;
    T* ga_ptr = flags.centered ? grad_avg + off : nullptr;
    T* b_ptr = momentum ? buf + off : nullptr;
    for_each_vector(p, grad + off, len, flags.maximize, [&](Vec pv, Vec g, int64_t j, int64_t cnt) {
      if (decay) g = at::vec::fmadd(pv, wd, g);                 // grad.add(param, alpha=wd)
      Vec sq = Vec::loadu(sq_ptr + j, cnt) * alpha;             // square_avg.mul_(alpha)
      sq = at::vec::fmadd(one_minus_alpha * g, g, sq);          //   .addcmul_(grad, grad, 1 - alpha)
      sq.store(sq_ptr + j, cnt);
      Vec avg;
      if (flags.centered) {
        const Vec ga = lerp(Vec::loadu(ga_ptr + j, cnt), g, one_minus_alpha_s);
        ga.store(ga_ptr + j, cnt);
        avg = at::vec::fmadd(minus_one * ga, ga, sq).sqrt();    // square_avg.addcmul(ga, ga, -1).sqrt_()
      } else {
        avg = sq.sqrt();
      }
      avg = avg + eps;                                          // avg.add_(eps)
      if (momentum) {
        const Vec b = Vec::loadu(b_ptr + j, cnt) * mom + one * g / avg;  // buf.mul_(m).addcdiv_(g, avg)
        b.store(b_ptr + j, cnt);
        at::vec::fmadd(b, neg_lr, pv).store(p + j, cnt);        // param.add_(buf, alpha=-lr)
      } else {
        (pv + neg_lr * g / avg).store(p + j, cnt);              // param.addcdiv_(grad, avg, -lr)
      }
    });
  });
}

// state: state_sum.
template <typename T>
void step_impl(T* param, const T* grad, T* const* state, int64_t n, int64_t m,
               const AdagradCoef* coef, AdagradFlags flags) {
  using Vec = Vectorized<T>;
  T* const sum = state[0];
  for_each_member_block(n, m, [&](int64_t k, int64_t off, int64_t len) {
    const AdagradCoef& c = coef[k];
    const bool decay = c.weight_decay != 0;
    const Vec wd(static_cast<T>(c.weight_decay)), eps(static_cast<T>(c.eps)),
        neg_clr(static_cast<T>(c.neg_clr)), one(T(1));
    T* p = param + off;
    T* s_ptr = sum + off;
    for_each_vector(p, grad + off, len, flags.maximize, [&](Vec pv, Vec g, int64_t j, int64_t cnt) {
      if (decay) g = at::vec::fmadd(pv, wd, g);                 // grad.add(param, alpha=wd)
      const Vec s = at::vec::fmadd(one * g, g, Vec::loadu(s_ptr + j, cnt));  // state_sum.addcmul_(g, g, 1)
      s.store(s_ptr + j, cnt);
      const Vec std = s.sqrt() + eps;                           // state_sum.sqrt().add_(eps)
      (pv + neg_clr * g / std).store(p + j, cnt);               // param.addcdiv_(g, std, -clr)
    });
  });
}

}  // namespace

#define WIDE_OPTIM_DEFINE_STEP(T, Opt)                                                            \
  void step(T* param, const T* grad, T* const* state, int64_t n, int64_t m, const Opt##Coef* coef, \
            Opt##Flags flags) {                                                                   \
    step_impl<T>(param, grad, state, n, m, coef, flags);                                          \
  }
#define WIDE_OPTIM_DEFINE_KERNELS(T) \
  WIDE_OPTIM_DEFINE_STEP(T, Sgd)     \
  WIDE_OPTIM_DEFINE_STEP(T, Adam)    \
  WIDE_OPTIM_DEFINE_STEP(T, Rmsprop) \
  WIDE_OPTIM_DEFINE_STEP(T, Adagrad)

WIDE_OPTIM_DEFINE_KERNELS(float)
WIDE_OPTIM_DEFINE_KERNELS(double)
#undef WIDE_OPTIM_DEFINE_KERNELS
#undef WIDE_OPTIM_DEFINE_STEP

}  // namespace wide::optim::cpu::CPU_CAPABILITY

WIDE_ISA_KERNEL_END
