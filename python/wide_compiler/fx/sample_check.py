"""Member 0 run eagerly on the sample before capture (:func:`check_sample`: a sample it cannot take
fails with PyTorch's own error), and a member run without changing it (:func:`attributes_kept`,
:func:`_run_on_clones`, which the member checks use too).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import WideCompileError
from .attribute_writes import _snapshot, held_objects, put_back_held

__all__ = ["attributes_kept", "check_sample"]


def check_sample(model: nn.Module, args: tuple, kwargs: dict, n: int) -> None:
    """Run member 0 eagerly on the sample before capture, so a sample it cannot take gets
    PyTorch's own error with real sizes (export's would come with its log and symbolic sizes
    such as ``s77``) and a hint about what the sample is. Nothing of the user's changes: the
    member runs as a deep copy (or on clones of its tensors), with the random number generators
    restored, in the caller's grad mode (a forward may take gradients inside)."""
    try:
        signature = inspect.signature(model.forward)
        signature.bind(*args, **kwargs)
    except TypeError as e:  # the sample does not fit the forward's parameters
        name = next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("_"))  # not a form's
        raise WideCompileError(
            f"wide_compiler: member 0 ({name}) cannot take the sample: its forward{signature} says {e} (the "
            f"sample gives {len(args)} positional input(s){', keywords ' + ', '.join(kwargs) if kwargs else ''}). "
            "Pass one member's inputs as the forward takes them: a tuple for several positional inputs, "
            "sample_kwargs= for keywords") from None
    except ValueError:
        pass  # no signature to read
    devices = sorted({t.device.index for t in (*model.parameters(), *model.buffers()) if t.is_cuda} - {None})
    try:
        with torch.random.fork_rng(devices=devices):
            try:
                member = copy.deepcopy(model)
            except Exception:  # noqa: BLE001 -- objects that refuse to be copied
                _run_on_clones(model, args, kwargs, contextlib.nullcontext())
            else:
                member(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the member's own error, whatever its type
        shapes = ", ".join(_describe_input(a) for a in tree_flatten((args, kwargs))[0]) or "no tensors"
        leading = {a.shape[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.dim()}
        hint = (f" Its dim 0 is {n}, the number of members: if that is the member dim, pass one member's "
                "input (sample[0]) instead." if leading == {n} else "")
        raise WideCompileError(
            f"wide_compiler: member 0 ({type(model).__name__}) fails on the sample ({shapes}): "
            f"{type(e).__name__}: {e}\n"
            "The sample is ONE member's input, without the member dim N: what you would pass to "
            f"members[0](...), e.g. a batch [B, features] for an MLP.{hint}") from e


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Any:
    """Put back every module's own Python attributes when the block ends (raised or not): rebound
    values (a call counter) get their old object back, attributes the block added are removed,
    and lists, dicts and sets changed in place get their old contents back. The same for the
    plain objects the modules hold (``self.state.step``, ``self.state.seen``: Note [A forward that
    writes its module's attributes] in fx/attribute_writes.py), so a member run in place leaves
    the user's objects as they were.

    >>> import types
    >>> m = nn.Linear(1, 1)
    >>> m.state = types.SimpleNamespace(step=0, seen=[])
    >>> with attributes_kept(m):
    ...     m.state.step += 1
    ...     m.state.seen.append(1)
    ...     m.state.extra = True
    >>> m.state
    namespace(step=0, seen=[])
    """
    held = [(obj, _snapshot(obj)) for _, _, obj in held_objects(list(model.named_modules()))]
    saved = []
    for m in model.modules():
        attrs = dict(m.__dict__)
        contents = {}
        for k, v in attrs.items():
            if isinstance(v, (list, dict, set)) and k not in ("_parameters", "_buffers", "_modules"):
                try:
                    contents[k] = copy.copy(v)
                except Exception:  # noqa: BLE001 -- kept as it is: a rebinding is still undone
                    pass
        saved.append((m, attrs, contents))
    try:
        yield
    finally:
        put_back_held(held)
        for m, attrs, contents in saved:
            for k in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            for k, old in contents.items():
                v = attrs[k]
                if isinstance(v, list):
                    v[:] = old
                else:
                    v.clear()
                    v.update(old)


def _run_on_clones(model: nn.Module, args: tuple, kwargs: dict, rec: Any) -> None:
    """Run ``model`` with clones of its parameters and buffers (``functional_call``), inside the
    context ``rec`` (the member checks' op recorder, or a null context), its Python attributes
    kept (:func:`attributes_kept`)."""
    tensors = {k: v.detach().clone() for k, v in (*model.named_parameters(remove_duplicate=False),
                                                   *model.named_buffers(remove_duplicate=False))}
    with attributes_kept(model), torch.no_grad(), rec:
        torch.func.functional_call(model, tensors, args, kwargs, strict=False)


def _describe_input(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"a {a.dtype} tensor {list(a.shape)}".replace("torch.", "")
    return repr(a)
