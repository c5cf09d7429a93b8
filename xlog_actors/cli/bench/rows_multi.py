"""The rows of several devices: the raw pipeline and the demo on every device at once, each beside
N times the same on one device, and a copy between two isolated devices beside
``cuMemcpyPeerAsync`` in one process. Each needs two devices or more and is skipped with the
reason on fewer (the host driver's bench has one).

* ``raw pipeline on N GPUs at once / N x one GPU <size>`` (informational): the raw three-stream
  pipeline (:mod:`..raw_pipeline`, no actors) on every device of the driver at once, one worker
  process per device placed as the demo's are (on CUDA bound to its GPU's NUMA node), all started
  together behind a start gate once each has made its buffers; the reference is the same on
  device 0 alone, in one such worker, N times over. It is what the host lets N devices move at
  once: where the devices share the host's memory and PCIe bandwidth, no program reaches N times
  one device, and this row says how far any can. A sample is one whole run of each; figures are
  per batch.
* ``demo on N GPUs / N x one GPU <size>`` and ``demo graph on N GPUs / N x one GPU <size>``:
  :func:`..multi_pipeline.run_on_devices` in its default placement (a worker process per device)
  on every device of the driver, in actor mode and in graph mode; the reference is the
  same job on device 0 alone, in one worker process placed as each of the N is (on CUDA bound to
  its GPU's NUMA node), N times over: N devices that scale perfectly move N times its bytes in its
  time. A sample is one whole run of
  each; figures are per batch (the batch's input bytes over its share of the time). Where the raw
  row of the same size ran before it in the run, the note gives this row's aggregate over the raw
  pipeline's on N devices at once: how close the runtime comes to what the host allows.
* ``cross-process peer copy 256 MiB``: a ``CopyDeviceToDevice`` asked of the ``CopyActor`` of
  isolated device 1 from a handle of isolated device 0 (each in its own process, IPC-capable
  pools): the export, the interprocess event, CUDA IPC and ``cuMemcpyPeerAsync`` in device 1's
  process, replying once the copy landed; the reference is ``cuMemcpyPeerAsync`` between the same
  two devices in this process, each copy synchronized (the same landed-before-reply contract).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Final

import pykka

from ...actors import Allocate, CopyActor, CopyDeviceToDevice, DeviceActor, Fill
from ...driver.host import HostDriver
from ...driver.open import open_driver
from ..batches import BatchData
from ..graph_pipeline import job_for
from ..multi_pipeline import DEFAULT_PLACEMENT, READY_TIMEOUT_S, run_on_devices
from ..pipeline import PipelineConfig
from ..raw_pipeline import raw_pipeline
from .harness import Context, Group, Op, Row, SkipRow, given, no_gc
from .plan import MIB, Plan, size_text
from .result import RowResult, Target

__all__ = ["MULTI", "raw_at_once"]

DEPTH = 8
PEER_BYTES = 256 * MIB

#: How long a raw worker may run once started, in seconds (the longest plan takes a few).
RAW_RUN_TIMEOUT_S: Final = 300.0


def _need_two(ctx: Context) -> int:
    count = ctx.driver.device_count()
    if count < 2:
        raise SkipRow(f"needs 2 devices or more; the {ctx.driver.kind} driver has {count}")
    return count


def _demo_measure(size: int, last: list[list[float]],
                  graph: bool) -> Callable[[Any, Context], tuple[list[float], list[float]]]:
    """The demo row's measure (``graph``: in graph mode); it leaves its own samples in ``last``
    for the row's note."""

    def measure(_fixture: Any, ctx: Context) -> tuple[list[float], list[float]]:
        count = _need_two(ctx)
        nbytes, batches = ctx.plan.pipe_sizes[size]
        cfg = PipelineConfig(batches=batches, batch_bytes=nbytes, depth=DEPTH, graph=graph)
        warm = job_for(cfg)(ctx.driver, replace(cfg, batches=min(4 * DEPTH, batches)))
        if not warm.ok:
            raise RuntimeError(f"one-device warm-up failed verification: {warm.errors[:3]}")
        ours: list[float] = []
        ref: list[float] = []
        with no_gc():
            for _ in range(max(1, ctx.plan.pipe_rounds)):
                multi = run_on_devices(ctx.driver.kind, count, cfg, DEFAULT_PLACEMENT)
                if not multi.ok:
                    failed = [(r.ordinal, r.error or (r.result.errors[:2] if r.result else None)) for r in multi.runs]
                    raise RuntimeError(f"demo on {count} devices failed: {failed}")
                # The reference runs as each device of the run does: a worker process of its own,
                # placed (and on CUDA bound to its GPU's NUMA node) the same way.
                one = run_on_devices(ctx.driver.kind, 1, cfg, DEFAULT_PLACEMENT)
                if not one.ok:
                    raise RuntimeError(f"one-device demo failed: {[r.error for r in one.runs]}")
                ours.append(multi.seconds * 1e9 / (count * batches))
                ref.append(one.seconds * 1e9 / (count * batches))  # N devices: N times the batches, same time
        last[:] = [ours]
        return ours, ref

    return measure


