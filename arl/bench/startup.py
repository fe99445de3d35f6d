"""``python -m arl.bench startup``: a recipe's start-up, cold (empty compile cache) and warm.

Runs ``python -m arl.launch RECIPE`` twice as a user does, each in a fresh run folder: first
with an empty compile cache (``ARL_CACHE`` pointed at a fresh folder, `arl.compile_cache`; no
bytecode kept there either, `arl.bytecode`), then again on the cache the first run filled. For
each it prints the seconds from launch to the end of step 1 (``first_step_s``, the first row of
``metrics.jsonl``) and to the launcher's exit, and the start-up phases the run's log tells (the
nodes log at INFO: when they joined, the engine's load / compile / graph capture, each train
rank's load and priming, its warm-up), beside their floors measured in the same run, after both
runs and in their environment: ``import torch, transformers`` in a fresh process that starts as
arl's processes do (`arl.bytecode`: where Python keeps no bytecode, the runs' cache holds it by
then), and the model's load alone (``from_pretrained`` onto the device, in a fresh process after
those imports).

The model is resolved once here and passed as ``actor.path`` to both runs, so the fresh cache
holds only compiled code; ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` are dropped from
the runs' environment (else they, not ``ARL_CACHE``, would hold the cache). Without a GPU the
launcher applies the recipe's CPU preset (compilation is CUDA-only: cold and warm are alike).

    python -m arl.bench startup                      # arith, 60 steps, one GPU if there is one
    python -m arl.bench startup --steps 60 --out startup.json cluster.n_gpus=1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from arl.bench import fresh_run_dir, new_file, positive_float, write_new
from arl.config import ConfigError, apply_overrides
from arl.recipe import load_recipe
from arl.stats.logger import read_jsonl

# A log line's time, as both logging formats of arl write it (the launcher's and the nodes').
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_NUM = r"([0-9.]+)"
# (phase, pattern): the line's time gives the phase's end since launch; groups give seconds.
_LINES = {
    "config_saved": re.compile(r"resolved config saved to"),
    "nodes_joined": re.compile(r"node \S+ joined"),
    "rollout_setup": re.compile(
        rf"rollout setup in {_NUM} s \(imports {_NUM} s, reward and workflow {_NUM} s, "
        rf"tokenizer {_NUM} s, engine {_NUM} s\)"
    ),
    "engine_ready": re.compile(
        rf"hf engine ready in {_NUM} s \(load {_NUM} s, compile {_NUM} s, graphs {_NUM} s\)"
        rf"(?:; compiled functions kept: {_NUM} loaded, {_NUM} compiled)?"
    ),
    "train_created": re.compile(
        rf"node train0: created \S+ \(\S+\) in {_NUM} s \(import {_NUM} s\)"
    ),
    "train_ready": re.compile(
        rf"rank 0: ready in {_NUM} s \(load {_NUM} s, prime {_NUM} s(?:; process group {_NUM} s)?\)"
        rf"(?:; compiled functions kept: {_NUM} loaded, {_NUM} compiled)?"
    ),
    "train_warm_up": re.compile(rf"rank 0: warmed up \(compile=\w+\) in {_NUM} s"),
}
# The seconds each line reports, by name, in the order of its groups.
_KEYS = {
    "rollout_setup": ("took_s", "imports_s", "reward_s", "tokenizer_s", "engine_s"),
    "engine_ready": (
        "took_s",
        "load_s",
        "compile_s",
        "graphs_s",
        "kept_loaded_n",
        "kept_compiled_n",
    ),
    "train_created": ("took_s", "import_s"),
    "train_ready": ("took_s", "load_s", "prime_s", "group_s", "kept_loaded_n", "kept_compiled_n"),
    "train_warm_up": ("took_s",),
}

_FLOOR_IMPORT = (
    "from arl.bytecode import cache_bytecode; cache_bytecode(); import torch, transformers"
)
_FLOOR_LOAD = """
import sys, time
from arl.bytecode import cache_bytecode
cache_bytecode()
import torch, transformers
t0 = time.perf_counter()
from transformers import AutoModelForCausalLM
cuda = torch.cuda.is_available() and sys.argv[2] == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=dtype).to("cuda" if cuda else "cpu")
if cuda:
    torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def log_time(line: str) -> float | None:
    """The epoch seconds of a log line's ``asctime`` (local time), or None if it has none."""
    m = _STAMP.match(line)
    if m is None:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3


