"""Soak: 100 steps of the CPU arith recipe on the tiny model; no memory growth (marked slow).

A sampler thread records the peak resident memory (VmRSS) during every step of every process of
the run (the controller, which is this process, each node, and the processes they started), and
the run logs each node's ``bytes_held`` gauge at the end of every step. The test asserts that

- no process grows: its peak RSS over the last quarter of the run is at most
  ``RSS_GROWTH_MIB`` above its peak over the second quarter (a leaked weight bucket would add
  ~12 MiB per step here, 600 MiB between the two). Peaks over 25 steps, because a sampler
  catches one step's true peak only sometimes: the train rank's per-step peaks scatter over
  ~150 MiB around a flat line, while its 25-step peaks agree within a few MiB;
- shards do not pile up: every node's ``bytes_held`` at the end of each step stays below what
  eta + 2 batches of groups can hold (a leak of one group per step would pass it within a few
  dozen steps), and the train rank's is back to 0 after every step.

``ARL_SOAK_REPORT=FILE`` writes the per-step samples and the summary as JSON (the figures in
docs/reliability.md come from it). Run it with
``python3 -m pytest -s -m slow tests/integration/test_soak.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path

import pytest

from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(7200)]

STEPS = int(os.environ.get("ARL_SOAK_STEPS", "100"))  # fewer: a quick check of the test
RSS_GROWTH_MIB = 25.0  # last quarter's peak over the second quarter's


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(entry.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), cmd.strip())
    return table


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None
    return kb / 1024


def _label(pid: int, cmd: str) -> str:
    if pid == os.getpid():
        return "controller"
    if "--node-id" in cmd:
        return cmd.split("--node-id", 1)[1].split()[0]
    return f"{cmd.split()[-1].rsplit('.', 1)[-1]}-{pid}"  # e.g. verify_pool-1234


class Sampler(threading.Thread):
    """Samples the RSS of this process and all its descendants ten times a second, and keeps
    each process's peak during each step (a step's allocations make RSS swing within it; the
    peak repeats from step to step, so a leak shows as a rising peak)."""

    def __init__(self, metrics: Path):
        super().__init__(name="soak-sampler", daemon=True)
        self.metrics = metrics
        self.peaks: dict[int, dict[str, float]] = {}  # step -> {label: peak MiB during it}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                step = self.metrics.read_text().count("\n") + 1  # the step in progress
            except OSError:
                continue
            table, root = _proc_table(), os.getpid()
            peaks = self.peaks.setdefault(step, {})
            frontier = [root]
            while frontier:
                pid = frontier.pop()
                rss = _rss_mib(pid)
                if rss is not None and (pid == root or pid in table):
                    label = _label(pid, table.get(pid, (0, ""))[1])
                    peaks[label] = max(rss, peaks.get(label, 0.0))
                frontier += [p for p, (pp, _) in table.items() if pp == pid]


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def test_soak_100_steps_memory_flat(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    cfg = tiny_run_config(
        tmp_path,
        model,
        f"experiment.total_train_steps={STEPS}",
        "weight_sync.verify=false",
        "saver.hf_export=false",
    )
    metrics = cfg.run_path / "metrics.jsonl"
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    metrics.touch()
    sampler = Sampler(metrics)
    sampler.start()
    t0 = time.monotonic()
    try:
        asyncio.run(run(cfg))
    finally:
        sampler.stop.set()
        sampler.join()
    wall_s = time.monotonic() - t0
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    # Peak RSS per process and step, for the processes seen in every step.
    half = STEPS // 2
    steps = [k for k in range(1, STEPS + 1) if k in sampler.peaks]
    assert len(steps) >= STEPS - 2, f"too few samples: {sorted(sampler.peaks)}"
    labels = set.intersection(*(set(sampler.peaks[k]) for k in steps))
    summary: dict = {"steps": STEPS, "wall_s": round(wall_s), "rss_mib": {}, "bytes_held": {}}
    for label in sorted(labels):
        series = [sampler.peaks[k][label] for k in steps]
        late = [(k, sampler.peaks[k][label]) for k in steps if k > half]
        q2 = [sampler.peaks[k][label] for k in steps if STEPS // 4 < k <= half]
        q4 = [sampler.peaks[k][label] for k in steps if k > STEPS - STEPS // 4]
        summary["rss_mib"][label] = {
            "first_step_peak": round(series[0], 1),
            "mid_step_peak": round(sampler.peaks[steps[len(steps) // 2]][label], 1),
            "last_step_peak": round(series[-1], 1),
            "max": round(max(series), 1),
            "slope_second_half_mib_per_step": round(_slope(*zip(*late, strict=True)), 4),
            "peak_q2": round(max(q2), 1),
            "peak_q4": round(max(q4), 1),
            "growth_q2_to_q4_mib": round(max(q4) - max(q2), 1),
            "median_growth_q2_to_q4_mib": round(statistics.median(q4) - statistics.median(q2), 1),
        }
    # bytes_held per node, as the run logged it at the end of each step.
    b, g = cfg.data.batch_size, cfg.gconfig
    bytes_per_token = 8 + 1 + 1 + 4 + 4  # input_ids, attention/loss masks, logprobs, versions
    group_bytes = g.n_samples * ((cfg.data.max_prompt_len + g.max_new_tokens) * bytes_per_token + 4)
    bound = (cfg.rollout.max_head_offpolicyness + 2) * b * group_bytes
    for key in sorted(k for k in rows[0] if k.endswith("/bytes_held")):
        held = [r[key] for r in rows]
        summary["bytes_held"][key.split("/")[1]] = {
            "max_first_half": max(held[:half]),
            "max_second_half": max(held[half:]),
            "last": held[-1],
            "bound": bound,
        }
    report = os.environ.get("ARL_SOAK_REPORT")
    if report:
        Path(report).write_text(json.dumps({"summary": summary, "peaks": sampler.peaks}))
    print(json.dumps(summary, indent=1))

    assert {"controller", "rollout0", "train0"} <= labels, labels
    for label, s in summary["rss_mib"].items():
        assert s["growth_q2_to_q4_mib"] <= RSS_GROWTH_MIB, (label, s)
    for node, h in summary["bytes_held"].items():
        assert max(h["max_first_half"], h["max_second_half"]) <= bound, (node, h)
    # A train rank's pulled copies and weight buckets are freed before the step is logged.
    assert all(r["node/train0/bytes_held"] == 0 for r in rows)
