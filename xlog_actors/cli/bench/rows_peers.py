"""The peers' allocators (cuda.core, CuPy, PyTorch) and ours, all from one measurement.

Every row of the group reads its samples and the raw twin's from one
:func:`~.harness.round_robin` over the twin, our pairs (``AsyncCudaResource``, the block cache,
the ``DeviceClient`` of an ``async+cache`` device) and every peer that can run here, so each row's
ratio is against the same measurement of the twin (measured row by row, the same twin read about
twice as fast beside the peers as in our rows of the same run, and the ratios could not be
compared). Each row shows its absolute time too.

This group runs last: importing CuPy or PyTorch initializes their runtimes in this process, which
was seen to change what other rows cost (raw ``cuMemAlloc``+``cuMemFree`` fell from about 57 µs to
about 2.6 µs on an H200 once they were loaded), and our rows are meant to be measured in a process
without them. None of them is a dependency: a peer that is absent or unusable is skipped with the
reason.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...actors import DeviceActor, GetClient
from ...driver.protocol import Stream
from ...memory.adaptors import BlockCacheResource
from ...memory.async_resource import AsyncCudaResource
from ...memory.block import StreamId
from ...memory.stream_pool import StreamPool
from .harness import Context, Group, Op, Row, SkipRow, no_gc
from .plan import SIZE
from .twins import alloc_free_loop, stream_ordered_twin

__all__ = ["PEERS", "ours_beside_raw", "round_robin"]


def round_robin(
    ops: dict[str, Op], samples: int, batch: int, *, budget_s: float, min_samples: int, warmup: int = 3
) -> dict[str, list[float]]:
    """One measurement of several operations: in each round every operation is sampled once,
    the round's order rotated by one each time, so each sees the same machine state and the same
    neighbours. Rows that read their figures and their twin's from it (peers beside ours) are
    compared against one measurement of the twin, not each against its own.

    Args:
        ops: the operations by name.
        samples: the most rounds.
        batch: ``n`` for one call of each.
        budget_s: stop once this much time has passed and ``min_samples`` rounds are taken.
        min_samples: the fewest rounds.
        warmup: untimed calls of each first.
    Returns:
        name -> nanoseconds per operation, one entry per round.
    Raises:
        Whatever an operation raises.
    Thread rule: the bench's thread.
    """
    names = list(ops)
    for _ in range(warmup):
        for name in names:
            ops[name](batch)
    out: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    with no_gc():
        for i in range(samples):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = clock()
                ops[name](batch)
                out[name].append((clock() - t0) / batch)
            if i + 1 >= min_samples and clock() > deadline:
                break
    return out


@contextlib.contextmanager
def ours_beside_raw(ctx: Context) -> Iterator[tuple[dict[str, Op], str]]:
    """Our 4 KiB pairs and the raw twin, as operations for one :func:`round_robin`: ``raw`` (the
    twin), ``async`` (``AsyncCudaResource``), ``cache`` (a ``BlockCacheResource`` over one) on one
    pool's default stream, and ``client`` (a ``DeviceClient`` of an ``async+cache`` device). Every
    size is a cached one after the first pair. Yields ``(ops, the twin's name)``; checks on the
    way out that the caches served hits.

    Thread rule: the bench's thread.
    """
    pool = StreamPool(ctx.driver, 0)
    device = DeviceActor.start(0, ctx.driver, resource="async+cache")
    try:
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        raw, raw_name = stream_ordered_twin(ctx.driver, stream)
        plain = AsyncCudaResource(ctx.driver, 0, pool)
        cached = BlockCacheResource(AsyncCudaResource(ctx.driver, 0, pool))
        client: Any = device.ask(GetClient())
        yield {"raw": raw, "async": alloc_free_loop(plain.allocate, plain.deallocate),
               "cache": alloc_free_loop(cached.allocate, cached.deallocate),
               "client": alloc_free_loop(client.allocate, client.free)}, raw_name
        if cached.figures().hits == 0:
            raise RuntimeError("the block cache served no allocation from a kept block")
        cached.trim()
        cached.reap_pending()
        plain.reap_pending()
    finally:
        device.stop()
        pool.close()


@dataclass
class _Peers:
    samples: dict[str, list[float]]
    raw_name: str
    what: dict[str, str] = field(default_factory=dict)  # each peer's description
    why_not: dict[str, str] = field(default_factory=dict)  # each peer that cannot run here: why


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@contextlib.contextmanager
def _peers(ctx: Context) -> Iterator[_Peers]:
    """Our pairs, the twin and every usable peer, in one round-robin measurement."""
    with ours_beside_raw(ctx) as (ops, raw_name):
        found = _Peers({}, raw_name)
        pool = StreamPool(ctx.driver, 0)
        try:
            stream = pool.resolve(StreamId.DEFAULT)
            assert stream is not None
            for name, maker in _MAKERS.items():
                try:
                    ops[name], found.what[name] = maker(stream)
                except Exception as exc:  # noqa: BLE001 - the row is skipped with the reason
                    found.why_not[name] = f"not usable here: {_first_line(exc)}"
            samples, batch = ctx.plan.alloc
            found.samples = round_robin(ops, samples, batch, budget_s=3 * ctx.plan.budget_s,
                                        min_samples=ctx.plan.min_samples)
            yield found
            stream.synchronize()
        finally:
            pool.close()


def _cuda_core_op(stream: Stream) -> tuple[Op, str]:
    try:
        from cuda.core import Device
    except ImportError:  # older cuda.core
        from cuda.core.experimental import Device
    dev = Device(0)
    dev.set_current()
    cstream = dev.create_stream(stream)  # wraps our stream through __cuda_stream__
    allocate = dev.allocate
    allocate(SIZE, stream=cstream).close(cstream)

    def op(n: int) -> None:
        for _ in range(n):
            allocate(SIZE, stream=cstream).close(cstream)

    return op, "cuda.core Device().allocate(4 KiB, stream=s) + Buffer.close(s), on our stream"


def _cupy_op(_stream: Stream) -> tuple[Op, str]:
    import cupy

    cupy.cuda.Device(0).use()
    empty, u8 = cupy.empty, cupy.uint8
    empty(SIZE, dtype=u8)

    def op(n: int) -> None:
        for _ in range(n):
            a = empty(SIZE, dtype=u8)
            del a

    return op, f"cupy.empty(4096, uint8) + del (CuPy {cupy.__version__} default memory pool, its current stream)"


def _torch_op(_stream: Stream) -> tuple[Op, str]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    dev = torch.device("cuda", 0)
    empty, u8 = torch.empty, torch.uint8
    empty(SIZE, dtype=u8, device=dev)

    def op(n: int) -> None:
        for _ in range(n):
            a = empty(SIZE, dtype=u8, device=dev)
            del a

    return op, f"torch.empty(4096, uint8, device='cuda') + del (PyTorch {torch.__version__} caching allocator)"


_CUDA_CORE, _CUPY, _TORCH = "cuda.core Device.allocate+close", "CuPy pool empty+del", "PyTorch caching empty+del"
_MAKERS: dict[str, Callable[[Stream], tuple[Op, str]]] = {_CUDA_CORE: _cuda_core_op, _CUPY: _cupy_op, _TORCH: _torch_op}
_NOTE = "one measurement of every row of the group and the raw twin: each round samples all of them once, rotated"


def _measured(name: str) -> Callable[[_Peers, Context], tuple[list[float], list[float]]]:
    def measure(f: _Peers, ctx: Context) -> tuple[list[float], list[float]]:
        if name in f.why_not:
            raise SkipRow(f.why_not[name])
        return f.samples[name], f.samples["raw"]

    return measure


def _peer(name: str) -> Row:
    """A peer's row, from the group's one measurement; a peer that cannot run here is skipped."""
    return Row(name, lambda f, p: f.what.get(name, name), _peers, None, None, lambda p: p.alloc,
               host_skip="CUDA driver only", measure=_measured(name),
               note="informational: a peer's allocator; " + _NOTE)


def _ours(name: str, key: str, measures: str) -> Row:
    return Row(name, measures, _peers, None, None, lambda p: p.alloc, host_skip="CUDA driver only",
               measure=_measured(key), note="informational: ours beside the peers; " + _NOTE)


PEERS = Group("peers' allocators", (
    _ours("ours beside the peers: AsyncCudaResource", "async", "AsyncCudaResource.allocate(4 KiB) + deallocate"),
    _ours("ours beside the peers: AsyncCudaResource through the cache", "cache",
          "BlockCacheResource over AsyncCudaResource: allocate(4 KiB) + deallocate, a cached size"),
    _ours("ours beside the peers: DeviceClient through the cache", "client",
          "DeviceClient.allocate(4 KiB) + free of an async+cache device, a cached size"),
    _peer(_CUDA_CORE),
    _peer(_CUPY),
    _peer(_TORCH),
))
