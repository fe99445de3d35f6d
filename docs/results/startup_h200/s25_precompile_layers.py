"""The train rank's compiled decoder layers: the first forward and backward of a model whose
layers `arl.train.sharding.compile_forwards` compiled, in a fresh process, for comparing an empty
and a filled ``ARL_CACHE``, with and without `arl.precompile` (``ARL_PRECOMPILE=0``).

    PYTHONPATH=. python3 docs/results/startup_h200/s25_precompile_layers.py MODEL DEVICE TOKENS

Prints one JSON line: seconds of the first pass (compilation included) and of a second pass of
another length, dynamo's traced graphs, what `arl.precompile` loaded and compiled, and whether
the gradients equal an uncompiled copy's (fp32 on CPU).
"""

import json
import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from arl.compile_cache import use_compile_cache
from arl.train.sharding import compile_forwards

path, device, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
use_compile_cache()
dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
model.to(device).train()
model.config.use_cache = False
reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
reference.to(device).train()
g = torch.Generator().manual_seed(0)


def step(m: torch.nn.Module, n: int) -> list[torch.Tensor]:
    ids = torch.randint(0, 1000, (1, n), generator=g).to(device)
    m.zero_grad()
    m(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return [p.grad for p in m.parameters()]


compile_forwards(list(model.model.layers))
t0 = time.perf_counter()
step(model, tokens)
first_s = time.perf_counter() - t0
t1 = time.perf_counter()
g.manual_seed(1)
got = step(model, tokens + 37)
second_s = time.perf_counter() - t1
g.manual_seed(1)
want = step(reference, tokens + 37)
# Compiled and eager kernels round differently: fp32 agrees to ~1e-4, bf16 to ~1e-2 of the
# gradient's scale; the worst parameter's error relative to its largest entry is reported.
worst = max(
    ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
    for a, b in zip(got, want, strict=True)
)
same = worst <= (3e-2 if dtype == torch.bfloat16 else 1e-3)
kept = model.model.layers[0].forward.__func__
print(
    json.dumps(
        {
            "first_pass_s": round(first_s, 2),
            "second_pass_s": round(second_s, 2),
            "dynamo_graphs": counters["stats"]["unique_graphs"],
            "precompiled_loaded": getattr(kept, "loaded", 0),
            "precompiled_compiled": getattr(kept, "compiled", 0),
            "grads_equal": same,
            "grads_worst_rel_err": round(worst, 5),
            "torch": torch.__version__,
        }
    )
)
