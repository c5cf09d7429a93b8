"""The plan of a bench run: sample counts, batch sizes and data sizes per driver and mode.

The CUDA plan is sized for an H100/H200 class GPU; the host plan keeps a run on two shared cores
within minutes. ``--quick`` is a smoke run of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GIB", "KIB", "MIB", "SIZE", "Plan", "make_plan", "size_text"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
SIZE = 4 * KIB  # the allocation size of every allocator row


@dataclass(frozen=True)
class Plan:
    """Sample counts, batch sizes and data sizes of one run (see :func:`make_plan`)."""

    budget_s: float  # per measured pair: stop sampling after this long (at least min_samples)
    min_samples: int
    alloc: tuple[int, int]  # (samples, ops per sample) for the stream-ordered allocator rows
    direct: tuple[int, int]
    ask: tuple[int, int]
    many: tuple[int, int]  # AllocateMany(64): calls per sample
    client: tuple[int, int]
    access: tuple[int, int]
    event: tuple[int, int]
    h2d_bytes: int
    h2d_samples: int
    d2d_bytes: int
    d2d_samples: int
    d2d_per_sync: int  # copies enqueued before each synchronize (both sides)
    pipe_sizes: tuple[tuple[int, int], ...]  # the demo rows: (batch bytes, batches) per size
    pipe_rounds: int
    scale_low: int
    scale_high: int
    scale_rounds: int
    scale: tuple[int, int]  # (samples per phase, ops per sample)
    # DeviceClient from 8 threads: (samples, allocate+free pairs per thread per sample); a share
    # long against a thread's start at the sample's barrier (a wake-up, 0.15-0.23 ms on the GPU
    # hosts), else the ratio measures the hand-offs: at 100 pairs a thread it reads about 0.5x
    threads: tuple[int, int]
    workers: tuple[int, int]  # Allocate from 16 worker actors: (samples, asks per worker per sample)
    train_steps: int  # the torch training loop: steps per round (CUDA only)
    train_rounds: int  # and timed rounds, per half
    many_count: int = 64


def make_plan(kind: str, quick: bool) -> Plan:
    """The plan for a run on ``kind``'s driver.

    Args:
        kind: ``"cuda"`` or ``"host"`` (the driver's ``kind``).
        quick: the ``--quick`` smoke run's smaller plan.
    Returns:
        The plan.
    Thread rule: any thread.
    """
    return Plan(**{name: column[_COLUMNS.index((kind == "cuda", quick))] for name, column in _TABLE.items()})


# One column per (driver, mode), so the four plans read side by side.
_COLUMNS = [(True, True), (True, False), (False, True), (False, False)]
_TABLE: dict[str, tuple[Any, Any, Any, Any]] = {
    #                  cuda --quick    cuda            host --quick    host
    "budget_s":         (1.0,          4.0,            0.6,            2.5),
    "min_samples":      (10,           20,             5,              10),
    "alloc":            ((300, 10),    (3000, 10),     (200, 10),      (1500, 10)),
    "direct":           ((60, 2),      (400, 2),       (100, 4),       (400, 4)),
    "ask":              ((150, 2),     (1500, 4),      (100, 2),       (400, 2)),
    "many":             ((30, 1),      (300, 1),       (15, 1),        (60, 1)),
    "client":           ((300, 10),    (3000, 10),     (200, 10),      (1500, 10)),
    "access":           ((100, 1000),  (600, 1000),    (100, 1000),    (400, 1000)),
    "event":            ((300, 10),    (3000, 10),     (200, 10),      (1500, 10)),
    "h2d_bytes":        (64 * MIB,     256 * MIB,      4 * MIB,        16 * MIB),
    "h2d_samples":      (6,            20,             5,              12),
    "d2d_bytes":        (256 * MIB,    GIB,            16 * MIB,       64 * MIB),
    "d2d_samples":      (8,            40,             5,              12),
    "d2d_per_sync":     (8,            8,              2,              2),
    "pipe_sizes":       (((64 * KIB, 400), (MIB, 200), (16 * MIB, 32)),
                         ((64 * KIB, 2000), (MIB, 1000), (16 * MIB, 128)),
                         ((64 * KIB, 40), (MIB, 12), (16 * MIB, 4)),
                         ((64 * KIB, 200), (MIB, 48), (16 * MIB, 8))),
    "pipe_rounds":      (1,            3,              1,              3),
    "scale_low":        (1_000,        1_000,          100,            1_000),
    "scale_high":       (100_000,      100_000,        5_000,          100_000),
    "scale_rounds":     (2,            4,              2,              2),
    "scale":            ((50, 10),     (300, 10),      (20, 10),       (100, 10)),
    "threads":          ((6, 1_000),   (20, 5_000),    (3, 200),       (8, 1_000)),
    "workers":          ((10, 20),     (60, 40),       (5, 10),        (15, 25)),
    "train_steps":      (1_000,        10_000,         1_000,          10_000),
    "train_rounds":     (3,            5,              3,              5),
}


def size_text(nbytes: int) -> str:
    """``nbytes`` as ``"1 GiB"``, ``"16 MiB"`` or ``"4 KiB"``, for row descriptions.

    Args:
        nbytes: a byte count.
    Returns:
        The text.
    Thread rule: any thread.
    """
    if nbytes >= GIB and nbytes % GIB == 0:
        return f"{nbytes // GIB} GiB"
    if nbytes >= MIB:
        return f"{nbytes / MIB:g} MiB"
    return f"{nbytes / KIB:g} KiB"
