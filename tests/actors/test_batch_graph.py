"""BatchGraph: a batch's stages recorded once and replayed, on both drivers: results, bindings, the
hazards its tracking prevents (each test fails with tracking off), a rebuild mid-run, and bad
input refused with a typed error and nothing changed."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core.graph_replay import ReplayCore
from xlog_actors.actors.messages import AllocatePinned, Attach
from xlog_actors.driver.graph import Memset
from xlog_actors.driver.kernel_library import SCALE_ADD_F32, launch_shape

N = 1 << 14  # float32 elements per buffer


def _pinned(device: pykka.ActorRef[Any], values: float | None = None, n: int = N) -> xa.PinnedBuffer:
    buf: xa.PinnedBuffer = device.ask(AllocatePinned(4 * n))
    if values is not None:
        buf.array(np.float32)[:] = values
    return buf


def _job(device: pykka.ActorRef[Any], *, track: bool = True) -> tuple[xa.BatchGraph, dict[str, Any]]:
    """copy in -> out = 2 * in + 1 -> copy out, recorded on input 1.0."""
    inp, out = device.ask(xa.Allocate(4 * N)), device.ask(xa.Allocate(4 * N))
    host_in, host_out = _pinned(device, 1.0), _pinned(device)
    grid, block = launch_shape(N)
    graph = xa.BatchGraph.record(device, [
        xa.CopyToDevice(inp, host_in),
        xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(inp), 2.0, 1.0, N]),
        xa.CopyToHost(out, out=host_out),
    ], track=track)
    return graph, {"inp": inp, "out": out, "host_in": host_in, "host_out": host_out}


def _values(buf: xa.PinnedBuffer) -> set[float]:
    return set(buf.array(np.float32).tolist())


def test_replay_runs_every_stage_and_bindings_stay(device: pykka.ActorRef[Any]) -> None:
    graph, b = _job(device)
    graph.replay().wait()
    assert _values(b["host_out"]) == {3.0}
    other_in, other_out = _pinned(device, 5.0), _pinned(device)
    graph.replay({b["host_in"]: other_in, b["host_out"]: other_out}).wait()
    assert _values(other_out) == {11.0}
    b["host_out"].array(np.float32)[:] = 0
    graph.replay().wait()  # the binding stays: the old host output is left alone
    assert _values(other_out) == {11.0} and _values(b["host_out"]) == {0.0}
    graph.replay({b["host_in"]: b["host_in"], b["host_out"]: b["host_out"]}).wait()  # back to the recorded
    assert _values(b["host_out"]) == {3.0}
    assert b["out"].last_write_stream == graph.stream_id
    graph.close()
    assert graph.closed


def test_an_input_rebound_round_after_round_is_copied_from_each_time(device: pykka.ActorRef[Any]) -> None:
    """One host operand rebound every replay among buffers seen before (on CUDA the compiled
    path: an address set on the node), then the output rebound too: every replay copies from
    the buffer bound at its own replay."""
    graph, b = _job(device)
    inputs = [b["host_in"], _pinned(device, 2.0), _pinned(device, 3.0)]
    for _ in range(3):
        for k, buf in enumerate(inputs):
            graph.replay({b["host_in"]: buf}).wait()
            assert _values(b["host_out"]) == {2.0 * (k + 1) + 1}
    other_out = _pinned(device)
    graph.replay({b["host_out"]: other_out}).wait()
    assert _values(other_out) == {7.0}
    inputs[1].array(np.float32)[:] = 10.0
    graph.replay({b["host_in"]: inputs[1]}).wait()
    assert _values(other_out) == {21.0}
    graph.close()


def test_a_bound_device_handle_is_written_and_tracked(device: pykka.ActorRef[Any]) -> None:
    graph, b = _job(device)
    out2 = device.ask(xa.Allocate(4 * N))
    graph.replay({b["out"]: out2}).wait()
    reader = xa.CopyActor.start(device)
    assert set(np.frombuffer(reader.ask(xa.CopyToHost(out2)), np.float32).tolist()) == {3.0}
    assert out2.last_write_stream == graph.stream_id


@pytest.mark.parametrize(
    "track", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)], ids=["tracked", "untracked"]
)
def test_a_replay_waits_for_a_slow_writer_outside_the_graph(driver: xa.Driver, track: bool) -> None:
    """A CopyActor's write queued behind slow work, then a replay that reads the handle: the
    replay must wait for it (prepare_block_use); without tracking it reads too early."""
    device = xa.DeviceActor.start(0, driver)
    try:
        inp, out = device.ask(xa.Allocate(4 * N)), device.ask(xa.Allocate(4 * N))
        host_out = _pinned(device)
        writer = xa.CopyActor.start(device)
        writer.ask(xa.Fill(inp, 0))
        writer.ask(xa.CopyToHost(inp, nbytes=4))  # the zero fill landed
        grid, block = launch_shape(N)
        graph = xa.BatchGraph.record(device, [
            xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(inp), 3.0, 0.0, N]),
            xa.CopyToHost(out, out=host_out),
        ], track=track)
        slow = inp.context.runtime.stream_pool.resolve(writer.proxy().stream_id.get())
        driver.sleep(slow, 200_000)
        writer.ask(xa.CopyToDevice(inp, np.full(N, 2.0, np.float32)))
        graph.replay().wait()
        if track:
            assert _values(host_out) == {6.0}
        else:
            assert _values(host_out) != {6.0}, "without tracking the replay read before the slow copy landed"
    finally:
        pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize(
    "track", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)], ids=["tracked", "untracked"]
)
def test_an_actor_outside_the_graph_waits_for_the_replay(driver: xa.Driver, track: bool) -> None:
    """A replay queued behind slow work on the graph's stream writes a handle; a CopyActor then
    reads it: it must wait for the replay (the graph's write recorded on the handle's block);
    without tracking it reads the old bytes."""
    device = xa.DeviceActor.start(0, driver)
    try:
        graph, b = _job(device, track=track)
        reader = xa.CopyActor.start(device)
        reader.ask(xa.Fill(b["out"], 0))
        reader.ask(xa.CopyToHost(b["out"], nbytes=4))
        stream = b["out"].context.runtime.stream_pool.resolve(graph.stream_id)
        driver.sleep(stream, 200_000)
        done = graph.replay()
        got = set(np.frombuffer(reader.ask(xa.CopyToHost(b["out"])), np.float32).tolist())
        done.wait()
        if track:
            assert got == {3.0}
        else:
            assert got != {3.0}, "without tracking the reader ran before the replay wrote"
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_rebuild_mid_run_makes_replays_stale_and_a_new_recording_works(device: pykka.ActorRef[Any]) -> None:
    graph, b = _job(device)
    for _ in range(3):
        done = graph.replay()
    done.wait()
    device.ask(xa.Rebuild("test: rebuild between replays"))
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        graph.replay()
    assert graph.closed
    with pytest.raises(xa.InvalidRequest, match="closed"):
        graph.replay()
    again, b2 = _job(device)
    again.replay().wait()
    assert _values(b2["host_out"]) == {3.0}
    stats = device.ask(xa.GetStats())
    assert stats.generation == 1


def test_bad_bindings_are_refused_and_change_nothing(driver: xa.Driver) -> None:
    device = xa.DeviceActor.start(0, driver)
    try:
        graph, b = _job(device)
        graph.replay().wait()
        bigger = device.ask(xa.Allocate(4 * N + 256))
        released = device.ask(xa.Allocate(4 * N))
        released.release()
        small_host = _pinned(device, 1.0, n=N // 2)
        cases: list[tuple[dict[Any, Any], type[Exception], str]] = [
            ({b["out"]: bigger}, xa.InvalidRequest, "keep their sizes"),
            ({b["out"]: released}, xa.GpuRefStale, "GpuRef stale"),
            ({b["host_in"]: small_host}, xa.InvalidRequest, "keep their sizes"),
            ({b["host_in"]: b"pageable"}, xa.InvalidRequest, "PinnedBuffer"),
            ({b["out"]: b["host_out"]}, xa.InvalidRequest, "GpuRef"),
            ({bigger: b["out"]}, xa.InvalidRequest, "no stage"),
            # a good binding beside a bad one: neither is applied
            ({b["host_in"]: _pinned(device, 9.0), b["out"]: bigger}, xa.InvalidRequest, "keep their sizes"),
        ]
        for bind, error, words in cases:
            with pytest.raises(error, match=words):
                graph.replay(bind)
        b["host_out"].array(np.float32)[:] = 0
        graph.replay().wait()
        assert _values(b["host_out"]) == {3.0}, "a refused binding changed the graph"
        assert b["out"].last_write_stream == graph.stream_id
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_handle_of_another_device_is_refused(two_devices: xa.Driver) -> None:
    device = xa.DeviceActor.start(0, two_devices)
    other = xa.DeviceActor.start(1, two_devices)
    graph, b = _job(device)
    foreign = other.ask(xa.Allocate(4 * N))
    with pytest.raises(xa.InvalidRequest, match="device 1"):
        graph.replay({b["out"]: foreign})
    with pytest.raises(xa.InvalidRequest, match="device 1"):
        xa.BatchGraph.record(device, [xa.Fill(foreign, 1)])
    graph.replay().wait()
    assert _values(b["host_out"]) == {3.0}


def test_a_stale_handle_fails_the_replay_before_anything_runs(device: pykka.ActorRef[Any]) -> None:
    graph, b = _job(device)
    b["host_out"].array(np.float32)[:] = 0
    b["inp"].release()
    with pytest.raises(xa.GpuRefStale):
        graph.replay()
    assert _values(b["host_out"]) == {0.0}


def test_recording_refuses_malformed_stages(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(64))
    pinned = _pinned(device, 1.0, n=16)
    grid, block = launch_shape(16)
    bad: list[tuple[Any, type[Exception], str]] = [
        ([], xa.InvalidRequest, "non-empty"),
        ([xa.Allocate(64)], xa.InvalidRequest, "expected CopyToDevice"),
        ([xa.CopyToDevice(ref, b"x" * 64)], xa.InvalidRequest, "pinned required"),
        ([xa.CopyToHost(ref, out=np.zeros(64, np.uint8))], xa.InvalidRequest, "pinned required"),
        ([xa.CopyToHost(ref, 65, out=pinned)], xa.InvalidRequest, "CopyToHost.nbytes"),
        ([xa.Fill(ref, 256)], xa.InvalidRequest, "Fill.byte"),
        ([xa.CopyDeviceToDevice(ref, ref)], xa.InvalidRequest, "same handle"),
        ([xa.Launch(SCALE_ADD_F32, grid, block, [ref, ref, 1.0, 0.0, 16])], xa.InvalidRequest, "wrap a GpuRef"),
    ]
    for stages, error, words in bad:
        with pytest.raises(error, match=words):
            xa.BatchGraph.record(device, stages)
    with pytest.raises(xa.InvalidRequest, match="DeviceActor"):
        xa.BatchGraph.record(xa.CopyActor.start(device), [xa.Fill(ref, 1)])
    with pytest.raises(xa.InvalidRequest, match="track"):
        xa.BatchGraph.record(device, [xa.Fill(ref, 1)], track=1)  # type: ignore[arg-type]
    stale = device.ask(xa.Allocate(64))
    stale.release()
    with pytest.raises(xa.GpuRefStale):
        xa.BatchGraph.record(device, [xa.Fill(stale, 1)])
    # the device lives on, and a good recording still works
    graph = xa.BatchGraph.record(device, [xa.Fill(ref, 7), xa.CopyToHost(ref, 16, out=pinned)])
    graph.replay().wait()
    assert bytes(pinned.array(np.uint8)[:16]) == b"\x07" * 16


def test_replays_from_several_threads_are_serialized(device: pykka.ActorRef[Any], run_threads: Any) -> None:
    graph, b = _job(device)

    def replay_many() -> None:
        for _ in range(20):
            graph.replay()

    assert run_threads(replay_many, 4, 60.0) == []
    graph.replay().wait()
    assert _values(b["host_out"]) == {3.0}


# -- the compiled replay's own rules -------------------------------------------------------------
class _Token:
    """A weakly referable stand-in for a replaced host view."""


def _core_on(driver: xa.Driver, device: pykka.ActorRef[Any], ring: int) -> tuple[ReplayCore, Any, Any]:
    """A ReplayCore (untracked) on a stream of the device, and a one-memset graph to replay."""
    ctx = device.ask(Attach())
    sid = ctx.runtime.stream_pool.acquire()
    stream = ctx.runtime.stream_pool.resolve(sid)
    ref = device.ask(xa.Allocate(64))
    graph = driver.record_graph(0, [Memset(ref.block.ptr, 1, 64)])
    core = ReplayCore(driver, 0, stream, sid, None, None, False, ring)
    core.set_uses([])
    return core, stream, (graph, ref)


def test_a_retired_view_is_kept_until_the_replays_before_it_ran(driver: xa.Driver,
                                                                  device: pykka.ActorRef[Any]) -> None:
    """What a rebinding replaced rides on the next replay's completion: let go only once that
    completion is seen to have fired, never while the replays before it may still run."""
    core, stream, (graph, _ref) = _core_on(driver, device, ring=1)
    token = _Token()
    alive = weakref.ref(token)
    driver.sleep(stream, 400_000)  # every replay below stays queued until this ran
    core.replay(graph)
    core.retire(token)
    del token
    core.replay(graph)  # the token rides on this replay's completion
    core.replay(graph)  # the ring comes back to it: still pending, so the token rides on
    gc.collect()
    assert alive() is not None, "a retired view was let go while the replays before it were queued"
    stream.synchronize()
    core.replay(graph)  # its completion fired: let go
    gc.collect()
    assert alive() is None, "a retired view was kept after the replays before it ran"
    core.retire(_Token())
    kept = core.take_kept()
    assert len(kept) == 1 and isinstance(kept[0], _Token) and core.take_kept() == []
    graph.close()


def test_the_replay_core_refuses_bad_arguments(driver: xa.Driver, device: pykka.ActorRef[Any]) -> None:
    ctx = device.ask(Attach())
    sid = ctx.runtime.stream_pool.acquire()
    stream = ctx.runtime.stream_pool.resolve(sid)
    with pytest.raises(ValueError, match="ring"):
        ReplayCore(driver, 0, stream, sid, None, None, False, 0)
    with pytest.raises(ValueError, match="together"):
        ReplayCore(driver, 0, stream, sid, ctx.runtime.prepare_block_use, None, False, 4)


def test_a_done_replay_reads_done_through_the_core(device: pykka.ActorRef[Any]) -> None:
    graph, b = _job(device)
    done = graph.replay()
    done.wait()
    assert done.done() and _values(b["host_out"]) == {3.0}
    graph.close()
    assert done.done()  # a closed graph's completions still answer
