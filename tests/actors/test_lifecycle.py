"""``DeviceLifecycle`` on its own, without pykka: every allowed transition, every refused one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from xlog_actors.actors.device_state import DeviceState
from xlog_actors.actors.lifecycle import DeviceLifecycle, DeviceStatus
from xlog_actors.errors import IllegalTransition, XlogError

S = DeviceStatus
CTX = "a context"

#: How to bring a fresh lifecycle into each status.
PATHS: dict[DeviceStatus, list[str]] = {
    S.STARTING: [],
    S.RUNNING: ["built"],
    S.REBUILDING: ["built", "begin_rebuild"],
    S.BROKEN: ["built", "begin_rebuild", "rebuild_failed"],
    S.POISONED: ["built", "poison"],
    S.STOPPED: ["built", "stop"],
}

#: (from, event) -> to, for every allowed transition.
ALLOWED: dict[tuple[DeviceStatus, str], DeviceStatus] = {
    (S.STARTING, "built"): S.RUNNING,
    (S.STARTING, "begin_rebuild"): S.REBUILDING,
    (S.STARTING, "poison"): S.POISONED,
    (S.STARTING, "stop"): S.STOPPED,
    (S.RUNNING, "begin_rebuild"): S.REBUILDING,
    (S.RUNNING, "poison"): S.POISONED,
    (S.RUNNING, "stop"): S.STOPPED,
    (S.REBUILDING, "built"): S.RUNNING,
    (S.REBUILDING, "rebuild_failed"): S.BROKEN,
    (S.REBUILDING, "poison"): S.POISONED,
    (S.REBUILDING, "stop"): S.STOPPED,
    (S.BROKEN, "begin_rebuild"): S.REBUILDING,
    (S.BROKEN, "poison"): S.POISONED,
    (S.BROKEN, "stop"): S.STOPPED,
    (S.POISONED, "stop"): S.STOPPED,
}
EVENTS = ["built", "begin_rebuild", "rebuild_failed", "poison", "stop"]


def fire(lifecycle: DeviceLifecycle[str], event: str) -> object:
    action: Callable[..., object] = getattr(lifecycle, event)
    return action(CTX) if event == "built" else action()


def in_status(status: DeviceStatus) -> DeviceLifecycle[str]:
    lifecycle: DeviceLifecycle[str] = DeviceLifecycle(DeviceState(3))
    for event in PATHS[status]:
        fire(lifecycle, event)
    assert lifecycle.status is status
    return lifecycle


def snapshot(lifecycle: DeviceLifecycle[str]) -> tuple[object, ...]:
    state = lifecycle.state
    return (
        lifecycle.status, lifecycle.context, lifecycle.restarts,
        state.generation, state.accepting_ops, state.poisoned, state.token,
    )


def test_a_new_lifecycle_is_starting_without_a_context() -> None:
    lifecycle: DeviceLifecycle[str] = DeviceLifecycle(DeviceState(0))
    state = lifecycle.state
    assert (lifecycle.status, lifecycle.context, state.generation, lifecycle.restarts) == (S.STARTING, None, 0, 0)
    assert lifecycle.needs_build and not lifecycle.ended
    assert DeviceStatus.RUNNING.value == "running" and DeviceStatus.STOPPED == "stopped"


@pytest.mark.parametrize(("start", "event"), list(ALLOWED), ids=lambda v: getattr(v, "value", v))
def test_every_allowed_transition(start: DeviceStatus, event: str) -> None:
    lifecycle = in_status(start)
    generation, restarts = lifecycle.state.generation, lifecycle.restarts
    returned = fire(lifecycle, event)
    end = ALLOWED[(start, event)]
    assert lifecycle.status is end
    # a context is present exactly while running
    assert (lifecycle.context is not None) == (end is S.RUNNING)
    state = lifecycle.state
    if event == "begin_rebuild":
        assert returned == ((CTX if start is S.RUNNING else None), generation + 1)
        assert lifecycle.state.generation == generation + 1
    else:
        assert lifecycle.state.generation == generation
    if event == "built":
        assert lifecycle.restarts == restarts + (1 if start is S.REBUILDING else 0)
    else:
        assert lifecycle.restarts == restarts
    if event in ("poison", "stop"):
        assert returned == (CTX if start is S.RUNNING else None)
    assert state.poisoned == (end is S.POISONED or start is S.POISONED)
    assert state.accepting_ops == (end is not S.STOPPED)
    assert lifecycle.ended == (end in (S.POISONED, S.STOPPED))
    assert lifecycle.needs_build == (end in (S.STARTING, S.BROKEN))


ILLEGAL = [(status, event) for status in S for event in EVENTS if (status, event) not in ALLOWED]


@pytest.mark.parametrize(("start", "event"), ILLEGAL, ids=lambda v: getattr(v, "value", v))
def test_every_illegal_transition_is_refused_and_changes_nothing(start: DeviceStatus, event: str) -> None:
    lifecycle = in_status(start)
    before = snapshot(lifecycle)
    with pytest.raises(IllegalTransition) as info:
        fire(lifecycle, event)
    assert isinstance(info.value, XlogError)
    assert (info.value.current, info.value.event) == (start.value, event)
    assert event in str(info.value) and start.value in str(info.value) and "device 3" in str(info.value)
    assert snapshot(lifecycle) == before


def test_the_illegal_list_covers_the_terminal_statuses() -> None:
    # poisoned and stopped are left only by stop (poisoned) or never (stopped)
    assert {e for s, e in ILLEGAL if s is S.STOPPED} == set(EVENTS)
    assert {e for s, e in ILLEGAL if s is S.POISONED} == set(EVENTS) - {"stop"}
    assert len(ALLOWED) + len(ILLEGAL) == len(S) * len(EVENTS)


def test_a_rebuild_cycle_makes_every_older_handle_token_stale() -> None:
    lifecycle = in_status(S.RUNNING)
    token = lifecycle.state.token
    old, generation = lifecycle.begin_rebuild()
    assert old == CTX and generation == 1 and lifecycle.state.token is not token
    lifecycle.rebuild_failed()
    lifecycle.begin_rebuild()
    lifecycle.built("new")
    state = lifecycle.state
    assert (lifecycle.status, lifecycle.context, state.generation, lifecycle.restarts) == (S.RUNNING, "new", 2, 1)
    assert "status=running" in repr(lifecycle) and "generation=2" in repr(lifecycle)


def test_the_lifecycle_module_imports_no_actor_machinery() -> None:
    import ast

    import xlog_actors.actors.lifecycle as module

    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not any("pykka" in name or "actor" in name for name in imported), imported


class _Watcher:
    def __init__(self, state: DeviceState, fail: bool = False) -> None:
        self.state = state
        self.seen: list[int] = []
        self.fail = fail

    def changed(self) -> None:
        self.seen.append(self.state.generation)
        if self.fail:
            raise RuntimeError("watcher failed")


def test_state_watchers_are_told_of_every_change_after_it_and_held_weakly(caplog: pytest.LogCaptureFixture) -> None:
    import gc
    import weakref

    state = DeviceState(0)
    failing, watcher, dropped = _Watcher(state, fail=True), _Watcher(state), _Watcher(state)
    for w in (failing, watcher, dropped):
        state.add_watcher(w.changed)
    gone = weakref.ref(dropped)
    del dropped, w
    gc.collect()
    assert gone() is None  # the state does not keep a watcher alive
    state.bump_generation()
    assert watcher.seen == [1] and failing.seen == [1]  # told after the change; a failure stops no one
    assert "a state watcher failed" in caplog.text
    state.poison()
    state.begin_shutdown()
    assert watcher.seen == [1, 1, 1]
    state.remove_watcher(watcher.changed)
    state.remove_watcher(watcher.changed)  # not watching: nothing happens
    state.bump_generation()
    assert watcher.seen == [1, 1, 1] and failing.seen == [1, 1, 1, 2]
    with pytest.raises(TypeError):
        state.add_watcher(print)  # not a bound method: cannot be held weakly
