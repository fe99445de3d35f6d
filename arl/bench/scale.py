"""``python -m arl.bench scale``: the RL loop at the model sizes people train, on one GPU.

Builds a model with random weights at a Qwen2.5 shape (``--shape q1p5b``, ``q3b``, ``q7b``;
``tiny`` for a CPU smoke test) with the default model's tokenizer and no EOS, so every sample
runs to its token budget, then runs the gsm8k-shaped step on it (64 prompt groups x 4 samples,
``gconfig.max_new_tokens`` 512, arith prompts) for ``--steps`` steps, full fine-tune or
``--lora RANK``. Rewards come from `text_hash_reward`: random text scores 0 on arith, which
would zero every advantage and gradient; hashed rewards are mixed, so the update moves the
weights as a real run's does. It prints, beside floors
measured in the same run:

- step time (mean over steps 3..N: what a user waits for; the median beside it);
- each phase of the step (`arl.bench.loop`'s table) and the train phase's MFU
  (6 x params x tokens / train seconds / measured matmul peak; with LoRA the frozen base still
  runs forward and backward through activations, so the same 6 N counts the work done);
- decode: tokens per second of the engines while busy, the decode phase alone (a step's
  generated tokens at that rate), and its floor (weights read once per decode step);
- weight sync: seconds and bytes per sync (with LoRA, the adapter's), against the full weights;
- peak GPU memory (device-wide, sampled every 0.25 s) and peak host memory (used RAM above the
  baseline before the run).

Settings that the memory plan needs (``rollout.gpu_sharing=sleep``, ``actor.offload=optimizer``)
are passed as overrides; the plan itself refuses a run that cannot fit before it starts.

    python -m arl.bench scale --shape q1p5b --steps 6 --out q1p5b_full.json
    python -m arl.bench scale --shape q7b --lora 16 --steps 5
    python -m arl.bench scale --shape q7b --steps 5 \
        rollout.gpu_sharing=sleep actor.offload=optimizer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from arl.bench import fresh_run_dir, new_file, write_new

# Qwen2.5 shapes (config.json of the released models), random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "q1p5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "q3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "q7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # A CPU smoke test of the bench itself.
    "tiny": dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


async def text_hash_reward(completion: str, data: dict[str, Any]) -> float:
    """0 or 1 from a hash of the completion's text. A random model's completions all score 0
    on arith, which zeroes GRPO's advantages and every gradient; hashed, a group's rewards are
    mixed, so the update moves the weights as a real run's does, at no scoring cost."""
    return float(zlib.crc32(completion.encode()) & 1)


# The gsm8k recipe's step shape; the CPU smoke test shrinks it (`CPU_SHAPE`).
GSM8K_SHAPE = ["data.batch_size=64", "gconfig.n_samples=4", "gconfig.max_new_tokens=512"]
CPU_SHAPE = ["data.batch_size=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=8"]


def build_random_model(
    shape: str, workdir: Path, device: str, tokenizer: str | None = None
) -> Path:
    """A HF folder of ``shape`` with random bf16 weights (fp32 on CPU), the tokenizer files of
    ``tokenizer`` (a folder; none: the default model's) and no EOS; built on ``device`` (a 7B
    model initialises in seconds on a GPU, minutes on a CPU). Kept under ``workdir/shape`` and
    reused when already complete."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arl.config import ActorConfig
    from arl.engines.model import resolve_model
    from arl.train.fsdp import EXPORT_FILES

    path = workdir / shape
    if (path / "done").exists():
        return path
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    del model
    source = Path(tokenizer or resolve_model(ActorConfig().path))
    for name in EXPORT_FILES:
        if (source / name).is_file() and name != "generation_config.json":
            (path / name).write_bytes((source / name).read_bytes())
    (path / "done").write_text("")
    return path


class MemorySampler:
    """Peak device-wide GPU memory in use and peak host RAM in use above its level at start,
    sampled every ``period`` seconds on a thread of its own."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.gpu_peak = 0
        self.host_base = _host_used()
        self.host_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arl-mem-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import torch

        cuda = torch.cuda.is_available()
        while not self._stop.is_set():
            if cuda:
                free, total = torch.cuda.mem_get_info()
                self.gpu_peak = max(self.gpu_peak, total - free)
            self.host_peak = max(self.host_peak, _host_used() - self.host_base)
            self._stop.wait(self.period)


