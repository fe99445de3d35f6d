"""``python -m arl.bench loop``: a recipe's RL step, phase by phase, each beside its floor.

Runs the recipe (default ``recipes/arith.py``, as written) for ``--steps`` steps on this machine
and prints, per phase of a step (medians over steps 2..N; step 1 waits for the first batch), its
seconds beside a floor measured in the same run on the same device:

- wait for rollout, pull and dispatch (``load_batch``), the rest (metrics, freeing shards, the
  RPCs between phases): floor 0;
- log-probs: 2 x params x tokens FLOPs, update: 6 x params x tokens (forward and backward), over
  the measured matmul peak (attention FLOPs left out: they are small at these lengths);
- weight sync: the weight bytes copied once at the measured device copy bandwidth.

Rollout in the loop: generated tokens per second (all the engines decoded, and those of the
trained groups), the mean batch each decode step really ran, and the share of wall time the
engines were busy. One step (``--profile-step``) is recorded with torch.profiler on every train
rank, from its ``load_batch`` to the next one: the top ops, a Chrome trace, and the per-step time
not covered by train-rank device work, the rollout wait or the weight sync (the fixed overhead).
That step and the next (where the profiler stops) are left out of the medians; the files are
written after the run.

Without a GPU a small preset (2 groups x 2 samples x 8 tokens, no evaluation) runs first so CI
can smoke-test it; overrides come last and win. ``--out FILE`` writes the figures as JSON to a
new file (an existing one is refused), with issue 16's keys under ``issue16``.

    python -m arl.bench loop --steps 60 cluster.n_gpus=1
    python -m arl.bench loop --recipe recipes/gsm8k.py --steps 10 --out gsm8k.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from arl.bench import fresh_run_dir, new_file, write_new
from arl.bench.e2e import bench_config
from arl.config import Config, ConfigError
from arl.control.placement import detect_gpus
from arl.recipe import load_recipe

CPU_PRESET = [
    "data.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=8",
    "evaluator.freq_steps=none",
]
# (name in the report, the trainer metric holding it)
PHASES = (
    ("wait_rollout", "time/wait_rollout_s"),
    ("pull_dispatch", "time/load_batch_s"),
    ("logp", "time/logp_s"),
    ("update", "time/update_s"),
    ("weight_sync", "time/sync_s"),
)

STEP_KEYS = (*(k for _, k in PHASES), "batch/n_tokens")


def loop_config(recipe: str, steps: int, out: Path, overrides: list[str]) -> Config:
    """The recipe's config with the bench's settings, the CPU preset without a GPU, then the
    user's overrides."""
    cfg = load_recipe(recipe)
    bench = [
        f"experiment.run_dir={out}",
        "experiment.name=loop",
        "experiment.trial=bench",
        f"experiment.total_train_steps={steps}",
        "saver.hf_export=false",
        "saver.freq_steps=none",
        "recover.mode=disabled",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "stats.trace=true",
    ]
    return bench_config(cfg, bench, CPU_PRESET, overrides)


async def _sample_engines(workers: list, samples: list[tuple[float, list[dict]]]) -> None:
    """Every 0.25 s, the engines' counters (decode steps, tokens, busy seconds) with the time."""
    while True:
        healths = await asyncio.gather(*(w.health() for w in workers))
        samples.append((time.time(), healths))
        await asyncio.sleep(0.25)


async def run_loop(cfg: Config, profile_step: int, profile_dir: Path) -> dict:
    """Run the loop like `arl.run.run`, with the profiler armed and the engines sampled."""
    from arl.control.cluster import start_cluster
    from arl.control.placement import plan_placement
    from arl.trainer import PPOTrainer

    samples: list[tuple[float, list[dict]]] = []
    t0 = time.monotonic()
    plan = plan_placement(cfg, detect_gpus(cfg))
    async with start_cluster(cfg, plan) as cluster:
        trainer = PPOTrainer(cfg, cluster)
        try:
            await trainer.setup()
            startup = time.monotonic() - t0
            # The trace's clock (seconds since the tracer started) on the samples' clock.
            trace_t0 = time.time() - (time.monotonic() - trainer.tracer.t0)
            if profile_step:
                await trainer.ranks.arm_profile(profile_step, str(profile_dir))
            sampler = asyncio.ensure_future(_sample_engines(trainer.rollout.workers, samples))
            try:
                await trainer.train()
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            samples.append((time.time(), await _healths(trainer)))
            info = (await trainer.ranks.info())[0]
            await trainer.ranks.write_profile()
        finally:
            await trainer.close()
    return {"startup_s": startup, "samples": samples, "train_info": info, "trace_t0": trace_t0}


