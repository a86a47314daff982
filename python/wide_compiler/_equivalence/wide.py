"""Phases 3 and 4 of :func:`~wide_compiler.testing.check_equivalence` (Note [check_equivalence in
phases]): which wide tensors stand for which member names, then the wide model run once and its
outputs, buffers and gradients compared with the members' references."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .compare import _abs_err, _float_leaf, _member_errors, _walk_members, _widest, assert_close, assert_members_close
from .inputs import _Inputs
from .members import _Float64Run, _References
from .reference import _assert_near_reference
from .report import EquivalenceReport

__all__: list[str] = []


def _strip(name: str) -> str:
    return name.removeprefix("_orig_mod.")  # a torch.compile'd wide model


def _default_wide_tensors(wide: Any, params: bool) -> dict[str, torch.Tensor]:
    if not isinstance(wide, nn.Module):
        raise TypeError(f"wide_compiler.testing.check_equivalence: the wide callable is a "
                        f"{type(wide).__name__}, not an nn.Module; pass wide_params= (and "
                        "wide_buffers=) mappings from member parameter names to stacked tensors")
    items = wide.named_parameters() if params else wide.named_buffers()
    return {_strip(name): t for name, t in items}



@dataclasses.dataclass(frozen=True)
class _Tolerance:
    """How one check compares: the compute dtype for :func:`tolerance`, the caller's overrides."""

    dtype: torch.dtype | None
    rtol: float | None
    atol: float | None
    equal_nan: bool
    own_rounding: bool = False  # Note [Rounding in a float64 model]: refs64 judges only what the table fails

    def members(self, wide: torch.Tensor, refs: Sequence[torch.Tensor], *, kind: str, what: str,
                report: EquivalenceReport | None = None, report_kind: str = "",
                refs64: Sequence[torch.Tensor] | None = None,
                resample: Callable[[int, int], torch.Tensor | None] | None = None) -> None:
        """``wide[i]`` vs ``refs[i]`` for every member: against ``refs64`` (the float64 run, noted
        in ``report`` under ``report_kind``; ``resample`` as for _assert_near_reference) for a
        floating tensor when given, else by the table."""
        if refs64 is not None and _float_leaf(wide) and self.own_rounding:
            judged = _table_then_own_rounding(
                lambda: assert_members_close(wide, refs, self.dtype, kind=kind, what=what, rtol=self.rtol,
                                             atol=self.atol, equal_nan=self.equal_nan),
                lambda: _assert_near_reference(wide, refs, refs64, what=what, equal_nan=self.equal_nan,
                                               resample=resample, unit=torch.finfo(torch.float64).eps))
            if judged is not None and report is not None:  # Note [A member too chaotic to judge]
                report._note_unjudged(what, judged[-1])
            return
        if refs64 is not None and _float_leaf(wide):
            *errs, blind = _assert_near_reference(wide, refs, refs64, what=what, equal_nan=self.equal_nan,
                                                  resample=resample)
            if report is not None:
                report._note_reference(report_kind, *errs)
                report._note_blind(what, blind)
            return
        assert_members_close(wide, refs, self.dtype, kind=kind, what=what, rtol=self.rtol,
                             atol=self.atol, equal_nan=self.equal_nan)



def _table_then_own_rounding(table: Callable[[], None], own: Callable[[], Any]) -> Any:
    """Note [Rounding in a float64 model]: ``table()``; where it fails, ``own()`` judges again
    (its result returned; None where the table passed), and a failure of both raises both messages."""
    try:
        table()
    except AssertionError as first:
        try:
            return own()
        except AssertionError as second:  # the judgement that failed first: the table's may name a member within noise
            raise AssertionError(f"{second}\n(the fixed float64 table, which the members' own rounding overrules: "
                                 f"{first})") from None
    return None


