"""One run of ``benchmark integrations`` (:mod:`wide_compiler.bench.integrations`) in a fresh
process: ``python path/to/_integrations_child.py '<json spec>'`` prints its JSON.

Run by its path, not as a module of the package: ``python -m`` would import ``wide_compiler``
before the clock starts, and the fused run's clock must count that import (the sequential run
never imports it). So this file imports nothing of ``wide_compiler`` at its top.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import tempfile
import time


@functools.cache
def regressor_class() -> type:
    """The ``Regressor`` of docs/integrations.md, the member both this benchmark and
    tests/python/test_lightning.py train: an MLP ``Linear(4, hidden) -> Tanh -> Linear(hidden, 1)``
    whose hyperparameters only ``configure_optimizers`` reads (``optimizer`` with ``lr``,
    ``weight_decay`` and, but for SGD, ``amsgrad``; a ``StepLR(step_size, gamma)``). The guide's is
    ``Regressor(lr, weight_decay, hidden=32, step_size=2)``. A function, so that lightning is
    imported at its first call, not at this file's top; one class per process."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Regressor(L.LightningModule):
        def __init__(self, lr=1e-2, weight_decay=0.0, hidden=16, optimizer="AdamW", step_size=3, gamma=0.5,
                     amsgrad=False):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self(x), y))

        def configure_optimizers(self):
            hp = self.hparams
            if hp.optimizer == "SGD":
                opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay)
            else:
                opt = getattr(torch.optim, hp.optimizer)(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay,
                                                         amsgrad=hp.amsgrad)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=hp.step_size, gamma=hp.gamma)
            return {"optimizer": opt, "lr_scheduler": sched}

    return Regressor


def _lightning(fused: bool, n: int, steps: int, weights: str) -> tuple[float, float]:
    import lightning as L
    import torch

    t0 = time.perf_counter()
    Regressor = regressor_class()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g, device=g.device)
    y = x.sum(1, keepdim=True).sin()

    def data():
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)

    def trainer():
        return L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")

    members = []
    for i in range(n):
        torch.manual_seed(i)
        members.append(Regressor(lr=1e-2 * (i + 1), weight_decay=0.01 * (i % 2), hidden=32, step_size=2))
    if fused:
        t_import = time.perf_counter()
        from wide_compiler.integrations.lightning import WideLightningModule

        import_s = time.perf_counter() - t_import
        wide = WideLightningModule(members, next(iter(data())), monitor="val_loss", mode="min")
        trainer().fit(wide, data(), data())
        seconds = time.perf_counter() - t0
        states = [wide.member(i).state_dict() for i in range(n)]
    else:
        import_s = 0.0
        for m in members:
            trainer().fit(m, data(), data())
        seconds = time.perf_counter() - t0
        states = [m.state_dict() for m in members]
    torch.save(states, weights)
    return seconds, import_s


def _transformers(fused: bool, n: int, steps: int, weights: str) -> tuple[float, float]:
    import torch
    import transformers

    t0 = time.perf_counter()
    length, vocab = 24, 32
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(32 * steps):  # examples/hf_trainer_seeds.py's task
        ids = torch.randint(3, vocab, (length,), generator=g, device=g.device)
        mask = torch.ones(length, dtype=torch.long)
        mask[int(torch.randint(length // 2, length + 1, (), generator=g, device=g.device)):] = 0
        ids = ids.masked_fill(mask == 0, 0)
        data.append({"input_ids": ids, "attention_mask": mask, "labels": int((ids == 5).sum() > (ids == 6).sum())})
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=length, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lrs, wds = [1e-4 * 3 ** i for i in range(n)], [0.01 * (i % 2) for i in range(n)]

    def arguments(out, **kw):
        return transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=32, lr_scheduler_type="cosine",
            warmup_steps=2, logging_steps=max(steps // 3, 1), save_strategy="no", report_to=[], disable_tqdm=True,
            use_cpu=True, seed=0, **kw)

    def member(i):
        torch.manual_seed(i)
        return transformers.BertForSequenceClassification(config)

    with tempfile.TemporaryDirectory() as out:
        if fused:
            t_import = time.perf_counter()
            from wide_compiler.integrations.transformers import WideTrainer, member_arguments

            import_s = time.perf_counter() - t_import
            args = member_arguments(arguments(out), learning_rate=lrs, weight_decay=wds)
            trainer = WideTrainer(model=[member(i) for i in range(n)], args=args, train_dataset=data)
            trainer.train()
            seconds = time.perf_counter() - t0
            states = [trainer.model.member(i).state_dict() for i in range(n)]
        else:
            import_s = 0.0
            states = []
            for i in range(n):
                t = transformers.Trainer(model=member(i), args=arguments(out, learning_rate=lrs[i],
                                                                          weight_decay=wds[i]),
                                         train_dataset=data)
                t.train()
                states.append(t.model.state_dict())
            seconds = time.perf_counter() - t0
    torch.save(states, weights)
    return seconds, import_s


def one_run(framework: str, fused: bool, n: int, steps: int, weights: str) -> dict[str, float]:
    """One run in this process: ``framework`` (``"lightning"`` or ``"transformers"``), fused or
    the N members one after the other, ``steps`` steps each; the members' final state dicts are
    saved to ``weights``. Returns ``{"seconds", "import_s", "cpu_s"}``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu = time.process_time()
    run = {"lightning": _lightning, "transformers": _transformers}[framework]
    try:
        seconds, import_s = run(fused, n, steps, weights)
    finally:
        torch.set_num_threads(threads)
    return {"seconds": seconds, "import_s": import_s, "cpu_s": time.process_time() - cpu}


def child() -> None:
    """``python _integrations_child.py '<json>'``: the framework is imported before the clock starts (both contenders need it), then
    :func:`one_run`; prints its JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    spec = json.loads(sys.argv[1])
    if spec["framework"] == "lightning":
        import lightning  # noqa: F401
    else:
        import transformers  # noqa: F401
        transformers.logging.set_verbosity_error()
    print(json.dumps(one_run(spec["framework"], spec["fused"], spec["n"], spec["steps"], spec["weights"])))




if __name__ == "__main__":
    child()
