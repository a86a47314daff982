"""Population checkpoint files: the state as tensors plus JSON text, which
``torch.load(weights_only=True)`` reads, so loading one runs no code."""

from __future__ import annotations

import json
import logging
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from .._files import atomic_write

__all__ = ["CHECKPOINT_FILE"]

CHECKPOINT_FILE = "wide_population.pt"        # the file Population.save writes in its directory
_FORMAT = 1                                   # the structure of Population.state_dict()
_FILE_FORMAT = "wide_compiler.population"     # the checkpoint file: tensors + JSON text
_FILE_VERSION = 2                             # (version 1: the state_dict pickled as it is)


log = logging.getLogger("wide_compiler.population")  # the package's one logger, as before the split


_TAG = "__wide_compiler__"


def _to_plain(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """``obj`` as JSON-able data: tensors become references into ``tensors``; tuples, dicts with
    keys other than strings (and the tag key) are tagged so they come back as they were; numpy
    scalars become Python numbers. Anything else raises ``TypeError`` naming ``where``."""
    if obj is None or type(obj) in (bool, str, int, float):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_TAG: "tensor", "index": len(tensors) - 1}
    if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        value = obj.item()                                   # np.float64(0.1) -> 0.1, np.int64 -> int
        if type(value) in (bool, int, float, str):
            return value
    elif type(obj) is list:
        return [_to_plain(v, tensors, f"{where}[{k}]") for k, v in enumerate(obj)]
    elif type(obj) is tuple:
        return {_TAG: "tuple", "items": [_to_plain(v, tensors, f"{where}[{k}]") for k, v in enumerate(obj)]}
    elif type(obj) in (dict, OrderedDict):
        if all(type(k) is str for k in obj) and _TAG not in obj:
            return {k: _to_plain(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_TAG: "dict", "items": [[_to_plain(k, tensors, f"{where} (key {k!r})"),
                                         _to_plain(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    text = repr(obj)
    text = text if len(text) <= 60 else text[:57] + "..."
    raise TypeError(f"wide_compiler.integrations.ray: cannot checkpoint {where}: a "
                    f"{type(obj).__module__}.{type(obj).__qualname__} ({text}). Checkpoints hold "
                    f"tensors and plain values only (None, bool, int, float, str, list, tuple, dict) "
                    f"so that loading one runs no code: use a plain value in the configuration "
                    f"(e.g. a name that build_model maps to the object)")


def _from_plain(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """The inverse of :func:`_to_plain`."""
    if isinstance(obj, list):
        return [_from_plain(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _from_plain(v, tensors, where) for k, v in obj.items()}
    if tag == "tensor" and type(obj.get("index")) is int and 0 <= obj["index"] < len(tensors):
        return tensors[obj["index"]]
    if tag == "tuple" and isinstance(obj.get("items"), list):
        return tuple(_from_plain(v, tensors, where) for v in obj["items"])
    if tag == "dict" and isinstance(obj.get("items"), list) and all(
            isinstance(kv, list) and len(kv) == 2 for kv in obj["items"]):
        out = {}
        for k, v in obj["items"]:
            k = _from_plain(k, tensors, where)
            try:
                out[k] = _from_plain(v, tensors, where)
            except TypeError as e:  # an unhashable key (a list): not something _to_plain writes
                raise ValueError(f"wide_compiler.integrations.ray: {where} is corrupt (a dict key "
                                 f"{k!r}: {e})") from e
        return out
    raise ValueError(f"wide_compiler.integrations.ray: {where} is corrupt (an unknown entry "
                     f"{json.dumps(obj)[:80]})")


def _write_checkpoint(state: Mapping[str, Any], path: str) -> None:
    tensors: list[torch.Tensor] = []
    text = json.dumps(_to_plain(dict(state), tensors, "the population state"))
    payload = {"format": _FILE_FORMAT, "version": _FILE_VERSION, "state": text, "tensors": tensors}
    atomic_write(path, lambda f: torch.save(payload, f), "wide_compiler.integrations.ray: Population.save")


def _read_checkpoint(path: str, allow_pickle: bool) -> dict[str, Any]:
    where = f"wide_compiler.integrations.ray: load_checkpoint: {path}"
    if allow_pickle:
        log.warning("%s: loaded with pickle (allow_pickle=True, torch.load(weights_only=False)): "
                    "this runs any code the file holds; do it only for files you trust", where)
        obj = torch.load(path, map_location="cpu", weights_only=False)
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{where} holds Python objects that a safe load (torch.load(weights_only=True)) "
                f"refuses: a checkpoint written by wide_compiler before checkpoints became plain "
                f"data (with non-plain configuration values), or a crafted file. Loading it with "
                f"pickle runs any code it holds: only if you trust the file, pass "
                f"allow_pickle=True. ({str(e).splitlines()[0]})") from e
        except (RuntimeError, EOFError, ValueError) as e:   # truncated or not a torch.save file
            raise ValueError(f"{where} cannot be read as a checkpoint file ({type(e).__name__}: "
                             f"{e})") from e
    if isinstance(obj, dict) and obj.get("format") == _FILE_FORMAT:
        if obj.get("version") != _FILE_VERSION or not isinstance(obj.get("state"), str) \
                or not isinstance(obj.get("tensors"), list):
            raise ValueError(f"{where}: unknown checkpoint file version {obj.get('version')!r} (this "
                             f"wide_compiler reads version {_FILE_VERSION})")
        try:
            plain = json.loads(obj["state"])
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: its state is not valid JSON ({e})") from e
        state = _from_plain(plain, obj["tensors"], where)
    elif isinstance(obj, dict) and obj.get("format") == _FORMAT and "members" in obj:
        state = obj                                   # version 1: the state_dict pickled as it is
    else:
        raise ValueError(f"{where} is not a checkpoint of wide_compiler.integrations.ray")
    if not isinstance(state, dict):
        raise ValueError(f"{where} is not a checkpoint of wide_compiler.integrations.ray")
    return state

