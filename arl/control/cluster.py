"""Bring up a run's processes from its config: controller, nodes, roles (DESIGN §1, §8).

``async with start_cluster(cfg, plan) as cluster`` binds the controller, starts the nodes the
way ``cluster.launcher`` says (local subprocesses, one ``srun`` step, Ray actors, or none for
attach), waits for them to say hello, and pairs each with its place in the plan. Leaving the
block ends every process it started, whatever the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs

from arl.config import Config
from arl.control.controller import Controller, NodeHandle
from arl.control.launcher import LocalNodes, SlurmNodes
from arl.control.placement import NodeSpec
from arl.control.ray_launcher import RayNodes
from arl.wire.sockets import SECRET_ENV, Security, new_secret, read_secret_file, routable_host

log = logging.getLogger("arl.cluster")


@attrs.define
class PlacedNode:
    """A live node and the plan entry it fills; ``device`` is as the node itself sees it."""

    handle: NodeHandle
    spec: NodeSpec

    @property
    def device(self) -> str:
        """The torch device for engines on this node (GPUs are renumbered from 0 per node)."""
        return "cuda:0" if self.spec.gpu_ids else "cpu"


@attrs.define
class Cluster:
    """The controller plus the run's nodes by role."""

    controller: Controller
    rollout: list[PlacedNode]
    train: list[PlacedNode]

    @property
    def nodes(self) -> list[PlacedNode]:
        """Every node, rollout first."""
        return [*self.rollout, *self.train]


def run_security(cfg: Config) -> Security:
    """The run secret: transport.secret_file, else $ARL_SECRET, else a fresh one."""
    if cfg.transport.secret_file:
        secret = read_secret_file(cfg.transport.secret_file)
    else:
        secret = os.environ.get(SECRET_ENV) or new_secret()
    return Security(secret, curve=cfg.transport.curve)


def node_env(spec: NodeSpec, cfg: Config, n_nodes: int = 1) -> dict[str, str]:
    """Environment of a locally spawned node: its GPUs and CPU threads."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpu_ids))}
    threads = cfg.cluster.cpu_threads_per_node
    if threads is None and not spec.gpu_ids:
        # Cores are split between the nodes: rollout and training run at the same time
        # (asynchronous RL), and oversubscribed OpenMP threads spin against each other
        # (measured 20x slower training steps with 2 threads per node on 2 cores).
        threads = max(1, (os.cpu_count() or 1) // n_nodes)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@asynccontextmanager
async def start_cluster(
    cfg: Config, plan: list[NodeSpec], security: Security | None = None
) -> AsyncIterator[Cluster]:
    """Start (or attach to) the nodes of ``plan`` and yield them by role."""
    security = security or run_security(cfg)
    c = cfg.cluster
    host = c.controller_host
    if (
        c.launcher == "slurm"
        and host == "127.0.0.1"
        and os.environ.get("SLURM_JOB_NUM_NODES", "1") != "1"
    ):
        host = routable_host()  # nodes on other hosts must reach the controller
    names = [f"{s.role}{s.rank}" for s in plan]
    command_kw = dict(
        allowed_prefixes=c.allowed_import_prefixes,
        heartbeat_interval=c.heartbeat_interval,
        heartbeat_timeout=c.heartbeat_timeout,
    )
    async with AsyncExitStack() as stack:
        ray_nodes = None
        if c.launcher == "ray":  # connect and reserve first: Ray says where the nodes will be
            ray_nodes = await stack.enter_async_context(
                RayNodes(
                    security,
                    plan,
                    node_ids=names,
                    address=c.ray_address,
                    namespace=c.ray_namespace,
                    cpus={"rollout": c.ray_rollout_cpus, "train": c.ray_train_cpus},
                    strategy=c.ray_placement_strategy,
                    placement_timeout=c.ray_placement_timeout,
                    cpu_threads=c.cpu_threads_per_node,
                    **command_kw,
                )
            )
            host = ray_nodes.controller_host(host)
        ctl = await stack.enter_async_context(
            Controller(
                security,
                host=host,
                port=c.controller_port,
                heartbeat_interval=c.heartbeat_interval,
                heartbeat_timeout=c.heartbeat_timeout,
                max_message_bytes=cfg.transport.max_message_bytes,
                inline_threshold=cfg.transport.inline_threshold_bytes,
            )
        )
        if c.launcher in ("local", "embedded"):
            await stack.enter_async_context(
                LocalNodes(
                    ctl.address,
                    security,
                    [node_env(s, cfg, len(plan)) for s in plan],
                    node_ids=names,
                    **command_kw,
                )
            )
        elif c.launcher == "slurm":
            await stack.enter_async_context(
                SlurmNodes(ctl.address, security, len(plan), srun_args=c.srun_args, **command_kw)
            )
        elif ray_nodes is not None:
            await ray_nodes.start(ctl.address)
        else:  # attach: a job script starts `arl-node --controller ...` itself
            log.warning("waiting for %d nodes to attach to %s", len(plan), ctl.address)
        # Unwound before the launchers end the nodes: their exits then are expected, not losses.
        stack.callback(ctl.expect_exits)
        n = c.n_nodes or len(plan)
        if n < len(plan):
            raise ValueError(f"cluster.n_nodes={n} but the placement plan needs {len(plan)} nodes")
        handles = await ctl.wait_for_nodes(len(plan), timeout=c.node_start_timeout)
        by_name = {h.node_id: h for h in handles}
        if set(names) <= set(by_name):
            placed = [PlacedNode(by_name[name], s) for name, s in zip(names, plan, strict=True)]
        else:  # nodes named themselves (srun, attach): fill the plan in a stable order
            ordered = sorted(handles, key=lambda h: (h.info.get("host", ""), h.node_id))
            placed = [PlacedNode(h, s) for h, s in zip(ordered, plan, strict=True)]
        yield Cluster(
            ctl,
            [p for p in placed if p.spec.role == "rollout"],
            [p for p in placed if p.spec.role == "train"],
        )
