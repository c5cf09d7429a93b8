"""``xlog-actors memory PATH``: one self-contained HTML page (no external reference) with the tags
and the top allocation sites; bad input is one line and exit status 2. Where a headless browser is
available the page is opened in it and must raise no JavaScript error."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors.cli import main
from xlog_actors.cli.memory import render_html, timeline
from xlog_actors.memory import AsyncCudaResource, MemoryHistory, StreamPool

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "memory-timeline.png"


def _load_weights(res: Any, blocks: list[Any]) -> None:
    for _ in range(4):
        blocks.append(res.allocate(1 << 20, tag=xa.AllocTag("weights")))


def _step(res: Any) -> None:
    acts = []
    for _ in range(8):  # a loop, not a comprehension: a comprehension is a frame of its own on 3.11
        acts.append(res.allocate(64 << 10, tag=xa.AllocTag("activations")))
    for block in acts:
        res.deallocate(block)


@pytest.fixture
def snapshot_file(host_driver: Any, tmp_path: Path) -> Path:
    pool = StreamPool(host_driver, 0)
    res = AsyncCudaResource(host_driver, 0, pool)
    history = MemoryHistory()
    res.set_history(history)
    blocks: list[Any] = []
    _load_weights(res, blocks)
    for _ in range(10):
        _step(res)
    res.deallocate(blocks.pop())
    path = tmp_path / "snap.pickle"
    history.dump(path)
    res.set_history(None)
    for block in blocks:
        res.deallocate(block)
    pool.close()
    return path


def test_the_page_is_one_self_contained_file_with_tags_and_sites(snapshot_file: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "page.html"
    assert main(["memory", str(snapshot_file), "-o", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html", "snap.pickle"], "one file, nothing beside it"
    page = out.read_text(encoding="utf-8")
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page, re.IGNORECASE), "an external reference"
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", page, re.IGNORECASE)
    assert "<svg" in page and page.count('class="layer"') == 2
    assert 'data-tag="weights"' in page and 'data-tag="activations"' in page
    sites = page[page.index('<table id="sites">'):]
    assert "_load_weights" in sites and "_step" in sites
    # by bytes allocated: the activations' site (80 x 64 KiB = 5 MiB) before the weights' (4 MiB)
    assert sites.index("_step") < sites.index("_load_weights")


def test_the_timeline_replays_live_bytes_by_tag(snapshot_file: Path) -> None:
    with open(snapshot_file, "rb") as f:
        snap = pickle.load(f)
    tl = timeline(snap)
    assert tl.tags == ["weights", "activations"]  # the larger peak first
    final = tl.points[-1][1]
    assert final["weights"] == 3 << 20 and final["activations"] == 0
    assert tl.peak == (4 << 20) + 8 * (64 << 10)
    by_site = {site.split()[-1]: (nbytes, count, live) for site, nbytes, count, live, _ in tl.sites}
    assert by_site["_load_weights"] == (4 << 20, 4, 3 << 20)
    assert by_site["_step"] == (80 * (64 << 10), 80, 0)


def test_a_pytorch_snapshot_without_tags_renders_as_untagged() -> None:
    frames = [{"filename": "train.py", "line": 12, "name": "forward"}]
    snap = {
        "segments": [{"device": 0, "address": 0x1000, "total_size": 2048, "stream": 0, "segment_type": "small",
                      "allocated_size": 1024, "active_size": 1024,
                      "blocks": [{"address": 0x1000, "size": 1024, "requested_size": 1000,
                                  "state": "active_allocated", "frames": frames},
                                 {"address": 0x1400, "size": 1024, "requested_size": 0, "state": "inactive",
                                  "frames": []}]}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 0x1000, "size": 2048, "stream": 0, "frames": frames, "time_us": 1},
            {"action": "alloc", "addr": 0x1000, "size": 1024, "stream": 0, "frames": frames, "time_us": 2},
            {"action": "alloc", "addr": 0x1400, "size": 1024, "stream": 0, "frames": frames, "time_us": 3},
            {"action": "free_requested", "addr": 0x1400, "size": 1024, "stream": 0, "frames": [], "time_us": 4},
            {"action": "free_completed", "addr": 0x1400, "size": 1024, "stream": 0, "frames": [], "time_us": 5},
        ]],
    }
    tl = timeline(snap)
    assert tl.tags == ["untagged"] and tl.points[-1][1] == {"untagged": 1024} and tl.peak == 2048
    assert "train.py:12 forward" in render_html(snap)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "xlog_actors", "memory", *args], capture_output=True, text=True,
                          timeout=60, check=False, env=env, cwd=ROOT)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("ran code",))


@pytest.mark.parametrize("case", ["missing", "text", "not-a-snapshot", "bad-entries", "code", "bad-output"])
def test_bad_input_is_one_line_and_exit_status_2(case: str, tmp_path: Path, snapshot_file: Path) -> None:
    path = tmp_path / "input.pickle"
    args = [str(path)]
    if case == "text":
        path.write_text("hello\n")
    elif case == "not-a-snapshot":
        path.write_bytes(pickle.dumps({"a": 1}))
    elif case == "bad-entries":
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"size": 1}]]}))
    elif case == "code":
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": _Evil()}))
    elif case == "bad-output":
        args = [str(snapshot_file), "-o", str(tmp_path / "no-such-dir" / "out.html")]
    proc = _run(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "ran code" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], proc.stderr
    assert not list(tmp_path.glob("*.html"))


def _browser() -> tuple[Any, str] | str:
    """(playwright's sync API, a Chromium executable), or why there is none."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "no headless browser: the playwright package is not installed"
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        exe = shutil.which(name)
        if exe:
            return sync_playwright, exe
    return "no headless browser: no Chromium executable on PATH"


def test_the_page_opens_in_a_headless_browser_without_errors(snapshot_file: Path, tmp_path: Path) -> None:
    found = _browser()
    if isinstance(found, str):
        pytest.skip(found)
    sync_playwright, exe = found
    out = tmp_path / "page.html"
    assert main(["memory", str(snapshot_file), "-o", str(out)]) == 0
    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("request", lambda r: requests.append(r.url))
            page.goto(out.as_uri())
            box = page.locator("#chart").bounding_box()
            assert box is not None
            page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)
            readout = page.inner_text("#readout")
            target = SCREENSHOT if os.environ.get("XLOG_ACTORS_SAVE_SCREENSHOT") == "1" else tmp_path / "shot.png"
            page.screenshot(path=str(target), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert requests == [out.as_uri()], "the page asked for something beyond itself"
    assert "total:" in readout and "weights" in readout
