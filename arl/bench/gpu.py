"""``python -m arl.bench gpu``: GPU figures, each beside a floor or peer measured in the same run.

Sections (``--only`` picks some):

- ``floors``: the device's own limits, measured here: HBM bandwidth (a device-to-device copy of
  1 GiB) and dense bf16 matmul TFLOP/s (8192^3). The nominal H200 figure (4.8 TB/s) is printed
  beside the measured one.
- ``decode``: the embedded hf engine's decode tokens/s at batch 1, 64 and 256 (every request
  runs to ``--new-tokens``: the model has no EOS), beside plain transformers ``generate`` on the
  same prompts and the roofline: a decode step must read every weight once and every row's KV
  cache once, so ``(weight bytes + KV bytes) / bandwidth`` is its floor. The engine's step is
  split into the forward pass (its CUDA graph replayed alone), sampling, and the rest (host
  work, the one device-to-host copy per step, and the prefill spread over the steps). The
  "before" column is the same engine with transformers' stock sdpa attention and no compiled
  blocks, as it was before the decode fixes of issue 7.
- ``decode_flex``: the engine's decode ms/step with ``decode_attention="sdpa"`` (every row's KV
  read up to the batch's longest, bucketed) beside ``"flex"`` and ``"triton"`` (each row's own
  length: compiled flex_attention, and the engine's split-KV Triton kernel), at the
  same batches, for prompts of ``--prompt-len`` and for prompts of mixed lengths (rows spanning
  64 to ``--mixed-max`` positions); beside the floor over the rows' own lengths and the floor
  over the padded width sdpa reads.
- ``train``: one training rank's (bf16) tokens/s of ``compute_logp`` and of advantages + update,
  with model FLOP utilisation against the matmul peak measured in ``floors``, per variant:
  padded rows in 8192-token micro-batches (the layout before issue 16), packed rows with
  varlen attention and memory-sized micro-batches, and that with compiled decoder layers.
- ``sync``: seconds per weight sync for ``ipc_buffer``, ``ipc``, ``zmq`` and ``disk`` (``python -m
  arl.bench sync`` runs a whole recipe per mode), the trainer and the engine
  colocated on one GPU as real arl nodes (three steps of the arith recipe, ``sync/paused_s``),
  beside the time the same bytes take in a device-to-device copy.

The model is SmolLM2-135M-Instruct by default (``--model``), or ``--model random``: its
architecture with random weights (``--model random-qwen1.5b``: Qwen2.5-1.5B's; same speed, no
download; needs ``--tokenizer DIR`` for the ``sync`` section, which runs the chat template).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from arl.bench import new_file, positive_int, write_new

NOMINAL_HBM_TB_S = 4.8  # H200 datasheet
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


# Qwen2.5-1.5B's shape (random weights): the MFU figure is taken at this size.
QWEN25_1P5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def _sync(device: str = "cuda") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time_cuda(fn: Any, reps: int, device: str = "cuda") -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- floors ---------------------------------------------------------------------------------
def measure_floors(device: str = "cuda") -> dict[str, float]:
    """Memory bandwidth (bytes read + written per second, a copy of 1 GiB) and matmul FLOP/s
    (bf16 8192^3 on a GPU; fp32 1024^3 on a CPU, where training runs in fp32) on ``device``."""
    on_gpu = torch.device(device).type == "cuda"
    size, n, dtype = (1 << 30, 8192, torch.bfloat16) if on_gpu else (1 << 27, 1024, torch.float32)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = _time_cuda(lambda: dst.copy_(src), 10 if on_gpu else 3, device)
    src = dst = None
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t_mm = _time_cuda(lambda: a @ b, 10 if on_gpu else 3, device)
    a = b = None
    if on_gpu:
        torch.cuda.empty_cache()
    key = "bf16_flops" if on_gpu else "fp32_flops"
    return {"hbm_bytes_s": 2 * size / t_copy, key: 2 * n**3 / t_mm, "matmul_flops": 2 * n**3 / t_mm}


# ---- the model ------------------------------------------------------------------------------
def prepare_model(spec: str, tokenizer: str | None, workdir: Path) -> str:
    """A local HF folder: the resolved model, or SmolLM2-135M's architecture with random weights.

    The random model has no EOS, so every request runs to its token budget.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if not spec.startswith("random"):
        from arl.engines.model import resolve_model

        src = Path(resolve_model(spec))
        # Copy with the EOS removed, so decode runs to the budget whatever the model says.
        path = workdir / "model"
        shutil.copytree(src, path)
        for name in ("config.json", "generation_config.json"):
            f = path / name
            if f.exists():
                cfg = json.loads(f.read_text())
                cfg["eos_token_id"] = None
                f.write_text(json.dumps(cfg))
        return str(path)
    torch.manual_seed(0)
    if spec == "random-qwen1.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_1P5B, eos_token_id=None))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, eos_token_id=None))
    model.generation_config.eos_token_id = None
    path = workdir / "random"
    model.save_pretrained(path)
    if tokenizer:
        from arl.train.fsdp import EXPORT_FILES

        # The tokenizer's files only, as an export copies them: a model folder passed as
        # --tokenizer also holds weights, which would replace the random ones, and a
        # generation config whose EOS would end decode early.
        for name in EXPORT_FILES:
            f = Path(tokenizer) / name
            if f.is_file() and name != "generation_config.json":
                shutil.copy(f, path / name)
    else:
        # The train and decode sections never tokenize, but a model folder needs a tokenizer.
        (path / "tokenizer_config.json").write_text("{}")
    return str(path)


