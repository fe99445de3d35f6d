"""The workers' typed interfaces: the workers implement them, the generated callers refuse
other names, bind arguments at the caller and decode the replies."""

from __future__ import annotations

import asyncio

import pytest

from arl.node.train import TrainWorker
from arl.protocol.proxy import MalformedReply, check_implements, per_rank
from arl.protocol.remote import (
    LoadedBatch,
    StatsError,
    StepStats,
    TrainWorkerAPI,
    UnknownRemoteMethod,
    api_methods,
    train_ranks,
)
from arl.protocol.rtensor import RTensor, ShardRef


class Recorder:
    """A fan-out that records what would be sent and answers like two ranks."""

    def __init__(self, answers: dict):
        self.sent: list[tuple[str, list | None]] = []
        self.answers = answers

    async def __call__(self, method: str, args: list[list] | None) -> list:
        self.sent.append((method, args))
        return self.answers.get(method, [None, None])


def test_train_worker_implements_its_api_with_the_same_parameters() -> None:
    assert check_implements(TrainWorker, TrainWorkerAPI) == []
    assert {"load_batch", "ppo_update", "set_sync_dtype", "save_hf"} <= api_methods(TrainWorkerAPI)


def test_a_worker_that_drifts_from_its_api_is_named() -> None:
    class Drifted:
        def warm_up(self, seconds: float) -> float: ...

    wrong = check_implements(Drifted, TrainWorkerAPI)
    assert "Drifted.warm_up takes ['self', 'seconds'], TrainWorkerAPI declares ['self']" in wrong
    assert "Drifted lacks ppo_update" in wrong


def test_the_fan_out_offers_exactly_the_api_methods() -> None:
    ranks = train_ranks(Recorder({}), 2)
    offered = {n for n in dir(ranks) if not n.startswith("_")} - {"n_ranks", "api"}
    assert offered == api_methods(TrainWorkerAPI)


def test_an_unknown_method_fails_at_the_caller_and_nothing_is_sent() -> None:
    fan_out = Recorder({})
    ranks = train_ranks(fan_out, 2)
    with pytest.raises(UnknownRemoteMethod, match="'full_stat' is not a method of TrainWorkerAPI"):
        ranks.full_stat()
    with pytest.raises(ValueError, match="1 values for 2 ranks"):
        asyncio.run(ranks.score(per_rank([[1, 2]])))
    with pytest.raises(TypeError, match=r"TrainWorkerAPI.load_state.*missing a required argument"):
        asyncio.run(ranks.load_state("/ckpt"))
    assert fan_out.sent == []


def test_calls_send_method_names_and_decode_the_replies() -> None:
    answers = {
        "load_batch": [{"n_seqs": 4, "n_tokens": 40}, {"n_seqs": 2, "n_tokens": 9}],
        "ppo_update": [{"loss": 0.5, "grad_norm": "nan"}, {"loss": 1, "grad_norm": 2.0}],
    }
    fan_out = Recorder(answers)
    ranks = train_ranks(fan_out, 2)
    parts = [RTensor([ShardRef("n", f"g{i}", 8, 4)]) for i in range(2)]

    async def step() -> tuple:
        loaded = await ranks.load_batch(per_rank(parts))
        stats = await ranks.ppo_update()
        await ranks.load_state("/ckpt", 3)
        return loaded, stats

    loaded, stats = asyncio.run(step())
    assert loaded == [LoadedBatch(4, 40), LoadedBatch(2, 9)]
    assert stats[1]["loss"] == 1.0 and stats[0]["grad_norm"] != stats[0]["grad_norm"]  # NaN
    assert stats[0].to_wire()["grad_norm"] == "nan"
    assert fan_out.sent[0] == ("load_batch", [[p.to_wire()] for p in parts])
    assert fan_out.sent[1] == ("ppo_update", None)
    assert fan_out.sent[2] == ("load_state", [["/ckpt", 3], ["/ckpt", 3]])


@pytest.mark.parametrize(
    ("method", "reply", "why"),
    [
        ("load_batch", None, "LoadedBatch: expected a map, got None"),
        ("load_batch", {"n_seqs": 1}, "LoadedBatch: 'n_tokens' must be an integer, it is missing"),
        ("load_batch", {"n_seqs": -1, "n_tokens": 1}, "LoadedBatch: 'n_seqs' must be >= 0: -1"),
        ("ppo_update", {}, "ppo_update must answer a non-empty map"),
        ("ppo_update", {"loss": "high"}, "StepStats: 'loss' must be a number, got 'high'"),
        ("ppo_update", {"loss": True}, "StepStats: 'loss' must be a number, got True"),
    ],
)
def test_malformed_rank_replies_are_refused_naming_the_entry(method, reply, why) -> None:
    decode = LoadedBatch.from_wire if method == "load_batch" else StepStats.from_wire
    with pytest.raises(StatsError) as info:
        decode(reply)
    assert why in str(info.value)


class FakeHandle:
    """What a RemoteObject offers the client: ``node`` and a method-name ``call``."""

    node = "node0"

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    async def call(self, method, *args, **kwargs):
        self.sent.append((method, args, kwargs))
        return self.answer


def test_rollout_worker_implements_its_api_with_the_same_parameters() -> None:
    from arl.node.rollout import RolloutWorker
    from arl.protocol.remote import RolloutWorkerAPI

    assert check_implements(RolloutWorker, RolloutWorkerAPI) == []


def test_rollout_proxy_refuses_unknown_methods_and_checks_replies() -> None:
    from arl.protocol.remote import rollout_worker

    handle = FakeHandle([1.0, 0])
    worker = rollout_worker(handle)
    assert worker.node == "node0"
    with pytest.raises(UnknownRemoteMethod, match="'update_weight' is not a method"):
        worker.update_weight()
    assert asyncio.run(worker.evaluate([{}, {}])) == [1.0, 0.0]
    assert asyncio.run(worker.evaluate([{}], max_new_tokens=8)) == [1.0, 0.0]
    # max_new_tokens reaches the worker (the hand-written client of before dropped it).
    assert handle.sent == [
        ("evaluate", ([{}, {}],), {}),
        ("evaluate", ([{}],), {"max_new_tokens": 8}),
    ]
    handle.answer = [1.0, "x"]
    evaluate_shape = r"RolloutWorkerAPI.evaluate must answer list\[float\]"
    with pytest.raises(MalformedReply, match=evaluate_shape):
        asyncio.run(worker.evaluate([{}, {}]))
    handle.answer = True
    with pytest.raises(MalformedReply, match="RolloutWorkerAPI.sleep must answer int, got True"):
        asyncio.run(worker.sleep())


def test_rollout_proxy_sends_the_pause_mode() -> None:
    from arl.protocol.remote import rollout_worker

    handle = FakeHandle(None)
    worker = rollout_worker(handle)
    asyncio.run(worker.pause(in_place=True))
    asyncio.run(worker.pause())
    assert handle.sent == [("pause", (True,), {}), ("pause", (), {})]


def test_rollout_worker_refuses_a_pause_mode_that_is_not_a_bool() -> None:
    from arl.node.rollout import RolloutWorker

    worker = RolloutWorker(model_path="/nonexistent/model")  # no engine: refused before use
    with pytest.raises(TypeError, match="takes true or false, got 'false'"):
        asyncio.run(worker.pause("false"))
