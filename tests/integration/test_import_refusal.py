"""Import strings outside the allowed module prefixes are refused before anything is imported.

Each test points an import string at a module in tmp_path that writes a marker file when it is
imported, and puts that folder on the import path: the refusal must name the setting and the
allowed prefixes, and the marker must not exist. A control case shows that the same module,
allowed, is imported (so the marker does prove an import).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import Config, ConfigError, apply_overrides
from arl.data.loader import load_rows
from arl.node.daemon import ImportRefused
from arl.protocol.errors import ErrorKind, RemoteError
from arl.protocol.remote import rollout_worker
from tests.support.cluster import local_cluster

REPO = Path(__file__).resolve().parents[2]
MODULE = "armed_module"

_SOURCE = """
\"\"\"Writes a marker file when imported.\"\"\"
with open(MARKER, "w") as f:
    f.write("imported")


def load(path, split, on_bad_row):
    return [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}], {"skipped": 0}


class Anything:
    pass
"""


@pytest.fixture
def armed(tmp_path, monkeypatch) -> Path:
    """A module ``armed_module`` importable from tmp_path; returns its marker file's path."""
    marker = tmp_path / "imported.marker"
    (tmp_path / f"{MODULE}.py").write_text(_SOURCE.replace("MARKER", repr(str(marker))))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return marker


@pytest.mark.parametrize("key", ["rollout.workflow", "rollout.reward", "data.loader"])
def test_launcher_refuses_a_setting_outside_the_prefixes_before_import(armed, tmp_path, key):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    res = subprocess.run(
        [sys.executable, "-m", "arl.launch", "recipes/arith.py", f"{key}={MODULE}:Anything"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    line = next(ln for ln in res.stderr.splitlines() if ln.strip().startswith(key))
    assert f"module {MODULE!r} is not under cluster.allowed_import_prefixes=['arl.']" in line
    assert not armed.exists()


def test_validation_names_the_setting_and_allows_an_added_prefix(armed):
    cfg = apply_overrides(Config(), [f"data.loader={MODULE}:load"])
    with pytest.raises(ConfigError, match=r"data\.loader='armed_module:load': module 'armed_mod"):
        cfg.validate()
    assert not armed.exists()
    # Allowed, validation resolves it (so an attribute path out of it is refused before launch).
    cfg = apply_overrides(cfg, [f"cluster.allowed_import_prefixes=[arl.,{MODULE}]"])
    cfg.validate()
    assert armed.read_text() == "imported"


def test_load_rows_refuses_before_import_and_imports_when_allowed(armed):
    # load_rows is also the embedded path, where nobody may have called validate().
    cfg = apply_overrides(
        Config(), [f"data.loader={MODULE}:load", "cluster.allowed_import_prefixes=[arl.]"]
    )
    with pytest.raises(ImportRefused, match=r"allowed prefixes \['arl\.'\]"):
        load_rows(cfg, "train")
    assert not armed.exists() and MODULE not in sys.modules
    # The control: allowed, the module is imported (and the marker written).
    cfg = apply_overrides(cfg, [f"cluster.allowed_import_prefixes=[arl.,{MODULE}]"])
    assert len(load_rows(cfg, "train")) == 1
    assert armed.read_text() == "imported"


def test_rollout_node_refuses_workflow_and_reward_outside_its_prefixes(armed, tmp_path):
    """The node checks both before importing either, naming the one refused."""
    target = f"{MODULE}:Anything"
    cases = {
        "rollout.workflow": {"workflow": target},
        "rollout.reward": {"reward": target},
    }
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    async def main():
        errors = {}
        async with local_cluster(1, allow=("arl.", "tests."), env=env) as (_, (node,), _p):
            for what, kwargs in cases.items():
                worker = await node.create(
                    "arl.node.rollout:RolloutWorker", model_path=str(tmp_path), **kwargs
                )
                with pytest.raises(RemoteError) as info:
                    await rollout_worker(worker).setup()
                errors[what] = info.value
            return errors

    errors = asyncio.run(main())
    for what, err in errors.items():
        assert err.type_name == "ImportRefused" and err.kind is ErrorKind.IMPORT_REFUSED, err
        assert err.remote_message.startswith(f"{what}: refusing to import {target!r}"), err
        assert "allowed prefixes ['arl.', 'tests.']" in err.remote_message
    assert not armed.exists()


def test_rollout_node_imports_the_module_when_its_prefix_is_allowed(armed, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    async def main():
        async with local_cluster(1, allow=("arl.", MODULE), env=env) as (_, (node,), _p):
            await node.create(f"{MODULE}:Anything")

    asyncio.run(main())
    assert armed.read_text() == "imported"


@pytest.mark.parametrize("dry_run", [True, False])
def test_launcher_refuses_an_attribute_path_out_of_an_allowed_module(tmp_path, dry_run):
    """Issue 19: ``arl.control.launcher:shutil.rmtree`` used to delete data.path."""
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    target = "arl.control.launcher:shutil.rmtree"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/gsm8k.py",
            f"data.loader={target}",
            f"data.path={victim}",
            f"experiment.run_dir={tmp_path / 'runs'}",
            *(["--dry-run"] if dry_run else []),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    line = next(ln for ln in res.stderr.splitlines() if ln.strip().startswith("data.loader"))
    assert repr(target) in line and "is defined in 'shutil'" in line, line
    assert (victim / "keep").is_dir()
    assert not (tmp_path / "runs").exists()  # refused before the run directory or any node


def test_launcher_refuses_os_execl_through_an_allowed_module(tmp_path):
    """``...:os.execl`` with data.path=/usr/bin/touch used to turn the launcher into touch."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/gsm8k.py",
            "data.loader=arl.control.launcher:os.execl",
            "data.path=/usr/bin/touch",
            f"experiment.run_dir={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "'arl.control.launcher:os' is defined in 'os'" in res.stderr


def test_node_refuses_an_attribute_path_out_of_an_allowed_module(tmp_path):
    """``create arl.node.daemon:os.system`` used to run a shell command on the node."""
    marker = tmp_path / "ran"

    async def main():
        async with local_cluster(1, allow=("arl.",)) as (_, (node,), _p):
            with pytest.raises(RemoteError) as info:
                await node.create("arl.node.daemon:os.system", f"touch {marker}")
            # The node keeps serving after the refusal.
            assert (await node.call("ping"))["node_id"] == node.node_id
            return info.value

    err = asyncio.run(main())
    assert err.type_name == "ImportRefused" and err.kind is ErrorKind.IMPORT_REFUSED, err
    assert "'arl.node.daemon:os' is defined in 'os'" in err.remote_message
    assert not marker.exists()