async def _healths(trainer: Any) -> list[dict]:
    return list(await asyncio.gather(*(w.health() for w in trainer.rollout.workers)))


def _model_params(path: str) -> int:
    from arl.bench.gpu import model_bytes
    from arl.engines.model import resolve_model

    return model_bytes(resolve_model(path))[0] // 2


def _total(healths: list[dict], key: str) -> float:
    """One engine counter of a sample, summed over the engines."""
    return sum(float(h.get(key, 0) or 0) for h in healths)


def _engine_delta(samples: list, t_from: float, t_to: float) -> dict:
    """Engine counters between the samples nearest ``t_from`` and ``t_to``, summed over engines."""
    if len(samples) < 2:
        return {}
    a = min(samples, key=lambda s: abs(s[0] - t_from))
    b = min(samples, key=lambda s: abs(s[0] - t_to))
    wall = max(b[0] - a[0], 1e-9)
    keys = ("steps", "generated_tokens", "busy_s", "prefills", "prefill_tokens", "prefill_s")
    d = {k: _total(b[1], k) - _total(a[1], k) for k in keys}
    n_engines = max(len(b[1]), 1)
    return {
        "wall_s": wall,
        "decoded_tokens_per_s": d["generated_tokens"] / wall,
        "mean_decode_batch": d["generated_tokens"] / max(d["steps"], 1),
        "decode_steps": d["steps"],
        "busy_share": d["busy_s"] / wall / n_engines,
        "busy_s": d["busy_s"],
        "prefill_s": d["prefill_s"],
        "prefills": d["prefills"],
        "prefill_tokens": d["prefill_tokens"],
    }


def summarize(
    rows: list[dict],
    floors: dict,
    n_params: int,
    samples: list,
    profile: dict | None,
    profile_step: int,
) -> dict:
    """The figures of one run: phases beside floors, rollout, training, the fixed overhead."""
    if len(rows) < 2:
        raise ValueError("the loop figures need at least 2 steps (step 1 is the warm-up)")
    # The profiler slows its step, and stopping it (processing its events) the next one.
    profiled = (profile_step, profile_step + 1) if profile else ()
    steady = [r for r in rows[1:] if r["step"] not in profiled] or rows[1:]
    peak, bw = floors["matmul_flops"], floors["hbm_bytes_s"]
    tokens = statistics.median(r["batch/n_tokens"] for r in steady)
    weight_bytes = rows[-1].get("sync/bytes") or 2 * n_params

    def med(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in steady)

    floor_of = {
        "wait_rollout": 0.0,
        "pull_dispatch": 0.0,
        # No pass of its own when the update computes the proximal log-probs (prox_logp=auto).
        "logp": 2 * n_params * tokens / peak if med("time/logp_s") > 0 else 0.0,
        "update": 6 * n_params * tokens / peak,
        "weight_sync": 2 * weight_bytes / bw,
    }

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in steady)

    phases = {
        name: {"median_s": med(key), "mean_s": mean(key), "floor_s": floor_of[name]}
        for name, key in PHASES
    }
    rest = [r["time/step_s"] - sum(float(r.get(k, 0.0)) for _, k in PHASES) for r in steady]
    phases["rest"] = {
        "median_s": statistics.median(rest),
        "mean_s": statistics.mean(rest),
        "floor_s": 0.0,
    }
    step_s = med("time/step_s")
    train_tps = statistics.median(
        r["batch/n_tokens"] / max(r["time/logp_s"] + r["time/update_s"], 1e-9) for r in steady
    )
    t_start = rows[0]["time"]  # the end of step 1
    gen_trained = sum(r["rollout/gen_tokens"] for r in rows[1:])
    out = {
        "steps": len(rows),
        "step_time_sum_s": sum(r["time/step_s"] for r in rows),
        "median_step_s": step_s,
        # What a user feels: total time over steps (steps 2..N, as the medians).
        "mean_step_s": statistics.mean(r["time/step_s"] for r in steady),
        "phases": phases,
        "train_tokens_per_step": tokens,
        "train_tokens_per_s": train_tps,
        "train_floor_tokens_per_s": tokens / (floor_of["logp"] + floor_of["update"]),
        "rollout": {
            "trained_gen_tokens_per_s": gen_trained / sum(r["time/step_s"] for r in rows[1:]),
            **_engine_delta(samples, t_start, rows[-1]["time"]),
        },
        "eval_accuracy": [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r],
        "sync_paused_s": med("sync/paused_s") if "sync/paused_s" in steady[0] else None,
    }
    if profile is not None:
        out["profile"] = profile
        if profile["kernels"]:  # a device timeline; on CPU there is none, so no figure
            by_step = {r["step"]: r for r in rows}
            nxt = by_step.get(profile_step + 1, {})
            sync = by_step.get(profile_step, {}).get("time/sync_s", 0.0)
            # The window runs from this step's load_batch to the next one's: take out the next
            # step's rollout wait, the device work and the weight sync; the rest is overhead.
            out["fixed_overhead_s"] = max(
                0.0,
                profile["window_s"]
                - nxt.get("time/wait_rollout_s", 0.0)
                - profile["device_busy_s"]
                - sync,
            )
    return out


