"""LoRA under FSDP2 on two CUDA devices (NCCL, bf16 frozen base, fp32 adapters gathered in bf16
and reduced in fp32): the ranks of `tests/integration/test_lora_train.py` run on GPUs 0 and 1;
only the adapters train, the base stays, sync moves the adapter, the export loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_fsdp_equivalence import DP2_SHARDS, run_ranks, save_tiny_llama
from tests.integration.test_lora_train import ACTOR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_lora_fsdp_on_two_gpus(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from arl.engines.lora import is_lora_name
    from tests.integration import test_lora_train

    model = save_tiny_llama(tmp_path / "model", seed=2)
    spec = {
        "actor": {**ACTOR, "path": str(model)},
        "data_seed": 7,
        "seed": 3,
        "shards_of_rank": DP2_SHARDS,
        "cuda": True,
    }
    out = tmp_path / "run"
    results = run_ranks(spec, 2, out, script=test_lora_train.__file__)
    for r in results:
        assert r["optimizer_state"] == r["trainable"] and len(r["trainable"]) == 28
        assert r["ref_equals_policy_at_start"] and not r["ref_is_copy"]
        assert [n for n, _, _ in r["specs"]] and all(is_lora_name(n) for n, _, _ in r["specs"])
        assert r["tied"] == {} and r["checksum_matches"]
        for s in r["stats"]:
            assert s["skipped"] == 0.0 and 0 < s["grad_norm"] < float("inf")
    assert results[0]["stats"] == results[1]["stats"]
    init, after = (
        load_file(str(out / "init.safetensors")),
        load_file(str(out / "after.safetensors")),
    )
    assert max((after[n] - init[n]).abs().max().item() for n in init) > 1e-3
    original = load_file(str(model / "model.safetensors"))
    for n, t in load_file(str(out / "base.safetensors")).items():
        assert t.dtype == torch.bfloat16  # the frozen base in the compute dtype, unchanged
        assert torch.equal(t, original[n.replace(".base_layer.", ".")].bfloat16()), n
    config = json.loads((out / "hf" / "adapter_config.json").read_text())
    assert config["r"] == ACTOR["lora"]["rank"]
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    PeftModel.from_pretrained(base, out / "hf")
    AutoModelForCausalLM.from_pretrained(out / "hf" / "merged")
