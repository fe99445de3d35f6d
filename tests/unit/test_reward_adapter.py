"""`as_async_reward`: what ``rollout.reward`` may name and how the workflows then call it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from arl.node.rollout import as_async_reward


async def _async_reward(completion: str, data: dict) -> float:
    return 1.0


class _Scorer:
    async def __call__(self, completion: str, data: dict) -> float:
        return 2.0


def test_async_rewards_run_on_the_loop_and_plain_ones_in_a_thread() -> None:
    seen = {}

    async def on_loop(completion: str, data: dict) -> float:
        seen["async"] = threading.get_ident()
        return 1.0

    def plain(completion: str, data: dict) -> float:
        seen["plain"] = threading.get_ident()
        return 0.0

    async def main() -> list[float]:
        seen["loop"] = threading.get_ident()
        return [
            await as_async_reward(on_loop, "m:f")("", {}),
            await as_async_reward(_Scorer(), "m:s")("", {}),
            await as_async_reward(plain, "m:p")("", {}),
        ]

    assert asyncio.run(main()) == [1.0, 2.0, 0.0]
    assert seen["async"] == seen["loop"] != seen["plain"]


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


@pytest.mark.parametrize("score", ["yes", None, float("nan"), float("inf"), [1.0]])
def test_a_score_that_is_not_a_finite_number_is_refused_naming_the_reward(score) -> None:
    async def reward(completion: str, data: dict):
        return score

    def plain(completion: str, data: dict):
        return score

    for fn in (reward, plain):
        with pytest.raises(TypeError, match=r"rollout.reward=m:r returned .*not a finite number"):
            asyncio.run(as_async_reward(fn, "m:r")("", {}))


def test_a_score_float_accepts_is_a_float() -> None:
    def flag(completion: str, data: dict) -> bool:
        return completion == "42"

    assert asyncio.run(as_async_reward(flag, "m:flag")("42", {})) == 1.0
