"""The device actor rows: ``Allocate`` and ``AllocateMany`` asked of a ``DeviceActor``, the
``DeviceClient`` direct path, ``GpuRef.access``, and one small library message (a ``Fill`` asked of
a ``CopyActor``) beside the same bare pykka ask."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pykka

from ...actors import Allocate, AllocateMany, CopyActor, CopyToHost, DeviceActor, Fill, GetClient
from ...driver.protocol import Stream
from .harness import Context, Group, Op, Row, given
from .plan import SIZE
from .result import Target
from .twins import alloc_free_loop, stream_ordered_twin

__all__ = ["ACTOR", "Echo", "Plain"]


class Echo(pykka.ThreadingActor):
    """The reference actor: answers every message with None.

    Thread rule: a pykka actor; ask or tell it from any thread.
    """

    def on_receive(self, message: Any) -> None:
        """Answer ``message`` with None (a bare ask round trip).

        Args:
            message: anything.
        Returns:
            None.
        Thread rule: the actor's thread only (pykka calls it).
        """
        return None


class Plain:
    """A slot object with one trivial method: the cost of a no-op method call.

    Thread rule: any thread.
    """

    __slots__ = ("_x",)

    def __init__(self) -> None:
        self._x = 1

    def get(self) -> int:
        """Return the slot's value (1)."""
        return self._x


@dataclass
class _Actors:
    device: pykka.ActorRef[Any]
    echo: pykka.ActorRef[Any]
    stream: Stream
    raw: Op
    raw_name: str
    many_count: int


@contextlib.contextmanager
def _actors(ctx: Context) -> Iterator[_Actors]:
    device = DeviceActor.start(0, ctx.driver)
    echo = Echo.start()
    stream = ctx.driver.create_stream(0)
    try:
        yield _Actors(device, echo, stream, *stream_ordered_twin(ctx.driver, stream), ctx.plan.many_count)
    finally:
        echo.stop()
        device.stop()
        stream.close()


def _allocate(f: _Actors) -> Op:
    msg = Allocate(SIZE)
    ask = f.device.ask
    held: list[Any] = [None]

    def ours(n: int) -> None:
        # Each new handle replaces the previous one in ``held``: that drop tells its free to the
        # device, which handles it before the next Allocate (its inbox is FIFO). So a sample pays
        # for n allocations and n frees, and no free is left running while the reference is timed.
        for _ in range(n):
            held[0] = None  # told ahead of the next Allocate, not after its reply
            held[0] = ask(msg)

    return ours


def _bare_ask(f: _Actors) -> Op:
    msg = Allocate(SIZE)
    echo_ask = f.echo.ask

    def bare(n: int) -> None:
        for _ in range(n):
            echo_ask(msg)

    return bare


def _allocate_many(f: _Actors) -> Op:
    many = AllocateMany((SIZE,) * f.many_count)
    ask = f.device.ask
    held_many: list[Any] = [None]

    def ours_many(n: int) -> None:
        for _ in range(n):
            held_many[0] = None  # the previous 64 frees are told ahead of this ask
            held_many[0] = ask(many)

    return ours_many


@dataclass
class _Client:
    client: Any
    ref: Any
    raw: Op
    raw_name: str


@contextlib.contextmanager
def _client(base: _Actors) -> Iterator[_Client]:
    """The device's client, and one live handle allocated through it (freed after)."""
    client: Any = base.device.ask(GetClient())
    ref = client.allocate(SIZE)
    try:
        yield _Client(client, ref, base.raw, base.raw_name)
    finally:
        client.free(ref)


def _access(f: _Client) -> Op:
    access = f.ref.access

    def ours_access(n: int) -> None:
        for _ in range(n):
            access()

    return ours_access


def _noop(f: _Client) -> Op:
    plain = Plain().get

    def noop(n: int) -> None:
        for _ in range(n):
            plain()

    return noop


#: The library message row's allocation and bytes: the setup fills it with ``_FILL_FIRST``, the
#: timed asks with ``_FILL_BYTE``, so the check after sampling sees whether they ran.
_FILL_BYTES = 4
_FILL_FIRST = 0
_FILL_BYTE = 7


@dataclass
class _Fill:
    base: _Actors
    copy: pykka.ActorRef[Any]
    ref: Any


@contextlib.contextmanager
def _fill(base: _Actors) -> Iterator[_Fill]:
    """A ``CopyActor`` of the group's device and a 4-byte allocation, filled once through the
    inbox first: that ask waits for the actor's start, so the timed asks find it running and idle."""
    copy = CopyActor.start(base.device)
    try:
        ref: Any = base.device.ask(Allocate(_FILL_BYTES))
        copy.ask(Fill(ref, _FILL_FIRST), timeout=60)  # a timeout sends it through the inbox
        yield _Fill(base, copy, ref)
        del ref  # its free is told to the device, which the group stops after this actor
    finally:
        copy.stop()


def _fill_ask(f: _Fill) -> Op:
    msg = Fill(f.ref, _FILL_BYTE)
    ask = f.copy.ask

    def ours_fill(n: int) -> None:
        for _ in range(n):
            ask(msg)

    return ours_fill


def _check_fill(f: _Fill) -> None:
    reply: Any = f.copy.ask(CopyToHost(f.ref))
    got = bytes(reply)
    if got != bytes([_FILL_BYTE]) * _FILL_BYTES:
        raise RuntimeError(f"CopyActor Fill: the allocation holds {got!r}, not the bytes the timed asks filled")


ACTOR = Group("device actor", (
    Row("DeviceActor Allocate", "device.ask(Allocate(4 KiB)); dropping the GpuRef tells its free back to the device",
        given, _allocate, _bare_ask, lambda p: p.ask, reference="bare pykka ask round trip to a trivial actor",
        target=Target("ratio", "<=", 1.1)),
    Row("DeviceActor AllocateMany(64)", "device.ask(AllocateMany(64 x 4 KiB)), drop the refs; per allocation",
        given, _allocate_many, lambda f: f.raw, lambda p: p.many, ours_ops=lambda p: p.many_count,
        ref_batch=lambda p: p.many_count * p.many[1], target=Target("ratio", "<=", 1.5),
        note="includes the 64 frees told back to the device (handled before the next ask)"),
    Row("DeviceClient allocate+free", "DeviceClient.allocate(4 KiB) + DeviceClient.free, in the calling thread",
        _client, lambda f: alloc_free_loop(f.client.allocate, f.client.free), lambda f: f.raw, lambda p: p.client,
        target=Target("ratio", "<=", 1.5), note="the direct path for code that allocates in a loop"),
    Row("GpuRef.access", "GpuRef.access() of a live handle (validation fast path)", _client, _access, _noop,
        lambda p: p.access, reference="a no-op method call returning a slot attribute (context only)",
        target=Target("median", "<=", 0.04), note="absolute target on the median (µs); the ratio is for context"),
    Row("CopyActor Fill round trip", "copy.ask(Fill(ref, 7)) of a 4-byte GpuRef: a blocking ask, no timeout",
        _fill, _fill_ask, lambda f: _bare_ask(f.base), lambda p: p.ask,
        reference="bare pykka ask round trip to a trivial actor", target=Target("ratio", "<=", 0.25),
        check=_check_fill,
        note="a blocking ask with no timeout of a library message is served in the asker's thread while the actor "
             "is idle (actors/served_ref.py): no thread hop either way, where the bare ask makes two"),
), base=_actors)
