"""Reward for generated multiplication rows (`arl.data.arith`); signature: `arl.rewards.gsm8k`."""

from __future__ import annotations

from typing import Any

from arl.rewards.gsm8k import VERIFY_TIMEOUT_S
from arl.rewards.verify_pool import default_pool, start_default_pool


async def arith_reward(completion: str, data: dict[str, Any]) -> float:
    """1.0 if the completion's answer (``\\boxed{}`` preferred) equals ``data["answer"]``."""
    return await default_pool().verify(str(data["answer"]), completion, timeout=VERIFY_TIMEOUT_S)


arith_reward.warm_up = start_default_pool  # type: ignore[attr-defined]
