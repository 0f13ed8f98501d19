"""Rows: what one sample of a micro-batch is. Unpacked, a row is one sample; packed, a row holds as
many samples as fit in model.max_length tokens (best fit, longest first), so a batch carries few pad
tokens. The packing is a pure function of the samples, the same on every rank.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rows:
    members: np.ndarray
    """Sample indices, row after row (int64)."""
    offsets: np.ndarray
    """Row i holds samples members[offsets[i]:offsets[i + 1]]."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, index: int) -> np.ndarray:
        return self.members[self.offsets[index] : self.offsets[index + 1]]

    def totals(self, per_sample: np.ndarray) -> np.ndarray:
        """per_sample summed over each row's samples."""
        return np.add.reduceat(per_sample[self.members], self.offsets[:-1]) if len(self) else per_sample[:0]


def one_per_row(count: int) -> Rows:
    return Rows(members=np.arange(count, dtype=np.int64), offsets=np.arange(count + 1, dtype=np.int64))


def pack(lengths: np.ndarray, max_length: int) -> Rows:
    """Best-fit decreasing: each sample, longest first, goes into the row it fills most tightly."""
    rows: list[list[int]] = []
    # (space left, row index), kept sorted: the first entry with enough space is the tightest fit.
    free: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        length = int(lengths[index])
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, row = free.pop(at)
            rows[row].append(index)
            bisect.insort(free, (space - length, row))
        else:
            rows.append([index])
            bisect.insort(free, (max_length - length, len(rows) - 1))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    members = np.array([i for r in rows for i in r], dtype=np.int64)
    return Rows(members=members, offsets=offsets)