def read_phases(log: str, t_launch: float) -> dict:
    """Start-up phases from a run's log: for each phase found, ``at_s`` (its end, seconds
    since launch; the last such line for nodes joining) and the seconds its line reports."""
    out: dict = {}
    for line in log.splitlines():
        for name, pattern in _LINES.items():
            m = pattern.search(line)
            t = log_time(line)
            if m is None or t is None or (name in out and name != "nodes_joined"):
                continue
            entry = {"at_s": round(t - t_launch, 3)}
            for key, g in zip(_KEYS.get(name, ()), m.groups(), strict=True):
                if g is not None:  # an optional group the line did not have
                    entry[key] = int(g) if key.endswith("_n") else float(g)
            out[name] = entry
    return out


def summarize_run(rows: list[dict], log: str, t_launch: float, t_exit: float, rc: int) -> dict:
    """One run's figures: ``first_step_s`` and ``launch_to_exit_s`` since launch, the end of
    setup (step 1's start: its end less its ``time/step_s``), step 1's own phases, and the
    start-up phases of its log."""
    if not rows:
        raise ValueError("the run wrote no metrics row: it ended before step 1 (see its log)")
    first = rows[0]
    return {
        "rc": rc,
        "steps": len(rows),
        "first_step_s": first["time"] - t_launch,
        "launch_to_exit_s": t_exit - t_launch,
        "setup_done_s": first["time"] - first["time/step_s"] - t_launch,
        "step1": {k: first[k] for k in ("time/step_s", "time/wait_rollout_s", "time/train_s")},
        "phases": read_phases(log, t_launch),
    }


def results_json(stem: str, cold: dict, warm: dict, floors: dict, steps: int) -> dict:
    """The figures the issue tracks (``<recipe>.first_step_s_cold`` / ``_warm``,
    ``<recipe>.launch_to_exit_s_warm``), then both runs and the floors in full."""
    return {
        f"{stem}.first_step_s_cold": round(cold["first_step_s"], 2),
        f"{stem}.first_step_s_warm": round(warm["first_step_s"], 2),
        f"{stem}.launch_to_exit_s_warm": round(warm["launch_to_exit_s"], 2),
        "steps": steps,
        "floors": floors,
        "cold": cold,
        "warm": warm,
    }


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if isinstance(x, int) else f"{x:.1f}"


# (row label, phase in the log, its key) of the table, in start-up order.
_TABLE = [
    ("launcher: config checked, nodes start, since launch", "config_saved", "at_s"),
    ("nodes joined, since launch", "nodes_joined", "at_s"),
    ("rollout setup: imports (transformers' tokenizer)", "rollout_setup", "imports_s"),
    ("rollout setup: reward and workflow", "rollout_setup", "reward_s"),
    ("rollout setup: tokenizer", "rollout_setup", "tokenizer_s"),
    ("engine: load (transformers' model imports included)", "engine_ready", "load_s"),
    ("engine: compile (norm/MLP blocks, decode attention)", "engine_ready", "compile_s"),
    ("engine: decode graphs (warm-up)", "engine_ready", "graphs_s"),
    ("engine: compiled functions loaded from ARL_CACHE (count)", "engine_ready", "kept_loaded_n"),
    ("engine: compiled functions compiled into it (count)", "engine_ready", "kept_compiled_n"),
    ("engine ready, since launch", "engine_ready", "at_s"),
    ("train rank 0: worker import", "train_created", "import_s"),
    ("train rank 0: load", "train_ready", "load_s"),
    ("train rank 0: of it, process group", "train_ready", "group_s"),
    ("train rank 0: prime (compile)", "train_ready", "prime_s"),
    (
        "train rank 0: compiled functions loaded from ARL_CACHE (count)",
        "train_ready",
        "kept_loaded_n",
    ),
    ("train rank 0: compiled functions compiled into it (count)", "train_ready", "kept_compiled_n"),
    ("train rank 0 ready, since launch", "train_ready", "at_s"),
    ("train rank 0: warm-up (during step 1)", "train_warm_up", "took_s"),
]


