"""N members of one LightningModule (one learning rate and weight decay each) trained by ONE
unchanged lightning.Trainer, on built-in synthetic data (3-class spirals).

    python examples/lightning_ensemble.py                  # 8 members, per-member early stopping
    python examples/lightning_ensemble.py --measure        # wall time: fused vs 8 separate Trainer runs

The LightningModule below is ordinary Lightning code for ONE model; WideLightningModule fuses N
instances of it. Every member logs member_<i>/val_loss, stops on its own (MemberEarlyStopping),
and the best one comes back as an ordinary Spirals module.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import lightning as L
from wide_compiler.integrations.lightning import MemberEarlyStopping, WideLightningModule
from wide_compiler.zoo import spirals


class Spirals(L.LightningModule):
    """One member: an MLP classifier; lr and weight_decay are read by configure_optimizers only."""

    def __init__(self, lr: float = 1e-2, weight_decay: float = 0.0, hidden: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)}


def loaders(batch_size: int = 128):
    x, y = spirals(2048, noise=0.2, seed=0)
    xv, yv = spirals(1024, noise=0.2, seed=1)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                                        generator=torch.Generator().manual_seed(0))
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xv, yv), batch_size=512)
    return train, val


def members(n: int) -> list[Spirals]:
    out = []
    for i in range(n):
        torch.manual_seed(i)                                     # member i's own initial weights
        out.append(Spirals(lr=1e-3 * 2 ** (i % 8), weight_decay=[0.0, 1e-2][i % 2]))
    return out


def trainer(epochs: int, **kw) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--measure", action="store_true", help="time the fused run against N separate runs")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    train, val = loaders()
    t0 = time.perf_counter()
    wide = WideLightningModule(members(args.members), next(iter(train)), monitor="val_loss")
    es = [] if args.measure else [MemberEarlyStopping(monitor="val_loss", patience=args.patience, min_delta=1e-3)]
    t = trainer(args.epochs, callbacks=es)
    t.fit(wide, train, val)
    fused = time.perf_counter() - t0

    for i, m in enumerate(wide.members):
        stopped = f"stopped at epoch {es[0].stopped_epoch[i]}" if es and wide.member_stopped[i] else "ran to the end"
        print(f"member {i}: lr={m.hparams.lr:.4f} wd={m.hparams.weight_decay:<5} "
              f"val_loss={float(wide.member_metrics['val_loss'][i]):.4f} "
              f"val_acc={float(wide.member_metrics['val_acc'][i]):.3f}  {stopped}")
    best = wide.best_member()                                    # an ordinary Spirals module
    print(f"best member: {wide.best_member_index} ({type(best).__name__}, lr={best.hparams.lr})")
    with tempfile.TemporaryDirectory() as d:                     # it saves and loads as one
        trainer(1, default_root_dir=d).validate(best, val, verbose=False)

    if args.measure:
        t0 = time.perf_counter()
        for m in members(args.members):
            trainer(args.epochs).fit(m, *loaders())
        separate = time.perf_counter() - t0
        print(f"{args.members} members, {args.epochs} epochs: fused {fused:.1f} s (compile included), "
              f"{args.members} separate Trainer runs {separate:.1f} s: {separate / fused:.1f}x")


if __name__ == "__main__":
    main()
