"""`node_env`: a local node's CUDA_VISIBLE_DEVICES names the GPUs the plan gave it, as the
launcher sees them (its own CUDA_VISIBLE_DEVICES renumbers them)."""

from __future__ import annotations

from arl.config import Config
from arl.control.cluster import node_env
from arl.protocol.plan import NodeSpec


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


def _mps_config() -> Config:
    cfg = Config()
    cfg.rollout.gpu_sharing = "mps"
    return cfg


def _colocated_plan() -> list[NodeSpec]:
    common = dict(rank=0, device="cuda:0", dp_rank=0, tp_size=1, gpu_ids=(0,), colocated=True)
    return [
        NodeSpec(node_id=0, role="rollout", engine="hf", **common),
        NodeSpec(node_id=1, role="train", engine="fsdp", **common),
    ]


def test_mps_nodes_are_clients_and_the_engine_sharing_a_train_gpu_is_held_to_its_share():
    from arl.control.mps import PIPE_ENV, SHARE_ENV, mps_node_env

    client = {PIPE_ENV: "/tmp/arl-mps-x", "CUDA_MPS_LOG_DIRECTORY": "/runs/r/mps"}
    rollout = mps_node_env("rollout", (0,), True, client, 40)
    assert rollout == client | {SHARE_ENV: "40"}
    assert mps_node_env("train", (0,), False, client, 40) == client  # ranks may use every SM
    assert mps_node_env("rollout", (1,), False, client, 40) == client  # a GPU of its own
    assert mps_node_env("rollout", (), False, client, 40) == {}  # a CPU node is no client


def test_mps_without_its_daemon_on_path_is_refused_before_any_process_starts(monkeypatch):
    import pytest

    from arl.config import ConfigError
    from arl.control.cluster import LaunchRequest, _LocalLauncher
    from arl.wire.sockets import Security

    monkeypatch.setenv("PATH", "/nonexistent")
    req = LaunchRequest(_mps_config(), _colocated_plan(), Security("s" * 32), ["r0", "t0"])
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control.*PATH"):
        _LocalLauncher(req)
    cpu = [
        NodeSpec(node_id=i, role=r, rank=0, device="cpu", engine=e, dp_rank=0, tp_size=1)
        for i, (r, e) in enumerate((("rollout", "hf"), ("train", "fsdp")))
    ]
    _LocalLauncher(LaunchRequest(_mps_config(), cpu, Security("s" * 32), ["r0", "t0"]))


def test_auto_sharing_uses_mps_only_where_its_daemon_is_found_and_starts(
    tmp_path, monkeypatch, caplog
):
    """``rollout.gpu_sharing=auto`` (the gsm8k recipe's): without the daemon on PATH the run
    time-slices and nothing is refused; with one that cannot start (another MPS daemon, an
    exclusive-process GPU: here a program that says so and exits) it warns and time-slices,
    where ``mps`` stops the run with the daemon's log."""
    import asyncio
    import logging
    import os
    import tempfile
    from pathlib import Path

    import pytest

    from arl.control.cluster import LaunchRequest, _LocalLauncher
    from arl.control.mps import CONTROL, start_daemon, wanted
    from arl.wire.sockets import Security

    auto = Config()
    auto.rollout.gpu_sharing = "auto"
    monkeypatch.setenv("PATH", "/nonexistent")
    req = LaunchRequest(auto, _colocated_plan(), Security("s" * 32), ["r0", "t0"])
    assert _LocalLauncher(req).use_mps is False
    assert not wanted("auto", True) and not wanted("concurrent", True) and not wanted("mps", False)

    refusing = tmp_path / "bin" / CONTROL
    refusing.parent.mkdir()
    says = "echo 'MPS is not supported in exclusive-process mode'"
    refusing.write_text(f"#!/bin/sh\n{says}\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setenv("PATH", f"{refusing.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert _LocalLauncher(req).use_mps is True
    pipes_before = set(Path(tempfile.gettempdir()).glob("arl-mps-*"))
    caplog.set_level(logging.WARNING, logger="arl.control.mps")
    assert asyncio.run(start_daemon(tmp_path / "auto", "auto")) is None
    (warning,) = [r.getMessage() for r in caplog.records if "gpu_sharing=auto" in r.getMessage()]
    assert "MPS did not start" in warning and "exclusive-process mode" in warning
    with pytest.raises(RuntimeError, match="exclusive-process mode"):
        asyncio.run(start_daemon(tmp_path / "mps", "mps"))
    assert set(Path(tempfile.gettempdir()).glob("arl-mps-*")) == pipes_before  # none left


def _cpu_node(node_id: int, role: str) -> NodeSpec:
    engine = "fsdp" if role == "train" else "hf"
    return NodeSpec(
        node_id=node_id, role=role, rank=0, device="cpu", engine=engine, dp_rank=0, tp_size=1
    )


def test_cpu_nodes_share_the_host_train_taking_its_cores(monkeypatch) -> None:
    from arl.control.cluster import cpu_threads

    rollout, train = _cpu_node(0, "rollout"), _cpu_node(1, "train")
    plan = [rollout, train]
    assert cpu_threads(train, plan, cores=16) == 16
    assert cpu_threads(rollout, plan, cores=16) == 8
    two_ranks = [rollout, train, _cpu_node(2, "train")]
    assert cpu_threads(train, two_ranks, cores=16) == 8
    assert cpu_threads(rollout, two_ranks, cores=16) == 5
    assert cpu_threads(rollout, [*two_ranks, _cpu_node(3, "rollout")], cores=2) == 1
    gpu_train = NodeSpec(
        node_id=2,
        role="train",
        rank=0,
        device="cuda:0",
        engine="fsdp",
        dp_rank=0,
        tp_size=1,
        gpu_ids=(0,),
    )
    assert cpu_threads(train, [rollout, train, gpu_train], cores=16) == 16  # GPU ranks aside

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = node_env(train, Config(), plan)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"  # idle OpenMP threads sleep: the cores overlap
    assert env["OMP_NUM_THREADS"] == str(cpu_threads(train, plan))
    assert "OMP_WAIT_POLICY" not in node_env(gpu_train, Config(), plan)
    assert "OMP_NUM_THREADS" not in node_env(gpu_train, Config(), plan)
    cfg = Config()
    cfg.cluster.cpu_threads_per_node = 3
    assert node_env(rollout, cfg, plan)["OMP_NUM_THREADS"] == "3"  # the user's count wins
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in node_env(train, Config(), plan)  # theirs is inherited
