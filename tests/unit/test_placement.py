"""The placement plan on CPU and on 1, 2 and 8 GPUs."""

import pytest

from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import format_plan, plan_placement
from arl.protocol.plan import Plan


def _cfg(rollout: str = "hf:d1", train: str = "fsdp:d1", *more: str) -> Config:
    return apply_overrides(
        Config(), [f"rollout.backend={rollout}", f"actor.backend={train}", *more]
    )


def _summary(plan):
    return [(n.node_id, n.role, n.rank, n.device, n.gpu_ids, n.colocated) for n in plan]


def test_cpu_one_node_per_replica_and_rank():
    plan = plan_placement(_cfg("hf:d2", "fsdp:d3"), n_gpus=0).nodes
    assert _summary(plan) == [
        (0, "rollout", 0, "cpu", (), False),
        (1, "rollout", 1, "cpu", (), False),
        (2, "train", 0, "cpu", (), False),
        (3, "train", 1, "cpu", (), False),
        (4, "train", 2, "cpu", (), False),
    ]
    assert [n.engine for n in plan] == ["hf", "hf", "fsdp", "fsdp", "fsdp"]
    assert [n.dp_rank for n in plan] == [0, 1, 0, 1, 2]


def test_cpu_refuses_gpu_only_weight_sync():
    with pytest.raises(ConfigError, match="weight_sync.mode=ipc needs GPUs"):
        plan_placement(_cfg("hf:d1", "fsdp:d1", "weight_sync.mode=ipc"), n_gpus=0)


def test_one_gpu_is_shared_by_rollout_and_training():
    plan = plan_placement(_cfg(), n_gpus=1).nodes
    assert _summary(plan) == [
        (0, "rollout", 0, "cuda:0", (0,), True),
        (1, "train", 0, "cuda:0", (0,), True),
    ]


def test_two_gpus_separate_rollout_and_training():
    plan = plan_placement(_cfg(), n_gpus=2).nodes
    assert _summary(plan) == [
        (0, "rollout", 0, "cuda:0", (0,), False),
        (1, "train", 0, "cuda:1", (1,), False),
    ]


def test_eight_gpus_tensor_parallel_replicas_then_train_ranks():
    plan = plan_placement(_cfg("sglang:d2t2", "fsdp:d4"), n_gpus=8).nodes
    assert _summary(plan) == [
        (0, "rollout", 0, "cuda:0", (0, 1), False),
        (1, "rollout", 1, "cuda:2", (2, 3), False),
        (2, "train", 0, "cuda:4", (4,), False),
        (3, "train", 1, "cuda:5", (5,), False),
        (4, "train", 2, "cuda:6", (6,), False),
        (5, "train", 3, "cuda:7", (7,), False),
    ]
    assert [n.tp_size for n in plan] == [2, 2, 1, 1, 1, 1]


def test_eight_gpus_colocate_when_groups_need_more_than_eight():
    plan = plan_placement(_cfg("sglang:d8", "fsdp:d8"), n_gpus=8).nodes
    assert all(n.colocated for n in plan)
    assert [n.device for n in plan if n.role == "rollout"] == [f"cuda:{i}" for i in range(8)]
    assert [n.device for n in plan if n.role == "train"] == [f"cuda:{i}" for i in range(8)]


def test_too_few_gpus_names_the_numbers():
    with pytest.raises(ConfigError) as e:
        plan_placement(_cfg("sglang:d2t2", "fsdp:d8"), n_gpus=2)
    msg = str(e.value)
    assert "needs 4" in msg and "needs 8" in msg and "12 separate, or 8 shared" in msg
    assert "2 are available" in msg


def test_format_plan_has_a_row_per_node():
    plan = plan_placement(_cfg("sglang:d2t2", "fsdp:d4"), n_gpus=8)
    lines = format_plan(plan).splitlines()
    assert lines[0].split() == [
        "node",
        "role",
        "rank",
        "engine",
        "dp_rank",
        "tp",
        "device",
        "gpus",
        "colocated",
    ]
    assert len(lines) == 2 + len(plan.nodes)
    assert lines[2].split() == ["0", "rollout", "0", "sglang", "0", "2", "cuda:0", "0,1", "no"]
    assert lines[-1].split() == ["5", "train", "3", "fsdp", "3", "1", "cuda:7", "7", "no"]


def test_a_plan_holds_a_resolved_mode_never_auto():
    with pytest.raises(ValueError, match="resolve 'auto'"):
        Plan(nodes=(), sync_mode="auto")
