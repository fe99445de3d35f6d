"""Weight sync plug-ins (DESIGN §6): one module per mode, both of its halves in it (its plan rule
in `arl.weights.rules`).

- ``ipc_buffer``: one persistent buffer shared once by CUDA IPC (a shared-memory file on CPU);
  per sync two device copies. ``auto`` picks it when every engine is on train rank 0's GPU.
- ``ipc``: CUDA IPC of one bucket buffer at a time (one bucket of extra memory); never ``auto``.
- ``nccl``: bucketed broadcast over a group of its own, the transfer overlapped (gloo on CPU).
  ``auto`` picks it for hf engines on GPUs apart from train rank 0's.
- ``zmq``: buckets through the data plane (shared memory on one host); ``auto`` on CPU.
- ``disk``: a safetensors folder per version, reloaded; ``auto`` for server engines.

`check_plan(mode, nodes)` is the one rule that decides the mode: it resolves ``auto`` and refuses
a forced mode the nodes cannot run (a `ConfigError` naming what to change), by the modes' rules
(`arl.weights.rules`, which their controller halves inherit; read without importing the modes'
modules, which import torch). The planner (`arl.control.placement`) calls it once and keeps the
result on the `arl.protocol.plan.Plan` before any node starts; `make_weight_sync` builds the
plan's mode.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from arl.config import ConfigError
from arl.weights.base import NodePart, SyncContext, WeightSync, WeightSyncError
from arl.weights.rules import DiskRule, IpcBufferRule, IpcRule, ModeRule, NcclRule, ZmqRule

if TYPE_CHECKING:
    from arl.protocol.plan import NodeSpec, Plan

__all__ = [
    "MODES",
    "ModeRule",
    "NodePart",
    "SyncContext",
    "WeightSync",
    "WeightSyncError",
    "check_plan",
    "make_weight_sync",
    "mode_rule",
    "sync_class",
]

# Mode name -> "module:Class" of its controller half, imported when it is asked for.
MODES: dict[str, str] = {
    "ipc_buffer": "arl.weights.ipc_buffer:IpcBufferSync",
    "ipc": "arl.weights.ipc:IpcSync",
    "nccl": "arl.weights.nccl:NcclSync",
    "zmq": "arl.weights.zmq:ZmqSync",
    "disk": "arl.weights.disk:DiskSync",
}


# Mode name -> its plan rule (the controller half above inherits it).
RULES: dict[str, type[ModeRule]] = {
    rule.mode: rule for rule in (IpcBufferRule, IpcRule, NcclRule, ZmqRule, DiskRule)
}


def mode_rule(mode: str) -> type[ModeRule]:
    """The plan rule of ``mode`` (a `ConfigError` naming the modes for an unknown one)."""
    try:
        return RULES[mode]
    except KeyError:
        close = difflib.get_close_matches(mode, MODES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"weight_sync.mode={mode!r} is not a weight-sync mode{hint}; known: auto, "
            f"{', '.join(MODES)}"
        ) from None


def sync_class(mode: str) -> type[WeightSync]:
    """The controller half registered as ``mode`` (imports its module)."""
    mode_rule(mode)  # refuses an unknown mode
    module, _, name = MODES[mode].partition(":")
    return getattr(importlib.import_module(module), name)


def check_plan(mode: str, nodes: Sequence[NodeSpec]) -> str:
    """The mode to run on ``nodes``: ``auto`` resolved by the modes' `suits` in `auto_rank`
    order; a named mode checked by its `check_plan` (raises `ConfigError`)."""
    if mode != "auto":
        mode_rule(mode).check_plan(nodes)
        return mode
    for rule in sorted((mode_rule(m) for m in MODES), key=lambda r: r.auto_rank):
        if rule.suits(nodes):
            return rule.mode
    raise ConfigError("no weight-sync mode suits this placement plan; set weight_sync.mode")


def make_weight_sync(plan: Plan, ctx: SyncContext) -> WeightSync:
    """Build the weight sync of the mode ``plan`` was placed with."""
    return sync_class(plan.sync_mode)(ctx)
