"""The train bench's ``packed+compile`` variant with its fourth step under torch.profiler: the
device's view (self device time by kernel) beside the bench's figures, to compare a cold process
with a warm one. Usage: ``python s34_train_kernel_profile.py`` (GPU; ``ARL_CACHE`` and
``TORCHINDUCTOR_CACHE_DIR`` pick cold or warm)."""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

import arl.bench.gpu as g

state = {"n": 0, "prof": None}
_sync = g._sync


def sync(device: str = "cuda") -> None:
    _sync(device)
    state["n"] += 1
    if state["n"] == 10:  # three syncs a step: the start of the fourth
        state["prof"] = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
        state["prof"].__enter__()


g._sync = sync
path = g.prepare_model("random", None, Path("/tmp/r"))
batch = g.synthetic_train_batch(AutoConfig.from_pretrained(path).vocab_size, 16, 4, 128, 384)
r, _ = g._train_variant("packed+compile", path, batch, None)
p = state["prof"]
p.__exit__(None, None, None)
figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
print(figures, "threads", torch.get_num_threads())
averages = p.key_averages()
print("total self device us", round(sum(e.self_device_time_total for e in averages)))
for e in sorted(averages, key=lambda e: -e.self_device_time_total)[:22]:
    print(f"{e.self_device_time_total:10.0f} us {e.count:5d}  {e.key[:110]}")
