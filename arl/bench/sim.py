"""``python -m arl.bench sim``: asynchronous overlap measured without a model.

Real ``arl-node`` processes, sockets, shard pulls, weight sync and the real `PPOTrainer` loop
(rollout controller, staleness semaphore, dispatch, free), with engines and train ranks that take
configured times (`arl.bench.sim_objects`): a group generates for ``gen_time`` seconds, a PPO
update takes ``train_time``. The same run is repeated for each eta (max_head_offpolicyness).

Theory: synchronous RL (eta = 0) takes gen + train per step; with eta >= 1 generation of the next
batch overlaps training, so a step takes max(gen, train), and gen = train gives 2x. The run
prints, per eta, steps/hour against eta = 0 (the peer) and the step time against that floor,
the share of training time during which rollout generated (from the trace), the time per phase,
the staleness of the trained groups, and the controller's CPU per step; each run's timeline is
written as a Chrome trace (and a PNG when matplotlib is installed).

    python -m arl.bench sim --eta 0 2 8 --steps 20 --gen-time 0.5 --train-time 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from arl.bench import (
    fraction,
    fresh_run_dir,
    int_at_least,
    non_negative_float,
    positive_float,
    positive_int,
)
from arl.config import Config, apply_overrides
from arl.control.cluster import Cluster, start_cluster
from arl.control.controller import RemoteObject
from arl.control.placement import plan_placement
from arl.protocol.remote import rollout_worker
from arl.stats.logger import read_jsonl
from arl.stats.trace import load_trace, overlap_s, spans
from arl.trainer import PPOTrainer

SPEEDUP_TARGET = 1.8


@attrs.define
class SimSpec:
    """One simulated run."""

    eta: int
    steps: int = 20
    batch_size: int = 8  # prompt groups per step
    n_samples: int = 4
    seq_len: int = 16  # generated tokens per sample
    gen_time: float = 0.5  # seconds per group (a node generates its groups concurrently)
    train_time: float = 0.5  # seconds per PPO update
    jitter: float = 0.1  # gen_time varies by +- this fraction per group
    rollout_nodes: int = 2
    train_nodes: int = 1
    max_concurrent: int | None = None  # none: the config default, (eta + 1) x batch_size
    overrides: tuple[str, ...] = ()


@attrs.define
class Probe:
    """The controller process at one instant."""

    t: float  # time.monotonic
    cpu: float  # time.process_time: CPU seconds of this (the controller's) process
    control_bytes: int  # bytes through the controller's socket, both ways
    rss: int  # resident bytes of this process


@attrs.define
class SimResult:
    """What one simulated run measured."""

    spec: SimSpec
    run_path: Path
    rows: list[dict]
    probes: list[Probe]  # before the first step, then after each step
    rss_setup: int
    trace: list[dict]

    @property
    def steady(self) -> tuple[Probe, Probe, int]:
        """First and last probe of the steady state (after step 1) and the steps between."""
        if len(self.probes) >= 3:
            return self.probes[1], self.probes[-1], len(self.probes) - 2
        return self.probes[0], self.probes[-1], len(self.probes) - 1

    @property
    def step_s(self) -> float:
        """Mean step time in the steady state (wall clock)."""
        a, b, n = self.steady
        return (b.t - a.t) / n

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s

    @property
    def steps_per_hour_all(self) -> float:
        """Including the first step (which waits for the first batch in every mode)."""
        a, b = self.probes[0], self.probes[-1]
        return 3600.0 * (len(self.probes) - 1) / (b.t - a.t)

    @property
    def cpu_per_step(self) -> float:
        a, b, n = self.steady
        return (b.cpu - a.cpu) / n

    @property
    def bytes_per_step(self) -> float:
        a, b, n = self.steady
        return (b.control_bytes - a.control_bytes) / n

    def phase_mean(self, key: str) -> float:
        vals = [r[key] for r in self.rows[1:] or self.rows if isinstance(r.get(key), int | float)]
        return statistics.fmean(vals) if vals else float("nan")

    def staleness(self) -> Counter:
        """Trained groups by staleness (versions between generation and training)."""
        return Counter(s for r in self.rows for s in r["rollout/staleness"])

    def gen_during_train(self) -> float:
        """Share of PPO-update time during which some rollout node was generating."""
        return gen_during_train(self.trace)


def gen_during_train(events: list[dict]) -> float:
    """Share of the PPO updates' time (in a trace) during which some node was generating."""
    ss = spans(events)
    gen = [s for s in ss if s["name"] == "generate"]
    train = [s for s in ss if s["name"] == "ppo_update"]
    total = sum(s["end"] - s["start"] for s in train)
    return overlap_s(gen, train) / total if total else 0.0


