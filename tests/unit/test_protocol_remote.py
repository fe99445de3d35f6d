"""The train ranks' typed interface: TrainWorker satisfies it, the proxy refuses other names."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from arl.node.train import TrainWorker
from arl.protocol.remote import (
    LoadedBatch,
    StatsError,
    StepStats,
    TrainRanks,
    TrainWorkerAPI,
    UnknownRemoteMethod,
    api_methods,
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


def test_train_worker_satisfies_the_api_with_the_same_parameters() -> None:
    for name in api_methods(TrainWorkerAPI):
        declared = inspect.signature(getattr(TrainWorkerAPI, name))
        actual = inspect.signature(getattr(TrainWorker, name))
        assert list(declared.parameters) == list(actual.parameters), name


def test_every_proxy_method_calls_the_api_method_of_its_name() -> None:
    proxied = {n for n, v in vars(TrainRanks).items() if inspect.iscoroutinefunction(v)} - {"call"}
    assert proxied == api_methods(TrainWorkerAPI)


def test_an_unknown_method_fails_at_the_caller_and_nothing_is_sent() -> None:
    fan_out = Recorder({})
    ranks = TrainRanks(fan_out, 2)
    with pytest.raises(UnknownRemoteMethod, match="'full_stat' is not a method of TrainWorkerAPI"):
        asyncio.run(ranks.call("full_stat"))
    with pytest.raises(ValueError, match="1 argument lists for 2 ranks"):
        asyncio.run(ranks.call("score", [[[1, 2]]]))
    assert fan_out.sent == []


def test_calls_send_method_names_and_decode_the_replies() -> None:
    answers = {
        "load_batch": [{"n_seqs": 4, "n_tokens": 40}, {"n_seqs": 2, "n_tokens": 9}],
        "ppo_update": [{"loss": 0.5, "grad_norm": "nan"}, {"loss": 1, "grad_norm": 2.0}],
    }
    fan_out = Recorder(answers)
    ranks = TrainRanks(fan_out, 2)
    parts = [RTensor([ShardRef("n", f"g{i}", 8, 4)]) for i in range(2)]

    async def step() -> tuple:
        loaded = await ranks.load_batch(parts)
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

    async def call(self, method, *args):
        self.sent.append((method, args))
        return self.answer


def test_rollout_worker_satisfies_its_api_with_the_same_parameters() -> None:
    from arl.node.rollout import RolloutWorker
    from arl.protocol.remote import RolloutWorkerAPI

    for name in api_methods(RolloutWorkerAPI):
        declared = inspect.signature(getattr(RolloutWorkerAPI, name))
        actual = inspect.signature(getattr(RolloutWorker, name))
        assert list(declared.parameters) == list(actual.parameters), name
        assert inspect.iscoroutinefunction(getattr(RolloutWorker, name)), name


def test_rollout_client_refuses_unknown_methods_and_checks_scores() -> None:
    from arl.protocol.remote import RolloutWorkerClient

    handle = FakeHandle([1.0, 0])
    client = RolloutWorkerClient(handle)
    assert client.node == "node0"
    with pytest.raises(UnknownRemoteMethod, match="'update_weight' is not a method"):
        asyncio.run(client.call("update_weight"))
    assert asyncio.run(client.evaluate([{}, {}])) == [1.0, 0.0]
    assert handle.sent == [("evaluate", ([{}, {}], 1, 0.0))]
    with pytest.raises(StatsError, match=r"one number per row \(3\)"):
        asyncio.run(client.evaluate([{}, {}, {}]))


def test_rollout_client_sends_the_pause_mode() -> None:
    from arl.protocol.remote import RolloutWorkerClient

    handle = FakeHandle(None)
    client = RolloutWorkerClient(handle)
    asyncio.run(client.pause(in_place=True))
    asyncio.run(client.pause())
    assert handle.sent == [("pause", (True,)), ("pause", (False,))]


def test_rollout_worker_refuses_a_pause_mode_that_is_not_a_bool() -> None:
    from arl.node.rollout import RolloutWorker

    worker = RolloutWorker(model_path="/nonexistent/model")  # no engine: refused before use
    with pytest.raises(TypeError, match="takes true or false, got 'false'"):
        asyncio.run(worker.pause("false"))
