"""Judging a float32 result against a float64 run of its members (Note [The float64 reference]):
the wide model must be as close to the exact result as the members themselves, with nudged
float32 runs of a member to tell a rounding flip from a defect."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .compare import _abs_err, _check_member_layout, _widest
from .tolerances import _REAL_OF_COMPLEX

__all__ = ["BLIND_SHARE", "NOISE_FACTOR", "NOISE_FLOOR_EPS", "NUDGE_EPS", "RESAMPLES"]


# Note [The float64 reference]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A float32 model is not held to fixed tolerances by default. A fixed bound is too tight for a
# deep model whose own float32 rounding is amplified -- a stock ResNet-18 in train mode on 32x32
# images in batches of 2 normalises its last stage's 1x1 planes over two values, and a member's own
# float32 logits sit 3e-3 from the exact ones (its gradients far more) -- and too loose for a
# small-scale tensor (atol=1e-4 hides anything in a gradient of size 1e-6). So, when the
# compute dtype is float32 and no rtol/atol is given, every member runs a second time in float64:
# a deep copy of the member as it was before the check (same weights, same buffers) cast with
# .double(), on the same inputs and under the same cotangents cast to float64. Its rounding is 2^-29
# of float32's, so it stands for the exact result. Then, per compared tensor (each output leaf, each
# input gradient, each parameter gradient, each buffer after the call) and per member i:
#
#   wide_i = max |wide[i] - ref64_i|               the wide model's error
#   own    = max over members j of max |member_j - ref64_j|   the members' own float32 error
#   floor  = NOISE_FLOOR_EPS * eps32 * max |ref64_i|
#   pass iff wide_i <= NOISE_FACTOR * max(own, floor)
#
# The wide op and the member's op round the same exact computation, in another order (a batched
# GEMM, a grouped convolution): the wide error is another draw of the member's, not the same value.
# NOISE_FACTOR = 4: the largest of a tensor's rounding errors in two such draws are within 2x of
# each other nearly always, and 4 leaves room for a summation order that is legitimately somewhat
# less accurate than ATen's (a blocked sum where ATen sums pairwise); a defect -- a member reading
# another's weights, a wrong dim, a 1e-3 relative perturbation -- lands orders of magnitude above.
# ``own`` is the largest over the members: they share the architecture and so the conditioning, and
# a tensor of a few elements can come out exact in one member by chance. The floor: a tensor the
# members compute exactly (a copy, a max-pool, a mask) has own error 0, while the wide program may
# still round once or twice more per op; 8 float32 eps (1e-6) of the tensor's largest value allows
# that and nothing of a real defect's size.
#
# What the largest error alone does not allow for is a flip: a value whose exact result sits
# closer to a kink (ReLU at 0, a max-pool between near-equal values, BatchNorm over two values)
# than float32's rounding. Its float32 side is a coin toss, and where the wide program lands on the
# other side than the member and the float64 run, every gradient upstream of it moves by a whole
# term. The wide program rounds differently, by design (in eval mode it folds BatchNorm into the
# conv weights), so it can flip where the member does not: in a ResNet-18 in eval mode about once in
# ten checks, moving an input gradient by 4.5e-5 where the member's own error is 1.2e-8 (the value
# was -7.8e-7). A flip is rounding; a defect is not, and they differ in what another rounding of
# the member does: so where a tensor of member i is outside the bound, member i runs again in
# float32, up to RESAMPLES (6) times, with its weights, buffers and inputs and the result of every
# op, forward and backward, moved by up to NUDGE_EPS (16) float32 eps at random (_Rerounded: another
# float32 program, rounding differently at each op and inside each sum, as the wide one does), and
# each such run's error against the float64 run
# joins the members' own error. A flip shows up in a good share of these runs; a defect in none,
# since rounding-sized changes do not make a member read another's weights. The runs cost nothing
# when the check passes the first time; they widen the bound of a failing tensor to about 16 times
# the rounding, still far below a defect's error.
#
# Integer and bool results are compared with the float32 member, exactly; so are the positions of
# NaN and inf (finite positions only enter the errors). float64 models keep the direct comparison
# (their reference would be themselves), as do bfloat16/float16 models and any call with rtol/atol
# (the fixed table). A member that cannot run in float64 (an op with no float64 kernel, a forward
# that builds float32 tensors of its own, MPS) falls back to the fixed table, with a warning in the
# log and the reason in the report.
#
# Note [Rounding in a float64 model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A float64 model has no more exact run to be judged against, so it is compared with its members
# within the fixed table (rtol 1e-10). That is too tight for a model whose own rounding is
# amplified as in float32 (above): torchvision's EfficientNet-B0 in train mode on 32x32 images in
# batches of 2 normalises 1x1 planes over two values, and the member alone moves by 4.8e-6 when its
# batch order is reversed; the wide model was 1.9e-8 from it, and check_compile failed (probe 6 of
# issue 44, F7). So where a float64 tensor is outside the table (and no rtol/atol was given), it is
# judged again as a float32 one is after its first bound: against the member's own float64 run,
# with up to RESAMPLES nudged float64 runs of the member (_Rerounded, NUDGE_EPS float64 eps)
# giving the member's own rounding error, and a floor of NOISE_FLOOR_EPS float64 eps. It passes
# iff the wide error is within NOISE_FACTOR times that: a tensor the table passes is never judged
# this way (nothing that passed before fails), and a defect, which rounding-sized changes do not
# reproduce, fails as before, with both judgements in the message.
#
# Note [A float32 judgement that cannot tell]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Where the members' own float32 error is a large part of a tensor's values, the bound above lets a
# defect of that size through: a stock ResNet-18 in train mode on 32x32 images in batches of 2
# normalises its last stage's 1x1 planes over two values, its own float32 gradients land as far
# from the exact ones as their size, and a defect multiplying one member's fc.weight gradient by
# 1.5 passed (probe 9 of issue 44, P9-1). So every tensor a float32 judgement passes reports the
# bound it was held to as a share of its largest value; over BLIND_SHARE (5%), the float32
# judgement cannot tell, and check_equivalence judges the check again in float64: a deep copy of
# the wide model and of every member cast with ``.double()``, on the inputs cast alike, compared
# as a float64 model is (the table, then its own rounding: Note [Rounding in a float64 model]),
# where the same widened program rounds 2^-29 as much and any defect of the program shows. The
# report says which tensors were judged so (``report.float64_recheck``). A wide model that cannot
# be copied and cast fails the check saying so, rather than pass what it could not judge. Not so a
# tensor whose exact values are nothing but rounding, the members' own float32 error over
# ROUNDING_ONLY (10) times its float64 values (the gradient of an attention key's bias, 0 exactly
# since softmax ignores a shift: 1e-9 in float32, 1e-18 in float64): it has no values a defect
# could be a share of, and one of any size shows above its 1e-9 bound in float32 already.
#
# Note [A member too chaotic to judge]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A few rounding-sized nudges estimate the members' own error; where that error is itself a large
# share of a tensor's values (BLIND_SHARE or more) the model is chaotic there, and a wide error
# above NOISE_FACTOR times it is one more draw from the same spread, not evidence of a defect:
# torchvision's EfficientNet-B0 and MobileNetV2 in train mode on batches of 2 of 32x32 images move
# their input gradients by 1e6-1e10 (as large as the values) when the input moves by 1e-13, even in
# float64, and the check reported such a gradient as a defect (probe 11 of issue 44, P11-3, P11-4).
# So such a tensor fails no judgement: in float32 (own error BLIND_SHARE of the values or more,
# EfficientNet-B0's summed input gradient 300 times them) it is judged again in float64 (above: a
# defect shows there when the model is not chaotic in float64 too), and in float64 (own error
# CHAOTIC_SHARE_FLOAT64 of the values or more: rounding amplified 1e12 times and more; MobileNetV2's
# input gradient spread 3.7% over 6 nudged runs and 57% in the wide model's) it is reported as not
# judged (``report.unjudged``, with that share), unless it is only rounding (ROUNDING_ONLY: a
# defect there shows far above its float64 bound). Every other tensor is judged as before.
CHAOTIC_SHARE_FLOAT64 = 1e-3
NOISE_FACTOR = 4.0
NOISE_FLOOR_EPS = 8.0
BLIND_SHARE = 0.05
ROUNDING_ONLY = 10.0
RESAMPLES = 6
NUDGE_EPS = 16.0


def _eps(dtype: torch.dtype) -> float:
    """The rounding unit of a float32 computation whose result has ``dtype``: float32's eps, or the
    result's own where coarser (a bfloat16 result under autocast)."""
    dtype = _REAL_OF_COMPLEX.get(dtype, dtype)
    own = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(own, torch.finfo(torch.float32).eps)



