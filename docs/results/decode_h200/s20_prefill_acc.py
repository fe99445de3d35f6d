"""Prefill accuracy: fused and module prefill in bf16 against module prefill in fp32 (keys)."""

import asyncio
import json
import os
import sys

import torch

from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine

model = sys.argv[1]
g = torch.Generator().manual_seed(0)
ps = []
for _n in range(12):
    ps.append(
        torch.randint(
            100, 40000, (int(torch.randint(20, 200, (1,), generator=g)),), generator=g
        ).tolist()
    )
loop = asyncio.new_event_loop()
sp = SamplingParams(max_new_tokens=4, greedy=True)


def keys_of(eng, fused):
    orig = eng._fused_prefill if eng._fused is not None else None
    if not fused and orig is not None:
        eng._fused_prefill = lambda row0, ids: False
    chunk = [eng._make_request(p, sp, loop) for p in ps]
    with eng._cv, eng._model_lock:
        eng._prefill(chunk)
        lens = [r.pos for r in eng._rows]
        order = [r.prompt for r in eng._rows]
        ks = {
            i: [eng._cache.keys[i][r, :, : lens[r]].float().clone() for r in range(len(lens))]
            for i in (0, 10, 20, 29)
        }
        eng._rows = []
    if orig is not None:
        eng._fused_prefill = orig
    return order, ks


ref_eng = HFEngine(
    model,
    device="cuda",
    dtype="float32",
    max_batch_size=16,
    max_seq_len=512,
    fused_decode=False,
    cuda_graphs=False,
)
ref_eng.__enter__()
o_ref, k_ref = keys_of(ref_eng, False)
ref_eng.__exit__(None, None, None)
eng = HFEngine(
    model, device="cuda", dtype="bfloat16", max_batch_size=16, max_seq_len=512, warm_up_len=256
)
eng.__enter__()
out = {}
for fused in (True, False):
    o, k = keys_of(eng, fused)
    assert o == o_ref
    res = {}
    for i in k:
        err = torch.cat([(a - b).flatten() for a, b in zip(k[i], k_ref[i], strict=False)])
        ref = torch.cat([b.flatten() for b in k_ref[i]])
        res[f"layer{i}"] = {
            "max_abs_err": err.abs().max().item(),
            "rms_err/rms": (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(),
        }
    out["fused" if fused else "modules"] = res
    print("fused" if fused else "modules", res, flush=True)
eng.__exit__(None, None, None)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_acc.json"), "w"), indent=1)
