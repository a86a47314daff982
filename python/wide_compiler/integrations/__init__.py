"""Integrations with other libraries. Each one is an optional dependency: importing
:mod:`wide_compiler` never imports them, and a submodule names the ``pip install`` it needs when
its library is missing.

* :mod:`wide_compiler.integrations.ray`: sweeps on Ray Tune, where ONE trial trains N
  hyperparameter configurations fused into one wide model (``pip install "ray[tune]"``).
"""

__all__: list[str] = []
