"""`TrainWorker.score` with ``weights_dtype`` on a real one-rank FSDP model (gloo, CPU): the
rounded weights are the ones scored, and the passes after it use the restored weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(script: str, spec: dict, tmp_path: Path) -> None:
    """Run ``script`` (a test file whose ``__main__`` is one rank) on ``spec`` in a child
    process, with this checkout's arl; it must exit 0."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path / "spec.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _rank(spec: dict) -> None:
    from arl.node.train import TrainWorker

    w = TrainWorker(
        {"path": spec["model"]}, rank=0, world_size=1, init_method=spec["init"], device="cpu"
    )
    ids = list(range(3, 40))
    plain = w.score(ids)
    rounded = w.score(ids, "bfloat16")
    after = w.score(ids)
    Path(spec["out"]).write_text(json.dumps({"plain": plain, "rounded": rounded, "after": after}))


def test_scoring_with_rounded_weights_leaves_later_passes_unrounded(tmp_path):
    from tests.integration.test_fsdp_equivalence import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=1)
    spec = {"model": str(model), "init": f"tcp://127.0.0.1:{_free_port()}"}
    spec["out"] = str(tmp_path / "scores.json")
    run_rank(__file__, spec, tmp_path)
    got = json.loads(Path(spec["out"]).read_text())
    assert got["rounded"] != got["plain"]  # the bf16-rounded weights were really scored
    assert got["after"] == got["plain"]  # and restored for every pass after it


if __name__ == "__main__":
    from tests.integration.test_fsdp_equivalence import run_rank_from_argv

    run_rank_from_argv(_rank)
