"""Rollout and train workers that take configured times instead of running a model.

They answer the same calls as `arl.node.rollout.RolloutWorker` and `arl.node.train.TrainWorker`
on real ``arl-node`` processes, so the real trainer loop, rollout controller, staleness semaphore,
shard pulls and weight sync drive them (``python -m arl.bench sim``):

- `SimRolloutWorker.run_group` "generates" for ``gen_time`` seconds (± ``jitter``) of engine
  time, then stores a real trajectory shard of ``seq_len`` generated tokens per sample. The
  engine clock stops while paused; each token carries the version in force at the engine time
  it was produced, so versions across a pause/resume are as honest as a real engine's. Groups
  run concurrently (an engine batches them), so a node's batch of groups takes ``gen_time``.
- `SimTrainWorker.load_batch` gets its shards pulled for real; ``ppo_update`` holds the node's
  engine thread for ``train_time``; the published weights are one small bucket.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections.abc import Iterator

import torch

from arl.node.rollout import data_id
from arl.protocol.hosting import NodeContext, UsesNode


class SimRolloutWorker(UsesNode):
    """A rollout node whose engine takes ``gen_time`` seconds per group, whatever the load."""

    def __init__(
        self,
        *,
        gen_time: float,
        jitter: float = 0.1,
        n_samples: int = 4,
        seq_len: int = 16,
        prompt_len: int = 8,
        seed: int = 0,
        node: NodeContext | None = None,
    ):
        if gen_time <= 0 or not 0 <= jitter < 1:
            raise ValueError(f"gen_time={gen_time} must be > 0 and jitter={jitter} in [0, 1)")
        self.gen_time, self.jitter = gen_time, jitter
        self.n_samples, self.seq_len, self.prompt_len = n_samples, seq_len, prompt_len
        self.rng = random.Random(seed)
        self.node = node
        self.version = 0
        self.groups_done = 0
        self.weight_bytes_loaded = 0
        # Engine time: wall time minus time spent paused. Version changes are recorded at the
        # engine time they took effect, so a token's version follows from when it was made.
        self._paused_total = 0.0
        self._paused_at: float | None = None
        self._changes_at: list[float] = [0.0]
        self._changes_version: list[int] = [0]
        self._running = asyncio.Event()
        self._running.set()

    async def setup(self) -> dict:
        """Nothing to load."""
        return await self.health()

    def _engine_now(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return now - self._paused_total

    def _version_at(self, engine_t: float) -> int:
        i = bisect.bisect_right(self._changes_at, engine_t) - 1
        return self._changes_version[max(i, 0)]

    async def run_group(self, key: str, data: dict) -> dict:
        """Generate for ``gen_time`` (± jitter) of engine time; store the group under ``key``."""
        t0 = time.monotonic()
        need = self.gen_time * (1 + self.jitter * self.rng.uniform(-1, 1))
        start = self._engine_now()
        while (left := start + need - self._engine_now()) > 0:
            await self._running.wait()
            await asyncio.sleep(left)
        n, P, T = self.n_samples, self.prompt_len, self.seq_len
        # Token i of every sample was produced at engine time start + need * (i + 1) / T.
        token_versions = [self._version_at(start + need * (i + 1) / T) for i in range(T)]
        versions = torch.full((n, P + T), -1, dtype=torch.int32)
        versions[:, P:] = torch.tensor(token_versions, dtype=torch.int32)
        loss_mask = torch.zeros(n, P + T, dtype=torch.bool)
        loss_mask[:, P:] = True
        rewards = torch.tensor([float(self.rng.random() < 0.5) for _ in range(n)])
        shard = {
            "input_ids": torch.randint(0, 1000, (n, P + T), dtype=torch.int64),
            "attention_mask": torch.ones(n, P + T, dtype=torch.bool),
            "loss_mask": loss_mask,
            "logprobs": torch.zeros(n, P + T, dtype=torch.float32),
            "versions": versions,
            "rewards": rewards,
        }
        meta = self.node.store.put(key, shard)
        self.groups_done += 1
        return {
            "key": key,
            "meta": meta.to_wire(),
            "group_size": n,
            "rewards": rewards.tolist(),
            "n_gen_tokens": n * T,
            "min_version": min(token_versions),
            "max_version": max(token_versions),
            "seconds": time.monotonic() - t0,
            "data_id": data_id(data),
            # A real worker sends the first sample's text (up to 500 characters): same size here.
            "sample_text": "x" * 500,
        }

    async def pause(self, in_place: bool = False) -> None:
        """Stop the engine clock (generation resumes where it was, in either mode)."""
        if self._paused_at is None:
            self._paused_at = time.monotonic()
            self._running.clear()

    async def resume(self) -> None:
        """Restart the engine clock."""
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None
            self._running.set()

    async def set_version(self, version: int) -> None:
        """Tokens produced from now on (in engine time) carry ``version``."""
        self._changes_at.append(self._engine_now())
        self._changes_version.append(version)
        self.version = version

    weights_device = torch.device("cpu")  # what the zmq weight sync copies into

    def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Take the pulled weights (their bytes came over the data plane)."""
        self.weight_bytes_loaded += sum(t.numel() * t.element_size() for _, t in named)
        return len(named)

    async def health(self) -> dict:
        """What a real worker's health says, as far as the trainer reads it."""
        return {"dtype": "float32", "groups_done": self.groups_done, "version": self.version}


class SimTrainWorker:
    """A train rank whose PPO update holds the node's engine thread for ``train_time``."""

    def __init__(
        self, *, rank: int, world_size: int, train_time: float, weight_bytes: int = 1 << 16
    ):
        if train_time < 0:
            raise ValueError(f"train_time={train_time} must be >= 0")
        self.rank, self.world_size = rank, world_size
        self.train_time, self.weight_bytes = train_time, weight_bytes
        self.batch: list[dict[str, torch.Tensor]] | None = None
        self.steps = 0

    def warm_up(self) -> float:
        """No first-pass costs to pay: the simulated update only takes time."""
        return 0.0

    def load_batch(self, shards: list[dict[str, torch.Tensor]]) -> dict:
        """Keep this rank's pulled shards; count what arrived."""
        if not shards:
            raise ValueError(f"rank {self.rank} got no shards")
        self.batch = shards
        n_tokens = sum(int(s["attention_mask"].sum()) for s in shards)
        return {"n_seqs": sum(int(s["rewards"].numel()) for s in shards), "n_tokens": n_tokens}

    def compute_logp(self) -> None:
        """Proximal log-probs: part of the configured train time."""

    def compute_advantages(self) -> dict:
        """Reward statistics of this rank's batch."""
        r = torch.cat([s["rewards"] for s in self.batch or []])
        return {"reward_sum": float(r.sum()), "n_seqs": int(r.numel())}

    def ppo_update(self) -> dict:
        """Hold the engine thread for ``train_time`` seconds."""
        time.sleep(self.train_time)
        self.steps += 1
        tokens = sum(int(s["loss_mask"].sum()) for s in self.batch or [])
        return {"n_tokens": tokens, "steps": self.steps}

    def end_step(self) -> None:
        """Drop the step's shards (the controller frees them on every node)."""
        self.batch = None

    def set_sync_dtype(self, dtype: str | None) -> None:
        """Nothing to convert."""

    def tied_weights(self) -> dict[str, str]:
        """No tied weights: the one tensor of `full_state`."""
        return {}

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's "weights": one tensor of ``weight_bytes`` (what the zmq sync publishes)."""
        if self.rank == 0:
            yield "w", torch.full((self.weight_bytes // 4,), float(self.steps), dtype=torch.float32)