def _demo_note(ctx: Context, label: str, nbytes: int, last: list[list[float]]) -> str:
    """The demo row's note: its figures' basis, and its aggregate over the raw pipeline's on N
    devices at once when the raw row of the same size ran earlier in this run (no second
    measurement: the two rows' medians)."""
    note = ("figures per batch; one sample is one whole run of each side, setup (processes, inputs, buffers, "
            "kernels) excluded")
    raw_name = _raw_name(label)
    raw = next((r for r in ctx.results if isinstance(r, RowResult) and r.name == raw_name), None)
    if raw is None or not last or raw.median <= 0:
        return note + f"; `{raw_name}` did not run before it, so no ratio to the raw pipeline at once"
    ours = nbytes / statistics.median(last[0])  # bytes per ns == GB/s
    return (note + f"; ours / the raw pipeline on N GPUs at once (`{raw_name}`, this run): "
            f"{ours / raw.median:.3f}x ({ours:.3g} / {raw.median:.3g} GB/s in all)")


def _demo_row(size: int, label: str, graph: bool = False) -> Row:
    last: list[list[float]] = []
    mode = "in graph mode (xlog-actors demo --graph)" if graph else "in actor mode"
    return Row(
        f"demo {'graph ' if graph else ''}on N GPUs / N x one GPU {label}",
        lambda f, p: f"the demo's job {mode} on every device at once ({DEFAULT_PLACEMENT}: a worker process per "
        f"device), {p.pipe_sizes[size][1]} batches of {size_text(p.pipe_sizes[size][0])} per device, {DEPTH} in "
        "flight each, every batch verified; aggregate throughput from the first start to the last end",
        given, None, None, lambda p: (p.pipe_rounds, 1),
        reference="N x the same job on device 0 alone, in a worker process placed as each of the N, N the device count",
        kind="rate",
        bytes_per_op=lambda p: p.pipe_sizes[size][0],
        target=Target("ratio", ">=", 0.9),
        note=lambda ctx, p: _demo_note(ctx, label, p.pipe_sizes[size][0], last),
        measure=_demo_measure(size, last, graph),
    )


# -- the raw pipeline on every device at once -----------------------------------------------------

def _raw_name(label: str) -> str:
    return f"raw pipeline on N GPUs at once / N x one GPU {label}"


