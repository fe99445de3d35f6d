"""The run directory belongs to one run at a time and is never mixed into a finished run.

`claim_run_dir` is what the launcher does before any node starts or any file is written there:

1. takes an exclusive lock (``flock`` on ``<run dir>/.arl.lock``, holding the run id, host and
   pid); a second run on the same directory is refused with the holder's host and pid. The
   kernel drops the lock when its process ends, however it ends, so a lock is never stale;
2. looks for an earlier run's results (``metrics.jsonl`` rows, ``checkpoints/``, a recovery
   checkpoint). A recovery checkpoint short of ``experiment.total_train_steps`` that a stop
   (SIGTERM, Ctrl-C) wrote, or any with ``recover.mode=auto``, is resumed from
   (`arl.ckpt.recovery.RecoveryState.resumes`); with ``experiment.overwrite=true``
   the earlier files are moved aside to ``<trial>.replaced-<UTC time>/`` beside the run
   directory (never deleted); otherwise it refuses, saying how to resume, start a new trial, or
   replace it;
3. checks that everything the run will write is writable (the run directory, ``checkpoints/``,
   ``recover/``, ``tensorboard/``, the folders of the placement plan's weight-sync mode, such
   as ``weights/`` for ``disk``, the files it appends to), so a read-only folder is found at
   launch and not after training.

Each launch gets a fresh run id (in the lock file and on every ``metrics.jsonl`` row); the
supervisor's restarts under ``recover.mode=auto`` are the same launch and keep it, a resume by
running the command again is a new launch with a new id.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import IO

import attrs

from arl.ckpt.recovery import read_latest
from arl.config import Config
from arl.weights import mode_rule

LOCK_NAME = ".arl.lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (in use, holds a finished run, unwritable)."""


def new_run_id() -> str:
    """A fresh run id: UTC start time and 6 random hex digits, e.g. ``20261201-101500-3fa2c1``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@attrs.define
class RunClaim:
    """The launcher's hold on a run directory; the lock lasts until `release` or process exit."""

    path: Path
    run_id: str
    resume_step: int | None = None  # the recovery checkpoint a resumed run continues from
    moved_to: Path | None = None  # where experiment.overwrite=true put the earlier files
    _lock: IO | None = None

    def release(self) -> None:
        """Drop the lock (closing the file releases the flock)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def claim_run_dir(cfg: Config, run_id: str | None = None, *, sync_mode: str) -> RunClaim:
    """Lock ``cfg.run_path`` for this run, refuse or move aside an earlier run, and check that
    every path the run writes is writable (``sync_mode``: the placement plan's resolved
    weight-sync mode); raises `RunDirError` naming what to do."""
    path = cfg.run_path
    run_id = run_id or new_run_id()
    _ensure_dir(path, "its files", "experiment.run_dir")
    lock = _lock(path, run_id)
    try:
        claim = RunClaim(path, run_id, lock=lock)
        found = earlier_results(path)
        if found:
            state = read_latest(path)
            if cfg.experiment.overwrite:
                claim.moved_to = _move_aside(path)
            elif state is not None and state.resumes(
                cfg.recover.mode, cfg.experiment.total_train_steps
            ):
                claim.resume_step = state.step
            else:
                spent = state is not None and state.spent
                latest = None if state is None else state.step
                raise RunDirError(_finished_message(cfg, found, latest, spent))
        check_writable(cfg, sync_mode)
    except BaseException:
        lock.close()
        raise
    return claim


# ---- the lock ---------------------------------------------------------------------------------
def _lock(path: Path, run_id: str) -> IO:
    file = path / LOCK_NAME
    try:
        fh = open(file, "a+")  # noqa: SIM115 - held for the whole run, closed by RunClaim.release
    except OSError as e:
        raise RunDirError(_unwritable(path, e, "experiment.run_dir")) from e
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read()
        fh.close()
        raise RunDirError(_in_use_message(path, holder)) from None
    holder = {
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps(holder) + "\n")
    fh.flush()
    return fh


def _in_use_message(path: Path, holder_text: str) -> str:
    try:
        h = json.loads(holder_text)
        who = f"pid {h['pid']} on host {h['host']} (run {h['run_id']}, started {h['started']})"
    except (ValueError, KeyError, TypeError):
        who = "another process that is just starting"
    return (
        f"{path} is in use by another run: {who}; two runs in one directory would mix their "
        f"checkpoints and metrics. Wait for it to end (or stop it), or run this one beside it "
        f"with experiment.trial={_next_trial(path)}"
    )


# ---- an earlier run ---------------------------------------------------------------------------
def earlier_results(path: Path) -> list[str]:
    """What an earlier run left in ``path`` that a new run would mix into (empty: nothing)."""
    found = []
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        with open(metrics, "rb") as f:
            n = sum(1 for line in f if line.strip())
        if n:
            found.append(f"metrics.jsonl with {n} row{'s' * (n != 1)}")
    ckpts = path / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        names = sorted(p.name for p in ckpts.iterdir())
        found.append(f"checkpoints/{names[-1] if len(names) == 1 else '{' + ','.join(names) + '}'}")
    latest = _latest_step(path)
    if latest is not None:
        found.append(f"a recovery checkpoint of step {latest}")
    return found


def _latest_step(path: Path) -> int | None:
    state = read_latest(path)
    return None if state is None else state.step


def _finished_message(cfg: Config, found: list[str], latest: int | None, spent: bool) -> str:
    path = cfg.run_path
    total = cfg.experiment.total_train_steps
    if spent:
        resume = (
            f"It ran to its last step after resuming; its step-{latest} recovery checkpoint is "
            "older than that, so it cannot continue."
        )
    elif latest is None:
        resume = (
            "It cannot be resumed: it kept no recovery checkpoint (recover.mode=auto keeps one)."
        )
    elif latest >= total:
        resume = (
            f"It ended at its step-{latest} checkpoint; to train it further add recover.mode=auto "
            f"experiment.total_train_steps=N with N > {latest}."
        )
    else:
        resume = f"To resume it from its step-{latest} checkpoint add recover.mode=auto."
    aside = path.parent / f"{path.name}.replaced-<UTC time>"
    return (
        f"{path} already holds a run ({', '.join(found)}); a new run there would mix into it. "
        f"{resume} To start a new trial beside it add experiment.trial={_next_trial(path)}; "
        f"to replace it add experiment.overwrite=true (the earlier files are moved to {aside}, "
        "nothing is deleted)"
    )


def _next_trial(path: Path) -> str:
    """The first trial name after ``path``'s that is not taken: trial0 -> trial1, x -> x-2."""
    m = re.fullmatch(r"(.*?)(\d+)", path.name)
    stem, n = (m.group(1), int(m.group(2)) + 1) if m else (path.name + "-", 2)
    while (path.parent / f"{stem}{n}").exists():
        n += 1
    return f"{stem}{n}"


