"""`as_async_reward`: what ``rollout.reward`` may name and how the workflows then call it."""

from __future__ import annotations

import asyncio

import pytest

from arl.node.rollout import as_async_reward


async def _async_reward(completion: str, data: dict) -> float:
    return 1.0


class _Scorer:
    async def __call__(self, completion: str, data: dict) -> float:
        return 2.0


def test_async_rewards_are_called_as_they_are() -> None:
    scorer = _Scorer()
    assert as_async_reward(_async_reward, "m:f") is _async_reward
    assert as_async_reward(scorer, "m:s") is scorer


def test_a_plain_function_is_awaited_and_may_return_an_awaitable() -> None:
    def plain(completion: str, data: dict) -> float:
        return len(completion) + data["x"]

    def returns_a_coroutine(completion: str, data: dict):
        return _async_reward(completion, data)

    async def main() -> list[float]:
        return [
            await as_async_reward(plain, "m:plain")("abc", {"x": 1}),
            await as_async_reward(returns_a_coroutine, "m:c")("", {}),
        ]

    assert asyncio.run(main()) == [4, 1.0]


def test_what_is_not_callable_is_refused_naming_the_target() -> None:
    with pytest.raises(TypeError, match=r"rollout.reward=m:x is a dict, not a function"):
        as_async_reward({}, "m:x")
