"""Plot metrics of a run from its metrics.jsonl into a PNG.

    python -m arl.stats.plot runs/arith-grpo/trial0/metrics.jsonl -o curve.png \
        --keys rollout/accuracy,eval/accuracy

Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from arl.stats.logger import read_jsonl

DEFAULT_KEYS = "rollout/accuracy,eval/accuracy"


def plot(rows: list[dict], keys: list[str], out: Path, title: str = "") -> Path:
    """Draw each key against step (steps where a key is missing are skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install -e '.[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    drawn = 0
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=key)
            drawn += 1
    if not drawn:
        raise SystemExit(f"none of {keys} is in the metrics; keys there: {sorted(rows[0])}")
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
    p.add_argument("-o", "--out", type=Path, default=Path("curve.png"))
    p.add_argument("--keys", default=DEFAULT_KEYS, help="comma-separated metric names")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    if not a.metrics.exists():
        print(f"error: {a.metrics} does not exist", file=sys.stderr)
        return 2
    rows = read_jsonl(a.metrics)
    if not rows:
        print(f"error: {a.metrics} has no rows", file=sys.stderr)
        return 2
    print(plot(rows, [k for k in a.keys.split(",") if k], a.out, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
