"""The training-loop rows. First, what torch's allocations cost through the allocator bridge
without torch: the bridge's exported C functions called through ctypes, as torch's pluggable
allocator calls them, on a block the bridge's cache hands back (every step of a training loop
after its first rounds), beside the Python path a cache miss takes (``DeviceAllocator``); it runs
on the host driver too. Then the loop itself: a PyTorch training-style loop (allocate, compute,
free; mixed sizes from 4 KiB to 64 MiB) with torch allocating through a ``DeviceActor``
(:mod:`xlog_actors.interop.torch`), beside the same loop on torch's own caching allocator, in the
same run. Last, the same loop on RMM's torch allocator (its pool), a peer row beside the same
torch half, skipped with the reason where RMM is not installed or not usable.

Each half of the loop runs in a process of its own (:mod:`.training_loop` says why: torch takes
a pluggable allocator only before its first CUDA allocation, for good). One sample is one round
of ``plan.train_steps`` steps, in ns per step; the row reports steps per second. Without torch,
or where torch cannot use CUDA, the row is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._core import alloc_bridge
from ...actors import DeviceActor
from ...interop.allocator import DeviceAllocator, as_client
from .harness import Context, Group, Op, Row, SkipRow, given
from .plan import SIZE
from .result import Target

__all__ = ["TRAINING", "run_half"]

_HOST_STREAM = 0x51  # a foreign stream handle for the bridge's cache key (the host driver never uses it)

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
_NO_CUDA = 3  # training_loop's exit status when torch cannot use CUDA
_NO_RMM = 4  # and when RMM cannot be set up


def run_half(half: str, steps: int, rounds: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run one half of the loop in a fresh process.

    Args:
        half: ``"device"``, ``"torch"`` or ``"rmm"``.
        steps: steps per round.
        rounds: timed rounds.
        timeout_s: the process's time limit.
    Returns:
        its JSON line: ``ns_per_step`` (one per round) and ``what``.
    Raises:
        SkipRow: torch (or, for ``"rmm"``, RMM) is absent, or cannot be used here.
        RuntimeError: the process failed (its stderr's tail in the message).
    Thread rule: any thread.
    """
    if half == "rmm" and importlib.util.find_spec("rmm") is None:
        raise SkipRow("RMM is not installed (a peer, not a dependency: the rmm-cu13 wheel and its librmm-cu13, "
                      "rapids-logger)")
    if importlib.util.find_spec("torch") is None:
        raise SkipRow("torch is not installed (an optional extra: pip install xlog-actors[torch])")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "xlog_actors.cli.bench.training_loop", half, str(steps), str(rounds)],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )
    if proc.returncode in (_NO_CUDA, _NO_RMM):
        raise SkipRow(f"not usable here: {proc.stderr.strip().splitlines()[-1]}")
    if proc.returncode != 0:
        raise RuntimeError(f"training loop ({half}) failed, exit status {proc.returncode}: {proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def _interleaved(first: str, second: str, steps: int, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two halves in processes in ABBA order (``first``, ``second``, ``second``, ``first``),
    the rounds split between each half's two processes, so that drift of the machine between the
    processes lands on both halves (a GPU host's speed was seen to move by 40% between two runs of
    the same half). Returns each half's JSON, its ``ns_per_step`` the rounds of both processes."""
    a_rounds, b_rounds = (rounds + 1) // 2, rounds // 2
    a1 = run_half(first, steps, a_rounds)  # first: a half that must skip does so before the other runs
    b1 = run_half(second, steps, a_rounds)
    b2 = run_half(second, steps, b_rounds) if b_rounds else {"ns_per_step": []}
    a2 = run_half(first, steps, b_rounds) if b_rounds else {"ns_per_step": []}
    a1["ns_per_step"] = [*a1["ns_per_step"], *a2["ns_per_step"]]
    b1["ns_per_step"] = [*b1["ns_per_step"], *b2["ns_per_step"]]
    return a1, b1


def _measure(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
    ours, ref = _interleaved("device", "torch", ctx.plan.train_steps, ctx.plan.train_rounds)
    _WHAT.update(ours=ours["what"], ref=ref["what"])
    return list(ours["ns_per_step"]), list(ref["ns_per_step"])


def _measure_rmm(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
    peer, ref = _interleaved("rmm", "torch", ctx.plan.train_steps, ctx.plan.train_rounds)
    _WHAT.update(rmm=peer["what"], ref=ref["what"])
    return list(peer["ns_per_step"]), list(ref["ns_per_step"])


_WHAT: dict[str, str] = {}


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
        f"the tensor 4 steps before, per round: {_WHAT.get('ours', 'PyTorch through DeviceActor(0)')}",
        given, None, None, lambda p: (p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('ref', 'PyTorch caching allocator')}",
        kind="throughput", target=Target("ratio", ">=", 1.1), host_skip="CUDA driver only (torch allocates on a GPU)",
        note="steps per second; each half in its own process (torch takes a pluggable allocator only before its "
        "first CUDA allocation), one untimed round first; a round ends with torch.cuda.synchronize()",
        measure=_measure),
    Row("torch training loop through RMM",
        lambda f, p: f"the same {p.train_steps}-step rounds: {_WHAT.get('rmm', 'PyTorch through RMM torch allocator')}",
        given, None, None, lambda p: (p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('ref', 'PyTorch caching allocator')}",
        kind="throughput", host_skip="CUDA driver only (torch allocates on a GPU)",
        note="informational: a peer (RMM's torch allocator over its pool) beside the same torch half as the row "
        "above; each half in its own process; skipped with the reason where RMM is not installed",
        measure=_measure_rmm),
))
