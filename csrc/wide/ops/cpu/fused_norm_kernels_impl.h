// Body of the kernel of wide::fused_norm. Included ONLY by
// fused_norm_kernels_{default,avx2,avx512}.cpp, each compiled with CPU_CAPABILITY=<ISA> and that
// ISA's -m flags (see CMakeLists.txt), so that at::vec::Vectorized is the real SIMD type and the
// definitions land in wide::ops::cpu::<ISA>.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "wide/ops/cpu/isa_kernel.h"
#include "wide/ops/cpu/fused_norm_kernels.h"

// Note [Fused per-member norm kernel]
// -----------------------------------
// The composite wide LayerNorm normalises all N*rows rows with ATen's kernel and then applies
// the per-member affine with one addcmul: two passes over the wide activation, and ATen's CPU
// layer norm without gamma/beta is itself about 2x slower than with them (measured, 1 thread:
// 300 vs 153 us for 16 x 256 x 64). A residual block adds a third pass (the add). This kernel
// does, per row and in one sweep of memory: s = x (+ residual), stored into y; mean and variance
// of the row (two passes over the row while it is in L1, in the accumulation type); then
// y = (s - mean) * rstd * weight[member] + bias[member] in place. RMSNorm skips the mean and the
// bias. It has no backward: it is the inference path of wide::layer_norm / wide::rms_norm /
// wide::add_layer_norm when no input needs a gradient (see Note [wide::fused_norm] in norm.cpp).
// Threading: at::parallel_for over rows, with a grain of about 32K elements.
//
// Note [Fused per-member norm backward]
// -------------------------------------
// With a gradient wanted, wide::fused_norm is differentiable (its autograd function in
// fused_norm_autograd.cpp) and this kernel is its backward. Per row it recomputes the forward's
// statistics with the same code (row_stats; the sum with the residual too), so nothing but the
// inputs is saved, then with xhat = (s - mean) * rstd and gw = dy * weight[member]:
//   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))      (RMSNorm: no mean(gw) term)
//   dweight[member] += dy * xhat,  dbias[member] += dy
// in two sweeps of the row while it is in L1 (the residual's gradient is dx). The composite's
// backward takes about six passes over the wide activation. dweight/dbias are reductions over a
// member's rows: each member's rows are split into a few tasks (enough for every thread), each
// summing into its own slot, and the slots are added at the end; the order is fixed, so the
// result does not depend on the thread count's scheduling.

// Note [N-first group norm kernel]
// --------------------------------
// wide::group_norm runs on the channel-packed layout (Note [wide norms]): fed an N-first
// activation it first packs it (a copy), and an N-first reader of its result pays a second one.
// For a GroupNorm between N-first ops (a lone norm, or one after a Linear) those two copies cost
// more than the norm (measured 45 us each against 105 us for the norm, 16 x 8 x 32 x 16 x 16).
// But on N-first memory [N, B, C, *] each (member, sample, group) is ALREADY one contiguous row
// of C/G * spatial values, so this kernel normalises the rows in place of any layout change:
// statistics with row_stats (as fused_norm), then per channel of the row
// y = x * (rstd * w) + (b - mean * rstd * w) over its spatial values, with the member's own
// weight and bias. One read for the statistics and one read and write for the result, like
// ATen's GroupNorm on one member. Inference only (wide::group_norm_nfirst takes it when no
// gradient is wanted).

// Note [Batch norm training kernel]
// ---------------------------------
// wide::batch_norm in training normalises the packed activation [B, N*C, *] per channel with the
// batch's statistics. ATen 2.13's CPU kernel collects a channels-first input's statistics with
// scalar loops: on [8, 256, 32, 32] (2 threads) its forward takes 1.35 ms against 0.11 ms for
// the same normalisation in eval mode and 0.10 ms for a copy; in a small conv net's training
// step the norms cost a third of what the convs do. wide::fused_batch_norm does, per channel (one
// task per block of channels): the sum of its B rows of `inner` values (vector lanes within a
// row, rows added in double); the sum of squared deviations from that mean the same way (a
// second read, the channel's values still in L2); then y = x * scale + shift with
// scale = weight * invstd and shift = bias - mean * scale, as ATen computes it. It returns the
// mean and invstd = 1/sqrt(biased variance + eps) (what ATen saves for the backward) and the
// unbiased variance (for the running statistics).
// Its backward, wide::fused_batch_norm_backward, is ATen's formula for training, with
// xhat = (x - mean) * invstd and M = B * inner values per channel:
//   dbias = sum(dy), dweight = sum(dy * xhat), dx = weight * invstd * (dy - dbias/M - xhat * dweight/M)
// in two sweeps per channel (the two sums, then dx), against 0.53 ms for ATen's on the shape
// above. A channel is one task's and its sums run in a fixed order, so results do not depend on
// the thread count.

