"""Recovery checkpoints: written atomically, so a crash (or a full disk) mid-write leaves the
previous one valid.

Layout under ``<run_dir>/recover/``: ``step<N>/`` holds ``model/`` (model and optimizer through
torch.distributed.checkpoint, written by the train ranks) and ``state.json`` (step, version,
the rollout controller's loader position and staleness counters). ``latest`` names the newest
complete one; it is replaced (rename) only after everything else is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs


@attrs.define
class RecoveryState:
    """The loop state saved beside the model: enough to resume at the next step."""

    step: int
    version: int
    rollout: dict
    path: Path | None = None


class Saver:
    """Writes and finds recovery checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, keep: int = 1):
        self.root = Path(run_dir) / "recover"
        self.keep = keep

    @asynccontextmanager
    async def write(self, state: RecoveryState) -> AsyncIterator[Path]:
        """Yield a scratch folder to write the model into; commit it with ``state`` after."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step{state.step}"
        tmp = self.root / f"step{state.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            body = {"step": state.step, "version": state.version, "rollout": state.rollout}
            (tmp / "state.json").write_text(json.dumps(body))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name)
            os.replace(pointer, self.root / "latest")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(final.name)

    def latest(self) -> RecoveryState | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        body = json.loads((path / "state.json").read_text())
        return RecoveryState(body["step"], body["version"], body["rollout"], path)

    def _prune(self, newest: str) -> None:
        done = sorted(
            (p for p in self.root.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")),
            key=lambda p: int(p.name[4:]),
        )
        for p in done[: -self.keep]:
            if p.name != newest:
                shutil.rmtree(p, ignore_errors=True)
