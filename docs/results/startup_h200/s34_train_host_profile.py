"""The train bench's ``packed+compile`` variant (`arl.bench.gpu._train_variant`: 27,187 tokens,
random SmolLM2-135M) with its three timed steps under cProfile, the host's view: where a warm
process's steps spent their time. Prints the training graphs' summary, the children of the
process once the rank is built (``PROBE_SLEEP=S`` then waits S seconds), the bench's figures and
the top functions. Usage: ``python s34_train_host_profile.py`` (GPU; ``ARL_CACHE`` and
``TORCHINDUCTOR_CACHE_DIR`` pick cold or warm)."""

import cProfile
import os
import pstats
import subprocess
import time
from pathlib import Path

from transformers import AutoConfig

import arl.bench.gpu as g
from arl.train.fsdp import FSDPEngine

prof = cProfile.Profile()
syncs = {"n": 0}
_sync = g._sync


def sync(device: str = "cuda") -> None:
    _sync(device)
    syncs["n"] += 1
    if syncs["n"] == 4:  # the first step took three: profile the rest
        prof.enable()


g._sync = sync
_destroy, _init = FSDPEngine.destroy, FSDPEngine.__init__


def destroy(self) -> None:
    print("graphs", None if self.graphs is None else self.graphs.summary(), flush=True)
    _destroy(self)


def init(self, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    me = os.getpid()
    cmd = f"ps --ppid {me} -o pid,pcpu,etime,comm | head -5; ps --ppid {me} | wc -l"
    kids = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True).stdout
    print("children after build:", kids, flush=True)
    if os.environ.get("PROBE_SLEEP"):
        time.sleep(float(os.environ["PROBE_SLEEP"]))


FSDPEngine.destroy, FSDPEngine.__init__ = destroy, init
path = g.prepare_model("random", None, Path("/tmp/r"))
batch = g.synthetic_train_batch(AutoConfig.from_pretrained(path).vocab_size, 16, 4, 128, 384)
r, _ = g._train_variant("packed+compile", path, batch, None)
prof.disable()
print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(25)
