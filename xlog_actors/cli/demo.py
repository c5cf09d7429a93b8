"""``xlog-actors demo``: the main job."""

from __future__ import annotations

import argparse
import sys

from ..driver.open import open_driver
from .pipeline import PipelineConfig, run_pipeline

__all__ = ["run_demo"]


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        print(f"\r  batches done {done}/{total}", end="", file=sys.stderr, flush=True)
    else:
        print(f"  batches done {done}/{total}", file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    driver = open_driver(args.driver)
    on_gpu = driver.kind == "cuda"
    batches = args.batches if args.batches is not None else (64 if on_gpu else 32)
    batch_mib = args.batch_mib if args.batch_mib is not None else (16.0 if on_gpu else 1.0)
    batch_bytes = max(4, int(batch_mib * (1 << 20)) // 4 * 4)
    cfg = PipelineConfig(
        batches=batches,
        batch_bytes=batch_bytes,
        depth=args.depth,
        track=not args.no_tracking,
        producer_delay_us=args.slow_producer_us,
        rebuild_at=args.rebuild_at,
    )
    print(
        f"xlog-actors demo: producer -> transformer -> consumer on 3 streams, {batches} batches of "
        f"{batch_bytes / (1 << 20):g} MiB, driver {driver.kind} ({driver.device_name(0)})",
        file=sys.stderr,
    )
    try:
        result = run_pipeline(driver, cfg, progress=_progress)
    finally:
        driver.close()
    if sys.stderr.isatty():
        print(file=sys.stderr)
    total = result.batches * result.batch_bytes
    print(f"driver        {result.driver}")
    print(f"device        {result.device}")
    print(
        f"batches       {result.batches} x {result.batch_bytes / (1 << 20):g} MiB "
        f"({total / (1 << 20):g} MiB in, as much out)"
    )
    print(f"tracking      {'on' if cfg.track else 'OFF'}")
    print(f"time          {result.seconds:.3f} s")
    print(f"throughput    {result.throughput_bytes_s / 1e9:.3f} GB/s (input bytes through copy in, kernel, copy out)")
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
            "batches match the host reference"
        )
    return 0 if result.ok else 1
