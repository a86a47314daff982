"""Widen rule families, one per file (as functorch's ``BatchRules*.cpp``); importing this package
registers every family's rows in the rule table (fx/table.py, Note [Adding a widen rule]).

Families are discovered: a new file here is a new family, with no import list to edit. Files
whose name starts with ``_`` hold shared rule templates and register nothing themselves.
"""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
