r"""The README's Python example runs to the end and the process exits.

pykka actors run on non-daemon threads, so an example that leaves its actors running never exits.
The README's first ``python`` block must therefore end by stopping them; its expected form:

```python
import xlog_actors as xa

device = xa.DeviceActor.start(0)                        # the GPU if reachable, else the host driver
copy = xa.CopyActor.start(device)
ref = device.ask(xa.Allocate(1 << 20, tag=xa.AllocTag("activations")))
copy.ask(xa.Fill(ref, 7))                               # on the copy actor's own stream, tracked
assert copy.ask(xa.CopyToHost(ref, nbytes=4)) == b"\x07" * 4
device.ask(xa.Rebuild("demo"))                          # ref.access() now raises GpuRefStale
copy.stop()
device.stop()                                           # stop the actors, or the process never exits
```
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def first_python_block(text: str) -> str:
    """The first fenced ``python`` block of a Markdown text (its code only)."""
    found = _BLOCK.search(text)
    assert found is not None, "no ```python block"
    return found.group(1)


def run_example(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XLOG_ACTORS_DRIVER": "host", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=ROOT)


def test_the_readme_python_example_exits() -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    try:
        proc = run_example(code, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the README's Python example did not exit within 60 s (are its actors stopped at the end?)")
    assert proc.returncode == 0, proc.stderr


def test_the_expected_form_exits() -> None:
    assert __doc__ is not None
    proc = run_example(first_python_block(__doc__), timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_an_example_that_leaves_its_actors_running_is_caught() -> None:
    """Without its last two lines the example hangs: its code runs to its end, and the process
    still does not exit (its actors' threads keep it), so the check above would fail on it."""
    assert __doc__ is not None
    code = first_python_block(__doc__)
    hanging = code.replace("copy.stop()\n", "").split("device.stop()")[0]
    assert "stop()" not in hanging
    env = {**os.environ, "XLOG_ACTORS_DRIVER": "host", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", hanging + 'print("the end", flush=True)\n'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == "the end\n", "the example did not run to its end in 60 s"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)  # a process with nothing left running exits at once
    finally:
        proc.kill()
        proc.communicate()
