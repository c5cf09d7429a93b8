"""``xlog-actors demo``: the main job (the pipeline of :mod:`.pipeline`), with a progress line, beside
the same job written raw (:mod:`.raw_pipeline`) in the same run."""

from __future__ import annotations

import argparse
import sys

from ..driver.protocol import Driver
from ..errors import XlogError
from .batches import BatchData
from .driver_choice import choose_driver
from .graph_pipeline import job_for, lanes_for
from .multi_demo import run_multi_demo
from .options import UsageError
from .pipeline import PipelineConfig, PipelineResult
from .raw_pipeline import RawResult, raw_pipeline

__all__ = ["run_demo"]


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        print(f"\r  batches done {done}/{total}", end="", file=sys.stderr, flush=True)
    else:
        print(f"  batches done {done}/{total}", file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo pipeline as the parsed flags say and print its result.

    The first line on stderr names the driver and why it was chosen. After the pipeline, the raw
    three-stream pipeline runs the same batches on the same device, and the throughput line shows
    both and their ratio.

    Args:
        args: the parsed ``demo`` flags (each already checked by its parser type).
    Returns:
        0 when every batch verified, else 1.
    Raises:
        UsageError: ``--rebuild-at`` outside the batches, or a bad ``XLOG_ACTORS_DRIVER``.
        NoGpu: ``cuda`` asked for where no GPU is usable.
    Thread rule: the command's main thread.
    """
    if args.graph and (args.no_tracking or args.slow_producer_us):
        raise UsageError("--graph: a graph orders its own stages; --no-tracking and --slow-producer-us "
                         "apply to the actor pipeline only")
    if args.graph_lanes is not None and not args.graph:
        raise UsageError("--graph-lanes: applies to the graph mode only (add --graph)")
    if args.graph_lanes is not None and args.graph_lanes > args.depth:
        raise UsageError(f"--graph-lanes {args.graph_lanes}: expected 1 .. {args.depth} (the ring's --depth)")
    status = run_multi_demo(args)  # --devices N > 1; None: one device, as below
    if status is not None:
        return status
    if args.batches is not None and args.rebuild_at is not None and args.rebuild_at >= args.batches:
        raise UsageError(f"--rebuild-at {args.rebuild_at}: expected a batch index from 0 to {args.batches - 1}")
    choice = choose_driver(args.driver)
    driver = choice.driver
    try:
        on_gpu = driver.kind == "cuda"
        batches = args.batches if args.batches is not None else (64 if on_gpu else 32)
        if args.rebuild_at is not None and args.rebuild_at >= batches:
            raise UsageError(
                f"--rebuild-at {args.rebuild_at}: expected a batch index from 0 to {batches - 1} "
                f"({batches} batches on the {driver.kind} driver)"
            )
        batch_mib = args.batch_mib if args.batch_mib is not None else (16.0 if on_gpu else 1.0)
        batch_bytes = max(4, int(batch_mib * (1 << 20)) // 4 * 4)
        cfg = PipelineConfig(
            batches=batches,
            batch_bytes=batch_bytes,
            depth=args.depth,
            track=not args.no_tracking,
            producer_delay_us=args.slow_producer_us,
            rebuild_at=args.rebuild_at,
            graph=args.graph,
            graph_lanes=args.graph_lanes,
        )
        print(f"xlog-actors demo: {choice.describe()}", file=sys.stderr)
        lanes = lanes_for(cfg)
        how = (f"the ring recorded as graphs of {lanes} lane{'s' if lanes > 1 else ''}, one replay per {lanes} "
               f"batch{'es' if lanes > 1 else ''}" if args.graph else "three library actors on 3 streams")
        print(
            f"xlog-actors demo: copy in -> kernel -> copy out ({how}), {batches} batches of "
            f"{batch_bytes / (1 << 20):g} MiB, {cfg.depth} in flight, device {driver.device_name(0)}",
            file=sys.stderr,
        )
        result = job_for(cfg)(driver, cfg, progress=_progress)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        raw = _raw(driver, cfg)
    finally:
        driver.close()
    _report(result, cfg, raw)
    return 0 if result.ok else 1


def _raw(driver: Driver, cfg: PipelineConfig) -> RawResult | str:
    """The raw three-stream pipeline over the same batches, or why it could not run."""
    print("xlog-actors demo: the same job raw (no actors) for comparison", file=sys.stderr)
    try:
        return raw_pipeline(driver, BatchData(cfg.depth + 1, cfg.batch_bytes), cfg.batches, cfg.depth)
    except (RuntimeError, XlogError) as exc:
        return f"failed: {exc}"


def _report(result: PipelineResult, cfg: PipelineConfig, raw: RawResult | str) -> None:
    total = result.batches * result.batch_bytes
    print(f"driver        {result.driver}")
    print(f"device        {result.device}")
    print(
        f"batches       {result.batches} x {result.batch_bytes / (1 << 20):g} MiB "
        f"({total / (1 << 20):g} MiB in, as much out)"
    )
    graph = result.extra.get("mode") == "graph"
    print(f"mode          {'graph (BatchGraph replays)' if graph else 'actors (CopyActor, KernelActor, CopyActor)'}")
    print(f"tracking      {'on' if cfg.track else 'OFF'}")
    print(f"time          {result.seconds:.3f} s")
    cpu = result.extra.get("cpu_seconds")
    if isinstance(cpu, float) and result.batches:
        emulator = "; the host driver's stream threads included" if result.driver == "host" else ""
        print(f"cpu           {cpu / result.batches * 1e6:.1f} µs a batch (process CPU time, all threads, "
              f"over the timed part{emulator})")
    gbs = result.throughput_bytes_s / 1e9
    if isinstance(raw, RawResult):
        raw_gbs = raw.throughput_bytes_s / 1e9
        versus = f"{raw_gbs:.3g} GB/s, {gbs / raw_gbs:.2f}x" if raw_gbs > 0 else "no time measured"
        if raw.batches:
            versus += f"; its CPU {raw.cpu_seconds / raw.batches * 1e6:.1f} µs a batch"
    else:
        versus = raw
    print(f"throughput    {gbs:.3g} GB/s (raw three-stream pipeline: {versus})")
    print(f"generation    {result.generation} ({result.stale_retries} batch(es) redone after stale handles)")
    if result.errors:
        print("errors        " + "; ".join(result.errors))
    if result.mismatched:
        print(
            f"verification  FAILED: {len(result.mismatched)} batch(es) differ from the host reference: "
            f"{result.mismatched[:10]}"
        )
    else:
        print(
            f"verification  {'ok' if result.ok else 'FAILED'}: {result.verified}/{result.batches} "
            f"batches match the host reference (device checksums; {result.compared} compared byte for byte)"
        )
