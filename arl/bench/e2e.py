"""``python -m arl.bench e2e``: one recipe trained synchronously (eta = 0) and asynchronously.

The recipe runs once per eta (``rollout.max_head_offpolicyness``) on fresh nodes of this machine,
everything else equal; eta = 0 is the peer. Per eta it prints steps/hour and trained tokens/s
in the steady state (steps 2..N: step 1 waits for the first batch in every mode), the time per
phase (means of the trainer's ``time/*`` metrics), the staleness of the trained groups and the
share of training time during which rollout generated; it copies each run's timeline to
``OUT/trace_eta<N>.json`` (Chrome trace; Perfetto opens it) and draws them one above the other
in ``OUT/timeline.png``.

Without a GPU a small preset is applied first (2 groups x 4 samples x 32 tokens per step) so the
run takes minutes on a CPU; on GPUs the recipe runs as written. Overrides on the command line
come last and win:

    python -m arl.bench e2e --recipe recipes/arith.py --eta 0 2 --steps 5
    python -m arl.bench e2e --steps 20 cluster.n_gpus=2 rollout.backend=hf:d1 actor.backend=fsdp:d1
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
from collections import Counter
from pathlib import Path

from arl.bench import fresh_run_dir
from arl.bench.sim import format_hist, gen_during_train
from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import detect_gpus
from arl.recipe import load_recipe
from arl.stats.logger import read_jsonl
from arl.stats.trace import load_trace

CPU_PRESET = ["data.batch_size=2", "gconfig.n_samples=4", "gconfig.max_new_tokens=32"]
PHASES = ("time/wait_rollout_s", "time/train_s", "time/sync_s", "time/step_s")


def e2e_config(recipe: str, eta: int, steps: int, out: Path, overrides: list[str]) -> Config:
    """The recipe's config for one eta: the bench's settings, the CPU preset if no GPU, then
    the user's overrides."""
    cfg = load_recipe(recipe)
    bench = [
        f"experiment.run_dir={out}",
        "experiment.name=e2e",
        f"experiment.trial=eta{eta}",
        f"experiment.total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
        "evaluator.freq_steps=none",
        "saver.hf_export=false",
        "recover.mode=disabled",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "stats.trace=true",
    ]
    return bench_config(cfg, bench, CPU_PRESET, overrides)


def bench_config(
    cfg: Config, bench: list[str], cpu_preset: list[str], overrides: list[str]
) -> Config:
    """``cfg`` with a benchmark's settings, then its CPU preset when the plan has no GPU, then
    the user's overrides (which always win); validated."""
    cfg = apply_overrides(cfg, bench + overrides)
    if detect_gpus(cfg) == 0:
        cfg = apply_overrides(cfg, bench + cpu_preset + overrides)
    cfg.validate()
    return cfg


def summarize(rows: list[dict], events: list[dict]) -> dict:
    """Steady-state figures of one run's metrics (and its trace)."""
    if len(rows) < 2:
        raise ValueError("the e2e figures need at least 2 steps (step 1 is the warm-up)")
    steady = rows[1:]
    wall = rows[-1]["time"] - rows[0]["time"]
    tokens = sum(r["rollout/gen_tokens"] for r in steady)
    return {
        "steps": len(rows),
        "steps_per_hour": 3600.0 * len(steady) / wall,
        "tokens_per_s": tokens / wall,
        **{k: statistics.fmean(r[k] for r in steady) for k in PHASES},
        "staleness": Counter(s for r in rows for s in r["rollout/staleness"]),
        "gen_during_train": gen_during_train(events),
        "first_step_s": rows[0]["time/step_s"],
    }


def report(results: dict[int, dict]) -> str:
    """The table: one row per eta, speed against eta = 0."""
    base = results.get(0)
    lines = [
        "| eta | steps/hour | vs eta=0 | tokens/s | step s | wait rollout s | train s | "
        "sync s | gen during train | staleness (groups) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for eta, m in results.items():
        speed = f"{m['steps_per_hour'] / base['steps_per_hour']:.2f}x" if base else "-"
        lines.append(
            f"| {eta} | {m['steps_per_hour']:,.0f} | {speed} | {m['tokens_per_s']:,.1f} | "
            f"{m['time/step_s']:.2f} | {m['time/wait_rollout_s']:.2f} | "
            f"{m['time/train_s']:.2f} | {m['time/sync_s']:.2f} | "
            f"{100 * m['gen_during_train']:.0f}% | {format_hist(m['staleness'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the recipe once per eta and print the comparison."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m arl.bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/arith.py")
    p.add_argument("--eta", type=int, nargs="+", default=[0, 2])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/bench-e2e"))
    p.add_argument("overrides", nargs="*", help="config overrides key=value (applied last)")
    a = p.parse_intermixed_args(args)
    if a.steps < 2:
        print("error: --steps must be >= 2 (step 1 is the warm-up)", file=sys.stderr)
        return 2
    try:
        configs = {eta: e2e_config(a.recipe, eta, a.steps, a.out, a.overrides) for eta in a.eta}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from arl.run import run

    fresh_run_dir(a.out, "--out")  # the traces and the timeline go here, beside the runs
    results, traces = {}, {}
    for eta, cfg in configs.items():
        fresh_run_dir(cfg.run_path)
        where = f"{detect_gpus(cfg)} GPU(s)" if detect_gpus(cfg) else "CPU (preset applied)"
        print(
            f"eta={eta}: {cfg.data.batch_size} groups x {cfg.gconfig.n_samples} samples x "
            f"{cfg.gconfig.max_new_tokens} tokens, {cfg.rollout.backend} + {cfg.actor.backend} "
            f"on {where}, {a.steps} steps ...",
            flush=True,
        )
        asyncio.run(run(cfg))
        trace = a.out / f"trace_eta{eta}.json"
        shutil.copyfile(cfg.run_path / "trace.json", trace)
        traces[f"eta={eta}"] = trace
        results[eta] = summarize(read_jsonl(cfg.run_path / "metrics.jsonl"), load_trace(trace))
        print(f"  {results[eta]['steps_per_hour']:,.0f} steps/hour; trace {trace}", flush=True)
    print()
    print(report(results))
    print(f"\ncommand: python -m arl.bench e2e {' '.join(args)}")
    try:
        from arl.stats.trace_png import render

        print(f"timeline: {render(traces, a.out / 'timeline.png', title=a.recipe)}")
    except SystemExit as e:  # matplotlib is not installed
        print(e, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