def _move_aside(path: Path) -> Path:
    """Move everything but the lock into ``<trial>.replaced-<UTC time>/`` beside ``path``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = path.parent / f"{path.name}.replaced-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = path.parent / f"{path.name}.replaced-{stamp}-{n}"
    dest.mkdir()
    for entry in path.iterdir():
        if entry.name != LOCK_NAME:
            os.rename(entry, dest / entry.name)
    return dest


def keep_previous(file: Path, text: str) -> Path | None:
    """Before writing ``text`` to ``file``: if it holds something else, keep that as
    ``<stem>.1<suffix>`` (then .2, ...) and return where it went."""
    if not file.exists() or file.read_text() == text:
        return None
    n = 1
    while (old := file.with_name(f"{file.stem}.{n}{file.suffix}")).exists():
        n += 1
    file.rename(old)
    return old


# ---- writability ------------------------------------------------------------------------------
def run_outputs(cfg: Config, sync_mode: str) -> list[tuple[Path, str, str]]:
    """The folders a run writes: (path, what goes there, the setting that asks for it);
    ``sync_mode`` is the plan's resolved weight-sync mode (``auto`` already decided)."""
    root = cfg.run_path
    out = [(root, "config.yaml, metrics.jsonl and trace.json", "experiment.run_dir")]
    if cfg.saver.hf_export:
        out.append((root / "checkpoints", "the trained model", "saver.hf_export=false"))
    if cfg.recover.mode == "auto":
        out.append((root / "recover", "recovery checkpoints", "recover.mode=disabled"))
    if cfg.stats.tensorboard:
        out.append((root / "tensorboard", "TensorBoard events", "stats.tensorboard=false"))
    for folder in mode_rule(sync_mode).run_dirs:
        what = f"the weights that weight_sync.mode={sync_mode} hands to the engines"
        out.append((root / folder, what, "weight_sync.mode"))
    return out


def check_writable(cfg: Config, sync_mode: str) -> None:
    """Create and write a probe file in every folder the run writes (under the plan's
    ``sync_mode``), and open every file it appends to; raise `RunDirError` naming the first
    that fails."""
    for folder, what, setting in run_outputs(cfg, sync_mode):
        _ensure_dir(folder, what, setting)
        probe = folder / f".arl-write-probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
            probe.unlink()
        except OSError as e:
            raise RunDirError(_unwritable(folder, e, setting, what)) from e
    for name in ("metrics.jsonl", "config.yaml", "trace.json"):
        file = cfg.run_path / name
        if file.exists():
            try:
                open(file, "a").close()
            except OSError as e:
                raise RunDirError(_unwritable(file, e, "experiment.run_dir")) from e


def _ensure_dir(folder: Path, what: str, setting: str) -> None:
    if folder.exists() and not folder.is_dir():
        raise RunDirError(
            f"{folder} is a file, but the run writes {what} into a folder there; move the file "
            f"away, or change {_elsewhere(setting)}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(_unwritable(folder, e, setting, what)) from e


def _unwritable(path: Path, e: OSError, setting: str, what: str = "") -> str:
    why = e.strerror or str(e)
    if e.errno == errno.EROFS:
        why = f"{path} is on a read-only mount"
    elif e.errno == errno.ENOTDIR:
        blocker = next((p for p in [path, *path.parents] if p.is_file()), None)
        why = f"{blocker or e.filename} is a file, not a folder"
    elif e.filename and str(e.filename) != str(path):
        why += f": {e.filename}"
    return (
        f"{path} is not writable ({why}); the run writes {what or 'its files'} there and "
        f"would fail only later. Make it writable, or change {_elsewhere(setting)}"
    )


def _elsewhere(setting: str) -> str:
    if setting == "experiment.run_dir":
        return "experiment.run_dir (or experiment.name / experiment.trial) to write elsewhere"
    if "=" in setting:
        return f"the setting: {setting} turns this output off"
    return f"{setting}"
