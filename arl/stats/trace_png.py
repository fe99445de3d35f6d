"""Draw run timelines (``trace.json`` files) one above the other, on one time axis, as a PNG.

    python -m arl.stats.trace_png runs/a/eta0/trace.json runs/a/eta2/trace.json \
        --labels eta=0 eta=2 -o docs/results/timeline.png

One band per row of the trace (the trainer, then each node), split into the row's lanes; spans
are coloured by phase. Times are seconds from each trace's first span. An existing ``-o`` file
is never replaced. Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from arl.stats.plot import figure_problem
from arl.stats.trace import TraceFileError, load_trace, spans

COLORS = {
    "generate": "#4C72B0",
    "paused": "#E8979A",
    "weight_sync": "#C44E52",
    "wait_rollout": "#BBBBBB",
    "wait_slot": "#DDDDDD",
    "train": "#55A868",
    "load_batch": "#DD8452",
    "compute_logp": "#8C8C3C",
    "compute_ref_logp": "#8C8C3C",
    "compute_advantages": "#64B5CD",
    "ppo_update": "#2E7D32",
    "end_step": "#777777",
}
OTHER = "#8172B3"


def _layout(events: list[dict]) -> list[tuple[int, str, list[int]]]:
    """Rows top to bottom as (pid, name, tids in lane order)."""
    meta = [e for e in events if e.get("ph") == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    row_order = {
        e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"
    }
    lane_order = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in meta
        if e["name"] == "thread_sort_index"
    }
    used: dict[int, set[int]] = {}
    for e in events:
        if e.get("ph") == "X":
            used.setdefault(e["pid"], set()).add(e["tid"])
    rows = []
    for pid in sorted(used, key=lambda p: (row_order.get(p, p), p)):
        tids = sorted(used[pid], key=lambda t: (lane_order.get((pid, t), t), t))
        rows.append((pid, names.get(pid, str(pid)), tids))
    return rows


def render(
    traces: dict[str, Path],
    out: Path,
    *,
    title: str = "",
    start: float = 0.0,
    end: float | None = None,
) -> Path:
    """Draw each labelled trace in its own panel (shared time axis); returns ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("drawing timelines needs matplotlib: pip install -e '.[plot]'") from None
    loaded = {label: load_trace(path) for label, path in traces.items()}
    layouts = {label: _layout(ev) for label, ev in loaded.items()}
    heights = [max(1, len(rows)) for rows in layouts.values()]
    fig, axes = plt.subplots(
        len(loaded),
        1,
        sharex=True,
        figsize=(11, 0.9 + 0.55 * sum(heights)),
        dpi=130,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    seen: dict[str, str] = {}
    t_max = 0.0
    for ax, (label, events) in zip(axes[:, 0], loaded.items(), strict=True):
        ss = spans(events)
        if not ss:
            ax.set_title(f"{label}: no spans")
            continue
        t0 = ss[0]["start"]
        rows = layouts[label]
        y_of = {}
        for i, (pid, _, tids) in enumerate(rows):
            band = 0.8 / len(tids)
            for j, tid in enumerate(tids):
                y_of[(pid, tid)] = (len(rows) - 1 - i + 0.4 - (j + 1) * band, band)
        for s in ss:
            a, b = s["start"] - t0, s["end"] - t0
            if b < start or (end is not None and a > end):
                continue
            y, h = y_of[(s["pid"], s["tid"])]
            color = COLORS.get(s["name"], OTHER)
            seen.setdefault(s["name"], color)
            # A thin white edge keeps back-to-back spans of one lane apart.
            ax.broken_barh(
                [(a, max(b - a, 1e-4))],
                (y, h * 0.9),
                facecolor=color,
                edgecolor="white",
                linewidth=0.4,
            )
            t_max = max(t_max, b)
        ax.set_yticks([len(rows) - 1 - i for i in range(len(rows))])
        ax.set_yticklabels([name for _, name, _ in rows])
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_title(label, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlim(start, end if end is not None else t_max)
    axes[-1, 0].set_xlabel("seconds since the first span")
    order = [n for n in COLORS if n in seen] + sorted(n for n in seen if n not in COLORS)
    fig.legend(
        [Patch(color=seen[n]) for n in order],
        order,
        loc="lower center",
        ncol=min(6, len(order)),
        fontsize=8,
        frameon=False,
    )
    if title:
        fig.suptitle(title)
    legend_rows = -(-len(order) // 6)
    fig.tight_layout(rect=(0, (0.05 + 0.18 * legend_rows) / fig.get_figheight(), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(
        prog="python -m arl.stats.trace_png", description=__doc__.split("\n")[0]
    )
    p.add_argument("traces", type=Path, nargs="+", help="trace.json files, drawn top to bottom")
    p.add_argument(
        "-o", "--out", type=Path, default=Path("timeline.png"), help="a new file (never replaced)"
    )
    p.add_argument("--labels", nargs="+", help="one panel title per trace (default: the paths)")
    p.add_argument("--title", default="")
    p.add_argument("--start", type=float, default=0.0, help="first second shown")
    p.add_argument("--end", type=float, default=None, help="last second shown (default: all)")
    a = p.parse_args(argv)
    labels = a.labels or [str(t) for t in a.traces]
    if len(labels) != len(a.traces):
        print(f"error: {len(a.traces)} traces but {len(labels)} labels", file=sys.stderr)
        return 2
    for t in a.traces:
        if not t.is_file():
            print(f"error: {t} is not a file; pass a run's trace.json", file=sys.stderr)
            return 2
    if problem := figure_problem(a.out, "-o"):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    traces = dict(zip(labels, a.traces, strict=True))
    try:
        print(render(traces, a.out, title=a.title, start=a.start, end=a.end))
    except TraceFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
