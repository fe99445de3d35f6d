"""The FSDP2 engine on one CUDA device: one bf16 update over NCCL, and training tokens/s.

The model has SmolLM2-135M's architecture (30 layers, hidden 576, vocab 49152) with random
weights, which trains at the same speed as the real weights and needs no download. Run with
``pytest -s -m gpu tests/gpu/test_fsdp_gpu.py`` to see the throughput line.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.bench.gpu import SMOLLM2_135M, synthetic_train_batch
from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_bf16_update_on_one_gpu(tmp_path: Path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    cfg = ActorConfig(path=str(tmp_path / "model"), lr=1e-5, max_tokens_per_mb=8192)
    eng = FSDPEngine(
        cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
    )
    try:
        assert eng.compute_dtype == torch.bfloat16
        batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 16, 4, 128, 384)
        before = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}

        def step() -> tuple[dict[str, float], float, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            b = dict(batch, prox_logp=eng.compute_logp(batch))
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            stats = eng.ppo_update(eng.compute_advantages(b))
            torch.cuda.synchronize()
            return stats, t1 - t0, time.perf_counter() - t1

        stats, _, _ = step()  # the first step includes CUDA/NCCL warm-up
        assert torch.isfinite(torch.tensor(stats["loss"])) and stats["skipped"] == 0.0
        assert 0 < stats["grad_norm"] < float("inf")
        after = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}
        moved = max((after[k] - before[k]).abs().max().item() for k in before)
        assert moved > 0, "the update did not change the weights"

        stats, t_logp, t_update = step()
        tokens = int(batch["attention_mask"].sum())
        print(
            f"\nFSDP2 bf16, SmolLM2-135M architecture, {tokens} tokens in "
            f"{stats['n_micro_batches']:.0f} micro-batches of <= {cfg.max_tokens_per_mb}, "
            f"{torch.cuda.get_device_name()}: compute_logp {t_logp:.3f} s "
            f"({tokens / t_logp:,.0f} tokens/s); advantages + ppo_update {t_update:.3f} s "
            f"({tokens / t_update:,.0f} tokens/s); whole step {tokens / (t_logp + t_update):,.0f}"
            " tokens/s"
        )
    finally:
        eng.destroy()


def test_packed_varlen_rows_give_the_padded_log_probs(tmp_path: Path):
    """Packed rows (varlen flash attention, no mask) against padded rows (sdpa with a mask):
    the same log-probs up to bf16 rounding, and one micro-batch sized from free memory."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 8, 4, 64, 128)
    logps = {}
    for layout in ("packed", "padded"):
        cfg = ActorConfig(path=str(tmp_path / "model"), layout=layout)
        eng = FSDPEngine(
            cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
        )
        try:
            assert eng.layout == layout
            assert len(eng._micro_batches(batch, eng._token_budget(batch))) == 1
            logps[layout] = eng.compute_logp(batch)
        finally:
            eng.destroy()
    mask = batch["attention_mask"].bool()
    diff = (logps["packed"] - logps["padded"]).abs()[mask]
    assert torch.isfinite(logps["packed"][mask]).all()
    assert float(diff.max()) < 0.1 and float(diff.mean()) < 0.01, (diff.max(), diff.mean())