WIDE_ISA_KERNEL_BEGIN

namespace wide::ops::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using ::wide::cpu_vec::CPU_CAPABILITY::lanes_sum;

// Mean (0 for RMSNorm) and 1/sqrt(variance + eps) of one row of d elements, in T: two passes
// over the row while it is in L1. The forward and the backward kernels share it, so the backward
// recomputes exactly the statistics the forward used.
template <typename T>
std::pair<T, T> row_stats(const T* src, int64_t d, double eps, bool rms) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  T mean = 0;
  if (!rms) {
    V acc(T(0));
    int64_t j = 0;
    for (; j + W <= d; j += W) acc = acc + V::loadu(src + j);
    T s = lanes_sum(acc);
    for (; j < d; ++j) s += src[j];
    mean = s / static_cast<T>(d);
  }
  const V vmean(mean);
  V acc(T(0));
  int64_t j = 0;
  for (; j + W <= d; j += W) {
    V c = V::loadu(src + j) - vmean;
    acc = at::vec::fmadd(c, c, acc);
  }
  T sq = lanes_sum(acc);
  for (; j < d; ++j) sq += (src[j] - mean) * (src[j] - mean);
  return {mean, static_cast<T>(1) / std::sqrt(sq / static_cast<T>(d) + static_cast<T>(eps))};
}

// s = x + residual into out (rounded to T as the composite's add is).
template <typename T>
void add_rows(const T* x, const T* residual, T* out, int64_t d) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + W <= d; j += W) (V::loadu(x + j) + V::loadu(residual + j)).store(out + j);
  if (j < d) (V::loadu(x + j, d - j) + V::loadu(residual + j, d - j)).store(out + j, d - j);
}

template <typename T>
void fused_norm_impl(const T* x, const T* residual, T* y, const T* weight, const T* bias,
                     int64_t rows, int64_t rows_per_member, int64_t d, double eps, bool rms) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t member = r / rows_per_member;
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const T* src = xr;
      if (residual != nullptr) {
        add_rows(xr, residual + r * d, yr, d);
        src = yr;
      }
      const auto [mean, rstd] = row_stats(src, d, eps, rms);
      const V vmean(mean);
      const V vrstd(rstd);
      const T* w = weight != nullptr ? weight + member * d : nullptr;
      const T* b = bias != nullptr ? bias + member * d : nullptr;
      auto apply = [&](int64_t at, int64_t count) {
        V v = (V::loadu(src + at, count) - vmean) * vrstd;
        if (w != nullptr) v = v * V::loadu(w + at, count);
        if (b != nullptr) v = v + V::loadu(b + at, count);
        v.store(yr + at, count);
      };
      int64_t j = 0;
      for (; j + W <= d; j += W) apply(j, W);
      if (j < d) apply(j, d - j);
    }
  });
}