def model_bytes(path: str) -> tuple[int, int]:
    """(bf16 weight bytes read per decode step, KV bytes per token)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_layer = (
        c.hidden_size * c.num_attention_heads * head_dim * 2
        + c.hidden_size * c.num_key_value_heads * head_dim * 2
        + 3 * c.hidden_size * c.intermediate_size
        + 2 * c.hidden_size
    )
    params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size
    if not c.tie_word_embeddings:
        params += c.vocab_size * c.hidden_size
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2
    return 2 * params, kv_per_token


# ---- decode ---------------------------------------------------------------------------------
def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


def mixed_lengths(batch: int, lo: int, hi: int) -> list[int]:
    """``batch`` prompt lengths spread evenly over ``lo..hi``."""
    if batch == 1:
        return [hi]
    return [lo + (hi - lo) * i // (batch - 1) for i in range(batch)]


def bench_engine(
    path: str,
    batch: int,
    prompt_len: int | list[int],
    new: int,
    stock: bool = False,
    decode_attention: str = "auto",
    device: str = "cuda",
    fused: bool | None = None,
) -> dict[str, float]:
    """hf engine: wall seconds for ``batch`` requests of ``new`` tokens, and a step breakdown.

    ``prompt_len``: one length for every prompt, or one per prompt. ``stock`` builds the engine
    as it was before the decode fixes (stock sdpa, no compiled blocks). Off CUDA (the CPU test
    of this function) the engine runs in fp32 without graphs, so there is no breakdown.
    """
    from arl.engines.base import SamplingParams
    from arl.engines.hf import HFEngine

    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    lengths = [prompt_len] * batch if isinstance(prompt_len, int) else list(prompt_len)
    longest = max(lengths)
    full = _prompts(batch, longest, 49152, seed=batch)
    prompts = [p[:n] for p, n in zip(full, lengths, strict=True)]
    with HFEngine(
        path,
        device=device,
        dtype="bfloat16" if torch.device(device).type == "cuda" else "float32",
        max_batch_size=batch,
        max_seq_len=longest + new + 8,
        max_prefill_tokens=max(8192, longest * batch),
        compile_blocks=not stock,
        grouped_attention=not stock,
        decode_attention=decode_attention,
        fused_decode=False if stock else fused,
    ) as eng:

        async def once() -> list:
            # Held while all are queued, so the whole batch starts in one prefill.
            await eng.pause()
            tasks = [asyncio.ensure_future(eng.agenerate(p, sp)) for p in prompts]
            await asyncio.sleep(0)
            await eng.resume()
            return await asyncio.gather(*tasks)

        # Warm-up twice: the first run grows the KV cache (which drops the graphs captured
        # before each growth); the second captures every graph bucket the timed run uses.
        asyncio.run(once())
        asyncio.run(once())
        steps0 = asyncio.run(eng.health())["steps"]
        _sync(device)
        t0 = time.perf_counter()
        results = asyncio.run(once())
        _sync(device)
        wall = time.perf_counter() - t0
        steps = asyncio.run(eng.health())["steps"] - steps0
        assert all(len(r.output_ids) == new for r in results), "a request ended early"
        health = asyncio.run(eng.health())
        used = health["decode_attention"]
        if decode_attention != "auto":
            assert used == decode_attention, f"decoded with {used}, not {decode_attention} (log)"
        assert fused is None or health["fused_decode"] == fused, "fused decode fell back (log)"
        # Breakdown at the last (widest) bucket: the forward alone, then sampling alone.
        graphs = {k[1]: g for k, g in eng._graphs.items() if k[0] >= batch}
        forward = sample = float("nan")
        if graphs:
            # The forward alone per width bucket, weighted by the steps decoded in each bucket.
            per_width = {w: _time_cuda(g.graph.replay, 20) for w, g in graphs.items()}
            kv_lens = [longest + i + 1 for i in range(new)]
            forward = statistics.mean(
                per_width[min(w for w in per_width if w >= n)] for n in kv_lens
            )
            logits = graphs[max(graphs)].logits[:batch]
            eng._temp[:batch] = 1.0
            sample = _time_cuda(lambda: eng._sample(logits, [_FakeRow()] * batch), 20)
    return {
        "wall": wall,
        "steps": steps,
        "forward": forward,
        "sample": sample,
        "attention": used,
        "fused": health["fused_decode"],
    }


class _FakeRow:
    """Stands for a sampling request's flags when timing `_sample` alone (temperature 1)."""

    greedy = False
    top_p = 1.0
    top_k = 0


