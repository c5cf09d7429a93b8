"""A stateful property test: hypothesis drives one ``DeviceActor`` on a fresh ``HostDriver``
through random sequences of allocations (good and bad), frees, releases, dropped handles,
tracked writes and reads through two ``CopyActor``s (two streams, so the cross-stream tracking
is what keeps the bytes right), rebuilds and injected faults. A plain-Python model says what
every handle holds and what the device must report; after every step the device's statistics
and every handle's ``access()`` are checked against it. The same machine runs again on a stack
with a block cache (``async+cache``), with rules of its own: allocations on the copiers' streams
(so kept blocks are reused across streams) and trims."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pykka
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import xlog_actors as xa
from xlog_actors.actors.messages import Attach

#: Emulated device memory.
MEMORY = 64 << 20
#: Largest valid allocation the machine asks for.
MAX_SIZE = 4 << 20
#: While the model's live bytes plus a request stay under this, the request must succeed; above
#: it (never near the device size) an ``OutOfMemory`` is accepted, since fragmentation of the
#: emulated address space is not modelled.
MUST_FIT = 32 << 20
#: Every ask waits at most this long: a hang is a failure, not a stuck test.
TIMEOUT = 10.0
TAGS = ("weights", "activations", "scratch")
#: Sizes that are not a positive int: ``InvalidRequest``, nothing changes.
BAD_SIZES: tuple[Any, ...] = (0, -1, -(1 << 20), 1.5, 4096.0, True, False, None, "64")
#: Stale handles kept after a rebuild.
KEEP_STALE = 3
#: The poisoning rule may run only after this many steps, so most sequences explore the rest.
STICKY_AFTER = 20

#: How a context is replaced: a ``Rebuild`` (with its reason after the word), or a lost context
#: met by the device actor's own allocation, by a copier's fill, or by a copier that must attach
#: again after a rebuild and meets the loss while attaching (one loss must give one rebuild: the
#: copier reports the generation it was attaching, and the device ignores a report about a
#: context it has already replaced).
CONTEXT_REPLACED_BY: tuple[str, ...] = (
    "rebuild",
    "rebuild: by hand",
    "rebuild: ünïcödé",
    "lost in allocate",
    "lost in fill",
    "lost in fill after rebuild",
)

sizes = st.one_of(st.integers(1, 4096), st.integers(4097, MAX_SIZE))
bad_sizes = st.sampled_from([*BAD_SIZES, MEMORY + 1, 1 << 40])
indices = st.integers(0, 1 << 16)
copiers = st.integers(0, 1)


@dataclass(frozen=True)
class _Nudge:
    """A message no actor understands: asking it makes a ``CopyActor`` let go of the previous
    message it handled (pykka keeps that envelope, and the handles in it, until the next one)."""


@dataclass
class Held:
    """One handle the test holds, and what the model says about it."""

    ref: xa.GpuRef
    generation: int
    released: bool
    data: npt.NDArray[np.uint8]
    known: npt.NDArray[np.bool_]  # bytes never written read back as anything


def pattern(seed: int, length: int) -> bytes:
    return ((np.arange(length, dtype=np.uint32) * 31 + seed) & 0xFF).astype(np.uint8).tobytes()


class DeviceMachine(RuleBasedStateMachine):
    #: The device's resource stack.
    RESOURCE = "async"

    def __init__(self) -> None:
        super().__init__()
        self.driver = xa.HostDriver(device_count=1, memory_per_device=MEMORY)
        # Restart intensity is not what this machine checks: a budget it never reaches.
        self.device = xa.DeviceActor.start(
            0, driver=self.driver, resource=self.RESOURCE, supervisor=xa.Supervisor(max_restarts=10_000)
        )
        self.copiers = [xa.CopyActor.start(self.device) for _ in range(2)]
        for copier in self.copiers:
            # on_start attaches (creates the copier's stream) in the copier's thread: wait for it,
            # or a fault injected next could be met there rather than by the step that injects it
            copier.proxy().stream_id.get(timeout=TIMEOUT)
        self.held: list[Held] = []
        self.generation = 0
        self.restarts = 0
        self.poisoned = False
        self.steps = 0

    def teardown(self) -> None:
        self.held.clear()
        for actor in [*self.copiers, self.device]:
            actor.stop(timeout=TIMEOUT)
        self.driver.close()

    # -- helpers -----------------------------------------------------------------------------------
    def ask(self, actor: pykka.ActorRef[Any], message: Any) -> Any:
        return actor.ask(message, timeout=TIMEOUT)

    def live(self, h: Held) -> bool:
        return not self.poisoned and h.generation == self.generation and not h.released

    def live_bytes(self) -> int:
        return sum(len(h.ref) for h in self.held if self.live(h))

    def stale_reason(self, h: Held) -> str | None:
        if self.poisoned:
            return "context poisoned"
        if h.generation != self.generation:
            return "context rebuilt"
        return "released" if h.released else None

    def expect(self, error: type[BaseException], call: Any, *args: Any) -> BaseException:
        try:
            result = call(*args)
        except error as exc:
            return exc
        raise AssertionError(f"expected {error.__name__}, got {result!r}")

    def expect_stale(self, reason: str, call: Any, *args: Any) -> None:
        exc = self.expect(xa.GpuRefStale, call, *args)
        assert exc.reason == reason, (exc.reason, reason)  # type: ignore[attr-defined]

    def adopt(self, ref: xa.GpuRef, size: int, tag: str) -> None:
        assert isinstance(ref, xa.GpuRef)
        assert (len(ref), ref.tag, ref.generation, ref.last_write_stream) == (size, tag, self.generation, None)
        self.held.append(Held(ref, self.generation, False, np.zeros(size, np.uint8), np.zeros(size, np.bool_)))

    def pick(self, i: int) -> Held:
        """A held handle: three times in four a live one where there is one, so that most work
        lands on memory that can be checked; else any, stale and released ones included."""
        live = [h for h in self.held if self.live(h)]
        choices = live if live and i % 4 else self.held
        return choices[i // 4 % len(choices)]

    def pick_live(self, i: int) -> Held | None:
        live = [h for h in self.held if self.live(h)]
        return live[i % len(live)] if live else None

    def before_fault(self) -> None:
        """Called right before a fault is injected for the next request to meet."""

    def rebuilt(self) -> None:
        self.generation += 1
        self.restarts += 1
        # A few stale handles are enough to check how they fail; the rest are dropped (their
        # memory went with the old context, so dropping them must change nothing either).
        stale = [h for h in self.held if h.generation != self.generation]
        for h in stale[:-KEEP_STALE]:
            self.held.remove(h)

    @initialize(many=st.lists(st.integers(1, 1 << 16), min_size=1, max_size=4), tag=st.sampled_from(TAGS))
    def start_with_some_handles(self, many: list[int], tag: str) -> None:
        refs = self.ask(self.device, xa.AllocateMany(many, tag=xa.AllocTag(tag)))
        for ref, size in zip(refs, many, strict=True):
            self.adopt(ref, size, tag)

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def accounting_matches_model(self) -> None:
        self.steps += 1
        s = self.ask(self.device, xa.GetStats())
        live = [h for h in self.held if self.live(h)]
        expected = (
            sum(len(h.ref) for h in live),
            len(live),
            self.generation,
            self.restarts,
            "poisoned" if self.poisoned else "running",
        )
        assert (s.bytes_outstanding, s.live_blocks, s.generation, s.restarts, s.status) == expected

    @invariant()
    def every_handle_validates_as_the_model_says(self) -> None:
        for h in self.held:
            reason = self.stale_reason(h)
            if reason is None:
                assert h.ref.access().nbytes == len(h.ref)
            else:
                self.expect_stale(reason, h.ref.access)

    # -- allocation --------------------------------------------------------------------------------
    def refuse_bad_request(self, message: Any, size: Any) -> None:
        """A size the device cannot take: its typed error, and nothing changes (the invariants)."""
        if type(size) is int and size > 0:
            exc = self.expect(xa.OutOfMemory, self.ask, self.device, message)
            assert exc.requested == size  # type: ignore[attr-defined]
        else:
            self.expect(xa.InvalidRequest, self.ask, self.device, message)

    @precondition(lambda self: not self.poisoned)
    @rule(size=sizes, tag=st.sampled_from(TAGS), bad=st.one_of(st.none(), bad_sizes))
    def allocate(self, size: int, tag: str, bad: Any) -> None:
        """Allocate ``size`` bytes, after asking for a ``bad`` size first when there is one."""
        if bad is not None:
            self.refuse_bad_request(xa.Allocate(bad), bad)
        self.allocate_one(size, tag)

    def allocate_one(self, size: int, tag: str) -> None:
        must_fit = self.live_bytes() + size <= MUST_FIT
        try:
            ref = self.ask(self.device, xa.Allocate(size, tag=xa.AllocTag(tag)))
        except xa.OutOfMemory:
            assert not must_fit, f"{size} bytes refused with {self.live_bytes()} live"
            return
        self.adopt_if_it_had_to_fit(must_fit, [ref], [size], tag)

    def adopt_if_it_had_to_fit(self, must_fit: bool, refs: list[xa.GpuRef], sizes: list[int], tag: str) -> None:
        """Adopt what a request gave, where it had to fit; else check it and free it at once.
        Past what must fit, whether a request fits depends on the emulated address space and on
        when queued frees ran: the model must not depend on it, since hypothesis replays a
        sequence of rules expecting the same machine (the same rules enabled) each time."""
        for ref, size in zip(refs, sizes, strict=True):
            self.adopt(ref, size, tag)
        if not must_fit:
            for held in self.held[-len(refs):]:
                assert self.ask(self.device, xa.Free(held.ref)) is None
            del self.held[-len(refs):]

    @precondition(lambda self: not self.poisoned)
    @rule(
        many=st.lists(st.integers(1, 1 << 20), max_size=4),
        tag=st.sampled_from(TAGS),
        bad=st.one_of(st.none(), st.tuples(st.integers(0, 4), bad_sizes)),
    )
    def allocate_many(self, many: list[int], tag: str, bad: tuple[int, Any] | None) -> None:
        """All or none: ``many`` with one ``bad`` size put in at a place gets nothing; then
        ``many`` itself."""
        if bad is not None:
            at, size = bad
            self.refuse_bad_request(xa.AllocateMany([*many[:at], size, *many[at:]]), size)
        self.allocate_many_at_once(many, tag)

    def allocate_many_at_once(self, many: list[int], tag: str) -> None:
        must_fit = self.live_bytes() + sum(many) <= MUST_FIT
        try:
            refs = self.ask(self.device, xa.AllocateMany(many, tag=xa.AllocTag(tag)))
        except xa.OutOfMemory:
            assert not must_fit
            return
        assert isinstance(refs, list) and len(refs) == len(many)
        assert len({r.raw_device_ptr() for r in refs}) == len(refs)
        self.adopt_if_it_had_to_fit(must_fit, refs, many, tag)

    @precondition(lambda self: not self.poisoned)
    @rule(size=sizes)
    def drop_a_handle_a_refused_request_saw(self, size: int) -> None:
        """A refused request's traceback holds the helper's frame and its ``ref``: the device
        actor must not keep that exception (as its last error), or dropping the handle would
        free nothing."""
        self.allocate_then_ask_a_bad_request(size)
        self.drop(len(self.held) - 1)

    def allocate_then_ask_a_bad_request(self, size: int) -> None:
        ref = self.ask(self.device, xa.Allocate(size))
        self.adopt(ref, size, xa.AllocTag.UNTAGGED)
        self.refuse_bad_request(xa.Allocate(0), 0)

    # -- ways a handle goes --------------------------------------------------------------------------
    @precondition(lambda self: self.held)
    @rule(i=indices, times=st.integers(1, 2))
    def free(self, i: int, times: int) -> None:
        h = self.pick(i)
        for _ in range(times):
            assert self.ask(self.device, xa.Free(h.ref)) is None
        h.released = True

    @precondition(lambda self: self.held)
    @rule(i=indices, times=st.integers(1, 2))
    def release(self, i: int, times: int) -> None:
        h = self.pick(i)
        for _ in range(times):
            h.ref.release()
        h.released = True
        assert h.ref.released

    @precondition(lambda self: self.held)
    @rule(i=indices)
    def drop_last_reference(self, i: int) -> None:
        self.drop(i % len(self.held))

    def drop(self, index: int) -> None:
        del self.held[index]
        for copier in self.copiers:
            self.expect(xa.InvalidRequest, self.ask, copier, _Nudge())
        gc.collect()  # an exception caught earlier may keep the handle in a reference cycle

    # -- tracked writes and reads ----------------------------------------------------------------------
    def check_copy(self, h: Held, call: Any, *args: Any) -> bool:
        """Run a copy on ``h``: it must succeed if the model says ``h`` is live, else fail stale."""
        reason = self.stale_reason(h)
        if reason is None:
            call(*args)
            return True
        self.expect_refused(reason, call, *args)
        return False

    def expect_refused(self, reason: str, call: Any, *args: Any) -> None:
        """A copier refuses work on a stale handle; on a poisoned device it cannot even attach."""
        if self.poisoned:
            self.expect(xa.ContextPoisoned, call, *args)
        else:
            self.expect_stale(reason, call, *args)

    def slow_down(self, c: int, h: Held, microseconds: int) -> None:
        """Queue a spin on copier ``c``'s stream, so its next work finishes well after its reply
        and only the tracking keeps the other copier (and the allocator) from racing it."""
        copier = self.copiers[c]
        self.ask(copier, xa.CopyToHost(h.ref, nbytes=1))  # attached to the current context
        ctx = self.ask(self.device, Attach())
        stream = ctx.runtime.stream_pool.resolve(copier.proxy().stream_id.get(timeout=TIMEOUT))
        assert stream is not None
        self.driver.sleep(stream, microseconds)

    @precondition(lambda self: self.held)
    @rule(i=indices, c=copiers, byte=st.integers(0, 255), slow_us=st.sampled_from([0, 3000]))
    def fill(self, i: int, c: int, byte: int, slow_us: int) -> None:
        h = self.pick(i)
        if slow_us and self.live(h):
            self.slow_down(c, h, slow_us)
        if self.check_copy(h, self.ask, self.copiers[c], xa.Fill(h.ref, byte)):
            h.data[:] = byte
            h.known[:] = True

    @precondition(lambda self: self.held)
    @rule(i=indices, c=copiers, eighths=st.integers(1, 8), seed=st.integers(0, 255))
    def copy_to_device(self, i: int, c: int, eighths: int, seed: int) -> None:
        h = self.pick(i)
        length = max(1, len(h.ref) * eighths // 8)
        data = pattern(seed, length)
        if self.check_copy(h, self.ask, self.copiers[c], xa.CopyToDevice(h.ref, data)):
            h.data[:length] = np.frombuffer(data, np.uint8)
            h.known[:length] = True

    @precondition(lambda self: self.held)
    @rule(
        i=indices,
        c=copiers,
        bad=st.sampled_from(["byte -1", "byte 256", "byte True", "no data", "too long", "read 0", "read too much"]),
    )
    def copy_with_a_bad_payload(self, i: int, c: int, bad: str) -> None:
        """Refused before the handle is even validated, whatever its state: nothing changes."""
        ref = self.pick(i).ref
        message = {
            "byte -1": xa.Fill(ref, -1),
            "byte 256": xa.Fill(ref, 256),
            "byte True": xa.Fill(ref, True),
            "no data": xa.CopyToDevice(ref, b""),
            "too long": xa.CopyToDevice(ref, bytes(len(ref) + 1)),
            "read 0": xa.CopyToHost(ref, nbytes=0),
            "read too much": xa.CopyToHost(ref, nbytes=len(ref) + 1),
        }[bad]
        self.expect(xa.InvalidRequest, self.ask, self.copiers[c], message)

    @precondition(lambda self: self.held)
    @rule(i=indices, j=indices, c=copiers)
    def copy_device_to_device(self, i: int, j: int, c: int) -> None:
        src, dst = self.pick(i), self.pick(j)
        message = xa.CopyDeviceToDevice(src.ref, dst.ref)
        if len(src.ref) > len(dst.ref) or src is dst:
            self.expect(xa.InvalidRequest, self.ask, self.copiers[c], message)
            return
        # the source is validated first: its reason wins
        reason = self.stale_reason(src) or self.stale_reason(dst)
        if reason is not None:
            self.expect_refused(reason, self.ask, self.copiers[c], message)
            return
        self.ask(self.copiers[c], message)
        n = len(src.ref)
        dst.data[:n] = src.data
        dst.known[:n] = src.known

    @precondition(lambda self: self.held)
    @rule(i=indices, c=copiers)
    def copy_to_host(self, i: int, c: int) -> None:
        h = self.pick(i)
        reason = self.stale_reason(h)
        if reason is not None:
            self.expect_refused(reason, self.ask, self.copiers[c], xa.CopyToHost(h.ref))
            return
        got = np.frombuffer(self.ask(self.copiers[c], xa.CopyToHost(h.ref)), np.uint8)
        assert len(got) == len(h.ref)
        wrong = np.flatnonzero((got != h.data) & h.known)
        assert wrong.size == 0, (
            f"{h.ref!r}: {wrong.size} bytes differ from the last write, first at {wrong[0]}: "
            f"read {got[wrong[0]]}, wrote {h.data[wrong[0]]}"
        )

    # -- rebuilds and faults ---------------------------------------------------------------------------
    @precondition(lambda self: not self.poisoned)
    @rule(
        kind=st.sampled_from(["oom", "error"]),
        op=st.sampled_from(["allocate", "allocate_many", "free"]),
        i=indices,
        size=sizes,
    )
    def transient_fault(self, kind: str, op: str, i: int, size: int) -> None:
        """The faulted call fails with its typed error and nothing changes (the invariants)."""
        self.fault_one_request(kind, op, i, size)

    def fault_one_request(self, kind: str, op: str, i: int, size: int) -> None:
        error = xa.OutOfMemory if kind == "oom" else xa.DriverError
        victim = self.pick_live(i) if op == "free" else None
        if victim is not None:
            message: Any = xa.Free(victim.ref)
        elif op == "allocate_many":
            message = xa.AllocateMany([size, 64])
        else:
            message = xa.Allocate(size)
        self.before_fault()
        self.driver.inject_fault(0, kind, after_calls=0)  # type: ignore[arg-type]
        exc = self.expect(error, self.ask, self.device, message)
        assert not isinstance(exc, xa.ContextLost)
        if victim is not None:  # the failed free left the handle usable
            assert not victim.ref.released and victim.ref.access().nbytes == len(victim.ref)

    def rebuild(self, reason: str) -> None:
        assert self.ask(self.device, xa.Rebuild(reason)) == self.generation + 1
        self.rebuilt()

    @precondition(lambda self: not self.poisoned)
    @rule(how=st.sampled_from(CONTEXT_REPLACED_BY), i=indices, c=copiers)
    def replace_context(self, how: str, i: int, c: int) -> None:
        """A ``Rebuild`` request, or a lost context met by the device actor's own allocation or
        by a copier's fill: the supervisor rebuilds behind the same ActorRef, one generation up,
        and every older handle is stale."""
        if how.startswith("rebuild"):
            self.rebuild(how.removeprefix("rebuild").removeprefix(": "))
            return
        copier = self.copiers[c]
        if how == "lost in fill after rebuild":
            # a copier told of a rebuild attaches again on its next work: the loss meets it there
            self.rebuild("detach the copiers")
            self.allocate_one(64, TAGS[0])
        victim = self.pick_live(i) if how.startswith("lost in fill") else None
        if victim is not None and how == "lost in fill":
            self.ask(copier, xa.CopyToHost(victim.ref, nbytes=1))  # attached: the loss meets the fill
        self.before_fault()
        self.driver.inject_fault(0, "context_lost", after_calls=0)
        if victim is not None:
            self.expect(xa.ContextLost, self.ask, copier, xa.Fill(victim.ref, 1))
        else:
            self.expect(xa.ContextLost, self.ask, self.device, xa.Allocate(64))
        self.rebuilt()

    @precondition(lambda self: not self.poisoned and self.steps >= STICKY_AFTER)
    @rule()
    def poison(self) -> None:
        """A sticky error ends the device's useful life in this process: the last state."""
        self.before_fault()
        self.driver.inject_fault(0, "sticky", after_calls=0)
        self.expect(xa.ContextPoisoned, self.ask, self.device, xa.Allocate(64))
        self.poisoned = True

    @precondition(lambda self: self.poisoned)
    @rule(request=st.sampled_from([xa.Allocate(64), xa.AllocateMany([64]), xa.Rebuild("again"), xa.Allocate(0)]))
    def poisoned_device_refuses(self, request: Any) -> None:
        self.expect(xa.ContextPoisoned, self.ask, self.device, request)


DeviceMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDeviceMachine = DeviceMachine.TestCase


class CachedDeviceMachine(DeviceMachine):
    """The machine on a stack with a block cache: every free keeps its block, later allocations
    take kept blocks back (on the copiers' streams too: across streams), trims give them back,
    a rebuild leaves nothing kept. The model and its invariants are the same: what the user
    holds, and every byte written, whatever the cache keeps."""

    RESOURCE = "async+cache"

    def cache_figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = self.ask(self.device, xa.GetStats()).report["block_cache"]
        return figures

    @invariant()
    def the_cache_keeps_whole_blocks(self) -> None:
        if self.poisoned:
            return
        f = self.cache_figures()
        assert f["cached_bytes"] >= 0 and f["cached_blocks"] >= 0
        assert (f["cached_bytes"] == 0) == (f["cached_blocks"] == 0)

    @precondition(lambda self: not self.poisoned)
    @rule(size=sizes, tag=st.sampled_from(TAGS), c=copiers)
    def allocate_on_a_copier_stream(self, size: int, tag: str, c: int) -> None:
        """An allocation ordered on a copier's stream: kept blocks of the default stream come
        back here only once their fence completed."""
        sid = self.copiers[c].proxy().stream_id.get(timeout=TIMEOUT)
        must_fit = self.live_bytes() + size <= MUST_FIT
        try:
            ref = self.ask(self.device, xa.Allocate(size, stream=sid, tag=xa.AllocTag(tag)))
        except xa.StreamMisuse:
            return  # the copier's stream went with a rebuild and it has not attached again yet
        except xa.OutOfMemory:
            assert not must_fit
            return
        self.adopt_if_it_had_to_fit(must_fit, [ref], [size], tag)

    @precondition(lambda self: not self.poisoned)
    @rule()
    def trim(self) -> None:
        ctx = self.ask(self.device, Attach())
        ctx.runtime.trim_caches()
        assert self.cache_figures()["cached_bytes"] == 0

    def rebuild(self, reason: str) -> None:
        super().rebuild(reason)
        assert self.cache_figures()["cached_bytes"] == 0

    def before_fault(self) -> None:
        """A request served from kept blocks makes no driver call to fail: the cache is trimmed
        first, so the request that must meet the fault reaches the driver."""
        self.trim()

    def fault_one_request(self, kind: str, op: str, i: int, size: int) -> None:
        # A free into the cache makes no driver call either: the faulted request is an allocation.
        super().fault_one_request(kind, "allocate" if op == "free" else op, i, size)


CachedDeviceMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCachedDeviceMachine = CachedDeviceMachine.TestCase
