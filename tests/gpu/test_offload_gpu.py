"""Optimizer offload on one CUDA device (``actor.offload=optimizer``): a step trains, the GPU
holds no fp32 master or AdamW bytes after it, and the synced weights are the forward copy.

Run with ``pytest -s -m gpu tests/gpu/test_offload_gpu.py`` to see the memory line.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.bench.gpu import SMOLLM2_135M, synthetic_train_batch
from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine
from arl.train.offload import HostMasterWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offloaded_step_leaves_only_the_bf16_copy_on_the_gpu(tmp_path: Path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    cfg = ActorConfig(
        path=str(tmp_path / "model"), lr=1e-5, max_tokens_per_mb=8192, offload="optimizer"
    )
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    eng = FSDPEngine(
        cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
    )
    try:
        assert isinstance(eng._master, HostMasterWeights) and eng.graphs is None
        n = sum(p.numel() for p in eng.model.parameters())
        assert all(p.device.type == "cpu" for p in eng.model.parameters())
        batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 16, 4, 128, 384)
        before = {k: v.float().cpu() for k, v in eng.state_dict_for_sync(torch.bfloat16)}
        stats = eng.ppo_update(eng.compute_advantages(batch))
        torch.cuda.synchronize()
        assert stats["skipped"] == 0.0 and 0 < stats["grad_norm"] < float("inf")
        state = [t for s in eng.optimizer.state.values() for t in s.values() if t.dim()]
        assert state and all(t.device.type == "cpu" for t in state)

        # After the step: the bf16 copy (2 bytes a parameter) and cuBLAS's workspaces (~64 MiB
        # on an H200: 321 MiB held for SmolLM2's 135 M parameters); fp32 masters (4 bytes a
        # parameter), their gradients (4) or AdamW's moments (8) would each exceed this.
        held = torch.cuda.memory_allocated() - base
        print(
            f"\noffload: {n / 1e6:.0f} M parameters, {held / 2**20:.0f} MiB on the GPU after a step"
        )
        assert held < 3 * n, held

        synced = list(eng.state_dict_for_sync(torch.bfloat16))
        fwd = eng.forward_model.state_dict()  # tied aliases (lm_head) included, as synced
        masters = eng.model.state_dict()
        moved = 0.0
        for name, t in synced:
            assert t.is_cuda and t.dtype == torch.bfloat16
            assert t.data_ptr() == fwd[name].data_ptr()  # the forward copy itself, no cast
            assert torch.equal(t.cpu(), masters[name].detach().to(torch.bfloat16))
            moved = max(moved, (t.float().cpu() - before[name]).abs().max().item())
        assert moved > 0, "the update did not reach the forward copy"
    finally:
        eng.destroy()
