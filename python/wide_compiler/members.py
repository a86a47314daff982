"""Per-member operations of a WideModel (mixed into :class:`~wide_compiler.WideModel`)."""

from __future__ import annotations

__all__ = ["MemberOpsMixin"]


class MemberOpsMixin:
    """Methods acting on single members of a wide model (filled in by the training issue)."""
