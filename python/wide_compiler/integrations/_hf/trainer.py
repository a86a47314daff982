"""The ``transformers.Trainer`` of N fused members (:class:`WideTrainer`): per-member optimizer,
schedules, gradient clipping, losses, logs, evaluation and checkpoints."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ...config import WideConfig
from .._optimizers import SUPPORTED, fuse_optimizers
from .arguments import MemberSchedules, check_arguments, value
from .common import NAME, hf
from .model import WideTransformersModel

__all__ = ["WideTrainer"]

# implementation choices of torch.optim that do not change the maths
_IMPLEMENTATION_KWARGS = ("fused", "foreach", "capturable", "differentiable")

# Note [Build the graph the loop runs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# WideTransformersModel keeps one fused graph per signature of the model's keyword inputs (their
# names, ranks and dtypes). The Trainer's loop calls the model with the collated batch AND, when
# the model accepts loss kwargs (BERT's and GPT-2's forward take **kwargs) and the batch holds
# labels, ``num_items_in_batch`` (Trainer.compute_loss; counted by _get_num_items_in_batch, a
# tensor). A graph built from the collated batch alone was never run in training: the first step
# captured a second train graph for the loop's signature, and the first evaluation captured the
# eval mode of both (the unused one as the model's submodule). That doubled the compile of a
# short run (issue 45: a 3-member, 10-step BERT run spent 2 of its 3 captures on it). So the graph
# built at construction is given the batch as the loop gives it, ``num_items_in_batch`` made by
# the Trainer's own function: the signature is the loop's whenever the Trainer passes it, and the
# batch alone otherwise (no labels, a model without loss kwargs), where nothing is added.



class WideTrainer(hf.Trainer):
    """A ``transformers.Trainer`` for N fused members (see the module docstring).

    ``WideTrainer(model=members_or_wide_model, args=args_or_N_args, ...)`` takes every other
    ``Trainer`` argument unchanged (datasets, ``data_collator``, ``processing_class``,
    ``compute_metrics``, ``callbacks``, ...). ``sample=``: one batch as the data collator gives
    it, to build the fused model from (default: the first two items of the train dataset, or of
    the eval dataset, collated). ``wide_config=``: the :class:`~wide_compiler.WideConfig` when
    ``model`` is a list.

    ``trainer.model`` is the :class:`WideTransformersModel`; ``trainer.model.member(i)`` is member
    ``i`` as an ordinary model; ``trainer.member_args[i]`` its ``TrainingArguments``.
    """

    def __init__(self, model: Any = None, args: Any = None, *trainer_args: Any, sample: Any = None,
                 wide_config: WideConfig | None = None, **trainer_kwargs: Any) -> None:
        if trainer_kwargs.get("model_init") is not None:
            raise ValueError(f"{NAME}: model_init is not supported; build the members (or "
                             "WideTransformersModel.from_config with seeds) and pass model=")
        if isinstance(model, (list, tuple)):
            model = WideTransformersModel(model, wide_config=wide_config)
        if not isinstance(model, WideTransformersModel):
            raise TypeError(f"{NAME}: WideTrainer needs model= a list of N PreTrainedModel members or a "
                            f"WideTransformersModel, got {type(model).__name__}")
        n = model.n
        if args is None:
            raise ValueError(f"{NAME}: pass args= (one TrainingArguments, or one per member)")
        all_args = list(args) if isinstance(args, (list, tuple)) else [args] * n
        if len(all_args) != n:
            raise ValueError(f"{NAME}: got {len(all_args)} TrainingArguments for {n} members; give one "
                             "(shared) or exactly one per member")
        for i, a in enumerate(all_args):
            if not isinstance(a, hf.TrainingArguments):
                raise TypeError(f"{NAME}: args for member {i} is a {type(a).__name__}; expected "
                                "transformers.TrainingArguments")
        check_arguments(all_args)
        self.member_args = all_args
        # the loop's arguments: shared ones, and the largest clip norm so that the Trainer clips
        # whenever any member does (members without clipping get an infinite norm)
        shared = dataclasses.replace(all_args[0], max_grad_norm=max(a.max_grad_norm for a in all_args))
        self._member_loss: torch.Tensor | None = None
        self._member_tr_loss = torch.zeros(n, dtype=torch.float64)
        self._member_last_logged = 0
        self._member_grad_norm: torch.Tensor | None = None
        self._member_lr: list[float] | None = None
        self._eval_losses: list[torch.Tensor] | None = None
        user_metrics = trainer_kwargs.pop("compute_metrics", None)
        user_preprocess = trainer_kwargs.pop("preprocess_logits_for_metrics", None)
        if trainer_kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{NAME}: compute_loss_func is not supported; the members' own losses "
                             "(outputs.loss) are used")
        opts = trainer_kwargs.get("optimizers", (None, None))
        if opts is not None and any(o is not None for o in opts):
            raise ValueError(f"{NAME}: optimizers= is not supported; the optimizer and schedules are built "
                             "per member from the TrainingArguments")
        if trainer_kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(f"{NAME}: optimizer_cls_and_kwargs is not supported; set optim/optim_args")
        super().__init__(model, shared, *trainer_args,
                         compute_metrics=self._per_member_metrics(user_metrics) if user_metrics else None,
                         preprocess_logits_for_metrics=(self._per_member_preprocess(user_preprocess)
                                                        if user_preprocess else None),
                         **trainer_kwargs)
        first = model._members[0]
        if self.args.label_names is None:
            self.label_names = hf.utils.find_labels(type(first))
        self.can_return_loss = hf.utils.can_return_loss(type(first))
        for m in model._members:       # what Trainer.__init__ does to its model's config
            m.config.use_cache = self.args.use_cache
            m.to(self.args.device)
        if model.wide is None:
            with torch.random.fork_rng(devices=[]):
                batch = self._prepare_inputs(sample if sample is not None else self._sample_batch())
                model.build(self._with_loss_kwargs(batch))

    # -- building ----------------------------------------------------------------------------
    def _with_loss_kwargs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` as the training loop gives it to the model: with ``num_items_in_batch``
        (Note [Build the graph the loop runs])."""
        if not self.model_accepts_loss_kwargs:
            return batch
        count = self._get_num_items_in_batch([batch], self.args.device)
        if count is None:
            return batch
        if isinstance(count, int):      # as compute_loss makes it: an input of the fused graph
            count = torch.tensor(count, device=self.args.device)
        return {**batch, "num_items_in_batch": count}

    def _sample_batch(self) -> dict[str, Any]:
        ds = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if isinstance(ds, Mapping):
            ds = next(iter(ds.values()))
        if ds is None or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise ValueError(f"{NAME}: cannot take a sample batch from the datasets (none, or not "
                             "map-style); pass sample= (one batch as the data collator gives it)")
        collate = self.data_collator
        if hf.utils.is_datasets_available():
            import datasets
            if isinstance(ds, datasets.Dataset):
                ds = self._remove_unused_columns(ds, description="training")
            else:
                collate = self._get_collator_with_removed_columns(collate, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        return dict(collate([ds[k] for k in range(min(2, len(ds)))]))

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            first = self.model._members[0]
            self._signature_columns = list(inspect.signature(first.forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resume: every member's weights from ``checkpoint/member_<i>/`` (what :meth:`_save`
        writes); the Trainer then loads the optimizer, schedules, RNG and loop state as usual."""
        wide = self.model
        cls = getattr(type(wide._members[0]), "_wide_base", type(wide._members[0]))
        dtype = next(iter(wide.parameters())).dtype
        for i in range(wide.n):
            path = os.path.join(resume_from_checkpoint, f"member_{i}")
            if not os.path.isdir(path):
                raise ValueError(f"{NAME}: cannot resume from {resume_from_checkpoint}: it has no member_{i}/ "
                                 f"directory (a WideTrainer checkpoint of {wide.n} members has member_0/ ... "
                                 f"member_{wide.n - 1}/)")
            loaded = cls.from_pretrained(path, dtype=dtype)
            wide.wide.load_member_state_dict(i, loaded.state_dict())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # torch.optim.Optimizer.load_state_dict (run once by accelerate's optimizer wrapper) adds a
        # 'differentiable' default that wide_compiler.optim does not save, so a second load (this
        # one) would be refused as another optimizer's state: drop it (wc.optim never reads it).
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        if opt is not None and "differentiable" not in type(opt)._flags:
            opt.defaults.pop("differentiable", None)
        super()._load_optimizer_and_scheduler(checkpoint)

    # -- optimizer and schedules -------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is not None:
            return self.optimizer
        wide = self.model
        first = wide._members[0]
        decay = set(self.get_decay_parameter_names(first))
        optimizers = []
        for i, (a, m) in enumerate(zip(self.member_args, wide._members)):
            cls, kw = hf.Trainer.get_optimizer_cls_and_kwargs(a, first)
            if cls not in SUPPORTED:
                raise ValueError(f"{NAME}: TrainingArguments.optim={value(a.optim)!r} (member {i}) builds "
                                 f"{cls.__module__}.{cls.__name__}; supported: adamw_torch, adamw_torch_fused, "
                                 "sgd, adagrad, rmsprop")
            # member i's optimizer as a plain Trainer builds it (Trainer.create_optimizer: decay and
            # no-decay groups), less the implementation choices that do not change the maths
            params = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
            groups = [{"params": [p for name, p in params if name in decay], "weight_decay": a.weight_decay},
                      {"params": [p for name, p in params if name not in decay], "weight_decay": 0.0}]
            optimizers.append(cls([g for g in groups if g["params"]],
                                  **{k: v for k, v in kw.items() if k not in _IMPLEMENTATION_KWARGS}))
        self.optimizer = fuse_optimizers(optimizers, wide._members, wide.wide.get_parameter, owner=NAME)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        # the run's length, known here (Note [Running the members until compiling pays] in
        # model_deferred.py): a run too short to earn a capture back never captures
        calls = int(num_training_steps) * max(int(self.args.gradient_accumulation_steps), 1)
        self.model.expect_calls(train_calls=calls, eval_calls=calls)
        if self.lr_scheduler is None:
            self.lr_scheduler = MemberSchedules(optimizer or self.optimizer, self.member_args,
                                                num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _get_learning_rate(self) -> float:
        if isinstance(self.lr_scheduler, MemberSchedules):
            self._member_lr = self.lr_scheduler.member_lrs()
            return sum(self._member_lr) / len(self._member_lr)
        return super()._get_learning_rate()

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        from ... import optim as wopt

        # a member without clipping: a bound no norm reaches (the scale is exactly 1)
        max_norm = [a.max_grad_norm if a.max_grad_norm > 0 else sys.float_info.max for a in self.member_args]
        norms = wopt.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm,
                                     n=self.model.n)
        self._member_grad_norm = norms.detach().to("cpu", torch.float64)
        return norms.detach().mean()

    # -- losses -------------------------------------------------------------------------------
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if isinstance(num_items_in_batch, int):      # an input of the fused graph: a tensor
            num_items_in_batch = torch.tensor(num_items_in_batch, device=self.args.device)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        n = self.model.n
        if not isinstance(loss, torch.Tensor) or loss.shape != (n,):
            raise ValueError(f"{NAME}: the fused model returned a loss of shape "
                             f"{list(getattr(loss, 'shape', []))}; expected one loss per member [{n}] "
                             "(does the batch hold the labels?)")
        self._member_loss = loss.detach()
        # training: the sum (each member's gradient is its own loss's); evaluation: the mean
        total = loss.sum() if model.training else loss.mean()
        return (total, outputs) if return_outputs else total

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self._member_loss = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        per = self._member_loss.to("cpu", torch.float64)
        scaled_for_ga = (self.loss_is_scaled_for_ga if getattr(self, "loss_is_scaled_for_ga", None) is not None
                         else (self.model_accepts_loss_kwargs and num_items_in_batch is not None))
        if not scaled_for_ga:
            per = per / self.current_gradient_accumulation_steps
        if self.args.logging_nan_inf_filter:
            bad = ~torch.isfinite(per)
            steps = 1 + self.state.global_step - self._member_last_logged
            per = torch.where(bad, self._member_tr_loss / steps, per)
        self._member_tr_loss += per
        return loss / self.model.n

    # -- logs ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        n = self.model.n
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            steps = max(self.state.global_step - self._member_last_logged, 1)
            values = (self._member_tr_loss / steps).tolist()
            self._member_tr_loss.zero_()
            self._member_last_logged = self.state.global_step
            logs.update({f"loss_member_{i}": values[i] for i in range(n)})
            if "grad_norm" in logs and self._member_grad_norm is not None:
                logs.update({f"grad_norm_member_{i}": float(self._member_grad_norm[i]) for i in range(n)})
            if "learning_rate" in logs and self._member_lr is not None:
                logs.update({f"learning_rate_member_{i}": self._member_lr[i] for i in range(n)})
        super().log(logs, start_time)

    # -- evaluation ---------------------------------------------------------------------------
    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        self._member_loss = None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if loss is not None and self._member_loss is not None and self._eval_losses is not None:
            self._eval_losses.append(self._member_loss.to("cpu", torch.float64))
            self._eval_batch_sizes.append(hf.trainer_pt_utils.find_batch_size(inputs))
        if logits is not None:      # member dim last: the loop concatenates (and pads) batch-first
            logits = tree_map(lambda t: t.movedim(0, -1) if isinstance(t, torch.Tensor) and t.dim() else t,
                              logits)
        return loss, logits, labels

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        self._eval_losses, self._eval_batch_sizes = [], []
        try:
            out = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                          metric_key_prefix)
        finally:
            losses, sizes = self._eval_losses, self._eval_batch_sizes
            self._eval_losses = None
        if losses:
            # as the Trainer does for one model: each batch's loss once per example in it
            # (accelerate's gather_for_metrics keeps the last batch's real size)
            per = torch.cat([loss.unsqueeze(0).expand(size if size is not None else 1, -1)
                             for loss, size in zip(losses, sizes)])     # [examples, N]
            for i in range(self.model.n):
                col = per[:, i]
                finite = torch.isfinite(col)
                if self.args.logging_nan_inf_filter and finite.any():
                    col = col[finite]
                out.metrics[f"{metric_key_prefix}_loss_member_{i}"] = col.mean().item()
        return out

    def _per_member_metrics(self, fn: Callable) -> Callable:
        def per_member(pred: Any, **kwargs: Any) -> dict[str, float]:
            n = self.model.n
            results = []
            for i in range(n):
                preds = tree_map(lambda a: a[..., i], pred.predictions)
                results.append(fn(hf.EvalPrediction(
                    predictions=preds, label_ids=pred.label_ids,
                    losses=getattr(pred, "losses", None), inputs=getattr(pred, "inputs", None)), **kwargs) or {})
            out: dict[str, float] = {}
            for key in results[0]:
                values = [r.get(key) for r in results]
                for i, v in enumerate(values):
                    out[f"{key}_member_{i}"] = v
                if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                    out[key] = sum(values) / n
            return out
        return per_member

    def _per_member_preprocess(self, fn: Callable) -> Callable:
        def per_member(logits: Any, labels: Any) -> Any:
            outs = [fn(tree_map(lambda t: t[..., i], logits), labels) for i in range(self.model.n)]
            flat = [tree_flatten(o) for o in outs]
            return tree_unflatten([torch.stack(ts, dim=-1) for ts in zip(*(f[0] for f in flat))], flat[0][1])
        return per_member

    # -- saving ------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        logger_dirs = self.model.save_pretrained(output_dir)
        for i, path in enumerate(logger_dirs):
            if self.processing_class is not None:
                self.processing_class.save_pretrained(path)
            torch.save(self.member_args[i], os.path.join(path, hf.trainer.TRAINING_ARGS_NAME))
        torch.save(self.args, os.path.join(output_dir, hf.trainer.TRAINING_ARGS_NAME))
