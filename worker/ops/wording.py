"""Counting words in what decider prints: "1 option", "2 options"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun in the plural (``plural``, else ``noun`` + "s") unless the count is 1."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
