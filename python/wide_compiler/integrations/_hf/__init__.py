"""The parts of :mod:`wide_compiler.integrations.transformers`, by concern (import them from
there): ``common`` (the library, the errors' name), ``model`` (``WideTransformersModel``),
``arguments`` (per-member ``TrainingArguments`` and schedules) and ``trainer`` (``WideTrainer``)."""
