"""The model fuzzer's CI tier (Note [The model fuzzer] in python/wide_compiler/fuzz.py): a fixed set
of generated programs, each compiled wide and compared with its members in train and eval mode at
several input sizes. A program may be refused clearly; it must never be wrong or crash. The long
mode is ``python -m wide_compiler.fuzz --minutes 30``; each finding becomes a case below."""

from __future__ import annotations

import json

import pytest

from wide_compiler import fuzz
from support import cpu_only

# a fixed budget: these seeds cover vectors, sequences (GRU, attention, length branches), images
# and index inputs, per-member constants and a second input (about 5 s each on 2 cores)
SEEDS = [0, 2, 3, 5, 7, 8, 13, 19, 22, 24, 100166, 300015]  # long-mode findings of the harness: 100166 a tie (see fuzz.py), 300015 a member with no parameters
#: seeds recorded before the generator's second stream (Note [The generator's second stream]): their programs
FIRST_GRAMMAR = {100166, 300015}


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_program_matches_its_members(seed):
    old = seed in FIRST_GRAMMAR
    result = fuzz.run_program(fuzz.generate(seed, second_stream=not old, state=not old))
    assert result.outcome in ("ok", "refused", "skipped"), result.report()


@pytest.mark.parametrize("seed", [17, 20, 38])
def test_branches_on_a_size_and_a_per_member_constant(seed):
    """Programs whose forward branches on a size and a per-member constant together (probe 3's F7:
    every member ran member 0's branch at other sizes)."""
    program = fuzz.generate(seed)
    assert "if h.shape[" in program.source and "self.s" in program.source, program.source
    result = fuzz.run_program(program)
    assert result.outcome in ("ok", "refused", "skipped"), result.report()


@pytest.mark.parametrize("seed, changed", [(4, "G ="), (28, "Cfg.K ="), (21, "D['scale'] ="), (45, "T[1][0] ="),
                                           (35, "FLAG ="), (2, "H ="), (27, "HOOK =")])
def test_state_changed_after_compiling(seed, changed):
    """Programs reading Python state that changes after the first calls (Note [State changed after
    compiling]): a global, a config class's attribute, a dict, a list in a tuple, a flag, a helper's
    global, a forward hook's global; probe 4's F5 and F6 ran the old value for some of them."""
    program = fuzz.generate(seed)
    assert program.mutations and program.mutations[0].startswith(changed), program.mutations
    result = fuzz.run_program(program)
    assert result.outcome in ("ok", "refused"), result.report()


@pytest.mark.parametrize("seed", [3, 8, 13])
def test_generated_program_in_float32_passes_the_trust_check(seed):
    import torch

    result = fuzz.run_program(fuzz.generate(seed), dtype=torch.float32)
    assert result.outcome in ("ok", "refused", "skipped"), result.report()


def test_the_generator_is_reproducible_and_varied():
    assert fuzz.generate(11).source == fuzz.generate(11).source
    sources = {fuzz.generate(s).source for s in range(40)}
    assert len(sources) == 40
    text = "\n".join(sources)
    for construct in ("nn.Linear", "nn.Conv2d", "nn.GRU", "scaled_dot_product_attention", "nn.Embedding",
                      "% 2 ==", "self.c", "def forward(self, x, y)", "h.shape[1] >= self.s", "Cfg.K"):
        assert construct in text, construct


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_wrong_wide_model_is_caught(monkeypatch, dtype):
    """The comparison can fail: a wide model whose member 1 is off is reported as wrong."""
    import torch

    from wide_compiler import api

    real = api.compile

    def off_by_one_member(*args, **kwargs):
        wide = real(*args, **kwargs)
        with torch.no_grad():
            next(wide.parameters())[1].add_(0.01)
        return wide

    monkeypatch.setattr(api, "compile", off_by_one_member)
    result = fuzz.run_program(fuzz.generate(0), dtype=getattr(torch, dtype))
    assert result.outcome == "wrong" and "member 1" in result.detail, result.report()


@pytest.mark.parametrize(("name", "dtype"), [(name, "float64") for name in sorted(fuzz.TRAIN_OPTIMIZERS)]
                         + [("SGD", "float32")])
