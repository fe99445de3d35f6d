"""A run's dataset rows (`load_data`, through ``data.loader``) and `StatefulLoader`: batches of
them in shuffled epochs, resumable at the exact position."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

from arl.config import Config
from arl.data.gsm8k import DatasetError
from arl.protocol.imports import resolve_import

log = logging.getLogger("arl.data")


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The training rows, and the evaluation rows (none without ``evaluator.freq_steps``)."""
    rows = load_rows(cfg, cfg.data.train_split)
    if not cfg.evaluator.freq_steps:
        return rows, []
    return rows, load_rows(cfg, cfg.data.eval_split)[: cfg.evaluator.max_questions or None]


def load_rows(cfg: Config, split: str) -> list[dict]:
    """Dataset rows of ``split`` through ``data.loader`` (rows carry chat ``messages``)."""
    loader = resolve_import(cfg.data.loader, tuple(cfg.cluster.allowed_import_prefixes))
    rows, stats = _loaded(loader(cfg.data.path, split, cfg.data.on_bad_row))
    skipped = stats.skipped if hasattr(stats, "skipped") else stats.get("skipped", 0)
    if skipped:
        log.warning("%s/%s: skipped %d malformed rows", cfg.data.path, split, skipped)
    return rows


_CONTRACT = (
    "a loader returns (rows, stats): rows a list of dicts (chat 'messages' and what the reward "
    "reads), stats a dict such as {'skipped': 0} or an object with .skipped"
)


def _loaded(out: Any) -> tuple[Sequence[dict], Any]:
    """A loader's ``(rows, stats)``, checked: one of another shape is refused (`DatasetError`)
    here, not met as an exception wherever the rows are first read."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise DatasetError(f"the loader returned {_what(out)}, not (rows, stats); {_CONTRACT}")
    rows, stats = out
    if isinstance(rows, str | bytes | dict) or not isinstance(rows, Sequence):
        raise DatasetError(f"the loader's rows are {_what(rows)}, not a list; {_CONTRACT}")
    bad = next((r for r in rows if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"the loader's rows hold {_what(bad)}, not only dicts; {_CONTRACT}")
    if not (hasattr(stats, "skipped") or isinstance(stats, dict)):
        raise DatasetError(f"the loader's stats are {_what(stats)}; {_CONTRACT}")
    return rows, stats


def _what(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


class StatefulLoader:
    """Endless batches over ``rows``; each epoch is a fresh permutation derived from (seed, epoch).

    A batch never spans two epochs; the last partial batch of an epoch is dropped when
    ``drop_last`` (the default). ``state_dict()`` / ``load_state_dict()`` resume exactly.
    """

    def __init__(
        self,
        rows: Sequence[Any],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        if not rows or (drop_last and len(rows) < batch_size):
            raise ValueError(
                f"{len(rows)} rows cannot fill one batch of {batch_size}; lower batch_size "
                "or pass drop_last=False"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._pos = 0  # index into the current epoch's order of the next row
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in each epoch."""
        full, rest = divmod(len(self.rows), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def next_batch(self) -> list[Any]:
        """The next batch, starting a new epoch when this one has no batch left."""
        remaining = len(self._order) - self._pos
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self._pos = 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += len(idx)
        return [self.rows[i] for i in idx]

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        """The position (epoch, row offset) plus what must match on restore."""
        return {
            "epoch": self.epoch,
            "pos": self._pos,
            "seed": self.seed,
            "n_rows": len(self.rows),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume at ``state``'s position; refuses a state from different rows or settings."""
        mine = self.state_dict()
        for key in ("seed", "n_rows", "batch_size", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {mine[key]!r}; "
                    "resume with the same data and loader settings"
                )
        self.epoch = int(state["epoch"])
        self._order = self._epoch_order(self.epoch)
        self._pos = int(state["pos"])

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            # A string seed is hashed deterministically (sha512), unlike hash() of a tuple.
            random.Random(f"arl-loader:{self.seed}:{epoch}").shuffle(order)
        return order
