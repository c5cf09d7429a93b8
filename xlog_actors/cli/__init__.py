"""Layer 5: the command line. ``xlog-actors info | demo | bench | memory | chaos`` (also ``python -m xlog_actors``).

Every flag is checked before any work starts: a mistake is one line on stderr naming the flag and
what it accepts, with exit status 2; ``--driver cuda`` where no GPU is usable is one line naming what
is missing, with exit status 1. A closed stdout (``xlog-actors info | head -c1``) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from .driver_choice import KINDS, NoGpu
from .options import EXIT_USAGE, OneLineParser, UsageError, at_least, device_count, positive_float, writable_file

__all__ = ["main"]

EXIT_NO_GPU = 1
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE


def _add_driver(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver",
        choices=KINDS,
        default=None,
        help="which driver to run on (default: XLOG_ACTORS_DRIVER, else auto: the GPU where one is reachable)",
    )


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="xlog-actors", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"xlog-actors {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    info = sub.add_parser("info", help="driver, devices, memory, default stack, versions")
    _add_driver(info)

    demo = sub.add_parser("demo", help="the main job: a pipeline of worker actors passing GpuRefs across streams")
    _add_driver(demo)
    demo.add_argument(
        "--batches", type=at_least(1), default=None,
        help="batches through the pipeline, >= 1 (default: 64 on a GPU, 32 on the host)",
    )
    demo.add_argument(
        "--batch-mib", type=positive_float, default=None,
        help="MiB per batch, > 0 (default: 16 on a GPU, 1 on the host)",
    )
    demo.add_argument("--depth", type=at_least(1), default=4, help="batches in flight at once, >= 1")
    demo.add_argument(
        "--rebuild-at", type=at_least(0), default=None,
        help="rebuild the device's context when this batch (0 .. batches-1) is produced",
    )
    demo.add_argument(
        "--no-tracking",
        action="store_true",
        help="switch the library actors' tracking off (shows the corruption it prevents)",
    )
    demo.add_argument(
        "--slow-producer-us", type=at_least(0), default=0,
        help="spin this long (µs, >= 0) on the producer's stream before each input copy",
    )
    demo.add_argument(
        "--graph",
        action="store_true",
        help="graph mode: the ring's batches recorded once as device graphs (BatchGraph), replayed per batch",
    )
    demo.add_argument(
        "--graph-lanes", type=at_least(1), default=None, metavar="N",
        help="with --graph: batches per replay, each a lane of one graph over its own ring slot, 1 .. --depth "
        "(default: half the ring for batches of at most 1 MiB, else 1)",
    )
    demo.add_argument(
        "--devices", type=device_count, default=None, metavar="all|N",
        help="run the job on N devices at once, one pipeline each ('all': every device; the host driver "
        "emulates N; default: one device)",
    )
    demo.add_argument(
        "--placement", choices=("isolated", "in-process"), default=None,
        help="with --devices N > 1: one worker process per device (isolated, the default) or every device in "
        "this process",
    )
    demo.add_argument(
        "--fault-device", type=at_least(0), default=None, metavar="K",
        help="with --devices N > 1 and --fault-at: plant a sticky error (an illegal address) on device K "
        "(0 .. N-1); isolated, its worker process is replaced and runs the batches not verified",
    )
    demo.add_argument(
        "--fault-at", type=at_least(0), default=None, metavar="BATCH",
        help="with --fault-device: the batch (0 .. batches-1) of that device at which the error is planted",
    )

    bench = sub.add_parser("bench", help="the benchmark suite: each figure beside its raw driver twin")
    _add_driver(bench)
    bench.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    bench.add_argument(
        "--json", metavar="PATH", type=writable_file, default=None,
        help="also write the results as JSON (its directory must exist and be writable)",
    )
    bench.add_argument(
        "--only", metavar="NAME", action="append", default=None, help="run only rows whose name contains NAME"
    )
    bench.add_argument(
        "--ray", action="store_true",
        help="also the Ray rows, on a simulated three-node cluster (needs the ray extra; ~1 min more)",
    )
    memory = sub.add_parser("memory", help="render a memory snapshot as one self-contained HTML timeline")
    memory.add_argument("path", metavar="PATH", help="a pickled memory snapshot (MemoryHistory.dump)")
    memory.add_argument(
        "-o", "--output", metavar="OUT.html", type=writable_file, default=None,
        help="where to write the page (default: PATH with .html; its directory must exist and be writable)",
    )
    chaos = sub.add_parser(
        "chaos", help="faults, kills and restarts under load, every invariant checked (exit 1 when one broke)"
    )
    _add_driver(chaos)
    chaos.add_argument(
        "--seconds", type=positive_float, default=60.0,
        help="seconds of load in all, > 0, split between the devices (default 60)",
    )
    chaos.add_argument("--seed", type=at_least(0), default=1, help="the random choices' seed, >= 0 (default 1)")
    chaos.add_argument("--threads", type=at_least(1), default=8, help="load threads, 1 to 64 (default 8)")
    chaos.add_argument(
        "--workers", type=at_least(0), default=2, help="worker processes handles are sent to, 0 to 8 (default 2)"
    )
    chaos.add_argument(
        "--fault-every", metavar="SECONDS", type=positive_float, default=3.0,
        help="the mean interval between faults, > 0 (default 3)",
    )
    chaos.add_argument(
        "--devices", choices=("both", "in-process", "isolated"), default="both",
        help="which device to run: both one after the other (default), or one of them",
    )
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "info":
        from .info import run_info

        return run_info(args.driver)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "chaos":
        from .chaos import run_chaos

        return run_chaos(args)
    if args.command == "memory":
        from .memory import run_memory

        return run_memory(args.path, args.output)
    from .bench import run_bench

    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``xlog-actors`` command.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    Returns:
        The exit status: 0 on success, 1 when a run failed (or ``--driver cuda`` has no GPU),
        2 for a command-line mistake, 141 when stdout was closed early.
    Raises:
        SystemExit: from argparse for ``--help``, ``--version`` and bad flags (status 0 or 2).
    Thread rule: the process's main thread.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # a closed pipe is met here, not at interpreter exit
        return status
    except UsageError as exc:
        print(f"xlog-actors {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NoGpu as exc:
        print(f"xlog-actors {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    except BrokenPipeError:
        # The reader went away: point stdout at devnull so the flush at exit cannot raise again
        # (the advice of the Python docs on SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
