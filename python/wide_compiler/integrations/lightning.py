"""Train N fused copies of a ``LightningModule`` with an unchanged ``lightning.Trainer``.

:class:`WideLightningModule` takes N instances of YOUR ``LightningModule`` (one per member: its
own initial weights and its own hyperparameters) and fuses them into ONE ``LightningModule``
that any ``lightning.Trainer`` trains: one forward, one backward and one fused optimizer step per
batch for all N members, and member ``i`` ends up exactly where ``Trainer.fit`` takes that module
trained alone on the same batches.

* **Your steps run fused.** Each member's ``training_step`` (train mode) and ``validation_step``
  (eval mode) are captured and widened (:func:`wide_compiler.compile`): the loss becomes N
  per-member losses, and every tensor the step logs with ``self.log`` becomes N values.
* **Per-member hyperparameters reach the optimizer.** ``configure_optimizers`` calls each
  member's own ``configure_optimizers`` and fuses the N ``torch.optim`` optimizers (SGD, Adam,
  AdamW, RMSprop, Adagrad) and schedulers (StepLR, MultiStepLR, ExponentialLR,
  CosineAnnealingLR, LinearLR, ReduceLROnPlateau) into one :mod:`wide_compiler.optim` optimizer
  and scheduler with one value per member. Or override ``configure_optimizers`` in a subclass and
  return ``wc.optim`` objects yourself.
* **Per-member metrics.** Every key Lightning makes of a value a member logs (``train_loss``;
  ``train_loss_step`` and ``train_loss_epoch`` when logged ``on_step`` and ``on_epoch``) is
  ``member_<i>/`` + that key, in the callback, logger and progress-bar metrics, so a callback
  can monitor ``member_0/train_loss``; at the end of each validation epoch ``val_loss`` itself
  is the best member's value (``monitor``/``mode``) and ``best_member`` its index, so
  Lightning's own ``ModelCheckpoint``/``EarlyStopping`` act on the best member.
* **Per-member early stopping** (:class:`MemberEarlyStopping`): a stopped member's parameters,
  buffers and optimizer state stop changing (exactly: no moment drift, no weight decay) while
  the others go on; the run ends when every member has stopped (or at ``max_epochs``).
* **Checkpoints** are Lightning's own: the wide parameters, the ``wc.optim`` optimizer and
  scheduler states, which members stopped, the last per-member metrics and the early-stopping
  state; ``trainer.fit(wide, ckpt_path=...)`` continues every member where it was.
  :func:`load_member` reads one member from a checkpoint into an ordinary module.
* **Export**: :meth:`WideLightningModule.member` / :meth:`~WideLightningModule.best_member` give
  an ordinary instance of your class (its own hyperparameters) with that member's weights.
* **DDP** (``strategy="ddp"``, also ``"ddp_spawn"``): the data axis, as for any module; each
  member's gradient is the mean over the processes, as for that member trained alone under DDP.

Step values of training metrics are logged on the Trainer's logging steps
(``log_every_n_steps``) and the last step of each epoch, epoch values once per epoch (Note
[Per-member metric keys]): Lightning's ``self.log`` costs about a millisecond per key, and a
fused step has N keys per name. Random ops (dropout)
draw an independent mask per member, not the numbers that member's own run would draw: such
members train as well, but not bit for bit like their separate runs.

What cannot be per member is refused, naming the key and the member: members whose
hyperparameters change the architecture, a ``training_step`` that returns something other than
a loss, a step that reads a hyperparameter that differs between members, optimizer flags that
differ, and ``Trainer`` settings that would be shared silently (``precision="16-mixed"``: ONE
GradScaler for all members; a sharded strategy; a ``Trainer`` argument among a member's
hyperparameters with different values).

Lightning is optional: ``pip install "wide_compiler[lightning]"`` (tested with lightning 2.6.6);
``import wide_compiler`` never imports this module.

Example:
    >>> import torch, torch.nn.functional as F, lightning as L
    >>> from wide_compiler.integrations.lightning import WideLightningModule
    >>> class Regressor(L.LightningModule):
    ...     def __init__(self, lr=1e-2):
    ...         super().__init__()
    ...         self.save_hyperparameters()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         loss = F.mse_loss(self(x), y)
    ...         self.log("train_loss", loss)
    ...         return loss
    ...     def configure_optimizers(self):
    ...         return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
    >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
    >>> wide = WideLightningModule([Regressor(lr=lr) for lr in (1e-3, 1e-2, 1e-1)], (x[:16], y[:16]))
    >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    >>> trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(wide, data)
    >>> type(wide.member(2)).__name__, wide.member(2).hparams.lr
    ('Regressor', 0.1)
"""

from __future__ import annotations

INSTALL_HINT = ('wide_compiler.integrations.lightning needs Lightning: pip install "lightning==2.6.6" '
                '(or pip install "wide_compiler[lightning]")')

try:
    import lightning.pytorch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError(INSTALL_HINT) from e

# The parts, by concern (wide_compiler.integrations._lightning): capture (a member's steps as a
# module; the checks of the members), metrics (per-member logging), optimizers (the members'
# configure_optimizers fused), module (WideLightningModule, load_member), early_stopping,
# model_with_loss.
from ._lightning.early_stopping import MemberEarlyStopping
from ._lightning.model_with_loss import ModelWithLoss
from ._lightning.module import WideLightningModule, load_member

__all__ = ["MemberEarlyStopping", "ModelWithLoss", "WideLightningModule", "load_member"]
