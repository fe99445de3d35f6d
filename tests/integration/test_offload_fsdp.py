"""Optimizer offload under FSDP2 (``actor.offload=optimizer`` on fsdp:d2, gloo on CPU): the
shards, their gradients and AdamW's state live on the host (FSDP's CPUOffloadPolicy) and the
update equals the one without offload."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.integration.test_fsdp_equivalence import DP2_SHARDS, run_ranks, save_tiny_llama


@pytest.mark.slow
def test_fsdp_offload_gives_the_update_of_fsdp_without_it(tmp_path):
    model = save_tiny_llama(tmp_path / "model")
    weights = {}
    for offload in ("none", "optimizer"):
        base = {
            "actor": {"path": str(model), "lr": 1e-3, "offload": offload},
            "data_seed": 7,
            "shards_of_rank": DP2_SHARDS,
        }
        results = run_ranks(base, 2, tmp_path / offload)
        assert all(r["step"] == 1 for r in results)
        weights[offload] = load_file(str(tmp_path / offload / "weights.safetensors"))
    assert weights["none"].keys() == weights["optimizer"].keys()
    for name, w in weights["none"].items():
        assert (w - weights["optimizer"][name]).abs().max() < 1e-6, name
