"""The rows of several devices: the demo on every device at once beside N times one device's demo,
and a copy between two isolated devices beside ``cuMemcpyPeerAsync`` in one process. Each needs
two devices or more and is skipped with the reason on fewer (the host driver's bench has one).

* ``demo on N GPUs / N x one GPU <size>``: :func:`..multi_pipeline.run_on_devices` in its default
  placement (a worker process per device) on every device of the driver; the reference is the
  same job on device 0 alone, in one worker process placed as each of the N is (on CUDA bound to
  its GPU's NUMA node), N times over: N devices that scale perfectly move N times its bytes in its
  time. A sample is one whole run of
  each; figures are per batch (the batch's input bytes over its share of the time).
* ``cross-process peer copy 256 MiB``: a ``CopyDeviceToDevice`` asked of the ``CopyActor`` of
  isolated device 1 from a handle of isolated device 0 (each in its own process, IPC-capable
  pools): the export, the interprocess event, CUDA IPC and ``cuMemcpyPeerAsync`` in device 1's
  process, replying once the copy landed; the reference is ``cuMemcpyPeerAsync`` between the same
  two devices in this process, each copy synchronized (the same landed-before-reply contract).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pykka

from ...actors import Allocate, CopyActor, CopyDeviceToDevice, DeviceActor, Fill
from ..multi_pipeline import DEFAULT_PLACEMENT, run_on_devices
from ..pipeline import PipelineConfig, run_pipeline
from .harness import Context, Group, Op, Row, SkipRow, given, no_gc
from .plan import MIB, Plan, size_text
from .result import Target

__all__ = ["MULTI"]

DEPTH = 8
PEER_BYTES = 256 * MIB


def _need_two(ctx: Context) -> int:
    count = ctx.driver.device_count()
    if count < 2:
        raise SkipRow(f"needs 2 devices or more; the {ctx.driver.kind} driver has {count}")
    return count


def _demo_measure(size: int) -> Callable[[Any, Context], tuple[list[float], list[float]]]:
    def measure(_fixture: Any, ctx: Context) -> tuple[list[float], list[float]]:
        count = _need_two(ctx)
        nbytes, batches = ctx.plan.pipe_sizes[size]
        cfg = PipelineConfig(batches=batches, batch_bytes=nbytes, depth=DEPTH)
        warm = run_pipeline(ctx.driver, PipelineConfig(batches=min(4 * DEPTH, batches), batch_bytes=nbytes,
                                                       depth=DEPTH))
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
        return ours, ref

    return measure


def _demo_row(size: int, label: str) -> Row:
    return Row(
        f"demo on N GPUs / N x one GPU {label}",
        lambda f, p: f"the demo's job on every device at once ({DEFAULT_PLACEMENT}: a worker process per device), "
        f"{p.pipe_sizes[size][1]} batches of {size_text(p.pipe_sizes[size][0])} per device, {DEPTH} in flight each, "
        "every batch verified; aggregate throughput from the first start to the last end",
        given, None, None, lambda p: (p.pipe_rounds, 1),
        reference="N x the same job on device 0 alone, in a worker process placed as each of the N, N the device count",
        kind="rate",
        bytes_per_op=lambda p: p.pipe_sizes[size][0],
        target=Target("ratio", ">=", 0.9),
        note="figures per batch; one sample is one whole run of each side, setup (processes, inputs, buffers, "
        "kernels) excluded",
        measure=_demo_measure(size),
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


MULTI = Group("several devices", (
    _demo_row(1, "1 MiB"),
    _demo_row(2, "16 MiB"),
    Row("cross-process peer copy 256 MiB",
        "CopyDeviceToDevice(256 MiB) asked of isolated device 1's CopyActor from a handle of isolated device 0 "
        "(another process): export, interprocess event, CUDA IPC and cuMemcpyPeerAsync in device 1's process, "
        "replying once landed",
        _pair, _cross_copy, _raw_peer, _peer_spec,
        reference="cuMemcpyPeerAsync(256 MiB) device 0 -> device 1 in one process, then cuStreamSynchronize",
        kind="rate", bytes_per_op=PEER_BYTES, target=Target("ratio", ">=", 0.95)),
))
