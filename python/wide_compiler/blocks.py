"""Flux-style (MMDiT) transformer blocks: member blocks and their hand-built wide forms.

The five blocks WideCompiler 0.x offered, as reference implementations of the usual Flux layout
(``flux/modules/layers.py``): :class:`MLP`, :class:`Attention`, :class:`JointAttention`,
:class:`DoubleStreamBlock` and :class:`SingleStreamBlock`, with their parts :class:`QKNorm`
(RMSNorm of q and k per head), :class:`Modulation` (AdaLN: SiLU + Linear from the conditioning
vector to shift/scale/gate chunks) and the rotary embedding helpers :func:`rope` and
:func:`apply_rope`. Each block ``X`` is an ordinary ``nn.Module``; ``WideX`` runs N of them as one
module built from :mod:`wide_compiler.nn` modules (``WideLinear``, ``WideLayerNorm``,
``WideRMSNorm``) and one SDPA call with the N members folded into the batch.

Note [one forward for member and wide]
    Every member forward is written with negative dims only, so it is rank-agnostic: a wide block
    *shares its member's forward* (``WideMLP.forward is MLP.forward``) and differs only in its
    submodules, which are the wide ones. What member ``i`` of a wide block computes is therefore
    the member's own code on member ``i``'s weights, by construction.

Layouts: members take ``[B, T, D]`` tokens and a ``[B, D]`` conditioning vector; wide blocks take
them N-first, ``[N, B, T, D]`` and ``[N, B, D]`` (a shared input is ``x.expand(N, *x.shape)``).

Rotary table ``pe``: as Flux's ``EmbedND`` builds it, ``[B or 1, 1, T, head_dim/2, 2, 2]`` (6 dims,
``rope(pos, head_dim, theta).unsqueeze(1)``), where ``T`` is the whole attended sequence (for the
joint blocks: text tokens first, then image tokens). A wide block takes the same 6-dim table,
shared by all members, or an N-first one ``[N, B or 1, 1, T, head_dim/2, 2, 2]`` (7 dims) with
one table per member. (A table of fewer than 6 dims broadcasts like a 6-dim one and is always
shared.)

Example:
    >>> import torch
    >>> from wide_compiler.blocks import DoubleStreamBlock, WideDoubleStreamBlock, rope
    >>> blocks = [DoubleStreamBlock(hidden_size=16, num_heads=2) for _ in range(3)]
    >>> wide = WideDoubleStreamBlock.from_modules(blocks)
    >>> img, txt, vec = torch.randn(3, 2, 5, 16), torch.randn(3, 2, 4, 16), torch.randn(3, 2, 16)
    >>> pe = rope(torch.arange(9.0).expand(2, 9), 8).unsqueeze(1)       # [2, 1, 9, 4, 2, 2], shared
    >>> img_out, txt_out = wide(img=img, txt=txt, vec=vec, pe=pe)   # the streams by keyword
    >>> ref_img, ref_txt = blocks[1](img[1], txt[1], vec[1], pe)
    >>> torch.allclose(img_out[1], ref_img, atol=1e-5) and torch.allclose(txt_out[1], ref_txt, atol=1e-5)
    True
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ArchitectureMismatchError
from .nn import WideLayerNorm, WideLinear, WideRMSNorm
from .nn._common import check_members, check_strategy

__all__ = [
    "MLP", "STRATEGIES", "Attention", "DoubleStreamBlock", "JointAttention", "Modulation", "QKNorm",
    "SingleStreamBlock", "WideAttention", "WideDoubleStreamBlock", "WideJointAttention", "WideMLP", "WideModulation",
    "WideQKNorm", "WideSingleStreamBlock", "apply_rope", "attention", "rope",
]

STRATEGIES = WideLinear.STRATEGIES
"""A wide block's ``strategy``: that of its ``WideLinear`` layers (see ``torch.ops.wide.linear``)."""


