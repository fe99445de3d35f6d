"""A run's timeline as a Chrome trace (``trace.json`` in the run directory; opens in Perfetto).

One row (Chrome "process") per node plus one for the trainer; each row has lanes ("threads"):
spans that overlap on one row (a rollout node generates many groups at once) each take the
lowest free numbered lane, and a span may name a fixed lane of its own (``lane="weights"``).
Every span is a complete ("X") event timed on the controller's clock (``time.monotonic``,
microseconds since the tracer started), so rows of different processes never disagree.

Events stream to the file as the run goes (`flush` after each step) in the JSON array format.
The file is a complete JSON array at every moment: it starts as ``[]`` and each flush writes its
events over the closing ``]`` together with a new one, in one write, so the trace of a run
stopped any way (Ctrl-C, SIGTERM, a crash, ``kill -9``) still parses. Recording a span costs a
few microseconds; ``Tracer(None)`` records nothing.

    python -m arl.stats.trace_png runs/NAME/TRIAL/trace.json -o timeline.png
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_OPEN, _CLOSE = b"[\n", b"\n]\n"


class Tracer:
    """Records spans per row and lane and writes them to ``path`` (None: records nothing)."""

    def __init__(self, path: str | Path | None, *, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path) if path is not None else None
        self.enabled = self.path is not None
        self.clock = clock
        self.t0 = clock()
        self._rows: dict[str, int] = {}  # row name -> pid
        self._lanes: dict[tuple[str, int | str], int] = {}  # (row, lane) -> tid
        self._made: dict[str, int] = {}  # row -> lanes (tids) it has
        self._numbered: dict[tuple[str, int], int] = {}  # (row, tid) -> numbered lane
        # Per row, numbered lanes from ``_next`` up were never taken, and ``_free`` is a heap of
        # the lower ones given back: taking the lowest free lane costs O(log n), not O(n), with
        # thousands of spans open at once (a large batch's groups).
        self._next: dict[str, int] = {}
        self._free: dict[str, list[int]] = {}
        self._pending: list[str] = []
        self._fd: int | None = None
        self._end = 0  # file offset of the closing "]" that the next flush writes over
        self._first = True
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _keep_previous(self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._end = len(_OPEN)
            os.write(self._fd, _OPEN + _CLOSE)

    # ---- recording --------------------------------------------------------------------------
    def declare(self, *rows: str) -> None:
        """Fix the top-to-bottom order of rows (others follow in order of first use)."""
        for row in rows:
            self._pid(row)

    def span(
        self, row: str, name: str, *, cat: str = "", lane: str | None = None, **args: Any
    ) -> _Span:
        """``with tracer.span(row, name, **args) as a:`` times the block; update ``a`` to add
        arguments. An exception or a cancellation inside still records the span (marked)."""
        return _Span(self, row, name, cat, lane, args)

    async def timed(
        self, row: str, name: str, aw: Awaitable[T], *, cat: str = "", lane: str | None = None
    ) -> T:
        """Await ``aw`` inside a span; returns its result."""
        with self.span(row, name, cat=cat, lane=lane):
            return await aw

    def add(
        self,
        row: str,
        name: str,
        start: float,
        end: float,
        *,
        cat: str = "",
        lane: str = "main",
        **args: Any,
    ) -> None:
        """Record a span measured elsewhere (``start``/``end`` on this tracer's clock) on the
        named ``lane`` of ``row``."""
        if self.enabled:
            self._emit(row, name, cat, self._tid(row, lane), start, end, args)

    def flush(self) -> None:
        """Write the events recorded so far (the trainer calls it once per step)."""
        if self._fd is None or not self._pending:
            return
        sep = "" if self._first else ",\n"
        body = (sep + ",\n".join(self._pending)).encode()
        # One write puts the events and a new closing bracket where the old bracket was; the file
        # only grows, so nothing of the old bracket is left behind it.
        os.pwrite(self._fd, body + _CLOSE, self._end)
        self._end += len(body)
        self._first = False
        self._pending.clear()

    def close(self) -> None:
        """Write what is left and close the file (idempotent); the array is already ended."""
        if self._fd is None:
            return
        self.flush()
        os.close(self._fd)
        self._fd = None
        self.enabled = False

    # ---- rows and lanes ---------------------------------------------------------------------
    def _pid(self, row: str) -> int:
        pid = self._rows.get(row)
        if pid is None:
            pid = self._rows[row] = len(self._rows) + 1
            self._meta(pid, 0, "process_name", {"name": row})
            self._meta(pid, 0, "process_sort_index", {"sort_index": pid})
        return pid

    def _tid(self, row: str, lane: int | str) -> int:
        tid = self._lanes.get((row, lane))
        if tid is None:
            pid = self._pid(row)
            # Named lanes first, then the numbered ones in order: tids are unique per row.
            tid = self._lanes[(row, lane)] = self._made[row] = self._made.get(row, 0) + 1
            if isinstance(lane, int):
                self._numbered[(row, tid)] = lane
            label = lane if isinstance(lane, str) else f"lane {lane}"
            order = -tid if isinstance(lane, str) else 1000 + lane
            self._meta(pid, tid, "thread_name", {"name": label})
            self._meta(pid, tid, "thread_sort_index", {"sort_index": order})
        return tid

    def _take_lane(self, row: str) -> int:
        """The tid of ``row``'s lowest numbered lane that no open span holds."""
        free = self._free.get(row)
        if free:
            lane = heapq.heappop(free)
        else:
            lane = self._next.get(row, 0)
            self._next[row] = lane + 1
        return self._tid(row, lane)

    def _release_lane(self, row: str, tid: int) -> None:
        lane = self._numbered.get((row, tid))
        if lane is not None:
            heapq.heappush(self._free.setdefault(row, []), lane)

    # ---- output -----------------------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def _emit(
        self, row: str, name: str, cat: str, tid: int, start: float, end: float, args: dict
    ) -> None:
        ev = {
            "name": name,
            "cat": cat or name,
            "ph": "X",
            "ts": self._us(start),
            "dur": round(max(0.0, end - start) * 1e6, 1),
            "pid": self._pid(row),
            "tid": tid,
        }
        if args:
            ev["args"] = args
        self._pending.append(json.dumps(ev, separators=(",", ":"), default=str))

    def _meta(self, pid: int, tid: int, name: str, args: dict) -> None:
        ev = {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
        self._pending.append(json.dumps(ev, separators=(",", ":")))


class _Span:
    """The context manager of `Tracer.span`; yields its args dict."""

    __slots__ = ("tracer", "row", "name", "cat", "lane", "args", "start", "tid")

    def __init__(self, tracer: Tracer, row: str, name: str, cat: str, lane: str | None, args: dict):
        self.tracer, self.row, self.name, self.cat = tracer, row, name, cat
        self.lane, self.args = lane, args
        self.tid = 0

    def __enter__(self) -> dict:
        t = self.tracer
        if t.enabled:
            self.tid = t._take_lane(self.row) if self.lane is None else t._tid(self.row, self.lane)
        self.start = t.clock()
        return self.args

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        t = self.tracer
        if not t.enabled:
            return
        end = t.clock()
        if self.lane is None:
            t._release_lane(self.row, self.tid)
        if exc_type is not None:
            cancelled = issubclass(exc_type, asyncio.CancelledError)
            self.args["cancelled" if cancelled else "error"] = (
                True if cancelled else exc_type.__name__
            )
        t._emit(self.row, self.name, self.cat, self.tid, self.start, end, self.args)


def _keep_previous(path: Path) -> None:
    """A resumed run starts a new trace; the earlier one is kept as trace.1.json, ..."""
    if not path.exists():
        return
    n = 1
    while (old := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(old)


# ---- reading ----------------------------------------------------------------------------------
class TraceFileError(ValueError):
    """A file that is not a trace (the message names it and what is wrong)."""


def load_trace(path: str | Path) -> list[dict]:
    """The events of a trace file (array or ``{"traceEvents": [...]}`` form, ended or not);
    `TraceFileError` for anything else."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise TraceFileError(f"{path} is not a text file; it is not a trace") from None
    if not text:
        raise TraceFileError(f"{path} is empty; it is not a trace")
    if text.startswith("[") and not text.endswith("]"):
        text = text.rstrip(",") + "]"  # a run that stopped before close(): the array is open
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFileError(
            f"{path} is not JSON ({e.msg}, line {e.lineno}); pass a run's trace.json"
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceFileError(f"{path} holds no list of trace events")
    return events


def spans(events: list[dict]) -> list[dict]:
    """The complete ("X") events, each with its row's name under ``row`` and times in seconds
    (``start``, ``end``), sorted by start."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        start = e["ts"] / 1e6
        out.append(
            {
                **e,
                "row": names.get(e["pid"], str(e["pid"])),
                "start": start,
                "end": start + e["dur"] / 1e6,
            }
        )
    return sorted(out, key=lambda s: s["start"])


def overlap_s(a: list[dict], b: list[dict]) -> float:
    """Seconds during which some span of ``a`` and some span of ``b`` both run."""

    def merged(ss: list[dict]) -> list[tuple[float, float]]:
        out: list[list[float]] = []
        for s in sorted(ss, key=lambda s: s["start"]):
            if out and s["start"] <= out[-1][1]:
                out[-1][1] = max(out[-1][1], s["end"])
            else:
                out.append([s["start"], s["end"]])
        return [(x, y) for x, y in out]

    total, ia, ib = 0.0, merged(a), merged(b)
    i = j = 0
    while i < len(ia) and j < len(ib):
        lo, hi = max(ia[i][0], ib[j][0]), min(ia[i][1], ib[j][1])
        total += max(0.0, hi - lo)
        if ia[i][1] < ib[j][1]:
            i += 1
        else:
            j += 1
    return total