def report(cold: dict, warm: dict, floors: dict) -> str:
    """The table: one row per phase, cold and warm, the floor beside it."""
    load_floor = floors["model_load_s"]
    rows: list[tuple[str, float | None, float | None, float | None]] = [
        (
            "import torch, transformers (a fresh process, as arl starts one)",
            None,
            None,
            floors["import_s"],
        )
    ]
    for label, name, key in _TABLE:
        c, w = (r["phases"].get(name, {}).get(key) for r in (cold, warm))
        rows.append((label, c, w, load_floor if key == "load_s" else None))
    rows += [
        ("setup done (step 1 starts), since launch", cold["setup_done_s"], warm["setup_done_s"]),
        ("step 1 (time/step_s)", cold["step1"]["time/step_s"], warm["step1"]["time/step_s"]),
        ("first_step_s: launch to the end of step 1", cold["first_step_s"], warm["first_step_s"]),
        (
            f"launch to exit ({warm['steps']} step{'s' * (warm['steps'] != 1)})",
            cold["launch_to_exit_s"],
            warm["launch_to_exit_s"],
        ),
    ]
    lines = ["| phase | cold s | warm s | floor s |", "| --- | --- | --- | --- |"]
    for name, c, w, *f in rows:
        lines.append(f"| {name} | {_fmt(c)} | {_fmt(w)} | {_fmt(f[0] if f else None)} |")
    return "\n".join(lines)


def measure_floors(model_path: str, device: str, env: dict | None = None) -> dict:
    """Seconds of ``import torch, transformers`` in a fresh process started as arl's are, and
    of the model's load alone onto ``device`` (a fresh process, after those imports); both in
    ``env`` (default: this process's)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _FLOOR_IMPORT], check=True, env=env)
    import_s = time.perf_counter() - t0
    r = subprocess.run(
        [sys.executable, "-c", _FLOOR_LOAD, model_path, device],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return {"import_s": import_s, "model_load_s": float(r.stdout.strip().splitlines()[-1])}


def run_once(cmd: list[str], env: dict, log_path: Path, timeout: float) -> tuple[float, float, int]:
    """Run ``cmd`` with its output to ``log_path``; (launch time, exit time, exit code)."""
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the launcher ends its nodes on SIGTERM
            rc = proc.wait(60)
        return t0, time.time(), rc


def main(argv: list[str] | None = None) -> int:
    """Run the recipe cold then warm and print the start-up table; 2 on bad arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m arl.bench startup", description=__doc__.split("\n")[0]
    )
    p.add_argument("--recipe", default="recipes/arith.py")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-dir", type=Path, default=Path("runs/bench-startup"))
    p.add_argument(
        "--out", type=new_file, default=None, help="write the figures as JSON here (a new file)"
    )
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, passed to the runs")
    a = p.parse_intermixed_args(args)
    if a.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = apply_overrides(load_recipe(a.recipe), a.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from arl.control.placement import detect_gpus
    from arl.engines.model import resolve_model

    model_path = resolve_model(cfg.actor.path)
    device = "cuda" if detect_gpus(cfg) else "cpu"
    fresh_run_dir(a.run_dir)
    cache = a.run_dir / "arl-cache"  # inside the benchmark's own folder, made afresh above
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    }
    env |= {"ARL_CACHE": str(cache.resolve()), "ARL_LOG_LEVEL": "INFO"}
    runs: dict[str, dict] = {}
    for label in ("cold", "warm"):
        bench = [
            f"experiment.run_dir={a.run_dir}",
            "experiment.name=startup",
            f"experiment.trial={label}",
            f"experiment.total_train_steps={a.steps}",
            f"actor.path={model_path}",
            "stats.progress_bar=false",
            "stats.tensorboard=false",
        ]
        cmd = [sys.executable, "-m", "arl.launch", a.recipe, *bench, *a.overrides]
        print(f"{label}: {' '.join(cmd[1:])} ...", flush=True)
        log_path = a.run_dir / f"{label}.log"
        t0, t1, rc = run_once(cmd, env, log_path, a.timeout)
        metrics = a.run_dir / "startup" / label / "metrics.jsonl"
        rows = read_jsonl(metrics) if metrics.exists() else []
        if rc != 0 or not rows:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
            print(
                f"error: the {label} run exited with {rc}; the end of {log_path}:\n{tail}",
                file=sys.stderr,
            )
            return 1
        runs[label] = summarize_run(rows, log_path.read_text(), t0, t1, rc)
        print(f"  step 1 ended {runs[label]['first_step_s']:.1f} s after launch", flush=True)
    floors = measure_floors(model_path, device, env)
    stem = Path(a.recipe).stem
    out = results_json(stem, runs["cold"], runs["warm"], floors, a.steps)
    print()
    print(report(runs["cold"], runs["warm"], floors))
    print(f"\narl cache (compiled code): {cache} ({_size_mb(cache):.0f} MB after both runs)")
    print(f"command: python -m arl.bench startup {' '.join(args)}")
    if a.out is not None:
        print(f"figures: {write_new(a.out, json.dumps(out, indent=1) + chr(10))}")
    shutil.rmtree(cache, ignore_errors=True)  # compiled code only; the next bench starts cold
    return 0


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


if __name__ == "__main__":
    sys.exit(main())