// Backward of fused_norm (Note [Fused per-member norm backward]).
template <typename T>
void fused_norm_backward_impl(const T* dy, const T* x, const T* residual, const T* weight, T* dx,
                              T* dw, T* db, int64_t rows, int64_t rows_per_member, int64_t d,
                              double eps, bool rms) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t n = rows / rows_per_member;
  // Each member's rows are split into `chunks` tasks so that every thread has work even when
  // there are fewer members than threads; each task sums its rows' dw/db into its own slot.
  const int64_t chunks = std::min<int64_t>(
      rows_per_member, std::max<int64_t>(1, (2 * at::get_num_threads() + n - 1) / n));
  const int64_t tasks = n * chunks;
  std::vector<T> pw(dw != nullptr ? tasks * d : 0, T(0)), pb(db != nullptr ? tasks * d : 0, T(0));
  const T inv_d = T(1) / static_cast<T>(d);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sum_row(residual != nullptr ? d : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t member = task / chunks, c = task % chunks;
      const int64_t r0 = member * rows_per_member + c * rows_per_member / chunks;
      const int64_t r1 = member * rows_per_member + (c + 1) * rows_per_member / chunks;
      const T* w = weight != nullptr ? weight + member * d : nullptr;
      T* tw = dw != nullptr ? pw.data() + task * d : nullptr;
      T* tb = db != nullptr ? pb.data() + task * d : nullptr;
      for (int64_t r = r0; r < r1; ++r) {
        const T* src = x + r * d;
        if (residual != nullptr) {
          add_rows(src, residual + r * d, sum_row.data(), d);
          src = sum_row.data();
        }
        const T* g = dy + r * d;
        const auto [mean, rstd] = row_stats(src, d, eps, rms);
        const V vmean(mean), vrstd(rstd);
        // xhat = (s - mean) * rstd; gw = dy * weight. Sums of gw and gw * xhat, and dw/db.
        V acc_g(T(0)), acc_gx(T(0));
        auto sums = [&](int64_t j, int64_t count) {
          const V xhat = (V::loadu(src + j, count) - vmean) * vrstd;
          const V gv = V::loadu(g + j, count);
          const V gw = w != nullptr ? gv * V::loadu(w + j, count) : gv;
          acc_g = acc_g + gw;
          acc_gx = at::vec::fmadd(gw, xhat, acc_gx);
          if (tw != nullptr) at::vec::fmadd(gv, xhat, V::loadu(tw + j, count)).store(tw + j, count);
          if (tb != nullptr) (V::loadu(tb + j, count) + gv).store(tb + j, count);
        };
        int64_t j = 0;
        for (; j + W <= d; j += W) sums(j, W);
        if (j < d) sums(j, d - j);  // tail lanes load as zeros: they add nothing
        if (dx == nullptr) continue;
        const V mean_g(rms ? T(0) : lanes_sum(acc_g) * inv_d);
        const V mean_gx(lanes_sum(acc_gx) * inv_d);
        T* out = dx + r * d;
        auto grad = [&](int64_t at, int64_t count) {
          const V xhat = (V::loadu(src + at, count) - vmean) * vrstd;
          const V gv = V::loadu(g + at, count);
          const V gw = w != nullptr ? gv * V::loadu(w + at, count) : gv;
          (vrstd * (gw - mean_g - xhat * mean_gx)).store(out + at, count);
        };
        for (j = 0; j + W <= d; j += W) grad(j, W);
        if (j < d) grad(j, d - j);
      }
    }
  });
  // Sum the tasks' slots per member (chunks is small: a few per member at most).
  for (int64_t member = 0; member < n; ++member) {
    for (auto [slots, out] : {std::pair{pw.data(), dw}, std::pair{pb.data(), db}}) {
      if (out == nullptr) continue;
      T* o = out + member * d;
      std::copy(slots + member * chunks * d, slots + (member * chunks + 1) * d, o);
      for (int64_t c = 1; c < chunks; ++c) {
        const T* sl = slots + (member * chunks + c) * d;
        for (int64_t j = 0; j < d; ++j) o[j] += sl[j];
      }
    }
  }
}

// N-first GroupNorm (Note [N-first group norm kernel]).
template <typename T>
void group_norm_impl(const T* x, T* y, const T* weight, const T* bias, int64_t n, int64_t batch,
                     int64_t groups, int64_t cg, int64_t inner, double eps) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t d = cg * inner, rows = n * batch * groups, channels = groups * cg;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t member = r / (batch * groups);
      const int64_t c0 = member * channels + (r % groups) * cg;
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const auto [mean, rstd] = row_stats(xr, d, eps, /*rms=*/false);
      for (int64_t c = 0; c < cg; ++c) {
        const T scale = weight != nullptr ? rstd * weight[c0 + c] : rstd;
        const T shift = (bias != nullptr ? bias[c0 + c] : T(0)) - mean * scale;
        const V vs(scale), vb(shift);
        const T* xc = xr + c * inner;
        T* yc = yr + c * inner;
        int64_t j = 0;
        for (; j + W <= inner; j += W) at::vec::fmadd(V::loadu(xc + j), vs, vb).store(yc + j);
        if (j < inner) at::vec::fmadd(V::loadu(xc + j, inner - j), vs, vb).store(yc + j, inner - j);
      }
    }
  });
}


