"""Real models nobody here wrote (tiny random configs from transformers and diffusers, catalog in
real_models.py), each compiled with strict=True (no fallback) and checked member by member with
wide_compiler.testing: eval and train outputs, input and parameter gradients, buffers."""
from __future__ import annotations

import warnings

import pytest
import torch
import wide_compiler as wc
from wide_compiler.testing import check_compile

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from real_models import catalog, members, sample  # noqa: E402  (after the skips: it imports both)

CASES = catalog()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_real_model_matches_its_members(case):
    models = members(case)
    args, kwargs = sample(case)
    modes = ("train", "eval")
    if case.train_refused:  # refused in train, before anything is built (a custom autograd.Function)
        with pytest.raises(wc.WideCompileError, match=case.train_refused):
            wc.compile(models, args, sample_kwargs=kwargs, strict=True, config=wc.WideConfig.fast())
        models, modes = [m.eval() for m in models], ("eval",)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wide, report = check_compile(models, args, sample_kwargs=kwargs, shared=(False,), strict=True,
                                     config=wc.WideConfig.fast(), modes=modes)
    assert not wide.fallbacks
    for key in (f"{mode}/own" for mode in modes):  # dropout is 0: train mode is compared too, never skipped
        assert not isinstance(report[key], str), report[key]
    if "train" in modes:
        assert report["train/own"]["param_grad"] is not None


@pytest.mark.parametrize("name", ["Wav2Vec2Model", "DebertaV2Model"])
def test_real_model_compiled_outside_autocast_runs_under_it_as_its_members(name):
    """Note [A dtype the forward reads]: compiled outside autocast, called under CPU bfloat16
    autocast (the suite's device's). Both read dtypes of their activations; before, Wav2Vec2 returned float32 where each
    member returns bfloat16, and DeBERTa-v2 failed filling float32's minimum into a bfloat16 mask."""
    from torch.utils._pytree import tree_flatten

    from support import DEVICE

    from wide_compiler.testing import assert_trees_members_close

    case = next(c for c in CASES if c.name == name)
    models = [m.eval() for m in members(case)]
    args, kwargs = sample(case)
    wide = wc.compile(models, args, sample_kwargs=kwargs or None, config=wc.WideConfig.fast()).eval()
    stack = lambda t: t.expand(len(models), *t.shape)  # noqa: E731
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = wide(*map(stack, args), **{k: stack(v) for k, v in kwargs.items()})
        refs = [m(*args, **kwargs) for m in models]
    assert [t.dtype for t in tree_flatten(out)[0]] == [t.dtype for t in tree_flatten(refs[0])[0]]
    assert_trees_members_close(out, refs, torch.bfloat16)


def test_decoder_cache_comes_out_n_first():
    """A decoder as it comes (use_cache=True) returns its DynamicCache; every key/value tensor of
    the wide cache is N-first and member i's slice is member i's own cache."""
    case = next(c for c in CASES if c.name == "LlamaForCausalLM")
    models = [m.eval() for m in members(case)]
    ids = case.args()[0]
    wide = wc.compile(models, (ids,), strict=True, config=wc.WideConfig.fast())
    out = wide(ids.expand(3, *ids.shape))
    layer = out.past_key_values.layers[0]
    assert layer.keys.shape[0] == 3
    for i, m in enumerate(models):
        ref = m(ids).past_key_values.layers[0]
        torch.testing.assert_close(layer.keys[i], ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values[i], ref.values, rtol=1e-5, atol=1e-5)


def test_unknown_output_container_names_what_to_do():
    class Box:
        def __init__(self, t):
            self.t = t

    class ReturnsBox(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return Box(self.fc(x))

    with pytest.raises(wc.WideCompileError, match=r"(?s)returns a .*Box.*use_cache.*register_pytree_node"):
        wc.compile([ReturnsBox() for _ in range(2)], torch.randn(2, 3))


def test_readme_table_lists_the_catalog():
    """The README's "Models known to work" table is generated from this catalog: same models."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("<!-- real-models-table -->")[1].split("<!-- /real-models-table -->")[0]
    listed = re.findall(r"^\| ([^|]+?) \| (?:transformers|diffusers) \|", block, flags=re.M)
    assert listed == [c.name for c in CASES], "regenerate: .venv/bin/python tests/python/real_models.py"


def test_analyze_runs_on_a_transformers_model():
    """wc.analyze on a model of the catalog: it compiles, times against the loop and vmap, and
    finds a member count that fits a small budget. Activation memory is measured at the one N
    timed (``memory_ns=(2,)``: the wide model already compiled; the default N = 1, 2, 4 compiled a
    BERT twice more, and the linear fit over several Ns is test_analyze.py's)."""
    case = next(c for c in CASES if c.name == "BertModel")
    args, _ = sample(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = wc.analyze(lambda: case.make().eval(), args, n=(2,), modes=("inference",), repeats=2,
                            memory="500MB", memory_ns=(2,))
    data = report.to_dict()
    assert data["compile"]["fallbacks"] == [] and data["compile"]["wide_ops"]
    row = data["speed"][0]
    assert row["n"] == 2 and row["ms"]["wide"] > 0 and row["ms"]["loop"] > 0 and row["speedup"]["vmap"] > 0
    assert data["memory"]["measured_ns"] == [2] and data["memory"]["activation_bytes_per_member"] > 0
    assert data["memory"]["max_n_train"] >= 1


def test_bloom_trains_with_its_own_gelu_backward(monkeypatch):
    """BLOOM's GeLU is transformers' custom GeLUFunction: the built-in wide form of BloomGelu
    (wide_compiler/nn/library_forms.py) applies it to the wide tensor, so in the wide model's
    backward GeLUFunction.backward runs once per layer, on all members at once."""
    from transformers.models.bloom import modeling_bloom

    case = next(c for c in CASES if c.name == "BloomForCausalLM")
    calls = []
    own = modeling_bloom.GeLUFunction.backward

    def backward(ctx, g):
        calls.append(g.shape[0])
        return own(ctx, g)

    monkeypatch.setattr(modeling_bloom.GeLUFunction, "backward", staticmethod(backward))
    models = members(case)
    args, kwargs = sample(case)
    wide = wc.compile(models, args, sample_kwargs=kwargs, strict=True, config=wc.WideConfig.fast())
    assert wide._registered == ["transformer.h.0.mlp.gelu_impl", "transformer.h.1.mlp.gelu_impl"]
    ids = args[0].expand(len(models), *args[0].shape)
    wide(ids, **kwargs).logits.sum().backward()
    assert calls == [len(models)] * 2  # N-first: one call per layer for every member
