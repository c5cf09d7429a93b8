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
:func:`session`: the processes of a row's two halves are all alive at once, their timed threads
pinned to one CPU, and take their rounds in turns. One sample is one round of
``plan.train_steps`` steps, in ns per step; the row reports steps per second. Without torch, or
where torch cannot use CUDA, the rows are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ..._core import alloc_bridge
from ...actors import DeviceActor
from ...interop.allocator import DeviceAllocator, as_client
from .harness import Context, Group, Op, Row, SkipRow, given
from .plan import SIZE
from .result import Target

__all__ = ["TRAINING", "run_half", "session"]

_HOST_STREAM = 0x51  # a foreign stream handle for the bridge's cache key (the host driver never uses it)

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
_NO_CUDA = 3  # training_loop's exit status when torch cannot use CUDA
_NO_RMM = 4  # and when RMM cannot be set up
_PROGRAM = ("-m", "xlog_actors.cli.bench.training_loop")  # a half's program, after the interpreter


class _Half:
    """One half's process (:mod:`.training_loop`), alive until :meth:`stop`: set up and pinned
    when made, then timed a round at a time. Every read has a deadline: a half that stops
    answering is killed and raises.

    Thread rule: the bench's thread.
    """

    def __init__(self, half: str, steps: int, cpu: int | None, timeout_s: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, *_PROGRAM, half, str(steps)]
        self.half = half
        self._timeout_s = timeout_s
        self._buffer = b""
        # A file, not a pipe, which could fill and stall the half; closed by close().
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen([*argv, *([] if cpu is None else [str(cpu)])], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._err, env=env)

    def _fail(self, why: str) -> NoReturn:
        """Kill the process and raise: SkipRow for the exit statuses that mean "not here"."""
        if self._proc.poll() is None:
            self._proc.kill()
        status = self._proc.wait()
        self._err.seek(0)
        err = self._err.read().decode("utf-8", "replace")
        self.close()
        if status in (_NO_CUDA, _NO_RMM) and err.strip():
            raise SkipRow(f"not usable here: {err.strip().splitlines()[-1]}")
        raise RuntimeError(f"training loop ({self.half}) {why}, exit status {status}: {err[-2000:]}")

    def _line(self) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._fail(f"gave no answer in {self._timeout_s:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                self._fail("ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _send(self, command: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(command.encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("ended")

    def ready(self) -> None:
        """Wait for the half's set-up and warm-up rounds.

        Raises:
            SkipRow: torch (or RMM) cannot be used here.
            RuntimeError: the half failed or gave no answer in time.
        """
        doc = json.loads(self._line())
        if not doc.get("ready"):
            self._fail(f"said {doc!r} instead of ready")

    def round(self) -> float:
        """One timed round: its nanoseconds per step."""
        self._send("round")
        return float(self._line())

    def stop(self) -> str:
        """End the half, after its own checks; what it measured (its ``what``)."""
        self._send("stop")
        doc = json.loads(self._line())
        if self._proc.wait(timeout=self._timeout_s) != 0 or not doc.get("done"):
            self._fail("failed its end")
        self.close()
        return str(doc["what"])

    def close(self) -> None:
        """Kill the process if it still runs, and let its pipes go. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._err.close()


def _cpu() -> int | None:
    """The CPU every half's timed thread is pinned to: the first this process may run on (None
    where threads cannot be pinned)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return min(os.sched_getaffinity(0))


def _check_available(half: str) -> None:
    if half == "rmm" and importlib.util.find_spec("rmm") is None:
        raise SkipRow("RMM is not installed (a peer, not a dependency: the rmm-cu13 wheel and its librmm-cu13, "
                      "rapids-logger)")
    if importlib.util.find_spec("torch") is None:
        raise SkipRow("torch is not installed (an optional extra: pip install xlog-actors[torch])")


def session(halves: tuple[str, ...], steps: int, rounds: int, processes: int = 2,
            timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
    """Time ``halves`` side by side: ``processes`` processes of each, all alive at once and
    pinned to one CPU, take ``rounds`` rounds each, in turns (every process once per turn, the
    order reversed every other turn), so every half's rounds run beside the others'.

    Args:
        halves: the halves (:data:`.training_loop.HALVES`).
        steps: steps per round.
        rounds: timed rounds per process.
        processes: processes per half.
        timeout_s: the bound on each answer of a half (its set-up included).
    Returns:
        per half: ``ns_per_step`` (its ``processes * rounds`` rounds) and ``what``.
    Raises:
        SkipRow: torch (or, for ``"rmm"``, RMM) is absent, or cannot be used here.
        RuntimeError: a half failed (its stderr's tail in the message).
    Thread rule: the bench's thread.
    """
    for half in halves:
        _check_available(half)
    cpu = _cpu()
    procs: list[_Half] = []
    try:
        for _ in range(processes):
            procs += [_Half(half, steps, cpu, timeout_s) for half in halves]
        for proc in procs:
            proc.ready()
        samples: dict[str, list[float]] = {half: [] for half in halves}
        for turn in range(rounds):
            for proc in procs if turn % 2 == 0 else procs[::-1]:
                samples[proc.half].append(proc.round())
        whats = {proc.half: proc.stop() for proc in procs}
    finally:
        for proc in procs:
            proc.close()
    return {half: {"ns_per_step": samples[half], "what": whats[half]} for half in halves}


def run_half(half: str, steps: int, rounds: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run one half alone, in one process.

    Args:
        half: one of :data:`.training_loop.HALVES`.
        steps: steps per round.
        rounds: timed rounds.
        timeout_s: the bound on each answer of the half.
    Returns:
        ``ns_per_step`` (one per round) and ``what``.
    Raises:
        SkipRow: torch (or, for ``"rmm"``, RMM) is absent, or cannot be used here.
        RuntimeError: the half failed.
    Thread rule: the bench's thread.
    """
    return session((half,), steps, rounds, processes=1, timeout_s=timeout_s)[half]


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
    Row("torch training loop through device",
        lambda f, p: f"{p.train_steps} steps of allocate (torch.empty, 4 KiB-64 MiB, log-uniform) + fill + free of "
        f"the tensor 4 steps before, per round: {_WHAT.get('device', 'PyTorch through DeviceActor(0)')}",
        given, None, None, lambda p: (2 * p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('torch', 'PyTorch caching allocator')}",
        kind="throughput", target=Target("ratio", ">=", 1.1), host_skip="CUDA driver only (torch allocates on a GPU)",
        note=_SESSION_NOTE, measure=_pair("device")),
    Row("torch training loop through the null allocator",
        lambda f, p: f"the same {p.train_steps}-step rounds: {_WHAT.get('null', 'PyTorch through the null allocator')}",
        given, None, None, lambda p: (2 * p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('torch', 'PyTorch caching allocator')}",
        kind="throughput", host_skip="CUDA driver only (torch allocates on a GPU)",
        note="informational: the ceiling of any allocator behind torch's pluggable interface (a stack of freed "
        "blocks per size class, no lock, no bookkeeping), beside its own torch half; " + _SESSION_NOTE,
        measure=_pair("null")),
    Row("torch training loop through RMM",
        lambda f, p: f"the same {p.train_steps}-step rounds: {_WHAT.get('rmm', 'PyTorch through RMM torch allocator')}",
        given, None, None, lambda p: (2 * p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('torch', 'PyTorch caching allocator')}",
        kind="throughput", host_skip="CUDA driver only (torch allocates on a GPU)",
        note="informational: a peer (RMM's torch allocator over its pool) beside its own torch half; skipped with "
        "the reason where RMM is not installed; " + _SESSION_NOTE,
        measure=_pair("rmm")),
))
