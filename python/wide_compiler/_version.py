"""The package version, in a module of its own so that any module may read it without importing
the package root (which imports everything). pyproject.toml reads it from here (``dynamic =
["version"]``, scikit-build-core's regex provider); ``wide_compiler.__version__`` re-exports it."""

__version__ = "0.1.0"
