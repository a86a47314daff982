"""A wide model deployed (mixed into :class:`~wide_compiler.WideModel`): its eval graph as a
``torch.export`` program (``export``) or compiled ahead of time with AOTInductor (``package``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils._pytree import tree_map

__all__ = ["DeploymentMixin"]


class DeploymentMixin:
    """Export and packaging of the eval graph. The host class has ``n``, the compile sample and
    its graphs (``_graph_for``)."""

    n: int

    def export(self, path: str | os.PathLike | None = None, *args: Any, **kwargs: Any) -> ExportedProgram:
        """The eval graph of this model as a ``torch.export`` program (written to ``path`` with
        ``torch.export.save`` when given): ATen ops and the ``torch.ops.wide`` ops, the parameters
        and buffers as they are now, the batch dynamic as at compile time. The file is written
        atomically (a temporary file of an unpredictable name beside it, then renamed over
        ``path``; a symlink at ``path`` is replaced, not followed); a ``path`` that is a directory,
        or whose directory is missing or cannot be written, raises an ``OSError`` naming it.

        ``args``/``kwargs``: N-first example inputs (default: the compile sample, one copy per
        member). Traced under ``no_grad`` in eval mode (this model's mode is restored). Load it
        with ``torch.export.load(path).module()`` in a process that imported ``wide_compiler``
        (which registers the ``wide`` ops); its outputs are this model's. The program takes its
        inputs positionally: keyword inputs follow the positional ones in the sample's order
        (``torch.export`` cannot give a ``**kwargs`` forward dynamic shapes).

        >>> import torch, tempfile, os, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()) for _ in range(3)]
        >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
        >>> path = os.path.join(tempfile.mkdtemp(), "wide.pt2")
        >>> _ = wide.export(path)
        >>> x = torch.randn(3, 5, 4)                                    # another batch size
        >>> torch.allclose(torch.export.load(path).module()(x), wide.eval()(x))
        True
        """
        if not args and not kwargs:
            args, kwargs = tree_map(lambda a: a.unsqueeze(0).expand(self.n, *a.shape).clone()
                                    if isinstance(a, torch.Tensor) else a, self._sample)
        wg = self._graph_for(False)
        dims = iter([i.member_shape for i in wg.inputs if i.kind == "user"])

        def spec(a: Any) -> Any:
            member = next(dims, None) if isinstance(a, torch.Tensor) else None
            if member is None:
                return None
            return {d + 1: torch.export.Dim.AUTO for d, m in enumerate(member) if m is None} or None

        inputs = (*args, *kwargs.values())  # keywords become trailing positional inputs (see above)
        dynamic = (tuple(tree_map(spec, a) for a in inputs),)
        training = self.training
        try:
            self.eval()
            with torch.no_grad():
                if wg.constant_table is not None:  # Note [Exporting per-member constants]
                    covering = self._graph_covering(False, tuple(args), dict(kwargs))  # the graph the call runs
                    runs = covering[0] if covering is not None else wg
                    self._sync_constants(runs)
                    self.__dict__["_constants_checked_for_export"] = runs
                ep = torch.export.export(_PositionalCall(self, list(kwargs)), inputs, dynamic_shapes=dynamic,
                                         strict=False)
        finally:
            self.__dict__.pop("_constants_checked_for_export", None)
            self.train(training)
        if path is not None:  # atomically, via an unpredictable temporary name beside it
            from ._files import atomic_write

            atomic_write(path, lambda f: torch.export.save(ep, f), "wide_compiler.WideModel.export")
        return ep

    def package(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> str:
        """Compile the eval graph ahead of time with AOTInductor into a ``.pt2`` package at
        ``path`` (returned): native code for this model's device, the weights inside, the batch
        dynamic. ``args``/``kwargs`` as :meth:`export`. A C++ program runs it with
        ``torch::inductor::AOTIModelPackageLoader`` linking LibTorch and ``WideCompiler::wide``
        (the ``wide`` ops; README: "The C++ API"); Python loads it with
        ``torch._inductor.aoti_load_package``. Needs a C++ compiler (it compiles), and takes
        seconds to minutes. Wide forms registered with ``wc.register`` are traced into the
        program like every other module.

        >>> import torch, tempfile, os, wide_compiler as wc
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()) for _ in range(3)]
        >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
        >>> path = wide.package(os.path.join(tempfile.mkdtemp(), "wide.pt2"))  # doctest: +SKIP
        >>> loaded = torch._inductor.aoti_load_package(path)                    # doctest: +SKIP
        >>> x = torch.randn(3, 5, 4)
        >>> torch.allclose(loaded(x), wide.eval()(x))                           # doctest: +SKIP
        True
        """
        ep = self.export(None, *args, **kwargs)
        import torch._inductor  # deferred: importing inductor costs seconds

        return torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path))


# Note [Exporting per-member constants]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Before a graph with per-member constants runs, the model checks that every member's constants
# are a configuration the graph was compiled for and sets the buffers derived from them (Note
# [Per-member constants at the call] in model_constants.py): Python on the buffers' values, which
# torch.export traces without values (it failed inside export, GuardOnDataDependentSymNode). The
# constants are fixed values at export time, so ``export`` checks and sets them on the real
# buffers first, and the traced call skips the check; the program holds the buffers as they are
# then, like every other buffer. A torch.export of the model that did not come through ``export``
# is refused by the check itself, naming ``export``. The graph checked is the one the example
# inputs run (found, or captured, as an eager call would: Note [Guards]), not always the mode's
# first: an example outside its guards (an odd batch where the forward tests the parity) runs
# another graph, whose check then refused the export, telling the user to call wide.export() --
# the call they had made (probe 6 of issue 44, F9).


class _PositionalCall(nn.Module):
    """``wide(*args, **dict(zip(names, trailing)))`` with every input positional (for export)."""

    def __init__(self, wide: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.wide, self.names = wide, names

    def forward(self, *inputs: Any) -> Any:
        k = len(inputs) - len(self.names)
        return self.wide(*inputs[:k], **dict(zip(self.names, inputs[k:])))
