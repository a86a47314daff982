"""Training N members as one: per-member optimizers, learning-rate schedules, gradient clipping
and losses (DESIGN §6).

Every hyperparameter is a float (shared by all members) or N values, one per member (the
scheduler arguments torch takes as one value per param group, such as OneCycleLR's ``max_lr``,
keep that meaning: see :mod:`wide_compiler.optim.lr_scheduler`); every parameter is a stacked
``[N, ...]`` tensor (a :class:`~wide_compiler.WideModel`'s parameters).
Each optimizer step is ONE fused C++ operator per parameter tensor (``torch.ops.wide.*_step``),
and member ``i`` ends up exactly where ``torch.optim`` would take it trained alone.

Example:
    >>> import torch, wide_compiler as wc
    >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ...           for _ in range(4)]
    >>> wide = wc.compile(models, torch.randn(2, 4), config=wc.WideConfig.fast())
    >>> opt = wc.optim.AdamW(wide.parameters(), lr=[1e-3, 3e-3, 1e-2, 3e-2], weight_decay=0.01)
    >>> sched = wc.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    >>> x, y = torch.randn(4, 16, 4), torch.randn(4, 16, 1)
    >>> losses = wc.optim.member_losses(torch.nn.functional.mse_loss, wide(x), y)
    >>> losses.shape
    torch.Size([4])
    >>> losses.sum().backward()
    >>> norms = wc.optim.clip_grad_norm_(wide.parameters(), max_norm=1.0)
    >>> opt.step(); sched.step(); opt.zero_grad()
"""

from . import lr_scheduler, swa_utils
from ._base import WideOptimizer, per_member
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, clip_grad_value_, member_grad_norms
from .losses import member_losses
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "RMSprop",
    "WideOptimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "lr_scheduler",
    "member_grad_norms",
    "member_losses",
    "per_member",
    "swa_utils",
]
