"""Hooks that write outside themselves, and one that does not, with what
``wide_compiler.fx.hook_writes`` reads of each (test_python_versions.py runs this under every
Python it finds: ``python hook_cases.py`` prints the readings as JSON, over a stand-in torch)."""
from __future__ import annotations

import functools
import json
import sys
import types

G: dict = {}
FEATS: list = [[]]
BUF = None


class Recorder:
    def __init__(self):
        self.items = []

    def __call__(self, mod, inp, out):
        self.items.append(out.detach())


class Counted:
    def __init__(self):
        self.n = 0

    def hook(self, mod, inp, out):
        self.n += 1
        return out * self.n

    def log(self, out):
        self.last = out

    def via_method(self, mod, inp, out):
        self.log(out)


def record(store, mod, inp, out):
    store.append(out)


def record_into(table, out):
    table.setdefault("acts", []).append(out)


class RecordsThroughAHelper:
    def __init__(self):
        self.items = {}

    def __call__(self, module, args, out):
        if isinstance(module, int):
            record_into(self.items, out)


class Nested:
    def __init__(self):
        self.d = {"a": []}

    def __call__(self, mod, inp, out):
        self.d["a"].append(out)


def into_a_global(mod, inp, out):
    G["x"] = out


def into_a_global_list(mod, inp, out):
    FEATS[0].append(out)


def in_place(mod, inp, out):
    BUF.copy_(out)


def in_a_comprehension(mod, inp, out):
    return [FEATS.append(x) for x in (out,)]


def pure(mod, inp, out):
    return out * 2


STATS: dict = {}
CFG = types.SimpleNamespace(scale=2.0, seen=[])


def forward_that_keeps_state(x):
    STATS["calls"] = STATS.get("calls", 0) + 1
    CFG.seen.append(x)
    return x * CFG.scale


HOOKS = {"recorder": Recorder(), "counted.hook": Counted().hook, "counted.via_method": Counted().via_method,
         "partial": functools.partial(record, []), "helper": RecordsThroughAHelper(), "global": into_a_global,
         "global list": into_a_global_list, "in place": in_place, "nested": Nested(),
         "comprehension": in_a_comprehension, "pure": pure}


def readings(hook_writes) -> dict:
    """Per hook: the globals/cells it writes, its writes into what it is bound to (and the phrase
    naming those objects), and its helpers that write."""
    out = {}
    model = types.SimpleNamespace(modules=lambda: [])  # a model none of the hooks is bound to
    for name, hook in HOOKS.items():
        bound, whose = hook_writes._object_writes(hook, model)
        fn = hook_writes._hook_function(hook)
        out[name] = [sorted(hook_writes._hook_writes(hook_writes._hook_code(hook))), sorted(bound), whose,
                     sorted(hook_writes._helper_writes(fn)) if fn is not None else []]
    import dis

    from wide_compiler.fx.code_reads import _written_into

    out["forward's writes"] = sorted(_written_into(list(dis.get_instructions(forward_that_keeps_state))))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from stub_torch import load

    print(json.dumps(readings(load())))
