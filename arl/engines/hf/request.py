"""A generation request of the hf engine and how its answer reaches the caller's event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs

from arl.engines.base import FinishReason, GenerationResult


@attrs.define(eq=False)
class Request:
    prompt: list[int]
    max_new: int
    stop: frozenset[int]
    temperature: float  # the T of the returned log-probs (1 for greedy with temperature 0)
    top_p: float
    top_k: int
    greedy: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    out: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    pos: int = 0  # tokens held in this request's cache row, counting a step in flight
    cancelled: bool = False
    done: bool = False  # answered: a step launched before that was known is not read back

    def result(self, reason: FinishReason) -> GenerationResult:
        return GenerationResult(self.out, self.logprobs, self.versions, reason)


def settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller gave up (cancelled) meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def deliver(req: Request, result: Any = None, error: BaseException | None = None) -> None:
    try:
        req.loop.call_soon_threadsafe(settle, req.future, result, error)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting for this answer
        pass
