"""`python -m arl.bench startup`'s reading of a run: the start-up phases from the lines the
engine and the train ranks log, and the figures issue 32 tracks from ``metrics.jsonl``."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from arl.bench.startup import read_phases, report, results_json, summarize_run
from arl.engines.hf import HFEngine
from tests.support.tiny_model import make_tiny_model

T0 = 1_800_000_000.0  # a launch time (epoch seconds)


def _line(t: float, text: str) -> str:
    """A log line as the nodes write it (``%(asctime)s %(name)s %(message)s``)."""
    ms = int(round((t % 1) * 1000))
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(int(t)))},{ms:03d} {text}"


def test_the_engines_own_ready_line_is_read_back(tmp_path, caplog: pytest.LogCaptureFixture):
    tiny = make_tiny_model(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="arl.engines.hf.engine"):
        with HFEngine(tiny, max_batch_size=2, max_seq_len=64) as engine:
            load_s = engine.load_s
    (record,) = [r for r in caplog.records if "ready in" in r.getMessage()]
    phases = read_phases(_line(record.created, record.getMessage()), record.created - 2.0)
    got = phases["engine_ready"]
    assert got["at_s"] == pytest.approx(2.0, abs=0.002)
    assert got["load_s"] == pytest.approx(load_s, abs=0.051)
    assert got["took_s"] >= got["load_s"] and got["graphs_s"] == 0.0  # no graphs on CPU


def test_the_engines_kept_functions_are_counted_and_read_back(
    tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """A flex engine compiled on CPU: the first build compiles its kernel into ``ARL_CACHE``,
    a later one (a fresh process's view: nothing in memory) loads it; the ready line says so."""
    from arl.engines.hf import flex

    tiny = make_tiny_model(tmp_path / "tiny")
    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ARL_PRECOMPILE", raising=False)
    # The engine points inductor at ARL_CACHE unless already set: keep that to this test.
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor)
    got = []
    for _ in range(2):
        monkeypatch.setattr(flex, "_COMPILED", None)
        caplog.clear()
        options = {"decode_attention": "flex", "compile_blocks": True}
        with caplog.at_level(logging.INFO, logger="arl.engines.hf.engine"):
            with HFEngine(tiny, max_batch_size=2, max_seq_len=64, **options) as engine:
                kept = engine.kept_functions()
        (record,) = [r for r in caplog.records if "ready in" in r.getMessage()]
        phases = read_phases(_line(record.created, record.getMessage()), record.created)
        ready = phases["engine_ready"]
        assert (ready["kept_loaded_n"], ready["kept_compiled_n"]) == kept
        got.append(kept)
    assert got == [(0, 1), (1, 0)]


def test_the_rollout_workers_setup_line_is_read_back(tmp_path, caplog: pytest.LogCaptureFixture):
    from arl.node.rollout import RolloutWorker

    worker = RolloutWorker(
        model_path=make_tiny_model(tmp_path / "tiny"), reward="arl.rewards.arith:arith_reward"
    )

    async def setup() -> None:
        await worker.setup()
        await worker.engine.aclose()

    with caplog.at_level(logging.INFO, logger="arl.rollout"):
        asyncio.run(setup())
    (record,) = [r for r in caplog.records if "rollout setup in" in r.getMessage()]
    got = read_phases(_line(record.created, record.getMessage()), record.created - 3.0)
    setup = got["rollout_setup"]
    assert setup["at_s"] == pytest.approx(3.0, abs=0.002)
    parts = ("imports_s", "reward_s", "tokenizer_s", "engine_s")
    assert setup["took_s"] == pytest.approx(sum(setup[k] for k in parts), abs=0.21)  # rounding
    assert setup["took_s"] > 0


