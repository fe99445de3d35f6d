"""What a rollout node reports for each prompt group it ran, and what a workflow hands it.

- `Trajectory`: a workflow's result on the node: the group's tensors (the shard) plus side data
  that stays on the node (sample texts, per-episode rewards, failed episodes).
- `GroupReport`: the node's answer to ``run_group`` for a stored group: where its shard is, its
  rewards, token count and policy versions. No tensors: those stay in the node's shard store.
- `RejectedGroup`: the answer for a row the workflow rejected (no shard, the reason).

Both reports are wire structs (`arl.protocol.wire`): plain maps (`to_wire`), and
`report_from_wire` checks every field and raises `ReportError` naming what is wrong. The
controller, the trainer and ``rollout.filter`` functions read the attrs objects, never the maps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from arl.protocol.rtensor import RTensorError, ShardRef
from arl.protocol.wire import WireStruct, WireStructError

# The tensors every trajectory has (layout: arl.workflows.base); others travel with the shard.
TRAJECTORY_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")
SAMPLE_TEXT_CHARS = 500  # the first sample's text a report carries, for logs


class ReportError(WireStructError):
    """A malformed group report or trajectory (from the wire, or from a workflow)."""


def _floats(v: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in v)


@attrs.frozen(eq=False)
class Trajectory:
    """A workflow's prompt group: ``tensors`` become the shard, the rest stays on the node.

    ``episode_rewards`` is set when rows are not episodes (a multi-turn agent packs several rows
    per episode); ``failed_samples`` counts episodes the workflow dropped from the group.
    """

    tensors: dict[str, Any]
    texts: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    episode_rewards: tuple[float, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_floats)
    )
    failed_samples: int = 0

    def __attrs_post_init__(self) -> None:
        missing = [k for k in TRAJECTORY_KEYS if k not in self.tensors]
        if missing:
            raise ReportError(
                f"a trajectory needs the tensors {missing} (has {sorted(self.tensors)})"
            )
        if self.failed_samples < 0:
            raise ReportError(f"failed_samples must be >= 0, got {self.failed_samples}")

    @classmethod
    def of(cls, result: Trajectory | Mapping[str, Any]) -> Trajectory:
        """A workflow's result as a Trajectory: a plain map of tensors is one with no side data;
        ``_``-prefixed keys (side data the node would silently train on or drop) are refused."""
        if isinstance(result, Trajectory):
            return result
        if not isinstance(result, Mapping):
            raise ReportError(
                f"a workflow must return a Trajectory (arl.protocol.report) or a map of tensors, "
                f"got {type(result).__name__}"
            )
        hidden = sorted(k for k in result if str(k).startswith("_"))
        if hidden:
            raise ReportError(
                f"a workflow result has side-data keys {hidden}: return "
                "Trajectory(tensors, texts=..., episode_rewards=..., failed_samples=...) instead"
            )
        return cls(dict(result))

    def rewards(self) -> list[float]:
        """One reward per episode (the rows' rewards when rows are episodes)."""
        if self.episode_rewards is not None:
            return list(self.episode_rewards)
        return [float(r) for r in self.tensors["rewards"].float().tolist()]

    def score(self) -> float:
        """Mean episode reward; failed episodes count 0."""
        if self.episode_rewards is None:
            return float(self.tensors["rewards"].float().mean())
        rewards = self.rewards()
        return sum(rewards) / max(1, len(rewards) + self.failed_samples)


@attrs.frozen(kw_only=True)
class GroupReport(WireStruct):
    """A stored prompt group as its node reports it (``meta`` is the shard's store metadata).

    On the wire, ``episode_rewards`` (default: ``rewards``), ``max_version`` (default:
    ``min_version``), ``seconds``, ``sample_text`` and ``failed_samples`` may be left out.
    """

    wire_error = ReportError
    wire_optional = frozenset(
        {"episode_rewards", "max_version", "seconds", "sample_text", "failed_samples"}
    )

    key: str
    meta: dict = attrs.field(hash=False)
    group_size: int
    rewards: tuple[float, ...] = attrs.field(converter=_floats)
    episode_rewards: tuple[float, ...] = attrs.field(
        default=attrs.Factory(lambda self: self.rewards, takes_self=True), converter=_floats
    )
    n_gen_tokens: int
    min_version: int  # oldest policy version among its generated tokens (-1: none generated)
    max_version: int = attrs.field(
        default=attrs.Factory(lambda self: self.min_version, takes_self=True)
    )
    seconds: float = 0.0
    data_id: str
    sample_text: str = ""
    failed_samples: int = 0

    rejected = False

    def __attrs_post_init__(self) -> None:
        if self.group_size < 1 or self.n_gen_tokens < 0 or self.failed_samples < 0:
            raise ReportError("group_size must be >= 1, n_gen_tokens and failed_samples >= 0")
        if self.max_version < self.min_version:
            raise ReportError(f"max_version {self.max_version} < min_version {self.min_version}")

    def shard_ref(self, node: str) -> ShardRef:
        """The ref to this group's shard on ``node``; raises ReportError if ``meta`` is bad."""
        try:
            ref = ShardRef.from_wire({**self.meta, "node": node, "group_size": self.group_size})
        except RTensorError as e:
            raise ReportError(f"'meta': {e}") from None
        if ref.key != self.key:
            raise ReportError(f"its shard is {ref.key!r}, not {self.key!r}")
        return ref


@attrs.frozen
class RejectedGroup(WireStruct):
    """A row the workflow rejected: no shard was stored; ``reason`` says why.

    Its wire map is tagged ``{"rejected": True}``.
    """

    wire_error = ReportError
    wire_tag = ("rejected", True)
    wire_optional = frozenset({"failed_samples", "seconds", "data_id"})

    key: str
    reason: str
    failed_samples: int = 0
    seconds: float = 0.0
    data_id: str = ""

    rejected = True

    def __attrs_post_init__(self) -> None:
        if self.failed_samples < 0:
            raise ReportError(f"failed_samples must be >= 0, got {self.failed_samples}")


def report_from_wire(d: Any) -> GroupReport | RejectedGroup:
    """The report a ``run_group`` reply carries; raises ReportError naming what is wrong."""
    rejected = isinstance(d, Mapping) and d.get("rejected")
    return (RejectedGroup if rejected else GroupReport).from_wire(d)
