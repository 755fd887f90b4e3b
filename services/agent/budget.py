"""What a cache on a node's disk removes to fit its byte budget: the least recently used first, never what is in
use (the dataset cache and the adapter cache share this rule)."""

from __future__ import annotations

from collections.abc import Container, Iterable


def to_remove(entries: Iterable[tuple[str, float, int]], budget: int, keep: Container[str]) -> tuple[list[str], int]:
    """For entries of (key, last used, bytes): the keys to remove, least recently used first, until the rest fits
    `budget`, and the bytes the rest then holds; a key in `keep` stays even over the budget."""
    ordered = sorted(entries, key=lambda entry: entry[1])
    total = sum(size for _, _, size in ordered)
    removed = []
    for key, _, size in ordered:
        if total <= budget:
            break
        if key not in keep:
            removed.append(key)
            total -= size
    return removed, total
