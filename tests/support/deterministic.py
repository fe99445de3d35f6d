"""A reward that depends on the completion's text alone, for runs that must repeat exactly."""

from __future__ import annotations

from typing import Any


async def vowel_reward(completion: str, data: dict[str, Any]) -> float:
    """The share of vowels among the completion's letters: mixed rewards within a group, so
    GRPO's advantages (and the update) are not zero even for a random model."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


async def _async_warm_up() -> None:
    pass


async def async_warm_up_reward(completion: str, data: dict[str, Any]) -> float:
    """`vowel_reward` with a ``warm_up`` that is (wrongly) async."""
    return await vowel_reward(completion, data)


async_warm_up_reward.warm_up = _async_warm_up  # type: ignore[attr-defined]


def plain_thread_reward(completion: str, data: dict[str, Any]) -> float:
    """A plain ``def`` reward that says where it ran: 1.0 off the main thread (where a node's
    event loop runs), 0.0 on it."""
    import threading

    return float(threading.current_thread() is not threading.main_thread())
