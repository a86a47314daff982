"""Built-in wide forms of other libraries' modules whose forward calls a custom
``torch.autograd.Function``: a train graph refuses such a function (Note [Custom Functions are
not sampled] in fx/export_watch.py), and a wide form that applies the SAME function to the wide
tensor runs its own backward, so the module trains fused exactly.

Nothing here imports the library: a form is looked up by the module's class (its module path and
name), which exists only once the user's code has imported the library, and is used only where
the library's source is the one read when the form was written (Note [BLOOM's GeLU is pointwise]).

Today: transformers' ``BloomGelu`` (BLOOM's MLP activation, ``GeLUFunction``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["WideBloomGelu", "library_wide_form"]

log = logging.getLogger("wide_compiler")

# Note [BLOOM's GeLU is pointwise]
# transformers' BLOOM (modeling_bloom.py, read in transformers 5.23.0, the version the project
# pins) computes its MLP activation with ``BloomGelu``, whose forward is ``GeLUFunction.apply(x)``:
#   forward(ctx, input):  ctx.save_for_backward(input); return bloom_gelu_forward(input)
#       bloom_gelu_forward(x) = x * 0.5 * (1.0 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
#   backward(ctx, g):     bloom_gelu_back(g, ctx.saved_tensors)
#       x = x[0]  -- the first saved tensor of the TUPLE ctx.saved_tensors, not row 0 of a tensor
#       tanh_out = tanh(0.79788456 * x * (1 + 0.044715 * x * x))
#       return (0.5 * x * ((1 - tanh_out^2) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)) * g
# Both are elementwise in x (and g): every output element depends only on the input element (and
# cotangent element) at the same index, through scalar arithmetic with Python float constants and
# tanh; no reduction, no shape, no dtype switch, no Python state. So applied to the N-first wide
# tensor [N, ...] the function computes, at every index of member i's slice, exactly what it
# computes on member i's tensor alone -- forward and backward -- with N folded into the elements
# (the same kernels on more elements: pointwise kernels give each element the same bits whatever
# the tensor's size). The module has no parameters, buffers or children, so there is no per-member
# state to stack. The wide form therefore calls the member's own forward (the installed class's,
# so the same ``GeLUFunction.apply``) on the wide tensor, and autograd runs ``GeLUFunction.backward``
# in the wide model's backward, as it does for each member.
#
# This reasoning holds for the source read. A form is used only while the installed source of
# BloomGelu, GeLUFunction, bloom_gelu_forward and bloom_gelu_back hashes to the hash of that source
# (_BLOOM_SOURCE): another transformers version that changed any of them gets no wide form (logged
# at INFO), and so the refusal of a train graph with a custom Function, with its reasons, as before.
# Only the exact class is matched (a subclass may override forward), and a member with hooks of its
# own is refused by from_modules.

_BLOOM_MODULE = "transformers.models.bloom.modeling_bloom"
_BLOOM_PARTS = ("BloomGelu", "GeLUFunction", "bloom_gelu_forward", "bloom_gelu_back")
_BLOOM_SOURCE = "59e59e3b3dbc1d68a641599d6d359ad5687ff7efbcdfb104f1fe9b41fe5f8fb6"  # sha256, transformers 5.23.0


def _source_hash(module_name: str, parts: Sequence[str]) -> str | None:
    """sha256 of the source of ``parts`` of the (already imported) module, or None when unreadable."""
    lib = sys.modules.get(module_name)
    try:
        text = "".join(inspect.getsource(getattr(lib, p)) for p in parts)
    except (AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class WideBloomGelu(nn.Module):
    """N transformers ``BloomGelu`` modules as one: the member's own forward (``GeLUFunction.apply``)
    on the N-first tensor, so its custom backward runs in the wide model's backward (Note [BLOOM's
    GeLU is pointwise]). ``wide_compiler.compile`` uses it for every ``BloomGelu`` by itself.

    Example (needs transformers; a plain module stands in for the doctest's sake otherwise):
        >>> import torch
        >>> try:
        ...     from transformers.models.bloom.modeling_bloom import BloomGelu
        ... except ImportError:
        ...     BloomGelu = None
        >>> if BloomGelu is not None:
        ...     gelus = [BloomGelu() for _ in range(3)]
        ...     wide = WideBloomGelu.from_modules(gelus)
        ...     x = torch.randn(3, 2, 5)
        ...     ok = all(torch.equal(wide(x)[i], gelus[i](x[i])) for i in range(3))
        ... else:
        ...     ok = True
        >>> ok
        True
    """

    def __init__(self, template: nn.Module, n: int) -> None:
        super().__init__()
        self.n = n
        object.__setattr__(self, "_template", template)  # not a submodule: no state, not named

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> WideBloomGelu:
        """The wide form of ``modules`` (N ``BloomGelu``, the exact class, without hooks)."""
        modules = list(modules)
        if not modules:
            raise ValueError("WideBloomGelu.from_modules: no modules given")
        kind = type(modules[0])
        for i, m in enumerate(modules):
            if type(m) is not kind or kind.__name__ != "BloomGelu":
                raise TypeError(f"WideBloomGelu.from_modules: member {i} is a {type(m).__qualname__}, not "
                                f"{kind.__module__}.BloomGelu")
            if list(m.parameters()) or list(m.buffers()) or list(m.children()):
                raise TypeError(f"WideBloomGelu.from_modules: member {i}'s BloomGelu holds parameters, buffers or "
                                "submodules, which transformers' does not: not the module this form was written for")
            if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                    or m.__dict__.get("forward") is not None):
                raise TypeError(f"WideBloomGelu.from_modules: member {i}'s BloomGelu has hooks or a forward of "
                                "its own, which the wide form would not run per member")
        template = kind()
        template.train(modules[0].training)
        return cls(template, len(modules))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[0] != self.n:
            raise ValueError(f"WideBloomGelu: an N-first input with N={self.n} expected, got shape {tuple(x.shape)}")
        self._template.training = self.training  # our own copy: the member's forward as it reads the mode
        return self._template(x)

    def unfuse(self) -> list[nn.Module]:
        """N ``BloomGelu`` modules (stateless: new ones, in this module's mode)."""
        return [type(self._template)().train(self.training) for _ in range(self.n)]


@functools.lru_cache(maxsize=None)
def _bloom_form_applies(cls: type) -> bool:
    """Whether ``cls`` is transformers' BloomGelu with the source Note [BLOOM's GeLU is pointwise] read."""
    lib = sys.modules.get(_BLOOM_MODULE)
    if lib is None or getattr(lib, "BloomGelu", None) is not cls:
        return False
    found = _source_hash(_BLOOM_MODULE, _BLOOM_PARTS)
    if found != _BLOOM_SOURCE:
        log.info("wide_compiler: transformers' BloomGelu/GeLUFunction is not the source its wide form was "
                 "written for (Note [BLOOM's GeLU is pointwise]); it is captured as it is (a train graph is "
                 "refused: its custom Function's backward would not run)")
        return False
    return True


def library_wide_form(module: nn.Module) -> type | None:
    """The built-in wide form of another library's ``module``, or None. Cheap for every other
    module (a look at its class's module path); never imports the library.

    >>> library_wide_form(torch.nn.GELU()) is None
    True
    """
    cls = type(module)
    if cls.__module__ == _BLOOM_MODULE and cls.__name__ == "BloomGelu" and _bloom_form_applies(cls):
        return WideBloomGelu
    return None
