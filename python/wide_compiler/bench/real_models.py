"""``benchmark real``: standard architectures at their real widths (DESIGN §10), N=4 members with
a small batch: the standard ResNet-18 of the benchmark zoo, and models built from ``transformers``
configurations at their defaults with dropout off (no downloads: random weights), ResNet-50 (``ResNetConfig()``),
ConvNeXt-T (``ConvNextConfig()``), ViT-B/16 (``ViTConfig(image_size=64)``: the real widths and
depth on 64x64 images), BERT-base (``BertConfig()``) and GPT-2 small (``GPT2Config()``).
Strategy mistakes only show at these sizes (a grouped conv with hundreds of channels per group is
slower than N convs on CPU). ``transformers`` is optional: without it only ResNet-18 runs, and
the records say why the others are missing.

Presets: ``ci`` the same architectures at toy widths (seconds: a smoke run of the harness);
``quick`` N=4 at real widths (minutes); ``full`` N=4 and 16.

Example::

    >>> from wide_compiler.bench.real_models import real_cases
    >>> [c.name for c in real_cases("tiny")][:1]
    ['resnet18']
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch
from torch import nn

from .registry import Preset
from .vision import Case, _vision_target
from .vision_models import ResNet18

__all__ = ["REAL_PRESETS", "real_cases"]

log = logging.getLogger(__name__)

REAL_PRESETS: dict[str, Preset] = {
    "ci": Preset("the architectures at toy widths, N=2 (seconds)", 0.01,
                 {"ns": (2,), "size": "tiny", "compile_variants": ("auto",)}),
    "quick": Preset("real widths, N=4 (minutes)", 0.5,
                    {"ns": (4,), "size": "real", "compile_variants": ("auto",)}),
    "full": Preset("real widths, N=4 and 16 (many minutes)", 0.5,
                   {"ns": (4, 16), "size": "real", "compile_variants": ("auto", "fast")}),
}


class _Hidden(nn.Module):
    """A transformers model returning one tensor of its output (the pooled one where the model
    has a pooler, so every parameter gets a gradient)."""

    def __init__(self, model: nn.Module, key: str = "last_hidden_state") -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return getattr(self.model(x), self.key)


def _hf(cls_name: str, config: Callable[[bool], object], key: str = "last_hidden_state"):
    def make(tiny: bool) -> nn.Module:
        import transformers as T

        return _Hidden(getattr(T, cls_name)(config(tiny)), key)
    return make


def _cfg(name: str, real: dict, tiny: dict):
    def config(is_tiny: bool):
        import transformers as T

        return getattr(T, name)(**(tiny if is_tiny else real))
    return config


# Dropout off, so that training results are compared with the members exactly (the default
# configs draw dropout, which members and wide model draw differently; ``benchmark dropout`` times it).
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_GPT2_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_TEXT_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
#: name -> (make(tiny), input maker(lead, tiny, g), batch, description)
_MODELS: dict[str, tuple] = {
    "resnet18": (lambda tiny: ResNet18(8 if tiny else 64, 10 if tiny else 1000),
                 lambda lead, tiny, g: (torch.randn(*lead, 3, 64, 64, generator=g, device=g.device),), 8,
                 "ResNet-18 (the zoo's torchvision layout), 64x64"),
    "hf_resnet50": (_hf("ResNetModel", _cfg("ResNetConfig", {}, {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64],
                                                                 "depths": [1, 1, 1, 1]}), "pooler_output"),
                    lambda lead, tiny, g: (torch.randn(*lead, 3, 64, 64, generator=g, device=g.device),), 4,
                    "transformers ResNetModel(ResNetConfig()) = ResNet-50, 64x64"),
    "hf_convnext": (_hf("ConvNextModel", _cfg("ConvNextConfig", {}, {"hidden_sizes": [8, 16, 32, 64],
                                                                     "depths": [1, 1, 1, 1]}), "pooler_output"),
                    lambda lead, tiny, g: (torch.randn(*lead, 3, 64, 64, generator=g, device=g.device),), 4,
                    "transformers ConvNextModel(ConvNextConfig()) = ConvNeXt-T, 64x64"),
    "hf_vit": (_hf("ViTModel", _cfg("ViTConfig", {"image_size": 64, **_NO_DROPOUT},
                                               {"image_size": 64, **_TEXT_TINY, **_NO_DROPOUT}), "pooler_output"),
               lambda lead, tiny, g: (torch.randn(*lead, 3, 64, 64, generator=g, device=g.device),), 4,
               "transformers ViTModel(ViTConfig(image_size=64)) = ViT-B/16 widths, 16 patches"),
    "hf_bert": (_hf("BertModel", _cfg("BertConfig", _NO_DROPOUT, {**_TEXT_TINY, **_NO_DROPOUT}), "pooler_output"),
                lambda lead, tiny, g: (torch.randint(0, 1000, (*lead, 64), generator=g, device=g.device),), 4,
                "transformers BertModel(BertConfig()) = BERT-base, T=64"),
    "hf_gpt2": (_hf("GPT2Model", _cfg("GPT2Config", _GPT2_NO_DROPOUT,
                                                    {"n_embd": 32, "n_layer": 2, "n_head": 2, **_GPT2_NO_DROPOUT})),
                lambda lead, tiny, g: (torch.randint(0, 1000, (*lead, 64), generator=g, device=g.device),), 4,
                "transformers GPT2Model(GPT2Config()) = GPT-2 small, T=64"),
}


@_vision_target("real", "standard architectures at their real widths: ResNet-18, and ResNet-50, "
                "ConvNeXt-T, ViT-B, BERT-base, GPT-2 from transformers configs (N=4)", REAL_PRESETS)
def real_cases(size: str) -> list[Case]:
    """One case per model; ``size`` is ``"tiny"`` (toy widths) or ``"real"``."""
    tiny = size == "tiny"
    have_hf = importlib.util.find_spec("transformers") is not None
    if not have_hf:
        log.warning("benchmark real: transformers is not installed (pip install transformers); "
                    "running ResNet-18 only")
    out = []
    for name, (make, inputs, batch, what) in _MODELS.items():
        if name.startswith("hf_") and not have_hf:
            continue
        out.append(Case("real", name, what if not tiny else f"{name}/tiny",
                        lambda make=make: make(tiny), lambda lead, g, inputs=inputs: inputs(lead, tiny, g),
                        2 if tiny else batch,
                        baselines=("loop", "loop_cl", "vmap") if name in ("resnet18", "hf_resnet50", "hf_convnext")
                        else ("loop", "vmap")))
    return out
