"""Metrics of a run: one JSONL line per step and TensorBoard scalars/histograms.

``StatsLogger.log(step, metrics)`` takes a flat dict of numbers (lists become histograms in
TensorBoard and stay lists in the JSONL). Both files live in the run directory:
``metrics.jsonl`` and ``tensorboard/``. Every JSONL row carries the ``run_id`` of the launch
that wrote it (`arl.run_dir`): a run resumed by running the command again continues the step
numbers under a new id, so a step logged twice is told apart (the later row is the one kept).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class StatsLogger:
    """Writes each step's metrics to JSONL and (optionally) TensorBoard."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        run_id: str | None = None,
    ):
        from arl.run_dir import new_run_id

        self.run_dir = Path(run_dir)
        self.run_id = run_id or new_run_id()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl" if jsonl else None
        if self.jsonl_path is not None:
            _drop_cut_row(self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a") if self.jsonl_path else None  # noqa: SIM115
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` for ``step``."""
        row = {
            "step": step,
            "run_id": self.run_id,
            "time": time.time(),
            **{k: _plain(v) for k, v in metrics.items()},
        }
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k in ("step", "run_id", "time"):
                    continue
                if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                    import numpy as np

                    self._tb.add_histogram(k, np.asarray(v, dtype=float), step)
                elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close both files."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _drop_cut_row(path: Path) -> None:
    """Cut ``path`` back to its last complete row. Each row is written with its newline in one
    write, so a file that ends without one ends in a row its process died writing (SIGKILL, a
    lost node); a resumed run appending after it would join the two into one unreadable line."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            tail = min(size, 1 << 20)  # a row is far shorter; past this, keep the file as it is
            f.seek(size - tail)
            end = f.read(tail).rfind(b"\n")
            if end < 0 and tail < size:
                return
            f.truncate(size - tail + end + 1)
    except FileNotFoundError:
        return


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsFileError(ValueError):
    """A metrics file that is not JSON lines of objects (the message names the file and line)."""


def read_jsonl(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl file.

    A last line without its newline that does not parse is skipped: the logger writes each row
    with its newline in one write, so that is a row of a live run still being written. Any
    other line that is not a JSON object raises `MetricsFileError`.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise MetricsFileError(f"{path} is not a text file; pass a run's metrics.jsonl") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # no newline after it: being written
                break
            raise MetricsFileError(
                f"{path}, line {n}: not JSON ({e.msg}); pass a run's metrics.jsonl"
            ) from None
        if not isinstance(row, dict):
            raise MetricsFileError(
                f"{path}, line {n}: a JSON {type(row).__name__}, not an object of metrics; "
                "pass a run's metrics.jsonl"
            )
        rows.append(row)
    return rows
