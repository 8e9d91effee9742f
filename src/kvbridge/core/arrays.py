"""Parallel int64 arrays: the one shape that segments, token segments and descriptors share.

Each is a frozen dataclass whose fields are int64 arrays of one length (entry i of every field describes run i);
`ParallelArrays` gives them the operations on whole entries once: empty, concatenate, select.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Self

import numpy as np


class ParallelArrays:
    """Base of a frozen dataclass of parallel int64 arrays (its fields, in order)."""

    @classmethod
    def empty(cls) -> Self:
        z = np.zeros(0, dtype=np.int64)
        return cls(*(z for _ in dataclasses.fields(cls)))

    @classmethod
    def concat(cls, parts: Sequence[Self]) -> Self:
        """Entries of `parts`, part after part (none: empty)."""
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def select(self, mask: np.ndarray) -> Self:
        """The entries where `mask` (a boolean array, or indexes) selects."""
        return type(self)(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))
