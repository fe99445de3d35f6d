"""The run directory: one run at a time, an earlier run refused or moved aside, outputs writable."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from arl.config import Config, apply_overrides
from arl.run_dir import LOCK_NAME, RunDirError, claim_run_dir, keep_previous
from arl.stats.logger import StatsLogger, read_jsonl


def _cfg(tmp_path, *overrides: str) -> Config:
    return apply_overrides(
        Config(), [f"experiment.run_dir={tmp_path}", "experiment.name=x", *overrides]
    )


def _claim(cfg: Config, run_id: str | None = None):
    """Claim as the launcher does for a CPU plan, whose weight sync writes no folder (zmq)."""
    return claim_run_dir(cfg, run_id, sync_mode="zmq")


def _finished(cfg: Config, rows: int = 2, checkpoint: int | None = None, **state) -> None:
    """Leave in cfg.run_path what a finished run leaves: metrics rows, an HF export, and (with
    ``checkpoint``) a recovery checkpoint of that step (``state``: more of its state.json)."""
    root = cfg.run_path
    (root / "checkpoints" / f"step{rows}").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, rows + 1)))
    if checkpoint is not None:
        step = root / "recover" / f"step{checkpoint}"
        step.mkdir(parents=True)
        (step / "state.json").write_text(json.dumps({"step": checkpoint, **state}))
        (root / "recover" / "latest").write_text(step.name)


def test_a_second_claim_is_refused_naming_the_holder(tmp_path):
    cfg = _cfg(tmp_path)
    first = _claim(cfg, "run-a")
    holder = json.loads((cfg.run_path / LOCK_NAME).read_text())
    assert (holder["pid"], holder["run_id"]) == (os.getpid(), "run-a")
    with pytest.raises(RunDirError) as info:
        _claim(cfg, "run-b")
    message = str(info.value)
    assert f"{cfg.run_path} is in use by another run: pid {os.getpid()} on host " in message
    assert socket.gethostname() in message and "experiment.trial=trial1" in message
    assert json.loads((cfg.run_path / LOCK_NAME).read_text())["run_id"] == "run-a"
    first.release()
    _claim(cfg, "run-c").release()  # free again once the holder let go


def test_the_lock_of_a_killed_holder_is_free_again(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.run_path.mkdir(parents=True)
    # A process that takes the lock the same way and is killed while holding it.
    script = (
        "import fcntl, os, sys, time\n"
        f"f = open({str(cfg.run_path / LOCK_NAME)!r}, 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(["python3", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="in use by another run"):
            _claim(cfg)
    finally:
        proc.kill()
        proc.wait()
    _claim(cfg).release()


def test_a_finished_run_is_refused_with_three_ways_on(tmp_path):
    cfg = _cfg(tmp_path)
    _finished(cfg)
    with pytest.raises(RunDirError) as info:
        _claim(cfg)
    message = str(info.value)
    assert "already holds a run (metrics.jsonl with 2 rows, checkpoints/step2)" in message
    assert "cannot be resumed: it kept no recovery checkpoint (recover.mode=auto" in message
    assert "experiment.trial=trial1" in message
    assert "experiment.overwrite=true" in message and "nothing is deleted" in message
    assert (cfg.run_path / "metrics.jsonl").read_text().count("step") == 2  # untouched


def test_the_refusal_says_how_to_resume_when_a_checkpoint_is_there(tmp_path):
    cfg = _cfg(tmp_path, "experiment.total_train_steps=4")
    _finished(cfg, rows=2, checkpoint=2)
    with pytest.raises(RunDirError, match="resume it from its step-2 checkpoint add recover.mode"):
        _claim(cfg)
    done = _cfg(tmp_path, "experiment.total_train_steps=2", "recover.mode=auto")
    with pytest.raises(RunDirError, match=r"total_train_steps=N with N > 2"):
        _claim(done)  # resuming a run that reached its last step would train nothing


def test_recover_auto_resumes_an_unfinished_run(tmp_path):
    cfg = _cfg(tmp_path, "experiment.total_train_steps=4", "recover.mode=auto")
    _finished(cfg, rows=2, checkpoint=2)
    claim = _claim(cfg)
    assert claim.resume_step == 2 and claim.moved_to is None
    assert (cfg.run_path / "metrics.jsonl").read_text().count("step") == 2
    claim.release()


def test_a_stop_checkpoint_resumes_without_recover_auto(tmp_path):
    cfg = _cfg(tmp_path, "experiment.total_train_steps=6")
    _finished(cfg, rows=2, checkpoint=2, stopped=True)
    claim = _claim(cfg)  # the same command again, as a Slurm requeue runs it
    assert claim.resume_step == 2
    claim.release()


def test_a_spent_stop_checkpoint_is_not_resumed_again(tmp_path):
    cfg = _cfg(tmp_path, "experiment.total_train_steps=6")
    _finished(cfg, rows=6, checkpoint=2, stopped=True, spent=True)
    with pytest.raises(RunDirError, match="its step-2 recovery checkpoint is older than that"):
        _claim(cfg)


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    cfg = _cfg(tmp_path, "experiment.overwrite=true")
    _finished(cfg)
    (cfg.run_path / "notes.txt").write_text("mine")
    claim = _claim(cfg)
    aside = claim.moved_to
    assert aside.parent == cfg.run_path.parent and aside.name.startswith("trial0.replaced-")
    assert (aside / "notes.txt").read_text() == "mine"
    assert (aside / "checkpoints" / "step2").is_dir()
    assert sorted(p.name for p in cfg.run_path.iterdir()) == sorted(
        [LOCK_NAME, "checkpoints", "tensorboard"]  # the lock, and the outputs just checked
    )
    assert not any((cfg.run_path / "checkpoints").iterdir())
    claim.release()


def test_a_new_trial_beside_a_finished_one_is_free(tmp_path):
    _finished(_cfg(tmp_path))
    new = _cfg(tmp_path, "experiment.trial=trial1")
    claim = _claim(new)  # raises RunDirError if the finished trial blocked it
    assert claim.path == new.run_path and claim.resume_step is None
    claim.release()


def test_checkpoints_being_a_file_is_found_before_launch(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "checkpoints").write_text("not a folder")
    with pytest.raises(RunDirError) as info:
        _claim(cfg)
    message = str(info.value)
    assert f"{cfg.run_path / 'checkpoints'} is a file" in message
    assert "the trained model" in message and "saver.hf_export=false" in message
    # Turning the export off is a way out the message names, also with periodic exports set
    # (hf_export=false exports nothing, so nothing is written there).
    _claim(_cfg(tmp_path, "saver.hf_export=false", "saver.freq_steps=2")).release()


def test_the_weights_folder_is_checked_when_the_plan_syncs_through_disk(tmp_path):
    """The folder follows the plan's resolved mode, never the engine's name: a server engine
    with auto resolves to disk at placement; an hf engine forced to disk writes there too."""
    cfg = _cfg(tmp_path, "rollout.backend=hf:d1")
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "weights").write_text("not a folder")
    _claim(cfg).release()  # zmq writes no folder: the file is in nobody's way
    with pytest.raises(RunDirError) as info:
        claim_run_dir(cfg, sync_mode="disk")
    message = str(info.value)
    assert f"{cfg.run_path / 'weights'} is a file" in message
    assert "weight_sync.mode=disk" in message


def test_a_read_only_mount_under_the_run_is_found_before_launch(tmp_path):
    cfg = _cfg(tmp_path, "stats.tensorboard=false")
    ckpts = cfg.run_path / "checkpoints"
    ckpts.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ckpts)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"mount refused here: {res.stderr.decode().strip()}")
    try:
        with pytest.raises(RunDirError) as info:
            _claim(cfg)
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)
    message = str(info.value)
    assert f"{ckpts} is not writable ({ckpts} is on a read-only mount)" in message


def test_metrics_rows_carry_the_run_id(tmp_path):
    for run_id in ("first", "second"):
        logger = StatsLogger(tmp_path, tensorboard=False, run_id=run_id)
        logger.log(1, {"a": 1.0})
        logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["run_id"]) for r in rows] == [(1, "first"), (1, "second")]
    fresh = StatsLogger(tmp_path / "other", tensorboard=False)
    assert fresh.run_id and fresh.run_id != StatsLogger(tmp_path / "o2", tensorboard=False).run_id


def test_a_resumed_run_drops_the_row_its_killed_process_cut_and_appends_whole_rows(tmp_path):
    logger = StatsLogger(tmp_path, tensorboard=False, run_id="first")
    logger.log(1, {"a": 1.0})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "run_id": "first", "a"')  # killed mid-write: no newline
    logger = StatsLogger(tmp_path, tensorboard=False, run_id="second")
    logger.log(2, {"a": 2.0})
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["run_id"]) for r in rows] == [(1, "first"), (2, "second")]
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"step": 1')  # the only row, cut
    StatsLogger(tmp_path / "cut", tensorboard=False).close()
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == ""


def test_keep_previous_keeps_a_different_config(tmp_path):
    file = tmp_path / "config.yaml"
    assert keep_previous(file, "a") is None
    file.write_text("a")
    assert keep_previous(file, "a") is None and file.read_text() == "a"
    kept = keep_previous(file, "b")
    assert kept == tmp_path / "config.1.yaml" and kept.read_text() == "a"
    assert not file.exists()


def test_a_run_dir_given_under_tilde_is_in_the_home_folder_not_a_folder_named_tilde(
    tmp_path, monkeypatch
):
    # A shell leaves `~` as it is in `experiment.run_dir=~/runs`.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = apply_overrides(Config(), ["experiment.run_dir=~/runs", "experiment.name=x"])
    _claim(cfg).release()
    assert (tmp_path / "home" / "runs" / "x" / "trial0" / LOCK_NAME).is_file()
    assert not (tmp_path / "~").exists()