# --- functional pieces (rank-agnostic: any leading dims) -------------------------------------
def rope(pos: torch.Tensor, dim: int, theta: float = 10_000.0) -> torch.Tensor:
    """Flux's rotary table: positions ``[..., T]`` -> 2x2 rotations ``[..., T, dim/2, 2, 2]`` (float32).

    >>> rope(torch.arange(4.0), 6).shape
    torch.Size([4, 3, 2, 2])
    """
    if dim % 2:
        raise ValueError(f"rope: expected an even dim, got {dim}")
    omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
    out = pos.to(torch.float64).unsqueeze(-1) * omega
    cos, sin = out.cos(), out.sin()
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2)).float()


def apply_rope(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """Rotate the feature pairs of ``x [..., T, head_dim]`` by ``pe [..., T, head_dim/2, 2, 2]`` (Flux).

    >>> x = torch.randn(1, 2, 4, 6)
    >>> torch.allclose(apply_rope(x, rope(torch.zeros(4), 6)), x)      # position 0: identity
    True
    """
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: torch.Tensor | None = None) -> torch.Tensor:
    """Flux's attention: rope on q and k, then ONE SDPA call with all leading dims folded into the
    batch. ``q, k, v [*, H, T, Dh]`` (``*`` = ``B``, or ``N, B``) -> ``[*, T, H*Dh]``.

    >>> q = torch.randn(3, 2, 4, 5, 8)
    >>> attention(q, q, q).shape
    torch.Size([3, 2, 5, 32])
    """
    if pe is not None:
        q, k = apply_rope(q, pe), apply_rope(k, pe)
    if q.device.type != "cpu":  # Note [Strided attention inputs on a GPU]
        q, k, v = (t if _aligned(t) else t.contiguous() for t in (q, k, v))
    x = F.scaled_dot_product_attention(q.flatten(0, -4), k.flatten(0, -4), v.flatten(0, -4))
    return x.unflatten(0, q.shape[:-3]).transpose(-3, -2).flatten(-2)


# Note [Strided attention inputs on a GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# q, k and v are views of one projection (the single-stream block's holds the MLP's input too), so
# a token's row starts 3*D + mlp_hidden values after the previous one. ATen's memory-efficient
# attention kernel (torch 2.11, float32, head dim 4) reads rows in 16-byte vectors without checking
# that they start on 16-byte boundaries: with rows 18 float32 values apart it faulted with
# "misaligned address" on an H200, in the member block and so in every wide one. Off the CPU a
# view whose offset or strides are not 16-byte multiples is copied first.
def _aligned(t: torch.Tensor) -> bool:
    """Whether every row of ``t`` (its offset and its strides but the last) starts on a 16-byte
    boundary.

    >>> proj = torch.zeros(2, 5, 18)   # a token's row: 18 float32 values (72 bytes)
    >>> _aligned(proj[..., 8:12]), _aligned(torch.zeros(2, 5, 16)[..., 8:12])
    (False, True)
    """
    size = t.element_size()
    return all((s * size) % 16 == 0 for s in (t.storage_offset(), *t.stride()[:-1]))


def _split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[*, T, 3*D]`` -> q, k, v ``[*, H, T, D/H]`` (Flux's ``B L (K H D) -> K B H L D``)."""
    return qkv.unflatten(-1, (3, num_heads, -1)).movedim(-3, 0).transpose(-3, -2).unbind(0)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * x + shift


def _norm(hidden_size: int) -> nn.LayerNorm:
    return nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)


def _head_dim(hidden_size: int, num_heads: int) -> int:
    if num_heads < 1 or hidden_size % num_heads:
        raise ValueError(f"expected hidden_size divisible by num_heads >= 1, got {hidden_size} and {num_heads}")
    return hidden_size // num_heads


