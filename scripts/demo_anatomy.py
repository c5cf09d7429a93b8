"""Where the demo's time goes, per thread: CPU seconds of each thread of a ``run_pipeline`` run
(read from ``/proc/self/task`` by a sampling thread), beside the run's wall time, for a few ring
depths. If the threads' CPU adds up to about the wall time, the run is bound by the interpreter
(one GIL), and the per-batch CPU of each stage says which one to make cheaper.

    python scripts/demo_anatomy.py [cuda|host] [batch size] [batches]

The batch size is bytes with an optional K or M suffix (``64K``, ``1M``, ``16M``; a multiple of
4), the demo's batch sizes of the bench.

Linux only. Prints one block per depth: GB/s, wall µs per batch, then CPU µs per batch per thread,
over the timed part of the run only.

When to use: the bench's ``demo pipeline`` row (or ``xlog-actors demo``) is slower than its raw
twin and you need to know which thread's CPU per batch to cut; the bench reports only the total.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from xlog_actors.cli import pipeline
from xlog_actors.cli.pipeline import PipelineConfig, run_pipeline
from xlog_actors.driver import open_driver


def _cpu_by_tid() -> dict[int, float]:
    """CPU seconds of each thread of this process (``schedstat``: nanoseconds on the CPU)."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return out


def _size(text: str) -> int:
    """``text`` (``64K``, ``1M``, ``16M``, ``4096``) as bytes: a positive multiple of 4."""
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    try:
        nbytes = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64K, 1M, 16M)") from None
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"a batch is a positive multiple of 4 bytes, got {text!r}")
    return nbytes


def _measure(driver: object, depth: int, nbytes: int, batches: int) -> None:
    last: dict[int, float] = {}
    before: dict[int, float] = {}
    names: dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for t in threading.enumerate():
                if t.native_id is not None:
                    names[t.native_id] = t.name
            time.sleep(0.005)

    real_drive = pipeline._drive

    def drive(*args: object) -> float:
        # Only the timed part: from the first copy in to the last batch verified.
        before.update(_cpu_by_tid())
        seconds: float = real_drive(*args)  # type: ignore[arg-type]
        last.update(_cpu_by_tid())
        stop.set()
        return seconds

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    sampler.start()
    pipeline._drive = drive  # type: ignore[assignment]
    try:
        result = run_pipeline(driver, PipelineConfig(batches=batches, batch_bytes=nbytes, depth=depth))  # type: ignore[arg-type]
    finally:
        pipeline._drive = real_drive
        stop.set()
        sampler.join()
    print(f"depth {depth}: ok={result.ok} {result.throughput_bytes_s / 1e9:.2f} GB/s, "
          f"{result.seconds / batches * 1e6:.0f} us wall per batch")
    rows: dict[str, float] = {}
    for tid, cpu in last.items():
        name = names.get(tid, "native")
        rows[name] = rows.get(name, 0.0) + cpu - before.get(tid, 0.0)
    print(f"  {'all threads':40s} {sum(rows.values()) / batches * 1e6:8.0f} us CPU per batch")
    for name, cpu in sorted(rows.items(), key=lambda kv: -kv[1]):
        if cpu > 0:
            print(f"  {name:40s} {cpu / batches * 1e6:8.0f} us CPU per batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="cuda", choices=("cuda", "host"), help="driver (default cuda)")
    parser.add_argument("size", nargs="?", type=_size, default=16 << 20,
                        help="bytes per batch, with a K or M suffix (default 16M)")
    parser.add_argument("batches", nargs="?", type=int, default=256, help="batches per run (default 256)")
    args = parser.parse_args()
    kind, nbytes, batches = args.kind, args.size, args.batches
    driver = open_driver(kind)
    run_pipeline(driver, PipelineConfig(batches=4, batch_bytes=nbytes))  # warm-up
    for depth in (4, 8):
        _measure(driver, depth, nbytes, batches)


if __name__ == "__main__":
    main()