def decode_by_phase(samples: list, events: list[dict], trace_t0: float) -> dict:
    """The engines' decode steps split by what the trainer did meanwhile: for each 0.25 s
    window between engine samples that lies wholly inside the trainer's ``train`` spans
    ("train": training shares the GPU) or wholly outside them ("other"), the counters' deltas,
    summed per kind. Per kind: windows, decode steps, mean batch, ms per decode step with the
    prefills taken out, and of that the ms spent waiting for the step's tokens on the host."""
    from arl.stats.trace import spans

    train = [
        (x["start"] + trace_t0, x["end"] + trace_t0)
        for x in spans(events)
        if x["row"] == "trainer" and x["name"] == "train"
    ]
    keys = ("steps", "generated_tokens", "busy_s", "prefill_s", "sync_s")
    sums = {kind: dict.fromkeys(("windows", *keys), 0.0) for kind in ("train", "other")}
    for (ta, ha), (tb, hb) in itertools.pairwise(samples):
        inside = sum(max(0.0, min(tb, e) - max(ta, s)) for s, e in train) / max(tb - ta, 1e-9)
        kind = "train" if inside >= 0.95 else "other" if inside <= 0.05 else None
        if kind is None:
            continue
        acc = sums[kind]
        acc["windows"] += 1
        for k in keys:
            acc[k] += _total(hb, k) - _total(ha, k)
    out = {}
    for kind, acc in sums.items():
        steps = max(acc["steps"], 1.0)
        out[kind] = {
            "windows": int(acc["windows"]),
            "decode_steps": int(acc["steps"]),
            "mean_batch": acc["generated_tokens"] / steps,
            "decode_step_ms": 1e3 * (acc["busy_s"] - acc["prefill_s"]) / steps,
            "sync_wait_ms": 1e3 * acc["sync_s"] / steps,
            "prefill_ms_per_step": 1e3 * acc["prefill_s"] / steps,
        }
    return out


def first_batch(rows: list[dict], samples: list, events: list[dict], batch_size: int) -> dict:
    """Where step 1's wait for its first batch went, in seconds from the start of step 1: the
    engines' first decoded token (from the 0.25 s engine samples), the first and the
    ``batch_size``-th prompt group to finish (generation and reward, from the trace), the train
    ranks' warm-up end (the trainer waits for it too), and when the batch was taken."""
    from arl.stats.trace import spans

    row = rows[0]
    start_wall = row["time"] - row["time/step_s"]
    out: dict[str, float | None] = {"batch_taken_s": row["time/wait_rollout_s"]}
    decoding = [t for t, hs in samples if sum(h.get("generated_tokens", 0) or 0 for h in hs)]
    out["first_token_by_s"] = min(decoding) - start_wall if decoding else None
    sp = spans(events)
    wait = next((x for x in sp if x["name"] == "wait_rollout" and x["args"].get("step") == 1), None)
    if wait is None:
        wait = next((x for x in sp if x["name"] == "wait_rollout"), None)
    t0 = wait["start"] if wait is not None else 0.0
    done = sorted(x["end"] - t0 for x in sp if x["name"] == "generate")
    out["first_group_s"] = done[0] if done else None
    out["batch_groups_s"] = done[batch_size - 1] if len(done) >= batch_size else None
    warm = [x["end"] - t0 for x in sp if x["name"] == "warm_up"]
    out["warm_up_end_s"] = max(warm) if warm else None
    return out


