"""Engine hosting on a rollout node: the engine, the workflow beside it, and their shards.

The controller creates one `RolloutWorker` per rollout node and calls ``setup()`` once. Each
``run_group`` runs the workflow on one dataset row, keeps the resulting trajectory in the node's
shard store, and answers with its metadata only (key, sizes, token count, rewards, versions):
the tensors stay here until a train rank pulls them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import torch

from arl.engines.base import Engine, SamplingParams, WeightTarget, refuse_target
from arl.engines.spec import EngineSpec, build_engine
from arl.protocol.errors import ErrorKind
from arl.protocol.hosting import NodeContext, UsesNode
from arl.protocol.imports import ImportRefused, resolve_import
from arl.protocol.report import (
    SAMPLE_TEXT_CHARS,
    GroupReport,
    RejectedGroup,
    ReportError,
    Trajectory,
)
from arl.transformers_imports import prepare_transformers_import
from arl.workflows.base import EpisodeRejected

log = logging.getLogger("arl.rollout")


def data_id(row: dict) -> str:
    """A short stable id of a dataset row (its prompt), for logs and batch-order checks."""
    blob = json.dumps(row.get("messages", row), sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


class GroupTimeout(TimeoutError):
    """A prompt group ran longer than ``rollout.group_timeout``; it was cancelled and dropped."""

    error_kind = ErrorKind.GROUP_TIMEOUT


def as_async_reward(fn: Any, target: str) -> Callable[[str, dict[str, Any]], Awaitable[float]]:
    """``rollout.reward`` as the workflows call it: an ``async def`` is awaited on the loop; a
    plain function runs in a worker thread, so a slow score never blocks the node's event loop
    (a coroutine it returns is awaited on the loop, but the function itself has no running
    loop: one that schedules work on the loop must be an ``async def``). Anything not callable
    is refused naming ``target``, and so is a score that is not a finite number."""
    if not callable(fn):
        raise TypeError(
            f"rollout.reward={target} is a {type(fn).__name__}, not a function; name a function "
            "(completion: str, data: dict) -> float, plain or async def"
        )
    on_loop = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)

    @functools.wraps(fn)
    async def reward(completion: str, data: dict[str, Any]) -> float:
        out = fn(completion, data) if on_loop else await asyncio.to_thread(fn, completion, data)
        return _score(await out if inspect.isawaitable(out) else out, target)

    return reward


def _score(out: Any, target: str) -> float:
    """A reward's return as a float; one that is not a finite number is refused naming the
    reward (a NaN would only show as training steps skipped for a non-finite gradient)."""
    try:
        value = float(out)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value):
        shown = repr(out)[:80]
        raise TypeError(
            f"rollout.reward={target} returned {shown} ({type(out).__name__}), not a finite "
            "number; a reward returns a float (e.g. 1.0 for a correct answer, 0.0 otherwise)"
        )
    return value


class RolloutWorker(UsesNode):
    """Hosts an inference engine and runs workflow episodes into the node's shard store."""

    def __init__(
        self,
        *,
        model_path: str,
        engine: dict | None = None,
        engine_options: dict | None = None,
        workflow: str = "arl.workflows.rlvr:RLVRWorkflow",
        reward: str = "arl.rewards.gsm8k:gsm8k_reward",
        sampling: dict | None = None,
        n_samples: int = 4,
        max_prompt_len: int = 512,
        prompt_overflow: str = "error",
        group_timeout: float | None = None,
        agent: str = "",
        workflow_kwargs: dict | None = None,
        node: NodeContext | None = None,
    ):
        self.model_path = model_path
        # The engine's `EngineSpec` in wire form (default: the hf engine on the CPU); the
        # options are further constructor arguments of its class (a server's env, say).
        self.engine_spec = EngineSpec.from_wire(
            engine if engine is not None else EngineSpec(name="hf", model_path=model_path).to_wire()
        )
        self.engine_options = dict(engine_options or {})
        self.reward_target, self.workflow_target = reward, workflow
        self.sampling = SamplingParams(**(sampling or {}))
        self.n_samples, self.max_prompt_len = n_samples, max_prompt_len
        self.prompt_overflow = prompt_overflow
        self.group_timeout = group_timeout
        self.agent_target, self.workflow_kwargs = agent, dict(workflow_kwargs or {})
        self.node = node  # the hosting node: its prefixes, shard store and stop (None: a test's)
        self.engine: Engine | None = None
        self.workflow: Any = None
        self.groups_done = 0
        self.groups_failed = 0
        self._engine_watch: asyncio.Task | None = None

    async def setup(self) -> dict:
        """Load the engine and tokenizer (imports checked against the node's prefixes)."""
        prefixes = self.node.allowed_prefixes if self.node else ("arl.",)
        loop = asyncio.get_running_loop()
        # All are checked before any is imported; a refusal names what it was for.
        for what, target in (
            ("rollout.reward", self.reward_target),
            ("rollout.workflow", self.workflow_target),
            *((("rollout.agent", self.agent_target),) if self.agent_target else ()),
        ):
            try:
                resolve_import(target, prefixes, import_now=False)
            except ImportRefused as e:
                raise ImportRefused(f"{what}: {e}") from None

        def load() -> tuple:
            # Imports (transformers, torch) and model loading take seconds: never on the loop,
            # or the node's heartbeats stall and the controller declares it lost.
            t = [time.perf_counter()]  # each phase's end, for the log line below
            prepare_transformers_import()  # before transformers' first import
            from transformers import AutoTokenizer

            t.append(time.perf_counter())
            scorer = resolve_import(self.reward_target, prefixes)
            reward_fn = as_async_reward(scorer, self.reward_target)
            warm_up = getattr(scorer, "warm_up", None)
            if callable(warm_up):  # e.g. verify workers, whose imports overlap the engine's load
                started = warm_up()
                if asyncio.iscoroutine(started):
                    started.close()
                    raise TypeError(
                        f"{self.reward_target}.warm_up is async; make it a plain function (it "
                        "runs once in a thread at rollout setup)"
                    )
            workflow_cls = resolve_import(self.workflow_target, prefixes)
            if self.agent_target:  # the agent workflow's `run(client, data)`
                self.workflow_kwargs["agent"] = resolve_import(self.agent_target, prefixes)
            t.append(time.perf_counter())
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            t.append(time.perf_counter())
            engine = build_engine(self.engine_spec, **self.engine_options)  # hf loads here
            t.append(time.perf_counter())
            # One line that `python -m arl.bench startup` reads back from the run's log.
            log.info(
                "rollout setup in %.1f s (imports %.1f s, reward and workflow %.1f s, "
                "tokenizer %.1f s, engine %.1f s)",
                t[-1] - t[0],
                *(b - a for a, b in zip(t, t[1:], strict=False)),
            )
            return engine, reward_fn, workflow_cls, tokenizer

        self.engine, reward_fn, workflow_cls, tokenizer = await loop.run_in_executor(None, load)
        await self.engine.start()  # server engines (vllm, sglang) start their process here
        if self.node is not None:
            self._engine_watch = asyncio.create_task(self._stop_node_when_engine_fails())
        stop = set(self.sampling.stop_token_ids)
        if tokenizer.eos_token_id is not None:
            stop.add(int(tokenizer.eos_token_id))
        self.sampling.stop_token_ids = sorted(stop)
        self.workflow = workflow_cls(
            tokenizer,
            reward_fn,
            self.sampling,
            n_samples=self.n_samples,
            max_prompt_len=self.max_prompt_len,
            prompt_overflow=self.prompt_overflow,
            **self.workflow_kwargs,
        )
        return await self.engine.health()

    async def _stop_node_when_engine_fails(self) -> None:
        """A rollout node whose engine died (a server exited, a decode thread crashed) cannot
        serve: it stops, and the controller sees it leave with the engine's reason (for a
        server, its exit status and log)."""
        failure = await self.engine.wait_failed()
        self.node.stop(str(failure))

    # ---- episodes ---------------------------------------------------------------------------
    async def run_group(self, key: str, data: dict) -> dict:
        """Run one prompt group, store it under ``key``; returns its metadata (no tensors).

        A group that takes longer than ``group_timeout`` seconds is cancelled here (its
        generations are aborted, nothing is stored) and `GroupTimeout` is raised.
        """
        t0 = time.monotonic()
        deadline = asyncio.timeout(self.group_timeout)
        try:
            async with deadline:
                group = await self.workflow.arun_episode(self.engine, data)
        except EpisodeRejected as e:
            return self._rejected(key, data, str(e), e.failed_samples, t0)
        except TimeoutError:
            if not deadline.expired():  # a timeout inside the workflow (a reward, a request)
                raise
            node = self.node.node_id if self.node is not None else "?"
            raise GroupTimeout(
                f"prompt group {key} ({data_id(data)}) ran longer than rollout.group_timeout="
                f"{self.group_timeout}s on node {node}; it was abandoned"
            ) from None
        if group is None:
            return self._rejected(key, data, "the workflow returned None", 0, t0)
        try:
            traj = Trajectory.of(group)
        except ReportError as e:
            raise ReportError(f"{self.workflow_target}: {e}") from None
        shard = traj.tensors
        meta = self.node.store.put(key, shard)
        self.groups_done += 1
        gen = shard["loss_mask"]
        versions = shard["versions"][gen]
        return GroupReport(
            key=key,
            meta=meta.to_wire(),
            group_size=int(shard["rewards"].numel()),
            rewards=shard["rewards"].tolist(),
            episode_rewards=traj.rewards(),
            n_gen_tokens=int(gen.sum()),
            min_version=int(versions.min()) if versions.numel() else -1,
            max_version=int(versions.max()) if versions.numel() else -1,
            seconds=time.monotonic() - t0,
            data_id=data_id(data),
            sample_text=traj.texts[0][:SAMPLE_TEXT_CHARS] if traj.texts else "",
            failed_samples=traj.failed_samples,
        ).to_wire()

    def _rejected(self, key: str, data: dict, reason: str, failed: int, t0: float) -> dict:
        """The answer for a row the workflow rejected: no shard, the reason and counts."""
        return RejectedGroup(key, reason, failed, time.monotonic() - t0, data_id(data)).to_wire()

    async def evaluate(
        self,
        rows: list[dict],
        n_samples: int = 1,
        temperature: float = 0.0,
        max_new_tokens: int | None = None,
    ) -> list[float]:
        """Mean reward per row under evaluation sampling (greedy at temperature 0); no shards."""
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens or self.sampling.max_new_tokens,
            temperature=temperature if temperature > 0 else 1.0,
            greedy=temperature <= 0,
            stop_token_ids=list(self.sampling.stop_token_ids),
        )
        groups = await asyncio.gather(
            *(self.workflow.arun_episode(self.engine, row, sampling, n_samples) for row in rows),
            return_exceptions=True,
        )
        for g in groups:  # a rejected row scores 0; any other error is raised
            if isinstance(g, BaseException) and not isinstance(g, EpisodeRejected):
                raise g
        return [
            0.0 if isinstance(g, EpisodeRejected) or g is None else Trajectory.of(g).score()
            for g in groups
        ]

    # ---- engine control (weight sync) -------------------------------------------------------
    async def pause(self, in_place: bool = False) -> None:
        """Stop in-flight generations (kept in the engine with ``in_place`` where it can, else
        aborted and resubmitted); either way they continue after resume()."""
        if not isinstance(in_place, bool):  # it crossed the wire: a string would be truthy
            raise TypeError(f"pause(in_place=...) takes true or false, got {in_place!r}")
        await self.engine.pause(in_place)

    async def resume(self) -> None:
        """Let generation continue."""
        await self.engine.resume()

    async def set_version(self, version: int) -> None:
        """Stamp tokens generated from now on with ``version``."""
        self.engine.set_version(version)

    async def sleep(self, drop_weights: bool = False) -> int:
        """Free the engine's GPU memory while a train rank uses it (rollout.gpu_sharing=sleep):
        in-flight generations are aborted and wait, resubmitted, until `wake` and `resume`;
        ``drop_weights`` also frees the weights a sync rewrites. Returns the bytes freed."""
        if not isinstance(drop_weights, bool):  # it crossed the wire: a string would be truthy
            raise TypeError(f"sleep(drop_weights=...) takes true or false, got {drop_weights!r}")
        return await self.engine.sleep(drop_weights)

    async def wake(self) -> None:
        """Reallocate what `sleep` freed; the engine stays paused until `resume`."""
        await self.engine.wake()

    @property
    def weights_device(self) -> torch.device | None:
        """The device `update_weights` copies onto; None for an engine that does not take
        tensors (`WeightTarget.TENSORS`), such as a server that loads weights itself."""
        if WeightTarget.TENSORS not in self.engine.weight_targets:
            return None
        return self.engine.weights_device

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors into the engine (paused; blocking: call it off the event loop).
        The weight-sync plug-ins (arl.weights) move weights here."""
        if WeightTarget.TENSORS not in self.engine.weight_targets:
            raise refuse_target(self.engine, WeightTarget.TENSORS)
        return self.engine.update_weights(named)

    async def update_weights_from_disk(self, path: str) -> None:
        """Load the HF-format folder ``path`` into the engine (paused)."""
        if WeightTarget.DIRECTORY not in self.engine.weight_targets:
            raise refuse_target(self.engine, WeightTarget.DIRECTORY)
        await self.engine.update_weights_from_disk(path)

    async def weights_checksum(self) -> str | None:
        """The engine's weight checksum (the trainer compares it with its own), or None where
        the engine cannot compute one."""
        return await self.engine.weights_checksum()

    async def score(self, token_ids: list[int]) -> list[float]:
        """The server engine's log-probs of ``token_ids[1:]`` (weight verification)."""
        return await self.engine.score(token_ids)

    async def health(self) -> dict:
        """Engine health plus this worker's counters."""
        h = await self.engine.health()
        return {**h, "groups_done": self.groups_done}

    async def aclose(self) -> None:
        """End the engine (and any server it started)."""
        if self._engine_watch is not None:
            self._engine_watch.cancel()
            self._engine_watch = None
        if self.engine is not None:
            await self.engine.aclose()
