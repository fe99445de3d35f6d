"""`python -m arl.bench loop` on CPU: the small preset on the tiny model, real nodes."""

from __future__ import annotations

import json

import pytest

from arl.bench.loop import main
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_loop_bench_writes_every_phase_beside_its_floor(tmp_path, tiny_model, capsys):
    out = tmp_path / "loop.json"
    rc = main(
        [
            "--steps",
            "3",  # the default profile step, 3, is past it: the last but one (2) is profiled
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            f"actor.path={tiny_model}",
            "actor.dtype=float32",
            "cluster.n_gpus=0",
        ]
    )
    assert rc == 0
    m = json.loads(out.read_text())
    phases = ("wait_rollout", "pull_dispatch", "logp", "update", "weight_sync", "rest")
    assert set(m["phases"]) == set(phases)
    for name in phases:
        assert m["phases"][name]["median_s"] >= 0 and m["phases"][name]["floor_s"] >= 0
        assert m["phases"][name]["mean_s"] >= 0
    steady = [r["time/step_s"] for r in m["per_step"][1:]]  # the mean a user feels: steps 2..N
    assert m["mean_step_s"] == pytest.approx(sum(steady) / len(steady))
    logp = m["phases"]["logp"]  # no pass of its own (and so no floor) when the update folds it
    assert (logp["floor_s"] > 0) == (logp["median_s"] > 0), logp
    assert m["phases"]["weight_sync"]["floor_s"] > 0
    assert m["steps"] == 3 and len(m["per_step"]) == 3
    assert m["train_tokens_per_step"] > 0 and m["train_tokens_per_s"] > 0
    assert m["train_info"]["layout"] == "padded"  # no varlen kernel on CPU
    r = m["rollout"]
    assert r["trained_gen_tokens_per_s"] > 0
    assert r["mean_decode_batch"] >= 1 and 0 < r["busy_share"] <= 1
    assert 0 <= r["prefill_s"] <= r["busy_s"]
    assert set(r["by_phase"]) == {"train", "other"}
    # Step 1's wait, taken apart: its batch is taken once its groups are done and the train
    # ranks warmed up; the engines were seen decoding by then (their counters are sampled every
    # 0.25 s, each sample an RPC, so "by" is late by up to a period and a loaded reply).
    f = m["step1"]
    assert f["first_group_s"] <= f["batch_groups_s"] <= f["batch_taken_s"] + 0.05
    assert f["warm_up_end_s"] <= f["batch_taken_s"] + 0.05
    assert f["first_token_by_s"] is not None and f["first_token_by_s"] <= f["batch_taken_s"] + 2
    # The profiled step cycle left its files and figures.
    assert m["profile"]["window_s"] > 0
    assert m["profile"]["kernels"] == 0 and "fixed_overhead_s" not in m  # CPU: no device work
    assert (tmp_path / "runs" / "loop" / "bench" / "profile" / "top_ops_rank0.txt").exists()
    assert m["issue16"]["arith.step_time_3_s"] == m["step_time_sum_s"]
    assert m["issue16"]["arith.train_tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "| weight_sync |" in printed and "floor" in printed


def test_loop_bench_refuses_a_profile_step_outside_the_run(tmp_path, capsys):
    assert main(["--steps", "3", "--profile-step", "3", "--run-dir", str(tmp_path)]) == 2
    assert "--profile-step must be in 1..2" in capsys.readouterr().err


def test_overrides_may_come_between_options(capsys):
    """``--steps 5 cluster.n_gpus=1 --profile-step 7``: the option after an override is still
    read (here it is refused, before anything starts, because step 7 is past the last)."""
    assert main(["--steps", "5", "cluster.n_gpus=0", "--profile-step", "7", "actor.lr=1e-5"]) == 2
    assert "--profile-step must be in 1..4" in capsys.readouterr().err


def test_a_run_folder_no_benchmark_wrote_is_refused_and_kept(tmp_path, capsys):
    from arl.bench.__main__ import main as bench

    mine = tmp_path / "victim" / "t0"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    argv = ["loop", "--steps", "2", "--run-dir", str(tmp_path), "experiment.name=victim"]
    assert bench([*argv, "experiment.trial=t0", "cluster.n_gpus=0"]) == 2
    assert "already holds files and no .arl-bench marker" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine"


def test_decode_by_phase_splits_the_engine_counters_by_the_trainers_train_spans():
    from arl.bench.loop import decode_by_phase

    # The trainer trains from 1.0 to 2.0 s on the trace's clock, which starts at wall 100.
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "trainer"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "train", "ts": 1.0e6, "dur": 1.0e6, "args": {}},
    ]

    def h(steps, busy, prefill, sync):
        return {
            "steps": steps,
            "generated_tokens": 10 * steps,
            "busy_s": busy,
            "prefill_s": prefill,
            "sync_s": sync,
        }

    samples = [  # wall time, one engine's cumulative counters
        (100.5, [h(0, 0.0, 0.0, 0.0)]),
        (100.75, [h(50, 0.2, 0.05, 0.1)]),  # 100.5-100.75: not training
        (101.25, [h(60, 0.3, 0.05, 0.15)]),  # 100.75-101.25: half inside, so neither
        (101.5, [h(70, 0.5, 0.1, 0.25)]),  # inside
        (101.75, [h(80, 0.7, 0.1, 0.35)]),  # inside
    ]
    by = decode_by_phase(samples, events, trace_t0=100.0)
    assert by["other"]["windows"] == 1 and by["other"]["decode_steps"] == 50
    assert by["other"]["decode_step_ms"] == pytest.approx(1e3 * 0.15 / 50)
    assert by["other"]["prefill_ms_per_step"] == pytest.approx(1e3 * 0.05 / 50)
    assert by["train"]["windows"] == 2 and by["train"]["decode_steps"] == 20
    assert by["train"]["decode_step_ms"] == pytest.approx(1e3 * 0.35 / 20)
    assert by["train"]["sync_wait_ms"] == pytest.approx(1e3 * 0.2 / 20)
    assert by["train"]["mean_batch"] == pytest.approx(10)
