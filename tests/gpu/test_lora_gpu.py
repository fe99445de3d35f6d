"""LoRA on one CUDA device: a bf16 frozen base with fp32 adapters, compiled layers and CUDA
graphs on (the defaults), trains only the adapters and syncs only them.

The model has SmolLM2-135M's architecture with random weights (no download). Run with
``pytest -s -m gpu tests/gpu/test_lora_gpu.py`` to see the memory and sync figures.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from arl.bench.gpu import SMOLLM2_135M, synthetic_train_batch
from arl.engines.lora import is_lora_name
from arl.node.train import TrainWorker
from arl.train.sharding import compiled_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LORA = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["all-linear"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lora_update_and_sync_on_one_gpu(tmp_path: Path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16).save_pretrained(
        tmp_path / "model"
    )
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    actor = {
        "path": str(tmp_path / "model"),
        "lr": 1e-3,
        "kl_ctl": 0.05,
        "max_tokens_per_mb": 8192,
        "lora": LORA,
    }
    w = TrainWorker(
        actor, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
    )
    eng = w.engine
    try:
        # no fp32 master copy, no second model for the reference
        assert eng.forward_model is eng.model and eng._master is None and eng.ref is None
        named = dict(eng.model.named_parameters())
        adapters = {n: p for n, p in named.items() if is_lora_name(n)}
        assert {n for n, p in named.items() if p.requires_grad} == set(adapters)
        assert {p.dtype for p in adapters.values()} == {torch.float32}
        assert {p.dtype for n, p in named.items() if n not in adapters} == {torch.bfloat16}
        compiled = compiled_layers(eng.model)
        base_before = {n: p.detach().clone() for n, p in named.items() if n not in adapters}
        a_before = {n: p.detach().clone() for n, p in adapters.items()}

        batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 8, 4, 64, 256)
        stats = []
        for _ in range(3):
            b = dict(batch, prox_logp=eng.compute_logp(batch))
            b["ref_logp"] = eng.compute_ref_logp(b)
            stats.append(eng.ppo_update(eng.compute_advantages(b)))
        for s in stats:
            assert torch.isfinite(torch.tensor(s["loss"])) and s["skipped"] == 0.0
            assert 0 < s["grad_norm"] < float("inf")
        # gradients exist (held, with graphs) on the adapters only
        assert all(p.grad is None for n, p in named.items() if n not in adapters)
        assert {id(p) for p in eng.optimizer.state} == {id(p) for p in adapters.values()}
        for n, p in named.items():
            if n not in adapters:
                assert torch.equal(p, base_before[n]), n
        moved = max((p - a_before[n]).abs().max().item() for n, p in adapters.items())
        assert moved > 1e-4

        # the reference is the base: after training it still gives the base's log-probs
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16)
        ids = batch["input_ids"][:2, :48].cuda()
        with torch.no_grad():
            want = torch.log_softmax(base.cuda()(input_ids=ids).logits.float(), -1)
            from arl.train.lora import adapters_disabled

            with adapters_disabled(eng.model):
                got = torch.log_softmax(eng.model(input_ids=ids).logits.float(), -1)
        assert (got - want).abs().max().item() < 0.05
        del base

        # sync: the adapter alone, in bf16
        w.set_sync_dtype("bfloat16")
        specs = w.weight_specs()
        assert [n for n, _, _ in specs] == list(adapters)
        sync_bytes = sum(t.numel() * t.element_size() for _, t in w.full_state())
        full_bytes = sum(p.numel() * 2 for p in base_before.values())
        assert sync_bytes < 0.1 * full_bytes
        assert w.tied_weights() == {}
        assert isinstance(w.weights_checksum(), str)
        scores = w.score(list(range(3, 40)), "bfloat16")
        assert all(s <= 0 for s in scores)

        # export: the adapter, and the merged model that loads as a plain HF folder
        w.save_hf(str(tmp_path / "export"), merged=True)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "merged").cuda()
        with torch.no_grad():
            m = torch.log_softmax(merged(input_ids=ids).logits.float(), -1)
            p = torch.log_softmax(eng.model(input_ids=ids).logits.float(), -1)
        assert (m - p).abs().max().item() < 0.1  # bf16 merged weights against W + BA live
        graphs = eng.graphs.summary() if eng.graphs is not None else None
        print(
            f"\nlora r16 on SmolLM2-135M shape: compiled modules {compiled}, graphs {graphs}, "
            f"sync {sync_bytes / 2**20:.1f} MiB of {full_bytes / 2**20:.1f} MiB full "
            f"({sync_bytes / full_bytes:.2%}), peak {torch.cuda.max_memory_allocated() / 2**30:.2f}"
            f" GiB, losses {[round(s['loss'], 5) for s in stats]}, merged max |dlogp| "
            f"{(m - p).abs().max().item():.4f}"
        )
    finally:
        w.close()
