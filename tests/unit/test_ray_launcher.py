"""The Ray launch mode without a Ray cluster: ray stays optional, bad setups fail before anything
starts, and each node's bundle holds its role's resources (a TP replica's GPUs in one bundle)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import plan_placement
from arl.control.ray_launcher import RayNodes
from arl.wire.sockets import Security, new_secret

REPO = Path(__file__).resolve().parents[2]


def test_core_never_imports_ray():
    code = (
        "import sys, arl, arl.config, arl.control.cluster, arl.control.launcher, "
        "arl.control.ray_launcher, arl.trainer, arl.run, arl.supervisor, arl.launch, "
        "arl.node.daemon\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def _nodes(plan, **kw) -> RayNodes:
    return RayNodes(
        Security(new_secret()), plan, node_ids=[f"{n.role}{n.rank}" for n in plan], **kw
    )


def _plan(rollout: str, train: str, n_gpus: int, *more: str):
    cfg = apply_overrides(Config(), [f"rollout.backend={rollout}", f"actor.backend={train}", *more])
    return plan_placement(cfg, n_gpus).nodes


def test_without_ray_installed_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError

    async def main():
        async with _nodes(_plan("hf:d1", "fsdp:d1", 0)):
            pass

    with pytest.raises(ConfigError, match=r"pip install 'arl\[ray\]'"):
        asyncio.run(main())


def test_bundles_hold_each_nodes_gpus_and_role_cpus():
    plan = _plan("sglang:d2t2", "fsdp:d2", 6, "weight_sync.mode=disk")
    nodes = _nodes(plan, cpus={"rollout": 4, "train": 2})
    # One bundle per node, and a bundle never spans hosts: each TP=2 replica keeps its 2 GPUs
    # together.
    assert nodes.bundles() == [
        {"CPU": 4.0, "GPU": 2.0},
        {"CPU": 4.0, "GPU": 2.0},
        {"CPU": 2.0, "GPU": 1.0},
        {"CPU": 2.0, "GPU": 1.0},
    ]
    assert _nodes(_plan("hf:d1", "fsdp:d1", 0)).bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_colocated_gpu_plan_is_refused_before_anything_starts():
    plan = _plan("hf:d1", "fsdp:d1", 1, "weight_sync.mode=ipc")  # both on GPU 0
    assert all(n.colocated for n in plan)
    with pytest.raises(ConfigError, match="shares GPUs between rollout and training"):
        _nodes(plan)


def test_ray_launcher_needs_n_gpus():
    cfg = apply_overrides(Config(), ["cluster.launcher=ray"])
    with pytest.raises(ConfigError, match="cluster.n_gpus=none: must be set with cluster.launcher"):
        cfg.validate()
    apply_overrides(cfg, ["cluster.n_gpus=0"]).validate()


@pytest.mark.parametrize("address", ["nohost", "host:port", "127.0.0.1:"])
def test_malformed_ray_address_is_a_clear_error(address):
    async def main():
        async with _nodes(_plan("hf:d1", "fsdp:d1", 0), address=address):
            pass

    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    with pytest.raises(ConfigError, match="is not HOST:PORT, ray://HOST:PORT, auto or local"):
        asyncio.run(main())
