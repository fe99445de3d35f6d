"""`python -m arl.bench scale`'s parts: the random model it builds and the figures it derives."""

from __future__ import annotations

import asyncio
import json

import pytest

from arl.bench.scale import SHAPES, build_random_model, scale_figures, text_hash_reward


def test_the_random_model_has_the_shape_the_tokenizer_and_no_eos(tmp_path):
    path = build_random_model("tiny", tmp_path, "cpu")
    config = json.loads((path / "config.json").read_text())
    for key, value in SHAPES["tiny"].items():
        assert config[key] == value, key
    assert config.get("eos_token_id") is None
    assert (path / "tokenizer.json").is_file() and (path / "done").is_file()
    # Built once: a second call reuses the folder.
    stamp = (path / "config.json").stat().st_mtime_ns
    assert build_random_model("tiny", tmp_path, "cpu") == path
    assert (path / "config.json").stat().st_mtime_ns == stamp


def _row(step: int, step_s: float, train_s: float, tokens: int, sync_bytes: float) -> dict:
    return {
        "step": step,
        "time/step_s": step_s,
        "time/logp_s": 0.0,
        "time/update_s": train_s,
        "time/sync_s": 0.01,
        "time/wait_rollout_s": step_s - train_s - 0.01,
        "batch/n_tokens": tokens,
        "rollout/gen_tokens": 1000,
        "sync/bytes": sync_bytes,
    }


def test_figures_are_means_over_steps_three_on_and_mfu_is_six_n_tokens_over_peak(tmp_path):
    path = build_random_model("tiny", tmp_path, "cpu")
    rows = [_row(1, 30.0, 9.0, 100, 8.0), _row(2, 4.0, 1.0, 100, 8.0)]
    rows += [_row(3, 2.0, 1.0, 100, 8.0), _row(4, 4.0, 2.0, 200, 8.0)]
    loop = {"rollout": {"decoded_tokens_per_s": 500.0, "busy_share": 0.5, "mean_decode_batch": 4}}
    floors = {"matmul_flops": 1e6, "hbm_bytes_s": 1e9}
    f = scale_figures(rows, loop, floors, 10, path)
    assert f["mean_step_s"] == pytest.approx(3.0)  # steps 3 and 4 only
    assert f["train_mfu"] == pytest.approx(6 * 10 * 100 / 1.0 / 1e6)  # both steps: 6e-3
    assert f["decode_tokens_per_s_busy"] == pytest.approx(1000.0)
    assert f["decode_phase_alone_s"] == pytest.approx(1.0)
    assert f["sync_bytes"] == 8.0 and f["sync_share_of_full"] == pytest.approx(
        8.0 / f["full_weight_bytes"]
    )


def test_random_text_gets_mixed_rewards_so_the_update_has_gradients():
    texts = [f"completion {i}" for i in range(64)]
    rewards = [asyncio.run(text_hash_reward(t, {})) for t in texts]
    assert set(rewards) == {0.0, 1.0}
    assert asyncio.run(text_hash_reward(texts[0], {})) == rewards[0]  # deterministic
