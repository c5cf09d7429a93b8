"""An isolated device's ``Allocate`` round trip, variant by variant, in one process, rounds
interleaved: through the call lane (``_core.call_lane``, the product where the waits spin) and
through the pipe (the lane taken away from the serving child); each beside a bare pykka ask of
the same round.

    python scripts/isolated_anatomy.py [cuda|host] [rounds] [asks per round]

Prints the median µs per ask of each variant, its ratio to the bare ask, and how many asks the
lane answered.

When to use: the bench's ``isolated Allocate`` row moved, or you change the call lane, the pipe
or ``_proxy.CALL_LANE``'s default: this shows lane against pipe against a bare ask in one run,
which the bench (the product's choice only) does not.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import pykka

from xlog_actors.actors import Allocate, DeviceActor, GetStats
from xlog_actors.actors.isolated import _proxy


class _Echo(pykka.ThreadingActor):
    def on_receive(self, message: Any) -> Any:
        return None


def _time(ask: Any, msg: Any, n: int) -> float:
    held: list[Any] = [None]
    t = time.perf_counter()
    for _ in range(n):
        held[0] = None
        held[0] = ask(msg)
    per = (time.perf_counter() - t) / n * 1e6
    held[0] = None
    return per


def main(kind: str, rounds: int, n: int) -> None:
    _proxy.CALL_LANE = True
    device = DeviceActor.start(0, kind, isolate=True)
    device.ask(GetStats())  # the proxy started: its inbox serves in the caller
    child = device.actor_inbox.serve.__self__._child  # type: ignore[attr-defined] # the proxy, by its inbox
    lane = child.lane
    echo = _Echo.start()
    msg = Allocate(4096)
    variants = {"call lane": lane, "pipe": None}
    times: dict[str, list[float]] = {name: [] for name in [*variants, "bare ask"]}
    answered = 0
    try:
        for value in variants.values():  # warm both
            child.lane = value
            _time(device.ask, msg, n)
        for r in range(rounds):
            order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
            for name, value in order:
                child.lane = value
                before = child.lane_answers
                times[name].append(_time(device.ask, msg, n))
                if value is not None:
                    answered += child.lane_answers - before
            times["bare ask"].append(_time(echo.ask, msg, n))
    finally:
        child.lane = lane
        _proxy.CALL_LANE = None
        echo.stop()
        device.stop()
    bare = statistics.median(times["bare ask"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:12s} {m:8.1f} us  {m / bare:6.3f}x the bare ask   (rounds: {', '.join(f'{t:.0f}' for t in ts)})")
    print(f"the lane answered {answered} of {rounds * n} asks in it")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="cuda", choices=("cuda", "host"), help="driver (default cuda)")
    parser.add_argument("rounds", nargs="?", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("asks", nargs="?", type=int, default=2000, help="asks per round (default 2000)")
    args = parser.parse_args()
    main(args.kind, args.rounds, args.asks)
