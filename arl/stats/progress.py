"""What a run shows its user while it trains and when it ends.

`rollout_metrics` turns a step's group reports into its ``rollout/`` metrics row; `trace_step`
puts the step's phases on the timeline; `ProgressBar` is the terminal's one line per run;
`summary` is the run's last lines (steps, wall time, rewards, where its files are); `say_if_slow`
prints one line for an end-of-run phase (export, shutdown) that took longer than a user expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arl.protocol.report import GroupReport
from arl.stats.trace import Tracer

SLOW_S = 2.0  # an end-of-run phase longer than this is named on the terminal


def rollout_metrics(infos: Sequence[GroupReport], version: int, counts: Any) -> dict:
    """The ``rollout/`` metrics of a step trained at ``version`` - 1 from the groups ``infos``;
    ``counts`` are the rollout controller's running totals (`RolloutStats`)."""
    rewards = [r for i in infos for r in i.episode_rewards]
    staleness = [version - 1 - i.min_version for i in infos]
    s = counts
    return {
        "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
        "rollout/accuracy": sum(r > 0 for r in rewards) / max(1, len(rewards)),
        "rollout/gen_tokens": sum(i.n_gen_tokens for i in infos),
        "rollout/staleness": staleness,
        "rollout/staleness_max": max(staleness, default=0),
        # Groups whose tokens come from more than one policy version (a sync interrupted them
        # and they went on under the new weights).
        "rollout/version_switches": sum(i.max_version > i.min_version for i in infos),
        "rollout/submitted": s.submitted,
        "rollout/accepted": s.accepted,
        "rollout/failed": s.failed,
        "rollout/rejected": s.rejected,
        "rollout/rejected_samples": s.rejected_samples,
        "rollout/stale_dropped": s.stale_dropped,
        "rollout/stale_kept": s.stale_kept,
        "rollout/timed_out": s.timed_out,
        "batch/data_ids": [i.data_id for i in infos],
    }


def trace_step(
    tracer: Tracer,
    step: int,
    version: int,
    train_rows: Sequence[str],
    t0: float,
    t_batch: float,
    t_train: float,
    t_sync: float,
) -> None:
    """The step's phases on the trainer's row (its start ``t0``, the batch taken, trained,
    synced), and the weight sync on every train rank's row (``train_rows``)."""
    tracer.add("trainer", "wait_rollout", t0, t_batch, cat="wait", step=step)
    tracer.add("trainer", "train", t_batch, t_train, cat="train", step=step)
    tracer.add("trainer", "weight_sync", t_train, t_sync, cat="sync", version=version)
    for row in train_rows:
        tracer.add(row, "weight_sync", t_train, t_sync, cat="sync")
    tracer.flush()


class ProgressBar:
    """One tqdm line for the run (``stats.progress_bar``): steps, last reward, version, eval."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def open(self, total: int, initial: int) -> None:
        """Start the bar at step ``initial`` of ``total`` (a resumed run starts part-way)."""
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True
            )

    def update(self, m: dict, version: int) -> None:
        """One step done, with its metrics row ``m``."""
        if self.bar is not None:
            post = {
                "reward": f"{m['rollout/reward_mean']:.3f}",
                "acc": f"{m['rollout/accuracy']:.2f}",
                "v": version,
            }
            if "eval/accuracy" in m:
                post["eval"] = f"{m['eval/accuracy']:.2f}"
            self.bar.set_postfix(post)
            self.bar.update(1)

    def close(self) -> None:
        """End the bar's line (it stays on the terminal)."""
        if self.bar is not None:
            self.bar.close()


def summary(
    wall_s: float,
    step: int,
    run: Path,
    *,
    resumed_from: int | None = None,
    last_metrics: dict | None = None,
    last_eval: tuple[int, dict] | None = None,
    metrics_path: Path | None = None,
    trace_path: Path | None = None,
) -> str:
    """The run's last lines: steps, wall time, final reward and accuracy, and its files (those
    of the run folder ``run`` that exist)."""
    m = last_metrics or {}
    minutes, seconds = divmod(round(wall_s), 60)
    steps = f"{step} step{'s' if step != 1 else ''}"
    if resumed_from is not None:  # the wall time is this attempt's
        steps += f" ({step - resumed_from} in this attempt, resumed from step {resumed_from})"
    lines = [f"done: {steps} in {minutes} min {seconds:02d} s"]
    if m:
        lines[0] += (
            f"; last step: reward {m['rollout/reward_mean']:.3f}, "
            f"accuracy {m['rollout/accuracy']:.2f}"
        )
    if last_eval is not None:
        at, e = last_eval
        acc, n = e["eval/accuracy"], e["eval/n"]
        lines[0] += f"; held-out accuracy {acc:.2f} ({n} questions, step {at})"
    files = [
        ("metrics", metrics_path),
        ("TensorBoard", run / "tensorboard"),  # tensorboard --logdir DIR
        ("trace", trace_path),
        ("checkpoints", run / "checkpoints"),
        ("recovery", run / "recover"),
    ]
    lines += [f"  {name:<12} {path}" for name, path in files if path and Path(path).exists()]
    if metrics_path is not None:
        lines.append(
            f"plot: python -m arl.stats.plot {metrics_path} -o {run / 'curve.png'}"
            "  (pip install -e '.[plot]')"
        )
    return "\n".join(lines)


def say_if_slow(what: str, seconds: float) -> None:
    """Print one line naming ``what`` and its ``seconds`` if it took over `SLOW_S`: the end of a
    run (export, shutdown) should be quick, and where it is not the user sees what took long."""
    if seconds > SLOW_S:
        print(f"{what} took {seconds:.1f} s", flush=True)
