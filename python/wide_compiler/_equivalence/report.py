"""What :func:`~wide_compiler.testing.check_equivalence` compared: the :class:`EquivalenceReport`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .reference import BLIND_SHARE

__all__ = ["EquivalenceReport"]


_REPORT_KINDS = ("output", "input_grad", "param_grad", "buffer")


class EquivalenceReport(dict):
    """What :func:`check_equivalence` compared: the max abs difference between the wide model and
    its members per kind -- ``"output"``, ``"input_grad"``, ``"param_grad"``, ``"buffer"`` (None
    where nothing of that kind was compared) -- and ``"members"``.

    Attributes (not keys): ``wide_output``, the wide model's output; ``per_member``, each member's
    largest difference over its outputs, gradients and buffers (a shared input's gradient, a sum
    over members, is not in it); ``reference``, ``"float64"`` where the floating results were judged
    against a float64 run of the members (Note [The float64 reference]: a float32 model without
    rtol/atol) or ``"fixed"`` where against the members with fixed tolerances; ``fallback``, why a
    float32 model was compared with fixed tolerances after all (its members cannot run in float64),
    else None; with ``reference == "float64"``, ``wide_error`` and ``own_error``, per kind, the
    largest error against the float64 run of the wide model and of the members themselves;
    ``blind``, the tensors whose float32 judgement could not tell a defect of a few percent from the
    members' own rounding (each with the share of its values its bound allowed), and
    ``float64_recheck``, the report of the check made again in float64 for them, else None (Note
    [A float32 judgement that cannot tell])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wide_output: Any = None
        self.per_member: list[float] = [0.0] * int(self.get("members") or 0)
        self.reference: str = "fixed"
        self.fallback: str | None = None
        self.wide_error: dict[str, float | None] = dict.fromkeys(_REPORT_KINDS)
        self.own_error: dict[str, float | None] = dict.fromkeys(_REPORT_KINDS)
        # Note [A float32 judgement that cannot tell]: tensor -> the share of its largest value its
        # float32 bound allowed (over BLIND_SHARE), and the float64 check made again for them
        self.blind: dict[str, float] = {}
        self.float64_recheck: EquivalenceReport | None = None
        # Note [A member too chaotic to judge]: tensor -> the share of its values the members' own
        # float64 runs spread over, where that spread is too wide to judge even in float64
        self.unjudged: dict[str, float] = {}

    def _note_blind(self, what: str, share: float) -> None:
        if share > BLIND_SHARE:
            self.blind[what] = max(share, self.blind.get(what, 0.0))

    def _note_unjudged(self, what: str, share: float) -> None:
        if share > BLIND_SHARE:
            self.unjudged[what] = max(share, self.unjudged.get(what, 0.0))

    def _note(self, kind: str, errs: Sequence[float]) -> None:
        e = max(errs, default=0.0)
        self[kind] = e if self.get(kind) is None else max(self[kind], e)
        self.per_member = [max(a, b) for a, b in zip(self.per_member, errs)]

    def _note_reference(self, kind: str, wide_errs: Sequence[float], own_errs: Sequence[float]) -> None:
        for table, errs in ((self.wide_error, wide_errs), (self.own_error, own_errs)):
            e = max(errs, default=0.0)
            table[kind] = e if table[kind] is None else max(table[kind], e)

    def max_error(self) -> float:
        """The largest difference from the members over every kind compared."""
        errs = [v for k, v in self.items() if k in _REPORT_KINDS and v is not None]
        return max(errs, default=0.0)

    def __str__(self) -> str:
        members = self.get("members", "?")
        if self.reference == "float64":
            parts = [f"{k.replace('_', ' ')} {self.wide_error[k]:.1e} / {self.own_error[k]:.1e}"
                     for k in _REPORT_KINDS if self.wide_error[k] is not None]
            text = (f"{members} members, max abs err against a float64 run (wide / members' own "
                    "float32): " + ", ".join(parts))
            if self.float64_recheck is not None:
                text += (f"; {len(self.blind)} tensor(s) too ill-conditioned to judge in float32 (own error up to "
                         f"{100 * max(self.blind.values()):.0f}% of their values) checked again with the wide model "
                         f"and members in float64: {self.float64_recheck}")
            return text
        if self.unjudged:
            names = ", ".join(sorted(self.unjudged)[:3]) + (", ..." if len(self.unjudged) > 3 else "")
            return (f"{self._plain()}; not judged: {names} (the members' own float64 runs spread over up to "
                    f"{100 * max(self.unjudged.values()):.0f}% of their values: chaotic at this sample, Note "
                    "[A member too chaotic to judge])")
        return self._plain()

    def _plain(self) -> str:
        members = self.get("members", "?")
        parts = [f"{k.replace('_', ' ')} {v:.1e}" for k, v in self.items()
                 if k != "members" and v is not None]
        text = f"{members} members, max abs err: " + ", ".join(parts)
        return text if self.fallback is None else f"{text} (fixed tolerances: {self.fallback})"

