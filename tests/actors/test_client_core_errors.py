"""The compiled client's error rules on its fast path (``ClientCore``), driven by a runtime that
fails on demand: what is raised, what is reported to the supervisor, and what the handle's
released flag says afterwards."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors._core import client_core
from xlog_actors._core.client_core import ClientCore
from xlog_actors._core.context_core import ContextCore
from xlog_actors._core.handles import TokenCell
from xlog_actors.memory.block import make_block
from xlog_actors.memory.stack import build_resource


class _State:
    def __init__(self) -> None:
        self.cell = TokenCell()


class _Runtime:
    """Hands out host-like blocks; ``fail`` (an exception) is raised by the next call instead."""

    def __init__(self) -> None:
        self.fail: BaseException | None = None
        self.next_ptr = 0x1000
        self.freed: list[Any] = []

    def allocate(self, nbytes: int, stream: Any, tag: Any) -> Any:
        if self.fail is not None:
            raise self.fail
        self.next_ptr += 0x1000
        return make_block(self.next_ptr, 0, stream, nbytes, 256, tag, xa.Generation(1))

    def deallocate(self, block: Any) -> None:
        if self.fail is not None:
            fail, self.fail = self.fail, None
            if isinstance(fail, xa.CorruptionDetected):
                self.freed.append(block)  # a guard frees the block before it reports
            raise fail
        self.freed.append(block)


class _Context(ContextCore):
    def _out_of_memory(self, exc: xa.OutOfMemory) -> xa.OutOfMemory:
        return xa.OutOfMemory(f"{exc} [with the stack's figures]", requested=exc.requested)

    def _send_wake(self, block: Any) -> None:
        pass


class _Lifecycle:
    __slots__ = ("_context",)


class _Cell:
    def __init__(self, lifecycle: _Lifecycle) -> None:
        self.lifecycle = lifecycle
        self.reports: list[tuple[BaseException, int]] = []

    def report_failure(self, error: BaseException, generation: int) -> None:
        self.reports.append((error, generation))


class _Client(ClientCore):
    def _allocate_slow(self, nbytes: int, stream: Any, tag: Any) -> str:
        return "slow"

    def _free_slow(self, ref: Any) -> str:
        return "slow"


@pytest.fixture
def rig() -> Any:
    state = _State()
    runtime = _Runtime()
    context = _Context(runtime, 3, weakref.ref(state), state.cell.token, xa.GpuRef)
    lifecycle = _Lifecycle()
    lifecycle._context = context
    cell = _Cell(lifecycle)
    client = _Client(cell, xa.GpuRef)
    yield client, cell, runtime, context, state
    context.open = False  # handles dropped after the test hand nothing over


def test_a_context_failure_met_by_an_allocation_is_reported_and_raised(rig: Any) -> None:
    client, cell, runtime, _context, _state = rig
    runtime.fail = xa.ContextLost("gone")
    with pytest.raises(xa.ContextLost, match="gone"):
        client.allocate(64)
    assert [(type(e), g) for e, g in cell.reports] == [(xa.ContextLost, 3)]


def test_out_of_memory_met_by_an_allocation_gets_the_stacks_figures(rig: Any) -> None:
    client, cell, runtime, _context, _state = rig
    runtime.fail = xa.OutOfMemory("no room", requested=64)
    with pytest.raises(xa.OutOfMemory, match=r"no room \[with the stack's figures\]") as info:
        client.allocate(64)
    assert info.value.__suppress_context__ and cell.reports == []


def test_an_allocation_error_after_the_context_went_is_retried_through_the_slow_path(rig: Any) -> None:
    client, cell, runtime, context, state = rig

    def fail_after_a_rebuild(nbytes: int, stream: Any, tag: Any) -> None:
        state.cell.token = object()  # a rebuild took the context away under the call
        raise xa.OutOfMemory("no room", requested=64)

    runtime.allocate = fail_after_a_rebuild
    context.rebind_runtime()
    assert client.allocate(64) == "slow", "the token moved under the call: the actor retries"
    assert cell.reports == []


def test_a_corrupted_guard_met_by_a_free_raises_and_the_handle_stays_released(rig: Any) -> None:
    client, cell, runtime, _context, _state = rig
    ref = client.allocate(64)
    runtime.fail = xa.CorruptionDetected("canaries", block=None)
    with pytest.raises(xa.CorruptionDetected):
        client.free(ref)
    assert ref._released and runtime.freed == [ref.block] and cell.reports == []
    assert client.free(ref) is None and len(runtime.freed) == 1, "released: a second free does nothing"


@pytest.mark.parametrize("error", [xa.ContextLost("gone"), xa.ContextPoisoned("bad")])
def test_a_context_failure_met_by_a_free_is_reported_and_the_handle_stays_usable(rig: Any, error: Exception) -> None:
    client, cell, runtime, _context, _state = rig
    ref = client.allocate(64)
    runtime.fail = error
    with pytest.raises(type(error)):
        client.free(ref)
    assert not ref._released and [(type(e), g) for e, g in cell.reports] == [(type(error), 3)]
    client.free(ref)
    assert ref._released and runtime.freed == [ref.block]


def test_a_free_error_after_the_context_went_is_dropped(rig: Any) -> None:
    client, cell, runtime, context, state = rig
    ref = client.allocate(64)

    def fail_after_a_rebuild(block: Any) -> None:
        state.cell.token = object()  # a rebuild took the context away under the call
        raise xa.ResourceError("the memory went with the context")

    runtime.deallocate = fail_after_a_rebuild
    context.rebind_runtime()
    assert client.free(ref) is None
    assert ref._released and cell.reports == []


def test_another_free_error_is_raised_and_the_handle_stays_usable(rig: Any) -> None:
    client, cell, runtime, _context, _state = rig
    ref = client.allocate(64)
    runtime.fail = xa.ResourceError("refused")
    with pytest.raises(xa.ResourceError, match="refused"):
        client.free(ref)
    assert not ref._released and cell.reports == []


# -- a block cache's context: the client's free asks the cache itself (context_release) ----------
@pytest.fixture
def cache_rig(host_driver: xa.HostDriver) -> Any:
    pool = xa.StreamPool(host_driver, 0)
    cache = build_resource("async+cache", host_driver, 0, pool)
    state = _State()
    context = _Context(cache, 3, weakref.ref(state), state.cell.token, xa.GpuRef)
    assert context.runtime_in_c
    lifecycle = _Lifecycle()
    lifecycle._context = context
    cell = _Cell(lifecycle)
    yield _Client(cell, xa.GpuRef), cell, cache, context, pool, state
    context.open = False
    pool.close()


def test_a_cache_free_error_is_raised_and_the_handle_stays_usable(cache_rig: Any) -> None:
    client, cell, cache, _context, pool, _state = cache_rig
    ref = client.allocate(4096)
    pool.close()  # the block's stream is gone: the cache refuses its free
    with pytest.raises(xa.StreamMisuse):
        client.free(ref)
    assert not ref._released and cell.reports == [] and cache.live_count() == 1


def test_a_cache_free_of_a_block_the_table_holds_goes_through_the_table(cache_rig: Any) -> None:
    client, _cell, cache, context, _pool, _state = cache_rig
    ref = client.allocate(4096)
    context.runtime = SimpleNamespace(allocate=lambda *args: cache.allocate(*args),
                                      deallocate=lambda block: cache.deallocate(block))
    context.rebind_runtime()  # no longer the cache's own methods: the table holds the live block
    context.runtime = cache
    context.rebind_runtime()  # the cache's own again: the block stays in the table
    assert context.runtime_in_c and context.live_count() == 1
    assert client.free(ref) is None
    assert ref._released and cache.live_count() == 0 and context.live_count() == 0
    again = client.allocate(4096)  # the same address, handed out again: freed once more
    client.free(again)
    assert again._released and cache.live_count() == 0


# -- the fast entries of allocate and free (client_core's end) --------------------------------
def test_the_fast_entries_take_positional_calls_and_leave_the_rest_to_cythons_parsing(rig: Any) -> None:
    client, _cell, _runtime, _context, _state = rig
    assert client_core._FAST_ENTRIES == 2, "both entries installed"
    s1, tag = xa.StreamId(1), xa.AllocTag("weights")
    default, untagged = xa.StreamId.DEFAULT, xa.AllocTag.UNTAGGED
    calls = {
        "one": (client.allocate(64), default, untagged),
        "two": (client.allocate(64, s1), s1, untagged),
        "three": (client.allocate(64, s1, tag), s1, tag),
        "keyword": (client.allocate(64, tag=tag), default, tag),
        "all keywords": (client.allocate(nbytes=64, stream=s1), s1, untagged),
        "unbound": (ClientCore.allocate(client, 64, s1), s1, untagged),
    }
    for name, (ref, stream, want_tag) in calls.items():
        assert (ref.block.nbytes, ref.block.alloc_stream, ref.block.tag) == (64, stream, want_tag), name
    refs = [ref for ref, _, _ in calls.values()]
    assert client.free(refs[0]) is None and client.free(ref=refs[1]) is None
    ClientCore.free(client, refs[2])
    assert [r._released for r in refs] == [True, True, True, False, False, False]
    for bad in (lambda: client.allocate(), lambda: client.allocate(64, s1, tag, 1), lambda: client.allocate(64, size=1),
                lambda: client.free(), lambda: client.free(refs[3], refs[4]), lambda: client.free(handle=refs[3]),
                lambda: ClientCore.allocate(object(), 64), lambda: ClientCore.free(object(), refs[3])):
        with pytest.raises(TypeError):
            bad()
    assert [r._released for r in refs] == [True, True, True, False, False, False]


def test_the_fast_entries_keep_the_methods_docs() -> None:
    assert ClientCore.allocate.__doc__.startswith(  # type: ignore[union-attr]
        "ClientCore.allocate(self, nbytes, stream=_DEFAULT_STREAM, tag=_UNTAGGED)\n\nAllocate one block")
    assert ClientCore.free.__doc__.startswith("ClientCore.free(self, ref)\n\nFree ``ref`` now")  # type: ignore[union-attr]
    assert ClientCore.allocate.__name__ == "allocate" and ClientCore.free.__qualname__ == "ClientCore.free"