def _host_used() -> int:
    """Bytes of RAM in use on this host (MemTotal - MemAvailable)."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def scale_figures(rows: list[dict], m: dict, floors: dict, n_params: int, model: Path) -> dict:
    """The issue's figures of one run: mean step time over steps 3..N, train MFU, decode rate and
    its floor, sync seconds and bytes against the full weights."""
    from arl.bench.gpu import model_bytes

    late = [r for r in rows if r["step"] >= 3] or rows[1:] or rows
    train_s = [r["time/logp_s"] + r["time/update_s"] for r in late]
    tokens = [r["batch/n_tokens"] for r in late]
    peak = floors["matmul_flops"]
    r = m["rollout"]
    gen_per_step = statistics.mean(r_["rollout/gen_tokens"] for r_ in late)
    busy_rate = r.get("decoded_tokens_per_s", 0.0) / max(r.get("busy_share", 0.0), 1e-9)
    weight_bytes, kv_per_token = model_bytes(str(model))
    batch = max(r.get("mean_decode_batch", 1.0), 1.0)
    # One decode step reads the weights once and each row's KV cache (~half the budget each).
    decode_step_floor = (weight_bytes + batch * 256 * kv_per_token) / floors["hbm_bytes_s"]
    sync_bytes = statistics.mean(float(x.get("sync/bytes") or 0) for x in late)
    return {
        "mean_step_s": statistics.mean(x["time/step_s"] for x in late),
        "median_step_s": statistics.median(x["time/step_s"] for x in late),
        "train_s": statistics.mean(train_s),
        "train_mfu": statistics.mean(
            6 * n_params * t / s / peak for t, s in zip(tokens, train_s, strict=True)
        ),
        "train_tokens_per_step": statistics.mean(tokens),
        "decode_tokens_per_s_busy": busy_rate,
        "decode_phase_alone_s": gen_per_step / busy_rate if busy_rate else None,
        "decode_step_ms": 1e3 * batch / busy_rate if busy_rate else None,
        "decode_step_floor_ms": 1e3 * decode_step_floor,
        "mean_decode_batch": batch,
        "sync_s": statistics.mean(x["time/sync_s"] for x in late),
        "sync_bytes": sync_bytes,
        "full_weight_bytes": weight_bytes,
        "sync_share_of_full": sync_bytes / weight_bytes if weight_bytes else None,
        "wait_rollout_s": statistics.mean(x["time/wait_rollout_s"] for x in late),
    }


def main(argv: list[str] | None = None) -> int:
    """Build the model, run the loop, print the figures, write the JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m arl.bench scale", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="q1p5b")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--tokenizer", default=None, help="folder of tokenizer files (default: the default model's)"
    )
    p.add_argument("--models", type=Path, default=Path("runs/bench-scale-models"))
    p.add_argument("--run-dir", type=Path, default=Path("runs/bench-scale"))
    p.add_argument(
        "--out", type=new_file, default=None, help="write the figures as JSON here (a new file)"
    )
    p.add_argument("overrides", nargs="*", help="config overrides key=value (applied last)")
    a = p.parse_intermixed_args(args)
    if a.steps < 2:
        print("error: --steps must be >= 2 (step 1 is the warm-up)", file=sys.stderr)
        return 2
    import torch

    from arl.bench.gpu import measure_floors
    from arl.bench.loop import loop_config, run_loop, summarize
    from arl.stats.logger import read_jsonl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.monotonic()
    model = build_random_model(a.shape, a.models, device, a.tokenizer)
    build_s = time.monotonic() - t0
    n_params = _count_params(model)
    shape = GSM8K_SHAPE if device == "cuda" else CPU_SHAPE
    lora = [f"actor.lora.rank={a.lora}"] if a.lora else []
    cfg = loop_config(
        "recipes/arith.py",
        a.steps,
        a.run_dir,
        [
            f"actor.path={model}",
            *shape,
            "evaluator.freq_steps=none",
            "rollout.reward=arl.bench.scale:text_hash_reward",
            *lora,
            *a.overrides,
        ],
    )
    floors = measure_floors(device)
    fresh_run_dir(cfg.run_path)
    kind = f"LoRA rank {a.lora}" if a.lora else "full fine-tune"
    print(
        f"scale: {a.shape} ({n_params / 1e9:.2f}B params, random weights, built in "
        f"{build_s:.0f} s), {kind}, {cfg.data.batch_size} groups x {cfg.gconfig.n_samples} "
        f"samples x {cfg.gconfig.max_new_tokens} tokens, {a.steps} steps on {device}; "
        f"overrides {a.overrides}",
        flush=True,
    )
    with MemorySampler() as mem:
        run = asyncio.run(run_loop(cfg, 0, cfg.run_path / "profile"))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    m = summarize(rows, floors, n_params, run["samples"], None, 0)
    fig = scale_figures(rows, m, floors, n_params, model)
    fig |= {
        "peak_gpu_gb": mem.gpu_peak / 1e9,
        "peak_host_gb": mem.host_peak / 1e9,
        "startup_s": run["startup_s"],
        "n_params": n_params,
        "shape": a.shape,
        "lora_rank": a.lora,
        "overrides": a.overrides,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "floors": floors,
        "per_step": [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "time/step_s",
                    "time/wait_rollout_s",
                    "time/train_s",
                    "time/sync_s",
                    "batch/n_tokens",
                    "rollout/gen_tokens",
                    "sync/bytes",
                )
            }
            for r in rows
        ],
    }
    print(report(fig))
    print(f"\ncommand: python -m arl.bench scale {' '.join(args)}")
    if a.out:
        write_new(a.out, json.dumps(fig | {"loop": m}, indent=1, default=str))
    return 0