def _run(first_end: float, exit_at: float) -> dict:
    rows = [
        {"time": T0 + first_end, "time/step_s": 4.0, "time/wait_rollout_s": 3.0, "time/train_s": 1},
        {"time": T0 + first_end + 1.0, "time/step_s": 1.0},
    ]
    log = "\n".join(
        [
            _line(T0 + 1.25, "INFO arl.launch: resolved config saved to runs/x/config.yaml"),
            _line(T0 + 2.5, "INFO arl.controller: node rollout0 joined from vm pid 1"),
            _line(T0 + 2.75, "INFO arl.controller: node train0 joined from vm pid 2"),
            "Loading weights: 100%|##########| 272/272",  # no time stamp: skipped
            _line(T0 + 9.0, "arl.engines.hf.engine hf engine ready in 6.0 s "
                  "(load 1.5 s, compile 2.5 s, graphs 2.0 s); compiled functions kept: 14 "
                  "loaded, 0 compiled"),
            _line(T0 + 9.0, "arl.rollout rollout setup in 6.2 s (imports 1.0 s, reward and "
                  "workflow 0.1 s, tokenizer 0.5 s, engine 4.6 s)"),
            _line(T0 + 8.0, "arl.train.fsdp rank 0: ready in 5.0 s (load 2.0 s, prime 3.0 s; "
                  "process group 0.5 s); compiled functions kept: 3 loaded, 1 compiled"),
            _line(T0 + 8.0, "arl.node node train0: created train (arl.node.train:TrainWorker) "
                  "in 5.2 s (import 0.2 s)"),
            _line(T0 + 8.1, "arl.node node train0: created weights (arl.weights.zmq:ZmqSender) "
                  "in 0.0 s (import 0.0 s)"),  # a later object: not the train worker's line
            _line(T0 + 11.0, "arl.train.fsdp rank 0: warmed up (compile=True) in 1.5 s"),
        ]
    )  # fmt: skip
    return summarize_run(rows, log, T0, T0 + exit_at, 0)


def test_the_tracked_figures_and_phases_come_from_the_metrics_and_the_log():
    cold, warm = _run(first_end=20.0, exit_at=70.0), _run(first_end=12.5, exit_at=28.0)
    assert warm["first_step_s"] == pytest.approx(12.5)
    assert warm["setup_done_s"] == pytest.approx(8.5)  # step 1 started 4 s before it ended
    assert warm["steps"] == 2 and warm["step1"]["time/wait_rollout_s"] == 3.0
    p = warm["phases"]
    assert p["nodes_joined"]["at_s"] == pytest.approx(2.75, abs=0.002)  # the last to join
    assert p["engine_ready"] == pytest.approx(
        {"at_s": 9.0, "took_s": 6.0, "load_s": 1.5, "compile_s": 2.5, "graphs_s": 2.0,
         "kept_loaded_n": 14, "kept_compiled_n": 0}, abs=0.002
    )  # fmt: skip
    assert p["train_ready"]["prime_s"] == 3.0 and p["train_warm_up"]["took_s"] == 1.5
    assert p["train_ready"]["group_s"] == 0.5 and p["train_created"]["import_s"] == 0.2
    assert (p["train_ready"]["kept_loaded_n"], p["train_ready"]["kept_compiled_n"]) == (3, 1)
    assert p["config_saved"]["at_s"] == pytest.approx(1.25, abs=0.002)
    assert p["rollout_setup"] == pytest.approx(
        {"at_s": 9.0, "took_s": 6.2, "imports_s": 1.0, "reward_s": 0.1, "tokenizer_s": 0.5,
         "engine_s": 4.6}, abs=0.002
    )  # fmt: skip
    floors = {"import_s": 2.0, "model_load_s": 1.0}
    out = results_json("arith", cold, warm, floors, steps=2)
    assert out["arith.first_step_s_cold"] == 20.0
    assert out["arith.first_step_s_warm"] == 12.5
    assert out["arith.launch_to_exit_s_warm"] == 28.0
    table = report(cold, warm, floors)
    assert "| engine: compile (norm/MLP blocks, decode attention) | 2.5 | 2.5 | - |" in table
    assert "| engine: compiled functions loaded from ARL_CACHE (count) | 14 | 14 | - |" in table
    assert "| first_step_s: launch to the end of step 1 | 20.0 | 12.5 | - |" in table
    assert "| train rank 0: load | 2.0 | 2.0 | 1.0 |" in table
    assert "| rollout setup: tokenizer | 0.5 | 0.5 | - |" in table


def test_a_ready_line_without_the_process_group_still_reads():
    line = _line(T0 + 8.0, "arl.train.fsdp rank 0: ready in 5.0 s (load 2.0 s, prime 3.0 s)")
    got = read_phases(line, T0)["train_ready"]
    assert got == pytest.approx({"at_s": 8.0, "took_s": 5.0, "load_s": 2.0, "prime_s": 3.0})


def test_a_run_that_ended_before_step_1_is_refused():
    with pytest.raises(ValueError, match="ended before step 1"):
        summarize_run([], "", T0, T0 + 5.0, 1)
