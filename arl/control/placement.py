"""Placement: the run's `Plan` (`arl.protocol.plan`), which node runs what, on which device.

Rollout nodes come first (one per inference replica, holding ``tp`` GPUs), then train nodes (one
per FSDP rank, one GPU each). GPUs are one pool numbered 0..n_gpus-1: rollout takes the first
ones, training the next. When there are too few GPUs for both but enough for the larger group,
both groups share the same GPUs (``colocated``). Without GPUs every node runs on the CPU.

The weight-sync mode is decided here, once: ``weight_sync.mode`` (``auto`` resolved) checked
against the nodes by the modes' own rule (`arl.weights.check_plan`) and stored on the plan,
which everything after reads.
"""

import os
from collections.abc import Sequence

from arl.config import Backend, Config, ConfigError, parse_backend
from arl.control.gpus import gpu_count
from arl.control.memory import check_memory
from arl.protocol.plan import NodeSpec, Plan
from arl.weights import check_plan as check_weight_sync


def shares_gpu(spec: NodeSpec, train: Sequence[NodeSpec]) -> bool:
    """Whether a rollout node's engine shares a GPU with one of the ``train`` nodes (specs)."""
    train_gpus = {g for t in train for g in t.gpu_ids}
    return bool(spec.colocated and set(spec.gpu_ids) & train_gpus)


def detect_gpus(cfg: Config) -> int:
    """GPUs to place nodes on: cluster.n_gpus, or the GPUs this process sees (`arl.control.gpus`:
    read through NVML, so the launcher does not import torch).

    The local launcher starts every node on this host, so it refuses more GPUs than are visible
    here; the other launchers' nodes may run on other hosts, so their count is taken as given.
    """
    n_gpus = cfg.cluster.n_gpus
    if n_gpus is not None and (n_gpus == 0 or cfg.cluster.launcher != "local"):
        return n_gpus
    found = gpu_count()
    if n_gpus is None:
        return found
    if n_gpus > found:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        fix = f"cluster.n_gpus={found} or fewer" if found else "cluster.n_gpus=0 to run on CPU"
        raise ConfigError(
            f"cluster.n_gpus={n_gpus}, but this host has {found} visible GPU"
            f"{'s' * (found != 1)}{seen} and cluster.launcher=local starts every node here; set "
            f"{fix}, or leave cluster.n_gpus unset to use the visible GPUs (to preview a plan "
            "for other machines, add cluster.launcher=slurm to --dry-run)"
        )
    return n_gpus


def place(cfg: Config) -> Plan:
    """The plan of ``cfg`` on the GPUs `detect_gpus` finds."""
    return plan_placement(cfg, detect_gpus(cfg))


def plan_placement(cfg: Config, n_gpus: int) -> Plan:
    """Place the rollout replicas and train ranks of ``cfg`` on ``n_gpus`` GPUs (0: CPU only)
    and resolve its weight-sync mode on them; refuse a plan that the mode cannot run, or whose
    memory plan does not fit (`arl.control.memory`)."""
    nodes = _place(cfg, n_gpus)
    # The one place the mode is decided; a forced mode refuses nodes it cannot run on.
    plan = Plan(nodes=nodes, sync_mode=check_weight_sync(cfg.weight_sync.mode, nodes))
    check_node_count(cfg, plan)
    check_memory(cfg, plan)  # a GPU that cannot hold its parts, with the option that fits
    return plan


def check_node_count(cfg: Config, plan: Plan) -> None:
    """Refuse a ``cluster.n_nodes`` other than the plan's node count (the run starts, or waits
    for, exactly the plan's nodes; a job script that starts another number would not fit)."""
    n_nodes = cfg.cluster.n_nodes
    if n_nodes is None or n_nodes == len(plan.nodes):
        return
    roles = {"rollout": len(plan.rollout), "train": len(plan.train)}
    raise ConfigError(
        f"cluster.n_nodes={n_nodes}, but the placement plan has {len(plan.nodes)} nodes "
        f"({roles['rollout']} rollout from rollout.backend={cfg.rollout.backend}, "
        f"{roles['train']} train from actor.backend={cfg.actor.backend}); set "
        f"cluster.n_nodes={len(plan.nodes)} (or none: the plan's count), or change the d/t in "
        "the backend strings"
    )


def _place(cfg: Config, n_gpus: int) -> list[NodeSpec]:
    rollout = parse_backend(cfg.rollout.backend, "rollout")
    train = parse_backend(cfg.actor.backend, "train")
    if n_gpus < 0:
        raise ConfigError(f"n_gpus={n_gpus}: must be >= 0")
    if n_gpus == 0:
        return _nodes(rollout, train, rollout_gpus=None, train_gpus=None, colocated=False)

    need_rollout, need_train = rollout.world_size, train.world_size
    if n_gpus >= need_rollout + need_train:
        gpus = list(range(n_gpus))
        return _nodes(
            rollout, train, gpus[:need_rollout], gpus[need_rollout:][:need_train], colocated=False
        )
    if n_gpus >= max(need_rollout, need_train):
        return _nodes(
            rollout, train, list(range(need_rollout)), list(range(need_train)), colocated=True
        )
    raise ConfigError(
        f"not enough GPUs: rollout.backend={cfg.rollout.backend} needs {need_rollout} and "
        f"actor.backend={cfg.actor.backend} needs {need_train} ({need_rollout + need_train} "
        f"separate, or {max(need_rollout, need_train)} shared), but {n_gpus} "
        f"{'is' if n_gpus == 1 else 'are'} available; lower d/t in the backend strings, "
        "or set cluster.n_gpus=0 to run on CPU"
    )


def _nodes(
    rollout: Backend,
    train: Backend,
    rollout_gpus: list[int] | None,
    train_gpus: list[int] | None,
    colocated: bool,
) -> list[NodeSpec]:
    nodes: list[NodeSpec] = []
    for replica in range(rollout.dp):
        gpus = (
            ()
            if rollout_gpus is None
            else tuple(rollout_gpus[replica * rollout.tp :][: rollout.tp])
        )
        nodes.append(
            NodeSpec(
                node_id=len(nodes),
                role="rollout",
                rank=replica,
                device=f"cuda:{gpus[0]}" if gpus else "cpu",
                engine=rollout.engine,
                dp_rank=replica,
                tp_size=rollout.tp,
                gpu_ids=gpus,
                colocated=colocated,
            )
        )
    for rank in range(train.dp):
        gpus = () if train_gpus is None else (train_gpus[rank],)
        nodes.append(
            NodeSpec(
                node_id=len(nodes),
                role="train",
                rank=rank,
                device=f"cuda:{gpus[0]}" if gpus else "cpu",
                engine=train.engine,
                dp_rank=rank,
                tp_size=1,
                gpu_ids=gpus,
                colocated=colocated,
            )
        )
    return nodes


def format_plan(plan: Plan) -> str:
    """The plan's nodes as a text table, one row per node."""
    header = ("node", "role", "rank", "engine", "dp_rank", "tp", "device", "gpus", "colocated")
    rows = [header] + [
        (
            str(n.node_id),
            n.role,
            str(n.rank),
            n.engine,
            str(n.dp_rank),
            str(n.tp_size),
            n.device,
            ",".join(map(str, n.gpu_ids)) or "-",
            "yes" if n.colocated else "no",
        )
        for n in plan.nodes
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"
