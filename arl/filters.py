"""Built-in sample filters: accept functions on finished prompt groups (``rollout.filter``).

A filter runs on the controller when a group finishes and sees the node's report of it, an
`arl.protocol.report.GroupReport` (frozen attributes: ``rewards`` per row, ``episode_rewards`` per
episode, ``n_gen_tokens``, ``min_version``, ``max_version``, ``failed_samples``, ``sample_text``,
``data_id``, ``group_size``). Returning False rejects the group: its shard is freed,
``rollout/rejected`` counts it, and its staleness slot goes back to rollout at once, so
rejections never stall generation. ``rollout.max_consecutive_rejections`` rejections in a row
stop the run with an error naming the filter, instead of a hang. Write your own with the same
signature, ``def accept(info: GroupReport) -> bool``, in a module under the allowed import prefixes.
"""

from __future__ import annotations

from arl.protocol.report import GroupReport


def nonconstant_reward(info: GroupReport) -> bool:
    """DAPO's dynamic sampling: keep a group only if its episodes' rewards are not all equal.

    A group whose rewards are all equal has zero group-normalised advantage, so it adds no
    gradient, only tokens; with sparse rewards most groups are such.
    """
    rewards = info.episode_rewards
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-6


def no_failed_samples(info: GroupReport) -> bool:
    """Keep a group only if none of its episodes failed (for agents that must all finish)."""
    return info.failed_samples == 0
