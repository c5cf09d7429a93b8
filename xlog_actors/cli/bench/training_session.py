"""The training-loop rows' halves, timed side by side: :func:`session` keeps the processes of
the halves (:mod:`.training_loop`, one half each) alive at once, their timed threads pinned to one
CPU, and has them take their rounds in turns, so that every round of one half has the others'
beside it. :mod:`.training_loop` says why a half is a process and why one CPU.

Invariants: every process a session starts has ended (or been killed) when it returns or
raises; every read of a half's answer has a deadline.

Thread rule: the bench's thread.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from .harness import SkipRow
from .training_loop import EXIT_NO_CUDA, EXIT_NO_RMM

__all__ = ["run_half", "session"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
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
        argv = [sys.executable, *_PROGRAM, half, str(steps), *([] if cpu is None else [str(cpu)])]
        self.half = half
        self._timeout_s = timeout_s
        self._buffer = b""
        # A file, not a pipe, which could fill and stall the half; closed by close().
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)

    def _fail(self, why: str) -> NoReturn:
        """Kill the process and raise: SkipRow for the exit statuses that mean "not here"."""
        if self._proc.poll() is None:
            self._proc.kill()
        status = self._proc.wait()
        self._err.seek(0)
        err = self._err.read().decode("utf-8", "replace")
        self.close()
        if status in (EXIT_NO_CUDA, EXIT_NO_RMM) and err.strip():
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
        try:
            status = self._proc.wait(timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            self._fail(f"did not exit in {self._timeout_s:.0f} s after its end")
        if status != 0 or not doc.get("done"):
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