def _errors_against(got: torch.Tensor, mem: torch.Tensor, ref: torch.Tensor, *, what: str,
                    equal_nan: bool) -> tuple[float, float, float]:
    """``(wide error, member's own error, scale)`` of one tensor against its float64 run: the max
    abs differences of ``got`` (the wide model's) and ``mem`` (the float32 member's) from ``ref``,
    and max abs ``ref``, over the positions where all three are finite. ``got`` must have NaN and
    inf exactly where ``mem`` has them (NaN at all only with ``equal_nan``)."""
    g, m, r = _widest(got), _widest(mem), _widest(ref)
    if g.numel() == 0:
        return 0.0, 0.0, 0.0
    errs = ((g - r).abs_().max().item(), (m - r).abs_().max().item(), r.abs().max().item())
    if all(math.isfinite(e) for e in errs):  # all finite (NaN or inf anywhere reaches a max)
        return errs
    g_bad, m_bad = ~torch.isfinite(g), ~torch.isfinite(m)
    if not equal_nan and (g.isnan().any() or m.isnan().any()):
        raise AssertionError(f"{what}: NaN in the {'wide model' if g.isnan().any() else 'member'}'s "
                             "result (pass equal_nan=True to accept NaN in the same places)")
    if g_bad.any() or m_bad.any():
        gn, mn = g[g_bad], m[m_bad]
        if not (torch.equal(g_bad, m_bad) and torch.equal(gn.isnan(), mn.isnan())
                and torch.equal(gn[~gn.isnan()], mn[~mn.isnan()])):
            raise AssertionError(f"{what}: NaN/inf in {int(g_bad.sum())} places where its own model "
                                 f"has them in {int(m_bad.sum())} (not the same places or values)")
    finite = ~g_bad & torch.isfinite(r)
    if not finite.any():
        return 0.0, 0.0, 0.0
    return ((g - r).abs()[finite].max().item(), (m - r).abs()[finite].max().item(),
            r.abs()[finite].max().item())


