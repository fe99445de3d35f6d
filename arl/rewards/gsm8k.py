"""GSM8K reward by math-verify, and the reward signature every arl reward follows::

    async def reward(completion: str, data: dict) -> float

``completion`` is the generated text (prompt excluded) and ``data`` the dataset row the prompt
came from. A reward never raises for a bad completion: wrong, unparsable, a check that times out
or errors all give 0.0 (timeouts and errors are counted in ``default_pool().stats``). A reward
may carry a ``warm_up()`` attribute, which the rollout worker calls once at setup (in a thread)
to start what its first call would otherwise start inside the first batch: these rewards start
the math-verify workers there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from arl.data.gsm8k import gsm8k_gold
from arl.rewards.verify_pool import default_pool, start_default_pool

RewardFn = Callable[[str, dict[str, Any]], Awaitable[float]]

VERIFY_TIMEOUT_S = 5.0


async def gsm8k_reward(completion: str, data: dict[str, Any]) -> float:
    """1.0 if the completion's answer (``\\boxed{}`` preferred) equals the number after ``####``.

    Raises `arl.data.gsm8k.DatasetError` if ``data["answer"]`` has no ``####`` (a data bug).
    """
    gold = gsm8k_gold(data["answer"])
    return await default_pool().verify(gold, completion, timeout=VERIFY_TIMEOUT_S)


gsm8k_reward.warm_up = start_default_pool  # type: ignore[attr-defined]
