"""Host and GPU time of the hf engine's prefill (SmolLM2-135M's shape, random weights, bf16).

    python3 s29_prefill_prof.py

For each case (unique prompts x copies of a length) it runs `_prefill` six times, as the decode
thread does (under no_grad, holding the engine's locks), and prints the host time of the call
and the time to the end of its GPU work (mean of calls 2-6); then the engine's prefill-graph
counts, the same cases with the graphs off, and a torch.profiler table of five 16 x 4 prefills.
"""

import asyncio
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from arl.bench.gpu import prepare_model
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine

CASES = {"1x4_150": (1, 4, 150), "16x4_150": (16, 4, 150), "48x4_150": (48, 4, 150)}
CASES["8x1_600"] = (8, 1, 600)


def main() -> None:
    path = prepare_model("random", None, Path(tempfile.mkdtemp()))
    kw = dict(max_batch_size=320, max_seq_len=1536, warm_up_len=1024)
    eng = HFEngine(path, device="cuda", dtype="bfloat16", **kw)
    eng.__enter__()
    gen = torch.Generator().manual_seed(0)
    loop = asyncio.new_event_loop()
    sp = SamplingParams(max_new_tokens=4, greedy=True)

    def prompts(unique: int, copies: int, length: int) -> list[list[int]]:
        out = []
        for _ in range(unique):
            out += [torch.randint(100, 49000, (length,), generator=gen).tolist()] * copies
        return out

    def run(ps: list[list[int]]) -> tuple[float, float]:
        chunk = [eng._make_request(p, sp, loop) for p in ps]
        with eng._cv, eng._model_lock, torch.no_grad():
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng._prefill(chunk)
            host = time.perf_counter() - t
            torch.cuda.synchronize()
            total = time.perf_counter() - t
            eng._rows = []
        return host, total

    def cases(label: str) -> None:
        for name, case in CASES.items():
            ps = prompts(*case)
            res = [run(ps) for _ in range(6)]
            host = 1e3 * sum(r[0] for r in res[1:]) / 5
            total = 1e3 * sum(r[1] for r in res[1:]) / 5
            first = 1e3 * res[0][1]
            print(f"{label} {name}: first {first:.1f} ms; host {host:.2f}, to GPU end {total:.2f}")

    cases("graphs")
    health = asyncio.run(eng.health())
    print("prefill graphs", health["prefill_graphs"], "replays", health["prefill_replays"])
    eng._prefill_graphs = None
    cases("eager")
    ps = prompts(16, 4, 150)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run(ps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    eng.__exit__(None, None, None)


if __name__ == "__main__":
    main()
