"""The engine spec: every rollout setting reaches its engine, and --dry-run shows the servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import plan_placement
from arl.engines.sglang import SGLangEngine
from arl.engines.spec import (
    EngineSpec,
    build_engine,
    describe,
    engine_options,
    engine_spec,
    server_command,
)
from arl.engines.vllm import VLLMEngine
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tests.support.sglang_standin"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _specs(overrides: list[str], n_gpus: int) -> list[EngineSpec]:
    cfg = apply_overrides(Config(), overrides)
    cfg.validate()
    plan = plan_placement(cfg, n_gpus)
    return [engine_spec(cfg, n, "/models/m") for n in plan.rollout]


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "arl.launch", "recipes/arith.py", *args, "--dry-run"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("engine", "flag"), [("vllm", "--tensor-parallel-size 2"), ("sglang", "--tp-size 2")]
)
def test_dry_run_prints_the_server_command_with_the_tensor_parallel_size(engine, flag):
    out = _dry_run(f"rollout.backend={engine}:d1t2", "cluster.n_gpus=3", "cluster.launcher=slurm")
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("node 0: ")]
    assert flag in line
    assert "--port <port>" in line


def test_every_rollout_setting_reaches_the_server_command_line():
    overrides = [
        "rollout.backend=vllm:d2t2",
        "rollout.dtype=bfloat16",
        "experiment.seed=7",
        "rollout.server_python=/venv/bin/python",
        "rollout.server_args=[--max-model-len,2048]",
        "rollout.server_start_timeout=33",
    ]
    first, second = _specs(overrides, n_gpus=5)
    argv = server_command(first, port=8000)
    assert argv[0] == "/venv/bin/python"
    assert argv[argv.index("--model") + 1] == "/models/m"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--seed") + 1] == "7"
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[-2:] == ["--max-model-len", "2048"]
    assert server_command(second)[server_command(second).index("--seed") + 1] == "8"
    # The engine built from the spec runs exactly that command and waits the configured time.
    engine = VLLMEngine.from_spec(first)
    assert engine.server.argv[:4] == argv[:4]
    assert engine.server.argv[engine.server.argv.index("--tensor-parallel-size") + 1] == "2"
    assert engine._start_timeout_s == 33.0


def test_a_vllm_server_on_the_cpu_runs_eager_unless_the_user_chooses_compilation():
    (cpu,) = _specs(["rollout.backend=vllm:d1"], n_gpus=0)
    assert cpu.device == "cpu"
    assert server_command(cpu)[-1] == "--enforce-eager"
    engine = VLLMEngine.from_spec(cpu)
    assert engine.server.argv.count("--enforce-eager") == 1
    assert cpu.server_args == ()  # the spec keeps what the user wrote
    # a server on a GPU compiles, as vLLM does by default
    gpu = attrs.evolve(cpu, device="cuda:0")
    assert "--enforce-eager" not in server_command(gpu)
    # a user's own choice stands, and is not doubled
    for args in (["-O3"], ["--compilation-config", "{}"], ["-cc={}"], ["--enforce-eager"]):
        (spec,) = _specs(["rollout.backend=vllm:d1", f"rollout.server_args=[{','.join(args)}]"], 0)
        argv = server_command(spec)
        assert argv[-len(args) :] == args and argv.count("--enforce-eager") <= 1, args
    # sglang takes no such flag
    (sg,) = _specs(["rollout.backend=sglang:d1"], n_gpus=0)
    assert "--enforce-eager" not in server_command(sg)


def test_sglang_spec_uses_sglang_flag_names():
    (spec,) = _specs(["rollout.backend=sglang:d1t4", "rollout.dtype=float16"], n_gpus=5)
    argv = server_command(spec)
    for flag, value in (("--tp-size", "4"), ("--dtype", "float16"), ("--random-seed", "1")):
        assert argv[argv.index(flag) + 1] == value
    assert "--model-path" in argv and "--tensor-parallel-size" not in argv


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.backend=vllm:d1", "rollout.server_args=[--dtype,float16]"], "sets --dtype"),
        (["rollout.backend=vllm:d1", "rollout.server_args=[--seed=3]"], "sets --seed"),
        (["rollout.backend=sglang:d1", "rollout.server_args=[--tp-size,2]"], "sets --tp-size"),
        (["rollout.server_args=[--foo]"], "starts no server"),
    ],
)
def test_contradicting_engine_settings_are_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _specs(overrides, n_gpus=0)
    out = _dry_run(*overrides)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and message in out.stderr


def test_wire_form_round_trips_and_names_a_bad_field():
    (spec,) = _specs(["rollout.backend=sglang:d1t2", "rollout.server_args=[--x]"], n_gpus=2)
    assert EngineSpec.from_wire(spec.to_wire()) == spec
    wire = spec.to_wire()
    with pytest.raises(ValueError, match="EngineSpec: 'tp_size' must be an integer, got '2'"):
        EngineSpec.from_wire({**wire, "tp_size": "2"})
    with pytest.raises(ValueError, match="EngineSpec: 'device' must be text, it is missing"):
        EngineSpec.from_wire({k: v for k, v in wire.items() if k != "device"})
    with pytest.raises(ValueError, match=r"EngineSpec: has unknown field\(s\) \['engine'\]"):
        EngineSpec.from_wire({**wire, "engine": "x"})
    with pytest.raises(ConfigError, match="not a registered engine"):
        EngineSpec.from_wire({**wire, "name": "os:system"})


def test_hf_engine_is_built_from_its_spec(tiny_model):
    spec = EngineSpec(name="hf", model_path=tiny_model, dtype="float32", seed=5)
    assert describe(spec).startswith("hf engine in the node process on cpu")
    with build_engine(spec) as engine:
        assert engine.device.type == "cpu"
        assert engine.dtype == torch.float32


def test_the_server_process_gets_the_spec_flags(tiny_model):
    """A real server process (the SGLang stand-in) is started with the spec's command line."""
    spec = EngineSpec(name="sglang", model_path=tiny_model, tp_size=2, dtype="float32", seed=9)

    async def scenario() -> list[str]:
        engine = SGLangEngine.from_spec(spec, launch_cmd=STANDIN)
        await engine.start()
        try:
            cmdline = Path(f"/proc/{engine.server.pid}/cmdline").read_bytes()
            return cmdline.decode().split("\0")
        finally:
            await engine.aclose()

    argv = asyncio.run(scenario())
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[argv.index("--random-seed") + 1] == "9"
    assert argv[argv.index("--model-path") + 1] == tiny_model


