"""`WeightVerifier` checks each engine by the `WeightCheck` its class declares, not its name."""

from __future__ import annotations

import pytest

from arl.config import Config
from arl.engines.base import WeightCheck
from arl.engines.hf import HFEngine
from arl.engines.spec import ENGINES
from arl.weights.verify import WeightVerifier


class ProbedHF(HFEngine):
    """An in-process engine that declares the probe check (registered under its own name)."""

    name = "probed_hf"
    weight_check = WeightCheck.PROBE


def test_each_engine_gets_the_check_its_class_declares(monkeypatch) -> None:
    monkeypatch.setitem(ENGINES, "probed_hf", f"{__name__}:ProbedHF")
    engines = [("hf", "r0", "w0"), ("sglang", "r1", "w1"), ("probed_hf", "r2", "w2")]
    v = WeightVerifier(None, engines, "/m", Config())
    assert [e[1] for e in v.checksummed] == ["r0"]
    assert [e[1] for e in v.probed] == ["r1", "r2"]


@pytest.mark.parametrize(("dtype", "scored"), [("auto", None), ("bfloat16", "bfloat16")])
def test_the_trainer_scores_the_probe_in_the_servers_dtype(dtype, scored) -> None:
    cfg = Config()
    cfg.rollout.dtype = dtype
    assert WeightVerifier(None, [], "/m", cfg).dtype == scored
