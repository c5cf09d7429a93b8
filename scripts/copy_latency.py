"""Where a CopyActor's copy loses time against the raw calls: each ask of the bench's copy rows
split into the message's trip to the actor, the handler, and the reply's trip back.

    python scripts/copy_latency.py [cuda|host] [MiB] [samples]

Prints, for the H2D row's pattern (ask CopyToDevice, then ask a 1-byte CopyToHost that
synchronizes) and the D2D row's (8 x ask CopyDeviceToDevice, then the same sync): the median
microseconds of each piece, per ask position, and the whole sample beside the raw calls.

When to use: a ``CopyActor H2D pinned`` or ``CopyActor D2D`` bench row falls below its raw twin
and you need to know whether the message trip, the handler or the reply costs the difference.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from xlog_actors.actors import Allocate, CopyActor, CopyDeviceToDevice, CopyToDevice, CopyToHost, DeviceActor
from xlog_actors.actors.messages import AllocatePinned
from xlog_actors.driver import open_driver

_marks: dict[str, list[float]] = {}
_local = threading.local()
_real_receive = CopyActor.on_receive


def _receive(self: Any, message: Any) -> Any:
    _marks.setdefault("recv", []).append(time.perf_counter())
    try:
        return _real_receive(self, message)
    finally:
        _marks.setdefault("done", []).append(time.perf_counter())


def _median_us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:8.1f}"


def _pattern(name: str, asks: list[Any], ask: Any, samples: int, raw: Any) -> None:
    rows: list[list[tuple[float, float, float, float]]] = []
    whole: list[float] = []
    raw_times: list[float] = []
    for _ in range(samples):
        _marks.clear()
        sent: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        for message in asks:
            s = time.perf_counter()
            ask(message)
            sent.append((s, time.perf_counter()))
        whole.append(time.perf_counter() - t0)
        rows.append([(s, r, d, e) for (s, e), r, d in zip(sent, _marks["recv"], _marks["done"], strict=True)])
        t = time.perf_counter()
        raw()
        raw_times.append(time.perf_counter() - t)
    print(f"{name}: sample {_median_us(whole)} us, raw {_median_us(raw_times)} us, "
          f"ratio {statistics.median(raw_times) / statistics.median(whole):.3f}")
    print("   ask  to-actor  handler  to-caller (median us)")
    for i in range(len(asks)):
        trip = [r[i][1] - r[i][0] for r in rows]
        handler = [r[i][2] - r[i][1] for r in rows]
        back = [r[i][3] - r[i][2] for r in rows]
        print(f"   {i:3d} {_median_us(trip)} {_median_us(handler)} {_median_us(back)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="host", choices=("cuda", "host"), help="driver (default host)")
    parser.add_argument("mib", nargs="?", type=int, default=256, help="MiB per copy (default 256)")
    parser.add_argument("samples", nargs="?", type=int, default=20, help="samples of each pattern (default 20)")
    args = parser.parse_args()
    kind, mib, samples = args.kind, args.mib, args.samples
    nbytes = mib << 20
    driver = open_driver(kind)
    CopyActor.on_receive = _receive  # type: ignore[method-assign]
    device = DeviceActor.start(0, driver)
    copy = CopyActor.start(device)
    try:
        host = device.ask(AllocatePinned(nbytes))
        host.array()[:] = 3
        ref = device.ask(Allocate(nbytes))
        src = device.ask(Allocate(nbytes))
        dst = device.ask(Allocate(nbytes))
        stream = driver.create_stream(0)
        view = host.view()
        dptr, sptr, tptr = ref.raw_device_ptr(), src.raw_device_ptr(), dst.raw_device_ptr()

        def raw_h2d() -> None:
            driver.copy_to_device(dptr, view, stream)
            stream.synchronize()

        def raw_d2d() -> None:
            for _ in range(8):
                driver.copy_device_to_device(tptr, sptr, nbytes, stream)
            stream.synchronize()

        sync = CopyToHost(ref, nbytes=1)
        for _ in range(3):  # warm up both
            copy.ask(CopyToDevice(ref, host))
            copy.ask(sync)
            raw_h2d()
        _pattern(f"H2D {mib} MiB pinned", [CopyToDevice(ref, host), sync], copy.ask, samples, raw_h2d)
        _pattern(f"D2D {mib} MiB x8", [CopyDeviceToDevice(src, dst)] * 8 + [CopyToHost(dst, nbytes=1)], copy.ask,
                 samples, raw_d2d)
        stream.synchronize()
        stream.close()
    finally:
        copy.stop()
        device.stop()
        driver.close()


if __name__ == "__main__":
    main()