def test_a_member_trained_with_another_learning_rate_is_caught(monkeypatch, name, dtype):
    """Note [Training steps in the fuzzer]: a wide optimizer that steps member 1 with twice its
    learning rate passes every call of the program (the calls take no step) and is reported by the
    training steps, naming the member and the weight, far above its own re-rounded training."""
    import torch

    import wide_compiler as wc

    class Off(getattr(wc.optim, name)):
        def __init__(self, params, lr, **kwargs):
            super().__init__(params, lr=[v * 2 if i == 1 else v for i, v in enumerate(lr)], **kwargs)

    monkeypatch.setattr(wc.optim, name, Off)
    monkeypatch.setattr(fuzz, "TRAIN_OPTIMIZERS", {name: fuzz.TRAIN_OPTIMIZERS[name]})
    result = fuzz.run_program(fuzz.generate(0), dtype=getattr(torch, dtype))
    assert result.outcome == "wrong", result.report()
    assert result.detail.startswith(f"after 2 {name} steps, member 1's ") and "re-rounded" in result.detail, \
        result.report()


def test_running_statistics_lost_when_members_are_given_back_are_caught(monkeypatch):
    """The training steps compare what ``unfuse`` gives back, buffers too: BatchNorm statistics
    left at their start in the members given back (generate(13): two BatchNorm2d) are a finding."""
    import torch

    from wide_compiler.model import WideModel

    real = WideModel.unfuse

    def stale(self):
        out = real(self)
        for m in out:
            for mod in m.modules():
                if isinstance(mod, torch.nn.BatchNorm2d):
                    mod.reset_running_stats()
        return out

    monkeypatch.setattr(WideModel, "unfuse", stale)
    result = fuzz.run_program(fuzz.generate(13))
    assert result.outcome == "wrong" and "running_" in result.detail, result.report()


def test_the_long_mode_keeps_its_compile_cache_to_itself(tmp_path, monkeypatch):
    """Every program of a run is new: the run's compile cache is a directory of its own, removed
    at the end (a hit is then two programs sharing a key), and the user's is not filled."""
    users = tmp_path / "users-cache"
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "1")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(users))
    assert fuzz.main(["--programs", "2", "--seed", "3", "--out", str(tmp_path / "out")]) == 0
    assert not users.exists() or not any(users.rglob("*"))
    assert json.loads((tmp_path / "out" / "summary-3.json").read_text())["programs"] == 2


# CPU only: the seeds were found on the CPU, whose member rounds to either side in the nudged runs;
# on a GPU (H200) the member of seed 1901016 rounded to one side in all six, so the check there
# judged the wide model's other side a defect (a false alarm, noted for the trust check)
@cpu_only
@pytest.mark.parametrize("seed", [1901016, 2001118])
def test_a_relu_whose_input_is_zero_up_to_rounding_is_not_a_finding(seed):
    """Long-mode findings of this session's run: a norm's output averaged over its own dims is 0 up
    to rounding (the bias, 0 at init), then a ReLU: the member and the wide model round to opposite
    signs and take different subgradients (a bias gradient 1.1 apart). Not a defect: float64 is
    judged as the harness judges it, against the member's own rounding (Note [Rounding in a
    float64 model]), which moves the member's gradient as much."""
    result = fuzz.run_program(fuzz.generate(seed))
    assert result.outcome == "ok", result.report()


@pytest.mark.parametrize("seed", [13, 20, 22, 23])
def test_generated_program_of_the_fourth_stream_matches_its_members(seed):
    """Note [The generator's fourth stream]: members of different widths compiled with pad=True
    (20, 22, 23) and in-place ops (all four); each compiles, and every call it takes is exact (a call
    at a size the padded program does not hold for is refused)."""
    program = fuzz.generate(seed, fourth=True)
    assert ("c['pad']" in program.source) == (seed != 13)
    assert "inplace=True" in program.source or "r += h" in program.source
    result = fuzz.run_program(program)
    assert result.outcome in ("ok", "refused"), result.report()
    assert not result.detail.startswith("compile"), result.report()


def test_a_padded_programs_call_at_other_sizes_is_refused_by_the_check_not_crashed():
    """generate(89, fourth=True): convolutions over widths 4-10 flattened, called at another image
    size (which the padded model refuses): the harness padded the members' outputs first and
    crashed in ``member_padded`` (IndexError); it now raises a clear error there too."""
    result = fuzz.run_program(fuzz.generate(89, fourth=True))
    assert result.outcome in ("ok", "refused"), result.report()
