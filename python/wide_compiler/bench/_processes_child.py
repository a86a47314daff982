"""One process of the ``processes`` baseline (:mod:`wide_compiler.bench.processes`): ``python -m
wide_compiler.bench._processes_child '<json spec>'`` builds its member, warms up, prints ``ready``,
waits for a line on stdin, runs its steps and prints ``done`` (a module of its own: run as
``__main__``, a target's module would register the target twice)."""
from __future__ import annotations

import json
import sys
from typing import Any

import torch

from .vision import case_by_name


def member_step(spec: dict[str, Any]) -> Any:
    """The step of one member of a benchmark case (``spec``: the case's ``target``, ``size``,
    ``case``, the ``member`` index, ``mode``, ``device``): forward under ``no_grad`` in
    inference; forward, the sum of the outputs and ``backward()`` into cleared ``.grad`` in
    training (the steps of :func:`wide_compiler.measure.make_step`)."""
    from torch.utils._pytree import tree_leaves

    case = case_by_name(spec["target"], spec["size"], spec["case"])
    torch.manual_seed(spec["member"])
    device = torch.device(spec["device"])
    training = spec["mode"] == "train"
    model = case.make().to(device).train(case.train_state if case.train_state is not None else training)
    g = torch.Generator().manual_seed(spec["member"])
    xs = tuple(t.to(device) for t in case.inputs((case.batch,), g))
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        if not training:
            with torch.no_grad():
                model(*xs)
            return
        for p in params:
            p.grad = None
        out = [t for t in tree_leaves(model(*xs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        sum(t.sum() for t in out).backward()

    return step


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    step = member_step(spec)
    for _ in range(spec["warmup"]):
        step()
    _sync(spec["device"])
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(spec["steps"]):
        step()
    _sync(spec["device"])
    print("done", flush=True)
