"""``python -m arl.launch`` as a user runs it, against the run directory and its inputs.

Real launcher processes on the tiny model: two runs on one directory (the second is refused
naming the first's host and pid), the same command again after a finished run (refused with the
ways on; a new trial and ``experiment.overwrite=true`` work), outputs that cannot be written and
bad model or data (one ``error:`` line, exit 2, before any node starts), and SIGTERM (a clear
line, a stop checkpoint once training runs, every node ended, a trace that parses).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _command(run_dir: Path, model: str, *extra: str, steps: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "arl.launch",
        "recipes/arith.py",
        f"experiment.run_dir={run_dir}",
        "experiment.name=safe",
        f"experiment.total_train_steps={steps}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "cluster.n_gpus=0",
        "data.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "evaluator.freq_steps=none",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        *extra,
    ]


def _launch(run_dir: Path, model: str, *extra: str, steps: int = 2):
    return subprocess.run(
        _command(run_dir, model, *extra, steps=steps),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _error_line(err: str) -> str:
    """The one ``error:`` line of a refused launch (no traceback, nothing else from arl)."""
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def _descendants(root: int) -> dict[int, str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True
    ).stdout
    parent, args = {}, {}
    for line in out.splitlines():
        p, pp, a = (line.split(None, 2) + [""])[:3]
        parent[int(p)], args[int(p)] = int(pp), a
    found, frontier = {}, [root]
    while frontier:
        cur = frontier.pop()
        for p, pp in parent.items():
            if pp == cur and p not in found:
                found[p] = args[p]
                frontier.append(p)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _has_rows(metrics: Path):
    return lambda: metrics.exists() and metrics.stat().st_size > 0


def _wait_for(proc: subprocess.Popen, ready, seen: dict[int, str], what: str) -> None:
    deadline = time.monotonic() + 600
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"not {what} in time"
        seen.update(_descendants(proc.pid))
        time.sleep(0.2)
    seen.update(_descendants(proc.pid))


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first(tmp_path, tiny_model):
    run_path = tmp_path / "safe" / "trial0"
    a = subprocess.Popen(
        _command(tmp_path, tiny_model, steps=50),
        cwd=REPO,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict[int, str] = {}
    try:
        _wait_for(a, _has_rows(run_path / "metrics.jsonl"), seen, "step 1")
        b = _launch(tmp_path, tiny_model, "actor.lr=3e-5")
        assert b.returncode == 2, b.stderr[-3000:]
        line = _error_line(b.stderr)
        assert f"{run_path} is in use by another run: pid {a.pid} on host " in line
        assert socket.gethostname() in line and "experiment.trial=trial1" in line
        assert "lr: 1.0e-05" in (run_path / "config.yaml").read_text()  # still A's config
        a.send_signal(signal.SIGTERM)
        _, err = a.communicate(timeout=300)  # drains the pipe while the run ends
    finally:
        a.kill()
    assert a.returncode == 128 + signal.SIGTERM, err[-3000:]
    holder = json.loads((run_path / ".arl.lock").read_text())
    assert holder["pid"] == a.pid
    rows = read_jsonl(run_path / "metrics.jsonl")
    assert {r["run_id"] for r in rows} == {holder["run_id"]}  # only A wrote metrics
    assert [(p, x) for p, x in seen.items() if _alive(p)] == []


def test_running_again_after_a_finished_run_refuses_and_the_ways_on_work(tmp_path, tiny_model):
    run_path = tmp_path / "safe" / "trial0"
    first = _launch(tmp_path, tiny_model)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run_path / "metrics.jsonl").read_bytes()
    exported = run_path / "checkpoints" / "step2" / "model.safetensors"
    weights = exported.read_bytes()

    again = _launch(tmp_path, tiny_model)  # the same command: the most natural thing to do
    assert again.returncode == 2, again.stderr[-3000:]
    line = _error_line(again.stderr)
    assert f"{run_path} already holds a run (metrics.jsonl with 2 rows, checkpoints/step2)" in line
    assert "recover.mode=auto" in line and "experiment.trial=trial1" in line
    assert "experiment.overwrite=true" in line
    assert (run_path / "metrics.jsonl").read_bytes() == before
    assert exported.read_bytes() == weights

    new_trial = _launch(tmp_path, tiny_model, "experiment.trial=trial1")
    assert new_trial.returncode == 0, new_trial.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "safe" / "trial1" / "metrics.jsonl")] == [1, 2]

    replaced = _launch(tmp_path, tiny_model, "experiment.overwrite=true")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    [aside] = list((tmp_path / "safe").glob("trial0.replaced-*"))
    assert (aside / "metrics.jsonl").read_bytes() == before
    assert (aside / "checkpoints" / "step2" / "model.safetensors").read_bytes() == weights
    old_ids = {r["run_id"] for r in read_jsonl(aside / "metrics.jsonl")}
    rows = read_jsonl(run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert len({r["run_id"] for r in rows}) == 1 and not old_ids & {r["run_id"] for r in rows}


def _mount_read_only(path: Path) -> str:
    if os.geteuid() != 0:
        return "needs root to mount a read-only tmpfs"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return "" if res.returncode == 0 else f"mount refused here: {res.stderr.strip()}"


@pytest.mark.parametrize("how", ["read-only mount", "a file in the way"])
def test_an_unwritable_checkpoints_folder_is_refused_before_any_node_starts(
    tmp_path, tiny_model, how
):
    ckpts = tmp_path / "safe" / "trial0" / "checkpoints"
    ckpts.parent.mkdir(parents=True)
    if how == "a file in the way":
        ckpts.write_text("")
    else:
        ckpts.mkdir()
        why = _mount_read_only(ckpts)
        if why:
            pytest.skip(why)
    try:
        r = _launch(tmp_path, tiny_model)
    finally:
        if how == "read-only mount":
            subprocess.run(["umount", str(ckpts)], check=True)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _error_line(r.stderr)
    assert str(ckpts) in line and "the trained model" in line, line
    if how == "read-only mount":
        assert "is on a read-only mount" in line
    assert "arl.controller" not in r.stderr  # no node was started
    assert not (ckpts.parent / "metrics.jsonl").exists()


def _no_config(model: Path) -> Path:
    (model / "config.json").unlink()
    return model / "config.json"


def _truncated(model: Path) -> Path:
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return weights


@pytest.mark.parametrize("damage", [_no_config, _truncated], ids=["no config.json", "truncated"])
def test_a_damaged_model_folder_is_one_error_line_naming_the_file(tmp_path, tiny_model, damage):
    model = Path(shutil.copytree(tiny_model, tmp_path / "my model"))  # a path with a space
    file = damage(model)
    r = _launch(tmp_path / "runs", str(model))
    assert r.returncode == 2, r.stderr[-3000:]
    line = _error_line(r.stderr)
    assert line.startswith(f"error: actor.path={model}: ") and str(file.name) in line, line
    assert not (tmp_path / "runs").exists()  # nothing was written


def test_a_missing_data_folder_is_one_error_line_naming_the_setting(tmp_path, tiny_model):
    r = _launch(
        tmp_path,
        tiny_model,
        "data.loader=arl.data.gsm8k:load_gsm8k",
        f"data.path={tmp_path / 'no such data'}",
    )
    assert r.returncode == 2, r.stderr[-3000:]
    line = _error_line(r.stderr)
    assert f"data.path={tmp_path / 'no such data'} (split 'train'" in line, line
    assert line.endswith(f"{tmp_path / 'no such data'} does not exist"), line
    assert not (tmp_path / "safe").exists()


def _sigint(disposition: str) -> list[str]:
    """A prefix that execs the command with SIGINT at ``disposition`` (SIG_DFL or SIG_IGN),
    whatever this test process has. A shell leaves SIGINT ignored for a background job
    (`cmd &` in an sbatch script) and it stays so across exec: SIGTERM must stop the run then
    too, its teardown included."""
    return [
        sys.executable,
        "-c",
        f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{disposition}); "
        "os.execv(sys.executable, sys.argv[1:])",
    ]


@pytest.mark.parametrize(
    ("when", "sigint"),
    [("during setup", "default"), ("during training", "default"), ("during training", "ignored")],
)
def test_sigterm_stops_the_run_like_ctrl_c(tmp_path, tiny_model, when, sigint):
    run_path = tmp_path / "safe" / "trial0"
    prefix = _sigint("SIG_IGN" if sigint == "ignored" else "SIG_DFL")
    proc = subprocess.Popen(
        prefix + _command(tmp_path, tiny_model, steps=50),
        cwd=REPO,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict[int, str] = {}

    def nodes_up() -> bool:
        return any("arl.node" in a for a in _descendants(proc.pid).values())

    try:
        ready = nodes_up if when == "during setup" else _has_rows(run_path / "metrics.jsonl")
        _wait_for(proc, ready, seen, when)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)  # drains the pipe while the run ends
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    if when == "during training":  # a stop is a checkpoint (tests/integration/test_stop.py)
        assert "stopped by SIGTERM after step " in err, err[-3000:]
        assert "the recovery checkpoint was written to " in err, err[-3000:]
    else:  # nothing trained yet: nothing to save
        assert "stopped by SIGTERM: the run and its nodes were ended" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert any("arl.node" in a for a in seen.values())
    assert [(p, a) for p, a in seen.items() if _alive(p)] == []
    trace = run_path / "trace.json"
    if when == "during training" or trace.exists():  # it is opened once the nodes are up
        assert isinstance(json.loads(trace.read_text()), list)  # plain JSON, not just loadable
