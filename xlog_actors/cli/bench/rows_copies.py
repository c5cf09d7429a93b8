"""The copy rows: host-to-device and device-to-device copies through a ``CopyActor``, beside the
raw copy calls on the same buffers.

The raw twins copy into (and between) the very device buffers the actor uses, so memory placement
is the same on both sides; the two never overlap in time (each sample ends with its stream
synchronized). The host-to-device buffers are freed before the device-to-device ones are made, so
the two sections never hold their memory at once.

The peer row copies from device 1 to device 0 through the group's copy actor (on device 0, so the
copy runs on its stream and the source is ordered through a bridge stream on device 1), beside
raw ``cuMemcpyPeerAsync`` on the group's raw stream of device 0. It needs two devices: with one
(the host bench driver has one) it is skipped with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pykka

from ...actors import (
    Allocate,
    AllocatePinned,
    CopyActor,
    CopyDeviceToDevice,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    Fill,
)
from ...driver.protocol import Driver, Stream
from .harness import Context, Group, Op, Row, SkipRow
from .plan import MIB, Plan, size_text
from .result import Target
from .twins import HostBuffer, PeerTwin, cu, raise_unless_success

__all__ = ["COPIES"]


@dataclass
class _Copies:
    driver: Driver
    plan: Plan
    device: pykka.ActorRef[Any]
    copy: pykka.ActorRef[Any]
    stream: Stream
    probe: Any  # a pinned buffer of device 0 that the rows' waits copy one byte into


@contextlib.contextmanager
def _copies(ctx: Context) -> Iterator[_Copies]:
    device = DeviceActor.start(0, ctx.driver)
    copy = CopyActor.start(device)
    stream = ctx.driver.create_stream(0)
    probe: Any = device.ask(AllocatePinned(64))
    try:
        yield _Copies(ctx.driver, ctx.plan, device, copy, stream, probe)
    finally:
        probe.release()
        copy.stop()
        device.stop()
        stream.synchronize()
        stream.close()


# -- host to device -----------------------------------------------------------------------------
@dataclass
class _H2D:
    base: _Copies
    ask: Any
    arr: np.ndarray
    dptr: int
    ref: Any
    raw: Op
    raw_name: str


def _raw_h2d(b: _Copies, dptr: int, host: HostBuffer) -> tuple[Op, str]:
    driver, stream, nbytes, arr = b.driver, b.stream, host.nbytes, host.array
    if driver.kind == "cuda":
        cuda = cu()
        h = cuda.CUstream(stream.handle)
        memcpy, stream_sync, hptr = cuda.cuMemcpyHtoDAsync, cuda.cuStreamSynchronize, host.ptr

        def raw(n: int) -> None:
            for _ in range(n):
                memcpy(dptr, hptr, nbytes, h)
                (err,) = stream_sync(h)
            raise_unless_success(cuda, "cuMemcpyHtoDAsync/cuStreamSynchronize", err)

        return raw, "raw cuMemcpyHtoDAsync + cuStreamSynchronize, same pinned buffer and destination"
    return _driver_h2d(driver, stream, dptr, arr), "HostDriver.copy_to_device + synchronize"


def _driver_h2d(driver: Driver, stream: Stream, dptr: int, arr: np.ndarray) -> Op:
    def via_driver(n: int) -> None:
        for _ in range(n):
            driver.copy_to_device(dptr, arr, stream)
            stream.synchronize()

    return via_driver


@contextlib.contextmanager
def _h2d(b: _Copies) -> Iterator[_H2D]:
    host = HostBuffer(b.driver.kind == "cuda", b.plan.h2d_bytes)
    try:
        ref: Any = b.device.ask(Allocate(host.nbytes))
        dptr = ref.raw_device_ptr()
        yield _H2D(b, b.copy.ask, host.array, dptr, ref, *_raw_h2d(b, dptr, host))
        del ref
    finally:
        host.close()


def _waiter(ask: Any, ref: Any, b: _Copies, pinned: bool) -> Callable[[], None]:
    """How a row waits for its copies through the actor: a 1-byte ``CopyToHost`` of ``ref``, on
    the copy actor's stream after them. ``pinned``: into the pinned probe, then its
    ``CopyDone.wait()`` (an event synchronize, the runtime's way to wait for one copy);
    else into new pageable bytes, which the ask returns once they landed (a pageable copy back,
    synchronous in CUDA, then a stream synchronize)."""
    if pinned:
        into_probe = CopyToHost(ref, nbytes=1, out=b.probe)

        def wait_pinned() -> None:
            ask(into_probe).wait()

        return wait_pinned
    pageable = CopyToHost(ref, nbytes=1)

    def wait_pageable() -> None:
        ask(pageable)

    return wait_pageable


def _copy_actor_h2d(f: _H2D, pinned_wait: bool = True) -> Op:
    ask = f.ask
    to_device = CopyToDevice(f.ref, f.arr)
    wait = _waiter(ask, f.ref, f.base, pinned_wait)

    def ours(n: int) -> None:
        for _ in range(n):
            ask(to_device)
            wait()

    return ours


def _check_h2d(f: _H2D) -> None:
    if f.ask(CopyToHost(f.ref, nbytes=64)) != f.arr[:64].tobytes():
        raise RuntimeError("CopyActor H2D: the device holds other bytes than were copied")


# -- device to device ---------------------------------------------------------------------------
@dataclass
class _D2D:
    base: _Copies
    ask: Any
    src: Any
    dst: Any
    raw: Op
    raw_name: str
    extra: contextlib.ExitStack  # what a row starts for itself (an untracked actor), left with the section


def _raw_d2d(b: _Copies, d_dst: int, d_src: int) -> tuple[Op, str]:
    driver, stream, nbytes, k = b.driver, b.stream, b.plan.d2d_bytes, b.plan.d2d_per_sync
    if driver.kind == "cuda":
        cuda = cu()
        h = cuda.CUstream(stream.handle)
        memcpy, stream_sync = cuda.cuMemcpyDtoDAsync, cuda.cuStreamSynchronize

        def raw(n: int) -> None:
            for _ in range(n):
                for _ in range(k):
                    memcpy(d_dst, d_src, nbytes, h)
                (err,) = stream_sync(h)
            raise_unless_success(cuda, "cuMemcpyDtoDAsync/cuStreamSynchronize", err)

        return raw, f"raw cuMemcpyDtoDAsync x{k} + cuStreamSynchronize"
    return _driver_d2d(b, d_dst, d_src), f"HostDriver.copy_device_to_device x{k} + synchronize"


def _driver_d2d(b: _Copies, d_dst: int, d_src: int) -> Op:
    d2d_copy, stream, nbytes, k = b.driver.copy_device_to_device, b.stream, b.plan.d2d_bytes, b.plan.d2d_per_sync

    def via_driver_d2d(n: int) -> None:
        for _ in range(n):
            for _ in range(k):
                d2d_copy(d_dst, d_src, nbytes, stream)
            stream.synchronize()

    return via_driver_d2d


@contextlib.contextmanager
def _d2d(b: _Copies) -> Iterator[_D2D]:
    ask = b.copy.ask
    src: Any = b.device.ask(Allocate(b.plan.d2d_bytes))
    dst: Any = b.device.ask(Allocate(b.plan.d2d_bytes))
    ask(Fill(src, 7))
    with contextlib.ExitStack() as extra:
        yield _D2D(b, ask, src, dst, *_raw_d2d(b, dst.raw_device_ptr(), src.raw_device_ptr()), extra)
    del src, dst


def _copy_actor_d2d(ask: Any, f: _D2D | _Peer, pinned_wait: bool = True) -> Op:
    d2d = CopyDeviceToDevice(f.src, f.dst)
    wait = _waiter(ask, f.dst, f.base, pinned_wait)
    k = f.base.plan.d2d_per_sync

    def ours_d2d(n: int) -> None:
        for _ in range(n):
            for _ in range(k):
                ask(d2d)
            wait()

    return ours_d2d


def _untracked_d2d(f: _D2D) -> Op:
    untracked = CopyActor.start(f.base.device, track=False)
    f.extra.callback(untracked.stop)
    return _copy_actor_d2d(untracked.ask, f)


def _check_d2d(f: _D2D) -> None:
    if f.ask(CopyToHost(f.dst, nbytes=16)) != bytes([7]) * 16:
        raise RuntimeError("CopyActor D2D: the destination does not hold the source's bytes")


def _d2d_rate(**kw: Any) -> dict[str, Any]:
    """What every device-to-device row shares: its samples, its per-copy count and its rate."""
    return dict(spec=lambda p: (p.d2d_samples, 1), ours_ops=lambda p: p.d2d_per_sync,
                ref_ops=lambda p: p.d2d_per_sync, kind="rate", bytes_per_op=lambda p: p.d2d_bytes, **kw)


# -- peer: device 1 to device 0 --------------------------------------------------------------------
_PEER_BYTES = 256 * MIB


@dataclass
class _Peer:
    base: _Copies
    skip: str | None
    src: Any = None
    dst: Any = None
    twin: PeerTwin | None = None
    helper: Any = None  # a copy actor on device 1, which fills the source


@contextlib.contextmanager
def _peer(b: _Copies) -> Iterator[_Peer]:
    count = b.driver.device_count()
    if count < 2:
        yield _Peer(b, f"a peer copy needs two devices; this {b.driver.kind} driver has {count}")
        return
    device1 = DeviceActor.start(1, b.driver)
    helper = CopyActor.start(device1)
    twin: PeerTwin | None = None
    try:
        src: Any = device1.ask(Allocate(_PEER_BYTES))
        dst: Any = b.device.ask(Allocate(_PEER_BYTES))
        helper.ask(Fill(src, 9))
        twin = PeerTwin(b.driver, b.stream, (0, dst.raw_device_ptr()), (1, src.raw_device_ptr()), _PEER_BYTES,
                        b.plan.d2d_per_sync)
        yield _Peer(b, None, src, dst, twin, helper)
        del src, dst
    finally:
        if twin is not None:
            twin.close()
        helper.stop()
        device1.stop()


def _copy_actor_peer(f: _Peer) -> Op:
    if f.skip is not None:
        raise SkipRow(f.skip)
    return _copy_actor_d2d(f.base.copy.ask, f)


def _raw_peer(f: _Peer) -> Op:
    assert f.twin is not None
    return f.twin.op


def _peer_reference(f: _Peer, p: Plan) -> str:
    return f.twin.name if f.twin is not None else "-"


def _check_peer(f: _Peer) -> None:
    if f.base.copy.ask(CopyToHost(f.dst, nbytes=16)) != bytes([9]) * 16:
        raise RuntimeError("CopyActor peer: the destination on device 0 does not hold device 1's bytes")


#: The note of the two "pageable wait" rows.
_PAGEABLE_NOTE = "informational: the row's earlier wait (a pageable copy back), and what the wait's kind costs"

COPIES = Group("copies", (
    Row("CopyActor H2D pinned", lambda f, p: f"copy.ask(CopyToDevice(ref, {size_text(p.h2d_bytes)} pinned)) + "
        "ask(CopyToHost(ref, nbytes=1, out=pinned)).wait() to wait for it", _h2d, _copy_actor_h2d, lambda f: f.raw,
        lambda p: (p.h2d_samples, 1), kind="rate", bytes_per_op=lambda p: p.h2d_bytes,
        target=Target("ratio", ">=", 0.98), check=_check_h2d),
    Row("CopyActor H2D pinned, pageable wait", lambda f, p: "as CopyActor H2D pinned, waiting with "
        "ask(CopyToHost(ref, nbytes=1)) (a pageable copy back) instead", _h2d,
        lambda f: _copy_actor_h2d(f, pinned_wait=False), lambda f: f.raw, lambda p: (p.h2d_samples, 1),
        kind="rate", bytes_per_op=lambda p: p.h2d_bytes,
        note=_PAGEABLE_NOTE),
    Row("driver copy_to_device H2D pinned", lambda f, p: f"driver.copy_to_device({size_text(p.h2d_bytes)} pinned) "
        "+ stream.synchronize(), no actor", _h2d, lambda f: _driver_h2d(f.base.driver, f.base.stream, f.dptr, f.arr),
        lambda f: f.raw, lambda p: (p.h2d_samples, 1), kind="rate", bytes_per_op=lambda p: p.h2d_bytes,
        note="informational: separates the driver's share (its snapshot of the source) from the actor's"),
    Row("CopyActor D2D, pageable wait", lambda f, p: "as CopyActor D2D, waiting with ask(CopyToHost(dst, "
        "nbytes=1)) (a pageable copy back) instead; per copy", _d2d,
        lambda f: _copy_actor_d2d(f.ask, f, pinned_wait=False), lambda f: f.raw,
        **_d2d_rate(note=_PAGEABLE_NOTE)),
    Row("CopyActor D2D", lambda f, p: f"{p.d2d_per_sync} x copy.ask(CopyDeviceToDevice({size_text(p.d2d_bytes)}))"
        " + ask(CopyToHost(dst, nbytes=1, out=pinned)).wait(); per copy", _d2d, lambda f: _copy_actor_d2d(f.ask, f),
        lambda f: f.raw,
        **_d2d_rate(target=Target("ratio", ">=", 0.98), check=_check_d2d,
                    note=lambda f, p: "bandwidth counts the bytes copied once (read + write traffic is twice "
                    f"that); {p.d2d_per_sync} copies per synchronize on both sides")),
    Row("CopyActor D2D, tracking off", "as CopyActor D2D, on a CopyActor started with track=False (no "
        "prepare/finish, no events); per copy", _d2d, _untracked_d2d, lambda f: f.raw,
        **_d2d_rate(note="informational: the tracking's share of the CopyActor D2D row")),
    Row("driver copy_device_to_device D2D", lambda f, p: f"{p.d2d_per_sync} x driver.copy_device_to_device("
        f"{size_text(p.d2d_bytes)}) + stream.synchronize(), no actor; per copy", _d2d,
        lambda f: _driver_d2d(f.base, f.dst.raw_device_ptr(), f.src.raw_device_ptr()), lambda f: f.raw,
        **_d2d_rate(host_skip="on the host driver this is the reference itself",
                    note="informational: the driver's share of the CopyActor D2D row")),
    Row(f"CopyActor peer {size_text(_PEER_BYTES)}", lambda f, p: f"{p.d2d_per_sync} x copy.ask(CopyDeviceToDevice("
        f"{size_text(_PEER_BYTES)} of device 1 -> device 0)) + ask(CopyToHost(dst, nbytes=1, out=pinned)).wait();"
        " per copy", _peer,
        _copy_actor_peer, _raw_peer, lambda p: (p.d2d_samples, 1), reference=_peer_reference,
        ours_ops=lambda p: p.d2d_per_sync, ref_ops=lambda p: p.d2d_per_sync, kind="rate",
        bytes_per_op=_PEER_BYTES, target=Target("ratio", ">=", 0.95), check=_check_peer,
        note=lambda f, p: "the copy actor is on device 0 and pulls from device 1; peer access is not enabled "
        f"(cuMemcpyPeerAsync picks the path); {p.d2d_per_sync} copies per synchronize on both sides"),
), base=_copies)