def _raw_worker(conn: Connection, kind: str, count: int, ordinal: int, nbytes: int, batches: int,
                depth: int) -> None:
    """A device's worker process of the raw rows: open the driver, warm the raw pipeline up on
    ``ordinal``, run it with a start gate that says ``ready`` and waits for ``go``, and send
    ``("done", started, seconds)``, or ``("failed", why)``."""
    if kind == "cuda":
        # Before anything is allocated, as the demo's workers do (multi_pipeline says why).
        from ...driver.cuda.topology import bind_to_device

        bind_to_device(ordinal)
    driver: Any = None
    started = [0.0]

    def gate() -> None:
        conn.send(("ready",))
        if conn.recv() != "go":
            raise RuntimeError("the run was called off before it started")
        started[0] = time.perf_counter()

    try:
        driver = HostDriver(device_count=count) if kind == "host" else open_driver("cuda")
        data = BatchData(depth + 1, nbytes)
        raw_pipeline(driver, data, min(4 * depth, batches), depth, ordinal=ordinal)  # compiled, warmed
        result = raw_pipeline(driver, data, batches, depth, ordinal=ordinal, start_gate=gate)
        conn.send(("done", started[0], result.seconds))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        with contextlib.suppress(OSError, ValueError):
            conn.send(("failed", f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
    finally:
        conn.close()
        if driver is not None:
            with contextlib.suppress(BaseException):
                driver.close()


def _frame(conn: Connection, proc: Any, ordinal: int, want: str, timeout_s: float) -> tuple[Any, ...]:
    """The next frame of a raw worker, which must be ``want``; RuntimeError naming the device
    when it failed, ended or said nothing in ``timeout_s``."""
    try:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"raw pipeline on device {ordinal}: no {want!r} from its worker in {timeout_s:g} s")
        frame: tuple[Any, ...] = conn.recv()
    except (EOFError, OSError):
        proc.join(5.0)
        raise RuntimeError(
            f"raw pipeline on device {ordinal}: its worker ended (exit status {proc.exitcode})"
        ) from None
    if frame[0] == "failed":
        raise RuntimeError(f"raw pipeline on device {ordinal}: {frame[1]}")
    if frame[0] != want:
        raise RuntimeError(f"raw pipeline on device {ordinal}: expected {want!r}, got {frame[0]!r}")
    return frame


def raw_at_once(kind: str, devices: int, nbytes: int, batches: int, depth: int = DEPTH) -> float:
    """Run the raw pipeline on devices ``0 .. devices - 1`` at once, one worker process each.

    Every worker makes its buffers, streams and kernel and warms up, then waits at its start
    gate; once all are there they start together.

    Args:
        kind: ``"cuda"`` or ``"host"`` (each host worker emulates ``devices`` devices).
        devices: how many devices, at least 1.
        nbytes: bytes per batch, a positive multiple of 4.
        batches: batches per device.
        depth: batches in flight per device.
    Returns:
        The seconds from the first device's start to the last device's end.
    Raises:
        RuntimeError: a worker failed, ended or went mute (the others are called off).
    Thread rule: the bench's thread; it blocks until every worker is done.
    """
    spawn = multiprocessing.get_context("spawn")
    workers: list[tuple[Any, Connection]] = []
    try:
        for k in range(devices):
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=_raw_worker, args=(theirs, kind, devices, k, nbytes, batches, depth),
                                 name=f"xlog-raw-device-{k}", daemon=True)
            proc.start()
            theirs.close()
            workers.append((proc, ours))
        for k, (proc, conn) in enumerate(workers):
            _frame(conn, proc, k, "ready", READY_TIMEOUT_S)
        for _, conn in workers:
            conn.send("go")
        spans = [_frame(conn, proc, k, "done", RAW_RUN_TIMEOUT_S)[1:] for k, (proc, conn) in enumerate(workers)]
        return float(max(start + seconds for start, seconds in spans) - min(start for start, _ in spans))
    finally:
        for _, conn in workers:
            conn.close()  # a worker still at its gate reads the end and stops
        for proc, _ in workers:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


def _raw_measure(size: int) -> Callable[[Any, Context], tuple[list[float], list[float]]]:
    def measure(_fixture: Any, ctx: Context) -> tuple[list[float], list[float]]:
        count = _need_two(ctx)
        nbytes, batches = ctx.plan.pipe_sizes[size]
        ours: list[float] = []
        ref: list[float] = []
        with no_gc():
            for _ in range(max(1, ctx.plan.pipe_rounds)):
                together = raw_at_once(ctx.driver.kind, count, nbytes, batches)
                alone = raw_at_once(ctx.driver.kind, 1, nbytes, batches)
                ours.append(together * 1e9 / (count * batches))
                ref.append(alone * 1e9 / (count * batches))  # N devices: N times the batches, same time
        return ours, ref

    return measure


