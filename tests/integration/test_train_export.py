"""`TrainWorker.save_hf` on a real one-rank FSDP model (gloo, CPU) when the disk refuses the
weights (a file-size limit stands in for a full disk: the write really fails): no half-written
folder is left, and an earlier export of the same step survives intact."""

from __future__ import annotations

import json
import resource
import signal
from pathlib import Path

from tests.integration.test_train_score import _free_port, run_rank


def _rank(spec: dict) -> None:
    from arl.node.train import TrainWorker

    w = TrainWorker(
        {"path": spec["model"]}, rank=0, world_size=1, init_method=spec["init"], device="cpu"
    )
    fresh, again = Path(spec["out"]) / "fresh", Path(spec["out"]) / "step2"
    w.save_hf(str(again))  # a first export that fits
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-size write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
    errors = []
    for path in (fresh, again):
        try:
            w.save_hf(str(path))
            errors.append("")
        except Exception as e:  # an OSError, or safetensors' own error wrapping it
            errors.append(type(e).__name__)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    (Path(spec["out"]) / "result.json").write_text(json.dumps(errors))


def test_a_failed_export_leaves_no_half_folder_and_keeps_the_earlier_one(tmp_path):
    from tests.integration.test_fsdp_equivalence import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=1)
    out = tmp_path / "ckpt"
    out.mkdir()
    spec = {"model": str(model), "init": f"tcp://127.0.0.1:{_free_port()}", "out": str(out)}
    run_rank(__file__, spec, tmp_path)
    errors = json.loads((out / "result.json").read_text())
    assert all(errors), errors  # both exports really failed
    assert sorted(p.name for p in out.iterdir()) == ["result.json", "step2"]
    weights = out / "step2" / "model.safetensors"
    assert weights.stat().st_size > 16384  # the first export, whole
    from safetensors.torch import load_file

    assert load_file(weights)  # and readable


if __name__ == "__main__":
    from tests.integration.test_fsdp_equivalence import run_rank_from_argv

    run_rank_from_argv(_rank)
