"""The isolated device's fast path: frees ride in the next ask's frame, the child's frame
reader serves ``Allocate``/``Free`` itself only while its device actor is quiet, and the pipe
readers spin before they sleep (only on machines of four cores or more; forced here)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault, _child, _lane, _protocol, _proxy, _reader

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_process")]


@pytest.fixture(autouse=True, params=["pipe", "lane"])
def call_lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test of this module runs with allocations through the pipe and through the call
    lane (the default only where the waits spin: four cores or more)."""
    monkeypatch.setattr(_proxy, "CALL_LANE", request.param == "lane")


def test_channel_spin_sees_a_frame_and_the_end_of_the_pipe() -> None:
    a, b = multiprocessing.Pipe()
    mine, theirs = _protocol.Channel(a), _protocol.Channel(b)
    assert mine.spin(0.002) is False  # nothing came: the spin ran out
    theirs.send(("x",))
    assert mine.spin(5.0) is True and mine.recv() == ("x",)
    theirs.close()
    assert mine.spin(5.0) is True  # the end of the pipe reads at once: the reader sees EOFError
    with pytest.raises(EOFError):
        mine.recv()
    mine.close()


def test_allocate_and_remote_block_cross_as_plain_fields_and_come_back_equal_and_of_their_types() -> None:
    import pickle

    from xlog_actors.memory.block import BlockState, Generation, make_block

    for msg in (xa.Allocate(4096), xa.Allocate(64, stream=xa.StreamId(3), tag=xa.AllocTag("weights"))):
        back = pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        assert back == msg and type(back.stream) is xa.StreamId and type(back.tag) is xa.AllocTag
        assert back.origin is None
    odd = xa.Allocate(64, stream="not a stream", tag=7)  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(odd))
    assert (back.stream, back.tag) == ("not a stream", 7)  # kept as they were: the device refuses them
    gen = Generation.next()
    block = make_block(0x1000, 0, xa.StreamId(2), 4096, 256, xa.AllocTag("t"), gen, BlockState.RETIRED)
    remote = _protocol.RemoteBlock(block, 5)
    back = pickle.loads(pickle.dumps(remote, pickle.HIGHEST_PROTOCOL))
    assert back == remote and back.generation == 5
    assert (type(back.block.generation), type(back.block.alloc_stream), type(back.block.tag)) == (
        Generation, xa.StreamId, xa.AllocTag)
    assert back.block.state is BlockState.RETIRED
    assert len(pickle.dumps(remote)) < 200


def test_a_frame_only_multiprocessing_can_pickle_still_crosses() -> None:
    import socket

    a, b = multiprocessing.Pipe()
    mine, theirs = _protocol.Channel(a), _protocol.Channel(b)
    left, right = socket.socketpair()
    try:
        theirs.send(("x", left))  # a socket: multiprocessing's reducers pickle it, pickle does not
        frame = mine.recv()
        assert frame[0] == "x" and isinstance(frame[1], socket.socket)
        frame[1].close()
    finally:
        left.close()
        right.close()
        mine.close()
        theirs.close()


class _Unpicklable(str):
    """A tag that cannot cross to the child: its class is not importable there."""

    def __reduce__(self) -> Any:
        raise TypeError("not picklable on purpose")


def test_an_unpicklable_allocate_is_refused_and_the_frees_before_it_still_go() -> None:
    device = xa.DeviceActor.start(0, "host", isolate=True)
    held = [device.ask(xa.Allocate(4096)) for _ in range(3)]
    held.clear()  # their frees wait for the next ask's frame: the one that cannot be sent
    with pytest.raises(xa.InvalidRequest, match="cannot cross to the device process"):
        device.ask(xa.Allocate(64, tag=_Unpicklable("t")))  # type: ignore[arg-type]
    stats = device.ask(xa.GetStats())
    assert (stats.bytes_outstanding, stats.live_blocks, stats.status) == (0, 0, "running")
    assert device.ask(xa.Allocate(64)).generation == 0


