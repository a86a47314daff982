"""Whole models for ``benchmark models`` (DESIGN §10): the vision, audio and tabular families the
widen pass covers, a transformer encoder layer and the Flux double/single-stream blocks of
:mod:`wide_compiler.blocks` (also timed as their hand-built wide blocks), each at a few sizes.

Each entry of :data:`MODELS` is a :class:`ModelSpec`: ``make(size)`` builds one member (its own
random init), ``inputs(lead, size, generator)`` builds that member's inputs with leading dims
``lead`` (``(B,)`` for one member's sample, ``(N, B)`` for the N-first wide input). ``size`` is
``"tiny"`` (the shapes of tests/python/test_vision_models.py, for smoke runs) or ``"small"``
(moderate shapes for timing). The architectures are those of :mod:`wide_compiler.zoo` (the one
model zoo; re-exported here); this module adds their sizes and inputs.

>>> import torch
>>> from wide_compiler.bench.vision_models import MODELS
>>> spec = MODELS["resnet"]
>>> m = spec.make("tiny")
>>> (x,) = spec.inputs((2,), "tiny", torch.Generator().manual_seed(0))
>>> m(x).shape
torch.Size([2, 5])
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

# The model definitions live in the one model zoo (wide_compiler.zoo); re-exported here.
from ..zoo import (  # noqa: F401
    BasicBlock,
    ResNet18,
    ResNetTiny,
    Tabular,
    audio1d,
    dcgan_d,
    dcgan_g,
    mobilenet,
)
from ..zoo import encoder_layer as transformer

__all__ = ["MODELS", "SIZES", "BasicBlock", "ModelSpec", "ResNet18", "ResNetTiny", "Tabular", "audio1d",
           "dcgan_d", "dcgan_g", "mobilenet", "transformer"]

SIZES = ("tiny", "small")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family: ``make(size)`` -> one member; ``inputs(lead, size, g)`` -> its inputs
    (a tuple) with leading dims ``lead``; ``batch[size]`` is the batch of the benchmark.
    ``module(members, strategy)``: a hand-built wide form of the members, timed next to
    ``wc.compile`` (once per entry of ``module_strategies``); None: none. ``channels_last``: the members also run as a
    channels-last loop (what a user of a conv net would try first)."""

    name: str
    make: Callable[[str], nn.Module]
    inputs: Callable[[tuple[int, ...], str, torch.Generator], tuple[torch.Tensor, ...]]
    batch: dict[str, int]
    description: str = ""
    module: Callable[[list[nn.Module], str], nn.Module] | None = None
    module_strategies: tuple[str, ...] = ("",)
    channels_last: bool = False  # image input: the channels-last loop is a baseline too


def _image(c: int, hw: dict[str, int]):
    def inputs(lead, size, g):
        return (torch.randn(*lead, c, hw[size], hw[size], generator=g, device=g.device),)
    return inputs


_TAB = {"tiny": {"cards": (10, 10), "dim": 4, "n_num": 3, "hidden": 8},
        "small": {"cards": (100, 50, 20, 10), "dim": 16, "n_num": 8, "hidden": 64}}


def _tab_inputs(lead, size, g):
    cfg = _TAB[size]
    idx = torch.stack([torch.randint(0, c, lead, generator=g, device=g.device) for c in cfg["cards"]], dim=-1)
    return idx, torch.randn(*lead, cfg["n_num"], generator=g, device=g.device)


def _audio_inputs(lead, size, g):
    return (torch.randn(*lead, 1, {"tiny": 64, "small": 1024}[size], generator=g, device=g.device),)


def _spec(name: str, factory: Callable[..., nn.Module], kwargs: dict[str, dict], inputs,
          batch: dict[str, int], description: str, **more) -> ModelSpec:
    return ModelSpec(name, lambda size: factory(**kwargs[size]), inputs, batch, description, **more)


#: transformer: d_model, heads, feed-forward width and tokens T per size (the issue's reference
#: case "TransformerEncoderLayer d=64, T=32" is ``small``).
_TRANSFORMER = {"tiny": {"d_model": 16, "nhead": 2, "dim_feedforward": 32},
                "small": {"d_model": 64, "nhead": 4, "dim_feedforward": 256}}
_TOKENS = {"tiny": 8, "small": 32}


def _transformer_inputs(lead, size, g):
    return (torch.randn(*lead, _TOKENS[size], _TRANSFORMER[size]["d_model"], generator=g, device=g.device),)


#: Flux blocks: hidden size, heads, image and text tokens per size.
_FLUX = {"tiny": {"hidden_size": 16, "num_heads": 2, "img": 4, "txt": 4},
         "small": {"hidden_size": 64, "num_heads": 4, "img": 16, "txt": 8}}


def _flux_block(kind: str) -> Callable[..., nn.Module]:
    def make(hidden_size: int, num_heads: int, img: int, txt: int) -> nn.Module:
        from .. import blocks

        cls = blocks.DoubleStreamBlock if kind == "double" else blocks.SingleStreamBlock
        return cls(hidden_size=hidden_size, num_heads=num_heads)
    return make


