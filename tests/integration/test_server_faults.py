"""The inference server under a rollout node is killed (SIGKILL) mid-generation.

The engine's watchdog sees the server exit and fails the request in flight, and every later
one, with `ServerExited` naming the server, its pid, how it ended and the last lines of its log.
On a node, the rollout worker then stops its node: the controller sees the node leave with that
reason, so a run stops naming the node and "inference server exited". The server is the SGLang
stand-in (a real HTTP server process, `tests/support/sglang_standin.py`); the last test does the
same with a real vLLM-CPU server (marked ``server``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from arl.control.controller import NodeLost
from arl.data.arith import make_arith
from arl.engines.base import SamplingParams, generate_to_completion
from arl.engines.server import ServerExited
from arl.engines.sglang import SGLangEngine
from arl.engines.spec import EngineSpec
from arl.process import process_group_members
from arl.protocol.errors import ErrorKind, RemoteError
from arl.protocol.remote import rollout_worker
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model
from tests.support.vllm import SKIP_REASON, vllm_python

REPO = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tests.support.sglang_standin"]
STANDIN_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
LONG = SamplingParams(max_new_tokens=1500)  # seconds of decoding on the stand-in


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def _until_vllm_runs_requests(base_url: str, timeout: float = 120.0) -> None:
    """Return once vLLM's metrics show a running request."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(base_url + "/metrics") as resp:
                text = await resp.text()
            running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
            if sum(float(ln.rsplit(" ", 1)[1]) for ln in running) > 0:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"vLLM at {base_url} ran no request within {timeout} s")


async def _tokens_in_flight(base_url: str) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/get_load") as resp:
            return sum(rank["num_tokens"] for rank in await resp.json())


async def _kill_when_decoding(base_url: str, pid: int) -> None:
    """SIGKILL the server's main process once it is generating (tokens in flight)."""
    deadline = time.monotonic() + 60
    while await _tokens_in_flight(base_url) == 0:
        assert time.monotonic() < deadline, "the request never reached the server"
        await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


def _assert_names_the_server(message: str, pid: int) -> None:
    assert "sglang inference server exited" in message, message
    assert f"pid {pid}" in message and "SIGKILL" in message, message
    assert "last lines of" in message and "sglang_standin" in message, message  # its log


def test_engine_fails_inflight_and_later_requests_when_its_server_is_killed(tiny_model, tmp_path):
    log_path = tmp_path / "server.log"

    async def scenario():
        engine = SGLangEngine(
            tiny_model,
            launch_cmd=STANDIN,
            env=STANDIN_ENV,
            start_timeout_s=120,
            log_path=str(log_path),
        )
        await engine.start()
        pid = engine.server.pid
        try:
            inflight = asyncio.create_task(generate_to_completion(engine, [5, 17, 42], LONG))
            await _kill_when_decoding(engine.base_url, pid)
            with pytest.raises(ServerExited) as first:
                await inflight
            failure = await asyncio.wait_for(engine.wait_failed(), 10)
            with pytest.raises(ServerExited) as later:
                await engine.agenerate([1, 2, 3], SamplingParams(max_new_tokens=2))
            with pytest.raises(ServerExited):
                await engine.health()
            with pytest.raises(ServerExited):
                await engine.pause()
        finally:
            await engine.aclose()
        return pid, str(first.value), str(later.value), str(failure)

    pid, first, later, failure = asyncio.run(scenario())
    _assert_names_the_server(first, pid)
    assert first == later == failure
    assert str(log_path) in first and log_path.exists()  # the log is kept for the post-mortem
    assert process_group_members(pid) == []


def test_clean_close_is_not_a_server_failure(tiny_model):
    async def scenario():
        engine = SGLangEngine(tiny_model, launch_cmd=STANDIN, env=STANDIN_ENV, start_timeout_s=120)
        await engine.start()
        watch = asyncio.create_task(engine.wait_failed())
        await engine.aclose()
        await asyncio.sleep(0.5)  # longer than the watchdog's poll
        assert not watch.done()
        watch.cancel()

    asyncio.run(scenario())