def issue_figures(rows: list[dict], m: dict, name: str) -> dict:
    """The figures under issue 16's keys (``name`` is the recipe's stem): sums and medians over
    the steps the issue names (1-N for the step-time sum, 3-N for the gsm8k medians)."""
    late = [r for r in rows if r["step"] >= 3] or rows
    acc = m["eval_accuracy"][-1][1] if m["eval_accuracy"] else None
    out = {
        f"{name}.step_time_{len(rows)}_s": m["step_time_sum_s"],
        f"{name}.eval_accuracy_{len(rows)}": acc,
        f"{name}.median_step_s": statistics.median(r["time/step_s"] for r in late),
        f"{name}.mean_step_s": statistics.mean(r["time/step_s"] for r in late),
        f"{name}.rollout_tokens_per_s": sum(r["rollout/gen_tokens"] for r in late)
        / sum(r["time/step_s"] for r in late),
        f"{name}.train_tokens_per_s": statistics.median(
            r["batch/n_tokens"] / max(r["time/logp_s"] + r["time/update_s"], 1e-9) for r in late
        ),
        "sync.total_s": statistics.median(r["time/sync_s"] for r in rows[1:] or rows),
        "sync.paused_s": m["sync_paused_s"],
        "step.fixed_overhead_s": m.get("fixed_overhead_s"),
    }
    out[f"{name}.sustained_rollout_tokens_per_s"] = out[f"{name}.rollout_tokens_per_s"]
    r = m["rollout"]
    if r.get("decode_steps"):
        # The engines' busy time per decode step (prefills included), and its mean batch.
        out[f"{name}.decode_step_ms"] = 1e3 * r["busy_s"] / r["decode_steps"]
        out[f"{name}.mean_decode_batch"] = r["mean_decode_batch"]
    return out


