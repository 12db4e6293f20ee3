"""Interleaving and summaries: rounds in rotating order, medians, spreads, paired ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def rotations(items: Sequence[T], rounds: int) -> list[list[T]]:
    """One order per round: round r starts at item r (mod n), so each contestant runs first,
    middle and last equally often and a slow spell on the machine hits all of them."""
    n = len(items)
    return [[items[(r + i) % n] for i in range(n)] for r in range(rounds)]


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int

    def spread_pct(self) -> float:
        """(max - min) / median, in percent."""
        return 100.0 * (self.high - self.low) / self.median if self.median else 0.0

    def fmt(self, digits: int = 0) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


def summarize(values: Sequence[float]) -> Summary:
    values = [v for v in values if v is not None]
    if not values:
        return Summary(float("nan"), float("nan"), float("nan"), 0)
    return Summary(statistics.median(values), min(values), max(values), len(values))


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> Summary:
    """Ratio of two contestants' rates measured in the same rounds, summarized over rounds:
    pairing within a round cancels most of what the shared machine does to both."""
    return summarize([a / b for a, b in zip(numerator, denominator, strict=True) if b])
