"""The demo pipeline row: ``run_pipeline`` (three library actors, a ring of ``depth`` buffer sets,
every batch verified by a device checksum) beside the raw three-stream pipeline of
:mod:`..raw_pipeline` on the same device. One sample is one whole run."""

from __future__ import annotations

from ..batches import BatchData
from ..pipeline import PipelineConfig, run_pipeline
from ..raw_pipeline import raw_pipeline
from .harness import Context, Group, Row, given, no_gc
from .plan import size_text
from .result import Target

__all__ = ["PIPELINE"]

_DEPTH = PipelineConfig.depth


def _measure(ctx: Context, _unused: Context) -> tuple[list[float], list[float]]:
    """Whole runs of ours and the raw twin, alternating per round (after a warm-up of each)."""
    driver, plan = ctx.driver, ctx.plan
    batches, nbytes = plan.pipe_batches, plan.pipe_batch_bytes
    cfg = PipelineConfig(batches=batches, batch_bytes=nbytes, depth=_DEPTH)
    data = BatchData(_DEPTH + 1, nbytes)  # built once: the raw runs measure copies and kernels only

    def ours() -> float:
        result = run_pipeline(driver, cfg)
        if not result.ok:
            raise RuntimeError(
                f"demo pipeline failed: verified {result.verified}/{result.batches}, "
                f"mismatched {result.mismatched[:10]}, errors {result.errors[:3]}"
            )
        return result.seconds

    def ref() -> float:
        return raw_pipeline(driver, data, batches, _DEPTH).seconds

    # warm up: NVRTC compile and module load, pool growth, pinned allocation
    if not run_pipeline(driver, PipelineConfig(batches=min(4, batches), batch_bytes=nbytes, depth=_DEPTH)).ok:
        raise RuntimeError("demo pipeline warm-up failed verification")
    raw_pipeline(driver, data, min(4, batches), _DEPTH)
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
        f"through copy in -> kernel -> copy out actors on 3 streams, {_DEPTH} in flight, each verified by a device "
        "checksum", given, None, None,
        lambda p: (p.pipe_rounds, 1), reference=f"the raw three-stream pipeline: the same copies and kernel on 3 "
        f"streams ordered by events, a ring of {_DEPTH} device buffer pairs, pinned host buffers on CUDA (raw "
        "cuda.bindings; HostDriver calls on the host driver)", kind="rate",
        bytes_per_op=lambda p: p.pipe_batches * p.pipe_batch_bytes,
        target=Target("ratio", ">=", 0.85), note="throughput counts input bytes per second; one sample is one whole "
        "run, its setup (inputs, buffers, kernels) excluded on both sides", measure=_measure),
))
