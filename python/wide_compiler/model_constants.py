"""Per-member constants at the call (mixed into :class:`~wide_compiler.WideModel`): the members'
constants as the graph reads them (``_per_member.<path>`` buffers), checked to be a configuration a
graph was compiled for before a graph runs and before a state dict is loaded (Note [Per-member
constants at the call]); each member's own values put back on its copy by ``unfuse``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .fx.constants import EARLIER_AT_MOST, constant_key, member_value
from .fx.state import get_tensor as _get_tensor

if TYPE_CHECKING:
    from .fx.widen import WideGraph

__all__ = ["MemberConstantsMixin"]


_ABSENT = object()


def _plain(value: Any) -> bool:
    """A plain Python value (Note [Attributes a deferred member's forward changed])."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class MemberConstantsMixin:
    """Methods of a wide model's per-member constants. The host class has ``n`` (members), the
    ``_per_member.<path>`` buffers, ``_constants`` (path -> every member's value) and the graphs
    with their constant tables (``_graphs``, ``_variants``, ``_constants_seen``)."""

    n: int

    @property
    def per_member_constants(self) -> dict[str, list[float]]:
        """The module attributes that differ between members and are per member in the graph
        (Note [Per-member constants] in fx/constants.py): ``{attribute path: every member's
        value}``, read from the ``_per_member.<path>`` buffers (which the graph reads: set a member's
        values to a configuration the model was compiled for and that member changes; other values
        are refused, Note [Per-member constants at the call]). Empty when the members agree on every
        constant.

        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p)) for p in (0.1, 0.2)]
        >>> wide = wc.compile(models, torch.randn(3, 4), config=wc.WideConfig.fast())
        >>> wide.per_member_constants, wide.member(1)[1].p
        ({'1.p': [0.1, 0.2]}, 0.2)
        """
        out = {}
        for path in self.__dict__.get("_constants") or {}:
            out[path] = [float(v) for v in _get_tensor(self, f"_per_member.{path}").tolist()]
        return out

    def _set_member_constants(self, m: nn.Module, i: int) -> nn.Module:
        """Member ``i``'s own per-member constants on ``m`` (a copy of the template): the original
        Python value while the buffer still holds it (the same value and sign: a ``-0.0`` buffer
        is not an original ``0.0``), else the buffer's value as a float."""
        for path in self.__dict__.get("_constants") or {}:
            mod_path, _, key = path.rpartition(".")
            setattr(m.get_submodule(mod_path) if mod_path else m, key, member_value(self, path, i))
        for path, value in self._deferred_attributes(i).items():
            mod_path, _, key = path.rpartition(".")
            setattr(m.get_submodule(mod_path) if mod_path else m, key, value)
        return m

    # Note [Attributes a deferred member's forward changed]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A deferred model runs our copies of the members (Note [Running the members until compiling
    # pays] in model_deferred.py). A forward that changes a Python attribute of its module
    # (``self.calls += 1``) changes the copy's, which each of its later calls reads, as the member
    # alone would; member(i), unfuse() and write_back() built from the template then gave the value
    # the attribute had at compile (probe 19 of issue 44, P19-4: the extracted member 4.29 off at its
    # next call; a GRU keeping its hidden state in ``self.hidden`` came back with None). They take
    # member i's copy's current value of each plain attribute (a number, a string, a bool or None,
    # or a tuple of them) and tensor attribute (a copy) that differs from the template's. (A
    # compile refuses such a forward, so a model that switched to its graph holds none.)
    def _deferred_attributes(self, i: int) -> dict[str, Any]:
        """``{attribute path: value}``: Note [Attributes a deferred member's forward changed]."""
        deferred = self.__dict__.get("_deferred")
        if deferred is None:
            return {}
        template = dict(self._template.named_modules())
        out = {}
        for path, mod in deferred.members[i].named_modules():
            base = template.get(path)
            if base is None:
                continue
            for key, value in mod.__dict__.items():
                if key.startswith("_") or key == "training":
                    continue
                held = base.__dict__.get(key, _ABSENT)
                if isinstance(value, torch.Tensor):  # a state tensor the forward keeps (TBPTT's hidden state)
                    same = (isinstance(held, torch.Tensor) and (held.shape, held.dtype, held.device)
                            == (value.shape, value.dtype, value.device) and torch.equal(held, value))
                    if not same:
                        out[f"{path}.{key}" if path else key] = value.detach().clone()
                elif _plain(value) and (type(held) is not type(value) or held != value):
                    out[f"{path}.{key}" if path else key] = value
        return out

    def _constants_to_write(self, models: list[nn.Module], where: str) -> list[dict[str, Any]]:
        """``write_back``'s per-member constants (Note [Per-member constants] in fx/constants.py):
        for each ``models[i]``, ``{attribute path: member i's value}``, checked first (every path
        an attribute holding a Python number on that module: the member's own kind of attribute);
        raises ``ValueError`` naming the member, the attribute and what it holds, before anything
        is written. Empty dicts when the members share every constant."""
        paths = list(self.__dict__.get("_constants") or {})
        out = []
        for i, m in enumerate(models):
            values = {}
            for path in paths:
                mod_path, _, key = path.rpartition(".")
                try:
                    owner = m.get_submodule(mod_path) if mod_path else m
                except AttributeError:
                    owner = None
                held = owner.__dict__.get(key) if owner is not None else None
                if not _is_number(held):
                    what = ("no such submodule" if owner is None else "no such attribute" if key not in
                            owner.__dict__ else f"a {type(held).__name__}")
                    raise ValueError(
                        f"{where}: member {i} ({type(m).__name__}) has no number attribute {path!r} ({what}) to "
                        f"take the member's per-member constant {member_value(self, path, i)!r}; nothing was "
                        "written")
                values[path] = member_value(self, path, i)
            values.update(self._deferred_attributes(i))
            out.append(values)
        return out

    def _constant_buffers(self, paths: tuple[str, ...]) -> list[torch.Tensor]:
        """The ``_per_member.<path>`` buffers of ``paths``, read through their holder modules, found
        once per instance (``.to()`` rebinds a buffer in its holder, never the holder itself)."""
        key = ("holders", paths)
        holders = self._constants_seen.get(key)
        if holders is None:
            holders = []
            for p in paths:
                mod_path, _, attr = f"_per_member.{p}".rpartition(".")
                holders.append((self.get_submodule(mod_path), attr))  # type: ignore[attr-defined]
            self._constants_seen[key] = holders
        return [h._buffers[attr] for h, attr in holders]

    # Note [Constants the members hold now]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A capture for new inputs or a new mode traces the capture template (a copy of member 0 at
    # compile time) and probes every configuration of ``_constants`` (Note [Per-member constants]
    # in fx/constants.py). After copy_member_weights, load_members, load_state_dict or an in-place
    # edit of a ``_per_member`` buffer, the members hold other constants than those: a capture of
    # the old ones traces a program no member runs (member 0 at its compile-time s = 0.5 takes the
    # other branch at the new size; the probes of the new s are then refused for differing from
    # it, "member 0: s is 1.5, member 0 has 1.5"). So before any capture the row of every
    # attribute is read back from its buffer (:func:`~wide_compiler.fx.constants.member_value`) and
    # the template takes member 0's values: each capture traces what the members hold now. A call
    # with unchanged buffers costs one version check per attribute.
    def _constants_now(self) -> None:
        consts = self.__dict__.get("_constants")
        if not consts or torch.compiler.is_compiling():
            return
        bufs = self._constant_buffers(tuple(consts))
        seen = tuple((id(b), b._version) for b in bufs)
        if self._constants_seen.get("now") == seen:
            return
        for path in list(consts):
            row = tuple(member_value(self, path, i) for i in range(self.n))
            if any(constant_key(a) != constant_key(b) for a, b in zip(row, consts[path])):
                consts[path] = row
        template = self.__dict__.get("_capture_template", (None,))[0]
        for path, row in consts.items() if template is not None else ():
            mod_path, _, key = path.rpartition(".")
            owner = template.get_submodule(mod_path) if mod_path else template
            if constant_key(owner.__dict__.get(key)) != constant_key(row[0]):
                setattr(owner, key, row[0])
        self._constants_seen["now"] = seen

    def _earlier_constants(self) -> tuple:
        """The configurations of the per-member constants this model's graphs proved (Note
        [Configurations proved before] in fx/constants.py): a later graph proves them too."""
        return tuple(self.__dict__.get("_proved_configurations", {}).values())

    def _remember_constants(self, plan: Any) -> None:
        """Note [Configurations proved before]: keep what ``plan`` (a ConstantPlan) proved, the
        most recent last, at most EARLIER_AT_MOST."""
        proved = self.__dict__.setdefault("_proved_configurations", {})
        for cfg in plan.configurations_proved():
            key = tuple(sorted((p, constant_key(v)) for p, v in cfg.items()))
            proved.pop(key, None)
            proved[key] = dict(cfg)
        while len(proved) > EARLIER_AT_MOST:
            proved.pop(next(iter(proved)))

    # Note [Per-member constants at the call]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The ``_per_member.<path>`` buffers are the members' constants as the graph reads them: writing
    # one (by hand, ``load_state_dict``, ``copy_member_weights``) changes that member. But an argument
    # computed from constants (``1 - p``, ``round(s, 2)``, a tensor made from one) reads a derived
    # buffer whose values came from each configuration's own trace at compile time, and only the
    # configurations traced are proved to follow the fused program (fx/constants.py). So before a
    # graph runs, when a constant buffer changed since the last call (its version counter), every
    # member's constants must be a configuration the graph was compiled for (else the call is
    # refused, naming the member and its values), and the derived buffers are set to that
    # configuration's values. A call with unchanged buffers costs one version check per attribute.
    def _sync_constants(self, wg: WideGraph) -> None:
        if torch.compiler.is_exporting():  # the buffers are traced values: export checked them first
            if self.__dict__.get("_constants_checked_for_export") is not wg:
                raise ValueError(
                    "wide_compiler: this wide model has per-member constants, which are checked on their "
                    "values before a graph runs (Note [Per-member constants at the call]); torch.export "
                    "traces them without values. Export it with wide.export(), which checks them first")
            return
        paths, by_key = wg.constant_table
        bufs = self._constant_buffers(tuple(paths))
        seen = tuple((id(b), b._version) for b in bufs)
        if self._constants_seen.get(id(wg)) == seen:
            return
        rows = [b.detach().double().cpu().tolist() for b in bufs]
        derived: dict[str, list[float]] = {}
        for i in range(self.n):
            values = by_key.get(tuple(constant_key(float(r[i])) for r in rows))
            if values is None:
                raise ValueError(_unproved(i, paths, rows, by_key, "Set a compiled configuration"))
            for name, v in values.items():
                derived.setdefault(name, []).append(v)
        with torch.no_grad():
            for name, vals in derived.items():
                t = _get_tensor(self, name)
                new = torch.tensor(vals, dtype=t.dtype, device=t.device).view(t.shape)
                if not torch.equal(t, new):
                    t.copy_(new)
        self._constants_seen[id(wg)] = seen

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, checked first (Note [Per-member constants at the call]): a
        state dict whose per-member constants give some member a configuration a graph of this
        model was not compiled for is refused before anything is loaded; so is, with ``strict``, a
        state dict whose keys are not this model's (``nn.Module`` loads every tensor it can first:
        here new weights with the old constants)."""
        if strict:
            own, given = set(self.state_dict()), set(state_dict)
            if own != given:
                raise RuntimeError(
                    f"Error(s) in loading state_dict for {type(self).__name__}: nothing was loaded: "
                    f"missing key(s): {sorted(own - given)}, unexpected key(s): {sorted(given - own)}")
        for wg in [*self._graphs.values(), *(v for vs in self._variants.values() for v in vs)]:
            if wg.constant_table is None:
                continue
            paths, by_key = wg.constant_table
            given = [state_dict.get(f"_per_member.{p}") for p in paths]
            if any(not isinstance(t, torch.Tensor) or t.shape != (self.n,) for t in given):
                continue  # not this model's constants: nn.Module's own checks say what is wrong
            rows = [t.detach().double().cpu().tolist() for t in given]
            for i in range(self.n):
                if tuple(constant_key(float(r[i])) for r in rows) not in by_key:
                    raise ValueError(_unproved(i, paths, rows, by_key, "Nothing was loaded. Load a state dict of "
                                               "compiled configurations"))
        return super().load_state_dict(state_dict, strict, assign)


def _unproved(i: int, paths: list[str], rows: list[list[float]], by_key: dict, what_to_do: str) -> str:
    """The refusal of member ``i``'s constants (``rows[k][i]`` of ``paths[k]``), no configuration of
    ``by_key`` (Note [Per-member constants at the call])."""
    have = "; ".join(", ".join(f"{p} = {v[1]}" for p, v in zip(paths, key)) for key in list(by_key)[:4])
    return (f"wide_compiler: member {i}'s per-member constants ({', '.join(f'{p} = {r[i]!r}' for p, r in zip(paths, rows))}) "
            f"are not a configuration this graph was compiled for ({have}{'; ...' if len(by_key) > 4 else ''}): "
            "each configuration is traced at compile time to prove the fused program is that member's (Note "
            f"[Per-member constants]). {what_to_do}, or compile again from members with these values")
