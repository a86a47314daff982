"""Per-member checkpoints: :func:`save_members` writes one file per member plus ``index.json``
(collective for a sharded model); :func:`load_members` reads them back on any number of ranks,
and :func:`load_member` / :func:`load_member_optimizer` give one member's ordinary ``state_dict``
without any process group. Files are read with ``torch.load(weights_only=True)`` and checked
against the index before anything changes. Each member file carries the member's Python number
attributes (its per-member constants among them: a swept dropout ``p``, a temperature; Note
[Per-member constants] in fx/constants.py), which :func:`load_members` sets where the model can
represent them and refuses otherwise; :func:`load_member_constants` reads them.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._files import atomic_write, ensure_directory
from ..fx.constants import check_member_constants, member_constants, set_member_constants
from .collectives import _agree
from .sharding import ShardedWideModel, _as_sharded, _check_optimizer, _comm_device, _span

__all__ = ["FORMAT", "FORMAT_VERSION", "load_member", "load_member_constants", "load_member_optimizer", "load_members",
           "read_index", "save_members"]

log = logging.getLogger(__name__)

FORMAT = "wide_compiler.members"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"


def _member_file(i: int) -> str:
    return f"member_{i:06d}.pt"


def save_members(model: Any, directory: str | os.PathLike, optimizer: Any = None, *,
                 metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a per-member checkpoint: one file per member (``member_000007.pt``: its
    ``state_dict``, its Python number attributes with its per-member constants (read back by
    :func:`load_member_constants`) and, with ``optimizer``, its optimizer state as the
    ``state_dict`` of the matching ``torch.optim`` optimizer) and ``index.json`` (format, version, N, keys, shapes,
    dtypes, optimizer class, your ``metadata``). Returns the directory.

    ``model`` is a :class:`ShardedWideModel` (COLLECTIVE: every rank writes the members it
    holds; rank 0 removes an older ``index.json`` (and member files of a larger older N) first
    and writes the new one last, once every rank has written its members, so a directory with
    an ``index.json`` holds a complete checkpoint; the directory must be one all ranks see, e.g.
    a shared filesystem) or a plain :class:`~wide_compiler.WideModel` (all its members). Files
    are written atomically: each goes to a temporary file of an unpredictable name, created
    exclusively in the directory (never through a file or symlink planted there), then renamed
    over its final name (a symlink at that name is replaced, not followed). When any rank fails
    (a wrong optimizer, a full disk, a directory that cannot be written: an ``OSError`` naming
    the path), every rank raises. Read it back with :func:`load_members` on any number of
    ranks, or :func:`load_member` without any.

    Saving over an existing checkpoint is NOT crash-safe: the old one is invalidated before the
    new one is complete, so a crash in between leaves no checkpoint there. Save each round to a
    fresh directory (and remove older ones once the new one is written).

    Example:
        >>> import tempfile, torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> sharded = wcd.shard(models, torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> d = tempfile.mkdtemp()
        >>> _ = wcd.save_members(sharded, d, metadata={"round": 3})
        >>> wcd.read_index(d)["n"], wcd.read_index(d)["metadata"]
        (4, {'round': 3})
        >>> plain = torch.nn.Linear(3, 2)                  # member 2 as an ordinary module
        >>> plain.load_state_dict(wcd.load_member(d, 2))
        <All keys matched successfully>
        >>> torch.equal(plain.weight, models[2].weight)
        True
    """
    what = "wide_compiler.distributed.save_members"
    sharded = _as_sharded(model, "save_members")
    _ = sharded.group  # raises on every rank when a pickled model lost its group
    path = Path(directory)
    error = None
    try:  # every step ends with _agree: a rank that fails makes every rank raise (none hangs)
        _check_optimizer(optimizer, sharded, "save_members")
        if metadata is not None:
            try:
                metadata = json.loads(json.dumps(dict(metadata)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{what}: metadata must be JSON-serialisable ({e})") from e
        if sharded.rank == 0:  # an older checkpoint here is no longer complete once we start writing
            ensure_directory(path, what)
            (path / INDEX_FILE).unlink(missing_ok=True)  # (a symlink there: the link goes, not its target)
            for f in path.glob("member_*.pt"):  # members of a larger older N
                k = f.stem.removeprefix("member_")
                if k.isdigit() and int(k) >= sharded.n_global:
                    f.unlink(missing_ok=True)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    try:
        ensure_directory(path, what)
        for i in sharded.members:
            payload = {"format": FORMAT, "version": FORMAT_VERSION, "member": i,
                       "model": sharded.member_state_dict(i),
                       "constants": member_constants(sharded.wide, sharded.local(i)),
                       "optimizer": _member_optimizer_state(sharded, optimizer, i) if optimizer is not None else None}
            atomic_write(path / _member_file(i), lambda f, payload=payload: torch.save(payload, f), what)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    try:
        if sharded.rank == 0:
            sd = sharded.member_state_dict(sharded.members.start)
            index = {
                "format": FORMAT, "version": FORMAT_VERSION, "n": sharded.n_global,
                "files": [_member_file(i) for i in range(sharded.n_global)],
                "keys": list(sd), "shapes": {k: list(v.shape) for k, v in sd.items()},
                # members of a padded model (compile(pad=True)) have their own sizes each
                **({"member_shapes": {str(i): {k: list(v.shape) for k, v in sharded.member_state_dict(i).items()}
                                      for i in sharded.members}} if _padded(sharded) else {}),
                "dtypes": {k: str(v.dtype) for k, v in sd.items()},
                "module": type(sharded.wide._template).__qualname__,
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "saved_by_world_size": sharded.world_size, "torch": torch.__version__,
                "metadata": metadata,
            }
            text = json.dumps(index, indent=1).encode()
            atomic_write(path / INDEX_FILE, lambda f: f.write(text), what)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    log.info("wide_compiler.distributed: rank %d saved members %s to %s", sharded.rank,
             _span(sharded.members), path)
    return path


def _padded(sharded: ShardedWideModel) -> bool:
    """Whether the members differ in size (a PaddedWideModel: each saved at its own sizes)."""
    return hasattr(sharded.wide, "member_optimizer_state_dict")


def _member_optimizer_state(sharded: ShardedWideModel, optimizer: Any, i: int) -> dict:
    """Global member ``i``'s optimizer state as saved: at its own sizes."""
    if _padded(sharded):
        return sharded.wide.member_optimizer_state_dict(optimizer, sharded.local(i))
    return optimizer.member_state_dict(sharded.local(i))


def _shapes_of(index: dict[str, Any], i: int) -> dict[str, list[int]]:
    """The shapes member ``i`` was saved with (its own, in a checkpoint of a padded model)."""
    return index.get("member_shapes", {}).get(str(i), index["shapes"])


def _dtype_of(name: Any) -> torch.dtype | None:
    """The torch dtype that ``str(dtype)`` wrote as ``name`` (``"torch.float32"``), or None."""
    if not isinstance(name, str) or not name.startswith("torch."):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _check_index(index: dict[str, Any], path: Path) -> None:
    """The fields of an ``index.json`` that loading relies on, checked for what
    :func:`save_members` writes (a corrupt or hand-edited index raises ``ValueError``)."""
    where = f"wide_compiler.distributed: {path}"
    n = index.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: 'n' (the number of members) must be an int >= 1; got {n!r} "
                         f"({type(n).__name__}): a corrupt or hand-edited index")
    files = index.get("files")
    if not isinstance(files, list) or len(files) != n:
        got = f"{len(files)} entries" if isinstance(files, list) else f"a {type(files).__name__}"
        raise ValueError(f"{where}: 'files' must list the checkpoint's {n} member files (one per "
                         f"member, n={n}); got {got}: a corrupt or hand-edited index")
    for i, name in enumerate(files):
        if name != _member_file(i):
            raise ValueError(f"{where}: member {i}'s file is listed as {name!r}; save_members names it "
                             f"{_member_file(i)!r}, in the checkpoint's own directory (a path elsewhere "
                             f"is never followed): a corrupt or hand-edited index")
    keys = index.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"{where}: 'keys' must be a list of distinct state_dict names; got {keys!r}")
    for field in ("shapes", "dtypes"):
        table = index.get(field)
        if not isinstance(table, dict) or sorted(table) != sorted(keys):
            raise ValueError(f"{where}: {field!r} must map every key of 'keys' to its {field[:-1]}; "
                             f"got {table!r}")
    for k in keys:
        shape = index["shapes"][k]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  and d >= 0 for d in shape):
            raise ValueError(f"{where}: the shape of {k!r} must be a list of sizes; got {shape!r}")
        if _dtype_of(index["dtypes"][k]) is None:
            raise ValueError(f"{where}: the dtype of {k!r} must name a torch dtype ('torch.float32'); "
                             f"got {index['dtypes'][k]!r}")
    if not isinstance(index.get("optimizer"), (str, type(None))):
        raise ValueError(f"{where}: 'optimizer' must be an optimizer class name or null; got "
                         f"{index.get('optimizer')!r}")


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of a checkpoint written by :func:`save_members`, checked (format,
    version, and the fields loading relies on: ``n`` an int, one ``files`` entry per member named
    as :func:`save_members` names it, keys, shapes and dtypes); raises
    ``FileNotFoundError``/``ValueError`` saying what is wrong."""
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"wide_compiler.distributed: {path} not found: not a checkpoint "
                                f"written by save_members (or one whose save did not complete)")
    try:
        index = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"wide_compiler.distributed: {path} is not valid JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"wide_compiler.distributed: {path} is not a {FORMAT} index")
    if index.get("version") != FORMAT_VERSION:
        raise ValueError(f"wide_compiler.distributed: {path} has format version {index.get('version')!r}; "
                         f"this wide_compiler reads version {FORMAT_VERSION}")
    _check_index(index, path)
    return index


def _open_member(directory: str | os.PathLike, i: int, index: dict) -> tuple[Path, Any]:
    """The path of member ``i``'s file and the file opened for reading; refuses a file that
    resolves outside the checkpoint directory (a symlink to elsewhere) or is not a regular file."""
    base = Path(directory)
    path = base / index["files"][i]  # a plain name: checked by read_index
    if not path.exists():
        raise FileNotFoundError(f"wide_compiler.distributed: {path} (member {i}) is missing from the "
                                f"checkpoint")
    root, real = base.resolve(), path.resolve()
    if not real.is_relative_to(root):
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is a symlink to {real}, "
                         f"outside the checkpoint directory {root}: refused (a checkpoint's files "
                         f"are its own)")
    if not real.is_file():
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is not a regular file")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(real, flags)  # the resolved path: no symlink is followed from here on
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is not a regular file")
    return path, os.fdopen(fd, "rb")


def _read_member(directory: str | os.PathLike, i: int, index: dict | None = None,
                 map_location: Any = "cpu") -> dict[str, Any]:
    """Member ``i``'s payload, read with ``weights_only=True`` and checked against the index
    (format, member id, keys, shapes and dtypes, an optimizer entry that is a dict or None)."""
    index = index if index is not None else read_index(directory)
    n = index["n"]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise IndexError(f"wide_compiler.distributed: member {i!r} out of range for the checkpoint "
                         f"in {directory} (N={n})")
    path, f = _open_member(directory, i, index)
    where = f"wide_compiler.distributed: {path} (member {i})"
    with f:
        try:
            payload = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:  # a truncated file, or one holding more than tensors and containers
            raise ValueError(f"{where} cannot be read as a checkpoint file ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("member") != i:
        raise ValueError(f"{where} is not member {i} of a {FORMAT} checkpoint")
    model = payload.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{where} has no model state_dict (got {type(model).__name__})")
    missing = [k for k in index["keys"] if k not in model]
    extra = [k for k in model if k not in index["keys"]]
    if missing or extra:
        raise ValueError(f"{where} does not match its index.json: keys missing from it {missing}, "
                         f"unexpected keys {extra}")
    shapes = _shapes_of(index, i)
    for k in index["keys"]:
        v, shape, dtype = model[k], shapes.get(k), _dtype_of(index["dtypes"][k])
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {k!r} is a {type(v).__name__}, not a tensor")
        if list(v.shape) != shape or v.dtype != dtype:
            raise ValueError(f"{where}: {k!r} is {list(v.shape)} {v.dtype}, but index.json records "
                             f"{shape} {dtype}: the file does not belong to this checkpoint")
    if not isinstance(payload.get("optimizer"), (dict, type(None))):
        raise ValueError(f"{where}: its optimizer state is a {type(payload.get('optimizer')).__name__}; "
                         f"expected a state_dict or None")
    constants = payload.get("constants")  # absent from checkpoints written before they were saved
    if constants is not None and not (isinstance(constants, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in constants.items())):
        raise ValueError(f"{where}: its constants must map attribute paths to numbers; got {constants!r}")
    return payload


def load_member(directory: str | os.PathLike, i: int, *, map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    """Member ``i``'s ``state_dict`` from a checkpoint of :func:`save_members` (no process group
    needed): load it into an ordinary module with ``module.load_state_dict``. The file is read
    with ``torch.load(weights_only=True)`` and checked against ``index.json``."""
    return _read_member(directory, i, map_location=map_location)["model"]


def load_member_constants(directory: str | os.PathLike, i: int) -> dict[str, int | float] | None:
    """Member ``i``'s Python number attributes as saved by :func:`save_members`, its per-member
    constants among them (``{"2.p": 0.3, "temperature": 2.0, ...}``, attribute paths as
    ``module.named_modules()`` names them), or None for a checkpoint written before they were
    saved: set them on a module (or on the members you compile) to rebuild member ``i``."""
    return _read_member(directory, i).get("constants")


def load_member_optimizer(directory: str | os.PathLike, i: int, *, map_location: Any = "cpu") -> dict | None:
    """Member ``i``'s optimizer state as the ``state_dict`` of the matching ``torch.optim``
    optimizer over that member's parameters (``torch.optim.Adam(module.parameters())
    .load_state_dict(...)``), or None when the checkpoint was saved without an optimizer."""
    return _read_member(directory, i, map_location=map_location)["optimizer"]


def load_members(model: Any, directory: str | os.PathLike, optimizer: Any = None) -> dict[str, Any]:
    """Load the members this rank holds (a :class:`ShardedWideModel`: its ``.members``; a
    :class:`~wide_compiler.WideModel`: all N) from a checkpoint of :func:`save_members`, whatever
    the number of ranks that wrote it; with ``optimizer``, their optimizer state and per-member
    hyperparameters too (state tensors are created when the optimizer has none yet), and each
    member's per-member constants (Note [Per-member constants] in fx/constants.py). Local: no
    communication. Returns the checkpoint's index (``index["metadata"]``: what was saved with it).

    Constants load only where the model can represent them without running a member outside what
    its compile proved: a member's per-member values must be a configuration some member of the
    model had (e.g. a model compiled from members built with the same hyperparameters, in any
    order), and an attribute the model shares must have that value in the checkpoint; otherwise
    ``ValueError`` names the member, the attribute and the values (compile the receiving model from
    members with the checkpoint's values: :func:`load_member_constants`). A checkpoint written
    before constants were saved leaves the model's own, with a logged warning when it has any.

    Everything is read and checked before anything changes: the index (``n`` an int equal to
    the model's N, one file per member named as :func:`save_members` names it, inside the
    checkpoint directory: a path or symlink leading elsewhere is refused), every member file
    this rank loads (read with ``torch.load(weights_only=True)``; its keys, shapes and dtypes),
    and with ``optimizer`` every member's optimizer state (param groups, state shapes and dtypes)
    and hyperparameters (the optimizer's rules). A failure raises and leaves the model and the
    optimizer as they were.

    Raises ``ValueError`` when the checkpoint's N, keys, shapes or dtypes (in its ``index.json``
    or its member files) differ from the model's, a file is not the one its index names, or an
    optimizer is given and the checkpoint has none (or another optimizer class's, or state that
    does not fit it); ``FileNotFoundError`` when a file is missing. (The index's ``module``,
    the member class's name, is informational and not checked.)

    Example:
        >>> import tempfile, torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> a = wc.compile([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> opt_a = wc.optim.Adam(a.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
        >>> d = tempfile.mkdtemp(); _ = wcd.save_members(a, d, opt_a)
        >>> b = wc.compile([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> opt_b = wc.optim.Adam(b.parameters())
        >>> _ = wcd.load_members(b, d, opt_b)
        >>> torch.equal(a.weight, b.weight), opt_b.param_groups[0]["lr"].tolist()
        (True, [0.1, 0.2, 0.3, 0.4])
    """
    name = "wide_compiler.distributed.load_members"
    sharded = _as_sharded(model, "load_members")
    _check_optimizer(optimizer, sharded, "load_members")
    index = read_index(directory)
    if index["n"] != sharded.n_global:
        raise ValueError(f"{name}: the checkpoint in {directory} has N={index['n']} members, the "
                         f"model N={sharded.n_global}")
    for i in sharded.members if _padded(sharded) else [sharded.members.start]:  # padded: each its own sizes
        sd = sharded.member_state_dict(i)
        keys = list(sd)
        if sorted(index["keys"]) != sorted(keys):
            missing = sorted(set(keys) - set(index["keys"]))
            extra = sorted(set(index["keys"]) - set(keys))
            raise ValueError(f"{name}: the checkpoint in {directory} does not match the model: keys "
                             f"missing from it {missing}, unexpected keys {extra}")
        shapes = _shapes_of(index, i)
        for k, v in sd.items():
            saved = (shapes.get(k), index["dtypes"][k])
            if saved != (list(v.shape), str(v.dtype)):
                raise ValueError(f"{name}: the checkpoint in {directory} does not match the model: member {i} "
                                 f"{k!r} was saved as {saved[0]} {saved[1]}, the model's is {list(v.shape)} "
                                 f"{v.dtype}")
    if optimizer is not None and index.get("optimizer") != type(optimizer).__name__:
        raise ValueError(f"{name}: the checkpoint in {directory} has optimizer state of "
                         f"{index.get('optimizer')!r}; got a {type(optimizer).__name__} (load it "
                         f"into the same optimizer class, or pass optimizer=None)")
    device = _comm_device(sharded)
    # Every file is read and checked (against the index, itself checked against the model
    # above) before anything changes.
    payloads = {i: _read_member(directory, i, index, map_location=device) for i in sharded.members}
    if optimizer is not None and _padded(sharded):  # saved at each member's own sizes
        for i, payload in payloads.items():
            if isinstance(payload["optimizer"], dict) and isinstance(payload["optimizer"].get("state"), dict):
                payload["optimizer"] = sharded.wide.padded_optimizer_state_dict(
                    optimizer, sharded.local(i), payload["optimizer"])
    if optimizer is not None:
        _check_optimizer_payloads(optimizer, sharded, payloads, directory)
    moves = _constant_moves(sharded, payloads, directory)
    for i, payload in payloads.items():
        sharded.load_member_state_dict(i, payload["model"])
        if optimizer is not None:
            _load_member_optimizer(optimizer, sharded.local(i), payload["optimizer"])
    set_member_constants(sharded.wide, moves)
    log.info("wide_compiler.distributed: rank %d loaded members %s from %s", sharded.rank,
             _span(sharded.members), directory)
    return index


def _constant_moves(sharded: ShardedWideModel, payloads: dict[int, dict], directory: Any) -> dict:
    """The per-member constants of the members loaded, checked against the model (before anything
    changes: fx/constants.py ``check_member_constants``)."""
    saved = {sharded.local(i): payload.get("constants") for i, payload in payloads.items()}
    if any(v is None for v in saved.values()):
        if sharded.wide.__dict__.get("_constants"):
            log.warning("wide_compiler.distributed.load_members: the checkpoint in %s was written before "
                        "checkpoints saved per-member constants; the model keeps its own (%s)", directory,
                        sharded.wide.per_member_constants)
        return {}
    return check_member_constants(sharded.wide, saved, lambda local: f"wide_compiler.distributed.load_members: member "
                                                                     f"{sharded.global_id(local)} in {directory}")


def _hparam_names(optimizer: Any) -> tuple[str, ...]:
    return (*optimizer._hparams, *optimizer._pairs, "initial_lr")


def _check_optimizer_payloads(optimizer: Any, sharded: ShardedWideModel, payloads: dict[int, dict],
                              directory: Any) -> None:
    """Every member's saved optimizer state fits ``optimizer`` (structure, state shapes and
    dtypes) and its hyperparameters pass the optimizer's rules: applied, in order, to a
    throwaway copy of the param groups, so nothing of ``optimizer`` changes here."""
    for i, payload in payloads.items():
        _check_member_optimizer(optimizer, payload["optimizer"], f"member {i} in {directory}")
    probe = object.__new__(type(optimizer))
    probe.__dict__.update(optimizer.__dict__)
    probe.param_groups = [dict(g) for g in optimizer.param_groups]  # updated instead of the real ones
    names = _hparam_names(optimizer)
    for i, payload in payloads.items():
        groups = payload["optimizer"]["param_groups"]
        try:
            probe._set_member_values(sharded.local(i), {gi: {k: sg[k] for k in names if k in sg}
                                                        for gi, sg in enumerate(groups)})
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"wide_compiler.distributed.load_members (member {i} in {directory}): its "
                             f"saved hyperparameters do not fit the optimizer ({e}); nothing was "
                             f"loaded") from e


def _check_member_optimizer(optimizer: Any, osd: Any, where: str) -> None:
    name = f"wide_compiler.distributed.load_members ({where})"
    if not isinstance(osd, dict) or "param_groups" not in osd:
        raise ValueError(f"{name}: no optimizer state in the checkpoint (saved without an optimizer)")
    groups, states = osd["param_groups"], osd.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{name}: 'param_groups' must be a list of dicts; got {type(groups).__name__}")
    if not isinstance(states, dict):
        raise ValueError(f"{name}: 'state' must be a dict; got {type(states).__name__}")
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{name}: {len(groups)} saved param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for gi, (g, sg) in enumerate(zip(optimizer.param_groups, groups)):
        if not isinstance(sg.get("params"), list) or len(sg["params"]) != len(g["params"]):
            saved = len(sg["params"]) if isinstance(sg.get("params"), list) else sg.get("params")
            raise ValueError(f"{name}: param group {gi} saved with {saved!r} parameters, "
                             f"the optimizer's has {len(g['params'])}")
        for flag in optimizer._flags:
            if flag in sg and sg[flag] != g.get(flag):
                raise ValueError(f"{name}: param group {gi} was saved with {flag}={sg[flag]!r}, the "
                                 f"optimizer has {flag}={g.get(flag)!r} (a flag shared by all members)")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, st in states.items():
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < len(params):
            raise ValueError(f"{name}: state for parameter {pid!r}; the optimizer has {len(params)} "
                             f"parameters (ids 0..{len(params) - 1})")
        if not isinstance(st, dict):
            raise ValueError(f"{name}: the state of parameter {pid} is a {type(st).__name__}; expected a dict")
        p = params[pid]
        current = optimizer.state.get(p, {})
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{name}: state {key!r} of parameter {pid} is a {type(v).__name__}; "
                                 f"expected a tensor")
            if v.dim() and tuple(v.shape) != tuple(p.shape[1:]):
                raise ValueError(f"{name}: state {key!r} of parameter {pid} has shape {list(v.shape)}; "
                                 f"expected {list(p.shape[1:])}")
            cur = current.get(key)
            if cur is not None and (not isinstance(cur, torch.Tensor) or tuple(cur.shape) != (optimizer.n, *v.shape)
                                    or cur.dtype != v.dtype):
                held = f"{list(cur.shape)} {cur.dtype}" if isinstance(cur, torch.Tensor) else type(cur).__name__
                raise ValueError(f"{name}: state {key!r} of parameter {pid} was saved as {list(v.shape)} "
                                 f"{v.dtype}; the optimizer holds {held} for its {optimizer.n} members")


@torch.no_grad()
def _load_member_optimizer(optimizer: Any, local: int, osd: dict) -> None:
    """Member ``local``'s optimizer state and hyperparameters from ``osd`` (checked by
    :func:`_check_optimizer_payloads`)."""
    names = _hparam_names(optimizer)
    optimizer._set_member_values(local, {gi: {k: sg[k] for k in names if k in sg}
                                         for gi, sg in enumerate(osd["param_groups"])})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, st in osd.get("state", {}).items():
        p = params[pid]
        state = optimizer.state[p]
        for key, v in st.items():
            cur = state.get(key)
            if cur is None:  # a fresh optimizer: make the [N, ...] state this member needs
                device = p.device if v.dim() else torch.device("cpu")  # step counts live on the CPU
                cur = state[key] = torch.zeros((optimizer.n, *v.shape), dtype=v.dtype, device=device)
            cur[local].copy_(v)
