"""``xlog-actors memory PATH [-o OUT.html]``: a memory snapshot rendered as one self-contained HTML
file: live bytes over time, stacked by tag, and the top allocation sites by bytes.

``PATH`` is a pickled snapshot in the format of ``torch.cuda.memory._snapshot()``, as
``MemoryHistory.dump`` writes it (or as PyTorch's ``_dump_snapshot`` does: its entries carry no
tag and are drawn as ``untagged``). The page has no external reference: the chart is inline SVG,
the hover read-out a few lines of inline JavaScript. The file is read with an unpickler that
refuses every class, so a snapshot can only hold plain data (dicts, lists, tuples, strings,
numbers): loading a file made to run code fails as "not a snapshot".
"""

from __future__ import annotations

import html
import io
import json
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .options import UsageError

__all__ = ["MemoryTimeline", "load_snapshot", "render_html", "run_memory", "timeline"]

#: Points drawn at most; a longer trace keeps the largest total of each bucket of events.
MAX_POINTS = 1500
#: Allocation sites listed.
TOP_SITES = 20
UNTAGGED = "untagged"
NO_FRAME = "<no Python frame>"
_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a snapshot holds plain data only, not {module}.{name}")


def load_snapshot(path: str) -> dict[str, Any]:
    """Read and check a snapshot file.

    Args:
        path: the pickled snapshot.
    Returns:
        The snapshot dict.
    Raises:
        UsageError: the file cannot be read, is not a pickle of plain data, or is not a snapshot
            (a dict with a ``device_traces`` list of lists of entries with ``action``, or a
            ``segments`` list).
    Thread rule: any thread.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not a snapshot"
        raise UsageError(f"{path} is not a memory snapshot (not a pickle of plain data: {exc})") from None
    if isinstance(data, list):  # PyTorch's reader accepts a bare segment list too
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or ("device_traces" not in data and "segments" not in data):
        raise UsageError(f"{path} is not a memory snapshot (no 'device_traces' or 'segments')")
    traces = data.get("device_traces", [])
    segments = data.get("segments", [])
    if not isinstance(traces, list) or not all(isinstance(d, list) for d in traces):
        raise UsageError(f"{path} is not a memory snapshot ('device_traces' is not a list of lists)")
    for device in traces:
        for e in device:
            if not isinstance(e, dict) or not isinstance(e.get("action"), str) or not _is_int(e.get("size", 0)):
                raise UsageError(f"{path} is not a memory snapshot (a trace entry without 'action' and 'size')")
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise UsageError(f"{path} is not a memory snapshot ('segments' is not a list of dicts)")
    return data


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _site(frames: object) -> str:
    if isinstance(frames, list) and frames and isinstance(frames[0], dict):
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
    return NO_FRAME


@dataclass
class MemoryTimeline:
    """What the page draws: ``tags`` (in legend order), ``points`` (``(time, {tag: live
    bytes})``, time in µs from the first event, or the event's index where entries carry no
    ``time_us``), ``sites`` (``(site, bytes allocated, allocations, bytes still live, tags)``,
    largest first), ``peak`` (the largest total), ``events`` (trace entries read), ``dropped``.

    Thread rule: plain data; any thread.
    """

    tags: list[str] = field(default_factory=list)
    points: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    sites: list[tuple[str, int, int, int, list[str]]] = field(default_factory=list)
    peak: int = 0
    events: int = 0
    dropped: int = 0
    timed: bool = True


def timeline(snapshot: dict[str, Any]) -> MemoryTimeline:
    """Replay a snapshot's traces (all devices, by time) into live bytes per tag.

    Blocks live before the trace began (freed in it without an allocation in it, or live at the
    end with none) count from the start. ``alloc`` adds, ``free_completed`` takes away.

    Thread rule: any thread.
    """
    entries: list[dict[str, Any]] = [
        {**e, "device": d} for d, device in enumerate(snapshot.get("device_traces", [])) for e in device
    ]
    timed = all(_is_int(e.get("time_us")) for e in entries)
    if timed:
        entries.sort(key=lambda e: e["time_us"])
    allocated: dict[tuple[Any, Any], tuple[str, str, int]] = {}  # (device, addr) -> (tag, site, size)
    initial: dict[str, int] = defaultdict(int)
    seen_alloc: set[tuple[Any, Any]] = set()
    for e in entries:
        key = (e.get("device", 0), e.get("addr"))
        if e["action"] == "alloc":
            seen_alloc.add(key)
        elif e["action"] == "free_completed" and key not in seen_alloc:
            initial[str(e.get("tag", UNTAGGED))] += int(e.get("size", 0))
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []) if isinstance(seg.get("blocks"), list) else []:
            if isinstance(b, dict) and b.get("state") == "active_allocated":
                addr = b.get("address", seg.get("address"))
                if (seg.get("device", 0), addr) not in seen_alloc:
                    initial[str(b.get("tag", seg.get("tag", UNTAGGED)))] += int(b.get("size", 0))
    live: dict[str, int] = defaultdict(int, initial)
    site_bytes: dict[str, list[Any]] = {}
    live_by_site: dict[str, int] = defaultdict(int)
    t0 = entries[0]["time_us"] if timed and entries else 0
    raw_points: list[tuple[float, dict[str, int]]] = [(0.0, dict(live))]
    for i, e in enumerate(entries):
        action, size = e["action"], int(e.get("size", 0))
        tag = str(e.get("tag", UNTAGGED))
        key = (e.get("device", 0), e.get("addr"))
        if action == "alloc":
            site = _site(e.get("frames"))
            live[tag] += size
            allocated[key] = (tag, site, size)
            s = site_bytes.setdefault(site, [0, 0, set()])
            s[0] += size
            s[1] += 1
            s[2].add(tag)
            live_by_site[site] += size
        elif action == "free_completed":
            known = allocated.pop(key, None)
            if known is not None:
                tag = known[0]
                live_by_site[known[1]] -= known[2]
            live[tag] = max(0, live[tag] - size)
        else:
            continue
        raw_points.append((float(e["time_us"] - t0) if timed else float(i + 1), dict(live)))
    tags = sorted({t for _, p in raw_points for t in p}, key=lambda t: -max(p.get(t, 0) for _, p in raw_points))
    meta = snapshot.get("xlog_actors")
    dropped = int(meta.get("dropped", 0)) if isinstance(meta, dict) and _is_int(meta.get("dropped")) else 0
    sites = sorted(
        ((name, v[0], v[1], live_by_site[name], sorted(v[2])) for name, v in site_bytes.items()),
        key=lambda s: (-s[1], s[0]),
    )[:TOP_SITES]
    return MemoryTimeline(
        tags=tags, points=_downsample(raw_points), sites=sites,
        peak=max((sum(p.values()) for _, p in raw_points), default=0),
        events=len(entries), dropped=dropped, timed=timed,
    )


def _downsample(points: list[tuple[float, dict[str, int]]]) -> list[tuple[float, dict[str, int]]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / MAX_POINTS
    out = []
    for b in range(MAX_POINTS):
        bucket = points[int(b * step): max(int((b + 1) * step), int(b * step) + 1)]
        out.append(max(bucket, key=lambda p: sum(p[1].values())))
    if out[-1] is not points[-1]:
        out.append(points[-1])
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _svg(tl: MemoryTimeline, width: int = 960, height: int = 320) -> str:
    left, right, top, bottom = 70, 10, 10, 30
    pw, ph = width - left - right, height - top - bottom
    t_end = max((t for t, _ in tl.points), default=1.0) or 1.0
    y_max = tl.peak or 1

    def x(t: float) -> float:
        return left + pw * t / t_end

    def y(v: float) -> float:
        return top + ph - ph * v / y_max

    parts = [f'<svg id="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="live bytes over time, stacked by tag">']
    for k in range(5):  # grid and y labels
        v = y_max * k / 4
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">'
                     f'{html.escape(_human(v))}</text>')
    unit = "µs" if tl.timed else "event"
    for k in range(5):
        t = t_end * k / 4
        label = f"{t / 1e6:.3g} s" if tl.timed and t_end >= 1e6 else (
            f"{t / 1e3:.3g} ms" if tl.timed and t_end >= 1e3 else f"{t:.0f} {unit}")
        anchor = "start" if k == 0 else ("end" if k == 4 else "middle")
        parts.append(f'<text x="{x(t):.1f}" y="{height - 10}" font-size="11" text-anchor="{anchor}">'
                     f'{html.escape(label)}</text>')
    below = [0] * len(tl.points)
    for i, tag in enumerate(tl.tags):
        upper = [below[j] + p.get(tag, 0) for j, (_, p) in enumerate(tl.points)]
        top_pts, bot_pts = [], []
        for j, (t, _) in enumerate(tl.points):  # a step chart: the value holds until the next event
            if j:
                top_pts.append(f"{x(t):.1f},{y(upper[j - 1]):.1f}")
                bot_pts.append(f"{x(t):.1f},{y(below[j - 1]):.1f}")
            top_pts.append(f"{x(t):.1f},{y(upper[j]):.1f}")
            bot_pts.append(f"{x(t):.1f},{y(below[j]):.1f}")
        poly = " ".join(top_pts + bot_pts[::-1])
        parts.append(f'<polygon class="layer" data-tag="{html.escape(tag)}" points="{poly}" '
                     f'fill="{_COLORS[i % len(_COLORS)]}" fill-opacity="0.85" stroke="none"/>')
        below = upper
    parts.append(f'<line id="cursor" x1="0" x2="0" y1="{top}" y2="{top + ph}" stroke="#333" visibility="hidden"/>')
    parts.append("</svg>")
    return "\n".join(parts)


_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var svg = document.getElementById("chart"), cursor = document.getElementById("cursor");
  var out = document.getElementById("readout");
  function human(n) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
  }
  svg.addEventListener("mousemove", function (ev) {
    var box = svg.getBoundingClientRect();
    var px = (ev.clientX - box.left) * (data.width / box.width);
    var t = (px - data.left) / data.plotWidth * data.tEnd;
    var best = 0;
    for (var i = 0; i < data.times.length; i++) { if (data.times[i] <= t) best = i; }
    cursor.setAttribute("x1", px); cursor.setAttribute("x2", px);
    cursor.setAttribute("visibility", "visible");
    var lines = [data.unit === "us" ? (data.times[best] / 1000).toFixed(3) + " ms" : "event " + data.times[best]];
    var total = 0;
    data.tags.forEach(function (tag, k) {
      var v = data.values[k][best]; total += v;
      if (v) lines.push(tag + ": " + human(v));
    });
    lines.push("total: " + human(total));
    out.textContent = lines.join("   ");
  });
})();
"""


