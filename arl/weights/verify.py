"""After a sync, check that every engine holds the trainer's weights (``weight_sync.verify``).

Each engine declares how (`arl.engines.base.WeightCheck`, in its class's ``weight_check``):

- ``CHECKSUM`` (hf): the engine's `weights_checksum` must equal train rank 0's, exactly.
- ``PROBE`` (the servers, which expose no weights): the engine and the trainer both score a
  fixed chat exchange (`PROBE_MESSAGES`); `probe_gap` gives the per-token difference's mean
  (shift) and mean absolute value (spread). Both are compared with their values before the
  first sync of the run (`WeightVerifier.measure_floor`: the same weights on both sides, so
  numerics only): each may move by at most ``weight_sync.verify_tolerance``.

A failed check raises `WeightSyncError` naming the engine and its node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from arl.config import Config
from arl.engines.base import WeightCheck
from arl.engines.spec import engine_class
from arl.weights.base import WeightSyncError

if TYPE_CHECKING:
    from arl.protocol.remote import RolloutWorkerAPI, TrainRanks

# What server engines and the trainer both score after a sync.
PROBE_MESSAGES = [
    {"role": "user", "content": "What is 12 * 7? Put the answer in \\boxed{}."},
    {"role": "assistant", "content": "12 * 7 = 84, so the answer is \\boxed{84}."},
]


def probe_gap(got: list[float], want: list[float]) -> tuple[float, float]:
    """(shift, spread) of per-token log-prob differences d = got - want: mean(d), mean(|d|).

    bf16 numerics make each d random-signed (SmolLM2-135M in bf16 against fp32, same weights,
    the 71-token probe: spread 0.054, shift 0.008), so they mostly cancel in the shift, while
    stale weights move the whole sequence's likelihood; the spread catches stale weights on
    engines whose numerics match the trainer's (spread 0 before any sync).
    """
    if len(got) != len(want) or not want:
        raise WeightSyncError(
            f"the probe was scored on {len(got)} tokens by the engine and {len(want)} by the "
            "trainer; both must score the same sequence"
        )
    diffs = [a - b for a, b in zip(got, want, strict=True)]
    return sum(diffs) / len(diffs), sum(abs(d) for d in diffs) / len(diffs)


class WeightVerifier:
    """Checks every rollout engine against the train ranks, each by its declared check.

    ``engines`` are (registered engine name, node id, worker) per rollout node; ``cfg`` gives
    ``weight_sync.verify_tolerance`` and ``rollout.dtype`` (the trainer scores the probe with
    its weights rounded to it).
    """

    def __init__(
        self,
        ranks: TrainRanks,
        engines: Sequence[tuple[str, str, RolloutWorkerAPI]],
        model_path: str,
        cfg: Config,
    ):
        self.ranks, self.model_path = ranks, model_path
        self.tolerance = cfg.weight_sync.verify_tolerance
        by = {c: [e for e in engines if engine_class(e[0]).weight_check is c] for c in WeightCheck}
        self.checksummed, self.probed = by[WeightCheck.CHECKSUM], by[WeightCheck.PROBE]
        # Scored with the weights in the servers' dtype: a sync in fp32 reaches a bf16 server
        # rounded, and rounding can undo an update smaller than bf16's spacing. With "auto"
        # the server picks its dtype from the model, unknown here: the weights stay unrounded.
        self.dtype = None if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
        self.floor: tuple[float, float] | None = None  # the probe's (shift, spread) at the start
        self._probe: list[int] | None = None

    async def measure_floor(self) -> None:
        """Before the first sync of this run (trainer and engines hold the same weights): the
        probe's shift (averaged) and spread (largest) over the probed engines, numerics only."""
        if self.probed:
            gaps = await self._probe_gaps()
            self.floor = (
                sum(shift for shift, _ in gaps) / len(gaps),
                max(spread for _, spread in gaps),
            )

    async def verify(self, version: int) -> dict:
        """Check every engine after the sync to ``version``; returns the ``sync/`` metrics."""
        out: dict = {}
        if self.checksummed:
            want = (await self.ranks.weights_checksum())[0]
            got = await asyncio.gather(*(w.weights_checksum() for _, _, w in self.checksummed))
            out.update({"sync/checksum_match": all(g == want for g in got), "sync/checksum": want})
        if self.probed:
            gaps = await self._probe_gaps()
            shift0, spread0 = self.floor or (0.0, 0.0)
            tol = self.tolerance
            for (engine, node_id, _), (shift, spread) in zip(self.probed, gaps, strict=True):
                if abs(shift - shift0) > tol or spread - spread0 > tol:
                    raise WeightSyncError(
                        f"after the sync to version {version}, the {engine} engine of node "
                        f"{node_id} scores the probe sequence away from the trainer: mean "
                        f"log-prob difference per token {shift:+.3f} (before any sync "
                        f"{shift0:+.3f}), mean |difference| {spread:.3f} (before any sync "
                        f"{spread0:.3f}), weight_sync.verify_tolerance={tol}: it does not "
                        "generate with the weights it was sent"
                    )
            out["sync/probe_mean_abs_diff"] = max(spread for _, spread in gaps)
            out["sync/probe_shift_change"] = max(abs(shift - shift0) for shift, _ in gaps)
            out["sync/probe_spread_change"] = max(spread - spread0 for _, spread in gaps)
            out["sync/probe_floor"] = spread0
        return out

    async def _probe_gaps(self) -> list[tuple[float, float]]:
        """`probe_gap` of each probed engine's log-probs of the probe against the trainer's."""
        probe = await self._probe_tokens()
        want = (await self.ranks.score(probe, self.dtype))[0]
        got = await asyncio.gather(*(w.score(probe) for _, _, w in self.probed))
        return [probe_gap(g, want) for g in got]

    async def _probe_tokens(self) -> list[int]:
        """The probe exchange in the policy's own chat template, as token ids (built once)."""
        if self._probe is None:
            from transformers import AutoTokenizer

            def build() -> list[int]:
                tok = AutoTokenizer.from_pretrained(self.model_path)
                text = tok.apply_chat_template(PROBE_MESSAGES, tokenize=False)
                return list(tok(text, add_special_tokens=False)["input_ids"])

            self._probe = await asyncio.get_running_loop().run_in_executor(None, build)
        return self._probe
