"""Group reports and trajectories: wire round trips, and malformed input refused by name."""

from __future__ import annotations

import msgpack
import pytest
import torch

from arl.protocol.report import (
    GroupReport,
    RejectedGroup,
    ReportError,
    Trajectory,
    report_from_wire,
)
from arl.workflows.base import pack_group

META = {"key": "g7", "nbytes": 96, "n_tokens": 12, "shapes": {"x": [2, 6]}, "dtypes": {"x": "f"}}


def _report(**over) -> GroupReport:
    fields = dict(
        key="g7",
        meta=META,
        group_size=2,
        rewards=[0.0, 1.0],
        episode_rewards=[0.0, 1.0],
        n_gen_tokens=8,
        min_version=3,
        max_version=4,
        seconds=1.5,
        data_id="abc",
        sample_text="twelve",
        failed_samples=0,
    )
    return GroupReport(**{**fields, **over})


def test_group_report_round_trips_through_msgpack() -> None:
    report = _report()
    wire = msgpack.unpackb(msgpack.packb(report.to_wire()))
    back = report_from_wire(wire)
    assert back == report and not back.rejected
    ref = back.shard_ref("node1")
    assert (ref.node, ref.key, ref.group_size, ref.n_tokens) == ("node1", "g7", 2, 12)


def test_rejected_group_round_trips_and_is_told_apart() -> None:
    rejected = RejectedGroup("g8", "all 4 agent episodes failed", 4, 0.25, "d")
    back = report_from_wire(msgpack.unpackb(msgpack.packb(rejected.to_wire())))
    assert back == rejected and back.rejected and isinstance(back, RejectedGroup)


def test_optional_fields_take_their_defaults() -> None:
    wire = _report().to_wire()
    for name in ("episode_rewards", "failed_samples", "sample_text", "max_version", "seconds"):
        del wire[name]
    back = report_from_wire(wire)
    assert back.episode_rewards == (0.0, 1.0) and back.failed_samples == 0
    assert back.max_version == back.min_version == 3


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"group_size": "2"}, "'group_size' must be an integer, got '2'"),
        ({"group_size": True}, "'group_size' must be an integer"),
        ({"n_gen_tokens": None}, "'n_gen_tokens' must be an integer"),
        ({"min_version": 1.5}, "'min_version' must be an integer"),
        ({"rewards": [0.0, "1"]}, "'rewards[1]' must be a number, got '1'"),
        ({"rewards": "01"}, "'rewards' must be a list of numbers"),
        ({"episode_rewards": {"a": 1}}, "'episode_rewards' must be a list of numbers"),
        ({"data_id": 5}, "'data_id' must be text"),
        ({"meta": []}, "'meta' must be a map, got []"),
        ({"key": None}, "'key' must be text"),
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"max_version": 1}, "max_version 1 < min_version 3"),
    ],
)
def test_malformed_reports_are_refused_naming_the_field(change, why) -> None:
    with pytest.raises(ReportError, match=None) as info:
        report_from_wire({**_report().to_wire(), **change})
    assert why in str(info.value)


@pytest.mark.parametrize("missing", ["key", "group_size", "n_gen_tokens", "rewards", "data_id"])
def test_a_missing_field_is_named(missing) -> None:
    wire = _report().to_wire()
    del wire[missing]
    with pytest.raises(ReportError, match=f"'{missing}' must be .*, it is missing"):
        report_from_wire(wire)


def test_a_rejected_report_needs_its_reason_and_a_report_must_be_a_map() -> None:
    with pytest.raises(ReportError, match="'reason' must be text"):
        report_from_wire({"key": "g", "rejected": True})
    with pytest.raises(ReportError, match=r"GroupReport: expected a map, got \[1, 2\]"):
        report_from_wire([1, 2])


def test_shard_ref_checks_the_meta_and_its_key() -> None:
    with pytest.raises(ReportError, match="'meta': ShardRef: 'nbytes' must be an integer, it is"):
        _report(meta={"key": "g7"}).shard_ref("n")
    with pytest.raises(ReportError, match="its shard is 'other'"):
        _report(meta={**META, "key": "other"}).shard_ref("n")


def _group() -> dict:
    return pack_group([[1, 2]] * 2, [[3], [4, 5]], [[-0.1], [-0.2, -0.3]], [[0], [0, 1]], [1, 0])


def test_trajectory_side_data_and_score() -> None:
    plain = Trajectory.of(_group())
    assert plain.rewards() == [1.0, 0.0] and plain.score() == 0.5 and plain.texts == ()
    agent = Trajectory(_group(), texts=["a", "b"], episode_rewards=[1.0], failed_samples=1)
    assert agent.rewards() == [1.0] and agent.score() == 0.5  # the failed episode counts 0
    assert Trajectory.of(agent) is agent


def test_trajectory_refuses_missing_tensors_and_hidden_keys() -> None:
    group = _group()
    del group["versions"]
    with pytest.raises(ReportError, match=r"needs the tensors \['versions'\]"):
        Trajectory(group)
    with pytest.raises(ReportError, match=r"side-data keys \['_texts'\]: return Trajectory"):
        Trajectory.of({**_group(), "_texts": ["x"]})
    with pytest.raises(ReportError, match="got list"):
        Trajectory.of([torch.zeros(1)])
