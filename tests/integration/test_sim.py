"""The real trainer loop on real nodes with simulated engines and train ranks (arl.bench.sim):
synchronous RL never overlaps, eta = 2 overlaps rollout with training within its staleness bound,
and the run's timeline (trace.json) shows both."""

from __future__ import annotations

import asyncio

import pytest

from arl.bench.sim import SimSpec, report, run_sim
from arl.stats.trace import overlap_s, spans

STEPS, B = 4, 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    return {
        eta: asyncio.run(
            run_sim(
                SimSpec(eta=eta, steps=STEPS, batch_size=B, gen_time=0.2, train_time=0.2),
                out,
            )
        )
        for eta in (0, 2)
    }


def _by_name(result, name):
    return [s for s in spans(result.trace) if s["name"] == name]


def test_every_step_ran_and_every_node_has_its_phases_in_the_trace(results):
    for r in results.values():
        assert [row["step"] for row in r.rows] == list(range(1, STEPS + 1))
        assert [row["version"] for row in r.rows] == list(range(1, STEPS + 1))
        rows: dict[str, set[str]] = {}
        for s in spans(r.trace):
            rows.setdefault(s["row"], set()).add(s["name"])
        assert {"wait_rollout", "train", "weight_sync"} <= rows["trainer"]
        for node in ("rollout0", "rollout1"):
            assert {"generate", "paused"} <= rows[node]
        assert {"load_batch", "compute_advantages", "ppo_update", "weight_sync"} <= rows["train0"]
        # One pause per weight sync on each rollout node; every accepted group was generated.
        for node in ("rollout0", "rollout1"):
            assert len([s for s in _by_name(r, "paused") if s["row"] == node]) == STEPS
        assert len(_by_name(r, "generate")) >= STEPS * B


def test_synchronous_rl_trains_only_fresh_samples_and_never_overlaps(results):
    r = results[0]
    assert set(r.staleness()) == {0}
    assert overlap_s(_by_name(r, "generate"), _by_name(r, "ppo_update")) == 0.0


def test_eta2_overlaps_rollout_with_training_within_the_bound(results):
    r = results[2]
    lags = r.staleness()
    assert max(lags) <= 2
    assert max(lags) >= 1  # groups generated under an older policy were trained
    assert overlap_s(_by_name(r, "generate"), _by_name(r, "ppo_update")) > 0.0
    table = report([results[0], results[2]])
    assert "| 0 |" in table and "| 2 |" in table and "vs eta=0" in table
