"""The parts of :mod:`wide_compiler.integrations.lightning`, by concern (import them from there):
``capture`` (a member's steps as a module; the checks of the members), ``metrics`` (per-member
logging), ``optimizers`` (the members' ``configure_optimizers`` fused), ``module``
(``WideLightningModule``, ``load_member``), ``early_stopping`` and ``model_with_loss``."""