def _wide_tensors(wide: Any, member: nn.Module, wide_params: Mapping[str, torch.Tensor | None] | None,
                  wide_buffers: Mapping[str, torch.Tensor | None] | None, *,
                  buffers: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Phase 3: the wide parameters and (with ``buffers``) buffers compared with the members',
    by the member's names: the caller's mappings, else ``wide``'s own tensors."""
    member_params = [name for name, _ in member.named_parameters()]
    member_buffers = [name for name, _ in member.named_buffers()]
    params_map = dict(wide_params) if wide_params is not None else _default_wide_tensors(wide, True)
    if wide_params is None and list(params_map) != member_params:
        raise AssertionError(f"the wide model's parameters {list(params_map)} are not the member's "
                             f"{member_params} (same names, same order)")
    params_map = {k: v for k, v in params_map.items() if v is not None}
    for name in params_map:
        if name not in member_params:
            raise AssertionError(f"wide parameter {name!r}: the members have no parameter of that name")
    if not buffers:
        return params_map, {}
    if wide_buffers is not None:
        buffers_map = {k: v for k, v in wide_buffers.items() if v is not None}
        for name in buffers_map:
            if name not in member_buffers:
                raise AssertionError(f"wide buffer {name!r}: the members have no buffer of that name")
        return params_map, buffers_map
    all_buffers = _default_wide_tensors(wide, False)
    missing = [name for name in member_buffers if name not in all_buffers]
    if missing:
        raise AssertionError(f"the wide model has no buffers {missing} (the member's names)")
    return params_map, {name: all_buffers[name] for name in member_buffers}


@contextlib.contextmanager
def _wide_state_kept(wide: Any, buffers_map: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Restore, on the way out, the buffers of ``wide`` (an ``nn.Module``), the tensors of
    ``buffers_map`` and the module's train/eval mode: the check leaves the wide model as it was."""
    saved = ({name: b.detach().clone() for name, b in wide.named_buffers()}
             if isinstance(wide, nn.Module) else {})
    saved.update({f"\0{name}": b.detach().clone() for name, b in buffers_map.items()})
    was_training = wide.training if isinstance(wide, nn.Module) else None
    try:
        yield
    finally:
        if isinstance(wide, nn.Module):
            with torch.no_grad():
                for name, b in wide.named_buffers():
                    if name in saved:
                        b.copy_(saved[name])
                for name, b in buffers_map.items():
                    b.copy_(saved[f"\0{name}"])
            if was_training is not None and wide.training != was_training:
                wide.train(was_training)


# Note [Checking padded members]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A padded model (``compile(..., pad=True)``) holds every member at the largest sizes, zero
# outside its own values; its members differ in size, so their results do not stack. The check
# places each member's own results (outputs, cotangents, parameter gradients, buffers, and those
# of the float64 and nudged runs) in the padded shapes, zeros outside, through the model's
# ``member_padded``; the padded wide results are then compared as any wide model's. The padding
# is compared too: it must come out zero, as the references have it (inputs are the same size for
# every padded member, so input gradients need nothing).
def _padded_references(wide: Any, refs: _References, *, training: bool, first: int = 0) -> _References:
    """``refs`` with each member's tensors in ``wide``'s padded shapes (Note [Checking padded
    members]); entry ``k`` of ``refs`` is member ``first + k``'s (a nudged run holds one member)."""
    pad = wide.member_padded

    def out(i: int, tree: Any) -> Any:
        leaves, spec = tree_flatten(tree)
        return tree_unflatten([pad(i, t, output=k, training=training) if isinstance(t, torch.Tensor) else t
                               for k, t in enumerate(leaves)], spec)

    def state(i: int, d: Mapping[str, Any]) -> dict[str, Any]:
        return {name: pad(i, t, state=name) if isinstance(t, torch.Tensor) else t for name, t in d.items()}

    new = copy.copy(refs)
    new.outputs = [out(first + k, o) for k, o in enumerate(refs.outputs)]
    new.cotangents = [[None if c is None else pad(first + k, c, output=j, training=training) for j, c in enumerate(cs)]
                      for k, cs in enumerate(refs.cotangents)]
    new.param_grads = [state(first + k, g) for k, g in enumerate(refs.param_grads)]
    new.buffers = [state(first + k, b) for k, b in enumerate(refs.buffers)]
    nudged = getattr(refs, "nudged", None)
    if nudged is not None:
        def padded_nudged(i: int, k: int) -> _References | None:
            run = nudged(i, k)
            return None if run is None else _padded_references(wide, run, training=training, first=i)

        new.nudged = padded_nudged
    return new


def _resampler(refs64: _Float64Run | None, get: Callable[[_References], torch.Tensor],
               ) -> Callable[[int, int], torch.Tensor | None] | None:
    """``(i, k) -> get(member i's k-th nudged run)`` (None where it cannot run), for
    _assert_near_reference."""
    if refs64 is None or refs64.nudged is None:
        return None
    nudged = refs64.nudged

    def resample(i: int, k: int) -> torch.Tensor | None:
        run = nudged(i, k)
        return None if run is None else get(run)

    return resample


def _or(t: torch.Tensor | None, zero: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(zero) if t is None else t


def _compare_outputs(report: EquivalenceReport, wide_out: Any, refs: _References,
                     refs64: _Float64Run | None, tol: _Tolerance, what: str) -> None:
    """The wide output vs the members' (any pytree; noted in ``report``)."""
    flat64 = None if refs64 is None else [tree_flatten(o)[0] for o in refs64.outputs]

    def tensors(label: str, leaf: Any, member_leaves: list[torch.Tensor], k: int) -> None:
        tol.members(leaf, member_leaves, kind="output", what=label, report=report, report_kind="output",
                    refs64=None if flat64 is None else [leaves[k] for leaves in flat64],
                    resample=_resampler(refs64, lambda run: tree_flatten(run.outputs[0])[0][k]))

    _walk_members(wide_out, refs.outputs, what, tensors)
    report._note("output", _member_errors(wide_out, refs.outputs))


def _compare_buffers(report: EquivalenceReport, buffers_map: Mapping[str, torch.Tensor], refs: _References,
                     refs64: _Float64Run | None, tol: _Tolerance) -> None:
    """The wide buffers after the call vs the members' (noted in ``report``)."""
    for name, b in buffers_map.items():  # after the call
        ref = [rb[name] for rb in refs.buffers]
        tol.members(b.detach(), ref, kind="buffer", what=f"buffer {name}", report=report,
                    report_kind="buffer", refs64=None if refs64 is None else [rb[name] for rb in refs64.buffers],
                    resample=_resampler(refs64, lambda run, name=name: run.buffers[0][name]))
        report._note("buffer", _member_errors(b, ref))


def _compare_grads(report: EquivalenceReport, wide_grads: Mapping[str, torch.Tensor | None],
                   refs: Sequence[Mapping[str, Any]], refs64: _Float64Run | None,
                   like: Mapping[str, torch.Tensor], tol: _Tolerance, label: str) -> None:
    """Gradients of N-first wide tensors vs each member's, by name (noted in ``report``)."""
    for name, g in wide_grads.items():
        ref = [r.get(name) for r in refs]
        if all(r is None for r in ref):
            if g is not None and g.any():
                raise AssertionError(f"{label} {name}: the members get no gradient, the wide model "
                                     f"gets a nonzero one")
            continue
        if g is None:
            raise AssertionError(f"{label} {name}: no gradient reached the wide tensor, the members "
                                 "get one")
        ref = [torch.zeros_like(like[name][0]) if r is None else r for r in ref]
        zero = torch.zeros_like(like[name][0])
        ref64 = None if refs64 is None else [_widest(zero) if r.get(name) is None else r[name]
                                             for r in refs64.param_grads]
        tol.members(g, ref, kind="grad", what=f"{label} {name}", report=report, report_kind="param_grad",
                    refs64=ref64, resample=_resampler(
                        refs64, lambda run, name=name, zero=zero: _or(run.param_grads[0].get(name), zero)))
        report._note("param_grad", _member_errors(g, ref))


def _compare_input_grad(report: EquivalenceReport, j: int, base: torch.Tensor, g: torch.Tensor | None,
                        refs: _References, refs64: _Float64Run | None, tol: _Tolerance, *,
                        shared: bool) -> None:
    """The gradient of wide input leaf ``j`` vs the members' (for a shared input: their sum)."""
    ref = [r[j] for r in refs.input_grads]
    label = f"grad of input {j}"
    if all(r is None for r in ref):
        if g is not None and g.any():
            raise AssertionError(f"{label}: the members get no gradient, the wide model "
                                 "gets a nonzero one")
        return
    if g is None:
        raise AssertionError(f"{label}: no gradient reached the wide model's input")
    like = base if shared else base[0]
    ref = [torch.zeros_like(like) if r is None else r for r in ref]
    ref64 = None if refs64 is None else [_widest(torch.zeros_like(like)) if r[j] is None else r[j]
                                         for r in refs64.input_grads]
    if shared:
        want = torch.stack(ref).sum(0)
        what = f"{label} (shared input: the sum over members)"
        if ref64 is not None and _float_leaf(g):
            n = len(ref)
            each = _resampler(refs64, lambda run: _or(run.input_grads[0][j], like))

            def summed(_: int, k: int) -> torch.Tensor | None:
                runs = [each(i, k) for i in range(n)] if each is not None else [None]
                return None if any(r is None for r in runs) else torch.stack(runs).sum(0)

            if tol.own_rounding:  # Note [Rounding in a float64 model]
                judged = _table_then_own_rounding(
                    lambda: assert_close(g, want, tol.dtype, kind="grad", rtol=tol.rtol, atol=tol.atol,
                                         equal_nan=tol.equal_nan, msg=what),
                    lambda: _assert_near_reference(
                        g.unsqueeze(0), [want], [torch.stack(ref64).sum(0)], what=what, equal_nan=tol.equal_nan,
                        summed=True, resample=summed, unit=torch.finfo(torch.float64).eps))
                if judged is not None:  # Note [A member too chaotic to judge]
                    report._note_unjudged(what, judged[-1])
            else:
                *errs, blind = _assert_near_reference(
                    g.unsqueeze(0), [want], [torch.stack(ref64).sum(0)], what=what, equal_nan=tol.equal_nan,
                    summed=True, resample=summed)
                report._note_reference("input_grad", *errs)
                report._note_blind(what, blind)
        else:
            assert_close(g, want, tol.dtype, kind="grad", rtol=tol.rtol, atol=tol.atol,
                         equal_nan=tol.equal_nan, msg=what)
        e = _abs_err(g, want)
        report["input_grad"] = e if report["input_grad"] is None else max(report["input_grad"], e)
    else:
        tol.members(g, ref, kind="grad", what=label, report=report, report_kind="input_grad", refs64=ref64,
                    resample=_resampler(refs64, lambda run: _or(run.input_grads[0][j], like)))
        report._note("input_grad", _member_errors(g, ref))


def _compare_grads_of_wide(report: EquivalenceReport, wide_out: Any, inp: _Inputs, refs: _References,
                           refs64: _Float64Run | None, params_map: Mapping[str, torch.Tensor],
                           tol: _Tolerance, *, shared: bool, what: str) -> None:
    """The wide model's input and parameter gradients under the members' cotangents, stacked."""
    out_leaves = tree_flatten(wide_out)[0]
    terms = []
    for k, t in enumerate(out_leaves):
        if refs.cotangents[0][k] is None:
            continue
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            raise AssertionError(f"{what} leaf {k}: the wide output lost its autograd graph "
                                 "(the members' output requires grad)")
        terms.append((t, torch.stack([c[k] for c in refs.cotangents])))
    in_targets = [(j, b) for j, b in enumerate(inp.bases) if b is not None]
    p_targets = [(name, p) for name, p in params_map.items() if p.requires_grad]
    wrt = [b for _, b in in_targets] + [p for _, p in p_targets]
    got: Sequence[torch.Tensor | None] = [None] * len(wrt)
    if terms and wrt:
        got = torch.autograd.grad([t for t, _ in terms], wrt, [g for _, g in terms], allow_unused=True)
    for (j, base), g in zip(in_targets, got[:len(in_targets)]):
        _compare_input_grad(report, j, base, g, refs, refs64, tol, shared=shared)
    pg = dict(zip([name for name, _ in p_targets], got[len(in_targets):]))
    _compare_grads(report, pg, refs.param_grads, refs64, params_map, tol, "grad of")
    for name, p in params_map.items():
        if not p.requires_grad and any(r.get(name) is not None for r in refs.param_grads):
            raise AssertionError(f"grad of {name}: the wide parameter does not require grad, "
                                 "the members' does")


def _run_wide(wide: Any, inp: _Inputs, refs: _References, refs64: _Float64Run | None,
              params_map: Mapping[str, torch.Tensor], buffers_map: Mapping[str, torch.Tensor],
              tol: _Tolerance, *, n: int, shared: bool, grads: bool, training: bool | None,
              what: str) -> EquivalenceReport:
    """Phase 4: the wide model once, then its outputs, buffers and gradients vs the references
    (against the float64 run ``refs64`` where there is one, Note [The float64 reference])."""
    report = EquivalenceReport(output=None, input_grad=None, param_grad=None, buffer=None, members=n)
    if refs64 is not None and not tol.own_rounding:
        report.reference = "float64"
    with _wide_state_kept(wide, buffers_map):
        if training is not None and isinstance(wide, nn.Module):
            wide.train(training)
        with torch.set_grad_enabled(grads):
            wide_out = wide(*inp.wide_args, **inp.wide_kwargs)
        report.wide_output = wide_out
        _compare_outputs(report, wide_out, refs, refs64, tol, what)
        _compare_buffers(report, buffers_map, refs, refs64, tol)
        if grads:
            _compare_grads_of_wide(report, wide_out, inp, refs, refs64, params_map, tol, shared=shared,
                                   what=what)
    return report

