"""The equivalence harness below the compiler API: comparisons, tolerances, sample inputs and
:func:`check_equivalence`. Everything here is public through :mod:`wide_compiler.testing` (import
it from there; its docstring justifies the tolerances), which adds :func:`check_compile` on top.

Note [The harness in two layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``compile(..., validate=True)`` (api.py) compares the wide model with its members through
:func:`check_equivalence`, and :func:`wide_compiler.testing.check_compile` compiles through
``api.compile``: one module holding both imported api while api imported it. The comparisons
therefore live here, below api, and wide_compiler/testing.py, above api, re-exports them next to
``check_compile``: imports go one way (.importlinter checks that the package has no import cycle).
This package imports nothing else of wide_compiler, so any layer may compare members with it (the
measuring code below model.py included).

The package, one concern a module: the fixed tolerances (tolerances.py); comparing a wide result
with its members' (compare.py); judging it against a float64 run of the members instead (Note [The
float64 reference] in reference.py); the inputs (inputs.py); the check itself (check.py), in phases
(Note [check_equivalence in phases]): the members run alone (members.py), then the wide model, its
results compared (wide.py); and what it reports (report.py).
"""

from __future__ import annotations

from .check import check_equivalence, random_ops
from .compare import assert_close, assert_members_close, assert_trees_members_close, max_member_error
from .inputs import _as_args, make_members, member_inputs, shared_input, stack_inputs
from .reference import NOISE_FACTOR, NOISE_FLOOR_EPS, NUDGE_EPS, RESAMPLES
from .report import EquivalenceReport
from .tolerances import TOLERANCES, tolerance

__all__ = [
    "NOISE_FACTOR",
    "NOISE_FLOOR_EPS",
    "NUDGE_EPS",
    "RESAMPLES",
    "TOLERANCES",
    "EquivalenceReport",
    "assert_close",
    "assert_members_close",
    "assert_trees_members_close",
    "check_equivalence",
    "max_member_error",
    "make_members",
    "member_inputs",
    "random_ops",
    "shared_input",
    "stack_inputs",
    "tolerance",
]
# _as_args is wide_compiler.testing's, imported from here.
