"""The training-loop rows. First, what torch's allocations cost through the allocator bridge
without torch: the bridge's exported C functions called through ctypes, as torch's pluggable
allocator calls them, on a block the bridge's cache hands back (every step of a training loop
after its first rounds), beside the Python path a cache miss takes (``DeviceAllocator``); it runs
on the host driver too. Then the loop itself: a PyTorch training-style loop (allocate, compute,
free; mixed sizes from 4 KiB to 64 MiB) with torch allocating through a ``DeviceActor``
(:mod:`xlog_actors.interop.torch`), beside the same loop on torch's own caching allocator; the
same loop through the null allocator, the ceiling of any allocator torch can load, beside its
own torch half; and through RMM's torch allocator (its pool), a peer row, skipped with the
reason where RMM is not installed or not usable.

Each half of the loop runs in processes of its own (:mod:`.training_loop` says why), timed by
:func:`.training_session.session`: the processes of a row's two halves are all alive at once, their timed threads
pinned to one CPU, and take their rounds in turns. One sample is one round of
``plan.train_steps`` steps, in ns per step; the row reports steps per second. Without torch, or
where torch cannot use CUDA, the rows are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..._core import alloc_bridge
from ...actors import DeviceActor
from ...interop.allocator import DeviceAllocator, as_client
from .harness import Context, Group, Op, Row, SkipRow, given
from .plan import SIZE, Plan
from .result import Target
from .training_session import session

__all__ = ["TRAINING"]

_HOST_STREAM = 0x51  # a foreign stream handle for the bridge's cache key (the host driver never uses it)


def _pair(ours: str) -> Callable[[Context, Context], tuple[list[float], list[float]]]:
    """A row's measure: ``ours`` beside torch's own allocator, in one session."""

    def measure(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
        done = session((ours, "torch"), ctx.plan.train_steps, ctx.plan.train_rounds)
        _WHAT.update({ours: done[ours]["what"], "torch": done["torch"]["what"]})
        return list(done[ours]["ns_per_step"]), list(done["torch"]["ns_per_step"])

    return measure


_WHAT: dict[str, str] = {}  # each half's "what" from the last session, for the rows' texts

_SESSION_NOTE = (
    "steps per second; each half in processes of its own (torch takes a pluggable allocator only before its first "
    "CUDA allocation), two per half, all alive at once with their timed threads pinned to one CPU, taking their "
    "rounds in turns (the GPU machines' CPUs differ by up to 1.5 times in speed, and a process keeps its CPU); two "
    "untimed rounds first; a round ends with torch.cuda.synchronize()"
)


def _loop_row(name: str, half: str, measures: Callable[[Plan], str], *, note: str,
              target: Target | None = None) -> Row:
    """A row of the loop through ``half`` beside torch's own allocator, timed by one session
    (:func:`_pair`); a sample is a round, two processes' rounds per half."""
    return Row(name, lambda f, p: measures(p), given, None, None, lambda p: (2 * p.train_rounds, p.train_steps),
               reference=lambda f, p: f"the same loop on {_WHAT.get('torch', 'PyTorch caching allocator')}",
               kind="throughput", target=target, host_skip="CUDA driver only (torch allocates on a GPU)", note=note,
               measure=_pair(half))


@dataclass
class _Bridge:
    allocator: DeviceAllocator
    alloc: Any  # the exported functions, typed as torch declares them
    free: Any
    stream: int  # the foreign stream handle the pairs name


@contextlib.contextmanager
def _bridge(ctx: Context) -> Iterator[_Bridge]:
    if alloc_bridge.registered(0) is not None:
        raise SkipRow("CUDA device 0 already routes its allocations through the bridge in this process")
    device = DeviceActor.start(0, ctx.driver)
    # On CUDA the allocator orders the foreign stream around each block (events on it): it must
    # be a real stream (an invented handle crashed the process on an H200).
    foreign = ctx.driver.create_stream(0) if ctx.driver.kind == "cuda" else None
    try:
        allocator = DeviceAllocator(as_client(device), "bench")
        lib = ctypes.CDLL(alloc_bridge.library_path())
        alloc = lib[alloc_bridge.ALLOC_OR_NULL_SYMBOL]
        alloc.restype = ctypes.c_void_p
        alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        free = lib[alloc_bridge.FREE_SYMBOL]
        free.restype = None
        free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        alloc_bridge.register(0, allocator)
        try:
            yield _Bridge(allocator, alloc, free, _HOST_STREAM if foreign is None else int(foreign.handle))
        finally:
            alloc_bridge.unregister(0, allocator)
            allocator.close()
    finally:
        device.stop()
        if foreign is not None:
            foreign.synchronize()
            foreign.close()


def _cache_hit_pair(f: _Bridge) -> Op:
    alloc, free, stream = f.alloc, f.free, f.stream

    def ours(n: int) -> None:
        for _ in range(n):
            free(alloc(SIZE, 0, stream), SIZE, 0, stream)

    return ours


def _python_pair(f: _Bridge) -> Op:
    allocate, free, stream = f.allocator.allocate, f.allocator.free, f.stream

    def ref(n: int) -> None:
        for _ in range(n):
            free(allocate(SIZE, stream), SIZE, stream)

    return ref


def _all_hits(f: _Bridge) -> None:
    stats = alloc_bridge.cache_stats(0)
    if stats["misses"] != 1 or int(stats["hits"] or 0) < 1:
        raise RuntimeError(f"the bridge's cache did not serve the timed pairs: {stats}")


TRAINING = Group("training loop", (
    Row("torch allocator bridge, cache hit",
        f"xlog_actors_alloc_or_null({SIZE // 1024} KiB) + xlog_actors_free on one stream, called through ctypes as "
        "torch's pluggable allocator calls them: after the first, every block comes from the bridge's cache",
        _bridge, _cache_hit_pair, _python_pair, lambda p: p.client,
        reference=f"DeviceAllocator.allocate({SIZE // 1024} KiB) + free called from Python: what a cache miss runs",
        check=_all_hits,
        note="informational: the allocator's part of a training step once torch's sizes are cached; the ours side "
        "also pays ctypes' call and GIL release (about 0.1 µs a call), which torch's C++ caller does not"),
    _loop_row("torch training loop through device", "device",
              lambda p: f"{p.train_steps} steps of allocate (torch.empty, 4 KiB-64 MiB, log-uniform) + fill + free of "
              f"the tensor 4 steps before, per round: {_WHAT.get('device', 'PyTorch through DeviceActor(0)')}",
              note=_SESSION_NOTE, target=Target("ratio", ">=", 1.1)),
    _loop_row("torch training loop through the null allocator", "null",
              lambda p: f"the same {p.train_steps}-step rounds: "
              f"{_WHAT.get('null', 'PyTorch through the null allocator')}",
              note="informational: the ceiling of any allocator behind torch's pluggable interface (a stack of "
              "freed blocks per size class, no lock, no bookkeeping), beside its own torch half; " + _SESSION_NOTE),
    _loop_row("torch training loop through RMM", "rmm",
              lambda p: f"the same {p.train_steps}-step rounds: "
              f"{_WHAT.get('rmm', 'PyTorch through RMM torch allocator')}",
              note="informational: a peer (RMM's torch allocator over its pool) beside its own torch half; skipped "
              "with the reason where RMM is not installed; " + _SESSION_NOTE),
))
