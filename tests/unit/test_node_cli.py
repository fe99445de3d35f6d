"""``python -m arl.node`` as a job script runs it: bad flags and secrets end as one ``error:``
line and status 2, a node that never reaches its controller exits 1 saying so, and one the
controller ends exits 0."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arl.control.controller import Controller
from arl.node.daemon import NodeDaemon, NodeStartError
from arl.protocol.node_config import NodeConfig
from arl.wire.addresses import free_port
from arl.wire.sockets import SECRET_ENV, Security, new_secret, read_secret_file

REPO = Path(__file__).resolve().parents[2]


def node(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, "ARL_LOG_LEVEL")}
    return subprocess.run(
        [sys.executable, "-m", "arl.node", *args],
        cwd=REPO,
        env={**base, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one line of a refused start: status 2, ``error: ...``, no traceback."""
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: "), line
    return line


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(new_secret())
    path.chmod(0o600)
    return path


@pytest.fixture
def nowhere() -> str:
    """A controller address where nothing listens."""
    return f"tcp://127.0.0.1:{free_port()}"


def test_no_secret_is_one_error_line(nowhere):
    line = error_line(node("--controller", nowhere))
    assert line == f"error: no run secret: pass --secret-file or set ${SECRET_ENV}"


def test_a_missing_secret_file_is_one_error_line(nowhere, tmp_path):
    missing = tmp_path / "nope"
    line = error_line(node("--controller", nowhere, "--secret-file", str(missing)))
    assert line == f"error: secret file {missing} does not exist; create it with mode 0600"


def test_a_secret_file_others_can_read_is_one_error_line(nowhere, secret_file):
    secret_file.chmod(0o644)
    line = error_line(node("--controller", nowhere, "--secret-file", str(secret_file)))
    assert line.endswith(f"has mode 0o644; run `chmod 600 {secret_file}`"), line


def test_an_empty_secret_file_is_one_error_line(nowhere, secret_file):
    secret_file.write_text("\n")
    line = error_line(node("--controller", nowhere, "--secret-file", str(secret_file)))
    assert line == f"error: secret file {secret_file} is empty"


@pytest.mark.parametrize("address", ["garbage", "127.0.0.1:5555", "tcp://host", "tcp://h:0"])
def test_a_controller_address_that_is_not_tcp_host_port_is_one_error_line(address, secret_file):
    line = error_line(node("--controller", address, "--secret-file", str(secret_file)))
    assert line.startswith(f"error: argument --controller: {address!r} is not tcp://HOST:PORT")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--heartbeat-interval", "-1", "-1 is not a positive number of seconds"),
        ("--heartbeat-timeout", "0", "0 is not a positive number of seconds"),
        ("--heartbeat-timeout", "soon", "invalid float value: 'soon'"),
    ],
)
def test_a_heartbeat_that_is_not_positive_seconds_is_one_error_line(
    flag, value, says, nowhere, secret_file
):
    line = error_line(node("--controller", nowhere, "--secret-file", str(secret_file), flag, value))
    assert line.startswith(f"error: argument {flag}: {says}"), line


def test_an_unknown_log_level_is_one_error_line_from_the_flag_or_the_environment(
    nowhere, secret_file
):
    args = ("--controller", nowhere, "--secret-file", str(secret_file))
    for r in (node(*args, "--log-level", "bogus"), node(*args, env={"ARL_LOG_LEVEL": "bogus"})):
        line = error_line(r)
        assert line.startswith("error: argument --log-level: unknown log level 'bogus'"), line
        assert "use one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in line


def test_a_data_host_it_cannot_bind_is_one_error_line(nowhere, secret_file):
    r = node("--controller", nowhere, "--secret-file", str(secret_file), "--data-host", "999.1.1.1")
    line = error_line(r)
    assert line.startswith("error: cannot bind the data plane on '999.1.1.1' ("), line
    assert line.endswith("pass --data-host with an address or name of this machine"), line


