"""The peers' allocators (cuda.core, CuPy, PyTorch) beside the same raw twin as ours.

This group runs last: importing CuPy or PyTorch initializes their runtimes in this process, which
was seen to change what other rows cost (raw ``cuMemAlloc``+``cuMemFree`` fell from about 57 µs to
about 2.6 µs on an H200 once they were loaded), and our rows are meant to be measured in a process
without them. None of them is a dependency: a peer that is absent or unusable is skipped with the
reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ...driver.protocol import Stream
from ...memory.block import StreamId
from ...memory.stream_pool import StreamPool
from .harness import Context, Group, Op, Row, SkipRow
from .plan import SIZE
from .twins import stream_ordered_twin

__all__ = ["PEERS"]


@dataclass
class _Peers:
    stream: Stream
    raw: Op
    raw_name: str
    what: dict[str, str] = field(default_factory=dict)  # each peer's description, known once it runs


@contextlib.contextmanager
def _peers(ctx: Context) -> Iterator[_Peers]:
    pool = StreamPool(ctx.driver, 0)
    try:
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        yield _Peers(stream, *stream_ordered_twin(ctx.driver, stream))
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


def _peer(name: str, maker: Callable[[Stream], tuple[Op, str]]) -> Row:
    """A peer's row: its operation comes from ``maker``, whose failure skips the row."""

    def op(f: _Peers) -> Op:
        try:
            fn, what = maker(f.stream)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise SkipRow(f"not usable here: {type(exc).__name__}: {first}") from exc
        f.what[name] = what
        return fn

    return Row(name, lambda f, p: f.what[name], _peers, op, lambda f: f.raw, lambda p: p.alloc,
               host_skip="CUDA driver only", note="informational: a peer's allocator beside the same raw twin")


PEERS = Group("peers' allocators", (
    _peer("cuda.core Device.allocate+close", _cuda_core_op),
    _peer("CuPy pool empty+del", _cupy_op),
    _peer("PyTorch caching empty+del", _torch_op),
))