def bench_generate(path: str, batch: int, prompt_len: int, new: int) -> float:
    """Seconds for transformers ``generate`` to sample ``new`` tokens for ``batch`` prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(_prompts(batch, prompt_len, 49152, seed=batch), device="cuda")
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync()
        wall = time.perf_counter() - t0
    assert out.shape[1] == prompt_len + new, out.shape
    del model
    torch.cuda.empty_cache()
    return wall


def run_decode(args: argparse.Namespace, path: str, floors: dict) -> list[dict]:
    wbytes, kv_tok = model_bytes(path)
    bw = floors.get("hbm_bytes_s", NOMINAL_HBM_TB_S * 1e12)
    rows = []
    print(
        f"\n## decode: hf engine vs transformers generate, prompt {args.prompt_len} + "
        f"{args.new_tokens} new tokens, bf16, sampling T=1"
    )
    print(
        f"floor per step = (weights {wbytes / 1e6:.0f} MB + KV {kv_tok} B/token x tokens held) "
        f"/ {bw / 1e12:.2f} TB/s (measured copy bandwidth; nominal {NOMINAL_HBM_TB_S} TB/s)"
    )
    hdr = (
        "| batch | arl tok/s | generate tok/s | arl / generate | arl ms/step | "
        "forward ms | sample ms | rest ms | floor ms | floor / step | modules ms/step | "
        "before ms/step |"
    )
    print(hdr)
    print("|" + " --- |" * 12)
    for b in args.batches:
        e = bench_engine(path, b, args.prompt_len, args.new_tokens)
        # The same engine decoding through the model's modules instead of the fused step.
        mod = bench_engine(path, b, args.prompt_len, args.new_tokens, fused=False)["wall"]
        g = bench_generate(path, b, args.prompt_len, args.new_tokens) if args.generate else None
        before = (
            bench_engine(path, b, args.prompt_len, args.new_tokens, stock=True)["wall"]
            if args.before
            else None
        )
        tokens = b * args.new_tokens
        step = e["wall"] / args.new_tokens
        held = b * (args.prompt_len + args.new_tokens / 2)  # mean KV tokens read per step
        floor = (wbytes + kv_tok * held) / bw
        rest = step - e["forward"] - e["sample"]
        row = {
            "batch": b,
            "arl_tok_s": tokens / e["wall"],
            "generate_tok_s": tokens / g if g else None,
            "arl_ms_step": 1e3 * step,
            "forward_ms": 1e3 * e["forward"],
            "sample_ms": 1e3 * e["sample"],
            "rest_ms": 1e3 * rest,
            "floor_ms": 1e3 * floor,
            "modules_ms_step": 1e3 * mod / args.new_tokens,
            "attention": e["attention"],
            "fused": e["fused"],
            "before_ms_step": 1e3 * before / args.new_tokens if before else None,
        }
        rows.append(row)
        ratio = f"{g / e['wall']:.1f}x" if g else "-"
        gen = f"{tokens / g:,.0f}" if g else "-"
        print(
            f"| {b} | {tokens / e['wall']:,.0f} | {gen} | {ratio} | {1e3 * step:.2f} | "
            f"{1e3 * e['forward']:.2f} | {1e3 * e['sample']:.2f} | {1e3 * rest:.2f} | "
            f"{1e3 * floor:.3f} | {floor / step:.2f} | {1e3 * mod / args.new_tokens:.2f} | "
            + (f"{1e3 * before / args.new_tokens:.2f} |" if before else "- |"),
            flush=True,
        )
    return rows


def run_decode_flex(args: argparse.Namespace, path: str, floors: dict) -> list[dict]:
    """Decode ms/step of sdpa beside flex, uniform and mixed prompt lengths, beside floors."""
    from arl.engines.hf.graphs import width_bucket

    wbytes, kv_tok = model_bytes(path)
    bw = floors.get("hbm_bytes_s", NOMINAL_HBM_TB_S * 1e12)
    new = args.new_tokens
    lo, hi = 64, args.mixed_max - new
    print(
        f"\n## decode attention: sdpa (KV read to the longest row's bucket) vs flex and triton "
        f"(each row's own length), {new} new tokens, bf16, sampling T=1; mixed: prompts "
        f"{lo}..{hi}, so rows span {lo}..{args.mixed_max} positions"
    )
    print(
        "own floor = (weights + KV of the rows' own lengths) / bandwidth; padded floor = "
        "(weights + KV of every row at the step's width bucket) / bandwidth"
    )
    print(
        "| prompts | batch | sdpa ms/step | flex ms/step | sdpa / flex | flex tok/s | own floor ms "
        "| padded floor ms | own floor / flex | flex through modules ms/step | triton ms/step "
        "| triton tok/s | own floor / triton |"
    )
    print("|" + " --- |" * 13)
    out = []
    for kind in ("uniform", "mixed"):
        for b in args.batches:
            lengths = [args.prompt_len] * b if kind == "uniform" else mixed_lengths(b, lo, hi)
            step = {}
            for attention in ("sdpa", "flex", "triton"):
                e = bench_engine(path, b, lengths, new, decode_attention=attention)
                step[attention] = e["wall"] / new
            # The fused step's gain: flex again through the model's own modules.
            e = bench_engine(path, b, lengths, new, decode_attention="flex", fused=False)
            step["modules"] = e["wall"] / new
            held = sum(n + new / 2 for n in lengths)  # mean KV positions read per step
            own = (wbytes + kv_tok * held) / bw
            cap = max(lengths) + new + 8
            widths = [width_bucket(max(lengths) + i + 1, cap) for i in range(new)]
            padded = (wbytes + kv_tok * b * statistics.mean(widths)) / bw
            row = {
                "prompts": kind,
                "batch": b,
                "sdpa_ms_step": 1e3 * step["sdpa"],
                "flex_ms_step": 1e3 * step["flex"],
                "flex_tokens_per_s": b / step["flex"],
                "flex_modules_ms_step": 1e3 * step["modules"],
                "triton_ms_step": 1e3 * step["triton"],
                "triton_tokens_per_s": b / step["triton"],
                "own_floor_ms": 1e3 * own,
                "padded_floor_ms": 1e3 * padded,
            }
            out.append(row)
            print(
                f"| {kind} | {b} | {1e3 * step['sdpa']:.2f} | {1e3 * step['flex']:.2f} | "
                f"{step['sdpa'] / step['flex']:.2f} | {b / step['flex']:,.0f} | {1e3 * own:.3f} | "
                f"{1e3 * padded:.3f} | {own / step['flex']:.2f} | {1e3 * step['modules']:.2f} | "
                f"{1e3 * step['triton']:.2f} | {b / step['triton']:,.0f} | "
                f"{own / step['triton']:.2f} |",
                flush=True,
            )
    return out


# ---- train ----------------------------------------------------------------------------------
def synthetic_train_batch(
    vocab: int, n_groups: int, group: int, prompt: int, completion: int
) -> dict[str, torch.Tensor]:
    """``n_groups`` groups of ``group`` random samples: ``prompt`` tokens, then a completion of
    ``completion // 2`` to ``completion`` tokens; log-probs ~ -ln(49152), as of a random model."""
    from arl.algo.packing import concat_shards

    g = torch.Generator().manual_seed(0)
    shards = []
    width = prompt + completion
    for _ in range(n_groups):
        lens = torch.randint(completion // 2, completion + 1, (group,), generator=g)
        am = torch.arange(width)[None] < (prompt + lens)[:, None]
        lm = am & (torch.arange(width)[None] >= prompt)
        shards.append(
            {
                "input_ids": torch.randint(0, vocab, (group, width), generator=g) * am,
                "attention_mask": am,
                "loss_mask": lm,
                "logprobs": torch.where(lm, -10.8, 0.0),
                "versions": torch.where(lm, 0, -1).int(),
                "rewards": (torch.arange(group) % 2).float(),
            }
        )
    return concat_shards(shards)


def run_train(args: argparse.Namespace, path: str, floors: dict) -> list[dict]:
    """One rank's tokens/s and MFU of compute_logp, the update, and the step as the trainer runs it
    (the update alone where it gives the proximal log-probs), per variant (``--train-variants``:
    ``padded`` is the layout as before issue 16, fixed 8192-token micro-batches; ``packed``
    packs rows with varlen attention and sizes micro-batches from free memory; ``+compile``
    compiles the decoder layers), and the largest log-prob difference against the first."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = synthetic_train_batch(vocab, 16, 4, 128, 384)
    tokens = int(batch["attention_mask"].sum())
    wbytes, _ = model_bytes(path)
    n_params = wbytes / 2
    peak = floors.get("bf16_flops", float("nan"))
    print(
        f"\n## train: one rank (fp32 masters, bf16 passes), {tokens} tokens "
        "(64 samples, 128 + <=384)"
    )
    print(
        "| variant | compute_logp tokens/s | MFU | update tokens/s | MFU | whole step tokens/s | "
        "MFU | priming s / first step s | max abs logp diff |"
    )
    print("|" + " --- |" * 9)
    rows, ref = [], None
    for variant in args.train_variants:
        r, logp = _train_variant(variant, path, batch, args.train_mb_tokens)
        ref = logp if ref is None else ref
        diff = float((logp - ref).abs().max())
        m_logp = 2 * n_params * tokens / r["t_logp"] / peak
        m_upd = 6 * n_params * tokens / r["t_upd"] / peak
        # The whole step as the trainer runs it: the update alone where its forward gives the
        # proximal log-probs (ActorConfig.prox_in_update, the default), else pass + update.
        t_step = r["t_upd"] if r["prox_in_update"] else r["t_logp"] + r["t_upd"]
        m_all = (6 if r["prox_in_update"] else 8) * n_params * tokens / t_step / peak
        row = {
            "variant": variant,
            "tokens": tokens,
            "logp_tok_s": tokens / r["t_logp"],
            "update_tok_s": tokens / r["t_upd"],
            "step_tok_s": tokens / t_step,
            "prox_in_update": r["prox_in_update"],
            "mfu_logp": m_logp,
            "mfu_update": m_upd,
            "mfu_step": m_all,
            "prime_s": r["prime"],
            "first_step_s": r["first"],
            "max_abs_logp_diff": diff,
            "peak_mem_gb": r["peak_mem"] / 1e9,
        }
        rows.append(row)
        print(
            f"| {variant} | {row['logp_tok_s']:,.0f} | {100 * m_logp:.1f}% | "
            f"{row['update_tok_s']:,.0f} | {100 * m_upd:.1f}% | {row['step_tok_s']:,.0f} | "
            f"{100 * m_all:.1f}% | {r['prime']:.1f} / {r['first']:.1f} | {diff:.2e} |",
            flush=True,
        )
    return rows


def _train_variant(
    variant: str, path: str, batch: dict, mb_tokens: int | None
) -> tuple[dict, torch.Tensor]:
    from arl.config import ActorConfig
    from arl.train.fsdp import FSDPEngine
    from arl.wire.addresses import free_port

    port = free_port()
    layout, _, extra = variant.partition("+")
    cfg = ActorConfig(
        path=path,
        lr=1e-6,
        layout=layout,
        max_tokens_per_mb=mb_tokens or (8192 if layout == "padded" else None),
        compile=extra == "compile",
    )
    eng = FSDPEngine(
        cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device="cuda"
    )
    try:

        def step() -> tuple[float, float, torch.Tensor]:
            _sync()
            t0 = time.perf_counter()
            logp = eng.compute_logp(batch)
            b = batch if cfg.prox_in_update() else dict(batch, prox_logp=logp)
            _sync()
            t1 = time.perf_counter()
            eng.ppo_update(eng.compute_advantages(b))
            _sync()
            return t1 - t0, time.perf_counter() - t1, logp

        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        _, _, logp = step()
        first = time.perf_counter() - t0
        t_logp, t_upd, _ = zip(*(step() for _ in range(3)), strict=True)
        peak_mem = torch.cuda.max_memory_allocated()
        prime = eng.prime_s  # the small passes, run when the engine was built
    finally:
        eng.destroy()
        torch.cuda.empty_cache()
    out = {"t_logp": statistics.median(t_logp), "t_upd": statistics.median(t_upd)}
    out["prox_in_update"] = cfg.prox_in_update()
    return out | {"prime": prime, "first": first, "peak_mem": peak_mem}, logp


# ---- weight sync ----------------------------------------------------------------------------
def run_sync(args: argparse.Namespace, path: str, floors: dict) -> list[dict]:
    from arl.config import Config, apply_overrides
    from arl.run import run
    from arl.stats.logger import read_jsonl

    out = []
    print("\n## weight sync: engine and trainer on one GPU, real arl nodes, 3 steps each")
    print("| mode | seconds paused (median) | MB per sync | GB/s | D2D-copy floor s | floor / s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in args.sync_modes:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = apply_overrides(
                Config(),
                [
                    f"experiment.run_dir={tmp}",
                    "experiment.name=bench-sync",
                    "experiment.total_train_steps=3",
                    f"actor.path={path}",
                    "data.loader=arl.data.arith:load_arith",
                    "data.batch_size=4",
                    "data.max_prompt_len=128",
                    "rollout.reward=arl.rewards.arith:arith_reward",
                    "rollout.max_head_offpolicyness=1",
                    "gconfig.n_samples=4",
                    "gconfig.max_new_tokens=16",
                    "cluster.n_gpus=1",
                    "cluster.heartbeat_timeout=120",
                    "stats.tensorboard=false",
                    "stats.progress_bar=false",
                    "saver.hf_export=false",
                    "weight_sync.verify=true",
                    f"weight_sync.mode={mode}",
                ],
            )
            cfg.validate()
            asyncio.run(run(cfg))
            rows = read_jsonl(cfg.run_path / "metrics.jsonl")
        paused = statistics.median(r["sync/paused_s"] for r in rows)
        nbytes = rows[-1].get("sync/bytes") or model_bytes(path)[0]
        ok = all(r.get("sync/checksum_match") for r in rows)
        floor = 2 * nbytes / floors.get("hbm_bytes_s", NOMINAL_HBM_TB_S * 1e12)
        out.append({"mode": mode, "paused_s": paused, "bytes": nbytes, "checksum_ok": ok})
        print(
            f"| {mode} | {paused:.4f} | {nbytes / 1e6:.0f} | {nbytes / paused / 1e9:.1f} | "
            f"{floor:.5f} | {floor / paused:.3f} |" + ("" if ok else " CHECKSUM MISMATCH"),
            flush=True,
        )
    return out


# ---- main -----------------------------------------------------------------------------------
SECTIONS = ("floors", "decode", "decode_flex", "train", "sync")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of ``python -m arl.bench gpu``."""
    p = argparse.ArgumentParser(prog="python -m arl.bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for --model random")
    p.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--batches", type=positive_int, nargs="*", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--new-tokens", type=positive_int, default=256)
    p.add_argument(
        "--mixed-max",
        type=int,
        default=1300,
        help="decode_flex: the longest row's positions at the end of the mixed-length run",
    )
    p.add_argument("--no-generate", dest="generate", action="store_false")
    p.add_argument(
        "--no-before",
        dest="before",
        action="store_false",
        help="skip the engine as it was before the decode fixes (stock sdpa, no compiled blocks)",
    )
    p.add_argument(
        "--train-mb-tokens", type=positive_int, default=None, help="none: each variant's own budget"
    )
    p.add_argument("--train-variants", nargs="*", default=["padded", "packed", "packed+compile"])
    p.add_argument("--sync-modes", nargs="*", default=["ipc_buffer", "ipc", "zmq", "disk"])
    p.add_argument(
        "--json", type=new_file, default=None, help="also write the figures here (a new file)"
    )
    args = p.parse_args(argv)
    if args.mixed_max - args.new_tokens < 64:
        p.error(f"--mixed-max must be at least --new-tokens + 64, got {args.mixed_max}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("arl.bench gpu needs a CUDA device", file=sys.stderr)
        return 2
    print(f"# arl.bench gpu on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = prepare_model(args.model, args.tokenizer, Path(tmp))
        floors = measure_floors() if "floors" in args.only else {}
        if floors:
            print(
                f"\n## floors: HBM copy {floors['hbm_bytes_s'] / 1e12:.2f} TB/s (nominal "
                f"{NOMINAL_HBM_TB_S}), bf16 matmul {floors['bf16_flops'] / 1e12:.0f} TFLOP/s"
            )
            results["floors"] = floors
        if "decode" in args.only:
            results["decode"] = run_decode(args, path, floors)
        if "decode_flex" in args.only:
            results["decode_flex"] = run_decode_flex(args, path, floors)
        if "train" in args.only:
            results["train"] = run_train(args, path, floors)
        if "sync" in args.only:
            os.environ.setdefault("ARL_CACHE", str(Path(tmp) / "cache"))
            results["sync"] = run_sync(args, path, floors)
    if args.json:
        write_new(args.json, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
