"""The placement plan as a value: which node runs what on which device, and the weight-sync mode.

`arl.control.placement.plan_placement` builds the one `Plan` of a run: it places the nodes and
resolves ``weight_sync.mode`` (``auto`` included) against them, once, by the rule of the modes
themselves (`arl.weights.check_plan`). Everything after reads the plan: the launchers, the
memory plan, the run directory's outputs, the trainer's weight sync. The types live here, below
control/, weights/ and engines/, so that all of them can read a plan without importing the
planner.
"""

from __future__ import annotations

from typing import Literal

import attrs


@attrs.frozen(kw_only=True)
class NodeSpec:
    """One node daemon of the plan.

    ``device`` is the first physical device the node uses ("cpu" or "cuda:N"); ``gpu_ids`` lists
    all of them (a tensor-parallel inference replica holds several), for CUDA_VISIBLE_DEVICES.
    """

    node_id: int
    role: Literal["rollout", "train"]
    rank: int  # within its role's group
    device: str
    engine: str
    dp_rank: int
    tp_size: int
    gpu_ids: tuple[int, ...] = ()
    colocated: bool = False


@attrs.frozen(kw_only=True)
class Plan:
    """The run's nodes (rollout first, then train, ``node_id`` their index) and the weight-sync
    mode they run, already resolved: never ``auto``."""

    nodes: tuple[NodeSpec, ...] = attrs.field(converter=tuple)
    sync_mode: str

    def __attrs_post_init__(self) -> None:
        if not self.sync_mode or self.sync_mode == "auto":
            raise ValueError(
                f"Plan(sync_mode={self.sync_mode!r}): a plan holds the resolved mode; resolve "
                "'auto' with arl.weights.check_plan (arl.control.placement does) first"
            )

    @property
    def rollout(self) -> tuple[NodeSpec, ...]:
        """The rollout nodes, replica order."""
        return tuple(n for n in self.nodes if n.role == "rollout")

    @property
    def train(self) -> tuple[NodeSpec, ...]:
        """The train nodes, rank order."""
        return tuple(n for n in self.nodes if n.role == "train")
