"""A run's learning curve from its metrics.jsonl: step, wall clock, eval accuracy, tokens/s.

    python -m arl.stats.curve runs/gsm8k-grpo/trial0/metrics.jsonl --out curve.json

Wall clock is seconds from the start of step 1 (its logged end time minus its step time) to the
end of each step. Generated tokens/s is the trained groups' generated tokens over the step time;
training tokens/s is the batch's tokens over the log-prob and update time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arl.stats.logger import MetricsFileError, read_jsonl


def curve(rows: list[dict]) -> list[dict]:
    """One point per logged step (rows without a ``step`` are skipped), in step order."""
    steps = sorted((r for r in rows if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    if not steps:
        return []
    first = steps[0]
    t0 = float(first["time"]) - float(first.get("time/step_s", 0.0))
    out = []
    for r in steps:
        step_s = float(r.get("time/step_s", 0.0))
        train_s = float(r.get("time/logp_s", 0.0)) + float(r.get("time/update_s", 0.0))
        point = {
            "step": r["step"],
            "wall_s": round(float(r["time"]) - t0, 3),
            "step_s": round(step_s, 4),
            "gen_tokens_per_s": (
                round(r.get("rollout/gen_tokens", 0) / step_s, 1) if step_s else None
            ),
            "train_tokens_per_s": (
                round(r.get("batch/n_tokens", 0) / train_s, 1) if train_s else None
            ),
            "rollout_accuracy": r.get("rollout/accuracy"),
        }
        if "eval/accuracy" in r:
            point["eval_accuracy"] = r["eval/accuracy"]
        out.append(point)
    return out


def _table(points: list[dict]) -> str:
    head = f"{'step':>5} {'wall s':>8} {'step s':>7} {'gen tok/s':>10} {'train tok/s':>11}  eval"
    lines = [head]
    for p in points:
        ev = f"{p['eval_accuracy']:.4f}" if "eval_accuracy" in p else ""
        gen = p["gen_tokens_per_s"] or 0.0
        train = p["train_tokens_per_s"] or 0.0
        lines.append(
            f"{p['step']:>5} {p['wall_s']:>8.1f} {p['step_s']:>7.2f} {gen:>10,.0f} "
            f"{train:>11,.0f}  {ev}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print a run's curve as a table (and write it as JSON with ``--out``); exit status."""
    p = argparse.ArgumentParser(
        prog="python -m arl.stats.curve", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    p.add_argument("--out", type=Path, default=None, help="also write the points as JSON here")
    args = p.parse_args(argv)
    if not args.metrics.is_file():
        print(f"error: {args.metrics} is not a file; pass a run's metrics.jsonl", file=sys.stderr)
        return 2
    if args.out is not None and (problem := new_file_problem(args.out, "--out")):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        points = curve(read_jsonl(args.metrics))
    except MetricsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not points:
        print(f"error: {args.metrics} holds no step rows", file=sys.stderr)
        return 2
    print(_table(points))
    if args.out is not None:
        args.out.write_text(json.dumps(points, indent=1) + "\n")
    return 0


def new_file_problem(out: Path, flag: str) -> str | None:
    """Why ``out`` may not be written as a new file (None: it may). A file there is the user's
    and is never replaced; a missing folder is theirs to make."""
    if out.exists():
        return f"{out} exists; pass another {flag} (the file is left as it is)"
    if not out.parent.is_dir():
        return f"{out.parent} is not a directory; create it or pass another {flag}"
    return None


if __name__ == "__main__":
    sys.exit(main())
