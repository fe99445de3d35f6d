"""``python -m arl.bench controller``: what the controller costs per training step.

The controller is this process (embedded, as with ``python -m arl.launch``); the nodes are real
``arl-node`` processes running the simulated workers of ``python -m arl.bench sim``, so every
control-plane message of a real run is sent, and none of the model's work is done. Each
configuration runs in a fresh child process, so that memory figures do not carry over:

1. CPU: the controller process's CPU time per step (``time.process_time``: its event loop and
   ZeroMQ's I/O thread) over the step's wall time, at a step as long as the measured H200
   arith step in docs/results.md (16 groups x 8 samples, 1.6 s). Goal: < 2%.
2. Memory: the controller's resident memory after setup, after step 1 and after the last step,
   for batches of 64 to 1,024 prompt groups. Goal: flat (the controller holds metadata only:
   it grows with the groups it tracks, never with steps or sequence length).
3. Bytes: control-plane bytes per step (everything through the controller's socket, both ways)
   at 16 and 4,096 generated tokens per sample, beside the trajectory bytes that the train rank
   pulled from the rollout nodes directly. Goal: independent of sequence length.

    python -m arl.bench controller --batches 64 128 256 512 1024 --seq-lens 16 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

from arl.bench import positive_float, positive_int
from arl.bench.sim import SimResult, SimSpec, run_sim

CPU_GOAL = 0.02
PROMPT_LEN = 8  # SimRolloutWorker's default
# Bytes per token of a stored trajectory: input_ids int64, attention/loss masks bool,
# logprobs float32, versions int32 (arl.workflows.base).
TRAJECTORY_BYTES_PER_TOKEN = 8 + 1 + 1 + 4 + 4


def measure(spec: SimSpec, run_dir: Path) -> dict:
    """Run ``spec`` here and return the controller's figures (this process is the controller)."""
    r: SimResult = asyncio.run(run_sim(spec, run_dir))
    per_step = spec.batch_size * spec.n_samples
    return {
        "spec": attrs.asdict(spec),
        "step_s": r.step_s,
        "cpu_per_step_s": r.cpu_per_step,
        "bytes_per_step": r.bytes_per_step,
        "rss_setup": r.rss_setup,
        "rss_steps": [p.rss for p in r.probes[1:]],  # after each step
        "pulled_per_step": per_step * (PROMPT_LEN + spec.seq_len) * TRAJECTORY_BYTES_PER_TOKEN,
        "staleness_max": max(r.staleness(), default=0),
    }


def measure_in_child(spec: SimSpec, run_dir: Path) -> dict:
    """`measure` in a fresh Python process (its memory starts from nothing)."""
    arg = json.dumps({**attrs.asdict(spec), "run_dir": str(run_dir)})
    out = subprocess.run(
        [sys.executable, "-m", "arl.bench", "controller", "--child", arg],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the measurement of {spec} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _size(n: float) -> str:
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else _mb(n)


def _spec(**kw: object) -> SimSpec:
    return SimSpec(**{k: tuple(v) if k == "overrides" else v for k, v in kw.items()})


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements and print them against their goals."""
    p = argparse.ArgumentParser(
        prog="python -m arl.bench controller", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batches", type=positive_int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[16, 4096])
    p.add_argument(
        "--steps", type=positive_int, default=4, help="steps per memory/bytes measurement"
    )
    p.add_argument("--cpu-steps", type=positive_int, default=10)
    p.add_argument(
        "--step-s", type=positive_float, default=1.6, help="step length of the CPU figure"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["cpu", "memory", "bytes"])
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        kw = json.loads(a.child)
        run_dir = Path(kw.pop("run_dir"))
        print(json.dumps(measure(_spec(**kw), run_dir)))
        return 0
    with tempfile.TemporaryDirectory(prefix="arl-bench-controller-") as tmp:
        out = a.out or Path(tmp)
        if "cpu" not in a.skip:
            _cpu(a, out)
        if "memory" not in a.skip:
            _memory(a, out)
        if "bytes" not in a.skip:
            _bytes(a, out)
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: python -m arl.bench controller {shown}")
    return 0


def _cpu(a: argparse.Namespace, out: Path) -> None:
    # gen = train = step: with eta = 2 generation hides behind training, as in the H200 run.
    spec = SimSpec(
        eta=2,
        steps=a.cpu_steps,
        batch_size=16,
        n_samples=8,
        seq_len=64,
        gen_time=a.step_s,
        train_time=a.step_s,
    )
    m = measure_in_child(spec, out / "cpu")
    ratio = m["cpu_per_step_s"] / m["step_s"]
    print("1. controller CPU per step (16 groups x 8 samples, eta = 2, 2 rollout + 1 train node)")
    print("| step (wall) | controller CPU per step | CPU / step | goal |")
    print("| --- | --- | --- | --- |")
    print(
        f"| {m['step_s']:.2f} s | {1000 * m['cpu_per_step_s']:.1f} ms | {100 * ratio:.2f}% | "
        f"< {100 * CPU_GOAL:.0f}%: {'met' if ratio < CPU_GOAL else 'MISSED'} |"
    )


def _memory(a: argparse.Namespace, out: Path) -> None:
    print("\n2. controller memory by batch size (4 samples x 16 tokens per group, eta = 1)")
    print(
        "| groups per step | RSS after setup | after step 1 | after the last step | "
        "growth per group | controller CPU per step | per group |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in a.batches:
        spec = SimSpec(eta=1, steps=a.steps, batch_size=b, gen_time=0.5, train_time=0.2)
        m = measure_in_child(spec, out / f"mem{b}")
        rss = m["rss_steps"]
        print(
            f"| {b:,} | {_mb(m['rss_setup'])} | {_mb(rss[0])} | {_mb(rss[-1])} | "
            f"{(max(rss) - m['rss_setup']) / b / 1e3:.1f} kB | "
            f"{1000 * m['cpu_per_step_s']:.0f} ms | {1000 * m['cpu_per_step_s'] / b:.2f} ms |",
            flush=True,
        )


def _bytes(a: argparse.Namespace, out: Path) -> None:
    print("\n3. control-plane bytes per step by sequence length (8 groups x 4 samples, eta = 2)")
    print(
        "| generated tokens per sample | control-plane bytes per step | vs the shortest | "
        "trajectory bytes pulled node to node per step |"
    )
    print("| --- | --- | --- | --- |")
    base = None
    for n in a.seq_lens:
        spec = SimSpec(eta=2, steps=a.steps + 2, seq_len=n)
        m = measure_in_child(spec, out / f"seq{n}")
        base = base or m["bytes_per_step"]
        print(
            f"| {n:,} | {m['bytes_per_step'] / 1e3:,.1f} kB | {m['bytes_per_step'] / base:.3f}x | "
            f"{_size(m['pulled_per_step'])} |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
