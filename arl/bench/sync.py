"""``python -m arl.bench sync``: weight-sync seconds per mode beside the device-copy floor.

Runs a recipe (arith by default, as written, evaluation and exports off) for ``--steps`` steps
once per weight-sync mode on fresh nodes of this machine, and prints the medians of
``sync/paused_s`` (rollout held), ``time/sync_s`` (the whole sync as the trainer sees it) and
``sync/stage_s`` beside the floor measured in this process: the bytes one sync moves over the
device's own copy bandwidth (a device-to-device copy on a GPU, memcpy on CPU), i.e. the time of
one copy of the weights. ``auto`` is printed with the mode it resolved to. Without a GPU the
e2e CPU preset applies (a smoke run, not a measurement)::

    python -m arl.bench sync --recipe recipes/arith.py --steps 20 --modes auto zmq
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from arl.bench import fresh_run_dir, new_file, write_new
from arl.bench.e2e import CPU_PRESET
from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import detect_gpus
from arl.recipe import load_recipe
from arl.stats.logger import read_jsonl


def copy_bandwidth(device: str, nbytes: int = 256 << 20, reps: int = 10) -> float:
    """Bytes per second of one copy of ``nbytes`` into a preallocated buffer on ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    if device != "cpu":
        torch.cuda.empty_cache()
    return nbytes / statistics.median(times[1:])


def sync_config(recipe: str, mode: str, steps: int, out: Path, overrides: list[str]) -> Config:
    """The recipe with the bench's settings and ``weight_sync.mode=mode``; the CPU preset when
    there is no GPU; the user's overrides last."""
    bench = [
        f"experiment.run_dir={out}",
        "experiment.name=bench-sync",
        f"experiment.trial={mode}",
        f"experiment.total_train_steps={steps}",
        "evaluator.freq_steps=none",
        "saver.hf_export=false",
        "recover.mode=disabled",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        f"weight_sync.mode={mode}",
    ]
    cfg = apply_overrides(load_recipe(recipe), bench + overrides)
    if detect_gpus(cfg) == 0:
        cfg = apply_overrides(cfg, bench + CPU_PRESET + overrides)
    cfg.validate()
    return cfg


def summarize(rows: list[dict]) -> dict:
    """Medians over every step (the first sync includes the mode's one-off setup)."""

    def med(key: str, part: list[dict]) -> float:
        return statistics.median(r[key] for r in part)

    return {
        "steps": len(rows),
        "paused_s": med("sync/paused_s", rows),
        "total_s": med("time/sync_s", rows),
        "stage_s": med("sync/stage_s", rows),
        "first_total_s": rows[0]["time/sync_s"],
        "bytes": int(rows[-1].get("sync/bytes") or 0),
        "checksum_ok": all(r.get("sync/checksum_match", True) for r in rows),
    }


def report(results: dict[str, dict], bandwidth: float, where: str) -> str:
    """One row per mode, each figure beside the floor."""
    lines = [
        f"device copy bandwidth ({where}, measured here): {bandwidth / 1e9:,.1f} GB/s",
        "",
        "| mode | paused s (median) | sync s (median) | stage s | first sync s | MB | "
        "floor s (one copy) | paused / floor | sync / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in results.items():
        bad = "" if m["checksum_ok"] else " CHECKSUM MISMATCH"
        floor = m["bytes"] / bandwidth
        vs = (
            f"{floor:.5f} | {m['paused_s'] / floor:,.1f}x | {m['total_s'] / floor:,.1f}x"
            if floor
            else "- | - | -"  # the mode does not report its bytes (disk)
        )
        lines.append(
            f"| {mode} | {m['paused_s']:.4f} | {m['total_s']:.4f} | {m['stage_s']:.4f} | "
            f"{m['first_total_s']:.3f} | {m['bytes'] / 1e6:,.0f} | {vs} |{bad}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the recipe once per mode and print the table."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m arl.bench sync", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/arith.py")
    p.add_argument("--modes", nargs="+", default=["auto", "zmq"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/bench-sync"))
    p.add_argument(
        "--json", type=new_file, default=None, help="also write the figures here (a new file)"
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value (applied last)")
    a = p.parse_args(args)
    try:
        configs = {m: sync_config(a.recipe, m, a.steps, a.out, a.overrides) for m in a.modes}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from arl.control.placement import plan_placement
    from arl.run import run

    first = next(iter(configs.values()))
    device = "cuda" if detect_gpus(first) else "cpu"
    bandwidth = copy_bandwidth(device)
    results = {}
    for mode, cfg in configs.items():
        try:
            resolved = plan_placement(cfg, detect_gpus(cfg)).sync_mode
        except ConfigError as e:
            print(f"{mode}: skipped, {e}", flush=True)
            continue
        label = f"{mode} -> {resolved}" if mode == "auto" else mode
        fresh_run_dir(cfg.run_path)
        print(f"{label}: {cfg.experiment.total_train_steps} steps of {a.recipe} ...", flush=True)
        asyncio.run(run(cfg))
        results[label] = summarize(read_jsonl(cfg.run_path / "metrics.jsonl"))
    print()
    print(report(results, bandwidth, torch.cuda.get_device_name() if device == "cuda" else "CPU"))
    print(f"\ncommand: python -m arl.bench sync {' '.join(args)}")
    if a.json:
        write_new(a.json, json.dumps({"copy_bytes_per_s": bandwidth, "modes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
