"""What decides a resume and a periodic save, and what a user reads when one is refused.

`check_resume` refuses a checkpoint whose carried settings or data differ (other data of the
same size included), naming the keys; `checkpoint_due` saves by steps or by time; a failed
write for space names the bytes free and needed; a split that is a FIFO or a link to a device
says so; `StopRequest` ends a stop that outlives its grace period.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal

import pytest

from arl.ckpt.recovery import (
    CheckpointError,
    RecoveryState,
    ResumeRefused,
    Saver,
    check_resume,
    checkpoint_due,
    resume_keys,
)
from arl.ckpt.stop import StopRequest
from arl.config import Config, apply_overrides
from arl.data.gsm8k import DatasetError, load_gsm8k


def _rows(*questions: str) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "answer": "1"} for q in questions]


def _state(tmp_path, carry: dict | None) -> RecoveryState:
    model = tmp_path / "step2" / "model"
    model.mkdir(parents=True)
    (model / "rank0.json").write_text(json.dumps({"format": "arl-rank-state-1", "world_size": 1}))
    return RecoveryState(2, 2, {}, tmp_path / "step2", stopped=True, carry=carry)


def test_the_same_settings_and_data_resume(tmp_path):
    keys = resume_keys(Config(), 1, _rows("a", "b"))
    check_resume(_state(tmp_path, keys), resume_keys(Config(), 1, _rows("a", "b")))


def test_other_data_of_the_same_size_is_refused(tmp_path):
    saved = resume_keys(Config(), 1, _rows("a", "b"))
    with pytest.raises(ResumeRefused) as info:
        check_resume(_state(tmp_path, saved), resume_keys(Config(), 1, _rows("a", "c")))
    message = str(info.value)
    assert "data ids_sha256 " in message and "n_rows" not in message, message
    assert "experiment.overwrite=true" in message


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.batch_size=64", "data.batch_size 32 -> 64"),
        ("gconfig.n_samples=8", "gconfig.n_samples"),
        ("actor.lora.rank=8", "actor.lora.rank 0 -> 8"),
        ("actor.path=other/model", "actor.path"),
    ],
)
def test_a_setting_a_resume_cannot_carry_is_named(tmp_path, override, named):
    base = Config()
    base.data.batch_size = 32
    changed = apply_overrides(Config(), ["data.batch_size=32", override])
    saved = resume_keys(base, 1, _rows("a"))
    with pytest.raises(ResumeRefused, match=named):
        check_resume(_state(tmp_path, saved), resume_keys(changed, 1, _rows("a")))


def test_another_train_world_size_is_named(tmp_path):
    saved = resume_keys(Config(), 2, _rows("a"))
    with pytest.raises(ResumeRefused, match="train world size 2 -> 1"):
        check_resume(_state(tmp_path, saved), resume_keys(Config(), 1, _rows("a")))


def test_a_legacy_dcp_checkpoint_is_refused_before_launch(tmp_path):
    state = _state(tmp_path, None)
    (state.path / "model" / "rank0.json").unlink()
    (state.path / "model" / ".metadata").write_bytes(b"\x80\x04not read")
    with pytest.raises(ResumeRefused, match="whose metadata is a pickle"):
        check_resume(state, resume_keys(Config(), 1, _rows("a")))


@pytest.mark.parametrize(
    ("step", "since", "freq_steps", "freq_secs", "due"),
    [
        (3, 1.0, 3, None, True),
        (4, 1.0, 3, None, False),
        (4, 599.0, None, 600.0, False),
        (4, 600.0, None, 600.0, True),
        (4, 700.0, 3, 600.0, True),
        (6, 1.0, 3, 600.0, True),
        (5, 1.0, None, None, False),
    ],
)
def test_checkpoints_are_due_by_steps_or_by_time(step, since, freq_steps, freq_secs, due):
    assert checkpoint_due(step, since, freq_steps, freq_secs) is due


def test_a_write_failed_for_space_names_bytes_free_and_needed(tmp_path):
    saver = Saver(tmp_path)

    async def fail() -> None:
        async with saver.write(RecoveryState(1, 1, {})) as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    with pytest.raises(CheckpointError) as info:
        asyncio.run(fail())
    message = str(info.value)
    assert "bytes" in message and " free on the filesystem of " in message, message
    assert "a checkpoint needs about " in message, message


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_split_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind):
    (tmp_path / "test.jsonl").write_text("")
    split = tmp_path / "train.jsonl"
    if kind == "fifo":
        os.mkfifo(split)
        want = "is a FIFO (named pipe)"
    else:
        os.symlink("/dev/zero", split)
        want = "is a link to /dev/zero, which is a character device"
    with pytest.raises(DatasetError) as info:
        load_gsm8k(str(tmp_path), "train")
    assert f"{split} {want}; a split must be a regular file" == str(info.value)


def test_a_stop_past_its_grace_period_is_ended_and_done_cancels_it():
    ended: list[str] = []

    async def go() -> None:
        stop = StopRequest(0.05, on_expiry=lambda: ended.append("late"))
        assert not stop.request(signal.SIGTERM)  # nothing armed: nothing would checkpoint
        stop.arm()  # a request before arming is seen at once
        await asyncio.wait_for(stop.wait(), 1)
        await asyncio.sleep(0.2)
        assert stop.expired and ended == ["late"]
        quick = StopRequest(0.05, on_expiry=lambda: ended.append("quick"))
        quick.arm()
        assert quick.request(signal.SIGINT)
        await asyncio.wait_for(quick.wait(), 1)
        quick.done()
        await asyncio.sleep(0.2)
        assert not quick.expired

    asyncio.run(go())
    assert ended == ["late"]


def test_a_second_signal_cancels_the_run_and_a_third_leaves_at_once():
    from arl.event_loop import run_loop
    from arl.launch import _StopSignals

    signals = _StopSignals(60.0)
    try:
        seen = {}

        async def run() -> None:
            signals.stop.arm()  # as the trainer's loop does
            signals._on_signal(signal.SIGTERM, None)
            seen["first"] = (signals.stop.requested, signals.cut)
            await asyncio.sleep(0)
            signals._on_signal(signal.SIGTERM, None)  # cancels this run
            await asyncio.sleep(5)

        with pytest.raises(asyncio.CancelledError):
            run_loop(run())
        assert seen["first"] == (True, "") and signals.cut == "second"
        with pytest.raises(KeyboardInterrupt):
            signals._on_signal(signal.SIGTERM, None)
    finally:
        signals.restore()
