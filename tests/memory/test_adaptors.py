"""Adaptors: statistics, logging, budget, guard, the memory report.

Cases from RMM's adaptor tests (statistics empty / all freed / peak; limiting over the limit,
rollback on upstream failure, back under the limit after frees; logging header and rows), plus
what RMM gets wrong or lacks: pending frees counted by the budget until reaped, a planted write
past the end caught by the guard, and every adaptor composed with every other over both bases.
Most run on the host driver; those taking the ``driver`` fixture also run on a GPU where one is
reachable.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import xlog_actors as xa
from xlog_actors.memory.adaptors import (
    CANARY_PATTERN,
    LOG_ENV,
    LOG_HEADER,
    BudgetResource,
    GuardResource,
    LoggingResource,
    ResourceAdaptor,
    StatisticsResource,
)
from xlog_actors.memory.report import enrich_out_of_memory, memory_report
from xlog_actors.memory.sizes import format_size, human_bytes, parse_size
from xlog_actors.memory.stack import ADAPTORS, build_resource

KiB = 1 << 10
MiB = 1 << 20
W = xa.AllocTag("weights")
A = xa.AllocTag("activations")


# -- helpers ----------------------------------------------------------------------------------
@pytest.fixture
def pool(host_driver: xa.HostDriver) -> Iterator[xa.StreamPool]:
    p = xa.StreamPool(host_driver, 0)
    yield p
    p.close()


def base(kind: str, driver: xa.Driver, pool: xa.StreamPool) -> xa.DeviceMemoryResource:
    if kind == "async":
        return xa.AsyncCudaResource(driver, 0, pool)
    return xa.DirectCudaResource(driver, 0)


class Counting(ResourceAdaptor):
    """Counts the calls that reach it; optionally turns ``reap_pending`` into a no-op, to show
    what the budget does when reaping cannot release anything."""

    def __init__(self, upstream: xa.DeviceMemoryResource, reap: bool = True) -> None:
        super().__init__(upstream)
        self.allocs = 0
        self.reaps = 0
        self._reap = reap

    def allocate(
        self,
        nbytes: int,
        stream: xa.StreamId = xa.StreamId.DEFAULT,
        tag: xa.AllocTag = xa.AllocTag.UNTAGGED,
    ) -> xa.DeviceBlock:
        self.allocs += 1
        return super().allocate(nbytes, stream, tag)

    def reap_pending(self) -> None:
        self.reaps += 1
        if self._reap:
            super().reap_pending()


class Snoop(ResourceAdaptor):
    """Copies a block's bytes to the host at the moment its free reaches this layer."""

    def __init__(
        self, upstream: xa.DeviceMemoryResource, driver: xa.Driver, stream: xa.Stream
    ) -> None:
        super().__init__(upstream)
        self.seen: list[bytes] = []
        self._driver = driver
        self._stream = stream

    def deallocate(self, block: xa.DeviceBlock) -> None:
        data = self._driver.copy_to_host(block.ptr, block.nbytes, self._stream)
        self._stream.synchronize()
        self.seen.append(bytes(data))
        super().deallocate(block)


def write_read(driver: xa.Driver, stream: xa.Stream, block: xa.DeviceBlock, byte: int) -> bytes:
    payload = bytes([byte]) * block.nbytes
    driver.copy_to_device(block.ptr, payload, stream)
    out = driver.copy_to_host(block.ptr, block.nbytes, stream)
    stream.synchronize()
    return bytes(out)


