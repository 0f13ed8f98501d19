"""Which nodes differ from the rest: the value most nodes share is the reference (ties: the head's)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable


def reference_value(values: dict[str, Hashable], head: str) -> Hashable:
    """The most common value; on a tie the head's, so one odd worker is named, not the others."""
    counts = Counter(values.values())
    best = max(counts.values())
    tied = [value for value, count in counts.items() if count == best]
    if head in values and values[head] in tied:
        return values[head]
    return tied[0]


def odd_ones(values: dict[str, Hashable], head: str) -> tuple[Hashable, list[str]]:
    """(reference value, hosts whose value differs from it), hosts in the order given."""
    if not values:
        return None, []
    reference = reference_value(values, head)
    return reference, [host for host, value in values.items() if value != reference]
