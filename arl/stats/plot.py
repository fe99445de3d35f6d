"""Plot metrics of a run from its metrics.jsonl into a PNG.

    python -m arl.stats.plot runs/arith-grpo/trial0/metrics.jsonl -o curve.png \
        --keys rollout/accuracy,eval/accuracy

An existing ``-o`` file is never replaced: pass another name. Needs matplotlib
(`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from arl.stats.curve import new_file_problem
from arl.stats.logger import MetricsFileError, read_jsonl

DEFAULT_KEYS = "rollout/accuracy,eval/accuracy"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; SystemExit with the install line without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plotting needs matplotlib: pip install -e '.[plot]'") from None
    return plt


def figure_problem(out: Path, flag: str) -> str | None:
    """Why a figure may not be written to ``out`` (None: it may): an existing file, a missing
    folder, or a suffix that names no format matplotlib writes."""
    pyplot()  # the install line first, when matplotlib is missing
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        return (
            f"{flag} {out}: the suffix names the image format; use one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    return new_file_problem(out, flag)


def points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in each row that has an integer step and a number there."""
    return [
        (r["step"], r[key])
        for r in rows
        if isinstance(r.get("step"), int) and isinstance(r.get(key), (int, float))
    ]


def missing_keys(rows: list[dict], keys: list[str]) -> str | None:
    """What to say when none of ``keys`` has a point to draw (None: some key has)."""
    if any(points(rows, k) for k in keys):
        return None
    there = sorted(
        {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    )
    return f"none of {keys} is a number in the metrics; pass --keys from: {', '.join(there)}"


def plot(rows: list[dict], keys: list[str], out: Path, title: str = "") -> Path:
    """Draw each key against step (rows without an integer step or the key are skipped)."""
    if problem := missing_keys(rows, keys):
        raise SystemExit(f"error: {problem}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key in keys:
        if pts := points(rows, key):
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=key)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m arl.stats.plot", description=__doc__.split("\n")[0])
    p.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    p.add_argument(
        "-o", "--out", type=Path, default=Path("curve.png"), help="a new file (never replaced)"
    )
    p.add_argument("--keys", default=DEFAULT_KEYS, help="comma-separated metric names")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    if not a.metrics.is_file():
        print(f"error: {a.metrics} is not a file; pass a run's metrics.jsonl", file=sys.stderr)
        return 2
    if problem := figure_problem(a.out, "-o"):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        rows = read_jsonl(a.metrics)
    except MetricsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {a.metrics} has no rows", file=sys.stderr)
        return 2
    keys = [k for k in a.keys.split(",") if k]
    if problem := missing_keys(rows, keys):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(plot(rows, keys, a.out, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