def _flux_inputs(kind: str):
    """A member's Flux inputs with leading dims ``lead``: ``(img, txt, vec, pe)`` (double) or
    ``(x, vec, pe)`` (single, x = the joint sequence), ``pe`` the rotary table
    ``[*lead, 1, T, head_dim/2, 2, 2]`` of each member at random positions (as Flux's
    ``EmbedND``)."""
    def inputs(lead, size, g):
        from ..blocks import rope

        c = _FLUX[size]
        d, t = c["hidden_size"], c["img"] + c["txt"]
        pe = rope(10 * torch.rand(*lead, t, generator=g, device=g.device), d // c["num_heads"]).unsqueeze(-5)
        vec = torch.randn(*lead, d, generator=g, device=g.device)
        if kind == "double":
            return (torch.randn(*lead, c["img"], d, generator=g, device=g.device),
                    torch.randn(*lead, c["txt"], d, generator=g, device=g.device), vec, pe)
        return torch.randn(*lead, t, d, generator=g, device=g.device), vec, pe
    return inputs


@functools.cache
def _flux_double_positional() -> type[nn.Module]:
    """``WideDoubleStreamBlock`` called as the bench calls every contender, positionally in the
    member's (Flux's) order ``(img, txt, vec, pe)``: the block itself wants its streams by
    keyword (Note [double-stream argument order] in wide_compiler/blocks.py)."""
    from .. import blocks

    class FluxOrderWideDoubleStreamBlock(blocks.WideDoubleStreamBlock):
        def __call__(self, img, txt, vec, pe=None):
            return super().__call__(img=img, txt=txt, vec=vec, pe=pe)

    return FluxOrderWideDoubleStreamBlock


def _flux_module(kind: str) -> Callable[[list[nn.Module], str], nn.Module]:
    """The hand-built wide block (``wide_compiler.blocks.Wide*StreamBlock``) with ``strategy``."""
    def build(models: list[nn.Module], strategy: str) -> nn.Module:
        from .. import blocks

        cls = _flux_double_positional() if kind == "double" else blocks.WideSingleStreamBlock
        return cls.from_modules(models, strategy=strategy)
    return build


MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    _spec("resnet", ResNetTiny,
          {"tiny": {"width": 8, "classes": 5}, "small": {"width": 16, "classes": 10}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "ResNet-18-style, 2 basic blocks (width 8 / 16), 16x16 / 32x32 images", channels_last=True),
    _spec("resnet_nopool", ResNetTiny,
          {"tiny": {"width": 8, "classes": 5, "pool": False}, "small": {"width": 16, "classes": 10, "pool": False}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "the ResNet-style net without its stem max pool (16/32 channels at 32x32 and 16x16)",
          channels_last=True),
    _spec("resnet18", ResNet18, {"tiny": {"width": 8, "classes": 10}, "small": {}},
          _image(3, {"tiny": 64, "small": 64}), {"tiny": 2, "small": 8},
          "the standard ResNet-18 at its real widths (64-512 channels, 1000 classes), 64x64 images; "
          "width 8 for tiny", channels_last=True),
    _spec("mobilenet", mobilenet, {"tiny": {"width": 8}, "small": {"width": 16, "classes": 10}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "MobileNet-style depthwise-separable blocks (width 8 / 16)", channels_last=True),
    _spec("dcgan_g", dcgan_g,
          {"tiny": {"nz": 6, "ngf": 4, "img": 16}, "small": {"nz": 32, "ngf": 16, "img": 32}},
          lambda lead, size, g: (torch.randn(*lead, {"tiny": 6, "small": 32}[size], 1, 1,
                                             generator=g, device=g.device),),
          {"tiny": 2, "small": 8}, "DCGAN generator, 16x16 / 32x32 output"),
    _spec("dcgan_d", dcgan_d, {"tiny": {"ndf": 8, "img": 16}, "small": {"ndf": 16, "img": 32}},
          _image(3, {"tiny": 16, "small": 32}), {"tiny": 2, "small": 8},
          "DCGAN discriminator, 16x16 / 32x32 input", channels_last=True),
    _spec("audio1d", audio1d, {"tiny": {"channels": 8}, "small": {"channels": 32, "classes": 10}},
          _audio_inputs, {"tiny": 2, "small": 8}, "1-D conv audio classifier, 64 / 1024 samples"),
    _spec("tabular", Tabular, _TAB, _tab_inputs, {"tiny": 4, "small": 64},
          "embeddings per categorical column + MLP with BatchNorm1d"),
    _spec("transformer", transformer, _TRANSFORMER, _transformer_inputs, {"tiny": 2, "small": 8},
          "nn.TransformerEncoderLayer d=16 / 64, 2 / 4 heads, T=8 / 32, batch first"),
    *(_spec(f"flux_{kind}", _flux_block(kind), _FLUX, _flux_inputs(kind), {"tiny": 2, "small": 4},
            f"Flux {kind}-stream block (wide_compiler.blocks), hidden 16 / 64, 2 / 4 heads, "
            "4+4 / 16+8 image+text tokens, rope table per member",
            module=_flux_module(kind), module_strategies=("auto",))
      for kind in ("double", "single")),
)}