def test_an_in_process_engine_is_sized_for_the_run_and_a_server_sizes_itself():
    """`engine_options`: rows for every concurrent sample split over the engines (at most
    1,024), a length for the longest prompt plus completion (at least 2,048), the adapter."""
    cfg = apply_overrides(
        Config(),
        [
            "rollout.max_concurrent_rollouts=300",
            "gconfig.n_samples=8",
            "data.max_prompt_len=3000",
            "gconfig.max_new_tokens=1000",
            "actor.lora.rank=4",
        ],
    )
    hf = EngineSpec(name="hf", model_path="/m")
    one, three = engine_options(cfg, hf, 1), engine_options(cfg, hf, 3)
    assert (one["max_batch_size"], three["max_batch_size"]) == (1024, 800)  # 2,400 / 3
    assert one["max_seq_len"] == one["warm_up_len"] == 4001
    assert one["lora"]["rank"] == 4 and one["decode_attention"] == "auto"
    short = engine_options(apply_overrides(Config(), ["gconfig.max_new_tokens=8"]), hf, 1)
    assert short["max_seq_len"] == 2048 and short["warm_up_len"] == 512 + 8 + 1
    assert "lora" not in short
    assert one["overlap"] is None and one["fused_decode"] is None  # each where the device allows
    off = apply_overrides(Config(), ["rollout.hf_overlap=false", "rollout.hf_fused_decode=false"])
    assert (
        engine_options(off, hf, 1)["overlap"] is engine_options(off, hf, 1)["fused_decode"] is False
    )
    assert engine_options(cfg, EngineSpec(name="vllm", model_path="/m"), 1) == {}


def test_a_server_python_under_tilde_is_in_the_home_folder(tmp_path, monkeypatch):
    # A shell leaves `~` as it is in `rollout.server_python=~/venv/bin/python`.
    monkeypatch.setenv("HOME", str(tmp_path))
    (spec,) = _specs(["rollout.backend=vllm:d1", "rollout.server_python=~/venv/bin/python"], 0)
    assert spec.python == str(tmp_path / "venv" / "bin" / "python")
    assert server_command(spec)[0] == spec.python
