"""``xlog-actors demo --devices all|N``: the main job on N devices at once (:mod:`.multi_pipeline`),
beside N times the raw pipeline of one device measured in the same run.

With one device (``--devices 1``, or ``all`` where one is present) the single-device demo runs as
it does without the flag.
"""

from __future__ import annotations

import argparse
import sys

from ..driver.host import MAX_EMULATED_DEVICES, HostDriver
from ..driver.protocol import Driver
from ..errors import XlogError
from .batches import BatchData
from .driver_choice import choose_driver
from .multi_pipeline import (
    DEFAULT_PLACEMENT,
    MAX_RESTARTS,
    InjectedFault,
    MultiResult,
    run_on_devices,
)
from .options import UsageError
from .pipeline import PipelineConfig
from .raw_pipeline import RawResult, raw_pipeline

__all__ = ["PLACEMENT_TEXT", "resolve_devices", "run_multi_demo"]

#: What each placement is, as the demo says it.
PLACEMENT_TEXT = {
    "isolated": "isolated: one worker process per device, each with its own DeviceActor, library actors and "
                "orchestrating thread (an interpreter lock per device)",
    "in-process": "in-process: one DeviceActor and orchestrating thread per device in this process (one "
                  "interpreter lock for all)",
}


def resolve_devices(value: int | str, kind: str, present: int) -> int:
    """The device count ``--devices`` asks for on a driver with ``present`` devices.

    Args:
        value: the flag's checked value: ``"all"`` or an int >= 1.
        kind: the driver's kind; the host driver emulates as many devices as asked, up to
            ``MAX_EMULATED_DEVICES``.
        present: the devices the opened driver has.
    Returns:
        The count, at least 1.
    Raises:
        UsageError: more devices than present (or than the host driver emulates).
    Thread rule: any thread.
    """
    if value == "all":
        return present
    assert isinstance(value, int)
    if kind == "host":
        if value > MAX_EMULATED_DEVICES:
            raise UsageError(f"--devices {value}: the host driver emulates 1 to {MAX_EMULATED_DEVICES} devices")
        return value
    if value > present:
        raise UsageError(f"--devices {value}: the {kind} driver has {present} device(s); expected 'all' or 1 to "
                         f"{present}")
    return value