# -- statistics -------------------------------------------------------------------------------
def test_statistics_empty(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    stats = StatisticsResource(base("async", host_driver, pool)).statistics()
    assert (stats.current_bytes, stats.current_count, stats.peak_bytes, stats.peak_count) == (
        0,
        0,
        0,
        0,
    )
    assert (stats.total_bytes, stats.total_count) == (0, 0)
    assert dict(stats.by_tag) == {}


@pytest.mark.parametrize("kind", ["async", "direct"])
def test_statistics_all_freed(host_driver: xa.HostDriver, pool: xa.StreamPool, kind: str) -> None:
    res = StatisticsResource(base(kind, host_driver, pool))
    sizes = [1, 255, 256, 4 * KiB, 100_000]
    blocks = [res.allocate(n, tag=W if i % 2 else A) for i, n in enumerate(sizes)]
    mid = res.statistics()
    assert (mid.current_bytes, mid.current_count) == (sum(sizes), len(sizes))
    for b in blocks:
        res.deallocate(b)
    s = res.statistics()
    assert (s.current_bytes, s.current_count) == (0, 0)
    assert (s.peak_bytes, s.peak_count) == (sum(sizes), len(sizes))
    assert (s.total_bytes, s.total_count) == (sum(sizes), len(sizes))
    assert s.by_tag[W].total_bytes == 255 + 4 * KiB and s.by_tag[W].total_count == 2
    assert s.by_tag[A].total_bytes == 1 + 256 + 100_000 and s.by_tag[A].peak_count == 3
    assert all(f.current_bytes == 0 and f.current_count == 0 for f in s.by_tag.values())


def test_statistics_peak_bytes_and_count_are_separate(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = StatisticsResource(base("async", host_driver, pool))
    small = [res.allocate(256, tag=A) for _ in range(10)]  # peak count 10, 2560 bytes
    for b in small:
        res.deallocate(b)
    big = res.allocate(MiB, tag=W)  # peak bytes 1 MiB with a count of 1
    s = res.statistics()
    assert s.peak_count == 10 and s.peak_bytes == MiB
    assert s.current_count == 1 and s.current_bytes == MiB
    assert s.by_tag[A].peak_bytes == 2560 and s.by_tag[A].current_count == 0
    assert s.by_tag[W].peak_bytes == MiB
    res.deallocate(big)
    assert res.statistics().peak_bytes == MiB


def test_statistics_failed_calls_change_nothing(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = StatisticsResource(base("async", host_driver, pool))
    kept = res.allocate(KiB, tag=W)
    before = res.statistics()
    host_driver.inject_fault(0, "oom")
    with pytest.raises(xa.OutOfMemory):
        res.allocate(KiB, tag=W)
    with pytest.raises(xa.InvalidRequest):
        res.allocate(0)
    res.deallocate(kept)
    with pytest.raises(xa.UseAfterFree):
        res.deallocate(kept)
    after = res.statistics()
    assert after.total_count == before.total_count == 1
    assert after.current_count == 0 and after.by_tag[W].current_bytes == 0


def test_statistics_consistent_under_concurrency(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = StatisticsResource(base("async", host_driver, pool))
    threads, rounds = 8, 200

    def work(i: int) -> None:
        tag = xa.AllocTag(f"t{i % 3}")
        for r in range(rounds):
            b = res.allocate(256 + r % 7, tag=tag)
            res.deallocate(b)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s = res.statistics()
    assert s.current_count == 0 and s.current_bytes == 0
    assert s.total_count == threads * rounds
    assert s.total_bytes == threads * sum(256 + r % 7 for r in range(rounds))
    assert 1 <= s.peak_count <= threads
    assert sum(f.total_count for f in s.by_tag.values()) == s.total_count
    res.reap_pending()
    assert res.bytes_outstanding() == 0


def test_statistics_enrich_out_of_memory(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = StatisticsResource(base("direct", host_driver, pool))
    held = [res.allocate(20 * MiB, tag=W), res.allocate(10 * MiB, tag=A)]
    with pytest.raises(xa.OutOfMemory) as info:
        res.allocate(40 * MiB, tag=A)
    msg = str(info.value)
    assert info.value.requested == 40 * MiB
    assert "asked for 40.0 MiB" in msg and "device free" in msg and "direct+stats" in msg
    assert msg.index("weights 20.0 MiB in 1 blocks") < msg.index("activations 10.0 MiB")
    assert info.value.free is not None
    # idempotent: enriching again appends nothing
    assert str(enrich_out_of_memory(info.value, res)) == msg
    for b in held:
        res.deallocate(b)


# -- budget -----------------------------------------------------------------------------------
def test_budget_over_limit_refused_before_upstream(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    counting = Counting(base("direct", host_driver, pool))
    res = BudgetResource(counting, 64 * KiB)
    held = res.allocate(48 * KiB)
    with pytest.raises(xa.BudgetExceeded) as info:
        res.allocate(32 * KiB, tag=W)
    err = info.value
    assert isinstance(err, xa.OutOfMemory)
    assert (err.requested, err.limit, err.outstanding) == (32 * KiB, 64 * KiB, 48 * KiB)
    assert "weights" in str(err) and "budget" in str(err)
    assert counting.allocs == 1 and host_driver.live_allocations(0) == 1
    assert counting.reaps == 1  # an over-budget request reaps once before refusing
    with pytest.raises(xa.BudgetExceeded):
        res.allocate(65 * KiB)  # larger than the whole budget: refused without reaping
    assert counting.reaps == 1 and counting.allocs == 1
    res.allocate(16 * KiB)  # exactly up to the limit
    assert res.available() == 0
    res.deallocate(held)


def test_budget_rollback_on_upstream_failure(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = BudgetResource(base("async", host_driver, pool), 64 * KiB)
    assert res.available() == 64 * KiB
    host_driver.inject_fault(0, "oom")
    with pytest.raises(xa.OutOfMemory) as info:
        res.allocate(32 * KiB)
    assert not isinstance(info.value, xa.BudgetExceeded)
    assert res.available() == 64 * KiB and res.bytes_outstanding() == 0
    host_driver.inject_fault(0, "error")
    with pytest.raises(xa.DriverError):
        res.allocate(32 * KiB)
    assert res.available() == 64 * KiB
    with pytest.raises(xa.InvalidRequest):
        res.allocate(-1)
    block = res.allocate(64 * KiB)  # the whole budget is still there
    res.deallocate(block)


def test_budget_back_under_the_limit_after_frees(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = BudgetResource(base("direct", host_driver, pool), 4 * KiB)
    blocks = [res.allocate(KiB) for _ in range(4)]
    with pytest.raises(xa.BudgetExceeded):
        res.allocate(KiB)
    res.deallocate(blocks.pop())
    blocks.append(res.allocate(KiB))
    for b in blocks:
        res.deallocate(b)
    assert res.bytes_outstanding() == 0 and res.available() == 4 * KiB


def test_budget_counts_pending_frees_until_reaped(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    async_res = base("async", host_driver, pool)
    no_reap = Counting(async_res, reap=False)
    res = BudgetResource(no_reap, MiB)
    stream = pool.resolve(xa.StreamId.DEFAULT)
    assert stream is not None
    block = res.allocate(MiB)
    host_driver.sleep(stream, 50_000)  # the free stays queued behind a slow stream
    res.deallocate(block)
    assert res.bytes_outstanding() == MiB  # pending, not live
    assert res.available() == 0
    with pytest.raises(xa.BudgetExceeded) as info:
        res.allocate(KiB)
    assert info.value.outstanding == MiB and no_reap.reaps == 1
    async_res.reap_pending()
    assert res.available() == MiB
    res.deallocate(res.allocate(MiB))


def test_budget_reaps_then_retries(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    counting = Counting(base("async", host_driver, pool))
    res = BudgetResource(counting, MiB)
    stream = pool.resolve(xa.StreamId.DEFAULT)
    assert stream is not None
    block = res.allocate(MiB)
    host_driver.sleep(stream, 20_000)
    res.deallocate(block)
    assert res.bytes_outstanding() == MiB
    again = res.allocate(MiB)  # over the budget until the reap released the pending free
    assert counting.reaps == 1 and res.bytes_outstanding() == MiB
    res.deallocate(again)


def test_budget_never_overshoots_under_concurrency(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    stats = StatisticsResource(base("async", host_driver, pool))
    res = BudgetResource(stats, 16 * KiB)
    refused = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal refused
        for _ in range(100):
            try:
                b = res.allocate(KiB)
            except xa.BudgetExceeded:
                with lock:
                    refused += 1
                continue
            res.deallocate(b)

    ts = [threading.Thread(target=work) for _ in range(24)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert stats.statistics().peak_bytes <= 16 * KiB
    assert stats.statistics().total_count + refused == 24 * 100
    res.reap_pending()
    assert res.bytes_outstanding() == 0


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1000000", 1_000_000),
        ("1.5G", 3 << 29),
        ("2KB", 2000),
        (" 4 kib ", 4096),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes
    assert parse_size(format_size(nbytes)) == nbytes


@pytest.mark.parametrize("text", ["", "0", "-1", "1.0001B", "8 GiBs", "lots", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(xa.InvalidRequest):
        parse_size(text)


# -- logging ----------------------------------------------------------------------------------
def rows_of(text: str) -> list[dict[str, str]]:
    reader = csv.reader(io.StringIO(text))
    assert tuple(next(reader)) == LOG_HEADER
    return [dict(zip(LOG_HEADER, row, strict=False)) for row in reader]


def test_logging_header_and_rows_parse(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    sink = io.StringIO()
    res = LoggingResource(base("async", host_driver, pool), sink)
    odd = xa.AllocTag('odd, "quoted" tag')
    sid = pool.acquire()
    a = res.allocate(1000, tag=W)
    b = res.allocate(300, sid, odd)
    host_driver.inject_fault(0, "oom")
    with pytest.raises(xa.OutOfMemory):
        res.allocate(77, tag=A)
    res.deallocate(a)
    res.deallocate(b)
    rows = rows_of(sink.getvalue())
    assert [r["action"] for r in rows] == [
        "allocate",
        "allocate",
        "allocate failure",
        "free",
        "free",
    ]
    assert (
        rows[0]["pointer"] == hex(a.ptr)
        and rows[0]["size"] == "1000"
        and rows[0]["tag"] == "weights"
    )
    assert rows[1]["stream"] == str(int(sid)) and rows[1]["tag"] == odd
    assert rows[2]["pointer"] == "" and rows[2]["size"] == "77" and rows[2]["tag"] == "activations"
    assert rows[4]["pointer"] == hex(b.ptr) and rows[4]["stream"] == str(int(sid))
    assert all(r["thread"] == str(threading.get_ident()) for r in rows)
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times)


def test_logging_to_a_path_appends_one_header(
    host_driver: xa.HostDriver, pool: xa.StreamPool, tmp_path: Path
) -> None:
    path = tmp_path / "alloc.csv"
    first = LoggingResource(base("direct", host_driver, pool), path)
    second = LoggingResource(base("direct", host_driver, pool), str(path))
    first.deallocate(first.allocate(10))
    second.deallocate(second.allocate(20))
    first.close()
    second.close()
    second.close()
    rows = rows_of(path.read_text())
    assert [(r["action"], r["size"]) for r in rows] == [
        ("allocate", "10"),
        ("free", "10"),
        ("allocate", "20"),
        ("free", "20"),
    ]


def test_logging_free_failure_and_closed_log(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    sink = io.StringIO()
    res = LoggingResource(base("direct", host_driver, pool), sink)
    block = res.allocate(64)
    res.deallocate(block)
    with pytest.raises(xa.UseAfterFree):
        res.deallocate(block)
    res.close()
    res.deallocate(res.allocate(64))  # still usable, no longer logged
    assert [r["action"] for r in rows_of(sink.getvalue())] == [
        "allocate",
        "free",
        "free",
        "free failure",
    ]
    assert not sink.closed  # a stream it was given is not its to close


class FlakySink(io.StringIO):
    fail = False

    def write(self, s: str) -> int:
        if self.fail:
            raise OSError("disk full")
        return super().write(s)


def test_logging_write_failure_leaves_nothing_allocated(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    sink = FlakySink()
    res = LoggingResource(base("direct", host_driver, pool), sink)
    block = res.allocate(64)
    sink.fail = True
    with pytest.raises(OSError):
        res.allocate(64)
    with pytest.raises(OSError):
        res.deallocate(block)
    assert res.bytes_outstanding() == 64  # the refused free left the block live
    sink.fail = False
    res.deallocate(block)
    assert res.bytes_outstanding() == 0 and host_driver.live_allocations(0) == 0


def test_logging_from_the_environment(
    host_driver: xa.HostDriver, pool: xa.StreamPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "env.csv"
    monkeypatch.setenv(LOG_ENV, str(path))
    res = build_resource("async+log", host_driver, 0, pool)
    assert res.describe() == f"async+log:{path}"
    res.deallocate(res.allocate(128))
    assert isinstance(res, LoggingResource)
    res.close()
    assert [r["action"] for r in rows_of(path.read_text())] == ["allocate", "free"]


def test_logging_dash_is_stderr(
    host_driver: xa.HostDriver, pool: xa.StreamPool, capsys: pytest.CaptureFixture[str]
) -> None:
    res = build_resource("direct+log:-", host_driver, 0, pool)
    res.deallocate(res.allocate(128))
    assert [r["action"] for r in rows_of(capsys.readouterr().err)] == ["allocate", "free"]


# -- guard ------------------------------------------------------------------------------------
def alloc_stream(pool: xa.StreamPool, block: xa.DeviceBlock) -> xa.Stream:
    stream = pool.resolve(block.alloc_stream)
    assert stream is not None
    return stream


@pytest.mark.parametrize("kind", ["async", "direct"])
def test_guard_catches_a_write_past_the_end(driver: xa.Driver, kind: str) -> None:
    pool = xa.StreamPool(driver, 0)
    try:
        res = GuardResource(base(kind, driver, pool))
        tag = xa.AllocTag("planted")
        block = res.allocate(1000, tag=tag)
        assert block.ptr % 256 == 0 and block.align == 256
        stream = alloc_stream(pool, block)
        assert write_read(driver, stream, block, 0x5A) == b"\x5a" * 1000  # in bounds: harmless
        driver.fill(block.ptr + block.nbytes, 0x00, 1, stream)  # one byte past the end
        stream.synchronize()
        with pytest.raises(xa.CorruptionDetected) as info:
            res.deallocate(block)
        err = info.value
        assert err.block == block
        msg = str(err)
        assert (
            "planted" in msg and "1000 bytes" in msg and f"stream {int(block.alloc_stream)}" in msg
        )
        assert "0 bytes past its end" in msg
        # it was freed anyway: nothing leaks, and a second free is a use after free
        res.reap_pending()
        assert res.bytes_outstanding() == 0
        with pytest.raises(xa.UseAfterFree):
            res.deallocate(block)
    finally:
        pool.close()


def test_guard_sees_a_tracked_overrun_still_running_on_another_stream(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    # A slow "kernel" on another stream overruns the block and is tracked; the block is freed
    # without synchronizing. The check must wait for it (through the tracked events), not read
    # the canary before the overrun happened.
    res = GuardResource(base("async", host_driver, pool))
    block = res.allocate(512)
    sid = pool.acquire()
    other = pool.resolve(sid)
    assert other is not None
    bid = xa.BlockId.from_block(block)
    res.prepare_block_use(bid, sid, xa.Access.WRITE)
    host_driver.sleep(other, 50_000)
    host_driver.fill(block.ptr, 0x33, block.nbytes + 8, other)
    res.finish_block_use(bid, sid, xa.Access.WRITE)
    with pytest.raises(xa.CorruptionDetected, match="8 of 256 bytes changed"):
        res.deallocate(block)
    res.reap_pending()
    assert res.bytes_outstanding() == 0


def test_guard_catches_a_write_before_the_start(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = GuardResource(base("async", host_driver, pool), guard_bytes=512)
    block = res.allocate(4096)
    stream = alloc_stream(pool, block)
    host_driver.fill(block.ptr - 3, 0xCA, 3, stream)  # 0xCA is the canary's own first byte
    with pytest.raises(
        xa.CorruptionDetected, match="before the block overwritten from 3 bytes before"
    ):
        res.deallocate(block)
    res.reap_pending()
    assert res.bytes_outstanding() == 0


def test_guard_poisons_freed_bytes(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    snoop_stream = host_driver.create_stream(0)
    snoop = Snoop(base("async", host_driver, pool), host_driver, snoop_stream)
    res = GuardResource(snoop)
    block = res.allocate(300)
    stream = alloc_stream(pool, block)
    write_read(host_driver, stream, block, 0x11)
    res.deallocate(block)
    assert snoop.seen == [b"\xdd" * (300 + 2 * 256)]


def test_guard_canaries_are_in_place(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = GuardResource(base("async", host_driver, pool))
    block = res.allocate(100)
    stream = alloc_stream(pool, block)
    head = host_driver.copy_to_host(block.ptr - 256, 256, stream)
    tail = host_driver.copy_to_host(block.ptr + 100, 256, stream)
    stream.synchronize()
    assert bytes(head) == bytes(tail) == (CANARY_PATTERN * 32)[:256]
    res.deallocate(block)


def test_guard_translates_tracking_hooks(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = GuardResource(base("async", host_driver, pool))
    assert res.supports_block_use_tracking()
    writer_sid, reader_sid = pool.acquire(), pool.acquire()
    writer, reader = pool.resolve(writer_sid), pool.resolve(reader_sid)
    assert writer is not None and reader is not None
    block = res.allocate(4096)
    bid = xa.BlockId.from_block(block)
    # a slow write on one stream, a read on another: correct only if the wait is queued
    res.prepare_block_use(bid, writer_sid, xa.Access.WRITE)
    host_driver.sleep(writer, 30_000)
    host_driver.fill(block.ptr, 0x42, block.nbytes, writer)
    res.finish_block_use(bid, writer_sid, xa.Access.WRITE)
    res.prepare_block_use(bid, reader_sid, xa.Access.READ)
    out = host_driver.copy_to_host(block.ptr, block.nbytes, reader)
    res.finish_block_use(bid, reader_sid, xa.Access.READ)
    res.record_block_use(block, reader_sid)
    reader.synchronize()
    assert bytes(out) == b"\x42" * 4096
    assert res.pending_use_event_count(block.ptr) == 2  # last write + one read stream
    res.deallocate(block)  # the canary check waits for the reader through the tracked events
    with pytest.raises(xa.UseAfterFree):
        res.prepare_block_use(bid, reader_sid, xa.Access.READ)
    res.reap_pending()
    assert res.bytes_outstanding() == 0


def test_guard_on_direct_rejects_tracking(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = GuardResource(base("direct", host_driver, pool))
    block = res.allocate(64)
    for call in (
        lambda: res.record_block_use(block, xa.StreamId.DEFAULT),
        lambda: res.prepare_block_use(
            xa.BlockId.from_block(block), xa.StreamId.DEFAULT, xa.Access.READ
        ),
        lambda: res.finish_block_use(
            xa.BlockId.from_block(block), xa.StreamId.DEFAULT, xa.Access.READ
        ),
    ):
        with pytest.raises(xa.StreamMisuse, match="unsupported"):
            call()
    res.deallocate(block)
    res.close()


def test_guard_rejects_bad_requests(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    with pytest.raises(xa.InvalidRequest):
        GuardResource(base("async", host_driver, pool), guard_bytes=100)
    with pytest.raises(xa.InvalidRequest):
        build_resource("async+guard:300", host_driver, 0, pool)
    res = build_resource("async+guard:4KiB", host_driver, 0, pool)
    assert res.describe() == "async+guard:4KiB"
    for bad in (0, -5, 1.5, True, None):
        with pytest.raises(xa.InvalidRequest):
            res.allocate(bad)  # type: ignore[arg-type]  # bad on purpose
    other = xa.DirectCudaResource(host_driver, 1).allocate(64)
    with pytest.raises(xa.InvalidRequest):
        res.deallocate(other)
    block = res.allocate(64)
    res.deallocate(block)
    with pytest.raises(xa.UseAfterFree):
        res.deallocate(block)
    assert res.bytes_outstanding() == 4096 * 2 + 64  # pending until reaped, canaries included
    res.reap_pending()
    assert res.bytes_outstanding() == 0


def test_guard_rollback_when_the_canary_write_fails(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = GuardResource(base("direct", host_driver, pool))
    host_driver.inject_fault(0, "error", after_calls=1)  # the alloc passes, the canary copy fails
    with pytest.raises(xa.DriverError):
        res.allocate(64)
    assert res.bytes_outstanding() == 0 and host_driver.live_allocations(0) == 0
    res.close()


# -- composition ------------------------------------------------------------------------------
ADAPTOR_PARTS = ["stats", "log", "budget:32MiB", "guard"]
COMPOSED = (
    [
        f"{b}+{x}+{y}"
        for b in ("async", "direct")
        for x, y in itertools.permutations(ADAPTOR_PARTS, 2)
    ]
    + [f"{b}+{x}" for b in ("async", "direct") for x in ADAPTOR_PARTS]
    + [
        "async+stats+log+budget:64MiB+guard",
        "direct+stats+log+budget:64MiB+guard",
        "async+guard+budget:64MiB+log+stats",
        "direct+guard+guard+stats+stats",
    ]
)


@pytest.fixture
def log_to_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "composed.csv"
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


@pytest.mark.parametrize("description", COMPOSED)
def test_adaptors_compose(
    host_driver: xa.HostDriver, pool: xa.StreamPool, log_to_tmp: Path, description: str
) -> None:
    res = build_resource(description, host_driver, 0, pool)
    expected = description.replace("+log", f"+log:{log_to_tmp}")
    assert res.describe() == expected
    assert res.device_ordinal == 0
    assert res.supports_block_use_tracking() == description.startswith("async")
    sid = pool.acquire()
    blocks = [
        res.allocate(n, sid if i % 2 else xa.StreamId.DEFAULT, W)
        for i, n in enumerate((1, 255, 4096, 70_000))
    ]
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in blocks)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # no aliasing
    for i, b in enumerate(blocks):
        stream = pool.resolve(b.alloc_stream)
        assert stream is not None
        assert write_read(host_driver, stream, b, i + 1) == bytes([i + 1]) * b.nbytes
    if res.supports_block_use_tracking():
        bid = xa.BlockId.from_block(blocks[0])
        res.prepare_block_use(bid, sid, xa.Access.READ)
        res.finish_block_use(bid, sid, xa.Access.READ)
    report = memory_report(res)
    assert report.blocks is not None and sum(g.count for g in report.by_tag.values()) == 4
    assert report.by_tag[W].nbytes == 1 + 255 + 4096 + 70_000
    for b in blocks:
        res.deallocate(b)
    res.reap_pending()
    assert res.bytes_outstanding() == 0
    assert host_driver.live_allocations(0) == 0 or description.startswith("async")


@pytest.mark.parametrize(
    "description", ["async+stats+log+budget:64MiB+guard", "direct+guard+budget:64MiB+stats"]
)
def test_full_stack_round_trip_on_every_driver(
    driver: xa.Driver, description: str, log_to_tmp: Path
) -> None:
    pool = xa.StreamPool(driver, 0)
    try:
        res = build_resource(description, driver, 0, pool)
        stream = pool.resolve(xa.StreamId.DEFAULT)
        assert stream is not None
        blocks = [res.allocate(n, tag=A) for n in (1, 1000, 1 << 16)]
        for b in blocks:
            assert write_read(driver, stream, b, 0x77) == b"\x77" * b.nbytes
        for b in blocks:
            res.deallocate(b)
        res.reap_pending()
        assert res.bytes_outstanding() == 0
        assert isinstance(res, ResourceAdaptor)  # reaches the stats layer through the stack
        stats = res.statistics()
        assert stats.total_count == 3 and stats.current_bytes == 0
    finally:
        pool.close()


def test_adaptor_forwards_base_diagnostics(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = build_resource("async+stats+budget:1MiB", host_driver, 0, pool)
    assert isinstance(res, BudgetResource)
    block = res.allocate(KiB)
    assert res.live_bytes() == KiB and res.pending_free_bytes() == 0
    assert res.driver is host_driver and res.stream_pool is pool
    assert isinstance(res.upstream, StatisticsResource)
    res.deallocate(block)
    assert res.pending_free_bytes() == KiB
    res.reap_pending_with(lambda sid: None)
    assert res.bytes_outstanding() == 0
    with pytest.raises(AttributeError):
        res.no_such_thing  # noqa: B018 - the attribute access is the test
    with pytest.raises(AttributeError):
        res._live  # noqa: B018 - private names are never forwarded


def test_registry_and_bad_arguments(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    assert {"stats", "log", "budget", "guard"} <= set(ADAPTORS)
    for bad in ("async+stats:1", "async+budget", "async+budget:lots", "async+nope"):
        with pytest.raises(xa.InvalidRequest):
            build_resource(bad, host_driver, 0, pool)
    with pytest.raises(xa.InvalidRequest):
        StatisticsResource("not a resource")  # type: ignore[arg-type]  # bad on purpose


# -- memory report ----------------------------------------------------------------------------
def test_memory_report_groups_by_tag_and_stream(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = build_resource("async+stats+budget:8MiB", host_driver, 0, pool)
    sid = pool.acquire()
    blocks = [res.allocate(KiB, tag=W), res.allocate(2 * KiB, tag=W), res.allocate(4 * KiB, sid, A)]
    report = memory_report(res)
    assert report.description == "async+stats+budget:8MiB" and report.budget_limit == 8 * MiB
    assert report.bytes_outstanding == 7 * KiB and report.driver_kind == "host"
    assert report.total_bytes == 64 * MiB and report.free_bytes is not None
    assert report.blocks is not None and len(report.blocks) == 3
    assert (report.by_tag[W].count, report.by_tag[W].nbytes) == (2, 3 * KiB)
    assert (report.by_stream[sid].count, report.by_stream[xa.StreamId.DEFAULT].nbytes) == (
        1,
        3 * KiB,
    )
    assert all(b.age_s is not None and b.age_s >= 0 for b in report.blocks)
    assert report.statistics is not None and report.statistics.current_count == 3
    text = report.format()
    assert (
        "weights: 2 blocks, 3.0 KiB" in text
        and f"stream {int(sid)}" in text
        and "budget 8.0 MiB" in text
    )
    data = json.loads(json.dumps(report.as_dict()))
    assert data["by_tag"]["activations"]["nbytes"] == 4 * KiB
    assert data["statistics"]["by_tag"]["weights"]["current_count"] == 2
    for b in blocks:
        res.deallocate(b)


def test_memory_report_of_direct_has_no_ages(
    host_driver: xa.HostDriver, pool: xa.StreamPool
) -> None:
    res = build_resource("direct+guard", host_driver, 0, pool)
    block = res.allocate(100, tag=A)
    report = memory_report(res)
    assert report.blocks is not None
    (only,) = report.blocks
    assert (only.ptr, only.nbytes, only.tag, only.age_s) == (block.ptr, 100, A, None)
    assert report.statistics is None and report.budget_limit is None
    assert "activations: 1 blocks, 100 B" in report.format()
    res.deallocate(block)


class Minimal(xa.DeviceMemoryResource):
    """A resource with no driver and no block listing: reports must cope."""

    def allocate(
        self,
        nbytes: int,
        stream: xa.StreamId = xa.StreamId.DEFAULT,
        tag: xa.AllocTag = xa.AllocTag.UNTAGGED,
    ) -> xa.DeviceBlock:
        raise xa.OutOfMemory("minimal: out of memory", requested=nbytes)

    def deallocate(self, block: xa.DeviceBlock) -> None:
        raise xa.UseAfterFree("minimal", generation=int(block.generation))

    @property
    def device_ordinal(self) -> int:
        return 0

    def bytes_outstanding(self) -> int:
        return 0


def test_memory_report_without_driver_or_listing() -> None:
    res = StatisticsResource(Minimal())
    report = memory_report(res)
    assert report.blocks is None and report.free_bytes is None and report.driver_kind is None
    assert "not listed" in report.format()
    with pytest.raises(xa.OutOfMemory, match="asked for 1.0 KiB") as info:
        res.allocate(KiB)
    assert "largest tags" not in str(info.value)
    assert res.statistics().total_count == 0


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * MiB, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 TiB",
    ]