def sim_config(spec: SimSpec, run_dir: Path) -> Config:
    """The run's config: the trainer's defaults, CPU nodes, the sim's sizes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = apply_overrides(
        Config(),
        [
            f"experiment.run_dir={run_dir}",
            "experiment.name=sim",
            f"experiment.trial=eta{spec.eta}",
            f"experiment.total_train_steps={spec.steps}",
            f"actor.path={run_dir}",  # an existing folder: no model is loaded
            "data.loader=arl.data.arith:load_arith",
            "data.path=arith",
            f"data.batch_size={spec.batch_size}",
            f"gconfig.n_samples={spec.n_samples}",
            f"rollout.backend=hf:d{spec.rollout_nodes}",
            f"actor.backend=fsdp:d{spec.train_nodes}",
            f"rollout.max_head_offpolicyness={spec.eta}",
            f"rollout.max_concurrent_rollouts={spec.max_concurrent or 'none'}",
            "weight_sync.mode=zmq",
            "cluster.n_gpus=0",
            "cluster.cpu_threads_per_node=1",
            "evaluator.freq_steps=none",
            "saver.hf_export=false",
            "stats.tensorboard=false",
            "stats.progress_bar=false",
            *spec.overrides,
        ],
    )
    cfg.validate()
    return cfg


class SimTrainer(PPOTrainer):
    """The real trainer loop with simulated workers on its nodes; probes the controller."""

    def __init__(self, cfg: Config, cluster: Cluster, spec: SimSpec):
        super().__init__(cfg, cluster)
        self.spec = spec
        self.probes: list[Probe] = []
        log = self.stats.log

        def log_and_probe(step: int, metrics: dict) -> None:
            self.probes.append(probe(cluster))
            log(step, metrics)

        self.stats.log = log_and_probe  # type: ignore[method-assign]

    def resolve_model(self) -> str:
        """The sim workers load no model: ``actor.path`` is only a name here."""
        return self.cfg.actor.path

    async def _start_workers(self, model_path: str) -> None:
        s = self.spec

        async def rollout(i: int, p: Any) -> RemoteObject:
            w = await p.handle.create(
                "arl.bench.sim_objects:SimRolloutWorker",
                name="rollout",
                gen_time=s.gen_time,
                jitter=s.jitter,
                n_samples=s.n_samples,
                seq_len=s.seq_len,
                seed=self.cfg.experiment.seed * 1000 + i,
            )
            await rollout_worker(w).setup()
            return w

        def train(p: Any) -> Any:
            return p.handle.create(
                "arl.bench.sim_objects:SimTrainWorker",
                name="train",
                rank=p.spec.rank,
                world_size=len(self.cluster.train),
                train_time=s.train_time,
            )

        workers = await asyncio.gather(
            asyncio.gather(*(rollout(i, p) for i, p in enumerate(self.cluster.rollout))),
            asyncio.gather(*(train(p) for p in self.cluster.train)),
        )
        self.rollout_workers, self.train_workers = (list(w) for w in workers)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe(cluster: Cluster) -> Probe:
    ctl = cluster.controller
    return Probe(time.monotonic(), time.process_time(), ctl.bytes_in + ctl.bytes_out, rss_bytes())


async def run_sim(spec: SimSpec, run_dir: Path) -> SimResult:
    """Run ``spec`` on fresh nodes under ``run_dir``; the nodes are ended before it returns."""
    cfg = sim_config(spec, run_dir)
    fresh_run_dir(cfg.run_path)
    plan = plan_placement(cfg, 0)
    async with start_cluster(cfg, plan) as cluster:
        trainer = SimTrainer(cfg, cluster, spec)
        try:
            await trainer.setup()
            rss_setup = rss_bytes()
            trainer.probes.append(probe(cluster))
            await trainer.train()
        finally:
            await trainer.close()
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    trace = load_trace(cfg.run_path / "trace.json")
    return SimResult(spec, cfg.run_path, rows, trainer.probes, rss_setup, trace)


# ---- report -----------------------------------------------------------------------------------
def format_hist(c: Counter) -> str:
    """``0:20% 1:80%``: the share of each value."""
    n = sum(c.values())
    return " ".join(f"{k}:{100 * v / n:.0f}%" for k, v in sorted(c.items())) if n else "-"


def report(results: list[SimResult]) -> str:
    """The table of one sim invocation (one row per eta)."""
    spec = results[0].spec
    base = next((r for r in results if r.spec.eta == 0), None)
    floor = max(spec.gen_time, spec.train_time)
    lines = [
        f"simulated: {spec.rollout_nodes} rollout nodes, {spec.train_nodes} train node(s), "
        f"batch {spec.batch_size} groups x {spec.n_samples} samples x {spec.seq_len} tokens, "
        f"gen {spec.gen_time} s (+-{spec.jitter:.0%}) per group, train {spec.train_time} s "
        f"per step, {spec.steps} steps; steady state = steps 2..{spec.steps}",
        f"theory: eta=0 step >= gen + train = {spec.gen_time + spec.train_time:.2f} s; "
        f"eta>=1 step >= max(gen, train) = {floor:.2f} s (speedup "
        f"{(spec.gen_time + spec.train_time) / floor:.2f}x)",
        "",
        "| eta | steps/hour | vs eta=0 | step s | floor / step | gen during train | "
        "wait rollout s | train s | sync s | staleness (groups) | controller CPU/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        speed = f"{r.steps_per_hour / base.steps_per_hour:.2f}x" if base else "-"
        cpu = r.cpu_per_step
        lines.append(
            f"| {r.spec.eta} | {r.steps_per_hour:,.0f} | {speed} | {r.step_s:.3f} | "
            f"{floor / r.step_s:.2f} | {100 * r.gen_during_train():.0f}% | "
            f"{r.phase_mean('time/wait_rollout_s'):.3f} | {r.phase_mean('time/train_s'):.3f} | "
            f"{r.phase_mean('time/sync_s'):.3f} | {format_hist(r.staleness())} | "
            f"{1000 * cpu:.1f} ms ({100 * cpu / r.step_s:.1f}%) |"
        )
    speedups = [r.steps_per_hour / base.steps_per_hour for r in results if base and r.spec.eta > 0]
    if speedups:  # the target is judged only with both a synchronous and an async run
        best = max(speedups)
        met = "met" if best >= SPEEDUP_TARGET else "MISSED"
        lines.append(f"\ntarget: async >= {SPEEDUP_TARGET}x synchronous: {met} ({best:.2f}x)")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m arl.bench sim", description=__doc__.split("\n")[0])
    p.add_argument("--eta", type=int_at_least(0), nargs="+", default=[0, 2, 8])
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompt groups per step")
    p.add_argument("--n-samples", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=16, help="generated tokens per sample")
    p.add_argument("--gen-time", type=positive_float, default=0.5, help="seconds per group")
    p.add_argument(
        "--train-time", type=non_negative_float, default=0.5, help="seconds per PPO update"
    )
    p.add_argument("--jitter", type=fraction, default=0.1, help="gen-time varies by +- this share")
    p.add_argument("--rollout-nodes", type=positive_int, default=2)
    p.add_argument("--train-nodes", type=positive_int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench-sim"))
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the sim for every eta and print the table."""
    a = _parse(argv)
    fresh_run_dir(a.out, "--out")  # the runs and the timeline go here
    results = []
    for eta in a.eta:
        spec = SimSpec(
            eta=eta,
            steps=a.steps,
            batch_size=a.batch_size,
            n_samples=a.n_samples,
            seq_len=a.seq_len,
            gen_time=a.gen_time,
            train_time=a.train_time,
            jitter=a.jitter,
            rollout_nodes=a.rollout_nodes,
            train_nodes=a.train_nodes,
            overrides=tuple(a.overrides),
        )
        r = asyncio.run(run_sim(spec, a.out))
        print(f"eta={eta}: {r.steps_per_hour:,.0f} steps/hour; trace {r.run_path / 'trace.json'}")
        results.append(r)
    print()
    print(report(results))
    traces = {f"eta={r.spec.eta}": r.run_path / "trace.json" for r in results}
    try:
        from arl.stats.trace_png import render
    except ImportError:
        return 0
    try:
        out = render(traces, a.out / "timeline_sim.png", title="simulated gen = train")
    except SystemExit as e:  # matplotlib missing
        print(e, file=sys.stderr)
        return 0
    print(f"timeline: {out}")
    print(
        f"command: python -m arl.bench sim {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
