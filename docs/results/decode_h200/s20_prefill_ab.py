"""Prefill A/B on one engine: fused prefill vs the modules; cache equality; greedy tokens.

Run as `python s20_prefill_ab.py MODEL_DIR` on the device (session 20). It calls `_prefill` from
the main thread with autograd on (the engine's decode thread runs under no_grad): both paths'
times include building autograd graphs, and the first fused call compiled grad-mode variants."""

import asyncio
import json
import os
import sys
import time

import torch

from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine

model = sys.argv[1]
out = {}
eng = HFEngine(
    model, device="cuda", dtype="bfloat16", max_batch_size=320, max_seq_len=1536, warm_up_len=1024
)
t0 = time.perf_counter()
eng.__enter__()
out["engine_ready_s"] = time.perf_counter() - t0
g = torch.Generator().manual_seed(0)
V = 49152


def prompts(n_unique, rep, length):
    ps = []
    for _ in range(n_unique):
        p = torch.randint(100, V - 100, (length,), generator=g).tolist()
        ps += [p] * rep
    return ps


loop = asyncio.new_event_loop()
sp = SamplingParams(max_new_tokens=4, greedy=True)
orig = eng._fused_prefill


def run(ps, fused):
    eng._fused_prefill = orig if fused else (lambda row0, ids: False)
    chunk = [eng._make_request(p, sp, loop) for p in ps]
    with eng._cv, eng._model_lock:
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng._prefill(chunk)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        eng._rows = []
    return dt


cases = {
    "16x4_150": (16, 4, 150),
    "64x4_150": (64, 4, 150),
    "32x4_200": (32, 4, 200),
    "1x4_150": (1, 4, 150),
    "64x1_600": (64, 1, 600),
}
for name, (u, r, L) in cases.items():
    ps = prompts(u, r, L)
    for fused in (True, False):
        times = [run(ps, fused) for _ in range(6)]
        out[f"{name}_{'fused' if fused else 'modules'}_ms"] = {
            "first": 1e3 * times[0],
            "mean_rest": 1e3 * sum(times[1:]) / 5,
        }
        print(name, fused, [round(1e3 * t, 2) for t in times], flush=True)
# cache equality (bf16) for a mixed chunk
ps = prompts(8, 2, 90) + [p[:37] for p in prompts(4, 1, 90)] + [[5]]


def cache_of(fused):
    eng._fused_prefill = orig if fused else (lambda row0, ids: False)
    chunk = [eng._make_request(p, sp, loop) for p in ps]
    with eng._cv, eng._model_lock:
        eng._prefill(chunk)
        lens = [r.pos for r in eng._rows]
        ks = {i: eng._cache.keys[i][: len(chunk)].float().clone() for i in (0, 15, 29)}
        eng._rows = []
    return lens, ks


la, ka = cache_of(True)
lb, kb = cache_of(False)
diffs = {}
for i in ka:
    d = max(
        (ka[i][r, :, : la[r]] - kb[i][r, :, : la[r]]).abs().max().item() if la[r] else 0.0
        for r in range(len(la))
    )
    scale = max(kb[i][r, :, : lb[r]].abs().max().item() if lb[r] else 0.0 for r in range(len(lb)))
    diffs[f"layer{i}"] = {"max_abs_diff": d, "max_abs": scale}
out["cache_diff_bf16"] = diffs
print(diffs)
# greedy generation through the whole engine, fused prefill vs modules
gen_ps = prompts(48, 1, 120)
spg = SamplingParams(max_new_tokens=64, greedy=True)


async def gen():
    return await asyncio.gather(*(eng.agenerate(p, spg) for p in gen_ps))


eng._fused_prefill = orig
a = asyncio.run(gen())
eng._fused_prefill = lambda row0, ids: False
b = asyncio.run(gen())
eq = sum(x.output_ids == y.output_ids for x, y in zip(a, b, strict=False))
first_div = [
    next(
        (j for j, (s, t) in enumerate(zip(x.output_ids, y.output_ids, strict=False)) if s != t),
        None,
    )
    for x, y in zip(a, b, strict=False)
]
out["greedy_equal_rows"] = f"{eq}/{len(a)}"
out["first_divergence"] = [d for d in first_div if d is not None]
print("greedy equal", eq, len(a), out["first_divergence"])
eng.__exit__(None, None, None)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_ab.json"), "w"), indent=1)
