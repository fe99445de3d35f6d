"""The memory plan (`arl.control.memory`) at Qwen2.5-1.5B and -7B shapes: the parts' bytes,
the phases under engine sleep, optimizer offload's host bytes, and a plan that cannot fit
refused before anything starts, naming the change that fits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import Config, ConfigError, apply_overrides
from arl.control.memory import GB, ModelShape, check_memory, plan_memory, read_model_shape
from arl.control.placement import plan_placement
from arl.train.activations import activation_bytes_per_token

REPO = Path(__file__).resolve().parents[2]
QWEN = {
    "1.5b": dict(hidden=1536, inter=8960, heads=12, kv=2, vocab=151936, tied=True),
    "7b": dict(hidden=3584, inter=18944, heads=28, kv=4, vocab=152064, tied=False),
}


def _model(tmp_path: Path, size: str) -> str:
    q = QWEN[size]
    folder = tmp_path / f"qwen2.5-{size}"
    folder.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": q["hidden"],
        "intermediate_size": q["inter"],
        "num_hidden_layers": 28,
        "num_attention_heads": q["heads"],
        "num_key_value_heads": q["kv"],
        "vocab_size": q["vocab"],
        "tie_word_embeddings": q["tied"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _cfg(path: str, *more: str) -> Config:
    """The gsm8k recipe's sizes (64 groups x 4 samples, eta 2, 1024 new tokens) on GPUs of
    1000 GB unless ``more`` says otherwise."""
    base = [
        f"actor.path={path}",
        "cluster.gpu_memory_gb=1000",
        "data.batch_size=64",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=1024",
    ]
    return apply_overrides(Config(), base + list(more))


def _parts(mem, gpu: int = 0) -> dict:
    return {p.name.split(" (")[0]: p for p in mem.gpus[gpu].parts}


def test_parameter_counts_match_the_published_qwen_sizes(tmp_path):
    small, where = read_model_shape(_model(tmp_path, "1.5b"))
    large, _ = read_model_shape(_model(tmp_path, "7b"))
    assert where.endswith("config.json")
    assert small.n_params() == 1_543_714_304  # Qwen2.5-1.5B: 1.54 B (tied embeddings)
    assert large.n_params() == 7_615_616_512  # Qwen2.5-7B: 7.62 B (separate output head)
    # LoRA rank 16 on all seven linears: r x (in + out) each, per layer.
    assert large.lora_params(16, ["all-linear"]) == 28 * 16 * (
        (3584 + 3584) * 2 + (3584 + 512) * 2 + (3584 + 18944) * 2 + (18944 + 3584)
    )
    assert large.lora_params(16, ["q_proj", "v_proj"]) == 28 * 16 * (3584 * 2 + 3584 + 512)
    assert large.kv_bytes_per_position(2) == 28 * 2 * 4 * 128 * 2


def test_one_shared_gpu_parts_follow_the_formulas(tmp_path):
    cfg = _cfg(_model(tmp_path, "1.5b"))
    shape, _ = read_model_shape(cfg.actor.path)
    p = shape.n_params()
    mem = plan_memory(cfg, plan_placement(cfg, 1))
    parts = _parts(mem)
    assert parts["engine weights"].gpu == 2 * p
    # Rows as the trainer sizes the hf engine: 192 groups in flight x 4 samples on one engine.
    rows, positions = min(1024, 192 * 4), max(2048, 512 + 1024 + 1)
    kv = parts["KV cache"]
    assert kv.name == f"KV cache ({rows} rows x {positions})"
    assert kv.gpu == rows * positions * 28 * 2 * 2 * 128 * 2
    assert parts["trainer weights"].gpu == 4 * p + 2 * p  # fp32 masters + bf16 copy
    assert parts["gradients"].gpu == 4 * p + 2 * p  # held for CUDA graphs: both dtypes
    assert parts["optimizer"].gpu == 8 * p
    tokens = 512 + 1024  # the longest row: the least micro-batch the trainer takes
    assert parts["activations"].gpu == int(activation_bytes_per_token(shape, False) * tokens)
    assert parts["sync buffer"].gpu == 2 * p  # ipc_buffer: auto's choice on one shared GPU
    assert all(not part.host for part in parts.values())
    g = mem.gpus[0]
    assert g.peak == sum(part.gpu for part in parts.values())  # concurrent: all at once
    assert g.fits and mem.fits


def test_sleep_makes_the_peak_the_larger_phase_not_the_sum(tmp_path):
    path = _model(tmp_path, "1.5b")
    awake = plan_memory(_cfg(path, "actor.offload=optimizer"), plan_placement(_cfg(path), 1))
    cfg = _cfg(path, "actor.offload=optimizer", "rollout.gpu_sharing=sleep")
    asleep = plan_memory(cfg, plan_placement(cfg, 1))
    g, parts = asleep.gpus[0], _parts(asleep)
    for name in ("engine weights", "KV cache"):  # a full fine-tune: both given back
        assert parts[name].phases == {"rollout"}
    assert (
        g.phase_bytes("train")
        == awake.gpus[0].peak - parts["engine weights"].gpu - parts["KV cache"].gpu
    )
    assert g.peak == max(g.phase_bytes("rollout"), g.phase_bytes("train")) < awake.gpus[0].peak
    # With LoRA the engine keeps its weights asleep (only the adapters change).
    lora = _cfg(path, "actor.lora.rank=16", "rollout.gpu_sharing=sleep")
    assert _parts(plan_memory(lora, plan_placement(lora, 1)))["engine weights"].phases == {
        "rollout",
        "train",
    }


def test_offload_moves_masters_gradient_sums_and_optimizer_to_the_host(tmp_path):
    cfg = _cfg(_model(tmp_path, "7b"), "actor.offload=optimizer")
    p = read_model_shape(cfg.actor.path)[0].n_params()
    parts = _parts(plan_memory(cfg, plan_placement(cfg, 1)))
    assert (parts["trainer weights"].gpu, parts["trainer weights"].host) == (2 * p, 4 * p)
    assert (parts["optimizer"].gpu, parts["optimizer"].host) == (0, 8 * p)
    # The step streams the gradient sums to the host two 1 GiB chunks at a time.
    assert parts["gradients"].host == 2 * 4 * 2**28 and parts["gradients"].phases == {"train"}
    assert (
        "host memory (all GPUs' trainers): 93.5 GB"
        in plan_memory(cfg, plan_placement(cfg, 1)).format()
    )


def test_fsdp_ranks_hold_a_world_size_share(tmp_path):
    path = _model(tmp_path, "7b")
    cfg = _cfg(path, "actor.backend=fsdp:d4")
    p = read_model_shape(path)[0].n_params()
    mem = plan_memory(cfg, plan_placement(cfg, 5))  # engine on GPU 0, ranks on GPUs 1-4
    train = _parts(mem, 1)
    assert train["trainer weights"].gpu == 4 * p // 4
    assert train["optimizer"].gpu == 8 * p // 4
    assert "engine weights" not in train and "trainer weights" not in _parts(mem, 0)
    assert "GPUs 1,2,3,4 (nodes 1,2,3,4): train\n" in mem.format()  # identical GPUs print once


def test_a_plan_that_cannot_fit_names_the_least_change_that_fits(tmp_path):
    path = _model(tmp_path, "7b")
    # 141 GB (an H200): a 7B full fine-tune's 16 bytes a parameter alone do not fit; the
    # optimizer on the host does.
    cfg = _cfg(path, "cluster.gpu_memory_gb=141", "rollout.max_concurrent_rollouts=32")
    with pytest.raises(ConfigError, match=r"GPU 0 needs 2\d\d\.\d GB .* set actor\.offload="):
        plan_placement(cfg, 1)
    plan_placement(
        _cfg(
            path,
            "cluster.gpu_memory_gb=141",
            "rollout.max_concurrent_rollouts=32",
            "actor.offload=optimizer",
        ),
        1,
    )
    # 80 GB: offload and sleep leave 94.6 GB in the train phase; LoRA's 64.7 GB fits.
    with pytest.raises(ConfigError, match=r"set actor\.lora\.rank=16 \(then the peak is 64\.7"):
        plan_placement(
            _cfg(path, "cluster.gpu_memory_gb=80", "rollout.max_concurrent_rollouts=32"), 1
        )
    # Only what changes is named; LoRA (refused beside offload) turns offload off.
    offloaded = ("cluster.gpu_memory_gb=80", "rollout.max_concurrent_rollouts=32")
    with pytest.raises(ConfigError, match=r"set actor\.lora\.rank=16 actor\.offload=none \("):
        plan_placement(_cfg(path, *offloaded, "actor.offload=optimizer"), 1)
    # gsm8k's 768 rows of KV cache (90 GB) do not fit 80 GB whatever the trainer does.
    with pytest.raises(ConfigError, match="lower rollout.max_concurrent_rollouts"):
        plan_placement(_cfg(path, "cluster.gpu_memory_gb=80"), 1)


def test_an_unknown_model_or_a_cpu_plan_refuses_nothing(tmp_path):
    cfg = _cfg(str(tmp_path / "missing"), "cluster.gpu_memory_gb=1")
    mem = check_memory(cfg, plan_placement(cfg, 1))
    assert not mem.gpus and "model shape unknown" in mem.format()
    cpu = plan_memory(cfg, plan_placement(cfg, 0))
    assert "no GPU in the placement plan" in cpu.format()


def test_without_a_visible_gpu_the_capacity_is_assumed_and_said(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its memory is read")
    cfg = apply_overrides(Config(), [f"actor.path={_model(tmp_path, '1.5b')}"])
    mem = plan_memory(cfg, plan_placement(cfg, 1))
    assert mem.gpus[0].capacity == 80 * GB
    assert "of 80.0 GB (assumed; set cluster.gpu_memory_gb): fits" in mem.format()


def test_shape_reads_a_multimodal_text_config():
    shape = ModelShape.from_config(
        {
            "text_config": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 100,
            }
        }
    )
    assert (shape.num_key_value_heads, shape.head_dim, shape.attention_bias) == (4, 16, False)


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arl.launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_refuses_a_7b_plan_with_the_option_and_prints_it_with_that_option(tmp_path):
    """A CPU machine previewing one GPU (80 GB assumed). The dry run reads only config.json:
    it does not resolve the model (the run's preflight checks for weights), so a folder with
    the config alone previews a model before downloading it."""
    path = _model(tmp_path, "7b")
    runs = tmp_path / "runs"
    args = [
        "recipes/gsm8k.py",
        f"actor.path={path}",
        "cluster.n_gpus=1",
        "cluster.launcher=slurm",
        "rollout.max_concurrent_rollouts=32",
        f"experiment.run_dir={runs}",
    ]
    r = _launch(*args, "--dry-run")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: the memory plan does not")
    assert "set actor.lora.rank=16" in r.stderr and "Traceback" not in r.stderr
    # Without --dry-run the same refusal comes before any node starts or file is written.
    r = _launch(*args)
    assert r.returncode == 2 and "set actor.lora.rank=16" in r.stderr
    assert not runs.exists()
    r = _launch(*args, "actor.lora.rank=16", "--dry-run")
    assert r.returncode == 0, r.stderr
    plan = r.stdout.split("# memory plan\n", 1)[1]
    assert "7.62 B parameters" in plan
    assert "KV cache (128 rows x 2048)" in plan
    assert "peak 64.7 of 80.0 GB (assumed; set cluster.gpu_memory_gb): fits" in plan
    assert plan.rstrip().endswith("verdict: fits")


def test_dry_run_of_a_cpu_plan_says_there_is_nothing_to_fit():
    r = _launch("recipes/gsm8k.py", "cluster.n_gpus=0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "# memory plan\nno GPU in the placement plan: nothing to fit" in r.stdout