// Blocks of whole channels of about 32K values, one at::parallel_for task each.
int64_t channel_grain(int64_t per_channel) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(per_channel, 1));
}

// The sum over a channel's `batch` rows (row b at x + b * stride, `inner` values each) of f(v) for
// every value v, where f is given for a vector (fv) and a scalar (fs): lanes within a row, the
// rows' sums added in double.
template <typename T, typename FV, typename FS>
double channel_sum(const T* x, int64_t batch, int64_t stride, int64_t inner, FV&& fv, FS&& fs) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  double sum = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const T* row = x + b * stride;
    V acc(T(0));
    int64_t j = 0;
    for (; j + W <= inner; j += W) acc = acc + fv(V::loadu(row + j));
    T s = lanes_sum(acc);
    for (; j < inner; ++j) s += fs(row[j]);
    sum += static_cast<double>(s);
  }
  return sum;
}

// BatchNorm in training, forward (Note [Batch norm training kernel]).
template <typename T>
void batch_norm_train_impl(const T* x, T* y, const T* weight, const T* bias, T* mean_out, T* invstd_out,
                           T* var_out, int64_t batch, int64_t channels, int64_t inner, double eps) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t count = batch * inner, stride = channels * inner;
  at::parallel_for(0, channels, channel_grain(count), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const T* xc = x + c * inner;
      const T mean = static_cast<T>(
          channel_sum(xc, batch, stride, inner, [](V v) { return v; }, [](T v) { return v; }) / count);
      const V vmean(mean);
      const double sq = channel_sum(
          xc, batch, stride, inner, [&](V v) { return (v - vmean) * (v - vmean); },
          [&](T v) { return (v - mean) * (v - mean); });
      const T invstd = static_cast<T>(1.0 / std::sqrt(sq / count + eps));
      mean_out[c] = mean;
      invstd_out[c] = invstd;
      var_out[c] = static_cast<T>(count > 1 ? sq / (count - 1) : std::numeric_limits<double>::quiet_NaN());
      const T scale = weight != nullptr ? weight[c] * invstd : invstd;
      const V vs(scale), vb((bias != nullptr ? bias[c] : T(0)) - mean * scale);
      for (int64_t b = 0; b < batch; ++b) {
        const T* xr = xc + b * stride;
        T* yr = y + c * inner + b * stride;
        int64_t j = 0;
        for (; j + W <= inner; j += W) at::vec::fmadd(V::loadu(xr + j), vs, vb).store(yr + j);
        if (j < inner) at::vec::fmadd(V::loadu(xr + j, inner - j), vs, vb).store(yr + j, inner - j);
      }
    }
  });
}

// BatchNorm in training, backward (Note [Batch norm training kernel]).
template <typename T>
void batch_norm_backward_impl(const T* dy, const T* x, const T* weight, const T* mean, const T* invstd,
                              T* dx, T* dw, T* db, int64_t batch, int64_t channels, int64_t inner) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const int64_t count = batch * inner, stride = channels * inner;
  at::parallel_for(0, channels, channel_grain(2 * count), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const V vmean(mean[c]);
      double sum_g = 0, sum_gx = 0;  // sum(dy), sum(dy * (x - mean))
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t off = c * inner + b * stride;
        V acc_g(T(0)), acc_gx(T(0));
        int64_t j = 0;
        // the tail loads zeros past the row: a zero dy adds nothing to either sum
        for (; j < inner; j += W) {
          const int64_t n = std::min<int64_t>(W, inner - j);
          const V g = V::loadu(dy + off + j, n);
          acc_g = acc_g + g;
          acc_gx = at::vec::fmadd(g, V::loadu(x + off + j, n) - vmean, acc_gx);
        }
        sum_g += static_cast<double>(lanes_sum(acc_g));
        sum_gx += static_cast<double>(lanes_sum(acc_gx));
      }
      if (db != nullptr) db[c] = static_cast<T>(sum_g);
      if (dw != nullptr) dw[c] = static_cast<T>(sum_gx * invstd[c]);
      if (dx == nullptr) continue;
      const T is = invstd[c];
      const V scale((weight != nullptr ? weight[c] : T(1)) * is);
      const V mean_g(static_cast<T>(sum_g / count));
      const V proj(static_cast<T>(sum_gx / count) * is * is);
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t off = c * inner + b * stride;
        for (int64_t j = 0; j < inner; j += W) {
          const int64_t n = std::min<int64_t>(W, inner - j);
          const V g = V::loadu(dy + off + j, n);
          const V xc = V::loadu(x + off + j, n) - vmean;
          ((g - mean_g - xc * proj) * scale).store(dx + off + j, n);
        }
      }
    }
  });
}

}  // namespace