@pytest.mark.parametrize("kind", ["sticky", "kill"])
def test_a_restart_answers_every_direct_allocation_in_flight(
    kind: str, answers_from_threads: Callable[..., list[object]]
) -> None:
    """Allocations from several threads at once, sent straight from their askers' threads, are
    in flight when the child fails: none hangs, and each is served by the next child (an
    allocation names no handle, so the death is no reason to refuse it)."""
    device = xa.DeviceActor.start(0, "host", supervisor=xa.Supervisor(max_restarts=3), isolate=True)
    device.tell(ChildFault(kind, hold=6))  # type: ignore[arg-type]  # armed before the allocations reach it
    # A hang fails the test (answers_from_threads bounds the threads by 40 s).
    outcomes = answers_from_threads(lambda: [device.ask(xa.Allocate(64), block=False) for _ in range(2)], 3, 40)
    assert len(outcomes) == 6
    for outcome in outcomes:
        assert isinstance(outcome, xa.GpuRef) and outcome.generation == 1, outcome
    assert device.ask(xa.Allocate(64)).generation == 1


def test_forced_spinning_readers_serve_and_free_as_the_sleeping_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's reader and the askers' futures spin (forced on this machine whatever its
    cores); every reply still reaches its asker and every dropped handle is freed."""
    for module in (_proxy, _reader, _lane):  # the askers' futures, the reader, the lane's waits
        monkeypatch.setattr(module, "spin_budget", lambda seconds: seconds)
    device = xa.DeviceActor.start(0, "host", isolate=True)
    held = None
    for _ in range(50):
        held = None
        held = device.ask(xa.Allocate(4096))
    assert isinstance(held, xa.GpuRef)
    stats = device.ask(xa.GetStats())
    assert (stats.bytes_outstanding, stats.live_blocks) == (4096, 1)
    del held
    assert device.ask(xa.GetStats()).bytes_outstanding == 0


class _RefusingClient:
    """Stands in for the device's client: any use of the reader's own path is an error reply."""

    def allocate(self, *_: Any) -> Any:
        raise xa.InvalidRequest("served on the frame reader's thread")

    def free(self, _ref: Any) -> None:
        raise xa.InvalidRequest("freed on the frame reader's thread")


def test_the_child_reader_serves_an_allocation_itself_only_while_the_device_actor_is_quiet() -> None:
    """The ordering rule of the child: a frame that arrives while the device actor has work
    queued or in hand goes to the actor's inbox behind it; only a quiet actor lets the reader
    serve it. Run in this process, on a ``_Server`` over a pipe."""
    driver = xa.HostDriver()
    device = xa.DeviceActor.start(0, driver)
    parent, child_end = multiprocessing.Pipe()
    server = _child._Server(_protocol.Channel(child_end), driver, 0, device)
    try:
        inbox = server.inbox
        assert inbox.quiet()
        server.client = _RefusingClient()  # type: ignore[assignment]
        inbox.busy = True  # as while the actor serves a message taken before this frame
        server.ask(1, xa.Allocate(64))
        kind, rid, ok, value = parent.recv()
        assert (kind, rid, ok) == ("reply", 1, True) and value.block.nbytes == 64  # the actor served it
        inbox.busy = False  # what the actor's idle() does once its handler returned (the reply goes first)
        assert inbox.quiet()
        server.ask(2, xa.Allocate(64))
        kind, rid, ok, value = parent.recv()
        assert (kind, rid, ok) == ("reply", 2, False)
        assert "frame reader" in str(_protocol.decode_error(value))  # quiet: the reader served it
    finally:
        device.stop()
        driver.close()
        parent.close()
        child_end.close()


def test_ipc_pool_is_checked_and_accepted_on_the_host_driver() -> None:
    with pytest.raises(xa.InvalidRequest, match="ipc_pool must be a bool"):
        xa.DeviceActor.start(0, "host", isolate=True, ipc_pool="yes")
    with pytest.raises(xa.InvalidRequest, match="ipc_pool is an option of isolate=True"):
        xa.DeviceActor.start(0, xa.HostDriver(), ipc_pool=True)
    assert pykka.ActorRegistry.get_all() == []  # nothing was started by either
    device = xa.DeviceActor.start(0, "host", isolate=True, ipc_pool=True)  # host memory is shared anyway
    ref = device.ask(xa.Allocate(4096))
    assert ref.nbytes == 4096 and device.ask(xa.GetStats()).live_blocks == 1
