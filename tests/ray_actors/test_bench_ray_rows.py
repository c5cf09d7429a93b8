"""The Ray bench rows (``xlog-actors bench --ray``) without Ray: each is skipped with the reason,
and a plain ``bench`` does not include them. (With Ray they start a cluster of their own, which a
test process already connected to the session's cluster cannot do; docs/ray.md has their figures.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import xlog_actors as xa
from xlog_actors.cli import main
from xlog_actors.cli.bench import collect, row_names
from xlog_actors.cli.bench.rows_ray import RAY

pytestmark = pytest.mark.timeout(60)


def test_without_ray_every_ray_row_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    driver = xa.HostDriver()
    try:
        doc = collect(driver, quick=True, groups=[RAY])
    finally:
        driver.close()
    assert doc["rows"] == [] and doc["errors"] == []
    assert [s["name"] for s in doc["skipped"]] == list(RAY.names)
    assert all("pip install 'xlog-actors[ray]'" in s["reason"] for s in doc["skipped"])


def test_the_ray_rows_run_only_with_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not set(RAY.names) & set(row_names())
    assert main(["bench", "--driver", "host", "--quick", "--only", "ray fetch"]) == 2
    assert "matches no row" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)
    path = tmp_path / "ray.json"
    assert main(["bench", "--driver", "host", "--quick", "--ray", "--only", "ray fetch", "--json", str(path)]) == 0
    doc = json.loads(path.read_text(encoding="utf-8"))
    skipped = [s["name"] for s in doc["skipped"]]
    assert doc["rows"] == [] and skipped == ["ray fetch 64 MiB", "ray fetch 64 MiB to the caller"]
