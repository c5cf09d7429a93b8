"""The cross-process read row: a consumer process reads a block another process owns,
through the handle it was sent, beside a read of a block of its own of the same size.

The owner is a ``DeviceActor`` in the bench's process: on CUDA on the ``direct`` stack (its
``cuMemAlloc`` blocks cross through legacy CUDA IPC), on the host driver on a
``HostDriver(shared=True)`` (device memory in shared memory). The consumer is a spawned process
(:mod:`.cross_reader`); it times its own reads, so the pipe's round trip is in neither figure,
and both reads run in the same process, on the same stream, into the same destination: what
differs is only where the source lives. Samples alternate (ABBA).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ...actors import Allocate, CopyActor, CopyToHost, DeviceActor, Fill
from ...driver.host import HostDriver
from .cross_reader import serve
from .harness import Context, Group, Row, given
from .plan import Plan, size_text
from .result import Target

__all__ = ["SHARED"]

_REPLY_S = 120.0


@dataclass
class _Cross:
    conn: Connection
    plan: Plan
    nbytes: int
    per_sync: int


def _ask(conn: Connection, *cmd: Any) -> Any:
    conn.send(cmd)
    if not conn.poll(_REPLY_S):
        raise RuntimeError(f"cross-process read: the consumer did not answer {cmd[0]!r} in {_REPLY_S:.0f} s")
    return conn.recv()


@contextlib.contextmanager
def _cross(ctx: Context) -> Iterator[_Cross]:
    kind = ctx.driver.kind
    own: HostDriver | None = HostDriver(shared=True) if kind == "host" else None
    driver = own if own is not None else ctx.driver
    nbytes, per_sync = ctx.plan.h2d_bytes, ctx.plan.d2d_per_sync
    device = DeviceActor.start(0, driver, resource="direct" if kind == "cuda" else None)
    mp = multiprocessing.get_context("spawn")
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=serve, args=(theirs, kind), name="xlog-bench-consumer", daemon=True)
    copy = CopyActor.start(device)
    try:
        ref: Any = device.ask(Allocate(nbytes))
        copy.ask(Fill(ref, 7))
        copy.ask(CopyToHost(ref, nbytes=1))  # the fill has landed
        proc.start()
        theirs.close()
        if _ask(mine, "open", ref, per_sync) != "ready":
            raise RuntimeError("cross-process read: the consumer could not open the handle")
        yield _Cross(mine, ctx.plan, nbytes, per_sync)
        _ask(mine, "stop")
        del ref
    finally:
        mine.close()
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(10.0)
        copy.stop()
        device.stop()
        if own is not None:
            own.close()


def _measure(f: _Cross, ctx: Context) -> tuple[list[float], list[float]]:
    """ABBA samples of ``d2d_per_sync`` reads each, timed in the consumer; ns per read."""
    samples = max(ctx.plan.min_samples, ctx.plan.d2d_samples)
    _ask(f.conn, "read", "imported", 1)  # warm both paths (the first use maps the memory)
    _ask(f.conn, "read", "local", 1)
    ours: list[float] = []
    ref: list[float] = []
    for i in range(samples):
        order = ("imported", "local") if i % 2 == 0 else ("local", "imported")
        for which in order:
            ns = _ask(f.conn, "read", which, 1) / f.per_sync
            (ours if which == "imported" else ref).append(float(ns))
    return ours, ref


def _check(f: _Cross) -> None:
    if _ask(f.conn, "check") != bytes([7]) * 16:
        raise RuntimeError("cross-process read: the consumer read other bytes than the owner wrote")


SHARED = Group("cross-process read", (
    Row("cross-process read", lambda f, p: f"in a consumer process, {p.d2d_per_sync} x copy of a "
        f"{size_text(p.h2d_bytes)} block another process owns (its handle sent pickled, opened through CUDA IPC "
        "or shared memory) into a local block, then synchronize; timed in the consumer; per copy",
        given, None, None, lambda p: (p.d2d_samples, 1),
        reference=lambda f, p: "the same copies in the same process from a block of its own (cuMemAlloc; private "
        "memory on the host driver)", kind="rate", bytes_per_op=lambda p: p.h2d_bytes, measure=_measure,
        target=Target("ratio", ">=", 0.95), check=_check,
        note="bandwidth counts the bytes copied once (read + write traffic is twice that)"),
), base=_cross)
