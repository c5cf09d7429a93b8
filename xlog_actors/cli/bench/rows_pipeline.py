"""The demo pipeline row: ``run_pipeline`` through three worker actors beside the same copies,
kernels and verification from one thread on one stream. One sample is one whole run."""

from __future__ import annotations

import time

from ...driver.kernel_library import SCALE_ADD_F32, launch_shape
from ...driver.protocol import Driver
from ..pipeline import ALPHA, BETA, PipelineConfig, expected, make_batch, run_pipeline
from .harness import Context, Group, Row, given, no_gc
from .plan import size_text
from .result import Target

__all__ = ["PIPELINE", "one_thread_pipeline"]


def one_thread_pipeline(driver: Driver, batches: int, batch_bytes: int) -> float:
    """The demo's copies and kernels from one thread on one stream through the driver.

    Args:
        driver: the run's driver.
        batches: how many batches.
        batch_bytes: bytes per batch (a multiple of 4).
    Returns:
        Seconds from the first batch to the last verification (setup excluded, as in
        ``run_pipeline``).
    Raises:
        RuntimeError: a batch differs from the host reference.
    Thread rule: the bench's thread.
    """
    n = batch_bytes // 4
    stream = driver.create_stream(0)
    d_in = driver.alloc(0, batch_bytes)
    d_out = driver.alloc(0, batch_bytes)
    out = bytearray(batch_bytes)
    grid, block = launch_shape(n)
    bad: list[int] = []
    try:
        t0 = time.perf_counter()
        for i in range(batches):
            driver.copy_to_device(d_in, make_batch(i, n), stream)
            driver.launch(SCALE_ADD_F32, grid, block, [d_out, d_in, ALPHA, BETA, n], stream)
            driver.copy_to_host_into(d_out, out, stream)
            stream.synchronize()
            if out != expected(i, n).tobytes():
                bad.append(i)
        seconds = time.perf_counter() - t0
    finally:
        stream.synchronize()
        driver.free(0, d_in)
        driver.free(0, d_out)
        stream.close()
    if bad:
        raise RuntimeError(f"one-thread pipeline: batches {bad[:10]} differ from the host reference")
    return seconds


def _measure(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
    """Whole runs of ours and the one-thread twin, alternating per round (after a warm-up)."""
    driver, plan = ctx.driver, ctx.plan
    batches, nbytes = plan.pipe_batches, plan.pipe_batch_bytes
    cfg = PipelineConfig(batches=batches, batch_bytes=nbytes)

    def ours() -> float:
        result = run_pipeline(driver, cfg)
        if not result.ok:
            raise RuntimeError(
                f"demo pipeline failed: verified {result.verified}/{result.batches}, "
                f"mismatched {result.mismatched[:10]}, errors {result.errors[:3]}"
            )
        return result.seconds

    def ref() -> float:
        return one_thread_pipeline(driver, batches, nbytes)

    # warm up: NVRTC compile and module load, pool growth, numpy
    warm = PipelineConfig(batches=min(4, batches), batch_bytes=nbytes)
    if not run_pipeline(driver, warm).ok:
        raise RuntimeError("demo pipeline warm-up failed verification")
    one_thread_pipeline(driver, min(4, batches), nbytes)
    a: list[float] = []
    b: list[float] = []
    with no_gc():
        for r in range(max(1, plan.pipe_rounds)):
            if r & 1:
                b.append(ref() * 1e9)
                a.append(ours() * 1e9)
            else:
                a.append(ours() * 1e9)
                b.append(ref() * 1e9)
    return a, b


PIPELINE = Group("pipeline", (
    Row("demo pipeline", lambda f, p: f"run_pipeline: {p.pipe_batches} batches of {size_text(p.pipe_batch_bytes)} "
        "through producer -> transformer -> consumer actors on 3 streams, verified", given, None, None,
        lambda p: (p.pipe_rounds, 1), reference="the same copies, kernels and verification from one thread on one "
        "stream through the driver", kind="rate", bytes_per_op=lambda p: p.pipe_batches * p.pipe_batch_bytes,
        target=Target("ratio", ">=", 0.9), note="throughput counts input bytes per second; one sample is one whole run",
        measure=_measure),
))
