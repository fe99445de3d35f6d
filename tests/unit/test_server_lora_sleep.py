"""Server engines with LoRA and sleep: SGLang's adapter and memory endpoints against the
stand-in (which really generates with the adapter injected by peft), vLLM's command line, and
the plan checks that refuse what an engine cannot do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arl.config import ConfigError
from arl.engines.base import SamplingParams
from arl.engines.lora import add_lora, lora_tensors, save_adapter
from arl.engines.server import ServerError
from arl.engines.spec import EngineSpec, check_engine_support, server_command
from tests.support import LoopThread
from tests.unit.test_sglang_engine import (
    PROMPT,
    _engine,
    _greedy,
    _load,
    _teacher_forced,
    _tiny_llama,
)

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["all-linear"]}


def _adapter(model_dir: Path, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Random adapter tensors (B nonzero) and the reference: the model holding them."""
    model = add_lora(_load(model_dir), LORA).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    named = {n: 0.5 * torch.randn(t.shape, generator=gen) for n, t in lora_tensors(model)}
    model.load_state_dict(named, strict=False)
    return named, model


def test_sglang_serves_each_synced_adapter_by_name_and_sleeps(tmp_path: Path) -> None:
    _tiny_llama(tmp_path / "base", seed=0)
    base = _load(tmp_path / "base")
    v1, ref1 = _adapter(tmp_path / "base", seed=1)
    v2, ref2 = _adapter(tmp_path / "base", seed=2)
    save_adapter(tmp_path / "v1", v1.items(), LORA)
    save_adapter(tmp_path / "v2", v2.items(), LORA)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    loop = LoopThread()
    engine = _engine(tmp_path / "base", lora_rank=4)
    try:
        loop.run(engine.start())

        async def sync(folder: str) -> list[int]:
            await engine.pause()
            await engine.update_weights_from_disk(str(tmp_path / folder))
            await engine.resume()
            return (await engine.agenerate(PROMPT, greedy)).output_ids

        assert loop.run(engine.agenerate(PROMPT, greedy)).output_ids == _greedy(base, PROMPT, 12)
        on_v1 = loop.run(sync("v1"))
        assert engine.adapter == "arl-v1"
        assert on_v1 == _greedy(ref1, PROMPT, 12)
        got = torch.tensor(loop.run(engine.score(PROMPT + on_v1)))
        want, _ = _teacher_forced(ref1, PROMPT[:1], PROMPT[1:] + on_v1)
        assert torch.allclose(got, want, atol=1e-4)
        on_v2 = loop.run(sync("v2"))
        assert engine.adapter == "arl-v2" and on_v2 == _greedy(ref2, PROMPT, 12)
        assert on_v1 != on_v2

        # The previous version was unloaded: the server refuses requests naming it.
        engine.adapter = "arl-v1"
        with pytest.raises(ServerError, match="no LoRA adapter named 'arl-v1'"):
            loop.run(engine.agenerate(PROMPT, greedy))
        engine.adapter = "arl-v2"

        assert loop.run(engine.sleep(drop_weights=False)) == 0
        health = loop.run(engine.health())
        assert health["asleep"] and health["paused"] and health["adapter"] == "arl-v2"
        with pytest.raises(ServerError, match="wake"):
            loop.run(engine.resume())
        loop.run(engine.wake())
        loop.run(engine.resume())
        assert loop.run(engine.agenerate(PROMPT, greedy)).output_ids == on_v2
        assert not loop.run(engine.health())["asleep"]
    finally:
        loop.run(engine.aclose())
        loop.close()


def test_server_command_lines_enable_lora_and_sleep() -> None:
    spec = EngineSpec(name="vllm", model_path="/m", device="cuda:0", lora_rank=16, sleep_mode=True)
    argv = server_command(spec)
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    assert "--enable-lora" in argv and "--enable-sleep-mode" in argv
    plain = server_command(EngineSpec(name="vllm", model_path="/m", device="cuda:0"))
    assert "--enable-lora" not in plain and "--enable-sleep-mode" not in plain
    argv = server_command(EngineSpec(name="sglang", model_path="/m", lora_rank=8, sleep_mode=True))
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    assert "--enable-memory-saver" in argv


def test_a_plan_asking_an_engine_for_what_it_cannot_do_is_refused() -> None:
    with pytest.raises(
        ConfigError, match="rollout.gpu_sharing=sleep: vLLM's sleep mode needs CUDA"
    ):
        check_engine_support(EngineSpec(name="vllm", model_path="/m", sleep_mode=True))
    check_engine_support(EngineSpec(name="vllm", model_path="/m", device="cuda:0", sleep_mode=True))
    check_engine_support(EngineSpec(name="hf", model_path="/m", lora_rank=8, sleep_mode=True))


def test_dry_run_shows_lora_and_sleep_on_a_shared_gpus_server_command() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    args = ["rollout.backend=vllm:d1", "cluster.n_gpus=1", "cluster.launcher=slurm"]
    args += ["actor.lora.rank=16", "rollout.gpu_sharing=sleep"]
    cmd = [sys.executable, "-m", "arl.launch", "recipes/arith.py", *args, "--dry-run"]
    out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("node 0: ")]
    assert "--enable-lora --max-lora-rank 16" in line and "--enable-sleep-mode" in line