def run_multi_demo(args: argparse.Namespace) -> int | None:
    """Run the demo on ``args.devices`` devices and print the result; None when that is one
    device (the caller then runs the single-device demo).

    Args:
        args: the parsed ``demo`` flags; ``devices`` is ``"all"`` or an int >= 1, ``placement``
            ``"isolated"``, ``"in-process"`` or None (the default, isolated).
    Returns:
        0 when every batch of every device verified, 1 otherwise, None for one device.
    Raises:
        UsageError: more devices than present, a flag of the single-device demo
            (``--rebuild-at``), or ``--fault-device``/``--fault-at`` without the other, on one
            device, outside the devices or the batches, or with ``--graph``.
        NoGpu: ``cuda`` asked for where no GPU is usable.
    Thread rule: the command's main thread.
    """
    devices = getattr(args, "devices", None)
    placement = getattr(args, "placement", None)
    fault_device, fault_at = getattr(args, "fault_device", None), getattr(args, "fault_at", None)
    if (fault_device is None) != (fault_at is None):
        raise UsageError("--fault-device" + (" needs --fault-at" if fault_at is None else ": --fault-at needs it"))
    if devices in (None, 1):
        if placement is not None:
            raise UsageError(f"--placement {placement}: applies with --devices 2 or more (or all)")
        if fault_device is not None:
            raise UsageError(f"--fault-device {fault_device}: applies with --devices 2 or more (or all)")
        return None
    choice = choose_driver(args.driver)
    driver: Driver = choice.driver
    try:
        count = resolve_devices(devices, driver.kind, driver.device_count())
        if count == 1:
            if fault_device is not None:
                raise UsageError(f"--fault-device {fault_device}: applies with 2 devices or more; this driver has 1")
            if placement is not None:
                print("xlog-actors demo: one device: --placement is not used", file=sys.stderr)
            return None
        if fault_device is not None and fault_device >= count:
            raise UsageError(f"--fault-device {fault_device}: expected a device from 0 to {count - 1}")
        if args.graph and fault_device is not None:
            raise UsageError("--fault-device: the planted sticky error is the actor pipeline's test hook; "
                             "leave --graph out")
        if args.rebuild_at is not None:
            raise UsageError("--rebuild-at: a rebuild mid-run is a one-device demo; leave --devices out")
        if driver.kind == "host" and driver.device_count() < count:
            driver.close()
            driver = HostDriver(device_count=count)
        on_gpu = driver.kind == "cuda"
        batches = args.batches if args.batches is not None else (64 if on_gpu else 32)
        batch_mib = args.batch_mib if args.batch_mib is not None else (16.0 if on_gpu else 1.0)
        cfg = PipelineConfig(
            batches=batches,
            batch_bytes=max(4, int(batch_mib * (1 << 20)) // 4 * 4),
            depth=args.depth,
            track=not args.no_tracking,
            producer_delay_us=args.slow_producer_us,
            graph=args.graph,
            graph_lanes=args.graph_lanes,
        )
        if fault_at is not None and fault_at >= batches:
            raise UsageError(f"--fault-at {fault_at}: expected a batch index from 0 to {batches - 1}")
        fault = InjectedFault(fault_device, fault_at) if fault_device is not None and fault_at is not None else None
        placement = placement or DEFAULT_PLACEMENT
        print(f"xlog-actors demo: {choice.describe()}", file=sys.stderr)
        print(
            f"xlog-actors demo: copy in -> kernel -> copy out{' (graph mode)' if cfg.graph else ''} on {count} "
            f"devices at once ({placement}), "
            f"{batches} batches of {cfg.batch_bytes / (1 << 20):g} MiB per device, {cfg.depth} in flight each",
            file=sys.stderr,
        )
        if fault is not None:
            print(f"xlog-actors demo: a sticky error (an illegal address) planted on device {fault.ordinal} at its "
                  f"batch {fault.at}" + (f"; its worker process is replaced up to {MAX_RESTARTS} times"
                                         if placement == "isolated" else ""), file=sys.stderr)
        result = run_on_devices(driver.kind, count, cfg, placement, driver, fault=fault)
        print("xlog-actors demo: the same job raw (no actors) on device 0 alone, for comparison", file=sys.stderr)
        raw: RawResult | str
        try:
            raw = raw_pipeline(driver, BatchData(cfg.depth + 1, cfg.batch_bytes), cfg.batches, cfg.depth)
        except (RuntimeError, XlogError) as exc:
            raw = f"failed: {exc}"
        names = [driver.device_name(k) for k in range(count)]
    finally:
        driver.close()
    _report(result, cfg, raw, names, driver.kind)
    return 0 if result.ok else 1


def _report(result: MultiResult, cfg: PipelineConfig, raw: RawResult | str, names: list[str], kind: str) -> None:
    count = len(result.runs)
    mib = cfg.batch_bytes / (1 << 20)
    print(f"driver        {kind}")
    same = len(set(names)) == 1
    print(f"devices       {count} ({names[0] if same else ', '.join(names)}{', emulated' if kind == 'host' else ''})")
    print(f"placement     {PLACEMENT_TEXT[result.placement]}")
    print(f"batches       {cfg.batches} x {mib:g} MiB per device ({count * cfg.batches * mib:g} MiB in all, "
          "as much out)")
    print("mode          actors (CopyActor, KernelActor, CopyActor), one pipeline per device")
    print(f"tracking      {'on' if cfg.track else 'OFF'}")
    for run in result.runs:
        if run.result is None:
            print(f"device {run.ordinal:<6d} FAILED: {run.error}")
            continue
        r = run.result
        line = (f"device {run.ordinal:<6d} {run.throughput_bytes_s / 1e9:.3g} GB/s, {r.verified}/{r.batches} "
                f"verified, {r.seconds:.3f} s, generation {r.generation}")
        if result.placement == "isolated":
            line += f", restarts {run.restarts}"
            if run.restarts:
                line += " (verified per worker process: " + ", ".join(map(str, r.extra["verified_by_worker"])) + ")"
        if r.errors:
            line += "; errors: " + "; ".join(r.errors)
        print(line)
        for k, why in enumerate(run.faults, 1):
            print(f"  restart {k:<5d} worker process {k - 1} of device {run.ordinal} ended: {why}")
        if run.error is not None:
            print(f"  failed     device {run.ordinal}: {run.error}")
    gbs = result.throughput_bytes_s / 1e9
    print(f"aggregate     {gbs:.3g} GB/s ({count} devices at once, {result.seconds:.3f} s from the first start to the "
          "last end)")
    if isinstance(raw, RawResult) and raw.throughput_bytes_s > 0:
        one = raw.throughput_bytes_s / 1e9
        print(f"raw x {count:<7d} {count * one:.3g} GB/s ({count} x {one:.3g} GB/s, the raw three-stream pipeline on "
              f"device 0 alone); aggregate / that: {gbs / (count * one):.2f}x")
    else:
        print(f"raw x {count:<7d} {raw if isinstance(raw, str) else 'no time measured'}")
    verified = sum(run.result.verified for run in result.runs if run.result is not None)
    total = count * cfg.batches
    mismatched = {run.ordinal: run.result.mismatched[:10] for run in result.runs
                  if run.result is not None and run.result.mismatched}
    if mismatched:
        print(f"verification  FAILED: batches differ from the host reference (device: batches): {mismatched}")
    else:
        print(f"verification  {'ok' if result.ok else 'FAILED'}: {verified}/{total} batches match the host "
              "reference (device checksums; the first and last of each device byte for byte)")
