"""The persistent compile cache: a compiled graph of each train/eval mode kept on disk, so that a
second compile of the same model, in this process or a new one, skips capture and widening.

Note [The compile cache]
~~~~~~~~~~~~~~~~~~~~~~~~
What is stored. The result of the pipeline (fx/pipeline.py) for one mode, everything
:class:`~wide_compiler.WideModel` keeps per graph: the wide graph with its chosen strategies
(``strategy`` kwargs), its layout conversions and eval rewrites as they are in the graph, its
member tile (the tiled graph module too), its :class:`~wide_compiler.fx.guards.Guards`, the
per-member constant plan (Note [Per-member constants] in fx/constants.py, whose table the model
checks at each call), the lifted constants of the capture, the narrow size ranges export found
(``WideModel._ranges``), the measured timings, the layout counts and the folds, and the stacked
shape every parameter and buffer input must have. The members' tensors are NOT stored: the
stacked state is built from the members at every compile (``stack_state``), as without the cache.

How a graph is stored: Note [Graphs as node tables] in fx/cache_pickle.py (a table of nodes per
graph, operators by name, the fake values dropped, a tuning spec's ``make`` replaced by a stub
that refuses to run; a graph whose pickling fails is simply not cached).

The key: Note [The compile cache key] in fx/cache_key.py (everything the compiled program depends
on, and ``members``, the digest of every other member, which is why a hit skips ``run_members``).

What a hit still does (pipeline.run_cached): ``check_members`` (which compares the members' module
trees and finds the per-member constants the key holds), the stacked state, and a check that the
loaded graph fits it: every parameter and buffer input is in the state with the stacked shape, dtype and
``requires_grad`` the graph was compiled for, the sample flattens as the graph's inputs, and the
per-member constants are those of the plan. A failure there is a stale entry: it is ignored
(logged once) and the model compiled afresh. ``trace_members=True`` bypasses the cache (it asks
for every member to be exported). A graph whose ops the tuning budget left unmeasured is not
stored: a later compile measures them (the ones measured are in the strategy cache, so each
compile gets further), then stores it. (A model-level check or member-tile trial cut short by
the budget keeps the defaults: that graph is stored as it is.)

Files. ``<cache_dir>/compiled/<key>.widecc`` (the strategy cache's directory,
``WideConfig.cache_dir`` / ``$WIDE_COMPILER_CACHE_DIR``), written atomically (_files.py). A file
is a magic line, a JSON header (format, versions, key, length and SHA-256 of the body) and the
pickled body. A file that is truncated, corrupt (digest), of another format or version, or whose
body does not load is ignored with one WARNING and replaced by the next store. The body is a
pickle: keep the cache directory as private as torch's own caches (``~/.cache``); never point
it at files others can write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._files import atomic_write, ensure_directory
from ..config import WideConfig
from .cache_key import FORMAT, _versions, key_of, key_parts
from .cache_key import (  # noqa: F401 -- read from here by tests (the key's code digest and its globals scan)
    _FAST_SCAN, _code_text, _globals_read, _globals_read_dis, _globals_read_fast)
from .cache_pickle import _dumps, _wide_graph, _wide_graph_state
from .code_reads import warn_unguarded
from .guards import Guards
from .widen import WideGraph

__all__ = ["ENV", "CachedCapture", "enabled", "entry_path", "key_of", "key_parts", "load", "store"]

log = logging.getLogger(__name__)

ENV = "WIDE_COMPILE_CACHE"  # "0" turns the compile cache off
_MAGIC = b"wide_compiler compile cache\n"
_SUBDIR = "compiled"
_SUFFIX = ".widecc"


def enabled(config: WideConfig) -> bool:
    """Whether compiles with ``config`` use the compile cache: ``config.compile_cache`` and
    ``config.cache`` on, ``$WIDE_COMPILE_CACHE`` not ``0``, and not ``trace_members``.

    >>> from wide_compiler import WideConfig
    >>> enabled(WideConfig(compile_cache=False)), enabled(WideConfig.debug())
    (False, False)
    """
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return bool(getattr(config, "compile_cache", True) and config.cache and not config.trace_members)


@dataclasses.dataclass
class CachedCapture:
    """What the model reads of a capture when the graph came from the cache (the capture itself,
    an ``ExportedProgram``, is not stored): ``constants`` as ``ExportedProgram.constants`` (the
    lifted constant tensors by name), ``ranges`` as ``model_inputs._narrow_ranges`` gives them."""

    constants: dict[str, torch.Tensor]
    ranges: dict[str, tuple]
    path: str = ""


def entry_path(config: WideConfig, key: str) -> Path:
    """Where the entry of ``key`` lives."""
    return Path(config.resolved_cache_dir()) / _SUBDIR / f"{key}{_SUFFIX}"


# --- entries ------------------------------------------------------------------------------------


def _expected_state(c: Any) -> dict[str, tuple]:
    """Per parameter/buffer input of the graph: (kind, stacked shape, dtype, requires_grad) in the state."""
    out = {}
    for inp in c.wide.inputs:
        if inp.kind in ("parameter", "buffer"):
            t = (c.state.parameters if inp.kind == "parameter" else c.state.buffers).get(inp.name)
            if t is not None:
                out[inp.name] = (inp.kind, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
    return out


def _tuning_complete(c: Any) -> bool:
    """Whether every op of this graph was measured or read from the strategy cache (a budget cut
    leaves ops for a later compile to measure). A model-level check or tile trial the budget cut
    short kept the defaults, a final choice: the graph is complete."""
    budget = c.wide.graph_module.meta.get("wide_tuning")
    return budget is None or getattr(budget, "gave_up_at", None) is None


def store(c: Any, key: str, ranges: dict) -> Path | None:
    """Write the entry of the compiled ``c`` under ``key`` (atomically); ``ranges``: the narrow size
    ranges of its capture. Returns the path, or None when it is not stored (logged: DEBUG when the
    graph cannot be pickled or the tuning budget left ops unmeasured, WARNING when the file cannot
    be written)."""
    if c.wide is None or c.ep is None:
        return None
    if not _tuning_complete(c):
        log.debug("wide_compiler: compile cache: not storing the %s graph: the tuning budget left ops "
                  "unmeasured (a later compile measures them)", "train" if c.training else "eval")
        return None
    body = {
        "wide": _wide_graph_state(c.wide),
        "guards": c.guards,
        "constant_plan": c.constant_plan,
        "constants": {name: t.detach().cpu().clone() for name, t in c.ep.constants.items()
                      if isinstance(t, torch.Tensor)},
        "opaque_constants": [name for name, t in c.ep.constants.items() if not isinstance(t, torch.Tensor)],
        "ranges": ranges,
        "layout": c.layout,
        "folded": c.folded,
        "timings": c.timings,
        "state": _expected_state(c) if c.state is not None else None,
        "training": c.training,
    }
    if body["opaque_constants"]:
        log.debug("wide_compiler: compile cache: not storing a graph with script-object constants")
        return None
    try:
        data = _dumps(body)
    except Exception as e:  # noqa: BLE001 -- anything that does not pickle: not cached, compiled as before
        log.debug("wide_compiler: compile cache: the %s graph cannot be stored (%s: %s)",
                  "train" if c.training else "eval", type(e).__name__, e)
        return None
    header = {"format": FORMAT, "key": key, "versions": _versions(), "length": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}
    path = entry_path(c.config, key)
    try:
        ensure_directory(path.parent, "wide_compiler compile cache")
        atomic_write(path, lambda f: f.write(_MAGIC + json.dumps(header).encode() + b"\n" + data),
                     "wide_compiler compile cache")
    except OSError as e:
        log.warning("wide_compiler: cannot write the compile cache entry %s: %s", path, e)
        return None
    log.debug("wide_compiler: compile cache: stored %s (%d bytes)", path, len(data))
    _prune(path.parent)
    return path


MAX_ENTRIES = 512  # entries kept in the cache directory; the least recently written go first


def _prune(folder: Path, keep: int | None = None) -> None:
    """Delete the oldest entries of ``folder`` past ``keep`` (each edit of a model's code, each new
    version makes new keys: the cache would otherwise only grow)."""
    keep = MAX_ENTRIES if keep is None else keep
    try:
        entries = [(e.stat().st_mtime_ns, e) for e in folder.iterdir() if e.name.endswith(_SUFFIX)]
    except OSError:
        return
    if len(entries) <= keep:
        return
    for _, old in sorted(entries, key=lambda te: te[0])[: len(entries) - keep]:
        try:
            old.unlink()
        except OSError:
            pass


def _ignore(path: Path, why: str) -> None:
    log.warning("wide_compiler: ignoring the compile cache entry %s (%s); compiling afresh", path, why)


def load(c: Any, key: str) -> dict | None:
    """The body of the entry of ``key`` (None: no entry, or one that is ignored with one WARNING:
    truncated, corrupt, of another format or version, or not loadable)."""
    path = entry_path(c.config, key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _ignore(path, f"cannot read it: {e}")
        return None
    if not raw.startswith(_MAGIC):
        _ignore(path, "not a compile cache file")
        return None
    head, sep, data = raw[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        _ignore(path, "truncated or corrupt header")
        return None
    if header.get("format") != FORMAT or header.get("versions") != json.loads(json.dumps(_versions())):
        _ignore(path, f"written by another version (format {header.get('format')}, "
                      f"wide_compiler {(header.get('versions') or {}).get('wide')}, "
                      f"torch {(header.get('versions') or {}).get('torch')})")
        return None
    if header.get("key") != key:
        _ignore(path, "its key differs from its file name")
        return None
    if header.get("length") != len(data) or header.get("sha256") != hashlib.sha256(data).hexdigest():
        _ignore(path, f"truncated or corrupt: {len(data)} bytes, expected {header.get('length')}")
        return None
    try:
        with warnings.catch_warnings():  # torch's own deprecation notes about the specs it unpickles
            warnings.simplefilter("ignore", FutureWarning)
            body = pickle.loads(data)  # noqa: S301 -- our own file, its digest checked (Note [The compile cache])
        body["wide"] = _wide_graph(body["wide"])
        for gm in (body["wide"].graph_module, body["wide"].tiled):
            if gm is not None:
                gm.graph.lint()
                budget = gm.meta.get("wide_tuning")
                if budget is not None:  # summary(): measured then, not now
                    budget.from_cache = str(path)
        if body["guards"] is not None and not isinstance(body["guards"], Guards):
            raise TypeError(f"guards of type {type(body['guards']).__name__}")
    except Exception as e:  # noqa: BLE001 -- whatever fails to load: compile afresh
        _ignore(path, f"its body does not load: {type(e).__name__}: {e}")
        return None
    body["path"] = str(path)
    if body["guards"] is not None:  # the capture's warning, given again (Note [State a forward reads])
        warn_unguarded(getattr(body["guards"], "unguarded", ()), str(path))
    return body


def check_loaded(c: Any, body: dict) -> str | None:
    """Why the loaded ``body`` does not fit ``c`` (None when it does): the stacked state has every
    parameter and buffer the graph reads, with the shape, dtype and ``requires_grad`` it was compiled
    for; the sample flattens as the graph's inputs; the per-member constants are the plan's."""
    wg: WideGraph = body["wide"]
    if tree_flatten(c.sample)[1] != wg.in_spec:
        return "the sample is not nested as the graph's inputs"
    users = [i for i in wg.inputs if i.kind == "user"]
    if len(users) != len(tree_flatten(c.sample)[0]):
        return "the sample has another number of inputs"
    expected = body.get("state") or {}
    plan = body.get("constant_plan")
    made = set(plan.buffers if plan is not None else ()) | set(body.get("constants") or ())  # by the model
    if c.state is not None:
        for inp in wg.inputs:
            if inp.kind not in ("parameter", "buffer") or inp.name in made:
                continue
            t = (c.state.parameters if inp.kind == "parameter" else c.state.buffers).get(inp.name)
            if t is None:
                return f"no stacked {inp.kind} {inp.name!r}"
            want = expected.get(inp.name)
            if want is not None and want[1:] != (tuple(t.shape), str(t.dtype), bool(t.requires_grad)):
                return f"{inp.kind} {inp.name!r} is {list(t.shape)} {t.dtype}, the graph was compiled for {want}"
            if inp.member_shape is not None and tuple(t.shape[1:]) != tuple(inp.member_shape):
                return f"{inp.kind} {inp.name!r} is {list(t.shape)}, one member's is {list(inp.member_shape)}"
    have = {p: tuple(v) for p, v in (c.constants or {}).items()}
    want = {p: tuple(v) for p, v in (plan.constants if plan is not None else {}).items()}
    if have.keys() != want.keys() or any(
            [repr(x) for x in have[p]] != [repr(x) for x in want[p]] for p in have):
        return "the per-member constants differ from the plan's"
    return None
