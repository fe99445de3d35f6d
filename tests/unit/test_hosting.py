"""What hosted objects get from their node is declared: the weight-sync hooks each worker
implements, and no probing of what the node hosts."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from arl.node.rollout import RolloutWorker
from arl.node.train import TrainWorker
from arl.protocol.proxy import check_implements
from arl.protocol.weight_hooks import WeightSink, WeightSource

NODE = Path(__file__).resolve().parents[2] / "arl" / "node"


def test_the_train_worker_is_a_weight_source() -> None:
    assert check_implements(TrainWorker, WeightSource) == []
    assert isinstance(inspect.getattr_static(TrainWorker, "weights_device"), property)


def test_the_rollout_worker_is_a_weight_sink() -> None:
    assert check_implements(RolloutWorker, WeightSink) == []
    assert isinstance(inspect.getattr_static(RolloutWorker, "weights_device"), property)


def test_the_node_never_probes_what_it_hosts_with_hasattr() -> None:
    found = [
        f"{p.name}:{i}"
        for p in sorted(NODE.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bhasattr\(", line)
    ]
    assert found == []