def render_html(snapshot: dict[str, Any], title: str = "memory snapshot") -> str:
    """The page for ``snapshot``: one self-contained HTML document (no external reference).

    Thread rule: any thread.
    """
    tl = timeline(snapshot)
    width, left, right = 960, 70, 10
    t_end = max((t for t, _ in tl.points), default=1.0) or 1.0
    data = {
        "tags": tl.tags, "times": [t for t, _ in tl.points],
        "values": [[p.get(tag, 0) for _, p in tl.points] for tag in tl.tags],
        "width": width, "left": left, "plotWidth": width - left - right, "tEnd": t_end,
        "unit": "us" if tl.timed else "event",
    }
    legend = "".join(
        f'<span class="tag"><span class="swatch" style="background:{_COLORS[i % len(_COLORS)]}"></span>'
        f"{html.escape(tag)}</span>"
        for i, tag in enumerate(tl.tags)
    )
    rows = "".join(
        f"<tr><td><code>{html.escape(site)}</code></td><td>{html.escape(_human(nbytes))}</td><td>{count}</td>"
        f"<td>{html.escape(_human(live))}</td><td>{html.escape(', '.join(tags))}</td></tr>"
        for site, nbytes, count, live, tags in tl.sites
    )
    dropped = (f" The ring dropped the {tl.dropped:,} oldest events: blocks allocated before it count from the "
               "start." if tl.dropped else "")
    blob = json.dumps(data).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; font-size: 13px; }}
