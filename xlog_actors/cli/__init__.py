"""Layer 5: the command line. ``xlog-actors info | demo | bench`` (also ``python -m xlog_actors``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _add_driver(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver",
        choices=("auto", "cuda", "host"),
        default=None,
        help="which driver to run on (default: XLOG_ACTORS_DRIVER, else auto: the GPU where one is reachable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xlog-actors", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="driver, devices, memory, default stack, versions")
    _add_driver(info)

    demo = sub.add_parser("demo", help="the main job: a pipeline of worker actors passing GpuRefs across streams")
    _add_driver(demo)
    demo.add_argument(
        "--batches", type=int, default=None, help="batches through the pipeline (default: 64 on a GPU, 32 on the host)"
    )
    demo.add_argument(
        "--batch-mib", type=float, default=None, help="MiB per batch (default: 16 on a GPU, 1 on the host)"
    )
    demo.add_argument("--depth", type=int, default=4, help="batches in flight at once")
    demo.add_argument(
        "--rebuild-at", type=int, default=None, help="rebuild the device's context when this batch is produced"
    )
    demo.add_argument(
        "--no-tracking",
        action="store_true",
        help="switch the library actors' tracking off (shows the corruption it prevents)",
    )
    demo.add_argument(
        "--slow-producer-us", type=int, default=0, help="spin this long on the producer's stream before each input copy"
    )

    bench = sub.add_parser("bench", help="the benchmark suite: each figure beside its raw driver twin")
    _add_driver(bench)
    bench.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    bench.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    bench.add_argument(
        "--only", metavar="NAME", action="append", default=None, help="run only rows whose name contains NAME"
    )

    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import run_info

        return run_info(args.driver)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
