"""A reward that depends on the completion's text alone, for runs that must repeat exactly."""

from __future__ import annotations

from typing import Any


async def vowel_reward(completion: str, data: dict[str, Any]) -> float:
    """The share of vowels among the completion's letters: mixed rewards within a group, so
    GRPO's advantages (and the update) are not zero even for a random model."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
