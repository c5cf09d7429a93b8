"""What a bench run reports: the JSON document, the table, and the progress line.

The document's keys are the schema the committed runs under ``docs/benchmarks/`` use; runs are
compared by them, so none is renamed or dropped.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ...driver.protocol import Driver
from ..info import versions
from .harness import Context, Group, run_group, timer_overhead_ns
from .plan import make_plan
from .result import RowResult, Skipped
from .rows import GROUPS

__all__ = ["Progress", "collect", "render_table", "selector"]


def selector(only: Sequence[str] | None) -> Callable[[str], bool]:
    """The row filter of ``--only``: a name is wanted when it contains one of ``only``.

    Args:
        only: the needles (case-insensitive); None or empty: every row.
    Returns:
        ``wants(name) -> bool``.
    Thread rule: any thread.
    """
    if not only:
        return lambda name: True
    needles = [n.lower() for n in only]
    return lambda name: any(n in name.lower() for n in needles)


class Progress:
    """The progress line: one line on stderr, rewritten in place on a terminal.

    Thread rule: the bench's thread only.
    """

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        """Show ``text`` with the seconds since the run started.

        Args:
            text: what the run is doing.
        Thread rule: the bench's thread.
        """
        stamp = f"[{time.perf_counter() - self.started:6.1f} s]"
        if self.tty:
            print(f"\r\033[K  bench {stamp} {text}", end="", file=sys.stderr, flush=True)
        else:
            print(f"  bench {stamp} {text}", file=sys.stderr, flush=True)

    def done(self) -> None:
        """End the line on a terminal (so the table starts on its own line)."""
        if self.tty:
            print(file=sys.stderr)


def collect(
    driver: Driver,
    quick: bool,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    groups: Sequence[Group] = GROUPS,
) -> dict[str, Any]:
    """Run every selected row on ``driver`` and build the JSON document.

    A group that raises is reported in ``errors`` (with its traceback) and the others still run.

    Args:
        driver: the driver to measure on (the caller closes it).
        quick: the ``--quick`` plan.
        only: run only rows whose name contains one of these (case-insensitive); None: all.
        progress: the progress sink (default: none).
        groups: the rows to choose from (default: every row).
    Returns:
        The document: header, ``rows`` (as dicts), ``skipped`` and ``errors``.
    Thread rule: the calling thread; one run at a time per driver.
    """
    progress = progress or (lambda text: None)
    plan = make_plan(driver.kind, quick)
    wants = selector(only)
    ctx = Context(driver, plan, wants, progress)
    errors: list[dict[str, str]] = []
    started = time.perf_counter()
    for group in groups:
        if not any(wants(n) for n in group.names):
            continue
        progress(f"{group.title} ...")
        try:
            run_group(group, ctx)
        except Exception as exc:  # noqa: BLE001 - one broken group must not hide the others
            errors.append(
                {"group": group.title, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
            progress(f"{group.title}: ERROR {type(exc).__name__}: {exc}")
    rows = [r for r in ctx.results if isinstance(r, RowResult)]
    skipped = [r for r in ctx.results if isinstance(r, Skipped)]
    doc: dict[str, Any] = {
        "device": driver.device_name(0),
        # Every device the run could use: the rows of several devices ran on all of them, and the
        # kind of machine (one GPU, two, four) is read from here.
        "devices": [driver.device_name(i) for i in range(driver.device_count())],
        "driver": driver.kind,
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "method": {
            "clock": "time.perf_counter_ns",
            "timer_overhead_ns": timer_overhead_ns(),
            "gc": "gc.collect() then gc.disable() around every timed loop",
            "order": "ours and reference sampled alternately (ABBA)",
            "p99": "nearest-rank 99th percentile over samples; each sample averages ops_per_sample ops",
            "plan": dict(plan.__dict__.items()),
        },
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.to_json() for r in rows],
        "skipped": [{"name": s.name, "reason": s.reason} for s in skipped],
        "errors": errors,
    }
    if driver.kind == "cuda":
        doc["cuda_driver_version"] = _cuda_driver_version()
    return doc


def _more_devices(doc: dict[str, Any]) -> str:
    """`` (of N devices)`` for a run on a machine of several devices; else nothing."""
    count = len(doc.get("devices") or [])
    return f" (of {count} devices)" if count > 1 else ""


def _cuda_driver_version() -> str | None:
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # noqa: BLE001 - informational only
        return None


def _fmt(value: float, unit: str) -> str:
    if unit == "ops/s":
        return f"{value:,.0f} ops/s"
    if unit == "us":
        return f"{value:,.3f} µs" if value < 10 else f"{value:,.1f} µs"
    return f"{value:,.2f} GB/s" if value < 100 else f"{value:,.0f} GB/s"


def render_table(doc: dict[str, Any]) -> str:
    """The table printed at the end of a run.

    Args:
        doc: the run's JSON document (as :func:`collect` builds it).
    Returns:
        The table, lines joined by newlines (no trailing newline).
    Thread rule: any thread.
    """
    header = ("row", "median", "p99", "reference", "ref median", "ref p99", "ratio", "target", "")
    lines: list[tuple[str, ...]] = []
    for row in doc["rows"]:
        unit = row["unit"]
        ref = row["reference"]
        arrow = "↓" if row["direction"] == "lower_is_better" else "↑"
        target = row["target"]["text"] if row["target"] else "(info)"
        verdict = "" if row["pass"] is None else ("pass" if row["pass"] else "FAIL")
        lines.append((
            row["name"], _fmt(row["median"], unit), _fmt(row["p99"], unit), ref["name"],
            _fmt(ref["median"], unit), _fmt(ref["p99"], unit), f"{row['ratio']:.3f}x {arrow}", target, verdict,
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    # the reference names are long: cap that column and let it wrap into the next line instead
    widths[3] = min(widths[3], 46)

    def fmt(cols: tuple[str, ...]) -> list[str]:
        ref_name = cols[3]
        first = ref_name[: widths[3]]
        rest = ref_name[widths[3]:]
        out = ["  ".join(
            (c if i != 3 else first).ljust(widths[i]) if i in (0, 3, 7, 8) else c.rjust(widths[i])
            for i, c in enumerate(cols)
        ).rstrip()]
        indent = sum(widths[:3]) + 6
        while rest:
            out.append(" " * indent + rest[: widths[3]])
            rest = rest[widths[3]:]
        return out

    text = [
        (f"xlog-actors bench: driver {doc['driver']}, device {doc['device']}"
         f"{_more_devices(doc)}, {doc['date']}"
         f"{' (--quick)' if doc['quick'] else ''}"),
        "versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        ("ratio = ours / reference: of times (↓, lower is better) or of bandwidths and aggregate "
         "operations per second (↑, higher is better)"),
        "",
    ]
    text += fmt(header)
    text.append("  ".join("-" * w for w in widths))
    for line in lines:
        text += fmt(line)
    for s in doc["skipped"]:
        text.append(f"skipped: {s['name']}: {s['reason']}")
    for e in doc["errors"]:
        text.append(f"ERROR in {e['group']}: {e['error']}")
    rated = [r for r in doc["rows"] if r["pass"] is not None]
    text.append(f"{sum(1 for r in rated if r['pass'])}/{len(rated)} targets met ({doc['seconds']} s)")
    return "\n".join(text)
