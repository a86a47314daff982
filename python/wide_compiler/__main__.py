"""``python -m wide_compiler``: see :mod:`wide_compiler.cli`."""
from .cli import main

raise SystemExit(main())
