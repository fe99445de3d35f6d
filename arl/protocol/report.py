"""What a rollout node reports for each prompt group it ran, and what a workflow hands it.

- `Trajectory`: a workflow's result on the node: the group's tensors (the shard) plus side data
  that stays on the node (sample texts, per-episode rewards, failed episodes).
- `GroupReport`: the node's answer to ``run_group`` for a stored group: where its shard is, its
  rewards, token count and policy versions. No tensors: those stay in the node's shard store.
- `RejectedGroup`: the answer for a row the workflow rejected (no shard, the reason).

Both reports cross the wire as plain maps (`to_wire`; `report_from_wire` checks every field and
raises `ReportError` naming what is wrong). The controller, the trainer and ``rollout.filter``
functions read the attrs objects, never the maps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from arl.protocol.errors import ErrorKind
from arl.protocol.rtensor import RTensorError, ShardRef

# The tensors every trajectory has (layout: arl.workflows.base); others travel with the shard.
TRAJECTORY_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")
SAMPLE_TEXT_CHARS = 500  # the first sample's text a report carries, for logs


class ReportError(ValueError):
    """A malformed group report or trajectory (from the wire, or from a workflow)."""

    error_kind = ErrorKind.MALFORMED


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


@attrs.frozen
class GroupReport:
    """A stored prompt group as its node reports it (``meta`` is the shard's store metadata)."""

    key: str
    meta: dict = attrs.field(hash=False)
    group_size: int
    rewards: tuple[float, ...] = attrs.field(converter=_floats)
    episode_rewards: tuple[float, ...] = attrs.field(converter=_floats)
    n_gen_tokens: int
    min_version: int  # oldest policy version among its generated tokens (-1: none generated)
    max_version: int
    seconds: float
    data_id: str
    sample_text: str = ""
    failed_samples: int = 0

    rejected = False

    def shard_ref(self, node: str) -> ShardRef:
        """The ref to this group's shard on ``node``; raises ReportError if ``meta`` is bad."""
        try:
            ref = ShardRef.from_wire({**self.meta, "node": node, "group_size": self.group_size})
        except RTensorError as e:
            raise ReportError(f"'meta': {e}") from None
        if ref.key != self.key:
            raise ReportError(f"its shard is {ref.key!r}, not {self.key!r}")
        return ref

    def to_wire(self) -> dict:
        """Plain msgpack-able map."""
        d = attrs.asdict(self, recurse=False)
        d["rewards"], d["episode_rewards"] = list(self.rewards), list(self.episode_rewards)
        return d


@attrs.frozen
class RejectedGroup:
    """A row the workflow rejected: no shard was stored; ``reason`` says why."""

    key: str
    reason: str
    failed_samples: int = 0
    seconds: float = 0.0
    data_id: str = ""

    rejected = True

    def to_wire(self) -> dict:
        """Plain msgpack-able map, tagged ``rejected``."""
        return {"rejected": True, **attrs.asdict(self)}


_INT = "an integer"
_NUM = "a number"
_STR = "text"


def _field(d: Mapping, name: str, kind: str, default: Any = attrs.NOTHING) -> Any:
    if name not in d:
        if default is attrs.NOTHING:
            raise ReportError(f"{name!r} must be {kind}, it is missing")
        return default
    v = d[name]
    ok = {
        _INT: isinstance(v, int) and not isinstance(v, bool),
        _NUM: isinstance(v, int | float) and not isinstance(v, bool),
        _STR: isinstance(v, str),
    }[kind]
    if not ok:
        raise ReportError(f"{name!r} must be {kind}, got {v!r}")
    return v


def _numbers(d: Mapping, name: str, default: Any = attrs.NOTHING) -> list[float]:
    v = d.get(name, default)
    if v is attrs.NOTHING:
        raise ReportError(f"{name!r} must be a list of numbers, it is missing")
    ok = isinstance(v, Sequence) and not isinstance(v, str | bytes)
    if not ok or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
        raise ReportError(f"{name!r} must be a list of numbers, got {v!r}")
    return list(v)


def report_from_wire(d: Any) -> GroupReport | RejectedGroup:
    """The report a ``run_group`` reply carries; raises ReportError naming what is wrong."""
    if not isinstance(d, Mapping):
        raise ReportError(f"expected a map, got {type(d).__name__}")
    key = _field(d, "key", _STR)
    failed = _field(d, "failed_samples", _INT, 0)
    seconds = float(_field(d, "seconds", _NUM, 0.0))
    if d.get("rejected"):
        data_id = _field(d, "data_id", _STR, "")
        return RejectedGroup(key, _field(d, "reason", _STR), failed, seconds, data_id)
    group_size = _field(d, "group_size", _INT)
    n_gen_tokens = _field(d, "n_gen_tokens", _INT)
    min_version = _field(d, "min_version", _INT)
    max_version = _field(d, "max_version", _INT, min_version)
    rewards = _numbers(d, "rewards")
    episode_rewards = _numbers(d, "episode_rewards", rewards)
    data_id = _field(d, "data_id", _STR)
    meta = d.get("meta")
    if not isinstance(meta, Mapping):
        raise ReportError(f"'meta' must be a map, got {type(meta).__name__}")
    report = GroupReport(
        key=key,
        meta=dict(meta),
        group_size=group_size,
        rewards=rewards,
        episode_rewards=episode_rewards,
        n_gen_tokens=n_gen_tokens,
        min_version=min_version,
        max_version=max_version,
        seconds=seconds,
        data_id=data_id,
        sample_text=_field(d, "sample_text", _STR, ""),
        failed_samples=failed,
    )
    if report.group_size < 1 or report.n_gen_tokens < 0 or failed < 0:
        raise ReportError("group_size must be >= 1, n_gen_tokens and failed_samples >= 0")
    if report.max_version < report.min_version:
        raise ReportError(f"max_version {report.max_version} < min_version {report.min_version}")
    return report