def _joint(txt_attn: nn.Module, img_attn: nn.Module, txt: torch.Tensor, img: torch.Tensor,
           pe: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams attend to the sequence [txt, img]; each projects its own part back."""
    qkv = [torch.cat(pair, dim=-2) for pair in zip(txt_attn.heads(txt), img_attn.heads(img))]
    x, n_txt = attention(*qkv, pe), txt.shape[-2]
    return txt_attn.proj(x[..., :n_txt, :]), img_attn.proj(x[..., n_txt:, :])


# --- member blocks ---------------------------------------------------------------------------
# Convention: every constructor argument is kept as an attribute of the same name (the wide
# blocks compare them across members and rebuild members from them in unfuse()).
class QKNorm(nn.Module):
    """RMSNorm (eps 1e-6) of q and of k over ``dim`` (the head dim); returns them in v's dtype.

    >>> q = torch.randn(2, 4, 5, 8)
    >>> [t.shape for t in QKNorm(8)(q, q, q)]
    [torch.Size([2, 4, 5, 8]), torch.Size([2, 4, 5, 8])]
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.query_norm = nn.RMSNorm(dim, eps=1e-6)
        self.key_norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class Modulation(nn.Module):
    """AdaLN modulation: ``vec [*, D]`` -> ``SiLU`` -> ``Linear(D, 6D or 3D)`` -> chunks
    ``(shift, scale, gate)`` (twice when ``double``), each ``[*, 1, D]``.

    >>> len(Modulation(8, double=True)(torch.randn(2, 8))), Modulation(8, double=False)(torch.randn(2, 8))[0].shape
    (6, torch.Size([2, 1, 8]))
    """

    def __init__(self, dim: int, double: bool) -> None:
        super().__init__()
        self.dim, self.double = dim, double
        self.lin = nn.Linear(dim, (6 if double else 3) * dim)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec)).unsqueeze(-2).chunk(6 if self.double else 3, dim=-1)