void fused_norm(const float* x, const float* residual, float* y, const float* weight,
                const float* bias, int64_t rows, int64_t rows_per_member, int64_t d, double eps,
                bool rms) {
  fused_norm_impl(x, residual, y, weight, bias, rows, rows_per_member, d, eps, rms);
}

void fused_norm(const double* x, const double* residual, double* y, const double* weight,
                const double* bias, int64_t rows, int64_t rows_per_member, int64_t d, double eps,
                bool rms) {
  fused_norm_impl(x, residual, y, weight, bias, rows, rows_per_member, d, eps, rms);
}

void fused_norm_backward(const float* dy, const float* x, const float* residual, const float* weight,
                         float* dx, float* dw, float* db, int64_t rows, int64_t rows_per_member,
                         int64_t d, double eps, bool rms) {
  fused_norm_backward_impl(dy, x, residual, weight, dx, dw, db, rows, rows_per_member, d, eps, rms);
}

void fused_norm_backward(const double* dy, const double* x, const double* residual,
                         const double* weight, double* dx, double* dw, double* db, int64_t rows,
                         int64_t rows_per_member, int64_t d, double eps, bool rms) {
  fused_norm_backward_impl(dy, x, residual, weight, dx, dw, db, rows, rows_per_member, d, eps, rms);
}

void group_norm(const float* x, float* y, const float* weight, const float* bias, int64_t n,
                int64_t batch, int64_t groups, int64_t channels_per_group, int64_t inner, double eps) {
  group_norm_impl(x, y, weight, bias, n, batch, groups, channels_per_group, inner, eps);
}

void group_norm(const double* x, double* y, const double* weight, const double* bias, int64_t n,
                int64_t batch, int64_t groups, int64_t channels_per_group, int64_t inner, double eps) {
  group_norm_impl(x, y, weight, bias, n, batch, groups, channels_per_group, inner, eps);
}

void batch_norm_train(const float* x, float* y, const float* weight, const float* bias, float* mean,
                      float* invstd, float* var, int64_t batch, int64_t channels, int64_t inner, double eps) {
  batch_norm_train_impl(x, y, weight, bias, mean, invstd, var, batch, channels, inner, eps);
}

void batch_norm_train(const double* x, double* y, const double* weight, const double* bias, double* mean,
                      double* invstd, double* var, int64_t batch, int64_t channels, int64_t inner, double eps) {
  batch_norm_train_impl(x, y, weight, bias, mean, invstd, var, batch, channels, inner, eps);
}

void batch_norm_backward(const float* dy, const float* x, const float* weight, const float* mean,
                         const float* invstd, float* dx, float* dw, float* db, int64_t batch, int64_t channels,
                         int64_t inner) {
  batch_norm_backward_impl(dy, x, weight, mean, invstd, dx, dw, db, batch, channels, inner);
}

void batch_norm_backward(const double* dy, const double* x, const double* weight, const double* mean,
                         const double* invstd, double* dx, double* dw, double* db, int64_t batch,
                         int64_t channels, int64_t inner) {
  batch_norm_backward_impl(dy, x, weight, mean, invstd, dx, dw, db, batch, channels, inner);
}

}  // namespace wide::ops::cpu::CPU_CAPABILITY

WIDE_ISA_KERNEL_END
