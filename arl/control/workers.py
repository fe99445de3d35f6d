"""The run's workers on a started cluster: created on their nodes, called all at once.

`start_rollout_workers` builds one rollout worker per rollout node (its engine from the engine
spec, sized by `arl.engines.spec.engine_options`) and sets it up; `start_train_workers` builds
the train ranks, joined through a rendezvous on train rank 0's node. `call_all` calls one method
on every train rank together (they run collectives with each other), failing fast and within a
deadline (`CallTimeout`); `raise_node_loss` turns a rank's failed pull into the loss of the node
it pulled from. `sharing_gpu` says which rollout engines share a train rank's GPU; `evaluate`
splits held-out rows over the rollout workers; `free_shards` and `node_gauges` reach every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

from arl.config import ClusterConfig, Config, EvaluatorConfig
from arl.control.cluster import Cluster
from arl.control.controller import NodeLost, RemoteObject
from arl.control.placement import shares_gpu
from arl.control.rollout import RolloutController
from arl.control.staleness import StalenessSemaphore
from arl.data.loader import StatefulLoader
from arl.engines.spec import engine_options, engine_spec
from arl.protocol.errors import RemoteError
from arl.protocol.imports import resolve_import
from arl.protocol.proxy import MalformedReply
from arl.protocol.remote import RolloutWorkerAPI, rollout_worker
from arl.protocol.rtensor import ShardRef
from arl.weights import SyncContext, WeightSync, make_weight_sync
from arl.weights.base import rendezvous_host

log = logging.getLogger("arl.control.workers")


async def start_rollout_workers(cfg: Config, cluster: Cluster, model_path: str) -> list:
    """A rollout worker on every rollout node, its engine loaded (`setup`), in node order."""
    sampling = {k: v for k, v in attrs.asdict(cfg.gconfig).items() if k != "n_samples"}
    agent: dict[str, Any] = {"workflow_kwargs": dict(cfg.rollout.workflow_args)}
    if cfg.rollout.agent:  # the agent workflow (arl.workflows.agent)
        trajectory = {"trajectory": cfg.rollout.agent_trajectory}
        discount = {"turn_discount": cfg.rollout.turn_discount}
        agent = {"agent": cfg.rollout.agent, "workflow_kwargs": {**trajectory, **discount}}
        agent["workflow_kwargs"].update(cfg.rollout.workflow_args)

    async def one(p: Any) -> RemoteObject:
        spec = engine_spec(cfg, p.spec, model_path, p.device)
        w = await p.handle.create(
            "arl.node.rollout:RolloutWorker",
            name="rollout",
            model_path=model_path,
            engine=spec.to_wire(),
            engine_options=engine_options(cfg, spec, len(cluster.rollout)),
            workflow=cfg.rollout.workflow,
            reward=cfg.rollout.reward,
            sampling=sampling,
            n_samples=cfg.gconfig.n_samples,
            max_prompt_len=cfg.data.max_prompt_len,
            prompt_overflow=cfg.data.prompt_overflow,
            group_timeout=cfg.rollout.group_timeout,
            **agent,
        )
        await rollout_worker(w).setup()
        return w

    return list(await asyncio.gather(*(one(p) for p in cluster.rollout)))


async def start_train_workers(cfg: Config, cluster: Cluster, model_path: str) -> list:
    """A train worker on every train node, in rank order, joined into one process group."""
    rank0 = cluster.train[0].handle
    host = rendezvous_host(cluster)
    port = await rank0.call("free_port", {"host": host})
    actor = attrs.asdict(cfg.actor)
    actor["path"] = model_path
    world = len(cluster.train)
    return list(
        await asyncio.gather(
            *(
                p.handle.create(
                    "arl.node.train:TrainWorker",
                    actor,
                    name="train",
                    rank=p.spec.rank,
                    world_size=world,
                    init_method=f"tcp://{host}:{port}",
                    device=p.device,
                    seed=cfg.experiment.seed,
                    ref_path=cfg.ref_path or None,
                    total_steps=cfg.experiment.total_train_steps * cfg.actor.ppo_n_minibatches,
                )
                for p in cluster.train
            )
        )
    )


def start_rollout(
    cfg: Config, cluster: Cluster, workers: list, rows: list[dict], free: Callable
) -> RolloutController:
    """The run's rollout controller over ``workers`` and the training ``rows`` (not started):
    the staleness bound, the resumable loader, the accept filter and the shard peers."""
    sem = StalenessSemaphore(
        cfg.data.batch_size, cfg.rollout.max_head_offpolicyness, cfg.max_concurrent_rollouts
    )
    loader = StatefulLoader(rows, 1, shuffle=cfg.data.shuffle, seed=cfg.experiment.seed)
    prefixes = tuple(cfg.cluster.allowed_import_prefixes)
    accept = resolve_import(cfg.rollout.filter, prefixes) if cfg.rollout.filter else None
    return RolloutController(
        workers,
        loader,
        sem,
        peers={p.handle.node_id: p.handle.info["data_addr"] for p in cluster.rollout},
        free=free,
        stale_policy=cfg.rollout.stale_sample_policy,
        order=cfg.rollout.batch_order,
        accept=accept,
        max_consecutive_rejections=cfg.rollout.max_consecutive_rejections,
        stall_log_s=cfg.rollout.stall_log_s,
    )


def start_weight_sync(
    cfg: Config,
    cluster: Cluster,
    workers: tuple[list, list],
    rollout: RolloutController,
    free: Callable,
) -> WeightSync:
    """The weight-sync plug-in of the mode the placement plan resolved (``cluster.plan``)
    between the (train, rollout) ``workers``."""
    train, rollout_workers = workers
    ctx = SyncContext(
        cluster=cluster,
        train=train,
        rollout_workers=rollout_workers,
        rollout=rollout,
        config=cfg.weight_sync,
        run_path=cfg.run_path,
        free=free,
    )
    return make_weight_sync(cluster.plan, ctx)


def sharing_gpu(cfg: Config, cluster: Cluster) -> list[int]:
    """Indices of the rollout nodes whose engine shares a GPU with a train rank (what
    ``rollout.gpu_sharing`` acts on); warns where that setting has nothing to act on."""
    train = [p.spec for p in cluster.train]
    sharing = [i for i, p in enumerate(cluster.rollout) if shares_gpu(p.spec, train)]
    if cfg.rollout.gpu_sharing not in ("concurrent", "auto") and not sharing:
        log.warning(
            "rollout.gpu_sharing=%s has no effect here: no rollout engine shares a GPU "
            "with a train rank",
            cfg.rollout.gpu_sharing,
        )
    return sharing


def gpu_turn(
    cfg: Config, rollout: RolloutController, sharing: list[int]
) -> contextlib.AbstractAsyncContextManager:
    """The engines ``sharing`` a train rank's GPU while it trains and syncs: ``alternate``
    pauses them in place; ``sleep`` aborts their requests (resubmitted, waiting) and puts them
    to sleep (KV cache freed; the weights too for a full fine-tune, whose sync rewrites them
    all; with LoRA the base stays), and the sync wakes them before its transfer
    (`RolloutController.held`); else nothing."""
    mode = cfg.rollout.gpu_sharing
    if mode not in ("alternate", "sleep") or not sharing:
        return contextlib.nullcontext()
    if mode == "sleep":
        return rollout.held(sharing, sleep=True, drop_weights=cfg.actor.lora.rank == 0)
    return rollout.held(sharing)


class CallTimeout(TimeoutError):
    """Calls ran past their deadline on nodes that still answer heartbeats (slow or stuck)."""

    def __init__(self, nodes: list[str], call: str, seconds: float, setting: str):
        self.nodes, self.call = nodes, call
        super().__init__(
            f"{call} on node {', '.join(nodes)} ran longer than {setting}={seconds:g}s; the "
            f"node still answers heartbeats, so it is slow or stuck in {call}"
        )


async def call_all(
    workers: list[RemoteObject],
    method: str,
    args: list[list] | None = None,
    timeout: float | None = None,
    *,
    setting: str = "actor.call_timeout",
    wrap: Any = None,
) -> list:
    """Call ``method`` on every worker at once; results in order.

    The first failure cancels the rest and is raised (a rank blocked in a collective with a
    failed one would otherwise wait forever); calls still running after ``timeout`` seconds
    raise `CallTimeout` naming their nodes.
    """
    calls = [w.call(method, *(args[i] if args else [])) for i, w in enumerate(workers)]
    if wrap is not None:
        calls = [wrap(w, c) for w, c in zip(workers, calls, strict=True)]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
        )
    finally:
        for t in tasks:
            t.cancel()  # no-op for finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:  # in rank order, so the error is the same whatever finished first
        if t in done and t.exception() is not None:
            raise t.exception()
    if pending:
        slow = [w for w, t in zip(workers, tasks, strict=True) if t in pending]
        raise CallTimeout(
            [w.node.node_id for w in slow], f"{slow[0].name}.{method}", timeout, setting
        )
    return [t.result() for t in tasks]


async def node_gauges(cluster: Cluster) -> dict:
    """Each node's shard-store gauges, asked for now (after a step's shards were freed) rather
    than taken from its last heartbeat, which may date from the middle of a sync."""
    nodes = [p.handle for p in cluster.nodes]
    stats = await asyncio.gather(*(n.call("ping") for n in nodes))
    return {
        f"node/{n.node_id}/{key}": s.get(key, 0)
        for n, s in zip(nodes, stats, strict=True)
        for key in ("bytes_held", "n_shards")
    }


async def free_shards(cluster: Cluster, refs: list[ShardRef]) -> None:
    """Free shards on their owners and every node holding a pulled copy, in one fan-out."""
    keys = sorted({r.key for r in refs})
    if keys:
        nodes = [p.handle for p in cluster.nodes if not p.handle.lost]
        await asyncio.gather(*(n.call("free", {"keys": keys}) for n in nodes))


async def evaluate(workers: list[RolloutWorkerAPI], rows: list[dict], ev: EvaluatorConfig) -> dict:
    """Mean reward (accuracy for 0/1 rewards) on the held-out ``rows``, split over ``workers``."""
    n = len(workers)
    chunks = [rows[i::n] for i in range(n)]
    pairs = [(w, chunk) for w, chunk in zip(workers, chunks, strict=True) if chunk]
    scores = await asyncio.gather(
        *(w.evaluate(chunk, ev.n_samples, ev.temperature) for w, chunk in pairs)
    )
    for (w, chunk), got in zip(pairs, scores, strict=True):
        if len(got) != len(chunk):
            raise MalformedReply(
                f"node {w.node.node_id} answered evaluate with {len(got)} scores for "
                f"{len(chunk)} rows; it must answer one per row"
            )
    flat = [s for part in scores for s in part]
    return {"eval/accuracy": sum(flat) / max(1, len(flat)), "eval/n": len(flat)}


async def raise_node_loss(
    err: RemoteError, cluster: Cluster, check: Callable[[], None], hb: ClusterConfig
) -> None:
    """Raise the loss of the node ``err``'s pull found gone, once the controller declares it;
    ``check`` raises the rollout's own error first (`RolloutController.check`).

    The pull fails as soon as the owner's connection closes; the controller declares the node
    lost only after ``cluster.heartbeat_timeout`` (``hb``), with what its event loop was blocked
    in (which decides whether a restart helps). Returns if no verdict comes by then."""
    deadline = time.monotonic() + hb.heartbeat_timeout + 2 * hb.heartbeat_interval + 1.0
    while time.monotonic() < deadline:
        check()
        for node in cluster.nodes:
            h = node.handle
            if h.lost:
                doing = f"{err.method} on node {err.node}"
                raise NodeLost(h.node_id, doing, h.lost, h.blocked_in) from err
        await asyncio.sleep(0.05)
