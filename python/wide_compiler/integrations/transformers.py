"""N fused copies of a transformers model trained by one ``transformers.Trainer``.

:class:`WideTrainer` is a ``transformers.Trainer`` whose model is N members of one architecture
(N seeds, N learning rates, N weight decays, ...) fused into one
:class:`~wide_compiler.WideModel`: one forward, one backward and one fused optimizer step per
batch for all N, and member ``i`` ends up where a plain ``Trainer`` takes that model trained
alone with member ``i``'s arguments on the same batches. Dropout draws its own masks per
member, not the ones that plain run draws: with dropout > 0 a member trains as that run would
with another dropout stream, not bit for bit (train both with dropout 0 to compare them exactly).

* **Members.** ``model=`` is a list of N ``PreTrainedModel`` instances (member ``i``'s initial
  weights), or a :class:`WideTransformersModel` (e.g. from
  :meth:`WideTransformersModel.from_config` with N seeds).
* **Per-member arguments.** ``args=`` is one ``TrainingArguments`` (shared) or N of them, one per
  member (:func:`member_arguments` makes them from one). What may differ between members:
  ``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``,
  ``max_grad_norm``, ``optim_args``, ``lr_scheduler_type``, ``lr_scheduler_kwargs`` and
  ``warmup_steps``; any other argument that differs is an error naming the key and the member.
* **Optimizer and schedules.** The ``Trainer``'s optimizer (``optim``: ``adamw_torch``,
  ``adamw_torch_fused``, ``sgd``, ``adagrad``, ``rmsprop``) with its decay / no-decay parameter
  groups becomes one :mod:`wide_compiler.optim` optimizer with each member's values; each
  member's learning rate follows the ``Trainer``'s own schedule (``get_scheduler``) built with that
  member's learning rate, warm-up and schedule type; gradients are clipped per member
  (:func:`wide_compiler.optim.clip_grad_norm_`).
* **Logs.** ``loss_member_<i>``, ``grad_norm_member_<i>`` and ``learning_rate_member_<i>`` next to
  ``loss``, ``grad_norm`` and ``learning_rate`` (which are the means over members); evaluation
  gives ``eval_loss_member_<i>`` and, with ``compute_metrics``, ``eval_<metric>_member_<i>``
  (``compute_metrics`` and ``preprocess_logits_for_metrics`` are called once per member with that
  member's predictions, as for one model; ``eval_<metric>`` is the mean over members).
* **Saving.** ``save_model(dir)`` (and every checkpoint) writes ``dir/member_<i>/`` with
  ``save_pretrained``: each loads with ``AutoModel*.from_pretrained`` as an ordinary model.
  ``train(resume_from_checkpoint=...)`` resumes every member from such a checkpoint.

Data: the data collator gives ONE batch and every member sees it (each with its own weights).
Per-member data is not supported by this ``Trainer`` integration (use :mod:`wide_compiler.optim`
with your own loop for that).

What cannot be per member is refused with an error naming the key (and the member): members
whose configs differ in anything but initialisation and label names (their architecture or
their forward would differ), ``fp16`` (one ``GradScaler`` would be shared by all members),
``load_best_model_at_end`` / ``save_strategy="best"`` (one checkpoint for all members),
``label_smoothing_factor``, ``gradient_checkpointing``, ``lr_scheduler_type`` ``reduce_lr_on_plateau``
or ``greedy`` (stepped with one metric), DeepSpeed / FSDP, and several GPUs in one process.

transformers is optional: ``pip install "wide_compiler[transformers]"`` (tested with transformers
5.23.0 and accelerate 1.15.0, which the ``Trainer`` needs); ``import wide_compiler`` never imports
this module.

Example:
    >>> import tempfile, torch, transformers
    >>> from wide_compiler.integrations.transformers import (WideTrainer, WideTransformersModel,
    ...                                                      member_arguments)
    >>> config = transformers.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_labels=2, hidden_dropout_prob=0.0,
    ...     attention_probs_dropout_prob=0.0)
    >>> model = WideTransformersModel.from_config(
    ...     transformers.BertForSequenceClassification, config, seeds=[0, 1, 2])
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [{"input_ids": torch.randint(3, 32, (8,), generator=g), "labels": k % 2} for k in range(32)]
    >>> args = member_arguments(transformers.TrainingArguments(
    ...     output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=8,
    ...     logging_steps=2, report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no"),
    ...     learning_rate=[1e-4, 1e-3, 1e-2])
    >>> trainer = WideTrainer(model=model, args=args, train_dataset=data)
    >>> trainer.remove_callback(transformers.PrinterCallback)     # no printed logs here
    >>> _ = trainer.train()
    >>> sorted(k for k in trainer.state.log_history[-2] if k.startswith("loss_member"))
    ['loss_member_0', 'loss_member_1', 'loss_member_2']
    >>> type(trainer.model.member(2)).__name__
    'BertForSequenceClassification'
"""

from __future__ import annotations

from typing import Any

from ._common import installed, require

__all__ = ["WideTrainer", "WideTransformersModel", "member_arguments", "transformers_available"]

INSTALL_HINT = ('wide_compiler.integrations.transformers needs transformers and accelerate: pip install '
                '"transformers==5.23.0" "accelerate==1.15.0" (or pip install "wide_compiler[transformers]")')


def transformers_available() -> bool:
    """Whether ``transformers`` and ``accelerate`` (which its ``Trainer`` needs) are installed,
    checked without importing them."""
    return installed("transformers", "accelerate")


def _require_transformers() -> Any:
    return require("transformers", INSTALL_HINT, "accelerate")  # the Trainer needs accelerate


_transformers = _require_transformers()

# The parts, by concern (wide_compiler.integrations._hf): common (the library, errors' name),
# model (WideTransformersModel), arguments (per-member TrainingArguments and schedules), trainer
# (WideTrainer).
from ._hf.arguments import PER_MEMBER_ARGUMENTS, member_arguments  # noqa: E402, F401
from ._hf.model import WideTransformersModel  # noqa: E402
from ._hf.trainer import WideTrainer  # noqa: E402
