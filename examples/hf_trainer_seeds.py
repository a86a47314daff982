"""N seeds x N learning rates of one transformers model, trained by ONE transformers.Trainer.

A tiny BERT sequence classifier (random config, no download) learns a built-in synthetic task
(is token 5 more frequent than token 6 in the sequence? padded sequences of random length).
wide_compiler.integrations.transformers.WideTrainer fuses N members (member i: seed i, its own
learning rate, weight decay and schedule) into one wide model and trains them with one
Trainer: one forward, one backward and one fused AdamW step per batch for all. The logs carry
loss_member_<i> and learning_rate_member_<i>, evaluation eval_loss_member_<i> and
eval_accuracy_member_<i>, and save_model writes one from_pretrained directory per member.

    python examples/hf_trainer_seeds.py [--members 4] [--steps 40]
    python examples/hf_trainer_seeds.py --measure [--members 8]    # fused vs N separate Trainer runs
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import torch
import transformers

from wide_compiler.integrations.transformers import WideTrainer, WideTransformersModel, member_arguments

VOCAB, LENGTH = 32, 24


def dataset(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (LENGTH,), generator=g)
        mask = torch.ones(LENGTH, dtype=torch.long)
        mask[int(torch.randint(LENGTH // 2, LENGTH + 1, (), generator=g)):] = 0
        ids = ids.masked_fill(mask == 0, 0)
        label = int((ids == 5).sum() > (ids == 6).sum())
        items.append({"input_ids": ids, "attention_mask": mask, "labels": label})
    return items


def config() -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=LENGTH, num_labels=2,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def accuracy(pred) -> dict[str, float]:
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    return {"accuracy": float((logits.argmax(-1) == pred.label_ids).mean())}


def arguments(out: str, steps: int, **kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=32, per_device_eval_batch_size=64,
        lr_scheduler_type="cosine", warmup_steps=5, logging_steps=max(steps // 3, 1), save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, seed=0, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--measure", action="store_true", help="time the fused run against N separate Trainer runs")
    a = p.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    n = a.members
    train, evals = dataset(1024, 0), dataset(256, 1)
    lrs = [1e-4 * 3 ** (k % 4) for k in range(n)]            # 1e-4, 3e-4, 9e-4, 2.7e-3, ...
    wds = [0.0 if k % 2 == 0 else 0.01 for k in range(n)]
    out = tempfile.mkdtemp()
    args = member_arguments(arguments(out, a.steps), learning_rate=lrs, weight_decay=wds)
    if a.measure:
        torch.set_num_threads(1)

    start = time.perf_counter()
    model = WideTransformersModel.from_config(transformers.BertForSequenceClassification, config(),
                                              seeds=range(n))
    trainer = WideTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals, compute_metrics=accuracy)
    trainer.remove_callback(transformers.PrinterCallback)
    built = time.perf_counter() - start                      # the fused model's capture and widening
    trainer.train()
    fused = time.perf_counter() - start
    print(f"trained {n} fused members for {a.steps} steps in {fused:.1f} s ({built:.1f} s of it building "
          "the fused model)")
    metrics = trainer.evaluate()
    for i in range(n):
        print(f"member {i}: seed {i}, lr {lrs[i]:.1e}, wd {wds[i]}: eval loss "
              f"{metrics[f'eval_loss_member_{i}']:.4f}, accuracy {metrics[f'eval_accuracy_member_{i}']:.3f}")
    best = min(range(n), key=lambda i: metrics[f"eval_loss_member_{i}"])
    dirs = trainer.model.save_pretrained(f"{out}/members")
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(dirs[best])
    print(f"best member {best}: saved to {dirs[best]}, reloaded as {type(loaded).__name__}")

    if a.measure:
        start = time.perf_counter()
        for i in range(n):
            torch.manual_seed(i)
            alone = transformers.Trainer(model=transformers.BertForSequenceClassification(config()),
                                         args=dataclasses.replace(args[i]), train_dataset=train)
            alone.remove_callback(transformers.PrinterCallback)
            alone.train()
        separate = time.perf_counter() - start
        print(f"{n} members, {a.steps} steps, 1 thread: fused {fused:.2f} s (compile included), "
              f"{n} separate Trainer runs {separate:.2f} s: {separate / fused:.1f}x")


if __name__ == "__main__":
    main()
