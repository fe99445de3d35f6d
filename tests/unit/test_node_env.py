"""`node_env`: a local node's CUDA_VISIBLE_DEVICES names the GPUs the plan gave it, as the
launcher sees them (its own CUDA_VISIBLE_DEVICES renumbers them)."""

from __future__ import annotations

from arl.config import Config
from arl.control.cluster import node_env
from arl.control.placement import NodeSpec


def _spec(*gpus: int) -> NodeSpec:
    device = f"cuda:{gpus[0]}" if gpus else "cpu"
    return NodeSpec(
        node_id=0,
        role="rollout",
        rank=0,
        device=device,
        engine="hf",
        dp_rank=0,
        tp_size=len(gpus) or 1,
        gpu_ids=gpus,
    )


def test_plan_gpus_are_mapped_through_the_launchers_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert node_env(_spec(0), Config())["CUDA_VISIBLE_DEVICES"] == "3"
    assert node_env(_spec(0, 1), Config())["CUDA_VISIBLE_DEVICES"] == "3,5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert node_env(_spec(1), Config())["CUDA_VISIBLE_DEVICES"] == "1"
    assert node_env(_spec(), Config())["CUDA_VISIBLE_DEVICES"] == ""  # a CPU node sees none
