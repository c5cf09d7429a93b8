"""The isolated device rows: ``Allocate`` asked of a device in its own process, beside a
bare pykka ask; and the time from a sticky error in the child to the first ``Allocate`` served
by its replacement, with where that time goes."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pykka

from ...actors import Allocate, DeviceActor, Rebuild, Supervisor
from ...actors.isolated import ChildFault, ChildTimeline
from ...errors import GpuRefStale
from .harness import Context, Group, Op, Row, given
from .plan import SIZE, Plan
from .result import Target
from .rows_actors import Echo

__all__ = ["ISOLATED"]


@dataclass
class _Isolated:
    device: pykka.ActorRef[Any]
    local: pykka.ActorRef[Any]
    echo: pykka.ActorRef[Any]
    restarts: int
    device_kind: str
    phases: dict[str, list[float]] = field(default_factory=dict)


@contextlib.contextmanager
def _isolated(ctx: Context) -> Iterator[_Isolated]:
    restarts = 3 if ctx.plan.min_samples <= 5 else 10
    device = DeviceActor.start(0, ctx.driver.kind, supervisor=Supervisor(max_restarts=restarts + 2), isolate=True)
    local = DeviceActor.start(0, ctx.driver)
    echo = Echo.start()
    try:
        yield _Isolated(device, local, echo, restarts, ctx.driver.kind)
    finally:
        echo.stop()
        local.stop()
        device.stop()


def _allocate(f: _Isolated) -> Op:
    msg = Allocate(SIZE)
    ask = f.device.ask
    held: list[Any] = [None]

    def ours(n: int) -> None:
        for _ in range(n):
            held[0] = None  # its free rides along with the next ask
            held[0] = ask(msg)

    return ours


def _bare_ask(f: _Isolated) -> Op:
    msg = Allocate(SIZE)
    ask = f.echo.ask

    def bare(n: int) -> None:
        for _ in range(n):
            ask(msg)

    return bare


#: The longest a restart row waits for one answer (a restart takes well under a second): past it
#: the row fails with the message instead of waiting for a restart that is not coming.
ANSWER_TIMEOUT_S = 60.0


def _ask(ref: pykka.ActorRef[Any], message: Any) -> Any:
    """``ref.ask(message)`` within :data:`ANSWER_TIMEOUT_S`; ``RuntimeError`` naming the message
    past it."""
    try:
        return ref.ask(message, timeout=ANSWER_TIMEOUT_S)
    except pykka.Timeout:
        raise RuntimeError(
            f"no answer to {type(message).__name__} within {ANSWER_TIMEOUT_S:.0f} s: the device did not restart"
        ) from None


def _restarts(f: _Isolated, ctx: Context) -> tuple[list[float], list[float]]:
    """Sticky error to first Allocate on the new generation, ``f.restarts`` times (a booted
    reserve waiting each time, as in service); the reference is an in-process ``Rebuild``."""
    ours: list[float] = []
    ref: list[float] = []
    phases: dict[str, list[float]] = {"detect": [], "exit seen": [], "spawn+import": [], "driver open": [],
                                      "actor start": [], "first allocate": []}
    # The host driver plants its emulated sticky error; on CUDA a real illegal-address kernel.
    fault = ChildFault("illegal_address" if f.device_kind == "cuda" else "sticky")
    for _ in range(f.restarts):
        time.sleep(1.0)  # the reserve child boots (spawn + import) before the next fault
        t0 = time.monotonic()
        with contextlib.suppress(GpuRefStale):
            _ask(f.device, fault)
        _ask(f.device, Allocate(SIZE))
        t1 = time.monotonic()
        line: dict[str, Any] = _ask(f.device, ChildTimeline())
        # From the parent seeing the sticky error (the dying child's report) to the first
        # allocation served by its replacement; the detection before it is the breakdown's.
        ours.append((t1 - line["previous_poisoned"]) * 1e9)
        start = max(line["configured"], line["spawned"])
        phases["detect"].append(line["previous_poisoned"] - t0)
        phases["exit seen"].append(line["previous_exit_seen"] - line["previous_poisoned"])
        phases["spawn+import"].append(max(0.0, line["booted"] - line["spawned"]) if line["booted"] > start else 0.0)
        phases["driver open"].append(line["driver_open"] - max(line["configured"], line["booted"]))
        phases["actor start"].append(line["ready"] - line["driver_open"])
        phases["first allocate"].append(t1 - line["ready"])
        r0 = time.perf_counter_ns()
        _ask(f.local, Rebuild("bench"))
        ref.append(float(time.perf_counter_ns() - r0))
    f.phases = phases
    return ours, ref


def _breakdown(f: _Isolated, plan: Plan) -> str:
    parts = ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms" for name, v in f.phases.items() if v)
    return (f"median of {f.restarts} runs; the hot spare takes over (its spawn, import and driver open paid "
            f"before the fault, 0 here when it was ready; the figure starts when the parent sees the error, "
            f"after 'detect'). Breakdown: {parts}")


ISOLATED = Group("isolated device", (
    Row("isolated Allocate", "isolated device.ask(Allocate(4 KiB)) from the parent: a round trip through the child "
        "process; dropping the GpuRef sends its free", given,
        _allocate, _bare_ask, lambda p: p.ask, reference="bare pykka ask round trip to a trivial actor",
        target=Target("ratio", "<=", 1.5)),
    Row("sticky error to first Allocate", "a sticky error in the child (an illegal-address kernel on CUDA, the "
        "emulated one on the host), from the parent seeing it to the first Allocate served by the replacement "
        "(generation + 1; the hot spare takes over)", given, None,
        None, lambda p: (1, 1), measure=_restarts,
        reference="in-process Rebuild round trip (context only)", target=Target("median", "<=", 1e5),
        note=_breakdown),
), base=_isolated)
