"""``scripts/workers_anatomy.py``, the probe the 16-worker row's variants are chosen by: its
chained and spinning futures wake each asker exactly once, in order, and never leave one waiting
for good; a run of every variant restores the product's future and loop as they were."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pykka
import pytest

from xlog_actors.actors import DeviceActor, pykka_internals
from xlog_actors.actors.latch_future import LatchFuture

TIMEOUT = 10.0
SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "workers_anatomy.py"


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("workers_anatomy", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["workers_anatomy"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _served_batch(probe: ModuleType, name: str, count: int) -> list[Any]:
    """``count`` futures of variant ``name`` filled and released as the batching loop does."""
    variant = probe.Variant.parse(name, force_spin=True)
    futures = [variant.make_future() for _ in range(count)]
    opened = [future.fill(i) for i, future in enumerate(futures)]
    for latch in opened:
        latch.release()
    return futures


def _is_open(future: Any) -> bool:
    if future._latch.acquire(False):
        future._latch.release()
        return True
    return False


@pytest.mark.parametrize("name", ["chain", "spin+chain"])
def test_a_chained_batch_wakes_its_first_asker_and_each_get_wakes_the_next(probe: ModuleType, name: str) -> None:
    futures = _served_batch(probe, name, 3)
    assert [_is_open(f) for f in futures] == [True, False, False]
    assert futures[0].get(timeout=TIMEOUT) == 0
    assert [_is_open(f) for f in futures] == [True, True, False]
    assert futures[1].get(timeout=TIMEOUT) == 1
    assert futures[2].get(timeout=TIMEOUT) == 2
    assert futures[0].get(timeout=TIMEOUT) == 0  # a second get reads the same reply


def test_a_late_chain_wakes_the_next_asker_at_this_threads_next_ask(probe: ModuleType) -> None:
    variant = probe.Variant.parse("late", force_spin=False)
    futures = _served_batch(probe, "late", 2)
    assert futures[0].get(timeout=TIMEOUT) == 0
    assert not _is_open(futures[1])
    variant.make_future()  # this thread's next ask
    assert futures[1].get(timeout=TIMEOUT) == 1


def test_a_chained_asker_whose_predecessor_never_gets_opens_itself_after_the_fallback(probe: ModuleType) -> None:
    futures = _served_batch(probe, "chain", 2)
    start = time.monotonic()
    assert futures[1].get(timeout=TIMEOUT) == 1  # futures[0] never gets: its successor goes anyway
    assert time.monotonic() - start < probe.CHAIN_FALLBACK_S + 1.0


def test_a_chained_get_with_a_timeout_that_nobody_answers_raises_timeout(probe: ModuleType) -> None:
    future = probe.Variant.parse("spin+chain", force_spin=True).make_future()
    with pytest.raises(pykka.Timeout):
        future.get(timeout=0.01)


def test_a_probe_future_set_directly_or_with_an_error_wakes_its_asker(probe: ModuleType) -> None:
    make = probe.Variant.parse("spin+chain", force_spin=True).make_future
    done, failed = make(), make()
    threading.Thread(target=done.set, args=(7,)).start()
    assert done.get(timeout=TIMEOUT) == 7
    try:
        raise ValueError("boom")
    except ValueError:
        failed.set_exception()
    with pytest.raises(ValueError, match="boom"):
        failed.get(timeout=TIMEOUT)


def test_an_unknown_or_contradictory_variant_is_refused(probe: ModuleType) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        probe.Variant.parse("now+fast", force_spin=False)
    with pytest.raises(SystemExit, match="pick one"):
        probe.Variant.parse("chain+late", force_spin=False)


@pytest.mark.timeout(120)
def test_one_round_of_every_variant_prints_each_ratio_and_restores_the_product(
    probe: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    own_future = DeviceActor.__dict__["_create_future"]
    every = [*probe.DEFAULT_VARIANTS, "pykka"]
    probe.main(["host", "--rounds", "1", "--force-spin", "--variants", ",".join(every)])
    lines = capsys.readouterr().out.splitlines()
    for name in every:
        assert any(line.split()[:1] == [name] and "x " in line for line in lines), name
    assert DeviceActor.__dict__["_create_future"] is own_future
    assert pykka_internals.LatchFuture is LatchFuture
    assert pykka_internals.DEFER_WAKES is True