def _assert_near_reference(wide_out: torch.Tensor, member_outs: Sequence[torch.Tensor],
                           ref_outs: Sequence[torch.Tensor], *, what: str, equal_nan: bool,
                           summed: bool = False,
                           resample: Callable[[int, int], torch.Tensor | None] | None = None,
                           unit: float | None = None) -> tuple[list[float], list[float]]:
    """Note [The float64 reference] for one floating tensor: ``wide_out[i]``'s error against
    ``ref_outs[i]`` (member ``i`` in float64) within NOISE_FACTOR times the members' own float32
    error (``member_outs[i]`` against ``ref_outs[i]``), or the floor. Where it is not,
    ``resample(i, k)`` (member ``i``'s tensor in its ``k``-th nudged float32 run, _Rerounded) adds
    own errors, up to RESAMPLES of them, until one covers the wide error. Returns the
    wide errors and the members' own errors, per member, and the largest share of the tensor's
    largest value that the bound allowed (Note [A float32 judgement that cannot tell]). ``summed``: one tensor, the sum over
    members of a shared input's gradient (``wide_out`` is then ``[1, ...]``). ``unit``: the rounding
    unit of the floor (default: float32's, _eps; float64's for Note [Rounding in a float64 model])."""
    _check_member_layout(wide_out, member_outs, what)
    n = len(member_outs)
    rows = [_errors_against(wide_out[i], mem, ref, what=what if summed else f"{what}: member {i}",
                            equal_nan=equal_nan)
            for i, (mem, ref) in enumerate(zip(member_outs, ref_outs))]
    own = max((o for _, o, _ in rows), default=0.0)
    owns = [o for _, o, _ in rows]
    eps = unit if unit is not None else _eps(wide_out.dtype)
    blind = 0.0
    for i, (w, o, scale) in enumerate(rows):
        floor = NOISE_FLOOR_EPS * eps * scale
        bound = NOISE_FACTOR * max(own, floor)
        for k in range(RESAMPLES if resample is not None else 0):
            if w <= bound:
                break
            nudged = resample(i, k)
            if nudged is None:  # the member cannot run nudged (logged)
                break
            _, o_k, _ = _errors_against(nudged, nudged, ref_outs[i], what=what, equal_nan=True)
            owns[i] = o = max(o, o_k)
            bound = NOISE_FACTOR * max(own, o, floor)
        if w <= bound:
            if 0 < max(own, o) < ROUNDING_ONLY * scale:  # Note [A float32 judgement that cannot tell]
                blind = max(blind, bound / scale)
            continue
        # Note [A member too chaotic to judge]: float32 hands it to the float64 judgement (whatever the share:
        # a tensor that is only rounding is judged there too); float64 does not judge it, unless it is only rounding
        # (a reference of zeros, scale 0, is judged: no share of it is rounding; a GPU run divided by it)
        if scale > 0 and (max(own, o) >= BLIND_SHARE * scale if unit is None or unit > torch.finfo(torch.float64).eps
                          else CHAOTIC_SHARE_FLOAT64 * scale <= max(own, o) < ROUNDING_ONLY * scale):
            blind = max(blind, NOISE_FACTOR * max(own, o) / scale)
            continue
        who = ("the wide gradient differs from the sum of the members' gradients" if summed else
               f"member {i} differs from its own model (member {i} of {n})")
        runs = f" and {RESAMPLES} nudged runs" if resample is not None else ""
        kind = "float64" if unit is not None and unit <= torch.finfo(torch.float64).eps else "float32"
        raise AssertionError(
            f"{what}: {who}: against a float64 run of the member{'s' if summed else ''}, the wide "
            f"model's max abs error is {w:.3g}, the members' own {kind} error {max(own, o):.3g} "
            f"(largest over the {n} members{runs}); allowed {NOISE_FACTOR:g} x max(own error, floor "
            f"{floor:.3g} = {NOISE_FLOOR_EPS:g} {kind} eps x max |value| {scale:.3g}) = {bound:.3g}; "
            f"max abs difference from the {kind} member{'s' if summed else ''}: "
            f"{_abs_err(wide_out[i], member_outs[i]):.3g}. An error this far above the model's own "
            f"{kind} rounding is not rounding (Note [The float64 reference] in "
            "wide_compiler/_equivalence/reference.py)")
    return [w for w, _, _ in rows], owns, blind



class _Rerounded(TorchDispatchMode):
    """A nudged run (Note [The float64 reference]): every floating result of every functional op,
    forward and backward, moved by ``NUDGE_EPS * eps * u`` relative, ``u`` uniform in [-1, 1]
    from ``gen`` -- another float32 program, rounding differently at each op (_run_member nudges
    the weights, buffers and inputs alike). Views and in-place ops are left alone (their results
    alias other tensors), as are factories (no floating input)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable or not any(
                isinstance(a, torch.Tensor) and a.is_floating_point() for a in tree_flatten((args, kwargs))[0]):
            return out
        return tree_map(self._nudge, out)

    def _nudge(self, t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
            return t
        u = torch.rand(t.shape, generator=self.gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
        return t + t * (u * 2 - 1) * (NUDGE_EPS * torch.finfo(t.dtype).eps)
