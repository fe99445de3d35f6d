"""The plan side of every weight-sync mode: can the mode run on a placement plan, and would
``weight_sync.mode=auto`` pick it.

Each mode's rule is a `ModeRule` subclass here, and its controller half (`arl.weights.base.
WeightSync`, in the mode's own module) inherits it. The launcher decides the mode from these
classes alone (`arl.weights.check_plan`), before any node starts and without importing the
modes' modules, which import torch. What an engine accepts comes from its declared traits
(`arl.engines.spec.TRAITS`), read without importing the engine either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from arl.config import ConfigError
from arl.engines.base import WeightTarget

if TYPE_CHECKING:
    from arl.protocol.plan import NodeSpec


class ModeRule:
    """A mode's name, where ``auto`` ranks it, the run folders it writes, and its plan check."""

    mode: ClassVar[str] = ""
    # `auto` picks the first registered mode whose `suits` holds, in this order (lower first).
    auto_rank: ClassVar[int] = 100
    # Folders under the run directory this mode writes (checked writable before any node starts).
    run_dirs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """Raise `ConfigError` if this mode cannot run on ``plan``; the default accepts all."""

    @classmethod
    def suits(cls, plan: Sequence[NodeSpec]) -> bool:
        """Whether ``weight_sync.mode=auto`` may pick this mode for ``plan``."""
        try:
            cls.check_plan(plan)
        except ConfigError:
            return False
        return True


class IpcBufferRule(ModeRule):
    """``ipc_buffer`` (`arl.weights.ipc_buffer`)."""

    mode = "ipc_buffer"
    auto_rank = 10

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """hf engines, all on train rank 0's GPU (or, without GPUs, on its host)."""
        if train_rank0(plan).gpu_ids:
            engines_on_rank0_gpu(cls.mode, plan)
        else:
            require_inprocess_engines(cls.mode, plan)

    @classmethod
    def suits(cls, plan: Sequence[NodeSpec]) -> bool:
        """Auto picks it on a shared GPU; on CPU auto keeps zmq."""
        return bool(train_rank0(plan).gpu_ids) and super().suits(plan)


class IpcRule(ModeRule):
    """``ipc`` (`arl.weights.ipc`)."""

    mode = "ipc"

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """hf engines, all on train rank 0's GPU."""
        engines_on_rank0_gpu(cls.mode, plan)

    @classmethod
    def suits(cls, plan: Sequence[NodeSpec]) -> bool:
        """Never auto's choice: where it runs, ``ipc_buffer`` runs faster."""
        return False


class NcclRule(ModeRule):
    """``nccl`` (`arl.weights.nccl`)."""

    mode = "nccl"
    auto_rank = 20

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """hf engines, each on a GPU of its own apart from train rank 0's (one GPU per rank)."""
        require_inprocess_engines(cls.mode, plan)
        rank0 = train_rank0(plan)
        shared = set(rank0.gpu_ids) & {g for n in plan if n.role == "rollout" for g in n.gpu_ids}
        if shared:
            raise ConfigError(
                f"weight_sync.mode=nccl cannot put train rank 0 and an engine on the same GPU "
                f"(GPU {sorted(shared)}: NCCL needs one GPU per rank); use "
                "weight_sync.mode=ipc_buffer (or auto) when they share a GPU, or give the run "
                "more GPUs"
            )

    @classmethod
    def suits(cls, plan: Sequence[NodeSpec]) -> bool:
        """Auto picks it across GPUs only; on CPU (gloo) zmq is the faster choice."""
        return bool(train_rank0(plan).gpu_ids) and super().suits(plan)


class ZmqRule(ModeRule):
    """``zmq`` (`arl.weights.zmq`)."""

    mode = "zmq"
    auto_rank = 30

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """The buckets are copied into in-process (hf) engines."""
        require_inprocess_engines(cls.mode, plan)


class DiskRule(ModeRule):
    """``disk`` (`arl.weights.disk`)."""

    mode = "disk"
    auto_rank = 40
    run_dirs = ("weights",)

    @classmethod
    def check_plan(cls, plan: Sequence[NodeSpec]) -> None:
        """Every engine loads a directory."""
        require_weight_target(cls.mode, plan, WeightTarget.DIRECTORY)


# ---- plan facts the rules check -------------------------------------------------------------
def train_rank0(plan: Sequence[NodeSpec]) -> NodeSpec:
    """Train rank 0's node spec."""
    return next(n for n in plan if n.role == "train" and n.rank == 0)


def engines_without(target: WeightTarget, plan: Sequence[NodeSpec]) -> list[str]:
    """Rollout engines of the plan whose declared `weight_targets` lack ``target``."""
    from arl.engines.spec import TRAITS

    names = {n.engine for n in plan if n.role == "rollout"}
    return sorted(n for n in names if target not in TRAITS[n].weight_targets)


def require_weight_target(mode: str, plan: Sequence[NodeSpec], target: WeightTarget) -> None:
    """Refuse ``mode`` unless every rollout engine of the plan declares ``target``."""
    from arl.engines.spec import TRAITS

    engines = engines_without(target, plan)
    if engines:
        accepts = "; ".join(
            f"{e} accepts only {', '.join(sorted(t.value for t in TRAITS[e].weight_targets))}"
            for e in engines
        )
        modes = "disk (or auto)" if target is WeightTarget.TENSORS else "auto"
        raise ConfigError(
            f"weight_sync.mode={mode} needs engines that accept weights as {target.value} "
            f"({accepts}: its weight_targets); use weight_sync.mode={modes} with these engines"
        )


def require_inprocess_engines(mode: str, plan: Sequence[NodeSpec]) -> None:
    """Modes that copy tensors into the engine: every engine accepts `WeightTarget.TENSORS`."""
    require_weight_target(mode, plan, WeightTarget.TENSORS)


def engines_on_rank0_gpu(mode: str, plan: Sequence[NodeSpec]) -> None:
    """CUDA IPC modes: every engine on train rank 0's GPU."""
    rank0 = train_rank0(plan)
    if not rank0.gpu_ids:
        raise ConfigError(
            f"weight_sync.mode={mode} needs GPUs (CUDA IPC) and none are available; "
            "use weight_sync.mode=auto, zmq, disk or nccl (gloo) on CPU"
        )
    require_inprocess_engines(mode, plan)
    if any(n.gpu_ids != rank0.gpu_ids for n in plan if n.role == "rollout"):
        raise ConfigError(
            f"weight_sync.mode={mode} needs every engine on train rank 0's GPU "
            f"{list(rank0.gpu_ids)}; use weight_sync.mode=nccl for engines on other GPUs"
        )