def _raw_row(size: int, label: str) -> Row:
    return Row(
        _raw_name(label),
        lambda f, p: f"the raw three-stream pipeline (no actors) on every device at once, a worker process per "
        f"device started together behind a start gate, {p.pipe_sizes[size][1]} batches of "
        f"{size_text(p.pipe_sizes[size][0])} per device, {DEPTH} in flight each; aggregate throughput from the "
        "first start to the last end",
        given, None, None, lambda p: (p.pipe_rounds, 1),
        reference="N x the same raw pipeline on device 0 alone, in a worker process placed as each of the N, N the "
        "device count",
        kind="rate",
        bytes_per_op=lambda p: p.pipe_sizes[size][0],
        note="informational: what the host lets N devices move at once, the ceiling of the demo row of the same size "
        "(whose note gives its ratio to this one); figures per batch; one sample is one whole run of each side, "
        "setup (processes, inputs, buffers, kernels, a warm-up run) excluded",
        measure=_raw_measure(size),
    )


@dataclass
class _Pair:
    copy: pykka.ActorRef[Any]
    src: Any
    dst: Any
    raw: Op


@contextlib.contextmanager
def _pair(ctx: Context) -> Iterator[_Pair | None]:
    if ctx.driver.device_count() < 2:
        yield None
        return
    driver, kind = ctx.driver, ctx.driver.kind
    actors: list[pykka.ActorRef[Any]] = []
    raw_src = raw_dst = None
    stream = None
    try:
        for k in (0, 1):
            actors.append(DeviceActor.start(k, kind, isolate=True, hot_spare=False, ipc_pool=True))
        devices = list(actors)
        copy = CopyActor.start(devices[1])
        filler = CopyActor.start(devices[0])
        actors += [copy, filler]
        src: Any = devices[0].ask(Allocate(PEER_BYTES))
        dst: Any = devices[1].ask(Allocate(PEER_BYTES))
        filler.ask(Fill(src, 5))
        raw_src, raw_dst = driver.alloc(0, PEER_BYTES), driver.alloc(1, PEER_BYTES)
        stream = driver.create_stream(1)
        copy_peer, sync = driver.copy_peer, stream.synchronize

        def raw(n: int) -> None:
            for _ in range(n):
                copy_peer(1, raw_dst, 0, raw_src, PEER_BYTES, stream)
                sync()

        yield _Pair(copy, src, dst, raw)
    finally:
        if stream is not None:
            stream.synchronize()
            stream.close()
        if raw_src is not None:
            driver.free(0, raw_src)
        if raw_dst is not None:
            driver.free(1, raw_dst)
        for ref in reversed(actors):  # the copy actors first, then the devices
            ref.stop()


def _cross_copy(f: _Pair | None) -> Op:
    if f is None:
        raise SkipRow("needs 2 devices or more; this driver has 1")
    ask, msg = f.copy.ask, CopyDeviceToDevice(f.src, f.dst)

    def ours(n: int) -> None:
        for _ in range(n):
            ask(msg)

    return ours


def _raw_peer(f: _Pair | None) -> Op:
    if f is None:
        raise SkipRow("needs 2 devices or more; this driver has 1")
    return f.raw


def _peer_spec(p: Plan) -> tuple[int, int]:
    return (p.d2d_samples, 1)


# The raw rows run first: each demo row's note reads the raw row of its size.
MULTI = Group("several devices", (
    _raw_row(1, "1 MiB"),
    _raw_row(2, "16 MiB"),
    _demo_row(1, "1 MiB"),
    _demo_row(2, "16 MiB"),
    _demo_row(1, "1 MiB", graph=True),
    _demo_row(2, "16 MiB", graph=True),
    Row("cross-process peer copy 256 MiB",
        "CopyDeviceToDevice(256 MiB) asked of isolated device 1's CopyActor from a handle of isolated device 0 "
        "(another process): export, interprocess event, CUDA IPC and cuMemcpyPeerAsync in device 1's process, "
        "replying once landed",
        _pair, _cross_copy, _raw_peer, _peer_spec,
        reference="cuMemcpyPeerAsync(256 MiB) device 0 -> device 1 in one process, then cuStreamSynchronize",
        kind="rate", bytes_per_op=PEER_BYTES, target=Target("ratio", ">=", 0.95)),
))
