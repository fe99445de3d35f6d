"""A fixed-seed CPU run is bit-identical when run again, and equals the recorded run.

A refactor must not change what the training step computes: this test runs the tiny model for
3 steps at eta = 0 with a reward that depends on the text alone, twice, and compares every step's
loss, gradient norm, entropy and token count: between the two runs exactly (``==`` on floats),
and with ``tests/golden/fixed_seed_cpu.json`` to within the last bits a CPU type leaves. Float
sums round differently on different CPUs (AVX2 or AVX-512 kernels): between two machines the
recorded gradient norms differed by < 5e-7 relative and the losses, ~0 here by construction
(batch-normalised advantages cancel), by < 2e-7 absolute. A change to the step's maths moves
them far more. A change that means to alter the numbers records a new file with
``ARL_RECORD_GOLDEN=1 python3 -m pytest tests/integration/test_fixed_seed.py`` and says why in
its commit message.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fixed_seed_cpu.json"
KEYS = ("train/loss", "train/grad_norm", "train/entropy", "train/n_tokens", "train/clip_frac")
# Per key, (relative, absolute) tolerance against the recorded run (see the module docstring);
# the other keys must be equal.
RECORDED_TOLERANCE = {
    "train/loss": (0.0, 1e-6),
    "train/grad_norm": (1e-5, 0.0),
    "train/entropy": (1e-5, 0.0),
}


def _run(tmp_path: Path, model: str) -> list[dict]:
    cfg = tiny_run_config(
        tmp_path,
        model,
        "rollout.max_head_offpolicyness=0",
        "rollout.reward=tests.support.deterministic:vowel_reward",
        "cluster.allowed_import_prefixes=[arl,tests]",
        "weight_sync.verify=false",
        "experiment.seed=3",
        # One generation at a time: the engine's sampling RNG is drawn in the same order
        # whatever the timing (concurrent requests interleave by when they arrive). One
        # sample per prompt, normalised over the batch, still gives every step an update.
        "rollout.max_concurrent_rollouts=1",
        "gconfig.n_samples=1",
        "actor.reward_norm_mean=batch",
        "actor.reward_norm_std=batch",
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows]


def _close(key: str, got: float, want: float) -> bool:
    rel, abs_ = RECORDED_TOLERANCE.get(key, (0.0, 0.0))
    return math.isclose(got, want, rel_tol=rel, abs_tol=abs_)


def test_fixed_seed_run_is_bit_identical_again_and_equals_the_recorded_run(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    got = _run(tmp_path / "first", model)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert any(r["train/grad_norm"] > 0 for r in got), "a run that does not train proves nothing"
    again = _run(tmp_path / "again", model)
    for g, a in zip(got, again, strict=True):
        assert g == a, f"step {g['step']}: the same seed gave {g}, then {a}"
    if os.environ.get("ARL_RECORD_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert GOLDEN.exists(), f"no recorded run at {GOLDEN}; record one with ARL_RECORD_GOLDEN=1"
    want = json.loads(GOLDEN.read_text())
    for g, w in zip(got, want, strict=True):
        off = [k for k in ("step", *KEYS) if not _close(k, g[k], w[k])]
        assert not off, f"step {w['step']}: {off} differ: got {g}, recorded {w}"
