"""Recovery checkpoints: written atomically, so a crash (or a full disk) mid-write leaves the
previous one valid.

Layout under ``<run_dir>/recover/``: ``step<N>/`` holds ``model/`` (model and optimizer through
torch.distributed.checkpoint, written by the train ranks) and ``state.json`` (step, version,
the rollout controller's loader position and staleness counters). ``latest`` names the newest
complete one; it is replaced (rename) only after everything else is on disk (and fsynced).

A checkpoint is written into ``step<N>.tmp/`` and renamed when complete. If anything fails on
the way (``ENOSPC``, a lost train node), the partial folder is removed, ``latest`` still names
the previous checkpoint, and `CheckpointError` says where and why.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs


class CheckpointError(RuntimeError):
    """A recovery checkpoint could not be written; the previous one (if any) is still valid."""


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
        final = self.root / f"step{state.step}"
        tmp = self.root / f"step{state.step}.tmp"
        pointer = self.root / "latest.tmp"
        previous = self._latest_name()
        if previous == final.name:
            raise CheckpointError(f"{final} is the latest checkpoint; it is never overwritten")
        committed = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            yield tmp
            body = {"step": state.step, "version": state.version, "rollout": state.rollout}
            _write_synced(tmp / "state.json", json.dumps(body))
            shutil.rmtree(final, ignore_errors=True)  # an uncommitted leftover, never `latest`
            os.replace(tmp, final)
            committed = True
            _write_synced(pointer, final.name)
            os.replace(pointer, self.root / "latest")
            _fsync_dir(self.root)
        except BaseException as e:
            full = _full_disk_note(self.root, previous)  # before freeing the partial files
            shutil.rmtree(tmp, ignore_errors=True)
            if committed:  # renamed but not pointed to: not a checkpoint
                shutil.rmtree(final, ignore_errors=True)
            pointer.unlink(missing_ok=True)
            if not isinstance(e, Exception):
                raise
            kept = f"{self.root / previous} is still the latest" if previous else "none is kept"
            raise CheckpointError(
                f"writing the recovery checkpoint of step {state.step} to {tmp} failed: "
                f"{_describe(e)}{full}; the partial checkpoint was removed and {kept}"
            ) from e
        self._prune(final.name)

    def _latest_name(self) -> str | None:
        pointer = self.root / "latest"
        return pointer.read_text().strip() if pointer.exists() else None

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


def _describe(e: BaseException) -> str:
    """``Type: message`` of an error; for a node's error (RemoteError) its remote type and
    message without the traceback."""
    type_name = getattr(e, "type_name", type(e).__name__)
    message = getattr(e, "remote_message", None) or str(e)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 2:  # e.g. torch's CheckpointException: a header, a traceback, the cause
        lines = [lines[0], "...", lines[-1]]
    return f"{type_name}: {' '.join(lines)}"


def _full_disk_note(root: Path, previous: str | None) -> str:
    """A note when the filesystem of ``root`` is (nearly) full: torch's checkpoint writer turns
    ENOSPC into "unexpected pos ..." errors, so the free space itself is the evidence."""
    need = 16 * 2**20
    try:
        st = os.statvfs(root)
        if previous:
            files = (f for f in (root / previous).rglob("*") if f.is_file())
            need = max(need, sum(f.stat().st_size for f in files))
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return ""
    return (
        f" (no space left on device: {free / 2**20:.1f} MiB free on the filesystem of {root}, "
        f"a checkpoint needs about {need / 2**20:.1f} MiB)"
    )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
