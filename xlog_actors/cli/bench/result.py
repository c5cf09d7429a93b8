"""What a bench row reports: its target, its figures (median, p99, ratio) and pass/fail.

These types are the JSON report's schema: ``RowResult.to_json`` writes the keys runs are compared
by, so a key is never renamed or dropped.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["RowResult", "Skipped", "Target", "percentile"]


@dataclass(frozen=True)
class Target:
    """What a row must meet: ``metric`` (``"ratio"`` or ``"median"``, the latter in the
    row's unit) ``op`` (``"<="``, ``"<"``, ``">="``) ``value``. Immutable; any thread."""

    metric: str
    op: str
    value: float

    @property
    def text(self) -> str:
        """The target as the table shows it: ``"<= 1.5x"`` or ``"median < 0.5"``."""
        if self.metric == "ratio":
            return f"{self.op} {self.value:g}x"
        return f"median {self.op} {self.value:g}"

    def check(self, ratio: float, median: float) -> bool:
        """Whether a row's figures meet the target.

        Args:
            ratio: the row's ratio (ours / reference, of times or of rates).
            median: the row's median in its unit.
        Returns:
            True when met.
        Raises:
            ValueError: an ``op`` this class does not know.
        Thread rule: any thread.
        """
        x = ratio if self.metric == "ratio" else median
        if self.op == "<=":
            return x <= self.value
        if self.op == "<":
            return x < self.value
        if self.op == ">=":
            return x >= self.value
        raise ValueError(self.op)

    def to_json(self) -> dict[str, Any]:
        """The target as the JSON report holds it (with its ``text``). Thread rule: any thread."""
        return {"metric": self.metric, "op": self.op, "value": self.value, "text": self.text}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty list.

    Args:
        values: the samples (not modified).
        q: the percentile, 0..100.
    Returns:
        The sample at that rank.
    Raises:
        IndexError: ``values`` is empty.
    Thread rule: any thread.
    """
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class RowResult:
    """One row. ``ours``/``ref`` hold nanoseconds per operation, one entry per sample.

    ``kind="time"``: figures are µs per op and ``ratio = ours / reference`` (lower is better).
    ``kind="rate"``: figures are GB/s (``bytes_per_op`` / time) and ``ratio = ours / reference``
    *of the rates*, i.e. reference time / our time (higher is better); the "p99" of a rate row
    is the rate at the 99th-percentile time, the slow tail.
    ``kind="throughput"``: figures are operations per second, all threads together (a sample's
    wall time over the operations all its threads ran), and ``ratio = ours / reference`` of those
    (higher is better); the "p99" is the throughput of the slow tail. ``concurrency`` is then
    ``(threads or actors on our side, on the reference's)``, written to the JSON as
    ``{"ours": ..., "reference": ...}`` (None for other rows).

    Thread rule: any thread; built once, then read.
    """

    name: str
    measures: str
    reference_name: str
    ours: list[float]
    ref: list[float]
    ops_per_sample: int
    kind: str = "time"
    bytes_per_op: int = 0
    target: Target | None = None
    informational: bool = False
    note: str = ""
    ref_ops_per_sample: int | None = None
    concurrency: tuple[int, int] | None = None

    @property
    def unit(self) -> str:
        """``"us"`` for a time row, ``"GB/s"`` for a rate row, ``"ops/s"`` for a throughput row."""
        return {"time": "us", "throughput": "ops/s"}.get(self.kind, "GB/s")

    def _fig(self, ns: float) -> float:
        if self.kind == "time":
            return ns / 1e3
        if self.kind == "throughput":
            return 1e9 / ns  # operations per second
        return self.bytes_per_op / ns  # bytes per ns == GB/s

    @property
    def median(self) -> float:
        """Our median, in the row's unit."""
        return self._fig(statistics.median(self.ours))

    @property
    def ratio(self) -> float:
        """Ours / reference: of median times (time rows) or of median rates (rate and throughput
        rows)."""
        ours, ref = statistics.median(self.ours), statistics.median(self.ref)
        return ours / ref if self.kind == "time" else ref / ours

    @property
    def direction(self) -> str:
        """``"lower_is_better"`` (time) or ``"higher_is_better"`` (rate)."""
        return "lower_is_better" if self.kind == "time" else "higher_is_better"

    @property
    def ratio_definition(self) -> str:
        """What the ratio means, in words, for the JSON report."""
        if self.kind == "time":
            return "ours / reference, median time per op (lower is better)"
        if self.kind == "throughput":
            return "ours / reference, median aggregate operations per second (higher is better)"
        return "ours / reference, median bandwidth (higher is better)"

    @property
    def passed(self) -> bool | None:
        """Whether the target is met; None for an informational row (no target)."""
        if self.target is None:
            return None
        return self.target.check(self.ratio, self.median)

    def to_json(self) -> dict[str, Any]:
        """The row as the JSON report holds it (the keys runs are compared by)."""
        return {
            "name": self.name,
            "measures": self.measures,
            "unit": self.unit,
            "median": self.median,
            "p99": self._fig(percentile(self.ours, 99)),  # for a rate: the rate of the slow tail
            "reference": {
                "name": self.reference_name,
                "median": self._fig(statistics.median(self.ref)),
                "p99": self._fig(percentile(self.ref, 99)),
                "samples": len(self.ref),
                "ops_per_sample": self.ref_ops_per_sample or self.ops_per_sample,
            },
            "ratio": self.ratio,
            "ratio_definition": self.ratio_definition,
            "direction": self.direction,
            "target": None if self.target is None else self.target.to_json(),
            "pass": self.passed,
            "informational": self.informational,
            "samples": len(self.ours),
            "ops_per_sample": self.ops_per_sample,
            "bytes_per_op": self.bytes_per_op or None,
            "note": self.note,
            "concurrency": None if self.concurrency is None else {
                "ours": self.concurrency[0], "reference": self.concurrency[1],
            },
        }


@dataclass(frozen=True)
class Skipped:
    """A row not measured in this run, and why (a CUDA-only row on the host, an absent peer)."""

    name: str
    reason: str