.tag {{ margin-right: 1.2em; font-size: 13px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }}
#readout {{ font-family: monospace; font-size: 12px; min-height: 1.4em; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p>{tl.events:,} trace entries; peak live {html.escape(_human(tl.peak))}.{html.escape(dropped)}</p>
<h2>Live bytes over time, by tag</h2>
<div id="legend">{legend}</div>
{_svg(tl, width)}
<div id="readout"></div>
<h2>Top allocation sites (by bytes allocated)</h2>
<table id="sites">
<tr><th>site (innermost frame)</th><th>bytes allocated</th><th>allocations</th><th>still live</th><th>tags</th></tr>
{rows}
</table>
<script type="application/json" id="timeline-data">{blob}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def default_output(path: str) -> str:
    """``PATH`` with its extension replaced by ``.html``. Thread rule: any thread."""
    root, _ext = os.path.splitext(path)
    return root + ".html"


def run_memory(path: str, out: str | None) -> int:
    """``xlog-actors memory``: render ``path`` to ``out`` (default ``PATH`` with ``.html``).

    Returns:
        0; the output's path is printed.
    Raises:
        UsageError: the input is missing or not a snapshot, or the output cannot be written.
    Thread rule: the command's main thread.
    """
    snapshot = load_snapshot(path)
    target = out or default_output(path)
    page = render_html(snapshot, title=f"memory snapshot: {os.path.basename(path)}")
    try:
        with open(target, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
    print(f"wrote {target}")
    return 0