class MLP(nn.Module):
    """Flux's feed-forward: ``Linear(D, D*mlp_ratio)``, GELU (tanh), ``Linear(D*mlp_ratio, D)``;
    ``[B, T, D]`` -> ``[B, T, D]``.

    >>> MLP(8, mlp_ratio=2.0)(torch.randn(2, 5, 8)).shape
    torch.Size([2, 5, 8])
    """

    def __init__(self, hidden_size: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.hidden_size, self.mlp_ratio = hidden_size, mlp_ratio
        self.fc1 = nn.Linear(hidden_size, int(hidden_size * mlp_ratio))
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(int(hidden_size * mlp_ratio), hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Flux's ``SelfAttention``: qkv projection, per-head :class:`QKNorm`, rope, SDPA, output
    projection; ``x [B, T, D]`` (+ optional ``pe``, see the module docstring) -> ``[B, T, D]``.

    >>> attn = Attention(hidden_size=16, num_heads=2)
    >>> pe = rope(torch.arange(5.0), 8)                               # [T, head_dim/2, 2, 2]
    >>> attn(torch.randn(3, 5, 16), pe).shape
    torch.Size([3, 5, 16])
    """

    def __init__(self, hidden_size: int, num_heads: int = 8, qkv_bias: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.qkv_bias = hidden_size, num_heads, qkv_bias
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=qkv_bias)
        self.norm = QKNorm(_head_dim(hidden_size, num_heads))
        self.proj = nn.Linear(hidden_size, hidden_size)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [*, T, D]`` -> q, k (normalised) and v, each ``[*, H, T, D/H]``."""
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        return (*self.norm(q, k, v), v)

    def forward(self, x: torch.Tensor, pe: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(attention(*self.heads(x), pe))


class JointAttention(nn.Module):
    """MMDiT joint attention: text and image tokens, each with its own :class:`Attention` weights
    (``txt_attn``, ``img_attn``), attend together to the sequence ``[txt, img]``.
    ``(txt [B, Ttxt, D], img [B, Timg, D], pe=None)`` -> ``(txt, img)``; ``pe`` covers Ttxt + Timg.

    >>> txt, img = JointAttention(16, num_heads=4)(torch.randn(2, 3, 16), torch.randn(2, 5, 16))
    >>> txt.shape, img.shape
    (torch.Size([2, 3, 16]), torch.Size([2, 5, 16]))
    """

    def __init__(self, hidden_size: int, num_heads: int = 8, qkv_bias: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.qkv_bias = hidden_size, num_heads, qkv_bias
        self.txt_attn = Attention(hidden_size, num_heads, qkv_bias)
        self.img_attn = Attention(hidden_size, num_heads, qkv_bias)

    def forward(self, txt: torch.Tensor, img: torch.Tensor,
                pe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _joint(self.txt_attn, self.img_attn, txt, img, pe)


class DoubleStreamBlock(nn.Module):
    """Flux's ``DoubleStreamBlock`` (same submodule names): per stream, AdaLN-modulated norm, joint
    attention over ``[txt, img]``, gated residual, modulated MLP with gated residual.
    ``(img [B, Timg, D], txt [B, Ttxt, D], vec [B, D], pe=None)`` -> ``(img, txt)`` (Flux's order);
    ``pe`` covers Ttxt + Timg, text first.

    >>> block = DoubleStreamBlock(hidden_size=16, num_heads=2, mlp_ratio=2.0)
    >>> img, txt = block(torch.randn(2, 5, 16), torch.randn(2, 3, 16), torch.randn(2, 16))
    >>> img.shape, txt.shape
    (torch.Size([2, 5, 16]), torch.Size([2, 3, 16]))
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.mlp_ratio, self.qkv_bias = hidden_size, num_heads, mlp_ratio, qkv_bias
        for s in ("img", "txt"):
            self.add_module(f"{s}_mod", Modulation(hidden_size, double=True))
            self.add_module(f"{s}_norm1", _norm(hidden_size))
            self.add_module(f"{s}_attn", Attention(hidden_size, num_heads, qkv_bias))
            self.add_module(f"{s}_norm2", _norm(hidden_size))
            self.add_module(f"{s}_mlp", MLP(hidden_size, mlp_ratio))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor,
                pe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        txt_a, img_a = _joint(self.txt_attn, self.img_attn, _modulate(self.txt_norm1(txt), *txt_mod[:2]),
                              _modulate(self.img_norm1(img), *img_mod[:2]), pe)

        def rest(x, a, mod, norm2, mlp):
            x = x + mod[2] * a
            return x + mod[5] * mlp(_modulate(norm2(x), *mod[3:5]))

        return (rest(img, img_a, img_mod, self.img_norm2, self.img_mlp),
                rest(txt, txt_a, txt_mod, self.txt_norm2, self.txt_mlp))


class SingleStreamBlock(nn.Module):
    """Flux's ``SingleStreamBlock`` (same submodule names): one modulated pre-norm, one Linear to
    qkv and the MLP's hidden units in parallel, attention and GELU, one Linear back, gated residual.
    ``(x [B, T, D], vec [B, D], pe=None)`` -> ``[B, T, D]``.

    >>> SingleStreamBlock(16, num_heads=4)(torch.randn(2, 7, 16), torch.randn(2, 16)).shape
    torch.Size([2, 7, 16])
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.mlp_ratio = hidden_size, num_heads, mlp_ratio
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, 3 * hidden_size + mlp_hidden)
        self.linear2 = nn.Linear(hidden_size + mlp_hidden, hidden_size)
        self.norm = QKNorm(_head_dim(hidden_size, num_heads))
        self.pre_norm = _norm(hidden_size)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor | None = None) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        h = self.linear1(_modulate(self.pre_norm(x), shift, scale))
        qkv, mlp = h[..., :3 * self.hidden_size], h[..., 3 * self.hidden_size:]
        q, k, v = _split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        return x + gate * self.linear2(torch.cat((attention(q, k, v, pe), self.mlp_act(mlp)), dim=-1))


# --- wide blocks -----------------------------------------------------------------------------
class _WideBlock(nn.Module):
    """N member blocks of class ``_member`` as one module: the member's submodules widened (same
    names, so parameter names are the member's), its hyperparameters as attributes, its forward
    shared (Note [one forward for member and wide])."""

    _member: type[nn.Module]

    def __init__(self, n: int, *args, strategy: str = "auto", head_dim: int | None = None,
                 bias: bool | None = None, **kwargs) -> None:
        """N fresh members ``_member(*args, **kwargs)``, each initialised independently.

        WideCompiler 0.x's arguments are accepted: ``head_dim`` (checked against
        ``hidden_size // num_heads``) and ``bias`` (the attention's ``qkv_bias``)."""
        super().__init__()
        if n < 1:
            raise ValueError(f"{type(self).__name__}: expected n >= 1 members, got {n}")
        check_strategy(self, strategy)
        if bias is not None:
            if "qkv_bias" not in self._hparams():
                raise TypeError(f"{type(self).__name__}: no bias option (its member has no qkv_bias)")
            kwargs["qkv_bias"] = bias
        self._fuse([self._member(*args, **kwargs) for _ in range(n)], strategy)
        if head_dim is not None and getattr(self, "hidden_size", 0) // getattr(self, "num_heads", 1) != head_dim:
            raise ValueError(f"{type(self).__name__}: head_dim={head_dim}, but hidden_size "
                             f"{self.hidden_size} / num_heads {self.num_heads} is {self.hidden_size // self.num_heads}")

    def __call__(self, *args, **kwargs):
        if "rope" in kwargs:  # WideCompiler 0.x's name of the rotary table
            kwargs["pe"] = kwargs.pop("rope")
        return super().__call__(*args, **kwargs)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *, strategy: str = "auto"):
        """Stack N member blocks of one configuration (weights copied; the members are not modified).

        Raises:
            ArchitectureMismatchError: a member of another type or with another hyperparameter,
                naming the member and the attribute (``member 2: num_heads is 4, member 0 has 2``).
            ValueError: an unknown ``strategy`` (see :data:`STRATEGIES`).
        """
        wide = cls.__new__(cls)
        nn.Module.__init__(wide)
        check_strategy(wide, strategy)
        wide._fuse(modules, strategy)
        return wide

    @classmethod
    def _hparams(cls) -> tuple[str, ...]:
        """The member's constructor arguments (kept as member attributes of the same names)."""
        return tuple(inspect.signature(cls._member).parameters)

    STRATEGIES = STRATEGIES

    def _fuse(self, modules: Sequence[nn.Module], strategy: str) -> None:
        modules = check_members(modules, self._member, self._hparams() + ("training",), type(self).__name__)
        self.n, self.strategy = len(modules), strategy
        for a in self._hparams():
            setattr(self, a, getattr(modules[0], a))
        for name, _ in modules[0].named_children():
            try:
                self.add_module(name, _widen([getattr(m, name) for m in modules], strategy))
            except ArchitectureMismatchError as e:
                raise ArchitectureMismatchError(f"{name}: {e}") from None
        self.train(modules[0].training)

    def unfuse(self) -> list[nn.Module]:
        """N ordinary member blocks holding copies of the members' weights."""
        ref, state = next(self.parameters()), self.state_dict()
        out = []
        for i in range(self.n):
            with torch.device("meta"):
                m = self._member(**{a: getattr(self, a) for a in self._hparams()})
            m = m.to_empty(device=ref.device).to(ref.dtype)
            m.load_state_dict({k: v[i] for k, v in state.items()})
            out.append(m.train(self.training))
        return out

    def extra_repr(self) -> str:
        hp = ", ".join(f"{a}={getattr(self, a)!r}" for a in self._hparams())
        return f"n={self.n}, {hp}, strategy={self.strategy!r}"


class WideQKNorm(_WideBlock):
    """N :class:`QKNorm` (two ``WideRMSNorm``); q, k, v ``[N, B, H, T, Dh]``.

    >>> norms = [QKNorm(4) for _ in range(2)]
    >>> q = torch.randn(2, 3, 2, 5, 4)
    >>> torch.allclose(WideQKNorm.from_modules(norms)(q, q, q)[0][1], norms[1](q[1], q[1], q[1])[0])
    True
    """

    _member = QKNorm
    forward = QKNorm.forward


class WideModulation(_WideBlock):
    """N :class:`Modulation`; ``vec [N, B, D]`` -> chunks ``[N, B, 1, D]``.

    >>> mods = WideModulation(3, 8, double=False).unfuse()
    >>> vec = torch.randn(3, 2, 8)
    >>> torch.allclose(WideModulation.from_modules(mods)(vec)[2][0], mods[0](vec[0])[2], atol=1e-6)
    True
    """

    _member = Modulation
    forward = Modulation.forward


class WideMLP(_WideBlock):
    """N :class:`MLP` as two ``WideLinear``: ``[N, B, T, D]`` -> ``[N, B, T, D]``.

    ``WideMLP(n, hidden_size, mlp_ratio=4.0, *, strategy="auto")`` makes N fresh members;
    ``from_modules(mlps, *, strategy="auto")`` stacks given ones; ``unfuse()`` gives them back.

    >>> mlps = [MLP(8, mlp_ratio=2.0) for _ in range(3)]
    >>> wide = WideMLP.from_modules(mlps)
    >>> x = torch.randn(3, 2, 5, 8)
    >>> torch.allclose(wide(x)[2], mlps[2](x[2]), atol=1e-6)
    True
    >>> torch.equal(wide.unfuse()[2].fc1.weight, mlps[2].fc1.weight)
    True
    """

    _member = MLP
    forward = MLP.forward


class WideAttention(_WideBlock):
    """N :class:`Attention`: ``(x [N, B, T, D], pe=None)`` -> ``[N, B, T, D]``; one SDPA call.

    ``WideAttention(n, hidden_size, num_heads=8, qkv_bias=False, *, strategy="auto")``;
    ``pe`` shared ``[B|1, 1, T, Dh/2, 2, 2]`` or N-first ``[N, B|1, 1, T, Dh/2, 2, 2]``.

    >>> attns = [Attention(16, num_heads=2, qkv_bias=True) for _ in range(3)]
    >>> wide = WideAttention.from_modules(attns)
    >>> x, pe = torch.randn(3, 2, 5, 16), rope(torch.arange(5.0), 8).expand(2, 1, 5, 4, 2, 2)
    >>> torch.allclose(wide(x, pe)[0], attns[0](x[0], pe), atol=1e-5)
    True
    """

    _member = Attention
    heads, forward = Attention.heads, Attention.forward


class WideJointAttention(_WideBlock):
    """N :class:`JointAttention`: ``(txt [N, B, Ttxt, D], img [N, B, Timg, D], pe=None)`` ->
    ``(txt, img)``; ``pe`` (shared or N-first) covers Ttxt + Timg, text first.

    ``WideJointAttention(n, hidden_size, num_heads=8, qkv_bias=False, *, strategy="auto")``.

    >>> joints = [JointAttention(16, num_heads=4) for _ in range(2)]
    >>> wide = WideJointAttention.from_modules(joints)
    >>> txt, img = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 6, 16)
    >>> torch.allclose(wide(txt, img)[1][1], joints[1](txt[1], img[1])[1], atol=1e-5)
    True
    """

    _member = JointAttention
    forward = JointAttention.forward


class WideDoubleStreamBlock(_WideBlock):
    """N :class:`DoubleStreamBlock`: ``(img=[N, B, Timg, D], txt=[N, B, Ttxt, D], vec=[N, B, D],
    pe=None)`` -> ``(img, txt)`` -- Flux's order; ``pe`` (shared or N-first) covers Ttxt + Timg,
    text first.

    ``WideDoubleStreamBlock(n, hidden_size, num_heads, mlp_ratio=4.0, qkv_bias=False, *, strategy="auto")``.

    The two streams are passed **by keyword** (``img=``, ``txt=``; at most the first, ``img``,
    positionally): this block follows Flux's ``(img, txt, ...)`` while WideCompiler 0.x's took
    ``(txt, img, ...)``, and two tensors of one shape cannot tell which is which, so a positional
    pair would run 0.x code with the streams' roles swapped and no error. A call passing both
    positionally raises ``TypeError`` (Note [double-stream argument order]). The member
    :class:`DoubleStreamBlock` is Flux's own and takes them positionally.

    >>> wide = WideDoubleStreamBlock(4, hidden_size=16, num_heads=2)
    >>> members = wide.unfuse()
    >>> img, txt, vec = torch.randn(4, 2, 6, 16), torch.randn(4, 2, 3, 16), torch.randn(4, 2, 16)
    >>> img_out, txt_out = wide(img=img, txt=txt, vec=vec)
    >>> torch.allclose(img_out[3], members[3](img[3], txt[3], vec[3])[0], atol=1e-5)
    True
    >>> wide(img, txt, vec)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: WideDoubleStreamBlock: pass the two streams by keyword, ...
    """

    _member = DoubleStreamBlock
    forward = DoubleStreamBlock.forward

    # Note [double-stream argument order]
    #     0.x's WideDoubleStreamBlock took (txt, img, vec, rope) and returned (txt, img); this one
    #     is Flux's (img, txt, vec, pe) -> (img, txt). The streams have the same shape but for
    #     their lengths, so nothing at run time can tell a 0.x call from a Flux one: refusing the
    #     positional pair is the only way neither group's code runs silently swapped. Keywords
    #     name the roles, so they mean the same in both conventions.
    def __call__(self, *args, **kwargs):
        if len(args) >= 2:
            raise TypeError(
                f"{type(self).__name__}: pass the two streams by keyword, e.g. "
                f"block(img=img, txt=txt, vec=vec, pe=pe) -> (img, txt): given positionally their "
                f"roles are ambiguous, since this block follows Flux's order (img, txt, ...) while "
                f"WideCompiler 0.x's took (txt, img, ...) and returned (txt, img); got {len(args)} "
                f"positional arguments")
        return super().__call__(*args, **kwargs)


class WideSingleStreamBlock(_WideBlock):
    """N :class:`SingleStreamBlock`: ``(x [N, B, T, D], vec [N, B, D], pe=None)`` -> ``[N, B, T, D]``.

    ``WideSingleStreamBlock(n, hidden_size, num_heads, mlp_ratio=4.0, *, strategy="auto")``.

    >>> blocks = [SingleStreamBlock(16, num_heads=2) for _ in range(3)]
    >>> wide = WideSingleStreamBlock.from_modules(blocks, strategy="bmm")
    >>> x, vec = torch.randn(2, 7, 16), torch.randn(2, 16)             # one input shared by all
    >>> y = wide(x.expand(3, *x.shape), vec.expand(3, *vec.shape))
    >>> torch.allclose(y[2], blocks[2](x, vec), atol=1e-5)
    True
    """

    _member = SingleStreamBlock
    forward = SingleStreamBlock.forward


def _stateless(modules: Sequence[nn.Module], strategy: str) -> nn.Module:
    """A submodule without parameters or buffers (an activation): member 0's, if all are alike."""
    first = modules[0]
    if next(first.parameters(), None) is not None or next(first.buffers(), None) is not None:
        raise TypeError(f"wide_compiler.blocks: no wide form for {type(first).__name__}")
    for i, m in enumerate(modules):
        if type(m) is not type(first) or m.extra_repr() != first.extra_repr():
            raise ArchitectureMismatchError(f"member {i}: {m!r}, member 0 has {first!r}")
    return copy.deepcopy(first)


_WIDE: dict[type, Callable[..., nn.Module]] = {
    nn.Linear: lambda ms, strategy: WideLinear.from_modules(ms, strategy=strategy),
    nn.LayerNorm: lambda ms, strategy: WideLayerNorm.from_modules(ms),
    nn.RMSNorm: lambda ms, strategy: WideRMSNorm.from_modules(ms),
    **{c._member: c.from_modules for c in (WideQKNorm, WideModulation, WideMLP, WideAttention,
                                          WideJointAttention, WideDoubleStreamBlock, WideSingleStreamBlock)},
}


def _widen(modules: Sequence[nn.Module], strategy: str) -> nn.Module:
    return _WIDE.get(type(modules[0]), _stateless)(modules, strategy=strategy)
