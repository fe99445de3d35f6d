"""The opt-in length-aware decode attention (``rollout.hf_decode_attention=flex``) through a
whole run on CPU: real nodes, three GRPO steps, in-place weight syncs. The engines must decode
with flex (no silent SDPA fallback) and hold exactly the trainer's weights after every sync."""

from __future__ import annotations

import asyncio

import pytest

from arl.config import Config
from arl.control.cluster import start_cluster
from arl.control.placement import place
from arl.stats.logger import read_jsonl
from arl.trainer import PPOTrainer
from tests.support.tiny_model import make_tiny_model, tiny_run_config


async def _train_then_ask_engines(cfg: Config) -> list[dict]:
    async with start_cluster(cfg, place(cfg)) as cluster:
        trainer = PPOTrainer(cfg, cluster)
        try:
            await trainer.setup()
            await trainer.train()
            return list(await asyncio.gather(*(w.health() for w in trainer.rollout.workers)))
        finally:
            await trainer.close()


@pytest.mark.parametrize("in_place", ["true", "false"])
def test_a_run_decodes_with_flex_and_every_sync_reaches_the_engines(tmp_path, in_place) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    cfg = tiny_run_config(
        tmp_path,
        model,
        "rollout.hf_decode_attention=flex",
        f"weight_sync.in_place={in_place}",
        "rollout.backend=hf:d2",
    )
    healths = asyncio.run(_train_then_ask_engines(cfg))
    assert [h["decode_attention"] for h in healths] == ["flex", "flex"]
    assert all(h["last_error"] is None and h["generated_tokens"] > 0 for h in healths), healths
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/checksum_match"] is True and r["version"] == r["step"] for r in rows)
    assert len({r["sync/checksum"] for r in rows}) == 3  # the weights moved, the engines followed
