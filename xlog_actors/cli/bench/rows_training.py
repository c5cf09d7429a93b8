"""The training-loop row: a PyTorch training-style loop (allocate, compute, free; mixed sizes
from 4 KiB to 64 MiB) with torch allocating through a ``DeviceActor``
(:mod:`xlog_actors.interop.torch`), beside the same loop on torch's own caching allocator, in the
same run.

Each half runs in a process of its own (:mod:`.training_loop` says why: torch takes a pluggable
allocator only before its first CUDA allocation, for good). One sample is one round of
``plan.train_steps`` steps, in ns per step; the row reports steps per second. Without torch, or
where torch cannot use CUDA, the row is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .harness import Context, Group, Row, SkipRow, given
from .result import Target

__all__ = ["TRAINING", "run_half"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
_NO_CUDA = 3  # training_loop's exit status when torch cannot use CUDA


def run_half(half: str, steps: int, rounds: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run one half of the loop in a fresh process.

    Args:
        half: ``"device"`` or ``"torch"``.
        steps: steps per round.
        rounds: timed rounds.
        timeout_s: the process's time limit.
    Returns:
        its JSON line: ``ns_per_step`` (one per round) and ``what``.
    Raises:
        SkipRow: torch is absent, or cannot use CUDA here.
        RuntimeError: the process failed (its stderr's tail in the message).
    Thread rule: any thread.
    """
    if importlib.util.find_spec("torch") is None:
        raise SkipRow("torch is not installed (an optional extra: pip install xlog-actors[torch])")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "xlog_actors.cli.bench.training_loop", half, str(steps), str(rounds)],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )
    if proc.returncode == _NO_CUDA:
        raise SkipRow(f"not usable here: {proc.stderr.strip().splitlines()[-1]}")
    if proc.returncode != 0:
        raise RuntimeError(f"training loop ({half}) failed, exit status {proc.returncode}: {proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def _measure(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
    steps, rounds = ctx.plan.train_steps, ctx.plan.train_rounds
    ours = run_half("device", steps, rounds)
    ref = run_half("torch", steps, rounds)
    _WHAT.update(ours=ours["what"], ref=ref["what"])
    return list(ours["ns_per_step"]), list(ref["ns_per_step"])


_WHAT: dict[str, str] = {}


TRAINING = Group("training loop", (
    Row("torch training loop through device",
        lambda f, p: f"{p.train_steps} steps of allocate (torch.empty, 4 KiB-64 MiB, log-uniform) + fill + free of "
        f"the tensor 4 steps before, per round: {_WHAT.get('ours', 'PyTorch through DeviceActor(0)')}",
        given, None, None, lambda p: (p.train_rounds, p.train_steps),
        reference=lambda f, p: f"the same loop on {_WHAT.get('ref', 'PyTorch caching allocator')}",
        kind="throughput", target=Target("ratio", ">=", 0.95), host_skip="CUDA driver only (torch allocates on a GPU)",
        note="steps per second; each half in its own process (torch takes a pluggable allocator only before its "
        "first CUDA allocation), one untimed round first; a round ends with torch.cuda.synchronize()",
        measure=_measure),
))