def test_a_node_that_never_reaches_its_controller_exits_1_saying_so(nowhere, secret_file):
    r = node(
        "--controller",
        nowhere,
        "--secret-file",
        str(secret_file),
        "--heartbeat-interval",
        "0.1",
        "--heartbeat-timeout",
        "0.5",
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    # Shown at the default log level (WARNING), on one line.
    (line,) = r.stderr.splitlines()
    assert line.endswith(
        f"stopping: controller silent for more than 0.5s: could not reach the controller at "
        f"{nowhere}; check that it runs there and that this node has the run's secret"
    ), line


def test_a_node_its_controller_says_bye_to_exits_0(secret_file):
    """The end of a run (the controller closes and says bye) is a success, not a lost link."""

    async def main() -> tuple[int, str]:
        security = Security(secret_file.read_text())
        async with Controller(security, heartbeat_interval=0.2, heartbeat_timeout=30) as ctl:
            cmd = [sys.executable, "-m", "arl.node", "--controller", ctl.address]
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                "--secret-file",
                str(secret_file),
                "--node-id",
                "done",
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stderr=subprocess.PIPE,
            )
            try:
                await ctl.wait_for_nodes(1, timeout=60)
            except BaseException:
                proc.kill()
                raise
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, err.decode()

    code, err = asyncio.run(main())
    assert code == 0, err[-2000:]
    assert err == "", err[-2000:]


class _SlowClose:
    """A hosted object whose close takes a second, as an engine's may."""

    async def aclose(self) -> None:
        await asyncio.sleep(1.0)


def test_a_stopping_node_reports_no_stall_while_it_closes_its_objects(nowhere, caplog):
    """The loop watchdog ends before the shutdown, whose seconds of awaiting (closes, the
    goodbye) it would otherwise take for a blocked loop: with a 1 s heartbeat timeout it
    reports a loop silent for 0.4 s, and this shutdown awaits for 2 s."""
    cfg = NodeConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0)
    daemon = NodeDaemon(nowhere, Security(new_secret()), node_id="quiet", config=cfg)
    daemon.info = lambda: {"node_id": "quiet"}  # the real one imports torch
    daemon.objects["engine"] = _SlowClose()

    async def main() -> str:
        asyncio.get_running_loop().call_later(0.2, daemon.stop, "told to")
        return await daemon.run()

    with caplog.at_level(logging.WARNING, logger="arl.node"):
        assert asyncio.run(main()) == "told to"
    assert not daemon.failed
    assert "event loop blocked" not in caplog.text, caplog.text


def test_a_node_whose_first_cuda_query_is_slow_keeps_its_loop_turning_and_reports_no_stall(
    nowhere, caplog
):
    """What the hello says is taken off the event loop: torch's first CUDA query starts NVML,
    which took over 2.5 s on an H100 host in a gsm8k run, and the loop's watchdog (0.4 s with
    a 1 s heartbeat timeout) reported that as a stall before the node had said hello."""
    cfg = NodeConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0)
    daemon = NodeDaemon(nowhere, Security(new_secret()), node_id="slow", config=cfg)
    asked: list[str] = []
    answered: list[float] = []

    def slow_info() -> dict:
        asked.append(threading.current_thread().name)
        time.sleep(1.0)  # as NVML's start blocks
        answered.append(time.monotonic())
        return {"node_id": "slow"}

    daemon.info = slow_info
    ticks: list[float] = []

    async def main() -> str:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            ticks.append(time.monotonic())
            if len(ticks) < 40:
                loop.call_later(0.05, tick)

        loop.call_soon(tick)
        loop.call_later(1.3, daemon.stop, "told to")
        return await daemon.run()

    with caplog.at_level(logging.WARNING, logger="arl.node"):
        assert asyncio.run(main()) == "told to"
    assert asked and asked[0] != threading.main_thread().name
    # The loop kept turning while the answer was awaited (about 20 ticks; none when it blocked).
    assert sum(t < answered[0] for t in ticks) >= 5, (ticks, answered)
    assert "event loop blocked" not in caplog.text, caplog.text


def test_a_data_host_it_cannot_bind_closes_what_it_opened():
    """`NodeDaemon.run` refuses the address with `NodeStartError` and leaves no thread (the
    ZAP authenticator's) behind."""
    daemon = NodeDaemon(
        "tcp://127.0.0.1:1", Security(new_secret()), node_id="x", data_host="999.1.1.1"
    )
    before = set(threading.enumerate())
    with pytest.raises(NodeStartError, match="cannot bind the data plane on '999.1.1.1'"):
        asyncio.run(daemon.run())
    assert set(threading.enumerate()) <= before


def test_a_secret_file_under_tilde_is_read_from_the_home_folder(tmp_path, monkeypatch):
    # A shell leaves `~` as it is in `--secret-file=~/s` and `transport.secret_file=~/s`.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "s").write_text("s3cret\n")
    (tmp_path / "s").chmod(0o600)
    assert read_secret_file("~/s") == "s3cret"