def _count_params(model: Path) -> int:
    from arl.bench.gpu import model_bytes

    return model_bytes(str(model))[0] // 2


def report(f: dict) -> str:
    """The figures as lines, each beside its floor or reference."""

    def s(x: float | None, fmt: str = ".3f") -> str:
        return "-" if x is None else format(x, fmt)

    return "\n".join(
        [
            f"step: mean {f['mean_step_s']:.2f} s (steps 3..N), median {f['median_step_s']:.2f} s;"
            f" waiting for rollout {f['wait_rollout_s']:.2f} s of it",
            f"train: {f['train_s']:.2f} s for {f['train_tokens_per_step']:,.0f} tokens, MFU "
            f"{f['train_mfu']:.3f} of the measured matmul peak "
            f"({f['floors']['matmul_flops'] / 1e12:.0f} TFLOP/s)",
            f"decode: {f['decode_tokens_per_s_busy']:,.0f} tokens/s while busy, mean batch "
            f"{f['mean_decode_batch']:.0f}; decode step {s(f['decode_step_ms'], '.1f')} ms vs "
            f"floor {f['decode_step_floor_ms']:.2f} ms; the decode phase alone "
            f"{s(f['decode_phase_alone_s'], '.1f')} s a step",
            f"sync: {f['sync_s']:.3f} s, {f['sync_bytes'] / 1e6:,.1f} MB a sync = "
            f"{100 * (f['sync_share_of_full'] or 0):.2f}% of the full weights "
            f"({f['full_weight_bytes'] / 1e9:.2f} GB)",
            f"memory: peak GPU {f['peak_gpu_gb']:.1f} GB (device-wide), peak host "
            f"{f['peak_host_gb']:.1f} GB above the start; start-up {f['startup_s']:.0f} s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
