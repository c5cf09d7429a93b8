"""``xlog-actors bench``: what users pay for this runtime beside what they would use instead.

Every row is measured in the same run as its reference (its "raw twin"), the two sampled
alternately so the machine's noise hits both, and reported as median, p99 and their ratio, with
its target and pass/fail. A progress line goes to stderr, the table to stdout, and ``--json PATH``
writes everything (``docs/performance.md`` says what each row means).

The package: :mod:`.harness` times a row beside its twin; the ``rows_*`` modules declare the rows
as data, grouped, and :mod:`.rows` orders them; :mod:`.report` builds the JSON document and the
table; :mod:`.profile` (``python -m xlog_actors.cli.bench profile|decompose [--driver host]``)
profiles the hot paths and times their pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import cast

from ...driver import Driver, HostDriver
from ...memory.stack import LOG_ENV, RESOURCE_ENV
from ..driver_choice import choose_driver
from ..options import UsageError
from .harness import Context, Group, Row, SkipRow, interleave
from .plan import Plan, make_plan
from .report import Progress, collect, render_table
from .result import RowResult, Skipped, Target, percentile
from .rows import GROUPS, row_names
from .rows_ray import RAY

__all__ = [
    "GROUPS",
    "HOST_MEMORY",
    "Context",
    "Group",
    "Plan",
    "Row",
    "RowResult",
    "SkipRow",
    "STACK_SETTINGS",
    "Skipped",
    "Target",
    "bench_driver",
    "collect",
    "interleave",
    "make_plan",
    "percentile",
    "render_table",
    "row_names",
    "run_bench",
]

# The host driver's emulated device for the benchmarks: pages are committed only when touched,
# so a large window costs nothing until the scaling row's 100,000 live blocks use it.
HOST_MEMORY = 4 << 30


def bench_driver(driver: Driver) -> Driver:
    """The driver to measure on: ``driver`` itself on CUDA; on the host, a new host driver with
    :data:`HOST_MEMORY` of emulated device memory (``driver`` is closed).

    Args:
        driver: the driver the user chose.
    Returns:
        The driver to use; the caller closes it.
    Thread rule: the calling thread.
    """
    if driver.kind != "host":
        return driver
    driver.close()
    # HostDriver narrows the protocol's stream and event parameters to its own types, so mypy
    # does not see it as a Driver; it is one at run time.
    return cast(Driver, HostDriver(memory_per_device=HOST_MEMORY))


#: The environment's stack settings, which the bench runs without: every row measures the stack it
#: names, and a default stack from the environment (a block cache, a log) would change what the
#: rows built on the default measure, or, where a row injects a fault a cached free never meets,
#: leave it waiting.
STACK_SETTINGS = (RESOURCE_ENV, LOG_ENV)


@contextlib.contextmanager
def _without_stack_settings() -> Iterator[list[str]]:
    """:data:`STACK_SETTINGS` out of the environment (so out of every process started meanwhile)
    until the block ends, then put back; yields the names that were set."""
    kept = {name: os.environ.pop(name) for name in STACK_SETTINGS if name in os.environ}
    try:
        yield sorted(kept)
    finally:
        os.environ.update(kept)


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench as the parsed flags say: progress on stderr, the table on stdout, the JSON
    document to ``--json`` (whose directory the parser checked).

    Args:
        args: the parsed ``bench`` flags (``driver``, ``quick``, ``json``, ``only``, ``ray``: also
            the Ray rows of :mod:`.rows_ray`).
    Returns:
        0, or 1 when a group of rows failed with an error.
    Raises:
        UsageError: an ``--only`` that matches no row, or a bad ``XLOG_ACTORS_DRIVER``.
        NoGpu: ``cuda`` asked for where no GPU is usable.
    The environment's :data:`STACK_SETTINGS` are set aside while it runs (a line on stderr
    names them).
    Thread rule: the command's main thread.
    """
    only = getattr(args, "only", None)
    groups = GROUPS + ((RAY,) if getattr(args, "ray", False) else ())
    if only:
        known = [name for group in groups for name in group.names]
        unknown = [o for o in only if not any(o.lower() in n.lower() for n in known)]
        if unknown:
            raise UsageError(f"--only {', '.join(map(repr, unknown))} matches no row; rows: {', '.join(known)}")
    choice = choose_driver(args.driver)
    driver = bench_driver(choice.driver)
    progress = Progress()
    print(
        f"xlog-actors bench: {choice.describe()}, device {driver.device_name(0)}{', quick' if args.quick else ''}",
        file=sys.stderr,
    )
    try:
        with _without_stack_settings() as ignored:
            if ignored:
                print(f"xlog-actors bench: {', '.join(ignored)} set aside for the run: every row measures the "
                      "stack it names", file=sys.stderr)
            doc = collect(driver, args.quick, only, progress, groups)
    finally:
        progress.done()
        driver.close()
    print(render_table(doc))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if doc["errors"] else 0
