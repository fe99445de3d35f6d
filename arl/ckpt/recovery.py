"""Recovery checkpoints: written atomically, so a crash (or a full disk) mid-write leaves the
previous one valid.

Layout under ``<run_dir>/recover/``: ``step<N>/`` holds ``model/`` (each train rank's
trainable weights, optimizer and RNG state as data: `arl.ckpt.rank_state`) and ``state.json``
(step, version, the rollout controller's loader position and staleness counters, whether a stop
wrote it, and ``carry``: the settings and data identity a resume must share, `resume_keys`).
``latest`` names the newest complete one; it is replaced (rename) only after everything else is
on disk (and fsynced). Nothing here is unpickled: JSON and safetensors only.

Which checkpoint a run resumes from (`RecoveryState.resumes`): the latest, short of
``experiment.total_train_steps``, with ``recover.mode=auto`` or when a stop (SIGTERM, Ctrl-C)
wrote it, unless a run already went on from it to its last step (``spent``, `Saver.settle`).
`check_resume` refuses, before any node starts, a checkpoint whose settings differ in what a
resume cannot carry, naming the keys.

A checkpoint is written into ``step<N>.tmp/`` and renamed when complete. If anything fails on
the way (``ENOSPC``, a lost train node), the partial folder is removed, ``latest`` still names
the previous checkpoint, and `CheckpointError` says where and why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger("arl.ckpt")


class CheckpointError(RuntimeError):
    """A recovery checkpoint could not be written; the previous one (if any) is still valid."""


@attrs.define
class RecoveryState:
    """The loop state saved beside the model: enough to resume at the next step."""

    step: int
    version: int
    rollout: dict
    path: Path | None = None
    stopped: bool = False  # written by a stop (SIGTERM, Ctrl-C): a rerun resumes from it
    carry: dict | None = None  # `resume_keys` of the run that wrote it
    spent: bool = False  # a later run went on from it to its last step (`Saver.settle`)

    def resumes(self, mode: str, total_steps: int) -> bool:
        """Whether a run of ``total_steps`` with ``recover.mode=mode`` continues from it."""
        return self.step < total_steps and not self.spent and (mode == "auto" or self.stopped)


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
            body = {
                "step": state.step,
                "version": state.version,
                "rollout": state.rollout,
                "stopped": state.stopped,
                "carry": state.carry,
            }
            _write_synced(tmp / "state.json", json.dumps(body))
            shutil.rmtree(final, ignore_errors=True)  # an uncommitted leftover, never `latest`
            os.replace(tmp, final)
            committed = True
            _write_synced(pointer, final.name)
            os.replace(pointer, self.root / "latest")
            _fsync_dir(self.root)
        except BaseException as e:
            full = _full_disk_note(self.root, previous, e)  # before freeing the partial files
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

    async def save(
        self, state: RecoveryState, write_model: Callable[[str], Awaitable[Sequence[int]]]
    ) -> tuple[Path, float]:
        """Write ``state`` with the model that ``write_model(folder)`` writes into ``model/``
        (returning the bytes each writer wrote); returns (its folder, the seconds it took)."""
        t0 = time.monotonic()
        async with self.write(state) as path:
            nbytes = sum(await write_model(str(path / "model")))
        seconds = time.monotonic() - t0
        final = self.root / f"step{state.step}"
        mib = nbytes / 2**20
        log.info(
            "recovery checkpoint of step %d: %.1f MiB in %.1f s -> %s",
            state.step,
            mib,
            seconds,
            final,
        )
        return final, seconds

    def _latest_name(self) -> str | None:
        pointer = self.root / "latest"
        return pointer.read_text().strip() if pointer.exists() else None

    def latest(self) -> RecoveryState | None:
        """The newest complete checkpoint, or None."""
        return read_latest(self.root.parent)

    def settle(self, last_step: int) -> None:
        """After the run reached its last step: a latest checkpoint older than it is spent (a
        rerun must not train the later steps again), so it is marked so."""
        state = self.latest()
        if state is None or state.step >= last_step:
            return
        body = json.loads((state.path / "state.json").read_text())
        body["spent"] = True
        tmp = state.path / "state.json.tmp"
        _write_synced(tmp, json.dumps(body))
        os.replace(tmp, state.path / "state.json")

    def _prune(self, newest: str) -> None:
        done = sorted(
            (p for p in self.root.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")),
            key=lambda p: int(p.name[4:]),
        )
        for p in done[: -self.keep]:
            if p.name != newest:
                shutil.rmtree(p, ignore_errors=True)


def read_latest(run_path: Path) -> RecoveryState | None:
    """The newest complete recovery checkpoint of the run directory ``run_path``, or None
    (also for a pointer or state that cannot be read)."""
    root = Path(run_path) / "recover"
    try:
        path = root / (root / "latest").read_text().strip()
        body = json.loads((path / "state.json").read_text())
        return RecoveryState(
            int(body["step"]),
            int(body.get("version", 0)),
            body.get("rollout", {}),
            path,
            stopped=bool(body.get("stopped", False)),
            carry=body.get("carry"),
            spent=bool(body.get("spent", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_due(
    step: int, seconds_since_last: float, freq_steps: int | None, freq_secs: float | None
) -> bool:
    """Whether a periodic recovery checkpoint is due after ``step``: every ``freq_steps``
    steps, or once ``freq_secs`` seconds passed since the last one (either None: not by it)."""
    by_steps = bool(freq_steps) and step % freq_steps == 0
    by_time = freq_secs is not None and seconds_since_last >= freq_secs
    return by_steps or by_time


def data_identity(path: str, rows: Sequence[dict]) -> dict:
    """What the training data was: its ``data.path``, row count and a hash of the rows' ids
    (each row's prompt messages, in order), so that other data of the same size is told
    apart on resume."""
    h = hashlib.sha256()
    for row in rows:
        blob = json.dumps(row.get("messages", row), sort_keys=True, default=str)
        h.update(hashlib.sha1(blob.encode()).digest())
    return {"path": path, "n_rows": len(rows), "ids_sha256": h.hexdigest()[:16]}


def resume_keys(cfg: Any, train_world_size: int, rows: Sequence[dict]) -> dict:
    """The settings a resumed run must share with the checkpoint it continues: the model,
    the data, the batch shape, LoRA's adapters and the train world size (each rank loads its
    own shards), by config key."""
    return {
        "actor.path": cfg.actor.path,
        "actor.lora.rank": cfg.actor.lora.rank,
        "actor.lora.target_modules": sorted(cfg.actor.lora.target_modules),
        "data.path": cfg.data.path,
        "data.loader": cfg.data.loader,
        "data.train_split": cfg.data.train_split,
        "data.batch_size": cfg.data.batch_size,
        "data.shuffle": cfg.data.shuffle,
        "experiment.seed": cfg.experiment.seed,
        "gconfig.n_samples": cfg.gconfig.n_samples,
        "train world size": train_world_size,
        "data": data_identity(cfg.data.path, rows),
    }


class ResumeRefused(RuntimeError):
    """A recovery checkpoint cannot be resumed with this config (the message names why)."""


def check_resume(state: RecoveryState, current: dict) -> None:
    """Refuse ``state`` if its recorded `resume_keys` differ from ``current``'s, or it is in a
    format that is not loaded (the old pickled DCP state); reads JSON only."""
    from arl.ckpt.rank_state import RankStateError, check_format

    where = state.path
    ways = (
        "start afresh with experiment.overwrite=true (the old run is moved aside) or a new "
        "experiment.trial"
    )
    try:
        check_format(where / "model")
    except RankStateError as e:
        raise ResumeRefused(str(e)) from None
    if state.carry is None:
        raise ResumeRefused(
            f"{where} records no settings to check a resume against (an older arl wrote it); {ways}"
        )
    differ = []
    for key in sorted(set(current) | set(state.carry)):
        was, now = state.carry.get(key), current.get(key)
        if was == now:
            continue
        if key == "data" and isinstance(was, dict) and isinstance(now, dict):
            changed = [k for k in now if was.get(k) != now[k]]
            differ.extend(f"data {k} {was.get(k)!r} -> {now[k]!r}" for k in changed)
        else:
            differ.append(f"{key} {was!r} -> {now!r}")
    if differ:
        raise ResumeRefused(
            f"the recovery checkpoint {where} (step {state.step}) cannot be resumed with this "
            f"config, which differs in what a resume cannot change: {'; '.join(differ)}. Run "
            f"with the checkpoint's values to resume it, or {ways}"
        )


def _describe(e: BaseException) -> str:
    """``Type: message`` of an error; for a node's error (RemoteError) its remote type and
    message without the traceback."""
    type_name = getattr(e, "type_name", type(e).__name__)
    message = getattr(e, "remote_message", None) or str(e)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 2:  # e.g. torch's CheckpointException: a header, a traceback, the cause
        lines = [lines[0], "...", lines[-1]]
    return f"{type_name}: {' '.join(lines)}"


def _full_disk_note(root: Path, previous: str | None, error: BaseException) -> str:
    """The bytes free and needed when the write failed for space (ENOSPC anywhere in the
    error, or a filesystem with less free space than the previous checkpoint took)."""
    need = 16 * 2**20
    try:
        st = os.statvfs(root)
        if previous:
            files = (f for f in (root / previous).rglob("*") if f.is_file())
            need = max(need, sum(f.stat().st_size for f in files))
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= need and not _is_enospc(error):
        return ""
    return (
        f" (no space left on device: {free:,} bytes ({free / 2**20:.1f} MiB) free on the "
        f"filesystem of {root}, a checkpoint needs about {need:,} bytes ({need / 2**20:.1f} "
        "MiB); free space there or point experiment.run_dir at a larger disk)"
    )


def _is_enospc(error: BaseException | None) -> bool:
    while error is not None:
        if getattr(error, "errno", None) == errno.ENOSPC:
            return True
        text = getattr(error, "remote_message", None) or str(error)
        if "No space left on device" in text or "no space left on device" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


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