def report(m: dict, floors: dict) -> str:
    """The phase table and the rollout and training lines."""
    lines = [
        f"floors: copy {floors['hbm_bytes_s'] / 1e9:,.1f} GB/s, matmul "
        f"{floors['matmul_flops'] / 1e12:,.1f} TFLOP/s (measured here)",
        "",
        "| phase | mean s | median s | floor s | floor / mean |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, p in m["phases"].items():
        ratio = f"{p['floor_s'] / p['mean_s']:.3f}" if p["mean_s"] > 0 else "-"
        lines.append(
            f"| {name} | {p['mean_s']:.4f} | {p['median_s']:.4f} | {p['floor_s']:.4f} | {ratio} |"
        )
    lines.append(f"| step | {m['mean_step_s']:.4f} | {m['median_step_s']:.4f} | | |")
    r = m["rollout"]
    lines += [
        "",
        f"steps {m['steps']}, sum of step times {m['step_time_sum_s']:.1f} s, mean step "
        f"{m['mean_step_s']:.3f} s (steps 2..N), median {m['median_step_s']:.3f} s",
        f"training: {m['train_tokens_per_step']:,.0f} tokens/step, "
        f"{m['train_tokens_per_s']:,.0f} tokens/s (log-probs + update) vs floor "
        f"{m['train_floor_tokens_per_s']:,.0f} tokens/s",
        f"rollout: trained groups' generated tokens {r['trained_gen_tokens_per_s']:,.0f}/s of "
        "step time"
        + (
            f"; engines decoded {r['decoded_tokens_per_s']:,.0f} tokens/s, mean decode batch "
            f"{r['mean_decode_batch']:.1f}, busy {100 * r['busy_share']:.0f}% of wall, "
            f"{r['prefills']:.0f} prefills"
            if "decoded_tokens_per_s" in r
            else ""
        ),
    ]
    for kind, b in r.get("by_phase", {}).items():
        lines.append(
            f"decode while {'training' if kind == 'train' else 'not training'}: "
            f"{b['decode_steps']} steps in {b['windows']} windows of 0.25 s, mean batch "
            f"{b['mean_batch']:.0f}, {b['decode_step_ms']:.2f} ms/step without prefills "
            f"({b['sync_wait_ms']:.2f} ms of it waiting for the tokens), prefills "
            f"{b['prefill_ms_per_step']:.2f} ms/step"
        )
    if "profile" in m:
        p = m["profile"]
        lines.append(
            f"profiled step: window {p['window_s']:.3f} s, train-rank device busy "
            f"{p['device_busy_s']:.3f} s, {p['kernels']} kernels, {p['host_syncs']} host syncs, "
            f"{p['device_mallocs']} device mallocs; fixed overhead "
            + (
                f"{m['fixed_overhead_s']:.3f} s"
                if "fixed_overhead_s" in m
                else "not measured (no device kernels: CPU)"
            )
        )
    if "step1" in m:
        f = m["step1"]

        def at(key: str) -> str:
            return "-" if f.get(key) is None else f"{f[key]:.2f} s"

        lines.append(
            f"step 1, from its start: engines' first token by {at('first_token_by_s')}, first "
            f"group done {at('first_group_s')}, the batch's last {at('batch_groups_s')}, train "
            f"warm-up done {at('warm_up_end_s')}, batch taken {at('batch_taken_s')}"
        )
    if m["eval_accuracy"]:
        lines.append(f"eval accuracy (step, value): {m['eval_accuracy']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the recipe, print the phase table, write the JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m arl.bench loop", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/arith.py")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="the step recorded with torch.profiler (default 3, or the last but one of a "
        "shorter run; 0: none)",
    )
    p.add_argument("--run-dir", type=Path, default=Path("runs/bench-loop"))
    p.add_argument(
        "--out", type=new_file, default=None, help="write the figures as JSON here (a new file)"
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value (applied last)")
    a = p.parse_intermixed_args(args)
    if a.steps < 2:
        print("error: --steps must be >= 2 (step 1 is the warm-up)", file=sys.stderr)
        return 2
    if a.profile_step is None:
        a.profile_step = min(3, a.steps - 1)
    if a.profile_step and not 1 <= a.profile_step < a.steps:
        print(f"error: --profile-step must be in 1..{a.steps - 1} (or 0)", file=sys.stderr)
        return 2
    try:
        cfg = loop_config(a.recipe, a.steps, a.run_dir, a.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from arl.bench.gpu import measure_floors
    from arl.stats.logger import read_jsonl

    n_gpus = detect_gpus(cfg)
    device = "cuda" if n_gpus and torch.cuda.is_available() else "cpu"
    floors = measure_floors(device)
    fresh_run_dir(cfg.run_path)
    profile_dir = cfg.run_path / "profile"
    where = f"{n_gpus} GPU(s)" if n_gpus else "CPU (preset applied)"
    print(
        f"loop: {a.recipe}, {cfg.data.batch_size} groups x {cfg.gconfig.n_samples} samples x <= "
        f"{cfg.gconfig.max_new_tokens} tokens, {cfg.rollout.backend} + {cfg.actor.backend} on "
        f"{where}, {a.steps} steps",
        flush=True,
    )
    run = asyncio.run(run_loop(cfg, a.profile_step, profile_dir))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    prof_file = profile_dir / "profile_rank0.json"
    profile = json.loads(prof_file.read_text()) if prof_file.exists() else None
    n_params = _model_params(cfg.actor.path)
    m = summarize(rows, floors, n_params, run["samples"], profile, a.profile_step)
    trace = cfg.run_path / "trace.json"
    if trace.exists():
        from arl.stats.trace import load_trace

        events = load_trace(trace)
        m["step1"] = first_batch(rows, run["samples"], events, cfg.data.batch_size)
        late = [x for x in run["samples"] if x[0] >= rows[0]["time"]]
        m["rollout"]["by_phase"] = decode_by_phase(late, events, run["trace_t0"])
    m["issue16"] = issue_figures(rows, m, Path(a.recipe).stem)
    m |= {
        "recipe": a.recipe,
        "overrides": a.overrides,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "floors": floors,
        "startup_s": run["startup_s"],
        "train_info": run["train_info"],
        "profile_dir": str(profile_dir) if profile else None,
        "per_step": [{k: r.get(k) for k in ("step", "time/step_s", *STEP_KEYS)} for r in rows],
    }
    print()
    info = run["train_info"]
    print(
        f"start-up {run['startup_s']:.1f} s; train layout {info['layout']}; compilation "
        f"included, priming {info['prime_s']:.1f} s (small passes, overlapped with the "
        f"engines' start-up), warm-up {info['warm_up_s']:.1f} s (the large pass, overlapped with "
        "the first rollout)"
    )
    g = info.get("graphs")
    print(
        "update CUDA graphs: "
        + (
            "off (they apply to one CUDA rank with packed rows)"
            if g is None
            else f"{'on' if g['enabled'] else 'off after a failed capture'}, micro-batches of "
            f"<= {g['max_tokens']} tokens; {g['captures']} captured ({g['capture_s']:.1f} s, "
            f"in the steps that met a new bucket), {g['replays']} replays, {g.get('eager', 0)} "
            "micro-batches eager (their mini-batch had one over the cap)"
        )
    )
    print(report(m, floors))
    top = profile_dir / "top_ops_rank0.txt"
    if top.exists():
        trace = profile_dir / "trace_rank0.json"
        print(f"\ntop ops of the profiled step (rank 0; trace: {trace}):")
        print("\n".join(top.read_text().splitlines()[:22]))
    print(f"\nissue 16 keys: {json.dumps(m['issue16'])}")
    print(f"\ncommand: python -m arl.bench loop {' '.join(args)}")
    if a.out:
        write_new(a.out, json.dumps(m, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
