"""Per-member ``TrainingArguments``: the copies (:func:`member_arguments`), the checks of what may
differ between members and what a fused run can honour, and each member's learning-rate schedule
(:class:`MemberSchedules`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .common import NAME, hf, refuse_differences

__all__ = ["PER_MEMBER_ARGUMENTS", "MemberSchedules", "check_arguments", "member_arguments", "value"]

# TrainingArguments that may take one value per member; every other one is shared.
PER_MEMBER_ARGUMENTS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                        "max_grad_norm", "optim_args", "lr_scheduler_type", "lr_scheduler_kwargs",
                        "warmup_steps")


def member_arguments(args: Any, **per_member: Sequence[Any]) -> list[Any]:
    """N copies of ``TrainingArguments`` ``args``, copy ``i`` with the ``i``-th value of each keyword:
    ``member_arguments(args, learning_rate=[1e-4, 1e-3], weight_decay=[0.0, 0.01])``. Keys must be
    among :data:`PER_MEMBER_ARGUMENTS`; every list has one value per member."""
    if not per_member:
        raise ValueError(f"{NAME}: member_arguments: give at least one per-member keyword, e.g. "
                         "learning_rate=[...]")
    lengths = {k: len(v) for k, v in per_member.items()}
    for k in per_member:
        if k not in PER_MEMBER_ARGUMENTS:
            raise ValueError(f"{NAME}: member_arguments: {k!r} cannot differ between members; per-member "
                             f"arguments are {list(PER_MEMBER_ARGUMENTS)}")
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{NAME}: member_arguments: every keyword needs one value per member; got lengths "
                         f"{lengths}")
    n = next(iter(lengths.values()))
    return [dataclasses.replace(args, **{k: v[i] for k, v in per_member.items()}) for i in range(n)]


def value(v: Any) -> Any:
    """An enum argument (``OptimizerNames.SGD``) as the string a user writes (``"sgd"``)."""
    return getattr(v, "value", v)


def check_arguments(all_args: Sequence[Any]) -> None:
    """Every argument outside PER_MEMBER_ARGUMENTS must be the same for every member, and the
    shared ones must be ones a fused run can honour."""
    refuse_differences(all_args, PER_MEMBER_ARGUMENTS, lambda i, key, ref, value: ValueError(
        f"{NAME}: TrainingArguments.{key} is {value!r} for member {i} but {ref!r} for member 0; it cannot "
        f"be per member in one fused run (one Trainer loop drives all members; per-member arguments are "
        f"{list(PER_MEMBER_ARGUMENTS)})"))
    a = all_args[0]
    refuse = [
        ("fp16", a.fp16, "one GradScaler would be shared by all members (one member's overflow would skip "
                         "every member's step); use bf16 or float32"),
        ("load_best_model_at_end", a.load_best_model_at_end, "the Trainer keeps ONE best checkpoint for all "
                                                             "members; choose per member from eval_*_member_<i>"),
        ("save_strategy", value(a.save_strategy) == "best",
         "'best' saves on ONE metric for all members"),
        ("label_smoothing_factor", a.label_smoothing_factor != 0, "the label smoother reads N-first outputs "
                                                                  "as one model's; not supported"),
        ("gradient_checkpointing", a.gradient_checkpointing, "not supported by fused members"),
        ("neftune_noise_alpha", a.neftune_noise_alpha is not None, "its noise hook needs one model's input "
                                                                 "embeddings; not supported"),
        ("deepspeed", bool(a.deepspeed), "not supported by fused members"),
        ("fsdp", bool(a.fsdp), "not supported by fused members"),
    ]
    for key, bad, why in refuse:
        if bad:
            raise ValueError(f"{NAME}: TrainingArguments.{key}={getattr(a, key)!r} is not supported: {why}")
    for i, m in enumerate(all_args):
        kind = value(m.lr_scheduler_type)
        if kind in ("reduce_lr_on_plateau", "greedy"):
            raise ValueError(f"{NAME}: TrainingArguments.lr_scheduler_type={kind!r} (member {i}) is stepped with "
                             "one metric for the whole run; not supported (use a schedule of the step count)")
    if a.n_gpu > 1:
        raise ValueError(f"{NAME}: {a.n_gpu} GPUs in one process (DataParallel) are not supported; run one "
                         "process per device (torch.distributed) or set CUDA_VISIBLE_DEVICES")


# -- learning-rate schedules --------------------------------------------------------------------------
class MemberSchedules:
    """The Trainer's schedule of each member (``transformers.get_scheduler`` with member ``i``'s
    ``lr_scheduler_type``, learning rate, warm-up and kwargs), each on a stand-in optimizer whose
    learning rates are copied into the wide optimizer's param groups (as ``[N]`` tensors)."""

    def __init__(self, optimizer: Any, all_args: Sequence[Any], num_training_steps: int) -> None:
        self.optimizer = optimizer
        self.schedulers = []
        for i, a in enumerate(all_args):
            dummy = torch.nn.Parameter(torch.zeros(()))
            groups = [{"params": [dummy] if k == 0 else [torch.nn.Parameter(torch.zeros(()))],
                       "lr": float(g["lr"][i])} for k, g in enumerate(optimizer.param_groups)]
            stand_in = torch.optim.SGD(groups, lr=a.learning_rate)
            self.schedulers.append(hf.get_scheduler(
                a.lr_scheduler_type, optimizer=stand_in, num_warmup_steps=a.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps, scheduler_specific_kwargs=a.lr_scheduler_kwargs))
            stand_in._opt_called = True      # it never steps: the wide optimizer does
        self._copy()

    def _copy(self) -> None:
        for gi, g in enumerate(self.optimizer.param_groups):
            g["lr"] = torch.tensor([s.optimizer.param_groups[gi]["lr"] for s in self.schedulers], dtype=torch.float64)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()
        self._copy()

    def member_lrs(self) -> list[float]:
        """Each member's learning rate of param group 0 now."""
        return [float(s.get_last_lr()[0]) for s in self.schedulers]

    def get_last_lr(self) -> list[float]:
        """Per param group, the mean over members (what a ``Trainer`` log shows as ``learning_rate``)."""
        return [sum(lrs) / len(lrs) for lrs in zip(*(s.get_last_lr() for s in self.schedulers))]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for s, st in zip(self.schedulers, state["schedulers"]):
            s.load_state_dict(st)
            for g, lr in zip(s.optimizer.param_groups, s.get_last_lr()):   # as a loaded optimizer's would be
                g["lr"] = lr
        self._copy()