def _rollout_worker_kwargs(model: str, launch_cmd: list[str], env: dict) -> dict:
    return {
        "model_path": model,
        "engine": EngineSpec(name="sglang", model_path=model, start_timeout_s=120).to_wire(),
        "engine_options": {"launch_cmd": launch_cmd, "env": env},
        "reward": "arl.rewards.arith:arith_reward",
        "sampling": {"max_new_tokens": LONG.max_new_tokens},
        "n_samples": 4,
        "max_prompt_len": 256,
    }


def test_rollout_node_stops_naming_its_killed_server(tiny_model):
    row = make_arith(1, seed=0, split="test")[0]

    async def scenario():
        async with local_cluster(1, heartbeat_interval=0.3, heartbeat_timeout=30) as (
            ctl,
            nodes,
            procs,
        ):
            node = nodes[0]
            worker = await node.create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                **_rollout_worker_kwargs(tiny_model, STANDIN, STANDIN_ENV),
            )
            health = await rollout_worker(worker).setup()
            pid, url = health["pid"], health["url"]
            group = asyncio.create_task(rollout_worker(worker).run_group("g0", row))
            t_kill = time.monotonic()
            await _kill_when_decoding(url, pid)
            # The group's own reply (ServerExited) may leave before the node's goodbye; either
            # way the error names the node and the server.
            with pytest.raises((RemoteError, NodeLost)) as failed:
                await group
            node_exit = await asyncio.wait_for(procs.procs[0].wait(), 30)
            detected_s = time.monotonic() - t_kill
            while not node.lost and time.monotonic() - t_kill < 30:
                await asyncio.sleep(0.05)  # the goodbye was sent before the process exited
            return pid, failed.value, node.lost, detected_s, node_exit

    pid, failed, reason, detected_s, node_exit = asyncio.run(scenario())
    message = str(failed)
    if isinstance(failed, RemoteError):
        assert failed.kind is ErrorKind.SERVER_EXITED and failed.node == "node0", message
        assert failed.recoverable, message
    else:
        assert "node node0 was lost while running rollout.run_group" in message, message
    _assert_names_the_server(message, pid)
    # The node left on its own, saying why; later calls to it fail at once with that reason.
    assert reason.startswith("node exited (sglang inference server exited"), reason
    # Seen by the watchdog, well inside the heartbeat timeout (30 s) the node kept answering.
    assert detected_s < 30
    assert node_exit == 0  # an orderly stop, not a crash
    assert process_group_members(pid) == []


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rollout_node_stops_naming_its_killed_vllm_server(tmp_path):
    python = vllm_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    from arl.engines.model import resolve_model

    model = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    row = make_arith(1, seed=0, split="test")[0]
    # A long answer, so the group is still generating when its server is killed.
    row["messages"] = [{"role": "user", "content": "Tell a long story about a lighthouse."}]

    async def scenario():
        async with local_cluster(1, heartbeat_interval=0.5, heartbeat_timeout=60) as (
            _ctl,
            nodes,
            procs,
        ):
            worker = await nodes[0].create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                model_path=model,
                engine=EngineSpec(
                    name="vllm",
                    model_path=model,
                    dtype="bfloat16",
                    python=python,
                    server_args=("--max-model-len", "2048"),  # eager: arl adds it
                    start_timeout_s=1500,
                ).to_wire(),
                engine_options={"env": {"VLLM_CPU_KVCACHE_SPACE": "2"}},
                reward="arl.rewards.arith:arith_reward",
                sampling={"max_new_tokens": 1024},
                n_samples=4,
            )
            health = await rollout_worker(worker).setup()
            group = asyncio.create_task(rollout_worker(worker).run_group("g0", row))
            # Killed while it generates: an idle machine answers a short question within a
            # second, so the kill waits for requests running on the server, not a fixed time.
            await _until_vllm_runs_requests(health["url"])
            os.kill(health["pid"], signal.SIGKILL)
            with pytest.raises((RemoteError, NodeLost)) as failed:  # as with the stand-in
                await group
            await asyncio.wait_for(procs.procs[0].wait(), 60)
            return health["pid"], str(failed.value)

    pid, message = asyncio.run(scenario())
    assert "vllm inference server exited" in message and f"pid {pid}" in message, message
    assert "node0" in message and "SIGKILL" in message, message
    deadline = time.monotonic() + 60
    while process_group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process_group_members(pid) == []
