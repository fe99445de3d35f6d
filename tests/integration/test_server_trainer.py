"""Server engines through the whole loop: the trainer starts them from ``rollout.backend``,
syncs weights into them, and verifies after every sync that they generate with those weights.

SGLang runs against the stand-in (tests/support/sglang_standin.py: a real transformers model
behind SGLang's HTTP API), started by the trainer as ``python -m sglang.launch_server`` through
the shim package in tests/support/standin_path. vLLM runs for real on CPU (marker ``server``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from arl.run import run
from arl.stats.logger import read_jsonl
from arl.weights import WeightSyncError
from tests.support.sglang_standin import IGNORE_UPDATES_ENV, TOKEN_DELAY_ENV
from tests.support.tiny_model import make_tiny_model, tiny_run_config
from tests.support.vllm import SKIP_REASON, vllm_python

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "support" / "standin_path"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def standin_env(monkeypatch):
    """Nodes (and the servers they start) find the stand-in as `sglang`."""
    path = os.pathsep.join(filter(None, [str(SHIM), str(REPO), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return monkeypatch


def _sglang_config(tmp_path: Path, model: str, *overrides: str):
    return tiny_run_config(
        tmp_path,
        model,
        "rollout.backend=sglang:d1",
        f"rollout.server_python={sys.executable}",
        "rollout.server_start_timeout=300",
        "gconfig.max_new_tokens=24",
        # Rewards that differ within a group, so every step really changes the weights.
        "rollout.reward=tests.support.deterministic:vowel_reward",
        "cluster.allowed_import_prefixes=[arl,tests]",
        *overrides,
    )


def test_sglang_through_the_trainer_generates_with_every_synced_version(
    tmp_path, tiny_model, standin_env
):
    cfg = _sglang_config(tmp_path, tiny_model)
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["train/grad_norm"] > 0 for r in rows)
    for r in rows:
        assert r["version"] == r["step"]
        # The server's log-probs of the probe match the trainer's after each sync (the
        # stand-in computes as the trainer does: no numerics floor).
        assert r["sync/probe_floor"] == 0.0
        assert r["sync/probe_mean_abs_diff"] <= cfg.weight_sync.verify_tolerance
        assert r["rollout/staleness_max"] <= 1


def test_a_sync_interrupts_server_generations_and_their_tokens_switch_version(
    tmp_path, tiny_model, standin_env
):
    """The first sync pauses rollout once the stand-in is generating: those generations are cut,
    continue after the resume, and step 2 trains them with tokens of versions 0 and 1, which
    `rollout/version_switches` counts. One batch of groups in flight at a time: with the
    default (two batches) the next batch's groups start beside the current ones and finish
    before the trainer's step ends, so no sync finds a generation to cut (0 switches, as the
    vLLM run above measures)."""
    from arl.control.rollout import RolloutController

    pause = RolloutController.pause
    inflight_at_pause: list[int] = []

    async def pause_once_generating(self, in_place: bool = False) -> None:
        inflight = 0
        # The first pause waits for a state (requests in flight on a server), not a duration.
        for _ in range(0 if inflight_at_pause else 1200):
            healths = await asyncio.gather(*(w.health() for w in self.workers))
            inflight = sum(h["inflight"] for h in healths)
            if inflight:
                break
            await asyncio.sleep(0.05)
        inflight_at_pause.append(inflight)
        await pause(self, in_place)

    standin_env.setattr(RolloutController, "pause", pause_once_generating)
    # 0.1 s a token: a group of the next batch outlasts a training step of the tiny model.
    standin_env.setenv(TOKEN_DELAY_ENV, "0.1")
    cfg = _sglang_config(
        tmp_path, tiny_model, "gconfig.max_new_tokens=64", "rollout.max_concurrent_rollouts=2"
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert inflight_at_pause[0] > 0
    assert rows[0]["rollout/version_switches"] == 0  # generated before any sync
    assert rows[1]["rollout/version_switches"] > 0
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)


def test_a_server_that_drops_weight_updates_stops_the_run(tmp_path, tiny_model, standin_env):
    standin_env.setenv(IGNORE_UPDATES_ENV, "1")
    cfg = _sglang_config(tmp_path, tiny_model)
    # Caught at the first sync: the stand-in computes as the trainer does (floor 0).
    with pytest.raises(WeightSyncError, match="after the sync to version 1, the sglang engine"):
        asyncio.run(run(cfg))


def _vllm_config(tmp_path: Path, python: str, *overrides: str):
    from arl.engines.model import resolve_model

    return tiny_run_config(
        tmp_path,
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"),
        "rollout.backend=vllm:d1",
        f"rollout.server_python={python}",
        "rollout.server_args=[--max-model-len,2048]",  # eager: arl adds it on the CPU
        "rollout.server_start_timeout=1500",
        "rollout.dtype=bfloat16",
        "gconfig.max_new_tokens=48",
        "gconfig.n_samples=4",
        "actor.max_tokens_per_mb=2048",
        "cluster.heartbeat_timeout=120",
        # Rewards that differ within a group: every step changes the weights (with arith's
        # reward a group can score all 0 and the step leave the weights as they were).
        "rollout.reward=tests.support.deterministic:vowel_reward",
        "cluster.allowed_import_prefixes=[arl,tests]",
        *overrides,
    )


@pytest.mark.server
@pytest.mark.timeout(2400)
def test_vllm_through_the_trainer_follows_a_sync_and_a_sync_that_moves_nothing_stops_it(
    tmp_path, monkeypatch
):
    """A real vLLM server on CPU, SmolLM2-135M-Instruct, 2 steps at eta = 1, disk weight sync,
    a learning rate that moves the policy in one step. The first sync reloads the weights: the
    server scores the probe as the trainer does. The second one's transfer is made a no-op
    (weights saved, never loaded): its verification stops the run, naming the engine. (One run
    for both: a vLLM run costs minutes of CI.)"""
    python = vllm_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    from arl.weights.disk import DiskSync

    transfer = DiskSync.transfer

    async def first_transfer_only(self, version: int) -> None:
        if version == 1:
            await transfer(self, version)

    monkeypatch.setattr(DiskSync, "transfer", first_transfer_only)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # the node's env reaches its server
    # lr 3e-4: one step moved the probe's mean log-prob by ~1.0, far past the tolerance (0.05),
    # and the real sync's shift change was 0.016 (at 1e-3: 1.4, and 0.034 too close to 0.05)
    cfg = _vllm_config(tmp_path, python, "actor.lr=3e-4", "experiment.total_train_steps=2")
    with pytest.raises(WeightSyncError, match="after the sync to version 2, the vllm engine") as e:
        asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    r = rows[0]
    assert r["version"] == 1 and r["rollout/staleness_max"] <= 1
    assert r["sync/probe_shift_change"] <= cfg.weight_sync.verify_tolerance
    assert r["sync/probe_spread_change"] <= cfg.weight_sync.verify_tolerance
    print("probe floor", r["sync/probe_floor"], "|diff|", r["sync/probe_mean_abs_diff"])
    print("probe shift change", r["sync/probe_shift_change"])
    print(e.value)
