"""The bench harness: times a row beside its raw twin and builds the row's result.

Every row follows one recipe (``docs/performance.md`` says what each row means):

* the measured operation and its reference are callables ``fn(n)`` that run the operation ``n``
  times; a *sample* times one call with ``time.perf_counter_ns`` and divides by the operations it
  ran;
* both are warmed up, then sampled alternately (ABBA order: ours, ref, ref, ours, ...), so the
  machine's noise lands on both;
* the garbage collector is off while samples are taken (``gc.disable`` in ``try/finally``, after a
  ``gc.collect``), so neither side pays for a collection the other triggered;
* a sample run stops at its sample count or its time budget, whichever comes first (never below
  a minimum).

A row is data (:class:`Row`): its name, what it measures, its setup, its operation, its twin, its
unit and its target. Rows of a :class:`Group` share the group's base setup (a device actor, say),
and consecutive rows with the same setup share one entry of it; :func:`run_group` enters each setup
only when a row that needs it is selected, and leaves it before the next setup is entered, so rows
that need much memory never hold it at the same time.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ...driver.protocol import Driver
from .plan import Plan
from .result import RowResult, Skipped, Target

__all__ = [
    "Context",
    "Group",
    "Op",
    "Row",
    "Setup",
    "SkipRow",
    "given",
    "interleave",
    "no_gc",
    "run_group",
    "timer_overhead_ns",
]

Op = Callable[[int], Any]
"""A timed operation: ``fn(n)`` runs the operation ``n`` times."""

PlanInt: TypeAlias = int | Callable[[Plan], int]
Text: TypeAlias = str | Callable[[Any, Plan], str]
Setup: TypeAlias = Callable[[Any], AbstractContextManager[Any]]
"""A row's (or a group's) setup: called with what it builds on, entered as a context manager."""


class SkipRow(Exception):
    """Raised by a row's operation factory when the row cannot run here (an absent peer
    library); the message is the reason recorded in the report.

    Thread rule: raised and caught on the bench's thread.
    """


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """``gc.collect`` then ``gc.disable`` for the block; the previous state is restored after.

    Thread rule: the bench's thread (the collector's switch is process-wide).
    """
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def interleave(
    ours: Op,
    ref: Op,
    samples: int,
    batch: int,
    *,
    budget_s: float,
    min_samples: int,
    ours_ops: int = 1,
    ref_batch: int | None = None,
    ref_ops: int = 1,
    warmup: int = 3,
) -> tuple[list[float], list[float]]:
    """Alternate samples of ``ours(batch)`` and ``ref(ref_batch)`` (ABBA), in ns per operation.

    Args:
        ours, ref: the measured operation and its reference.
        samples: the most samples of each.
        batch: ``n`` for one call of ``ours`` (and of ``ref`` unless ``ref_batch`` is given).
        budget_s: stop once this much time has passed and ``min_samples`` are taken.
        min_samples: the fewest samples of each.
        ours_ops, ref_ops: operations one call of ``fn(1)`` runs (AllocateMany: 64).
        ref_batch: ``n`` for one call of ``ref``.
        warmup: untimed calls of each first.
    Returns:
        ``(ours, ref)``: nanoseconds per operation, one entry per sample.
    Raises:
        Whatever ``ours`` or ``ref`` raise.
    Thread rule: the bench's thread.
    """
    rb = batch if ref_batch is None else ref_batch
    for _ in range(warmup):
        ours(batch)
        ref(rb)
    a: list[float] = []
    b: list[float] = []
    da = batch * ours_ops
    db = rb * ref_ops
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    with no_gc():
        for i in range(samples):
            if i & 1:
                t0, t1, t2 = _timed_pair(ref, rb, ours, batch)
                b.append((t1 - t0) / db)
                a.append((t2 - t1) / da)
            else:
                t0, t1, t2 = _timed_pair(ours, batch, ref, rb)
                a.append((t1 - t0) / da)
                b.append((t2 - t1) / db)
            if i + 1 >= min_samples and t2 > deadline:
                break
    return a, b


def _timed_pair(first: Op, n1: int, second: Op, n2: int) -> tuple[int, int, int]:
    """``first(n1)`` then ``second(n2)``, with the clock read before, between and after."""
    clock = time.perf_counter_ns
    t0 = clock()
    first(n1)
    t1 = clock()
    second(n2)
    t2 = clock()
    return t0, t1, t2


def timer_overhead_ns() -> float:
    """Median cost of one ``perf_counter_ns`` pair, for the JSON header.

    Returns:
        Nanoseconds.
    Thread rule: any thread.
    """
    clock = time.perf_counter_ns
    values = []
    for _ in range(2000):
        t0 = clock()
        t1 = clock()
        values.append(t1 - t0)
    return float(statistics.median(values))


@dataclass
class Context:
    """One bench run: its driver, plan, row selection, progress sink and results so far.

    Thread rule: the bench's thread only.
    """

    driver: Driver
    plan: Plan
    wants: Callable[[str], bool]
    progress: Callable[[str], None]
    results: list[RowResult | Skipped] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        """Whether the run is on the CUDA driver."""
        return self.driver.kind == "cuda"

    def add(self, row: RowResult) -> None:
        """Record a measured row and report it on the progress line.

        Args:
            row: the result.
        Thread rule: the bench's thread.
        """
        self.results.append(row)
        verdict = ""
        if row.target is not None:
            verdict = f", target {row.target.text}: {'pass' if row.passed else 'FAIL'}"
        self.progress(f"{row.name}: {row.median:.4g} {row.unit}, {row.ratio:.3g}x{verdict}")

    def skip(self, name: str, reason: str) -> None:
        """Record a row not measured here, and why.

        Args:
            name: the row's name.
            reason: why it was not measured.
        Thread rule: the bench's thread.
        """
        self.results.append(Skipped(name, reason))
        self.progress(f"{name}: skipped ({reason})")


def _value(x: PlanInt, plan: Plan) -> int:
    return x if isinstance(x, int) else x(plan)


def _text(x: Text, fixture: Any, plan: Plan) -> str:
    return x if isinstance(x, str) else x(fixture, plan)


def _twin_name(fixture: Any, plan: Plan) -> str:
    """A row's default reference name: its fixture's ``raw_name``. Thread rule: any thread."""
    return str(fixture.raw_name)


@dataclass(frozen=True)
class Row:
    """One bench row, declared once.

    The operation and its twin are factories: given the row's entered setup (its *fixture*) they
    return the timed :data:`Op`. Texts may be callables of ``(fixture, plan)`` where they name
    sizes or the twin the driver has. Counts that depend on the plan are callables of the plan.

    Attributes:
        name: the row's name (``--only`` matches on it).
        measures: what the row measures.
        setup: a context-manager factory called with the group's base fixture; its value is the
            fixture the factories below receive. Rows with the same setup object, listed one
            after another, share one entry.
        op: the measured operation's factory.
        twin: the reference's factory.
        spec: ``(samples, batch)`` from the plan.
        reference: the reference's name (default: the fixture's ``raw_name``).
        kind: ``"time"`` (µs per op), ``"rate"`` (GB/s of ``bytes_per_op``) or ``"throughput"``
            (operations per second, all threads together: ``ours_ops`` and ``ref_ops`` count the
            operations one ``fn(1)`` runs on all its threads).
        bytes_per_op: bytes one operation moves (rate rows).
        target: what the row must meet; None makes it informational.
        note: shown in the JSON.
        ours_ops, ref_ops, ref_batch: as :func:`interleave` takes them.
        host_skip: where set, the reason the row is skipped on the host driver.
        check: called with the fixture after sampling; raises when the result is wrong.
        measure: replaces the sampling: ``measure(fixture, ctx) -> (ours, ref)`` in ns per op.
        concurrency: for a throughput row, ``(threads or actors of ours, of the reference)``.
    Thread rule: immutable; any thread.
    """

    name: str
    measures: Text
    setup: Setup
    op: Callable[[Any], Op] | None
    twin: Callable[[Any], Op] | None
    spec: Callable[[Plan], tuple[int, int]]
    reference: Text = _twin_name
    kind: str = "time"
    bytes_per_op: PlanInt = 0
    target: Target | None = None
    note: Text = ""
    ours_ops: PlanInt = 1
    ref_ops: PlanInt = 1
    ref_batch: Callable[[Plan], int] | None = None
    host_skip: str | None = None
    check: Callable[[Any], None] | None = None
    measure: Callable[[Any, Context], tuple[list[float], list[float]]] | None = None
    concurrency: tuple[int, int] | None = None

    def run(self, fixture: Any, ctx: Context) -> RowResult:
        """Time the row beside its twin and build its result.

        Args:
            fixture: the row's entered setup.
            ctx: the run.
        Returns:
            The row's result (not yet recorded).
        Raises:
            SkipRow: the operation cannot run here.
            RuntimeError: the row's check found a wrong result.
        Thread rule: the bench's thread.
        """
        plan = ctx.plan
        samples, batch = self.spec(plan)
        ours_ops, ref_ops = _value(self.ours_ops, plan), _value(self.ref_ops, plan)
        ref_batch = batch if self.ref_batch is None else self.ref_batch(plan)
        if self.measure is not None:
            a, b = self.measure(fixture, ctx)
        else:
            assert self.op is not None and self.twin is not None, f"{self.name}: no op or twin"
            ours, ref = self.op(fixture), self.twin(fixture)
            a, b = interleave(
                ours, ref, samples, batch, budget_s=plan.budget_s, min_samples=plan.min_samples,
                ours_ops=ours_ops, ref_batch=ref_batch, ref_ops=ref_ops,
            )
            # Dropping the closures drops what they hold (an actor's last handle, say) now,
            # before the next row is timed.
            del ours, ref
        if self.check is not None:
            self.check(fixture)
        return RowResult(
            self.name, _text(self.measures, fixture, plan), _text(self.reference, fixture, plan), a, b,
            batch * ours_ops, kind=self.kind, bytes_per_op=_value(self.bytes_per_op, plan),
            target=self.target, informational=self.target is None, note=_text(self.note, fixture, plan),
            ref_ops_per_sample=ref_batch * ref_ops, concurrency=self.concurrency,
        )


@contextlib.contextmanager
def given(value: Any) -> Iterator[Any]:
    """A setup that enters nothing: its fixture is ``value`` (a group's base fixture, say).

    Args:
        value: the fixture.
    Returns:
        A context manager yielding ``value``.
    Thread rule: any thread.
    """
    yield value


@dataclass(frozen=True)
class Group:
    """Rows that share a base setup, run together and reported under one title.

    Attributes:
        title: shown on the progress line.
        rows: the rows, in report order.
        base: a context-manager factory called with the run's :class:`Context`; its value is what
            each row's setup receives (default: the context itself).
    Thread rule: immutable; any thread.
    """

    title: str
    rows: tuple[Row, ...]
    base: Setup = given

    @property
    def names(self) -> tuple[str, ...]:
        """The rows' names, in order."""
        return tuple(row.name for row in self.rows)


def run_group(group: Group, ctx: Context) -> None:
    """Run the selected rows of ``group``, recording each result or skip in ``ctx``.

    The base setup is entered at the first row that runs; a row's setup is entered when the row
    before it had another one (which is left first).

    Args:
        group: the rows.
        ctx: the run (its selection and its results).
    Raises:
        Whatever a setup, an operation or a check raises (the runner reports it for the group).
    Thread rule: the bench's thread.
    """
    with contextlib.ExitStack() as outer:
        base: Any = None
        started = False
        entered: Setup | None = None
        fixture: Any = None
        inner = contextlib.ExitStack()
        for row in group.rows:
            if not ctx.wants(row.name):
                continue
            if row.host_skip is not None and not ctx.cuda:
                ctx.skip(row.name, row.host_skip)
                continue
            if not started:
                base = outer.enter_context(group.base(ctx))
                outer.callback(inner.close)  # the rows' setups are left before the base
                started = True
            if row.setup is not entered:
                fixture = None  # the fixture's buffers and handles go with its setup, not after the next
                inner.close()
                fixture = inner.enter_context(row.setup(base))
                entered = row.setup
            try:
                result = row.run(fixture, ctx)
            except SkipRow as exc:
                ctx.skip(row.name, str(exc))
                continue
            ctx.add(result)
        fixture = None
