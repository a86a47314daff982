"""A population of N hyperparameter configurations trained as ONE wide model, without Ray.

:class:`Population` holds the N members of one sweep: the fused :class:`~wide_compiler.WideModel`,
its per-member optimizer (:mod:`wide_compiler.optim`: every hyperparameter has one value per
member), each member's configuration and record, and the member operations a scheduler uses:
:meth:`~Population.stop`, :meth:`~Population.restart`, :meth:`~Population.exploit` (member ``dst``
becomes a copy of member ``src``: weights, buffers, optimizer state, hyperparameters) and
:meth:`~Population.set_hyperparameters` (explore). :meth:`Population.step` runs one iteration
of a user's ``train_step`` and lets the member scheduler act:

* :class:`MemberASHA`: asynchronous successive halving over the members. A member below the rung
  cutoff is stopped; its slot restarts with a fresh configuration from the member space or is
  frozen (its weights kept) once the population's ``num_member_samples`` is spent.
* :class:`MemberPBT`: population-based training over the members. The bottom quantile copies a
  top member (exploit) and perturbs its hyperparameters (explore), in place.
* :class:`MemberScheduler`: the base class, for schedulers of your own.

:meth:`Population.state_dict` / :meth:`Population.from_state` continue a population bit for bit
(the random generators included); :meth:`Population.save` writes it as plain data (tensors, and
everything else as JSON text) that ``torch.load(weights_only=True)`` reads, so loading one runs no
code.

Nothing here needs Ray: ``train_step`` and a ``while not pop.done`` loop are enough (see
:class:`Population`). :mod:`wide_compiler.integrations.ray` runs a population inside each Ray
Tune trial (:func:`~wide_compiler.integrations.ray.fused_trainable`) and reads its checkpoints
back (:func:`~wide_compiler.integrations.ray.load_checkpoint`, ``best_model``); its error
messages name it, as they did before this package was split from it.

The package, one concern a module: :class:`Population` (core.py), its optimizer's per-member
hyperparameters (hyperparameters.py), the member schedulers (schedulers.py), the member space and
PBT's explore step (spaces.py), the members' metrics and records (records.py) and the checkpoint
files (checkpoint.py).
"""

from __future__ import annotations

from .checkpoint import CHECKPOINT_FILE, _read_checkpoint
from .core import Population
from .records import _best_of, _seed_of
from .schedulers import MemberASHA, MemberPBT, MemberScheduler
from .spaces import sample_member_config

__all__ = [
    "CHECKPOINT_FILE",
    "MemberASHA",
    "MemberPBT",
    "MemberScheduler",
    "Population",
    "sample_member_config",
]
# _best_of, _read_checkpoint and _seed_of are wide_compiler.integrations.ray's, imported from here; the
# classes stay importable from here for objects pickled before the module became a package.
