"""What the parts of :mod:`wide_compiler.integrations.transformers` share: its name in errors, the
transformers library, and the member-by-member comparison of configs and ``TrainingArguments``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import transformers as hf

__all__ = ["NAME", "hf", "refuse_differences"]

NAME = "wide_compiler.integrations.transformers"


def refuse_differences(objects: Sequence[Any], free: Collection[str],
                       error: Callable[[int, str, Any, Any], Exception], absent: Any = None) -> None:
    """Compare the ``to_dict()`` of every member's object (its config, its TrainingArguments) with
    member 0's, key by key in sorted order, the keys in ``free`` aside (a missing key reads as
    ``absent``); at the first difference raise ``error(member, key, member 0's value, its value)``."""
    ref = objects[0].to_dict()
    for i, obj in enumerate(objects[1:], start=1):
        d = obj.to_dict()
        for key in sorted(set(ref) | set(d)):
            a, b = ref.get(key, absent), d.get(key, absent)
            if key not in free and a != b:
                raise error(i, key, a, b)
