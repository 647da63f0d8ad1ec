"""The order the arms of an A/B run in, round by round: shared by the benches and the probes that alternate arms."""

from __future__ import annotations


def rotated(arms: list, round_: int) -> list:
    """`arms` starting at the `round_`-th (modulo their count): each round of an A/B starts at another arm, so that no
    arm is always timed first."""
    return arms[round_ % len(arms):] + arms[:round_ % len(arms)]
