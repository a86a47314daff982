"""A plain model and a loss as a ``LightningModule``: one member of a
:class:`~wide_compiler.integrations.lightning.WideLightningModule`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

__all__ = ["ModelWithLoss"]


class ModelWithLoss(pl.LightningModule):
    """A plain model and a loss as a ``LightningModule`` (one member): ``batch = (x, y)``,
    ``training_step`` logs ``train_loss``, ``validation_step`` logs ``val_loss``, and
    ``configure_optimizers`` builds ``torch.optim.<optimizer>(lr=lr, **optimizer_kwargs)``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> m = ModelWithLoss(torch.nn.Linear(3, 1), F.mse_loss, optimizer="SGD", lr=0.1, momentum=0.9)
        >>> type(m.configure_optimizers()).__name__
        'SGD'
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                 optimizer: str = "Adam", lr: float = 1e-3, **optimizer_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "loss_fn"])
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: Any) -> Any:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_fn(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = dict(self.hparams)
        name = hp.pop("optimizer")
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ValueError(f"ModelWithLoss: torch.optim has no optimizer {name!r}")
        hp.update(hp.pop("optimizer_kwargs", {}))
        return cls(self.parameters(), **hp)
